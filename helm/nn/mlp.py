"""Hyperbolic SwiGLU (paper App. B.3)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..manifold.math import lift
from .activation import get_activation
from .linear import linear_space, lorentz_linear, space_linear
from .storage import RealignAfterLoading


class LorentzSwiGLU(RealignAfterLoading, nn.Module):
    """``y = act(HLT_gate(x)_s) ⊙ HLT_up(x)_s``, ``out = HLT_down(lift(y))``.

    The space part of a lifted HLT output is ``W x + b`` itself, so the gate and up projections are
    never lifted (same result, no wasted square roots). Llama's names: ``gate_proj``, ``up_proj``,
    ``down_proj``.

    Args:
        hidden_size: ambient dim ``1+n``.
        intermediate_size: ambient dim ``1+m`` of the inner point.
        k: curvature parameter; ``forward(x, k=...)`` overrides it (MiCE experts on their own curvature).
        hidden_act: gate activation (default ``silu``).
        bias: biases in the three HLTs (the official code uses them).

    Shapes: ``[..., 1+n] -> [..., 1+n]``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, k: float = 1.0, hidden_act: str = "silu",
                 bias: bool = True):
        super().__init__()
        self.k = float(k)
        self.act = get_activation(hidden_act)
        self.gate_proj = space_linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = space_linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = space_linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, *, k: Optional[torch.Tensor] = None) -> torch.Tensor:
        kk = self.k if k is None else k
        y = self.act(linear_space(self.gate_proj, x)) * linear_space(self.up_proj, x)
        return lorentz_linear(self.down_proj, lift(y, k=kk), k=kk)
