"""Probe 8: ``from_pretrained`` of a PEFT adapter folder whose base model cannot be loaded (P303, P327, P351), and
``AutoTokenizer.from_pretrained`` of a tokenizer whose JSON files are damaged (S010, S020, S030); probe 9: a
tokenizer folder whose tokenizer.json is a folder, not a tokenizers file, or missing (K230, K231, K232).

``transformers`` loads the base model an adapter folder's ``adapter_config.json`` names; for a base of null it said
"AutoConfig.from_pretrained(None): got None", naming neither the folder nor the adapter. A damaged tokenizer file
raised a bare ``JSONDecodeError`` that named no file. ``helm.models.loading.local_path_problem`` names both (after
``transformers`` fails, for the Auto classes; before loading, for the zoo's own classes). Each table states the case
and the message fragment after ``Class.from_pretrained(path): `` (None: it loads)."""

import json
import re
import warnings
from pathlib import Path

import peft
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import helm.models
from tests.helpers import tiny_model

LOADERS = {"helm_d": ["AutoModelForCausalLM", "HelmDForCausalLM"],
           "helm_mice": ["AutoModelForCausalLM", "HelmMiCEForCausalLM"]}
REMEDY = (r"load the base model, then PeftModel\.from_pretrained\(base, '\S*adapter'\) or "
          r"base\.load_adapter\('\S*adapter'\)")


def _without(key):
    def edit(settings, tmp):
        del settings[key]
    return edit


def _set(key, value):
    def edit(settings, tmp):
        settings[key] = value(tmp) if callable(value) else value
    return edit


# (case, how adapter_config.json is edited (its settings and tmp_path; bytes: its new contents), message fragment)
ADAPTER_FOLDERS = [
    ("base null", _set("base_model_name_or_path", None),
     r"is a PEFT adapter folder whose adapter_config\.json names no base model \(base_model_name_or_path is null\): "
     + REMEDY + "$"),
    ("base empty", _set("base_model_name_or_path", ""),
     r"is a PEFT adapter folder whose adapter_config\.json names no base model \(base_model_name_or_path is \"\"\): "
     + REMEDY),
    ("no base key", _without("base_model_name_or_path"),
     r"is a PEFT adapter folder whose adapter_config\.json names no base model \(it has no base_model_name_or_path\): "
     + REMEDY),
    ("base a missing local folder", _set("base_model_name_or_path", lambda tmp: str(tmp / "gone")),
     r"is a PEFT adapter folder whose base model '\S*gone' \(base_model_name_or_path in adapter_config\.json\) "
     r"cannot be loaded: no such folder; " + REMEDY + ", or correct base_model_name_or_path$"),
    ("adapter_config.json cut short", b'{"peft_type": "LORA",',
     r"is a PEFT adapter folder, but its adapter_config\.json is not valid JSON \(Expecting property name enclosed in "
     r"double quotes at line 1, column 22\)"),
    ("base saved", None, None),
]


@pytest.mark.parametrize("family, loader", [(f, loader) for f, loaders in LOADERS.items() for loader in loaders])
@pytest.mark.parametrize("case, edit, match", ADAPTER_FOLDERS, ids=[c[0] for c in ADAPTER_FOLDERS])
def test_an_adapter_folder_whose_base_cannot_load_is_named(tmp_path, family, loader, case, edit, match):
    import transformers

    tiny_model(family).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft.get_peft_model(base, peft.LoraConfig(r=4)).save_pretrained(tmp_path / "adapter")
    file = tmp_path / "adapter" / "adapter_config.json"
    if isinstance(edit, bytes):
        file.write_bytes(edit)
    elif edit is not None:
        settings = json.loads(file.read_text())
        edit(settings, tmp_path)
        file.write_text(json.dumps(settings))
    cls = getattr(helm.models, loader, None) or getattr(transformers, loader)
    if match is None:
        loaded = cls.from_pretrained(tmp_path / "adapter")
        assert any("lora_A" in name for name, _ in loaded.named_parameters())
        return
    shown = re.escape(repr(str(tmp_path / "adapter")))
    with pytest.raises((OSError, ValueError), match=rf"^{loader}\.from_pretrained\({shown}\): {match}") as err:
        cls.from_pretrained(tmp_path / "adapter")
    if loader.startswith("Auto"):  # transformers' own error is kept as the cause
        assert err.value.__cause__ is not None


