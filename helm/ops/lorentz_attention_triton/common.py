"""Pieces shared by the Lorentz attention kernels: host-side input preparation and Triton helpers.

Notation (per batch row ``b`` and head ``h``; queries are the *last* ``Tq`` of ``Tk`` positions, so query
row ``i`` sits at position ``pos_i = Tk - Tq + i``)::

    z_ij = c_h <q_i, k_j>_L - slope_h (pos_i - j)      c_h = 2 / τ_h,   <x, y>_L = -x_t y_t + x_s · y_s
    P_ij = softmax_j(z_ij)  over the kept keys            S_i = Σ_j P_ij v_j
    O_i  = lift(sqrt(k) S_i,s / sqrt(max(N_i, k/2)))      N_i = k + (E_i - <D_i, D_i>_L)   (= |<S_i, S_i>_L|)
    D_i  = Σ_j P_ij w_j,  E_i = Σ_j P_ij e_j,  S_i = c_i + D_i   with  w_j = v_j - c_j,  e_j = <w_j, w_j>_L

The kernels only ever see the centred values ``w`` (passed as ``V``; they compute ``e`` from them) and the row centres
``c`` (or, from a cache, plain values with their norms ``e`` about one centre), made by :func:`prepare`
(:func:`centre_values` explains the centres and ``README.md`` next to this file the pairwise form of ``N``).

The kernels work in base 2 (``exp2``/``log2``) with ``z`` pre-multiplied by ``log2(e)``. A point row
``[x_t, x_s]`` is always loaded as two blocks: the time coordinate ``[BT]`` in fp32 (for queries and keys from
their separate fp32 inputs ``qt``, ``kt``; for values converted at once) and the space part ``[BT, BLOCK_D]`` (for
queries and keys from their own ``[T, d]`` arrays in the GEMM dtype, rows starting at column 0: aligned and
contiguous where the cast to that dtype made them), so a head of ``1+64`` or ``1+128`` coordinates needs no padding
and ``q_t k_t`` never passes through half precision.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# One centring rule for every attention path: the kernels centre the values with helm.ops.centring's functions,
# which the eager and sdpa paths use, so a change to the rule cannot leave one path behind.
from ..centring import KeyGroups, key_groups, value_centres

__all__ = ["DEBUG_NAN_FILL", "INTERPRET", "LOG2E", "MAX_HEAD_DIM", "Prepared", "alloc", "block_d", "dot_precision",
           "launch_args", "needs_grad", "prepare", "centre_values", "document_runs", "kernel_ids", "SM90_SMEM_BYTES",
           "REG_BUDGET", "AUTOTUNE", "autotune_configs", "estimate_resources", "prune_configs"]

# ``triton.jit`` picks compiled or interpreted functions when a kernel module is imported; record the
# same decision so launchers choose interpreter-friendly blocks and fp32 dots consistently.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Debug switch for tests: allocate every kernel output with NaN (or 1 for integer flags) instead of
# ``torch.empty``, so a read of memory no kernel wrote shows up as a NaN or a wrong result.
DEBUG_NAN_FILL = False

# A Triton constexpr so the kernels can read it as a global.
LOG2E = tl.constexpr(1.4426950408889634)
MAX_HEAD_DIM = 256  # space dims d, dv per head; larger blocks exhaust registers on current GPUs

Tau = Union[float, torch.Tensor]
Curv = Union[float, torch.Tensor]

# --------------------------------------------------------------------------------------------------
# Autotuning (sm90: H100 / H200)
# --------------------------------------------------------------------------------------------------

# Largest dynamic shared memory one block may use on sm90 (228 KB per SM, of which 227 KB per block).
SM90_SMEM_BYTES = 227 * 1024
# fp32 values per thread that the estimated live tiles may take (3/4 of the 255 registers; the rest holds
# pointers, offsets, row statistics): configurations above it would spill.
REG_BUDGET = 192
# HELM_TRITON_AUTOTUNE=0: no timing, the first candidate of each list that fits the budget (the lists start with
# the hand-picked blocks); for test runs on a GPU, where every new key would otherwise compile and time dozens of
# candidates. Read when this module is imported.
AUTOTUNE = os.environ.get("HELM_TRITON_AUTOTUNE", "1") != "0"


def autotune_configs(preferred, block_m, block_n, warps, stages) -> list:
    """``triton.Config`` list: the ``preferred`` ``(BLOCK_M, BLOCK_N, warps, stages)`` first, in order, then the rest
    of the product of the candidates; ONE config under the interpreter (where the autotuner would run every
    candidate through the slow interpreter, and its benchmark timer needs a GPU)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)]
    order = list(preferred) + [(m, n, w, s) for m in block_m for n in block_n for w in warps for s in stages
                               if (m, n, w, s) not in preferred]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in order]


