"""train.py under bad input and failures (issue 11, items 1, 2, 3, 6, 8): exit status 2 and one ``error: ...`` line
for every user error, exit 3 when training diverges, no non-finite or half-written checkpoint, one run per
output_dir.

The table runs ``train.main`` in-process on the micro model and synthetic corpus of ``tests/test_train.py``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from filelock import FileLock
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from helm.manifest import RUN_MARKER
from helm.training import ConfigError, list_checkpoints, load_run_config, verify_checkpoint
from tests.test_train import REPO, fresh_accelerate_state, run_data, train_script, write_recipe  # noqa: F401  (fixtures)


def _data_folder(tmp_path, run_data, train: bytes):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_bytes(train)
    (folder / "validation.jsonl").write_bytes((run_data / "validation.jsonl").read_bytes())
    return [f"--data.dataset={folder}"]


def _two_files_for_one_split(tmp_path, run_data):
    extra = _data_folder(tmp_path, run_data, (run_data / "train.jsonl").read_bytes())
    (tmp_path / "data" / "train.txt").write_text("a second training text that either reader would drop")
    return extra


def _bad_utf8_recipe(tmp_path, run_data):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(recipe.read_bytes() + b"\n# caf\xe9 au lait\n")
    return []


def _recipe_text(text):
    def write(tmp_path, run_data):
        (tmp_path / "recipe.yaml").write_text(text)
        return []
    return write


def _corrupted_pretrained(tmp_path, run_data):
    """A folder train.py wrote (weights + manifest) whose weights changed on disk afterwards."""
    import helm
    from transformers import AutoModelForCausalLM

    from helm.manifest import write_manifest
    from tests.test_train import MICRO_D

    folder = tmp_path / "pretrained"
    AutoModelForCausalLM.from_config(helm.load_config("tiny-helm-d", **MICRO_D)).save_pretrained(folder)
    write_manifest(folder, 1)
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-100] ^= 0x40
    (folder / "model.safetensors").write_bytes(bytes(data))
    return ["--model.preset=null", f"--model.pretrained={folder}"]


def _preset_without_model_type(tmp_path, run_data):
    preset = tmp_path / "preset.json"
    preset.write_text(json.dumps({"hidden_size": 33, "num_attention_heads": 2}))
    return [f"--model.preset={preset}"]


def _legacy_config(run):
    """The config.yaml a train.py from before the run marker wrote: the resolved recipe, its five sections."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {}, "data": {}, "optim": {},
                                                     "train": {"output_dir": str(run)}, "demo": {}}))


def _previous_run(tmp_path, run_data):
    (tmp_path / "run" / "checkpoints" / "step-00000004").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    _legacy_config(tmp_path / "run")
    return []


def _run_with_files_of_the_users(where, manifests=True, args=("--train.overwrite=true",)):
    """A finished run (checkpoints, final/ with their manifests) where the user then put a file of their own."""
    def setup(tmp_path, run_data):
        from helm.manifest import write_manifest

        run = tmp_path / "run"
        for folder in (run / "checkpoints" / "step-00000002", run / "final"):
            folder.mkdir(parents=True)
            (folder / "config.json").write_text("{}")
            if manifests:
                write_manifest(folder, 2)
        (run / RUN_MARKER).write_text("{}")
        if where:
            (run / where).write_text("mine")
        return [arg.format(tmp=tmp_path) for arg in args]
    return setup


def _linked(name):
    def setup(tmp_path, run_data):
        _previous_run(tmp_path, run_data)
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "mine.txt").write_text("mine")
        target = tmp_path / "run" / name
        if target.exists():
            shutil.rmtree(target)
        target.symlink_to(tmp_path / "elsewhere")
        return ["--train.overwrite=true"]
    return setup


def _single_document(tmp_path, run_data):
    (tmp_path / "book.txt").write_text(" ".join(["a line of a book"] * 200))
    return [f"--data.dataset={tmp_path / 'book.txt'}", "--data.validation_split=null", "--data.holdout_documents=1"]


def _user_folder(tmp_path, run_data):
    """A folder of the user's that never held a run, with files named like a run's (issue: FILE LOST 1)."""
    run = tmp_path / "run"
    for name, text in (("final/thesis.txt", "years of work"), ("metrics.jsonl", "{}\n"), ("config.yaml", "a: 1\n"),
                       ("checkpoints/mine/k.txt", "key")):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    return []


def _run_folder_as_pretrained(tmp_path, run_data):
    folder = tmp_path / "old-run"
    _previous_run(tmp_path, run_data)
    (tmp_path / "run").rename(folder)
    return ["--model.preset=null", f"--model.pretrained={folder}"]


_HELD_LOCKS = []  # a FileLock releases itself when collected: kept here for the rest of the session


def _released(path) -> bool:
    """Whether no run holds the lock at ``path`` (a missing file holds none)."""
    if not path.exists():
        return True
    lock = FileLock(path, timeout=0)
    with lock:
        return True


def _live_lock(tmp_path, run_data):
    (tmp_path / "run").mkdir()
    _HELD_LOCKS.append(FileLock(tmp_path / "run" / "train.lock"))  # held as another run's would be
    _HELD_LOCKS[-1].acquire()
    return []


