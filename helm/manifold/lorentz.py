"""A thin :class:`geoopt.Lorentz` subclass that delegates to :mod:`helm.manifold.math`.

It is what ``ManifoldParameter`` embedding tables carry, so geoopt's Riemannian optimisers (``projx``,
``egrad2rgrad``, ``retr``) work unchanged, while distances and maps agree with the functional core.
"""

from __future__ import annotations

import warnings

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import geoopt

from .math import centroid, check_k, dist, expmap0, lift, logmap0, manifold_error, sqdist


class Lorentz(geoopt.Lorentz):
    """Hyperboloid ``<x, x>_L = -k`` (geoopt's ``k = -1/K``) with the project's numerics.

    Only methods whose meaning matches geoopt's are overridden; the rest (tangent projection, Riemannian
    gradient, retraction) are geoopt's own, so optimisers behave exactly as with ``geoopt.Lorentz``.
    """

    def __init__(self, k: float = 1.0, learnable: bool = False):
        check_k(k)
        super().__init__(k=k, learnable=learnable)

    def dist(self, x: torch.Tensor, y: torch.Tensor, *, keepdim: bool = False, dim: int = -1) -> torch.Tensor:
        return dist(x, y, k=self.k, keepdim=keepdim)

    def expmap0(self, u: torch.Tensor, *, project: bool = True, dim: int = -1) -> torch.Tensor:
        return expmap0(u, k=self.k)

    def logmap0(self, x: torch.Tensor, *, dim: int = -1) -> torch.Tensor:
        return logmap0(x, k=self.k)

    def sqdist(self, x: torch.Tensor, y: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
        return sqdist(x, y, k=self.k, keepdim=keepdim)

    def lift(self, x_s: torch.Tensor) -> torch.Tensor:
        return lift(x_s, k=self.k)

    def centroid(self, x: torch.Tensor, w: torch.Tensor | None = None, *, dim: int = -2) -> torch.Tensor:
        return centroid(x, w, k=self.k, dim=dim)

    def manifold_error(self, x: torch.Tensor) -> torch.Tensor:
        return manifold_error(x, self.k)

    def extra_repr(self) -> str:
        return f"k={float(self.k):g}"
