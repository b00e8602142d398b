"""Centres of attention values, per group of keys: what every implementation of :mod:`helm.ops.attention` (eager,
sdpa, the Triton kernel's launcher) subtracts before it sums values, so that the centroid's normaliser
``N = k + (E - <D, D>_L)`` keeps fp32 precision far from the origin (the derivation is in :mod:`helm.ops.attention`).

The normaliser is exact for any centre shared by the keys a query row attends to, so the keys are grouped by document
(segment id) and padding flag, and each group gets one detached centre. Sorts and segmented scans only: no host
synchronisation, deterministic, and each group's centre is bit for bit independent of the other groups."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..precision import to_stat

__all__ = ["KeyGroups", "group_sum", "key_groups", "value_centres"]


class KeyGroups(NamedTuple):
    """The keys' groups (same segment id, same padding flag) and what a segmented sum over them needs, computed once
    per mask (:meth:`helm.ops.AttentionMask.groups`) and shared by every layer. Keys are numbered row-major over
    ``[B, Tk]`` (key ``j`` of batch row ``b`` is ``b·Tk + j``), and ``B·Tk`` names a zero row (:func:`group_sum`).

    ``first [B·Tk]`` int64: the first key of each key's group. ``sources``: for the doubling steps
    ``s = 1, 2, 4, ... < Tk``, ``[B·Tk]`` int64, the key ``s`` places before each key within its group (keys in index
    order), or ``B·Tk`` where there is none. ``last [B·Tk]``: the last key of each key's group.
    ``count [B·Tk, 1, 1]`` int64: the size of each key's group."""

    first: torch.Tensor
    sources: tuple
    last: torch.Tensor
    count: torch.Tensor


def key_groups(batch: int, kv_len: int, segment_ids: Optional[torch.Tensor], padding: Optional[torch.Tensor],
               device) -> Optional[KeyGroups]:
    """The :class:`KeyGroups` of keys with these segment ids and padding flags; None when all keys form one
    group. Sorts and scans only: no host synchronisation."""
    if segment_ids is None and padding is None:
        return None
    key = torch.zeros(batch, kv_len, dtype=torch.int64, device=device)
    if segment_ids is not None:
        seg = segment_ids.to(device=device, dtype=torch.int64)
        key = seg - seg.amin(dim=1, keepdim=True)
    key = 2 * key
    if padding is not None:
        key = key + (~padding.to(device=device, dtype=torch.bool)).to(torch.int64)
    # keys sorted by group, stably (each group keeps index order); positions below are in that order
    s, order = key.sort(dim=1, stable=True)
    start = torch.ones_like(s, dtype=torch.bool)
    start[:, 1:] = s[:, 1:] != s[:, :-1]
    end = torch.ones_like(start)
    end[:, :-1] = start[:, 1:]
    pos = torch.arange(kv_len, device=device).expand(batch, kv_len)
    run_start = torch.where(start, pos, torch.zeros_like(pos)).cummax(dim=1).values
    run_end = torch.where(end, pos, torch.full_like(pos, kv_len)).flip(1).cummin(dim=1).values.flip(1)
    offset = (torch.arange(batch, device=device) * kv_len).view(batch, 1)
    none = batch * kv_len

    def by_key(sorted_keys: torch.Tensor) -> torch.Tensor:  # per sorted position -> per key, flattened
        return torch.empty_like(order).scatter_(1, order, sorted_keys).view(-1)

    rank = pos - run_start  # within the group
    sources = tuple(by_key(torch.where(rank >= step, order.gather(1, (pos - step).clamp_min(0)) + offset, none))
                    for step in (1 << i for i in range(max(kv_len - 1, 0).bit_length())))
    return KeyGroups(first=by_key(order.gather(1, run_start) + offset), sources=sources,
                     last=by_key(order.gather(1, run_end) + offset),
                     count=by_key(run_end - run_start + 1).view(-1, 1, 1))


def group_sum(rows: torch.Tensor, groups: KeyGroups) -> torch.Tensor:
    """Per-key sum of ``rows [B·Tk, W]`` over the key's group: a segmented scan (``log2 Tk`` doubling steps, each
    adding the partial sum of the key ``step`` places before within the group, or of the zero row), then each key
    takes its group's last partial sum. A group's sum involves its own keys only, in an order set by their ranks
    within the group: bit for bit independent of the other groups (a cumulative sum across groups would round each
    group's sum by its prefix), deterministic, no fp64; row copies only (``index_select``)."""
    n = rows.shape[0]
    y = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])  # row n stays 0
    for source in groups.sources:
        y[:n].add_(y.index_select(0, source))  # the gather reads y before the in-place add writes it
    return y.index_select(0, groups.last)


def value_centres(v: torch.Tensor, groups: Optional[KeyGroups]) -> torch.Tensor:
    """Detached centres ``c_j``: ``[B, H, 1, 1+dv]`` (one group) or ``[B, H, Tk, 1+dv]`` (``groups`` from
    :func:`key_groups`), in ``v``'s dtype.

    The normalisation is exact for any centre shared by a row's keys, so the centre's own rounding does not
    matter: the mean ``m`` of the group, shrunk towards 0 unless the values cluster (``β = 1 - 100 var/|m|²``, so an
    unclustered group keeps the origin as centre), in the statistics dtype. Per group, ``m`` and ``var`` come from
    one segmented sum of the values shifted by the group's first value ``f`` (``d = v - f``: ``m = f + Σd/n``,
    ``var = Σ|d|²/n - |Σd/n|²``, the shift keeping the difference of moments at the scale of the group's spread)."""
    v = v.detach()
    wide = to_stat(v)
    B, H, Tk, C = wide.shape
    if groups is None:
        m = wide.mean(-2, keepdim=True)
        var = (wide - m).square().sum(-1, keepdim=True).mean(-2, keepdim=True)
    else:  # one row of [H, C] per key, so that gathering keys copies whole rows
        rows = wide.transpose(1, 2).reshape(B * Tk, H, C)
        f = rows.index_select(0, groups.first)
        d = rows - f
        sums = group_sum(torch.cat([d, d.square().sum(-1, keepdim=True)], dim=-1).view(B * Tk, -1), groups)
        sums = sums.view(B * Tk, H, C + 1)
        count = groups.count.to(wide.dtype)
        mean_d = sums[..., :-1] / count
        m = f + mean_d
        var = (sums[..., -1:] / count - mean_d.square().sum(-1, keepdim=True)).clamp_min(0)
    m2 = m.square().sum(-1, keepdim=True)
    beta = (1 - 100 * var / m2.clamp_min(torch.finfo(m2.dtype).tiny)).clamp_min(0)
    c = (m * beta).to(v.dtype)
    return c if groups is None else c.view(B, Tk, H, C).transpose(1, 2)
