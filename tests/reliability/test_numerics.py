"""Issue 11, item 7 ("far from the origin"): the public manifold functions and Lorentz attention stay accurate
for space-part norms up to 1e4 in fp32.

Every case builds its inputs in fp64, rounds them to fp32 once, and compares the function evaluated in fp32
with the *same* function evaluated in fp64 on the fp32-rounded inputs (so input rounding is not counted, only
the arithmetic). Errors are relative to the largest entry of the fp64 result (``tests.helpers.relative_error``).
The Triton kernel gets the same sweep in ``tests/ops/lorentz_attention_triton/test_far_from_origin.py`` (it needs
the interpreter set up by that folder's conftest).
"""

from __future__ import annotations

import fractions
import math
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import helm.manifold.math as M
from helm.ops import lorentz_attention
from tests.helpers import assert_close, relative_error, space_parts, tiny_model

NORMS = [1.0, 1e2, 1e3, 1e4]
NORM_IDS = ["1", "1e2", "1e3", "1e4"]
K = 0.7  # a curvature other than 1 so a missing k would show

# Bounds (relative error of fp32 against fp64 on the same fp32 inputs). fp32 unit roundoff is 6e-8.
# * Elementwise maps and single reductions over n <= 64 coordinates (lift, inner, rescale, hcat, logmap0,
#   expmap0, manifold_error): a few dozen roundings at most -> 1e-5 (tests.helpers.RTOL[float32]).
# * Results that divide by a Minkowski norm or take a square root of a difference that can be small
#   (sqdist, dist, normalize, centroid): the formulations avoid the cancellation, so the error is still a few
#   dozen roundings of the result's own scale -> 1e-5 as well.
# * Attention: a softmax over 16 keys (scores up to 2|q||k|/tau ~ 1e8 at 1e4, whose own fp32 rounding moves the
#   weights by at most a few ulps relative), a weighted sum of 16 values and the normalisation -> 1e-4, the
#   kernel tests' fp32 bound (tests/ops/lorentz_attention_triton/test_lorentz_attention.py::FP32_TOL).
TOL = 1e-5
ATTN_TOL = 1e-4
# * Ill-conditioned forms (issue 22: nothing is widened to fp64 any more): the plain Minkowski product of nearby
#   points far from the origin (inner-near) and normalize without the caller's norm2 cancel two terms of size ~r²,
#   so fp32 gives them to about u·κ, u = 2^-24, κ = (|x_t y_t| + |x_s||y_s|) / |<x, y>_L| (normalize:
#   (s_t² + |s_s|²) / |<s, s>_L|). Measured 0.2-0.5 u·κ (1e-4 to 5e-2 at 1e2-1e3; 2e-8 to 4e-8 with the fp64
#   accumulation they had before); past κ = 1/u (1e4 here) no digit is left, and nothing is pinned there. No
#   layer evaluates them in that regime: distances, residuals, centroids, attention and MiCE use difference forms.
ILL_CONDITIONED = {"inner-near", "normalize", "normalize-mix"}
U = 2.0 ** -24


def condition(name, inputs):
    """``κ`` of an ``ILL_CONDITIONED`` case on its (fp32) inputs, evaluated in fp64."""
    x = [t.double() for t in inputs]
    if name.startswith("inner"):
        terms = (x[0][..., 0] * x[1][..., 0]).abs() + x[0][..., 1:].norm(dim=-1) * x[1][..., 1:].norm(dim=-1)
        return float((terms / M.inner(x[0], x[1]).abs()).max())
    return float((x[0].pow(2).sum(-1) / M.sqnorm(x[0]).abs()).max())


def points(r, shape=(5, 3), n=16, seed=0, k=K):
    """Points of ``H_k`` with space-part norm ``r``, lifted in fp64 (rounded to fp32 by the caller)."""
    return M.lift(r * space_parts(shape, n, "unit", seed=seed), k=k)


def near(x, eps, seed, k=K):
    """Points at Euclidean distance ~``eps`` of ``x`` (space part perturbed, time recomputed)."""
    g = torch.Generator().manual_seed(seed)
    return M.lift(x[..., 1:] + eps * torch.randn(x[..., 1:].shape, generator=g, dtype=torch.float64), k=k)


def _tangent_for_norm(r, shape=(5, 3), n=16, seed=0, k=K):
    """Tangent vectors at the origin whose image under expmap0 has space norm ``r`` (|u| = sqrt(k) asinh(r/sqrt k)):
    expmap0 of a tangent of norm 1e4 is e^(1e4), beyond every float format."""
    u = math.sqrt(k) * math.asinh(r / math.sqrt(k)) * space_parts(shape, n, "unit", seed=seed)
    return torch.cat([torch.zeros_like(u[..., :1]), u], dim=-1)


