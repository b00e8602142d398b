"""What is wrong with a local path given to ``from_pretrained``, said in one sentence.

``transformers`` reads any path that is not an existing folder as a hub id, so a mistyped folder says "Repo id must
be in the form 'repo_name' or 'namespace/repo_name'", a folder without ``config.json`` says "Unrecognized model ...
should have a `model_type` key", a ``config.json`` with a byte-order mark "is not a valid JSON file", a damaged
``tokenizer.json`` raises a bare ``JSONDecodeError`` (one that is a folder, ``{}`` or missing: "Couldn't instantiate
the backend tokenizer", a bare ``KeyError``), and a PEFT adapter folder whose ``adapter_config.json`` names
no base model says "AutoConfig.from_pretrained(None)". :func:`local_path_problem` names the actual problem. The
zoo's own classes check before loading (:func:`check_local_folder`). :func:`install_auto_load_messages` wraps the
Auto classes (``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM``, ... and ``AutoTokenizer``): a path that can
load nothing (:func:`unloadable_path_problem`: None, an empty or ``~`` path, a missing folder) is refused at once,
and any other failure is re-raised with :func:`local_path_problem` when it finds one. A load that succeeds is
untouched, a re-raised exception is an ``OSError`` or, for transformers' ``ValueError``, a ``ValueError``, with
transformers' own as its ``__cause__``, and a failure the path does not explain (a hub id, a bad keyword, damaged
weights) is transformers' error unchanged."""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import threading
import warnings
from pathlib import Path

from ..manifest import MANIFEST, STATE_FILE, manifest_problem, read_manifest, run_of

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# the files of a PEFT adapter folder (PeftModel.save_pretrained)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# the files of a save_pretrained folder that from_pretrained reads when they are there (a generation_config.json
# that is a folder is skipped without a word: the model loads with default generation settings)
CHECKPOINT_FILES = ("config.json", "generation_config.json", MANIFEST) + WEIGHT_FILES
# weight files and their shard indexes (not the code, config or tokenizer files, which users edit)
WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")
# The files transformers builds a tokenizer from: a fast tokenizer's tokenizer.json, or a slow one's vocabulary
# (sentencepiece models, BPE vocab + merges, WordPiece vocab); tokenizer_config.json alone may do for a tokenizer
# that needs no vocabulary file (ByT5's bytes) or names custom code.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                    "sentencepiece.bpe.model")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json") + VOCABULARY_FILES[1:]
# the JSON files of a tokenizer folder, each read with json.load (a damaged one raises a JSONDecodeError that names
# no file)
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def tokenizer_files_problem(folder: str | os.PathLike) -> str | None:
    """Why the local ``folder`` cannot hold a tokenizer: it has none of :data:`TOKENIZER_FILES` (nor a
    ``*.tiktoken`` file); ``None`` otherwise. Checked before ``AutoTokenizer.from_pretrained``, whose message for
    such a folder (a model folder saved without its tokenizer) is about sentencepiece or tiktoken not being
    installed."""
    folder = Path(folder).expanduser()
    if any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return None
    hint = ""
    if (folder / "final" / "tokenizer.json").is_file():
        hint = f"; its final/ folder holds one ({folder / 'final'})"
    elif (folder / "config.json").is_file():
        hint = "; it is a model folder (config.json) saved without its tokenizer"
    return f"{str(folder)!r} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}, *.tiktoken){hint}"


# every file a tokenizer folder may hold that transformers reads when it is there
TOKENIZER_FOLDER_FILES = TOKENIZER_FILES + ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
# the files some save_pretrained writes (a model's, a tokenizer's, an adapter's, a processor's; README.md: PEFT's model
# card); one of them that is a folder in the save directory is refused before writing (save_directory_problem)
SAVED_FILES = CHECKPOINT_FILES + TOKENIZER_FOLDER_FILES + (ADAPTER_CONFIG, *ADAPTER_WEIGHTS, "README.md",
                                                           "preprocessor_config.json", "processor_config.json")


def folder_entry_problem(folder: Path, names, writer: str) -> str | None:
    """``"<name> is a folder, not the file <writer> writes"`` for the first of ``names`` (files of ``folder`` that a
    loader reads when they are there) that is a folder, or None. A loader skips such an entry, or says the file is
    missing or "Is a directory"."""
    name = next((name for name in names if (folder / name).is_dir()), None)
    return name and f"{name} is a folder, not the file {writer} writes"