def estimate_resources(kind: str, block_m: int, block_n: int, block_d: int, block_dv: int, elem_qk: int,
                       elem_v: int, warps: int, stages: int) -> Tuple[int, int]:
    """``(shared memory bytes, fp32 registers per thread)`` a configuration is estimated to need (a model, not
    what the compiler allocates; configurations that still do not fit fail to compile and the autotuner drops
    them). ``elem_qk``, ``elem_v``: bytes per element of ``q, k`` and of the values.

    ``fwd`` / ``dq`` (a query block resident, key blocks streamed): ``stages`` buffered key + value tiles, the
    query tile and one ``[BM, BN]`` probability tile (value dtype) in shared memory; live ``[BM, BN]`` scores and
    probabilities (2 tiles; ``dq``: 3 with ``dP``) and the ``[BM, BLOCK_DV]`` (``dq``: ``[BM, BLOCK_D]``)
    accumulator in registers. ``dkdv`` (a key block resident, query blocks streamed): the same with query and key
    roles swapped, the ``dS`` tiles in the value dtype, four live ``[BN, BM]`` tiles (scores, ``P``, ``dP``,
    ``dz``) and the ``dK``, ``dV`` accumulators."""
    threads = 32 * warps
    stream_kv = block_n * (block_d * elem_qk + block_dv * elem_v)
    stream_q = block_m * (block_d * elem_qk + block_dv * elem_v)
    if kind == "fwd":
        smem = stages * stream_kv + block_m * block_d * elem_qk + block_m * block_n * elem_v
        regs = (2 * block_m * block_n + block_m * block_dv) // threads
    elif kind == "dq":
        smem = stages * stream_kv + stream_q + block_m * block_n * elem_v
        regs = (3 * block_m * block_n + block_m * block_d) // threads
    elif kind == "dkdv":
        smem = stages * stream_q + stream_kv + block_m * block_n * elem_v
        regs = (4 * block_m * block_n + block_n * (block_d + block_dv)) // threads
    else:
        raise ValueError(f"unknown kernel kind {kind!r}")
    return smem, regs


def prune_configs(kind: str):
    """``early_config_prune`` for ``triton.autotune``: drop the configurations estimated to exceed sm90's shared
    memory or register budget (:func:`estimate_resources`), keeping at least the smallest one; with
    :data:`AUTOTUNE` off, only the first that fits (one candidate: the autotuner then times nothing). ``BLOCK_M``
    comes from the configuration or, for the decoding kernel (fixed 16 rows), from the launch arguments."""
    def prune(configs, named_args, **kwargs):
        elem_qk, elem_v = named_args["Q"].element_size(), named_args["V"].element_size()
        block_d, block_dv = kwargs["BLOCK_D"], kwargs["BLOCK_DV"]
        fits = []
        for cfg in configs:
            block_m = cfg.kwargs.get("BLOCK_M", kwargs.get("BLOCK_M"))
            smem, regs = estimate_resources(kind, block_m, cfg.kwargs["BLOCK_N"], block_d, block_dv, elem_qk, elem_v,
                                            cfg.num_warps, cfg.num_stages)
            if smem <= SM90_SMEM_BYTES and regs <= REG_BUDGET:
                fits.append(cfg)
        if not fits:
            fits = [min(configs, key=lambda c: (c.kwargs.get("BLOCK_M", 1) * c.kwargs["BLOCK_N"], c.num_stages,
                                                -c.num_warps))]
        return fits if AUTOTUNE else fits[:1]
    return prune


