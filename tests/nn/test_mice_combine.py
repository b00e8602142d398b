"""MiCE combinations against per-token references: the official chain of LResNets (`expert_combine="lresnet_official"`)
and the default centroid of paper Eq. 6 (`expert_combine="centroid"`)."""

import math

import pytest
import torch

from helm.manifold import lift, manifold_error
from helm.nn.mice import EXPERT_COMBINES, MiCE
from tests import references
from tests.helpers import assert_close

K = 0.7  # a layer curvature other than 1, so the origin sqrt(k) and k in the norms are exercised
D = 1 + 10
CURVATURES = [-0.5, -1.0, -2.0, -1.5]


def make_mice(scoring_func="softmax", norm_topk_prob=False, *, top_k=2, seed=0, dtype=torch.float64, **kwargs):
    torch.manual_seed(seed)
    mice = MiCE(D, 1 + 7, n_routed_experts=len(CURVATURES), num_experts_per_tok=top_k, n_shared_experts=1, k=K,
                routed_curvatures=CURVATURES, scoring_func=scoring_func, norm_topk_prob=norm_topk_prob,
                expert_combine="lresnet_official", **kwargs).to(dtype)
    with torch.no_grad():  # non-trivial combination scalars, biases and routing bias
        mice.add_experts_weight.fill_(0.63)
        mice.add_experts_log_scale.fill_(0.31)
        mice.e_score_correction_bias.copy_(0.05 * torch.randn(len(CURVATURES)))
        mice.gate.weight.mul_(20.0)  # scores far from uniform
        for name, p in mice.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.3)
    return mice


