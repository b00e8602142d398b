"""Issue 23 item 10: ``peft.LoraConfig()`` without ``target_modules`` adapts a HELM model as it adapts Llama (PEFT's
default table, keyed by model type: query and value projections; HMLA's values come from ``kv_b_proj``), whether
PEFT or helm is imported first, and from a remote-code folder where helm is not installed."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from helm.manifold import manifold_error
from tests.helpers import run_without_helm, tiny_config, tiny_model

EXPECTED = {"helm_d": {"q_proj", "v_proj"}, "helm_mice": {"q_proj", "kv_b_proj"}, "llama": {"q_proj", "v_proj"}}


def adapted(model):
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
            if isinstance(module, peft.tuners.lora.LoraLayer)}


@pytest.mark.parametrize("family", ["helm_d", "helm_mice", "llama"])
def test_lora_without_target_modules_trains_like_llama(family):
    model = peft.get_peft_model(tiny_model(family), peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    assert adapted(model) == EXPECTED[family]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    model.train()
    for _ in range(4):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert (out.logits - before).abs().max() > 1e-3
    if family != "llama":
        assert max(float(manifold_error(h, model.config.k).max()) for h in out.hidden_states) <= 1e-5


def test_mha_attention_in_helm_mice_gets_its_value_projection():
    """The MiCE-HMHA ablation (``attention_type="mha"``) has ``v_proj`` instead of ``kv_b_proj``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("helm_mice", attention_type="mha"))
    assert adapted(peft.get_peft_model(model, peft.LoraConfig(r=4))) == {"q_proj", "v_proj"}


@pytest.mark.parametrize("order", ["helm, then peft", "peft, then helm"])
def test_either_import_order(order, tmp_path):
    imports = "import helm\nimport peft" if order.startswith("helm") else "import peft\nimport helm"
    code = textwrap.dedent("""
        import json, sys
        sys.path.insert(0, {repo!r})
        {imports}
        from tests.helpers import tiny_model
        model = peft.get_peft_model(tiny_model("helm_d"), peft.LoraConfig(r=4))
        print(json.dumps(sorted({{n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                  if isinstance(m, peft.tuners.lora.LoraLayer)}})))
    """).format(repo=str(Path(__file__).resolve().parents[2]), imports=imports)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["q_proj", "v_proj"]


def test_remote_code_folder_without_helm(tmp_path):
    tiny_model("helm_mice").save_pretrained(tmp_path)
    proc = run_without_helm(f"""
        import peft
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4))
        print("REPORT", sorted({{n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                if isinstance(m, peft.tuners.lora.LoraLayer)}}))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("REPORT ")[-1].strip() == str(["kv_b_proj", "q_proj"])
