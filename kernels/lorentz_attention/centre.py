"""Per-key centres of the values for the Lorentz normalisation (pure torch; restated in ``helm.ops.attention``).

The normaliser of ``S = Σ_j ν_j v_j`` is evaluated in the pairwise form ``N = k + (E - <D, D>_L)`` with
``D = Σ_j ν_j (v_j - c_j)`` and ``E = Σ_j ν_j <v_j - c_j, v_j - c_j>_L`` (see ``kernels/README.md``). Its value does
not depend on the centres ``c_j`` as long as every key a row attends to has the same centre; only its rounding
does. Keys are therefore grouped by document (segment id) and padding, so packed documents stay bit-for-bit
independent, and each group gets ``c = β m``: ``m`` its mean value, ``σ²`` the mean squared Euclidean distance to
``m`` and ``β = max(0, 1 - 100 σ²/|m|²)``. Values spread around the origin (``σ ≥ |m|/10``) get ``c = 0``:
their ``e_j = <v_j, v_j>_L ≈ -k`` are small and exact, where any other centre makes ``e_j`` (and the backward's
``δ = dD·D + dE E``) far larger than ``N``. Values clustered far from it get ``c ≈ m`` (the centred values are small, and so is the fp32
error of their weighted sum). Sorting and segmented scans only: deterministic, no host synchronisation.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["key_groups", "value_centres"]


def key_groups(batch: int, kv_len: int, segment_ids: Optional[torch.Tensor], padding: Optional[torch.Tensor],
               device) -> Optional[torch.Tensor]:
    """``[B, Tk]`` int64: for each key, the index of the first key of its group (same segment id, same padding
    flag); None when all keys form one group."""
    if segment_ids is None and padding is None:
        return None
    key = torch.zeros(batch, kv_len, dtype=torch.int64, device=device)
    if segment_ids is not None:
        seg = segment_ids.to(device=device, dtype=torch.int64)
        key = seg - seg.amin(dim=1, keepdim=True)
    key = 2 * key
    if padding is not None:
        key = key + (~padding.to(device=device, dtype=torch.bool)).to(torch.int64)
    s, perm = key.sort(dim=1, stable=True)
    start = torch.ones_like(s, dtype=torch.bool)
    start[:, 1:] = s[:, 1:] != s[:, :-1]
    pos = torch.arange(kv_len, device=device).expand(batch, kv_len)
    run_start = torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values
    first = perm.gather(1, run_start)  # stable sort: the run's first entry is the group's lowest key index
    return torch.empty_like(first).scatter_(1, perm, first)


def _group_sum(x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per-key sum of ``x [B, H, Tk, C]`` over the key's group: a segmented scan over the keys sorted by group
    (``log2 Tk`` doubling steps, each adding the partial sum ``step`` keys back when it lies in the same group), so
    a group's sum involves its own keys only, in a fixed order: bit for bit independent of the other groups (a
    cumulative sum across groups would round each group's sum by its prefix), deterministic, no fp64."""
    B, H, Tk, C = x.shape
    order = groups.argsort(dim=1, stable=True)
    idx = order.view(B, 1, Tk, 1).expand(B, H, Tk, C)
    xs = x.gather(2, idx)
    g_sorted = groups.gather(1, order)
    step = 1
    while step < Tk:
        same = (g_sorted[:, step:] == g_sorted[:, :-step]).view(B, 1, Tk - step, 1)
        xs = torch.cat([xs[:, :, :step], xs[:, :, step:] + torch.where(same, xs[:, :, :-step], 0)], dim=2)
        step *= 2
    end = torch.ones_like(g_sorted, dtype=torch.bool)
    end[:, :-1] = g_sorted[:, 1:] != g_sorted[:, :-1]
    pos = torch.arange(Tk, device=x.device).expand(B, Tk)
    last = torch.where(end, pos, torch.full_like(pos, Tk)).flip(1).cummin(dim=1).values.flip(1)
    total = xs.gather(2, last.view(B, 1, Tk, 1).expand(B, H, Tk, C))  # the inclusive scan at the group's last key
    return torch.empty_like(total).scatter_(2, idx, total)


def value_centres(v: torch.Tensor, groups: Optional[torch.Tensor]) -> torch.Tensor:
    """Detached centres ``c_j``: ``[B, H, 1, 1+dv]`` (one group) or ``[B, H, Tk, 1+dv]`` (``groups`` from
    :func:`key_groups`), in ``v``'s dtype. Computed in fp32 (fp64 for fp64 values): any centre shared by a row's
    keys gives the exact normaliser, so its own rounding does not matter."""
    v = v.detach()
    wide = v.double() if v.dtype == torch.float64 else v.float()
    if groups is None:
        m = wide.mean(-2, keepdim=True)
        var = (wide - m).pow(2).sum(-1, keepdim=True).mean(-2, keepdim=True)
    else:
        ones = torch.ones_like(wide[..., :1])
        count = _group_sum(ones, groups)
        m = _group_sum(wide, groups) / count
        var = _group_sum((wide - m).pow(2).sum(-1, keepdim=True), groups) / count
    m2 = m.pow(2).sum(-1, keepdim=True)
    beta = (1 - 100 * var / m2.clamp_min(torch.finfo(m2.dtype).tiny)).clamp_min(0)
    return (m * beta).to(v.dtype)
