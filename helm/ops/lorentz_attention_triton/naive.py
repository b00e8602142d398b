"""Readable PyTorch reference of the Lorentz attention kernels, written from the equations alone.

It shares no code with :mod:`helm.ops.attention` (nor with :mod:`helm.ops.centring`): its masks, scores and
normalisation are restated here in fp64, so comparing the eager path with it can catch a bug in either, the eager
path's per-document centring included. It materialises the ``[Tq, Tk]`` weights and, for the normaliser, the
``[Tq, Tk, 1+dv]`` differences of every value from each row's centroid: small shapes only.
"""

from __future__ import annotations

import torch


def _minkowski_sq(x: torch.Tensor) -> torch.Tensor:
    """``<x, x>_L = |x_s|² - x_t²`` over the last dim, keeping it."""
    return x[..., 1:].square().sum(-1, keepdim=True) - x[..., :1].square()


def naive_lorentz_attention(query, key, value, *, k, tau, causal=True, attention_mask=None, segment_ids=None,
                            alibi_slopes=None) -> torch.Tensor:
    """Paper Eq. 3: ``O_i = sqrt(k) S_i / sqrt(|<S_i, S_i>_L|)`` with ``S_i = Σ_j P_ij v_j`` and
    ``P_i = softmax_j(-d²(q_i, k_j)/τ + bias_ij)`` over the keys query ``i`` may see, ``d²(q, k) = -2k - 2<q, k>_L``.

    The queries are the last ``Tq`` of the ``Tk`` positions. Query ``i`` sees key ``j`` when ``j <= i`` (``causal``),
    ``attention_mask[b, j]`` is nonzero and ``segment_ids`` agree; a row that sees no key sees every key (its output
    is ignored by callers, this keeps it finite). ALiBi's bias is ``-m_h (i - j)``.

    The normaliser is evaluated in the centroid's pairwise form with the row's own centroid as centre: since
    ``Σ_j P_ij = 1``, ``|<S, S>_L| = k + Σ_j P_ij <v_j - S_i, v_j - S_i>_L`` for values on ``H_k``
    (expand ``<v_j - S, v_j - S>_L`` and use ``<v_j, v_j>_L = -k``), which involves no centre shared across rows and
    cancels nothing far from the origin. Floored at ``k/2`` (the exact value is ``>= k``), then ``O`` is lifted from its
    space part as the other implementations return it.

    Shapes as :func:`helm.ops.lorentz_attention_triton.lorentz_flash_attention`: ``query [B, H, Tq, 1+d]``,
    ``key [B, H, Tk, 1+d]``, ``value [B, H, Tk, 1+dv]``, ``tau`` a number or ``[H]``. Computes in fp64; returns fp64
    for fp64 inputs, else fp32.
    """
    out_dtype = torch.float64 if torch.float64 in (query.dtype, key.dtype, value.dtype) else torch.float32
    q, kk, v = query.double(), key.double(), value.double()
    B, H, Tq, _ = q.shape
    Tk = kk.shape[2]
    curv = torch.as_tensor(k, dtype=torch.float64, device=q.device)
    tau = torch.as_tensor(tau, dtype=torch.float64, device=q.device).reshape(-1).expand(H).view(1, H, 1, 1)

    inner = q[..., 1:] @ kk[..., 1:].transpose(-1, -2) - q[..., :1] @ kk[..., :1].transpose(-1, -2)  # <q_i, k_j>_L
    logits = (2 * curv + 2 * inner) / tau  # -d²(q_i, k_j) / τ
    i = torch.arange(Tk - Tq, Tk, device=q.device).view(Tq, 1)
    j = torch.arange(Tk, device=q.device).view(1, Tk)
    if alibi_slopes is not None:
        logits = logits - alibi_slopes.double().view(1, H, 1, 1) * (i - j)

    sees = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        sees = sees & (j <= i)
    if attention_mask is not None:
        sees = sees & (attention_mask != 0).view(B, 1, 1, Tk)
    if segment_ids is not None:
        sees = sees & (segment_ids[:, Tk - Tq:].view(B, 1, Tq, 1) == segment_ids.view(B, 1, 1, Tk))
    sees = sees | ~sees.any(-1, keepdim=True)
    p = logits.masked_fill(~sees, float("-inf")).softmax(-1)  # [B, H, Tq, Tk]

    s = p @ v  # [B, H, Tq, 1+dv]
    spread = _minkowski_sq(v.unsqueeze(2) - s.unsqueeze(3))  # <v_j - S_i, v_j - S_i>_L  [B, H, Tq, Tk, 1]
    norm = curv + (p.unsqueeze(-1) * spread).sum(-2)  # |<S_i, S_i>_L|  [B, H, Tq, 1]
    out_s = s[..., 1:] * (curv.sqrt() / torch.maximum(norm, curv / 2).sqrt())
    out = torch.cat([(out_s.square().sum(-1, keepdim=True) + curv).sqrt(), out_s], dim=-1)
    return out.to(out_dtype)
