"""train.py and helm.training: recipes, bad input, LR schedule, training end to end, checkpoints, metrics,
SIGKILL + resume, DDP.

Everything runs on a micro model (ambient 33, one or two layers) and a synthetic corpus with the suite's 320-token
tokenizer, written to a temporary folder once per module. In-process runs call ``train.main``; the kill and
data-parallel tests start real processes.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from helm.training import (CheckpointError, ConfigError, RunConfig, all_keys, cli_overrides, key_docs,
                           list_checkpoints, load_run_config, verify_checkpoint)
from helm.training.checkpoint import MANIFEST
from tests.helpers import TINY_SHAPES, synthetic_text

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "configs" / "train").glob("*.yaml"))
MICRO_D = dict(TINY_SHAPES["helm_d"], num_hidden_layers=1, vocab_size=320, max_position_embeddings=64)
MICRO_MICE = dict(TINY_SHAPES["helm_mice"], vocab_size=320, max_position_embeddings=64, first_k_dense_replace=1)
MICRO = {"tiny-helm-mice": MICRO_MICE, "tiny-deepseek-v3": dict(TINY_SHAPES["deepseek_v3"], vocab_size=320,
                                                                max_position_embeddings=64, first_k_dense_replace=1)}


def read_metrics(output_dir: Path) -> list[dict]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def load_train_script():
    spec = importlib.util.spec_from_file_location("helm_train_script", REPO / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_script = load_train_script()


@pytest.fixture(scope="module")
def run_data(tmp_path_factory, tokenizer) -> Path:
    """``train.jsonl`` (300 documents of five sentences), ``validation.jsonl`` (30) and the suite's tokenizer."""
    root = tmp_path_factory.mktemp("train-corpus")
    for split, n, seed in (("train", 300, 0), ("validation", 30, 1)):
        lines = synthetic_text(seed, 5 * n)
        docs = [" ".join(lines[i:i + 5]) for i in range(0, len(lines), 5)]
        (root / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer.save_pretrained(root / "tokenizer")
    return root


def write_recipe(folder: Path, run_data: Path, name: str = "recipe.yaml", *, base: str = "tiny-helm-d",
                 **sections) -> Path:
    """The shipped tiny recipe pointed at the synthetic run_data and a micro model, with ``sections`` merged in."""
    recipe = yaml.safe_load((REPO / "configs" / "train" / f"{base}.yaml").read_text())
    for section, values in (
            ("model", {"overrides": dict(MICRO.get(base, MICRO_D))}),
            ("data", {"dataset": str(run_data), "tokenizer": str(run_data / "tokenizer"), "build_default": False,
                      "seq_len": 32}),
            ("train", {"output_dir": str(folder / "run"), "max_steps": 12, "batch_size": 4, "log_every": 1,
                       "eval_every": 0, "eval_rows": 8, "save_every": 4}),
            ("optim", {"lr": 1e-2}), ("demo", {"max_new_tokens": 8}), *sections.items()):
        recipe.setdefault(section, {}).update(values)
    path = folder / name
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """In-process runs each build an Accelerator; its shared state must not leak between them."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_main(args, capsys) -> tuple[int, str]:
    code = train_script.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def subprocess_env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


# ------------------------------------------------------------------------------------------------- recipes


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_shipped_recipes_load_and_set_only_what_differs_from_the_defaults(recipe):
    """A recipe holds the keys that differ from the defaults (the documentation lives once, in the dataclasses),
    under a header saying what it is and how to run it."""
    config = load_run_config(recipe)
    assert config.train.output_dir.startswith("runs/")
    assert recipe.read_text().startswith("# ") and f"--config configs/train/{recipe.name}" in recipe.read_text()
    defaults = OmegaConf.to_container(OmegaConf.structured(RunConfig))
    body = yaml.safe_load(recipe.read_text())
    for section, keys in body.items():
        for key, value in keys.items():
            assert value != defaults[section][key], f"{recipe.name} sets {section}.{key} to its default {value!r}"


def test_every_recipe_key_is_documented_and_help_prints_them(capsys):
    docs = key_docs()
    assert list(docs) == all_keys()
    assert all(len(doc) > 10 for doc in docs.values()), docs
    with pytest.raises(SystemExit) as exit_:
        train_script.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for dotted, doc in docs.items():
        section, key = dotted.split(".")
        assert f"\n  {key}: " in text and doc.split()[0] in text, dotted
    assert "max_steps: '???'" in text and "betas: [0.9, 0.95]" in text


def test_print_config_shows_the_resolved_recipe_and_loads_back(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = REPO / "configs" / "train" / "tiny-helm-mice.yaml"
    code, output = run_main(["--config", recipe, "--optim.lr=1e-3", "--print-config"], capsys)
    assert code == 0, output
    assert not (tmp_path / "runs").exists(), "--print-config started a run"
    assert "# Peak learning rate of the Euclidean parameters" in output and "  lr: 0.001\n" in output
    printed = tmp_path / "printed.yaml"
    printed.write_text(output)
    assert load_run_config(printed) == load_run_config(recipe, ["optim.lr=1e-3"])


def test_paper_recipes_follow_the_paper():
    for name, lr in (("helm-d-115m", 2e-4), ("helm-mice-120m", 4e-4), ("helm-mice-1b", 4e-4), ("llama-115m", 2e-4),
                     ("deepseek-v3-120m", 4e-4)):
        c = load_run_config(REPO / "configs" / "train" / f"{name}.yaml")
        assert c.optim.lr == lr and c.optim.weight_decay == 0.01 and c.optim.grad_clip == 1.0, name
        assert (c.optim.warmup_ratio, c.optim.final_lr_ratio, c.data.seq_len) == (0.03, 0.1, 2048), name
        assert c.train.mixed_precision in ("bf16", "auto"), name


def test_overrides_are_typed(tmp_path, run_data):
    recipe = write_recipe(tmp_path, run_data)
    overrides = cli_overrides(["--optim.lr=1e-3", "--train.max_steps=7", "--demo.prompt=null",
                               "--model.overrides.num_hidden_layers=2", "--data.dataset_config=20231101.en"])
    assert overrides[:2] == ["optim.lr=1e-3", "train.max_steps=7"]
    c = load_run_config(recipe, overrides)
    assert (c.optim.lr, c.train.max_steps, c.demo.prompt) == (1e-3, 7, None)
    assert c.model.overrides["num_hidden_layers"] == 2 and c.data.dataset_config == "20231101.en"
    assert c.model.overrides["hidden_size"] == MICRO_D["hidden_size"], "a sub-key override replaced the mapping"
    for bad, culprit in ((["--train.max_steps=many"], "train.max_steps"), (["--optim.betas=0.9"], "optim.betas"),
                         (["--optim.warmup_ratio=1.5"], "optim.warmup_ratio"),
                         (["--train.mixed_precision=fp8"], "train.mixed_precision"),
                         (["--train.max_step=3"], "'train.max_step'.*'train.max_steps'"),
                         (["--trian.max_steps=3"], "'trian'"),
                         (["--model.preset=null"], "model.preset.*model.pretrained"),
                         (["--train.output_dir=''"], "train.output_dir")):
        with pytest.raises(ConfigError, match=culprit):
            load_run_config(recipe, cli_overrides(bad))
    for bad in (["max_steps=3"], ["--train.max_steps", "7"], ["--train=3"]):
        with pytest.raises(ConfigError, match=re.escape(repr(bad[0]))):
            cli_overrides(bad)


@pytest.mark.parametrize("override, message", [("--train.max_stepz=3", "unknown key 'train.max_stepz'"),
                                               ("--train.batch_size=two", "train.batch_size: ")])
def test_bad_command_line_exits_2_with_one_line_naming_the_key(override, message, tmp_path, run_data, capsys):
    code, output = run_main(["--config", write_recipe(tmp_path, run_data), override], capsys)
    assert code == 2
    assert len(output.strip().splitlines()) == 1 and output.startswith(f"error: {message}"), output
    assert not (tmp_path / "run").exists()


def test_lr_schedule_is_linear_warmup_then_cosine_to_the_final_ratio(tmp_path, run_data, capsys):
    """The learning rates train.py logs: 0, peak/W, ..., peak over W = round(0.25 * 12) = 3 warmup steps, then
    peak * (r + (1 - r) * (1 + cos(pi * t)) / 2), t = (s - W) / (12 - W), falling to r = 0.1 of the peak."""
    import math

    recipe = write_recipe(tmp_path, run_data, optim={"warmup_ratio": 0.25, "final_lr_ratio": 0.1},
                          train={"save_every": 0, "eval_at_start": False}, demo={"prompt": None})
    code, output = run_main(["--config", recipe], capsys)
    assert code == 0, output
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r]
    peak, total, warmup = 1e-2, 12, 3
    expected = [peak * s / warmup if s < warmup else
                peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))))
                for s in range(total)]
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert max(lrs) == pytest.approx(peak) and lrs[1] < lrs[2] < lrs[3] and lrs[-1] < 0.2 * peak


# ------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", ["unknown-key", "dataset", "tokenizer", "vocab", "seq_len", "resume-missing"])
def test_bad_input_stops_before_training_and_names_the_problem(case, tmp_path, run_data, capsys):
    args, expected = [], None
    if case == "unknown-key":
        recipe = write_recipe(tmp_path, run_data, train={"learning_rate": 0.1})
        expected = "unknown key 'train.learning_rate'"
    elif case == "dataset":
        recipe = write_recipe(tmp_path, run_data, data={"dataset": str(tmp_path / "nowhere")})
        expected = "data.dataset.*nowhere"
    elif case == "tokenizer":
        recipe = write_recipe(tmp_path, run_data, data={"tokenizer": str(tmp_path / "no-tokenizer")})
        expected = "data.tokenizer .*no-tokenizer.*no such folder"
    elif case == "vocab":
        recipe = write_recipe(tmp_path, run_data)
        args = ["--model.overrides.vocab_size=200"]
        expected = "data.tokenizer.*320.*vocab_size=200"
    elif case == "seq_len":
        recipe = write_recipe(tmp_path, run_data, data={"seq_len": 128})
        expected = "data.seq_len=128.*max_position_embeddings=64"
    else:
        recipe = write_recipe(tmp_path, run_data)
        args = ["--resume", str(tmp_path / "run" / "checkpoints" / "step-00000004")]
        expected = "--resume .*step-00000004.*no such"
    code, output = run_main(["--config", recipe, *args], capsys)
    assert code == 2
    assert re_search(expected, output), output
    assert not list_checkpoints(tmp_path / "run" / "checkpoints")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def re_search(pattern: str, text: str) -> bool:
    return re.search(pattern, text, flags=re.S) is not None


# ------------------------------------------------------------------------------------------------- training


def test_train_end_to_end_then_resume_finished_run(tmp_path, run_data, capsys):
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 40, "save_every": 10, "keep_last": 2,
                                                   "eval_every": 20, "log_every": 5})
    code, output = run_main(["--config", recipe], capsys)
    assert code == 0, output
    run = tmp_path / "run"
    records = read_metrics(run)
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [0, 20, 40]
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 1.0, val
    assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert "validation perplexity" in output and "sample for the prompt" in output
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [30, 40]
    for _, path in list_checkpoints(run / "checkpoints"):
        verify_checkpoint(path)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    assert type(model).__name__ == "HelmDForCausalLM"
    # resuming a finished run trains nothing and reproduces the final model
    code, output = run_main(["--config", recipe, "--resume"], capsys)
    assert code == 0, output
    assert "resumed from" in output and "trained 0 steps" in output
    again = AutoModelForCausalLM.from_pretrained(run / "final").state_dict()
    assert all(torch.equal(value, again[key]) for key, value in model.state_dict().items())
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [5, 10, 15, 20, 25, 30, 35, 40]
    # a saved model is a starting point too: its initial validation loss is where the first run ended
    code, output = run_main(["--config", recipe, "--model.preset=null", f"--model.pretrained={run / 'final'}",
                             "--train.max_steps=1", f"--train.output_dir={tmp_path / 'again'}"], capsys)
    assert code == 0, output
    again = [r for r in read_metrics(tmp_path / "again") if "val_loss" in r]
    assert again[0]["step"] == 0 and again[0]["val_loss"] == pytest.approx(val[-1]["val_loss"], abs=1e-5)


def test_progress_bar_on_a_terminal_replaces_the_log_lines(tmp_path, run_data, capsys, monkeypatch):
    """train.progress_bar (default true): where stdout and stderr are a terminal, a tqdm bar over the optimiser
    steps (on stderr) replaces the log_every lines; train.progress_bar=false brings the lines back. (Output to a
    file, as in every other test here, gets the lines.)"""
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 3, "save_every": 0}, demo={"prompt": None})
    for stream in (sys.stdout, sys.stderr):
        monkeypatch.setattr(stream, "isatty", lambda: True)
    assert train_script.main(["--config", str(recipe)]) == 0
    captured = capsys.readouterr()
    assert re.search(r"train: 100%.*\b3/3 ", captured.err) and "[train] step 3/3 loss" not in captured.out, captured
    assert train_script.main(["--config", str(recipe), "--train.overwrite=true", "--train.progress_bar=false"]) == 0
    captured = capsys.readouterr()
    assert "3/3 [" not in captured.err and "[train] step 3/3 loss" in captured.out, captured


def test_build_model_probes_on_the_training_device(tmp_path, run_data, monkeypatch):
    """build_model runs its two-token probe forward on the device it is given (the accelerator's, where a kernel
    that runs only there is tried), and returns the model there, in training mode: here the meta device, which
    no CPU-only probe would reach."""
    from transformers import AutoModelForCausalLM

    cfg = load_run_config(write_recipe(tmp_path, run_data))
    seen, build = [], AutoModelForCausalLM.from_config

    def spied(*args, **kwargs):
        model = build(*args, **kwargs)
        model.register_forward_pre_hook(lambda module, a, k: seen.append(k["input_ids"].device), with_kwargs=True)
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", spied)
    model = train_script.build_model(cfg, train_script.model_config(cfg), torch.device("meta"), {})
    assert seen == [torch.device("meta")] and model.device.type == "meta" and model.training


def test_fresh_run_refuses_to_mix_into_an_old_one(tmp_path, run_data, capsys):
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 0, "overwrite": False},
                          demo={"prompt": None})
    assert run_main(["--config", recipe], capsys)[0] == 0
    code, output = run_main(["--config", recipe], capsys)
    assert code == 2 and "already holds a run" in output and "--resume" in output


@pytest.mark.parametrize("base", ["tiny-helm-mice", "tiny-deepseek-v3"])
def test_mice_and_its_baseline_train_with_routing_bias_and_balance_loss(base, tmp_path, run_data, capsys):
    """Paper App. C.2: HELM-MiCE and the DeepSeek-V3 baseline train with the same balancing (issue 12)."""
    recipe = write_recipe(tmp_path, run_data, base=base, train={"max_steps": 6, "save_every": 0},
                          demo={"prompt": None})
    code, output = run_main(["--config", recipe], capsys)
    assert code == 0, output
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all(r["aux_loss"] > 0 for r in records)
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "run" / "final" / "model.safetensors")
    biases = [v for k, v in weights.items() if k.endswith("e_score_correction_bias")]
    assert biases and any(b.abs().sum() > 0 for b in biases), "update_routing_bias was never applied"


@pytest.mark.parametrize("base", ["tiny-helm-d", "tiny-helm-mice"])
def test_compiled_checkpointed_training_matches_plain_training(base, tmp_path, run_data, capsys):
    """Issue 13, items 4-5: train.compile (one graph: fullgraph) and train.gradient_checkpointing train as the plain
    loop does: the same losses, the same MiCE balancing (expert loads leave the compiled graph), an uncompiled saved
    model. With the aot_eager backend, which traces exactly what inductor compiles (dynamo + AOT autograd, no graph
    break allowed) without inductor's code generation, which takes minutes on the CI's CPU."""
    # MiCE dense in both: compiled, it always dispatches densely (the sparse path is eager-only: tests/nn)
    model = {"overrides": dict(MICRO_MICE, moe_dispatch="dense")} if base == "tiny-helm-mice" else {}
    runs = {}
    for name, extra in (("plain", {}), ("compiled", {"compile": True, "compile_backend": "aot_eager",
                                                     "gradient_checkpointing": True})):
        recipe = write_recipe(tmp_path, run_data, f"{name}.yaml", base=base, demo={"prompt": None}, model=model,
                              train={"max_steps": 4, "save_every": 0, "output_dir": str(tmp_path / name), **extra})
        code, output = run_main(["--config", recipe], capsys)
        assert code == 0, output
        runs[name] = [r for r in read_metrics(tmp_path / name) if "loss" in r]
    assert [r["step"] for r in runs["compiled"]] == [1, 2, 3, 4]
    for plain, compiled in zip(runs["plain"], runs["compiled"]):
        assert compiled["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-6)
        assert compiled["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4, abs=1e-6)
        assert compiled.get("aux_loss") == pytest.approx(plain.get("aux_loss"), rel=1e-5)
    from safetensors.torch import load_file

    plain, compiled = (load_file(tmp_path / name / "final" / "model.safetensors") for name in ("plain", "compiled"))
    assert plain.keys() == compiled.keys()  # no torch.compile "_orig_mod." prefix
    for key in plain:
        torch.testing.assert_close(compiled[key], plain[key], rtol=1e-4, atol=1e-6, msg=key)


def test_tensorboard_and_jsonl_metrics_resume_without_duplicate_steps(tmp_path, run_data, capsys):
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 4, "save_every": 2, "keep_last": 2, "logger": "both"},
                          demo={"prompt": None})
    assert run_main(["--config", recipe], capsys)[0] == 0
    run = tmp_path / "run"
    first = [r for r in read_metrics(run) if "loss" in r]
    events = list((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and sum(e.stat().st_size for e in events) > 0
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # as if killed before it was written
    code, output = run_main(["--config", recipe, "--resume", run / "checkpoints" / "step-00000002"], capsys)
    assert code == 0, output
    again = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    assert again[:2] == first[:2] and [r["loss"] for r in again[2:]] == pytest.approx([r["loss"] for r in first[2:]])


def _micro_model(preset: str):
    """The micro model of a tiny preset, built as train.py builds it (seeded)."""
    import helm
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(helm.load_config(preset, **MICRO.get(preset, MICRO_D))).train()


def _packed_micro_batches(count: int, seed: int) -> list[dict]:
    from helm.data import pack_documents

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, 320, (int(torch.randint(3, 30, (), generator=g)),), generator=g).tolist()
            for _ in range(40)]
    rows = pack_documents(docs, 32, eos_id=0)
    assert int(rows["segment_ids"].max()) >= 1, "no row holds several documents"
    return [{key: value[2 * i:2 * i + 2] for key, value in rows.items()} for i in range(count)]


@pytest.mark.parametrize("preset", ["tiny-helm-d", "tiny-helm-mice", "tiny-deepseek-v3"])
def test_train_step_is_forward_backward_clip_step_and_routing_bias_update(preset):
    """helm.training.train_step (what train.py and benchmarks/train_step.py run) against the same step written out:
    two micro-batches of packed rows (document ids as segment_ids for HELM, restarting positions for
    transformers' DeepSeek-V3), each loss halved, clipping, AdamW/RiemannianAdam, the scheduler, and for routed
    models the bias update from the load of both micro-batches."""
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    from helm.models.routing import attach_balancing
    from helm.optim import build_optimizer
    from helm.training import train_step

    def optimisation(model):
        optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.01)
        return optimizer, get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=4)

    model, reference = _micro_model(preset), _micro_model(preset)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, scheduler = accelerator.prepare(model, *optimisation(model))
    ref_optimizer, ref_scheduler = optimisation(reference)
    routed = attach_balancing(reference)
    helm_model = preset != "tiny-deepseek-v3"
    assert bool(routed) == (preset != "tiny-helm-d")
    biases = [name for name, _ in reference.named_buffers() if name.endswith("e_score_correction_bias")]
    assert bool(biases) == bool(routed)

    for step in range(3):
        micro_batches = _packed_micro_batches(2, seed=step)
        metrics = train_step(accelerator, model, optimizer, scheduler, micro_batches, grad_clip=0.5)

        lr = ref_optimizer.param_groups[0]["lr"]
        losses, aux_losses, load = [], [], 0
        for batch in micro_batches:
            segments = {"segment_ids": batch["segment_ids"]} if helm_model else {}
            output = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                               labels=batch["labels"], use_cache=False, **segments)
            (output.loss / 2).backward()
            aux = output.aux_loss.detach() if routed else torch.zeros(())
            losses.append(output.loss.detach() - aux)
            aux_losses.append(aux)
            if routed:
                load = load + torch.stack([layer.last_expert_load for layer in routed])
        grad_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_optimizer.step()
        ref_scheduler.step()
        ref_optimizer.zero_grad(set_to_none=True)
        for layer, layer_load in zip(routed, load if routed else []):
            layer.last_expert_load.copy_(layer_load)
            layer.update_bias()

        assert metrics.lr == lr and float(metrics.grad_norm) == pytest.approx(float(grad_norm), rel=1e-6)
        assert float(metrics.loss) == pytest.approx(float(sum(losses) / 2), rel=1e-6)
        assert float(metrics.aux_loss) == pytest.approx(float(sum(aux_losses) / 2), rel=1e-6)
        assert (float(metrics.aux_loss) > 0) == bool(routed)
        assert all(p.grad is None for p in model.parameters())
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6, msg=name)
    for name in biases:
        assert dict(model.named_buffers())[name].abs().sum() > 0, f"{name} never moved"


def test_packed_rows_reach_helm_models_by_their_forward_names():
    """A packed batch's keys are the HELM forward's own: model(**rows) keeps attention within documents."""
    from helm.data import packed_inputs

    model = _micro_model("tiny-helm-d").eval()
    [batch] = _packed_micro_batches(1, seed=0)
    with torch.no_grad():
        direct = model(**batch).logits
        explicit = model(**packed_inputs(model, batch)).logits
        plain = model(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(direct, explicit)
    assert not torch.allclose(direct, plain), "the segment ids changed nothing"


@pytest.mark.parametrize("workers", [0, 2])
def test_training_batches_hand_each_process_its_rows_in_order_from_any_step(workers):
    """The DataLoader of train.py: step s, micro-batch m of process r reads the batch_size rows from
    s·G + (m·world + r)·batch_size of the endless stream (G rows per step), each epoch a fresh seeded
    permutation; with workers too, and from a resumed step on."""
    from helm.training import PackedRows, training_batches

    n, B, accum, world = 10, 2, 2, 2
    rows = {"input_ids": torch.arange(n * 4).view(n, 4), "labels": torch.arange(n * 4).view(n, 4)}
    packed = PackedRows(rows, seed=3)
    stream = [packed[i]["input_ids"] for i in range(4 * n)]
    assert torch.equal(torch.stack(stream[:n]).sort(0).values, rows["input_ids"])  # an epoch is a permutation
    assert not torch.equal(torch.stack(stream[:n]), torch.stack(stream[n:2 * n]))  # reshuffled each epoch
    G = B * accum * world
    for rank in range(world):
        for start_step in (0, 2):
            loader = training_batches(packed, start_step=start_step, max_steps=4, batch_size=B, grad_accum=accum,
                                      rank=rank, world_size=world, num_workers=workers)
            batches = [batch["input_ids"] for batch in loader]
            assert len(batches) == (4 - start_step) * accum
            for i, batch in enumerate(batches):
                step, micro = start_step + i // accum, i % accum
                first = step * G + (micro * world + rank) * B
                assert torch.equal(batch, torch.stack(stream[first:first + B])), (rank, start_step, i)


def test_streamed_rows_restart_and_resume_at_the_step(run_data, tokenizer):
    """A stream is read in order, endlessly (epoch after epoch), and a resumed DataLoader starts at the step's
    row: step 3 of 2 rows x 2 micro-batches is row 12 (in a worker process here)."""
    from helm.training import StreamRows, load_splits, training_batches
    from helm.training.config import DataConfig

    data = DataConfig(dataset=str(run_data / "validation.jsonl"), streaming=True, validation_split=None,
                      holdout_documents=1, seq_len=32)
    train_set, _, streaming = load_splits(data)
    assert streaming
    rows = [row["input_ids"] for row in itertools.islice(StreamRows(train_set, tokenizer, data), 400)]
    per_epoch = next(i for i in range(1, len(rows)) if torch.equal(rows[i], rows[0]))
    assert per_epoch < 200 and torch.equal(torch.stack(rows[:per_epoch]), torch.stack(rows[per_epoch:2 * per_epoch]))
    resumed = training_batches(StreamRows(train_set, tokenizer, data), start_step=3, max_steps=5, batch_size=2,
                               grad_accum=2, num_workers=1)
    assert torch.equal(next(iter(resumed))["input_ids"], torch.stack(rows[12:14]))


# ------------------------------------------------------------------------------------------------- checkpoints


def _finished_run(tmp_path, run_data, capsys, **train) -> Path:
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 8, "save_every": 4, "keep_last": 3, **train},
                          demo={"prompt": None})
    code, output = run_main(["--config", recipe], capsys)
    assert code == 0, output
    return recipe


def test_corrupted_or_truncated_checkpoints_are_refused(tmp_path, run_data, capsys):
    recipe = _finished_run(tmp_path, run_data, capsys)
    root = tmp_path / "run" / "checkpoints"
    ckpt = root / "step-00000008"
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, output = run_main(["--config", recipe, "--resume"], capsys)
    assert code == 2 and "step-00000008" in output and "model.safetensors" in output

    earlier = root / "step-00000004"
    optimizer = earlier / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="optimizer.bin"):
        verify_checkpoint(earlier)
    (earlier / MANIFEST).unlink()
    code, output = run_main(["--config", recipe, "--resume", earlier], capsys)
    assert code == 2 and "step-00000004" in output and MANIFEST in output


def test_resume_refuses_a_changed_recipe(tmp_path, run_data, capsys):
    recipe = _finished_run(tmp_path, run_data, capsys)
    code, output = run_main(["--config", recipe, "--resume", tmp_path / "run" / "checkpoints" / "step-00000004",
                             "--optim.lr=0.5"], capsys)
    assert code == 2 and "optim.lr: 0.01 in the checkpoint, 0.5 now" in output


def test_checkpoint_round_trip_keeps_manifold_parameters(tmp_path):
    """save_checkpoint / accelerator.load_state on a Lorentz token table: the reloaded table is still a geoopt
    ManifoldParameter (so RiemannianAdam keeps updating it) and equal to the saved one, optimiser state included."""
    import geoopt
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from helm.optim import build_optimizer
    from helm.training import TrainerState, read_trainer_state, save_checkpoint
    from tests.helpers import tiny_config

    def build(step):
        torch.manual_seed(step)
        model = AutoModelForCausalLM.from_config(tiny_config("helm_d", embedding_mode="lorentz"))
        accelerator = Accelerator()
        state = TrainerState({"note": "x"}, step=step)
        model, optimizer = accelerator.prepare(model, build_optimizer(model, lr=1e-2))
        accelerator.register_for_checkpointing(state)
        return accelerator, model, optimizer, state

    accelerator, model, optimizer, state = build(3)
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    save_checkpoint(accelerator, tmp_path, 3, keep_last=1)
    checkpoint = tmp_path / "checkpoints" / "step-00000003"
    verify_checkpoint(checkpoint)
    assert read_trainer_state(checkpoint) == {"step": 3, "config": {"note": "x"}, "data": None, "world_size": 1}

    again, fresh, fresh_optimizer, fresh_state = build(0)
    again.load_state(str(checkpoint))
    assert fresh_state.step == 3
    tables = [(n, p) for n, p in fresh.named_parameters() if isinstance(p, geoopt.ManifoldParameter)]
    assert tables, "the Lorentz token table is no longer a ManifoldParameter"
    saved = dict(model.named_parameters())
    for name, param in fresh.named_parameters():
        assert torch.equal(param, saved[name]), name
    assert any(g["group"] == "manifold" and g["params"] for g in fresh_optimizer.param_groups)
    assert fresh_optimizer.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_interrupted_checkpoint_write_never_looks_complete(tmp_path, run_data, capsys):
    """SIGKILL in the middle of writing checkpoint 8 (model and optimiser written, manifest half hashed):
    only a .tmp- folder is left, which is never listed or resumed from; --resume continues from step 4."""
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 8, "save_every": 4}, demo={"prompt": None})
    script = f"""
import os, runpy, signal, sys
import helm.manifest as C
real = C.hash_file
def dying(path, fsync=False):
    if ".tmp-step-00000008" in str(path) and path.name == "random_states_0.pkl":  # after the model and optimiser
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, fsync)
C.hash_file = dying
sys.argv = ["train.py", "--config", {str(recipe)!r}]
runpy.run_path({str(REPO / "train.py")!r}, run_name="__main__")
"""
    killed = subprocess.run([sys.executable, "-c", script], env=subprocess_env(), cwd=tmp_path, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    root = tmp_path / "run" / "checkpoints"
    partial = root / ".tmp-step-00000008"
    assert [s for s, _ in list_checkpoints(root)] == [4]
    assert (partial / "optimizer.bin").is_file() and not (partial / MANIFEST).exists()
    with pytest.raises(CheckpointError, match="manifest.json"):
        verify_checkpoint(partial)
    code, output = run_main(["--config", recipe, "--resume"], capsys)
    assert code == 0, output
    assert "resumed from" in output and "step-00000004" in output
    assert [s for s, _ in list_checkpoints(root)][-1] == 8 and not list(root.glob(".tmp-*"))


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"training exited ({process.returncode}) before {path.name} appeared:\n"
                                 + process.stdout.read().decode())
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.005)


def test_sigkill_mid_training_then_resume_continues_exactly(tmp_path, run_data):
    """Kill -9 right after the step-10 checkpoint appears; --resume must continue from the newest complete
    checkpoint and reproduce the uninterrupted run's learning rate and loss at every later step."""
    steps = 60
    reference = write_recipe(tmp_path, run_data, "reference.yaml", train={
        "max_steps": steps, "save_every": 5, "keep_last": 2, "output_dir": str(tmp_path / "reference")},
        demo={"prompt": None})
    killed = write_recipe(tmp_path, run_data, "killed.yaml", train={
        "max_steps": steps, "save_every": 5, "keep_last": 2, "output_dir": str(tmp_path / "killed")},
        demo={"prompt": None})
    command = [sys.executable, str(REPO / "train.py"), "--config"]
    env = subprocess_env()
    subprocess.run(command + [str(reference)], env=env, check=True, capture_output=True, cwd=tmp_path)

    process = subprocess.Popen(command + [str(killed)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    _wait_for(tmp_path / "killed" / "checkpoints" / "step-00000010", process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    survivors = list_checkpoints(tmp_path / "killed" / "checkpoints")
    assert survivors and survivors[-1][0] < steps, "the run finished before it was killed"
    last = survivors[-1][0]
    verify_checkpoint(survivors[-1][1])

    result = subprocess.run(command + [str(killed), "--resume"], env=env, capture_output=True, cwd=tmp_path,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resumed from {survivors[-1][1]} at step {last}" in result.stdout + result.stderr
    expected = {r["step"]: r for r in read_metrics(tmp_path / "reference") if "loss" in r}
    resumed = {r["step"]: r for r in read_metrics(tmp_path / "killed") if "loss" in r}
    assert sorted(resumed) == list(range(1, steps + 1)), "the step count differs from the uninterrupted run"
    for step in range(last + 1, steps + 1):
        assert resumed[step]["lr"] == expected[step]["lr"], step
        assert resumed[step]["loss"] == pytest.approx(expected[step]["loss"], abs=1e-6), step
    assert list_checkpoints(tmp_path / "killed" / "checkpoints")[-1][0] == steps


# ------------------------------------------------------------------------------------------------- DDP


def test_two_process_ddp_matches_one_process_with_double_accumulation(tmp_path, run_data):
    """torchrun with 2 CPU processes x grad_accum 1 against 1 process x grad_accum 2: same rows per step,
    same averaged gradient, so the same losses (HELM-MiCE with a Lorentz token table: Riemannian Adam, the
    balance loss and the routing-bias update all under DDP)."""
    common = dict(max_steps=5, batch_size=2, save_every=0, eval_at_start=False, eval_rows=8)
    overrides = dict(MICRO_MICE, embedding_mode="lorentz")
    single = write_recipe(tmp_path, run_data, "single.yaml", base="tiny-helm-mice", demo={"prompt": None},
                          model={"overrides": overrides},
                          train=dict(common, grad_accum=2, output_dir=str(tmp_path / "single")))
    ddp = write_recipe(tmp_path, run_data, "ddp.yaml", base="tiny-helm-mice", demo={"prompt": None},
                       model={"overrides": overrides},
                       train=dict(common, grad_accum=1, output_dir=str(tmp_path / "ddp")))
    env = subprocess_env()
    one = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(single)], env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert one.returncode == 0, one.stdout + one.stderr
    env_ddp = dict(env, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(29500 + os.getpid() % 1000), str(REPO / "train.py"),
                          "--config", str(ddp)], env=env_ddp, cwd=tmp_path, capture_output=True, text=True)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "2 process(es)" in two.stdout + two.stderr
    a = [r for r in read_metrics(tmp_path / "single") if "loss" in r]
    b = [r for r in read_metrics(tmp_path / "ddp") if "loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-3), (ra, rb)
        assert rb["lr"] == ra["lr"]
    va = [r["val_loss"] for r in read_metrics(tmp_path / "single") if "val_loss" in r]
    vb = [r["val_loss"] for r in read_metrics(tmp_path / "ddp") if "val_loss" in r]
    assert vb[-1] == pytest.approx(va[-1], abs=1e-3)
    assert abs(a[-1]["loss"] - a[0]["loss"]) > 1e-2, "the runs did not train"


def test_streamed_dataset_with_held_out_documents_resumes_exactly(tmp_path, run_data, capsys):
    """The streaming path (what hub datasets use) on a local file: validation held out of the training split,
    rows read in order, and a resume from the middle re-reads the stream up to the saved position."""
    recipe = write_recipe(tmp_path, run_data, data={"dataset": str(run_data / "train.jsonl"), "streaming": True,
                                                  "validation_split": None, "holdout_documents": 20},
                          train={"max_steps": 8, "save_every": 4, "keep_last": 3}, demo={"prompt": None})
    code, output = run_main(["--config", recipe], capsys)
    assert code == 0, output
    assert "streamed" in output
    run = tmp_path / "run"
    first = [r for r in read_metrics(run) if "loss" in r]
    shutil.rmtree(run / "checkpoints" / "step-00000008")  # as if killed before it was written
    code, output = run_main(["--config", recipe, "--resume", run / "checkpoints" / "step-00000004"], capsys)
    assert code == 0, output
    again = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in again] == list(range(1, 9))
    for a, b in zip(first, again):
        assert (a["lr"], a["loss"]) == (b["lr"], pytest.approx(b["loss"], abs=1e-6)), (a, b)