def _remote_code_folder(tmp_path, run_data):
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "not_a_registered_type", "auto_map": {"AutoConfig": "configuration_x.XConfig",
                                                            "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    (folder / "configuration_x.py").write_text("raise SystemExit('remote code ran')\n")
    return ["--model.preset=null", f"--model.pretrained={folder}"]


def _pretrained_llama(tmp_path, run_data):
    import helm
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "llama"
    config = helm.load_config("tiny-llama", vocab_size=320, max_position_embeddings=64, num_hidden_layers=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return ["--model.preset=null", f"--model.pretrained={folder}"]


def _training_checkpoint_as_pretrained(tmp_path, run_data):
    """The folder layout of a train.py checkpoint: accelerate's files, no config.json."""
    folder = tmp_path / "old-run" / "checkpoints" / "step-00000002"
    folder.mkdir(parents=True)
    for name in ("custom_checkpoint_0.pkl", "model.safetensors", "optimizer.bin", "manifest.json"):
        (folder / name).write_bytes(b"")
    return ["--model.preset=null", f"--model.pretrained={folder}"]


def _checkpoints_folder_as_pretrained(tmp_path, run_data):
    folder = _training_checkpoint_as_pretrained(tmp_path, run_data)[-1].split("=", 1)[1]
    return ["--model.preset=null", f"--model.pretrained={os.path.dirname(folder)}"]


def _file_as_pretrained(tmp_path, run_data):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    return ["--model.preset=null", f"--model.pretrained={tmp_path / 'model.safetensors'}"]


def _model_folder_as_tokenizer(tmp_path, run_data):
    """A model folder saved without its tokenizer (config.json and weights): transformers' message for it is about
    sentencepiece or tiktoken not being installed."""
    import helm
    from transformers import AutoModelForCausalLM

    from tests.test_train import MICRO_D

    folder = tmp_path / "model-without-tokenizer"
    AutoModelForCausalLM.from_config(helm.load_config("tiny-helm-d", **MICRO_D)).save_pretrained(folder)
    return [f"--data.tokenizer={folder}"]


def _metrics_but_no_checkpoint(tmp_path, run_data):
    _legacy_config(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return []


def _remote_code_tokenizer(tmp_path, run_data):
    """A tokenizer folder whose tokenizer_config.json names custom code (auto_map): transformers would ask on a
    terminal whether to run it, and run it on "y"."""
    import shutil

    folder = tmp_path / "custom-tokenizer"
    shutil.copytree(run_data / "tokenizer", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="XTokenizer",
                  auto_map={"AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "tokenization_x.py").write_text("raise SystemExit('remote code ran')\n")
    return [f"--data.tokenizer={folder}"]


# id, recipe base, setup(tmp_path, run_data) -> extra arguments, extra arguments, exit status, culprit the one
# error line names (regex)
CASES = [
    ("pretrained-corrupted", "tiny-helm-d", _corrupted_pretrained, [], 2, r"model\.pretrained.*model\.safetensors"),
    ("recipe-malformed-yaml", "tiny-helm-d", _recipe_text("model: [1, 2\n"), [], 2, r"--config .*recipe\.yaml"),
    ("recipe-is-a-list", "tiny-helm-d", _recipe_text("[1, 2]\n"), [], 2, r"--config .*recipe\.yaml"),
    ("override-malformed-yaml", "tiny-helm-d", lambda t, r: [], ["--optim.betas=[0.9"], 2, r"override"),
    # '???' (what --print-config shows for a required key) as an override would be dropped by the merge
    ("override-is-the-missing-marker", "tiny-helm-d", lambda t, r: [], ["--train.output_dir=???"], 2,
     r"train\.output_dir=\?\?\?"),
    ("override-without-a-value", "tiny-helm-d", lambda t, r: [], ["--train.output_dir="], 2, r"train\.output_dir"),
    ("seed-too-large", "tiny-helm-d", lambda t, r: [], ["--train.seed=4294967296"], 2, r"train\.seed.*4294967296"),
    ("recipe-invalid-utf8", "tiny-helm-d", _bad_utf8_recipe, [], 2, r"--config .*recipe\.yaml.*utf-8"),
    ("data-invalid-utf8", "tiny-helm-d", lambda t, r: _data_folder(t, r, b'{"text": "caf\xe9"}\n' * 50), [], 2,
     r"data\.dataset .*data'.*utf-8"),
    ("data-empty-file", "tiny-helm-d", lambda t, r: _data_folder(t, r, b""), [], 2, r"data\.dataset.*train\.jsonl"),
    ("data-malformed-json", "tiny-helm-d", lambda t, r: _data_folder(t, r, b'{"text": "ok"}\n{not json\n'), [], 2,
     r"data\.dataset.*train\.jsonl"),
    ("data-text-not-strings", "tiny-helm-d", lambda t, r: _data_folder(t, r, b'{"text": 5}\n' * 50), [], 2,
     r"data\.dataset.*train\.jsonl.*'text'"),
    ("data-text-null", "tiny-helm-d", lambda t, r: _data_folder(t, r, b'{"text": "ok"}\n{"text": null}\n' * 50), [], 2,
     r"data\.dataset.*train\.jsonl.*'text'"),
    ("data-text-missing", "tiny-helm-d",
     lambda t, r: _data_folder(t, r, b'{"text": "ok"}\n' * 3 + b'{"body": "x"}\n' + b'{"text": "ok"}\n' * 50), [], 2,
     r"data\.dataset.*train\.jsonl.*'text'"),
    # a file has no named splits: the default validation_split would read the training file itself
    ("data-file-with-a-validation-split", "tiny-helm-d", lambda t, r: [f"--data.dataset={r / 'train.jsonl'}"], [], 2,
     r"data\.validation_split 'validation'.*train\.jsonl.*data\.holdout_documents"),
    ("data-split-in-two-files", "tiny-helm-d", _two_files_for_one_split, [], 2,
     r"data\.dataset: .*data: split 'train' is ambiguous: train\.jsonl and train\.txt"),
    # train.overwrite deletes only what train.py wrote: nothing when anything else is there, or a link
    ("overwrite-a-file-of-the-users-in-final", "tiny-helm-d", _run_with_files_of_the_users("final/notes.md"), [], 2,
     r"train\.overwrite .*final/notes\.md.*nothing was deleted"),
    ("overwrite-a-file-of-the-users-in-checkpoints", "tiny-helm-d",
     _run_with_files_of_the_users("checkpoints/mine.txt"), [], 2, r"train\.overwrite .*checkpoints/mine\.txt"),
    ("overwrite-a-file-of-the-users-in-a-checkpoint", "tiny-helm-d",
     _run_with_files_of_the_users("checkpoints/step-00000002/notes.md"), [], 2,
     r"train\.overwrite .*checkpoints/step-00000002/notes\.md"),
    # second re-probe: a final/ without a manifest (an older train.py's, or the user's own) lost the user's file
    ("overwrite-a-file-of-the-users-in-a-final-without-manifest", "tiny-helm-d",
     _run_with_files_of_the_users("final/notes.md", manifests=False), [], 2, r"train\.overwrite .*final/notes\.md"),
    # ... and what the recipe reads was deleted before it was read
    ("overwrite-the-tokenizer-the-recipe-reads", "tiny-helm-d",
     _run_with_files_of_the_users(None, args=("--train.overwrite=true", "--data.tokenizer={tmp}/run/final")), [], 2,
     r"data\.tokenizer '.*run/final' lies in what train\.overwrite would delete"),
    ("overwrite-a-linked-checkpoints-folder", "tiny-helm-d", _linked("checkpoints"), [], 2,
     r"train\.overwrite .*checkpoints \(a link\)"),
    ("overwrite-a-linked-final-folder", "tiny-helm-d", _linked("final"), [], 2, r"train\.overwrite .*final \(a link\)"),
    # holding out every document leaves nothing to train on (a .txt file is one document)
    ("holdout-of-every-document", "tiny-helm-d", _single_document, [], 2,
     r"data\.holdout_documents=1 leaves no training document: .*book\.txt.* holds 1"),
    ("output-dir-is-a-file", "tiny-helm-d", lambda t, r: (t / "run").write_text("x") and [], [], 2,
     r"train\.output_dir .*run'"),
    ("output-dir-unwritable", "tiny-helm-d", lambda t, r: [], ["--train.output_dir=/sys/helm-run"], 2,
     r"train\.output_dir '/sys/helm-run'"),
    ("preset-without-model_type", "tiny-helm-d", _preset_without_model_type, [], 2,
     r"model\.preset '.*': .*model_type"),
    ("negative-seed", "tiny-helm-d", lambda t, r: [], ["--train.seed=-1"], 2, r"train\.seed.*-1"),
    ("compile-neither-boolean-nor-auto", "tiny-helm-d", lambda t, r: [], ["--train.compile=maybe"], 2,
     r"train\.compile.*maybe"),
    ("override-bad-in-config", "tiny-llama", lambda t, r: [], ["--model.overrides.num_attention_heads=5"], 2,
     r"model\.preset '.*': "),
    ("override-fails-building", "tiny-llama", lambda t, r: [], ["--model.overrides.hidden_act=nope"], 2,
     r"model\.overrides=.*'nope'"),
    ("override-fails-in-forward", "tiny-llama", lambda t, r: [], ["--model.overrides.num_key_value_heads=3"], 2,
     r"model\.overrides=.*num_key_value_heads"),
    ("batch-larger-than-data", "tiny-helm-d", lambda t, r: [], ["--train.batch_size=5000"], 2,
     r"train\.batch_size=5000"),
    ("fp16-without-cuda", "tiny-helm-d", lambda t, r: [], ["--train.mixed_precision=fp16"], 2,
     r"train\.mixed_precision=fp16"),
    ("reused-output-dir", "tiny-helm-d", _previous_run, [], 2, r"train\.output_dir .*run'"),
    ("output-dir-in-use", "tiny-helm-d", _live_lock, [], 2, r"train\.output_dir .*run'.* in use"),
    ("pretrained-missing-local-path", "tiny-helm-d", lambda t, r: ["--model.preset=null"],
     ["--model.pretrained=./no-such-model"], 2, r"model\.pretrained './no-such-model'"),
    ("pretrained-is-a-training-checkpoint", "tiny-helm-d", _training_checkpoint_as_pretrained, [], 2,
     r"model\.pretrained '.*step-00000002'.*config\.json"),
    # whatever the path looks like, one line naming the key and the path
    ("pretrained-missing-hub-like-path", "tiny-helm-d", lambda t, r: ["--model.preset=null"],
     ["--model.pretrained=no-such-owner-xyz/no-such-model-xyz"], 2,
     r"model\.pretrained.*no-such-owner-xyz/no-such-model-xyz"),
    ("pretrained-invalid-repo-id", "tiny-helm-d", lambda t, r: ["--model.preset=null"], ["--model.pretrained=my run/x"],
     2, r"model\.pretrained.*my run/x"),
    ("pretrained-is-the-checkpoints-folder", "tiny-helm-d", _checkpoints_folder_as_pretrained, [], 2,
     r"model\.pretrained '.*old-run/checkpoints'.*config\.json"),
    ("pretrained-is-a-file", "tiny-helm-d", _file_as_pretrained, [], 2, r"model\.pretrained '.*model\.safetensors'"),
    ("pretrained-is-a-run-folder", "tiny-helm-d", _run_folder_as_pretrained, [], 2,
     r"model\.pretrained '.*old-run'.*config\.json"),
    ("tokenizer-is-a-model-folder", "tiny-helm-d", _model_folder_as_tokenizer, [], 2,
     r"data\.tokenizer '.*model-without-tokenizer'.*tokenizer\.json"),
    ("preset-and-pretrained-both-set", "tiny-helm-d", lambda t, r: [], ["--model.pretrained=runs/x/final"], 2,
     r"model\.preset.*model\.pretrained"),
    ("preset-and-pretrained-neither-set", "tiny-helm-d", lambda t, r: [], ["--model.preset=null"], 2,
     r"model\.preset.*model\.pretrained"),
    # the remedy is not --resume, which was given ("starting from step 0" was printed before this line)
    ("resume-without-checkpoint-in-a-used-folder", "tiny-helm-d", _metrics_but_no_checkpoint, ["--resume"], 2,
     r"train\.output_dir .*run'.*no complete checkpoint to --resume from; --train\.overwrite=true starts over$"),
    # custom code runs only with model.trust_remote_code, never on a terminal's "y"
    ("remote-code-not-trusted", "tiny-helm-d", _remote_code_folder, [], 2, r"model\.pretrained.*trust_remote_code"),
    ("tokenizer-remote-code-not-trusted", "tiny-helm-d", _remote_code_tokenizer, [], 2,
     r"data\.tokenizer .*custom-tokenizer.*trust_remote_code"),
    ("optim-eps-inf", "tiny-helm-d", lambda t, r: [], ["--optim.eps=inf"], 2, r"optim\.eps.*inf"),
    ("optim-weight-decay-nan", "tiny-helm-d", lambda t, r: [], ["--optim.weight_decay=nan"], 2,
     r"optim\.weight_decay.*nan"),
    ("override-boolean-string", "tiny-helm-d", lambda t, r: [], ['--model.overrides.attention_bias="false"'], 2,
     r"model\.preset '.*': .*attention_bias"),
    ("override-tie-word-embeddings", "tiny-helm-d", lambda t, r: [], ["--model.overrides.tie_word_embeddings=true"],
     2, r"model\.preset '.*': .*tie_word_embeddings"),
    ("optim-betas-a-number", "tiny-helm-d", lambda t, r: [], ["--optim.betas=0.9"], 2, r"optim\.betas"),
    ("optim-betas-strings", "tiny-helm-d", lambda t, r: [], ["--optim.betas=[a,b]"], 2, r"optim\.betas"),
    ("optim-betas-three", "tiny-helm-d", lambda t, r: [], ["--optim.betas=[0.9,0.9,0.9]"], 2, r"optim\.betas"),
    ("recipe-section-a-number", "tiny-helm-d", _recipe_text("model: {preset: tiny-helm-d}\ntrain: 5\n"), [], 2,
     r"TrainConfig"),
    ("model-overrides-a-number", "tiny-helm-d", lambda t, r: [], ["--model.overrides=5"], 2, r"model\.overrides"),
    ("overwrite-a-user-folder", "tiny-helm-d", _user_folder, ["--train.overwrite=true"], 2,
     r"train\.output_dir .*/run'.*no run folder"),
]


@pytest.mark.parametrize("name, base, setup, args, code, message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_with_one_line(name, base, setup, args, code, message, tmp_path, run_data, capsys,
                                       monkeypatch):
    # a user at a terminal who answers "y" to transformers' "Do you wish to run the custom code?": train.py must
    # never let it ask (the recipe's model.trust_remote_code decides)
    monkeypatch.setattr("builtins.input", lambda *prompt: "y")
    if name == "fp16-without-cuda" and torch.cuda.is_available():
        pytest.skip("fp16 is allowed on a CUDA machine")
    if name == "output-dir-unwritable" and not os.path.isdir("/sys"):
        pytest.skip("no read-only /sys here")
    model = {} if base != "tiny-llama" else {"overrides": {"vocab_size": 320, "max_position_embeddings": 64}}
    recipe = write_recipe(tmp_path, run_data, base=base, train={"max_steps": 4, "save_every": 2},
                          demo={"prompt": None}, model=model)
    extra = setup(tmp_path, run_data) + args
    run = tmp_path / "run"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} if run.is_dir() else {}
    assert train_script.main(["--config", str(recipe), *extra]) == code
    assert all(p.is_file() and p.read_bytes() == data for p, data in before.items()), "a file of the folder changed"
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), captured.out + captured.err
    assert "Traceback" not in captured.out + captured.err
    assert "[train] data:" not in captured.out, "the problem was found only after loading the data"
    assert "starting from step 0" not in captured.out + captured.err, "a start announced, then refused"
    assert not list_checkpoints(tmp_path / "run" / "checkpoints")[1:], "a checkpoint was written"
    assert name == "output-dir-in-use" or _released(tmp_path / "run" / "train.lock")


def _recipe_with_bare_no(tmp_path):
    path = tmp_path / "bare-no.yaml"
    path.write_text(f"model: {{preset: tiny-helm-d}}\ntrain:\n  output_dir: {tmp_path / 'run'}\n  max_steps: 1\n"
                    "  mixed_precision: no\n")
    return path


# Recipes that are accepted though OmegaConf alone would refuse them: (case, recipe(tmp_path) or None for the
# shipped tiny recipe, overrides, key, value it resolves to)
ACCEPTED = [
    ("mixed-precision-no-on-the-command-line", None, ["train.mixed_precision=no"], "train.mixed_precision", "no"),
    ("mixed-precision-no-in-a-recipe", _recipe_with_bare_no, [], "train.mixed_precision", "no"),
    ("compile-by-default-where-it-pays", None, [], "train.compile", "auto"),
    ("compile-as-a-boolean", None, ["train.compile=true"], "train.compile", "true"),
    ("compile-off-as-a-boolean", None, ["train.compile=False"], "train.compile", "false"),
]


@pytest.mark.parametrize("case, recipe, overrides, key, value", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_recipe_spellings_that_are_accepted(case, recipe, overrides, key, value, tmp_path):
    """YAML 1.1 reads a bare `no` as false: train.mixed_precision, whose allowed strings include `no` (its
    default), takes false as `no`; --print-config then writes it back quoted."""
    from helm.training import describe, load_run_config

    path = recipe(tmp_path) if recipe else REPO / "configs" / "train" / "tiny-helm-d.yaml"
    config = load_run_config(path, [*overrides, f"train.output_dir={tmp_path / 'run'}"])
    section, name = key.split(".")
    assert getattr(getattr(config, section), name) == value
    (tmp_path / "printed.yaml").write_text(describe(config))
    assert getattr(getattr(load_run_config(tmp_path / "printed.yaml"), section), name) == value


def _poison_weights(value):
    def damage(checkpoint, monkeypatch):
        weights = load_file(checkpoint / "model.safetensors")
        key = next(k for k, v in weights.items() if v.is_floating_point())
        weights[key] = torch.full_like(weights[key], value)
        save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})
    return damage


def _nan_validation_of_the_saved_model(checkpoint, monkeypatch):
    """Finite weights whose validation loss is not: the check of the reloaded model (distributed=False) sees NaN."""
    real = train_script.validation_loss

    def validation_loss(model, validation, accelerator, batch_size, distributed=True):
        loss = real(model, validation, accelerator, batch_size, distributed=distributed)
        return loss if distributed else float("nan")

    monkeypatch.setattr(train_script, "validation_loss", validation_loss)


# A finished run whose newest checkpoint holds non-finite weights (its manifest re-hashed to match), resumed: it
# trains 0 steps and reaches the final save, where the reloaded model's validation loss is not finite; or finite
# weights whose validation loss is NaN. (case, damage(checkpoint, monkeypatch), culprit named)
NON_FINITE_FINAL = [
    ("nan-weights", _poison_weights(float("nan")), r"final|validation loss"),
    ("inf-weights", _poison_weights(float("inf")), r"final|validation loss"),
    ("nan-validation-loss", _nan_validation_of_the_saved_model, r"validation loss.*nan.*step-00000004"),
]


@pytest.mark.parametrize("case, damage, message", NON_FINITE_FINAL, ids=[c[0] for c in NON_FINITE_FINAL])
def test_final_is_never_replaced_by_a_non_finite_model(case, damage, message, tmp_path, run_data, capsys,
                                                       monkeypatch):
    """final/ is never written nor replaced when the model to be saved has non-finite weights or a non-finite
    validation loss: exit 3, as for NaN during training, and the good final/ stays as it was."""
    from helm.manifest import write_manifest

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 4, "save_every": 2}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0, capsys.readouterr()
    final = tmp_path / "run" / "final"
    kept = {p.name: p.read_bytes() for p in final.iterdir()}
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000004"
    damage(checkpoint, monkeypatch)
    (checkpoint / "manifest.json").unlink()
    write_manifest(checkpoint, 4)
    capsys.readouterr()
    code = train_script.main(["--config", str(recipe), "--resume"])
    captured = capsys.readouterr()
    # exit 3 from the validation loss, or 2 where from_pretrained itself refuses non-finite weights
    assert code in (2, 3), captured.out + captured.err
    [error] = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert re.search(message, error), error
    assert "Traceback" not in captured.err
    assert {p.name: p.read_bytes() for p in final.iterdir()} == kept
    assert not (tmp_path / "run" / ".tmp-final").exists()


def _schedule(config, max_steps: int) -> dict[int, float]:
    """The learning rate train.py's schedule gives each step 1..max_steps of a run of max_steps steps."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=config.optim.lr)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=round(config.optim.warmup_ratio * max_steps), num_training_steps=max_steps,
        min_lr_rate=config.optim.final_lr_ratio)
    rates = {}
    for step in range(1, max_steps + 1):
        rates[step] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
    return rates


def test_resume_may_change_max_steps_past_the_checkpoint(tmp_path, run_data, capsys):
    """Reliability probe item 5: --resume with another train.max_steps extends a run (or ends it earlier), as
    transformers' Trainer does, when the new length lies past the checkpoint's step; the warmup + cosine schedule is
    recomputed for the new length and the learning rate continues on it from the resumed step (logged lrs equal the
    new schedule's, not the old one's). A length at or before the checkpoint's step is refused (exit 2). Resuming
    from an earlier checkpoint of the run while later ones exist is refused (exit 2) naming them, nothing changed."""
    from helm.training import load_run_config
    from tests.test_train import read_metrics

    recipe = write_recipe(tmp_path, run_data, optim={"warmup_ratio": 0.25},
                          train={"max_steps": 4, "save_every": 2, "keep_last": 4, "eval_at_start": False},
                          demo={"prompt": None})
    config, run = load_run_config(recipe), tmp_path / "run"
    assert train_script.main(["--config", str(recipe)]) == 0, capsys.readouterr()
    capsys.readouterr()
    # extend: 4 -> 8 from the last checkpoint (a finished run)
    assert train_script.main(["--config", str(recipe), "--resume", "--train.max_steps=8"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "train.max_steps changed from 4 to 8" in out and "the learning rate of step 5 is 7.750e-03" in out, out
    rates = {m["step"]: m["lr"] for m in read_metrics(run) if "lr" in m}
    old, new = _schedule(config, 4), _schedule(config, 8)
    assert [rates[s] for s in range(1, 5)] == [old[s] for s in range(1, 5)]
    assert [rates[s] for s in range(5, 9)] == [new[s] for s in range(5, 9)], rates
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2, 4, 6, 8]
    assert json.loads((run / "final" / "manifest.json").read_text())["step"] == 8
    # from step 2 while 4, 6 and 8 exist: two histories would mix, so it is refused naming the later ones
    two = ["--config", str(recipe), "--resume", str(run / "checkpoints" / "step-00000002"), "--train.max_steps=6"]
    metrics = (run / "metrics.jsonl").read_text()
    assert train_script.main(two) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "step-00000002" in error and all(f"step-0000000{s}" in error for s in (4, 6, 8)), error
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2, 4, 6, 8]
    assert (run / "metrics.jsonl").read_text() == metrics
    # the same through a link of another name: the steps decide, not the names
    (tmp_path / "zz").symlink_to(run / "checkpoints" / "step-00000002")
    assert train_script.main([*two[:3], str(tmp_path / "zz"), *two[4:]]) == 2
    assert "step-00000008" in capsys.readouterr().err
    # end earlier: 8 -> 6 from step 2 (the checkpoint's recipe said 4), once the later ones are moved out
    for step in (4, 6, 8):
        shutil.move(run / "checkpoints" / f"step-0000000{step}", tmp_path / f"step-0000000{step}")
    assert train_script.main(two) == 0, capsys.readouterr()
    rates, six = {m["step"]: m["lr"] for m in read_metrics(run) if "lr" in m}, _schedule(config, 6)
    assert sorted(rates) == list(range(1, 7)) and [rates[s] for s in range(3, 7)] == [six[s] for s in range(3, 7)]
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2, 4, 6]
    capsys.readouterr()
    # a length not past the checkpoint's step: refused, naming both
    six_steps = str(run / "checkpoints" / "step-00000006")
    for steps in (5, 3):
        code = train_script.main(["--config", str(recipe), "--resume", six_steps, f"--train.max_steps={steps}"])
        captured = capsys.readouterr()
        assert code == 2, captured.out + captured.err
        [error] = [line for line in captured.err.splitlines() if line.startswith("error:")]
        assert re.search(rf"train\.max_steps={steps}.*step 6", error), error
    # unchanged (6, as step-00000006 was saved with): a finished run, resumed as before
    assert train_script.main(["--config", str(recipe), "--resume", six_steps, "--train.max_steps=6"]) == 0


def test_overwrite_of_a_run_folder_keeps_the_users_other_files(tmp_path, run_data, capsys):
    """train.overwrite deletes a run's checkpoints, metrics and final model and nothing else; a leftover
    checkpoints/.tmp-step-* of an interrupted write is removed on the next start."""
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 2}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0, capsys.readouterr()
    run = tmp_path / "run"
    assert (run / ".helm-train-run").is_file()
    (run / "notes.txt").write_text("mine")
    (run / "checkpoints" / ".tmp-step-00000003").mkdir()
    assert train_script.main(["--config", str(recipe), "--train.overwrite=true"]) == 0, capsys.readouterr()
    assert (run / "notes.txt").read_text() == "mine" and not (run / "checkpoints" / ".tmp-step-00000003").exists()
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [2]


def _checkpoint_weights_finite(run) -> list[int]:
    steps = []
    for step, path in list_checkpoints(run / "checkpoints"):
        verify_checkpoint(path)
        assert all(torch.isfinite(v).all() for v in load_file(path / "model.safetensors").values()), step
        steps.append(step)
    return steps


def test_diverging_run_stops_with_exit_3_and_keeps_only_finite_checkpoints(tmp_path, run_data, capsys):
    """An absurd learning rate from step 5 on (after a finite checkpoint at step 4) makes the weights NaN: the
    run stops at the next check with exit 3 and a message naming the step and the likely causes; no checkpoint
    of the diverged model is written and keep_last=1 does not prune the last finite one."""
    import helm.training.checkpoint as C

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 12, "save_every": 4, "keep_last": 1,
                                                     "log_every": 3}, demo={"prompt": None})
    real = C.save_checkpoint

    def poison_after_first(accelerator, output_dir, step, **kwargs):
        real(accelerator, output_dir, step, **kwargs)
        for group in accelerator._optimizers[0].param_groups:  # the scheduler scales this: NaN stays NaN
            group["initial_lr"] = group["lr"] = float("nan")

    original = train_script.save_checkpoint
    train_script.save_checkpoint = poison_after_first
    try:
        code = train_script.main(["--config", str(recipe)])
    finally:
        train_script.save_checkpoint = original
    captured = capsys.readouterr()
    assert code == 3, captured.out + captured.err
    [error] = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert re.search(r"non-finite .* at step 6\b", error) and "optim.lr" in error and "mixed_precision" in error, error
    assert "Traceback" not in captured.err
    run = tmp_path / "run"
    assert _checkpoint_weights_finite(run) == [4] and not (run / "final").exists()
    assert _released(run / "train.lock")


def test_huge_learning_rate_diverges_with_exit_3(tmp_path, run_data):
    """The same from the command line, as a user meets it: lr 1e6 without clipping, in a real process."""
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 12, "save_every": 1, "log_every": 6},
                          demo={"prompt": None})
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(recipe),
                             "--optim.lr=1e6", "--optim.grad_clip=null", "--optim.warmup_ratio=0"],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and re.search(r"non-finite .* at step \d+", result.stderr)
    _checkpoint_weights_finite(tmp_path / "run")


def test_a_config_yaml_of_an_earlier_train_py_still_loads_without_its_retired_keys(tmp_path, run_data):
    """Every config.yaml an earlier train.py wrote holds train.keep_best and demo.do_sample / temperature / top_k,
    which are gone: such a recipe loads, each retired key named in a warning; set on the command line, one is an
    unknown key as any other."""
    from helm.training.config import RETIRED

    recipe = write_recipe(tmp_path, run_data)
    current = load_run_config(recipe).to_dict()
    old = yaml.safe_load(recipe.read_text())
    old["train"]["keep_best"] = True
    old.setdefault("demo", {}).update(do_sample=True, temperature=0.8, top_k=40)
    recipe.write_text(yaml.safe_dump(old))
    with pytest.warns(UserWarning) as caught:
        assert load_run_config(recipe).to_dict() == current
    assert sorted(key for key in RETIRED if any(key in str(w.message) for w in caught)) == sorted(RETIRED)
    with pytest.raises(ConfigError, match="train.keep_best"):
        load_run_config(write_recipe(tmp_path, run_data, name="new.yaml"), ["train.keep_best=true"])


def test_ctrl_c_is_one_line_naming_the_newest_checkpoint_and_exit_130(tmp_path, run_data):
    """SIGINT (Ctrl-C) during training: no traceback, one line naming the step reached, the newest complete
    checkpoint and --resume, exit 130 (128 + SIGINT), the lock released; more Ctrl-Cs while it shuts down (a user
    pressing again) print nothing either. The run then resumes from that checkpoint."""
    import signal
    import time

    from tests.test_train import _wait_for, subprocess_env

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 100_000, "save_every": 2, "log_every": 1000},
                          demo={"prompt": None})
    # SIGINT at its default (a job started in the background inherits it ignored), in a session of its own
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", str(recipe)],
                               env=subprocess_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for(tmp_path / "run" / "checkpoints" / "step-00000002", process)
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:  # Ctrl-C, again every 20 ms until it has exited
        process.send_signal(signal.SIGINT)
        time.sleep(0.02)
    process.kill()  # nothing, unless it hung
    out, err = (stream.read().decode() for stream in (process.stdout, process.stderr))
    assert process.returncode == 130, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    step, newest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    match = re.fullmatch(rf"error: interrupted after step (\d+); .*{re.escape(str(newest))}.*--resume", line)
    assert match and int(match.group(1)) >= step, line
    assert _released(tmp_path / "run" / "train.lock")
    assert train_script.main(["--config", str(recipe), "--resume", f"--train.max_steps={step + 1}"]) == 0


# a full disk as the OS reports it, as torch.save reports it (a RuntimeError from its zip writer) and as safetensors
# reports it (model.safetensors): (error, fragment of the message)
DISK_FULL = {
    "oserror": (lambda path: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path + "/optimizer.bin"),
                "No space left on device"),
    "torch-runtimeerror": (lambda path: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 88832 "
                                                     "vs 88724"), "unexpected pos"),
    "safetensors-error": (lambda path: SafetensorError("Error while serializing: IoError(No space left on device (os "
                                                       "error 28))"), "os error 28"),
}


@pytest.mark.parametrize("kind", list(DISK_FULL))
def test_disk_full_while_saving_keeps_the_previous_checkpoint(kind, tmp_path, run_data, capsys, monkeypatch):
    from accelerate import Accelerator

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 12, "save_every": 4, "keep_last": 1},
                          demo={"prompt": None})
    real = Accelerator.save_state

    def full_disk(self, output_dir=None, **kwargs):
        if "step-00000008" in str(output_dir):
            real(self, output_dir, **kwargs)  # half written: then the disk fills up
            raise DISK_FULL[kind][0](str(output_dir))
        return real(self, output_dir, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", full_disk)
    code = train_script.main(["--config", str(recipe)])
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    [error] = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert "checkpoint of step 8" in error and "step-00000004" in error, error
    assert DISK_FULL[kind][1] in error and "MB free on its disk" in error and "file-size limit" in error, error
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in list_checkpoints(root)] == [4] and not list(root.glob(".tmp-*"))
    verify_checkpoint(root / "step-00000004")
    monkeypatch.undo()
    code = train_script.main(["--config", str(recipe), "--resume"])
    assert code == 0, capsys.readouterr()
    assert [s for s, _ in list_checkpoints(root)] == [12]


def test_disk_full_at_the_first_checkpoint_names_a_remedy_that_works(tmp_path, run_data, capsys, monkeypatch):
    """No checkpoint before it, so --resume cannot be the remedy (it was advised, and then refused)."""
    from accelerate import Accelerator

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 4, "save_every": 2}, demo={"prompt": None})

    def full_disk(self, output_dir=None, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(Accelerator, "save_state", full_disk)
    assert train_script.main(["--config", str(recipe)]) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert re.search(r"checkpoint of step 2 .*PytorchStreamWriter.*MB free on its disk.*--train\.overwrite=true$",
                     error), error
    monkeypatch.undo()
    assert train_script.main(["--config", str(recipe), "--train.overwrite=true"]) == 0, capsys.readouterr()
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2, 4]


def test_a_folder_train_py_cannot_write_is_named_with_the_right_remedy(tmp_path, run_data, capsys, monkeypatch):
    """Issue 34 re-probe: a read-only checkpoints/ was found only after training, and the message said to free
    space (77 GB were free); a read-only final/ was named by one file of the remote code, relative."""
    from accelerate import Accelerator

    import helm.training.checkpoint as checkpoint

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 1}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0
    capsys.readouterr()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "checkpoints" and real_access(path, mode))
    assert train_script.main(["--config", str(recipe), "--resume", "--train.max_steps=3"]) == 2
    out = capsys.readouterr()
    assert re.search(r"error: train\.output_dir .*: checkpoints cannot be written.*make them writable", out.err)
    assert "[train] data:" not in out.out
    monkeypatch.undo()

    def denied(self, output_dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", str(output_dir))

    monkeypatch.setattr(Accelerator, "save_state", denied)
    assert train_script.main(["--config", str(recipe), "--resume", "--train.max_steps=3"]) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert re.search(r"permission denied\): the previous checkpoint .*make '.*run/checkpoints' writable", error), error
    assert "free space" not in error
    monkeypatch.undo()

    def replace_denied(tmp, final):
        raise PermissionError(13, "Permission denied", "helm_nn_positional_base.py")

    monkeypatch.setattr(checkpoint, "finalize", lambda tmp, final: replace_denied(tmp, final) if final.name ==
                        "final" else Path(tmp).rename(final))
    assert train_script.main(["--config", str(recipe), "--resume", "--train.max_steps=3"]) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert re.search(r"could not replace '.*run/final' .*make it writable.*--resume", error), error
    assert not (tmp_path / "run" / ".tmp-final").exists()


def test_ctrl_c_while_the_libraries_load_is_one_line(tmp_path, run_data):
    """Issue 34 re-probe: a Ctrl-C in the seconds torch and transformers take to import was a traceback."""
    import signal
    import time

    from tests.test_train import subprocess_env

    recipe = write_recipe(tmp_path, run_data, demo={"prompt": None})
    process = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", str(recipe)], env=subprocess_env(),
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.5)  # the interpreter is up, the libraries are still loading
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err.decode()
    assert "Traceback" not in err.decode()
    assert [line for line in err.decode().splitlines() if line.startswith("error:")] == [
        "error: interrupted before training started; nothing was written"]
    assert not (tmp_path / "run").exists()


def test_resume_of_another_folders_checkpoint_never_replaces_a_run_unasked(tmp_path, run_data, capsys):
    """Second re-probe: --resume CHECKPOINT of another folder into an output_dir holding a run replaced its final/
    and checkpoints without train.overwrite, and mixed two runs in its metrics.jsonl."""
    from helm.manifest import hash_file

    other = write_recipe(tmp_path, run_data, "other.yaml", train={"max_steps": 2, "save_every": 1,
                                                                  "output_dir": str(tmp_path / "other")},
                         demo={"prompt": None})
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 1}, demo={"prompt": None})
    assert train_script.main(["--config", str(other)]) == 0 and train_script.main(["--config", str(recipe)]) == 0
    final = hash_file(tmp_path / "run" / "final" / "model.safetensors")
    theirs = tmp_path / "other" / "checkpoints" / "step-00000001"
    capsys.readouterr()
    assert train_script.main(["--config", str(recipe), "--resume", str(theirs)]) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert re.search(r"train\.output_dir .*run' already holds a run .*checkpoint of another folder", error), error
    assert hash_file(tmp_path / "run" / "final" / "model.safetensors") == final
    assert train_script.main(["--config", str(recipe), "--resume", str(theirs), "--train.overwrite=true"]) == 0
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)] == [2]  # the resumed run's own rows only (log_every=1, from step 1)


def test_resuming_a_finished_run_logs_its_final_validation_once(tmp_path, run_data, capsys):
    """Second re-probe: a --resume at the last step (after a failed final write) appended a second final row."""
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 1}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0
    assert train_script.main(["--config", str(recipe), "--resume"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([row for row in rows if row["step"] == 2 and "val_loss" in row]) == 1, rows
    capsys.readouterr()


def test_a_manifest_entry_of_the_wrong_shape_is_one_line(tmp_path, run_data, capsys):
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 1}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0
    manifest = tmp_path / "run" / "checkpoints" / "step-00000002" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"][next(iter(data["files"]))] = 5
    manifest.write_text(json.dumps(data))
    capsys.readouterr()
    assert train_script.main(["--config", str(recipe), "--resume", "--train.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: --resume .*step-00000002.*manifest\.json is unreadable.*unknown format.*resume from another checkpoint", err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("planted", ["custom_checkpoint_0.pkl", "optimizer.bin"])
def test_a_checkpoint_file_holding_a_pickled_object_is_one_line(planted, tmp_path, run_data, capsys):
    """Third re-probe: --resume of a checkpoint whose manifest matched a planted pickle was torch's traceback, advising
    weights_only=False (which would run it)."""
    import hashlib

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 1}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0
    folder = tmp_path / "run" / "checkpoints" / "step-00000002"
    torch.save({"planted": Path("x")}, folder / planted)
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / planted).read_bytes()
    manifest["files"][planted] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert train_script.main(["--config", str(recipe), "--resume", "--train.max_steps=3"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: --resume '.*step-00000002': .*holds more than tensors.*trust", err), err
    assert "weights_only=False" not in err


def test_rotation_keeps_a_checkpoint_holding_the_users_file(tmp_path, run_data, capsys, caplog):
    """Fourth re-probe: keep_last pruning deleted an old checkpoint folder whole, the user's file in it too."""
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 2, "keep_last": 1},
                          demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0
    note = tmp_path / "run" / "checkpoints" / "step-00000002" / "mynote.txt"
    note.write_text("mine")
    assert train_script.main(["--config", str(recipe), "--resume", "--train.max_steps=6"]) == 0
    assert note.read_text() == "mine"
    assert "kept" in caplog.text and "mynote.txt" in caplog.text
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2, 6]  # step 4 pruned as asked
    capsys.readouterr()


