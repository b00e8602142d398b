"""Lorentz (distance-based) attention, paper Eq. 3, behind one entry point with swappable implementations.

For queries ``q_i``, keys ``k_j`` and values ``v_j`` on ``H_k`` (per head)::

    ν_ij = softmax_j(-d²(q_i, k_j) / τ + b_ij)        d²(q, k) = -2k - 2<q, k>_L
    o_i  = centroid({v_j}, ν_i) = sqrt(k) · Σ_j ν_ij v_j / sqrt(|<Σ ν v, Σ ν v>_L|)

Since softmax ignores the per-row constant ``2k/τ``, ``softmax(-d²/τ) = softmax((J q)·k · 2/τ)`` with
``J = diag(-1, 1, ..., 1)``: Eq. 3 is SDPA on ``(J q · 2/τ, k, v)`` with ``scale=1`` followed by the
centroid normalisation. Implementations, registered by name in :data:`ATTENTION_FUNCTIONS` (the names of
``attn_implementation=``; :func:`resolve_attention` decides which one runs each call):

* ``eager``  explicit ``-d²/τ`` scores, masks and softmax: the readable spec (use it in float64 in tests).
* ``sdpa``   :func:`torch.nn.functional.scaled_dot_product_attention` on the reduction above (its operands zero-padded
  to one head width, a multiple of 8, so the flash / memory-efficient backends are eligible: :func:`_pad_heads`);
  in half precision the weights are materialised instead (see Precision below).
* ``triton`` the fused kernel of :mod:`helm.ops.lorentz_attention_triton` (loaded lazily; CUDA, or the Triton
  interpreter).
* ``auto``   ``triton`` on CUDA tensors when the kernel can run, ``sdpa`` elsewhere (``eager`` in half precision,
  which is what ``sdpa`` runs there); logs its choice once.

**Normalisation far from the origin.** With ``Σ_j ν_ij = 1`` and ``S = Σ_j ν_j v_j``, the centroid identity for
points of ``H_k`` (``<v_i, v_j>_L = -k - d²_ij/2``) gives ``|<S, S>_L| = k + ½ Σ_ij ν_i ν_j d²(v_i, v_j)``. For any
centre ``c`` this pairwise form equals::

    N = k + (E - <D, D>_L),   w_j = v_j - c,   e_j = <w_j, w_j>_L,   E = Σ_j ν_j e_j,   D = Σ_j ν_j w_j,   S = c + D

(expand: ``E - <D, D>_L = Σ_j ν_j <v_j, v_j>_L - <S, S>_L``) whenever all the keys a row attends to share ``c``,
and every implementation evaluates it so, with a detached centre per (batch, head, document)
(:func:`helm.ops.centring.value_centres`), ``e_j`` and ``<D, D>_L`` in fp32 (the statistics dtype of
:mod:`helm.precision`; fp64 only for fp64 inputs), and ``O = lift(sqrt(k) S_s / sqrt(max(N, k/2)))``. Why: the naive
``-<S, S>_L = S_t² - |S_s|²`` in fp32 cancels to nothing once ``|v_s| ≳ 1e3`` (a one-hot row must give ``N = k``
from two terms of size ``|v_s|²``: 41% to 100% output error at ``1e4``), and on fp32-rounded values it is not even
well defined: rounding ``v_t`` moves ``<v, v>_L`` by ``~|v_s| ulp(|v_s|)`` (``±10`` at ``1e4``). The pairwise form
measures each value's own ``<v_j, v_j>_L`` (so a one-hot row gives exactly ``k``), and summing centred values keeps
the fp32 error of ``D`` at the scale of the values' spread instead of their norm when they cluster far from the origin.

**Precision** (:mod:`helm.precision`). ``q·k`` runs in the compute dtype (``dtype``: the autocast dtype under
autocast, the layer's weight dtype for a half-precision model, else the points'); everything else (time
coordinates, the softmax and its logits, ``ν·[w | e]``, ``N`` and the normalisation) in the statistics dtype, fp32
(fp64 for fp64 inputs). A half-precision ``q·k`` gets each time coordinate as a pair ``hi + lo``
(:func:`~helm.precision.split_hi_lo`): ``q_t k_t``, which cancels against ``q_s·k_s`` far from the origin, enters
the fp32 accumulation to ``2^-16`` relative instead of bf16's ``2^-8``, and ``<q, k>_L`` is rounded once before
``2/τ`` scales it in fp32. ``ν·[w | e]`` in the statistics dtype is a named exception (:func:`_explicit_attention`
says why), so in half precision the weights are materialised (the ``sdpa`` implementation included).
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Union

import torch
import torch.nn.functional as F

from transformers.utils import logging

from ..manifold.math import lift, sqnorm
from ..precision import HALF, compute_dtype, no_autocast, split_hi_lo, stat_dtype, to_stat
from .centring import KeyGroups, key_groups, value_centres

logger = logging.get_logger(__name__)

Tau = Union[float, torch.Tensor]

__all__ = [
    "ATTENTION_FUNCTIONS",
    "ATTENTION_ALIASES",
    "ATTENTION_IMPLEMENTATIONS",
    "AttentionMask",
    "alibi_bias",
    "build_attention_mask",
    "check_attention_implementation",
    "continuous_batching_attention",
    "lorentz_attention",
    "resolve_attention",
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

    Queries sit at key indices ``q_offset .. q_offset + Tq - 1``; by default (``q_offset=None``) they are the
    *last* ``Tq`` of the ``Tk`` positions (bottom-right alignment, as in cached decoding with a growing cache).
    ``padding`` ``[B, Tk]``: True for real tokens (the Hugging Face ``attention_mask``). ``segment_ids``
    ``[B, Tk]``: document ids of packed rows; a query attends only to keys of its own document.

    **Static caches.** A ``transformers`` ``StaticCache`` hands every layer all ``Tk = max_cache_len`` slots, of
    which only the first ``q_offset + Tq`` are written. ``q_offset`` (an int, or the cache's 0-dim length tensor,
    read without a host synchronisation so the decode step compiles) then places the queries, and the unwritten
    keys count as padding (``padding`` is ANDed with ``index < q_offset + Tq``). ``dense`` ``[B, 1, Tq, Tk]``
    (bool, True = may attend) is a ready-made keep-mask, such as the 4-D mask ``generate`` builds for static
    caches: it replaces the causal and padding rules (segments still apply), as a 4-D mask does in
    ``transformers``; its keys that no query may see count as padding.

    **Continuous batching.** ``transformers``' paged cache flattens the requests of a step into one row: the new
    tokens of every request one after the other (``Tq``), and the keys each request reads (its cached and new tokens)
    one request after the other (``Tk``). ``query_index`` ``[Tq]`` (int64, instead of ``q_offset``) is then the key
    index of each query (its own key, the last its request may see), ``dense`` the block-diagonal causal mask and
    ``segment_ids`` the request of each key, so that values are centred per request; index differences within a
    request are position differences, so the biases of relative encodings (ALiBi, :func:`alibi_bias`) hold.

    Two forms, one meaning: the Triton kernel reads ``padding`` and ``segment_ids`` (it never materialises a
    ``Tq × Tk`` mask); eager and sdpa read :meth:`keep`, the dense boolean mask, computed on first use and
    then shared by every layer of the forward. Rows that would mask every key (a padding query under left
    padding) are unmasked entirely: their output is ignored by the caller and this keeps the softmax finite
    without a host-side check.
    """

    __slots__ = ("batch", "q_len", "kv_len", "causal", "padding", "segment_ids", "device", "q_offset", "dense",
                 "_query_index", "_keep", "_groups", "_kernel_ids")

    def __init__(self, batch: int, q_len: int, kv_len: int, *, causal: bool = True,
                 padding: Optional[torch.Tensor] = None, segment_ids: Optional[torch.Tensor] = None, device=None,
                 q_offset: Optional[Union[int, torch.Tensor]] = None, dense: Optional[torch.Tensor] = None,
                 query_index: Optional[torch.Tensor] = None):
        for name, t in (("attention_mask", padding), ("segment_ids", segment_ids)):
            if t is not None and tuple(t.shape) != (batch, kv_len):
                raise ValueError(f"{name} must be [B, Tk] = {(batch, kv_len)}, got {tuple(t.shape)}")
        if dense is not None and (dense.dim() != 4 or dense.shape[1] != 1 or dense.shape[-2:] != (q_len, kv_len)
                                  or dense.shape[0] not in (1, batch)):
            raise ValueError(f"a 4-D attention mask must be [B, 1, Tq, Tk] = {(batch, 1, q_len, kv_len)}, "
                             f"got {tuple(dense.shape)}")
        if query_index is not None and (q_offset is not None or tuple(query_index.shape) != (q_len,)):
            raise ValueError(f"query_index must be [Tq] = {(q_len,)} and replaces q_offset, got shape "
                             f"{tuple(query_index.shape)} with q_offset={q_offset!r}")
        if isinstance(q_offset, int) and q_offset == kv_len - q_len:
            q_offset = None  # bottom-right: the default
        self.batch, self.q_len, self.kv_len, self.causal, self.device = batch, q_len, kv_len, bool(causal), device
        self.q_offset = None if q_offset is None else torch.as_tensor(q_offset, device=device)
        self.padding = None if padding is None else padding.to(device=device, dtype=torch.bool)
        self.segment_ids = None if segment_ids is None else segment_ids.to(device)
        self.dense = None if dense is None else _as_keep(dense).to(device).expand(batch, 1, q_len, kv_len)
        self._query_index = None if query_index is None else query_index.to(device=device, dtype=torch.int64)
        if self.dense is not None:
            seen = self.dense.any(-2).view(batch, kv_len)
            self.padding = seen if self.padding is None else self.padding & seen
        if self.q_offset is not None:
            written = torch.arange(kv_len, device=device).view(1, kv_len) < self.q_offset + q_len
            self.padding = written.expand(batch, kv_len) if self.padding is None else self.padding & written
        self._keep = None
        self._groups = False
        self._kernel_ids = None

    @property
    def is_plain_causal(self) -> bool:
        """Causal over a square problem with nothing else masked: fused kernels can use their causal flag."""
        return (self.causal and self.padding is None and self.segment_ids is None and self.q_len == self.kv_len
                and self.dense is None and self.queries_last)

    @property
    def bottom_right(self) -> bool:
        """The queries are the last ``Tq`` keys and the mask is causal + padding + segments (no ``dense`` mask):
        what the Triton kernel expresses."""
        return self.queries_last and self.dense is None

    @property
    def queries_last(self) -> bool:
        """The queries are the last ``Tq`` keys, in order (no ``q_offset``, no ``query_index``)."""
        return self.q_offset is None and self._query_index is None

    def query_index(self) -> torch.Tensor:
        """``[Tq]`` int64: the key index of each query."""
        if self._query_index is not None:
            return self._query_index
        start = self.kv_len - self.q_len if self.q_offset is None else self.q_offset
        return torch.arange(self.q_len, device=self.device) + start

    def keep(self) -> Optional[torch.Tensor]:
        """Boolean keep-mask ``[B, 1, Tq, Tk]`` (True = may attend), or None when nothing is masked."""
        if self._keep is None:
            self._keep = _dense_keep(self)
        return self._keep if isinstance(self._keep, torch.Tensor) else None

    def groups(self) -> Optional[KeyGroups]:
        """The keys' groups (document and padding flag, :class:`KeyGroups`), or None for one group; the values are
        centred per group (see the module docstring). Computed on first use, then shared by every layer."""
        if self._groups is False:
            self._groups = key_groups(self.batch, self.kv_len, self.segment_ids, self.padding, self.device)
        return self._groups

    def kernel_ids(self, make: Callable[..., tuple], device) -> tuple:
        """What the Triton kernel masks with on ``device`` (the attention's), ``make(segment_ids, padding, q_len,
        device)`` (:func:`helm.ops.lorentz_attention_triton.common.kernel_ids`): computed on first use, then shared by
        every layer."""
        if self._kernel_ids is None:
            self._kernel_ids = make(self.segment_ids, self.padding, self.q_len, device)
        return self._kernel_ids

    def __repr__(self) -> str:
        return (f"AttentionMask(B={self.batch}, Tq={self.q_len}, Tk={self.kv_len}, causal={self.causal}, "
                f"padding={self.padding is not None}, segments={self.segment_ids is not None}, "
                f"offset={not self.queries_last}, dense={self.dense is not None})")


