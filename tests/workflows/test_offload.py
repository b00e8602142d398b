"""Issue 14, item 7: disk offload (accelerate) gives the in-memory logits, for HELM and for Llama / DeepSeek-V3.

accelerate loads an offloaded module's weights in a hook around that module's own forward, so a layer that reads
a submodule's weight directly (the MiCE router once read ``gate.weight``) computes with an unloaded tensor."""

import pytest
import torch
from accelerate import disk_offload
from transformers import AutoModelForCausalLM

from tests.helpers import tiny_config

FAMILIES = ["helm_d", "helm_mice", "llama", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_disk_offload_gives_the_in_memory_logits(family, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    ids = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, cached = model(ids, use_cache=False).logits, model(ids).logits
    disk_offload(model, str(tmp_path), execution_device=torch.device("cpu"))
    assert any(p.device.type == "meta" for p in model.parameters())  # the weights really live on disk
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, expected)
        # with a cache, HMLA decodes absorbed in memory (it reads kv_b_proj.weight) and plainly when offloaded
        torch.testing.assert_close(model(ids).logits, cached, rtol=0, atol=1e-5)