# name -> (function of fp-typed inputs, inputs builder(r) returning fp64 tensors, bound)
CASES = {
    "inner": (lambda x, y: M.inner(x, y), lambda r: (points(r), points(r, seed=1)), TOL),
    "inner-near": (lambda x, y: M.inner(x, y), lambda r: (points(r), near(points(r), 1.0, 2)), TOL),
    "sqnorm": (lambda s: M.sqnorm(s), lambda r: (points(r) * 1.5 + points(r, seed=1),), TOL),
    "lift": (lambda s: M.lift(s, k=K), lambda r: (r * space_parts((5, 3), 16, "unit"),), TOL),
    "sqdist": (lambda x, y: M.sqdist(x, y, k=K), lambda r: (points(r), points(r, seed=1)), TOL),
    "sqdist-near": (lambda x, y: M.sqdist(x, y, k=K), lambda r: (points(r), near(points(r), 1.0, 2)), TOL),
    # the layers' one-pass form: accurate relative to d² for points apart only (nearby: absolute, see sqdist)
    "sqdist_one_pass": (lambda x, y: M.sqdist_one_pass(x, y), lambda r: (points(r), points(r, seed=1)), TOL),
    "dist": (lambda x, y: M.dist(x, y, k=K), lambda r: (points(r), points(r, seed=1)), TOL),
    "dist-near": (lambda x, y: M.dist(x, y, k=K), lambda r: (points(r), near(points(r), 1.0, 2)), TOL),
    "expmap0": (lambda u: M.expmap0(u, k=K), lambda r: (_tangent_for_norm(r),), TOL),
    "logmap0": (lambda x: M.logmap0(x, k=K), lambda r: (points(r),), TOL),
    # normalize: a time-like vector close to the hyperboloid (a scaled point) is the hard case: |<s,s>_L| ~ k
    # while s_t^2 ~ |s_s|^2 ~ r^2.
    "normalize": (lambda s: M.normalize(s, k=K), lambda r: (2.5 * points(r),), TOL),
    "normalize-mix": (lambda s: M.normalize(s, k=K), lambda r: (0.3 * points(r) + 0.7 * near(points(r), 1.0, 3),),
                      TOL),
    "centroid": (lambda x, w: M.centroid(x, w, k=K),
                 lambda r: (torch.stack([points(r), near(points(r), 1.0, 4), points(r, seed=5)], -2),
                            torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)), TOL),
    "centroid-cluster": (lambda x: M.centroid(x, k=K),
                         lambda r: (torch.stack([near(points(r), 1.0, s) for s in range(4)], -2),), TOL),
    "rescale": (lambda x: M.rescale(x, k_in=K, k_out=2.0), lambda r: (points(r),), TOL),
    "hcat": (lambda x: M.hcat(x, k=K, dim=-2), lambda r: (points(r),), TOL),
    "manifold_error": (lambda x: M.manifold_error(x, K), lambda r: (points(r),), TOL),
}


def _round(t):
    return t.to(torch.float32)


