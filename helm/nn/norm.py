"""RMSNorm_L (paper Eq. 7)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..manifold.math import lift
from ..precision import to_stat
from .storage import RealignAfterLoading


class LorentzRMSNorm(RealignAfterLoading, nn.Module):
    """``RMSNorm_L(x) = lift(g ⊙ x_s / sqrt(mean(x_s²) + eps))``.

    The space part is normalised in fp32 and the time coordinate recomputed, so the output lies on
    ``H_k``. Invariant to any positive scaling of ``x_s`` (paper Prop. 4.5) up to ``eps``; the default
    ``eps = 1e-12`` keeps the invariance at fp32 resolution for space-part RMS down to about ``1e-3`` (configs
    keep it in ``(0, 1e-2]``, :data:`helm.nn.validation.NORM_EPS_RANGE`).
    (The paper writes ``sqrt(||·|| - 1/K)`` for the time coordinate, dropping a square; we lift.)

    Shapes: ``[..., 1+n] -> [..., 1+n]``.
    """

    def __init__(self, hidden_size: int, *, k: float = 1.0, eps: float = 1e-12):
        super().__init__()
        self.eps = float(eps)
        self.k = float(k)
        self.weight = nn.Parameter(torch.ones(hidden_size - 1))

    def forward(self, x: torch.Tensor, *, k: Optional[torch.Tensor] = None) -> torch.Tensor:
        x_s = to_stat(x[..., 1:]).contiguous()  # statistics dtype (helm.precision); one strided pass, then none
        y_s = F.rms_norm(x_s, (x_s.shape[-1],), self.weight.to(x_s.dtype), self.eps)
        return lift(y_s, k=self.k if k is None else k)

    def extra_repr(self) -> str:
        return f"{self.weight.numel() + 1}, k={self.k:g}, eps={self.eps:g}"