def test_an_unknown_key_of_a_known_section_is_never_matched_to_the_section(tmp_path, run_data, capsys):
    """Fifth re-probe: --train.foo=1 suggested 'train', a section, not a key."""
    recipe = write_recipe(tmp_path, run_data)
    assert train_script.main(["--config", str(recipe), "--train.foo=1"]) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert error.startswith("error: unknown key 'train.foo'") and "'train'?" not in error, error


def test_a_folder_given_as_the_recipe_is_named_as_a_folder(tmp_path, capsys):
    assert train_script.main(["--config", str(tmp_path)]) == 2
    assert re.search(r"error: --config '.*': a folder, not a recipe file", capsys.readouterr().err)


def test_ctrl_c_after_the_run_is_ignored_at_shutdown():
    """Second re-probe: a Ctrl-C while the interpreter shut down after a finished run raised in tqdm's atexit hook."""
    import signal

    previous = signal.signal(signal.SIGINT, train_script.stop_on_first_interrupt)
    try:
        assert train_script.main(["--config", "no-such-recipe.yaml"]) == 2
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_build_default_finishes_a_build_that_was_cut_short(tmp_path, monkeypatch):
    """Second re-probe: a data.dataset folder left by an interrupted build was used as it was (no tokenizer)."""
    from accelerate import Accelerator

    from helm.data.corpus import BUILD_MARKER

    built = []
    monkeypatch.setattr(train_script, "build_default_data", lambda root: built.append(root))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text('{"text": "half"}\n')
    cfg = load_run_config(write_recipe(tmp_path, tmp_path / "d", data={"build_default": True}))
    train_script.ensure_default_data(cfg, Accelerator(cpu=True))
    assert built == []  # the user's own data: used as it is
    (tmp_path / "d" / BUILD_MARKER).touch()
    train_script.ensure_default_data(cfg, Accelerator(cpu=True))
    assert built == [tmp_path / "d"]


