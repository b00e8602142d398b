import math

import pytest
import torch

from helm.manifold import (
    Lorentz,
    centroid,
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
)
from tests.helpers import BATCH_SHAPES, CURVATURES, EDGE_KINDS, MANIFOLD_TOL, space_parts

DTYPES = [torch.float32, torch.float64]
N = 17  # odd space dim


def _ids(vals, prefix):
    return [f"{prefix}{v}" for v in vals]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", EDGE_KINDS)
@pytest.mark.parametrize("shape", BATCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("k", CURVATURES, ids=_ids(CURVATURES, "k"))
def test_functions_stay_on_manifold(k, shape, kind, dtype):
    tol = MANIFOLD_TOL[dtype]
    xs = space_parts(shape, N, kind, dtype)
    ys = space_parts(shape, N, "random", dtype, seed=1)
    x, y = lift(xs, k=k), lift(ys, k=k)
    outputs = {
        "lift": x,
        "origin": origin(*shape, 1 + N, k=k, dtype=dtype),
        "expmap0": expmap0(torch.cat([torch.zeros_like(xs[..., :1]), xs * 1e-3 if kind == "huge" else xs], -1), k=k),
        "centroid": centroid(torch.stack([x, y, x], dim=-2), torch.tensor([0.2, 1.0, 3.0], dtype=dtype), k=k),
        "centroid_uniform": centroid(torch.stack([x, y], dim=-2), k=k),
        "normalize": normalize(x + 2 * y, k=k),
        "rescale": rescale(x, k_in=k, k_out=3.0 * k),
        "hcat": hcat([x, y, x], k=k),
    }
    for name, out in outputs.items():
        kk = 3.0 * k if name == "rescale" else k
        err = manifold_error(out, kk).max().item()
        assert err <= tol, f"{name}: manifold_error {err:.3g} > {tol}"
        assert out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", EDGE_KINDS)
@pytest.mark.parametrize("k", CURVATURES, ids=_ids(CURVATURES, "k"))
def test_identities(k, kind, dtype):
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    x = lift(space_parts((3, 5), N, kind, dtype), k=k)
    y = lift(space_parts((3, 5), N, "random", dtype, seed=2), k=k)

    back = expmap0(logmap0(x, k=k), k=k)
    assert torch.allclose(back, x, rtol=rtol, atol=rtol * math.sqrt(k))
    assert logmap0(x, k=k)[..., 0].abs().max() == 0

    assert dist(x, x, k=k).abs().max() <= 10 * rtol * math.sqrt(k)
    assert sqdist(x, x, k=k).abs().max() <= rtol * k

    # sqdist = -2k - 2<x,y>_L, evaluated in fp64 from the same stored points; rounding is relative to the
    # Euclidean size of the operands of the Minkowski form, |x - y|^2 (+ k at the origin)
    ref = -2 * k - 2 * inner(x.double(), y.double())
    scale = (x.double() - y.double()).pow(2).sum(-1) + k
    assert ((sqdist(x, y, k=k).double() - ref).abs() / scale).max() <= rtol

    # geodesic distance agrees with sqrt(k) arcosh(-<x,y>/k) (well conditioned when x, y are apart)
    if kind == "random":
        ref_d = math.sqrt(k) * torch.acosh((-inner(x.double(), y.double()) / k).clamp_min(1))
        assert torch.allclose(dist(x, y, k=k).double(), ref_d, rtol=100 * rtol)

    assert torch.allclose(centroid(x.unsqueeze(-2), k=k), x, rtol=rtol, atol=rtol * math.sqrt(k))
    assert torch.allclose(rescale(rescale(x, k_in=k, k_out=7.0), k_in=7.0, k_out=k), x, rtol=rtol)

    a, b = space_parts((3, 5), 4, kind, dtype, seed=3), space_parts((3, 5), 9, "random", dtype, seed=4)
    assert torch.allclose(hcat([lift(a, k=k), lift(b, k=k)], k=k), lift(torch.cat([a, b], -1), k=k), rtol=rtol)
    heads = lift(space_parts((3, 4), 5, kind, dtype, seed=5), k=k)  # [3, H=4, 1+5]
    assert torch.allclose(hcat(heads, k=k, dim=-2), lift(heads[..., 1:].reshape(3, 20), k=k), rtol=rtol)


def test_centroid_matches_paper_formula_and_floor():
    k = 0.7
    x = lift(torch.randn(4, 6, 9, dtype=torch.float64), k=k)
    w = torch.rand(4, 6, dtype=torch.float64)
    s = (w.unsqueeze(-1) * x).sum(-2)
    ref = math.sqrt(k) * s / inner(s, s, keepdim=True).abs().sqrt()
    assert torch.allclose(centroid(x, w, k=k), ref, rtol=1e-12)
    # the floor k (Σw)^2 is a true lower bound for non-negative weights
    assert (inner(s, s).abs() >= k * w.sum(-1).pow(2) * (1 - 1e-12)).all()
    # all-equal points: the bound is attained and the centroid is the point
    same = x[:, :1].expand(4, 6, 10)
    assert torch.allclose(centroid(same, w, k=k), x[:, 0], rtol=1e-12)


def test_centroid_rejects_coordinate_dim():
    with pytest.raises(ValueError, match="dim"):
        centroid(lift(torch.randn(3, 4), k=1.0), k=1.0, dim=-1)


def test_curvature_conversion_is_the_only_sign_flip():
    assert curvature_to_k(-1.0) == 1.0
    assert curvature_to_k(-0.1) == pytest.approx(10.0)
    assert k_to_curvature(curvature_to_k(-2.0)) == pytest.approx(-2.0)
    for bad in (0.0, 1.0, float("nan"), float("-inf")):
        with pytest.raises(ValueError, match="curvature"):
            curvature_to_k(bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "1"])
