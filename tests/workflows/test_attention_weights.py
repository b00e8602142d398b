"""Issue 23 item 6: ``output_attentions=True`` with ``attn_implementation="eager"`` returns the attention weights as
Llama's eager path does (one ``[B, H, T, T_kv]`` tensor per layer, rows summing to 1 over the allowed keys, also
from ``generate``); HELM's are paper Eq. 3's ``ν = softmax(-d²(q, k)/τ)``, checked against an fp64 rewrite from the
queries and keys each layer attends with. The other implementations, which never form the weights, return an empty
tuple with a warning naming eager, as Llama's sdpa does."""

import pytest
import torch
from transformers.utils import logging

import helm.ops.attention as attention_ops
from tests.helpers import assert_close, tiny_model
from tests.references import minkowski

FAMILIES = ["helm_d", "helm_mice", "llama"]


def batch():
    ids = torch.randint(1, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    return ids, mask


def eager(family, **overrides):
    return tiny_model(family, model_kwargs={"attn_implementation": "eager"}, **overrides)


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_returns_one_weight_tensor_per_layer_like_llama(family):
    model = eager(family)
    ids, mask = batch()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_attentions=True)
        plain = model(ids, attention_mask=mask)
    heads = model.config.num_attention_heads
    assert len(out.attentions) == model.config.num_hidden_layers
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    for weights in out.attentions:
        assert weights.shape == (2, heads, 9, 9)
        torch.testing.assert_close(weights.sum(-1)[:, :, 3:], torch.ones(2, heads, 6))
        # no weight on later keys nor on padding (rows of padding queries attend to nothing defined)
        assert (weights[0][..., ~causal] == 0).all() and (weights[1, :, 3:][..., ~causal[3:]] == 0).all()
        assert (weights[1, :, 3:, :3] == 0).all()
    # asking for the weights changes nothing else (eager attends on HMLA's plain path either way; rows of padding
    # queries are undefined)
    real = mask.bool()
    assert_close(out.logits[real], plain.logits[real], rtol=0)
    assert model.model(ids, output_attentions=True).attentions is not None


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_the_weights_are_eq_3_of_the_layers_queries_and_keys(family, monkeypatch):
    model = eager(family)
    calls = []
    original = attention_ops.ATTENTION_FUNCTIONS["eager"]

    def spy(query, key, value, **kwargs):
        calls.append((query.detach().double(), key.detach().double(), kwargs["tau"], kwargs["k"],
                      kwargs["mask"].keep()))
        return original(query, key, value, **kwargs)

    monkeypatch.setitem(attention_ops.ATTENTION_FUNCTIONS, "eager", spy)
    ids, mask = batch()
    with torch.no_grad():
        weights = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert len(calls) == len(weights)
    for (q, key, tau, k, keep), nu in zip(calls, weights):
        d2 = -2 * k - 2 * minkowski(q.unsqueeze(-2), key.unsqueeze(-3))  # [B, H, Tq, Tk]
        tau = torch.as_tensor(tau, dtype=torch.float64).reshape(-1, 1, 1)
        expected = (-d2 / tau).masked_fill(~keep, float("-inf")).softmax(-1)
        rows = keep.any(-1).expand_as(expected[..., 0])
        torch.testing.assert_close(nu.double()[rows], expected[rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_returns_the_weights_of_every_step(family):
    model = eager(family)
    ids = torch.randint(1, 512, (1, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=3, do_sample=False, output_attentions=True,
                         return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    steps = out.attentions
    assert len(steps) == 3 and all(len(step) == model.config.num_hidden_layers for step in steps)
    assert steps[0][0].shape[-2:] == (5, 5) and steps[2][0].shape[-2:] == (1, 7)
    plain = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, plain)


@pytest.mark.parametrize("impl", ["sdpa", None])
@pytest.mark.parametrize("family", FAMILIES)
def test_other_implementations_return_no_weights_and_name_eager_as_llama(family, impl, caplog):
    model = tiny_model(family, model_kwargs={} if impl is None else {"attn_implementation": impl})
    ids, _ = batch()
    logging.get_logger(__name__).warning_once.cache_clear()  # warned once per message and process
    assert model(ids, output_attentions=True).attentions == ()
    if family != "llama":  # (Llama's warning goes to transformers' own handler)
        assert any("output_attentions" in r.message and "'eager'" in r.message for r in caplog.records), caplog.text
    assert model(ids, output_attentions=False).attentions is None
