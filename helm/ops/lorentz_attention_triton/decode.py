"""Split-K ("flash-decoding") forward of Lorentz attention for a few query rows against a long cache.

Layout: kernels -> launcher -> custom op ``helm::lorentz_attention_decode`` (``torch.library``, with a fake
implementation; forward only: decoding needs no backward, training goes through :mod:`.fwd_bwd`) ->
:func:`lorentz_decode_attention`.

With ``Tq <= 16`` the forward kernel would run one program per batch·head, each walking the whole cache.
Here the keys are cut into ``n_splits`` contiguous chunks; program ``(split, b·h)`` runs the online softmax
of all query rows over its chunk and writes the partial state ``(m, l, acc_t, acc_s, acc_e)``; a combine kernel
merges the chunks (``l = Σ_s l_s 2^(m_s - m)``, same for ``acc``) and applies the Lorentz normalisation.
Given a cache's values with their norms about one centre (``value_centre``), it reads them as they are
(``CENTRED=False``) instead of re-centring the cache every step.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET,
    LOG2E,
    Curv,
    Prepared,
    Tau,
    _attend_blocks,
    _centroid_normalise,
    _load_points,
    _load_split,
    _store_points,
    alloc,
    block_d,
    dot_precision,
    launch_args,
    needs_grad,
    prepare,
    prune_configs,
)

__all__ = ["lorentz_decode_attention", "lorentz_attention_decode", "DECODE_BLOCK_M"]

# Query rows handled by one program (and the largest Tq the decoding kernel accepts); 16 is the smallest
# tl.dot tile.
DECODE_BLOCK_M = 16
# Key block candidates of the split kernel on sm90 (pruned like the forward's); one small block under the
# interpreter, so its tests see several splits. Every split holds a multiple of SPLIT_KEYS keys, a multiple of
# every candidate, so the split boundaries do not depend on the configuration the autotuner picks.
if INTERPRET:
    DECODE_CONFIGS = [triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)]
    SPLIT_KEYS = 32
else:
    # the earlier hand-picked 64-key block first (HELM_TRITON_AUTOTUNE=0 takes the first that fits)
    DECODE_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
                      for n in (64, 32, 128) for w in (4, 8) for s in (2, 3, 4)]
    SPLIT_KEYS = 128
# Key block of the combine kernel's walk for rows whose mask kept nothing (rare: not tuned).
COMBINE_BLOCK_N = 32


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.autotune(configs=DECODE_CONFIGS, key=["D", "DV", "CAUSAL"], cache_results=True,
                 prune_configs_by={"early_config_prune": prune_configs("fwd")})
@triton.jit
def lorentz_attention_decode_split_kernel(
    Q, QT, K, KT, V, E, SCALE, SLOPES, QID, KID, M_PART, L_PART, ACC_T, ACC_S, ACC_E,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    H, Tq, Tk, keys_per_split, n_splits,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, SPLIT_V: tl.constexpr,
    CENTRED: tl.constexpr,
):
    """Grid ``(n_splits, B*H)``. Partial softmax state of all ``Tq <= BLOCK_M`` rows over the keys
    ``[split * keys_per_split, (split+1) * keys_per_split)``, stored in ``[B*H, n_splits, BLOCK_M(, BLOCK_DV)]``
    buffers (every entry written, padding rows included)."""
    i_s = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    o_m = tl.arange(0, BLOCK_M)
    m_q = o_m < Tq
    pos_q = o_m + (Tk - Tq)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    b_qt, b_qs = _load_split(Q + i_b * stride_qb + i_h * stride_qh, QT + i_bh.to(tl.int64) * Tq, o_m, m_q,
                             stride_qt, o_d, D, BLOCK_D)
    qk_scale = tl.load(SCALE + i_h) * LOG2E
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + i_h) * LOG2E
    b_qid = o_m
    if HAS_SEG:
        b_qid = tl.load(QID + i_b * Tq + o_m, mask=m_q, other=0)
    lo = i_s * keys_per_split
    hi = tl.minimum(lo + keys_per_split, Tk)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_t = tl.zeros([BLOCK_M], tl.float32)
    acc_s = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_e = tl.zeros([BLOCK_M], tl.float32)
    acc_t, acc_s, acc_e, l_i, m_i = _attend_blocks(
        acc_t, acc_s, acc_e, l_i, m_i, b_qt, b_qs, pos_q, m_q, b_qid, m_q,
        K + i_b * stride_kb + i_h * stride_kh, KT + i_bh.to(tl.int64) * Tk, V + i_b * stride_vb + i_h * stride_vh,
        E + i_bh.to(tl.int64) * Tk, KID + i_b * 3 * Tk,
        stride_kt, stride_vt, lo, hi, Tk, qk_scale, slope,
        D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, HAS_SEG, HAS_ALIBI, False, DOT_F32, PREC, SPLIT_V, CENTRED)

    o_part = (i_bh.to(tl.int64) * n_splits + i_s) * BLOCK_M + o_m
    tl.store(M_PART + o_part, m_i)
    tl.store(L_PART + o_part, l_i)
    tl.store(ACC_T + o_part, acc_t)
    tl.store(ACC_E + o_part, acc_e)
    tl.store(ACC_S + o_part[:, None] * BLOCK_DV + o_dv[None, :], acc_s)


@triton.jit
def lorentz_attention_decode_combine_kernel(
    Q, QT, K, KT, V, E, C, SCALE, SLOPES, KC, M_PART, L_PART, ACC_T, ACC_S, ACC_E, OUT,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, Tq, Tk, n_splits,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SEG: tl.constexpr, HAS_ALIBI: tl.constexpr,
    CENTRED: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, SPLIT_V: tl.constexpr,
):
    """Grid ``(B*H,)``. Merges the split states, handles rows whose mask kept no key, normalises, writes
    the output ``OUT [B, H, Tq, 1+DV]``. Without ``CENTRED`` ``V`` holds plain values and ``D = Σ P v - c``."""
    i_bh = tl.program_id(0)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    o_m = tl.arange(0, BLOCK_M)
    m_q = o_m < Tq
    o_dv = tl.arange(0, BLOCK_DV)
    m_g = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_g = tl.zeros([BLOCK_M], tl.float32)
    acc_t = tl.zeros([BLOCK_M], tl.float32)
    acc_s = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_e = tl.zeros([BLOCK_M], tl.float32)
    for i_s in range(0, n_splits):
        o_part = (i_bh.to(tl.int64) * n_splits + i_s) * BLOCK_M + o_m
        b_m = tl.load(M_PART + o_part)
        m_new = tl.maximum(m_g, b_m)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_alpha = tl.exp2(m_g - m_use)
        b_beta = tl.exp2(b_m - m_use)
        l_g = l_g * b_alpha + tl.load(L_PART + o_part) * b_beta
        acc_t = acc_t * b_alpha + tl.load(ACC_T + o_part) * b_beta
        acc_e = acc_e * b_alpha + tl.load(ACC_E + o_part) * b_beta
        acc_s = acc_s * b_alpha[:, None] + tl.load(ACC_S + o_part[:, None] * BLOCK_DV + o_dv[None, :]) * b_beta[:, None]
        m_g = m_new

    if HAS_SEG:
        # Rows whose mask kept no key attend to every key (eager's convention). Rare (a padding query),
        # so one program walks the whole cache for them rather than every split paying for it.
        m_full = m_q & (l_g == 0.0)
        if tl.max(m_full.to(tl.int32), 0) > 0:
            o_d = tl.arange(0, BLOCK_D)
            b_qt, b_qs = _load_split(Q + i_b * stride_qb + i_h * stride_qh, QT + i_bh.to(tl.int64) * Tq, o_m, m_q,
                                     stride_qt, o_d, D, BLOCK_D)
            qk_scale = tl.load(SCALE + i_h) * LOG2E
            slope = 0.0
            if HAS_ALIBI:
                slope = tl.load(SLOPES + i_h) * LOG2E
            acc_t, acc_s, acc_e, l_g, m_g = _attend_blocks(
                acc_t, acc_s, acc_e, l_g, m_g, b_qt, b_qs, o_m + (Tk - Tq), m_q, o_m, m_full,
                K + i_b * stride_kb + i_h * stride_kh, KT + i_bh.to(tl.int64) * Tk,
                V + i_b * stride_vb + i_h * stride_vh, E + i_bh.to(tl.int64) * Tk, K,
                stride_kt, stride_vt, 0, Tk, Tk, qk_scale, slope,
                D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, False, HAS_ALIBI, True, DOT_F32, PREC, SPLIT_V, CENTRED)

    l_safe = tl.where(l_g == 0.0, 1.0, l_g)
    b_ct, b_cs = _load_points(C + i_bh.to(tl.int64) * Tq * (1 + DV), o_m, m_q, 1 + DV, o_dv, DV, BLOCK_DV)
    b_dt = acc_t / l_safe
    b_ds = acc_s / l_safe[:, None]
    if not CENTRED:
        b_dt = b_dt - b_ct
        b_ds = b_ds - b_cs
    b_ot, b_os, b_n = _centroid_normalise(b_dt, b_ds, acc_e / l_safe, b_ct, b_cs, tl.load(KC))
    _store_points(OUT + i_b * stride_ob + i_h * stride_oh, b_ot, b_os, o_m, m_q, stride_ot, o_dv, DV, BLOCK_DV)


# --------------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def lorentz_attention_decode_fwd(p: Prepared) -> torch.Tensor:
    """Launch the split and combine kernels on prepared inputs (``Tq <= DECODE_BLOCK_M``). Returns ``O``."""
    q, k, v = p.q, p.k, p.v
    B, H, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3] - 1
    if Tq > DECODE_BLOCK_M:
        raise ValueError(f"the decoding kernel takes at most {DECODE_BLOCK_M} query rows, got {Tq}")
    dev = q.device
    n_chunks = triton.cdiv(Tk, SPLIT_KEYS)
    # Enough programs for about two waves over the GPU (4 splits in the interpreter), no empty split.
    target = 4 if INTERPRET or dev.type != "cuda" else triton.cdiv(2 * _num_sms(dev.index or 0), B * H)
    n_splits = max(1, min(n_chunks, target, 256))
    keys_per_split = triton.cdiv(n_chunks, n_splits) * SPLIT_KEYS
    n_splits = triton.cdiv(Tk, keys_per_split)

    BM, BDV = DECODE_BLOCK_M, block_d(DV)
    m_part = alloc((B * H, n_splits, BM), torch.float32, dev)
    l_part = alloc((B * H, n_splits, BM), torch.float32, dev)
    acc_t = alloc((B * H, n_splits, BM), torch.float32, dev)
    acc_s = alloc((B * H, n_splits, BM, BDV), torch.float32, dev)
    acc_e = alloc((B * H, n_splits, BM), torch.float32, dev)
    slopes, qid, kid, kc, e = launch_args(p)
    common = dict(D=D, DV=DV, BLOCK_M=BM, BLOCK_D=block_d(D), BLOCK_DV=BDV, HAS_SEG=p.qid is not None,
                  HAS_ALIBI=p.slopes is not None, DOT_F32=INTERPRET, PREC=dot_precision(q.dtype),
                  SPLIT_V=v.dtype == torch.float32)
    lorentz_attention_decode_split_kernel[(n_splits, B * H)](
        q, p.qt, k, p.kt, v, e, p.scale, slopes, qid, kid, m_part, l_part, acc_t, acc_s, acc_e,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], H, Tq, Tk, keys_per_split, n_splits,
        CAUSAL=p.causal, CENTRED=p.centred, **common,
    )
    o = alloc((B, H, Tq, 1 + DV), torch.float32, dev)
    lorentz_attention_decode_combine_kernel[(B * H,)](
        q, p.qt, k, p.kt, v, e, p.c, p.scale, slopes, kc, m_part, l_part, acc_t, acc_s, acc_e, o,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], H, Tq, Tk, n_splits,
        BLOCK_N=COMBINE_BLOCK_N, CENTRED=p.centred, num_warps=4, **common,
    )
    return o


# --------------------------------------------------------------------------------------------------
# Custom op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("helm::lorentz_attention_decode", mutates_args=())
def lorentz_attention_decode(q: torch.Tensor, qt: torch.Tensor, k: torch.Tensor, kt: torch.Tensor,
                             w: torch.Tensor, e: Optional[torch.Tensor], c: torch.Tensor, scale: torch.Tensor,
                             slopes: Optional[torch.Tensor], kc: torch.Tensor, qid: Optional[torch.Tensor],
                             kid: Optional[torch.Tensor], causal: bool, centred: bool) -> torch.Tensor:
    """Split-K forward on prepared inputs (arguments as ``helm::lorentz_attention_fwd``, ``Tq <= 16``); returns
    ``O [B, H, Tq, 1+dv]`` fp32. No autograd formula: decoding runs without gradients."""
    p = Prepared(q=q, qt=qt, k=k, kt=kt, v=w, e=e, c=c, scale=scale, slopes=slopes, kc=kc, qid=qid, kid=kid,
                 causal=causal, centred=centred)
    return lorentz_attention_decode_fwd(p)


@lorentz_attention_decode.register_fake
def _lorentz_attention_decode_fake(q, qt, k, kt, w, e, c, scale, slopes, kc, qid, kid, causal, centred):
    B, H, Tq, _ = q.shape
    return q.new_empty((B, H, Tq, w.shape[3]), dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------


def lorentz_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    k: Curv,
    tau: Tau,
    causal: bool = True,
    attention_mask: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    value_centre: Optional[torch.Tensor] = None,
    qk_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Lorentz attention for decoding: ``Tq <= 16`` query rows against ``Tk`` cached keys, forward only.

    Arguments, masks and result as :func:`helm.ops.lorentz_attention_triton.lorentz_flash_attention` (queries are the
    last ``Tq`` positions; ``query [B, H, Tq, 1+d]``, ``key [B, H, Tk, 1+d]``, ``value [B, H, Tk, 1+dv]``;
    fp16/bf16/fp32 in, fp32 ``[B, H, Tq, 1+dv]`` out; ``1 <= d, dv <= 256``). Raises ``ValueError`` for
    ``Tq > 16`` and ``RuntimeError`` when gradients are required (use ``lorentz_flash_attention``, which
    picks this kernel by itself when it applies).
    """
    p = prepare(query, key, value, k=k, tau=tau, causal=causal, attention_mask=attention_mask,
                segment_ids=segment_ids, alibi_slopes=alibi_slopes, value_centre=value_centre, qk_dtype=qk_dtype)
    if needs_grad(p):
        raise RuntimeError("lorentz_decode_attention is forward only; use lorentz_flash_attention for gradients")
    return lorentz_attention_decode(p.q, p.qt, p.k, p.kt, p.v, p.e, p.c, p.scale, p.slopes, p.kc, p.qid, p.kid,
                                    p.causal, p.centred)
