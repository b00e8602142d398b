"""Functional Lorentz-model math.

Conventions (README.md, Conventions; ARCHITECTURE.md for who uses what):

* A point of the hyperboloid ``H^n_k`` is a tensor ``[..., 1+n]`` with the *time* coordinate first and
  ``<x, x>_L = -k``, ``x_t > 0``. ``k > 0`` is geoopt's parameter; the paper's signed curvature is
  ``K = -1/k`` (see :func:`curvature_to_k`, the only place the two are converted).
* ``k`` is keyword-only everywhere. It is a Python float or a tensor broadcastable against ``x[..., :1]``.
  Every public function refuses a Python-number ``k`` that is not positive and finite, or outside fp32's normal
  range ``[K_MIN, K_MAX] = [1.18e-38, 3.4e38]`` (where ``k`` or ``sqrt(k)`` is 0, subnormal or inf in fp32:
  ``origin(3, k=1e-320)`` had the time coordinate 0), for every dtype (``ValueError`` naming ``k``,
  :func:`check_k`: no device work); :func:`curvature_to_k` refuses a ``K`` whose ``k`` is outside it. A tensor
  ``k`` is checked the same way where reading it is free: a plain CPU tensor outside ``torch.compile`` tracing
  (:func:`readable_for_free`). A tensor on an accelerator, a
  DTensor (FSDP) or one met while compiling is *not* checked: reading it would synchronise with the device (or
  run a collective, or break the graph); tensors come from parametrisations that keep them positive (MiCE
  experts). :func:`centroid`'s weights follow the same rule. Its *shape* is always checked (free): a tensor ``k``
  must broadcast against the time coordinates ``x[..., :1]`` without growing them (last dim 1, no extra leading
  dims), else ``ValueError`` naming its shape (a ``k`` of shape ``[n]`` would make ``n`` time coordinates).
* Points: :func:`sqdist`, :func:`dist`, :func:`logmap0`, :func:`centroid` and :func:`rescale` (``x`` on
  ``H_{k_in}``) take points of ``H^n_k`` for *their* ``k``, and :func:`normalize` a future-pointing ``s``
  (``s_t > 0``). Where the values are free to read (:func:`readable_for_free`) a ``ValueError`` names the argument
  for a point of the lower sheet (``-x``, time coordinate ``<= 0``), a NaN or inf coordinate, a point past the
  statistics dtype's range of points, time coordinate ``x_t >= sqrt(max)/2`` (``9.2e18`` in fp32, ``6.7e153`` in
  fp64; ``|x_s| < x_t``), beyond which the inner products and squared distances of two points overflow (fp32
  points at ``|x_s| = 1e20``, which :func:`lift` refuses, gave ``dist = inf``), or a point off the hyperboloid:
  ``|<x, x>_L + k| > rtol · (x_t² + |x_s|²)`` (:func:`point_rtol`: ``64 · 2^-23 = 7.6e-6`` for fp32 and fp64
  points, ``4 · eps`` of the dtype for fp16/bf16 ones, each checked in its own dtype; the points this module
  returns are on ``H_k`` to ``2e-7`` in fp32). The bound is relative to the Euclidean size of the point, the scale of its
  rounding, so a point of another curvature ``k'`` is refused while ``|k - k'| > rtol (x_t² + |x_s|²)`` (near the
  origin); far out the two hyperboloids are within rounding of each other and it passes. fp64 gets fp32's
  bound: fp32 points promoted to fp64 (references evaluated on fp32-rounded inputs) are points. On accelerators
  and under ``torch.compile`` nothing is read, and such inputs give wrong values (``dist(-x, y)`` about 0,
  ``logmap0(-x) = -logmap0(x)``, NaN propagates). Inside a model's forward (:func:`trusted_points`) the same.
* Arguments: a tensor argument that is not fp16/bf16/fp32/fp64 is a ``TypeError`` naming it, a 0-dim one (or
  points with no coordinates) a ``ValueError``, and two point arguments whose coordinates differ in number or
  whose batch dims do not broadcast a ``ValueError`` naming both shapes (and two on different devices one naming
  both devices). These look at dtypes, shapes and devices only, so they run everywhere (no device work).
  Overflow: for finite inputs they accept (where free to read) the functions return finite values: :func:`inner`
  and :func:`sqnorm` of finite vectors whose product overflows, :func:`normalize` of an ``s`` whose squares
  overflow and :func:`rescale` to inf coordinates are a ``ValueError`` (``k`` and the points are bounded above).
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

import functools
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
    "readable_for_free",
    "point_rtol",
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
    shape: a shape comparison, no device work; 0-dim tensors and numbers pass at once."""
    if not isinstance(k, torch.Tensor) or not k.dim():
        return
    time = tuple(like.shape[:-1]) + (1,)
    if k.dim() > len(time) or any(a not in (1, b) for a, b in zip(reversed(k.shape), reversed(time))):
        raise ValueError(f"{name} must broadcast against the time coordinates x[..., :1] of shape {time} (a tensor of "
                         f"shape [..., 1]) without growing them, got a tensor of shape {tuple(k.shape)}")


def _check_upper(fn: str, **points: torch.Tensor) -> None:
    """``ValueError`` naming the argument of ``fn`` whose time coordinate is not positive (the lower sheet), where
    its values are free to read (:func:`readable_for_free`); one reduction per argument. NaN passes here."""
    for name, x in points.items():
        if readable_for_free(x) and x.numel() and bool((x[..., 0] <= 0).any()):
            raise ValueError(f"{fn}: {name} must be points of the upper sheet (time coordinate {name}[..., 0] > 0), "
                             f"got time coordinates down to {float(x[..., 0].min()):g} (the lower sheet, -x, is "
                             "not H^n_k)")


