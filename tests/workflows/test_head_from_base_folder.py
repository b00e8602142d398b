"""Issue 23 item 3: a folder saved from the base model (``AutoModel``) loads into ``AutoModelForCausalLM`` (and the
task heads) as a Llama one does: the decoder's weights load, the head is newly initialised and a warning says so.
Loading stays strict where ``transformers`` is lenient only by accident: a decoder weight that is missing or does not
fit, or a head weight missing from a checkpoint saved by the same class, is an error naming it."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
from transformers.utils import logging as transformers_logging

from tests.helpers import assert_close, run_without_helm, tiny_config

FAMILIES = ["helm_d", "helm_mice", "llama"]


def saved_base(family, folder):
    torch.manual_seed(0)
    base = AutoModel.from_config(tiny_config(family)).eval()
    base.save_pretrained(folder)
    return base


@pytest.mark.parametrize("head", [AutoModelForCausalLM, AutoModelForSequenceClassification])
@pytest.mark.parametrize("family", FAMILIES)
def test_base_folder_into_a_head_class_warns_that_the_head_is_new(family, head, tmp_path, caplog):
    base = saved_base(family, tmp_path)
    transformers_logging.enable_propagation()  # Llama's warning is transformers' load report, on its own handler
    try:
        with caplog.at_level(logging.WARNING):
            model = head.from_pretrained(tmp_path).eval()
    finally:
        transformers_logging.disable_propagation()
    head_name = "lm_head" if head is AutoModelForCausalLM else "score"
    warned = caplog.text
    assert f"{head_name}.weight" in warned and ("newly initialised" in warned or "newly initialized" in warned)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.model(ids).last_hidden_state, base(ids).last_hidden_state, rtol=0, atol=0)
        assert torch.isfinite(model(ids).logits).all()
    if family != "llama":  # the new head is initialised as from_config initialises it, not left empty
        weight = getattr(model, head_name).weight
        assert 0 < float(weight.detach().std()) < 2 * model.config.initializer_range


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_strict_loading_stays_for_weights_that_do_not_fit(family, tmp_path):
    saved_base(family, tmp_path)
    (tmp_path / "manifest.json").unlink()  # the weights are edited by hand below: the manifest would refuse them
    weights = load_file(tmp_path / "model.safetensors")
    key = next(k for k in weights if k.endswith("o_proj.weight"))
    save_file({**weights, key: torch.zeros(3, 3)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"wrong shape.*o_proj\.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    save_file({k: v for k, v in weights.items() if k != key}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"missing from the checkpoint.*o_proj\.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_a_causal_checkpoint_without_its_lm_head_is_still_refused(family, tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(family)).save_pretrained(tmp_path)
    (tmp_path / "manifest.json").unlink()  # edited by hand below
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"missing from the checkpoint.*lm_head\.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_base_folder_into_the_causal_lm_as_remote_code_without_helm(tmp_path):
    """The base model's folder names every head in its ``auto_map``, so the same load works where helm is not
    installed."""
    base = saved_base("helm_mice", tmp_path)
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = base(ids).last_hidden_state
    proc = run_without_helm(f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            print("REPORT", type(model).__name__, model.model(torch.tensor({ids.tolist()})).last_hidden_state.tolist())
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, hidden = proc.stdout.split("REPORT ")[-1].split(" ", 1)
    assert name == "HelmMiCEForCausalLM" and "lm_head.weight" in proc.stderr + proc.stdout
    # fp32 agreement, not bit-equality: the child process runs the same kernels on other memory addresses (the
    # bit-exact reload in one process is tests/workflows/test_reload_bit_exact.py)
    assert_close(torch.tensor(json.loads(hidden)), expected)
