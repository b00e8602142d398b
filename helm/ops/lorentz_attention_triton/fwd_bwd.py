"""FlashAttention-style forward and backward of Lorentz (distance-based) attention.

Layout: kernels -> launchers -> custom ops ``helm::lorentz_attention_fwd`` / ``helm::lorentz_attention_bwd``
(``torch.library``, with fake implementations and the backward registered as the forward's autograd formula, so
``torch.compile`` traces around them) -> :func:`lorentz_flash_attention`. The maths is derived in this folder's
``README.md``; :mod:`.common` fixes the notation (``z``, ``P``, ``S``, ``O``).

* forward: one program per (block of ``BLOCK_M`` query rows, batch·head); online softmax over key blocks,
  causal blocks past the diagonal skipped, the Lorentz normalisation of ``S = c + D`` (pairwise form, see
  :mod:`.common`) fused into the epilogue. Saves ``D`` and ``E`` (fp32), the base-2 log-sum-exp and a per-row
  flag for rows whose mask kept no key.
* backward: a row-wise preprocess kernel differentiates the normalisation (``dO -> dD, dE``, ``δ = dD·D + dE E``,
  the curvature gradient), then one kernel per key block accumulates ``dK, dV`` and one per query block
  accumulates ``dQ`` and the per-row pieces of the ``τ`` and ALiBi-slope gradients; no atomics.
"""

from __future__ import annotations

from typing import Optional, Tuple

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
    _block_keep,
    _block_logits,
    _causal_free_end,
    _centroid_normalise,
    _document_span,
    _dot,
    _lorentz_sqnorm,
    _dot_v,
    _load_points,
    _load_split,
    _load_rows,
    _store_points,
    _store_rows,
    alloc,
    autotune_configs,
    block_d,
    dot_precision,
    launch_args,
    needs_grad,
    prepare,
    prune_configs,
)
from .decode import lorentz_attention_decode

__all__ = ["lorentz_flash_attention", "lorentz_attention_fwd", "lorentz_attention_bwd", "DECODE_MAX_Q"]

# Without gradients, at most this many query rows go to the split-K decoding kernel (:mod:`.decode`).
DECODE_MAX_Q = 16

# sm90 candidates (README.md, "Autotuning"); pruned per call by estimated shared memory and registers, one
# configuration under the interpreter. Keyed on the head dims, causality and (added by Triton) the input dtypes.
# The hand-picked blocks of earlier versions come first: HELM_TRITON_AUTOTUNE=0 takes the first that fits.
FWD_CONFIGS = autotune_configs(preferred=[(128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2), (64, 32, 8, 2)],
                               block_m=(64, 128), block_n=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4))
BWD_CONFIGS = autotune_configs(preferred=[(64, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2)],
                               block_m=(32, 64, 128), block_n=(32, 64, 128), warps=(4, 8), stages=(2, 3))
# The row-wise preprocess kernel of the backward reads O(Tq·dv) and is not tuned.
PRE_BLOCK_M = 64


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


@triton.autotune(configs=FWD_CONFIGS, key=["D", "DV", "CAUSAL"], cache_results=True,
                 prune_configs_by={"early_config_prune": prune_configs("fwd")})
