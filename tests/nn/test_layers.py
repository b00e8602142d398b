import pytest
import torch

from helm.manifold import lift, manifold_error
from helm.nn import (
    LorentzActivation,
    LorentzEmbedding,
    LorentzLinear,
    LorentzLMHead,
    LorentzResidual,
    LorentzRMSNorm,
    LorentzSwiGLU,
)
from tests.helpers import BATCH_SHAPES, CURVATURES, EDGE_KINDS, MANIFOLD_TOL, assert_close, space_parts

D = 1 + 17  # ambient dim with an odd space part


def point_layers(k):
    """name -> (module, forward(module, x), output curvature)."""
    return {
        "linear": (LorentzLinear(D, 1 + 9, k=k), lambda m, x: m(x), k),
        "linear_curvature_change": (LorentzLinear(D, 1 + 12, k=k, k_out=2.5), lambda m, x: m(x), 2.5),
        "rmsnorm": (LorentzRMSNorm(D, k=k), lambda m, x: m(x), k),
        "activation": (LorentzActivation("gelu", k=k), lambda m, x: m(x), k),
        "swiglu": (LorentzSwiGLU(D, 1 + 33, k=k), lambda m, x: m(x), k),
        "residual": (LorentzResidual(k=k, weight=0.7), lambda m, x: m(x, x.flip(0)), k),
        "residual_scaled": (LorentzResidual(k=k, space_scale=3.0), lambda m, x: m(x, x.flip(0)), k),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", EDGE_KINDS)
@pytest.mark.parametrize("shape", BATCH_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("k", CURVATURES, ids=[f"k{k}" for k in CURVATURES])
def test_layers_stay_on_manifold(k, shape, kind, dtype):
    x = lift(space_parts(shape, D - 1, kind, dtype), k=k)
    for name, (m, fwd, k_out) in point_layers(k).items():
        m = m.to(dtype)
        y = fwd(m, x)
        assert y.dtype == dtype, name
        assert torch.isfinite(y).all(), name
        err = manifold_error(y, k_out).max().item()
        assert err <= MANIFOLD_TOL[dtype], f"{name}: {err:.3g}"


@pytest.mark.parametrize("mode", ["lorentz", "space"])
@pytest.mark.parametrize("k", CURVATURES, ids=[f"k{k}" for k in CURVATURES])
def test_embedding_on_manifold(mode, k):
    emb = LorentzEmbedding(101, D, k=k, mode=mode)
    ids = torch.randint(0, 101, (3, 7))
    for dtype in (torch.float32, torch.float64):
        emb = emb.to(dtype)
        emb.reset_parameters()  # initialise in the target precision
        out = emb(ids)
        assert out.shape == (3, 7, D)
        assert manifold_error(out, k).max() <= MANIFOLD_TOL[dtype]


def test_lorentz_embedding_is_manifold_parameter_with_wrapped_normal_init():
    import geoopt

    emb = LorentzEmbedding(2000, D, k=0.5, mode="lorentz", init_std=0.1)
    assert isinstance(emb.weight, geoopt.ManifoldParameter)
    assert isinstance(emb.weight.manifold, geoopt.Lorentz)
    assert float(emb.weight.manifold.k) == 0.5
    # wrapped normal: the log map at the origin recovers N(0, std^2) tangent coordinates
    from helm.manifold import logmap0

    u = logmap0(emb.weight.detach().double(), k=0.5)[:, 1:]
    assert abs(u.std().item() - 0.1) < 0.01
    assert abs(u.mean().item()) < 0.01


@pytest.mark.parametrize("mode", ["linear", "distance"])
def test_lm_head(mode):
    head = LorentzLMHead(D, 50, k=2.0, mode=mode).double()
    x = lift(torch.randn(2, 5, D - 1, dtype=torch.float64), k=2.0).requires_grad_()
    logits = head(x)
    assert logits.shape == (2, 5, 50) and torch.isfinite(logits).all()
    assert torch.autograd.gradcheck(lambda a: head(a), (x,))
    if mode == "distance":
        from helm.manifold import sqdist
        from helm.nn import wrapped_normal_

        wrapped_normal_(head.weight, k=2.0, std=0.5)  # prototypes on the manifold to fp64 precision
        logits = head(x)
        ref = -sqdist(x.unsqueeze(-2), head.weight, k=2.0) / head.log_tau.exp()
        assert_close(logits, ref, rtol=1e-9)


def _grad_cases(k):
    cases = {name: (m, fwd) for name, (m, fwd, _) in point_layers(k).items()}
    cases["head_linear"] = (LorentzLMHead(D, 11, k=k), lambda m, x: m(x))
    cases["head_distance"] = (LorentzLMHead(D, 11, k=k, mode="distance"), lambda m, x: m(x))
    return cases


@pytest.mark.parametrize("name", list(_grad_cases(1.0)))
@pytest.mark.parametrize("k", CURVATURES, ids=[f"k{k}" for k in CURVATURES])
def test_gradcheck_layers(name, k):
    m, fwd = _grad_cases(k)[name]
    m = m.double()
    x = lift(torch.randn(2, 3, D - 1, dtype=torch.float64), k=k).requires_grad_()
    params = [p for p in m.parameters() if p.requires_grad]
    assert torch.autograd.gradcheck(lambda a, *ps: fwd(m, a), (x, *params))


@pytest.mark.parametrize("kind", ["zero", "huge"])
@pytest.mark.parametrize("name", list(_grad_cases(1.0)))
def test_layer_gradients_finite_at_edges(name, kind):
    m, fwd = _grad_cases(1.0)[name]
    x = lift(space_parts((3, 2), D - 1, kind, torch.float32), k=1.0).requires_grad_()
    fwd(m, x).sum().backward()
    assert torch.isfinite(x.grad).all(), name
    for pname, p in m.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), f"{name}.{pname}"


def test_embedding_gradients():
    for mode in ("lorentz", "space"):
        emb = LorentzEmbedding(13, D, k=1.0, mode=mode).double()
        ids = torch.tensor([[0, 3, 3, 12]])
        assert torch.autograd.gradcheck(lambda w: torch.nn.functional.embedding(ids, w) if mode == "lorentz"
                                        else lift(torch.nn.functional.embedding(ids, w), k=1.0), (emb.weight,))
        emb(ids).sum().backward()
        assert torch.isfinite(emb.weight.grad).all()


@pytest.mark.parametrize("delta", [1e-3, 1.0, 1e3])
@pytest.mark.parametrize("k", CURVATURES, ids=[f"k{k}" for k in CURVATURES])
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
    """Every layer runs under bf16 autocast, returns finite fp32 points on the manifold.

    Documented bf16 tolerance: the matmuls run in bf16, but time coordinates and norms are computed and
    stored in fp32, so the manifold bound is the fp32 one (MANIFOLD_TOL[bfloat16] = 1e-5).
    """
    k = 1.0
    x = lift(space_parts((3, 5), D - 1, kind, torch.float32), k=k)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for name, (m, fwd, k_out) in point_layers(k).items():
            y = fwd(m, x)
            assert y.dtype == torch.float32, name
            assert torch.isfinite(y).all(), name
            assert manifold_error(y, k_out).max() <= MANIFOLD_TOL[torch.bfloat16], name
        for mode in ("lorentz", "space"):
            e = LorentzEmbedding(17, D, k=k, mode=mode)(torch.arange(17))
            assert manifold_error(e, k).max() <= MANIFOLD_TOL[torch.bfloat16]
        for mode in ("linear", "distance"):
            assert torch.isfinite(LorentzLMHead(D, 9, k=k, mode=mode)(x)).all()


def test_pure_bf16_parameters():
    """A model cast to bf16 (no autocast) still works: inputs are cast to the weight dtype."""
    m = LorentzSwiGLU(D, 1 + 33, k=1.0).to(torch.bfloat16)
    y = m(lift(torch.randn(3, D - 1), k=1.0))
    assert y.dtype == torch.float32 and manifold_error(y, 1.0).max() <= 1e-5


BAD = [
    (lambda: LorentzLinear(0, 5), "in_features"),
    (lambda: LorentzLinear(5, 1), "out_features"),
    (lambda: LorentzLinear(5, 5, k=0.0), "k must be a positive"),
    (lambda: LorentzLinear(5, 5, k_out=-1.0), "k_out must be a positive"),
    (lambda: LorentzRMSNorm(-3), "hidden_size"),
    (lambda: LorentzRMSNorm(5, k=-2.0), "k must be a positive"),
    (lambda: LorentzRMSNorm(5, eps=0.0), "eps"),
    (lambda: LorentzActivation("swish-ish"), r"activation must be one of \('silu'"),
    (lambda: LorentzSwiGLU(5, 0), "intermediate_size"),
    (lambda: LorentzSwiGLU(5, 9, hidden_act="nope"), "activation must be one of"),
    (lambda: LorentzResidual(weight=0.0), "weight"),
    (lambda: LorentzResidual(k=float("nan")), "k must be a positive"),
    (lambda: LorentzResidual(space_scale=-1.0), "space_scale"),
    (lambda: LorentzEmbedding(10, 5, mode="poincare"), r"mode must be one of \('lorentz', 'space'\)"),
    (lambda: LorentzEmbedding(0, 5), "num_embeddings"),
    (lambda: LorentzEmbedding(10, 1), "embedding_dim"),
    (lambda: LorentzLMHead(5, 10, mode="mlr"), r"mode must be one of \('linear', 'distance'\)"),
    (lambda: LorentzLMHead(5, 10, tau=0), "tau"),
]


@pytest.mark.parametrize("make,match", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()
