"""``config.attn_impl`` assigned after the model is built reaches every attention layer (issue 22), as
``transformers``' layers follow ``config._attn_implementation``: the next forward runs the new implementation."""

from __future__ import annotations

import pytest
import torch

import helm.ops.attention as ops
from helm.nn.attention import LorentzAttentionBase
from tests.helpers import assert_close, tiny_model

FAMILIES = ["helm_d", "helm_mice"]


@pytest.fixture
def impls_called(monkeypatch):
    """The names of the :func:`helm.ops.lorentz_attention` implementations each forward ran."""
    called = []
    for name, fn in list(ops.ATTENTION_IMPLS.items()):
        def spy(*args, _fn=fn, _name=name, **kwargs):
            called.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setitem(ops.ATTENTION_IMPLS, name, spy)
    return called


def _layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, LorentzAttentionBase)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["attn_impl", "_attn_implementation"])
def test_assigning_the_config_after_build_switches_the_layers(family, how, impls_called):
    model = tiny_model(family, attn_impl="sdpa")
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    before = model(input_ids=ids, use_cache=False).logits
    assert set(impls_called) == {"sdpa"}
    impls_called.clear()
    setattr(model.config, how, "eager")
    assert all(m.attn_impl == "eager" for m in _layers(model))
    after = model(input_ids=ids, use_cache=False).logits
    assert impls_called == ["eager"] * model.config.num_hidden_layers
    assert_close(after, before, dtype=torch.float32)  # the same attention, its reference implementation


@pytest.mark.parametrize("family", FAMILIES)
def test_the_base_model_inside_a_head_follows_the_same_config(family, impls_called):
    model = tiny_model(family, attn_impl="eager")
    assert model.model.config is model.config
    model.model.config.attn_impl = "sdpa"
    model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
    assert set(impls_called) == {"sdpa"}


def test_a_replaced_config_is_bound_again_by_set_attn_implementation(impls_called):
    model = tiny_model("helm_d", attn_impl="sdpa")
    model.config = model.config.__class__.from_dict(model.config.to_dict())
    model.set_attn_implementation("eager")
    model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
    assert set(impls_called) == {"eager"}
    model.config.attn_impl = "sdpa"
    impls_called.clear()
    model(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
    assert set(impls_called) == {"sdpa"}


def test_an_unknown_name_is_refused_where_it_is_assigned():
    model = tiny_model("helm_d")
    with pytest.raises(ValueError, match="attn_impl"):
        model.config.attn_impl = "flash"
    assert all(m.attn_impl == "auto" for m in _layers(model))