@triton.jit
def lorentz_attention_fwd_kernel(
    Q, QT, K, KT, V, E, C, SCALE, SLOPES, KC, QID, KID, OUT, S, EBAR, LSE, FULL,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    H, Tq, Tk,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    HAS_ALIBI: tl.constexpr, STORE_S: tl.constexpr, CENTRED: tl.constexpr, DOT_F32: tl.constexpr,
    PREC: tl.constexpr, SPLIT_V: tl.constexpr,
):
    """Grid ``(cdiv(Tq, BLOCK_M), B*H)``. Reads the space parts of ``Q``, ``K`` (GEMM dtype) and their time
    coordinates ``QT [B*H, Tq]``, ``KT [B*H, Tk]`` (fp32), the centred values ``V`` (``w``, whose ``e`` it computes)
    and the row centres ``C [B*H, Tq, 1+DV]``; without ``CENTRED`` ``V`` holds the plain values ``v`` (a cache's) and
    ``E [B*H, Tk]`` their ``e_j = <v_j - c, v_j - c>_L`` for one centre ``c``, and the epilogue takes
    ``D = Σ P v - c``. Writes the
    output ``OUT [B, H, Tq, 1+DV]``; with ``STORE_S`` also ``S`` (the centred sums ``D``, same layout, fp32),
    ``EBAR [B*H, Tq]`` (``E``), ``LSE [B*H, Tq]`` (base 2) and ``FULL [B*H, Tq]`` (int8: the row attends to every
    key)."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    p_q = Q + i_b * stride_qb + i_h * stride_qh
    p_k = K + i_b * stride_kb + i_h * stride_kh
    p_v = V + i_b * stride_vb + i_h * stride_vh
    p_e = E + i_bh.to(tl.int64) * Tk
    p_kt = KT + i_bh.to(tl.int64) * Tk
    p_kid = KID + i_b * 3 * Tk

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_q = o_m < Tq
    pos_q = o_m + (Tk - Tq)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    b_qt, b_qs = _load_split(p_q, QT + i_bh.to(tl.int64) * Tq, o_m, m_q, stride_qt, o_d, D, BLOCK_D)
    qk_scale = tl.load(SCALE + i_h) * LOG2E
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + i_h) * LOG2E
    kc = tl.load(KC)
    b_qid = o_m
    if HAS_SEG:
        b_qid = tl.load(QID + i_b * Tq + o_m, mask=m_q, other=0)
    lo = 0
    hi = Tk
    if CAUSAL:
        # Key blocks past the last row's position are fully masked: never visited.
        hi = tl.minimum(Tk, Tk - Tq + (i_m + 1) * BLOCK_M)
    if HAS_SEG:
        # Nor are those outside the rows' documents (the fallback pass below visits every key).
        lo, hi = _document_span(p_kid, pos_q, m_q, Tk, 0, lo, hi, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_t = tl.zeros([BLOCK_M], tl.float32)
    acc_s = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    acc_e = tl.zeros([BLOCK_M], tl.float32)
    mid = _causal_free_end(Tk - Tq + i_m * BLOCK_M, lo, hi, CAUSAL, BLOCK_N)
    acc_t, acc_s, acc_e, l_i, m_i = _attend_blocks(
        acc_t, acc_s, acc_e, l_i, m_i, b_qt, b_qs, pos_q, m_q, b_qid, m_q, p_k, p_kt, p_v, p_e, p_kid, stride_kt,
        stride_vt, lo, mid, Tk, qk_scale, slope, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_SEG, HAS_ALIBI, False,
        DOT_F32, PREC, SPLIT_V, CENTRED)
    if CAUSAL:  # the diagonal blocks, with the causal mask
        acc_t, acc_s, acc_e, l_i, m_i = _attend_blocks(
            acc_t, acc_s, acc_e, l_i, m_i, b_qt, b_qs, pos_q, m_q, b_qid, m_q, p_k, p_kt, p_v, p_e, p_kid, stride_kt,
            stride_vt, mid, hi, Tk, qk_scale, slope, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_SEG, HAS_ALIBI,
            False, DOT_F32, PREC, SPLIT_V, CENTRED)
    # Only padding can leave a row with no key (its own position is kept otherwise). Such rows attend to
    # every key, as build_attention_mask specifies; they start from l = 0, acc = 0, so one more pass suffices.
    m_full = m_q & (l_i == 0.0)
    if HAS_SEG:
        if tl.max(m_full.to(tl.int32), 0) > 0:
            acc_t, acc_s, acc_e, l_i, m_i = _attend_blocks(
                acc_t, acc_s, acc_e, l_i, m_i, b_qt, b_qs, pos_q, m_q, b_qid, m_full, p_k, p_kt, p_v, p_e, p_kid,
                stride_kt, stride_vt, 0, Tk, Tk, qk_scale, slope, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, HAS_SEG,
                HAS_ALIBI, True, DOT_F32, PREC, SPLIT_V, CENTRED)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # rows past Tq only
    b_st = acc_t / l_safe
    b_ss = acc_s / l_safe[:, None]
    b_e = acc_e / l_safe
    b_ct, b_cs = _load_points(C + i_bh.to(tl.int64) * Tq * (1 + DV), o_m, m_q, 1 + DV, o_dv, DV, BLOCK_DV)
    b_cs = b_cs.to(tl.float32)
    if not CENTRED:
        b_st = b_st - b_ct
        b_ss = b_ss - b_cs
    b_ot, b_os, b_n = _centroid_normalise(b_st, b_ss, b_e, b_ct, b_cs, kc)
    off_o = i_b * stride_ob + i_h * stride_oh
    _store_points(OUT + off_o, b_ot, b_os, o_m, m_q, stride_ot, o_dv, DV, BLOCK_DV)
    if STORE_S:
        _store_points(S + off_o, b_st, b_ss, o_m, m_q, stride_ot, o_dv, DV, BLOCK_DV)
        tl.store(EBAR + i_bh * Tq + o_m, b_e, mask=m_q)
        tl.store(LSE + i_bh * Tq + o_m, m_i + tl.log2(l_safe), mask=m_q)
        tl.store(FULL + i_bh * Tq + o_m, m_full.to(tl.int8), mask=m_q)


@triton.jit
def lorentz_attention_bwd_preprocess_kernel(
    S, EBAR, C, DO, KC, DS_T, DS_S, DE, DELTA, DKC,
    stride_sb, stride_sh, stride_st, stride_dob, stride_doh, stride_dot,
    H, Tq,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Backward of the normalisation epilogue, row-wise. Grid ``(cdiv(Tq, BLOCK_M), B*H)``.

    From the centred sums ``D`` (in ``S``), ``E`` (``EBAR``), the row centres ``C`` and ``dO`` writes ``dD`` (time
    ``DS_T [B*H, Tq]`` fp32, space ``DS_S [B*H, Tq, DV]`` in the dtype the attention kernels multiply with),
    ``dE`` (``DE [B*H, Tq]``), ``DELTA = dD·D + dE E [B*H, Tq]`` and the per-row curvature gradient ``DKC``.
    """
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_q = o_m < Tq
    o_dv = tl.arange(0, BLOCK_DV)
    b_st, b_ss = _load_points(S + i_b * stride_sb + i_h * stride_sh, o_m, m_q, stride_st, o_dv, DV, BLOCK_DV)
    b_dot, b_dos = _load_points(DO + i_b * stride_dob + i_h * stride_doh, o_m, m_q, stride_dot, o_dv, DV,
                                BLOCK_DV)
    b_ct, b_cs = _load_points(C + i_bh.to(tl.int64) * Tq * (1 + DV), o_m, m_q, 1 + DV, o_dv, DV, BLOCK_DV)
    b_e = tl.load(EBAR + i_bh * Tq + o_m, mask=m_q, other=0.0)
    b_dos = b_dos.to(tl.float32)
    kc = tl.load(KC)

    # Forward again: N = k + (E - <D,D>_L), n = max(N, k/2), a = sqrt(k/n), O_s = a (c_s + D_s), O_t = sqrt(|O_s|^2 + k).
    b_ot, b_os, b_nraw = _centroid_normalise(b_st, b_ss, b_e, b_ct, b_cs, kc)
    # Whether n follows N: the exact N >= k (a row with one key attains it); the floor k/2 binds only for
    # off-manifold values, and then, as in eager, n = k/2 is constant.
    m_free = b_nraw >= 0.5 * kc
    b_n = tl.maximum(b_nraw, 0.5 * kc)
    b_a = tl.sqrt(kc) / tl.sqrt(b_n)
    # Through lift: the time output feeds back into the space output.
    b_gs = b_dos + (b_dot / b_ot)[:, None] * b_os
    b_ga = tl.sum(b_gs * (b_ss + b_cs), 1)
    # Through n:  dN = -ga a / (2n);  dN/dE = 1,  dN/dD = -2 J D.
    b_dn = tl.where(m_free, -0.5 * b_ga * b_a / b_n, 0.0)
    b_dst = 2.0 * b_dn * b_st
    b_dss = b_gs * b_a[:, None] - (2.0 * b_dn)[:, None] * b_ss
    # D must match the dP the attention kernels form from the rounded dD, so round first.
    b_dss = b_dss.to(DS_S.dtype.element_ty)
    b_delta = b_dst * b_st + tl.sum(b_dss.to(tl.float32) * b_ss, 1) + b_dn * b_e
    # dO/dk: a = sqrt(k/n) with n = N(k) = ... + k while free (with the floor, a = sqrt(2)), and O_t has +k.
    b_dkc = tl.where(m_free, 0.5 * b_ga * b_a / kc + b_dn, 0.0) + 0.5 * b_dot / b_ot

    o_row = i_bh * Tq + o_m
    tl.store(DS_T + o_row, b_dst, mask=m_q)
    p_dss = DS_S + o_row.to(tl.int64)[:, None] * DV + o_dv[None, :]
    tl.store(p_dss, b_dss, mask=m_q[:, None] & (o_dv[None, :] < DV))
    tl.store(DE + o_row, b_dn, mask=m_q)
    tl.store(DELTA + o_row, b_delta, mask=m_q)
    tl.store(DKC + o_row, b_dkc, mask=m_q)


