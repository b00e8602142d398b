"""Helpers shared by the scripts in ``eval/``: loading checkpoints and text, argument parsing, result files.

``eval`` is a Python builtin, so ``eval/`` is a folder of scripts, not a package: each script puts its own
folder on ``sys.path`` and imports this module (and, where needed, a sibling script) by its plain name.

Every checkpoint loads through ``AutoModelForCausalLM``: ``import helm`` registers the HELM model types, so
our checkpoints load without remote code, and any other causal LM (e.g. a ``LlamaForCausalLM`` baseline)
loads as usual. Errors name the missing path or the missing package and what to do about it.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

EVAL_DIR = Path(__file__).resolve().parent
TASK_DIR = EVAL_DIR / "tasks"
EVAL_EXTRA = "pip install 'helm-zoo[eval]'"

warnings.filterwarnings("ignore", category=DeprecationWarning)


class EvalError(RuntimeError):
    """A user-facing error (missing checkpoint, file or package); scripts print it and exit with status 2."""


def require(module: str, purpose: str):
    """Import ``module`` or raise :class:`EvalError` naming the install command."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise EvalError(f"{purpose} needs the Python package {module!r} ({error}); install the evaluation "
                        f"extras with:  {EVAL_EXTRA}") from error


def run_main(main) -> None:
    """Run a script's ``main()``, turning :class:`EvalError` into a one-line message and exit status 2."""
    import sys

    try:
        main()
    except EvalError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


# ----------------------------------------------------------------------------------------------------------
# checkpoints


def check_checkpoint(path: str) -> str:
    """Validate a checkpoint argument: an existing ``save_pretrained`` folder, or a hub model id.

    A value that looks like a filesystem path (absolute, relative with a separator, or an existing entry)
    must be a folder holding ``config.json``; so must every value when ``HF_HUB_OFFLINE`` is set, unless the
    hub cache holds it. Anything else is passed on as a hub id, which resolves with network access.
    """
    p = Path(path).expanduser()
    looks_like_path = p.is_absolute() or path.startswith((".", "~")) or (os.sep in path and not _hub_id_like(path))
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline and not p.exists() and not looks_like_path and _in_hub_cache(path):
        return path
    if p.exists() or looks_like_path or offline:
        if not p.is_dir():
            hint = ""
            if offline and not p.exists():
                hint = " (HF_HUB_OFFLINE is set and no hub model of that name is cached)"
            raise EvalError(f"checkpoint not found: {path!r} is not a folder (expected a folder written by "
                            f"save_pretrained, holding config.json and the weights){hint}")
        if not (p / "config.json").is_file():
            raise EvalError(f"checkpoint {path!r} has no config.json; expected a folder written by save_pretrained")
        return str(p)
    return path


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001  (an invalid repo id, or no huggingface_hub: not cached)
        return False


def _hub_id_like(name: str) -> bool:
    """``owner/name`` with one slash and no path-like parts is treated as a hub id."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not any(part in (".", "..") for part in parts)


def parse_dtype(name: str | None):
    import torch

    if name in (None, "auto"):
        return None
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}
    if name not in table:
        raise EvalError(f"unknown dtype {name!r}; choose one of {sorted(table)} or 'auto'")
    return table[name]


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(path: str, *, device: str | None = None, dtype: str | None = "float32",
               trust_remote_code: bool = True):
    """``AutoModelForCausalLM.from_pretrained(path)`` in eval mode on ``device`` (HELM types registered)."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM

    import helm  # noqa: F401  (registers helm_d / helm_mice with the Auto classes)

    path = check_checkpoint(path)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    torch_dtype = parse_dtype(dtype)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as error:
        raise EvalError(f"could not load checkpoint {path!r}: {error}") from error
    return model.to(device or default_device()).eval()


