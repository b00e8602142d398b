"""Issue 12, fair comparisons: the DeepSeek-V3 baseline trains with HELM-MiCE's balancing (paper App. C.2); HELM-MiCE
says when an optimiser step went by without a routing-bias update (issue 23), reading tensor values at most once."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import helm
from helm.manifold import lift
from helm.models.routing import attach_balancing
from helm.nn.mice import MiCE
from tests.helpers import tiny_config

PAIRS = [("tiny-deepseek-v3", "tiny-helm-mice"), ("deepseek-v3-120m", "helm-mice-120m")]


@pytest.mark.parametrize("baseline,mice", PAIRS, ids=[p[0] for p in PAIRS])
def test_baseline_presets_balance_like_helm_mice(baseline, mice):
    b, m = helm.load_config(baseline), helm.load_config(mice)
    assert b.routed_scaling_factor == 1.0  # transformers' default is 2.5; HELM-MiCE has no such factor
    for name in ("aux_loss_alpha", "bias_update_speed", "norm_topk_prob", "n_routed_experts", "num_experts_per_tok",
                 "n_shared_experts"):
        assert getattr(b, name) == getattr(m, name), name


def _reference_balance_loss(logits: torch.Tensor, top_k: int, alpha: float, batch: int) -> torch.Tensor:
    """The loss written token by token from DeepSeek-V3's report (sigmoid scores, selection with the bias)."""
    scores = logits.sigmoid().view(batch, -1, logits.shape[-1])
    total = 0.0
    for row in scores:
        seq_len, n = row.shape
        chosen = row.topk(top_k, dim=-1).indices  # the bias is still zero here
        f = torch.zeros(n)
        for t in range(seq_len):
            f[chosen[t]] += n / (top_k * seq_len)
        p = (row / row.sum(-1, keepdim=True)).mean(0)
        total = total + (f * p).sum()
    return alpha * total / batch


def test_deepseek_v3_gets_the_balance_loss_and_bias_update():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3", first_k_dense_replace=1, num_hidden_layers=3))
    layers = attach_balancing(model)
    assert attach_balancing(model) is layers  # hooks attached once
    assert len(layers) == 2
    logits = []
    for layer in layers:
        layer.router.register_forward_hook(lambda m, a, out: logits.append(out[0].detach()))
    x = torch.randint(0, 512, (3, 13), generator=torch.Generator().manual_seed(1))
    out = model.train()(x, labels=x)
    expected = sum(_reference_balance_loss(lg, 2, model.config.aux_loss_alpha, 3) for lg in logits)
    torch.testing.assert_close(out.aux_loss, expected.to(out.aux_loss.dtype), rtol=1e-5, atol=0)
    plain = model.eval()(x, labels=x)
    assert plain.get("aux_loss") is None
    torch.testing.assert_close(out.loss, plain.loss + out.aux_loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()  # the balance loss reaches the router weights
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in layers)

    loads = [layer.last_expert_load.clone() for layer in layers]
    assert all(load.sum() == 3 * 13 * 2 for load in loads)
    for layer in layers:
        layer.update_bias()
    for layer, load in zip(layers, loads):
        bias = layer.router.e_score_correction_bias
        expected_bias = model.config.bias_update_speed * torch.sign(load.mean() - load)
        torch.testing.assert_close(bias, expected_bias)
        assert bias.abs().sum() > 0


def test_dense_models_have_no_routed_layers():
    assert attach_balancing(AutoModelForCausalLM.from_config(tiny_config("llama"))) == []
    mice = AutoModelForCausalLM.from_config(tiny_config("helm_mice"))
    assert attach_balancing(mice) == mice.mice_layers()


def _mice_layer():
    torch.manual_seed(0)
    layer = MiCE(1 + 8, 1 + 8, n_routed_experts=4, num_experts_per_tok=2, k=1.0).train()
    x = lift(torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)), k=1.0)
    return layer, x


@pytest.mark.parametrize("fused", [True, False], ids=["fused-adamw", "adamw"])
def test_mice_warns_after_the_first_step_without_a_bias_update(fused):
    """The step is seen from the gate weight's version counter (AdamW) or, for fused AdamW, which writes without
    bumping it, from a backward followed by zero_grad and changed values."""
    layer, x = _mice_layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=fused)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # micro-batches whose gradients are freed in between (FSDP2's way), no step
            layer(x).sum().backward()
            layer.gate.weight.grad = None
        assert not caught
        layer(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        layer(x)
    assert [str(w.message) for w in caught if "routing-bias" in str(w.message)], "no warning after a step"


def test_mice_with_bias_updates_is_silent():
    layer, x = _mice_layer()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            layer(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            layer.update_bias()
    assert not caught and layer.e_score_correction_bias.abs().sum() > 0
