"""HLT: the Lorentz linear layer (paper §3, App. B)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..manifold.math import lift
from .storage import RealignAfterLoading

Curv = Union[float, torch.Tensor]


def space_linear(in_features: int, out_features: int, *, bias: bool = True) -> nn.Linear:
    """The Euclidean map of an HLT ``H^{n} -> H^{m}``: ``nn.Linear(1+n, m)`` (``out_features`` is ambient, ``1+m``).

    Attention and MLP layers hold their projections as these plain linears under Llama's names (``q_proj``,
    ``gate_proj``, ...) and lift with :func:`lorentz_linear`. A wrapper that adds to a linear's output (PEFT's
    LoRA, quantised linears) then changes ``W x + b`` before the lift, so the output stays on the hyperboloid.
    """
    return nn.Linear(in_features, out_features - 1, bias=bias)


def linear_input(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype ``linear`` multiplies in: its floating-point weight's (a bf16 model's GEMMs in bf16; autocast
    then casts as it does for any ``nn.Linear``). A linear whose ``weight`` is not a floating-point tensor (a
    dynamically quantised ``torch.ao`` linear, whose ``weight`` is a method returning int8 weights) takes ``x``
    as it is: such modules quantise a float input themselves."""
    weight = getattr(linear, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and x.dtype != weight.dtype:
        return x.to(weight.dtype)
    return x


def linear_space(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``W x + b`` on the full input (time coordinate included), ``[..., 1+n] -> [..., m]``, in the compute dtype of
    :mod:`helm.precision` (the weight's, or autocast's): the GEMM's output, which ``lift`` completes in fp32."""
    return linear(linear_input(linear, x))


def lorentz_linear(linear: nn.Module, x: torch.Tensor, *, k: Curv, k_out: Optional[Curv] = None) -> torch.Tensor:
    """HLT: ``y = sqrt(k_out/k) · lift_k(W x + b) = lift_{k_out}(sqrt(k_out/k) · (W x + b))``, ``[..., 1+n] ->
    [..., 1+m]``; ``k_out`` defaults to ``k`` (no scaling)."""
    y_s = linear_space(linear, x)
    if k_out is None or k_out is k:
        return lift(y_s, k=k)
    return lift(y_s * (k_out / k) ** 0.5, k=k_out)


class LorentzLinear(RealignAfterLoading, nn.Module):
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
        self.in_features, self.out_features = in_features, out_features
        self.k = float(k)
        # Same object when the curvature does not change, so forward skips the scaling.
        self.k_out = self.k if k_out is None or float(k_out) == self.k else float(k_out)
        self.linear = space_linear(in_features, out_features, bias=bias)

    def forward(self, x: torch.Tensor, *, k: Optional[Curv] = None, k_out: Optional[Curv] = None) -> torch.Tensor:
        """``k`` / ``k_out`` override the constructor's curvatures (MiCE experts pass their own). An output
        curvature not given follows the input one for a layer built with ``k_out == k`` (a map within one
        manifold), and is the constructor's ``k_out`` otherwise."""
        if k is None and k_out is None:
            return lorentz_linear(self.linear, x, k=self.k, k_out=self.k_out)
        k_in = self.k if k is None else k
        if k_out is None:
            k_out = k_in if self.k_out == self.k else self.k_out
        return lorentz_linear(self.linear, x, k=k_in, k_out=k_out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, k={self.k:g}, k_out={self.k_out:g}"