def load_tokenizer(path: str, *, trust_remote_code: bool = True):
    from transformers import AutoTokenizer

    import helm  # noqa: F401  (AutoTokenizer reads config.json, whose model type must be known)

    path = check_checkpoint(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise EvalError(f"could not load a tokenizer from {path!r}: {error} (save it next to the model with "
                        "tokenizer.save_pretrained, or pass --tokenizer)") from error


def parse_named(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` -> ``(NAME, PATH)``; a bare ``PATH`` is named after its last component."""
    if "=" in spec:
        name, path = spec.split("=", 1)
        if not name or not path:
            raise EvalError(f"expected NAME=PATH or PATH, got {spec!r}")
        return name, path
    return Path(spec.rstrip("/")).name or spec, spec


def model_max_length(model, default: int = 2048) -> int:
    """The context length a config declares (``max_position_embeddings`` and friends)."""
    config = model.config
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


# ----------------------------------------------------------------------------------------------------------
# text


def add_text_arguments(parser) -> None:
    """``--files`` / ``--dataset`` options shared by the scripts that read text."""
    group = parser.add_argument_group("text (local files or a datasets split)")
    group.add_argument("--files", nargs="+", metavar="FILE",
                       help="local text: .txt (the whole file is one document) or .jsonl (one document per line, "
                            "field --text-column)")
    group.add_argument("--dataset", metavar="NAME",
                       help="a `datasets` dataset instead of files, e.g. wikitext (needs network or a local cache)")
    group.add_argument("--dataset-config", metavar="CONFIG", help="dataset configuration, e.g. wikitext-2-raw-v1")
    group.add_argument("--split", default="test", help="dataset split (default: test)")
    group.add_argument("--text-column", default="text", help="field holding the text (default: text)")
    group.add_argument("--max-documents", type=int, metavar="N", help="read at most N documents")


def load_texts(*, files=None, dataset=None, dataset_config=None, split="test", text_column="text",
               max_documents=None) -> list[str]:
    """Documents from local files or a ``datasets`` split; empty documents are dropped."""
    if bool(files) == bool(dataset):
        raise EvalError("give exactly one of --files and --dataset")
    texts: list[str] = []
    if files:
        for name in files:
            path = Path(name).expanduser()
            if not path.is_file():
                raise EvalError(f"text file not found: {name}")
            if path.suffix == ".jsonl":
                with path.open(encoding="utf-8") as handle:
                    for number, line in enumerate(handle, 1):
                        if not line.strip():
                            continue
                        record = json.loads(line)
                        if text_column not in record:
                            raise EvalError(f"{name}:{number}: no field {text_column!r} (fields: {sorted(record)}); "
                                            "set --text-column")
                        texts.append(record[text_column])
            else:
                texts.append(path.read_text(encoding="utf-8"))
    else:
        datasets = require("datasets", "--dataset")
        try:
            data = datasets.load_dataset(dataset, dataset_config, split=split)
        except Exception as error:  # noqa: BLE001  (datasets raises many types; all mean "cannot load")
            raise EvalError(f"could not load dataset {dataset!r} (config {dataset_config!r}, split {split!r}): "
                            f"{error}") from error
        if text_column not in data.column_names:
            raise EvalError(f"dataset {dataset!r} has no column {text_column!r} (columns: {data.column_names}); "
                            "set --text-column")
        texts = list(data[text_column])
    texts = [t for t in texts if t and t.strip()]
    if max_documents is not None:
        texts = texts[:max_documents]
    if not texts:
        raise EvalError("no text: every document is empty")
    return texts


def texts_from_args(args) -> list[str]:
    return load_texts(files=args.files, dataset=args.dataset, dataset_config=args.dataset_config, split=args.split,
                      text_column=args.text_column, max_documents=args.max_documents)


def text_label(args) -> str:
    """A short name for the evaluated text, used as the task name in result files."""
    if args.files:
        return "+".join(Path(f).stem for f in args.files)
    return "/".join(x for x in (args.dataset, args.dataset_config, args.split) if x)


# ----------------------------------------------------------------------------------------------------------
# result files (the layout compare.py reads: lm-eval's ``{"model_name", "results": {task: {metric: value}}}``)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    return path


def matplotlib_pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend."""
    matplotlib = require("matplotlib", "plotting")
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")
