"""Fused, chunked LM head + cross-entropy: the loss of ``logits = s·(x Wᵀ) + b`` without the ``[N, V]`` logits.

Both modes of :class:`helm.nn.LorentzLMHead` are this affine map: ``linear`` is ``x Wᵀ (+ b)``; ``distance`` is
``(2k + 2<x, p_c>_L)/τ + b_c`` with the Minkowski product ``<x, p>_L = -x_0 p_0 + x_{1:}·p_{1:}`` in place of
``x Wᵀ`` (``minkowski=True``) and ``s = 2/τ``; the constant ``2k/τ`` cancels in the softmax.

The plain path materialises ``[N, V]`` fp32 logits, their log-softmax and, in backward, the gradient of each:
at ``N = 2048`` tokens and the 128k Llama-3 vocabulary that is ~1 GB per tensor, more than the 115M model's
activations. :func:`linear_cross_entropy` walks the rows in chunks of ``chunk_size`` tokens (default: about
:data:`CHUNK_ELEMENTS` logits per chunk on a CPU, a quarter of the free memory on CUDA: :func:`default_chunk_size`) in
one ``[chunk, V]`` buffer. Per chunk it computes the logits, their
``logsumexp`` and the NLL of the targets; when gradients are needed it turns the same buffer into
``dL/dlogits = softmax - onehot`` (zero on ignored rows) and accumulates

    dL/dx = s · dl W,   dL/dW = s · Σ_chunks dlᵀ x,   dL/ds = Σ_rows <dl W, x>,   dL/db = Σ_rows dl

(with ``minkowski``, ``W`` and ``<·,·>`` carry the time coordinate's sign), so the chunk's logits are never
needed again: nothing is recomputed in backward and nothing of size ``N·V`` is kept. Forward therefore does the
work of forward + backward (three matmuls, like the plain path's forward and backward; recomputing the logits in
backward would cost a fourth), holds the gradients of ``x``, ``W``, ``s``, ``b`` until backward and there only
multiplies them by the incoming scalar gradient. The gradients are first-order only (no double backward), and one
``backward`` per forward (``retain_graph`` for a second pass is refused). Under ``torch.no_grad()`` or with no
input requiring a gradient only the loss is computed.

Precision (README, Conventions): the three chunk GEMMs (``x Wᵀ``, ``dl W``, ``dlᵀ x``; in half precision their
``D`` side zero-padded to a multiple of :data:`ALIGN`) run in the compute dtype
(:func:`helm.precision.compute_dtype`: the autocast dtype under autocast, else the weight's), accumulating in fp32
inside the GEMM; the logits, ``logsumexp``, softmax and the ``dL/dW`` summed over chunks are fp32 (fp64 for fp64
inputs; nothing is widened to fp64 otherwise). With ``minkowski`` the time coordinates never enter a half-precision
GEMM: ``-x_0 p_0`` and its gradients (rank-1 products and matrix-vector products with the fp32 ``dl``) are fp32.
The compute dtype is decided by the public wrapper and handed to the ``autograd.Function``, which queries no
autocast state, so ``torch.compile(fullgraph=True)`` traces it under autocast.

:func:`linear_cross_entropy_reference` is the same loss written out on the full logits (the oracle of
``tests/ops/test_lm_loss.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..precision import autocast_dtype, compute_dtype, stat_dtype, to_stat

# logits per chunk: 2^25 fp32 = 128 MiB (261 tokens of a 128256-token vocabulary) on a CPU, where larger chunks
# gain little (benchmarks/lm_head_loss.py); on CUDA a quarter of the free memory (:func:`default_chunk_size`)
CHUNK_ELEMENTS = 1 << 25
# the half-precision GEMMs' width is zero-padded to a multiple of this (16-byte aligned bf16 rows: cuBLAS' fast
# kernels; the models' 389 or 390 columns are not)
ALIGN = 16
# logits per chunk on the CUDA devices measured (``str(device)``): a dict lookup, which dynamo traces
_CHUNK_ELEMENTS_ON: dict[str, int] = {}


def default_chunk_size(vocab_size: int, device: Optional[torch.device] = None) -> int:
    """Tokens per chunk, at least one: about :data:`CHUNK_ELEMENTS` logits, or on CUDA as many as a quarter of the
    device's free memory holds at 12 bytes per logit (the half-precision GEMM output, fp32 logits and ``dl``, the
    half-precision copy of ``dl``), measured once per device. On an H200 the 16,384 tokens of an
    8 x 2048 batch at a 128k vocabulary are one chunk: one pass of launches and one ``dL/dW`` accumulation instead
    of 63."""
    key = str(device)
    if key not in _CHUNK_ELEMENTS_ON and device is not None and torch.device(device).type == "cuda" \
            and not torch.compiler.is_compiling():
        _CHUNK_ELEMENTS_ON[key] = max(CHUNK_ELEMENTS, torch.cuda.mem_get_info(device)[0] // 4 // 12)
    return max(1, _CHUNK_ELEMENTS_ON.get(key, CHUNK_ELEMENTS) // max(int(vocab_size), 1))


def _aligned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``; in half precision with its last dim zero-padded to a multiple of :data:`ALIGN` (the copy
    is made anyway). Zero columns add nothing to the products that contract over them."""
    if dtype not in (torch.bfloat16, torch.float16) or t.shape[-1] % ALIGN == 0:
        return t.to(dtype)
    return torch.nn.functional.pad(t.to(dtype), (0, -t.shape[-1] % ALIGN))