BROKEN = b"{broken"
# (case, the file written (relative to the folder given), its contents (or a function of the file it replaces),
# message fragment); tokenizer.json and tokenizer_config.json replace the tokenizer's own, the others are added
TOKENIZER_FILES = [
    ("tokenizer.json broken", "tokenizer.json", BROKEN,
     r"tokenizer\.json is not valid JSON \(Expecting property name enclosed in double quotes at line 1, column 2\)$"),
    ("tokenizer.json cut short", "tokenizer.json", b'{\n  "version": "1.0",\n',
     r"tokenizer\.json is not valid JSON \(Expecting property name enclosed in double quotes at line 3, column 1\)"),
    ("tokenizer.json with a BOM", "tokenizer.json", lambda old: b"\xef\xbb\xbf" + old,
     r"tokenizer\.json starts with a UTF-8 byte-order mark, which transformers' JSON reader refuses"),
    ("tokenizer_config.json broken", "tokenizer_config.json", BROKEN, r"tokenizer_config\.json is not valid JSON"),
    ("special_tokens_map.json broken", "special_tokens_map.json", BROKEN,
     r"special_tokens_map\.json is not valid JSON"),
    ("added_tokens.json broken", "added_tokens.json", BROKEN, r"added_tokens\.json is not valid JSON"),
    ("in a subfolder", "sub/tokenizer.json", BROKEN, r"sub/tokenizer\.json is not valid JSON \(Expecting property"),
    ("intact", None, None, None),
]


@pytest.mark.parametrize("case, name, contents, match", TOKENIZER_FILES, ids=[c[0] for c in TOKENIZER_FILES])
def test_a_damaged_tokenizer_file_is_named(tokenizer, tmp_path, case, name, contents, match):
    """The message names the file (and line and column); the exception stays a ``ValueError`` with the
    ``JSONDecodeError`` as its cause."""
    folder = tmp_path / "model"
    subfolder = name.rpartition("/")[0] if name else ""
    tokenizer.save_pretrained(folder / subfolder)
    kwargs = {"subfolder": subfolder} if subfolder else {}
    if match is None:
        assert AutoTokenizer.from_pretrained(folder, **kwargs)("hello world")["input_ids"]
        return
    (folder / name).write_bytes(contents((folder / name).read_bytes()) if callable(contents) else contents)
    with pytest.raises(ValueError, match=rf"^AutoTokenizer\.from_pretrained\({re.escape(repr(str(folder)))}\): "
                                         rf"{match}") as err:
        AutoTokenizer.from_pretrained(folder, **kwargs)
    assert isinstance(err.value.__cause__, json.JSONDecodeError)


def _replace_tokenizer_json(folder, contents):
    (folder / "tokenizer.json").unlink()
    if contents is not None:
        (folder / "tokenizer.json").write_bytes(contents)


# probe 9: (case, damage of a saved tokenizer folder, exception, message fragment); transformers said "Couldn't
# instantiate the backend tokenizer from one of ..." (K230, K232) or raised a bare KeyError 'added_tokens' (K231)
DAMAGED_TOKENIZER_FOLDERS = [
    ("tokenizer.json a folder", lambda folder: (folder / "tokenizer.json").unlink()
     or (folder / "tokenizer.json").mkdir(), ValueError,
     r"tokenizer\.json is a folder, not the tokenizers file that tokenizer\.save_pretrained writes; copy the "
     r"tokenizer's files$"),
    ("tokenizer.json {}", lambda folder: _replace_tokenizer_json(folder, b"{}"), OSError,
     r"tokenizer\.json is not a tokenizers file \(no 'model' key; tokenizer\.save_pretrained writes one\)"),
    ("tokenizer.json without added_tokens", lambda folder: _replace_tokenizer_json(
        folder, b'{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}'), OSError,
     r"tokenizer\.json is not a tokenizers file \(no 'added_tokens' key"),
    ("tokenizer.json deleted", lambda folder: _replace_tokenizer_json(folder, None), ValueError,
     r"the folder '\S*' has no tokenizer\.json \(nor a vocabulary file: tokenizer\.model, vocab\.json, .*\), which "
     r"its tokenizer_config\.json's \w+ is built from: copy the tokenizer's files$"),
]


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_tokenizer_file_that_is_a_folder_is_named_before_loading(tokenizer, tmp_path, name):
    """re-probe 10 L108: with tokenizer_config.json a folder, transformers loaded the tokenizer without its special
    tokens (eos, bos and pad None) and without a word."""
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    (folder / name).unlink(missing_ok=True)
    (folder / name).mkdir()
    with pytest.raises(OSError, match=rf"^AutoTokenizer\.from_pretrained\({re.escape(repr(str(folder)))}\): "
                                      rf"{re.escape(name)} is a folder, not the file tokenizer\.save_pretrained writes "
                                      r"\(the tokenizer would load without what it holds\); copy the tokenizer's files$"):
        AutoTokenizer.from_pretrained(folder)


