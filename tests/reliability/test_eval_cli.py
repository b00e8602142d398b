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


@pytest.fixture
def paths(tmp_path, tiny_checkpoint):
    """``{missing}``, ``{text}``, ``{bare}`` (a folder with only a Llama config.json), ``{custom}`` (an unknown model
    type with an auto_map and code that must never run), ``{nocfg}`` (an empty folder), ``{tmp}``."""
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "one two three four five six seven"}) + "\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    bare, custom, nocfg = tmp_path / "bare", tmp_path / "custom", tmp_path / "nocfg"
    for folder in (bare, custom, nocfg):
        folder.mkdir()
    (bare / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (custom / "config.json").write_text(json.dumps({
        "model_type": "not_a_registered_type",
        "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    (custom / "configuration_x.py").write_text("raise SystemExit('remote code ran')\n")
    remotetok = tmp_path / "remote-tokenizer"  # the tiny model, its tokenizer naming custom code (auto_map)
    shutil.copytree(tiny_checkpoint, remotetok)
    config = json.loads((remotetok / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="XTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XTokenizer"]})
    (remotetok / "tokenizer_config.json").write_text(json.dumps(config))
    (remotetok / "tokenization_x.py").write_text("raise SystemExit('remote code ran')\n")
    return {"missing": str(tmp_path / "no-such-checkpoint"), "text": str(text), "bare": str(bare),
            "remotetok": str(remotetok),
            "custom": str(custom), "nocfg": str(nocfg), "tmp": str(tmp_path),
            "bad": str(tmp_path / "bad.jsonl"), "model": tiny_checkpoint}


REMOTE = "neither helm nor transformers knows.*pass --trust-remote-code"
# script, arguments, exit status, message (regex of the one error line)
CASES = [
    ("perplexity", ["--model", "{missing}", "--files", "{text}"], 2, "checkpoint not found: .*no-such-checkpoint"),
    ("perplexity", ["--model", "{nocfg}", "--files", "{text}"], 2, "has no config.json"),
    ("perplexity", ["--model", "{bare}", "--files", "{tmp}/nope.jsonl"], 2, "text file not found: .*nope.jsonl"),
    ("perplexity", ["--model", "{bare}", "--files", "{text}", "--dtype", "float8"], 2, "dtype must be"),
    ("perplexity", ["--model", "{custom}", "--files", "{text}"], 2, REMOTE),
    ("perplexity", ["--model", "{bare}", "--files", "{bad}"], 2, r"bad\.jsonl: not valid UTF-8 json data"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--seq-len", "0"], 2, "seq_len must be at least 2"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--batch-size", "0"], 2,
     "batch_size must be at least 1"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--max-windows", "0"], 2,
     "max_windows must be at least 1"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--max-documents", "0"], 2,
     "max_documents must be at least 1"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--device", "cuda:7"], 2,
     r"--device cuda:7: this machine"),
    ("length_extrapolation", ["--model", "{custom}", "--files", "{text}", "--output-dir", "{tmp}/o"], 2, REMOTE),
    ("length_extrapolation", ["--model", "{bare}", "--files", "{text}", "--factors", "0"], 2, "--factors"),
    ("length_extrapolation", ["--model", "{model}", "--files", "{text}", "--train-length", "0"], 2,
     "--train-length must be an integer >= 1, got 0"),
    ("curvature", ["--model", "{custom}", "--files", "{text}", "--output-dir", "{tmp}/o"], 2, REMOTE),
    ("curvature", ["--model", "{bare}", "--files", "{text}", "--max-points", "2"], 2, "--max-points"),
    ("harness", ["--model", "{custom}", "--suite", "local"], 2, REMOTE),
    ("harness", ["--model", "{missing}", "--suite", "local"], 2, "checkpoint not found"),
    ("harness", ["--model", "{bare}", "--tasks", "x", "--num-fewshot", "-1"], 2, "--num-fewshot"),
    ("harness", ["--model", "{bare}", "--suite", "local", "--limit", "0"], 2, "--limit must be a positive"),
    ("harness", ["--model", "{bare}", "--tasks", "no_such_task_xyz"], 2,
     "--tasks: no lm-eval task, group or tag 'no_such_task_xyz'"),
    ("harness", ["--model", "{bare}", "--tasks", "helm_local,hellaswg"], 2,
     r"no lm-eval task, group or tag 'hellaswg' \(did you mean 'hellaswag'\?\)$"),
    ("pe_decay", ["--head-dim", "15", "--output", "{tmp}/a.png"], 2, "--head-dim"),
    ("pe_decay", ["--curvature", "1", "--output", "{tmp}/a.png"], 2, "--curvature must be a negative finite number"),
    ("compare", ["{tmp}/missing.json"], 2, "result file or folder not found"),
    # issue 25 item 9: arguments refused and --output checked before anything is evaluated ({text} is a file, so
    # nothing can be written under it)
    ("harness", ["--model", "{bare}", "--suite", "local", "--batch-size", "0"], 2,
     r"--batch-size must be an integer >= 1 or 'auto', got '0'"),
    ("harness", ["--model", "{bare}", "--suite", "local", "--batch-size", "two"], 2, r"--batch-size must be"),
    ("harness", ["--model", "{bare}", "--suite", "local", "--output", "{text}/results.json"], 2,
     r"--output '.*text\.jsonl/results\.json' is not writable"),
    ("compare", ["{text}", "--digits", "-2"], 2, r"--digits must be an integer in \[0, 15\], got -2"),
    ("compare", ["{text}", "--output", "{text}/table.md"], 2, r"--output .* is not writable"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--output", "{text}/result.json"], 2,
     r"--output '.*text\.jsonl/result\.json' is not writable"),
    ("perplexity", ["--model", "{model}", "--files", "{text}", "--output", "{tmp}"], 2,
     r"--output '.*' is a folder; expected a file path"),
    ("length_extrapolation", ["--model", "{model}", "--files", "{text}", "--output-dir", "{text}"], 2,
     r"--output-dir '.*text\.jsonl' is a file; expected a folder"),
    ("curvature", ["--model", "{model}", "--files", "{text}", "--output-dir", "{text}/o"], 2,
     r"--output-dir '.*text\.jsonl/o' is not writable"),
    ("pe_decay", ["--output", "{text}/a.png"], 2, r"--output '.*text\.jsonl/a\.png' is not writable"),
    # issue 25 item 1: a tokenizer naming custom code is refused without --trust-remote-code, never asked about
    ("perplexity", ["--model", "{remotetok}", "--files", "{text}"], 2,
     r"could not load a tokenizer from .*remote-tokenizer.*trust_remote_code"),
    ("compare", ["{text}", "--metric", "t"], 2, "TASK=METRIC"),
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
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # progress bars may come before
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0] and re.search(message, errors[0]), err
    assert "Traceback" not in err


def test_trusting_remote_code_gets_past_the_refusal(paths, capsys):
    """With --trust-remote-code the refusal is gone: transformers goes on to import the saved code."""
    with pytest.raises(SystemExit) as exit_info:
        run_script(load_script("perplexity").main, ["--model", paths["custom"], "--files", paths["text"],
                                                     "--trust-remote-code"])
    assert exit_info.value.code == "remote code ran" or "trust-remote-code" not in capsys.readouterr().err


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
    assert code == 2 and err.startswith("error: ") and "pass --trust-remote-code" in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
