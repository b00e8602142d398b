"""Issue 14, item 1 with ``attn_implementation="triton"``: the kernel aligns queries bottom-right, which a static
cache's slots do not satisfy, so those calls run through sdpa (``helm.ops.attention.resolve_attention``); generation
with a static cache still gives the tokens of the dynamic cache, whose decoding steps use the kernel."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import assert_close, tiny_config


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_static_cache_generation_with_the_triton_impl(lk, monkeypatch, family):
    calls = []
    kernel = lk.lorentz_flash_attention
    monkeypatch.setattr("helm.ops.lorentz_attention_triton.lorentz_flash_attention",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    torch.manual_seed(0)
    # HMLA's absorbed decoding attends in the latent space without the kernel: the plain path here
    plain = {"hmla_absorb": False} if family == "helm_mice" else {}
    model = AutoModelForCausalLM.from_config(tiny_config(family, **plain), attn_implementation="triton").eval()
    ids = torch.randint(3, 512, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    dynamic = model.generate(ids, **kw)
    assert calls, "the dynamic cache's steps run the kernel"
    static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(static.sequences, dynamic.sequences)
    assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), rtol=1e-5)
