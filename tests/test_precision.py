"""Issue 22, item 1: one precision policy (``helm/precision.py``), checked on what a training step dispatches.

A ``TorchDispatchMode`` records every aten op with the dtypes of its tensor inputs and outputs over one training
step (forward with labels, backward) of tiny HELM-D and HELM-MiCE, after one warm-up step that builds the cached
positional tables (a named exception of the policy: built once per device in fp64):

* CPU bf16 autocast, fp32 master weights: no op touches an fp64 tensor, and every GEMM has bf16 operands except
  the policy's named exception, attention's value side ``ν·[w | e]`` (an fp32 ``bmm`` per layer forward and two
  backward; its operands carry the value width ``1 + d_v`` plus the norm column); hidden states fp32 and logits
  bf16, as ``LlamaForCausalLM`` gives under autocast;
* fp32, no autocast: no op touches an fp64 tensor;
* fp64 model and inputs: no op touches a lower-precision floating tensor (the tests' fp64 references).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import helm.manifold.math as M
from helm.nn.mice import MiCE, mixture_centroid
from helm.precision import autocast_dtype, compute_dtype, split_hi_lo, stat_dtype, to_stat
from tests import references
from tests.helpers import assert_close, tiny_model

FAMILIES = ["helm_d", "helm_mice"]
GEMMS = ("mm", "bmm", "addmm", "baddbmm", "addbmm", "linear", "matmul", "mv", "addmv", "dot")
HALF = (torch.bfloat16, torch.float16)


class Recorder(TorchDispatchMode):
    """Every aten op as ``(name, floating input dtypes, input shapes, floating output dtypes)``."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        outs = [t.dtype for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
        self.ops.append((func.overloadpacket.__name__, [t.dtype for t in ins], [tuple(t.shape) for t in ins], outs))
        return out

    def dtypes(self, op):
        return set(op[1]) | set(op[3])

    def gemms(self):
        return [op for op in self.ops if op[0] in GEMMS or op[0].startswith("_scaled_dot_product")]


def training_step(model, ids, *, autocast: bool):
    """Forward with labels under ``autocast`` (bf16), backward outside it; returns the outputs."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    return out


def recorded_step(family, *, autocast=False, dtype=None, **overrides):
    model = tiny_model(family, train=True, **overrides)
    if dtype is not None:
        model = model.to(dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    training_step(model, ids, autocast=autocast)  # warm-up: the positional tables are built and cached
    model.zero_grad(set_to_none=True)
    with Recorder() as rec:
        out = training_step(model, ids, autocast=autocast)
    return model, out, rec


def value_width(config) -> int:
    """``1 + d_v`` plus the centred-norm column: the last dim of attention's ``[w | e]``."""
    return (config.v_head_dim if config.model_type == "helm_mice" else config.head_dim) + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_step_runs_every_gemm_in_bf16_and_nothing_in_fp64(family):
    model, out, rec = recorded_step(family, autocast=True)
    fp64 = Counter(op[0] for op in rec.ops if torch.float64 in rec.dtypes(op))
    assert not fp64, f"ops on fp64 tensors under bf16 autocast: {dict(fp64)}"
    width = value_width(model.config)
    off = [op for op in rec.gemms() if any(d not in HALF for d in op[1])]
    # the named exception: ν·[w | e] in fp32 (forward S = ν W; backward dν = dS Wᵀ, dW = νᵀ dS), one per layer
    value_side = [op for op in off if op[0] == "bmm" and set(op[1]) == {torch.float32}
                  and any(width in shape[-2:] for shape in op[2])]
    assert len(value_side) == 3 * model.config.num_hidden_layers, value_side
    # the other: MiCE's mixture sums over its N experts, w @ points and w @ e (forward), their two gradients each
    experts = getattr(model.config, "n_routed_experts", 0) + getattr(model.config, "n_shared_experts", 0)
    mixture = [op for op in off if op[0] == "bmm" and set(op[1]) == {torch.float32} and op not in value_side
               and any(experts in shape[-2:] for shape in op[2])]
    mice_layers = len(getattr(model, "mice_layers", list)())
    assert len(mixture) == 6 * mice_layers and (family == "helm_mice") == (mice_layers > 0), mixture
    others = [op for op in off if op not in value_side + mixture]
    assert not others, f"GEMMs with operands outside bf16 (not named in helm.precision): {others}"
    assert any(op[1] and set(op[1]) == {torch.bfloat16} for op in rec.gemms())
    # Llama's dtypes under autocast: fp32 residual stream (here: points), bf16 logits, fp32 loss
    assert all(h.dtype == torch.float32 for h in out.hidden_states)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randint(0, 512, (1, 5))).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_step_has_no_fp64_op(family):
    _, out, rec = recorded_step(family)
    fp64 = Counter(op[0] for op in rec.ops if torch.float64 in rec.dtypes(op))
    assert not fp64, f"ops on fp64 tensors in an fp32 step: {dict(fp64)}"
    assert out.loss.dtype == torch.float32