# the classes a tokenizer folder is loaded with and the name their messages begin with (PreTrainedTokenizerFast is
# transformers' TokenizersBackend); re-probe 10 L109/L110: the tokenizer class itself said "Couldn't instantiate the
# backend tokenizer" or raised a bare KeyError, only AutoTokenizer named the file
TOKENIZER_LOADERS = [(AutoTokenizer, "AutoTokenizer"), (PreTrainedTokenizerFast, "TokenizersBackend")]


@pytest.mark.parametrize("loader, shown", TOKENIZER_LOADERS, ids=[c[1] for c in TOKENIZER_LOADERS])
@pytest.mark.parametrize("case, damage, exc, match", DAMAGED_TOKENIZER_FOLDERS,
                         ids=[c[0] for c in DAMAGED_TOKENIZER_FOLDERS])
def test_a_tokenizer_folder_without_a_usable_tokenizer_json_is_named(tokenizer, tmp_path, loader, shown, case, damage,
                                                                     exc, match):
    """The message names tokenizer.json and what is wrong with it; transformers' error is kept as the cause (a
    ``ValueError`` stays one, a ``KeyError`` becomes an ``OSError``, as for the other path messages)."""
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    damage(folder)
    with pytest.raises(exc, match=rf"^{shown}\.from_pretrained\({re.escape(repr(str(folder)))}\): {match}") as err:
        loader.from_pretrained(folder)
    assert err.value.__cause__ is not None
    # transformers' own error, not the tokenizer class's explained one (AutoTokenizer calls the class: one message)
    assert "from_pretrained(" not in str(err.value.__cause__)


@pytest.mark.parametrize("loader, shown", TOKENIZER_LOADERS, ids=[c[1] for c in TOKENIZER_LOADERS])
@pytest.mark.parametrize("given, missing", [({}, ["eos", "bos", "pad"]), ({"eos_token": "<|endoftext|>"}, ["bos", "pad"]),
                                            ({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
                                              "pad_token": "<|pad|>"}, [])],
                         ids=["none given", "eos given (re-probe 11 M227)", "all given"])
def test_a_tokenizer_folder_without_tokenizer_config_warns(tokenizer, tmp_path, loader, shown, given, missing):
    """re-probe 10 L111: tokenizer.json without tokenizer_config.json loaded with eos, bos and pad None, without a
    word (transformers keeps the special tokens in tokenizer_config.json); it warns, naming the file and the tokens
    still None (those passed as keywords are set)."""
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    (folder / "tokenizer_config.json").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = loader.from_pretrained(folder, **given)
    notes = [str(w.message) for w in caught if "tokenizer_config.json" in str(w.message)]
    assert [name for name in ("eos", "bos", "pad") if getattr(loaded, f"{name}_token") is None] == missing
    if not missing:
        assert notes == []
    else:
        assert notes == [f"{shown}.from_pretrained({str(folder)!r}): the folder has tokenizer.json but no "
                         f"tokenizer_config.json, so the tokenizer has no {', '.join(missing)} token "
                         f"({' and '.join(missing)} None: without eos generation will not stop at an end of text, "
                         "without pad padding fails); copy the tokenizer's files, or pass "
                         f"{', '.join(name + '_token=' for name in missing)}"]
    with warnings.catch_warnings(record=True) as caught:  # an intact folder is silent
        warnings.simplefilter("always")
        tokenizer.save_pretrained(tmp_path / "intact")
        assert loader.from_pretrained(tmp_path / "intact").eos_token == "<|endoftext|>"
    assert not [w for w in caught if "tokenizer_config.json" in str(w.message)]