# the dtypes every function here takes: the statistics dtype is fp32 or fp64 (helm.precision), fp8 has no promotion
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_tensor(fn: str, name: str, t, *, what: str = "points [..., 1+n] (time coordinate first)",
                  coordinates: Optional[bool] = True) -> None:
    """``TypeError`` unless ``t`` is an fp16/bf16/fp32/fp64 tensor, ``ValueError`` if it has no last dim (or, with
    ``coordinates``, an empty one: no time coordinate; ``coordinates=None``: any shape): attribute reads only, so
    it runs everywhere. ``what`` names the expected layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a floating-point torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{fn}: {name} must be a floating-point tensor (float16, bfloat16, float32 or float64), got "
                        f"{t.dtype}; convert it first, e.g. {name}.float()")
    if coordinates is not None and (t.dim() == 0 or coordinates and t.shape[-1] == 0):
        got = "a 0-dim tensor" if t.dim() == 0 else f"shape {tuple(t.shape)} (no time coordinate)"
        raise ValueError(f"{fn}: {name} must be {what}, got {got}")


def _check_devices(fn: str, **tensors: torch.Tensor) -> None:
    """``ValueError`` naming the devices when tensors (other than 0-dim ones, which torch moves) lie on different
    devices: torch's own error names neither the function nor the arguments."""
    placed = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.dim()}
    if len(set(placed.values())) > 1:
        shown = ", ".join(f"{name} on {device}" for name, device in placed.items())
        raise ValueError(f"{fn}: the arguments must be on one device, got {shown}; move them with .to(device)")


