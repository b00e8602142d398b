"""Issue 11, items 5 and 8 (model part): bad model inputs, labels that are all ignored, inputs_embeds off the
manifold, checkpoints with missing or corrupted weights, fp16 on CPU.

The input table states, for each case, the arguments, the exception and a fragment of its message (both HELM
families). Checks are on shapes and dtypes only (no host synchronisation); the vocabulary check is the existing
one (one bool, switchable).
"""

import copy
import os
import pathlib
import re
import shutil
import warnings

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, DynamicCache, GenerationConfig, StaticCache

from helm.manifold import lift, manifold_error
from helm.models.modeling_common import CACHE_FIELD, CacheOrigin
from tests.helpers import MANIFOLD_TOL, assert_close, tiny_config, tiny_model

FAMILIES = ["helm_d", "helm_mice"]
B, T, V, HIDDEN = 2, 5, 512, 33  # tiny configs: vocab 512, hidden_size 33 (1 + 32)


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in FAMILIES + ["llama"]}


def ids(b=B, t=T):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(0))


# (case id, kwargs factory, exception, message fragment)
BAD_INPUTS = [
    ("T=0", lambda: dict(input_ids=ids(B, 0)), ValueError, r"input_ids must be \[B, T\] with B >= 1 and T >= 1, got \(2, 0\)"),
    ("B=0", lambda: dict(input_ids=ids(0, T)), ValueError, r"input_ids must be \[B, T\] with B >= 1 and T >= 1, got \(0, 5\)"),
    ("input_ids 1-D", lambda: dict(input_ids=ids()[0]), ValueError, r"input_ids must be \[B, T\]"),
    ("input_ids 3-D", lambda: dict(input_ids=ids()[None]), ValueError, r"input_ids must be \[B, T\]"),
    ("input_ids float", lambda: dict(input_ids=ids().float()), ValueError, r"input_ids must be an int64 \(or int32\) tensor of token ids, got torch.float32"),
    # re-probe 6: uint8 ids wrapped at 256 ("must lie in [0, vocab_size)" for ids 1, 2) or hit torch's index error
    ("input_ids uint8", lambda: dict(input_ids=ids().to(torch.uint8)), ValueError,
     r"input_ids must be an int64 \(or int32\) tensor of token ids, got torch.uint8; convert it with input_ids.long\(\)"),
    ("input_ids >= vocab", lambda: dict(input_ids=ids() + V), ValueError, r"input_ids must lie in \[0, vocab_size=512\)"),
    ("input_ids < 0", lambda: dict(input_ids=-ids() - 1), ValueError, r"input_ids must lie in \[0, vocab_size=512\)"),
    ("ids and embeds", lambda: dict(input_ids=ids(), inputs_embeds=torch.randn(B, T, HIDDEN)), ValueError, "exactly one of input_ids and inputs_embeds"),
    ("neither", lambda: dict(), ValueError, "exactly one of input_ids and inputs_embeds"),
    # re-probe 5: "Tensor.item() cannot be called on meta tensors" before
    ("input_ids on meta", lambda: dict(input_ids=ids().to("meta")), ValueError,
     r"input_ids is on the meta device, which holds shapes but no values; create it on the model's device \(model\.device is cpu\)"),
    ("attention_mask on meta", lambda: dict(input_ids=ids(), attention_mask=torch.ones(B, T, device="meta")), ValueError,
     "attention_mask is on the meta device"),
    # re-probe 7: transformers' "Cannot copy out of meta tensor; no data!" before
    ("labels on meta", lambda: dict(input_ids=ids(), labels=ids().to("meta")), ValueError, "labels is on the meta device"),
    ("attention_mask 1-D", lambda: dict(input_ids=ids(), attention_mask=torch.ones(T)), ValueError, r"attention_mask must be \[B, T_past\+T\] = \[2, 5\], got \(5,\)"),
    ("attention_mask batch", lambda: dict(input_ids=ids(), attention_mask=torch.ones(3, T)), ValueError, r"attention_mask must be \[B, T_past\+T\] = \[2, 5\], got \(3, 5\)"),
    ("attention_mask length", lambda: dict(input_ids=ids(), attention_mask=torch.ones(B, T + 1)), ValueError, r"attention_mask must be \[B, T_past\+T\] = \[2, 5\], got \(2, 6\)"),
    ("attention_mask 4-D length", lambda: dict(input_ids=ids(), attention_mask=torch.ones(B, 1, T, T + 1)), ValueError, r"attention_mask must be \[B, 1, T, T_kv\] = \[2, 1, 5, 5\] \(a 4-D mask\)"),
    ("position_ids 1-D", lambda: dict(input_ids=ids(), position_ids=torch.arange(T)), ValueError, r"position_ids must be \[B, T\] = \[2, 5\] \(or \[1, 5\]\), got \(5,\)"),
    ("position_ids length", lambda: dict(input_ids=ids(), position_ids=torch.arange(T - 1).expand(B, T - 1)), ValueError, r"position_ids must be \[B, T\] = \[2, 5\]"),
    ("position_ids batch", lambda: dict(input_ids=ids(), position_ids=torch.arange(T).expand(3, T)), ValueError, r"position_ids must be \[B, T\] = \[2, 5\] \(or \[1, 5\]\), got \(3, 5\)"),
    ("position_ids float", lambda: dict(input_ids=ids(), position_ids=torch.arange(T).float().expand(B, T)), ValueError, "position_ids must be an integer tensor, got torch.float32"),
    ("segment_ids length", lambda: dict(input_ids=ids(), segment_ids=torch.zeros(B, T - 1, dtype=torch.long)), ValueError, r"segment_ids must be \[B, T_past\+T\] = \[2, 5\]"),
    ("segment_ids batch", lambda: dict(input_ids=ids(), segment_ids=torch.zeros(1, T, dtype=torch.long)), ValueError, r"segment_ids must be \[B, T_past\+T\] = \[2, 5\], got \(1, 5\)"),
    ("segment_ids float", lambda: dict(input_ids=ids(), segment_ids=torch.zeros(B, T)), ValueError, "segment_ids must be an integer tensor, got torch.float32"),
    ("inputs_embeds last dim", lambda: dict(inputs_embeds=torch.randn(B, T, HIDDEN - 1)), ValueError, r"inputs_embeds must be \[B, T, hidden_size\] = \[B, T, 33\] points \(time coordinate first\), got \(2, 5, 32\)"),
    ("inputs_embeds 2-D", lambda: dict(inputs_embeds=torch.randn(T, HIDDEN)), ValueError, r"inputs_embeds must be \[B, T, hidden_size\]"),
    ("inputs_embeds T=0", lambda: dict(inputs_embeds=torch.randn(B, 0, HIDDEN)), ValueError, r"inputs_embeds must be \[B, T, hidden_size\] with B >= 1 and T >= 1"),
    ("inputs_embeds int", lambda: dict(inputs_embeds=torch.ones(B, T, HIDDEN, dtype=torch.long)), ValueError, "inputs_embeds must be a floating-point tensor, got torch.int64"),
    ("labels shape", lambda: dict(input_ids=ids(), labels=ids()[:, :3]), ValueError, r"labels must be \[B, T\] = \[2, 5\], got \(2, 3\)"),
    ("labels float", lambda: dict(input_ids=ids(), labels=ids().float()), ValueError, r"labels must be an int64 tensor of token ids, got torch.float32"),
    ("labels int32", lambda: dict(input_ids=ids(), labels=ids().int()), ValueError,
     r"labels must be an int64 tensor of token ids, got torch.int32"),
    # re-probe 6: torch's "IndexError: index 7 is out of bounds for dimension 0 with size 3" before
    ("logits_to_keep position past T", lambda: dict(input_ids=ids(), logits_to_keep=torch.tensor([T + 2])), ValueError,
     rf"logits_to_keep holds positions outside \[-T, T\) = \[-{T}, {T}\) of the {T} tokens of this forward, got "
     rf"values in \[{T + 2}, {T + 2}\]"),
    ("labels >= vocab", lambda: dict(input_ids=ids(), labels=ids() + V), ValueError, r"labels must lie in \[0, vocab_size=512\) or equal ignore_index=-100"),
    ("labels -5", lambda: dict(input_ids=ids(), labels=torch.full((B, T), -5)), ValueError, r"labels must lie in \[0, vocab_size=512\) or equal ignore_index=-100; got values in \[-5, -5\]"),
    ("inputs_embeds NaN", lambda: dict(inputs_embeds=torch.full((B, T, HIDDEN), float("nan"))), ValueError, "inputs_embeds must be finite points; got NaN or inf"),
    ("inputs_embeds inf", lambda: dict(inputs_embeds=torch.randn(B, T, HIDDEN).index_fill(2, torch.tensor([3]), float("inf"))), ValueError, "inputs_embeds must be finite points; got NaN or inf"),
    ("inputs_embeds 1e30", lambda: dict(inputs_embeds=torch.full((B, T, HIDDEN), 1e30)), ValueError, "squared norm overflows fp32"),
    ("cache of another batch size", lambda: dict(input_ids=ids(), past_key_values=cache_of_batch(1)), ValueError, r"past_key_values \(cache=\) holds 1 sequences but the inputs have batch size 2"),
    ("cache a string", lambda: dict(input_ids=ids(), past_key_values="cache"), ValueError, r"past_key_values \(cache=\) must be a transformers Cache, .* got str"),
    ("cache a legacy tuple", lambda: dict(input_ids=ids(), past_key_values=((torch.zeros(B, 2, 3, 4),) * 2,)), ValueError, r"got tuple \(tuples of \(key, value\) tensors are transformers' legacy format"),
    ("cache of 1 layer", lambda: dict(input_ids=ids(), past_key_values=cache_of_batch(B)), ValueError, r"past_key_values \(cache=\) was written by a model with another number of layers: it has 1 layer\(s\), this model has num_hidden_layers=2"),
    ("cache with tokens in layer 2", lambda: dict(input_ids=ids(), past_key_values=cache_of_batch(B, layers=3)), ValueError, r"another number of layers: it has 3 layers \(tokens up to layer index 2\), this model has num_hidden_layers=2"),
    ("cache of another key width", lambda: dict(input_ids=ids(), past_key_values=cache_of_batch(B, layers=2)), ValueError, r"past_key_values \(cache=\) was written by another architecture: its layer 0 holds keys of shape \[B, 2, T, 4\] \(width 4\)"),
    ("static cache too short", lambda: dict(input_ids=ids(), past_key_values=StaticCache(config=tiny_config("helm_d"), max_cache_len=4)), ValueError, r"past_key_values \(cache=\) is a StaticCache of max_cache_len=4 holding 0 tokens: 5 more do not fit"),
    # issue 27 item 1: forward switches are booleans or None ("false" and 1 would read as true; output_attentions
    # "false" asked for eager attention)
    ("return_dict 'false'", lambda: dict(input_ids=ids(), return_dict="false"), ValueError, r"^return_dict must be a bool \(True or False\) or None for the config's default, got 'false'"),
    ("use_cache 'no'", lambda: dict(input_ids=ids(), use_cache="no"), ValueError, r"^use_cache must be a bool \(True or False\) or None .*got 'no'"),
    ("output_hidden_states 1", lambda: dict(input_ids=ids(), output_hidden_states=1), ValueError, r"^output_hidden_states must be a bool \(True or False\) or None .*got 1"),
    ("output_attentions 'false'", lambda: dict(input_ids=ids(), output_attentions="false"), ValueError, r"^output_attentions must be a bool \(True or False\) or None .*got 'false'"),
    ("skip_logits 'no'", lambda: dict(input_ids=ids(), labels=ids(), skip_logits="no"), ValueError, r"^skip_logits must be a bool \(True or False\) or None .*got 'no'"),
    ("use_cache tensor", lambda: dict(input_ids=ids(), use_cache=torch.tensor(True)), ValueError, r"^use_cache must be a bool"),
    # probe items 1-3: masks other than 0/1 (read as booleans before: a mask of 2s, 0.5s or -1s gave the logits of all
    # ones, an additive 0/-inf mask was read backwards), negative or non-int logits_to_keep (-1 dropped the first
    # position; "1" was "bad operand type for unary -"), and keywords the forward does not take (ignored before)
    ("attention_mask 2s", lambda: dict(input_ids=ids(), attention_mask=torch.full((B, T), 2)), ValueError, r"^attention_mask must hold only 1 \(attend\) and 0 \(padding\), or be a bool tensor; got values 2\.$"),
    ("attention_mask 0.5s", lambda: dict(input_ids=ids(), attention_mask=torch.full((B, T), 0.5)), ValueError, r"^attention_mask must hold only 1 \(attend\) and 0 \(padding\), or be a bool tensor; got values 0\.5"),
    ("attention_mask -1s", lambda: dict(input_ids=ids(), attention_mask=-torch.ones(B, T)), ValueError, r"^attention_mask must hold only 1 .*got values -1\.0\. An additive mask"),
    ("attention_mask additive 0/-inf", lambda: dict(input_ids=ids(), attention_mask=torch.zeros(B, T).index_fill(1, torch.tensor([0]), float("-inf"))), ValueError, r"^attention_mask must hold only 1 .*got values -inf\. An additive mask \(0 = attend, -inf = masked\) reads backwards"),
    ("attention_mask NaN", lambda: dict(input_ids=ids(), attention_mask=torch.full((B, T), float("nan"))), ValueError, r"^attention_mask must hold only 1 .*got values nan"),
    ("attention_mask complex", lambda: dict(input_ids=ids(), attention_mask=torch.ones(B, T, dtype=torch.complex64)), ValueError, r"^attention_mask must be a bool or 0/1 integer or floating tensor, got torch.complex64"),
    ("cache_position of another length", lambda: dict(input_ids=ids(), cache_position=torch.arange(3)), ValueError, r"^cache_position must be an integer tensor \[T\] = \[\d+\] \(one entry per new token\), got torch\.int64 \(3,\)"),
    ("logits_to_keep -1", lambda: dict(input_ids=ids(), logits_to_keep=-1), ValueError, r"^logits_to_keep must be an int >= 0 \(0 keeps every position, n the last n\) or a 1-D tensor of positions, got -1"),
    ("logits_to_keep '1'", lambda: dict(input_ids=ids(), logits_to_keep="1"), ValueError, r"^logits_to_keep must be an int >= 0 .*got '1'"),
    ("logits_to_keep 1.0", lambda: dict(input_ids=ids(), logits_to_keep=1.0), ValueError, r"^logits_to_keep must be an int >= 0 .*got 1\.0"),
    ("logits_to_keep float tensor", lambda: dict(input_ids=ids(), logits_to_keep=torch.tensor([1.0])), ValueError, r"^logits_to_keep as a tensor must hold 1-D integer sequence positions, got a 1-D torch.float32 tensor"),
    ("unknown keyword foo", lambda: dict(input_ids=ids(), foo=1), TypeError, r"^Helm\w+ForCausalLM\.forward\(\) got unexpected keyword argument\(s\) 'foo'; it takes input_ids, attention_mask"),
    ("misspelt attention_masks", lambda: dict(input_ids=ids(), attention_masks=torch.ones(B, T)), TypeError, r"got unexpected keyword argument\(s\) 'attention_masks' \(did you mean 'attention_mask'\?\)"),
    ("misspelt label", lambda: dict(input_ids=ids(), label=ids()), TypeError, r"'label' \(did you mean 'labels'\?\)"),
]
BAD_IDS = [case[0] for case in BAD_INPUTS]


