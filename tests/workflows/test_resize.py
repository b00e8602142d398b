"""Issue 14, item 3: resize_token_embeddings for both embedding modes and both head modes, as for Llama."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from helm.manifold import manifold_error
from tests.helpers import MANIFOLD_TOL, tiny_config

V = 512
VARIANTS = [("llama", {}), ("helm_d", dict(embedding_mode="space", lm_head_mode="linear")),
            ("helm_d", dict(embedding_mode="lorentz", lm_head_mode="distance")),
            ("helm_mice", dict(embedding_mode="lorentz", lm_head_mode="linear")),
            ("helm_mice", dict(embedding_mode="space", lm_head_mode="distance"))]
IDS = [f"{f}-{o.get('embedding_mode', 'nn')}-{o.get('lm_head_mode', 'linear')}" for f, o in VARIANTS]


def tables(model):
    return [model.get_input_embeddings().weight, model.get_output_embeddings().weight]


@pytest.mark.parametrize("mean_resizing", [True, False], ids=["mean", "fresh"])
@pytest.mark.parametrize("family,options", VARIANTS, ids=IDS)
def test_growing_the_vocabulary_keeps_old_tokens_and_adds_valid_rows(family, options, mean_resizing, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **options)).eval()
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    kinds = [type(t) for t in tables(model)]
    returned = model.resize_token_embeddings(V + 5, pad_to_multiple_of=8, mean_resizing=mean_resizing)
    assert returned is model.get_input_embeddings() and model.config.vocab_size == V + 8
    assert [type(t) for t in tables(model)] == kinds  # a ManifoldParameter stays one
    assert all(t.shape[0] == V + 8 for t in tables(model))
    with torch.no_grad():
        after = model(ids).logits
        new_ids = torch.tensor([[V + 1, V + 7, 3]])
        assert torch.isfinite(model(new_ids).logits).all()  # the new ids are accepted
    torch.testing.assert_close(after[..., :V], before, rtol=1e-5, atol=1e-5)  # old tokens: same logits
    for table, on_manifold in zip(tables(model), (options.get("embedding_mode") == "lorentz",
                                                  options.get("lm_head_mode") == "distance")):
        if on_manifold:
            assert manifold_error(table[V:].detach(), model.config.k).max() <= MANIFOLD_TOL[torch.float32]
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():  # to rounding: loaded weights sit at other addresses, where BLAS may round differently
        torch.testing.assert_close(reloaded(ids).logits, after, rtol=1e-6, atol=1e-6)
    assert model.generate(ids[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (2, 7)


@pytest.mark.parametrize("family,options", VARIANTS, ids=IDS)
def test_shrinking_the_vocabulary_keeps_the_first_rows(family, options):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **options)).eval()
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    model.resize_token_embeddings(100)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before[..., :100], rtol=1e-5, atol=1e-5)
    assert model.config.vocab_size == 100