def _check_pair(fn: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """``ValueError`` naming both shapes unless ``x`` and ``y`` have the same number of coordinates and batch dims
    that broadcast (a shape comparison; equal shapes return at once), or naming both devices unless they are on
    one."""
    _check_devices(fn, x=x, y=y)
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


# fp32's bound also for fp64: a point rounded to fp32 and promoted (a reference on fp32 inputs) is a point
_POINT_RTOL_FP32 = 64 * torch.finfo(torch.float32).eps


def point_rtol(dtype: torch.dtype) -> float:
    """The relative bound of the membership check: ``|<x, x>_L + k| <= point_rtol · (x_t² + |x_s|²)``.

    ``max(4 · eps(dtype), 64 · eps(fp32))``: 7.6e-6 for fp32 and fp64 points, 3.9e-3 for fp16, 3.1e-2 for bf16.
    Storing a point rounds each coordinate by ``eps/2``, moving ``<x, x>_L`` by up to ``eps · (x_t² + |x_s|²)``
    (measured: 0.6 eps for half-precision copies of fp32 points), and the points this module returns are within
    2 fp32 eps; the margin also covers the fp32 evaluation of the check over thousands of coordinates."""
    return max(4 * torch.finfo(dtype).eps, _POINT_RTOL_FP32)


def _point_bound(dtype: torch.dtype) -> float:
    """The largest time coordinate of the points :func:`_check_points` takes in the statistics dtype ``dtype``:
    ``sqrt(max)/2`` (9.2e18 in fp32, 6.7e153 in fp64), so ``<x, y>_L``, ``d²(x, y)`` (up to ``4 x_t y_t``) and the
    other pairwise quantities of two points are finite."""
    return math.sqrt(torch.finfo(dtype).max) / 2


def _check_points(fn: str, k: Curv, kname: str = "k", **points: torch.Tensor) -> None:
    """``ValueError`` naming the argument of ``fn`` that holds something other than points of ``H^n_k`` (``k``
    already checked: a number or a tensor broadcasting against the points' time coordinates), where its values
    are free to read: the lower sheet (:func:`_check_upper`), NaN/inf coordinates, a time coordinate (the largest,
    ``|x_s| < x_t``) of at least :func:`_point_bound` (``9.2e18`` in fp32: beyond, ``d²`` of two points overflows
    and :func:`dist` returned ``inf`` for finite points), or ``|<x, x>_L + k| > point_rtol · (x_t² + |x_s|²)``.

    Evaluated in the statistics dtype on ``x / x_t`` (``|x_s/x_t|² - 1 + k/x_t²`` against ``rtol (1 + |x_s/x_t|²)``),
    which neither overflows for the large points fp32 holds nor cancels more than the bound allows."""
    for name, x in points.items():
        if not (readable_for_free(x) and x.numel()):
            continue
        _check_upper(fn, **{name: x})
        xf = to_stat(x.detach())
        if not bool(torch.isfinite(xf).all()):
            raise ValueError(f"{fn}: {name} must be finite points of H^n_k, got NaN or inf coordinates")
        bound = _point_bound(xf.dtype)
        if not bool((xf[..., 0] < bound).all()):  # x_t > |x_s| on H_k: the time coordinate bounds the point
            raise ValueError(f"{fn}: {name} has points with time coordinates up to {float(xf[..., 0].max()):g} "
                             f"(|{name}_s| < {name}_t), outside the range of points in "
                             f"{str(xf.dtype).removeprefix('torch.')}: {name}_t < {bound:.3g} (sqrt(max)/2: the inner "
                             "products and squared distances of two such points, up to 4 x_t y_t, overflow beyond)")
        t = xf[..., :1]
        s2 = (xf[..., 1:] / t).square().sum(-1, keepdim=True)
        kk = k.detach().to(dtype=xf.dtype, device=xf.device) if isinstance(k, torch.Tensor) else float(k)
        err = (s2 - 1 + kk / t.square()).abs()
        rtol = point_rtol(x.dtype)
        if not bool((err <= rtol * (1 + s2)).all()):
            # k may be per row of the other argument (sqdist's y broadcasting against x): index the common shape
            tb, sb, kb = torch.broadcast_tensors(t, s2, kk * torch.ones_like(err))
            worst = (err / (1 + sb)).flatten().argmax()
            t0, s0, k0 = float(tb.flatten()[worst]), float(sb.flatten()[worst]), float(kb.flatten()[worst])
            norm = t0 * t0 * (s0 - 1)  # <x, x>_L of that point (a Python number: for the message only)
            what = f"a point of the hyperboloid of {kname} = {-norm:.6g}" if norm < 0 else \
                "on no hyperboloid (a Minkowski norm >= 0: not time-like)"
            raise ValueError(f"{fn}: {name} must be points of H^n_k for {kname} = {k0:g} (<{name}, {name}>_L = "
                             f"-{kname} to a relative {rtol:.2g} of {name}_t² + |{name}_s|²), got <{name}, {name}>_L = "
                             f"{norm:.6g} for one of them, {what}; make points with lift(x_s, k=k) or "
                             "expmap0(u, k=k) and pass the k they were made with")


def _check_lifted(fn: str, name: str, x_s: torch.Tensor, out: torch.Tensor) -> None:
    """``ValueError`` naming ``x_s`` (argument ``name`` of ``fn``) when its point ``out`` has a non-finite time
    coordinate, where that is free to read: NaN/inf in ``x_s``, or ``|x_s|² + k`` past the statistics dtype."""
    if not (readable_for_free(x_s) and out.numel()) or bool(torch.isfinite(out.detach()[..., 0]).all()):
        return
    if not bool(torch.isfinite(x_s).all()):
        raise ValueError(f"{fn}: {name} must be finite, got NaN or inf coordinates")
    big = math.sqrt(torch.finfo(out.dtype).max)
    raise ValueError(f"{fn}: {name} has space parts of norm up to {float(x_s.detach().abs().amax()):g} (largest "
                     f"coordinate), outside the range where |x_s|² + k is finite in "
                     f"{str(out.dtype).removeprefix('torch.')}: |x_s| < {big:.3g} (the time coordinate "
                     "sqrt(|x_s|² + k) is computed from that square)")


def _sqrt(k: Union[float, torch.Tensor]):
    return k.sqrt() if isinstance(k, torch.Tensor) else math.sqrt(k)


# False while a model's forward runs (:func:`trusted_points`); a plain global, so a public function called from
# another thread during that forward skips its checks too
_DOMAIN_CHECKS = True


def readable_for_free(t: torch.Tensor) -> bool:
    """Whether the values of ``t`` can be read with no device synchronisation, collective or graph break: a plain
    CPU tensor (or ``Parameter``) outside ``torch.compile`` tracing, and outside a model's forward
    (:func:`trusted_points`). Domain checks of tensor arguments run only then."""
    return _DOMAIN_CHECKS and t.device.type == "cpu" and type(t) in (torch.Tensor, torch.nn.Parameter) and \
        not torch.compiler.is_compiling()


def trusted_points(forward):
    """Decorate a model's ``forward``: inside it the tensor domain checks of this module are skipped.

    The model checks its inputs once (``check_inputs``) and its layers make points of ``H_k`` and positive
    curvatures by construction, so checking them again in every call only costs time: on the CPU, where the checks
    run, they made a tiny training step about 10% slower. Standalone calls of the functions and layers keep them."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        global _DOMAIN_CHECKS
        if not _DOMAIN_CHECKS or torch.compiler.is_compiling():
            return forward(*args, **kwargs)
        _DOMAIN_CHECKS = False
        try:
            return forward(*args, **kwargs)
        finally:
            _DOMAIN_CHECKS = True
    return run


# the range of k (every dtype): fp32's normal numbers. Below it k is 0 or subnormal in fp32 (a Python k = 1e-320
# became 0 in fp32 arithmetic: the origin's time coordinate sqrt(k) was 0, a point of no upper sheet), above it inf
K_MIN = torch.finfo(torch.float32).tiny
K_MAX = torch.finfo(torch.float32).max
_K_RANGE = f"[{K_MIN:.3g}, {K_MAX:.3g}], float32's normal range"


def check_k(k: Curv, name: str = "k") -> None:
    """Raise ``ValueError`` unless ``k`` (geoopt's positive curvature parameter) is a positive finite number in
    ``[K_MIN, K_MAX] = [1.18e-38, 3.4e38]``, fp32's normal range (for fp64 inputs too: a ``k`` outside it is 0,
    subnormal or inf in fp32, where the points of ``H_k`` and ``sqrt(k)`` are computed).

    The single domain check of ``k`` used by every public function of this module: a Python comparison for a
    number, and for a tensor every entry where that is free (:func:`readable_for_free`; compared in fp32, so an
    fp64 entry that fp32 rounds to 0 or inf is refused); elsewhere tensors pass unchecked: they come from a
    parametrisation that keeps them positive, and reading them would synchronise with the device. Layers
    additionally require the documented range (:func:`helm.nn.validation.k_parameter`)."""
    if isinstance(k, torch.Tensor):
        if readable_for_free(k) and k.numel():
            values = k.detach().float()
            if not bool((torch.isfinite(values) & (values >= K_MIN)).all()):
                raise ValueError(f"{name} must be positive and finite (geoopt's k = -1/K > 0), in {_K_RANGE}, got "
                                 f"a tensor with values in [{float(values.min()):g}, {float(values.max()):g}]")
        return
    if not (isinstance(k, numbers.Real) and not isinstance(k, bool) and math.isfinite(k) and k > 0):
        raise ValueError(f"{name} must be a positive finite number (geoopt's k = -1/K > 0), got {k!r}")
    if not K_MIN <= float(k) <= K_MAX:
        raise ValueError(f"{name} must be a positive finite number (geoopt's k = -1/K > 0) in {_K_RANGE} (beyond it "
                         f"k or sqrt(k) is 0 or inf in fp32), got {k!r}")


def curvature_to_k(curvature: float) -> float:
    """Paper curvature ``K < 0`` (``<x,x>_L = 1/K``) to geoopt's ``k = -1/K > 0``.

    This is the one place where the paper's signed curvature is converted; configs speak ``K``. ``curvature`` is a
    Python (or NumPy) real number: a tensor is a ``TypeError`` (no device read is made for it), anything else that
    is not a negative finite number a ``ValueError``, and so is a ``K`` whose ``k`` is outside :func:`check_k`'s
    range ``[1.18e-38, 3.4e38]`` (``K`` in ``[-8.5e37, -2.9e-39]``: ``K = -1e-320`` gave ``k = inf``).
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
    vectors (not only points): their values are not checked, except that finite vectors whose product overflows the
    statistics dtype (coordinates past ``sqrt(max)``, ``1.8e19`` in fp32: the probe's ``-inf`` for two points at
    ``|x_s| = 1e20``) are a ``ValueError`` naming them, where free to read (:func:`readable_for_free`; one
    reduction over the result). NaN and inf inputs propagate.
    """
    return _checked_inner("inner", x, y, keepdim)


def _checked_inner(fn: str, x: torch.Tensor, y: torch.Tensor, keepdim: bool) -> torch.Tensor:
    """:func:`inner` (``y is x``: :func:`sqnorm`) with its checks, messages naming the public ``fn``."""
    same = y is x  # sqnorm: one cast
    _check_tensor(fn, "x", x)
    if not same:
        _check_tensor(fn, "y", y)
        _check_pair(fn, x, y)
    x0, y0 = x, y
    x = to_stat(x)
    y = x if same else to_stat(y)
    if torch.is_grad_enabled() and (x.requires_grad or y.requires_grad):
        out = _Inner.apply(x, None if same else y)
    else:
        out = _inner(x, x if same else y, same)
    if readable_for_free(x0) and readable_for_free(y0) and out.numel() and not bool(out.detach().isfinite().all()) \
            and bool(x.detach().isfinite().all()) and (same or bool(y.detach().isfinite().all())):
        names = "x has" if same else "x and y have"
        largest = max(float(x.detach().abs().max()), float(y.detach().abs().max()))
        raise ValueError(f"{fn}: {names} coordinates up to {largest:g}, outside the range where "
                         f"<x, {'x' if same else 'y'}>_L is finite in {str(out.dtype).removeprefix('torch.')}: "
                         f"coordinates below {math.sqrt(torch.finfo(out.dtype).max):.3g} (sqrt(max); less for many "
                         "coordinates), got a non-finite product of finite vectors")
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
    """Squared Minkowski norm ``<x, x>_L`` (``-k`` on ``H^n_k``; negative for time-like vectors); checks as
    :func:`inner`'s (finite vectors whose square overflows are a ``ValueError`` naming ``x``, where free to read)."""
    return _checked_inner("sqnorm", x, x, keepdim)


def lift(x_s: torch.Tensor, *, k: Curv) -> torch.Tensor:
    """Space part to point: ``lift(x_s) = [sqrt(|x_s|^2 + k), x_s]``.

    The "HRC" pattern: any Euclidean op on the space part followed by ``lift`` stays on ``H^n_k``.
    Shapes: ``[..., n] -> [..., 1+n]`` (``n >= 0``; a 0-dim ``x_s`` is a ``ValueError``); the result is in the
    statistics dtype (fp32 for bf16/fp16 space parts, the precision policy's points) so the time coordinate keeps
    its precision under bf16 autocast.

    Range: ``|x_s|² + k`` must be finite in the statistics dtype, ``|x_s| < 1.8e19`` in fp32 (``1.3e154`` in fp64).
    A NaN or inf coordinate, or a space part past that range (whose time coordinate would be ``inf``), is a
    ``ValueError`` naming ``x_s`` where the result is free to read (:func:`readable_for_free`; one reduction over
    the time coordinates); elsewhere (accelerators, compilation, a model's forward) NaN/inf propagate.
    """
    _check_tensor("lift", "x_s", x_s, what="space parts [..., n] (at least one dim: x_s[..., None] for n = 1)",
                  coordinates=False)
    x_s = to_stat(x_s)
    out = _lift(x_s, _kt(k, x_s))
    _check_lifted("lift", "x_s", x_s, out)
    return out


def _lift(x_s: torch.Tensor, kk: Union[float, torch.Tensor]) -> torch.Tensor:
    """:func:`lift` of a statistics-dtype ``x_s`` with ``kk`` from :func:`_kt`, unchecked."""
    if torch.is_grad_enabled() and (x_s.requires_grad or isinstance(kk, torch.Tensor) and kk.requires_grad):
        return _Lift.apply(x_s, kk)
    x_t = (x_s.square().sum(-1, keepdim=True) + kk).sqrt()
    return torch.cat([x_t, x_s], dim=-1)


class _Lift(torch.autograd.Function):
    """:func:`lift` with a fused gradient, ``∂/∂x_s = g_s + (g_t / x_t) x_s`` and ``∂/∂k = Σ g_t / (2 x_t)``: one
    pass over ``[..., n]`` where autograd's chain through ``square``, ``sum``, ``sqrt`` and ``cat`` takes four (every
    layer lifts several times). Used when a gradient is needed; not twice differentiable."""

    @staticmethod
    def forward(ctx, x_s: torch.Tensor, k) -> torch.Tensor:
        x_t = (x_s.square().sum(-1, keepdim=True) + k).sqrt()
        ctx.save_for_backward(x_s, x_t)
        ctx.k_shape = k.shape if isinstance(k, torch.Tensor) else None
        return torch.cat([x_t, x_s], dim=-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x_s, x_t = ctx.saved_tensors
        g_t, g_s = grad.split([1, x_s.shape[-1]], dim=-1)
        h = g_t / x_t
        grad_x = torch.addcmul(g_s, h, x_s) if ctx.needs_input_grad[0] else None
        grad_k = (h / 2).sum_to_size(ctx.k_shape) if ctx.needs_input_grad[1] else None
        return grad_x, grad_k


def origin(*size: int, k: Curv, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """The origin ``(sqrt(k), 0, ..., 0)`` of ``H^n_k``; ``size`` includes the time coordinate (``1+n``).

    ``size``: non-negative ints (or one tuple of them), at least one, the last (``1+n``) at least 1, else a
    ``ValueError`` naming ``size``; ``dtype``: None (the default dtype) or fp16/bf16/fp32/fp64, else a ``TypeError``
    (an integer origin ``(round(sqrt k), 0, ...)`` is on no hyperboloid). The time coordinate ``sqrt(k)`` must be a
    normal number of ``dtype`` (``ValueError`` naming ``k`` otherwise: fp16 holds ``k`` in ``[3.7e-9, 4.3e9]`` only;
    a tensor ``k`` where free to read, :func:`readable_for_free`), never 0 or inf."""
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
    if isinstance(kk, torch.Tensor) and readable_for_free(out) and out.numel():
        time = out[..., 0].float()
        if not bool((torch.isfinite(time) & (time >= info.tiny)).all()):
            raise ValueError(f"origin: k has no origin in {str(out.dtype).removeprefix('torch.')} for some entries: "
                             f"the time coordinate sqrt(k) must be in that dtype's normal range [{info.tiny:.3g}, "
                             f"{info.max:.3g}], got values in [{float(time.min()):g}, {float(time.max()):g}]")
    return out


def sqdist(x: torch.Tensor, y: torch.Tensor, *, k: Curv, keepdim: bool = False) -> torch.Tensor:
    """Squared Lorentz distance ``d²(x, y) = <x-y, x-y>_L = -2k - 2<x, y>_L`` (paper: ``2/K - 2<x,y>_L``).

    ``x`` and ``y`` must be points of ``H^n_k`` (upper sheet, ``<x, x>_L = -k``: checked on CPU, see the module
    docstring; a point of the lower sheet or of another curvature gives a distance on no hyperboloid), with the same
    number of coordinates and broadcastable batch dims (``ValueError`` naming both shapes). Returns the statistics
    dtype, ``>= 0``.

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
    kk = _kt(k, to_stat(x))
    _check_pair(name, x, y)
    _check_points(name, k, x=x, y=y)
    return _sqdist_accurate(x, y, kk), kk


def sqdist_one_pass(x: torch.Tensor, y: torch.Tensor, *, keepdim: bool = False) -> torch.Tensor:
    """``d²(x, y)`` as ``<x-y, x-y>_L`` clamped at 0, in the statistics dtype: one pass, accurate to
    ``u · |x - y| · (|x| + |y|)`` absolute (the rounding of the stored time coordinates), not relative to ``d²``
    itself as :func:`sqdist` is (far out, nearby points can get 0). The form of the layers' hot path and
    :func:`centroid`'s pairwise norm, which add it to ``k (Σ w)²``, where that absolute rounding is what they can
    use. Points are not checked."""
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

    Every quantity is finite for finite points with time coordinates below ``9.2e18`` (fp32, :func:`_point_bound`)
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
    pass. Points of ``H^n_k`` only, shapes as :func:`sqdist` (both checked as there). Returns the statistics dtype.
    """
    d2, kk = _checked_sqdist("dist", x, y, k)
    tiny = torch.finfo(d2.dtype).tiny
    # sqrt(d²) / (2 sqrt k), not sqrt(d² / 4k): d² / 4k overflowed fp32 for small k (k = 1e-30, |x_s| = 1e5: inf)
    sk = _sqrt(kk)
    out = 2 * sk * torch.asinh(d2.clamp_min(tiny).sqrt() / (2 * sk))
    out = torch.where(d2 == 0, torch.zeros_like(out), out)  # exactly 0 (not sqrt(tiny)) for equal points; NaN stays
    return out if keepdim else out.squeeze(-1)


def expmap0(u: torch.Tensor, *, k: Curv) -> torch.Tensor:
    """Exponential map at the origin for a tangent vector ``u = [0, u_s]`` (a non-zero ``u_t`` is refused where
    the input is read for free, :func:`readable_for_free`, and ignored elsewhere).

    ``exp_o(u) = [sqrt(k) cosh(|u_s|/sqrt k), sqrt(k) sinh(|u_s|/sqrt k) u_s / |u_s|]``; the space part
    uses ``sinh(θ)/θ`` (exactly 1 at ``θ = 0``) and the time part is recomputed by :func:`lift`.

    Far out (``θ = |u_s|/sqrt k > 20``, where ``cosh θ = sinh θ = e^θ/2`` to fp64 precision) ``sinh θ``, the
    squared norm in :func:`lift` and ``sinh(θ)/θ · u_s`` would overflow long before the point does (fp32:
    ``sinh`` at ``θ ≈ 89``, ``|x_s|²`` at ``|x_s| ≈ 1.8e19``, then ``inf · 0 = nan`` for zero coordinates).
    There the point is ``s · [|d|, d]`` with ``s = exp(θ - log 2 + log sqrt k)`` and ``d = u_s / |u_s|`` (no square
    of a large number), so it is finite (with finite gradients) whenever it is representable; beyond the dtype's
    range its time and non-zero coordinates are ``±inf`` and its zero coordinates 0, never ``nan``.

    Exact range: the result is finite, to a few roundings, for ``θ = |u_s|/sqrt(k) < log(2·max/sqrt(k))``, ``max``
    the largest number of the *output* dtype, ``u``'s (computed in the statistics dtype, rounded once to ``u``'s
    dtype at the end): fp32 and bf16 ``θ < 89.41 - ½ log k`` (so a tangent of norm 200 at ``k = 1`` is past it:
    ``inf`` coordinates, the point ``e^200`` away is not an fp32 number), fp16 ``θ < 11.78 - ½ log k``, fp64
    ``θ < 710.47 - ½ log k``. Layers never come near it (their tables sit at ``θ <= 40``, see ``HelmConfigBase``).
    Checks, where the input is free to read (:func:`readable_for_free`: a CPU tensor outside compilation and
    outside a model's forward; one reduction over the time coordinates of the result): a tangent beyond that range
    is a ``ValueError`` naming the tangent norm and the range, a NaN or inf coordinate of ``u`` a ``ValueError``
    naming ``u``, an integer (non-float) ``u`` a ``TypeError`` (always). On accelerators and while compiling
    nothing is read: NaN propagates, and out of range the result is as described above (never NaN, also when
    ``|u_s|`` itself overflows: then the time coordinate is ``inf`` and the space part 0).
    Shapes: ``[..., 1+n] -> [..., 1+n]``, in ``u``'s dtype.
    """
    _check_tensor("expmap0", "u", u, what="a tangent vector [..., 1+n] at the origin, [0, u_s]")
    u_s = to_stat(u[..., 1:])
    kk = _kt(k, u_s)
    checked = readable_for_free(u) and u.numel() > 0
    if checked and bool((u[..., 0] != 0).any()):
        raise ValueError("expmap0: u must be a tangent vector at the origin, [0, u_s] (time coordinate 0), got time "
                         f"coordinates up to {float(u[..., 0].abs().max()):g}; pass [0, u_s], or lift a point with lift()")
    sk = _sqrt(kk)
    norm = u_s.norm(dim=-1, keepdim=True)
    theta = norm / sk
    small = theta < 1e-4
    big = theta > 20.0
    safe = torch.where(small | big, torch.ones_like(theta), theta)
    ratio = torch.where(small, 1 + theta.square() / 6, torch.sinh(safe) / safe)
    near = _lift(ratio * u_s, kk)  # unchecked: where big it is not selected and may overflow
    # far branch, with safe arguments where it is not selected (no inf/nan in either pass)
    log_sk = sk.log() if isinstance(sk, torch.Tensor) else math.log(sk)
    scale = torch.exp(torch.where(big, theta, torch.full_like(theta, 20.0)) - math.log(2.0) + log_sk)
    direction = u_s / torch.where(big, norm, torch.ones_like(norm))
    far_s = scale * direction
    far_s = torch.where(torch.isinf(scale) & (direction == 0), torch.zeros_like(far_s), far_s)  # not inf·0
    # x_t = sqrt(|x_s|² + k) = |x_s| = scale (|direction| = 1) to within k/|x_s|² < 1e-17 here; scale itself, not
    # scale·|direction|, so an overflowing |u_s| (direction 0) gives inf, not inf·0 = nan
    far = torch.cat([scale, far_s], dim=-1)
    out = torch.where(big, far, near).to(u.dtype)
    # the time coordinate is the largest one, so it alone tells whether the point (in u's dtype) is finite
    if checked and not bool(torch.isfinite(out.detach()[..., 0]).all()):
        if not bool(torch.isfinite(u_s).all()):
            raise ValueError("expmap0: u must be finite, got NaN or inf coordinates in u[..., 1:]")
        bad = ~torch.isfinite(out.detach()[..., :1])
        largest, theta_max = float(norm.detach()[bad].max()), float(theta.detach()[bad].max())
        limit = math.floor(100 * (math.log(2) + math.log(torch.finfo(u.dtype).max))) / 100
        raise ValueError(f"expmap0: a tangent vector of norm |u_s| = {largest:g} (theta = |u_s|/sqrt(k) "
                         f"= {theta_max:g}) is outside the range where its image is a finite "
                         f"{str(u.dtype).removeprefix('torch.')} point, theta < {limit:.2f} - log(k)/2")
    return out


def logmap0(x: torch.Tensor, *, k: Curv) -> torch.Tensor:
    """Logarithmic map at the origin: ``[0, (θ / sinh θ) x_s]`` with ``θ = asinh(|x_s| / sqrt k)``.

    Inverse of :func:`expmap0`; exact at the origin (``θ/sinh θ -> 1``). Shapes: ``[..., 1+n]``; computed in the
    statistics dtype, returned in ``x``'s dtype. Only the space part is read, so ``x`` must be a point of
    ``H^n_k`` for this ``k`` (checked on CPU, see the module docstring; ``logmap0(-x)`` would be ``-logmap0(x)``,
    and a point of another curvature would give the tangent of another point).
    """
    _check_tensor("logmap0", "x", x)
    x_s = to_stat(x[..., 1:])
    kk = _kt(k, x_s)
    _check_points("logmap0", k, x=x)
    r = x_s.norm(dim=-1, keepdim=True) / _sqrt(kk)
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
    manifold to rounding. Shapes: ``[..., 1+n] -> [..., 1+n]``, a point in the statistics dtype. ``s_t > 0``
    (future-pointing) is checked on CPU: the space part alone is read, so a past-pointing ``s`` would silently land
    on the reflected point.

    ``floor``: None, or a non-negative finite number (``ValueError`` naming it otherwise), or a tensor
    broadcasting against the time coordinates (shape always checked; its values where free to read, as ``k``).
    A non-finite result where free to read (NaN/inf in ``s``, or ``|<s, s>_L| = 0`` with no positive floor: ``s``
    light-like or zero has no point on its ray) is a ``ValueError`` naming ``s``.

    ``s`` must be within the statistics dtype's range: where free to read, a finite ``s`` with
    ``s_t² + |s_s|² = inf`` (``1.8e19`` in fp32) is a ``ValueError`` naming ``s`` (``|<s, s>_L|`` overflowed and the
    result was the origin).

    ``s`` must be time-like: where free to read, a space-like ``s`` (``<s, s>_L > point_rtol · (s_t² + |s_s|²)``,
    beyond the rounding of that form) is a ``ValueError`` naming ``s`` (it used to land on the point of its space
    part's direction). Within that rounding of the light cone the sign of ``<s, s>_L`` cannot be told in the
    statistics dtype and ``s`` is not refused: that includes time-like vectors close to a scaled hyperboloid far from
    the origin (``2.5 x`` at ``|x_s| >= 1e3`` in fp32, where ``<s, s>_L ~ -6k`` against terms ``~ 6 |x_s|²``), which
    is why such callers pass ``norm2``. Not read on accelerators, while compiling or in a model's forward.

    ``norm2``: None or a floating-point tensor broadcasting against the time coordinates ``s[..., :1]`` without
    growing them (``TypeError`` / ``ValueError`` naming ``norm2``, always), whose values must be positive and finite
    (non-negative with a ``floor``): ``ValueError`` naming ``norm2`` where free to read.
    """
    _check_tensor("normalize", "s", s)
    rtol = point_rtol(s.dtype)
    s = to_stat(s)
    _check_upper("normalize", s=s)
    _check_floor(floor, s)
    _check_norm2(norm2, floor, s)
    given = norm2 is not None
    minkowski = None
    if readable_for_free(s) and s.numel():  # the sign of <s, s>_L: refuse a clearly space-like s
        scale = s.detach().square().sum(-1, keepdim=True)
        if not bool(scale.isfinite().all()) and bool(s.isfinite().all()):  # finite s: its squares overflow
            raise ValueError(f"normalize: s has coordinates up to {float(s.detach().abs().max()):g}, outside the "
                             f"range where <s, s>_L and s_t² + |s_s|² are finite in "
                             f"{str(s.dtype).removeprefix('torch.')}: sqrt(s_t² + |s_s|²) < "
                             f"{math.sqrt(torch.finfo(s.dtype).max):.3g} (beyond, |<s, s>_L| = inf made the point "
                             "the origin)")
        minkowski = _inner(s.detach(), s.detach(), True)
        if not bool((minkowski <= rtol * scale).all()):
            worst = ((minkowski - rtol * scale) / scale).flatten().argmax()
            value, row = float(minkowski.flatten()[worst]), s.detach().reshape(-1, s.shape[-1])[worst]
            raise ValueError(f"normalize: s must be time-like (<s, s>_L = -s_t² + |s_s|² < 0, s_t > |s_s|), got a "
                             f"space-like vector with <s, s>_L = {value:.6g} (s_t = {float(row[0]):g}, |s_s| = "
                             f"{float(row[1:].norm()):g}): no point of H^n_k lies on its ray")
    if norm2 is None:
        norm2 = (minkowski if minkowski is not None and not s.requires_grad else sqnorm(s, keepdim=True)).abs()
    if floor is not None:
        norm2 = norm2.clamp_min(floor) if not isinstance(floor, torch.Tensor) else torch.maximum(norm2, floor)
    kk = _kt(k, s)
    out = _lift(s[..., 1:] * (_sqrt(kk) * norm2.rsqrt()), kk)
    if readable_for_free(s) and out.numel() and not bool(torch.isfinite(out.detach()[..., 0]).all()):
        if given:
            raise ValueError("normalize: s must be finite, got NaN or inf coordinates" if not bool(
                torch.isfinite(s).all()) else "normalize: norm2 = 0 for some rows (and no positive floor): "
                "|<s, s>_L| must be > 0, pass a floor > 0 for rows that may reach 0")
        raise ValueError("normalize: s must be finite and time-like, |<s, s>_L| > 0 (or pass a floor > 0), got "
                         + ("NaN or inf coordinates" if not bool(torch.isfinite(s).all()) else
                            "a vector with |<s, s>_L| = 0 (light-like or zero: no point of H^n_k on its ray)"))
    return out


def _check_norm2(norm2, floor, like: torch.Tensor) -> None:
    """:func:`normalize`'s ``norm2``: ``TypeError`` unless None or a floating-point tensor, ``ValueError`` naming it
    unless it broadcasts against the time coordinates of ``like`` without growing them (always: a shape
    comparison) and, where its values are free to read (:func:`readable_for_free`), they are finite and positive
    (non-negative with a ``floor``, which bounds them from below)."""
    if norm2 is None:
        return
    _check_tensor("normalize", "norm2", norm2, what="a tensor [..., 1] (|<s, s>_L| per row)", coordinates=None)
    _check_k_shape(norm2, like, "normalize: norm2")
    if readable_for_free(norm2) and norm2.numel():
        values = norm2.detach()
        ok = torch.isfinite(values) & ((values >= 0) if floor is not None else (values > 0))
        if not bool(ok.all()):
            values = values.float()
            raise ValueError("normalize: norm2 must be " + ("non-negative" if floor is not None else "positive")
                             + " and finite (|<s, s>_L| of s, a positive number for a time-like s), got a tensor "
                             f"with values in [{float(values.min()):g}, {float(values.max()):g}]"
                             + (" (NaN included)" if bool(values.isnan().any()) else ""))


def _check_floor(floor, like: torch.Tensor) -> None:
    """:func:`normalize`'s ``floor``: ``ValueError`` unless None, a non-negative finite number, or a tensor shaped
    like the time coordinates of ``like`` whose values (read where free, :func:`readable_for_free`) are too. A NaN
    floor made every result NaN; a negative one is no bound on the non-negative ``|<s, s>_L|``."""
    if floor is None:
        return
    if isinstance(floor, torch.Tensor):
        _check_tensor("normalize", "floor", floor, what="a number or a tensor [..., 1]", coordinates=False)
        _check_k_shape(floor, like, "normalize: floor")
        if readable_for_free(floor) and floor.numel() and not bool((torch.isfinite(floor) & (floor >= 0)).all()):
            values = floor.detach().float()
            raise ValueError("normalize: floor must be non-negative and finite (a lower bound on |<s, s>_L|), got a "
                             f"tensor with values in [{float(values.min()):g}, {float(values.max()):g}]")
        return
    if not (isinstance(floor, numbers.Real) and not isinstance(floor, bool) and math.isfinite(floor) and floor >= 0):
        raise ValueError(f"normalize: floor must be None or a non-negative finite number (a lower bound on "
                         f"|<s, s>_L|), got {floor!r}")


def centroid(x: torch.Tensor, w: torch.Tensor | None = None, *, k: Curv, dim: int = -2) -> torch.Tensor:
    """Weighted Lorentz centroid (paper Eq. 3): ``sqrt(k) · s / sqrt(|<s, s>_L|)``, ``s = Σ w_i x_i``.

    ``x``: points ``[..., N, ..., 1+n]`` stacked along ``dim``; ``w``: non-negative weights broadcastable to
    ``x``'s shape minus the last dim (default: uniform ``1/N``), summing to a positive number for every centroid:
    ``ValueError`` otherwise where the weights can be read for free (:func:`readable_for_free`: CPU tensors
    outside compilation); on an accelerator they are not read (no synchronisation) and such weights give
    non-finite points. A ``w`` that does not broadcast to the points, or no points (``x.shape[dim] == 0``), is a
    ``ValueError`` (shapes: always checked). The points must be points of ``H^n_k`` (checked on CPU, see the
    module docstring: the norm below holds for points of ``H_k`` only), checked in their own dtype (the bound of
    bf16/fp16 points is theirs, :func:`point_rtol`, as in every other function), before the fp32 evaluation.

    The centroid does not change when the weights of one centroid are scaled by a common positive factor, and
    neither does its evaluation: the weights are divided by their largest one per centroid first, then by their sum,
    so weights like ``1e-30`` or ``1e20`` (whose ``(Σ w)²`` under- or overflows fp32) give the centroid of the same
    weights summing to 1 (and ``|<s, s>_L|`` stays below the largest ``d²``, finite for the points checked).

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
        _check_devices("centroid", x=x, w=w)
    given_x = x  # the points as given: checked in their own dtype (point_rtol of bf16/fp16, not fp32's)
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
    if readable_for_free(wm) and not bool(((wm >= 0) & wm.isfinite()).all(-1).logical_and(wm.sum(-1) > 0).all()):
        raise ValueError("centroid: w must be non-negative and finite, with a positive sum over the points of "
                         f"each centroid (got weights in [{float(wm.min()):g}, {float(wm.max()):g}], sums down to "
                         f"{float(wm.sum(-1).min()):g}); a zero or negative total weight has no centroid")
    _check_points("centroid", kc.unsqueeze(-2) if isinstance(kc, torch.Tensor) and kc.dim() else kc,
                  x=given_x.movedim(dim, -2))
    if given:  # scale-free: (Σ w)² and Σ w_i w_j d² under- or overflow fp32 for tiny or huge common scales
        wm = wm / wm.amax(-1, keepdim=True)
        wm = wm / wm.sum(-1, keepdim=True)  # Σ w = 1: ½ Σ w_i w_j d² <= max d², finite for checked points
    s = (wm.unsqueeze(-1) * xm).sum(-2)
    d2 = sqdist_one_pass(xm.unsqueeze(-2), xm.unsqueeze(-3))
    norm2 = kc * wm.sum(-1, keepdim=True).square() + \
        0.5 * (wm.unsqueeze(-1) * wm.unsqueeze(-2) * d2).sum((-1, -2)).unsqueeze(-1)
    return normalize(s, k=k, norm2=norm2)


def rescale(x: torch.Tensor, *, k_in: Curv, k_out: Curv) -> torch.Tensor:
    """Curvature change ``x ↦ sqrt(k_out / k_in) · x``: maps ``H_{k_in}`` onto ``H_{k_out}`` (MiCE experts).

    ``x`` must be points of ``H_{k_in}`` (checked on CPU, see the module docstring). Computed in the statistics
    dtype and returned in ``x``'s (one rounding, whether ``k`` is a number or a tensor). A result past the range of
    that dtype (``k_out / k_in`` large: inf coordinates) is a ``ValueError`` naming ``k_out / k_in`` where free to
    read (:func:`readable_for_free`)."""
    _check_tensor("rescale", "x", x)
    k_out, k_in = _kt(k_out, x, "k_out"), _kt(k_in, x, "k_in")
    _check_points("rescale", k_in, "k_in", x=x)
    out = (to_stat(x) * _sqrt(k_out / k_in)).to(x.dtype)
    if readable_for_free(x) and out.numel() and not bool(out.detach()[..., 0].isfinite().all()):
        ratio = k_out / k_in
        ratio = float(ratio.max()) if isinstance(ratio, torch.Tensor) else ratio
        raise ValueError(f"rescale: k_out / k_in = {ratio:g} scales x (time coordinates up to "
                         f"{float(x.detach()[..., 0].max()):g}) past the range of "
                         f"{str(x.dtype).removeprefix('torch.')}: the points of H_k_out would be inf, "
                         f"sqrt(k_out / k_in) · x_t < {torch.finfo(x.dtype).max:.3g}")
    return out


def hcat(xs: Union[torch.Tensor, Sequence[torch.Tensor]], *, k: Curv, dim: int = -2) -> torch.Tensor:
    """Lorentz concatenation (HCat): concatenate the space parts, recompute one time coordinate.

    ``xs`` is a sequence of points ``[..., 1+n_i]`` or one tensor stacking them along ``dim``
    (e.g. heads ``[..., H, 1+d] -> [..., 1+H·d]``). ``hcat(lift(a), lift(b)) = lift(cat(a, b))``; the result is
    computed from the space parts alone, and the range and checks of the result are :func:`lift`'s.

    Checks: the inputs must be points of ``H_k`` for this ``k`` (a point of another curvature would be
    concatenated silently as if it were one of ``H_k``): :func:`_check_points`, where free to read
    (:func:`readable_for_free`: not on accelerators, while compiling or in a model's forward); ``k`` broadcasts
    against the result's time coordinates (for a stacked tensor, those of ``xs`` without ``dim``). Always (shapes):
    a sequence needs at least one tensor, all with the same batch dims, and a stacked tensor a valid ``dim`` other
    than the coordinates (last): ``ValueError`` naming ``hcat`` and the shapes.
    """
    if isinstance(xs, torch.Tensor):
        _check_tensor("hcat", "xs", xs)
        if xs.dim() < 2:
            raise ValueError(f"hcat: a stacked xs must be points [..., H, 1+d] stacked along dim, got shape "
                             f"{tuple(xs.shape)}")
        ndim = dim if dim >= 0 else xs.dim() + dim
        if not 0 <= ndim < xs.dim() - 1:
            raise ValueError(f"hcat: dim={dim} must index the stacked points of xs {tuple(xs.shape)}, not the "
                             "coordinate (last) dim")
        stacked = xs.movedim(ndim, -2)
        kk = _kt(k, stacked[..., 0, :])
        _check_points("hcat", kk.unsqueeze(-2) if isinstance(kk, torch.Tensor) and kk.dim() else k, xs=stacked)
        space = stacked[..., 1:]
        space = space.reshape(*space.shape[:-2], -1)
    else:
        if isinstance(xs, (str, bytes)) or not isinstance(xs, Sequence):
            raise TypeError(f"hcat: xs must be a tensor or a sequence of tensors, got {type(xs).__name__}")
        if not len(xs):
            raise ValueError("hcat: xs must hold at least one tensor of points [..., 1+n], got an empty sequence")
        for i, x in enumerate(xs):
            _check_tensor("hcat", f"xs[{i}]", x)
        _check_devices("hcat", **{f"xs[{i}]": x for i, x in enumerate(xs)})
        batch = [tuple(x.shape[:-1]) for x in xs]
        if len(set(batch)) > 1:
            raise ValueError("hcat: the points xs[i] must have the same batch dims (all but the last), got shapes "
                             + ", ".join(str(tuple(x.shape)) for x in xs))
        kk = _kt(k, xs[0])
        for i, x in enumerate(xs):
            _check_points("hcat", k, **{f"xs[{i}]": x})
        space = torch.cat([x[..., 1:] for x in xs], dim=-1)
    space = to_stat(space)
    out = _lift(space, kk if not isinstance(kk, torch.Tensor) else kk.to(space.dtype))
    _check_lifted("hcat", "xs", space, out)
    return out


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