def cache_of_batch(batch, layers=1):
    """A DynamicCache holding 3 past tokens of ``batch`` sequences in its first ``layers`` layers (keys of width 4)."""
    cache = DynamicCache()
    for layer in range(layers):
        cache.update(torch.zeros(batch, 2, 3, 4), torch.zeros(batch, 2, 3, 4), layer)
    return cache


# Issue 26 items 6 and 7: a cache written by another model (the other family, another number of layers) or a static
# cache too short for the prompt and max_new_tokens is a ValueError naming past_key_values and what differs (these
# were shape errors deep in the attention, an IndexError, or index_copy_'s IndexError).
# (case, source (family, overrides), target (family, overrides), message fragment)
FOREIGN_CACHES = [
    ("helm_d cache to helm_mice", ("helm_d", {}), ("helm_mice", {}),
     r"was written by another architecture: its layer 0 holds keys of shape \[B, 2, T, 33\] \(width 33\), this "
     r"model's layers write \[B, 1, T, 17\]"),
    ("helm_mice cache to helm_d", ("helm_mice", {}), ("helm_d", {}),
     r"was written by another architecture: its layer 0 holds keys of shape \[B, 1, T, 23\] \(width 23\), this "
     r"model's layers write \[B, 2, T, 33\]"),
    ("1-layer cache to 4 layers", ("helm_d", dict(num_hidden_layers=1)), ("helm_d", dict(num_hidden_layers=4)),
     r"was written by a model with another number of layers: it has 1 layer\(s\), this model has num_hidden_layers=4"),
    ("4-layer cache to 2 layers", ("helm_mice", dict(num_hidden_layers=4)), ("helm_mice", {}),
     r"was written by a model with another number of layers: it has 4 layers \(tokens up to layer index 3\), this model has "
     r"num_hidden_layers=2"),
]


@pytest.mark.parametrize("case, source, target, match", FOREIGN_CACHES, ids=[c[0] for c in FOREIGN_CACHES])
def test_a_cache_of_another_model_is_refused(case, source, target, match):
    cache = DynamicCache()
    tiny_model(source[0], **source[1])(ids(), past_key_values=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"^past_key_values \(cache=\) " + match):
        tiny_model(target[0], **target[1])(ids(B, 1), past_key_values=cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_boolean_switches_keep_their_meaning(models, family):
    """The accepted values of the switches refused above (True, False, None) still do what they say."""
    model = models[family]
    x = ids()
    assert isinstance(model(x, return_dict=False), tuple) and not isinstance(model(x, return_dict=None), tuple)
    assert model(x, use_cache=False).past_key_values is None and model(x, use_cache=True).past_key_values is not None
    out = model(x, output_hidden_states=True, output_attentions=False, use_cache=None)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1 and out.attentions is None
    assert model(x, output_hidden_states=False).hidden_states is None
    assert model(x, labels=x, skip_logits=False).logits is not None


HEADS = ["AutoModelForSequenceClassification", "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"]
# (switch, bad value): refused by every task head of both families, naming the switch
HEAD_SWITCHES = [("return_dict", "false"), ("use_cache", "no"), ("output_hidden_states", 1),
                 ("output_attentions", "false")]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("name, value", HEAD_SWITCHES, ids=[f"{n}={v!r}" for n, v in HEAD_SWITCHES])
def test_task_heads_take_boolean_switches_only(family, head, name, value):
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, head).from_config(tiny_config(family, pad_token_id=0)).eval()
    with pytest.raises(ValueError, match=rf"^{name} must be a bool \(True or False\) or None .*got {value!r}"):
        model(ids(), **{name: value})
    assert isinstance(model(ids(), **{name: False}), tuple if name == "return_dict" else dict)


# Issue 27 item 4: a cache whose keys mean something else for this model, although their shapes fit: written by a
# model of another curvature or positional encoding (recorded on the cache when a HELM forward first sees it), of
# another precision (fp64 keys in an fp32 model, or the other way round: torch.cat promoted them silently), or
# holding non-finite values (checked on the CPU only, each cached token once). (case, source (family, overrides,
# dtype), target (family, overrides, dtype), how the cache is damaged or None, message fragment)
MISFIT_CACHES = [
    ("curvature", ("helm_d", dict(curvature=-2.0), torch.float32), ("helm_d", {}, torch.float32), None,
     r"was written by a model with curvature=-2.0; this model has curvature=-1.0: its cached keys are points of "
     r"another hyperboloid"),
    ("curvature mice", ("helm_mice", dict(curvature=-0.5), torch.float32), ("helm_mice", {}, torch.float32), None,
     r"was written by a model with curvature=-0.5; this model has curvature=-1.0"),
    ("positional", ("helm_d", dict(positional="alibi"), torch.float32), ("helm_d", {}, torch.float32), None,
     r"was written by a model with positional='alibi'; this model has positional='hope'"),
    ("rope_theta", ("helm_d", dict(rope_theta=500.0), torch.float32), ("helm_d", {}, torch.float32), None,
     r"was written by a model with rope_theta=500.0, .*; this model has rope_theta=10000.0"),
    ("fp64 cache to fp32", ("helm_d", {}, torch.float64), ("helm_d", {}, torch.float32), None,
     r"holds torch.float64 keys but this model runs in torch.float32: it was written by a model of another "
     r"precision"),
    ("fp32 cache to fp64", ("helm_mice", {}, torch.float32), ("helm_mice", {}, torch.float64), None,
     r"holds torch.float32 keys but this model runs in torch.float64"),
    ("NaN keys", ("helm_d", {}, torch.float32), ("helm_d", {}, torch.float32),
     lambda c: c.layers[1].keys.fill_(float("nan")),
     r"holds non-finite \(NaN or inf\) keys in layer 1 among tokens 0..4"),
    ("inf values", ("helm_mice", {}, torch.float32), ("helm_mice", {}, torch.float32),
     lambda c: c.layers[0].values[1, 0, 3].fill_(float("inf")), r"holds non-finite \(NaN or inf\) values in layer 0"),
]