def tokenizer_folder_entry_problem(where, subfolder: str = "") -> str | None:
    """Why the local tokenizer folder ``where`` (``/subfolder``) cannot be read as it is: one of the files a tokenizer
    reads (:data:`TOKENIZER_FOLDER_FILES`) is a folder. transformers skips a ``tokenizer_config.json`` that is a
    folder and loads the tokenizer without its special tokens (eos, bos and pad None), without a word. None for
    anything else (hub ids included)."""
    if not isinstance(where, (str, os.PathLike)) or not os.fspath(where).strip():
        return None
    folder = Path(os.fspath(where)) / (subfolder or "")
    if not folder.is_dir():
        return None
    # (a tokenizer.json that is a folder fails in transformers, and is named after it does: local_path_problem)
    problem = folder_entry_problem(folder, [name for name in TOKENIZER_FOLDER_FILES if name != "tokenizer.json"],
                                   "tokenizer.save_pretrained")
    return problem and f"{problem} (the tokenizer would load without what it holds); copy the tokenizer's files"


_TARGET = "a folder written by save_pretrained or a hub model id ('owner/name')"


def looks_like_local_path(where) -> bool:
    """Whether ``where`` can only be a local path: a ``PathLike``, or a str that no hub id matches (hub ids are
    ``name`` or ``owner/name``, never starting with ``.``, ``/`` or ``~``)."""
    if isinstance(where, os.PathLike):
        return True
    parts = where.replace(os.sep, "/").split("/")
    return where.startswith((".", "/", "~")) or len(parts) > 2 or not all(parts)


def config_file_problem(file: Path) -> str | None:
    """Why ``file`` (an existing ``config.json``) cannot be read as a config (:func:`json_file_problem`); None when
    it reads as an object."""
    return json_file_problem(file, holds="config fields")


def json_file_problem(file: Path, *, holds: str | None = None) -> str | None:
    """Why ``file`` (an existing JSON file that ``transformers`` reads: a config, a tokenizer's files, an adapter's
    config) cannot be read as a JSON object, as a sentence beginning with the file's name: a UTF-8 byte-order mark
    (which ``transformers``' reader refuses), text that is not UTF-8 or not JSON (with the line and column), or JSON
    that is not an object (of ``holds``, when given); None when it reads as an object."""
    try:
        raw = file.read_bytes()
    except OSError as error:
        return f"{file.name} cannot be read ({error.strerror or error})"
    if raw.startswith(b"\xef\xbb\xbf"):
        return (f"{file.name} starts with a UTF-8 byte-order mark, which transformers' JSON reader refuses; re-save "
                "it as plain UTF-8")
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        return f"{file.name} is not UTF-8 text ({error.reason} at byte {error.start})"
    except json.JSONDecodeError as error:
        return f"{file.name} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})"
    if not isinstance(value, dict):
        return f"{file.name} holds a JSON {type(value).__name__}, not an object" + (f" of {holds}" if holds else "")
    return None


def unloadable_path_problem(where) -> str | None:
    """Why ``where`` can load nothing, whatever is asked of it, or None: None, not a path, an empty path, a ``~``
    path (transformers does not expand it: a str is read as a hub id, a ``PathLike`` as a folder literally named
    ``~`` in the current directory, which is refused too), or a path that no hub id matches
    (:func:`looks_like_local_path`) and that does not exist."""
    if where is None:
        return f"got None; pass {_TARGET}"
    if not isinstance(where, (str, os.PathLike)):
        return f"expects a str or os.PathLike, got {type(where).__name__}; pass {_TARGET}"
    text = os.fspath(where)
    if not text.strip():
        return f"got an empty path; pass {_TARGET}"
    path = Path(text)
    if text.startswith("~"):
        found = "that folder exists" if path.expanduser().is_dir() else "there is no such folder either"
        if path.exists():  # a folder literally named '~' in the current directory (an earlier unexpanded save)
            found += f"; a folder {os.path.join('.', text)!r} exists in the current directory: pass that to mean it"
        return tilde_problem(text, "it would be read as a hub id, or as a folder named '~' in the current "
                                   "directory") + f" ({found})"
    if path.exists():
        return None
    return "no such folder" if looks_like_local_path(where) else None


