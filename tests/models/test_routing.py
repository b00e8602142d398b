"""Issue 12, fair comparisons: the DeepSeek-V3 baseline trains with HELM-MiCE's balancing (paper App. C.2)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import helm
from helm.models.routing import attach_balancing
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