def points(shape=(3, 6), seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return lift(2.0 * torch.randn(*shape, D - 1, generator=g, dtype=torch.float64), k=K).to(dtype)


def minkowski(a, b):
    return -a[0] * b[0] + (a[1:] * b[1:]).sum()


def lresnet_reference(x, y, w, scale):
    """The official LResNet for single points: lift(σ · z_s), z = sqrt(k) a / sqrt(|<a,a>_L|), a = x + w y."""
    a = x + w * y
    z = math.sqrt(K) * a / minkowski(a, a).abs().sqrt()
    zs = scale * z[1:]
    return torch.cat([(zs.pow(2).sum() + K).sqrt().reshape(1), zs])


def reference(mice, x, *, descending=False, skip=True):
    """Token by token: chain the selected experts from the origin in ascending index order, then add_experts.

    ``descending`` / ``skip=False`` (zero-weight steps for unselected experts) are the wrong variants."""
    weights, _, selected = mice.route(x)  # the gate itself is checked independently below
    w_add = mice.add_experts_weight.item()
    scale = math.exp(mice.add_experts_log_scale.item())
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            xt = x[b, t]
            y = torch.zeros_like(xt)
            y[0] = math.sqrt(K)
            chain = [int(i) for i in torch.nonzero(selected[b, t])[:, 0]] if skip else range(len(mice.experts))
            for j in sorted(chain, reverse=descending):
                y = lresnet_reference(y, mice.experts[j](xt), float(weights[b, t, j]), 2.0)
            out[b, t] = lresnet_reference(mice.shared_experts[0](xt), y, w_add, scale)
    return out


def gate_reference(mice, x, scoring_func, norm_topk_prob):
    """The official gate (FIDELITY.md, MiCE gate): scores from the space part, bias only in the selection."""
    logits = (x[..., 1:] @ mice.gate.weight.T).float()
    scores = logits.softmax(-1) if scoring_func == "softmax" else logits.sigmoid()
    idx = (scores + mice.e_score_correction_bias).topk(mice.top_k, dim=-1).indices
    g = scores.gather(-1, idx)
    if norm_topk_prob:
        g = g / g.sum(-1, keepdim=True)
    return idx, g


@pytest.mark.parametrize("scoring_func,norm_topk_prob,top_k", [
    ("softmax", False, 2), ("sigmoid", True, 2), ("sigmoid", False, 3), ("softmax", False, 1)])
def test_matches_per_token_reference(scoring_func, norm_topk_prob, top_k):
    mice = make_mice(scoring_func, norm_topk_prob, top_k=top_k)
    x = points()
    with torch.no_grad():
        out = mice(x)
        expected = reference(mice, x)
    assert out.dtype == torch.float64
    assert_close(out, expected, rtol=1e-10)
    # the routing used by the reference is the official gate
    idx, g = gate_reference(mice, x, scoring_func, norm_topk_prob)
    weights, _, selected = mice.route(x)
    assert torch.equal(selected, torch.zeros_like(selected).scatter_(-1, idx, True))
    assert_close(weights.gather(-1, idx), g, rtol=1e-6)
    # the inputs exercise more than one selection pattern and, with several experts per token, tokens whose
    # score order differs from the index order
    patterns = {tuple(row.tolist()) for row in selected.reshape(-1, selected.shape[-1])}
    assert len(patterns) > 1
    if top_k > 1:
        assert (idx[..., 0] > idx[..., 1]).any()  # topk lists by score: somewhere a higher index comes first


def test_order_and_skip_matter():
    """Descending order, or a zero-weight step for unselected experts, would give another result."""
    mice = make_mice()
    x = points()
    with torch.no_grad():
        out = mice(x)
        assert (out - reference(mice, x, descending=True)).abs().max() > 1e-3
        assert (out - reference(mice, x, skip=False)).abs().max() > 1e-3


def test_on_manifold_and_gradients():
    mice = make_mice("sigmoid", True, dtype=torch.float32)
    x = points((4, 8), dtype=torch.float32)
    out = mice(x)
    assert out.dtype == torch.float32
    assert manifold_error(out, K).max() <= 1e-6
    loss = (out[..., 1:] * torch.linspace(-1, 1, D - 1)).sum() + out[..., 0].pow(2).mean()
    loss.backward()
    grads = {
        "add_experts_weight": mice.add_experts_weight.grad,
        "add_experts_log_scale": mice.add_experts_log_scale.grad,
        "gate.weight": mice.gate.weight.grad,
        "shared_experts.0.down_proj": mice.shared_experts[0].down_proj.weight.grad,
    }
    for j, expert in enumerate(mice.experts):
        grads[f"experts.{j}.down_proj"] = expert.mlp.down_proj.weight.grad
        grads[f"experts.{j}.gate_proj"] = expert.mlp.gate_proj.weight.grad
        grads[f"experts.{j}.log_k"] = expert.log_k.grad
    for name, grad in grads.items():
        assert grad is not None, name
        assert torch.isfinite(grad).all(), name
        assert grad.abs().max() > 0, name
    assert all(torch.isfinite(p.grad).all() for p in mice.parameters() if p.grad is not None)


def test_parameters_only_in_official_mode():
    official = MiCE(D, 1 + 7, n_routed_experts=4, num_experts_per_tok=2, expert_combine="lresnet_official")
    assert official.add_experts_weight.dtype == torch.float32 and official.add_experts_weight.shape == (1,)
    assert official.add_experts_weight.item() == 1.0
    assert official.add_experts_log_scale.item() == pytest.approx(math.log(2.0))
    assert {"add_experts_weight", "add_experts_log_scale"} <= set(official.state_dict())

    centroid = MiCE(D, 1 + 7, n_routed_experts=2, num_experts_per_tok=1)
    assert centroid.expert_combine == "centroid"
    swiglu = [f"{p}_proj.{w}" for p in ("down", "gate", "up") for w in ("bias", "weight")]
    expected = {"e_score_correction_bias", "gate.weight"}
    expected |= {f"experts.{j}.log_k" for j in range(2)}
    expected |= {f"experts.{j}.mlp.{s}" for j in range(2) for s in swiglu}
    expected |= {f"shared_experts.0.{s}" for s in swiglu}
    assert set(centroid.state_dict()) == expected


def test_validation():
    assert EXPERT_COMBINES == ("centroid", "lresnet_official")
    for n_shared in (0, 2):
        with pytest.raises(ValueError, match="n_shared_experts"):
            MiCE(D, 1 + 7, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=n_shared,
                 expert_combine="lresnet_official")
    MiCE(D, 1 + 7, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2)  # fine for the centroid
    with pytest.raises(ValueError, match="expert_combine"):
        MiCE(D, 1 + 7, n_routed_experts=4, num_experts_per_tok=2, expert_combine="lresnet")


# The default combination, expert_combine="centroid" (paper Eq. 5-6), against a reference written from the equations.
ROUTED = [-0.1, -0.6, -1.0, -1.5, -2.0]  # routed curvatures K_j (k_j = -1/K_j), none equal to the layer's K = -1/0.7
ROUTER_RTOL = 1e-5  # fp32 routing and curvatures in an fp64 layer (see the test's docstring): observed <= 3e-6
CENTROID_CASES = {  # scoring_func, norm_topk_prob, top_k, n_shared
    "sigmoid-norm-k2-s1": ("sigmoid", True, 2, 1),
    "sigmoid-norm-k3-s2": ("sigmoid", True, 3, 2),
    "sigmoid-raw-k2-s1": ("sigmoid", False, 2, 1),
    "softmax-raw-k1-s1": ("softmax", False, 1, 1),
    "softmax-norm-k2-s0": ("softmax", True, 2, 0),
}


def make_centroid_mice(scoring_func, norm_topk_prob, top_k, n_shared, dispatch):
    torch.manual_seed(0)
    mice = MiCE(D, 1 + 7, n_routed_experts=len(ROUTED), num_experts_per_tok=top_k, n_shared_experts=n_shared, k=K,
                routed_curvatures=ROUTED, scoring_func=scoring_func, norm_topk_prob=norm_topk_prob,
                dispatch=dispatch).double()
    with torch.no_grad():  # a routing bias large enough to change the selection, non-zero HLT biases
        mice.e_score_correction_bias.copy_(0.15 * torch.randn(len(ROUTED)))
        for name, p in mice.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.3)
    return mice


