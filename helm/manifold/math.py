"""Functional Lorentz-model math.

Conventions (README.md, Conventions; ARCHITECTURE.md for who uses what):

* A point of the hyperboloid ``H^n_k`` is a tensor ``[..., 1+n]`` with the *time* coordinate first and
  ``<x, x>_L = -k``, ``x_t > 0``. ``k > 0`` is geoopt's parameter; the paper's signed curvature is
  ``K = -1/k`` (see :func:`curvature_to_k`, the only place the two are converted).
* ``k`` is keyword-only everywhere. It is a Python float or a tensor broadcastable against ``x[..., :1]``.
* Checks read no tensor values, so they cost no device synchronisation, collective or graph break and run the
  same in a model's forward, on an accelerator and under ``torch.compile``. Every public function refuses a
  Python-number ``k`` that is not positive and finite or outside fp32's normal range ``[K_MIN, K_MAX] =
  [1.18e-38, 3.4e38]`` (where ``k`` or ``sqrt(k)`` is 0, subnormal or inf in fp32) with a ``ValueError`` naming
  ``k`` (:func:`check_k`), a tensor ``k`` whose *shape* would grow the time coordinates ``x[..., :1]`` (a ``k``
  of shape ``[n]`` would make ``n`` of them), a tensor argument that is not fp16/bf16/fp32/fp64 (``TypeError``),
  and two point arguments whose coordinates differ in number or whose batch dims do not broadcast.
* Domain of the values (the caller's contract, not checked): points of the upper sheet of ``H^n_k`` for the
  ``k`` passed, with time coordinates below ``sqrt(max)/2`` of the statistics dtype (``9.2e18`` in fp32, beyond
  which the inner products of two points overflow); tensor curvatures positive (layers make them so by
  parametrisation); centroid weights non-negative with a positive sum. Outside it the results are wrong, not
  refused: ``dist(-x, y)`` is about 0, ``logmap0(-x) = -logmap0(x)``, NaN and inf propagate.
* Precision (:mod:`helm.precision`): every function here computes in the statistics dtype, fp32 for
  fp32/bf16/fp16 inputs and fp64 for fp64 ones. What it returns: :func:`expmap0`, :func:`logmap0` and
  :func:`rescale` (maps a caller applies to its own points and tangents; no layer calls them in a forward) round
  their result once to the input's dtype. :func:`lift`, :func:`hcat`, :func:`normalize` and :func:`centroid`
  return points in the statistics dtype (the policy's layout of points between layers: a bf16 time coordinate
  would be off the hyperboloid by ``x_t² · 2^-8``, so under autocast a half-precision space part gets an fp32
  point), and :func:`inner`, :func:`sqnorm`, :func:`sqdist`, :func:`dist` statistics in the statistics dtype.
  Nothing is widened to fp64 (except the diagnostic :func:`manifold_error`): accuracy far from the origin comes
  from the formulations (difference forms for nearby points, the pairwise centroid norm), and the plain
  :func:`inner` / :func:`sqnorm` carry the fp32 rounding of their two terms (see :func:`inner`).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Union

import torch

from ..precision import to_stat

Curv = Union[float, torch.Tensor]

__all__ = [
    "positive_exp",
    "curvature_to_k",
    "k_to_curvature",
    "check_k",
    "inner",
    "sqnorm",
    "lift",
    "origin",
    "sqdist",
    "sqdist_one_pass",
    "dist",
    "expmap0",
    "logmap0",
    "normalize",
    "centroid",
    "rescale",
    "hcat",
    "manifold_error",
]


# exp(88) = 1.65e38 is the largest power of e that fp32 holds with margin (its maximum is 3.4e38 = e^88.72)
_MAX_LOG = 88.0


def positive_exp(log_value: torch.Tensor) -> torch.Tensor:
    """``exp(min(log_value, 88))`` in fp32 at least: a positive scale (temperature, curvature) from its logarithm.

    Past ``e^88`` fp32 overflows to ``inf`` and ``x / inf`` has the gradient ``0 · inf = NaN``; there every
    quantity divided by the scale is already below fp32 resolution next to O(1) terms (softmax of scores
    ``< 1e-7`` is uniform to rounding), so capping the exponent changes no representable result and keeps
    gradients finite (zero for the capped logarithm, as the exact gradient ``s · e^{-log}`` underflows too).
    """
    return to_stat(log_value).clamp(max=_MAX_LOG).exp()


def _kt(k: Curv, like: torch.Tensor, name: str = "k") -> Union[float, torch.Tensor]:
    """``k`` in the accumulation dtype of ``like`` (floats stay floats: no device transfer), checked by
    :func:`check_k` and :func:`_check_k_shape`."""
    check_k(k, name)
    _check_k_shape(k, like, name)
    if isinstance(k, torch.Tensor):
        return k.to(dtype=to_stat(like).dtype if like.is_floating_point() else k.dtype, device=like.device)
    return float(k)


def _check_k_shape(k: Curv, like: torch.Tensor, name: str = "k") -> None:
    """``ValueError`` unless a tensor ``k`` broadcasts against ``like[..., :1]`` (the time coordinates) to exactly that
    shape: a shape comparison; 0-dim tensors and numbers pass at once."""
    if not isinstance(k, torch.Tensor) or not k.dim():
        return
    time = tuple(like.shape[:-1]) + (1,)
    if k.dim() > len(time) or any(a not in (1, b) for a, b in zip(reversed(k.shape), reversed(time))):
        raise ValueError(f"{name} must broadcast against the time coordinates x[..., :1] of shape {time} (a tensor of "
                         f"shape [..., 1]) without growing them, got a tensor of shape {tuple(k.shape)}")


# the dtypes every function here takes: the statistics dtype is fp32 or fp64 (helm.precision), fp8 has no promotion
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(fn: str, name: str, t, *, what: str = "points [..., 1+n] (time coordinate first)",
                  coordinates: Optional[bool] = True) -> None:
    """``TypeError`` unless ``t`` is an fp16/bf16/fp32/fp64 tensor, ``ValueError`` if it has no last dim (or, with
    ``coordinates``, an empty one: no time coordinate; ``coordinates=None``: any shape): attribute reads only.
    ``what`` names the expected layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a floating-point torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {name} must be a floating-point tensor (float16, bfloat16, float32 or float64), got "
                        f"{t.dtype}; convert it first, e.g. {name}.float()")
    if coordinates is not None and (t.dim() == 0 or coordinates and t.shape[-1] == 0):
        got = "a 0-dim tensor" if t.dim() == 0 else f"shape {tuple(t.shape)} (no time coordinate)"
        raise ValueError(f"{fn}: {name} must be {what}, got {got}")