@pytest.mark.parametrize("family", FAMILIES)
def test_fp64_step_runs_entirely_in_fp64(family):
    _, out, rec = recorded_step(family, dtype=torch.float64)
    lower = Counter(op[0] for op in rec.ops if rec.dtypes(op) - {torch.float64})
    assert not lower, f"ops on lower-precision tensors in an fp64 step: {dict(lower)}"
    assert out.loss.dtype == torch.float64 and all(h.dtype == torch.float64 for h in out.hidden_states)


def test_helpers():
    x32, x64, xb = torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)
    assert [stat_dtype(t) for t in (x32, x64, xb)] == [torch.float32, torch.float64, torch.float32]
    assert to_stat(xb).dtype == torch.float32 and to_stat(x32) is x32 and to_stat(x64) is x64
    assert compute_dtype(x32) == torch.float32 and autocast_dtype("cpu") is None
    assert compute_dtype(x32, xb) == torch.bfloat16  # a bf16 model computes in bf16 whatever its fp32 points
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x32) == torch.bfloat16 and autocast_dtype("cpu") == torch.bfloat16
        assert compute_dtype(x64) == torch.float64 and compute_dtype(x32, x64) == torch.float64
        assert compute_dtype(x32.to("meta")) == torch.float32  # no autocast state on meta


def test_split_hi_lo_carries_16_bits_and_the_gradient_of_x():
    x = (torch.randn(1000, dtype=torch.float64) * 100).float().requires_grad_()
    y = (torch.randn(1000, dtype=torch.float64) * 100).float()
    hi, lo = split_hi_lo(x, torch.bfloat16)
    yh, yl = split_hi_lo(y, torch.bfloat16)
    assert hi.dtype == lo.dtype == torch.bfloat16
    exact = x.detach().double() * y.double()
    paired = hi.double() * yh.double() + hi.double() * yl.double() + lo.double() * yh.double()
    assert ((paired - exact).abs() / exact.abs()).max() < 2 ** -15
    assert ((hi.double() * yh.double() - exact).abs() / exact.abs()).max() > 2 ** -12  # one bf16 number: 8 bits
    # x gets the gradient of x·y ≈ hi·(hi' + lo') + lo·hi' through hi (lo's two paths cancel), to bf16 rounding
    (hi.float() * (yh.float() + yl.float()) + lo.float() * yh.float()).sum().backward()
    assert ((x.grad - y) / y).abs().max() < 2 ** -7


def _clustered(r, shape=(3, 5), n_points=5, n=16, spread=1.0):
    """``n_points`` points per batch entry, spread ~``spread`` around one point at space norm ``r``, with weights
    (the shared expert's 1 last), built in fp64 and rounded to fp32."""
    g = torch.Generator().manual_seed(1)
    direction = torch.randn(n, dtype=torch.float64, generator=g)
    centre = r * direction / direction.norm()
    x_s = centre + spread * torch.randn(*shape, n_points, n, dtype=torch.float64, generator=g)
    w = torch.rand(*shape, n_points, dtype=torch.float64, generator=g)
    w[..., -1] = 1.0
    return M.lift(x_s, k=1.0).float(), w.float()


@pytest.mark.parametrize("r", [1.0, 1e2, 1e3, 1e4])
def test_mice_mixture_is_accurate_far_from_the_origin_in_fp32(r):
    """MiCE's centroid of expert outputs clustered at space norm ``r`` (``mixture_centroid``: the norm from the
    outputs centred on their weighted mean), evaluated in fp32 and in fp64 on the same fp32 points, agree to fp32
    rounding (``tests/reliability/test_numerics.py``'s method and bound), where the naive ``s_t² - |s_s|²`` in fp32
    cancels to nothing at 1e4. The fp64 reference on these off-manifold fp32 points is the same centred form (the
    naive one would measure their time coordinates' rounding, ``±10`` in ``<x, x>_L`` at 1e4)."""
    points, w = _clustered(r)
    out = mixture_centroid(points, w, k=1.0)
    assert out.dtype == torch.float32
    assert_close(out, mixture_centroid(points.double(), w.double(), k=1.0), rtol=1e-5, msg=f"|x_s| = {r:g}")
    assert M.manifold_error(out, 1.0).max() <= 1e-5
    if r == 1.0:  # near the origin the fp32 points are on H_k to rounding and the naive form is the reference
        assert_close(out, references.weighted_centroid(points, w, 1.0), rtol=1e-5)


@pytest.mark.parametrize("r", [1.0, 1e4])
def test_mice_sparse_dispatch_is_the_dense_mixture_far_from_the_origin(r):
    """The sparse path accumulates the same centred norm expert by expert (index_add): fp32 outputs of the two
    dispatches agree to fp32 rounding with the experts' outputs at space norm ``r`` (their biases put them there)."""
    torch.manual_seed(0)
    layer = MiCE(17, 9, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1)
    direction = torch.randn(16)
    with torch.no_grad():
        for expert in [*layer.experts, *layer.shared_experts]:
            getattr(expert, "mlp", expert).down_proj.bias.copy_(r * direction / direction.norm())
    x = M.lift(torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2)), k=1.0)
    layer.dispatch = "dense"
    dense = layer(x)
    layer.dispatch = "sparse"
    assert_close(layer(x), dense, rtol=1e-5, msg=f"|x_s| = {r:g}")