def _as_keep(mask: torch.Tensor) -> torch.Tensor:
    """A 4-D mask as booleans: bool as given (True = attend); floating point in ``transformers``' additive form
    (0 = attend, a large negative number = masked)."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask > torch.finfo(mask.dtype).min / 2
    return mask != 0


def _dense_keep(mask: AttentionMask):
    """The dense form of ``mask``; ``False`` (not None, so it is cached) when nothing is masked."""
    B, Tq, Tk, device = mask.batch, mask.q_len, mask.kv_len, mask.device
    keep = mask.dense
    qi = mask.query_index()
    if keep is None:
        if mask.causal:
            kj = torch.arange(Tk, device=device).view(1, Tk)
            keep = (kj <= qi.view(Tq, 1)).view(1, 1, Tq, Tk).expand(B, 1, Tq, Tk)
        if mask.padding is not None:
            pad = mask.padding.view(B, 1, 1, Tk)
            keep = pad if keep is None else keep & pad
    if mask.segment_ids is not None:
        seg = mask.segment_ids
        seg_q = seg[:, -Tq:] if mask.queries_last else seg.index_select(1, qi)
        same = seg_q.view(B, 1, Tq, 1) == seg.view(B, 1, 1, Tk)
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


def alibi_bias(slopes: torch.Tensor, q_len: int, kv_len: int,
               q_offset: Optional[Union[int, torch.Tensor]] = None, *,
               query_index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ALiBi logits bias ``-m_h · (i - j)`` as ``[1, H, Tq, Tk]``; the queries are at key indices
    ``q_offset + (0 .. Tq-1)``, by default the last ``Tq`` positions, or ``query_index [Tq]`` (a flattened
    continuous batch, :class:`AttentionMask`)."""
    if query_index is not None:
        qi = query_index.to(slopes.device).view(q_len, 1)
    else:
        start = kv_len - q_len if q_offset is None else q_offset
        qi = (torch.arange(q_len, device=slopes.device) + start).view(q_len, 1)
    kj = torch.arange(kv_len, device=slopes.device).view(1, kv_len)
    return -(slopes.float().view(1, -1, 1, 1) * (qi - kj).float())