def _settings_loaders():
    from transformers import GenerationConfig

    return {"GenerationConfig": GenerationConfig.from_pretrained, "PeftConfig": peft.PeftConfig.from_pretrained,
            "LoraConfig": peft.LoraConfig.from_pretrained}


# (case, the path given (a function of the saved folder), message fragment); the settings file's name follows
# "holding" for a file given. transformers and PEFT read each of these as a hub id: "Repo id must be in the form
# 'repo_name' or 'namespace/repo_name'", or PEFT's "Can't find 'adapter_config.json' at '~/x'"
SETTINGS_PATHS = [
    ("missing folder", lambda saved: saved.parent / "gone", r"no such folder$"),
    ("tilde path", lambda saved: "~/saved", r"'~' is not expanded by transformers or PEFT \(it would be read as a hub "
                                            r"id, or as a folder named '~' in the current directory\); pass "
                                            r"os\.path\.expanduser\(\.\.\.\) = '\S+/saved'"),
    ("None", lambda saved: None, r"got None; pass a folder written by save_pretrained or a hub model id"),
    ("a file", lambda saved: saved / "the_settings.json", r"expects a folder \(holding \S+.json.*\), not a file; use "
                                                          r"'\S+saved'$"),
    ("the folder", lambda saved: saved, None),
]