def tilde_problem(text: str, consequence: str) -> str:
    """The sentence for a path ``text`` that starts with ``~``: transformers and PEFT do not expand it
    (``consequence`` says what becomes of it), and the path to pass instead."""
    return (f"'~' is not expanded by transformers or PEFT ({consequence}); pass os.path.expanduser(...) = "
            f"{os.path.expanduser(text)!r}")


def tilde_save_problem(save_directory) -> str | None:
    """Why ``save_pretrained(save_directory)`` must not write: a path starting with ``~`` (transformers does not
    expand it, so the save would create a folder named ``~`` in the current directory); None otherwise."""
    if not isinstance(save_directory, (str, os.PathLike)) or not os.fspath(save_directory).startswith("~"):
        return None
    return tilde_problem(os.fspath(save_directory), "the save would create a folder named '~' in the current "
                         "directory") + "; nothing was written"


def save_directory_problem(save_directory) -> tuple[type[Exception], str] | None:
    """Why ``save_pretrained(save_directory)`` must not write, and the exception to raise: an empty path or not a
    path (``ValueError``; transformers: "No such file or directory: ''"), one starting with ``~``
    (:func:`tilde_save_problem`, ``ValueError``), an existing file or a path under one (``NotADirectoryError``;
    transformers logs an error and saves nothing, or raises an ``AssertionError``), a folder there in place of a file
    the save writes (:data:`SAVED_FILES`; ``IsADirectoryError``: the writers' "Is a directory (os error 21)" named
    no file); None otherwise. Checked by every ``save_pretrained`` before anything is written
    (:func:`checking_save_directory`)."""
    if not isinstance(save_directory, (str, os.PathLike)) or not os.fspath(save_directory).strip():
        return ValueError, "save_directory is empty (or not a path); give a folder (it is created if missing)"
    if problem := tilde_save_problem(save_directory):
        return ValueError, problem
    path = Path(save_directory)
    blocking = next((p for p in (path, *path.parents) if p.is_file()), None)
    if blocking is not None:
        what = "is an existing file" if blocking == path else f"lies under {str(blocking)!r}, an existing file"
        return NotADirectoryError, f"the save directory {what}; give a folder (it is created if missing)"
    if path.is_dir() and (problem := folder_entry_problem(path, SAVED_FILES, "save_pretrained")):
        return IsADirectoryError, (f"in the save directory, {problem} there; move it away or save elsewhere "
                                   "(nothing was written)")
    return None


def local_path_problem(where, *, subfolder: str = "", need_config: bool = True, json_file_ok: bool = False,
                       tokenizer: bool = False, need_model_type: bool = False) -> str | None:
    """Why ``where`` cannot be loaded as a local checkpoint, as a sentence that follows ``from_pretrained(where)``;
    None when it may be loaded (a folder whose ``config.json`` reads as an object, or a str that may be a hub id).

    ``need_config=False``: a folder without ``config.json`` is fine (a ``config=`` was passed, a GGUF file is
    named); a PEFT adapter folder (``adapter_config.json``) never needs one, but it must name a base model that can
    be loaded (:func:`adapter_folder_problem`). ``json_file_ok``: a ``.json`` file is a config
    (``AutoConfig.from_pretrained("config.json")``). ``tokenizer``: a tokenizer folder (no ``config.json`` needed)
    that holds tokenizer files whose JSON files read (:func:`tokenizer_json_problem`). ``need_model_type``: the
    ``config.json`` must name its ``model_type`` (the Auto classes pick the class by it)."""
    if problem := unloadable_path_problem(where):
        return problem
    path = Path(os.fspath(where))
    if path.is_file():
        if json_file_ok and path.suffix == ".json":
            return config_file_problem(path)
        folder = "a tokenizer folder" if tokenizer else "the checkpoint folder (with config.json)"
        return f"expects {folder}, not a file; use {str(path.parent)!r}"
    folder = path / subfolder if subfolder else path
    if subfolder and path.is_dir() and not folder.is_dir():
        return f"has no subfolder {subfolder!r} (subfolder=)"
    if tokenizer:
        if not folder.is_dir():
            return None
        if (folder / "tokenizer.json").is_dir():
            return (f"{(folder / 'tokenizer.json').relative_to(path).as_posix()} is a folder, not the tokenizers file "
                    "that tokenizer.save_pretrained writes; copy the tokenizer's files")
        if problem := tokenizer_files_problem(folder):
            return f"the folder {problem}"
        return tokenizer_json_problem(folder, path) or missing_vocabulary_problem(folder)
    if not folder.is_dir():
        return None
    config = folder / "config.json"
    if config.is_dir():
        return f"{folder_entry_problem(folder, ['config.json'], 'save_pretrained')}; copy the checkpoint's files"
    if config.is_file():
        if problem := config_file_problem(config):
            return problem
        if need_model_type and "model_type" not in json.loads(config.read_text(encoding="utf-8")):
            return ('config.json has no "model_type" key, by which the Auto classes pick the model class; add it '
                    '(e.g. "model_type": "helm_d"), or load with the model\'s own class (HelmDForCausalLM, ...)')
        return None
    if (folder / "adapter_config.json").is_file():  # transformers loads the base model it names, then the adapter
        return adapter_folder_problem(folder)
    if not need_config:
        return None
    if (run := run_of(folder)) is not None:
        what = "a training checkpoint" if (folder / STATE_FILE).is_file() else \
            "the checkpoints/ folder" if folder != run else "a run folder"
        return (f"{what} of train.py (no config.json), not a save_pretrained folder: load the run's model, "
                f"{str(run / 'final')!r}, or continue training with train.py --resume")
    weights = sorted(p.name for p in folder.iterdir() if WEIGHT_FILE.match(p.name))
    held = f"it holds {', '.join(weights)} but no config.json" if weights else "it has no config.json"
    return (f"not a checkpoint folder: {held} (a save_pretrained folder holds config.json and the weights); save "
            "the model's config there (model.config.save_pretrained), or pass config=")