def _centred_values(v: torch.Tensor, mask: "AttentionMask"):
    """``(c_rows, [w | e])``: the centred values ``w_j = v_j - c_j`` (:func:`~helm.ops.centring.value_centres`, one
    centre per document of the mask) with ``e_j = <w_j, w_j>_L`` (:func:`~helm.manifold.math.sqnorm`) appended as
    one more column, so a single ``ν @ ·`` (or SDPA) yields both ``D = Σ ν w`` and ``E = Σ ν e``; and the centre of
    each query row (that of the key at the query's position, which is in its document)."""
    c = value_centres(v, mask.groups())
    w = v - c
    c_rows = c
    if c.shape[-2] > 1:  # each query row takes the centre of the key at its own position
        rows = mask.query_index()
        c_rows = c[..., mask.kv_len - mask.q_len:, :] if mask.queries_last else c.index_select(-2, rows)
    return c_rows, torch.cat([w, sqnorm(w, keepdim=True)], dim=-1)


def _normalise(de: torch.Tensor, c: torch.Tensor, k) -> torch.Tensor:
    """``O = lift(sqrt(k) (c_s + D_s) / sqrt(max(N, k/2)))``, ``N = k + (E - <D, D>_L)``, from ``de = [D | E]``.

    ``E - <D, D>_L`` is formed first (``k`` would be lost in ``k + E`` when ``E ~ |v|²``), in the statistics dtype
    (``de`` is promoted to it). The floor: the exact ``N >= k`` (a one-key row attains it, so rounding can put it a
    hair below ``k``, where a clamp at ``k`` would zero that row's gradient at random), so ``k/2`` never binds for
    values on the manifold and keeps degenerate inputs finite; the Triton kernel uses the same rule."""
    de = to_stat(de)
    d, e = de[..., :-1], de[..., -1:]
    kk = k.to(dtype=d.dtype, device=d.device) if isinstance(k, torch.Tensor) else float(k)
    n = (e - sqnorm(d, keepdim=True)) + kk
    n = n.clamp_min(kk / 2) if not isinstance(kk, torch.Tensor) else torch.maximum(n, kk / 2)
    scale = n.rsqrt() * (kk.sqrt() if isinstance(kk, torch.Tensor) else kk ** 0.5)
    return lift((c[..., 1:] + d[..., 1:]) * scale, k=k)