@triton.jit
def _bwd_kv_rows(dk_t, dk_s, dv_t, dv_s, de, b_kt, b_ks, b_vt, b_vs, b_e, o_n, m_n, b_kid,
                 p_q, p_qt, p_qid, p_dst, p_dss, p_de, p_lse, p_delta, p_full, stride_qt, lo, hi, Tq, Tk, qk_scale,
                 slope, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, FULL_ONLY: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                 SPLIT_V: tl.constexpr):
    """``dK, dV`` of one key block from the query rows starting in ``[lo, hi)``, in transposed layout
    (``[BLOCK_N, BLOCK_M]`` tiles) so no product needs a transposed probability tile.
    ``FULL_ONLY``: only rows whose mask kept nothing (they attend to every key)."""
    o_m0 = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for m0 in range(lo, hi, BLOCK_M):
        o_m = m0 + o_m0
        m_q = o_m < Tq
        pos_q = o_m + (Tk - Tq)
        b_qt, b_qs = _load_split(p_q, p_qt, o_m, m_q, stride_qt, o_d, D, BLOCK_D)
        b_dst = tl.load(p_dst + o_m, mask=m_q, other=0.0)
        b_dss = _load_rows(p_dss, o_m, m_q, DV, o_dv, DV, BLOCK_DV)
        b_de = tl.load(p_de + o_m, mask=m_q, other=0.0)
        b_lse = tl.load(p_lse + o_m, mask=m_q, other=float("inf"))
        b_delta = tl.load(p_delta + o_m, mask=m_q, other=0.0)

        b_qkT = _dot(b_ks, tl.trans(b_qs), DOT_F32, PREC) - b_kt[:, None] * b_qt[None, :]
        b_sT = b_qkT * qk_scale
        if HAS_ALIBI:
            b_sT += slope * (o_n[:, None] - pos_q[None, :]).to(tl.float32)
        if FULL_ONLY:
            b_full = tl.load(p_full + o_m, mask=m_q, other=0) != 0
            m_s = m_n[:, None] & b_full[None, :]
        else:
            m_s = m_n[:, None] & m_q[None, :]
            if CAUSAL:
                m_s = m_s & (o_n[:, None] <= pos_q[None, :])
            if HAS_SEG:
                b_qid = tl.load(p_qid + o_m, mask=m_q, other=0)
                b_full = tl.load(p_full + o_m, mask=m_q, other=0) != 0
                m_s = (m_s & (b_kid[:, None] == b_qid[None, :])) | (m_n[:, None] & b_full[None, :])
        # Masked entries go to -inf before exp2: P = 0 without an overflowing intermediate.
        b_pT = tl.exp2(tl.where(m_s, b_sT, float("-inf")) - b_lse[None, :])

        dv_t += tl.sum(b_pT * b_dst[None, :], 1)
        dv_s += _dot_v(b_pT.to(b_dss.dtype), b_dss, DOT_F32, SPLIT_V)
        de += tl.sum(b_pT * b_de[None, :], 1)
        # dP_ij = dD_i · w_j + dE_i e_j (Euclidean: D and E are plain weighted sums of w and e).
        b_dpT = _dot_v(b_vs, tl.trans(b_dss), DOT_F32, SPLIT_V) + b_vt[:, None] * b_dst[None, :] + \
            b_e[:, None] * b_de[None, :]
        b_dzT = b_pT * (b_dpT - b_delta[None, :])
        dk_t += tl.sum(b_dzT * b_qt[None, :], 1)
        dk_s += _dot(b_dzT.to(b_qs.dtype), b_qs, DOT_F32, PREC)
    return dk_t, dk_s, dv_t, dv_s, de


@triton.autotune(configs=BWD_CONFIGS, key=["D", "DV", "CAUSAL"], cache_results=True,
                 prune_configs_by={"early_config_prune": prune_configs("dkdv")})
