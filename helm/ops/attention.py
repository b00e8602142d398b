"""Lorentz (distance-based) attention, paper Eq. 3, behind one entry point with swappable implementations.

For queries ``q_i``, keys ``k_j`` and values ``v_j`` on ``H_k`` (per head)::

    ν_ij = softmax_j(-d²(q_i, k_j) / τ + b_ij)        d²(q, k) = -2k - 2<q, k>_L
    o_i  = centroid({v_j}, ν_i) = sqrt(k) · Σ_j ν_ij v_j / sqrt(|<Σ ν v, Σ ν v>_L|)

Since softmax ignores the per-row constant ``2k/τ``, ``softmax(-d²/τ) = softmax((J q)·k · 2/τ)`` with
``J = diag(-1, 1, ..., 1)``: Eq. 3 is SDPA on ``(J q · 2/τ, k, v)`` with ``scale=1`` followed by the
centroid normalisation. Implementations:

* ``eager``  explicit ``-d²/τ`` scores, masks and softmax: the readable spec (use it in float64 in tests).
* ``sdpa``   :func:`torch.nn.functional.scaled_dot_product_attention` on the reduction above.
* ``triton`` the fused kernel of :mod:`kernels` (loaded lazily; CUDA, or the Triton interpreter).
* ``auto``   ``triton`` on CUDA tensors when the kernel can run, ``sdpa`` elsewhere; logs its choice once.

Scores, softmax and the normalisation are computed in at least fp32 (bf16 inputs are promoted and autocast
is switched off inside), so the time coordinate's cancellation in ``<q, k>_L`` never happens in bf16.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Union

import torch
import torch.nn.functional as F

from transformers.utils import logging

from ..manifold.math import normalize, upcast

logger = logging.get_logger(__name__)

Tau = Union[float, torch.Tensor]

__all__ = [
    "ATTENTION_IMPLS",
    "lorentz_attention",
    "AttentionMask",
    "available_attention_impls",
    "build_attention_mask",
    "alibi_bias",
]


def _logit_scale(tau: Tau, num_heads: int, like: torch.Tensor) -> torch.Tensor:
    """``2/τ`` as a ``[1, H, 1, 1]`` tensor (τ: scalar or ``[H]``), in the accumulation dtype."""
    tau = tau.to(device=like.device, dtype=like.dtype) if isinstance(tau, torch.Tensor) else \
        torch.tensor(float(tau), device=like.device, dtype=like.dtype)
    if tau.dim() == 0:
        tau = tau.expand(num_heads)
    return (2.0 / tau).view(1, num_heads, 1, 1)


class AttentionMask:
    """Who may attend to whom, built once per model forward and read by every attention layer.

    Queries are the *last* ``Tq`` of the ``Tk`` positions (bottom-right alignment, as in cached decoding).
    ``padding`` ``[B, Tk]``: True for real tokens (the Hugging Face ``attention_mask``). ``segment_ids``
    ``[B, Tk]``: document ids of packed rows; a query attends only to keys of its own document.

    Two forms, one meaning: the Triton kernel reads ``padding`` and ``segment_ids`` (it never materialises a
    ``Tq × Tk`` mask); eager and sdpa read :meth:`keep`, the dense boolean mask, computed on first use and
    then shared by every layer of the forward. Rows that would mask every key (a padding query under left
    padding) are unmasked entirely: their output is ignored by the caller and this keeps the softmax finite
    without a host-side check.
    """

    __slots__ = ("batch", "q_len", "kv_len", "causal", "padding", "segment_ids", "device", "_keep")

    def __init__(self, batch: int, q_len: int, kv_len: int, *, causal: bool = True,
                 padding: Optional[torch.Tensor] = None, segment_ids: Optional[torch.Tensor] = None, device=None):
        for name, t in (("attention_mask", padding), ("segment_ids", segment_ids)):
            if t is not None and tuple(t.shape) != (batch, kv_len):
                raise ValueError(f"{name} must be [B, Tk] = {(batch, kv_len)}, got {tuple(t.shape)}")
        self.batch, self.q_len, self.kv_len, self.causal, self.device = batch, q_len, kv_len, bool(causal), device
        self.padding = None if padding is None else padding.to(device=device, dtype=torch.bool)
        self.segment_ids = None if segment_ids is None else segment_ids.to(device)
        self._keep = None

    @property
    def is_plain_causal(self) -> bool:
        """Causal over a square problem with nothing else masked: fused kernels can use their causal flag."""
        return self.causal and self.padding is None and self.segment_ids is None and self.q_len == self.kv_len

    def keep(self) -> Optional[torch.Tensor]:
        """Boolean keep-mask ``[B, 1, Tq, Tk]`` (True = may attend), or None when nothing is masked."""
        if self._keep is None:
            self._keep = _dense_keep(self)
        return self._keep if isinstance(self._keep, torch.Tensor) else None

    def __repr__(self) -> str:
        return (f"AttentionMask(B={self.batch}, Tq={self.q_len}, Tk={self.kv_len}, causal={self.causal}, "
                f"padding={self.padding is not None}, segments={self.segment_ids is not None})")


def _dense_keep(mask: AttentionMask):
    """The dense form of ``mask``; ``False`` (not None, so it is cached) when nothing is masked."""
    B, Tq, Tk, device = mask.batch, mask.q_len, mask.kv_len, mask.device
    keep = None
    if mask.causal:
        qi = torch.arange(Tk - Tq, Tk, device=device).view(Tq, 1)
        kj = torch.arange(Tk, device=device).view(1, Tk)
        keep = (kj <= qi).view(1, 1, Tq, Tk).expand(B, 1, Tq, Tk)
    if mask.padding is not None:
        pad = mask.padding.view(B, 1, 1, Tk)
        keep = pad if keep is None else keep & pad
    if mask.segment_ids is not None:
        seg = mask.segment_ids
        same = seg[:, -Tq:].view(B, 1, Tq, 1) == seg.view(B, 1, 1, Tk)
        keep = same if keep is None else keep & same
    if keep is None:
        return False
    keep = keep.expand(B, 1, Tq, Tk)
    return keep | ~keep.any(-1, keepdim=True)


def build_attention_mask(
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    attention_mask: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
    device=None,
) -> Optional[torch.Tensor]:
    """The dense keep-mask ``[B, 1, Tq, Tk]`` of :class:`AttentionMask` (None when nothing is masked)."""
    return AttentionMask(batch, q_len, kv_len, causal=causal, padding=attention_mask, segment_ids=segment_ids,
                         device=device).keep()


def alibi_bias(slopes: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """ALiBi logits bias ``-m_h · (i - j)`` as ``[1, H, Tq, Tk]`` (queries are the last ``Tq`` positions)."""
    qi = torch.arange(kv_len - q_len, kv_len, device=slopes.device).view(q_len, 1)
    kj = torch.arange(kv_len, device=slopes.device).view(1, kv_len)
    return -(slopes.float().view(1, -1, 1, 1) * (qi - kj).float())


def _floor(k):
    """Floor for ``|<s, s>_L|`` of a softmax-weighted sum of values.

    The exact bound is ``k (Σν)² = k``, and a row with a single key attains it, so rounding can put the norm
    a hair below ``k``; clamping there would zero that row's gradient at random. Half the bound never binds
    for valid inputs and still keeps degenerate ones (e.g. values off the manifold) finite; the Triton
    kernel uses the same rule.
    """
    return k / 2


def _prepare(query, key, value, tau, mask: AttentionMask, position_bias, alibi_slopes, causal_flag_ok=False):
    """Promote to the accumulation dtype; read the keep-mask and build the additive logits bias.

    With ``causal_flag_ok`` (sdpa) a plain causal square problem returns no mask, so the fused kernels run
    with ``is_causal=True`` and never materialise a ``T × T`` mask.
    """
    q, kk, v = upcast(query), upcast(key), upcast(value)
    dtype = torch.promote_types(torch.promote_types(q.dtype, kk.dtype), v.dtype)
    q, kk, v = q.to(dtype), kk.to(dtype), v.to(dtype)
    B, H, Tq, _ = q.shape
    Tk = kk.shape[-2]
    plain_causal = mask.is_plain_causal and position_bias is None and alibi_slopes is None
    keep = None if (causal_flag_ok and plain_causal) else mask.keep()
    bias = None
    if position_bias is not None:
        bias = position_bias.to(dtype)
    if alibi_slopes is not None:
        ab = alibi_bias(alibi_slopes, Tq, Tk).to(dtype)
        bias = ab if bias is None else bias + ab
    return q, kk, v, _logit_scale(tau, H, q), keep, bias


def eager_attention(query, key, value, *, k, tau, mask: AttentionMask, position_bias=None,
                    alibi_slopes=None) -> torch.Tensor:
    """Reference: explicit squared Lorentz distances, ``ν = softmax(-d²/τ + b)``, Lorentz centroid of values."""
    q, kk, v, scale, keep, bias = _prepare(query, key, value, tau, mask, position_bias, alibi_slopes)
    curv = torch.as_tensor(k, dtype=q.dtype, device=q.device)
    lorentz_inner = q[..., 1:] @ kk[..., 1:].transpose(-1, -2) - q[..., :1] * kk[..., :1].transpose(-1, -2)
    sqd = -2 * curv - 2 * lorentz_inner
    scores = -sqd * (scale / 2)
    if bias is not None:
        scores = scores + bias
    if keep is not None:
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    weights = scores.softmax(-1)
    return normalize(weights @ v, k=k, floor=_floor(k))


def sdpa_attention(query, key, value, *, k, tau, mask: AttentionMask, position_bias=None,
                   alibi_slopes=None) -> torch.Tensor:
    """``SDPA(J q · 2/τ, k, v, scale=1)`` then centroid normalisation; exact to :func:`eager_attention`."""
    q, kk, v, scale, keep, bias = _prepare(query, key, value, tau, mask, position_bias, alibi_slopes,
                                           causal_flag_ok=True)
    # J q · 2/τ in one broadcast multiply: the sign flip of the time coordinate rides on the scale vector
    sign = torch.ones(q.shape[-1], dtype=q.dtype, device=q.device)
    sign[0] = -1
    q = q * (scale * sign)
    attn_mask = keep
    if bias is not None:
        attn_mask = bias if keep is None else bias.masked_fill(~keep, torch.finfo(q.dtype).min)
    use_causal_flag = attn_mask is None and mask.is_plain_causal
    with torch.autocast(device_type=q.device.type, enabled=False):
        out = F.scaled_dot_product_attention(q, kk, v, attn_mask=attn_mask, is_causal=use_causal_flag, scale=1.0)
    return normalize(out, k=k, floor=_floor(k))


def _load_kernel():
    """The Triton kernel's public function, or the reason it cannot be imported (imports stay inside ``try``:
    remote-code loading must not list ``triton`` or our ``kernels`` folder as hard requirements)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None, "impl='triton' needs the 'triton' package: pip install 'helm-zoo[triton]'"
    try:
        from kernels.lorentz_attention import lorentz_flash_attention
    except ImportError as err:
        return None, f"impl='triton': the Lorentz attention kernel is not available ({err})"
    return lorentz_flash_attention, None


