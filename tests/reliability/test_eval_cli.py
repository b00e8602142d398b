"""The eval/ scripts under bad input (issue 11, items 3 and 6): every user error is one ``error: ...`` line on
stderr and exit status 2 (argparse's convention), and code saved with a checkpoint of a model type neither helm
nor transformers knows runs only with --trust-remote-code.

The table runs each script's ``main`` in-process through ``helm.evaluation.run_script`` (what ``__main__`` does);
one case runs a script as a real process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helm.evaluation import run_script
from tests.eval.script_loader import EVAL_DIR, REPO, load_script
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def tiny_checkpoint(tokenizer, tmp_path_factory):
    """A saved tiny Llama with the shared test tokenizer: a checkpoint that loads, for the argument checks."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def learned_checkpoints(tokenizer, tmp_path_factory):
    """Saved models whose positions are a learned table of 8 rows, with the shared tokenizer: a transformers GPT-2
    (``wpe``; an index past it is an IndexError) and a HELM-D with ``positional: learned`` (a ValueError)."""
    import helm
    from transformers import AutoModelForCausalLM, GPT2Config

    folders = {}
    for name, config in (
            ("gpt2", GPT2Config(vocab_size=len(tokenizer), n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                bos_token_id=0, eos_token_id=0)),
            ("helmlearned", tiny_config("helm_d", vocab_size=len(tokenizer), positional="learned",
                                        max_position_embeddings=8))):
        folder = tmp_path_factory.mktemp(name)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def small_vocab_checkpoint(tokenizer, tmp_path_factory):
    """A saved tiny HELM-D of vocab_size=100 with the shared 320-token tokenizer beside it (re-probe 8 R906: the
    forward's ValueError on the first ids past its table was a traceback)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("vocab100")
    AutoModelForCausalLM.from_config(tiny_config("helm_d", vocab_size=100)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _train_run_layout(root, model):
    """The folders train.py leaves (marker, recipe, a checkpoint of accelerate files, final/), without training."""
    run = root / "old-run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / ".helm-train-run").write_text('{"written_by": "train.py"}\n')
    (run / "config.yaml").write_text(f"model: {{}}\ndata: {{}}\noptim: {{}}\ntrain: {{output_dir: {run}}}\n"
                                     "demo: {}\n")
    for name in ("custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "manifest.json"):
        (run / "checkpoints" / "step-00000002" / name).write_bytes(b"")
    shutil.copytree(model, run / "final")
    return run


@pytest.fixture
def paths(tmp_path, tiny_checkpoint, learned_checkpoints, small_vocab_checkpoint):
    """``{missing}``, ``{text}``, ``{link}`` (a symlink to it), ``{bare}`` (a folder with only a Llama config.json),
    ``{custom}`` (an unknown model type with an auto_map and code that must never run), ``{nocfg}`` (an empty folder),
    ``{result}`` (a result file in the folder ``{results}``), ``{tmp}``."""
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "one two three four five six seven"}) + "\n")
    (tmp_path / "link.jsonl").symlink_to(text)
    (results := tmp_path / "results").mkdir()
    (results / "r.json").write_text(json.dumps({"model_name": "m", "results": {"t": {"acc": 0.5}}}))
    (twice := tmp_path / "twice").mkdir()  # one model measured twice, with other settings
    for run, value in (("a", 0.5), ("b", 0.7)):
        record = {"model_name": "final", "model_path": "runs/x/final", "results": {"t": {"acc": value}}}
        (twice / f"{run}.json").write_text(json.dumps(record))
    (twins := tmp_path / "twins").mkdir()  # two models both labelled by their folder name, train.py's final/
    for run, value in (("a", 0.5), ("b", 0.7)):
        record = {"model_name": "final", "model_path": f"runs/{run}/final", "results": {"t": {"acc": value}}}
        (twins / f"{run}.json").write_text(json.dumps(record))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    bare, custom, nocfg = tmp_path / "bare", tmp_path / "custom", tmp_path / "nocfg"
    for folder in (bare, custom, nocfg):
        folder.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (custom / "config.json").write_text(json.dumps({
        "model_type": "not_a_registered_type",
        "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    (custom / "configuration_x.py").write_text("raise SystemExit('remote code ran')\n")
    shutil.copy(Path(tiny_checkpoint) / "tokenizer.json", custom / "tokenizer.json")
    remotetok = tmp_path / "remote-tokenizer"  # the tiny model, its tokenizer naming custom code (auto_map)
    shutil.copytree(tiny_checkpoint, remotetok)
    config = json.loads((remotetok / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="XTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XTokenizer"]})
    (remotetok / "tokenizer_config.json").write_text(json.dumps(config))
    (remotetok / "tokenization_x.py").write_text("raise SystemExit('remote code ran')\n")
    modelonly = tmp_path / "no-tokenizer"  # a model folder saved without its tokenizer
    shutil.copytree(tiny_checkpoint, modelonly, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    run = _train_run_layout(tmp_path, tiny_checkpoint)
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": " ".join(["one two three four five"] * 20)}) + "\n")
    shutil.copytree(tiny_checkpoint, tmp_path / "lr=0.1")  # a model folder whose name holds '='
    return {"eqmodel": str(tmp_path / "lr=0.1"), "vocab100": small_vocab_checkpoint,
            **learned_checkpoints, "modelonly": str(modelonly), "run": str(run), "long": str(tmp_path / "long.jsonl"),
            "trainckpt": str(run / "checkpoints" / "step-00000002"), "checkpoints": str(run / "checkpoints"),
            "missing": str(tmp_path / "no-such-checkpoint"), "text": str(text), "bare": str(bare),
            "remotetok": str(remotetok),
            "custom": str(custom), "nocfg": str(nocfg), "tmp": str(tmp_path),
            "bad": str(tmp_path / "bad.jsonl"), "model": tiny_checkpoint, "link": str(tmp_path / "link.jsonl"),
            "results": str(results), "result": str(results / "r.json")}


REMOTE = r"--model '.*custom'.*trust.remote.code"
# script, arguments, exit status, culprit the one error line names (regex)
CASES = [
    ("perplexity", ["--model", "{missing}", "--files", "{text}"], 2, r"--model '.*no-such-checkpoint': no such folder"),
    ("perplexity", ["--model", "{nocfg}", "--files", "{text}"], 2, r"--model '.*nocfg'.*config\.json"),
    ("perplexity", ["--model", "{bare}", "--files", "{tmp}/nope.jsonl"], 2, r"nope\.jsonl"),
    ("perplexity", ["--model", "{bare}", "--files", "{text}", "--dtype", "float8"], 2, r"--dtype"),
    ("perplexity", ["--model", "{custom}", "--files", "{text}"], 2, REMOTE),
    ("perplexity", ["--model", "{model}", "--files", "{bad}"], 2, r"bad\.jsonl"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--seq-len", "0"], 2, r"--seq-len.*>= 2"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--batch-size", "0"], 2, r"--batch-size.*>= 1"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--max-windows", "0"], 2, r"--max-windows.*>= 1"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--max-documents", "0"], 2, r"--max-documents"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--max-tokens", "-5"], 2, r"--max-tokens"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--stride", "0"], 2, r"--stride"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--device", "cuda:7"], 2, r"--device cuda:7"),
    ("perplexity", ["--model", "{model}", "--files", "{long}", "--seq-len", "8", "--stride", "9"], 2,
     r"stride.*9"),
    ("perplexity", ["--model", "{model}", "--files", "{long}", "--document-attention", "--keep-last"], 2,
     r"document_attention"),
    ("length_extrapolation", ["--model", "{custom}", "--files", "{text}", "--output-dir", "{tmp}/o"], 2, REMOTE),
    ("length_extrapolation", ["--model", "{bare}", "--files", "{text}", "--factors", "0"], 2, r"--factors"),
    ("length_extrapolation", ["--model", "{model}", "--files", "{text}", "--train-length", "0"], 2,
     r"--train-length"),
    ("length_extrapolation", ["--model", "{missing}", "--files", "{text}", "--max-tokens", "-1"], 2,
     r"--max-tokens"),
    ("length_extrapolation", ["--model", "{missing}", "--files", "{text}", "--batch-size", "0"], 2, r"--batch-size"),
    ("curvature", ["--model", "{custom}", "--files", "{text}", "--output-dir", "{tmp}/o"], 2, REMOTE),
    ("curvature", ["--model", "{bare}", "--files", "{text}", "--max-points", "2"], 2, r"--max-points"),
    ("curvature", ["--model", "{missing}", "--files", "{text}", "--knn", "0", "--output-dir", "{tmp}/o"], 2,
     r"--knn"),
    ("curvature", ["--model", "{missing}", "--files", "{text}", "--alpha", "1", "--output-dir", "{tmp}/o"], 2,
     r"--alpha"),
    ("curvature", ["--model", "{missing}", "--files", "{text}", "--seq-len", "0", "--output-dir", "{tmp}/o"], 2,
     r"--seq-len"),
    ("harness", ["--model", "{custom}", "--tasks", "helm_local_mc", "--limit", "2"], 2, REMOTE),
    ("harness", ["--model", "{missing}", "--suite", "local"], 2, r"--model '.*no-such-checkpoint'"),
    ("harness", ["--model", "{bare}", "--tasks", "x", "--num-fewshot", "-1"], 2, r"--num-fewshot"),
    ("harness", ["--model", "{model}", "--suite", "local", "--limit", "0"], 2, r"--limit"),
    ("harness", ["--model", "{model}", "--limit", "nan"], 2, r"--limit"),
    ("harness", ["--model", "{model}", "--tasks", "no_such_task_xyz"], 2, r"--tasks.*'no_such_task_xyz'"),
    ("harness", ["--model", "{model}", "--tasks", "helm_local,hellaswg"], 2, r"'hellaswg'.*'hellaswag'"),
    # an empty --tasks ran the default suite
    ("harness", ["--model", "{model}", "--tasks", ""], 2, r"--tasks ''"),
    ("harness", ["--model", "{model}", "--suite", "local", "--batch-size", "0"], 2, r"--batch-size"),
    ("harness", ["--model", "{model}", "--device", "cuda:7"], 2, r"--device cuda:7"),
    ("harness", ["--model", "{model}", "--device", "xla"], 2, r"--device xla"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--device", "meta"], 2, r"--device meta"),
    ("pe_decay", ["--head-dim", "15", "--output", "{tmp}/a.png"], 2, r"--head-dim"),
    ("pe_decay", ["--head-dim", "0", "--output", "{tmp}/a.png"], 2, r"--head-dim"),
    ("pe_decay", ["--num-heads", "0", "--output", "{tmp}/a.png"], 2, r"--num-heads"),
    ("pe_decay", ["--curvature", "1", "--output", "{tmp}/a.png"], 2, r"--curvature"),
    ("compare", ["{tmp}/missing.json"], 2, r"missing\.json"),
    # two models under one label: one row would silently drop the other's results
    ("compare", ["{tmp}/twins"], 2, r"'final'.*runs/a/final.*runs/b/final.*NAME=PATH"),
    ("compare", ["{result}", "--output", "{tmp}/table.json"], 2, r"--output '.*table\.json'.*Markdown"),
    ("compare", ["{tmp}/twice"], 2, r"'final' has two results for t \(acc\): 0\.5 in .*a\.json, 0\.7 in .*b\.json"),
    ("pe_decay", ["--variants", "none", "--head-dim", "4", "--num-heads", "1", "--output", "{tmp}/pe.xyz"], 2,
     r"--output '.*pe\.xyz'.*'\.xyz'"),
    ("compare", ["{text}", "--metric", "t"], 2, r"TASK=METRIC"),
    # outputs are checked before anything is evaluated, and never overwrite an input or a model's files
    ("harness", ["--model", "{model}", "--suite", "local", "--output", "{text}/results.json"], 2,
     r"--output '.*text\.jsonl/results\.json'"),
    ("compare", ["{text}", "--output", "{text}/table.md"], 2, r"--output '.*text\.jsonl/table\.md'"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--output", "{text}/result.json"], 2,
     r"--output '.*text\.jsonl/result\.json'"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--output", "{tmp}"], 2, r"--output '.*'"),
    ("length_extrapolation", ["--model", "{model}", "--files", "{text}", "--output-dir", "{text}"], 2,
     r"--output-dir '.*text\.jsonl'"),
    ("curvature", ["--model", "{model}", "--files", "{text}", "--output-dir", "{text}/o"], 2,
     r"--output-dir '.*text\.jsonl/o'"),
    ("pe_decay", ["--output", "{text}/a.png"], 2, r"--output '.*text\.jsonl/a\.png'"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--seq-len", "4", "--output", "{text}"], 2,
     r"--output '.*text\.jsonl'.*input file"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--seq-len", "4", "--output", "{link}"], 2,
     r"--output '.*link\.jsonl'.*input file"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--output", "{model}/model.safetensors"], 2,
     r"--output '.*model\.safetensors'.*model folder"),
    ("perplexity", ["--model", "{bare}", "--files", "{text}", "--tokenizer", "{model}", "--output",
                    "{model}/tokenizer.json"], 2, r"--output '.*tokenizer\.json'.*model folder"),
    ("compare", ["{result}", "--output", "{result}"], 2, r"--output '.*r\.json'.*input file"),
    ("compare", ["{results}", "--output", "{result}"], 2, r"--output '.*r\.json'.*input file"),
    ("length_extrapolation", ["--model", "{model}", "--files", "{text}", "--output-dir", "{model}"], 2,
     r"--output-dir '.*'.*model folder"),
    ("curvature", ["--model", "{model}", "--files", "{text}", "--output-dir", "{model}/curvature"], 2,
     r"--output-dir '.*curvature'.*model folder"),
    ("harness", ["--model", "{model}", "--output", "{model}/results.json"], 2,
     r"--output '.*results\.json'.*model folder"),
    ("curvature", ["--model", "x={model}", "--model", "x={model}", "--files", "{text}", "--output-dir", "{tmp}/o"],
     2, r"--model 'x=.*'.*'x'"),
    ("length_extrapolation", ["--model", "{model}", "--model", "{model}", "--files", "{text}", "--output-dir",
                              "{tmp}/o"], 2, r"--model .*--model"),
    # a window past a learned position table is refused naming both lengths, before any window is scored
    ("perplexity", ["--model", "{gpt2}", "--files", "{long}", "--seq-len", "16"], 2, r"--seq-len=16.*=8"),
    ("perplexity", ["--model", "{helmlearned}", "--files", "{long}", "--seq-len", "9", "--document-attention"], 2,
     r"--seq-len=9.*=8"),
    ("curvature", ["--model", "{gpt2}", "--files", "{long}", "--seq-len", "12", "--output-dir", "{tmp}/o"], 2,
     r"--seq-len=12.*=8"),
    # paths: a folder without tokenizer files, a train.py checkpoint, checkpoints/ or run folder, a file, a missing
    # path that reads as a hub id: one line naming the option and the path, before the weights load
    ("perplexity", ["--model", "{bare}", "--files", "{text}"], 2, r"--model.*'.*bare'.*tokenizer\.json"),
    ("perplexity", ["--model", "{model}", "--tokenizer", "{modelonly}", "--files", "{text}"], 2,
     r"--tokenizer '.*no-tokenizer'.*tokenizer\.json"),
    ("length_extrapolation", ["--model", "{modelonly}", "--files", "{text}", "--output-dir", "{tmp}/o"], 2,
     r"--model.*'.*no-tokenizer'"),
    ("curvature", ["--model", "{modelonly}", "--files", "{text}", "--output-dir", "{tmp}/o"], 2,
     r"--model.*'.*no-tokenizer'"),
    ("harness", ["--model", "{modelonly}", "--suite", "local"], 2, r"--model.*'.*no-tokenizer'"),
    ("perplexity", ["--model", "no-such-owner-xyz/no-such-model-xyz", "--files", "{text}"], 2,
     r"--model 'no-such-owner-xyz/no-such-model-xyz'"),
    ("perplexity", ["--model", "my model/x", "--files", "{text}"], 2, r"--model 'my model/x'"),
    ("perplexity", ["--model", "{trainckpt}", "--files", "{text}"], 2, r"--model '.*step-00000002'.*config\.json"),
    ("harness", ["--model", "{trainckpt}", "--suite", "local"], 2, r"--model '.*step-00000002'"),
    ("perplexity", ["--model", "{checkpoints}", "--files", "{text}"], 2, r"--model '.*old-run/checkpoints'"),
    ("perplexity", ["--model", "{run}", "--files", "{text}"], 2, r"--model '.*old-run'"),
    ("harness", ["--model", "{run}"], 2, r"--model '.*old-run'"),
    ("perplexity", ["--model", "{model}/model.safetensors", "--files", "{text}"], 2,
     r"--model '.*model\.safetensors': is a file"),
    # a path holding '=' is all path when it exists or the part before the '=' holds a '/'
    ("perplexity", ["--model", "{tmp}/x/a=b", "--files", "{text}"], 2, r"--model '.*/x/a=b': no such folder"),
    ("harness", ["--model", "{tmp}/x/a=b"], 2, r"--model '.*/x/a=b'"),
    ("perplexity", ["--model", "{eqmodel}", "--files", "{text}", "--output", "{eqmodel}/result.json"], 2,
     r"--output '.*lr=0\.1/result\.json'.*'.*lr=0\.1'"),
    ("compare", ["{tmp}/x/a=b.json"], 2, r"/x/a=b\.json"),
    # --distance lorentz on a Llama's (Euclidean) hidden states is refused, not a chord clamped to 0
    ("curvature", ["--model", "{model}", "--files", "{long}", "--distance", "lorentz", "--max-points", "20", "--knn",
                   "3", "--output-dir", "{tmp}/o", "--no-progress"], 2, r"--distance lorentz"),
    # a tokenizer of more tokens than the model's vocabulary is refused before any text is scored
    ("perplexity", ["--model", "{vocab100}", "--tokenizer", "{model}", "--files", "{long}", "--seq-len", "8"], 2,
     r"tokenizer .*320.*vocab_size=100"),
    ("perplexity", ["--model", "{vocab100}", "--files", "{long}", "--seq-len", "8"], 2,
     r"tokenizer .*vocab100.*320.*vocab_size=100"),
    ("harness", ["--model", "{vocab100}", "--suite", "local", "--limit", "2"], 2, r"320.*vocab_size=100"),
    # every cell failing (each window past GPT-2's 8-row table) is no result
    ("length_extrapolation", ["--model", "{gpt2}", "--files", "{long}", "--train-length", "12", "--factors", "1", "2",
                              "--output-dir", "{tmp}/o", "--no-progress"], 2, r"no length could be scored.*'.*/o'"),
]


@pytest.mark.parametrize("script, argv, code, message", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_user_errors_are_one_line_and_exit_2(script, argv, code, message, paths, capsys, monkeypatch):
    monkeypatch.setattr("builtins.input", lambda *prompt: "y")  # a terminal user who would say yes to custom code
    main = load_script(script).main
    with pytest.raises(SystemExit) as exit_info:
        run_script(main, [a.format(**paths) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    # progress bars may come before; argparse's own refusals are "PROG: error: ..." after its usage line
    errors = [line for line in err.splitlines() if "error: " in line]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0] and re.search(message, errors[0]), err
    assert "Traceback" not in err


def test_trusting_remote_code_gets_past_the_refusal(paths, capsys):
    """With --trust-remote-code the refusal is gone: transformers goes on to import the saved code."""
    with pytest.raises(SystemExit) as exit_info:
        run_script(load_script("perplexity").main, ["--model", paths["custom"], "--files", paths["text"],
                                                     "--trust-remote-code"])
    assert exit_info.value.code == "remote code ran" or "trust-remote-code" not in capsys.readouterr().err


def test_perplexity_loads_a_tokenizer_only_folder(paths, tokenizer, tmp_path, capsys):
    """--tokenizer of a folder written by tokenizer.save_pretrained (tokenizer.json, tokenizer_config.json, no
    config.json; what train.py takes as data.tokenizer) loads next to a model folder saved without a tokenizer."""
    model = tmp_path / "model-only"
    shutil.copytree(paths["model"], model)
    for name in os.listdir(model):
        if name.startswith(("tokenizer", "special_tokens")) or name in ("vocab.json", "merges.txt"):
            (model / name).unlink()
    tokenizer.save_pretrained(tokonly := tmp_path / "tokenizer-only")
    assert not (tokonly / "config.json").exists() and (tokonly / "tokenizer.json").is_file()
    record = run_script(load_script("perplexity").main,
                        ["--model", str(model), "--tokenizer", str(tokonly), "--files", paths["text"],
                         "--seq-len", "4", "--max-windows", "2", "--no-progress"])
    result = next(iter(record["results"].values()))
    assert result["windows"] >= 1 and result["perplexity"] > 0, capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a folder with no tokenizer files is still one error line
        run_script(load_script("perplexity").main, ["--model", str(model), "--tokenizer", paths["nocfg"],
                                                    "--files", paths["text"], "--seq-len", "4"])
    assert exit_info.value.code == 2
    assert re.search(r"error: --tokenizer '.*nocfg'.*tokenizer\.json", capsys.readouterr().err)


def test_a_script_as_a_process_prints_one_line_and_exits_2(paths):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run([sys.executable, str(EVAL_DIR / "perplexity.py"), "--model", paths["custom"], "--files",
                             paths["text"]], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "--trust-remote-code" in result.stderr


def test_convert_official_refuses_a_tokenizer_naming_custom_code(tokenizer, tmp_path, capsys, monkeypatch):
    """Issue 25 item 1 for scripts/: --tokenizer of a folder whose tokenizer_config.json names custom code is refused
    (exit 2, one line naming --trust-remote-code), never asked about on a terminal (here one that would say yes)."""
    import importlib.util

    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="XTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_x.py").write_text("raise SystemExit('remote code ran')\n")
    spec = importlib.util.spec_from_file_location("convert_official_script", REPO / "scripts" / "convert_official.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr("builtins.input", lambda *prompt: "y")
    code = script.main(["--checkpoint", str(REPO / "tests" / "fixtures" / "official" / "helm_d_tiny.pt"),
                        "--output", str(tmp_path / "out"), "--tokenizer", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "trust-remote-code" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_learned_position_limit_is_found_only_for_learned_tables(learned_checkpoints, tiny_checkpoint):
    """Item 1's rule: a learned table of absolute positions (transformers' wpe, HELM's learned) bounds the window at
    max_position_embeddings; rotary models (the tiny Llama) extrapolate and are never refused."""
    from transformers import AutoModelForCausalLM

    from helm.evaluation import learned_position_limit

    assert learned_position_limit(AutoModelForCausalLM.from_pretrained(learned_checkpoints["gpt2"])) == 8
    assert learned_position_limit(AutoModelForCausalLM.from_pretrained(learned_checkpoints["helmlearned"])) == 8
    assert learned_position_limit(AutoModelForCausalLM.from_pretrained(tiny_checkpoint)) is None


def test_a_rotary_model_is_scored_past_its_max_position_embeddings(paths, capsys):
    """Longer windows than max_position_embeddings are an extrapolation for a rotary model, not an error."""
    import json as json_module

    limit = json_module.loads((Path(paths["model"]) / "config.json").read_text())["max_position_embeddings"]
    record = run_script(load_script("perplexity").main, ["--model", paths["model"], "--files", paths["long"],
                                                         "--seq-len", str(2 * limit), "--keep-last", "--no-progress"])
    assert next(iter(record["results"].values()))["seq_len"] == 2 * limit, capsys.readouterr().err


def test_length_extrapolation_notes_a_length_past_a_learned_table(paths, tmp_path, capsys):
    """eval/length_extrapolation.py records a factor past GPT-2's table as a note (an empty cell), as it does for
    HELM's learned table, instead of an IndexError traceback, and scores the factors that fit."""
    rows = run_script(load_script("length_extrapolation").main, [
        "--model", paths["gpt2"], "--files", paths["long"], "--train-length", "4", "--factors", "1", "2", "4",
        "--output-dir", str(tmp_path / "o"), "--no-progress"])
    assert [row["factor"] for row in rows if row["perplexity"] != ""] == [1, 2]
    [row] = [row for row in rows if row["factor"] == 4]
    assert row["perplexity"] == "" and re.search(r"seq_len=16 is longer than the model's learned position table "
                                                 r"\(max_position_embeddings=8\)", row["note"]), row