@triton.jit
def lorentz_attention_bwd_dkdv_kernel(
    Q, QT, K, KT, V, SCALE, SLOPES, QID, KID, DS_T, DS_S, DE, LSE, DELTA, FULL, DK, DKT, DV_,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    H, Tq, Tk,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, SPLIT_V: tl.constexpr,
):
    """Grid ``(cdiv(Tk, BLOCK_N), B*H)``: ``dK = c J Σ_i dz_ij q_i`` (space part into ``DK [B, H, Tk, D]``, time
    part into ``DKT [B*H, Tk]`` fp32) and ``dW = Σ_i P_ij dD_i + 2 J w_j de_j`` with ``de_j = Σ_i P_ij dE_i``
    (through ``e_j = <w_j, w_j>_L``, computed here from the loaded ``w_j``) for one key block."""
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < Tk
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    b_kt, b_ks = _load_split(K + i_b * stride_kb + i_h * stride_kh, KT + i_bh.to(tl.int64) * Tk, o_n, m_n, stride_kt,
                             o_d, D, BLOCK_D)
    b_vt, b_vs = _load_points(V + i_b * stride_vb + i_h * stride_vh, o_n, m_n, stride_vt, o_dv, DV, BLOCK_DV)
    b_e = _lorentz_sqnorm(b_vt, b_vs)
    b_kid = o_n
    p_kid = KID + i_b * 3 * Tk
    if HAS_SEG:
        b_kid = tl.load(p_kid + o_n, mask=m_n, other=-1)
    c = tl.load(SCALE + i_h)
    qk_scale = c * LOG2E
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + i_h) * LOG2E
    p_q = Q + i_b * stride_qb + i_h * stride_qh
    p_qid = QID + i_b * Tq
    p_row = i_bh.to(tl.int64) * Tq
    p_qt = QT + p_row
    p_dss = DS_S + p_row * DV

    dk_t = tl.zeros([BLOCK_N], tl.float32)
    dk_s = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv_t = tl.zeros([BLOCK_N], tl.float32)
    dv_s = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    de = tl.zeros([BLOCK_N], tl.float32)
    lo = 0
    hi = Tq
    if CAUSAL:
        # Query rows before this key block's first position cannot see it (causally).
        lo = (tl.maximum(i_n * BLOCK_N - (Tk - Tq), 0) // BLOCK_M) * BLOCK_M
    if HAS_SEG:
        # Nor can rows outside the documents of its keys (padding keys belong to none).
        lo, hi = _document_span(p_kid, o_n, m_n & (b_kid >= 0), Tk, Tk - Tq, lo, hi, BLOCK_M)
    # Query blocks wholly at or after this key block's last position need no causal mask: a second loop without it.
    mid = lo
    if CAUSAL:
        mid = tl.maximum(lo, tl.minimum(hi, tl.cdiv(tl.maximum((i_n + 1) * BLOCK_N - 1 - (Tk - Tq), 0), BLOCK_M)
                                        * BLOCK_M))
        dk_t, dk_s, dv_t, dv_s, de = _bwd_kv_rows(
            dk_t, dk_s, dv_t, dv_s, de, b_kt, b_ks, b_vt, b_vs, b_e, o_n, m_n, b_kid, p_q, p_qt, p_qid, DS_T + p_row,
            p_dss, DE + p_row, LSE + p_row, DELTA + p_row, FULL + p_row, stride_qt, lo, mid, Tq, Tk, qk_scale, slope,
            D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, True, HAS_SEG, HAS_ALIBI, False, DOT_F32, PREC, SPLIT_V)
    dk_t, dk_s, dv_t, dv_s, de = _bwd_kv_rows(
        dk_t, dk_s, dv_t, dv_s, de, b_kt, b_ks, b_vt, b_vs, b_e, o_n, m_n, b_kid, p_q, p_qt, p_qid, DS_T + p_row,
        p_dss, DE + p_row, LSE + p_row, DELTA + p_row, FULL + p_row, stride_qt, mid, hi, Tq, Tk,
        qk_scale, slope, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, False, HAS_SEG, HAS_ALIBI, False, DOT_F32, PREC, SPLIT_V)
    if HAS_SEG:
        # ... unless their mask kept nothing: such rows attend to every key, future ones included. The blocks of
        # rows before and after those the first pass visited (it gave such rows every key of this block).
        o_m0 = tl.arange(0, BLOCK_M)
        for m0 in range(0, Tq, BLOCK_M):
            if (m0 < lo) | (m0 >= hi):
                b_full = tl.load(FULL + p_row + m0 + o_m0, mask=m0 + o_m0 < Tq, other=0)
                if tl.max(b_full.to(tl.int32), 0) > 0:
                    dk_t, dk_s, dv_t, dv_s, de = _bwd_kv_rows(
                        dk_t, dk_s, dv_t, dv_s, de, b_kt, b_ks, b_vt, b_vs, b_e, o_n, m_n, b_kid, p_q, p_qt, p_qid,
                        DS_T + p_row, p_dss, DE + p_row, LSE + p_row, DELTA + p_row, FULL + p_row, stride_qt, m0,
                        m0 + BLOCK_M, Tq, Tk, qk_scale, slope, D, DV, BLOCK_M, BLOCK_D, BLOCK_DV, CAUSAL, HAS_SEG,
                        HAS_ALIBI, True, DOT_F32, PREC, SPLIT_V)

    # z = c (-q_t k_t + q_s·k_s): dK_t carries the Minkowski sign; it goes to the fp32 time input.
    _store_rows(DK + i_b * stride_dkb + i_h * stride_dkh, c * dk_s, o_n, m_n, stride_dkt, o_d, D, BLOCK_D)
    tl.store(DKT + i_bh.to(tl.int64) * Tk + o_n, -c * dk_t, mask=m_n)
    # e_j = -w_t² + |w_s|²: de_j adds -2 w_t de_j to the time coordinate, 2 w_s de_j to the space part.
    dv_t += -2.0 * b_vt * de
    dv_s += 2.0 * b_vs.to(tl.float32) * de[:, None]
    _store_points(DV_ + i_b * stride_dvb + i_h * stride_dvh, dv_t, dv_s, o_n, m_n, stride_dvt, o_dv, DV,
                  BLOCK_DV)


@triton.jit
def _bwd_q_blocks(dq_t, dq_s, b_dsc, b_dsl, b_qt, b_qs, b_dst, b_dss, b_de, b_lse, b_delta, b_qid, b_full, pos_q, m_q,
                  p_k, p_kt, p_v, p_kid, stride_kt, stride_vt, lo, hi, Tk, qk_scale, slope,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, FULL_ONLY: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                  SPLIT_V: tl.constexpr):
    """``dQ`` of one query block from the key blocks starting in ``[lo, hi)``, plus per-row
    ``Σ_j dz_ij <q_i, k_j>_L`` (for ``dτ``) and ``Σ_j dz_ij (j - pos_i)`` (for the ALiBi slope)."""
    o_n0 = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + o_n0
        m_n = o_n < Tk
        b_kt, b_ks = _load_split(p_k, p_kt, o_n, m_n, stride_kt, o_d, D, BLOCK_D)
        b_vt, b_vs = _load_points(p_v, o_n, m_n, stride_vt, o_dv, DV, BLOCK_DV)
        b_e = _lorentz_sqnorm(b_vt, b_vs)
        b_qk, b_s = _block_logits(b_qt, b_qs, b_kt, b_ks, o_n, pos_q, qk_scale, slope, HAS_ALIBI, DOT_F32, PREC)
        if FULL_ONLY:
            m_s = b_full[:, None] & m_n[None, :]
        else:
            m_s = _block_keep(m_q, m_n, o_n, pos_q, b_qid, p_kid, CAUSAL, HAS_SEG)
            if HAS_SEG:
                m_s = m_s | (b_full[:, None] & m_n[None, :])
        b_p = tl.exp2(tl.where(m_s, b_s, float("-inf")) - b_lse[:, None])
        b_dp = _dot_v(b_dss, tl.trans(b_vs), DOT_F32, SPLIT_V) + b_dst[:, None] * b_vt[None, :] + \
            b_de[:, None] * b_e[None, :]
        b_dz = b_p * (b_dp - b_delta[:, None])
        dq_t += tl.sum(b_dz * b_kt[None, :], 1)
        dq_s += _dot(b_dz.to(b_ks.dtype), b_ks, DOT_F32, PREC)
        b_dsc += tl.sum(b_dz * b_qk, 1)
        if HAS_ALIBI:
            b_dsl += tl.sum(b_dz * (o_n[None, :] - pos_q[:, None]).to(tl.float32), 1)
    return dq_t, dq_s, b_dsc, b_dsl


@triton.autotune(configs=BWD_CONFIGS, key=["D", "DV", "CAUSAL"], cache_results=True,
                 prune_configs_by={"early_config_prune": prune_configs("dq")})
@triton.jit
def lorentz_attention_bwd_dq_kernel(
    Q, QT, K, KT, V, SCALE, SLOPES, QID, KID, DS_T, DS_S, DE, LSE, DELTA, FULL, DQ, DQT, DSCALE, DSLOPE,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dqb, stride_dqh, stride_dqt,
    H, Tq, Tk,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, SPLIT_V: tl.constexpr,
):
    """Grid ``(cdiv(Tq, BLOCK_M), B*H)``: ``dQ = c J Σ_j dz_ij k_j`` (space part into ``DQ [B, H, Tq, D]``, time
    part into ``DQT [B*H, Tq]`` fp32); per-row ``dc`` and ALiBi-slope pieces
    into ``DSCALE, DSLOPE [B*H, Tq]`` (summed on the host)."""
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = (i_bh // H).to(tl.int64)
    i_h = i_bh % H
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_q = o_m < Tq
    pos_q = o_m + (Tk - Tq)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    p_row = i_bh.to(tl.int64) * Tq
    b_qt, b_qs = _load_split(Q + i_b * stride_qb + i_h * stride_qh, QT + p_row, o_m, m_q, stride_qt, o_d, D, BLOCK_D)
    b_dst = tl.load(DS_T + p_row + o_m, mask=m_q, other=0.0)
    b_dss = _load_rows(DS_S + p_row * DV, o_m, m_q, DV, o_dv, DV, BLOCK_DV)
    b_de = tl.load(DE + p_row + o_m, mask=m_q, other=0.0)
    b_lse = tl.load(LSE + p_row + o_m, mask=m_q, other=float("inf"))
    b_delta = tl.load(DELTA + p_row + o_m, mask=m_q, other=0.0)
    b_qid = o_m
    b_full = o_m < 0  # no row attends to every key unless padding says so
    if HAS_SEG:
        b_qid = tl.load(QID + i_b * Tq + o_m, mask=m_q, other=0)
        b_full = tl.load(FULL + p_row + o_m, mask=m_q, other=0) != 0
    c = tl.load(SCALE + i_h)
    qk_scale = c * LOG2E
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + i_h) * LOG2E
    p_k = K + i_b * stride_kb + i_h * stride_kh
    p_v = V + i_b * stride_vb + i_h * stride_vh
    p_kt = KT + i_bh.to(tl.int64) * Tk
    p_kid = KID + i_b * 3 * Tk
    lo = 0
    hi = Tk
    if CAUSAL:
        hi = tl.minimum(Tk, Tk - Tq + (i_m + 1) * BLOCK_M)
    any_full = tl.max(b_full.to(tl.int32), 0) > 0
    if HAS_SEG:
        lo, hi = _document_span(p_kid, pos_q, m_q, Tk, 0, lo, hi, BLOCK_N)
        if any_full:  # the first pass gives such rows every key of the blocks it visits, from the first
            lo = 0

    dq_t = tl.zeros([BLOCK_M], tl.float32)
    dq_s = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    b_dsc = tl.zeros([BLOCK_M], tl.float32)
    b_dsl = tl.zeros([BLOCK_M], tl.float32)
    mid = _causal_free_end(Tk - Tq + i_m * BLOCK_M, lo, hi, CAUSAL, BLOCK_N)
    dq_t, dq_s, b_dsc, b_dsl = _bwd_q_blocks(
        dq_t, dq_s, b_dsc, b_dsl, b_qt, b_qs, b_dst, b_dss, b_de, b_lse, b_delta, b_qid, b_full, pos_q, m_q,
        p_k, p_kt, p_v, p_kid, stride_kt, stride_vt, lo, mid, Tk, qk_scale, slope,
        D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, False, HAS_SEG, HAS_ALIBI, False, DOT_F32, PREC, SPLIT_V)
    if CAUSAL:  # the diagonal blocks, with the causal mask
        dq_t, dq_s, b_dsc, b_dsl = _bwd_q_blocks(
            dq_t, dq_s, b_dsc, b_dsl, b_qt, b_qs, b_dst, b_dss, b_de, b_lse, b_delta, b_qid, b_full, pos_q, m_q,
            p_k, p_kt, p_v, p_kid, stride_kt, stride_vt, mid, hi, Tk, qk_scale, slope,
            D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, True, HAS_SEG, HAS_ALIBI, False, DOT_F32, PREC, SPLIT_V)
    if HAS_SEG:
        # Rows whose mask kept nothing also attend to the keys past the causal horizon and the rows' documents:
        # those after the last key block of the first pass, which already gave such rows every key of the blocks it
        # visited.
        if any_full:
            dq_t, dq_s, b_dsc, b_dsl = _bwd_q_blocks(
                dq_t, dq_s, b_dsc, b_dsl, b_qt, b_qs, b_dst, b_dss, b_de, b_lse, b_delta, b_qid, b_full, pos_q,
                m_q, p_k, p_kt, p_v, p_kid, stride_kt, stride_vt, tl.cdiv(hi, BLOCK_N) * BLOCK_N, Tk, Tk,
                qk_scale, slope,
                D, DV, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, HAS_SEG, HAS_ALIBI, True, DOT_F32, PREC, SPLIT_V)

    _store_rows(DQ + i_b * stride_dqb + i_h * stride_dqh, c * dq_s, o_m, m_q, stride_dqt, o_d, D, BLOCK_D)
    tl.store(DQT + p_row + o_m, -c * dq_t, mask=m_q)
    tl.store(DSCALE + p_row + o_m, b_dsc, mask=m_q)
    if HAS_ALIBI:
        tl.store(DSLOPE + p_row + o_m, b_dsl, mask=m_q)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _launch_fwd(p: Prepared, store_s: bool):
    """Launch the forward kernel. Returns ``(O, S, EBAR, LSE, FULL)``; the last four are None unless ``store_s``."""
    q, k, v = p.q, p.k, p.v
    B, H, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3] - 1
    o = alloc((B, H, Tq, 1 + DV), OUT_DTYPE, q.device)
    s = ebar = lse = full = None
    if store_s:
        s = alloc((B, H, Tq, 1 + DV), torch.float32, q.device)
        ebar = alloc((B * H, Tq), torch.float32, q.device)
        lse = alloc((B * H, Tq), torch.float32, q.device)
        full = alloc((B * H, Tq), torch.int8, q.device)
    slopes, qid, kid, kc, e = launch_args(p)

    def grid(meta):
        return triton.cdiv(Tq, meta["BLOCK_M"]), B * H

    lorentz_attention_fwd_kernel[grid](
        q, p.qt, k, p.kt, v, e, p.c, p.scale, slopes, kc, qid, kid, o, s if store_s else o, ebar if store_s else kc,
        lse if store_s else kc, full if store_s else kc,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        H, Tq, Tk,
        D=D, DV=DV, BLOCK_D=block_d(D), BLOCK_DV=block_d(DV), CAUSAL=p.causal,
        HAS_SEG=p.qid is not None, HAS_ALIBI=p.slopes is not None, STORE_S=store_s, CENTRED=p.centred,
        DOT_F32=INTERPRET, PREC=dot_precision(q.dtype), SPLIT_V=v.dtype == torch.float32,
    )
    return o, s, ebar, lse, full