def _triton_available(device: torch.device) -> Optional[str]:
    """None if the Triton kernel can run on ``device``; otherwise the reason it cannot."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type != "cuda" and not interpret:
        return (f"impl='triton' needs CUDA tensors (got device {device.type!r}); set TRITON_INTERPRET=1 "
                "before importing the kernels to run them in the Triton interpreter, or use impl='sdpa'")
    return _load_kernel()[1]


def triton_attention(query, key, value, *, k, tau, mask: AttentionMask, position_bias=None,
                     alibi_slopes=None) -> torch.Tensor:
    """Fused Triton kernel (:func:`kernels.lorentz_attention.lorentz_flash_attention`); it reads the mask's
    padding and segment ids and builds no dense mask."""
    reason = _triton_available(query.device)
    if reason is not None:
        raise ValueError(reason)
    if position_bias is not None:
        raise ValueError("impl='triton' supports ALiBi slopes but not a dense position_bias; use impl='sdpa'")
    kernel, _ = _load_kernel()
    return kernel(query, key, value, k=k, tau=tau, causal=mask.causal, attention_mask=mask.padding,
                  segment_ids=mask.segment_ids, alibi_slopes=alibi_slopes)


ATTENTION_IMPLS: Dict[str, Callable[..., torch.Tensor]] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "triton": triton_attention,
}
_AUTO_LOGGED: set = set()


def available_attention_impls() -> tuple:
    return tuple(ATTENTION_IMPLS) + ("auto",)


def _resolve_impl(impl: str, device: torch.device, needs_dense_bias: bool) -> str:
    if impl != "auto":
        return impl
    choice = "triton" if device.type == "cuda" and not needs_dense_bias and _triton_available(device) is None \
        else "sdpa"
    if (choice, device.type) not in _AUTO_LOGGED:
        _AUTO_LOGGED.add((choice, device.type))
        logger.info("helm attention impl='auto' uses %r on %s", choice, device.type)
    return choice


def _validate(query, key, value, tau, mask, position_bias, alibi_slopes, impl):
    if impl not in ATTENTION_IMPLS and impl != "auto":
        raise ValueError(f"impl must be one of {available_attention_impls()}, got {impl!r}")
    B, H, Tq, D = query.shape
    if key.shape[:2] != (B, H) or value.shape[:2] != (B, H):
        raise ValueError(f"query, key and value must share [B, H]: got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[-1] != D:
        raise ValueError(f"query and key must have the same head dim 1+d: got {D} and {key.shape[-1]}")
    if value.shape[-2] != key.shape[-2]:
        raise ValueError(f"key and value must have the same length: got {key.shape[-2]} and {value.shape[-2]}")
    if Tq > key.shape[-2]:
        raise ValueError(f"query length {Tq} exceeds key length {key.shape[-2]}")
    Tk = key.shape[-2]
    if isinstance(tau, (int, float)):
        if not tau > 0:
            raise ValueError(f"tau must be positive, got {tau!r}")
    elif tau.dim() > 1 or (tau.dim() == 1 and tau.numel() not in (1, H)):
        raise ValueError(f"tau must be a scalar or have shape [H={H}], got {tuple(tau.shape)}")
    if (mask.batch, mask.q_len, mask.kv_len) != (B, Tq, Tk):
        raise ValueError(f"the attention mask was built for [B, Tq, Tk] = {(mask.batch, mask.q_len, mask.kv_len)}, "
                         f"got {(B, Tq, Tk)}")
    if position_bias is not None and (position_bias.dim() != 4 or position_bias.shape[-2:] != (Tq, Tk)):
        raise ValueError(f"position_bias must be [B|1, H|1, Tq, Tk] with Tq, Tk = {(Tq, Tk)}, "
                         f"got {tuple(position_bias.shape)}")
    if alibi_slopes is not None and tuple(alibi_slopes.shape) != (H,):
        raise ValueError(f"alibi_slopes must be [H={H}], got {tuple(alibi_slopes.shape)}")


def lorentz_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    k: Union[float, torch.Tensor],
    tau: Tau,
    causal: bool = True,
    attention_mask: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
    position_bias: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    impl: str = "auto",
    mask: Optional[AttentionMask] = None,
) -> torch.Tensor:
    """Multi-head Lorentz attention (paper Eq. 3).

    Args:
        query: ``[B, H, Tq, 1+d]`` points of ``H_k``; the queries are the last ``Tq`` of the ``Tk`` positions.
        key: ``[B, H, Tk, 1+d]`` points.
        value: ``[B, H, Tk, 1+dv]`` points.
        k: curvature parameter ``k = -1/K > 0`` (float or scalar tensor).
        tau: temperature ``τ > 0``, scalar or ``[H]`` (learnable; gradients flow).
        causal: mask keys after each query.
        attention_mask: ``[B, Tk]``, 1 for real tokens, 0 for padding (left or right).
        segment_ids: ``[B, Tk]`` document ids of packed rows; attention never crosses documents.
        position_bias: additive logits ``[B|1, H|1, Tq, Tk]`` (e.g. a positional encoding's score bias).
        alibi_slopes: ``[H]`` ALiBi slopes, bias ``-m_h (i - j)``; supported by every implementation.
        impl: ``eager``, ``sdpa``, ``triton`` or ``auto``.
        mask: a prebuilt :class:`AttentionMask` (models build one per forward for all layers); replaces
            ``causal``, ``attention_mask`` and ``segment_ids``.

    Returns:
        ``[B, H, Tq, 1+dv]`` points of ``H_k`` (fp32 for half-precision inputs, else the input dtype).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, H, T, 1+d], got shape {tuple(t.shape)}")
    if mask is None:
        B, _, Tq, _ = query.shape
        mask = AttentionMask(B, Tq, key.shape[-2], causal=causal, padding=attention_mask, segment_ids=segment_ids,
                             device=query.device)
    elif attention_mask is not None or segment_ids is not None:
        raise ValueError("pass either mask or attention_mask / segment_ids, not both")
    _validate(query, key, value, tau, mask, position_bias, alibi_slopes, impl)
    name = _resolve_impl(impl, query.device, position_bias is not None)
    return ATTENTION_IMPLS[name](query, key, value, k=k, tau=tau, mask=mask, position_bias=position_bias,
                                 alibi_slopes=alibi_slopes)