def swiglu_reference(mlp, x, k):
    """SwiGLU_L (App. B.3) from its weights: ``y = SiLU(HLT_1(x)_s) ⊙ HLT_3(x)_s``, ``out = HLT_2(lift(y))``, an HLT
    being ``lift(W x + b)`` with ``W`` on the full vector ``x = [x_t, x_s]``; all on ``H_k``."""
    gate = x @ mlp.gate_proj.weight.T + mlp.gate_proj.bias
    up = x @ mlp.up_proj.weight.T + mlp.up_proj.bias
    inner = references.to_hyperboloid(torch.nn.functional.silu(gate) * up, k)
    return references.to_hyperboloid(inner @ mlp.down_proj.weight.T + mlp.down_proj.bias, k)


def mice_centroid_reference(mice, x):
    """Paper Eq. 5-6 token by token (without the residual, which the decoder layer applies):
    ``s_j = act(x_s · y_j)``; the top-``K_r`` of ``s_j + b_j`` selected (DeepSeek-V3's aux-loss-free bias moves the
    selection only); ``g_j = s_j`` over the selected, divided by their sum when ``norm_topk_prob``; routed expert
    ``j`` is SwiGLU_L on ``H_{k_j}`` fed ``sqrt(k_j/k) x`` and scaled back by ``sqrt(k/k_j)``, each shared expert
    SwiGLU_L on ``H_k``; the output is one centroid of all of them, routed weights ``g_j``, shared weights 1.

    Also returns, per token, the selected experts and the plain top-``K_r`` of ``s`` (to check the bias mattered)."""
    k, n_routed = mice.k, len(mice.experts)
    outs, chosen_all, unbiased_all = [], [], []
    for xt in x.reshape(-1, x.shape[-1]):
        logits = mice.gate.weight @ xt[1:]
        s = logits.sigmoid() if mice.scoring_func == "sigmoid" else logits.softmax(-1)
        bias = mice.e_score_correction_bias.double()
        chosen = sorted(range(n_routed), key=lambda j: float(s[j].detach() + bias[j]), reverse=True)[:mice.top_k]
        g = s[chosen]
        if mice.norm_topk_prob:
            g = g / g.sum()
        points, weights = [], []
        for j, gj in zip(chosen, g):
            kj = mice.experts[j].log_k[0].double().exp()  # a tensor: the curvature's gradient flows through it
            y = swiglu_reference(mice.experts[j].mlp, (kj / k).sqrt() * xt, kj)
            points.append((k / kj).sqrt() * y)
            weights.append(gj)
        for shared in mice.shared_experts:
            points.append(swiglu_reference(shared, xt, k))
            weights.append(torch.ones((), dtype=torch.float64))
        outs.append(references.weighted_centroid(torch.stack(points), torch.stack(weights), k))
        chosen_all.append(sorted(chosen))
        unbiased_all.append(sorted(s.topk(mice.top_k).indices.tolist()))
    return torch.stack(outs).view(x.shape), chosen_all, unbiased_all


