"""Lorentz-manifold core: pure functions (:mod:`helm.manifold.math`) and a thin geoopt-backed class."""

from .math import (
    centroid,
    check_k,
    curvature_to_k,
    dist,
    expmap0,
    hcat,
    inner,
    k_to_curvature,
    lift,
    logmap0,
    manifold_error,
    normalize,
    origin,
    rescale,
    sqdist,
    sqdist_one_pass,
    sqnorm,
)
from .lorentz import Lorentz

__all__ = [
    "Lorentz",
    "centroid",
    "check_k",
    "curvature_to_k",
    "dist",
    "expmap0",
    "hcat",
    "inner",
    "k_to_curvature",
    "lift",
    "logmap0",
    "manifold_error",
    "normalize",
    "origin",
    "rescale",
    "sqdist",
    "sqdist_one_pass",
    "sqnorm",
]
