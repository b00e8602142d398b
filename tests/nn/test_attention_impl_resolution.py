"""The attention implementation is chosen once (issue 22 item 3C): when the layer's ``attn_impl`` is set (at build,
or by ``set_attn_implementation``) and on the first call on each device, not on every call."""

from __future__ import annotations

import pytest
import torch

import helm.nn.attention as layers
from helm.ops.attention import resolve_attention_impl
from tests.helpers import tiny_model


def test_resolution_of_each_name():
    cpu = torch.device("cpu")
    assert [resolve_attention_impl(n, cpu) for n in ("eager", "sdpa", "triton", "auto")] == \
        ["eager", "sdpa", "triton", "sdpa"]
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve_attention_impl("flash", cpu)


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_impl_is_resolved_once_per_device_and_again_after_a_change(family, monkeypatch):
    calls = []
    resolve = layers.resolve_attention_impl
    monkeypatch.setattr(layers, "resolve_attention_impl", lambda impl, device: calls.append(impl) or resolve(impl, device))
    model = tiny_model(family, attn_impl="auto")
    attention = [m for m in model.modules() if isinstance(m, layers.LorentzAttentionBase)]
    assert len(attention) == model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (1, 6))
    for _ in range(3):
        model(input_ids=ids, use_cache=False)
    assert calls == ["auto"] * len(attention)
    assert all(m.attention_impl_for(torch.device("cpu")) == "sdpa" for m in attention)
    model.set_attn_implementation("eager")
    assert all(m.attn_impl == "eager" and not m._resolved_impl for m in attention)
    model(input_ids=ids, use_cache=False)
    model(input_ids=ids, use_cache=False)
    assert calls == ["auto"] * len(attention) + ["eager"] * len(attention)
    with pytest.raises(ValueError, match="attn_impl"):
        attention[0].attn_impl = "flash"
