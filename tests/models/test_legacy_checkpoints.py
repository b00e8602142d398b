"""Checkpoints saved before the projections became plain linears (``q_proj.linear.weight``) still load, give the
same logits, and are re-saved under the current names (``q_proj.weight``)."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.helpers import tiny_config


def legacy_name(key: str) -> str:
    return re.sub(r"\.(\w+_proj)\.(weight|bias)$",
                  lambda m: m.group(0) if m.group(1) == "final_proj" else f".{m.group(1)}.linear.{m.group(2)}", key)


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_a_legacy_checkpoint_loads_and_is_resaved_in_the_current_layout(family, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, final_proj=True)).eval()
    model.save_pretrained(tmp_path / "new")
    state = load_file(tmp_path / "new" / "model.safetensors")
    legacy = {legacy_name(key): value for key, value in state.items()}
    assert sum(".linear." in key for key in legacy) > sum(".linear." in key for key in state) > 0  # final_proj
    model.config.save_pretrained(tmp_path / "old")
    save_file(legacy, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})

    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "old", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)

    loaded.save_pretrained(tmp_path / "resaved")
    assert set(load_file(tmp_path / "resaved" / "model.safetensors")) == set(state)
