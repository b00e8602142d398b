"""HLT: the Lorentz linear layer (paper §3, App. B)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..manifold.math import lift
from .validation import check_dim, check_k

Curv = Union[float, torch.Tensor]


class LorentzLinear(nn.Module):
    """Hyperbolic linear transformation ``H^{n}_{k_in} -> H^{m}_{k_out}``.

    ``y_s = W x + b`` on the *full* input vector (time coordinate included), then
    ``y = sqrt(k_out/k_in) · lift_{k_in}(y_s) = lift_{k_out}(sqrt(k_out/k_in) · y_s)``.

    Args:
        in_features: ambient input dim ``1+n`` (time coordinate included).
        out_features: ambient output dim ``1+m``; ``W`` has shape ``[m, 1+n]``.
        k: input curvature parameter (geoopt ``k = -1/K``).
        k_out: output curvature parameter (default ``k``).
        bias: learn ``b``.

    Shapes: ``[..., 1+n] -> [..., 1+m]``.
    """

    def __init__(self, in_features: int, out_features: int, *, k: float = 1.0, k_out: Optional[float] = None,
                 bias: bool = True):
        super().__init__()
        check_dim(in_features, "in_features", minimum=2)
        check_dim(out_features, "out_features", minimum=2)
        check_k(k, "k")
        if k_out is not None:
            check_k(k_out, "k_out")
        self.in_features, self.out_features = in_features, out_features
        self.k = float(k)
        # Same object when the curvature does not change, so forward skips the scaling.
        self.k_out = self.k if k_out is None or float(k_out) == self.k else float(k_out)
        self.linear = nn.Linear(in_features, out_features - 1, bias=bias)

    def space(self, x: torch.Tensor) -> torch.Tensor:
        """``W x + b``: the output space part before lifting (``[..., m]``, in the weight's dtype)."""
        return self.linear(x.to(self.linear.weight.dtype))

    def forward(self, x: torch.Tensor, *, k: Optional[Curv] = None, k_out: Optional[Curv] = None) -> torch.Tensor:
        """``k`` / ``k_out`` override the constructor's curvatures (MiCE experts pass their own)."""
        y_s = self.space(x)
        if k is None and k_out is None:
            k_in, k_o = self.k, self.k_out
        else:
            k_in = self.k if k is None else k
            k_o = k_in if k_out is None else k_out
        if k_o is not k_in:
            y_s = y_s * (k_o / k_in) ** 0.5
        return lift(y_s, k=k_o)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, k={self.k:g}, k_out={self.k_out:g}"
