"""Layer values and gradients against fp64 references written from the paper's equations (``tests/references.py``,
which imports nothing from ``helm``), on perturbed parameters so that a dropped term shows."""

from typing import Callable, NamedTuple

import pytest
import torch
from torch import nn

from helm.manifold import lift
from helm.nn import (
    LorentzActivation,
    LorentzEmbedding,
    LorentzLinear,
    LorentzLMHead,
    LorentzResidual,
    LorentzRMSNorm,
    LorentzSwiGLU,
)
from tests import references as refs
from tests.helpers import CURVATURES, EDGE_KINDS, MANIFOLD_TOL, assert_close, space_parts

D = 1 + 17  # ambient dim with an odd space part
SHAPES = [(1,), (2, 63)]  # a single token; a batch of 63-token rows
F64 = torch.float64

# Euclidean activations written out, so a swapped or mis-wired activation in helm cannot hide in the reference
ACTS = {
    "silu": refs.silu,
    "gelu": refs.gelu,
    "relu": lambda z: z.clamp_min(0),
    "tanh": torch.tanh,
    "sigmoid": lambda z: 1 / (1 + torch.exp(-z)),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randomise_linear(lin: nn.Linear, g: torch.Generator, std: float = 0.3) -> None:
    """Weights of order one on the time column too (init leaves them small), biases far from zero."""
    with torch.no_grad():
        lin.weight.copy_(std * torch.randn(lin.weight.shape, generator=g))
        if lin.bias is not None:
            lin.bias.copy_(0.5 * torch.randn(lin.bias.shape, generator=g))


def _linear(out_features, k_out=None, bias=True):
    def make(k):
        m = LorentzLinear(D, out_features, k=k, k_out=k_out, bias=bias)
        _randomise_linear(m.linear, _gen(1))
        return m
    return make


def _swiglu(k):
    m = LorentzSwiGLU(D, 1 + 33, k=k)
    g = _gen(2)
    for lin in (m.gate_proj, m.up_proj, m.down_proj):
        _randomise_linear(lin, g)
    return m


def _rmsnorm(eps):
    def make(k):
        m = LorentzRMSNorm(D, k=k, eps=eps)
        with torch.no_grad():
            m.weight.copy_(torch.empty(D - 1).uniform_(-2.0, 2.0, generator=_gen(3)))  # signs too
        return m
    return make


def _residual(raw_weight, space_scale=None):
    def make(k):
        m = LorentzResidual(k=k, space_scale=space_scale)
        with torch.no_grad():
            m.raw_weight.fill_(raw_weight)
        return m
    return make


def _head(mode, bias):
    def make(k):
        m = LorentzLMHead(D, 11, k=k, mode=mode, bias=bias)
        g = _gen(4)
        with torch.no_grad():
            if mode == "linear":
                m.weight.copy_(0.3 * torch.randn(m.weight.shape, generator=g))
            else:  # prototypes on H_k, away from the origin; a temperature away from 1
                m.weight.copy_(refs.to_hyperboloid(0.5 * torch.randn(11, D - 1, generator=g, dtype=F64), k))
                m.log_tau.fill_(0.4)
            if bias:
                m.bias.copy_(torch.randn(11, generator=g))
        return m
    return make


class Case(NamedTuple):
    make: Callable[[float], nn.Module]  # k -> module with perturbed parameters
    forward: Callable  # (module, x, fx) -> output; fx is the residual branch, ignored elsewhere
    reference: Callable  # (parameters by name, x, fx, k) -> fp64 output
    k_out: Callable[[float], float]  # output curvature of a point layer


def _same(k):
    return k


def _one_input(m, x, fx):
    return m(x)


POINT_CASES = {
    "linear": Case(_linear(1 + 9), _one_input,
                   lambda p, x, fx, k: refs.hlt(x, p["linear.weight"], p["linear.bias"], k), _same),
    "linear_no_bias": Case(_linear(1 + 9, bias=False), _one_input,
                           lambda p, x, fx, k: refs.hlt(x, p["linear.weight"], None, k), _same),
    "linear_curvature_change": Case(
        _linear(1 + 12, k_out=2.5), _one_input,
        lambda p, x, fx, k: refs.hlt(x, p["linear.weight"], p["linear.bias"], k, 2.5), lambda k: 2.5),
    "rmsnorm": Case(_rmsnorm(1e-12), _one_input, lambda p, x, fx, k: refs.rms_norm_l(x, p["weight"], 1e-12, k), _same),
    # eps at its upper bound is 1% of the unit-variance inputs' mean square, so a misplaced eps shows
    "rmsnorm_eps": Case(_rmsnorm(1e-2), _one_input, lambda p, x, fx, k: refs.rms_norm_l(x, p["weight"], 1e-2, k),
                        _same),
    **{f"activation_{a}": Case(lambda k, a=a: LorentzActivation(a, k=k), _one_input,
                               lambda p, x, fx, k, a=a: refs.activation_l(x, ACTS[a], k), _same)
       for a in ("silu", "gelu", "relu", "tanh", "sigmoid")},
    "swiglu": Case(_swiglu, _one_input, lambda p, x, fx, k: refs.swiglu_l(
        x, p["gate_proj.weight"], p["gate_proj.bias"], p["up_proj.weight"], p["up_proj.bias"],
        p["down_proj.weight"], p["down_proj.bias"], k), _same),
    # raw weight < 0: w = softplus(-1.3) = 0.24, so a raw weight used unsquashed is negative and shows
    "residual": Case(_residual(-1.3), lambda m, x, fx: m(x, fx),
                     lambda p, x, fx, k: refs.lresnet(x, fx, p["raw_weight"], k), _same),
    "residual_space_scale": Case(_residual(0.9, space_scale=3.0), lambda m, x, fx: m(x, fx),
                                 lambda p, x, fx, k: refs.lresnet(x, fx, p["raw_weight"], k, 3.0), _same),
}

HEAD_CASES = {
    "head_linear": Case(_head("linear", False), _one_input,
                        lambda p, x, fx, k: refs.linear_logits(x, p["weight"]), None),
    "head_linear_bias": Case(_head("linear", True), _one_input,
                             lambda p, x, fx, k: refs.linear_logits(x, p["weight"], p["bias"]), None),
    "head_distance": Case(_head("distance", False), _one_input,
                          lambda p, x, fx, k: refs.distance_logits(x, p["weight"], p["log_tau"], k), None),
    "head_distance_bias": Case(_head("distance", True), _one_input,
                               lambda p, x, fx, k: refs.distance_logits(x, p["weight"], p["log_tau"], k, p["bias"]),
                               None),
}

CASES = {**POINT_CASES, **HEAD_CASES}


def _points(shape, k, kind, dtype):
    """Input points ``x`` and residual branches ``fx`` (a different draw), stored in ``dtype``."""
    x = refs.to_hyperboloid(space_parts(shape, D - 1, kind, seed=0), k)
    fx = refs.to_hyperboloid(space_parts(shape, D - 1, kind, seed=1), k)
    return x.to(dtype), fx.to(dtype)


def _params(m: nn.Module) -> dict:
    """The module's parameters as stored, in fp64, for the reference."""
    return {name: p.detach().double() for name, p in m.named_parameters()}


def _k_id(k):
    return f"k{k}"


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("kind", EDGE_KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("k", CURVATURES, ids=_k_id)
@pytest.mark.parametrize("name", list(CASES))
def test_layer_values_match_reference(name, k, shape, kind, dtype):
    """Forward values equal the fp64 paper reference evaluated on the same stored inputs and parameters, to the
    tolerance of the precision the layer ran in (fp32 layers against the fp64 reference)."""
    case = CASES[name]
    m = case.make(k).to(dtype)
    x, fx = _points(shape, k, kind, dtype)
    y = case.forward(m, x, fx)
    assert y.dtype == dtype, name
    assert_close(y, case.reference(_params(m), x, fx, k), msg=name)


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("k", CURVATURES, ids=_k_id)
def test_layers_stay_on_manifold_at_huge_inputs(k, dtype):
    """At space norm 1e4 the value test's error bound (relative to the largest coordinate) leaves the time
    coordinate room to drift off ``<y, y>_L = -k_out``; bound the constraint itself there."""
    x, fx = _points((2, 63), k, "huge", dtype)
    for name, case in POINT_CASES.items():
        y = case.forward(case.make(k).to(dtype), x, fx)
        err = refs.manifold_violation(y, case.k_out(k)).max().item()
        assert err <= MANIFOLD_TOL[dtype], f"{name}: {err:.3g}"


@pytest.mark.parametrize("k", CURVATURES, ids=_k_id)
@pytest.mark.parametrize("name", list(CASES))
def test_layer_gradients_match_reference(name, k):
    """Autograd through the layer equals autograd through the fp64 reference, for every parameter and for the
    inputs' space parts (a point is a function of its space part, so that is the gradient along the manifold;
    the layers may use identities that hold on ``H_k`` only, which change the ambient gradient's normal part)."""
    case = CASES[name]
    m = case.make(k).double()
    g = _gen(5)
    xs = torch.randn(3, 7, D - 1, generator=g, dtype=F64, requires_grad=True)
    fxs = torch.randn(3, 7, D - 1, generator=g, dtype=F64, requires_grad=True)
    x, fx = refs.to_hyperboloid(xs, k), refs.to_hyperboloid(fxs, k)
    y = case.forward(m, x, fx)
    p = {n: t.clone().requires_grad_() for n, t in _params(m).items()}
    ref = case.reference(p, x, fx, k)
    cot = torch.randn(y.shape, generator=g, dtype=F64)
    labels = ["x_s", "fx_s", *p]
    got = torch.autograd.grad((y * cot).sum(), [xs, fxs, *dict(m.named_parameters()).values()], allow_unused=True,
                              retain_graph=True)  # x, fx are shared with the reference's graph
    want = torch.autograd.grad((ref * cot).sum(), [xs, fxs, *p.values()], allow_unused=True)
    for label, a, b in zip(labels, got, want):
        if b is None:
            assert a is None or not a.any(), f"{name}: d/d{label} should be zero"
        else:
            assert a is not None, f"{name}: no gradient for {label}"
            assert_close(a, b, msg=f"{name}: d/d{label}")


@pytest.mark.parametrize("name", ["linear", "rmsnorm_eps", "activation_gelu", "swiglu", "residual",
                                  "residual_space_scale"])
def test_curvature_passed_at_forward(name):
    """MiCE experts call layers with their own curvature tensor (``forward(..., k=k_j)``): the output is the
    reference's on that curvature, not the constructor's."""
    case = POINT_CASES[name]
    m = case.make(1.0).double()
    k_j = 0.3
    x, fx = _points((2, 63), k_j, "random", F64)
    kt = torch.tensor(k_j, dtype=F64)
    y = m(x, fx, k=kt) if name.startswith("residual") else m(x, k=kt)
    assert_close(y, case.reference(_params(m), x, fx, k_j), msg=name)


def test_linear_curvature_change_passed_at_forward():
    """``LorentzLinear.forward(x, k=k_in, k_out=k_out)`` maps ``H_{k_in} -> H_{k_out}`` (MiCE expert boundaries); an
    output curvature not given follows ``k_in`` on a layer built with ``k_out == k``, else is the constructor's."""
    m = _linear(1 + 12)(1.0).double()
    x, _ = _points((2, 63), 0.3, "random", F64)
    for k_in, k_out in [(0.3, 1.7), (0.3, None)]:
        y = m(x, k=torch.tensor(k_in, dtype=F64), k_out=None if k_out is None else torch.tensor(k_out, dtype=F64))
        assert_close(y, refs.hlt(x, m.linear.weight, m.linear.bias, k_in, k_out), msg=f"k_out={k_out}")
    y = m(refs.to_hyperboloid(x[..., 1:], 1.0), k_out=2.0)  # k_out alone: from the constructor's k = 1
    assert_close(y, refs.hlt(refs.to_hyperboloid(x[..., 1:], 1.0), m.linear.weight, m.linear.bias, 1.0, 2.0))
    # k alone, on a layer built to change curvature (k=1 -> k_out=2.5): the constructor's k_out is kept
    changing = _linear(1 + 12, k_out=2.5)(1.0).double()
    y = changing(x, k=torch.tensor(0.3, dtype=F64))
    assert_close(y, refs.hlt(x, changing.linear.weight, changing.linear.bias, 0.3, 2.5))


@pytest.mark.parametrize("mode", ["linear", "distance"])
def test_lm_head_cross_entropy_matches_reference_logits(mode):
    """``head(x, targets=t)`` (the fused training path) is the summed cross-entropy of the reference logits over
    the labelled positions; ``distance`` mode's dropped ``2k/τ`` cancels in the softmax."""
    k = 0.7
    head = _head(mode, True)(k).double()
    x, _ = _points((2, 63), k, "random", F64)
    t = torch.randint(0, 11, (2, 63), generator=_gen(6))
    t[0, :5] = -100
    ref_logits = CASES[f"head_{mode}_bias"].reference(_params(head), x, None, k)
    ref = nn.functional.cross_entropy(ref_logits.reshape(-1, 11), t.reshape(-1), ignore_index=-100, reduction="sum")
    assert_close(head(x, targets=t, chunk_size=17), ref)


def _embedding(mode, k):
    emb = LorentzEmbedding(101, D, k=k, mode=mode)
    with torch.no_grad():  # rows far from the origin, where a missing or wrong time coordinate shows
        space = torch.randn(101, D - 1, generator=_gen(7), dtype=F64)
        emb.weight.copy_(space if mode == "space" else refs.to_hyperboloid(space, k))
    return emb


def _embedding_reference(mode, table, ids, k):
    """``space``: the row is a space part, the output its point ``[sqrt(|e|² + k), e]``; ``lorentz``: the row is
    the point (paper App. C.1)."""
    rows = table.double()[ids]
    return refs.to_hyperboloid(rows, k) if mode == "space" else rows


def _ids():
    ids = torch.randint(0, 101, (3, 63), generator=_gen(8))
    ids[0, :3] = torch.tensor([0, 100, 0])  # both ends of the table, and a repeat
    return ids


@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("mode", ["space", "lorentz"])
@pytest.mark.parametrize("k", CURVATURES, ids=_k_id)
def test_embedding_values_match_reference(mode, k, dtype):
    emb = _embedding(mode, k).to(dtype)
    ids = _ids()
    out = emb(ids)
    assert out.dtype == dtype
    assert_close(out, _embedding_reference(mode, emb.weight.detach(), ids, k))


@pytest.mark.parametrize("mode", ["space", "lorentz"])
def test_embedding_gradients_match_reference(mode):
    """Gradients reach the table rows that were looked up, summed over repeats."""
    emb = _embedding(mode, 1.0).double()
    ids = _ids()
    cot = torch.randn(3, 63, D, generator=_gen(9), dtype=F64)
    (got,) = torch.autograd.grad((emb(ids) * cot).sum(), [emb.weight])
    table = emb.weight.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad((_embedding_reference(mode, table, ids, 1.0) * cot).sum(), [table])
    assert_close(got, want)


@pytest.mark.parametrize("k", CURVATURES, ids=_k_id)
def test_lorentz_embedding_init_on_manifold(k):
    """``lorentz`` mode returns its rows as they are, so the table's initialisation must put them on ``H_k``
    (no ``lift`` does it), in the precision the table is held in."""
    emb = LorentzEmbedding(101, D, k=k, mode="lorentz")
    for dtype in (torch.float32, F64):
        emb = emb.to(dtype)
        emb.reset_parameters()  # initialise in the target precision
        assert refs.manifold_violation(emb.weight.detach(), k).max() <= MANIFOLD_TOL[dtype]


def test_lorentz_embedding_is_manifold_parameter_with_wrapped_normal_init():
    import geoopt

    emb = LorentzEmbedding(2000, D, k=0.5, mode="lorentz", init_std=0.1)
    assert isinstance(emb.weight, geoopt.ManifoldParameter)
    assert isinstance(emb.weight.manifold, geoopt.Lorentz)
    assert float(emb.weight.manifold.k) == 0.5
    # wrapped normal: the log map at the origin recovers N(0, std^2) tangent coordinates
    u = refs.logmap0_space(emb.weight.detach(), k=0.5)
    assert abs(u.std().item() - 0.1) < 0.01
    assert abs(u.mean().item()) < 0.01


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("k", CURVATURES, ids=_k_id)
def test_gradcheck_layers(name, k):
    """Finite differences agree with autograd in every ambient direction of the input, off the manifold too (the
    reference comparison above covers the parameters and the directions along ``H_k``)."""
    case = CASES[name]
    m = case.make(k).double()
    x = lift(torch.randn(2, 3, D - 1, dtype=F64), k=k).requires_grad_()
    fx = lift(torch.randn(2, 3, D - 1, dtype=F64), k=k)
    assert torch.autograd.gradcheck(lambda a: case.forward(m, a, fx), (x,))


@pytest.mark.parametrize("kind", ["zero", "huge"])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_gradients_finite_at_edges(name, kind):
    case = CASES[name]
    m = case.make(1.0)
    x, fx = _points((3, 2), 1.0, kind, torch.float32)
    x.requires_grad_()
    case.forward(m, x, fx).sum().backward()
    assert torch.isfinite(x.grad).all(), name
    for pname, p in m.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{name}.{pname}"


@pytest.mark.parametrize("delta", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("k", CURVATURES, ids=_k_id)
def test_rmsnorm_scale_invariance_prop_4_5(delta, k):
    norm = LorentzRMSNorm(D, k=k)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    xs = torch.randn(4, 9, D - 1)
    ref = norm(lift(xs, k=k))
    out = norm(lift(delta * xs, k=k))
    assert_close(out, ref)


@pytest.mark.parametrize("kind", EDGE_KINDS)
def test_layers_under_bf16_autocast(kind):
    """Under bf16 autocast every layer returns fp32 values within the bf16 tolerance of the fp64 reference (on
    the fp32 inputs and parameters), and points on the manifold to the fp32 bound.

    Documented bf16 tolerance: the matmuls run in bf16 (RTOL[bfloat16] on values), but time coordinates and
    norms are computed and stored in fp32, so the manifold bound is the fp32 one (MANIFOLD_TOL[bfloat16] = 1e-5).
    """
    k = 1.0
    x, fx = _points((3, 5), k, kind, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, case in CASES.items():
            m = case.make(k)
            y = case.forward(m, x, fx)
            # points keep fp32 time coordinates; linear logits may stay in the autocast dtype, as nn.Linear's
            assert y.dtype == torch.float32 or name.startswith("head_linear") and y.dtype == torch.bfloat16, name
            assert_close(y, case.reference(_params(m), x, fx, k), dtype=torch.bfloat16, msg=name)
            if case.k_out is not None:
                assert refs.manifold_violation(y, case.k_out(k)).max() <= MANIFOLD_TOL[torch.bfloat16], name
        for mode in ("lorentz", "space"):
            emb, ids = _embedding(mode, k), _ids()
            e = emb(ids)
            assert_close(e, _embedding_reference(mode, emb.weight.detach(), ids, k), dtype=torch.bfloat16)
            assert refs.manifold_violation(e, k).max() <= MANIFOLD_TOL[torch.bfloat16]


def test_pure_bf16_parameters():
    """A model cast to bf16 (no autocast) still works: inputs are cast to the weight dtype, and the result is the
    reference's on the bf16-rounded input and parameters to the bf16 tolerance."""
    case = POINT_CASES["swiglu"]
    m = case.make(1.0).to(torch.bfloat16)
    x, _ = _points((3, 63), 1.0, "random", torch.float32)
    y = m(x)
    assert y.dtype == torch.float32 and refs.manifold_violation(y, 1.0).max() <= 1e-5
    assert_close(y, case.reference(_params(m), x.bfloat16(), None, 1.0), dtype=torch.bfloat16)


# Layers trust the arguments a validated config gives them; a standalone layer checks only what would otherwise be
# silently wrong (a reflected residual stream, a table of another kind, a table cut from its end). (factory, culprit)
BAD = [
    (lambda: LorentzResidual(space_scale=-1.0), "space_scale"),
    (lambda: LorentzEmbedding(10, 5, mode="poincare"), "mode"),
    (lambda: LorentzEmbedding(10, 5).resize(-1), "num_embeddings"),
    (lambda: LorentzLMHead(5, 10, mode="mlr"), "mode"),
]


@pytest.mark.parametrize("make,match", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()