def _launch_bwd(p: Prepared, s, ebar, lse, full, do):
    """Launch the three backward kernels. Returns ``(dq, dqt, dk, dkt, dw, dscale [H], dslopes [H] | None,
    dkc [1])``."""
    q, k, v = p.q, p.k, p.v
    B, H, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3] - 1
    dev = q.device
    if do.stride(-1) != 1:
        do = do.contiguous()
    ds_dtype = v.dtype  # dS_s only ever multiplies v (and P cast to its dtype)
    ds_t = alloc((B * H, Tq), torch.float32, dev)
    ds_s = alloc((B * H, Tq, DV), ds_dtype, dev)
    de_row = alloc((B * H, Tq), torch.float32, dev)
    delta = alloc((B * H, Tq), torch.float32, dev)
    dkc_row = alloc((B * H, Tq), torch.float32, dev)
    lorentz_attention_bwd_preprocess_kernel[(triton.cdiv(Tq, PRE_BLOCK_M), B * H)](
        s, ebar, p.c, do, p.kc, ds_t, ds_s, de_row, delta, dkc_row, *s.stride()[:3], *do.stride()[:3], H, Tq,
        DV=DV, BLOCK_M=PRE_BLOCK_M, BLOCK_DV=block_d(DV), num_warps=4,
    )
    slopes, qid, kid, _, _ = launch_args(p)
    flags = dict(D=D, DV=DV, BLOCK_D=block_d(D), BLOCK_DV=block_d(DV), CAUSAL=p.causal,
                 HAS_SEG=p.qid is not None, HAS_ALIBI=p.slopes is not None, DOT_F32=INTERPRET,
                 PREC=dot_precision(q.dtype), SPLIT_V=v.dtype == torch.float32)
    dk = alloc(k.shape, k.dtype, dev)
    dkt = alloc((B * H, Tk), torch.float32, dev)
    dv = alloc(v.shape, v.dtype, dev)

    def grid_kv(meta):
        return triton.cdiv(Tk, meta["BLOCK_N"]), B * H

    lorentz_attention_bwd_dkdv_kernel[grid_kv](
        q, p.qt, k, p.kt, v, p.scale, slopes, qid, kid, ds_t, ds_s, de_row, lse, delta, full, dk, dkt, dv,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], H, Tq, Tk, **flags,
    )
    dq = alloc(q.shape, q.dtype, dev)
    dqt = alloc((B * H, Tq), torch.float32, dev)
    dscale_row = alloc((B * H, Tq), torch.float32, dev)
    dslope_row = alloc((B * H, Tq), torch.float32, dev) if p.slopes is not None else dscale_row

    def grid_q(meta):
        return triton.cdiv(Tq, meta["BLOCK_M"]), B * H

    lorentz_attention_bwd_dq_kernel[grid_q](
        q, p.qt, k, p.kt, v, p.scale, slopes, qid, kid, ds_t, ds_s, de_row, lse, delta, full, dq, dqt,
        dscale_row, dslope_row,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dq.stride()[:3], H, Tq, Tk, **flags,
    )
    dscale = dscale_row.view(B, H, Tq).sum(dim=(0, 2))
    dslopes = dslope_row.view(B, H, Tq).sum(dim=(0, 2)) if p.slopes is not None else None
    return dq, dqt, dk, dkt, dv, dscale, dslopes, dkc_row.sum().reshape(1)