@pytest.mark.parametrize("loader", ["GenerationConfig", "PeftConfig", "LoraConfig"])
@pytest.mark.parametrize("case, where, match", SETTINGS_PATHS, ids=[c[0] for c in SETTINGS_PATHS])
def test_a_settings_path_that_can_load_nothing_is_named(tmp_path, monkeypatch, loader, case, where, match):
    """A generation config's or an adapter's settings loaded from a path that is missing, starts with '~', is None
    or is a file is named before the hub is asked; the folder loads."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    saved = tmp_path / "saved"
    model = tiny_model("helm_d")
    model.generation_config.save_pretrained(saved)
    peft.get_peft_model(model, peft.LoraConfig(r=2)).save_pretrained(saved)
    (saved / "the_settings.json").write_text("{}")
    path = where(saved)
    if match is None:
        assert _settings_loaders()[loader](path) is not None
        return
    with pytest.raises(OSError, match=rf"^\w+\.from_pretrained\({re.escape(repr(str(path) if path else None))}\): "
                                      rf"{match}"):
        _settings_loaders()[loader](path)


# (file of a save_pretrained folder made a folder, the loaders that read it, message fragment after the file name);
# transformers loaded the model with default generation settings (generation_config.json) or without its weights'
# check (manifest.json), or said "no config.json" / "model.safetensors is missing"
CHECKPOINT_ENTRIES = [
    ("config.json", ["AutoModelForCausalLM", "HelmDForCausalLM", "AutoConfig"],
     r"is a folder, not the file save_pretrained writes; copy the checkpoint's files$"),
    ("model.safetensors", ["AutoModelForCausalLM", "HelmDForCausalLM"],
     r"is a folder, not the file save_pretrained writes \(the model would load without it or fail on it\)"),
    ("generation_config.json", ["AutoModelForCausalLM", "HelmDForCausalLM", "GenerationConfig"],
     r"is a folder, not the file save_pretrained writes"),
    ("manifest.json", ["AutoModelForCausalLM", "HelmDForCausalLM"],
     r"is a folder, not the file save_pretrained writes \(the model would load without it or fail on it\)"),
]


@pytest.mark.parametrize("name, loaders, match", CHECKPOINT_ENTRIES, ids=[c[0] for c in CHECKPOINT_ENTRIES])
def test_a_checkpoint_file_that_is_a_folder_is_named(tmp_path, name, loaders, match):
    import transformers

    folder = tmp_path / "model"
    tiny_model("helm_d").save_pretrained(folder)
    (folder / name).unlink()
    (folder / name).mkdir()
    for loader in loaders:
        cls = getattr(helm.models, loader, None) or getattr(transformers, loader)
        with pytest.raises((OSError, ValueError), match=rf"^\w+\.from_pretrained\({re.escape(repr(str(folder)))}\): "
                                                        rf"{re.escape(name)} {match}"):
            cls.from_pretrained(folder)


@pytest.mark.parametrize("how", ["PeftModel.from_pretrained", "load_adapter", "PeftConfig.from_pretrained"])
def test_an_adapter_config_that_is_a_folder_is_named(tmp_path, how):
    """adapter_config.json a folder: "the folder has no adapter_config.json" (our own message) before."""
    peft.get_peft_model(tiny_model("helm_d"), peft.LoraConfig(r=2)).save_pretrained(tmp_path / "adapter")
    (tmp_path / "adapter" / "adapter_config.json").unlink()
    (tmp_path / "adapter" / "adapter_config.json").mkdir()
    base = tiny_model("helm_d")
    load = {"PeftModel.from_pretrained": lambda path: peft.PeftModel.from_pretrained(base, path),
            "load_adapter": base.load_adapter, "PeftConfig.from_pretrained": peft.PeftConfig.from_pretrained}[how]
    with pytest.raises((OSError, ValueError), match=r"adapter_config\.json is a folder, not the file "
                                                    r"(PeftModel\.)?save_pretrained writes; (save the adapter again|"
                                                    r"copy the files save_pretrained wrote)$"):
        load(tmp_path / "adapter")


@pytest.mark.parametrize("loader", ["AutoTokenizer", "PreTrainedTokenizerFast", "GenerationConfig", "PeftConfig"])
@pytest.mark.parametrize("subfolder", ["nope", "saved/tokenizer.json"], ids=["missing", "a file"])
def test_a_missing_subfolder_is_named(tokenizer, tmp_path, loader, subfolder):
    """subfolder= that the folder lacks: tokenizers said "Couldn't instantiate the backend tokenizer", PEFT "Can't
    find 'adapter_config.json' at <the folder>" (no word of the subfolder)."""
    import transformers

    tokenizer.save_pretrained(tmp_path / "saved")
    cls = getattr(peft, loader, None) or getattr(transformers, loader)
    with pytest.raises((OSError, ValueError), match=rf"^\w+\.from_pretrained\({re.escape(repr(str(tmp_path)))}\): has "
                                                    rf"no subfolder {re.escape(repr(subfolder))} \(subfolder=\)$"):
        cls.from_pretrained(tmp_path, subfolder=subfolder)


def test_a_tokenizer_file_given_for_the_folder_is_refused(tokenizer, tmp_path):
    """re-probe 11 M203: PreTrainedTokenizerFast.from_pretrained(<the tokenizer.json file>) loaded it alone, without
    its special tokens (eos, bos and pad None), and without a word; AutoTokenizer refused it."""
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    file = tmp_path / "tokenizer" / "tokenizer.json"
    for loader, shown in TOKENIZER_LOADERS:
        with pytest.raises(OSError, match=rf"^{shown}\.from_pretrained\({re.escape(repr(str(file)))}\): expects a "
                                          rf"tokenizer folder, not a file; use {re.escape(repr(str(file.parent)))}$"):
            loader.from_pretrained(file)


def test_a_tokenizer_config_holding_a_list_is_named(tokenizer, tmp_path):
    """re-probe 11 M234: a bare "AttributeError: 'list' object has no attribute 'get'" (AutoTokenizer; the class:
    "TypeError: pop expected at most 1 argument, got 2"), kept as the cause."""
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text("[]")
    for loader, shown in TOKENIZER_LOADERS:
        with pytest.raises(OSError, match=rf"^{shown}\.from_pretrained\('\S+'\): tokenizer_config\.json holds a JSON "
                                          r"list, not an object$") as err:
            loader.from_pretrained(tmp_path / "tokenizer")
        assert isinstance(err.value.__cause__, (AttributeError, TypeError))


