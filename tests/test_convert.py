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
                           str(FIXTURES / KINDS[model]), "--output", str(out), "--set", "attn_implementation=\"eager\""],
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
    with pytest.raises(ValueError, match="model='helm_mice'.*'helm_d'"):
        convert_official_checkpoint(_state("helm_d"), model="helm_mice")
    with pytest.raises(ValueError, match=r"model.*'llama'"):
        convert_official_checkpoint(_state("helm_d"), model="llama")
    # re-probe 6: "the checkpoint's keys are those of the official None" before
    for state, keys in (({}, "no weights at all"), ({"w": torch.zeros(1)}, "w")):
        with pytest.raises(ValueError, match=rf"official.*{keys}"):
            convert_official_checkpoint(state, model="helm_d")


def test_a_folder_is_refused_as_a_folder_naming_the_file_inside(tmp_path):
    """Re-probe 8 N112: an existing folder was reported as 'does not exist'."""
    with pytest.raises(IsADirectoryError, match=r"folder"):
        convert_official_checkpoint(tmp_path, model="helm_d")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(IsADirectoryError, match="may already be a model folder: load it with from_pretrained"):
        convert_official_checkpoint(tmp_path, model="helm_d")
    torch.save(fixture("helm_d"), tmp_path / "helm.pt")
    with pytest.raises(IsADirectoryError, match=re.escape(f"pass {str(tmp_path / 'helm.pt')!r}")):
        convert_official_checkpoint(tmp_path, model="helm_d")


@pytest.mark.parametrize("saved, message", [
    ([1, 2, 3], r"^the official checkpoint '.*l\.pt' holds a list, not a state dict \(a dict of parameter names to "
                r"tensors, bare or under 'state_dict' / 'model'\)$"),
    (torch.zeros(2), r"holds a Tensor, not a state dict"),
    ({"w": torch.zeros(1), "step": 3},
     r"^the official checkpoint '.*l\.pt' is not a state dict of tensors: its entry 'step' is an int \(a dict of "
     r"parameter names to tensors"),
    ({"state_dict": {"w": [1.0]}}, r"its entry 'w' is a list"),
], ids=["list", "tensor", "int-entry", "nested-list-entry"])
def test_a_file_that_is_no_state_dict_says_what_it_holds(saved, message, tmp_path):
    """Re-probe 9 K236: torch.save of a list was "AttributeError: 'list' object has no attribute 'get'"."""
    torch.save(saved, tmp_path / "l.pt")
    with pytest.raises(ValueError, match=message):
        convert_official_checkpoint(tmp_path / "l.pt", model="helm_d")


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


# Issue 23 item 11: every official configuration that leaves weights converts; what the zoo (or the official forward)
# cannot compute is refused naming the official flag.
LORENTZ_MICE = FIXTURES / "helm_mice_tiny_lorentz.pt"


def test_official_default_lorentz_token_table_converts_to_the_official_logits(tmp_path):
    """The official HELM-MiCE default ``project_emb=False``: a table of Lorentz points (``embed.embedding``)."""
    import geoopt

    data = torch.load(LORENTZ_MICE, weights_only=True)
    assert data["args"]["project_emb"] is False and "embed.embedding" in data["state_dict"]
    convert_official_checkpoint(LORENTZ_MICE, attn_implementation="eager").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.embedding_mode == "lorentz"
    assert isinstance(loaded.model.embed_tokens.weight, geoopt.ManifoldParameter)
    with torch.no_grad():
        logits = loaded(data["input_ids"]).logits
    assert_close(logits, data["logits"], rtol=1e-5)


def _layers(state, keep):
    """The official MiCE state with only the layers ``keep`` (renumbered from 0)."""
    out = {}
    for key, value in state.items():
        m = re.match(r"layers\.(\d+)\.(.*)", key)
        if m is None:
            out[key] = value
        elif int(m.group(1)) in keep:
            out[f"layers.{keep.index(int(m.group(1)))}.{m.group(2)}"] = value
    return out


@pytest.mark.parametrize("table", ["helm_mice_tiny.pt", "helm_mice_tiny_lorentz.pt"])
@pytest.mark.parametrize("layout,keep,dense", [("dense and MoE", [0, 1, 2], 1), ("dense only", [0], 1),
                                               ("MoE only", [1, 2], 0)])