def alloc(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty``, or a poison-filled tensor when :data:`DEBUG_NAN_FILL` is set."""
    if not DEBUG_NAN_FILL:
        return torch.empty(shape, dtype=dtype, device=device)
    fill = float("nan") if dtype.is_floating_point else 1
    return torch.full(shape, fill, dtype=dtype, device=device)


def block_d(n: int) -> int:
    """Block width for ``n`` space coordinates: a power of two, at least 16 (the smallest ``tl.dot`` size)."""
    return max(16, triton.next_power_of_2(n))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact fp32 products for fp32 inputs (no silent TF32), ignored for half."""
    return "ieee" if dtype == torch.float32 or INTERPRET else "tf32"


class Prepared:
    """Kernel-ready inputs (see :func:`prepare`)."""

    __slots__ = ("q", "qt", "k", "kt", "v", "e", "c", "scale", "slopes", "kc", "qid", "kid", "causal", "centred")

    def __init__(self, centred: bool = True, **kw):
        self.centred = centred
        for name, value in kw.items():
            setattr(self, name, value)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def prepare(query, key, value, *, k: Curv, tau: Tau, causal: bool, attention_mask, segment_ids,
            alibi_slopes, value_centre: Optional[torch.Tensor] = None,
            qk_dtype: Optional[torch.dtype] = None, groups: Optional[KeyGroups] = None,
            key_time: Optional[torch.Tensor] = None, ids: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
            ) -> Prepared:
    """Validate the public arguments and turn them into what the kernels read.

    * The space parts of ``q, k``, ``[B, H, T, d]`` in the GEMM dtype ``qk_dtype`` (default: the promoted dtype of
      the three inputs; the dots run in it), and their time coordinates apart, ``qt [B*H, Tq]``, ``kt [B*H, Tk]``
      fp32, taken from the inputs before any rounding: the time part of ``<q, k>_L`` (large and nearly the same for
      every key far from the origin) never passes through a half-precision dtype (helm.precision). Where the GEMM
      dtype differs from the points' the cast writes the space parts contiguous, rows of ``d`` from column 0 (16-byte
      aligned for ``d`` a multiple of 8: vectorised loads); otherwise they stay views of the points.

    * ``key_time`` ``[B, H, Tk]``: ``key`` is then not points but a cache's space parts ``[B, H, Tk, d]``, stored in
      the GEMM dtype, and ``key_time`` their time coordinates in fp32 (:class:`helm.nn.LorentzSelfAttention`'s
      cache): nothing over the cache is cast.

    * The values are centred (:func:`centre_values`), unless ``value_centre`` ``[B, H, 1, 1+dv]`` is given: then
      ``value`` is a cache's ``[B, H, Tk, 1+dv+1] = [v | e]`` with ``e_j = <v_j - c, v_j - c>_L`` for that one
      centre ``c``, and the kernels take ``v`` as it is (``centred=False``: ``D = Σ P v - c``), so a decode
      step does not re-centre the cache (forward only).

    * ``q, k, v`` share one dtype (fp16, bf16 or fp32; promoted like eager) and have unit last stride.
    * ``scale = 2/τ`` ``[H]`` fp32 and ``kc = k`` ``[1]`` fp32 stay in the autograd graph, so gradients of
      ``τ`` and of a tensor curvature flow through ordinary torch ops around the kernel.
    * Padding is folded into segment ids: ``qid [B, Tq]`` holds each query's document id (>= 0) and
      ``kid [B, Tk]`` each key's, with ``-1`` for padding keys, which therefore match no query. The kernel's
      masking is then ``causal & (qid_i == kid_j)``. Ids are shifted to start at 0 per row and stored as
      int32, so the ids of one row must span less than 2^31. ``kid`` is ``[B, 3, Tk]``: the ids, then each
      position's document span (:func:`document_runs`), which the kernels use to skip the blocks of other documents.
      ``ids``: ``(qid, kid)`` of this mask when the caller has them (:func:`kernel_ids`; a model computes them once
      per forward for all its layers).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a [B, H, T, 1+d] tensor, got {getattr(t, 'shape', type(t))}")
    cached_norms = None
    if value_centre is not None:
        if value_centre.dim() != 4 or tuple(value_centre.shape) != (*value.shape[:2], 1, value.shape[3] - 1):
            raise ValueError(f"value_centre must be [B, H, 1, 1+dv] for values [B, H, Tk, 1+dv+1], got "
                             f"{tuple(value_centre.shape)} for {tuple(value.shape)}")
        value, cached_norms = value[..., :-1], value[..., -1]
    B, H, Tq, Dq = query.shape
    Tk = key.shape[2]
    if key.shape[:2] != (B, H) or value.shape[:2] != (B, H):
        raise ValueError(f"query, key and value must share [B, H]: got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key_time is not None and tuple(key_time.shape) != (B, H, Tk):
        raise ValueError(f"key_time must be [B, H, Tk] = {(B, H, Tk)}, got {tuple(key_time.shape)}")
    if key_time is not None and key.shape[3] != Dq - 1:
        raise ValueError(f"with key_time, key must be the keys' space parts [B, H, Tk, d = {Dq - 1}] (query is "
                         f"1+d = {Dq}), got {tuple(key.shape)}")
    if key_time is None and key.shape[3] != Dq:
        raise ValueError(f"query and key must have the same head dim 1+d: got {Dq} and {key.shape[3]}")
    if value.shape[2] != Tk:
        raise ValueError(f"key and value must have the same length: got {Tk} and {value.shape[2]}")
    if Tq > Tk or Tq == 0:
        raise ValueError(f"need 0 < Tq <= Tk (queries are the last Tq positions), got Tq={Tq}, Tk={Tk}")
    d, dv = Dq - 1, value.shape[3] - 1
    if not (1 <= d <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM):
        raise ValueError(f"head dims must be 1+d with 1 <= d <= {MAX_HEAD_DIM}: got 1+{d} (q, k), 1+{dv} (v)")
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the Lorentz attention kernel supports fp16, bf16 and fp32 inputs, got {dtype}; "
                         "use helm.ops.lorentz_attention(..., impl='eager') for float64")
    device = query.device
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(f"the Lorentz attention kernel needs CUDA tensors (got {device.type!r}); set "
                         "TRITON_INTERPRET=1 before triton is first imported to run it in the Triton interpreter")
    if qk_dtype is not None and qk_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"qk_dtype must be fp16, bf16 or fp32, got {qk_dtype}")
    gemm = dtype if qk_dtype is None else qk_dtype
    q = _last_dim_contiguous(query[..., 1:].to(gemm))
    qt = query[..., 0].to(torch.float32).reshape(B * H, Tq).contiguous()
    if key_time is None:
        kk = _last_dim_contiguous(key[..., 1:].to(gemm))
        kt = key[..., 0].to(torch.float32).reshape(B * H, Tk).contiguous()
    else:
        kk = _last_dim_contiguous(key.to(gemm))
        kt = key_time.to(torch.float32).reshape(B * H, Tk).contiguous()
    v = _last_dim_contiguous(value.to(dtype))

    tau_t = torch.as_tensor(tau, dtype=torch.float32, device=device)
    if tau_t.numel() == 1:
        tau_t = tau_t.reshape(1).expand(H)
    elif tuple(tau_t.shape) != (H,):
        raise ValueError(f"tau must be a scalar or have shape [H={H}], got {tuple(tau_t.shape)}")
    scale = (2.0 / tau_t).contiguous()
    kc = torch.as_tensor(k, dtype=torch.float32, device=device)
    if kc.numel() != 1:
        raise ValueError(f"k must be a float or a one-element tensor, got shape {tuple(kc.shape)}")
    kc = kc.reshape(1)
    slopes = None
    if alibi_slopes is not None:
        if tuple(alibi_slopes.shape) != (H,):
            raise ValueError(f"alibi_slopes must be [H={H}], got {tuple(alibi_slopes.shape)}")
        slopes = alibi_slopes.to(device=device, dtype=torch.float32).contiguous()

    for name, m in (("attention_mask", attention_mask), ("segment_ids", segment_ids)):
        if m is not None and tuple(m.shape) != (B, Tk):
            raise ValueError(f"{name} must be [B, Tk] = {(B, Tk)}, got {tuple(m.shape)}")
    qid, kid = kernel_ids(segment_ids, attention_mask, Tq, device) if ids is None else ids
    want = [None] * 2 if segment_ids is None and attention_mask is None else [((B, Tq), device), ((B, 3, Tk), device)]
    if ids is not None and [t if t is None else (tuple(t.shape), t.device) for t in ids] != want:
        raise ValueError(f"ids must be kernel_ids() of this call's masks, {want}; got "
                         f"{[getattr(t, 'shape', t) for t in ids]}")
    if cached_norms is None:
        (w, c), e = centre_values(v, segment_ids, attention_mask, Tq, groups), None
    else:
        w, e = v, cached_norms.to(torch.float32).contiguous()
        c = value_centre.detach().to(torch.float32).expand(B, H, Tq, 1 + dv).contiguous()
    return Prepared(q=q, qt=qt, k=kk, kt=kt, v=w, e=e, c=c, scale=scale, slopes=slopes, kc=kc, qid=qid, kid=kid,
                    causal=bool(causal), centred=cached_norms is None)


def kernel_ids(segment_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor], q_len: int, device
               ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(qid [B, Tq], kid [B, 3, Tk])`` int32, the rows the kernels mask with (:func:`prepare`), or ``(None, None)``
    without ``segment_ids`` and ``attention_mask`` ``[B, Tk]``."""
    if segment_ids is None and attention_mask is None:
        return None, None
    B, Tk = (segment_ids if segment_ids is not None else attention_mask).shape
    if segment_ids is not None:
        seg = segment_ids.to(device=device, dtype=torch.int64)
        seg = seg - seg.amin(dim=1, keepdim=True)
    else:
        seg = torch.zeros(B, Tk, dtype=torch.int64, device=device)
    qid = seg[:, Tk - q_len:].to(torch.int32).contiguous()
    kid = seg if attention_mask is None else torch.where(attention_mask.to(device).bool(), seg, -1)
    return qid, torch.stack([kid, *document_runs(seg)], dim=1).to(torch.int32).contiguous()


def document_runs(seg: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(first, end)`` ``[B, T]``: for each position of a row of document ids ``seg [B, T]``, the first position of
    its document and the position after its last, where the row's ids never decrease (documents packed one after
    another: a document is a run); ``(0, T)`` for every position of a row whose ids go down somewhere (a document
    may then come back later). Scans on the device, no host synchronisation."""
    B, T = seg.shape
    pos = torch.arange(T, device=seg.device).expand(B, T)
    change = seg[:, 1:] != seg[:, :-1]  # a document starts after each change and at 0, ends before each and at T
    first = torch.where(F.pad(change, (1, 0), value=True), pos, 0).cummax(dim=1).values
    end = torch.where(F.pad(change, (0, 1), value=True), pos + 1, T).flip(1).cummin(dim=1).values.flip(1)
    runs = (seg[:, 1:] >= seg[:, :-1]).all(dim=1, keepdim=True)
    return torch.where(runs, first, 0), torch.where(runs, end, T)


def centre_values(v: torch.Tensor, segment_ids, attention_mask, q_len: int, groups: Optional[KeyGroups] = None):
    """``(w, c)``: centred values ``w_j = v_j - c_j`` (in ``v``'s dtype, unit last stride; in the autograd graph) and
    the centre of each query row ``c [B, H, Tq, 1+dv]`` fp32 (detached). The kernels compute ``e_j = <w_j, w_j>_L``
    from the ``w_j`` they load (:func:`_lorentz_sqnorm`, accumulated in fp64: the named exception of
    ``helm/precision.py``, see :func:`_centroid_normalise`) and carry its gradient into ``dw`` themselves.

    The normaliser ``N = k + (E - <D, D>_L)`` does not depend on the centres as long as every key a row attends to
    has the same one; only its rounding does. Keys are grouped by document (segment id) and padding flag
    (:func:`helm.ops.centring.key_groups`), so packed documents stay bit-for-bit independent, and each group gets
    :func:`helm.ops.centring.value_centres`: ``0`` for values spread around the origin (their ``e_j ≈ -k`` are
    small and exact), about their mean for values clustered far from it (small centred values, small fp32 error of
    their weighted sum). Sorts and segmented scans only: deterministic, no host synchronisation. ``groups``: those
    of this mask when the caller has them (:meth:`helm.ops.AttentionMask.groups`, shared by every layer)."""
    B, H, Tk, _ = v.shape
    if groups is None:
        groups = key_groups(B, Tk, segment_ids, None if attention_mask is None else attention_mask.bool(), v.device)
    vf = v.float()
    c = value_centres(vf, groups)
    w = _last_dim_contiguous((vf - c).to(v.dtype))
    c_rows = c.expand(B, H, Tk, c.shape[-1])[:, :, Tk - q_len:].contiguous()
    return w, c_rows


def needs_grad(p: Prepared) -> bool:
    """Whether autograd will ask for gradients of any kernel input."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in (p.q, p.qt, p.k, p.kt, p.v, p.e, p.scale, p.slopes, p.kc))


def launch_args(p: Prepared) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slopes, qid, kid, kc, e)`` with stand-ins for the optional pointers (never read: the matching ``HAS_*``
    flag is off, or for ``e`` ``CENTRED`` is on)."""
    slopes = p.slopes if p.slopes is not None else p.scale
    qid = p.qid if p.qid is not None else p.scale
    kid = p.kid if p.kid is not None else p.scale
    return slopes, qid, kid, p.kc, p.e if p.e is not None else p.scale


# --------------------------------------------------------------------------------------------------
# Triton helpers
# --------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """``a @ b`` with fp32 accumulation; operands cast to fp32 first where half-precision dots are unsafe
    (the Triton interpreter computes bf16 ``tl.dot`` wrongly)."""
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _bf16_parts(x):
    """``x`` (fp32) as three bf16 numbers ``hi + mid + lo``, each the rounded remainder of the ones before: 24
    significant bits together, fp32's own."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot_v(a, b, DOT_F32: tl.constexpr, SPLIT: tl.constexpr):
    """A value-side product (``P·w``, ``Pᵀ·dD``, ``dD·wᵀ``) on tensor cores with fp32 accumulation. ``SPLIT`` (fp32
    operands): each operand split into three bf16 parts (:func:`_bf16_parts`) and ``a·b`` summed from the six
    bf16 dots whose parts weigh at least ``2⁻¹⁶`` of ``hi·hi``, smallest first; the three dropped products weigh
    ``2⁻²⁴`` and less, so the error is fp32's (README.md, "Precision"). Half-precision operands go through one dot
    as they are."""
    if SPLIT:
        a_hi, a_mid, a_lo = _bf16_parts(a)
        b_hi, b_mid, b_lo = _bf16_parts(b)
        small = _dot(a_hi, b_lo, DOT_F32, "ieee") + _dot(a_lo, b_hi, DOT_F32, "ieee") + \
            _dot(a_mid, b_mid, DOT_F32, "ieee")
        cross = _dot(a_hi, b_mid, DOT_F32, "ieee") + _dot(a_mid, b_hi, DOT_F32, "ieee")
        return _dot(a_hi, b_hi, DOT_F32, "ieee") + (cross + small)
    return _dot(a, b, DOT_F32, "ieee")


@triton.jit
def _block_logits(b_qt, b_qs, b_kt, b_ks, o_n, pos_q, qk_scale, slope, HAS_ALIBI: tl.constexpr,
                  DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """``<q, k>_L [BM, BN]`` and the base-2 logits ``c·log2(e)·<q, k>_L (+ ALiBi)`` of one query × key block.

    The space part goes through ``tl.dot`` (tensor cores), the time part is an fp32 outer product."""
    b_qk = _dot(b_qs, tl.trans(b_ks), DOT_F32, PREC) - b_qt[:, None] * b_kt[None, :]
    b_s = b_qk * qk_scale
    if HAS_ALIBI:
        b_s += slope * (o_n[None, :] - pos_q[:, None]).to(tl.float32)
    return b_qk, b_s


@triton.jit
def _block_keep(m_q, m_n, o_n, pos_q, b_qid, p_kid, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr):
    """Keep-mask ``[BM, BN]`` of one query × key block: in range, causal, same segment (padding included)."""
    m_s = m_q[:, None] & m_n[None, :]
    if CAUSAL:
        m_s = m_s & (o_n[None, :] <= pos_q[:, None])
    if HAS_SEG:
        b_kid = tl.load(p_kid + o_n, mask=m_n, other=-1)
        m_s = m_s & (b_qid[:, None] == b_kid[None, :])
    return m_s


@triton.jit
def _causal_free_end(pos_first, lo, hi, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where the key blocks ``[lo, hi)`` that every row of a query block sees whole (its first row sits at position
    ``pos_first``) end, so the causal mask is needed only from there: the two-stage loop. ``hi`` without ``CAUSAL``."""
    if CAUSAL:
        return tl.maximum(lo, tl.minimum(hi, ((pos_first + 1) // BLOCK_N) * BLOCK_N))
    return hi


@triton.jit
def _document_span(p_kid, o_t, m_t, Tk, shift, lo, hi, BLOCK: tl.constexpr):
    """``[lo, hi)`` narrowed to the rows that can share a document with the positions ``o_t`` (mask ``m_t``): from
    the first position of their first document to the end of their last (:func:`document_runs`, the rows ``1, 2`` of
    ``KID``), less ``shift`` (query rows: ``Tk - Tq``), ``lo`` rounded down to a multiple of ``BLOCK``. Empty
    (``hi <= lo``) when ``m_t`` keeps no row."""
    first = tl.min(tl.load(p_kid + Tk + o_t, mask=m_t, other=Tk), 0) - shift
    last = tl.max(tl.load(p_kid + 2 * Tk + o_t, mask=m_t, other=0), 0) - shift
    return tl.maximum(lo, (tl.maximum(first, 0) // BLOCK) * BLOCK), tl.minimum(hi, last)


@triton.jit
def _load_points(p_x, o_t, m_t, stride_t, o_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``o_t`` of a ``[T, 1+D]`` array of points: time ``[BT]`` in fp32, space ``[BT, BLOCK_D]`` as stored
    (zero beyond ``D`` and for masked rows)."""
    b_t = tl.load(p_x + o_t * stride_t, mask=m_t, other=0.0).to(tl.float32)
    return b_t, _load_rows(p_x + 1, o_t, m_t, stride_t, o_d, D, BLOCK_D)


@triton.jit
def _load_split(p_x, p_xt, o_t, m_t, stride_t, o_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``o_t`` of points stored apart: time ``[BT]`` fp32 from the contiguous ``p_xt``, space ``[BT, BLOCK_D]``
    from the ``[T, D]`` array ``p_x`` (in the GEMM dtype)."""
    return tl.load(p_xt + o_t, mask=m_t, other=0.0), _load_rows(p_x, o_t, m_t, stride_t, o_d, D, BLOCK_D)


@triton.jit
def _load_rows(p_x, o_t, m_t, stride_t, o_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows ``o_t`` of a ``[T, D]`` array as a ``[BT, BLOCK_D]`` block (zero-padded)."""
    p = p_x + o_t[:, None] * stride_t + o_d[None, :]
    if D == BLOCK_D:
        b_x = tl.load(p, mask=m_t[:, None], other=0.0)
    else:
        b_x = tl.load(p, mask=m_t[:, None] & (o_d[None, :] < D), other=0.0)
    return b_x


@triton.jit
def _store_rows(p_x, b_x, o_t, m_t, stride_t, o_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store a ``[BT, BLOCK_D]`` block into rows ``o_t`` of a ``[T, D]`` array."""
    p = p_x + o_t[:, None] * stride_t + o_d[None, :]
    if D == BLOCK_D:
        tl.store(p, b_x.to(p_x.dtype.element_ty), mask=m_t[:, None])
    else:
        tl.store(p, b_x.to(p_x.dtype.element_ty), mask=m_t[:, None] & (o_d[None, :] < D))


@triton.jit
def _store_points(p_x, b_t, b_s, o_t, m_t, stride_t, o_d, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store time ``[BT]`` and space ``[BT, BLOCK_D]`` blocks into rows ``o_t`` of a ``[T, 1+D]`` array."""
    tl.store(p_x + o_t * stride_t, b_t.to(p_x.dtype.element_ty), mask=m_t)
    _store_rows(p_x + 1, b_s, o_t, m_t, stride_t, o_d, D, BLOCK_D)


@triton.jit
def _lorentz_sqnorm(b_t, b_s):
    """``<x, x>_L = |x_s|² - x_t²`` of each row of a block (time ``[BT]``, space ``[BT, BLOCK_D]``), accumulated in
    fp64 and rounded to fp32: the named fp64 exception (:func:`_centroid_normalise` says why)."""
    b_s64 = b_s.to(tl.float64)
    b_t64 = b_t.to(tl.float64)
    return (tl.sum(b_s64 * b_s64, 1) - b_t64 * b_t64).to(tl.float32)


@triton.jit
def _centroid_normalise(b_dt, b_ds, b_e, b_ct, b_cs, kc):
    """Lorentz normalisation of the rows from their centred sums ``D`` (time ``b_dt``, space ``b_ds``), ``E`` and
    centres ``c``: ``N = k + (E - <D, D>_L)`` with ``<D, D>_L`` accumulated in fp64, ``O_s = sqrt(k) (c_s + D_s) /
    sqrt(max(N, k/2))``, ``O_t = sqrt(|O_s|^2 + k)``. The exact ``N >= k`` (a one-key row attains it); the floor
    ``k/2`` never binds for values on the manifold (as ``helm.ops``). Recomputing ``O_t`` puts the output on the
    hyperboloid to rounding. Returns ``(O_t, O_s, N)`` (``N`` before the floor).

    fp64 here and in the kernels' ``e_j`` (:func:`_lorentz_sqnorm`) is a named exception of ``helm/precision.py``
    (``O(T·d_v)`` per head and key block, off the tensor cores): for a one-hot row (every sequence's first token, a
    saturated softmax) ``E - <D, D>_L`` must come out 0 to ``u·k`` while both terms are ``~|v|²``; ``helm.ops`` gets
    that in fp32 because there ``D`` is bitwise ``w_j`` and both norms come from one function, and so does this one,
    but ``e_j`` is summed over a key block's tile and ``<D, D>_L`` over a query block's, whose reduction orders differ
    on a GPU with the layouts (fp32: ``u·|v|²`` error, 7e-4 output error at ``|v| = 100``; the interpreter happens to
    sum both in one order)."""
    b_dd = _lorentz_sqnorm(b_dt, b_ds)
    b_n = (b_e - b_dd) + kc
    b_a = tl.sqrt(kc) / tl.sqrt(tl.maximum(b_n, 0.5 * kc))
    b_os = (b_ds + b_cs) * b_a[:, None]
    b_ot = tl.sqrt(tl.sum(b_os * b_os, 1) + kc)
    return b_ot, b_os, b_n


@triton.jit
def _attend_blocks(acc_t, acc_s, acc_e, l_i, m_i, b_qt, b_qs, pos_q, m_q, b_qid, m_rows,
                   p_k, p_kt, p_v, p_e, p_kid, stride_kt, stride_vt, lo, hi, Tk, qk_scale, slope,
                   D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_SEG: tl.constexpr,
                   HAS_ALIBI: tl.constexpr, FALLBACK: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
                   SPLIT_V: tl.constexpr, CENTRED: tl.constexpr):
    """Online softmax over the key blocks starting in ``[lo, hi)`` for one block of query rows.

    Carries, per row, the running max ``m_i`` and sum ``l_i`` of ``2^(z log2 e)`` and the unnormalised sums
    ``acc_t [BM]`` (time) and ``acc_s [BM, BLOCK_DV]`` (space) of ``2^(...) w`` and ``acc_e [BM]`` of
    ``2^(...) e``. The keys' time coordinates come from ``p_kt`` (fp32), their space parts from ``p_k``; ``e_j`` is
    computed from the loaded ``w_j`` (``CENTRED``) or read from ``p_e`` (a cache's norms). Normal
    pass: keys kept by the causal / segment mask. ``FALLBACK`` pass: only rows flagged in ``m_rows`` take part, and
    they attend to every key (the convention for rows whose mask keeps nothing).
    """
    o_n0 = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    o_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + o_n0
        m_n = o_n < Tk
        b_kt, b_ks = _load_split(p_k, p_kt, o_n, m_n, stride_kt, o_d, D, BLOCK_D)
        b_vt, b_vs = _load_points(p_v, o_n, m_n, stride_vt, o_dv, DV, BLOCK_DV)
        if CENTRED:
            b_e = _lorentz_sqnorm(b_vt, b_vs)
        else:
            b_e = tl.load(p_e + o_n, mask=m_n, other=0.0)
        b_qk, b_s = _block_logits(b_qt, b_qs, b_kt, b_ks, o_n, pos_q, qk_scale, slope, HAS_ALIBI, DOT_F32, PREC)
        if FALLBACK:
            m_s = m_rows[:, None] & m_n[None, :]
        else:
            m_s = _block_keep(m_q, m_n, o_n, pos_q, b_qid, p_kid, CAUSAL, HAS_SEG)
        b_s = tl.where(m_s, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        # Rows with nothing kept so far keep m = -inf; shift them by 0 so no -inf - -inf = NaN appears.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_alpha = tl.exp2(m_i - m_use)
        b_p = tl.exp2(b_s - m_use[:, None])
        l_i = l_i * b_alpha + tl.sum(b_p, 1)
        acc_t = acc_t * b_alpha + tl.sum(b_p * b_vt[None, :], 1)
        acc_e = acc_e * b_alpha + tl.sum(b_p * b_e[None, :], 1)
        acc_s = acc_s * b_alpha[:, None] + _dot_v(b_p.to(b_vs.dtype), b_vs, DOT_F32, SPLIT_V)
        m_i = m_new
    return acc_t, acc_s, acc_e, l_i, m_i