# --------------------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------------------

# The output is a point between layers: the statistics dtype of helm.precision (fp32) for every input dtype.
OUT_DTYPE = torch.float32
T = torch.Tensor


@torch.library.custom_op("helm::lorentz_attention_fwd", mutates_args=())
def lorentz_attention_fwd(q: T, qt: T, k: T, kt: T, w: T, e: Optional[T], c: T, scale: T, slopes: Optional[T], kc: T,
                          qid: Optional[T], kid: Optional[T], causal: bool, centred: bool,
                          store_stats: bool) -> Tuple[T, T, T, T, T]:
    """Forward kernel on prepared inputs (:func:`~.common.prepare`): the space parts ``q [B, H, Tq, d]``,
    ``k [B, H, Tk, d]`` in the GEMM dtype (unit last stride) with their time coordinates ``qt [B*H, Tq]``,
    ``kt [B*H, Tk]`` fp32, centred values ``w [B, H, Tk, 1+dv]`` (unit last stride; the kernels compute their
    ``e_j = <w_j, w_j>_L``), row centres ``c [B, H, Tq, 1+dv]``, ``scale = 2/τ [H]``, ``slopes [H]`` or None,
    ``kc [1]`` (fp32), ids ``qid [B, Tq]``, ``kid [B, 3, Tk]`` (int32) or None. ``centred=False``: ``w`` holds plain values and ``e``
    ``[B, H, Tk]`` their norms about one centre ``c`` (a cache's, forward only); ``e`` is None otherwise.

    Returns ``(O, S, EBAR, LSE, FULL)``: ``O [B, H, Tq, 1+dv]`` fp32 and, with ``store_stats``, what the backward
    reads: the centred sums ``S = D [B, H, Tq, 1+dv]``, ``EBAR = E``, base-2 ``LSE`` ``[B*H, Tq]`` fp32 and the
    rows-attending-to-every-key flag ``FULL [B*H, Tq]`` int8; without, four empty tensors (a custom op returns
    tensors, not None)."""
    p = Prepared(q=q, qt=qt, k=k, kt=kt, v=w, e=e, c=c, scale=scale, slopes=slopes, kc=kc, qid=qid, kid=kid,
                 causal=causal, centred=centred)
    o, s, ebar, lse, full = _launch_fwd(p, store_s=store_stats)
    if not store_stats:
        return o, o.new_empty(0), o.new_empty(0), o.new_empty(0), o.new_empty(0, dtype=torch.int8)
    return o, s, ebar, lse, full