def test_bad_k_raises(bad):
    with pytest.raises(ValueError, match="k must be a positive"):
        Lorentz(bad)
    with pytest.raises(ValueError, match="k must be a positive"):
        k_to_curvature(bad)


FUNCS = {
    "inner": lambda x, y, k: inner(x, y),
    "lift": lambda x, y, k: lift(x[..., 1:], k=k),
    "sqdist": lambda x, y, k: sqdist(x, y, k=k),
    "dist": lambda x, y, k: dist(x, y, k=k),
    # a tangent vector of the size that reaches the test points (|x_s| = 1e4 is where sinh overflows)
    "expmap0": lambda x, y, k: expmap0(logmap0(x, k=k), k=k),
    "logmap0": lambda x, y, k: logmap0(x, k=k),
    "centroid": lambda x, y, k: centroid(torch.stack([x, y], -2), torch.tensor([0.3, 1.7], dtype=x.dtype), k=k),
    "normalize": lambda x, y, k: normalize(x + y, k=k),
    "rescale": lambda x, y, k: rescale(x, k_in=k, k_out=2.5),
    "hcat": lambda x, y, k: hcat([x, y], k=k),
}


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("k", CURVATURES, ids=_ids(CURVATURES, "k"))
def test_gradcheck(name, k):
    fn = FUNCS[name]
    x = lift(torch.randn(2, 3, 5, dtype=torch.float64), k=k).requires_grad_()
    y = lift(torch.randn(2, 3, 5, dtype=torch.float64), k=k).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: fn(a, b, k), (x, y))


@pytest.mark.parametrize("kind", ["zero", "huge"])
@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64"])
def test_gradients_finite_at_edges(name, kind, dtype):
    k = 1.0
    x = lift(space_parts((3,), N, kind, dtype), k=k).requires_grad_()
    y = lift(space_parts((3,), N, "random", dtype, seed=7), k=k).requires_grad_()
    out = FUNCS[name](x, y, k)
    gx, gy = torch.autograd.grad(out.sum(), [x, y], allow_unused=True)
    for g in (gx, gy):
        assert g is None or torch.isfinite(g).all(), name


def test_curvature_tensor_gradient():
    k = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(4, 3, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda kk: lift(xs, k=kk), (k,))
    assert torch.autograd.gradcheck(lambda kk: rescale(lift(xs, k=0.5), k_in=0.5, k_out=kk), (k,))


def test_lorentz_class_delegates_and_is_geoopt():
    import geoopt

    m = Lorentz(0.3)
    assert isinstance(m, geoopt.Lorentz)
    x = lift(torch.randn(5, 8, dtype=torch.float64), k=0.3)
    y = lift(torch.randn(5, 8, dtype=torch.float64), k=0.3)
    assert torch.allclose(m.dist(x, y), dist(x, y, k=0.3))
    assert torch.allclose(m.expmap0(m.logmap0(x)), x)
    assert torch.allclose(m.centroid(torch.stack([x, y], -2)), centroid(torch.stack([x, y], -2), k=0.3))
    # geoopt's own machinery agrees with our distance
    assert torch.allclose(geoopt.Lorentz(0.3).dist(x, y), dist(x, y, k=0.3), rtol=1e-6)
    assert m.manifold_error(m.projx(x + 0.1)).max() < 1e-12


def test_half_precision_inputs_promote_to_fp32():
    xs = torch.randn(4, 33).bfloat16() * 30
    x = lift(xs, k=1.0)
    assert x.dtype == torch.float32
    assert manifold_error(x, 1.0).max() <= MANIFOLD_TOL[torch.bfloat16]
    assert inner(xs, xs).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_tangents_map_in_their_dtype_with_fp32_gradients_inside(dtype):
    """expmap0/logmap0 compute in fp32 and round once to the input dtype, differentiably."""
    u = torch.cat([torch.zeros(4, 1), torch.randn(4, 6)], -1).to(dtype).requires_grad_()
    x = expmap0(u, k=0.7)
    assert x.dtype == dtype and logmap0(x, k=0.7).dtype == dtype
    assert torch.equal(x, expmap0(u.detach().float(), k=0.7).to(dtype))
    x.float().sum().backward()
    assert u.grad.dtype == dtype and torch.isfinite(u.grad).all() and u.grad[:, 1:].abs().sum() > 0


@pytest.mark.parametrize("pair", ["nearby far out", "apart", "antipodal", "at the origin"])
def test_sqdist_gradcheck_in_both_forms(pair):
    """sqdist picks the inner-product form for points apart and the difference form for nearby ones (per row): the
    gradient is the exact derivative of whichever is evaluated, and finite where they meet."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3, 4, generator=g, dtype=torch.float64)
    b = {"nearby far out": 50 * a + 0.1 * torch.randn(3, 4, generator=g, dtype=torch.float64),
         "apart": torch.randn(3, 4, generator=g, dtype=torch.float64) * 5, "antipodal": -3 * a,
         "at the origin": torch.zeros(3, 4, dtype=torch.float64)}[pair]
    x = lift(50 * a if pair == "nearby far out" else a, k=0.7).requires_grad_()
    y = lift(b, k=0.7).requires_grad_()
    assert torch.autograd.gradcheck(lambda p, q: sqdist(p, q, k=0.7), (x, y))
    assert torch.autograd.gradcheck(lambda p, q: dist(p, q, k=0.7), (x, y))