@pytest.mark.parametrize("spec, expected", [
    ("runs/helm-d", ("", "runs/helm-d")),
    ("helm-d=runs/helm-d", ("helm-d", "runs/helm-d")),
    ("/tmp/x/a=b", ("", "/tmp/x/a=b")),  # F034: the part before '=' holds a '/', so no label
    ("runs/lr=0.1/final", ("", "runs/lr=0.1/final")),
    ("best=runs/lr=0.1", ("best", "runs/lr=0.1")),  # a label, then a path holding '='
    ("=runs/x", ("", "runs/x")),
])
def test_split_model_spec(spec, expected):
    """F034: the ``[NAME=]PATH`` rule of every script's --model (and compare.py's inputs)."""
    from helm.evaluation import split_model_spec

    assert split_model_spec(spec) == expected


@pytest.mark.parametrize("spec, match", [("name=", r"--model 'name=' has no path after name=: pass NAME=PATH"),
                                         ("name=  ", r"has no path after name=")])
def test_a_label_without_a_path_is_named(spec, match):
    """re-probe 7: ``--model name=`` said "checkpoint '' has no config.json"."""
    from helm.evaluation import EvalError, split_model_spec

    with pytest.raises(EvalError, match=match):
        split_model_spec(spec)


def test_a_model_folder_whose_name_holds_an_equals_sign_is_scored(paths, capsys):
    """F034: an existing folder ``lr=0.1`` is the path, not the label ``lr`` of a path ``0.1``; labelled, it is
    ``NAME=PATH`` with the path whole."""
    for spec, name in ((paths["eqmodel"], "lr=0.1"), (f"best={paths['eqmodel']}", "best")):
        record = run_script(load_script("perplexity").main, ["--model", spec, "--files", paths["long"],
                                                             "--seq-len", "4", "--max-windows", "1", "--no-progress"])
        assert (record["model_name"], record["model_path"]) == (name, paths["eqmodel"]), capsys.readouterr().err