@lorentz_attention_fwd.register_fake
def _lorentz_attention_fwd_fake(q, qt, k, kt, w, e, c, scale, slopes, kc, qid, kid, causal, centred, store_stats):
    B, H, Tq, _ = q.shape
    o = q.new_empty((B, H, Tq, w.shape[3]), dtype=OUT_DTYPE)
    if not store_stats:
        empty = [q.new_empty(0, dtype=torch.float32) for _ in range(3)]
        return o, *empty, q.new_empty(0, dtype=torch.int8)
    rows = (B * H, Tq)
    return (o, torch.empty_like(o, dtype=torch.float32), q.new_empty(rows, dtype=torch.float32),
            q.new_empty(rows, dtype=torch.float32), q.new_empty(rows, dtype=torch.int8))


@torch.library.custom_op("helm::lorentz_attention_bwd", mutates_args=())
def lorentz_attention_bwd(q: T, qt: T, k: T, kt: T, w: T, c: T, scale: T, slopes: Optional[T], kc: T,
                          qid: Optional[T], kid: Optional[T], s: T, ebar: T, lse: T, full: T, do: T,
                          causal: bool) -> Tuple[T, T, T, T, T, T, T, T]:
    """Backward kernels: inputs of :func:`lorentz_attention_fwd` (centred, so without ``e``), its saved ``S, EBAR, LSE,
    FULL`` and ``dO`` ``[B, H, Tq, 1+dv]``. Returns ``(dq, dqt, dk, dkt, dw, dscale [H], dslopes [H], dkc [1])``:
    ``dq, dk, dw`` contiguous in the dtypes of ``q, k, w`` (space parts: the time gradients are ``dqt, dkt``; ``dw``
    includes what reaches ``w`` through ``e``); the rest fp32; ``dslopes`` zeros without slopes."""
    p = Prepared(q=q, qt=qt, k=k, kt=kt, v=w, e=None, c=c, scale=scale, slopes=slopes, kc=kc, qid=qid, kid=kid,
                 causal=causal, centred=True)
    dq, dqt, dk, dkt, dw, dscale, dslopes, dkc = _launch_bwd(p, s, ebar, lse, full, do)
    if dslopes is None:
        dslopes = torch.zeros_like(dscale)
    return dq, dqt, dk, dkt, dw, dscale, dslopes, dkc


@lorentz_attention_bwd.register_fake
def _lorentz_attention_bwd_fake(q, qt, k, kt, w, c, scale, slopes, kc, qid, kid, s, ebar, lse, full, do, causal):
    H = q.shape[1]
    return (q.new_empty(q.shape), torch.empty_like(qt, dtype=torch.float32), k.new_empty(k.shape),
            torch.empty_like(kt, dtype=torch.float32), w.new_empty(w.shape), q.new_empty((H,), dtype=torch.float32),
            q.new_empty((H,), dtype=torch.float32), q.new_empty((1,), dtype=torch.float32))


