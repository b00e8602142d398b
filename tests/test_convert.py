"""Issue 12: official HELM checkpoints convert exactly (fixtures made with the official code: fixtures/official)."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import helm
from helm.convert import convert_official_checkpoint
from tests.helpers import assert_close, paper_parameter_count

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "official"
REPO = Path(__file__).resolve().parent.parent
KINDS = {"helm_d": "helm_d_tiny.pt", "helm_mice": "helm_mice_tiny.pt"}


def fixture(model):
    return torch.load(FIXTURES / KINDS[model], weights_only=True)


@pytest.fixture(scope="module", params=list(KINDS))
def converted(request, tmp_path_factory):
    model = request.param
    out = tmp_path_factory.mktemp(model)
    code = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_official.py"), "--checkpoint",
                           str(FIXTURES / KINDS[model]), "--output", str(out), "--set", "attn_impl=\"eager\""],
                          capture_output=True, text=True, timeout=300)
    assert code.returncode == 0, code.stderr[-2000:]
    return model, out


def test_converted_logits_equal_the_official_ones(converted):
    model, folder = converted
    data = fixture(model)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        logits = loaded(data["input_ids"]).logits
    assert_close(logits, data["logits"], claim=f"official_logits/{model}")  # FIDELITY.md's figures
    # every official switch is selected, nothing else changed from the paper presets
    c = loaded.config
    assert (c.head_merge, c.final_proj, c.lm_head_mode, c.positional) == ("flatten", True, "linear", "hope")
    expected_factor = (4 if model == "helm_d" else 1) * math.sqrt(c.hidden_size / (c.hidden_size - 1))
    assert c.residual_space_scale_factor == pytest.approx(expected_factor, rel=1e-12)
    greedy = loaded.generate(data["input_ids"][:, :8], max_new_tokens=5, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    assert greedy.shape == (2, 13)
    # the next token is the official model's argmax at the last prompt position
    assert torch.equal(greedy[:, 8], data["logits"][:, 7].argmax(-1))


def test_converted_folder_loads_with_stock_transformers_and_remote_code(converted, tmp_path):
    model, folder = converted
    data = fixture(model)
    assert "auto_map" in json.loads((folder / "config.json").read_text())
    code = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert not any(k == "helm" or k.startswith("helm.") for k in sys.modules), "helm was imported"
        ids = torch.load({str(FIXTURES / KINDS[model])!r}, weights_only=True)["input_ids"]
        with torch.no_grad():
            torch.save(m(ids).logits, {str(tmp_path / "logits.pt")!r})
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close(torch.load(tmp_path / "logits.pt"), data["logits"], claim=f"official_logits/{model}")


# What the official HELM-D holds and the converter drops (FIDELITY.md): one attention score bias per layer (it
# cancels in the softmax), the embedding's positional LResNet that is built but never called (weight and scale)
# and the three model-level curvatures.
OFFICIAL_ONLY = re.compile(r"resblocks\.\d+\.attn\.bias|token_embed\.add_pos\.(w_y|scale)|manifold_(in|hidden|out)\.k")


def test_official_helm_d_115m_parameter_count():
    """The official count, 114,770,253 (its train.py sums decoder.parameters()), is the paper's layer shapes with
    the official switches (preset helm-d-115m-official) plus the parameters only the official model holds, read
    off the official fixture (same layout, its own number of layers)."""
    config = helm.load_config("helm-d-115m-official")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ours = sum(p.numel() for p in model.parameters())
    assert ours == paper_parameter_count(config)[0]
    official = fixture("helm_d")["state_dict"]
    extra = {key: value.numel() for key, value in official.items() if OFFICIAL_ONLY.fullmatch(key)}
    layers = len({key.split(".")[1] for key in official if key.startswith("resblocks.")})
    per_layer = sum(n for key, n in extra.items() if key.startswith("resblocks.")) / layers
    fixed = sum(n for key, n in extra.items() if not key.startswith("resblocks."))
    assert (per_layer, fixed) == (1, 2 + 3)
    assert ours + config.num_hidden_layers * per_layer + fixed == 114_770_253


def _state(model):
    return {k: v.clone() for k, v in fixture(model)["state_dict"].items()}


BAD = [
    ("unknown key", "helm_d", lambda sd: sd.__setitem__("resblocks.0.attn.extra", torch.zeros(2)),
     r"no counterpart in the zoo: \['resblocks.0.attn.extra'\]"),
    ("negative residual weight", "helm_d", lambda sd: sd.__setitem__("resblocks.1.res2.w_y", torch.tensor(-0.5)),
     r"resblocks.1.res2.w_y = -0.5: the official residual weight must be positive"),
    ("zero temperature", "helm_d", lambda sd: sd.__setitem__("resblocks.0.attn.scale", torch.zeros(1)),
     r"resblocks.0.attn.scale = \[0.0\] must be positive"),
    ("missing weight", "helm_d", lambda sd: sd.pop("resblocks.1.mlp.w2.linear.weight"),
     r"lacks 1 weights the converted model needs: \['model.layers.1.mlp.down_proj.weight'\]"),
    ("two curvatures", "helm_d", lambda sd: sd.__setitem__("manifold_out.k", torch.tensor(2.0)),
     r"manifold_out.k = 2 differs from manifold_hidden.k = 1"),
]


@pytest.mark.parametrize("case,model,damage,match", BAD, ids=[b[0] for b in BAD])
def test_unconvertible_checkpoints_are_refused_naming_the_key(case, model, damage, match):
    state = _state(model)
    damage(state)
    with pytest.raises((ValueError, KeyError), match=match):
        convert_official_checkpoint(state)


def test_model_argument_is_checked():
    with pytest.raises(ValueError, match="model='helm_mice', but the checkpoint's keys are those of the official 'helm_d'"):
        convert_official_checkpoint(_state("helm_d"), model="helm_mice")
    with pytest.raises(ValueError, match=r"model must be one of \('helm_d', 'helm_mice'\), got 'llama'"):
        convert_official_checkpoint(_state("helm_d"), model="llama")


def test_cli_refuses_a_bad_checkpoint_with_exit_2(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "convert_official.py"), "--checkpoint",
                           str(tmp_path / "bad.pt"), "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: cannot read the official checkpoint")
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_fidelity_table_names_real_config_fields():
    """Every config field FIDELITY.md names as a switch exists on the configs."""
    import re

    from helm.models.helm_d import HelmDConfig
    from helm.models.helm_mice import HelmMiCEConfig

    rows = [line for line in (REPO / "FIDELITY.md").read_text().splitlines() if line.startswith("| ")][2:]
    names = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row.rstrip(" |").rsplit(" | ", 1)[-1])}
    assert {"head_merge", "final_proj", "expert_combine", "scoring_func", "norm_topk_prob"} <= names
    configs = [HelmDConfig(), HelmMiCEConfig(), helm.load_config("deepseek-v3-120m")]
    missing = [name for name in names if not any(hasattr(c, name) for c in configs)]
    assert not missing, missing
