"""Readable PyTorch reference of the Lorentz attention kernels (materialises the ``[Tq, Tk]`` scores).

Restates ``helm.ops.lorentz_attention(..., impl="eager")`` in plain torch so the kernels can be read
against it; the tests compare both the kernels and this function with helm's eager path in float64.
"""

from __future__ import annotations

import torch

from ..attention import _key_groups, _value_centres


def naive_lorentz_attention(query, key, value, *, k, tau, causal=True, attention_mask=None, segment_ids=None,
                            alibi_slopes=None) -> torch.Tensor:
    """``O = lift(sqrt(k) S_s / sqrt(max(N, k/2)))`` with ``S = P v``, ``P = softmax(2<q,k>_L/τ + bias)``.

    ``N = |<S,S>_L|`` in the pairwise form ``k + (P e - <D, D>_L)``, ``D = P w``, ``S = c + D``, for the centred
    values ``w_j = v_j - c_j`` (one centre per document, :func:`.common.centre_values`) and ``e_j = <w_j, w_j>_L``,
    the last two Minkowski norms accumulated in fp64 (see this folder's ``README.md``). The exact ``N >= k``; the
    floor ``k/2`` never binds for values on the manifold (see ``helm.ops``).

    Shapes as :func:`helm.ops.lorentz_attention_triton.lorentz_flash_attention`; computes in fp32 (fp64 for fp64).
    """
    dtype = torch.float64 if torch.float64 in (query.dtype, key.dtype, value.dtype) else torch.float32
    q, kk, v = query.to(dtype), key.to(dtype), value.to(dtype)
    B, H, Tq, _ = q.shape
    Tk = kk.shape[2]
    tau = torch.as_tensor(tau, dtype=dtype, device=q.device).reshape(-1).expand(H).view(1, H, 1, 1)
    minkowski = q[..., 1:] @ kk[..., 1:].transpose(-1, -2) - q[..., :1] * kk[..., :1].transpose(-1, -2)
    logits = 2 * minkowski / tau  # -d²/τ up to the per-row constant 2k/τ, which softmax ignores
    pos = torch.arange(Tk - Tq, Tk, device=q.device).view(Tq, 1)  # queries are the last Tq positions
    key_pos = torch.arange(Tk, device=q.device).view(1, Tk)
    if alibi_slopes is not None:
        logits = logits - alibi_slopes.to(dtype).view(1, H, 1, 1) * (pos - key_pos)
    keep = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep & (key_pos <= pos)
    if attention_mask is not None:
        keep = keep & attention_mask.bool().view(B, 1, 1, Tk)
    if segment_ids is not None:
        keep = keep & (segment_ids[:, Tk - Tq:].view(B, 1, Tq, 1) == segment_ids.view(B, 1, 1, Tk))
    keep = keep | ~keep.any(-1, keepdim=True)  # a row that keeps nothing attends to every key
    c = _value_centres(v, _key_groups(B, Tk, segment_ids, None if attention_mask is None else attention_mask.bool(),
                                    q.device))
    w = v - c
    c_rows = c.expand_as(v)[:, :, Tk - Tq:]

    def minkowski(x):  # <x, x>_L accumulated in fp64
        x = x.double()
        return (x[..., 1:].pow(2).sum(-1, keepdim=True) - x[..., :1].pow(2)).to(dtype)

    p = logits.masked_fill(~keep, float("-inf")).softmax(-1)
    d, e = p @ w, p @ minkowski(w)
    kt = torch.as_tensor(k, dtype=dtype, device=q.device)
    n = (e - minkowski(d)) + kt
    out_s = (c_rows[..., 1:] + d[..., 1:]) * (kt.sqrt() / torch.maximum(n, kt / 2).sqrt())
    return torch.cat([(out_s.pow(2).sum(-1, keepdim=True) + kt).sqrt(), out_s], dim=-1)