def _fwd_setup_context(ctx, inputs, output):
    q, qt, k, kt, w, e, c, scale, slopes, kc, qid, kid, causal, centred, store_stats = inputs
    o, s, ebar, lse, full = output
    if not (store_stats and centred):
        raise RuntimeError("helm::lorentz_attention_fwd is differentiable only with centred=True, store_stats=True")
    ctx.save_for_backward(q, qt, k, kt, w, c, scale, slopes, kc, qid, kid, s, ebar, lse, full)
    ctx.causal = causal
    ctx.has_slopes = slopes is not None
    ctx.mark_non_differentiable(s, ebar, lse, full)


def _fwd_backward(ctx, do, *_stats):
    """Gradients of ``q, k`` (space parts) and their time coordinates ``qt, kt``, the centred values ``w`` (all made
    from the inputs in torch by :func:`~.common.prepare`, so autograd carries them back to the query, key and value
    points), ``scale = 2/τ``, the ALiBi slopes and ``kc``; ``e`` is None (centred), the row centres ``c`` constants
    (detached), the ids integers."""
    q, qt, k, kt, w, c, scale, slopes, kc, qid, kid, s, ebar, lse, full = ctx.saved_tensors
    dq, dqt, dk, dkt, dw, dscale, dslopes, dkc = lorentz_attention_bwd(
        q, qt, k, kt, w, c, scale, slopes, kc, qid, kid, s, ebar, lse, full, do, ctx.causal)
    return (dq, dqt, dk, dkt, dw, None, None, dscale, dslopes if ctx.has_slopes else None, dkc, None, None, None,
            None, None)


lorentz_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# --------------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------------


def lorentz_flash_attention(
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
    groups=None,
    key_time: Optional[torch.Tensor] = None,
    ids=None,
) -> torch.Tensor:
    """Fused Lorentz attention (HELM Eq. 3): ``O_i = centroid({v_j}, softmax_j(-d²(q_i, k_j)/τ + b_ij))``.

    Same semantics as ``helm.ops.lorentz_attention(..., impl="eager")``, including its mask conventions.

    Args:
        query: ``[B, H, Tq, 1+d]`` points of ``H_k``, the *last* ``Tq`` of the ``Tk`` positions
            (bottom-right causal alignment, as in cached decoding).
        key: ``[B, H, Tk, 1+d]``.
        value: ``[B, H, Tk, 1+dv]``.
        k: curvature parameter ``k = -1/K > 0``: float or one-element tensor (gradients flow).
        tau: temperature ``τ > 0``: float, one-element or ``[H]`` tensor (gradients flow).
        causal: key ``j`` is visible to query row ``i`` only if ``j <= Tk - Tq + i``.
        attention_mask: ``[B, Tk]``, 1 for real tokens, 0 for padding (left or right).
        segment_ids: ``[B, Tk]`` integer document ids of packed rows; attention never crosses documents.
            The ids of one row must span less than ``2^31``.
        alibi_slopes: ``[H]``; adds ``-slope_h (i - j)`` to the logits (gradients flow).
        value_centre: ``[B, H, 1, 1+dv]``, a centre ``c`` for which ``value`` is ``[B, H, Tk, 1+dv+1] = [v | e]``,
            ``e_j = <v_j - c, v_j - c>_L`` (a cache's, :func:`helm.ops.lorentz_attention`): the kernels read the
            values as they are instead of centring them (inference only: raises when gradients are required).
        qk_dtype: dtype of the ``q·k`` products' space parts (the compute dtype of helm.precision, e.g. bf16 under
            autocast; default the promoted input dtype). The time coordinates enter in fp32 whatever it is, and the
            values keep their own dtype (the value side, ``ν·[w | e]``, is fp32 for fp32 values).
        groups: the keys' :class:`~helm.ops.centring.KeyGroups` for this ``attention_mask`` and ``segment_ids``
            when the caller has them (a model's layers share one mask's); computed here otherwise.
        key_time: ``[B, H, Tk]`` fp32: ``key`` is then the keys' space parts ``[B, H, Tk, d]`` (a cache's, stored
            in ``qk_dtype``) and these their time coordinates; the kernels read both as they are.
        ids: the kernels' id rows for this ``attention_mask`` and ``segment_ids`` when the caller has them
            (:func:`~.common.kernel_ids`); computed here otherwise.

    Returns:
        ``[B, H, Tq, 1+dv]`` points of ``H_k`` in fp32 (also for fp16/bf16 inputs, like eager). A query row
        whose mask keeps no key (a padding query under left padding) attends to every key, as in eager.

    Limits: CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``); fp16, bf16 or fp32 inputs (mixed
    dtypes are promoted), scores and normalisation in fp32; ``1 <= d, dv <= 256`` (any size: the space part
    is padded to a power of two inside the kernel, the time coordinate is handled apart); no dense
    position bias (use ``impl="sdpa"``). Without gradients and with ``Tq <= 16`` the split-K decoding kernel
    of :mod:`helm.ops.lorentz_attention_triton.decode` runs instead of the forward kernel.
    """
    p = prepare(query, key, value, k=k, tau=tau, causal=causal, attention_mask=attention_mask,
                segment_ids=segment_ids, alibi_slopes=alibi_slopes, value_centre=value_centre, qk_dtype=qk_dtype,
                groups=groups, key_time=key_time, ids=ids)
    args = (p.q, p.qt, p.k, p.kt, p.v, p.e, p.c, p.scale, p.slopes, p.kc, p.qid, p.kid, p.causal, p.centred)
    if needs_grad(p):
        if not p.centred:
            raise ValueError("value_centre (a cache's centred norms) is for inference; pass plain values to "
                             "differentiate")
        return lorentz_attention_fwd(*args, True)[0]
    if p.q.shape[2] <= DECODE_MAX_Q:
        return lorentz_attention_decode(*args)
    return lorentz_attention_fwd(*args, False)[0]