def _prepare(query, key, value, tau, mask: AttentionMask, position_bias, alibi_slopes, dtype, causal_flag_ok=False):
    """Points in the statistics dtype, the GEMM dtype (``dtype``, default :func:`~helm.precision.compute_dtype` of
    the query), the logit scale ``2/τ``, the keep-mask and the additive logits bias (statistics dtype).

    With ``causal_flag_ok`` (sdpa) a plain causal square problem returns no mask, so the fused kernels run
    with ``is_causal=True`` and never materialise a ``T × T`` mask.
    """
    gemm = compute_dtype(query) if dtype is None else dtype
    acc = stat_dtype(gemm)
    q, kk, v = query.to(acc), key.to(acc), value.to(acc)
    B, H, Tq, _ = q.shape
    Tk = kk.shape[-2]
    plain_causal = mask.is_plain_causal and position_bias is None and alibi_slopes is None
    keep = None if (causal_flag_ok and plain_causal) else mask.keep()
    bias = None
    if position_bias is not None:
        bias = position_bias.to(acc)
    if alibi_slopes is not None:
        ab = alibi_bias(alibi_slopes, Tq, Tk, query_index=mask.query_index()).to(acc)
        bias = ab if bias is None else bias + ab
    return q, kk, v, _logit_scale(tau, H, q), keep, bias, gemm


def _score_operands(q: torch.Tensor, kk: torch.Tensor, dtype: torch.dtype,
                    scale: Optional[torch.Tensor] = None) -> tuple:
    """``(Q, K)`` in the GEMM dtype with ``Q Kᵀ = <q, k>_L`` (``Q = J q``, ``K = k``), or ``scale · <q, k>_L`` with
    ``scale`` folded into ``Q`` (SDPA, whose own scale is a number; fp32/fp64 only).

    In half precision each time coordinate becomes three columns, ``Q = [-hi, -hi, -lo, q_s]`` against
    ``K = [hi', lo', hi', k_s]`` (:func:`~helm.precision.split_hi_lo`): ``q_t k_t``, which cancels against
    ``q_s·k_s`` far from the origin, keeps 16 bits. The space parts come out of half-precision projections, so
    they are exact in it, and the fp32-accumulated product is rounded once, relative to ``<q, k>_L`` itself (the
    scale is applied afterwards, in the statistics dtype)."""
    if dtype not in HALF:
        # J q (· 2/τ) in one broadcast multiply: the sign flip of the time coordinate rides on the scale vector
        sign = torch.ones(q.shape[-1], dtype=q.dtype, device=q.device)
        sign[0] = -1
        return (q * (sign if scale is None else scale * sign)).to(dtype), kk.to(dtype)
    if scale is not None:
        raise ValueError("half-precision scores are scaled after the GEMM, in the statistics dtype")
    q_hi, q_lo = split_hi_lo(-q[..., :1], dtype)
    k_hi, k_lo = split_hi_lo(kk[..., :1], dtype)
    return (torch.cat([q_hi, q_hi, q_lo, q[..., 1:].to(dtype)], dim=-1),
            torch.cat([k_hi, k_lo, k_hi, kk[..., 1:].to(dtype)], dim=-1))


