"""Independent fp64 references written from the paper's equations (HELM, ``shared/seeds/003_*``), for tests.

Nothing here imports ``helm``: a test compares the code under test against these, so a bug in ``helm`` cannot
also be in the reference. Conventions as in the package: a point is ``[x_t, x_s]`` with ``<x, x>_L = -k``,
``k = -1/K > 0``. Every function computes in float64 and returns float64.
"""

from __future__ import annotations

import math

import torch


def minkowski(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``<x, y>_L = -x_t y_t + x_s · y_s`` over the last dimension."""
    x, y = x.double(), y.double()
    return -x[..., 0] * y[..., 0] + (x[..., 1:] * y[..., 1:]).sum(-1)


def to_hyperboloid(x_s: torch.Tensor, k: float) -> torch.Tensor:
    """``[sqrt(|x_s|² + k), x_s]``: the point of ``<x, x>_L = -k`` with space part ``x_s``."""
    x_s = x_s.double()
    return torch.cat([(x_s.pow(2).sum(-1, keepdim=True) + k).sqrt(), x_s], dim=-1)


def weighted_centroid(points: torch.Tensor, weights: torch.Tensor, k: float) -> torch.Tensor:
    """Paper Eq. 3's centroid: ``sqrt(k) · s / sqrt(|<s, s>_L|)`` with ``s = Σ_i w_i x_i``.

    ``points [..., N, 1+n]``, ``weights [..., N]`` (broadcast against the points' batch dimensions).
    """
    s = (weights.double().unsqueeze(-1) * points.double()).sum(-2)
    return math.sqrt(k) * s / minkowski(s, s).abs().sqrt().unsqueeze(-1)


def change_curvature(x: torch.Tensor, k_in: float, k_out: float) -> torch.Tensor:
    """``sqrt(k_out / k_in) · x``: maps ``<x, x>_L = -k_in`` onto ``<y, y>_L = -k_out``."""
    return math.sqrt(k_out / k_in) * x.double()