def test_layer_layouts_and_token_tables_convert(table, layout, keep, dense):
    """Official ``n_dense_layers`` from 0 to ``n_layers``, with either token table: the weights land where the
    converted model reads them (every tensor copied or mapped as documented), and it computes finite points."""
    data = torch.load(FIXTURES / table, weights_only=True)
    state = _layers(data["state_dict"], keep)
    model = convert_official_checkpoint(state, attn_implementation="eager")
    c = model.config
    assert (c.num_hidden_layers, c.first_k_dense_replace) == (len(keep), dense)
    assert c.embedding_mode == ("lorentz" if "embed.embedding" in state else "space")
    table_key = "embed.embedding" if "embed.embedding" in state else "embed.weight"
    assert torch.equal(model.model.embed_tokens.weight.detach(), state[table_key].float())
    last = f"layers.{len(keep) - 1}."
    ours = model.model.layers[-1]
    assert torch.equal(ours.self_attn.o_proj.weight.detach(), state[last + "attn.wo.linear.weight"].float())
    if dense < len(keep):
        assert torch.equal(ours.mlp.experts[3].mlp.down_proj.weight.detach(),
                           state[last + "ffn.experts.3.w2.linear.weight"].float())
    with torch.no_grad():
        out = model(data["input_ids"], output_hidden_states=True)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("train_curv", [True, False])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_official_flags_outside_the_weights_come_from_the_stored_args(score_func, train_curv):
    """``score_func`` (sigmoid weights are renormalised by the official gate, softmax ones are not) and
    ``train_curv`` (fixed or trained expert curvatures) are read from the ``args`` stored with the weights."""
    data = torch.load(LORENTZ_MICE, weights_only=True)
    args = {**data["args"], "score_func": score_func, "train_curv": train_curv}
    model = convert_official_checkpoint({"state_dict": data["state_dict"], "args": args})
    c = model.config
    assert (c.scoring_func, c.norm_topk_prob, c.trainable_curvatures) == (score_func, score_func == "sigmoid",
                                                                          train_curv)
    curvatures = [p for n, p in model.named_parameters() if n.endswith("log_k")]
    assert curvatures and all(p.requires_grad == train_curv for p in curvatures)
    if score_func == "softmax" and train_curv:  # the fixture's own flags: its logits
        with torch.no_grad():
            assert_close(model(data["input_ids"]).logits, data["logits"], rtol=1e-5)
    # the rest of the model is the softmax fixture's: the gate must be the official Gate.forward for either score_func
    # (scores of the space part, bias only in the selection, renormalised for sigmoid only)
    state = data["state_dict"]
    x = torch.randn(3, 5, 66, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    logits = x[..., 1:] @ state["layers.1.ffn.gate.weight"].double().T
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    chosen = (scores + state["layers.1.ffn.gate.bias"].double()).topk(2, dim=-1).indices
    official = scores.gather(-1, chosen)
    if score_func == "sigmoid":
        official = official / official.sum(-1, keepdim=True)
    weights, _, _ = model.model.layers[1].mlp.double().route(x)
    assert_close(weights.gather(-1, chosen), official, rtol=1e-12)
    assert_close(weights.sum(-1), official.sum(-1), rtol=1e-12)  # nothing outside the official top-k


def _drop(prefix):
    return lambda sd, args: [sd.pop(k) for k in [k for k in sd if k.startswith(prefix)]]


def _set_arg(name, value):
    return lambda sd, args: args.__setitem__(name, value)


UNREPRESENTABLE = [
    ("route_scale", _set_arg("route_scale", 2.5), r"official route_scale=2\.5 cannot be converted"),
    ("n_expert_groups", _set_arg("n_expert_groups", 2), r"official n_expert_groups=2 cannot be converted"),
    ("n_activated_experts arg", _set_arg("n_activated_experts", 3), r"official n_activated_experts=3"),
    ("n_shared_experts arg", _set_arg("n_shared_experts", 2), r"official n_shared_experts=2"),
    ("project_emb", _set_arg("project_emb", True), r"official project_emb=True disagrees"),
    ("n_activated_experts weights", _drop("layers.2.ffn.add_experts."), r"n_activated_experts != 2"),
    ("n_shared_experts weights", _drop("layers.1.ffn.weighted_sum."), r"n_shared_experts != 1"),
    ("q_lora_rank", lambda sd, args: sd.__setitem__("layers.0.attn.wq_a.linear.weight", torch.zeros(8, 66)),
     r"official q_lora_rank > 0"),
    ("YaRN", lambda sd, args: [sd.pop(f"layers.{i}.attn.softmax_scale") for i in range(3)],
     r"official max_seq_len > original_seq_len"),
]


@pytest.mark.parametrize("case,damage,match", UNREPRESENTABLE, ids=[u[0] for u in UNREPRESENTABLE])
def test_unrepresentable_official_flags_are_refused_naming_the_flag(case, damage, match):
    data = torch.load(LORENTZ_MICE, weights_only=True)
    state, args = dict(data["state_dict"]), dict(data["args"])
    damage(state, args)
    with pytest.raises(ValueError, match=match):
        convert_official_checkpoint({"state_dict": state, "args": args})
    if case.endswith("weights") or case in ("q_lora_rank", "YaRN"):  # read off the keys: no args needed
        with pytest.raises(ValueError, match=match):
            convert_official_checkpoint(state)