def test_resume_in_a_fresh_folder_starts_from_step_0_and_says_so(tmp_path, run_data, capsys):
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 0}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe), "--resume"]) == 0
    assert "[train] --resume: no checkpoint in" in capsys.readouterr().out
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]


def test_lock_file_of_a_run_that_is_gone_does_not_block_and_the_lock_is_released(tmp_path, run_data, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.lock").write_text(str(dead.pid))
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 0}, demo={"prompt": None})
    code = train_script.main(["--config", str(recipe)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert _released(tmp_path / "run" / "train.lock")


def test_overwrite_is_explicit_and_resume_continues(tmp_path, run_data, capsys):
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 1}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0
    assert train_script.main(["--config", str(recipe)]) == 2  # refused: nothing deleted
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [1, 2]
    assert train_script.main(["--config", str(recipe), "--resume"]) == 0
    assert train_script.main(["--config", str(recipe), "--train.overwrite=true", "--train.keep_last=1"]) == 0
    assert [s for s, _ in list_checkpoints(tmp_path / "run" / "checkpoints")] == [2]
    capsys.readouterr()


def test_disk_full_while_writing_the_final_model(tmp_path, run_data, capsys, monkeypatch):
    """save_pretrained fails half way (safetensors reports ENOSPC as a SafetensorError): exit 2 naming final/,
    no .tmp-final left, the checkpoints intact, and --resume then writes final/."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 4, "save_every": 4}, demo={"prompt": None})
    real = PreTrainedModel.save_pretrained

    def full_disk(self, save_directory, *args, **kwargs):
        real(self, save_directory, *args, **kwargs)
        raise SafetensorError("Error while serializing: IoError(No space left on device (os error 28))")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full_disk)
    code = train_script.main(["--config", str(recipe)])
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    [error] = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert "could not write the final model" in error and "No space left on device" in error, error
    run = tmp_path / "run"
    assert not (run / "final").exists() and not (run / ".tmp-final").exists()
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [4]
    monkeypatch.undo()
    assert train_script.main(["--config", str(recipe), "--resume"]) == 0, capsys.readouterr()
    assert (run / "final" / "manifest.json").is_file()


@pytest.mark.parametrize("value, text", [(1.0, "1.0"), (234.17, "234.2"), (999_999.0, "999,999.0"),
                                         (1e6, "1.000e+06"), (math.exp(700), "1.014e+304")])
def test_perplexities_above_1e6_are_printed_in_scientific_notation(value, text):
    from helm.evaluation import format_perplexity

    assert format_perplexity(value) == text


def _shortened(folder):
    lines = (folder / "train.jsonl").read_text().splitlines(keepends=True)
    (folder / "train.jsonl").write_text("".join(lines[: len(lines) * 3 // 4]))


def _reshuffled(folder):
    lines = (folder / "train.jsonl").read_text().splitlines(keepends=True)
    (folder / "train.jsonl").write_text("".join(lines[1::2] + lines[::2]))


def _other_tokenizer(folder):
    config = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    config["eos_token"] = "<pad>" if config.get("eos_token") != "<pad>" else "<unk>"
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))


# (case, change to the data folder between the run and --resume, extra resume arguments, exit status, culprit)
CHANGED_DATA = [
    ("train-file-shortened", _shortened, [], 2, r"data file .*train\.jsonl.*--data\.resume_on_changed_data=true"),
    ("train-file-reshuffled", _reshuffled, [], 2, r"data file .*train\.jsonl"),
    ("validation-file-changed", lambda f: (f / "validation.jsonl").write_text(
        (f / "validation.jsonl").read_text()[:-300] + "\n"), [], 2, r"data file .*validation\.jsonl"),
    ("tokenizer-changed", _other_tokenizer, [], 2, r"tokenizer"),
    ("allowed-explicitly", _shortened, ["--data.resume_on_changed_data=true"], 0, None),
    ("unchanged", lambda f: None, [], 0, None),
    ("seq-len-changed", lambda f: None, ["--data.seq_len=16"], 2,
     r"data\.seq_len: 32 in the checkpoint, 16 now.*--data\.resume_on_changed_data=true"),
    ("seq-len-allowed-explicitly", lambda f: None, ["--data.seq_len=16", "--data.resume_on_changed_data=true"], 0,
     None),
    ("other-keys-still-refused", lambda f: None, ["--data.seq_len=16", "--optim.lr=0.5",
                                                  "--data.resume_on_changed_data=true"], 2,
     r"optim\.lr: 0\.01 in the checkpoint, 0\.5 now"),
]


@pytest.mark.parametrize("case, change, extra, code, message", CHANGED_DATA, ids=[c[0] for c in CHANGED_DATA])
def test_resume_on_a_changed_data_stream_is_refused_naming_the_change(case, change, extra, code, message, tmp_path,
                                                                      run_data, capsys):
    """Issue 25 item 3: every checkpoint records a fingerprint of its data stream (each file's size and SHA-256, the
    tokenizer, seq_len, packing); --resume on another stream is exit 2 naming what changed, unless
    data.resume_on_changed_data says so."""
    import shutil

    folder = tmp_path / "data"
    shutil.copytree(run_data, folder)
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 4, "save_every": 2}, demo={"prompt": None},
                          data={"dataset": str(folder), "tokenizer": str(folder / "tokenizer")})
    assert train_script.main(["--config", str(recipe), "--train.max_steps=2"]) == 0, capsys.readouterr()
    change(folder)
    capsys.readouterr()
    result = train_script.main(["--config", str(recipe), "--train.max_steps=2", "--resume", *extra])
    captured = capsys.readouterr()
    assert result == code, captured.out + captured.err
    if message:
        [error] = [line for line in captured.err.splitlines() if line.startswith("error:")]
        assert "step-00000002" in error, error
        error = captured.err[captured.err.index(error):].strip()  # the list of differences follows the line
        assert re.search(message, error), error
        assert "[train] data:" not in captured.out, "the data was read before the refusal"


def test_an_output_dir_that_is_itself_a_link_is_fine(tmp_path, run_data, capsys):
    """The user's choice of where the run folder lives (a link to scratch space) is not refused."""
    real = tmp_path / "scratch-run"
    real.mkdir()
    (tmp_path / "run").symlink_to(real, target_is_directory=True)
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 2}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0, capsys.readouterr()
    assert (real / "final" / "manifest.json").is_file()