@pytest.mark.parametrize("script", ["perplexity", "length_extrapolation", "pe_decay", "curvature"])
def test_every_script_with_progress_bars_takes_no_progress(script):
    """F073: eval/README.md says every script with long loops hides its progress bars with --no-progress."""
    parser = load_script(script).build_parser()
    assert "--no-progress" in parser._option_string_actions, script
    assert parser.parse_args([*(["--model", "m"] if script != "pe_decay" else []),
                              *(["--files", "t"] if script != "pe_decay" else []),
                              "--no-progress"]).no_progress


def test_curvature_lorentz_distance_only_between_points_of_the_hyperboloid(paths, tmp_path, capsys):
    """F056: a HELM model's final hidden states lie on its hyperboloid, so --distance lorentz measures them; with a
    Llama beside it the run is refused before any curvature is computed or written, the HELM model's included."""
    curvature = load_script("curvature").main
    common = ["--files", paths["long"], "--distance", "lorentz", "--max-points", "20", "--knn", "3", "--seq-len", "8",
              "--no-progress"]
    record = run_script(curvature, ["--model", f"helm={paths['helmlearned']}", *common, "--output-dir",
                                    str(tmp_path / "ok")])
    stats = record["runs"][0]["results"]["ricci_curvature"]
    assert stats["distance"] == "lorentz" and stats["edges"] > 0, capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        run_script(curvature, ["--model", f"helm={paths['helmlearned']}", "--model", f"llama={paths['model']}",
                               *common, "--output-dir", str(tmp_path / "refused")])
    assert exit_info.value.code == 2
    assert re.search(r"error: --distance lorentz: .* --model 'llama' \(model_type 'llama'\)", capsys.readouterr().err)
    assert not list((tmp_path / "refused").glob("curvature*"))


