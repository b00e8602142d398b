"""Fused, chunked LM head + cross-entropy: the loss of ``logits = s·(x Wᵀ) + b`` without the ``[N, V]`` logits.

Both modes of :class:`helm.nn.LorentzLMHead` are this affine map: ``linear`` is ``x Wᵀ (+ b)``; ``distance`` is
``(2k + 2<x, p_c>_L)/τ + b_c = (2/τ)·((Jx) Pᵀ) + b_c + 2k/τ`` with ``J = diag(-1, 1, ..., 1)``, and the constant
``2k/τ`` cancels in the softmax, so its cross-entropy is that of ``s = 2/τ`` on ``Jx``.

The plain path materialises ``[N, V]`` fp32 logits, their log-softmax and, in backward, the gradient of each:
at ``N = 2048`` tokens and the 128k Llama-3 vocabulary that is ~1 GB per tensor, more than the 115M model's
activations. :func:`linear_cross_entropy` walks the rows in chunks of ``chunk_size`` tokens (default: about
:data:`CHUNK_ELEMENTS` logits per chunk) in one ``[chunk, V]`` buffer. Per chunk it computes the logits, their fp32
``logsumexp`` (fp64 stays fp64, also under bf16 autocast or bf16 weights) and the NLL of the targets; when
gradients are needed it turns the same buffer into ``dL/dlogits = softmax - onehot`` (zero on ignored rows) and accumulates

    dL/dx = s · dl W,   dL/dW = s · Σ_chunks dlᵀ x,   dL/ds = Σ <dl W, x>,   dL/db = Σ_rows dl

so the chunk's logits are never needed again: nothing is recomputed in backward and nothing of size ``N·V`` is
kept. Forward therefore does the work of forward + backward (three matmuls, like the plain path's forward and
backward; recomputing the logits in backward would cost a fourth), holds the gradients of ``x``, ``W``, ``s``,
``b`` until backward and there only multiplies them by the incoming scalar gradient. The gradients are
first-order only (no double backward), and one ``backward`` per forward (``retain_graph`` for a second pass is
refused). Under ``torch.no_grad()`` or with no input requiring a gradient only the loss is computed.

Matmuls run in the dtype the plain path uses (the autocast dtype under autocast, else the inputs' common dtype);
the logits, ``logsumexp`` and the accumulated ``dL/dW`` are fp32 (fp64 for fp64 inputs).

:func:`linear_cross_entropy_reference` is the same loss written out on the full logits (the oracle of
``tests/ops/test_lm_loss.py``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..manifold.math import upcast

# logits per chunk: 2^25 fp32 = 128 MiB (261 tokens of a 128256-token vocabulary): larger chunks make the matmuls
# faster but the chunk buffer bigger; see benchmarks/lm_head_loss.py
CHUNK_ELEMENTS = 1 << 25


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk: about :data:`CHUNK_ELEMENTS` logits, at least one token."""
    return max(1, CHUNK_ELEMENTS // max(int(vocab_size), 1))


def _matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``x @ weight.T`` computes in: autocast's for autocast-eligible inputs, else their common dtype."""
    dtype = torch.promote_types(x.dtype, weight.dtype)
    device = x.device.type
    if dtype != torch.float64 and torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return dtype


def _check(x, weight, targets, scale, bias) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [N, D] and weight [V, D], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if targets.shape != x.shape[:1] or targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"targets must be integer [N] = [{x.shape[0]}], got {targets.dtype} {tuple(targets.shape)}")
    if scale is not None and scale.dim() != 0:
        raise ValueError(f"scale must be a 0-dim tensor, got shape {tuple(scale.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                   scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                                   ignore_index: int = -100) -> torch.Tensor:
    """``Σ_{i: t_i != ignore_index} -log softmax(s·(x_i Wᵀ) + b)[t_i]`` on the full ``[N, V]`` logits (fp32 at
    least). Differentiable by autograd; the readable spec of :func:`linear_cross_entropy`."""
    logits = upcast(x @ weight.T)
    if scale is not None:
        logits = logits * upcast(scale)
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    keep = targets != ignore_index
    picked = logits.gather(-1, torch.where(keep, targets, 0)[:, None])[:, 0]
    return torch.where(keep, torch.logsumexp(logits, dim=-1) - picked, 0).sum()


def _chunked(x, weight, scale, bias, targets, ignore_index: int, chunk: int, need: tuple):
    """The summed NLL and, where ``need`` (for x, weight, scale, bias) says so, its gradients."""
    need_x, need_w, need_s, need_b = need
    mm = _matmul_dtype(x, weight)
    acc = torch.float64 if torch.promote_types(x.dtype, weight.dtype) == torch.float64 else torch.float32
    device = x.device.type
    no_autocast = (torch.autocast(device, enabled=False) if torch.amp.is_autocast_available(device)
                   else contextlib.nullcontext())
    with no_autocast, torch.no_grad():
        xm, wm = x.to(mm), weight.to(mm)
        s = None if scale is None else scale.to(acc)
        b = None if bias is None else bias.to(acc)
        keep = targets != ignore_index
        safe = torch.where(keep, targets, 0)
        total = torch.zeros((), dtype=acc, device=x.device)
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=x.device) if need_w else None
        grad_s = torch.zeros((), dtype=acc, device=x.device) if need_s else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=x.device) if need_b else None
        for start in range(0, x.shape[0], chunk):
            xc, kc, tc = xm[start:start + chunk], keep[start:start + chunk], safe[start:start + chunk, None]
            logits = (xc @ wm.T).to(acc)  # a fresh buffer: everything below is in place
            if s is not None:
                logits.mul_(s)
            if b is not None:
                logits.add_(b)
            picked = logits.gather(1, tc)[:, 0]
            peak = logits.amax(dim=-1, keepdim=True)
            dl = logits.sub_(peak).exp_()  # the logsumexp, in place: lse = peak + log Σ exp(logits - peak)
            sumexp = dl.sum(dim=-1, keepdim=True)
            total += torch.where(kc, (peak + sumexp.log())[:, 0] - picked, 0).sum()
            if not any(need):
                continue
            dl.div_(sumexp)  # softmax
            dl.scatter_add_(1, tc, torch.full_like(tc, -1, dtype=acc))  # - onehot
            dl.mul_(kc[:, None])  # ignored rows contribute nothing
            if need_b:
                grad_b += dl.sum(0)
            if need_x or need_s:
                u = dl.to(mm) @ wm  # dL/dx for s = 1
                if need_x:
                    grad_x[start:start + chunk] = u if s is None else u * s
                if need_s:
                    grad_s += (u.to(acc) * xc.to(acc)).sum()
            if need_w:
                if mm == acc:
                    grad_w.addmm_(dl.T, xc)
                else:
                    grad_w += dl.to(mm).T @ xc
        if need_w and s is not None:
            grad_w.mul_(s)
    return total, (grad_x, grad_w, grad_s, grad_b)


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss in forward together with its gradients (see the module docstring); backward scales them."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, targets, ignore_index, chunk):
        total, grads = _chunked(x, weight, scale, bias, targets, ignore_index, chunk, tuple(ctx.needs_input_grad[:4]))
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
        return (*out, None, None, None)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                         ignore_index: int = -100, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Summed cross-entropy of ``logits = s·(x Wᵀ) + b`` over the rows whose target is not ``ignore_index``,
    computed ``chunk_size`` rows at a time without the ``[N, V]`` logits (see the module docstring).

    Args:
        x: ``[N, D]`` features. weight: ``[V, D]``. targets: ``[N]`` integer class ids or ``ignore_index``.
        scale: optional 0-dim logit scale ``s`` (differentiable). bias: optional ``[V]`` logit bias.
        chunk_size: rows per chunk (default :func:`default_chunk_size` of ``V``).

    Returns a 0-dim tensor, fp32 (fp64 for fp64 inputs); divide by the number of labelled tokens for the mean.
    Equal to :func:`linear_cross_entropy_reference` in loss and in the gradients of ``x``, ``weight``,
    ``scale`` and ``bias``.
    """
    _check(x, weight, targets, scale, bias)
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    targets = targets.to(x.device)
    inputs = (x, weight, scale, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _LinearCrossEntropy.apply(x, weight, scale, bias, targets, ignore_index, chunk)
    return _chunked(x, weight, scale, bias, targets, ignore_index, chunk, (False,) * 4)[0]


__all__ = ["CHUNK_ELEMENTS", "default_chunk_size", "linear_cross_entropy", "linear_cross_entropy_reference"]