def _check(x, weight, targets, scale, bias, minkowski) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [N, D] and weight [V, D], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if minkowski and x.shape[1] < 2:
        raise ValueError(f"minkowski needs a time coordinate and a space part (D >= 2), got D = {x.shape[1]}")
    if targets.shape != x.shape[:1] or targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"targets must be integer [N] = [{x.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if scale is not None and scale.dim() != 0:
        raise ValueError(f"scale must be a 0-dim tensor, got shape {tuple(scale.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                   scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                                   ignore_index: int = -100, minkowski: bool = False) -> torch.Tensor:
    """``Σ_{i: t_i != ignore_index} -log softmax(s·(x_i Wᵀ) + b)[t_i]`` on the full ``[N, V]`` logits (fp32 at
    least), with ``x_i Wᵀ`` the Minkowski products ``<x_i, w_c>_L`` when ``minkowski``. Differentiable by
    autograd; the readable spec of :func:`linear_cross_entropy`."""
    if minkowski:
        logits = to_stat(x[:, 1:] @ weight[:, 1:].T) - to_stat(x[:, :1]) * to_stat(weight[:, 0])
    else:
        logits = to_stat(x @ weight.T)
    if scale is not None:
        logits = logits * to_stat(scale)
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    keep = targets != ignore_index
    picked = logits.gather(-1, torch.where(keep, targets, 0)[:, None])[:, 0]
    return torch.where(keep, torch.logsumexp(logits, dim=-1) - picked, 0).sum()


def _epilogue(z, kc, tc, xt, wt, s, b, *, acc: torch.dtype, mm: torch.dtype, need: tuple, fused: bool = False):
    """One chunk from the GEMM's output ``z = x_{lo:} W_{lo:}ᵀ`` ``[C, V]`` on: the logits ``s·(z - x_0 w_0) + b``
    in ``acc``, the summed NLL of the kept rows (``kc``; targets ``tc`` ``[C, 1]``) and, when ``need`` asks for
    gradients, ``dl = softmax - onehot`` (zero on ignored rows) in ``mm``, its column sums ``Σ_rows dl`` (for
    dL/db), ``dl·w_0`` ``[C]`` and ``dlᵀ·x_0`` ``[V]`` (with the time coordinates ``xt``, ``wt``; in ``acc``).
    Eager (a CPU), the logits' buffer becomes ``dl`` in place and the time products are matrix-vector products;
    compiled (CUDA, :func:`_compiled_epilogue`; ``fused``), they are reductions that inductor fuses with the rest,
    so the ``[C, V]`` logits are read a few times and ``dl`` written once in ``mm``."""
    need_x, need_w, need_s, need_b = need
    logits = z.to(acc)
    if xt is not None:
        logits.addcmul_(xt[:, None], wt, value=-1)  # -x_0 p_0, in fp32
    if s is not None:
        logits.mul_(s)
    if b is not None:
        logits.add_(b)
    picked = logits.gather(1, tc)[:, 0]
    peak = logits.amax(dim=-1, keepdim=True)
    dl = logits.sub_(peak).exp_()  # the logsumexp, in place: lse = peak + log Σ exp(logits - peak)
    sumexp = dl.sum(dim=-1, keepdim=True)
    total = torch.where(kc, (peak + sumexp.log())[:, 0] - picked, 0).sum()
    if not any(need):
        return total, None, None, None, None
    # softmax - onehot, zero on ignored rows: one pass scales by 1/Σexp (by 0 where ignored)
    dl.mul_(torch.where(kc[:, None], sumexp.reciprocal(), 0))
    dl.scatter_add_(1, tc, -kc[:, None].to(acc))
    dl_sum = dl.sum(0) if need_b else None
    ut = dl_xt = None
    if xt is not None and (need_x or need_s):
        ut = (dl * wt).sum(-1) if fused else dl @ wt
    if xt is not None and need_w:
        dl_xt = (dl * xt[:, None]).sum(0) if fused else dl.T @ xt
    return total, dl.to(mm) if need_x or need_s or need_w else None, dl_sum, ut, dl_xt


@functools.cache
def _compiled_epilogue():
    """:func:`_epilogue` under ``torch.compile`` (inductor, ``fused``; automatic dynamic shapes after a second
    chunk shape), made on first use."""
    return torch.compile(functools.partial(_epilogue, fused=True))


def _chunked(x, weight, scale, bias, targets, ignore_index: int, chunk: int, need: tuple, mm: torch.dtype,
             autocast: bool, minkowski: bool):
    """The summed NLL and, where ``need`` (for x, weight, scale, bias) says so, its gradients (fp32, fp64 for fp64
    inputs). ``mm``: the GEMM dtype; ``autocast``: whether autocast is on (switched off here: every operand is
    cast explicitly)."""
    need_x, need_w, need_s, need_b = need
    acc = stat_dtype(mm)
    lo = 1 if minkowski else 0  # first column of the half-precision GEMMs
    no_autocast = torch.autocast(x.device.type, enabled=False) if autocast else contextlib.nullcontext()
    with no_autocast, torch.no_grad():
        width = x.shape[1] - lo
        xm, wm = _aligned(x[:, lo:], mm), _aligned(weight[:, lo:], mm)
        xa = x[:, lo:].to(acc) if need_s else None  # for dL/ds: x itself, not its half-precision rounding
        xt, wt = (x[:, 0].to(acc), weight[:, 0].to(acc)) if minkowski else (None, None)
        s = None if scale is None else scale.to(acc)
        b = None if bias is None else bias.to(acc)
        keep = targets != ignore_index
        safe = torch.where(keep, targets, 0)
        total = torch.zeros((), dtype=acc, device=x.device)
        grad_x = torch.empty(x.shape, dtype=acc, device=x.device) if need_x else None
        # dL/dW accumulated transposed, [D, V]: xᵀ·dl runs faster than dlᵀ·x on CPU BLAS when D is odd (129: 57 vs
        # 74 ms at 2048 x 8192), and is made contiguous once at the end
        grad_wt = torch.zeros(lo + xm.shape[1], weight.shape[0], dtype=acc, device=x.device) if need_w else None
        grad_s = torch.zeros((), dtype=acc, device=x.device) if need_s else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=x.device) if need_b else None
        # views taken once: `grad_wt[lo:] += ...` would also copy the [D, V] result onto itself (setitem)
        gw, gwt = (grad_wt[lo:], grad_wt[0]) if need_w else (None, None)
        # inlined (fused) into a compiled model's graph; compiled on CUDA where inductor runs (Triton, sm70+)
        if torch.compiler.is_compiling():
            epilogue = functools.partial(_epilogue, fused=x.device.type == "cuda")
        elif x.device.type == "cuda" and importlib.util.find_spec("triton") is not None \
                and torch.cuda.get_device_capability(x.device)[0] >= 7:
            epilogue = _compiled_epilogue()
        else:
            epilogue = _epilogue
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            xc, kc, tc = xm[rows], keep[rows], safe[rows, None]
            part, dlm, dl_sum, ut, dl_xt = epilogue(xc @ wm.T, kc, tc, None if xt is None else xt[rows], wt, s, b,
                                                    acc=acc, mm=mm, need=need)
            total += part
            if not any(need):
                continue
            if need_b:
                grad_b += dl_sum
            if need_x or need_s:
                u = (wm.T @ dlm.T).T[:, :width].to(acc)  # dL/dx_{lo:} for s = 1; (Wᵀ dlᵀ)ᵀ: faster on CPU BLAS
                if need_x:
                    grad_x[rows, lo:] = u
                    if minkowski:
                        grad_x[rows, 0] = -ut
                if need_s:  # dL/ds = Σ dl ⊙ (logits - b)/s
                    grad_s += (u * xa[rows]).sum()
                    if minkowski:
                        grad_s -= (ut * xt[rows]).sum()
            if need_w:
                if mm == acc:
                    gw.addmm_(xc.T, dlm)
                else:
                    gw += xc.T @ dlm  # fp32 accumulation inside the GEMM, rounded to mm once per chunk
                if minkowski:
                    gwt -= dl_xt
        grad_w = grad_wt[:lo + width].T.contiguous() if need_w else None
        if s is not None:
            for g in (grad_x, grad_w):
                if g is not None:
                    g.mul_(s)
    return total, (grad_x, grad_w, grad_s, grad_b)


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss in forward together with its gradients (see the module docstring); backward scales them. ``mm`` and
    ``autocast`` come from the caller: nothing here reads the autocast state (dynamo traces this under autocast)."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, targets, ignore_index, chunk, mm, autocast, minkowski):
        total, grads = _chunked(x, weight, scale, bias, targets, ignore_index, chunk, tuple(ctx.needs_input_grad[:4]),
                                mm, autocast, minkowski)
        ctx.grads = grads
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (x, weight, scale, bias))
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: backward through the same loss twice is not supported (its "
                               "gradients are computed in forward and handed over once); run forward again")
        grads, ctx.grads = ctx.grads, None
        out = tuple(None if g is None else g.mul_(grad_total.to(g.dtype)).to(dtype)
                    for g, dtype in zip(grads, ctx.dtypes))
        return (*out, None, None, None, None, None, None)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                         ignore_index: int = -100, chunk_size: Optional[int] = None,
                         minkowski: bool = False) -> torch.Tensor:
    """Summed cross-entropy of ``logits = s·(x Wᵀ) + b`` over the rows whose target is not ``ignore_index``,
    computed ``chunk_size`` rows at a time without the ``[N, V]`` logits (see the module docstring).

    Args:
        x: ``[N, D]`` features. weight: ``[V, D]``. targets: ``[N]`` integer class ids or ``ignore_index``.
        scale: optional 0-dim logit scale ``s`` (differentiable). bias: optional ``[V]`` logit bias.
        chunk_size: rows per chunk (default :func:`default_chunk_size` of ``V``).
        minkowski: ``x Wᵀ`` is the Minkowski product ``<x_i, w_c>_L = -x_i0 w_c0 + x_i,1: · w_c,1:`` (column 0
            the time coordinate, kept out of half-precision GEMMs).

    The GEMMs run in :func:`helm.precision.compute_dtype` (the autocast dtype under autocast, else the weight's).
    Returns a 0-dim tensor, fp32 (fp64 for fp64 inputs); divide by the number of labelled tokens for the mean. Equal to
    :func:`linear_cross_entropy_reference` in loss and in the gradients of ``x``, ``weight``, ``scale`` and
    ``bias`` (gradients in the dtypes of those inputs).
    """
    _check(x, weight, targets, scale, bias, minkowski)
    chunk = default_chunk_size(weight.shape[0], x.device) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    targets = targets.to(x.device)
    mm = compute_dtype(x, weight)
    autocast = autocast_dtype(x.device.type) is not None
    inputs = (x, weight, scale, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _LinearCrossEntropy.apply(x, weight, scale, bias, targets, ignore_index, chunk, mm, autocast, minkowski)
    return _chunked(x, weight, scale, bias, targets, ignore_index, chunk, (False,) * 4, mm, autocast, minkowski)[0]


__all__ = ["CHUNK_ELEMENTS", "default_chunk_size", "linear_cross_entropy", "linear_cross_entropy_reference"]
