"""A model built on the CPU with ``attn_implementation="triton"`` is a valid model: it builds, saves and reloads
there; its forward on CPU tensors without the Triton interpreter raises one clear error naming the implementation,
the device and the alternatives. (With the interpreter it runs:
tests/ops/lorentz_attention_triton/test_triton_model_on_cpu.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import tiny_model


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_triton_model_builds_saves_reloads_and_refuses_cpu_forward_clearly(family, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = tiny_model(family, model_kwargs={"attn_implementation": "triton"})
    assert model.config._attn_implementation == "triton"
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="triton")
    state, again = model.state_dict(), reloaded.state_dict()
    assert state.keys() == again.keys() and all(torch.equal(state[n], again[n]) for n in state)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError) as caught:
        reloaded(input_ids=ids, use_cache=False)
    message = str(caught.value)
    assert "\n" not in message
    for part in ("'triton'", "device 'cpu'", "TRITON_INTERPRET=1", "'sdpa'", "'auto'"):
        assert part in message, message
    reloaded.set_attn_implementation("auto")  # auto falls back to sdpa on the CPU
    assert torch.isfinite(reloaded(input_ids=ids, use_cache=False).logits).all()