def _explicit_attention(q, kk, v, scale, keep, bias, gemm, *, k, mask: AttentionMask,
                        value_centre: Optional[torch.Tensor] = None,
                        weights_out: Optional[list] = None) -> torch.Tensor:
    """Eq. 3 with the weights materialised: ``-d²/τ`` scores from ``Q Kᵀ`` in the GEMM dtype, softmax and
    ``ν·[w | e]`` in the statistics dtype, then :func:`_normalise` (``value_centre``: see :func:`sdpa_attention`).
    ``weights_out``: a list that receives the softmax weights ``ν [B, H, Tq, Tk]``.

    ``ν·[w | e]`` stays in the statistics dtype whatever the GEMM dtype, a named exception of
    :mod:`helm.precision`: ``N = k + E - <D, D>_L`` cancels ``E`` against ``<D, D>_L`` down to the scale of ``k``
    (a one-hot row gives exactly ``k``), so ``D`` and ``E`` need fp32 *outputs*, which a half-precision GEMM does not
    give on CPU (nor SDPA anywhere): rounding them to bf16 moves ``N`` by ``2^-8 |D|²``, the whole of ``k`` once
    the values' norms reach ~10. The Triton kernel gets the same from its fp32 accumulators."""
    curv = torch.as_tensor(k, dtype=q.dtype, device=q.device)
    if value_centre is None:
        c, we = _centred_values(v, mask)
    else:
        c, we = value_centre.to(v.dtype), v
    qm, km = _score_operands(q, kk, gemm)
    with no_autocast(q.device.type):  # the operands are cast already
        # -d²(q, k)/τ = (2k + 2<q, k>_L)/τ = scale·(k + <q, k>_L)
        scores = (to_stat(qm @ km.transpose(-1, -2)).to(q.dtype) + curv) * scale
        if bias is not None:
            scores = scores + bias
        if keep is not None:
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        weights = scores.softmax(-1)
        if weights_out is not None:
            weights_out.append(weights)
        out = weights @ we
    if value_centre is not None:  # [S | E] -> [D | E]  (Σ ν = 1)
        out = torch.cat([out[..., :-1] - c, out[..., -1:]], dim=-1)
    return _normalise(out, c, k)


class record_attention_weights:
    """``with record_attention_weights() as record:`` every :func:`eager_attention` call inside appends its softmax
    weights ``ν [B, H, Tq, Tk]`` (statistics dtype) to ``record.weights``, in call order: how the models return
    ``output_attentions`` (only eager forms the weights; sdpa and the Triton kernel never do)."""

    active = None

    def __init__(self):
        self.weights = []

    def __enter__(self):
        self._outer, record_attention_weights.active = record_attention_weights.active, self
        return self

    def __exit__(self, *exc):
        record_attention_weights.active = self._outer


def eager_attention(query, key, value, *, k, tau, mask: AttentionMask, position_bias=None,
                    alibi_slopes=None, value_centre: Optional[torch.Tensor] = None,
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Reference: explicit ``-d²/τ`` scores, masks and softmax, Lorentz centroid of values
    (:func:`_explicit_attention`); the weights go to an active :class:`record_attention_weights`. ``value_centre``:
    as :func:`sdpa_attention` (a fallback's decode step reads the cache's norms; as requested, eager centres)."""
    q, kk, v, scale, keep, bias, gemm = _prepare(query, key, value, tau, mask, position_bias, alibi_slopes, dtype)
    record = record_attention_weights.active
    return _explicit_attention(q, kk, v, scale, keep, bias, gemm, k=k, mask=mask, value_centre=value_centre,
                               weights_out=None if record is None else record.weights)


def sdpa_attention(query, key, value, *, k, tau, mask: AttentionMask, position_bias=None,
                   alibi_slopes=None, value_centre: Optional[torch.Tensor] = None,
                   dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``SDPA(J q · 2/τ, k, v, scale=1)`` then centroid normalisation; exact to :func:`eager_attention`.

    ``value_centre`` ``[B, H, 1, 1+dv]``: ``value`` is ``[v | e]`` with ``e_j = <v_j - c, v_j - c>_L`` (a cache that
    keeps it, :class:`helm.nn.LorentzSelfAttention`), so ``SDPA`` on it gives ``S = Σ ν v`` and ``E`` and the
    normalisation takes ``D = S - c``: no pass over the values besides the attention itself (a decode step).

    In half precision SDPA would return ``[D | E]`` rounded to half precision (its outputs take its operands'
    dtype), which the normalisation cannot take (:func:`_explicit_attention`): the same maths then runs with the
    weights materialised, ``q·k`` in half precision and ``ν·v`` in fp32, as the CPU's SDPA did for these unequal
    head widths anyway (its fallback materialises them too)."""
    q, kk, v, scale, keep, bias, gemm = _prepare(query, key, value, tau, mask, position_bias, alibi_slopes, dtype,
                                                 causal_flag_ok=True)
    if gemm in HALF:
        if keep is None and mask.is_plain_causal:
            keep = mask.keep()
        return _explicit_attention(q, kk, v, scale, keep, bias, gemm, k=k, mask=mask, value_centre=value_centre)
    qm, km = _score_operands(q, kk, gemm, scale)
    attn_mask = keep
    if bias is not None:
        attn_mask = bias if keep is None else bias.masked_fill(~keep, torch.finfo(bias.dtype).min)
    use_causal_flag = attn_mask is None and mask.is_plain_causal
    c, we = _centred_values(v, mask) if value_centre is None else (value_centre.to(v.dtype), v)
    width = we.shape[-1]
    qm, km, we = _pad_heads(qm, km, we)  # one head width, a multiple of 8: flash / memory-efficient eligible
    with no_autocast(q.device.type):  # the operands are cast already
        out = F.scaled_dot_product_attention(qm, km, we, attn_mask=attn_mask, is_causal=use_causal_flag, scale=1.0)
    out = out[..., :width]
    if value_centre is not None:  # [S | E] -> [D | E]  (Σ ν = 1)
        out = torch.cat([out[..., :-1] - c, out[..., -1:]], dim=-1)
    return _normalise(out, c, k)


def _pad_heads(*xs: torch.Tensor) -> tuple:
    """``xs`` zero-padded on the last dim to their common width rounded up to a multiple of 8, which
    :func:`sdpa_attention` always does.

    Zero columns leave ``Q Kᵀ`` (so ``<q, k>_L``, the time sign riding on ``Q``) unchanged and give zero output
    columns, which the caller slices off. Unpadded, the unequal widths (``q, k``: ``1 + d``; ``[w | e]``: ``2 + d``)
    leave only SDPA's math backend, which materialises the ``T × T`` weights and scans them for fully masked rows;
    padded, the flash kernel (CPU and CUDA) and the memory-efficient one are eligible, as they are for Llama's equal
    widths. On the CPU this took a tiny-helm-d training step from 1.15x to 1.09x tiny-llama's time
    (docs/benchmarks.md). The price is in fp32 gradients: flash's are within 2e-4 relative of fp64 (measured up to
    9e-5, on ``dq`` with ALiBi; tests/ops/test_attention.py), the math path's within 1e-5 (``eager``, or torch's
    ``sdpa_kernel(SDPBackend.MATH)``); through a model the difference stays below the fp32 model's own worst rounding
    (~1e-4 on the residual weights' gradients, either backend; tests/ops/test_attention_backends.py)."""
    width = -(-max(x.shape[-1] for x in xs) // 8) * 8
    return tuple(x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1])) for x in xs)