def _filled(family, overrides, dtype, seed=0):
    model = tiny_model(family, seed=seed, **overrides).to(dtype)
    return model, model(ids(), use_cache=True).past_key_values


@pytest.mark.parametrize("case, source, target, damage, match", MISFIT_CACHES, ids=[c[0] for c in MISFIT_CACHES])
def test_a_cache_that_does_not_fit_the_model_is_refused(case, source, target, damage, match):
    _, cache = _filled(*source)
    if damage is not None:
        damage(cache)
    model = tiny_model(target[0], **target[1]).to(target[2])
    with pytest.raises(ValueError, match=r"^past_key_values \(cache=\) " + match):
        model(ids(B, 1), past_key_values=cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fitting_cache_is_accepted_and_each_token_checked_once(family):
    """A cache of the same configuration (other weights: not detectable, and not the checks' business) is
    accepted; a decode step value-checks only the token the previous step wrote; a cache reused after decoding
    keeps its record (a later NaN in an unchecked token is still found)."""
    _, cache = _filled(family, {}, torch.float32, seed=1)
    model = tiny_model(family)
    for step in range(3):
        cache = model(ids(B, 1), past_key_values=cache, use_cache=True).past_key_values
        assert cache.helm_origin.checked == T + step  # the tokens present before this step
    cache = model(ids(B, 1), past_key_values=cache, use_cache=True).past_key_values
    cache.layers[0].keys[:, :, -1] = float("nan")  # the token the last step wrote, not checked yet
    with pytest.raises(ValueError, match=rf"non-finite \(NaN or inf\) keys in layer 0 among tokens {T + 3}..{T + 3}"):
        model(ids(B, 1), past_key_values=cache)
    # a reset static cache is new again: another configuration may fill it
    static = StaticCache(config=model.config, max_cache_len=T + 2)
    tiny_model(family, curvature=-2.0)(ids(), past_key_values=static)
    static.reset()
    assert model(ids(), past_key_values=static).logits.shape == (B, T, V)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_generate_refuses_a_cache_that_is_not_a_cache(models, family, name):
    with pytest.raises(ValueError, match=rf"^{name} must be a transformers Cache \(DynamicCache, StaticCache, e.g. the "
                                         r"one a previous call returned\) or None for a new DynamicCache, got str"):
        models[family].generate(ids(), max_new_tokens=2, do_sample=False, **{name: "cache"})


@pytest.mark.parametrize("family", FAMILIES)
def test_a_helm_cache_extended_by_llama_is_refused(models, family):
    """The cache a HELM forward makes (HelmDynamicCache) refuses keys of another shape from a model that does not
    check it, such as transformers' LlamaForCausalLM (a raw torch.cat error before). A DynamicCache made by the
    caller is transformers' own and cannot tell (see HelmDynamicCache)."""
    cache = models[family](ids(), use_cache=True).past_key_values
    with pytest.raises(ValueError, match=rf"^past_key_values \(cache=\) is a HELM cache written by a {family} model "
                                         r"\(layer 0 holds keys \[B, \d, T, \d+\] of hyperbolic points\), and a model "
                                         r"writing keys of shape \(2, 2, 1, 16\) is extending it"):
        models["llama"](ids(B, 1), past_key_values=cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_refuses_the_cache_of_another_prompt_and_continues_its_own(models, family):
    """re-probe 6: a cache filled from [9, 9, 9] continued input_ids [5, 6, 7, 8] silently (Llama does the same);
    the ids a cache was written from are recorded (CPU ids), so generate compares them with its prompt."""
    model = models[family]
    prompt = ids(1, 4)
    other = model(prompt[:, :3] + 1, use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"past_key_values holds the keys of other tokens than input_ids begins with: "
                                         r"of its 3 cached tokens, token 0 of row 0 was \d+, input_ids has \d+ there"):
        model.generate(prompt, past_key_values=other, max_new_tokens=2)
    own = model(prompt[:, :3], use_cache=True).past_key_values
    assert torch.equal(model.generate(prompt, past_key_values=own, max_new_tokens=2),
                       model.generate(prompt, max_new_tokens=2))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_generate_refuses_the_cache_of_another_prompt_given_as_embeddings(models, family):
    """probe 9 (K247): generate(inputs_embeds=..., past_key_values=a cache of other tokens) took the cache as the
    prompt's first tokens (Llama does the same); the embeddings are compared with the model's embedding of the ids
    the cache was filled from (space parts: the time coordinate is recomputed)."""
    model = models[family]
    prompt = ids(1, 4)
    embeds = model.get_input_embeddings()(prompt)
    other = model(prompt[:, :3] + 1, use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"^past_key_values holds the keys of other tokens than inputs_embeds begins "
                                         r"with: of its 3 cached tokens, token 0 of row 0 was \d+, whose embedding "
                                         r"inputs_embeds does not hold there"):
        model.generate(inputs_embeds=embeds, past_key_values=other, max_new_tokens=2, do_sample=False)
    own = model(prompt[:, :3], use_cache=True).past_key_values
    embeds[..., 0] = 0  # the time coordinate is not read
    assert torch.equal(model.generate(inputs_embeds=embeds, past_key_values=own, max_new_tokens=2, do_sample=False),
                       model.generate(inputs_embeds=embeds, max_new_tokens=2, do_sample=False))
    whole = model(prompt[:, :3], use_cache=True).past_key_values  # generate extended own
    with pytest.raises(ValueError, match=r"^past_key_values already holds 3 tokens but inputs_embeds has 3"):
        model.generate(inputs_embeds=embeds[:, :3], past_key_values=whole, max_new_tokens=2, do_sample=False)


def test_the_recorded_ids_follow_the_cache():
    """CacheOrigin.record: a forward appends its ids (a decode step one column, without copying the others), a
    crop (assisted decoding) keeps the prefix, a forward from the start replaces them, and ids it cannot see (on
    another device, or inputs_embeds) make them unknown for good."""
    origin = CacheOrigin({})
    prompt = ids(2, 5)
    origin.record(prompt[:, :3], 0)
    for step in (3, 4):
        origin.record(prompt[:, step:step + 1], step)
    assert torch.equal(origin.tokens, prompt)
    origin.record(prompt[:, 2:4] + 1, 2)  # cropped to 2 tokens, then two others
    assert torch.equal(origin.tokens, torch.cat([prompt[:, :2], prompt[:, 2:4] + 1], 1))
    origin.record(prompt[:, :1], 0)
    assert torch.equal(origin.tokens, prompt[:, :1])
    origin.record(None, 1)
    assert origin.tokens is None
    origin.record(prompt, 0)
    assert origin.tokens is None


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_assisted_decoding_takes_an_empty_cache_only(models, family):
    """Prompt-lookup decoding crops the cache after rejected guesses; the ids recorded follow it. Given a cache that
    holds a prefix, transformers 5 feeds the whole prompt again after it (Llama's continuation differs from greedy
    decoding's then), so that is refused."""
    model, prompt = models[family], torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    cache = DynamicCache(config=model.config)
    out = model.generate(prompt, past_key_values=cache, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=2)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=6, do_sample=False))
    assert torch.equal(cache.helm_origin.tokens, out[:, :cache.get_seq_length()])
    prefilled = model(prompt[:, :4], use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"^past_key_values already holds 4 tokens, and prompt_lookup_num_tokens=2 asks "
                                         r"for assisted decoding, which in transformers feeds the whole of input_ids "
                                         r"again after the cached tokens"):
        model.generate(prompt, past_key_values=prefilled, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=2)