# the keys of a tokenizers file (tokenizer.json) that transformers reads unconditionally: {} raised a bare
# KeyError 'added_tokens'
TOKENIZERS_FILE_KEYS = ("model", "added_tokens")


def tokenizer_json_problem(folder: Path, path: Path) -> str | None:
    """Why one of the tokenizer's JSON files in ``folder`` (:data:`TOKENIZER_JSON_FILES`) cannot be read
    (:func:`json_file_problem`), or a ``tokenizer.json`` that is a JSON object but not a tokenizers file (it lacks
    one of :data:`TOKENIZERS_FILE_KEYS`), naming the file relative to ``path`` (the path given to
    ``from_pretrained``); None when all those present read as objects."""
    for name in TOKENIZER_JSON_FILES:
        file = folder / name
        if file.is_file() and (problem := json_file_problem(file)):
            shown = file.relative_to(path).as_posix()
            return shown + problem[len(name):]
    file = folder / "tokenizer.json"
    if file.is_file():
        keys = json.loads(file.read_text(encoding="utf-8"))
        if missing := next((key for key in TOKENIZERS_FILE_KEYS if key not in keys), None):
            return (f"{file.relative_to(path).as_posix()} is not a tokenizers file (no {missing!r} key; "
                    "tokenizer.save_pretrained writes one); copy the tokenizer's files")
    return None


