"""Issue 23 item 5: ``transformers``' ExecuTorch export (static cache), as a Llama user runs it.

``TorchExportableModuleForDecoderOnlyLM`` allocates a ``StaticCache`` with every layer shaped ``[B, h, T, D]`` from
the config (``early_initialization``) and ``torch.export``s one decoding step. HMLA caches two latents of other
widths; it packs them into those slots. The exported program, fed a prompt token by token, gives the logits of the
eager model's full forward."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

from helm.nn.hmla import HMLA
from tests.helpers import assert_close, tiny_config

FAMILIES = ["helm_d", "helm_mice", "llama"]
MAX_LEN = 16


def exported_program(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=MAX_LEN,
                                               cache_config={"batch_size": 1, "max_cache_len": MAX_LEN})
    module = TorchExportableModuleForDecoderOnlyLM(model)
    program = module.export(input_ids=torch.tensor([[3]]), cache_position=torch.tensor([0]))
    return model, module, program


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_decoding_gives_the_eager_logits(family):
    model, module, program = exported_program(family)
    ids = torch.randint(2, 512, (1, 7), generator=torch.Generator().manual_seed(1))
    step = program.module()
    got = torch.cat([step(input_ids=ids[:, t:t + 1], cache_position=torch.tensor([t])) for t in range(ids.shape[1])],
                    dim=1)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    assert got.shape == want.shape
    assert_close(got, want, dtype=torch.float32)


def test_hmla_packs_its_latents_into_the_config_shaped_cache():
    model, module, _ = exported_program("helm_mice")
    config = model.config
    layer = module.model.static_cache.layers[0]
    # the cache is shaped from the config's heads, not HMLA's one latent row: without packing nothing fits it
    assert layer.keys.shape[1] == config.num_attention_heads and layer.keys.shape[-1] != config.kv_lora_rank
    hmla = [m for m in model.modules() if isinstance(m, HMLA)]
    assert hmla
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        for t in range(ids.shape[1]):
            module.model(input_ids=ids[:, t:t + 1], cache_position=torch.tensor([t]))
    written = layer.keys.transpose(1, 2).reshape(1, MAX_LEN, -1)
    latent = written[0, :3, :config.kv_lora_rank]
    assert torch.all(latent[:, 0] > 0)  # time coordinates of the three cached latents
    assert torch.all(written[0, 3:] == 0) and torch.all(written[0, :3, config.kv_lora_rank:] == 0)
