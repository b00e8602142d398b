"""Re-probe 7 (D118, D242): a PEFT adapter saved for one HELM family loaded onto the other without a word, wherever
the module names and shapes matched (PEFT's behaviour for any pair of models; Llama's is the same).

Before PEFT injects anything, ``PeftModel.from_pretrained``, ``PeftModel.load_adapter`` and the model's own
``load_adapter`` (``transformers``' integration) check the adapter (``helm.models.peft_support.adapter_problem``):
its base model's ``model_type`` (from ``adapter_config.json``'s ``base_model_name_or_path``) and the modules its
weights adapt. The table states, for each case, where the adapter was trained, where it is loaded, and the message
fragment (None: it loads, and gives the logits it was saved with)."""

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
    the adapter's ``base_model_name_or_path``)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    if folder is None:
        return model
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


# (case, adapter trained on (family, overrides, saved base), loaded onto (family, overrides), how, message or None)
ADAPTERS = [
    ("helm_d adapter onto helm_mice (mha)", ("helm_d", {}, True), ("helm_mice", MHA), "PeftModel",
     r"the adapter was trained on '.*base', a helm_d model, and this model is a helm_mice model: PEFT would apply its "
     r"weights to this model's modules of the same names and shapes; load it onto a helm_d model"),
    ("helm_mice (mha) adapter onto helm_d", ("helm_mice", MHA, True), ("helm_d", {}), "PeftModel",
     r"the adapter was trained on '.*base', a helm_mice model, and this model is a helm_d model"),
    ("helm_d adapter onto helm_mice, load_adapter", ("helm_d", {}, True), ("helm_mice", MHA), "load_adapter",
     r"^HelmMiCEForCausalLM\.load_adapter\('.*adapter'\): the adapter was trained on '.*base', a helm_d model"),
    ("helm_d adapter, base unknown, onto hmla", ("helm_d", {}, False), ("helm_mice", {}), "PeftModel",
     r"the adapter holds weights for 2 module\(s\) this HelmMiCEForCausalLM does not have "
     r"\(model\.layers\.0\.self_attn\.v_proj, model\.layers\.1\.self_attn\.v_proj\): PEFT would load the others and "
     r"drop these without a word"),
    ("4-layer adapter onto 2 layers", ("helm_d", dict(num_hidden_layers=4), False), ("helm_d", {}), "PeftModel",
     r"the adapter holds weights for 4 module\(s\) this HelmDForCausalLM does not have \(model\.layers\.2\.self_attn"
     r"\.q_proj, model\.layers\.2\.self_attn\.v_proj, model\.layers\.3\.self_attn\.q_proj and 1 more\)"),
    ("own base, saved", ("helm_d", {}, True), ("helm_d", {}), "PeftModel", None),
    ("own base, built from config", ("helm_mice", {}, False), ("helm_mice", {}), "PeftModel", None),
    ("own base, load_adapter", ("helm_mice", {}, True), ("helm_mice", {}), "load_adapter", None),
]


@pytest.mark.parametrize("case, source, target, how, match", ADAPTERS, ids=[c[0] for c in ADAPTERS])
@torch.no_grad()
def test_an_adapter_of_another_model_is_refused(case, source, target, how, match, tmp_path):
    family, overrides, saved = source
    trained = peft.get_peft_model(_base(family, tmp_path / "base" if saved else None, **overrides),
                                  peft.LoraConfig(r=4, init_lora_weights=False))
    trained.save_pretrained(tmp_path / "adapter")
    expected = trained(IDS).logits
    if saved:
        assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
            == str(tmp_path / "base")
    onto = _base(target[0], **target[1])
    modules = sorted(name for name, _ in onto.named_modules())

    def load():
        if how == "PeftModel":
            return peft.PeftModel.from_pretrained(onto, tmp_path / "adapter")
        onto.load_adapter(str(tmp_path / "adapter"))
        return onto

    if match is None:
        torch.testing.assert_close(load()(IDS).logits, expected, rtol=0, atol=1e-5)
        return
    with pytest.raises(ValueError, match=match):
        load()
    assert sorted(name for name, _ in onto.named_modules()) == modules, "PEFT injected layers before the refusal"


def test_a_llama_adapter_is_left_to_peft(tmp_path):
    """The check applies to HELM base models only: onto Llama, PEFT's behaviour is unchanged."""
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    peft.get_peft_model(llama, peft.LoraConfig(r=4)).save_pretrained(tmp_path / "adapter")
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    assert isinstance(peft.PeftModel.from_pretrained(other, tmp_path / "adapter"), peft.PeftModel)