@pytest.mark.parametrize("r", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_manifold_function_far_from_origin(name, r, request):
    fn, build, bound = CASES[name]
    inputs32 = [_round(t) for t in build(r)]
    if name in ILL_CONDITIONED:
        cond = U * condition(name, inputs32)
        if cond >= 1:
            pytest.skip(f"{name} at |x_s| = {r:g}: u·κ = {cond:.0f}, beyond fp32 (no layer evaluates it there)")
        bound = max(bound, cond)
    out32 = fn(*inputs32)
    out64 = fn(*[t.double() for t in inputs32])
    # manifold_error measures in fp64 whatever it is given; every other function returns the input precision
    assert out32.dtype == (torch.float64 if name == "manifold_error" else torch.float32)
    assert_close(out32, out64, rtol=bound, msg=f"{name} at |x_s| = {r:g}")


# sqdist / dist of two points against fp64 on the same fp32 inputs over space-part norms 1..1e4 and separations
# 1e-4..1e4 (the second re-probe: nearby points far out gave dist 1.1e-19 for 1e-4, sqdist 0). Directions of the
# separation: random, tangential (orthogonal to x_s), and along the ray of x_s (outwards and inwards). Along the ray
# the distance of nearby far points itself moves under a one-ulp rotation of an input by up to u·|x_s + y_s|/sqrt(k)
# of itself, so the bound there is SEP_RAY_BOUND u·κ, κ = 1 + |x_s + y_s|/sqrt(k) (measured up to 1.3 u·κ); elsewhere
# the error is a few u (measured 4e-7). The old <x-y, x-y>_L of the stored points was off by up to 5e4 (relative).
SEPARATIONS = [1e-4, 1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3, 1e4]
SEP_TOL = 2e-6
SEP_RAY_BOUND = 4.0


def _separated_pairs(r, direction, n=16, rows=32):
    """fp32 point pairs of H_K: x at space norm r, y = x + sep·v for every separation (rows each), lifted from the
    fp32-rounded space parts."""
    g = torch.Generator().manual_seed(int(r) + len(direction))
    u = torch.randn(len(SEPARATIONS), rows, n, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True)
    v = torch.randn(len(SEPARATIONS), rows, n, generator=g, dtype=torch.float64)
    if direction == "tangent":
        v = v - (v * u).sum(-1, keepdim=True) * u
    elif direction in ("outwards", "inwards"):
        v = u if direction == "outwards" else -u
    v = v / v.norm(dim=-1, keepdim=True)
    sep = torch.tensor(SEPARATIONS, dtype=torch.float64)[:, None, None]
    return M.lift((r * u).float(), k=K), M.lift((r * u + sep * v).float(), k=K)


@pytest.mark.parametrize("direction", ["random", "tangent", "outwards", "inwards"])
@pytest.mark.parametrize("r", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("fn", [M.sqdist, M.dist], ids=["sqdist", "dist"])
def test_distance_of_points_at_every_separation_far_from_the_origin(fn, r, direction):
    x, y = _separated_pairs(r, direction)
    out, ref = fn(x, y, k=K), fn(x.double(), y.double(), k=K)
    assert out.dtype == torch.float32 and (out >= 0).all()
    err = (out.double() - ref).abs() / ref.where(ref > 0, torch.ones_like(ref))  # equal fp32 inputs: both exactly 0
    assert (out[ref == 0] == 0).all()
    if direction in ("outwards", "inwards"):
        kappa = 1 + (x[..., 1:] + y[..., 1:]).double().norm(dim=-1) / math.sqrt(K)
        worst = float((err / (U * kappa)).max())
        assert worst <= SEP_RAY_BOUND, f"{fn.__name__} along the ray at |x_s| = {r:g}: {worst:.2f} u·κ"
    else:
        worst = float(err.max())
        assert worst <= SEP_TOL, f"{fn.__name__} ({direction}) at |x_s| = {r:g}: relative error {worst:.2e}"


def test_distance_far_apart_on_one_ray_is_exact_to_rounding():
    """The other end of the sweep: the origin and points 1e4 out on one ray, where the difference form alone
    cancels (its denominator) and the inner-product form is the well-conditioned one: exact asinh differences."""
    r = torch.tensor([1e-3, 1.0, 1e2, 1e4], dtype=torch.float64)
    x = M.origin(4, 5, k=K)
    y = M.lift(torch.cat([r[:, None], torch.zeros(4, 3, dtype=torch.float64)], -1).float(), k=K)
    ref = math.sqrt(K) * torch.asinh(y[..., 1].double() / math.sqrt(K))
    assert_close(M.dist(x, y, k=K).double(), ref, rtol=1e-6)


def test_every_public_function_is_swept():
    swept = {name.split("-")[0] for name in CASES} | {"origin"}
    # no floating-point maths of points (positive_exp, of scalar scales, has its own test below)
    helpers = {"positive_exp", "curvature_to_k", "k_to_curvature", "check_k"}
    assert set(M.__all__) - helpers <= swept


# Python-number k outside (0, inf) is refused by every public function, naming the argument (tensors are not
# read: that would synchronise with the device). (case id, call, k, argument named)
_x = torch.tensor([[1.5, 0.5, 1.0]])
BAD_K = [
    ("dist k=0", lambda k: M.dist(_x, _x, k=k), 0.0, "k"),
    ("dist k=-1", lambda k: M.dist(_x, _x, k=k), -1.0, "k"),
    ("lift k=-1", lambda k: M.lift(_x[..., 1:], k=k), -1.0, "k"),
    ("lift k=nan", lambda k: M.lift(_x[..., 1:], k=k), float("nan"), "k"),
    ("expmap0 k=inf", lambda k: M.expmap0(_x, k=k), float("inf"), "k"),
    ("logmap0 k=0", lambda k: M.logmap0(_x, k=k), 0.0, "k"),
    ("sqdist k=-1", lambda k: M.sqdist(_x, _x, k=k), -1.0, "k"),
    ("origin k=0", lambda k: M.origin(1, 3, k=k), 0.0, "k"),
    ("normalize k=-2", lambda k: M.normalize(_x, k=k), -2.0, "k"),
    ("centroid k=0", lambda k: M.centroid(_x[None], k=k), 0.0, "k"),
    ("hcat k=-1", lambda k: M.hcat([_x, _x], k=k), -1.0, "k"),
    ("manifold_error k=0", lambda k: M.manifold_error(_x, k), 0.0, "k"),
    ("rescale k_out=0", lambda k: M.rescale(_x, k_in=1.0, k_out=k), 0.0, "k_out"),
    ("rescale k_in=-1", lambda k: M.rescale(_x, k_in=k, k_out=1.0), -1.0, "k_in"),
    ("lift k=str", lambda k: M.lift(_x[..., 1:], k=k), "1", "k"),
    # C046/C081: a k that fp32 rounds to 0 (origin's time coordinate was 0) or inf, or a subnormal one
    ("origin k=1e-320", lambda k: M.origin(3, k=k), 1e-320, "k"),
    ("dist k=1e-320", lambda k: M.dist(_x, _x, k=k), 1e-320, "k"),
    ("lift k=1e-39 (subnormal in fp32)", lambda k: M.lift(_x[..., 1:], k=k), 1e-39, "k"),
    ("expmap0 k=1e39 (inf in fp32)", lambda k: M.expmap0(_x, k=k), 1e39, "k"),
    ("rescale k_out=1e-320", lambda k: M.rescale(_x, k_in=1.0, k_out=k), 1e-320, "k_out"),
    ("k_to_curvature k=1e-320", lambda k: M.k_to_curvature(k), 1e-320, "k"),
]


@pytest.mark.parametrize("case,call,k,name", BAD_K, ids=[c[0] for c in BAD_K])
def test_python_k_outside_the_domain_is_refused(case, call, k, name):
    with pytest.raises(ValueError, match=rf"^{name} .*{re.escape(repr(k))}"):
        call(k)


def test_python_k_at_the_ends_of_its_range_is_accepted():
    """C046/C081's range, fp32's normal numbers: its ends are taken and give points of the upper sheet."""
    for k in (M.K_MIN, M.K_MAX, 1e-30):
        o = M.origin(2, 3, k=k)
        assert bool((o[..., 0] > 0).all() and torch.isfinite(o).all()), k
        assert M.k_to_curvature(k) == -1 / k and M.curvature_to_k(-1 / k) == k


# Issue 33: no public function reads a tensor's values on the host (each read stalls an accelerator's launch
# queue), also for a tensor k and centroid weights outside the domain: those give wrong values, not errors.
_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal"}


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _SYNC_OPS:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(CASES) + ["negative tensor k", "negative centroid weights", "origin"])
def test_public_functions_read_no_tensor_values(name):
    fn, build, _ = CASES.get(name, (None, lambda r: (points(r),), None))
    calls = {"negative tensor k": lambda x: M.lift(x[..., 1:], k=torch.tensor(-1.0)),
             "negative centroid weights": lambda x: M.centroid(x, -torch.ones(3), k=K, dim=0),
             "origin": lambda x: M.origin(2, 3, k=torch.tensor([[1.0], [4.0]]))}
    inputs = [t.float().requires_grad_() for t in build(10.0)]
    with _HostReads() as reads:
        out = calls.get(name, fn)(*inputs)
        if out.requires_grad:
            out.sum().backward()
    assert reads.seen == []


# Issue 26 item 3: a tensor k broadcasts against the time coordinates x[..., :1] without growing them (shape checked
# everywhere, free); a k of shape [3] against points [3, 1+n] made 3 time coordinates. (case, call)
_x3 = M.lift(torch.tensor([[0.5, 1.0], [-1.0, 0.2], [2.0, -0.3]]), k=1.0)
K_SHAPES = [
    ("lift k=ones(3)", lambda: M.lift(torch.randn(3, 4), k=torch.ones(3))),
    ("lift k=ones(2, 3, 1) grows the batch", lambda: M.lift(torch.randn(3, 4), k=torch.ones(2, 3, 1))),
    ("expmap0 k=ones(3)", lambda: M.expmap0(_x3, k=torch.ones(3))),
    ("logmap0 k=ones(3)", lambda: M.logmap0(_x3, k=torch.ones(3))),
    ("sqdist k=ones(3)", lambda: M.sqdist(_x3, _x3, k=torch.ones(3))),
    ("dist k=ones(3)", lambda: M.dist(_x3, _x3, k=torch.ones(3))),
    ("origin k=ones(3)", lambda: M.origin(3, 3, k=torch.ones(3))),
    ("normalize k=ones(3)", lambda: M.normalize(_x3, k=torch.ones(3))),
    ("centroid k=ones(3)", lambda: M.centroid(_x3, k=torch.ones(3))),
    ("rescale k_out=ones(3)", lambda: M.rescale(_x3, k_in=1.0, k_out=torch.ones(3))),
    ("hcat k=ones(3)", lambda: M.hcat([_x3, _x3], k=torch.ones(3))),
    ("manifold_error k=ones(3)", lambda: M.manifold_error(_x3, torch.ones(3))),
]


@pytest.mark.parametrize("case, call", K_SHAPES, ids=[c[0] for c in K_SHAPES])
def test_tensor_k_of_another_shape_than_the_time_coordinates_is_refused(case, call):
    with pytest.raises(ValueError, match=r"^k(_out)?\b.*\((3,|2, 3, 1)\)"):
        call()


def test_tensor_k_of_the_time_coordinates_shape_is_accepted():
    k = torch.tensor([[1.0], [2.0], [0.5]])
    x = M.lift(torch.randn(3, 4), k=k)
    assert x.shape == (3, 5) and M.manifold_error(x, k).max() <= 1e-6
    # one k per centroid, the points of each on their own H_k (x above, on three curvatures, is no such set)
    kc = torch.tensor([[1.0], [2.0]])
    c = M.centroid(M.lift(torch.randn(2, 3, 4), k=kc[:, None]), k=kc, dim=1)
    assert c.shape == (2, 5) and M.manifold_error(c, kc).max() <= 1e-6


# Issue 26 items 2 and 5: the centroid is invariant to a common positive scale of the weights, numerically too
# (1e-30 gave inf, 1e20 NaN), and weights that do not fit the points, or no points, are a ValueError.
# (case, weights of the 3 points of _points, expected message or None: the centroid of weights [1, 1, 1])
_points = M.lift(torch.tensor([[0.5, 1.0], [-1.0, 0.2], [2.0, -0.3]]), k=0.7)
CENTROID_SCALES = [
    ("1e-30", torch.full((3,), 1e-30), None),
    ("1e20", torch.full((3,), 1e20), None),
    ("1e30 uneven", torch.tensor([3e30, 1e30, 2e30]), None),
    ("4 weights for 3 points", torch.ones(4), r"^centroid: w of shape \(4,\) must broadcast to x's points \(3,\)"),
    ("no points", None, r"^centroid of no points: x \(0, 3\) holds 0 points"),
]


@pytest.mark.parametrize("case, w, message", CENTROID_SCALES, ids=[c[0] for c in CENTROID_SCALES])
def test_centroid_weights_scale_and_shape(case, w, message):
    if message is not None:
        with pytest.raises(ValueError, match=message):
            M.centroid(_points if w is not None else _points[:0], w if w is not None else torch.ones(0), k=0.7)
        return
    ref = M.centroid(_points.double(), (w / w.max()).double(), k=0.7)
    assert_close(M.centroid(_points, w, k=0.7), ref, rtol=TOL)


# Issue 25 item 11: the documented exact range of expmap0, theta = |u_s|/sqrt(k) < log(2 max / sqrt(k)):
# fp32 89.41 - log(k)/2, fp64 710.47 - log(k)/2; just inside finite, just outside an infinite time coordinate, never
# NaN (also for a tangent whose norm itself overflows, which gave nan). (dtype, k, theta, finite?)
EXPMAP_RANGE = [
    (torch.float32, 1.0, 89.40, True), (torch.float32, 1.0, 89.43, False), (torch.float32, 1.0, 200.0, False),
    (torch.float32, 1.0, 100.0, False), (torch.float32, 1.0, 1e30, False),
    (torch.float32, 4.0, 89.41 - 0.5 * math.log(4.0) - 0.02, True),
    (torch.float32, 4.0, 89.41 - 0.5 * math.log(4.0) + 0.03, False),
    (torch.float32, 1e-4, 89.41 - 0.5 * math.log(1e-4) - 0.02, True),
    (torch.float64, 1.0, 200.0, True), (torch.float64, 1.0, 710.46, True), (torch.float64, 1.0, 710.49, False),
    # the range of the output dtype, u's: an fp16 point overflows past e^11.78/2 = 65504 (it came back fp32 before)
    (torch.float16, 1.0, 11.70, True), (torch.float16, 1.0, 11.85, False), (torch.float16, 1.0, 15.0, False),
    (torch.bfloat16, 1.0, 88.5, True), (torch.bfloat16, 1.0, 90.0, False),
]
EXPMAP_LIMIT = {torch.float16: "11.78", torch.bfloat16: "89.41", torch.float32: "89.41", torch.float64: "710.47"}


@pytest.mark.parametrize("dtype, k, theta, finite", EXPMAP_RANGE,
                         ids=[f"{d}-k{k:g}-theta{t:.2f}" for d, k, t, _ in EXPMAP_RANGE])
def test_expmap0_is_finite_exactly_in_its_documented_range(dtype, k, theta, finite):
    u = torch.zeros(1, 4, dtype=dtype)
    u[0, 2] = math.sqrt(k) * theta
    u[0, 3] = u[0, 2]  # two equal coordinates: |u_s|² overflows for theta = 1e30
    u[0, 2:] /= math.sqrt(2) if theta < 1e30 else 1.0
    x = M.expmap0(u, k=k)
    assert x.dtype == dtype and not torch.isnan(x).any()
    assert bool(torch.isfinite(x).all()) == finite and (finite or torch.isposinf(x[..., 0]).all())
    assert (x[..., 1] == 0).all()


# expmap0 far out: sinh/cosh and |x_s|² overflow fp32 long before the point does. theta = |u|/sqrt(k); at
# theta <= 88 (k = 1) the point is representable in fp32 and must be finite, accurate, on the manifold, with
# finite gradients; beyond, an infinite time coordinate, never nan. (theta, k)
EXPMAP_FAR = [(20.5, 1.0), (50.0, 1.0), (88.0, 1.0), (60.0, 0.7), (89.5, 1.0), (283.0, 1.0), (1e4, 1.0),
              (283.0, 1e-4)]


@pytest.mark.parametrize("theta,k", EXPMAP_FAR, ids=[f"theta{t:g}-k{k:g}" for t, k in EXPMAP_FAR])
def test_expmap0_does_not_overflow_before_the_result(theta, k):
    direction = torch.tensor([0.0, 0.6, 0.0, -0.8, 1e-3], dtype=torch.float64)
    direction = direction / direction.norm()
    u = torch.cat([torch.zeros(1, dtype=torch.float64), math.sqrt(k) * theta * direction]).float()[None]
    u.requires_grad_(True)
    if theta + 0.5 * math.log(k) < 89.41:  # representable in fp32
        x = M.expmap0(u, k=k)
        ref = M.expmap0(u.detach().double(), k=k)
        assert torch.isfinite(x).all()
        assert_close(x.detach(), ref, rtol=10 * theta * 6e-8 + 1e-5, msg=f"expmap0 at theta={theta}")
        assert M.manifold_error(x.detach(), k).max() <= 1e-5
        x.sum().backward()
        assert torch.isfinite(u.grad).all()
    else:
        x = M.expmap0(u, k=k)
        assert torch.isposinf(x[..., 0]).all() and not torch.isnan(x).any()


@pytest.mark.parametrize("log_value", [0.0, 80.0, 88.0, 89.0, 1732.0, float("inf")])
def test_positive_exp_caps_the_exponent_where_fp32_overflows(log_value):
    """Below e^88 it is exp; above, e^88, so ``x / scale`` keeps a finite gradient (plain exp gives 0 * inf)."""
    log = torch.tensor(log_value, requires_grad=True)
    scale = M.positive_exp(log)
    assert scale.item() == pytest.approx(math.exp(min(log_value, 88.0)), rel=1e-6)
    (torch.tensor(3.0) / scale).backward()
    assert torch.isfinite(log.grad)
    if log_value < 88.0:
        assert log.grad.item() == pytest.approx(-3.0 / math.exp(log_value), rel=1e-6)


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_huge_temperatures_keep_gradients_finite(family):
    """Temperatures at e^1732 (every log-temperature scaled by 1000) make attention uniform; the loss and every
    gradient stay finite instead of the temperature's gradient turning NaN."""
    model = tiny_model(family, train=True, lm_head_mode="distance")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("log_tau"):
                p.fill_(1732.0)
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    loss = model(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("k", [0.1, 1.0, 10.0])
def test_origin(k):
    assert_close(M.origin(3, 17, k=k, dtype=torch.float32), M.origin(3, 17, k=k, dtype=torch.float64), rtol=TOL)


# Re-probe of the public manifold functions (the reliability issue's last numerics findings): arguments whose type,
# shape or Python value is wrong end in an exception naming the function and the argument, where they gave a silently
# wrong result or a raw torch error. Only what reads no tensor values is checked. (case, call, exception, culprit)
_pts = M.lift(torch.tensor([[0.5, 1.0], [-1.0, 0.2], [2.0, -0.3]]), k=1.0)  # on H_1
_far = M.lift(1e4 * space_parts((3,), 4, "unit"), k=K).float()  # |x_s| = 1e4 on H_0.7, rounded to fp32 once
_u = torch.tensor([[0.0, 0.3, -0.2]])
_nan, _inf = float("nan"), float("inf")
_k3 = torch.tensor([[1.0], [2.0], [5.0]])
BAD_ARGUMENTS = [
    # normalize's floor (NaN gave NaN points, -1 was taken) and norm2
    ("normalize floor=nan", lambda: M.normalize(2 * _pts, k=1.0, floor=_nan), ValueError, "normalize: floor .*nan"),
    ("normalize floor=-1", lambda: M.normalize(2 * _pts, k=1.0, floor=-1), ValueError, "normalize: floor .*-1"),
    ("normalize floor=inf", lambda: M.normalize(2 * _pts, k=1.0, floor=_inf), ValueError, "normalize: floor .*inf"),
    ("normalize floor of shape [3]", lambda: M.normalize(2 * _pts, k=1.0, floor=torch.ones(3)), ValueError,
     r"normalize: floor .*\(3,\)"),
    ("normalize norm2 of shape [7] (raw broadcast error)", lambda: M.normalize(2 * _pts, k=1.0, norm2=torch.ones(7)),
     ValueError, r"normalize: norm2 .*\(7,\)"),
    ("normalize norm2 of ints", lambda: M.normalize(2 * _pts, k=1.0, norm2=torch.ones(3, 1, dtype=torch.long)),
     TypeError, "normalize: norm2 .*int64"),
    # raw torch errors
    ("expmap0 of an integer tensor", lambda: M.expmap0(torch.tensor([[0, 1, 2]]), k=1.0), TypeError,
     "expmap0: u .*int64"),
    ("lift of an integer tensor", lambda: M.lift(torch.tensor([[1, 2]]), k=1.0), TypeError, "lift: x_s .*int64"),
    ("dist of a bool tensor", lambda: M.dist(_pts > 0, _pts, k=1.0), TypeError, "dist: x .*bool"),
    ("logmap0 of a list", lambda: M.logmap0([[1.0, 0.0]], k=1.0), TypeError, "logmap0: x .*list"),
    ("lift of a 0-dim tensor", lambda: M.lift(torch.tensor(1.0), k=1.0), ValueError, "lift: x_s .*0-dim"),
    ("logmap0 of a 0-dim tensor", lambda: M.logmap0(torch.tensor(1.0), k=1.0), ValueError, "logmap0: x .*0-dim"),
    ("expmap0 of shape (2, 0)", lambda: M.expmap0(torch.zeros(2, 0), k=1.0), ValueError,
     r"expmap0: u .*\(2, 0\)"),
    # shapes that broadcast silently into a wrong result, or fail with a raw error
    ("dist of (3, 3) and (2, 3) points", lambda: M.dist(_pts, _pts[:2], k=1.0), ValueError,
     r"dist: x of shape \(3, 3\) and y of shape \(2, 3\)"),
    ("sqdist of 1+2 and 1+3 coordinates", lambda: M.sqdist(_pts, M.lift(torch.ones(3, 3), k=1.0), k=1.0),
     ValueError, r"sqdist: x of shape \(3, 3\) and y of shape \(3, 4\)"),
    ("sqdist of 1+2 and 1 coordinates (broadcast)", lambda: M.sqdist(_pts, _pts[:, :1], k=1.0), ValueError,
     r"sqdist: x of shape \(3, 3\) and y of shape \(3, 1\)"),
    ("inner of (3, 3) and (2, 3)", lambda: M.inner(_pts, _pts[:2]), ValueError,
     r"inner: x of shape \(3, 3\) and y of shape \(2, 3\)"),
    ("hcat of nothing (raw torch.cat error)", lambda: M.hcat([], k=1.0), ValueError, "hcat: xs"),
    ("hcat along the coordinate dim", lambda: M.hcat(_pts[None], k=1.0, dim=-1), ValueError, "hcat: dim=-1"),
    ("origin of an integer dtype (was an integer point)", lambda: M.origin(2, 3, k=2.0, dtype=torch.long),
     TypeError, "origin: dtype .*int64"),
    ("origin of size -1 (raw torch error)", lambda: M.origin(-1, 3, k=1.0), ValueError,
     r"origin: size .*\(-1, 3\)"),
    ("origin of no coordinates (raw IndexError)", lambda: M.origin(2, 0, k=1.0), ValueError,
     r"origin: size .*\(2, 0\)"),
    ("curvature_to_k of a tensor (said 'must be a negative finite number')",
     lambda: M.curvature_to_k(torch.tensor(-2.0)), TypeError, "curvature .*torch.Tensor"),
    # C047/C082: k = -1/K past fp32's range (inf for -1e-320, which check_k then refused) or below it
    ("curvature_to_k(-1e-320) (was inf)", lambda: M.curvature_to_k(-1e-320), ValueError, "curvature .*-1e-320"),
    ("curvature_to_k(-1e39) (k subnormal in fp32)", lambda: M.curvature_to_k(-1e39), ValueError,
     r"curvature .*-1e\+39"),
    ("curvature_to_k of a Fraction below float's range (ZeroDivisionError)",
     lambda: M.curvature_to_k(fractions.Fraction(-1, 10 ** 400)), ValueError, r"curvature .*k = inf"),
    # C046/C081 in half precision: sqrt(k) is 0 or inf in fp16 (the origin's time coordinate)
    ("origin k=1e-10 in fp16 (time coordinate subnormal)", lambda: M.origin(3, k=1e-10, dtype=torch.float16),
     ValueError, "origin: k = 1e-10 .*float16"),
    ("origin k=1e10 in fp16 (time coordinate inf)", lambda: M.origin(3, k=1e10, dtype=torch.float16), ValueError,
     "origin: k = 10000000000.0 .*float16"),
]


@pytest.mark.parametrize("case, call, exc, message", BAD_ARGUMENTS, ids=[c[0] for c in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_naming_them(case, call, exc, message):
    with pytest.raises(exc, match=message):
        call()


# The other side of those checks: what they let through, and the documented results. (case, call, check)
_far4 = M.lift(torch.full((1, 4), 1e4), k=1.0)  # |x_s| = 2e4 in fp32; the probe's nearby pair
_far4b = M.lift(torch.full((1, 4), 1e4 + 1), k=1.0)


_np_half = fractions.Fraction(-1, 2)  # a numbers.Real that is no float (as NumPy's float32 scalars)


def _grad_at_equal_points():
    grads = []
    for fn in (M.dist, M.sqdist):
        for x in (M.lift(torch.randn(3, 8), k=K), _far4.expand(3, 5)):
            a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
            fn(a, b, k=K if x.shape[-1] == 9 else 1.0).sum().backward()
            grads += [a.grad, b.grad]
    return grads

DOCUMENTED_RESULTS = [
    ("far fp32 points on H_k (|x_s| = 1e4): finite distances", lambda: M.dist(_far, _far.flip(0), k=K),
     lambda d: torch.isfinite(d).all() and (d[[0, 2]] > 10).all() and d[1] < 1e-6),
    ("logmap0 of bf16 points returns bf16",
     lambda: M.logmap0(M.lift(space_parts((64,), 32, "random"), k=K).bfloat16(), k=K),
     lambda u: u.dtype == torch.bfloat16 and torch.isfinite(u).all()),
    ("item 3: expmap0 of fp16 is fp16, the fp32 result rounded once", lambda: M.expmap0(_u.half(), k=K),
     lambda x: x.dtype == torch.float16 and torch.equal(x, M.expmap0(_u.half().float(), k=K).half())),
    ("item 3: expmap0 of bf16 is bf16", lambda: M.expmap0(_u.bfloat16(), k=K), lambda x: x.dtype == torch.bfloat16),
    ("rescale of bf16 with a tensor k stays bf16", lambda: M.rescale(_pts.bfloat16(), k_in=torch.tensor(1.0),
                                                                     k_out=2.0), lambda x: x.dtype == torch.bfloat16),
    ("lift of bf16 is fp32 (the precision policy's points)", lambda: M.lift(_u[..., 1:].bfloat16(), k=K),
     lambda x: x.dtype == torch.float32),
    ("lift of |x_s| = 1.8e19 (inside fp32's range)", lambda: M.lift(torch.tensor([[1.8e19, 0.0]]), k=1.0),
     lambda x: torch.isfinite(x).all()),
    ("lift of |x_s| = 1e20 in fp64 (range 1.3e154)", lambda: M.lift(torch.tensor([[1e20, 0.0]], dtype=torch.float64),
                                                                    k=1.0), lambda x: torch.isfinite(x).all()),
    ("normalize floor=0 is no bound", lambda: M.normalize(2 * _pts, k=1.0, floor=0),
     lambda x: torch.equal(x, M.normalize(2 * _pts, k=1.0))),
    ("dist of (3, 3) and (1, 3) points broadcasts", lambda: M.dist(_pts, _pts[:1], k=1.0),
     lambda d: d.shape == (3,) and d[0] < 1e-6 and (d[1:] > 1).all()),
    # second re-probe
    ("dist of nearby fp32 points at |x_s| = 2e4 (was 1.1e-19, sqdist 0): fp64's 9.9995e-5",
     lambda: torch.cat([M.dist(_far4, _far4b, k=1.0), M.sqdist(_far4, _far4b, k=1.0)]),
     lambda d: abs(float(d[0]) / 9.99950003e-05 - 1) < 1e-5 and abs(float(d[1]) / 9.99900010e-09 - 1) < 1e-5),
    ("dist of equal points is exactly 0 (was sqrt(tiny) = 1.1e-19)", lambda: M.dist(_far4, _far4, k=1.0),
     lambda d: bool((d == 0).all())),
    ("dist and sqdist of x and itself have finite (zero) gradients, also far out",
     lambda: _grad_at_equal_points(), lambda g: all(bool(torch.isfinite(t).all() and (t == 0).all()) for t in g)),
    ("sqdist is the accurate form; the layers' one-pass form gives 0 (documented)",
     lambda: torch.cat([M.sqdist(_far4, _far4b, k=1.0), M.sqdist_one_pass(_far4, _far4b)]),
     lambda d: abs(float(d[0]) / 9.99900010e-09 - 1) < 1e-5 and float(d[1]) == 0),
    ("normalize norm2 = 0 with a floor is bounded by the floor", lambda: M.normalize(2 * _pts, k=1.0, floor=4.0,
                                                                                    norm2=torch.zeros(3, 1)),
     lambda x: torch.allclose(x, _pts)),
    ("normalize norm2 as a 0-dim tensor broadcasts", lambda: M.normalize(2 * _pts, k=1.0, norm2=torch.tensor(4.0)),
     lambda x: torch.allclose(x, _pts)),
    ("hcat of stacked heads with a per-row tensor k", lambda: M.hcat(M.lift(torch.randn(3, 4, 5), k=_k3[:, None]),
                                                                     k=_k3, dim=-2), lambda x: x.shape == (3, 21)),
    ("origin of a size tuple", lambda: M.origin((2, 3), k=2.0), lambda x: x.shape == (2, 3) and x[0, 0] == 2 ** 0.5),
    ("origin with a tensor k shaped like the time coordinates [2, 1] (was a raw expand error)",
     lambda: M.origin(2, 3, k=torch.tensor([[1.0], [4.0]])), lambda x: torch.equal(x[:, 0], torch.tensor([1.0, 2.0]))),
    ("curvature_to_k of a Fraction (a numbers.Real, not a float)", lambda: M.curvature_to_k(_np_half),
     lambda k: k == 2.0),
]


@pytest.mark.parametrize("case, call, check", DOCUMENTED_RESULTS, ids=[c[0] for c in DOCUMENTED_RESULTS])
def test_documented_results_of_the_checked_functions(case, call, check):
    assert check(call())


# C134/C209/C133: half-precision points are taken by every function (centroid converted them to fp32 first)
_half_points = torch.tensor([[[0.0, 0.3, 0.2], [0.0, 0.1, -0.5]]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_points_are_taken_by_every_function(dtype):
    x = M.expmap0(_half_points.to(dtype), k=1.0)
    assert x.dtype == dtype
    results = {
        "centroid": M.centroid(x, k=1.0),
        "centroid weighted, dim=1": M.centroid(x, torch.tensor([1.0, 2.0], dtype=dtype), k=1.0, dim=1),
        "centroid tensor k": M.centroid(x, k=torch.tensor([[1.0]])),
        "dist": M.dist(x, x.flip(1), k=1.0),
        "hcat": M.hcat(x, k=1.0),
        "rescale": M.rescale(x, k_in=1.0, k_out=2.0),
        "logmap0": M.logmap0(x, k=1.0),
    }
    for name, out in results.items():
        assert torch.isfinite(out).all(), name


# C172, the other side: points inside the range (time coordinates up to 9e18 < 9.22e18 in fp32) give finite
# distances, inner products, logarithms, centroids and concatenations for every pair: apart (antipodal,
# orthogonal), equal, and with the smallest and largest k of check_k's range. On the old code the distance of such
# points for a small k was inf (d² / 4k overflowed) and the weighted centroid of four of them overflowed its norm.
def _edge_points(r, k):
    s = torch.tensor([[r, 0.0], [-r, 0.0], [0.0, r], [r / 3, -r / 2]], dtype=torch.float64)
    return M.lift(s, k=k).float()


# (|x_s|, k); the old code failed each (k = 1 is fine there below 9e18; for k = 1e30 near the origin, 4k |Δ|² and
# (ck)² in sqdist's nearby form overflowed: NaN, which dist turned into 0)
_EDGE_CASES = [(r, k) for r in (1e5, 1e15, 9e18) for k in (M.K_MIN, 1e-30, 1e30)] + [(9e18, 1.0)]


@pytest.mark.parametrize("r, k", _EDGE_CASES, ids=[f"r={r:g}-k={k:.3g}" for r, k in _EDGE_CASES])
def test_points_inside_the_range_give_finite_results(r, k):
    x = _edge_points(r, k)
    a, b = x[:, None], x[None]
    d = M.dist(a, b, k=k)
    assert torch.isfinite(d).all() and (d.diagonal() == 0).all() and (d + torch.eye(4) > 0).all()
    reference = M.dist(a.double(), b.double(), k=k)  # fp64 on the same fp32 points
    assert_close(d, reference.float(), rtol=1e-5, msg=f"dist at r={r:g}, k={k:g}")
    for out in (M.sqdist(a, b, k=k), M.inner(a, b), M.sqnorm(x), M.logmap0(x, k=k), M.hcat(x, k=k, dim=0),
                M.centroid(x, torch.tensor([1.0, 1.0, 1.0, 1.0]), k=k, dim=0), M.centroid(x, k=k, dim=0),
                M.rescale(x, k_in=k, k_out=k)):
        assert torch.isfinite(out).all()


def test_dist_for_a_small_k_is_finite_and_accurate():
    """C172 (found with it): d² / 4k overflowed fp32 for k = 1e-30 at |x_s| = 1e5 (dist inf; fp64: 9.35e-14)."""
    x = M.lift(torch.tensor([[1e5, 0.0], [-1e5, 0.0]]), k=1e-30)
    d = M.dist(x[:1], x[1:], k=1e-30)
    assert_close(d, M.dist(x[:1].double(), x[1:].double(), k=1e-30).float(), rtol=1e-6)


# --- attention -------------------------------------------------------------------------------------------

B, H, T, D, DV = 1, 2, 16, 8, 8
TAU = 3.0


def _attention_inputs(kind, r):
    """fp64 q, k, v for one scenario at space norm ``r``:
    * ``all``: queries, keys and values at norm r (scores ~ r^2: the softmax is one-hot far out);
    * ``values``: q, k near the origin (flat softmax), values at norm r in random directions;
    * ``cluster``: flat softmax over values clustered (Euclidean spread 1) around one point at norm r, the
      case where the weighted sum lies close to the hyperboloid and <S,S>_L cancels most."""
    qn, vn = (r, r) if kind == "all" else (1.0, r)
    q = points(qn, (B, H, T), D, seed=11)
    k = points(qn, (B, H, T), D, seed=12)
    if kind == "cluster":
        centre = points(r, (B, H, 1), DV, seed=13).expand(B, H, T, 1 + DV)
        v = near(centre, 1.0, 14)
    else:
        v = points(vn, (B, H, T), DV, seed=13)
    return q, k, v


ATTN_KINDS = ["all", "values", "cluster"]


@pytest.mark.parametrize("r", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("kind", ATTN_KINDS)
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_far_from_origin(impl, kind, r):
    q, k, v = (_round(t) for t in _attention_inputs(kind, r))
    out32 = lorentz_attention(q, k, v, k=K, tau=TAU, impl=impl)
    out64 = lorentz_attention(q.double(), k.double(), v.double(), k=K, tau=TAU, impl="eager")
    assert out32.dtype == torch.float32
    assert_close(out32, out64, rtol=ATTN_TOL, msg=f"{impl} {kind} at |x_s| = {r:g}")
    # The result lies on the manifold by construction (time recomputed from space): manifold_error alone
    # cannot see the errors this test is about.
    assert M.manifold_error(out32, K).max() <= 1e-5


def measure():  # pragma: no cover - `python -m tests.reliability.test_numerics` prints the error table
    for name, (fn, build, _) in CASES.items():
        errs = []
        for r in NORMS:
            inputs32 = [_round(t) for t in build(r)]
            errs.append(relative_error(fn(*inputs32), fn(*[t.double() for t in inputs32])))
        print(f"{name:18s}", " ".join(f"{e:9.2e}" for e in errs))
    for impl in ("eager", "sdpa"):
        for kind in ATTN_KINDS:
            errs = []
            for r in NORMS:
                q, k, v = (_round(t) for t in _attention_inputs(kind, r))
                o32 = lorentz_attention(q, k, v, k=K, tau=TAU, impl=impl)
                o64 = lorentz_attention(q.double(), k.double(), v.double(), k=K, tau=TAU, impl="eager")
                errs.append(relative_error(o32, o64))
            print(f"attn-{impl}-{kind:8s}", " ".join(f"{e:9.2e}" for e in errs))


if __name__ == "__main__":
    measure()


def test_expmap0_ignores_the_time_coordinate_of_a_tangent():
    """Tangents at the origin are [0, u_s]: u_t is not read (geoopt's expmap0 reads it)."""
    u = torch.tensor([[5.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]])
    x = M.expmap0(u, k=1.0)
    assert torch.equal(x[0], x[1]) and M.manifold_error(x, 1.0).max() <= 1e-6