@pytest.mark.parametrize("dispatch", ["dense", "sparse"])
@pytest.mark.parametrize("case", list(CENTROID_CASES))
def test_centroid_matches_per_token_reference_on_outputs_and_gradients(case, dispatch):
    """``expert_combine="centroid"`` equals :func:`mice_centroid_reference` (fp64) on the output of every token and
    on the gradients of the input and of every parameter (experts' curvatures included), densely and sparsely.

    To fp32 rounding, not fp64: even an fp64 layer routes in fp32 (gate logits, scores, weights) and computes the
    expert curvatures ``k_j`` in fp32 (a wrong expert, weight or curvature moves the output by far more)."""
    scoring_func, norm_topk_prob, top_k, n_shared = CENTROID_CASES[case]
    mice = make_centroid_mice(scoring_func, norm_topk_prob, top_k, n_shared, dispatch)
    assert mice.expert_combine == "centroid" and mice.sparse_dispatch() == (dispatch == "sparse")
    for expert, K_j in zip(mice.experts, ROUTED):  # the reference reads k_j = exp(log k_j): the config's -1/K_j
        assert expert.log_k.item() == pytest.approx(math.log(-1 / K_j), rel=1e-6)
    x = points((3, 7)).requires_grad_()
    out_weights = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    params = dict(mice.named_parameters())

    out = mice(x)
    grads = torch.autograd.grad((out * out_weights).sum(), [x, *params.values()], allow_unused=True)
    expected, chosen, unbiased = mice_centroid_reference(mice, x)
    ref_grads = torch.autograd.grad((expected * out_weights).sum(), [x, *params.values()], allow_unused=True)
    assert_close(out, expected, rtol=ROUTER_RTOL)
    for name, a, b in zip(["input", *params], grads, ref_grads):
        a = torch.zeros_like(params.get(name, x)) if a is None else a
        b = torch.zeros_like(params.get(name, x)) if b is None else b
        assert_close(a, b, rtol=ROUTER_RTOL, msg=f"grad {name}")
    # the inputs exercise what the equations say: the bias changes some token's selection, the tokens use several
    # routed experts (the last included), and the layer routes exactly as the reference
    assert any(c != u for c, u in zip(chosen, unbiased))
    used = {j for c in chosen for j in c}
    assert len(ROUTED) - 1 in used and len(used) >= 4
    assert mice.last_expert_load.tolist() == [float(sum(j in c for c in chosen)) for j in range(len(ROUTED))]
    with torch.no_grad():  # without autograd the sparse path skips unchosen experts, and one token skips the gather
        assert_close(mice(x), expected, rtol=ROUTER_RTOL)
        assert_close(mice(x[:1, 2:3]), expected[:1, 2:3], rtol=ROUTER_RTOL)