def test_a_tilde_tokenizer_file_is_named(tmp_path, monkeypatch):
    """re-probe 11 M187: PreTrainedTokenizerFast(tokenizer_file='~/...') said "Couldn't instantiate the backend
    tokenizer from one of ...", naming neither the file nor the '~'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match=r"^TokenizersBackend\(tokenizer_file='~/tk/tokenizer\.json'\): '~' is not "
                                         r"expanded by transformers or PEFT \(the file would not be found\); pass "
                                         rf"os\.path\.expanduser\(\.\.\.\) = "
                                         rf"{re.escape(repr(str(tmp_path / 'tk' / 'tokenizer.json')))}$"):
        PreTrainedTokenizerFast(tokenizer_file="~/tk/tokenizer.json")


def test_a_processor_saved_to_a_tilde_path_is_refused(tmp_path, monkeypatch):
    """re-probe 11 M189: an image processor's save_pretrained('~/ip') made a folder named '~' (transformers' class)."""
    from transformers.image_processing_base import ImageProcessingMixin

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^ImageProcessingMixin\.save_pretrained\('~/ip'\): '~' is not expanded"):
        ImageProcessingMixin().save_pretrained("~/ip")
    assert not any(tmp_path.iterdir())


def test_helpers_expand_a_tilde_path(tmp_path, monkeypatch):
    """re-probe 11 M269-M272, O015: list_checkpoints('~/run/checkpoints') returned [] for a folder that held
    checkpoints; verify_checkpoint, load_config and convert_official_checkpoint said a '~' path "does not exist"."""
    import shutil

    from helm import convert_official_checkpoint, load_config
    from helm.training.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run" / "checkpoints" / "step-00000002").mkdir(parents=True)
    assert list_checkpoints("~/run/checkpoints") == [(2, tmp_path / "run" / "checkpoints" / "step-00000002")]
    with pytest.raises(CheckpointError) as err:  # found, and refused for what it lacks
        verify_checkpoint("~/run/checkpoints/step-00000002")
    assert "does not exist" not in str(err.value)
    load_config("helm-d-115m").save_pretrained(tmp_path / "cfg")
    assert load_config("~/cfg/config.json").hidden_size == load_config("helm-d-115m").hidden_size
    shutil.copy(Path(__file__).parents[1] / "fixtures" / "official" / "helm_d_tiny.pt", tmp_path / "off.pt")
    assert convert_official_checkpoint("~/off.pt") is not None


@pytest.mark.parametrize("loader", ["AutoModelForCausalLM", "HelmDForCausalLM"])
def test_a_generation_config_that_is_not_json_is_named(tmp_path, loader):
    """re-probe 12 S2168: a damaged generation_config.json was skipped without a word (the model loaded with default
    generation settings)."""
    import transformers

    folder = tmp_path / "model"
    tiny_model("helm_d").save_pretrained(folder)
    (folder / "generation_config.json").write_text("{nope")
    cls = getattr(helm.models, loader, None) or getattr(transformers, loader)
    with pytest.raises(OSError, match=rf"^\w+\.from_pretrained\({re.escape(repr(str(folder)))}\): "
                                      r"generation_config\.json is not valid JSON \(Expecting property name enclosed in "
                                      r"double quotes at line 1, column 2\) \(the model would load with default "
                                      r"generation settings\); fix it, or delete it to load those$"):
        cls.from_pretrained(folder)


@pytest.mark.parametrize("loader, keyword", [("GenerationConfig", "pretrained_model_name"),
                                             ("PeftConfig", "pretrained_model_name_or_path")])
def test_a_settings_folder_given_by_keyword_is_checked_and_loads(tmp_path, loader, keyword):
    """The path checks find the folder under the loader's own parameter name: PeftConfig.from_pretrained(
    pretrained_model_name_or_path=...) was refused as 'got None' by a check that looked for GenerationConfig's."""
    model = tiny_model("helm_d")
    model.generation_config.save_pretrained(tmp_path / "saved")
    peft.get_peft_model(model, peft.LoraConfig(r=2)).save_pretrained(tmp_path / "saved")
    load = _settings_loaders()[loader]
    assert load(**{keyword: tmp_path / "saved"}) is not None
    with pytest.raises(OSError, match=r"^\w+\.from_pretrained\('~/saved'\): '~' is not expanded"):
        load(**{keyword: "~/saved"})