def _load_kernel():
    """The Triton kernel's package (:mod:`helm.ops.lorentz_attention_triton`), or the reason it cannot be imported.

    The imports stay inside ``try`` and the kernel package is imported by its absolute name: ``transformers``
    ignores imports inside ``try`` when it lists a remote-code file's requirements, and
    :mod:`helm.models.remote_code` copies only the modules reached by relative imports, so a saved model's code
    needs neither ``triton`` nor the kernel files (which import triton at the top). Loaded as remote code, the
    kernel is used where ``helm-zoo`` and ``triton`` are installed, and ``auto`` falls back to sdpa elsewhere."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None, "attn_implementation='triton' needs the 'triton' package: pip install 'helm-zoo[triton]'"
    try:
        from helm.ops import lorentz_attention_triton
    except ImportError as err:
        return None, f"attn_implementation='triton': the Lorentz attention kernel is not available ({err})"
    return lorentz_attention_triton, None


def _triton_unavailable(device: torch.device) -> Optional[str]:
    """None if the Triton kernel can run on ``device``; otherwise the reason it cannot."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return (f"attn_implementation='triton' cannot run on device {str(device)!r}: the Triton kernel needs CUDA "
                "tensors, or the Triton interpreter (TRITON_INTERPRET=1 set before triton is imported); use "
                "attn_implementation='sdpa', or 'auto' (the kernel where it can run, else sdpa)")
    return _load_kernel()[1]


