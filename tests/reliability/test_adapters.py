"""Re-probe 7 (D118, D242): a PEFT adapter saved for one HELM family loaded onto the other without a word, wherever
the module names and shapes matched, and weights of modules the model lacks were dropped (PEFT's behaviour for any
pair of models; Llama's is the same).

``load_adapter`` of a HELM model refuses both before anything is loaded (``helm.models.peft_support.adapter_problem``:
the model type recorded in ``adapter_config.json``, the module names in the safetensors header). ``PeftModel``'s own
loaders, and damaged adapter folders, are PEFT's (tests/test_lane.py: nothing of PEFT is replaced)."""

import json

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import tiny_config

IDS = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0))
MHA = dict(attention_type="mha", q_lora_rank=None)


def _base(family, folder=None, **overrides):
    """A tiny model of ``family``; saved to and reloaded from ``folder`` when given (so PEFT records the folder as
    the adapter's ``base_model_name_or_path``; otherwise it records the class in ``auto_mapping``)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    if folder is None:
        return model
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


# (case, adapter trained on (family, overrides, base saved), loaded onto (family, overrides), the culprit the
# message names, or None: it loads and gives the logits it was saved with)
ADAPTERS = [
    ("helm_d adapter onto helm_mice (mha), base saved", ("helm_d", {}, True), ("helm_mice", MHA), "helm_d model"),
    ("helm_d adapter onto helm_mice (mha), class recorded", ("helm_d", {}, False), ("helm_mice", MHA), "helm_d model"),
    ("helm_mice (mha) adapter onto helm_d", ("helm_mice", MHA, False), ("helm_d", {}), "helm_mice model"),
    ("4-layer adapter onto 2 layers", ("helm_d", dict(num_hidden_layers=4), False), ("helm_d", {}),
     r"model\.layers\.2\.self_attn\.q_proj"),
    ("own base, saved", ("helm_d", {}, True), ("helm_d", {}), None),
    ("own base, built from config", ("helm_mice", {}, False), ("helm_mice", {}), None),
]


@pytest.mark.parametrize("case, source, target, culprit", ADAPTERS, ids=[c[0] for c in ADAPTERS])
@torch.no_grad()
def test_an_adapter_of_another_model_is_refused(case, source, target, culprit, tmp_path):
    family, overrides, saved = source
    trained = peft.get_peft_model(_base(family, tmp_path / "base" if saved else None, **overrides),
                                  peft.LoraConfig(r=4, init_lora_weights=False))
    trained.save_pretrained(tmp_path / "adapter")
    expected = trained(IDS).logits
    recorded = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == (str(tmp_path / "base") if saved else None)
    onto = _base(target[0], **target[1])
    if culprit is None:
        onto.load_adapter(str(tmp_path / "adapter"))
        torch.testing.assert_close(onto(IDS).logits, expected, rtol=0, atol=1e-5)
        return
    modules = sorted(name for name, _ in onto.named_modules())
    with pytest.raises(ValueError, match=culprit):
        onto.load_adapter(str(tmp_path / "adapter"))
    assert sorted(name for name, _ in onto.named_modules()) == modules, "PEFT injected layers before the refusal"