# re-probe 7 (N040, N068): a cache filled by another model of the same config from the same tokens was continued
# without a word (Llama does the same). The cache records the weights_id of the model that fills it; another one is a
# warning, a copy.deepcopy or a second load of the same checkpoint is the same model. (case, make the second model
# from the first and a checkpoint folder, warned)
OWNERS = [
    ("another instance", lambda model, folder: tiny_model(model.config.model_type, seed=1), True),
    ("same seed, built again", lambda model, folder: tiny_model(model.config.model_type), True),
    ("the model itself", lambda model, folder: model, False),
    ("a deepcopy", lambda model, folder: copy.deepcopy(model), False),
    ("a second load of its checkpoint", lambda model, folder: AutoModelForCausalLM.from_pretrained(folder).eval(), False),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case, second, warned", OWNERS, ids=[c[0] for c in OWNERS])
@torch.no_grad()
def test_a_cache_filled_by_another_model_warns(family, case, second, warned, tmp_path):
    first = tiny_model(family)
    if case == "a second load of its checkpoint":
        first.save_pretrained(tmp_path)
        first = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    other = second(first, tmp_path)
    prompt = ids(1, 4)
    cache = first(prompt[:, :3], use_cache=True).past_key_values
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = other.generate(prompt, past_key_values=cache, max_new_tokens=2, do_sample=False)
    mine = [str(w.message) for w in caught if "filled by another model" in str(w.message)]
    assert len(mine) == int(warned), mine
    if warned:
        assert mine[0].startswith("past_key_values (cache=) was filled by another model (the same architecture")
    else:
        assert torch.equal(out, other.generate(prompt, max_new_tokens=2, do_sample=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_an_empty_static_cache_of_fewer_layers_is_refused(models, family):
    """re-probe 6: a StaticCache allocated for a 1-layer config failed with "IndexError: list index out of range"."""
    cache = StaticCache(config=tiny_config(family, num_hidden_layers=1), max_cache_len=16)
    with pytest.raises(ValueError, match=r"is a StaticCache of 1 layer\(s\), this model has num_hidden_layers=2; "
                                         r"allocate it from this model's config"):
        models[family].generate(ids(1, 3), past_key_values=cache, max_new_tokens=2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("max_cache_len", [4, 8])
def test_generate_past_a_static_cache_is_refused(models, family, max_cache_len):
    """max_cache_len 4: the prompt (5) does not fit; 8: the fourth new token does not."""
    cache = StaticCache(config=models[family].config, max_cache_len=max_cache_len)
    with pytest.raises(ValueError, match=rf"^past_key_values \(cache=\) is a StaticCache of "
                                         rf"max_cache_len={max_cache_len} holding \d+ tokens: \d+ more do not fit"):
        models[family].generate(ids(), past_key_values=cache, max_new_tokens=6, do_sample=False)
    # one that fits generates, and its own cache is accepted step after step
    cache = StaticCache(config=models[family].config, max_cache_len=T + 6)
    assert models[family].generate(ids(), past_key_values=cache, max_new_tokens=6, do_sample=False).shape == (B, T + 6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,make,exc,match", BAD_INPUTS, ids=BAD_IDS)
def test_bad_inputs_give_a_clear_error(models, family, case, make, exc, match):
    with pytest.raises(exc, match=match):
        models[family](**make())


@pytest.mark.parametrize("family", FAMILIES)
def test_vocabulary_check_is_switchable(family):
    model = tiny_model(family, validate_inputs=False)
    with pytest.raises(IndexError):  # torch's own error from the embedding lookup
        model(ids() + V)
    with pytest.raises(IndexError):  # torch's cross entropy
        model(ids(), labels=ids() + V)
    # non-finite inputs_embeds propagate, as in Llama
    out = model(inputs_embeds=torch.full((B, T, HIDDEN), float("nan"))).logits
    assert out.isnan().all()


@pytest.mark.parametrize("family", FAMILIES)
def test_position_ids_of_one_row_broadcast_like_llama(models, family):
    model = models[family]
    x = ids()
    default = model(x).logits
    assert torch.equal(model(x, position_ids=torch.arange(T)[None]).logits, default)
    assert torch.equal(model(x, position_ids=torch.arange(T).expand(B, T)).logits, default)
    assert torch.equal(model(x, position_ids=torch.arange(T, dtype=torch.int32)[None]).logits, default)


# 0/1 masks of every dtype mean the same (masks of other values are refused: BAD_INPUTS): (case id, fill value, dtype)
MASK_VALUES = [("1.0 float", 1.0, torch.float32), ("bool", True, torch.bool), ("int32", 1, torch.int32),
               ("fp16", 1.0, torch.float16)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,value,dtype", MASK_VALUES, ids=[c for c, *_ in MASK_VALUES])
def test_attention_masks_of_0_and_1_in_any_dtype_agree(models, family, case, value, dtype):
    """A 0/1 mask of any dtype gives the logits of the long one, with and without left padding."""
    model = models[family]
    x = ids()
    ones = torch.ones(B, T, dtype=torch.long)
    mask = torch.full((B, T), value, dtype=dtype)
    assert torch.equal(model(x, attention_mask=mask).logits, model(x, attention_mask=ones).logits)
    ones[0, :2] = 0
    mask[0, :2] = 0
    assert torch.equal(model(x, attention_mask=mask).logits, model(x, attention_mask=ones).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_values_are_checked_only_where_free(family):
    """The value check of a 2-D mask is a CPU read, switched off with validate_inputs (a mask of 2s is then read
    as a boolean, as before); a 4-D mask (transformers' additive form) is used as given."""
    model = tiny_model(family, validate_inputs=False)
    x = ids()
    assert torch.equal(model(x, attention_mask=torch.full((B, T), 2)).logits,
                       model(x, attention_mask=torch.ones(B, T, dtype=torch.long)).logits)
    model = tiny_model(family)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    additive = torch.zeros(B, 1, T, T).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert torch.allclose(model(x, attention_mask=additive).logits, model(x).logits, atol=1e-5)


# probe item 2: logits_to_keep's accepted forms (transformers': an int n >= 0, or a 1-D tensor of positions)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_to_keep_forms(models, family):
    model, x = models[family], ids()
    full = model(x).logits
    assert torch.equal(model(x, logits_to_keep=0).logits, full)
    assert_close(model(x, logits_to_keep=2).logits, full[:, -2:])  # fewer GEMM rows: rounding may differ
    assert torch.equal(model(x, logits_to_keep=T + 10).logits, full)
    assert_close(model(x, logits_to_keep=torch.tensor([0, 3])).logits, full[:, [0, 3]])


# probe item 3: the keywords transformers passes (Trainer, generate, packing collators) are still taken
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_keywords_are_accepted(models, family):
    model, x = models[family], ids()
    extra = dict(num_items_in_batch=torch.tensor(3), cache_position=torch.arange(T), return_dict=True,
                 token_type_ids=torch.zeros(B, T, dtype=torch.long), is_causal=True, output_router_logits=False,
                 ignore_index=-100, shift_labels=None)
    assert model(x, labels=x, **extra).loss is not None
    extra = {k: v for k, v in extra.items() if k not in ("ignore_index", "shift_labels")}
    assert model.model(x, **extra).last_hidden_state.shape[:2] == (B, T)
    with pytest.raises(TypeError, match=r"^Helm\w+Model\.forward\(\) got unexpected keyword argument\(s\) 'labels'"):
        model.model(x, labels=x)


def _generation_config(**fields):
    config = GenerationConfig(max_new_tokens=2)  # its own validation compares some fields with ints as well
    for name, value in fields.items():
        setattr(config, name, value)
    return config


# probe item 6: generate's integer lengths and counts: (case id, generate keywords, message fragment)
BAD_GENERATE = [
    ("max_new_tokens '5'", dict(max_new_tokens="5"), r"^max_new_tokens must be an int >= 1 \(or None for the default\), got '5'"),
    ("max_new_tokens 2.0", dict(max_new_tokens=2.0), r"^max_new_tokens must be an int >= 1 .*got 2\.0"),
    ("max_length '9'", dict(max_length="9"), r"^max_length must be an int >= 1 .*got '9'"),
    ("min_new_tokens -1", dict(max_new_tokens=2, min_new_tokens=-1), r"^min_new_tokens must be an int >= 0 .*got -1"),
    ("min_length '1'", dict(max_new_tokens=2, min_length="1"), r"^min_length must be an int >= 0 .*got '1'"),
    ("num_return_sequences 0", dict(max_new_tokens=2, num_return_sequences=0), r"^num_return_sequences must be an int >= 1 .*got 0"),
    ("num_beams '2'", dict(max_new_tokens=2, num_beams="2"), r"^num_beams must be an int >= 1 .*got '2'"),
    ("generation_config", dict(generation_config=_generation_config(num_beams="2")), r"^generation_config\.num_beams must be an int >= 1 .*got '2'"),
    # second re-probe: values transformers accepts although they cannot mean what they say
    ("top_p 1.5", dict(max_new_tokens=2, do_sample=True, top_p=1.5), r"^top_p must be a number in \(0, 1\], got 1\.5"),
    ("top_p 0", dict(max_new_tokens=2, do_sample=True, top_p=0.0), r"^top_p must be a number in \(0, 1\], got 0\.0"),
    ("do_sample 'yes'", dict(max_new_tokens=2, do_sample="yes"), r"^do_sample must be True or False .*got 'yes'"),
    ("eos_token_id past the vocabulary", dict(max_new_tokens=2, eos_token_id=99999), r"^eos_token_id must be a token id in \[0, vocab_size=\d+\) .*got 99999"),
    ("min_new_tokens > max_new_tokens", dict(max_new_tokens=3, min_new_tokens=10), r"^min_new_tokens=10 is more than max_new_tokens=3"),
    ("repetition_penalty 0", dict(max_new_tokens=2, repetition_penalty=0.0), r"^repetition_penalty must be a positive finite number"),
    ("bad_words_ids past the vocabulary", dict(max_new_tokens=2, bad_words_ids=[[99999]]), r"^bad_words_ids must be a list of token-id lists, each id in \[0, vocab_size=\d+\)"),
    # probe 9 (K016): transformers' "Invalid max_matching_ngram_size or num_output_tokens" before
    ("prompt_lookup_num_tokens 0", dict(max_new_tokens=2, prompt_lookup_num_tokens=0),
     r"^prompt_lookup_num_tokens must be an int >= 1 \(or None for the default\), got 0"),
    ("max_matching_ngram_size 0", dict(max_new_tokens=2, prompt_lookup_num_tokens=2, max_matching_ngram_size=0),
     r"^max_matching_ngram_size must be an int >= 1 .*got 0"),
    ("generation_config.prompt_lookup_num_tokens 0",
     dict(generation_config=_generation_config(prompt_lookup_num_tokens=0)),
     r"^generation_config\.prompt_lookup_num_tokens must be an int >= 1 .*got 0"),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_a_cache_holding_the_whole_prompt_names_the_cache(models, family):
    """Second re-probe: a cache already holding every token of input_ids left generate nothing to feed, and the
    forward complained about an empty input_ids; generate names the cache and both lengths."""
    prompt = ids()
    out = models[family].generate(prompt, do_sample=False, max_new_tokens=2, return_dict_in_generate=True)
    cache = getattr(out, CACHE_FIELD)
    with pytest.raises(ValueError, match=rf"^past_key_values already holds {cache.get_seq_length()} tokens but "
                                         rf"input_ids has {prompt.shape[1]}"):
        models[family].generate(prompt, do_sample=False, max_new_tokens=2, past_key_values=cache)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,kwargs,match", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
def test_bad_generation_lengths_are_named(models, family, case, kwargs, match):
    with pytest.raises(ValueError, match=match):
        models[family].generate(ids(), **{"do_sample": False, **kwargs})


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
def test_labels_all_ignored_give_a_zero_loss_and_zero_gradients(models, family):
    """transformers' ``ForCausalLMLoss`` takes the mean over the labelled tokens, which is 0/0 = NaN when none
    is labelled (``LlamaForCausalLM`` returns NaN, checked below) and poisons the gradients of a whole
    accumulation step. HELM normalises by ``max(#labelled, 1)`` on the device (no synchronisation): the same
    value as the mean whenever a token is labelled, and what transformers itself returns when the trainer passes
    ``num_items_in_batch`` (sum over labelled tokens / count), i.e. 0 with zero gradients here."""
    model = models[family]
    x = ids()
    labels = torch.full_like(x, -100)
    if family == "llama":
        assert torch.isnan(model(x, labels=labels).loss)
        assert model(x, labels=labels, num_items_in_batch=torch.tensor(1)).loss == 0.0
        return
    model.zero_grad()
    loss = model(x, labels=labels).loss
    assert loss == 0.0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)
    model.zero_grad()


@pytest.mark.parametrize("family", FAMILIES)
def test_partially_ignored_labels_average_over_the_labelled_tokens(models, family):
    model = models[family]
    x = ids()
    labels = x.clone()
    labels[0, :3] = -100
    out = model(x, labels=labels)
    shifted = labels[:, 1:].reshape(-1)
    logits = out.logits[:, :-1].reshape(-1, V)
    keep = shifted != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], shifted[keep])
    assert_close(out.loss, expected)
    # and exactly transformers' loss with the count passed explicitly
    ref = model.loss_function(logits=out.logits, labels=labels, vocab_size=V, num_items_in_batch=keep.sum())
    assert_close(out.loss, ref)


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_are_read_as_points_and_projected(models, family):
    """``inputs_embeds`` are points ``[B, T, 1+n]``; only the space part is read and the time coordinate
    recomputed (``lift``), so an input off the hyperboloid is projected onto it instead of corrupting the
    Lorentz residuals (no synchronisation, one sqrt)."""
    model = models[family]
    x = ids()
    on = model.model.embed_tokens(x)
    assert torch.equal(model(inputs_embeds=on).logits, model(x).logits)
    off = on.clone()
    off[..., 0] = 123.0  # time coordinate off the hyperboloid
    out = model(inputs_embeds=off, output_hidden_states=True)
    assert torch.equal(out.logits, model(inputs_embeds=lift(off[..., 1:], k=model.config.k)).logits)
    for h in out.hidden_states:
        assert manifold_error(h, model.config.k).max() <= MANIFOLD_TOL[torch.float32]


# ---- from_pretrained of damaged checkpoints (item 8) -------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("saved")
    for family in FAMILIES:
        models[family].save_pretrained(root / family)
    return root


def _rewrite(fn):
    """The weights edited and re-saved with a matching manifest (as if saved so): the load checks behind it act."""
    def edit(path):
        from helm.manifest import write_manifest

        sd = load_file(path / "model.safetensors")
        fn(sd)
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
        write_manifest(path, None, which=lambda name: name == "model.safetensors")
    return edit


def _without_manifest(damage):
    """``damage`` to a folder without save_pretrained's manifest (saved before it wrote one, or the manifest
    deleted): the weights file itself is read."""
    def edit(path):
        os.remove(path / "manifest.json")
        damage(path)
    return edit


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _drop_tail(path):  # header intact, tensor data cut short
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-64])


def _flip_one_bit(path):
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-100] ^= 0x40  # an exponent bit of a weight: still a valid file, a different model
    (path / "model.safetensors").write_bytes(bytes(data))


WEIGHT = "model.layers.0.attn_residual.raw_weight"
MATRIX = "model.layers.1.self_attn.o_proj.weight"
# (case id, damage to the saved directory, exception, message fragment)
DAMAGED = [
    ("no weights file", _without_manifest(lambda p: os.remove(p / "model.safetensors")), OSError,
     "no file named model.safetensors"),
    # a corrupt file: an OSError naming the file, chained from safetensors' error (checked below)
    ("truncated file", _without_manifest(_truncate), OSError,
     r"model\.safetensors is corrupted or truncated.*deserializing header"),
    ("tensor data cut", _without_manifest(_drop_tail), OSError, r"model\.safetensors is corrupted or truncated"),
    ("not safetensors", _without_manifest(lambda p: (p / "model.safetensors").write_bytes(b"\0" * 100)), OSError,
     r"model\.safetensors is corrupted or truncated.*header"),
    # probe item 4: save_pretrained writes a manifest of its weight files, so damage after saving is refused
    ("one byte flipped", lambda p: _flip_one_bit(p), OSError,
     r"the checkpoint is corrupted: the SHA-256 of model\.safetensors does not match its manifest"),
    ("truncated, manifest kept", _truncate, OSError,
     r"the checkpoint is truncated or corrupted: model\.safetensors has \d+ bytes, the manifest records \d+"),
    ("weights deleted, manifest kept", lambda p: os.remove(p / "model.safetensors"), OSError,
     r"the checkpoint is incomplete: model\.safetensors is missing"),
    # probe item 5: non-finite weights are named with their file (NaN logits before)
    ("NaN weight", _rewrite(lambda sd: sd[MATRIX].view(-1)[0].fill_(float("nan"))), OSError,
     rf"the weight '{MATRIX}' holds NaN or inf values in \S*model\.safetensors; every output of this model would be NaN"),
    ("inf scalar", _rewrite(lambda sd: sd[WEIGHT].fill_(float("inf"))), OSError,
     rf"the weight '{WEIGHT}' holds NaN or inf values in \S*model\.safetensors"),
    # re-probe 6: embeddings x 1e30 (finite) loaded and gave NaN logits
    ("weights x 1e30", _rewrite(lambda sd: sd["model.embed_tokens.weight"].mul_(1e30)), OSError,
     r"the weight 'model.embed_tokens.weight' holds values up to \S+ in \S*model\.safetensors, beyond 1e\+15, far "
     r"past any trained weight: the checkpoint is damaged"),
    ("missing key", _rewrite(lambda sd: sd.pop(MATRIX)), RuntimeError, rf"missing from the checkpoint.*{MATRIX}"),
    ("missing scalar", _rewrite(lambda sd: sd.pop(WEIGHT)), RuntimeError, rf"missing from the checkpoint.*{WEIGHT}"),
    ("missing lm_head", _rewrite(lambda sd: sd.pop("lm_head.weight")), RuntimeError, "lm_head.weight"),
    ("unexpected key", _rewrite(lambda sd: sd.__setitem__("model.layers.0.extra", torch.zeros(3))), RuntimeError,
     r"not used by the model.*model\.layers\.0\.extra"),
    ("wrong shape", _rewrite(lambda sd: sd.__setitem__(MATRIX, torch.zeros(3, 3))), RuntimeError,
     r"weights of the wrong shape \(key, checkpoint, model\)"),
    ("wrong scalar shape", _rewrite(lambda sd: sd.__setitem__(WEIGHT, torch.zeros(2))), RuntimeError,
     r"weights of the wrong shape \(key, checkpoint, model\)"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,damage,exc,match", DAMAGED, ids=[c[0] for c in DAMAGED])
def test_damaged_checkpoints_fail_loudly(saved, tmp_path, family, case, damage, exc, match):
    path = tmp_path / family
    shutil.copytree(saved / family, path)
    damage(path)
    with pytest.raises(exc, match=match) as err:
        AutoModelForCausalLM.from_pretrained(path)
    if "corrupted or truncated" in match:
        assert str(path) in str(err.value) and isinstance(err.value.__cause__, SafetensorError)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_changed_after_train_py_wrote_them_are_refused(saved, tmp_path, family):
    """train.py writes final/ with a SHA-256 manifest; from_pretrained checks the weight files against it."""
    from helm.manifest import read_manifest, write_manifest

    path = tmp_path / family
    shutil.copytree(saved / family, path)
    write_manifest(path, 1)
    assert AutoModelForCausalLM.from_pretrained(path) is not None  # intact: loads
    _flip_one_bit(path)
    with pytest.raises(OSError, match="is corrupted: the SHA-256 of model.safetensors does not match its manifest"):
        AutoModelForCausalLM.from_pretrained(path)
    # saving new weights there replaces the old manifest with one of the new weights (not one that refuses them)
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    model.save_pretrained(path)
    manifest = read_manifest(path)
    assert manifest["step"] is None and list(manifest["files"]) == ["model.safetensors"]
    AutoModelForCausalLM.from_pretrained(path)
    # which the remote code (no helm import) checks as well
    _flip_one_bit(path)
    with pytest.raises(OSError, match="is corrupted: the SHA-256 of model.safetensors does not match its manifest"):
        AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_saves_are_listed_and_a_nan_weight_names_its_shard(tmp_path, family):
    """save_pretrained's manifest lists every shard and the index; a NaN weight is named with the shard it is in."""
    from helm.manifest import read_manifest, write_manifest

    model = tiny_model(family)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    files = read_manifest(tmp_path)["files"]
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(files) == sorted(shards + ["model.safetensors.index.json"])
    assert AutoModelForCausalLM.from_pretrained(tmp_path) is not None
    last = tmp_path / shards[-1]
    sd = load_file(last)
    name = sorted(sd)[0]
    sd[name].view(-1)[0] = float("nan")
    save_file(sd, last, metadata={"format": "pt"})
    with pytest.raises(OSError, match="SHA-256"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    write_manifest(tmp_path, None)
    with pytest.raises(OSError, match=rf"the weight '{name}' holds NaN or inf values in {last}"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def _no_config(saved, tmp_path, family):
    shutil.copytree(saved / family, tmp_path / family)
    os.remove(tmp_path / family / "config.json")
    return tmp_path / family


def _with_config(saved, tmp_path, text: bytes):
    """A copy of the saved helm_d folder whose config.json is ``text``."""
    path = _no_config(saved, tmp_path, "helm_d")
    (path / "config.json").write_bytes(text)
    return path


def _train_run(tmp_path):
    """The layout train.py writes: run/{.helm-train-run, config.yaml, checkpoints/step-00000002/...} (no final/ yet)."""
    from helm.manifest import RUN_MARKER, STATE_FILE

    step = tmp_path / "run" / "checkpoints" / "step-00000002"
    step.mkdir(parents=True)
    (step / STATE_FILE).write_bytes(b"")
    (step / "model.safetensors").write_bytes(b"")
    (tmp_path / "run" / RUN_MARKER).write_text("")
    (tmp_path / "run" / "config.yaml").write_text("")
    return tmp_path / "run"


FINAL = r"load the run's model, '\S*run/final', or continue training with train\.py --resume"
# (case id, the path to load from (saved, tmp_path), message fragment after "Class.from_pretrained(path): ");
# every loader says the same: the zoo's classes check before loading, the Auto classes after transformers fails
# (probe items 7 and 10, re-probes 4 and 5: "Repo id must be in the form ...", "Unrecognized model ... Should have a
# `model_type` key", "couldn't connect to huggingface.co", "not a valid JSON file" before)
NOT_CHECKPOINT_FOLDERS = [
    ("no such folder", lambda saved, tmp: "/no/such/folder", "no such folder"),
    ("no such relative folder", lambda saved, tmp: "no/such/folder", "no such folder"),
    ("a file", lambda saved, tmp: saved / "helm_d" / "model.safetensors",
     r"expects the checkpoint folder \(with config\.json\), not a file; use '\S*helm_d'"),
    ("None", lambda saved, tmp: None, "got None; pass a folder written by save_pretrained or a hub model id"),
    ("empty string", lambda saved, tmp: "", "got an empty path; pass a folder written by save_pretrained"),
    ("tilde path", lambda saved, tmp: "~/no/such/model",
     r"'~' is not expanded by transformers .*pass os\.path\.expanduser\(\.\.\.\) = '\S*no/such/model' \(there is "
     r"no such folder either\)"),
    ("folder without config.json", lambda saved, tmp: _no_config(saved, tmp, "helm_d"),
     r"not a checkpoint folder: it holds model\.safetensors but no config\.json \(a save_pretrained "
     r"folder holds config\.json and the weights\)"),
    ("empty folder", lambda saved, tmp: tmp, r"not a checkpoint folder: it has no config\.json"),
    ("config.json with a BOM", lambda saved, tmp: _with_config(
        saved, tmp, b"\xef\xbb\xbf" + (saved / "helm_d" / "config.json").read_bytes()),
     "config.json starts with a UTF-8 byte-order mark"),
    ("config.json cut short", lambda saved, tmp: _with_config(saved, tmp, b'{"model_type": "helm_d",'),
     r"config\.json is not valid JSON \(Expecting property name enclosed in double quotes at line 1, column 25\)"),
    ("config.json a list", lambda saved, tmp: _with_config(saved, tmp, b"[1, 2]"),
     "config.json holds a JSON list, not an object of config fields"),
    ("train.py checkpoint", lambda saved, tmp: _train_run(tmp) / "checkpoints" / "step-00000002",
     "a training checkpoint of train.py \\(no config.json\\), not a save_pretrained folder: " + FINAL),
    ("checkpoints folder", lambda saved, tmp: _train_run(tmp) / "checkpoints", "the checkpoints/ folder of train.py"),
    ("run folder", lambda saved, tmp: _train_run(tmp), "a run folder of train.py .*" + FINAL),
]
# paths that can load nothing: the Auto classes refuse them before transformers tries (the hub, for a '~' path)
UNLOADABLE = {"no such folder", "no such relative folder", "None", "empty string", "tilde path"}
LOADERS = ["HelmDForCausalLM", "HelmMiCEModel", "HelmDConfig", "AutoConfig", "AutoModelForCausalLM", "AutoModel"]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("case,where,match", NOT_CHECKPOINT_FOLDERS, ids=[c[0] for c in NOT_CHECKPOINT_FOLDERS])
def test_paths_that_are_not_checkpoint_folders_are_named(saved, tmp_path, loader, case, where, match):
    import transformers

    import helm.models as models

    if loader.endswith("Config") and case == "a file":
        pytest.skip("a config class reads a config file given directly (a .json file: the BOM/list rows cover it)")
    cls = getattr(models, loader, None) or getattr(transformers, loader)
    path = where(saved, tmp_path)
    shown = repr(os.fspath(path)) if path is not None else "None"
    with pytest.raises((OSError, ValueError), match=rf"^{loader}\.from_pretrained\({re.escape(shown)}\): {match}") as err:
        cls.from_pretrained(path)
    if loader.startswith("Auto") and case not in UNLOADABLE:  # transformers' own error is kept as the cause
        assert err.value.__cause__ is not None


CUDA_DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0
# (case id, from_pretrained keywords, exception, message fragment): options that transformers turns into raw errors
# ("Torch not compiled with CUDA enabled", "Unrecognized model ... model_type", "did you mean 'load_in_8bit'?")
BAD_LOADING_OPTIONS = [
    ("subfolder missing", dict(subfolder="nope"), (OSError, ValueError), r"has no subfolder 'nope' \(subfolder=\)"),
    ("device_map a missing GPU", dict(device_map=f"cuda:{CUDA_DEVICES}"), ValueError,
     rf"device_map='cuda:{CUDA_DEVICES}' names cuda:{CUDA_DEVICES}, but this machine has {CUDA_DEVICES} CUDA device"),
    ("device_map a bad name", dict(device_map="gpu"), ValueError, "device_map='gpu' names no device"),
    ("device_map an index past the accelerators", dict(device_map=64), ValueError,
     r"device_map=64 names accelerator 64, but this machine has \d+ accelerator device"),
    ("load_in_8bit", dict(load_in_8bit=True), ValueError,
     r"load_in_8bit= is not a loading option of transformers 5 .*quantization_config=BitsAndBytesConfig"),
    ("use_flash_attention_2", dict(use_flash_attention_2=True), ValueError, "HELM models have no FlashAttention-2"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,kwargs,exc,match", BAD_LOADING_OPTIONS, ids=[c[0] for c in BAD_LOADING_OPTIONS])
def test_bad_loading_options_are_named(saved, family, case, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        AutoModelForCausalLM.from_pretrained(saved / family, **kwargs)


TOKENIZER_PATHS = [
    ("no such folder", lambda tmp: tmp / "no" / "such", "no such folder"),
    ("None", lambda tmp: None, "got None"),
    ("tilde path", lambda tmp: "~/no/such/tokenizer", "'~' is not expanded by transformers"),
    ("a file", lambda tmp: tmp / "vocab.txt", r"expects a tokenizer folder, not a file; use '\S*'"),
    ("a model folder without tokenizer files", lambda tmp: tmp, r"the folder '\S*' has no tokenizer files \(looked "
     r"for tokenizer\.json, tokenizer_config\.json, .*; it is a model folder \(config\.json\) saved without its tokenizer"),
]


@pytest.mark.parametrize("case,where,match", TOKENIZER_PATHS, ids=[c[0] for c in TOKENIZER_PATHS])
def test_auto_tokenizer_names_paths_that_hold_no_tokenizer(tmp_path, case, where, match):
    """AutoTokenizer gets the path checks (a tokenizer folder needs no config.json): transformers said "Repo id must
    be ..." or "Couldn't instantiate the backend tokenizer" before."""
    from transformers import AutoTokenizer

    (tmp_path / "config.json").write_text("{}")
    if case == "a file":
        (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises((OSError, ValueError), match=rf"^AutoTokenizer\.from_pretrained\(.*\): {match}"):
        AutoTokenizer.from_pretrained(where(tmp_path))


@pytest.mark.parametrize("loader", ["AutoConfig", "AutoModelForCausalLM"])
def test_a_config_json_without_model_type_is_named_by_the_auto_classes(saved, tmp_path, loader):
    """re-probe 6: transformers said the folder "contains custom code which must be executed" (it has an auto_map);
    the concrete class still loads it (its config class is known)."""
    import json

    import transformers

    import helm.models

    config = json.loads((saved / "helm_d" / "config.json").read_text())
    del config["model_type"]
    path = _with_config(saved, tmp_path, json.dumps(config).encode())
    with pytest.raises(ValueError, match=rf'^{loader}\.from_pretrained\(.*\): config\.json has no "model_type" key'):
        getattr(transformers, loader).from_pretrained(path)
    assert helm.models.HelmDForCausalLM.from_pretrained(path) is not None


@pytest.mark.parametrize("loader", ["AutoConfig", "AutoModelForCausalLM"])
def test_auto_loading_messages_leave_the_rest_to_transformers(saved, tmp_path, loader):
    """A good folder loads; a failure that is not about the path (a model type nobody registered) is transformers'
    own error, unchanged."""
    import transformers

    cls = getattr(transformers, loader)
    assert cls.from_pretrained(saved / "helm_d") is not None
    path = _with_config(saved, tmp_path, b'{"model_type": "no_such_type"}')
    with pytest.raises(ValueError, match="no_such_type") as err:
        cls.from_pretrained(path)
    assert not str(err.value).startswith(loader) and err.value.__cause__ is None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_without_config_json_loads_with_config(models, saved, tmp_path, family):
    """config= makes config.json unnecessary, as in transformers."""
    path = _no_config(saved, tmp_path, family)
    loaded = type(models[family]).from_pretrained(path, config=models[family].config)
    assert torch.equal(loaded.eval()(ids()).logits, models[family].eval()(ids()).logits)


# probe item 8: (case id, the save directory under tmp_path, message fragment); NotADirectoryError about
# config.json/manifest.json before
BAD_SAVE_DIRECTORIES = [
    ("an existing file", "file.txt", r"save_pretrained\('.*file\.txt'\): the save directory is an existing file"),
    ("under an existing file", "file.txt/sub",
     r"save_pretrained\('.*file\.txt/sub'\): the save directory lies under '.*file\.txt', an existing file"),
]


def _peft_model(model):
    import peft

    return peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2))


# (case id, what is saved, as a function of the model and the tokenizer): every save_pretrained a user calls. probe 9
# K283/K252 (the model) and re-probe 10 L033/L034 (the generation config, a PEFT model: transformers' and PEFT's
# classes, so Llama did the same) for '~' paths
SAVERS = [
    ("model", lambda model, tokenizer: model),
    ("config", lambda model, tokenizer: model.config),
    ("generation config", lambda model, tokenizer: model.generation_config),
    ("tokenizer", lambda model, tokenizer: tokenizer),
    ("PEFT model", lambda model, tokenizer: _peft_model(model)),
    ("PEFT config", lambda model, tokenizer: _peft_model(model).peft_config["default"]),
]


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
@pytest.mark.parametrize("case, saver", SAVERS, ids=[c[0] for c in SAVERS])
@pytest.mark.parametrize("kind", [str, pathlib.Path])
def test_a_tilde_save_directory_is_refused_before_writing(models, tokenizer, tmp_path, monkeypatch, family, case, saver,
                                                          kind):
    """save_pretrained('~/run') created a folder literally named '~' in the current directory (transformers and PEFT
    do not expand it), which from_pretrained('~/run') then refused; the model's, its config's and generation
    config's, the tokenizer's and a PEFT model's save refuse it before writing (Llama's too: the wrapped classes are
    transformers' and PEFT's)."""
    target = saver(models[family], tokenizer)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ValueError, match=r"^\w+\.save_pretrained\('~/run'\): '~' is not expanded by transformers or "
                                         r"PEFT \(the save would create a folder named '~' in the current directory\); "
                                         rf"pass os\.path\.expanduser\(\.\.\.\) = "
                                         rf"{re.escape(repr(str(tmp_path / 'home' / 'run')))}; nothing was written$"):
        target.save_pretrained(kind("~/run"))
    assert not any(tmp_path.iterdir())
    target.save_pretrained(tmp_path / "run")  # a real path saves
    assert any((tmp_path / "run").iterdir())


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("kind", [str, pathlib.Path])
def test_a_tilde_path_is_refused_where_a_tilde_folder_exists(saved, tmp_path, monkeypatch, loader, kind):
    """probe 9 (K252): with a folder literally named '~' in the current directory (an unexpanded save),
    from_pretrained(Path('~/run')) loaded it; a '~' path is refused, naming that folder and how to mean it."""
    import transformers

    import helm.models as zoo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shutil.copytree(saved / "helm_d", tmp_path / "~" / "run")
    cls = getattr(zoo, loader, None) or getattr(transformers, loader)
    with pytest.raises(OSError, match=rf"^{loader}\.from_pretrained\('~/run'\): '~' is not expanded by transformers "
                                      r".*\(there is no such folder either; a folder '\./~/run' exists in the current "
                                      r"directory: pass that to mean it\)$"):
        cls.from_pretrained(kind("~/run"))
    if loader in ("HelmDForCausalLM", "AutoModelForCausalLM", "AutoConfig"):
        assert cls.from_pretrained("./~/run") is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_save_directory_that_cannot_be_created_is_named(models, family):
    """re-probe 5: a raw FileNotFoundError from os.makedirs before."""
    with pytest.raises(OSError, match=r"save_pretrained\('/proc/helm-no-such/x'\): cannot create the save directory "
                                      r"\(No such file or directory: /proc/helm-no-such"):
        models[family].save_pretrained("/proc/helm-no-such/x")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_on_the_meta_device_is_named_and_shape_inference_works(family):
    """Weights on the meta device (never loaded) with real inputs are refused, naming the weights; all on the meta
    device runs (shape inference, as with transformers' models)."""
    with torch.device("meta"):
        model = tiny_model(family)
    with pytest.raises(ValueError, match="the model's weights are on the meta device .*model.to_empty"):
        model(input_ids=ids())
    out = model(input_ids=ids().to("meta"))
    assert out.logits.shape == (B, T, V) and out.logits.device.type == "meta"


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
@pytest.mark.parametrize("saver_case, saver", SAVERS, ids=[c[0] for c in SAVERS])
@pytest.mark.parametrize("case,where,match", BAD_SAVE_DIRECTORIES, ids=[c[0] for c in BAD_SAVE_DIRECTORIES])
def test_saving_onto_a_file_is_named(models, tokenizer, tmp_path, family, saver_case, saver, case, where, match):
    """Every save_pretrained names a file in the way; transformers logged an error and saved nothing (a tokenizer),
    raised an ``AssertionError`` (configs) or "[Errno 20] Not a directory" (a path under a file)."""
    (tmp_path / "file.txt").write_text("keep me")
    with pytest.raises(NotADirectoryError, match=rf"^\w+\.{match}; give a folder \(it is created if missing\)$"):
        saver(models[family], tokenizer).save_pretrained(tmp_path / where)
    assert (tmp_path / "file.txt").read_text() == "keep me" and sorted(tmp_path.iterdir()) == [tmp_path / "file.txt"]


@pytest.mark.parametrize("family", FAMILIES)
def test_ignore_mismatched_sizes_is_honoured(saved, tmp_path, family):
    """As in transformers: the mismatched weight is left freshly initialised and reported, the rest is loaded."""
    path = tmp_path / family
    shutil.copytree(saved / family, path)
    _rewrite(lambda sd: sd.__setitem__(MATRIX, torch.zeros(3, 3)))(path)
    model, info = AutoModelForCausalLM.from_pretrained(path, ignore_mismatched_sizes=True, output_loading_info=True)
    assert [key for key, *_ in info["mismatched_keys"]] == [MATRIX]
    assert model.get_parameter(MATRIX).shape != (3, 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_intact_checkpoints_load_and_report(models, saved, family):
    x = ids()
    loaded, info = AutoModelForCausalLM.from_pretrained(saved / family, output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(loaded.eval()(x).logits, models[family](x).logits)
    # the bare model from a causal-LM checkpoint: the LM head is not used, as in transformers
    base = AutoModel.from_pretrained(saved / family).eval()
    assert torch.equal(base(x).last_hidden_state, models[family].model(x).last_hidden_state)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp16_on_cpu_is_applied(models, saved, family):
    """``dtype=torch.float16`` on CPU is applied: weights in fp16, the scalars that parametrise the geometry
    (temperatures, residual weights, curvatures) and every time coordinate in fp32; outputs finite, on the
    manifold, and within fp16 rounding of the fp32 model."""
    model = AutoModelForCausalLM.from_pretrained(saved / family, dtype=torch.float16).eval()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["lm_head.weight"] == torch.float16
    assert all(dtypes[n] == torch.float32 for n in dtypes if n.endswith(("log_tau", "raw_weight", "log_k")))
    x = ids()
    out = model(x, output_hidden_states=True)
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.logits).all()
    for h in out.hidden_states:
        assert manifold_error(h, model.config.k).max() <= MANIFOLD_TOL[torch.float32]
    assert_close(out.logits, models[family](x).logits, dtype=torch.float16, factor=2.0)
    assert model.generate(x, max_new_tokens=3, do_sample=False).shape == (B, T + 3)


# ---- re-probe 8: generate's mask, cache copies, dtype=, saving and loading across model types ----------------

PROMPT = torch.tensor([[5, 6, 7]])
# P136/P176/P216 (a longer mask was continued silently) and S001/S011/S021 (a shorter one was blamed on
# position_ids): generate's attention_mask must be [B, T] of its prompt. (case id, generate keywords from the model,
# the mask's shape as the message gives it)
BAD_GENERATE_MASKS = [
    ("longer than input_ids", lambda model: dict(input_ids=PROMPT, attention_mask=torch.ones(1, 5, dtype=torch.long)),
     "(1, 5)"),
    ("shorter than input_ids", lambda model: dict(input_ids=PROMPT, attention_mask=torch.ones(1, 2, dtype=torch.long)),
     "(1, 2)"),
    ("another batch size", lambda model: dict(input_ids=PROMPT, attention_mask=torch.ones(2, 3, dtype=torch.long)),
     "(2, 3)"),
    ("1-D, positional prompt", lambda model: dict(inputs=PROMPT, attention_mask=torch.ones(3, dtype=torch.long)),
     "(3,)"),
    ("longer than inputs_embeds", lambda model: dict(inputs_embeds=model.model.embed_tokens(PROMPT).detach(),
                                                     attention_mask=torch.ones(1, 4, dtype=torch.long)),
     "(1, 4)"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,make,given", BAD_GENERATE_MASKS, ids=[c[0] for c in BAD_GENERATE_MASKS])
def test_generate_refuses_a_mask_of_another_shape_than_the_prompt(models, family, case, make, given):
    with pytest.raises(ValueError, match=r"^attention_mask must be \[B, T\] = \[1, 3\] \(one entry per prompt token; "
                                         r"generate adds one per new token\), got " + re.escape(given) + "$"):
        models[family].generate(**make(models[family]), max_new_tokens=3, do_sample=False)


# Z005/Z010/Z015: generate from a right-padded prompt continued after the pad without a word (transformers logs its
# own warning for batched token ids with a pad token id only). HELM warns where transformers does not, so each such
# call warns once. (case id, prompt, mask, keep the model's pad/eos token ids, HELM warns, transformers logs)
RIGHT_PADDING = [
    ("one row ends in a pad", [[5, 6, 7, 0]], [[1, 1, 1, 0]], True, True, False),
    ("two rows, no pad or eos token id", [[5, 6, 7, 0], [5, 6, 7, 8]], [[1, 1, 1, 0], [1, 1, 1, 1]], False, True,
     False),
    ("two rows with a pad token id: transformers warns", [[5, 6, 7, 0], [5, 6, 7, 8]], [[1, 1, 1, 0], [1, 1, 1, 1]],
     True, False, True),
    ("left padding", [[0, 5, 6, 7]], [[0, 1, 1, 1]], True, False, False),
    ("no padding", [[5, 6, 7, 8]], [[1, 1, 1, 1]], True, False, False),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,prompt,mask,special,helm_warns,transformers_logs", RIGHT_PADDING,
                         ids=[c[0] for c in RIGHT_PADDING])
def test_right_padding_in_generate_warns_once(family, case, prompt, mask, special, helm_warns, transformers_logs):
    from transformers.generation import utils as generation_utils
    from transformers.testing_utils import CaptureLogger

    model = tiny_model(family)
    if not special:
        model.generation_config.pad_token_id = model.generation_config.eos_token_id = None
    with CaptureLogger(generation_utils.logger) as log, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(torch.tensor(prompt), attention_mask=torch.tensor(mask), max_new_tokens=2, do_sample=False)
    mine = [str(w.message) for w in caught if "right padding" in str(w.message)]
    assert mine == ["generate: right padding was detected (attention_mask ends in 0 in some row), and a decoder-only "
                    "model continues after the padding; pad prompts on the left (tokenizer.padding_side = \"left\")"] \
        * helm_warns
    assert ("right-padding was detected" in log.out) == transformers_logs, log.out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cache_filled_with_gradients_names_the_deepcopy_problem(models, family):
    """P133/P173/P213: copy.deepcopy of a cache that a forward filled with gradients enabled raised torch's "Only
    Tensors created explicitly by the user (graph leaves)"; the HELM cache says what to do, chained from torch's. One
    filled under torch.no_grad() copies, and the copy continues generation as the original does."""
    model, prompt = models[family], ids(1, 4)
    cache = model(prompt[:, :3], use_cache=True).past_key_values
    with pytest.raises(RuntimeError, match=r"^copy\.deepcopy\(cache\): the cache holds keys and values that are part "
                                           r"of an autograd graph \(it was filled with gradients enabled\), which "
                                           r"torch cannot deepcopy; fill it under torch\.no_grad\(\)") as err:
        copy.deepcopy(cache)
    assert isinstance(err.value.__cause__, RuntimeError) and "graph leaves" in str(err.value.__cause__)
    with torch.no_grad():
        cache = model(prompt[:, :3], use_cache=True).past_key_values
    copied = copy.deepcopy(cache)
    assert type(copied) is type(cache) and copied.layers[0].keys is not cache.layers[0].keys
    greedy = model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(model.generate(prompt, past_key_values=copied, max_new_tokens=3, do_sample=False), greedy)
    assert torch.equal(model.generate(prompt, past_key_values=cache, max_new_tokens=3, do_sample=False), greedy)


def _helm_class(family, suffix="ForCausalLM"):
    import helm.models

    return getattr(helm.models, {"helm_d": "HelmD", "helm_mice": "HelmMiCE"}[family] + suffix)


DTYPE_ACCEPTED = (r"is not a dtype a HELM model runs in; pass a torch dtype \(torch\.float32, torch\.bfloat16, "
                  r"torch\.float16, torch\.float64\), its name \('float32', 'bfloat16', 'float16', 'float64'\) or "
                  r"'auto'")
# P023/P046/P069: dtype='float33' was torch's "module 'torch' has no attribute 'float33'"; an integer dtype built an
# integer model. (case id, call (family, saved folder), message fragment before DTYPE_ACCEPTED)
BAD_DTYPES = [
    ("AutoModelForCausalLM.from_config dtype='float33'",
     lambda family, saved: AutoModelForCausalLM.from_config(tiny_config(family), dtype="float33"),
     r"^from_config of Helm\w+ForCausalLM: dtype='float33' "),
    ("AutoModel.from_config torch_dtype='float33'",
     lambda family, saved: AutoModel.from_config(tiny_config(family), torch_dtype="float33"),
     r"^from_config of Helm\w+Model: torch_dtype='float33' "),
    ("AutoModelForCausalLM.from_config dtype=torch.int8",
     lambda family, saved: AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.int8),
     r"^from_config of Helm\w+ForCausalLM: dtype=torch\.int8 "),
    ("concrete from_pretrained dtype='float33'",
     lambda family, saved: _helm_class(family).from_pretrained(saved / family, dtype="float33"),
     r"^Helm\w+ForCausalLM\.from_pretrained\('\S+'\): dtype='float33' "),
    ("concrete from_pretrained torch_dtype='int64'",
     lambda family, saved: _helm_class(family).from_pretrained(saved / family, torch_dtype="int64"),
     r"^Helm\w+ForCausalLM\.from_pretrained\('\S+'\): torch_dtype='int64' "),
    ("AutoModelForCausalLM.from_pretrained dtype=torch.int8",
     lambda family, saved: AutoModelForCausalLM.from_pretrained(saved / family, dtype=torch.int8),
     r"^Helm\w+ForCausalLM\.from_pretrained\('\S+'\): dtype=torch\.int8 "),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,call,match", BAD_DTYPES, ids=[c[0] for c in BAD_DTYPES])
def test_a_dtype_that_is_not_one_is_named(saved, family, case, call, match):
    with pytest.raises(ValueError, match=match + DTYPE_ACCEPTED):
        call(family, saved)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_config_takes_dtype_names_and_auto(family):
    """The accepted forms build the model in that dtype; "auto" in the config's (fp32 here), as from_pretrained."""
    assert AutoModelForCausalLM.from_config(tiny_config(family), dtype="auto").dtype == torch.float32
    assert AutoModelForCausalLM.from_config(tiny_config(family), dtype="bfloat16").dtype == torch.bfloat16
    assert AutoModel.from_config(tiny_config(family), torch_dtype=torch.float64).dtype == torch.float64


# (saver case of SAVERS, a file that save_pretrained writes); saving over a folder of that name gave "Is a directory
# (os error 21)" naming no file (safetensors, tokenizers), or the hub's "Repo id must be in the form ..." (PEFT's
# README.md) (re-probe 11 M026, M031, M032, M204)
SAVED_FILE_FOLDERS = [("model", "model.safetensors"), ("config", "config.json"),
                      ("generation config", "generation_config.json"), ("tokenizer", "tokenizer.json"),
                      ("PEFT model", "adapter_model.safetensors"), ("PEFT model", "README.md"),
                      ("PEFT config", "adapter_config.json")]


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
@pytest.mark.parametrize("saver_case, name", SAVED_FILE_FOLDERS, ids=[f"{c[0]} {c[1]}" for c in SAVED_FILE_FOLDERS])
def test_saving_over_a_folder_named_as_a_saved_file_is_refused(models, tokenizer, tmp_path, family, saver_case, name):
    saver = dict(SAVERS)[saver_case]
    (tmp_path / name / "kept.txt").parent.mkdir()
    (tmp_path / name / "kept.txt").write_text("keep me")
    with pytest.raises(IsADirectoryError, match=rf"^\w+\.save_pretrained\('\S+'\): in the save directory, "
                                                rf"{re.escape(name)} is a folder, not the file save_pretrained writes "
                                                r"there; move it away or save elsewhere \(nothing was written\)$"):
        saver(models[family], tokenizer).save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted([name, "kept.txt"])


# (field, value set after the model is built, whether save_pretrained warns); re-probe 12 S2185-S2188: curvature,
# positional or rms_norm_eps set on a built model's config changed nothing in the model, but the saved config.json
# had the new value and reloaded as another model, without a word (Llama the same)
CHANGED_FIELDS = [("curvature", -2.0, True), ("positional", "none", True), ("rms_norm_eps", 1e-3, True),
                  ("attn_impl", "eager", False), ("use_cache", False, False), ("validate_inputs", False, False)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("field, value, warns", CHANGED_FIELDS, ids=[c[0] for c in CHANGED_FIELDS])
def test_a_config_field_changed_after_the_model_is_built_warns_at_save(tmp_path, family, field, value, warns):
    model = tiny_model(family)
    before = getattr(model.config, field)
    setattr(model.config, field, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_pretrained(tmp_path / "saved")
    notes = [str(w.message) for w in caught if "changed after the model was built" in str(w.message)]
    if not warns:  # read at each call: the model follows the change
        assert notes == []
        return
    assert notes == [f"{type(model).__name__}.save_pretrained({str(tmp_path / 'saved')!r}): config field(s) changed "
                     f"after the model was built: {field} ({before!r} -> {value!r}). The layers read them when they "
                     "were built and do not follow the change, but config.json is saved with the new values, so the "
                     "saved model would reload as a different model; set them back before saving, or build a new "
                     "model from the changed config (from_config) and load these weights into it"]
    setattr(model.config, field, before)  # set back: saved without a note
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_pretrained(tmp_path / "again")
    assert not [w for w in caught if "changed after the model was built" in str(w.message)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("resize", [{"new_num_tokens": 520}, {"pad_to_multiple_of": 96}], ids=["new size", "padded"])
@torch.no_grad()
def test_resized_embeddings_save_without_a_changed_field_note(tmp_path, family, resize):
    """re-probe 13 S2190-S2192, T3102: after resize_token_embeddings, save_pretrained warned that vocab_size had
    changed after the model was built, although the layers follow it and the model reloads equal."""
    model = tiny_model(family).eval()
    model.resize_token_embeddings(**resize)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_pretrained(tmp_path / "saved")
    assert not [w for w in caught if "changed after the model was built" in str(w.message)]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert reloaded.config.vocab_size == model.config.vocab_size != V
    assert torch.equal(reloaded(ids()).logits, model(ids()).logits)


class _HubReached(Exception):
    pass


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
@pytest.mark.parametrize("saver_case, saver", SAVERS, ids=[c[0] for c in SAVERS])
@pytest.mark.parametrize("repo_id", ["~/x", "/abs/x", "./x", "a/b/c", "owner/name"])
def test_push_to_hub_of_a_local_path_is_refused(models, tokenizer, tmp_path, monkeypatch, family, saver_case, saver,
                                                 repo_id):
    """push_to_hub('~/x') (meant as a folder) reached the hub's id check: "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'". A local path is named, with the save_pretrained call to use; a hub id goes on to the
    hub (here a stand-in that stops there)."""
    class Hub:
        def __getattr__(self, name):
            raise _HubReached(name)

    monkeypatch.setattr("transformers.utils.hub.hf_api", lambda: Hub())
    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", lambda *args, **kwargs: Hub().create_repo)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    target = saver(models[family], tokenizer)
    if repo_id == "owner/name":
        with pytest.raises(_HubReached):
            target.push_to_hub(repo_id)
        return
    with pytest.raises(ValueError, match=rf"^\w+\.push_to_hub\({re.escape(repr(repo_id))}\): push_to_hub uploads to a "
                                         r"hub repository \('name' or 'owner/name'\), and this is a local path; to "
                                         r"write a folder use save_pretrained\('[^~]+'\)$"):
        target.push_to_hub(repo_id)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
@pytest.mark.parametrize("saver_case, saver", SAVERS, ids=[c[0] for c in SAVERS])
def test_an_empty_save_directory_is_named(models, tokenizer, tmp_path, monkeypatch, family, saver_case, saver):
    """P363: a raw "FileNotFoundError: [Errno 2] No such file or directory: ''" before (for every save_pretrained)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^\w+\.save_pretrained\(''\): save_directory is empty \(or not a path\); "
                                         r"give a folder \(it is created if missing\)$"):
        saver(models[family], tokenizer).save_pretrained("")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("family", FAMILIES)
def test_saving_weights_on_the_meta_device_is_refused_before_writing(saved, tmp_path, family):
    """U009/U018/U027: model.to("meta").save_pretrained raised torch's "Cannot copy out of meta tensor" after
    writing config.json and generation_config.json. It is refused before anything is written; a model whose
    layers accelerate offloaded to disk (meta tensors, values held by its hooks) still saves, and reloads equal."""
    folder = tmp_path / "meta"
    with pytest.raises(ValueError, match=r"^Helm\w+ForCausalLM\.save_pretrained\('\S+'\): the model's weights are on "
                                         r"the meta device \(shapes without values: \d+ tensors, e.g\. "
                                         r"'model\.embed_tokens\.weight'.*nothing was written"):
        tiny_model(family).to("meta").save_pretrained(folder)
    assert not folder.exists()
    device_map = {"model.embed_tokens": "cpu", "model.pos_encoding": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(saved / family, device_map=device_map,
                                                     offload_folder=tmp_path / "offload")
    assert any(p.device.type == "meta" for p in offloaded.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' note on saving offloaded modules
        offloaded.save_pretrained(tmp_path / "resaved")
    x = ids()
    assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "resaved").eval()(x).logits,
                       AutoModelForCausalLM.from_pretrained(saved / family).eval()(x).logits)


# S031: a folder of another model type given to a HELM class was refused field by field ("unknown config field
# 'attention_type' for HelmDConfig; did you mean 'attention_bias'?"). (case id, loader, folder (saved, tmp_path,
# models), message fragment after "Class.from_pretrained('folder'): ")
OTHER_MODEL_TYPES = [
    ("HelmDForCausalLM, helm_mice folder", "HelmDForCausalLM", lambda saved, tmp, models: saved / "helm_mice",
     r"the folder holds a helm_mice model \(config\.json has model_type='helm_mice'\), not a helm_d one; load it with "
     r"HelmMiCEForCausalLM or AutoModelForCausalLM$"),
    ("HelmMiCEForCausalLM, helm_d folder", "HelmMiCEForCausalLM", lambda saved, tmp, models: saved / "helm_d",
     r"the folder holds a helm_d model .*not a helm_mice one; load it with HelmDForCausalLM or AutoModelForCausalLM$"),
    ("HelmMiCEModel, helm_d folder", "HelmMiCEModel", lambda saved, tmp, models: saved / "helm_d",
     r"the folder holds a helm_d model .*; load it with HelmDModel or AutoModel$"),
    ("HelmDForCausalLM, llama folder", "HelmDForCausalLM",
     lambda saved, tmp, models: models["llama"].save_pretrained(tmp / "llama") or tmp / "llama",
     r"the folder holds a llama model \(config\.json has model_type='llama'\), not a helm_d one; load it with "
     r"LlamaForCausalLM or AutoModelForCausalLM$"),
]


@pytest.mark.parametrize("case,loader,where,match", OTHER_MODEL_TYPES, ids=[c[0] for c in OTHER_MODEL_TYPES])
def test_a_folder_of_another_model_type_is_named(models, saved, tmp_path, case, loader, where, match):
    import helm.models

    path = where(saved, tmp_path, models)
    with pytest.raises(ValueError, match=rf"^{loader}\.from_pretrained\({re.escape(repr(str(path)))}\): {match}"):
        getattr(helm.models, loader).from_pretrained(path)