def triton_attention(query, key, value, *, k, tau, mask: AttentionMask, position_bias=None,
                     alibi_slopes=None, value_centre: Optional[torch.Tensor] = None,
                     dtype: Optional[torch.dtype] = None, key_time: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Fused Triton kernel (:func:`helm.ops.lorentz_attention_triton.lorentz_flash_attention`); it reads the mask's
    padding and segment ids and builds no dense mask.

    ``value_centre``: as :func:`sdpa_attention`; without gradients the kernel reads the cache's ``[v | e]`` as it is
    (no re-centring of the cache per decode step); with gradients the column is dropped and the values centred.
    ``key_time``: ``key`` holds a cache's space parts in the compute dtype and ``key_time`` their time coordinates
    (:func:`lorentz_attention`); the kernel reads both as they are.

    Precision as the other implementations (:mod:`helm.precision`): the space parts of ``q, k`` reach the kernel in
    the compute dtype ``dtype`` (default :func:`~helm.precision.compute_dtype` of the query: bf16 under bf16
    autocast), their time coordinates in fp32 (separate kernel inputs, so ``q_t k_t`` never passes through bf16), the
    values in their own dtype (fp32 points: the value side ``ν·[w | e]`` in fp32, the named exception); softmax
    statistics and the normalisation in fp32 (plus the kernel's fp64 row normaliser, named in the policy); the output
    in the statistics dtype, fp32, as :func:`sdpa_attention` returns it.

    The kernel aligns the queries bottom-right (they are the last ``Tq`` keys), centres each query row's values on
    the group of the key at its own position and takes no dense bias: :func:`resolve_attention` sends the calls it
    cannot take (a static cache, a 4-D mask, a dense score bias) to :func:`sdpa_attention`, the same maths."""
    if value_centre is not None and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (query, key, value, tau, k, alibi_slopes)):
        value, value_centre = value[..., :-1], None
    kernels, _ = _load_kernel()
    return kernels.lorentz_flash_attention(
        query, key, value, k=k, tau=tau, causal=mask.causal, attention_mask=mask.padding,
        segment_ids=mask.segment_ids, alibi_slopes=alibi_slopes, value_centre=value_centre,
        qk_dtype=compute_dtype(query) if dtype is None else dtype,
        groups=mask.groups() if value_centre is None else None, key_time=key_time,
        ids=mask.kernel_ids(kernels.common.kernel_ids, query.device))


# The zoo's own registry (transformers' AttentionInterface pattern, kept out of transformers' global one): a name
# of ``attn_implementation`` -> the function that attends. ``auto`` picks one of them per call.
ATTENTION_FUNCTIONS: Dict[str, Callable[..., torch.Tensor]] = {
    "eager": eager_attention,
    "sdpa": sdpa_attention,
    "triton": triton_attention,
}
ATTENTION_IMPLEMENTATIONS = ("auto", *ATTENTION_FUNCTIONS)
# Names ``transformers`` sets itself, accepted and kept as they are (``config._attn_implementation``, which its code
# reads back), and the implementation each one runs: continuous batching switches ``eager`` to ``paged|eager`` for
# the duration of a session, and builds its block-diagonal mask only for ``paged|eager`` and ``sdpa``.
ATTENTION_ALIASES = {"paged|eager": "eager"}


def check_attention_implementation(name: Optional[str]) -> str:
    """``name`` if it is one of :data:`ATTENTION_IMPLEMENTATIONS` or :data:`ATTENTION_ALIASES` (``None``, no
    request: ``auto``); otherwise a ``ValueError`` naming it and the accepted names. As for ``transformers``' models,
    another name with the former ``paged|`` prefix is that name (``paged|sdpa`` is ``sdpa``). The one check of an
    implementation's name: HELM models run it on ``attn_implementation=``
    (``HelmPreTrainedModel.get_correct_attn_implementation``)."""
    if name is None:
        return "auto"
    if isinstance(name, str) and name.startswith("paged|") and name not in ATTENTION_ALIASES:
        name = name.removeprefix("paged|")
    if name not in ATTENTION_IMPLEMENTATIONS and name not in ATTENTION_ALIASES:
        raise ValueError(f"attn_implementation={name!r} is not available for HELM models; use one of "
                         f"{ATTENTION_IMPLEMENTATIONS}")
    return name


def continuous_batching_attention(name: Optional[str]) -> str:
    """The implementation a continuous-batching session of ``transformers`` runs for the requested ``name``: one
    of the names it accepts (``sdpa``, ``paged|eager``, ``eager``, which it switches to ``paged|eager`` itself).
    ``auto`` and ``triton`` become ``sdpa``: the paged cache's flattened batch comes with a 4-D block-diagonal mask,
    which the Triton kernel never takes (:func:`resolve_attention` sends those calls to ``sdpa``), and
    ``transformers`` refuses names it does not know."""
    name = check_attention_implementation(name)
    return "sdpa" if name in ("auto", "triton") else name


def _note_once(message: str, *args) -> None:
    if not torch.compiler.is_compiling():  # dynamo refuses logging
        logger.info_once(message, *args)


def resolve_attention(requested: Optional[str], device: torch.device, *, mask: Optional[AttentionMask] = None,
                      dense_bias: bool = False, absorbable: bool = False, half: bool = False) -> str:
    """The path one attention call takes: ``eager``, ``sdpa``, ``triton`` or ``absorbed``; decided here only, at
    every call, from the requested implementation (``config._attn_implementation``; None means ``auto``).

    * ``absorbed``: HMLA's absorbed decode (:class:`helm.nn.HMLA`), whenever the layer says it can take it
      (``absorbable``: a cached step with the per-token scalars) and ``eager`` is not requested: eager, the
      reference, forms the ``[Tq, Tk]`` weights (``output_attentions``) on the plain path.
    * ``eager``, ``sdpa``: as requested (``paged|eager``, continuous batching's name, is ``eager``).
    * ``triton``: the kernel when it can take the call, else ``sdpa``, the same maths: a dense score bias
      (``dense_bias``), a mask that is not bottom-right aligned (a static cache, a 4-D mask). Requested where the
      kernel cannot run (no CUDA and no Triton interpreter, or ``triton`` not installed): a ``ValueError`` saying
      why.
    * ``auto``: ``triton`` on CUDA where it can run and take the call, else ``sdpa``.

    Where ``triton`` or ``auto`` fall back in half precision (``half``: the call's GEMM dtype), they take ``eager``:
    ``sdpa`` would materialise the weights there too (SDPA's half-precision ``[D | E]`` is what the normalisation
    cannot take, :func:`_explicit_attention`), so no fallback is named after a flash kernel that does not run.
    """
    requested = check_attention_implementation(requested)
    requested = ATTENTION_ALIASES.get(requested, requested)
    # before the absorbed path: a request the device cannot run fails on every call, not only on uncached ones
    if requested == "triton" and (reason := _triton_unavailable(device)) is not None:
        raise ValueError(reason)
    if absorbable and requested != "eager":
        return "absorbed"
    if requested in ("eager", "sdpa"):
        return requested
    takes_call = not dense_bias and (mask is None or mask.bottom_right)
    fallback = "eager" if half else "sdpa"
    if requested == "triton":
        if not takes_call:
            _note_once("helm attention 'triton': a dense score bias, static cache or 4-D mask; %r takes it", fallback)
        return "triton" if takes_call else fallback
    choice = "triton" if device.type == "cuda" and takes_call and _triton_unavailable(device) is None else fallback
    _note_once("helm attention 'auto' uses %r on %s", choice, device.type)
    return choice


def _validate(query, key_shape, value, tau, mask, position_bias, alibi_slopes):
    B, H, Tq, D = query.shape
    if key_shape[:2] != (B, H) or value.shape[:2] != (B, H):
        raise ValueError(f"query, key and value must share [B, H]: got {tuple(query.shape)}, "
                         f"{tuple(key_shape)}, {tuple(value.shape)}")
    if key_shape[-1] != D:
        raise ValueError(f"query and key must have the same head dim 1+d: got {D} and {key_shape[-1]}")
    Tk = key_shape[-2]
    if value.shape[-2] != Tk:
        raise ValueError(f"key and value must have the same length: got {Tk} and {value.shape[-2]}")
    if Tq > Tk:
        raise ValueError(f"query length {Tq} exceeds key length {Tk}")
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
    impl: Optional[str] = "auto",
    mask: Optional[AttentionMask] = None,
    value_centre: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
    key_time: Optional[torch.Tensor] = None,
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
        impl: ``eager``, ``sdpa``, ``triton`` or ``auto`` (None: ``auto``; :func:`resolve_attention` decides what runs).
        mask: a prebuilt :class:`AttentionMask` (models build one per forward for all layers); replaces
            ``causal``, ``attention_mask`` and ``segment_ids``.
        value_centre: ``[B, H, 1, 1+dv]``, a centre ``c`` of the values for which ``value`` carries one more
            column, ``[B, H, Tk, 1+dv+1] = [v | e]`` with ``e_j = <v_j - c, v_j - c>_L`` (statistics dtype): what a
            cache computes once per token. ``sdpa`` and ``triton`` (without gradients) then normalise from
            ``Σ ν [v | e]`` with ``D = S - c`` instead of re-centring every value every call (a decode step's cost
            over the cache); ``eager`` drops the column and centres as usual. The same centroid (any centre gives
            it exactly).
        dtype: the GEMM dtype of ``q·k`` and ``ν·v`` (:mod:`helm.precision`); default
            :func:`~helm.precision.compute_dtype` of ``query`` (the autocast dtype under autocast, else the
            query's dtype). Layers pass their projections' output dtype, so a bf16 model attends in bf16.
        key_time: ``[B, H, Tk]``, the keys' time coordinates (statistics dtype); ``key`` is then their space parts
            ``[B, H, Tk, d]`` only, in the compute dtype: how :class:`helm.nn.LorentzSelfAttention` caches keys.
            ``triton`` reads both as they are (no cast over the cache per decode step); the other implementations
            attend to the points ``[key_time | key]``.

    Returns:
        ``[B, H, Tq, 1+dv]`` points of ``H_k`` in the statistics dtype of ``dtype`` (fp32, or fp64 for fp64).
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
    if value_centre is not None and (value_centre.dim() != 4 or value_centre.shape[-2] != 1
                                     or value_centre.shape[-1] != value.shape[-1] - 1
                                     or value_centre.shape[:2] != value.shape[:2]):
        raise ValueError(f"value_centre must be [B, H, 1, 1+dv] for values [B, H, Tk, 1+dv+1], got "
                         f"{tuple(value_centre.shape)} for {tuple(value.shape)}")
    key_shape = key.shape
    if key_time is not None:
        if tuple(key_time.shape) != tuple(key.shape[:3]) or not key_time.is_floating_point():
            raise ValueError(f"key_time must be floating [B, H, Tk] = {tuple(key.shape[:3])}, got "
                             f"{tuple(key_time.shape)} {key_time.dtype}")
        if key.shape[3] != query.shape[3] - 1:
            raise ValueError(f"with key_time, key must be the keys' space parts [B, H, Tk, d = {query.shape[3] - 1}] "
                             f"(query is 1+d = {query.shape[3]}), got {tuple(key.shape)}")
        key_shape = torch.Size((*key.shape[:3], 1 + key.shape[3]))
    _validate(query, key_shape, value, tau, mask, position_bias, alibi_slopes)
    name = resolve_attention(impl, query.device, mask=mask, dense_bias=position_bias is not None,
                             half=(compute_dtype(query) if dtype is None else dtype) in HALF)
    extra = {}
    if key_time is not None:
        if name == "triton":
            extra["key_time"] = key_time
        else:
            stat = stat_dtype(key_time)  # the points' dtype, never the GEMM's
            key = torch.cat([key_time.unsqueeze(-1).to(stat), key.to(stat)], dim=-1)
    if value_centre is not None:
        # eager as requested, the reference, centres the values itself; as a half-precision fallback it reads them
        if name != "eager" or ATTENTION_ALIASES.get(impl, impl) != "eager":
            extra["value_centre"] = value_centre
        else:
            value = value[..., :-1]
    return ATTENTION_FUNCTIONS[name](query, key, value, k=k, tau=tau, mask=mask, position_bias=position_bias,
                                     alibi_slopes=alibi_slopes, dtype=dtype, **extra)
