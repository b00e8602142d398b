"""RMSNorm_L (paper Eq. 7)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..manifold.math import lift
from ..precision import to_stat
from .validation import check, check_dim, check_k, norm_eps
from .storage import RealignAfterLoading


class LorentzRMSNorm(RealignAfterLoading, nn.Module):
    """``RMSNorm_L(x) = lift(g ⊙ x_s / sqrt(mean(x_s²) + eps))``.

    The space part is normalised in fp32 and the time coordinate recomputed, so the output lies on
    ``H_k``. Invariant to any positive scaling of ``x_s`` (paper Prop. 4.5) up to ``eps``; the default
    ``eps = 1e-12`` keeps the invariance at fp32 resolution for space-part RMS down to about ``1e-3``; ``eps``
    must lie in ``(0, 1e-2]`` (:data:`helm.nn.validation.NORM_EPS_RANGE`).
    (The paper writes ``sqrt(||·|| - 1/K)`` for the time coordinate, dropping a square; we lift.)

    Shapes: ``[..., 1+n] -> [..., 1+n]``.
    """

    def __init__(self, hidden_size: int, *, k: float = 1.0, eps: float = 1e-12):
        super().__init__()
        check_dim(hidden_size, "hidden_size", minimum=2)
        check_k(k, "k")
        self.eps = float(check(eps, "eps", norm_eps))
        self.k = float(k)
        self.weight = nn.Parameter(torch.ones(hidden_size - 1))

    def forward(self, x: torch.Tensor, *, k: Optional[torch.Tensor] = None) -> torch.Tensor:
        kk = self.k if k is None else k
        x = to_stat(x)  # RMS statistics in the statistics dtype (helm.precision)
        weight = self.weight.to(x.dtype)
        if (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
                and not (isinstance(kk, torch.Tensor) and kk.requires_grad)):
            return _RMSNormLift.apply(x, weight, self.eps, kk)
        return _rms_norm_lift(x, weight, self.eps, kk)

    def extra_repr(self) -> str:
        return f"{self.weight.numel() + 1}, k={self.k:g}, eps={self.eps:g}"


def _rms_norm_lift(x: torch.Tensor, weight: torch.Tensor, eps: float, k) -> torch.Tensor:
    """``lift(g ⊙ x_s / sqrt(mean(x_s²) + eps))`` for points ``x [..., 1+n]``."""
    x_s = x[..., 1:]
    return lift(F.rms_norm(x_s, (x_s.shape[-1],), weight, eps), k=k)


class _RMSNormLift(torch.autograd.Function):
    """:func:`_rms_norm_lift` (bitwise its forward) with one fused backward: the lift's
    ``∂/∂y_s = G_s + (G_t / y_t) y_s``, then RMSNorm's ``∂/∂x_s = r (ĝ - x̂ mean(ĝ ⊙ x̂))`` with ``x̂ = r x_s``,
    ``ĝ = g ⊙ ∂/∂y_s``, ``r = 1/sqrt(mean(x_s²) + eps)``, padded with a zero column into the gradient of the whole
    point (the norm reads the space part only). Autograd's chain through the slice, the normalisation's
    pow/mean/rsqrt/mul and the lift takes about twice the passes over ``[..., n]``. A tensor ``k`` that needs a
    gradient takes the plain path. Not twice differentiable."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, k) -> torch.Tensor:
        out = _rms_norm_lift(x, weight, eps, k)
        ctx.save_for_backward(x, weight, out)
        ctx.eps = eps
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight, out = ctx.saved_tensors
        n = weight.shape[-1]
        x_s = x[..., 1:]
        g_t, g_s = grad.split([1, n], dim=-1)
        y_t, y_s = out.split([1, n], dim=-1)
        grad_y = torch.addcmul(g_s, g_t / y_t, y_s)
        r = torch.rsqrt(x_s.square().mean(-1, keepdim=True) + ctx.eps)
        x_hat = x_s * r
        grad_w = (grad_y * x_hat).sum_to_size(weight.shape) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            g_hat = grad_y.mul_(weight)
            dot = (g_hat * x_hat).mean(-1, keepdim=True)
            grad_x = F.pad(g_hat.addcmul_(x_hat, dot, value=-1).mul_(r), (1, 0))
        return grad_x, grad_w, None, None