def test_a_null_text_in_a_stream_is_one_error_line(tmp_path, run_data, capsys):
    """Issue 25 item 10: a stream is tokenised as it is read, so {"text": null} is met during training: still one
    line, exit 2, naming the key and the field."""
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 4, "save_every": 0}, demo={"prompt": None})
    extra = _data_folder(tmp_path, run_data, b'{"text": "ok"}\n{"text": null}\n' * 50)
    code = train_script.main(["--config", str(recipe), *extra, "--data.streaming=true"])
    captured = capsys.readouterr()
    assert code == 2, captured.out + captured.err
    [error] = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert re.search(r"data\.dataset .*/data.*'text'", error), error
    assert "Traceback" not in captured.err and not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("base", ["tiny-helm-d", "tiny-llama"])
def test_saved_configs_carry_the_tokenizers_special_ids(base, tmp_path, run_data, capsys):
    """Issue 23 item 7: with a tokenizer whose eos/bos are id 2 and pad id 3 (the presets say 0/0/1), final/'s
    config.json and generation_config.json carry the tokenizer's ids, for HELM and for the Euclidean baselines, so
    generate stops at the user's eos; an id set in model.overrides stays the user's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_data / "tokenizer")
    eos, pad = tokenizer.convert_ids_to_tokens([2, 3])
    tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token = eos, eos, pad
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    model = {} if base != "tiny-llama" else {"overrides": {"vocab_size": 320, "max_position_embeddings": 64}}
    recipe = write_recipe(tmp_path, run_data, base=base, model=model, train={"max_steps": 1, "save_every": 0},
                          demo={"prompt": None}, data={"tokenizer": str(tmp_path / "tokenizer")})
    assert train_script.main(["--config", str(recipe)]) == 0, capsys.readouterr()
    final = tmp_path / "run" / "final"
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((final / name).read_text())
        assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (2, 2, 3), (name, saved)
    capsys.readouterr()
    assert train_script.main(["--config", str(recipe), "--train.overwrite=true",
                              "--model.overrides.pad_token_id=5"]) == 0, capsys.readouterr()
    assert json.loads((final / "config.json").read_text())["pad_token_id"] == 5


def test_a_pretrained_model_takes_the_tokenizers_special_ids(tmp_path, run_data, capsys):
    """The model.pretrained path of the test above: a folder saved with the preset's ids (0/0/1), trained on with a
    tokenizer whose eos/bos are id 2 and pad id 3, saves config.json and generation_config.json with 2/2/3 (its own
    generation_config.json is read as it was saved, so it must be rewritten too)."""
    from transformers import AutoTokenizer

    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 1, "save_every": 0}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0, capsys.readouterr()
    tokenizer = AutoTokenizer.from_pretrained(run_data / "tokenizer")
    eos, pad = tokenizer.convert_ids_to_tokens([2, 3])
    tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token = eos, eos, pad
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    first = tmp_path / "first"
    (tmp_path / "run").rename(first)
    assert train_script.main(["--config", str(recipe), "--model.preset=null", f"--model.pretrained={first / 'final'}",
                              f"--data.tokenizer={tmp_path / 'tokenizer'}"]) == 0, capsys.readouterr()
    for name in ("config.json", "generation_config.json"):
        saved = json.loads((tmp_path / "run" / "final" / name).read_text())
        assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (2, 2, 3), (name, saved)


def test_build_default_never_writes_into_the_users_own_data(tmp_path, run_data, capsys):
    """The tiny recipes say data.build_default: true; pointed at a folder of the user's own data (no corpus
    manifest), train.py trains on it as it is. It rebuilt the default corpus there before, overwriting train.jsonl,
    validation.jsonl and tokenizer/."""
    import hashlib
    import shutil

    mine = tmp_path / "mine"
    shutil.copytree(run_data, mine)

    def digests():
        return {p.relative_to(mine).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(mine.rglob("*")) if p.is_file()}

    before = digests()
    recipe = write_recipe(tmp_path, run_data, data={"dataset": str(mine), "build_default": True},
                          train={"max_steps": 2, "save_every": 0}, demo={"prompt": None})
    code = train_script.main(["--config", str(recipe)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert digests() == before and "building the offline default data" not in out


def _error_line(captured) -> str:
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in captured.out + captured.err, captured.out + captured.err
    return errors[0]


def test_a_home_relative_path_means_the_home_folder(tmp_path, run_data, capsys, monkeypatch):
    """Reliability probe E075: --train.output_dir='~/x' (quoted, so the shell leaves it) wrote into a folder
    literally named '~' in the current directory. '~' is expanded in the path-valued recipe keys (output_dir, data
    folder, tokenizer, pretrained model) and in --resume PATH."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    (home / "data").symlink_to(run_data)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 2, "save_every": 2}, demo={"prompt": None})
    paths = ["--train.output_dir=~/run", "--data.dataset=~/data", "--data.tokenizer=~/data/tokenizer"]
    assert train_script.main(["--config", str(recipe), *paths]) == 0, capsys.readouterr()
    assert (home / "run" / "final" / "manifest.json").is_file() and not (cwd / "~").exists()
    assert yaml.safe_load((home / "run" / "config.yaml").read_text())["train"]["output_dir"] == str(home / "run")
    capsys.readouterr()
    code = train_script.main(["--config", str(recipe), *paths, "--resume", "~/run/checkpoints/step-00000002"])
    assert code == 0, capsys.readouterr()
    code = train_script.main(["--config", str(recipe), "--train.output_dir=~/second", "--model.preset=null",
                              "--model.pretrained=~/run/final", "--train.max_steps=1", "--train.save_every=0"])
    assert code == 0, capsys.readouterr()
    assert (home / "second" / "final" / "manifest.json").is_file() and not (cwd / "~").exists()


def test_resume_of_what_is_no_checkpoint_names_it_and_changes_nothing(tmp_path, run_data, capsys):
    """--resume of a file, a run folder, its checkpoints/ or final/, another folder or a half-written step folder:
    exit 2, one line naming --resume and the path, never advice to delete it, and nothing written."""
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 4, "save_every": 2}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe)]) == 0, capsys.readouterr()
    run = tmp_path / "run"
    (other := tmp_path / "other").mkdir()
    (half := run / "checkpoints" / "step-00000006").mkdir()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for path in (run / "checkpoints" / "step-00000004" / "model.safetensors", run, run / "checkpoints",
                 run / "final", other, half):
        capsys.readouterr()
        code = train_script.main(["--config", str(recipe), "--train.max_steps=6", f"--resume={path}"])
        captured = capsys.readouterr()
        assert code == 2, captured.out + captured.err
        error = _error_line(captured)
        assert error.startswith(f"error: --resume {str(path)!r}") and "delete" not in error, error
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

