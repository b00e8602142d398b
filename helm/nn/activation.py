"""HRC activation: ``f_L(x) = lift(f(x_s))``."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..manifold.math import lift

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Euclidean activation by name (a key of :data:`ACTIVATIONS`)."""
    return ACTIVATIONS[name]


class LorentzActivation(nn.Module):
    """Apply a Euclidean activation to the space part and recompute the time coordinate.

    Args:
        activation: a name from :data:`ACTIVATIONS` or any callable on tensors.
        k: curvature parameter.

    Shapes: ``[..., 1+n] -> [..., 1+n]``.
    """

    def __init__(self, activation: Union[str, Callable[[torch.Tensor], torch.Tensor]] = "silu", *, k: float = 1.0):
        super().__init__()
        self.k = float(k)
        self.name = activation if isinstance(activation, str) else getattr(activation, "__name__", "custom")
        self.fn = get_activation(activation) if isinstance(activation, str) else activation

    def forward(self, x: torch.Tensor, *, k: Optional[torch.Tensor] = None) -> torch.Tensor:
        return lift(self.fn(x[..., 1:]), k=self.k if k is None else k)

    def extra_repr(self) -> str:
        return f"{self.name}, k={self.k:g}"
