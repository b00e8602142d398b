"""Issue 14, item 1: transformers' static cache and compiled generation work for HELM as for Llama.

A static cache hands every layer all ``max_cache_len`` slots (the unwritten ones zero) and ``generate`` passes a
4-D mask over them; the models read the cache's length as a tensor (no host read), so the decode step compiles
with ``fullgraph=True``. Tiny models, a left-padded batch of two prompts of different lengths, greedy decoding.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache, StaticCache
from transformers.masking_utils import create_masks_for_generate

from tests.helpers import assert_close, tiny_model

# id -> tiny_model arguments; "helm_mice-mha" is the MiCE model with plain attention instead of HMLA
MODELS = {"helm_d": dict(family="helm_d"), "helm_mice": dict(family="helm_mice"),
          "helm_mice-mha": dict(family="helm_mice", attention_type="mha"), "llama": dict(family="llama")}
NEW_TOKENS = 5


def prompts():
    """Two prompts of 7 and 4 tokens, left padded; their positions count from each prompt's first token."""
    ids = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def greedy(model, **kwargs):
    ids, mask = prompts()
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("name", list(MODELS))
def test_static_cache_generates_what_the_dynamic_cache_does(name):
    model = tiny_model(**MODELS[name])
    dynamic = greedy(model)
    static = greedy(model, cache_implementation="static")
    assert isinstance(static.past_key_values, StaticCache)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), rtol=1e-5)


def test_hmla_static_cache_holds_only_the_latent_and_the_rope_key():
    """A user's StaticCache with spare slots (never written during generation) gives the same tokens; HMLA's
    layers cache c_KV as the keys and the shared rope key k^R as the values."""
    model = tiny_model("helm_mice")
    cache = StaticCache(config=model.config, max_cache_len=16)
    got = greedy(model, past_key_values=cache)
    assert torch.equal(got.sequences, greedy(model).sequences)
    c = model.config
    layer = cache.layers[0]
    # c_KV [B, 1, T, 1+n_kv], then (absorbed decoding, hmla_absorb) three fp32 scalars per head
    assert tuple(layer.keys.shape) == (2, 1, 16, c.kv_lora_rank + 3 * c.num_attention_heads * c.hmla_absorb)
    assert tuple(layer.values.shape) == (2, 1, 16, c.qk_rope_head_dim)  # k^R [B, 1, T, 1+d_r]
    written = 7 + NEW_TOKENS - 1
    assert int(cache.get_seq_length()) == written
    assert not layer.keys[:, :, written:].any() and layer.keys[:, :, :written].abs().amax(-1).gt(0).all()


def _decode(model, forward, cache_of, mask_form, steps=2):
    """Prefill the prompts eagerly on ``cache_of(model)``, then ``steps`` greedy steps through ``forward`` with
    the padding mask as a growing 2-D mask, as generate's 4-D mask over the cache's slots, or none (no padding:
    the second prompt only); returns the logits of the steps."""
    ids, mask = prompts()
    if mask_form == "none":
        ids, mask = ids[:1], mask[:1]
    cache = cache_of(model)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    logits = []
    with torch.no_grad():
        out = model(ids, attention_mask=None if mask_form == "none" else mask, position_ids=pos, past_key_values=cache)
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            mask, pos = torch.cat([mask, torch.ones_like(token)], 1), pos[:, -1:] + 1
            step_mask = {"2-D": mask, "none": None}.get(mask_form)
            if mask_form == "4-D":  # as generate builds it: the model's own hook where it has one
                build = getattr(model, "create_masks_for_generate", create_masks_for_generate)
                step_mask = build(config=model.config, inputs_embeds=torch.empty(len(token), 1, 0),
                                  attention_mask=mask, past_key_values=cache, position_ids=pos)
            out = forward(input_ids=token, attention_mask=step_mask, position_ids=pos, past_key_values=cache)
            logits.append(out.logits)
    return torch.stack(logits)


def static_cache(model):
    return StaticCache(config=model.config, max_cache_len=12)


@pytest.mark.parametrize("mask_form", ["2-D", "4-D", "none"])
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_on_a_static_cache_matches_the_dynamic_cache(name, mask_form):
    model = tiny_model(**MODELS[name])
    dynamic = _decode(model, model.forward, lambda m: DynamicCache(config=m.config), mask_form)
    static = _decode(model, model.forward, static_cache, mask_form)
    assert_close(static, dynamic, rtol=1e-5)


@pytest.mark.parametrize("impl", ["eager", "sdpa", "auto"])
@pytest.mark.parametrize("name", ["helm_d", "helm_mice"])
def test_static_cache_with_each_attention_implementation(name, impl):
    """transformers builds generate's static-cache mask only for the names it knows; HELM's model asks for the sdpa
    form under each of its own (without it, ``auto`` lost the left padding: logits off by 1e-1)."""
    model = tiny_model(**MODELS[name], model_kwargs={"attn_implementation": impl})
    assert torch.equal(greedy(model, cache_implementation="static").sequences, greedy(model).sequences)


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_compiles_the_decode_step_in_one_graph(name):
    """generate's own compile (on CPU only on request: CompileConfig._compile_all_devices, as transformers' tests do),
    fullgraph, with dynamo's eager backend to keep the test fast: no graph break, no host read, and one graph
    reused by every decoding step (no recompilation as the cache fills)."""
    assert tiny_model(**MODELS[name])._can_compile_fullgraph
    model = tiny_model(**MODELS[name])
    expected = greedy(model).sequences
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    got = greedy(model, cache_implementation="static", compile_config=config)
    assert hasattr(model, "_compiled_call")  # generate really took the compiled path
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(got.sequences, expected)


def test_inductor_compiled_decode_step_matches_eager():
    """Inductor's code for one decode step on a static cache gives eager's logits. Inductor compiles for about a
    minute per tiny model on the 2-core CI machine, so one model only: one HMLA layer (the latent cache); the
    fullgraph capture of every family is the test above."""
    model = tiny_model("helm_mice", num_hidden_layers=1)
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, fullgraph=True)
    expected = _decode(model, model.forward, static_cache, "4-D", steps=1)
    got = _decode(model, compiled, static_cache, "4-D", steps=1)
    assert_close(got, expected, rtol=1e-5)