# (script, its arguments before the output option, the output option, the file or folder given under '~')
TILDE_OUTPUTS = [
    ("compare", ["{result}"], "--output", "table.md"),
    ("pe_decay", ["--variants", "none", "--head-dim", "4", "--num-heads", "1"], "--output", "decay.png"),
    ("perplexity", ["--model", "{tiny}", "--files", "{text}", "--seq-len", "4", "--max-windows", "1",
                    "--no-progress"], "--output", "ppl.json"),
]


@pytest.mark.parametrize("script, before, option, name", TILDE_OUTPUTS, ids=[f"{c[0]} {c[3]}" for c in TILDE_OUTPUTS])
def test_a_quoted_tilde_output_is_written_under_home(paths, tiny_checkpoint, tmp_path, monkeypatch, script, before,
                                                     option, name):
    """--output '~/x' (quoted, so the shell leaves the '~') created a folder named '~' in the current directory; the
    scripts expand it (helm.evaluation.user_path), as train.py's output_dir."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    argv = [arg.format(tiny=tiny_checkpoint, **paths) for arg in before] + ([option] if option else []) + [f"~/{name}"]
    run_script(load_script(script).main, argv)
    assert (home / name).is_file() and not (cwd / "~").exists()


@pytest.mark.parametrize("script, option", [("curvature", "--output-dir"), ("harness", "--output"),
                                            ("length_extrapolation", "--output-dir")])
def test_the_other_output_options_expand_a_tilde(tmp_path, monkeypatch, script, option):
    """The options of the slower scripts, parsed: the same type as the scripts run above."""
    monkeypatch.setenv("HOME", str(tmp_path))
    parser = load_script(script).build_parser()
    action = next(action for action in parser._actions if option in action.option_strings)
    assert action.type("~/out") == tmp_path / "out"


@pytest.mark.parametrize("script, option", [("convert_official", "--output"), ("build_data", "--out")])
def test_the_scripts_output_folders_expand_a_tilde(tmp_path, monkeypatch, capsys, script, option):
    """scripts/: the output folder of convert_official.py (run on the official fixture) and build_data.py."""
    import importlib.util

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location(f"{script}_script", REPO / "scripts" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if script == "build_data":  # building downloads a corpus: the parsed option is checked instead
        built = []
        monkeypatch.setattr(module.data, "build_default_data", lambda out, **kwargs: built.append(out) or out)
        assert module.main([option, "~/data", "--quiet"]) == 0
        assert built == [tmp_path / "home" / "data"]
        return
    code = module.main(["--checkpoint", str(REPO / "tests" / "fixtures" / "official" / "helm_d_tiny.pt"),
                        option, "~/converted"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "home" / "converted" / "config.json").is_file() and not (tmp_path / "~").exists()