def missing_vocabulary_problem(folder: Path) -> str | None:
    """Why the tokenizer folder ``folder`` cannot build its tokenizer: its ``tokenizer_config.json`` names a fast
    (``tokenizers``-backed) tokenizer class, but the folder has no ``tokenizer.json`` nor another vocabulary file
    (:data:`VOCABULARY_FILES`, ``*.tiktoken``) to build it from (transformers: "Couldn't instantiate the backend
    tokenizer from one of ..."); None otherwise, and for a class that needs no vocabulary file (ByT5's bytes)."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    config = folder / "tokenizer_config.json"
    if not config.is_file() or any((folder / name).exists() for name in VOCABULARY_FILES) \
            or any(folder.glob("*.tiktoken")):
        return None
    name = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
    cls = tokenizer_class_from_name(name) if isinstance(name, str) else None
    if not (isinstance(cls, type) and issubclass(cls, TokenizersBackend)):
        return None
    return (f"the folder {str(folder)!r} has no tokenizer.json (nor a vocabulary file: "
            f"{', '.join(VOCABULARY_FILES[1:])}), which its tokenizer_config.json's {name} is built from: copy the "
            "tokenizer's files")


def adapter_folder_problem(folder: Path) -> str | None:
    """Why ``from_pretrained`` cannot load the PEFT adapter folder ``folder`` (an ``adapter_config.json``, no
    ``config.json``): ``transformers`` loads the base model that ``adapter_config.json`` names
    (``base_model_name_or_path``), then the adapter onto it, so an unreadable ``adapter_config.json``, one that
    names no base model (PEFT writes null for a model built from a config), or a base that can load nothing
    (:func:`unloadable_path_problem`: a local folder that does not exist) is named with the way to load the adapter
    by hand. None otherwise."""
    file = folder / "adapter_config.json"
    if problem := json_file_problem(file, holds="adapter settings"):
        return f"is a PEFT adapter folder, but its {problem}"
    settings = json.loads(file.read_text(encoding="utf-8"))
    base = settings.get("base_model_name_or_path")
    shown = repr(str(folder))
    remedy = f"load the base model, then PeftModel.from_pretrained(base, {shown}) or base.load_adapter({shown})"
    if not isinstance(base, str) or not base.strip():
        found = f"base_model_name_or_path is {json.dumps(base)}" if "base_model_name_or_path" in settings else \
            "it has no base_model_name_or_path"
        return f"is a PEFT adapter folder whose adapter_config.json names no base model ({found}): {remedy}"
    if problem := unloadable_path_problem(base):
        return (f"is a PEFT adapter folder whose base model {base!r} (base_model_name_or_path in "
                f"adapter_config.json) cannot be loaded: {problem}; {remedy}, or correct base_model_name_or_path")
    return None


def weights_identity(where, *, subfolder: str = "", revision=None) -> str:
    """A name for the weights ``from_pretrained(where)`` loaded, equal for two loads of the same files: for a local
    folder its weight files' real paths, sizes and modification times; for a hub id the id, subfolder and commit.
    A KV cache records the identity of the model that filled it (:class:`~helm.models.modeling_common.CacheOrigin`)."""
    folder = Path(str(where)).expanduser() / (subfolder or "")
    if folder.is_dir():
        files = sorted(f for f in folder.iterdir() if WEIGHT_FILE.match(f.name) and f.is_file())
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        return "local:" + json.dumps(stats)
    return f"hub:{where}/{subfolder}@{revision}"


def device_map_problem(device_map) -> str | None:
    """Why ``device_map`` (a device, its name or index, a strategy name, or a dict of them) names a CUDA device this
    machine lacks, or None (torch would raise "Torch not compiled with CUDA enabled" or "invalid device ordinal")."""
    import torch

    specs = device_map.values() if isinstance(device_map, dict) else [device_map]
    for spec in specs:
        if isinstance(spec, str) and spec in ("auto", "balanced", "balanced_low_0", "sequential", "disk"):
            continue
        if isinstance(spec, int) and not isinstance(spec, bool):  # an index of the machine's accelerator
            accelerator = torch.accelerator.current_accelerator()
            count = torch.accelerator.device_count() if accelerator is not None else 0
            if not 0 <= spec < count:
                return (f"device_map={device_map!r} names accelerator {spec}, but this machine has {count} "
                        f"accelerator device(s); use device_map='auto' (or 'cpu')")
            continue
        try:
            device = torch.device(spec)
        except (RuntimeError, TypeError):
            return f"device_map={device_map!r} names no device (a device, e.g. 'cpu' or 'cuda:0', or 'auto')"
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda" and (device.index or 0) >= count:
            return (f"device_map={device_map!r} names {device}, but this machine has {count} CUDA device(s); use "
                    "device_map='auto' (or 'cpu')")
    return None


def check_local_path(name: str, where, **options) -> None:
    """An ``OSError`` beginning ``{name}.from_pretrained(where):`` with :func:`local_path_problem` (given
    ``options``), if it finds one."""
    if problem := local_path_problem(where, **options):
        raise OSError(f"{name}.from_pretrained({_shown(where)}): {problem}")


def check_local_folder(name: str, where, *, config=None, subfolder: str = "", gguf_file=None) -> None:
    """An ``OSError`` beginning ``{name}.from_pretrained(where):`` for a local path that is not a checkpoint folder
    (:func:`local_path_problem`), and the manifest check of folders written by ``save_pretrained`` or ``train.py``:
    weights changed on disk after they were written (truncation, bit rot) are refused instead of loaded."""
    check_local_path(name, where, subfolder=subfolder, need_config=config is None and gguf_file is None)
    if not isinstance(where, (str, os.PathLike)):
        return
    path = Path(where) / subfolder if subfolder else Path(where)
    if path.is_dir() and (problem := folder_entry_problem(path, CHECKPOINT_FILES, "save_pretrained")):
        raise OSError(f"{name}.from_pretrained({_shown(where)}): {problem} (the model would load without it or fail "
                      "on it); copy the checkpoint's files")
    if (path / "generation_config.json").is_file() and (problem := json_file_problem(
            path / "generation_config.json", holds="generation settings")):  # transformers skips it without a word
        raise OSError(f"{name}.from_pretrained({_shown(where)}): {problem} (the model would load with default "
                      "generation settings); fix it, or delete it to load those")
    if (path / MANIFEST).is_file():
        try:
            problem = manifest_problem(path, read_manifest(path), WEIGHT_FILE.match)
        except (OSError, ValueError, KeyError, TypeError) as error:
            problem = f"has an unreadable {MANIFEST} ({error})"
        if problem:
            raise OSError(f"{name}.from_pretrained({_shown(where)}): the checkpoint {problem}; re-save or re-download "
                          f"it (or delete {MANIFEST} to load it anyway)")


def _shown(where) -> str:
    return repr(os.fspath(where)) if isinstance(where, os.PathLike) else repr(where)


def missing_tokenizer_config_note(where, tokenizer, subfolder: str = "") -> str | None:
    """Why the tokenizer just loaded from the local folder ``where`` (``/subfolder``) lacks special tokens: the
    folder has a ``tokenizer.json`` but no ``tokenizer_config.json`` (where eos, bos and pad are kept), and some of
    them are None (those passed as keywords are set). None otherwise (hub ids included)."""
    if not isinstance(where, (str, os.PathLike)):
        return None
    folder = Path(os.fspath(where)) / (subfolder or "")
    if not (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").exists():
        return None
    missing = [name for name in ("eos", "bos", "pad") if getattr(tokenizer, f"{name}_token", None) is None]
    if not missing:
        return None
    return (f"the folder has tokenizer.json but no tokenizer_config.json, so the tokenizer has no "
            f"{', '.join(missing)} token ({' and '.join(missing)} None: without eos generation will not stop at an "
            "end of text, without pad padding fails); copy the tokenizer's files, or pass "
            f"{', '.join(name + '_token=' for name in missing)}")


# set while a tokenizer's from_pretrained wrapped by _explained runs: AutoTokenizer.from_pretrained calls the
# tokenizer class's (also wrapped), and only the outer call checks and explains
_TOKENIZER_LOAD = threading.local()


def _explained(original, **options):
    """``original`` (a ``from_pretrained`` classmethod's function), re-raising its ``OSError`` / ``ValueError`` /
    ``TypeError`` / ``KeyError`` with :func:`local_path_problem` when that finds one (a ``ValueError`` as a
    ``ValueError``, the others as an ``OSError``; transformers reads ``base_model_name_or_path`` of an adapter's
    config by key, and a tokenizer_config.json holding a list with ``.get``). With ``tokenizer=True`` it also refuses,
    before loading, a tokenizer file that is a folder (:func:`tokenizer_folder_entry_problem`) and a file given in
    place of the folder (the tokenizer classes load a lone tokenizer.json without its special tokens), and warns
    when the loaded tokenizer lacks its special tokens (:func:`missing_tokenizer_config_note`)."""
    tokenizer = options.get("tokenizer", False)

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, **kwargs):
        if tokenizer and getattr(_TOKENIZER_LOAD, "active", False):
            return original(cls, pretrained_model_name_or_path, *args, **kwargs)
        if problem := unloadable_path_problem(pretrained_model_name_or_path):  # transformers would fail (slowly)
            raise OSError(f"{cls.__name__}.from_pretrained({_shown(pretrained_model_name_or_path)}): {problem}")
        subfolder = kwargs.get("subfolder") or ""
        if tokenizer and (problem := tokenizer_folder_entry_problem(pretrained_model_name_or_path, subfolder) or (
                Path(os.fspath(pretrained_model_name_or_path)).is_file() and local_path_problem(
                    pretrained_model_name_or_path, tokenizer=True))):
            # transformers would load without it (a tokenizer.json file alone: without its special tokens)
            raise OSError(f"{cls.__name__}.from_pretrained({_shown(pretrained_model_name_or_path)}): {problem}")
        outer = getattr(_TOKENIZER_LOAD, "active", False)
        _TOKENIZER_LOAD.active = outer or tokenizer
        try:
            loaded = original(cls, pretrained_model_name_or_path, *args, **kwargs)
            if tokenizer and (note := missing_tokenizer_config_note(pretrained_model_name_or_path, loaded, subfolder)):
                warnings.warn(f"{cls.__name__}.from_pretrained({_shown(pretrained_model_name_or_path)}): {note}",
                              UserWarning, stacklevel=2)
            return loaded
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            problem = local_path_problem(
                pretrained_model_name_or_path, subfolder=subfolder,
                need_config=kwargs.get("config") is None and kwargs.get("gguf_file") is None, **options)
            if problem is None:
                raise
            kind = ValueError if isinstance(error, ValueError) else OSError
            raise kind(f"{cls.__name__}.from_pretrained({_shown(pretrained_model_name_or_path)}): {problem}") \
                from error
        finally:
            _TOKENIZER_LOAD.active = outer

    from_pretrained.__helm_explained__ = True
    return from_pretrained


def settings_path_problem(where, file: str, holds: str, subfolder: str = "") -> str | None:
    """Why ``where`` (with ``subfolder``) cannot be the folder a settings file ``file`` is read from (``holds``
    describes it), as a sentence that follows ``from_pretrained(where)``: it can load nothing
    (:func:`unloadable_path_problem`), it is an existing file, it lacks ``subfolder``, or its ``file`` is a folder or
    not a JSON object (:func:`json_file_problem`); None otherwise (a hub id included)."""
    if problem := unloadable_path_problem(where):
        return problem
    path = Path(os.fspath(where))
    folder = path / subfolder
    if path.is_file():
        return f"expects a folder (holding {holds}), not a file; use {str(path.parent)!r}"
    if subfolder and path.is_dir() and not folder.is_dir():
        return f"has no subfolder {subfolder!r} (subfolder=)"
    if problem := folder_entry_problem(folder, [file], "save_pretrained"):
        return f"{problem}; copy the files save_pretrained wrote"
    problem = (folder / file).is_file() and json_file_problem(folder / file, holds=holds)
    return problem and f"{problem}; fix it or save it again"


def _refusing(method, refusal):
    """``method`` (a function taking its owner, an instance or a class, first) raising the exception
    ``refusal(owner, value, kwargs)`` returns, if any, before it runs: ``value`` is the argument after the owner
    (given by position or by its name). The arguments are passed on unchanged. A method wrapped once is returned as
    it is (the installs are idempotent)."""
    if getattr(method, "__helm_checked__", False):
        return method
    name = list(inspect.signature(method).parameters)[1]

    @functools.wraps(method)
    def checked(owner, *args, **kwargs):
        if (error := refusal(owner, args[0] if args else kwargs.get(name), kwargs)) is not None:
            raise error
        return method(owner, *args, **kwargs)

    checked.__helm_checked__ = True
    return checked


def checking_folder(from_pretrained, file: str, holds: str):
    """``from_pretrained`` (a classmethod's function that reads the file ``file`` from a folder, described by
    ``holds``; ``config_file_name=`` may name another) refusing what :func:`settings_path_problem` finds before
    transformers or PEFT read the path as a hub id ("Repo id must be in the form ...", "Can't find
    'adapter_config.json'")."""
    def refusal(cls, where, kwargs):
        if problem := settings_path_problem(where, kwargs.get("config_file_name") or file, holds,
                                            kwargs.get("subfolder") or ""):
            return OSError(f"{cls.__name__}.from_pretrained({_shown(where)}): {problem}")
        return None

    return _refusing(from_pretrained, refusal)


def _save_directory_refusal(self, save_directory, kwargs=None):
    """:func:`save_directory_problem`'s exception for ``self.save_pretrained(save_directory)``, or None."""
    if found := save_directory_problem(save_directory):
        kind, problem = found
        return kind(f"{type(self).__name__}.save_pretrained({str(save_directory)!r}): {problem}")
    return None


def check_save_directory(owner, save_directory) -> None:
    """Raise :func:`save_directory_problem`'s exception, beginning ``{type(owner).__name__}.save_pretrained(...)``."""
    if (error := _save_directory_refusal(owner, save_directory)) is not None:
        raise error


def checking_save_directory(save_pretrained):
    """``save_pretrained`` (a method whose first argument is the folder to write) refusing a folder it must not write
    (:func:`save_directory_problem`: empty, ``~``, a file, a folder where it writes a file) before writing anything."""
    return _refusing(save_pretrained, _save_directory_refusal)


def _repo_id_refusal(self, repo_id, kwargs):
    if isinstance(repo_id, (str, os.PathLike)) and looks_like_local_path(repo_id):
        return ValueError(f"{type(self).__name__}.push_to_hub({_shown(repo_id)}): push_to_hub uploads to a hub "
                          "repository ('name' or 'owner/name'), and this is a local path; to write a folder use "
                          f"save_pretrained({_shown(os.path.expanduser(os.fspath(repo_id)))})")
    return None


def checking_repo_id(push_to_hub):
    """``push_to_hub`` (a method whose first argument is a hub repository id) refusing a local path before anything is
    written or uploaded (:func:`looks_like_local_path`: the hub's "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'" says nothing of the folder the user meant)."""
    return _refusing(push_to_hub, _repo_id_refusal)


def _tokenizer_file_refusal(self, first, kwargs):
    file = kwargs.get("tokenizer_file")
    if isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith("~"):
        return ValueError(f"{type(self).__name__}(tokenizer_file={_shown(file)}): "
                          + tilde_problem(os.fspath(file), "the file would not be found"))
    return None


def checking_tokenizer_file(init):
    """A fast tokenizer's ``__init__`` refusing ``tokenizer_file=`` starting with ``~`` (transformers does not expand
    it and says "Couldn't instantiate the backend tokenizer from one of ...", naming no file)."""
    return _refusing(init, _tokenizer_file_refusal)


def install_auto_load_messages() -> None:
    """Wrap, idempotently, transformers' classes (so a Llama model or tokenizer gets the same messages):

    * ``AutoConfig.from_pretrained``, ``AutoTokenizer.from_pretrained``, the tokenizer classes' (path checks only)
      and every Auto model class's with :func:`_explained`; ``GenerationConfig.from_pretrained`` with
      :func:`checking_folder`;
    * the ``save_pretrained`` of models, configs, ``GenerationConfig``, the tokenizer classes and the processors
      with :func:`checking_save_directory` (HELM's models check first themselves); the fast tokenizers' constructor
      with :func:`checking_tokenizer_file`;
    * every ``push_to_hub`` with :func:`checking_repo_id`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedModel
    from transformers.models.auto import modeling_auto  # noqa: F401 (defines the Auto model classes)
    from transformers.models.auto.auto_factory import _BaseAutoModelClass
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
    from transformers.feature_extraction_utils import FeatureExtractionMixin
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.processing_utils import ProcessorMixin
    from transformers.utils import PushToHubMixin

    owners = [(AutoConfig, {"json_file_ok": True, "need_model_type": True}), (AutoTokenizer, {"tokenizer": True}),
              (PreTrainedTokenizerBase, {"tokenizer": True})]
    pending = [_BaseAutoModelClass]
    while pending:  # each Auto model class has its own copy of from_pretrained (transformers' auto_class_update)
        owner = pending.pop()
        pending.extend(owner.__subclasses__())
        owners.append((owner, {"need_model_type": True}))
    for owner, options in owners:
        method = owner.__dict__.get("from_pretrained")
        if isinstance(method, classmethod) and not getattr(method.__func__, "__helm_explained__", False):
            owner.from_pretrained = classmethod(_explained(method.__func__, **options))
    GenerationConfig.from_pretrained = classmethod(checking_folder(
        GenerationConfig.__dict__["from_pretrained"].__func__, "generation_config.json",
        "generation_config.json, or the file config_file_name= names"))
    for owner in (PushToHubMixin, PretrainedConfig, PreTrainedTokenizerBase):  # each holds a copy of the method
        owner.push_to_hub = checking_repo_id(owner.__dict__["push_to_hub"])
    for owner in (PreTrainedModel, PretrainedConfig, GenerationConfig, PreTrainedTokenizerBase, TokenizersBackend,
                  ImageProcessingMixin, FeatureExtractionMixin, ProcessorMixin):
        owner.save_pretrained = checking_save_directory(owner.__dict__["save_pretrained"])
    TokenizersBackend.__init__ = checking_tokenizer_file(TokenizersBackend.__dict__["__init__"])