def _check_pair(fn: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """``ValueError`` naming both shapes unless ``x`` and ``y`` have the same number of coordinates and batch dims
    that broadcast (a shape comparison; equal shapes return at once): a ``y`` of one coordinate would broadcast
    against every coordinate of ``x``."""
    if x.shape == y.shape:
        return
    if x.shape[-1] == y.shape[-1]:
        try:
            torch.broadcast_shapes(x.shape[:-1], y.shape[:-1])
            return
        except RuntimeError:
            pass
    raise ValueError(f"{fn}: x of shape {tuple(x.shape)} and y of shape {tuple(y.shape)} must have the same number "
                     "of coordinates (last dim, 1+n) and batch dims that broadcast against each other")


def _sqrt(k: Union[float, torch.Tensor]):
    return k.sqrt() if isinstance(k, torch.Tensor) else math.sqrt(k)


# the range of k (every dtype): fp32's normal numbers. Below it k is 0 or subnormal in fp32 (a Python k = 1e-320
# became 0 in fp32 arithmetic: the origin's time coordinate sqrt(k) was 0, a point of no upper sheet), above it inf
K_MIN = torch.finfo(torch.float32).tiny
K_MAX = torch.finfo(torch.float32).max
_K_RANGE = f"[{K_MIN:.3g}, {K_MAX:.3g}], float32's normal range"


def check_k(k: Curv, name: str = "k") -> None:
    """Raise ``ValueError`` unless a Python-number ``k`` (geoopt's positive curvature parameter) is positive and
    finite in ``[K_MIN, K_MAX] = [1.18e-38, 3.4e38]``, fp32's normal range (for fp64 inputs too: a ``k`` outside it
    is 0, subnormal or inf in fp32, where the points of ``H_k`` and ``sqrt(k)`` are computed).

    A tensor ``k`` passes: reading it would synchronise with its device; tensors come from parametrisations that
    keep them positive (MiCE's experts). Layers additionally require the documented range
    (:func:`helm.nn.validation.k_parameter`)."""
    if isinstance(k, torch.Tensor):
        return
    if not (isinstance(k, numbers.Real) and not isinstance(k, bool) and math.isfinite(k) and k > 0):
        raise ValueError(f"{name} must be a positive finite number (geoopt's k = -1/K > 0), got {k!r}")
    if not K_MIN <= float(k) <= K_MAX:
        raise ValueError(f"{name} must be a positive finite number (geoopt's k = -1/K > 0) in {_K_RANGE} (beyond it "
                         f"k or sqrt(k) is 0 or inf in fp32), got {k!r}")


def curvature_to_k(curvature: float) -> float:
    """Paper curvature ``K < 0`` (``<x,x>_L = 1/K``) to geoopt's ``k = -1/K > 0``.

    This is the one place where the paper's signed curvature is converted; configs speak ``K``. ``curvature`` is a
    Python (or NumPy) real number: a tensor is a ``TypeError``, anything else that is not a negative finite number
    a ``ValueError``, and so is a ``K`` whose ``k`` is outside :func:`check_k`'s range ``[1.18e-38, 3.4e38]``
    (``K`` in ``[-8.5e37, -2.9e-39]``: ``K = -1e-320`` gave ``k = inf``).
    """
    if isinstance(curvature, torch.Tensor):
        raise TypeError("curvature must be a Python number (a float K < 0, the paper's convention), got a "
                        f"torch.Tensor of shape {tuple(curvature.shape)}; pass float(K) (configs speak numbers: a "
                        "learnable curvature is a k parametrisation, not this conversion)")
    if not (isinstance(curvature, numbers.Real) and not isinstance(curvature, bool) and math.isfinite(curvature)
            and curvature < 0):
        raise ValueError(f"curvature must be a negative finite number (paper convention K < 0), got {curvature!r}")
    value = float(curvature)  # -0.0 for a negative Fraction below float's range
    k = -1.0 / value if value else math.inf
    if not K_MIN <= k <= K_MAX:
        raise ValueError(f"curvature must be a negative finite number whose k = -1/K is in {_K_RANGE} (K in "
                         f"[{-1 / K_MIN:.3g}, {-1 / K_MAX:.3g}]), got {curvature!r} (k = {k:g})")
    return k


def k_to_curvature(k: float) -> float:
    """Inverse of :func:`curvature_to_k`: ``K = -1/k``."""
    check_k(k)
    return -1.0 / float(k)


def inner(x: torch.Tensor, y: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """Lorentz inner product ``<x, y>_L = -x_t y_t + x_s · y_s`` over the last dim, in the statistics dtype.

    Accuracy: a few roundings of the *terms*, ``|x_t y_t| + |x_s · y_s|``, i.e. a relative error of about
    ``u · κ`` with ``κ = (|x_t y_t| + |x_s||y_s|) / |<x, y>_L|`` (``u = 6e-8`` in fp32). Far from the origin the two
    terms cancel for nearby points (``<x, y>_L ≈ -k - d²/2`` while each term is ``≈ r²``: ``κ = 1e8`` at
    ``r = 1e4``), so no fixed-precision evaluation of this form is accurate there; callers that need the small
    result use a difference form instead (:func:`sqdist`, the pairwise norm of :func:`centroid`, attention's
    centred values). Shapes: ``x, y`` broadcastable ``[..., 1+n]`` -> ``[...]`` (``[..., 1]`` with ``keepdim``);
    the same number of coordinates and broadcastable batch dims, else ``ValueError`` naming both shapes. Any
    vectors (not only points); coordinates past ``sqrt(max)`` of the statistics dtype (``1.8e19`` in fp32) give
    an infinite product.
    """
    return _checked_inner("inner", x, y, keepdim)


def _checked_inner(fn: str, x: torch.Tensor, y: torch.Tensor, keepdim: bool) -> torch.Tensor:
    """:func:`inner` (``y is x``: :func:`sqnorm`) with its checks, messages naming the public ``fn``."""
    same = y is x  # sqnorm: one cast
    _check_tensor(fn, "x", x)
    if not same:
        _check_tensor(fn, "y", y)
        _check_pair(fn, x, y)
    x = to_stat(x)
    y = x if same else to_stat(y)
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        out = _Inner.apply(x, None if same else y)
    else:
        out = _inner(x, x if same else y, same)
    return out if keepdim else out.squeeze(-1)


def _inner(x: torch.Tensor, y: torch.Tensor, same: bool) -> torch.Tensor:
    """``<x, y>_L`` as ``[..., 1]``: one product, split (not sliced twice), the space sum less the time product."""
    prod = x.square() if same else x * y
    time, space = prod.split([1, prod.shape[-1] - 1], dim=-1)
    return space.sum(-1, keepdim=True) - time


def _minkowski_scaled(x: torch.Tensor, g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``g · J x`` (``J = diag(-1, 1, ..., 1)``) summed to ``like``'s shape (undoing broadcasting): the gradient of
    ``<x, y>_L`` with respect to ``y``, for the output gradient ``g [..., 1]``. One product, then a sign flip of one
    column in place."""
    out = x * g
    out[..., :1].neg_()
    return out if out.shape == like.shape else out.sum_to_size(like.shape)


class _Inner(torch.autograd.Function):
    """:func:`inner` (``y`` None: :func:`sqnorm`) with a fused gradient, ``∂<x, y>_L/∂x = g · J y`` (``2 g · J x`` for
    the square): one product per input where autograd's chain through ``mul``/``pow``, ``split``, ``sum`` and ``sub``
    writes a product, a zero-filled concatenation and a negation. Forward bitwise :func:`_inner`; not twice
    differentiable."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y) -> torch.Tensor:
        ctx.save_for_backward(x, y)
        return _inner(x, x if y is None else y, y is None)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, y = ctx.saved_tensors
        if y is None:
            return _minkowski_scaled(x, 2 * grad, x), None
        grad_x = _minkowski_scaled(y, grad, x) if ctx.needs_input_grad[0] else None
        grad_y = _minkowski_scaled(x, grad, y) if ctx.needs_input_grad[1] else None
        return grad_x, grad_y


def sqnorm(x: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """Squared Minkowski norm ``<x, x>_L`` (``-k`` on ``H^n_k``; negative for time-like vectors), as :func:`inner`."""
    return _checked_inner("sqnorm", x, x, keepdim)


def lift(x_s: torch.Tensor, *, k: Curv) -> torch.Tensor:
    """Space part to point: ``lift(x_s) = [sqrt(|x_s|^2 + k), x_s]``.

    The "HRC" pattern: any Euclidean op on the space part followed by ``lift`` stays on ``H^n_k``.
    Shapes: ``[..., n] -> [..., 1+n]`` (``n >= 0``; a 0-dim ``x_s`` is a ``ValueError``); the result is in the
    statistics dtype (fp32 for bf16/fp16 space parts, the precision policy's points) so the time coordinate keeps
    its precision under bf16 autocast. Range: ``|x_s|² + k`` must be finite in the statistics dtype,
    ``|x_s| < 1.8e19`` in fp32 (``1.3e154`` in fp64); beyond, the time coordinate is ``inf``.
    """
    _check_tensor("lift", "x_s", x_s, what="space parts [..., n] (at least one dim: x_s[..., None] for n = 1)",
                  coordinates=False)
    x_s = to_stat(x_s)
    return _lift(x_s, _kt(k, x_s))


def _lift(x_s: torch.Tensor, kk: Union[float, torch.Tensor]) -> torch.Tensor:
    """:func:`lift` of a statistics-dtype ``x_s`` with ``kk`` from :func:`_kt`, unchecked."""
    if torch.is_grad_enabled() and (x_s.requires_grad or isinstance(kk, torch.Tensor) and kk.requires_grad):
        return _Lift.apply(x_s, kk)
    x_t = (x_s.square().sum(-1, keepdim=True) + kk).sqrt()
    return torch.cat([x_t, x_s], dim=-1)


class _Lift(torch.autograd.Function):
    """:func:`lift` with a fused gradient, ``∂/∂x_s = g_s + (g_t / x_t) x_s`` and ``∂/∂k = Σ g_t / (2 x_t)``: one
    pass where autograd's chain through ``square``, ``sum``, ``sqrt`` and ``cat`` takes four, over whole rows of the
    saved point ``[..., 1+n]`` (column 0 dropped after): the slice ``g_s``, one element into each row, would take
    PyTorch's strided path (no vectorised loads). Used when a gradient is needed; not twice differentiable."""

    @staticmethod
    def forward(ctx, x_s: torch.Tensor, k) -> torch.Tensor:
        x = torch.cat([(x_s.square().sum(-1, keepdim=True) + k).sqrt(), x_s], dim=-1)
        ctx.save_for_backward(x)
        ctx.k_shape = k.shape if isinstance(k, torch.Tensor) else None
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, = ctx.saved_tensors
        h = grad[..., :1] / x[..., :1]
        grad_x = torch.addcmul(grad, h, x)[..., 1:] if ctx.needs_input_grad[0] else None
        grad_k = (h / 2).sum_to_size(ctx.k_shape) if ctx.needs_input_grad[1] else None
        return grad_x, grad_k


def origin(*size: int, k: Curv, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """The origin ``(sqrt(k), 0, ..., 0)`` of ``H^n_k``; ``size`` includes the time coordinate (``1+n``).

    ``size``: non-negative ints (or one tuple of them), at least one, the last (``1+n``) at least 1, else a
    ``ValueError`` naming ``size``; ``dtype``: None (the default dtype) or fp16/bf16/fp32/fp64, else a ``TypeError``
    (an integer origin ``(round(sqrt k), 0, ...)`` is on no hyperboloid). The time coordinate ``sqrt(k)`` of a
    Python-number ``k`` must be a normal number of ``dtype`` (``ValueError`` naming ``k`` otherwise: fp16 holds
    ``k`` in ``[3.7e-9, 4.3e9]`` only), never 0 or inf."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not size or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in size) \
            or size[-1] < 1:
        raise ValueError(f"origin: size must be non-negative ints [..., 1+n], the last (1+n, time coordinate "
                         f"included) at least 1, got size {size!r}")
    if dtype is not None and dtype not in _FLOATS:
        raise TypeError(f"origin: dtype must be None or a floating-point dtype (float16, bfloat16, float32 or "
                        f"float64), got {dtype}")
    out = torch.zeros(*size, dtype=dtype, device=device)
    kk = _kt(k, out)
    info = torch.finfo(out.dtype)
    if not isinstance(kk, torch.Tensor) and not info.tiny <= math.sqrt(kk) <= info.max:
        raise ValueError(f"origin: k = {k!r} has no origin in {str(out.dtype).removeprefix('torch.')}: its time "
                         f"coordinate sqrt(k) = {math.sqrt(kk):.3g} is outside that dtype's normal range "
                         f"[{info.tiny:.3g}, {info.max:.3g}] (k in [{info.tiny ** 2:.3g}, {info.max ** 2:.3g}])")
    out[..., :1] = _sqrt(kk)  # a tensor k is shaped like the time coordinates [..., 1]
    return out


def sqdist(x: torch.Tensor, y: torch.Tensor, *, k: Curv, keepdim: bool = False) -> torch.Tensor:
    """Squared Lorentz distance ``d²(x, y) = <x-y, x-y>_L = -2k - 2<x, y>_L`` (paper: ``2/K - 2<x,y>_L``).

    ``x`` and ``y``: points of ``H^n_k`` (the module's domain) with the same number of coordinates and
    broadcastable batch dims (``ValueError`` naming both shapes). Returns the statistics dtype, ``>= 0``.

    Accuracy (:func:`_sqdist_accurate`): backward stable in the statistics dtype for every pair of points, also
    nearby points far from the origin, where ``<x-y, x-y>_L`` of the stored coordinates loses everything (at
    ``|x_s| = 1e4`` in fp32 the time coordinates carry a rounding of ``1e-3``, more than the distance of points
    ``1e-4`` apart, and that form gave ``0``). Measured against fp64 on the same fp32 inputs over space-part norms
    ``1..1e4`` and separations ``1e-4..1e4``: a relative error of a few ``u`` (``u = 2^-24``), except for nearby
    points on one ray from the origin, where the distance itself moves by up to ``u · |x_s + y_s| / sqrt(k)`` of
    itself under a one-ulp rotation of an input and the error stays below that
    (``tests/reliability/test_numerics.py``).

    The layers (the Lorentz residual, MiCE's mixture) call :func:`sqdist_one_pass` instead: they add ``w · d²`` to
    ``k (1 + w)²``, where its absolute rounding, ``u · |x - y| · (|x| + |y|)``, is what their normalisation can use,
    and this form costs about 6x that pass (forward and backward) on the CPU.
    """
    d2, _ = _checked_sqdist("sqdist", x, y, k)
    return d2 if keepdim else d2.squeeze(-1)


def _checked_sqdist(name: str, x: torch.Tensor, y: torch.Tensor, k: Curv) -> tuple:
    """``(d² [..., 1], k)`` for the public ``name`` (:func:`sqdist`, :func:`dist`): its arguments checked, then
    :func:`_sqdist_accurate`; ``k`` in the statistics dtype."""
    _check_tensor(name, "x", x)
    _check_tensor(name, "y", y)
    _check_pair(name, x, y)
    kk = _kt(k, to_stat(x))
    return _sqdist_accurate(x, y, kk), kk


def sqdist_one_pass(x: torch.Tensor, y: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """``d²(x, y)`` as ``<x-y, x-y>_L`` clamped at 0, in the statistics dtype: one pass, accurate to
    ``u · |x - y| · (|x| + |y|)`` absolute (the rounding of the stored time coordinates), not relative to ``d²``
    itself as :func:`sqdist` is (far out, nearby points can get 0). The form of the layers' hot path and
    :func:`centroid`'s pairwise norm, which add it to ``k (Σ w)²``, where that absolute rounding is what they can
    use."""
    return sqnorm(to_stat(x) - to_stat(y), keepdim=keepdim).clamp_min(0)


def _sqdist_accurate(x: torch.Tensor, y: torch.Tensor, kk: Union[float, torch.Tensor]) -> torch.Tensor:
    """``d²(x, y)`` as ``[..., 1]`` in the statistics dtype, unchecked, from one of two forms chosen per pair by
    which is better conditioned (both exact for points of ``H_k``; ``Δ = x_s - y_s``, ``Σ = x_s + y_s``,
    ``p = x_s · y_s``, ``τ = x_t y_t``):

    * apart, ``τ - k - p >= (τ + |p|) / 4``: the inner-product form ``2 (τ - k - p)``, whose terms cancel by at most
      a factor 4 there;
    * nearby (the rest, including every pair of points near the origin and every pair closer than about its norm):
      ``d² = ((|Σ|² + 4k) |Δ|² - (Δ·Σ)²) / (2 (k + τ + p))``, from ``(τ - k - p)(τ + k + p) = τ² - (k + p)²``
      and ``x_t² = |x_s|² + k`` (Lagrange's identity turns ``|x_s|²|y_s|² - p²`` into ``(|Σ|²|Δ|² - (Δ·Σ)²)/4``).
      The denominator has no cancellation there (it is at least ``5k/3``), the stored time coordinates enter only
      as a relative factor, and the numerator is evaluated without cancellation as
      ``|Σ|² |Δ - cΣ|² - (ck)² + 4k |Δ|²`` with ``c = Δ·Σ / (|Σ|² + k)`` (a projection of ``Δ`` off ``Σ``; the
      ``+k`` keeps it finite at ``Σ = 0`` and the ``(ck)²`` term, at most ``k|Δ|²/4``, undoes it exactly).

    Every quantity is finite for finite points with time coordinates below ``9.2e18`` (fp32: the module's domain)
    for every ``k`` of :func:`check_k`'s range (``k |Δ|²`` and ``(ck)²`` enter as ratios to the denominator) and so is
    its gradient, also at ``x = y`` (the gradient is 0 there): the form not selected gets safe operands."""
    x, y = to_stat(x), to_stat(y)
    xt, xs = x[..., :1], x[..., 1:]
    yt, ys = y[..., :1], y[..., 1:]
    delta, sigma = xs - ys, xs + ys
    dd = delta.square().sum(-1, keepdim=True)
    ss = sigma.square().sum(-1, keepdim=True)
    ds = (delta * sigma).sum(-1, keepdim=True)
    p = (xs * ys).sum(-1, keepdim=True)
    tt = xt * yt
    apart = 4 * (tt - kk - p) >= tt + p.abs()
    den = kk + tt + torch.where(apart, torch.zeros_like(p), p)  # >= k + τ > 0 where not selected
    c = ds / (ss + kk)
    perp = torch.addcmul(delta, c, sigma, value=-1)
    # ratios to den first: k |Δ|² and (ck)² themselves overflowed fp32 for large k (k = 1e30: inf - inf = NaN)
    kd = kk / den  # <= 1
    near = ((ss / den) * perp.square().sum(-1, keepdim=True) - (c * (c * kk)) * kd + (4 * kd) * dd) / 2
    return torch.where(apart, 2 * (tt - kk - p), near).clamp_min(0)


def dist(x: torch.Tensor, y: torch.Tensor, *, k: Curv, keepdim: bool = False) -> torch.Tensor:
    """Geodesic distance ``sqrt(k) · arcosh(-<x, y>_L / k)``.

    Evaluated as ``2 sqrt(k) · asinh(sqrt(d²/(4k)))`` (since ``d² = 4k sinh²(d/(2 sqrt k))``) from :func:`sqdist`,
    which is exact at ``x = y`` where ``arcosh`` has an infinite slope (finite gradient there: 0) and keeps
    :func:`sqdist`'s accuracy, also for nearby points far from the origin. For analysis and tests, not the forward
    pass. Points of ``H^n_k`` only, shapes as :func:`sqdist` (checked as there). Returns the statistics dtype.
    """
    d2, kk = _checked_sqdist("dist", x, y, k)
    tiny = torch.finfo(d2.dtype).tiny
    # sqrt(d²) / (2 sqrt k), not sqrt(d² / 4k): d² / 4k overflowed fp32 for small k (k = 1e-30, |x_s| = 1e5: inf)
    sk = _sqrt(kk)
    out = 2 * sk * torch.asinh(d2.clamp_min(tiny).sqrt() / (2 * sk))
    out = torch.where(d2 == 0, torch.zeros_like(out), out)  # exactly 0 (not sqrt(tiny)) for equal points; NaN stays
    return out if keepdim else out.squeeze(-1)


def expmap0(u: torch.Tensor, *, k: Curv) -> torch.Tensor:
    """Exponential map at the origin for a tangent vector ``u = [0, u_s]`` (``u_t`` is ignored).

    ``exp_o(u) = [sqrt(k) cosh(|u_s|/sqrt k), sqrt(k) sinh(|u_s|/sqrt k) u_s / |u_s|]``; the space part
    uses ``sinh(θ)/θ`` (exactly 1 at ``θ = 0``) and the time part is recomputed by :func:`lift`.

    Far out (``θ = |u_s|/sqrt k > 20``, where ``cosh θ = sinh θ = e^θ/2`` to fp64 precision) ``sinh θ``, the
    squared norm in :func:`lift` and ``sinh(θ)/θ · u_s`` would overflow long before the point does (fp32:
    ``sinh`` at ``θ ≈ 89``, ``|x_s|²`` at ``|x_s| ≈ 1.8e19``, then ``inf · 0 = nan`` for zero coordinates).
    There the point is ``s · [|d|, d]`` with ``s = exp(θ - log 2 + log sqrt k)`` and ``d = u_s / |u_s|`` (no square
    of a large number), so it is finite (with finite gradients) whenever it is representable; beyond the dtype's
    range its time and non-zero coordinates are ``±inf`` and its zero coordinates 0, never ``nan`` (also when
    ``|u_s|`` itself overflows: then the time coordinate is ``inf`` and the space part 0).

    Exact range: the result is finite, to a few roundings, for ``θ = |u_s|/sqrt(k) < log(2·max/sqrt(k))``, ``max``
    the largest number of the *output* dtype, ``u``'s (computed in the statistics dtype, rounded once to ``u``'s
    dtype at the end): fp32 and bf16 ``θ < 89.41 - ½ log k`` (so a tangent of norm 200 at ``k = 1`` is past it:
    ``inf`` coordinates, the point ``e^200`` away is not an fp32 number), fp16 ``θ < 11.78 - ½ log k``, fp64
    ``θ < 710.47 - ½ log k``. Layers never come near it (their tables sit at ``θ <= 40``, see ``HelmConfigBase``).
    Shapes: ``[..., 1+n] -> [..., 1+n]``, in ``u``'s dtype.
    """
    _check_tensor("expmap0", "u", u, what="a tangent vector [..., 1+n] at the origin, [0, u_s]")
    u_s = to_stat(u[..., 1:])
    kk = _kt(k, u_s)
    sk = _sqrt(kk)
    norm = u_s.norm(dim=-1, keepdim=True)
    theta = norm / sk
    small = theta < 1e-4
    big = theta > 20.0
    safe = torch.where(small | big, torch.ones_like(theta), theta)
    ratio = torch.where(small, 1 + theta.square() / 6, torch.sinh(safe) / safe)
    near = _lift(ratio * u_s, kk)  # where big it is not selected and may overflow
    # far branch, with safe arguments where it is not selected (no inf/nan in either pass)
    log_sk = sk.log() if isinstance(sk, torch.Tensor) else math.log(sk)
    scale = torch.exp(torch.where(big, theta, torch.full_like(theta, 20.0)) - math.log(2.0) + log_sk)
    direction = u_s / torch.where(big, norm, torch.ones_like(norm))
    far_s = scale * direction
    far_s = torch.where(torch.isinf(scale) & (direction == 0), torch.zeros_like(far_s), far_s)  # not inf·0
    # x_t = sqrt(|x_s|² + k) = |x_s| = scale (|direction| = 1) to within k/|x_s|² < 1e-17 here; scale itself, not
    # scale·|direction|, so an overflowing |u_s| (direction 0) gives inf, not inf·0 = nan
    far = torch.cat([scale, far_s], dim=-1)
    return torch.where(big, far, near).to(u.dtype)


def logmap0(x: torch.Tensor, *, k: Curv) -> torch.Tensor:
    """Logarithmic map at the origin: ``[0, (θ / sinh θ) x_s]`` with ``θ = asinh(|x_s| / sqrt k)``.

    Inverse of :func:`expmap0`; exact at the origin (``θ/sinh θ -> 1``). Shapes: ``[..., 1+n]``; computed in the
    statistics dtype, returned in ``x``'s dtype. Only the space part is read, so ``x`` must be a point of
    ``H^n_k`` for this ``k`` (``logmap0(-x)`` is ``-logmap0(x)``, and a point of another curvature gives the
    tangent of another point).
    """
    _check_tensor("logmap0", "x", x)
    x_s = to_stat(x[..., 1:])
    r = x_s.norm(dim=-1, keepdim=True) / _sqrt(_kt(k, x_s))
    small = r < 1e-4
    safe = torch.where(small, torch.ones_like(r), r)
    ratio = torch.where(small, 1 - r.square() / 6, torch.asinh(safe) / safe)
    return torch.cat([torch.zeros_like(r), ratio * x_s], dim=-1).to(x.dtype)


def normalize(s: torch.Tensor, *, k: Curv, floor: Union[float, torch.Tensor, None] = None,
              norm2: torch.Tensor | None = None) -> torch.Tensor:
    """Project a future-pointing time-like vector onto ``H^n_k``: ``sqrt(k) · s / sqrt(|<s, s>_L|)``.

    ``|<s, s>_L| = s_t² - |s_s|²`` cancels catastrophically when ``s`` is close to the light cone or to a scaled
    hyperboloid far from the origin (``s = 2.5 x`` at ``|x_s| = 1e3`` loses 5% in fp32: the relative error of
    :func:`sqnorm` is ``u · (s_t² + |s_s|²) / |<s, s>_L|``). ``norm2`` is ``|<s, s>_L|`` from a better-conditioned
    expression the caller knows (the pairwise form of :func:`centroid`, the Lorentz residual's
    ``k (1 + w)² + w d²``, attention's and MiCE's centred sums): every layer passes one; without it the norm is
    computed from ``s``, accurate near the origin only. ``floor`` is a lower bound on it known from the
    math. The time coordinate of the result is recomputed from its space part, so the output is on the
    manifold to rounding. Shapes: ``[..., 1+n] -> [..., 1+n]``, a point in the statistics dtype.

    Domain (not read): ``s`` future-pointing (``s_t > 0``: only the space part is read, so a past-pointing ``s``
    lands on the reflected point), time-like (a space-like ``s`` lands on the point of its space part's direction)
    and finite; ``norm2`` positive (non-negative with a positive ``floor``); a zero norm without a floor gives
    ``inf``. Checked: ``floor`` None, a non-negative finite number or a tensor, and ``norm2`` None or a
    floating-point tensor, each tensor broadcasting against the time coordinates ``s[..., :1]`` without growing
    them (``TypeError`` / ``ValueError`` naming the argument).
    """
    _check_tensor("normalize", "s", s)
    s = to_stat(s)
    _check_floor(floor, s)
    if norm2 is not None:
        _check_tensor("normalize", "norm2", norm2, what="a tensor [..., 1] (|<s, s>_L| per row)", coordinates=None)
        _check_k_shape(norm2, s, "normalize: norm2")
    kk = _kt(k, s)
    if norm2 is None:
        norm2 = sqnorm(s, keepdim=True).abs()
    if floor is not None:
        norm2 = norm2.clamp_min(floor) if not isinstance(floor, torch.Tensor) else torch.maximum(norm2, floor)
    return _lift(s[..., 1:] * (_sqrt(kk) * norm2.rsqrt()), kk)


def _check_floor(floor, like: torch.Tensor) -> None:
    """:func:`normalize`'s ``floor``: ``ValueError`` unless None, a non-negative finite number, or a tensor shaped
    like the time coordinates of ``like`` (its values are not read). A NaN floor made every result NaN; a negative
    one is no bound on the non-negative ``|<s, s>_L|``."""
    if floor is None:
        return
    if isinstance(floor, torch.Tensor):
        _check_tensor("normalize", "floor", floor, what="a number or a tensor [..., 1]", coordinates=False)
        _check_k_shape(floor, like, "normalize: floor")
        return
    if not (isinstance(floor, numbers.Real) and not isinstance(floor, bool) and math.isfinite(floor) and floor >= 0):
        raise ValueError(f"normalize: floor must be None or a non-negative finite number (a lower bound on "
                         f"|<s, s>_L|), got {floor!r}")


def centroid(x: torch.Tensor, w: torch.Tensor | None = None, *, k: Curv, dim: int = -2) -> torch.Tensor:
    """Weighted Lorentz centroid (paper Eq. 3): ``sqrt(k) · s / sqrt(|<s, s>_L|)``, ``s = Σ w_i x_i``.

    ``x``: points of ``H^n_k`` ``[..., N, ..., 1+n]`` stacked along ``dim``; ``w``: non-negative weights
    broadcastable to ``x``'s shape minus the last dim (default: uniform ``1/N``), summing to a positive number for
    every centroid (not read: other weights give non-finite points). A ``w`` that does not broadcast to the
    points, no points (``x.shape[dim] == 0``) or a ``dim`` that is the coordinates' is a ``ValueError``.

    The centroid does not change when the weights of one centroid are scaled by a common positive factor, and
    neither does its evaluation: the weights are divided by their largest one per centroid first, then by their sum,
    so weights like ``1e-30`` or ``1e20`` (whose ``(Σ w)²`` under- or overflows fp32) give the centroid of the same
    weights summing to 1 (and ``|<s, s>_L|`` stays below the largest ``d²``).

    For points of ``H_k``, ``<x_i, x_j>_L = -k - d²_ij / 2``, hence
    ``|<s, s>_L| = k (Σ w)² + ½ Σ_ij w_i w_j d²(x_i, x_j)``. That form is used: it is exact for points on the
    manifold, never below the bound ``k (Σ w)²`` (so no clamp is needed), and, with ``d²`` from the
    difference form, free of the cancellation ``-s_t² + |s_s|²`` suffers far from the origin (at
    ``|x_s| = 1e4`` in fp32 that cancellation alone is larger than ``k``). Costs ``O(N² n)``: meant for few
    points (residuals, expert mixtures); attention normalises its softmax-weighted sums directly.
    """
    _check_tensor("centroid", "x", x)
    if w is not None:
        _check_tensor("centroid", "w", w, what="weights", coordinates=None)  # 0-dim: one weight for all
    x = to_stat(x)
    dim = dim if dim >= 0 else x.dim() + dim
    if not 0 <= dim < x.dim() - 1:
        raise ValueError(f"centroid: dim={dim} must index the points of x {tuple(x.shape)}, not the coordinate "
                         "(last) dim")
    if x.shape[dim] == 0:
        raise ValueError(f"centroid of no points: x {tuple(x.shape)} holds 0 points along dim {dim}")
    given = w is not None
    if w is None:
        w = torch.full(x.shape[:-1], 1.0 / x.shape[dim], dtype=x.dtype, device=x.device)
    points = tuple(x.shape[:-1])
    if w.dim() > len(points) or any(a not in (1, b) for a, b in zip(reversed(w.shape), reversed(points))):
        raise ValueError(f"centroid: w of shape {tuple(w.shape)} must broadcast to x's points {points} (x "
                         f"{tuple(x.shape)}: {x.shape[dim]} points along dim {dim}, coordinates last)")
    w = to_stat(w).to(x.dtype).expand(points)
    xm, wm = x.movedim(dim, -2), w.movedim(dim, -1)
    # k is per centroid (it broadcasts against the result's time coordinates); the points carry one more dim
    kc = _kt(k, xm[..., 0, :])
    if given:  # scale-free: (Σ w)² and Σ w_i w_j d² under- or overflow fp32 for tiny or huge common scales
        wm = wm / wm.amax(-1, keepdim=True)
        wm = wm / wm.sum(-1, keepdim=True)  # Σ w = 1: ½ Σ w_i w_j d² <= max d²
    s = (wm.unsqueeze(-1) * xm).sum(-2)
    d2 = sqdist_one_pass(xm.unsqueeze(-2), xm.unsqueeze(-3))
    norm2 = kc * wm.sum(-1, keepdim=True).square() + \
        0.5 * (wm.unsqueeze(-1) * wm.unsqueeze(-2) * d2).sum((-1, -2)).unsqueeze(-1)
    return normalize(s, k=k, norm2=norm2)


def rescale(x: torch.Tensor, *, k_in: Curv, k_out: Curv) -> torch.Tensor:
    """Curvature change ``x ↦ sqrt(k_out / k_in) · x``: maps ``H_{k_in}`` onto ``H_{k_out}`` (MiCE experts).

    ``x``: points of ``H_{k_in}``. Computed in the statistics dtype and returned in ``x``'s (one rounding, whether
    ``k`` is a number or a tensor); past that dtype's range (``k_out / k_in`` large) the coordinates are inf."""
    _check_tensor("rescale", "x", x)
    k_out, k_in = _kt(k_out, x, "k_out"), _kt(k_in, x, "k_in")
    return (to_stat(x) * _sqrt(k_out / k_in)).to(x.dtype)


def hcat(xs: Union[torch.Tensor, Sequence[torch.Tensor]], *, k: Curv, dim: int = -2) -> torch.Tensor:
    """Lorentz concatenation (HCat): concatenate the space parts, recompute one time coordinate.

    ``xs`` is a sequence of points ``[..., 1+n_i]`` of ``H_k`` or one tensor stacking them along ``dim``
    (e.g. heads ``[..., H, 1+d] -> [..., 1+H·d]``). ``hcat(lift(a), lift(b)) = lift(cat(a, b))``; the result is
    computed from the space parts alone (a point of another curvature is concatenated as if it were one of
    ``H_k``), its range is :func:`lift`'s. ``k`` broadcasts against the result's time coordinates (for a stacked
    tensor, those of ``xs`` without ``dim``). A stacked tensor needs a ``dim`` other than the coordinates (last),
    a sequence at least one tensor: ``ValueError`` naming ``hcat`` and the shapes.
    """
    if isinstance(xs, torch.Tensor):
        _check_tensor("hcat", "xs", xs)
        ndim = dim if dim >= 0 else xs.dim() + dim
        if not 0 <= ndim < xs.dim() - 1:
            raise ValueError(f"hcat: dim={dim} must index the stacked points of xs {tuple(xs.shape)}, not the "
                             "coordinate (last) dim")
        stacked = xs.movedim(ndim, -2)
        kk = _kt(k, stacked[..., 0, :])
        space = stacked[..., 1:]
        space = space.reshape(*space.shape[:-2], -1)
    else:
        if not len(xs):
            raise ValueError("hcat: xs must hold at least one tensor of points [..., 1+n], got an empty sequence")
        for i, x in enumerate(xs):
            _check_tensor("hcat", f"xs[{i}]", x)
        kk = _kt(k, xs[0])
        space = torch.cat([x[..., 1:] for x in xs], dim=-1)
    space = to_stat(space)
    return _lift(space, kk if not isinstance(kk, torch.Tensor) else kk.to(space.dtype))


def manifold_error(x: torch.Tensor, k: Curv) -> torch.Tensor:
    """Relative violation of ``<x, x>_L = -k``: ``|<x,x>_L + k| / (x_t² + |x_s|²)`` per point, in fp64 (a diagnostic,
    never called by a forward: the named fp64 exception of :mod:`helm.precision`).

    Measures the tensor as stored (upcast to fp64 before any arithmetic). The denominator is the
    Euclidean squared norm, the natural scale of rounding in ``<x,x>_L``; it equals ``k`` at the origin.
    A negative time coordinate (the other sheet) counts as an error of at least 1, a point with a NaN or
    infinite coordinate (not a point of the manifold in any precision) as ``inf``.
    """
    check_k(k)
    _check_k_shape(k, x)
    x64 = x.detach().double()
    kk = k.detach().double().to(x64.device) if isinstance(k, torch.Tensor) else float(k)
    err = (sqnorm(x64) + (kk.squeeze(-1) if isinstance(kk, torch.Tensor) and kk.dim() == x64.dim() else kk)).abs()
    err = err / x64.square().sum(-1)
    err = torch.where(x64[..., 0] > 0, err, torch.ones_like(err) + err)
    return torch.where(torch.isfinite(x64).all(-1), err, torch.full_like(err, float("inf")))

