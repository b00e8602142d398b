"""Library pieces of ``train.py``: the typed recipe, the LR schedule, packed data, checkpoints, metrics.

``train.py`` reads top to bottom as the training procedure; everything here is a self-contained part it calls.

Recipe
    A YAML file with the sections ``model``, ``data``, ``optim``, ``train``, ``demo`` (the dataclasses below;
    ``configs/train/*.yaml`` list and explain every key). Command-line overrides ``--section.key=value`` are
    parsed as YAML values and type-checked like the file. Unknown sections or keys, wrong types and
    out-of-range values raise :class:`ConfigError` naming the key, before anything is loaded.

Data
    Text is tokenised without special tokens and packed with :func:`helm.data.pack_documents` (eos after every
    document, rows of ``seq_len``, document ids so attention never crosses documents, positions restarting
    at each document). Local corpora are packed once in memory and reshuffled every epoch with a seeded
    permutation; the rows of optimiser step ``s`` are global rows ``[s·G, (s+1)·G)``, ``G`` = rows per step,
    so the data position is the step itself and the split between processes does not change which rows a
    step sees. Streamed (hub) datasets are sharded between processes and read in order.

Checkpoints
    ``output_dir/checkpoints/step-XXXXXXXX/`` holds ``model/`` (``save_pretrained``), ``optimizer.pt``,
    ``scheduler.pt``, ``rng-rankN.pt``, ``trainer_state.json`` and, written last, ``manifest.json`` with the
    size and SHA-256 of every other file. It is assembled in a ``.tmp-`` folder and renamed into place only
    after the manifest exists, so a checkpoint that looks complete is complete; :func:`verify_checkpoint`
    refuses one whose files do not match their manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import math
import os
import random
import re
import shutil
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

import torch

# ----------------------------------------------------------------------------------------------------
# errors


class ConfigError(ValueError):
    """A problem with the recipe, the command line or the inputs they name, found before training starts."""


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or incompatible with the current recipe."""


# ----------------------------------------------------------------------------------------------------
# recipe

MIXED_PRECISION = ("no", "bf16", "fp16", "auto")
LOGGERS = ("jsonl", "tensorboard", "both")
DISTRIBUTED = ("ddp", "fsdp")


@dataclass
class ModelConfig:
    preset: Optional[str] = None
    pretrained: Optional[str] = None
    overrides: dict = field(default_factory=dict)

    def validate(self) -> None:
        if (self.preset is None) == (self.pretrained is None):
            raise ConfigError("set exactly one of model.preset (a preset name or JSON file) and model.pretrained "
                              f"(a save_pretrained folder or hub name); got preset={self.preset!r}, "
                              f"pretrained={self.pretrained!r}")


@dataclass
class DataConfig:
    dataset: str = "data/default"
    dataset_config: Optional[str] = None
    build_default: bool = False
    tokenizer: str = "data/default/tokenizer"
    text_column: str = "text"
    train_split: str = "train"
    validation_split: Optional[str] = "validation"
    holdout_documents: int = 0
    streaming: Optional[bool] = None
    seq_len: int = 256
    mask_document_starts: bool = False
    shuffle: bool = True

    def validate(self) -> None:
        _at_least(self.seq_len, "data.seq_len", 2)
        _at_least(self.holdout_documents, "data.holdout_documents", 0)
        if self.validation_split is None and self.holdout_documents < 1:
            raise ConfigError("data.validation_split is null, so data.holdout_documents must be >= 1 (documents "
                              "held out of the training split for validation)")


@dataclass
class OptimConfig:
    lr: float = 3e-3
    manifold_lr: Optional[float] = None
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_ratio: float = 0.03
    final_lr_ratio: float = 0.1
    grad_clip: Optional[float] = 1.0
    stabilize: Optional[int] = 1

    def validate(self) -> None:
        _positive(self.lr, "optim.lr")
        if self.manifold_lr is not None:
            _positive(self.manifold_lr, "optim.manifold_lr")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        _positive(self.eps, "optim.eps")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"optim.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0 <= self.final_lr_ratio <= 1:
            raise ConfigError(f"optim.final_lr_ratio must be in [0, 1], got {self.final_lr_ratio}")
        if self.grad_clip is not None:
            _positive(self.grad_clip, "optim.grad_clip")
        if self.stabilize is not None:
            _at_least(self.stabilize, "optim.stabilize", 1)


@dataclass
class TrainConfig:
    output_dir: str = ""
    overwrite: bool = False
    max_steps: int = 0
    batch_size: int = 8
    grad_accum: int = 1
    mixed_precision: str = "no"
    distributed: str = "ddp"
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    eval_rows: int = 64
    eval_at_start: bool = True
    save_every: int = 0
    keep_last: int = 2
    logger: str = "jsonl"
    progress_bar: bool = True

    def validate(self) -> None:
        if not self.output_dir:
            raise ConfigError("train.output_dir is required")
        _at_least(self.max_steps, "train.max_steps", 1)
        _at_least(self.batch_size, "train.batch_size", 1)
        _at_least(self.grad_accum, "train.grad_accum", 1)
        _choice(self.mixed_precision, "train.mixed_precision", MIXED_PRECISION)
        _choice(self.distributed, "train.distributed", DISTRIBUTED)
        _at_least(self.log_every, "train.log_every", 1)
        _at_least(self.eval_every, "train.eval_every", 0)
        _at_least(self.eval_rows, "train.eval_rows", 1)
        _at_least(self.save_every, "train.save_every", 0)
        _at_least(self.keep_last, "train.keep_last", 1)
        _choice(self.logger, "train.logger", LOGGERS)
        if self.logger != "jsonl":
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                raise ConfigError(f"train.logger={self.logger!r} needs the tensorboard package "
                                  "(pip install tensorboard), or use train.logger: jsonl") from None


@dataclass
class DemoConfig:
    prompt: Optional[str] = None
    max_new_tokens: int = 48
    do_sample: bool = True
    temperature: float = 0.8
    top_k: int = 40

    def validate(self) -> None:
        _at_least(self.max_new_tokens, "demo.max_new_tokens", 1)
        _positive(self.temperature, "demo.temperature")
        _at_least(self.top_k, "demo.top_k", 0)


@dataclass
class RunConfig:
    """A whole recipe: one dataclass per YAML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)

    def validate(self) -> None:
        for section in SECTIONS:
            getattr(self, section).validate()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.default_factory().__class__ for f in dataclasses.fields(RunConfig)}
# Keys without a usable default: a recipe must set them (the rest default to the dataclass values).
REQUIRED_KEYS = ("train.output_dir", "train.max_steps")


def _positive(value, key: str) -> None:
    if not value > 0:
        raise ConfigError(f"{key} must be positive, got {value!r}")


def _at_least(value, key: str, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value!r}")


def _choice(value, key: str, accepted) -> None:
    if value not in accepted:
        raise ConfigError(f"{key} must be one of {accepted}, got {value!r}")


def _field_types(cls) -> dict[str, Any]:
    return get_type_hints(cls)


def all_keys() -> list[str]:
    """Every ``section.key`` a recipe may set, in declaration order."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def _type_name(tp) -> str:
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
             type(None): "null"}
    if get_origin(tp) is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value, tp, key: str):
    """``value`` as type ``tp`` (a dataclass annotation), or a ConfigError that names ``key``."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    bad = ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise bad
        (inner,) = get_args(tp) or (Any,)
        return [v if inner is Any else _coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    raise TypeError(f"unsupported recipe field type {tp!r} for {key}")


def _unknown(kind: str, name: str, known, where: str) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {kind} {name!r} in {where}{hint} (known: {', '.join(known)})")


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``["--train.max_steps=5", "--optim.lr", "1e-3"]`` → ``[("train.max_steps", "5"), ("optim.lr", "1e-3")]``."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognised argument {arg!r}: overrides are written --section.key=value "
                              f"(sections: {', '.join(SECTIONS)})")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 2
        else:
            raise ConfigError(f"override {arg!r} has no value (write {arg}=VALUE)")
        out.append((key, value))
    return out


def load_run_config(path: str | os.PathLike, overrides: list[tuple[str, str]] = ()) -> RunConfig:
    """Read a recipe, apply ``section.key`` overrides (values as YAML text), type-check and validate it."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {str(path)!r}: no such file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"--config {str(path)!r} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {str(path)!r} must be a mapping of sections ({', '.join(SECTIONS)})")
    values: dict[str, dict[str, Any]] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise _unknown("section", str(section), list(SECTIONS), str(path))
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError(f"section {section!r} of {path} must be a mapping of keys")
        known = [f.name for f in dataclasses.fields(SECTIONS[section])]
        for key, value in body.items():
            if key not in known:
                raise _unknown("key", f"{section}.{key}", [f"{section}.{k}" for k in known], str(path))
            values.setdefault(section, {})[key] = value

    for dotted, text in overrides:
        parts = dotted.split(".")
        section = parts[0]
        if section not in SECTIONS:
            raise _unknown("section", section, list(SECTIONS), "command-line override --" + dotted)
        hints = _field_types(SECTIONS[section])
        known = {f.name: hints[f.name] for f in dataclasses.fields(SECTIONS[section])}
        if len(parts) < 2 or parts[1] not in known:
            raise _unknown("key", ".".join(parts[:2]), [f"{section}.{k}" for k in known],
                           "command-line override --" + dotted)
        key, tp = parts[1], known[parts[1]]
        # Strings stay verbatim (a dataset config "20231101.en" or a prompt is not YAML), except null.
        verbatim = tp is str or (tp == Optional[str] and text not in ("null", "~"))
        value = text if verbatim else yaml.safe_load(text)
        if len(parts) > 2:
            # --model.overrides.num_hidden_layers=2 sets one entry of a mapping-valued key.
            if not (tp is dict or get_origin(tp) is dict):
                raise ConfigError(f"--{dotted}: {section}.{key} is not a mapping, so it has no sub-keys")
            target = values.setdefault(section, {}).setdefault(key, {})
            if target is None:
                target = values[section][key] = {}
            for part in parts[2:-1]:
                target = target.setdefault(part, {})
            target[parts[-1]] = yaml.safe_load(text)
        else:
            values.setdefault(section, {})[key] = value

    for required in REQUIRED_KEYS:
        section, key = required.split(".")
        if key not in values.get(section, {}):
            raise ConfigError(f"{required} is required but {path} does not set it")

    sections = {}
    for section, cls in SECTIONS.items():
        hints = _field_types(cls)
        given = values.get(section, {})
        sections[section] = cls(**{k: _coerce(v, hints[k], f"{section}.{k}") for k, v in given.items()})
    config = RunConfig(**sections)
    config.validate()
    return config


def dump_run_config(config: RunConfig) -> str:
    import yaml

    return yaml.safe_dump(config.to_dict(), sort_keys=False, allow_unicode=True)


# Keys that may change when a run is resumed (they do not change what is computed); any other difference
# between the checkpoint's recipe and the current one is refused.
RESUMABLE_CHANGES = frozenset({
    "train.output_dir", "train.overwrite", "train.log_every", "train.eval_every", "train.eval_rows",
    "train.eval_at_start", "train.save_every", "train.keep_last", "train.logger", "train.progress_bar",
    "data.build_default", "demo.prompt", "demo.max_new_tokens", "demo.do_sample", "demo.temperature", "demo.top_k",
})


def recipe_differences(saved: dict, current: dict) -> list[str]:
    """``section.key: saved -> current`` for every key that differs and may not change on resume."""
    out = []
    for section, body in current.items():
        for key, value in body.items():
            dotted = f"{section}.{key}"
            old = saved.get(section, {}).get(key)
            if dotted not in RESUMABLE_CHANGES and old != value:
                out.append(f"{dotted}: {old!r} in the checkpoint, {value!r} now")
    return out


# ----------------------------------------------------------------------------------------------------
# learning-rate schedule


class WarmupCosine:
    """LR multiplier: linear warmup to 1 over ``round(warmup_ratio·total)`` steps, then cosine to ``final_ratio``.

    ``step`` counts optimiser steps from 0; the first step already gets ``1/warmup_steps`` (never 0) and the
    last step gets exactly ``final_ratio``. A plain object rather than a closure so that ``LambdaLR`` can
    put it in its ``state_dict``.
    """

    def __init__(self, total_steps: int, warmup_ratio: float, final_ratio: float):
        self.total_steps = int(total_steps)
        self.warmup_steps = round(warmup_ratio * total_steps)
        self.final_ratio = float(final_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.final_ratio + (1.0 - self.final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, optim: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(total_steps, optim.warmup_ratio,
                                                                     optim.final_lr_ratio))


# ----------------------------------------------------------------------------------------------------
# data


def looks_local(name: str) -> bool:
    """Whether ``name`` means a local path (existing, or written like one) rather than a hub repository id."""
    path = Path(name).expanduser()
    return (path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
            or path.suffix.lower() in (".json", ".jsonl", ".txt"))


def load_tokenizer(name: str):
    """A tokenizer from a local folder or a hub name; ``ConfigError`` naming ``data.tokenizer`` otherwise."""
    from transformers import AutoTokenizer

    if looks_local(name) and not Path(name).expanduser().is_dir():
        raise ConfigError(f"data.tokenizer: no such directory {name!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(Path(name).expanduser()) if looks_local(name) else name)
    except (OSError, ValueError) as error:
        where = "local folder" if looks_local(name) else "local folder, nor loadable from the Hugging Face Hub"
        raise ConfigError(f"data.tokenizer: {name!r} is not a usable {where}: {error}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"data.tokenizer: {name!r} has no eos token, which packing puts after every document")
    return tokenizer


def _load_split(data: DataConfig, split: str, streaming: bool, key: str):
    from .data import load_text_dataset

    kwargs = {"name": data.dataset_config} if data.dataset_config else {}
    try:
        return load_text_dataset(data.dataset, split, text_column=data.text_column, streaming=streaming, **kwargs)
    except (FileNotFoundError, KeyError, RuntimeError, ValueError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise ConfigError(f"{key}: {message}") from None


def load_splits(data: DataConfig, *, rank: int = 0, world_size: int = 1):
    """Train and validation datasets from ``data``; streamed ones are sharded between processes.

    Returns ``(train, validation, streaming)``. Without a validation split, the first ``holdout_documents``
    documents of the training split are the validation set and training skips them.
    """
    streaming = data.streaming if data.streaming is not None else not looks_local(data.dataset)
    train = _load_split(data, data.train_split, streaming, "data.dataset")
    if data.validation_split is not None:
        validation = _load_split(data, data.validation_split, streaming, "data.validation_split")
    elif streaming:
        validation, train = train.take(data.holdout_documents), train.skip(data.holdout_documents)
    else:
        if data.holdout_documents >= len(train):
            raise ConfigError(f"data.holdout_documents={data.holdout_documents} would hold out all {len(train)} "
                              "training documents")
        validation = train.select(range(data.holdout_documents))
        train = train.select(range(data.holdout_documents, len(train)))
    if streaming and world_size > 1:
        from datasets.distributed import split_dataset_by_node

        train = split_dataset_by_node(train, rank=rank, world_size=world_size)
    return train, validation, streaming


def _token_lists(dataset, tokenizer, text_column: str, batch_size: int = 512) -> Iterator[list[int]]:
    """Token ids of each document (no special tokens), tokenised in batches for the fast tokenizer."""
    import itertools

    if hasattr(dataset, "iter"):
        batches = (b[text_column] for b in dataset.iter(batch_size=batch_size))
    else:
        records = iter(dataset)
        batches = iter(lambda: [r[text_column] for r in itertools.islice(records, batch_size)], [])
    for texts in batches:
        yield from tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]


def pack_split(dataset, tokenizer, data: DataConfig, max_rows: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Pack a dataset (or its first ``max_rows`` rows, for validation) into ``[N, seq_len]`` tensors."""
    from .data import iter_packed, pack_documents

    docs = _token_lists(dataset, tokenizer, data.text_column)
    kwargs = dict(eos_id=tokenizer.eos_token_id, mask_document_starts=data.mask_document_starts)
    if max_rows is None:
        return pack_documents(docs, data.seq_len, **kwargs)
    rows = []
    for row in iter_packed(docs, data.seq_len, **kwargs):
        rows.append(row)
        if len(rows) == max_rows:
            break
    if not rows:
        return {}
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


class PackedRows:
    """In-memory packed rows, visited in a fresh seeded permutation every epoch; addressed by global row index.

    Row ``i`` of the infinite training stream is row ``perm_e[i mod N]`` of epoch ``e = i // N``, so any
    process can fetch any slice of the stream without reading the rest, and resuming needs only the step.
    """

    def __init__(self, rows: dict[str, torch.Tensor], *, seed: int, shuffle: bool):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.n = rows["input_ids"].shape[0]
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.n

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.n, generator=g)
            else:
                self._perm = torch.arange(self.n)
            self._epoch = epoch
        return self._perm

    def take(self, start: int, count: int) -> dict[str, torch.Tensor]:
        index = torch.empty(count, dtype=torch.long)
        for j, i in enumerate(range(start, start + count)):
            index[j] = self._permutation(i // self.n)[i % self.n]
        return {key: value[index] for key, value in self.rows.items()}


class StreamRows:
    """Rows packed on the fly from this process's shard of a streamed dataset, in order, restarting at its end."""

    def __init__(self, dataset, tokenizer, data: DataConfig, *, skip_rows: int = 0):
        self.dataset, self.tokenizer, self.data = dataset, tokenizer, data
        self.epoch, self.consumed = 0, 0
        self._rows = self._open()
        for _ in range(skip_rows):  # resuming a stream re-reads it up to the saved position
            self._next()

    def _open(self) -> Iterator[dict[str, torch.Tensor]]:
        from .data import iter_packed

        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        docs = _token_lists(self.dataset, self.tokenizer, self.data.text_column)
        return iter_packed(docs, self.data.seq_len, eos_id=self.tokenizer.eos_token_id,
                           mask_document_starts=self.data.mask_document_starts)

    def _next(self) -> dict[str, torch.Tensor]:
        for attempt in range(2):
            try:
                row = next(self._rows)
                self.consumed += 1
                return row
            except StopIteration:
                if attempt or self.consumed == 0 and self.epoch == 0:
                    raise ConfigError(f"data.dataset: {self.data.dataset!r} yields no complete row of "
                                      f"data.seq_len={self.data.seq_len} tokens") from None
                self.epoch += 1
                self._rows = self._open()
        raise AssertionError("unreachable")

    def next(self, count: int) -> dict[str, torch.Tensor]:
        rows = [self._next() for _ in range(count)]
        return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


def model_inputs(batch: dict[str, torch.Tensor], accepts_segment_ids: bool) -> dict[str, torch.Tensor]:
    """Forward kwargs of a packed batch: HELM models take ``segment_ids``; transformers' own models detect
    packed rows from ``position_ids`` restarting at 0 (with no attention mask), which gives the same
    document-causal attention."""
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"], "position_ids": batch["position_ids"]}
    if accepts_segment_ids:
        inputs["segment_ids"] = batch["document_ids"]
    return inputs


# ----------------------------------------------------------------------------------------------------
# checkpoints

MANIFEST = "manifest.json"
CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoint folders under ``root``, oldest first (``.tmp-`` folders excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def _hash_file(path: Path, fsync: bool = False) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
        if fsync:
            os.fsync(handle.fileno())
    return digest.hexdigest(), size


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, step: int) -> None:
    """Hash (and flush to disk) every file in ``folder``, then write ``manifest.json`` atomically, last."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest, size = _hash_file(path, fsync=True)
        files[path.relative_to(folder).as_posix()] = {"sha256": digest, "bytes": size}
    manifest = {"format": CHECKPOINT_FORMAT, "step": step, "files": files}
    tmp = folder / (MANIFEST + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(folder / MANIFEST)
    _fsync_dir(folder)


# Files every checkpoint must hold (the model may be sharded, so only its config is required by name).
REQUIRED_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "model/config.json")


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """The manifest of a complete, intact checkpoint; :class:`CheckpointError` explaining what is wrong otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    advice = "delete it and resume from an earlier checkpoint with --resume PATH, or start over"
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST}, so it was interrupted "
                              f"while being written; {advice}") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {MANIFEST} is unreadable ({error}); "
                              f"{advice}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != CHECKPOINT_FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {str(path)!r} has a {MANIFEST} of an unknown format; {advice}")
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing or not any(name.startswith("model/") and name.endswith(".safetensors") for name in files):
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: its manifest lists no "
                              f"{missing or 'model weights'}; {advice}")
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: {name} is missing; {advice}")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is truncated or corrupted: {name} has {size} bytes, "
                                  f"the manifest records {entry['bytes']}; {advice}")
        digest, _ = _hash_file(file)
        if digest != entry["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: the SHA-256 of {name} does not match "
                                  f"its manifest; {advice}")
    return manifest


def finalize_checkpoint(tmp: Path, final: Path) -> None:
    """Rename a fully written checkpoint into place (replacing an older folder of the same name)."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(final.parent)


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints, and leftovers of interrupted writes."""
    for _, path in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".tmp-*"):
        shutil.rmtree(path, ignore_errors=True)


def rng_state() -> dict:
    """This process's RNG states (python, numpy, torch, CUDA), in types ``torch.load(weights_only=True)`` accepts."""
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(_as_tuples(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value):
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


# ----------------------------------------------------------------------------------------------------
# metrics


class MetricsLog:
    """Metrics as JSON lines in ``output_dir/metrics.jsonl`` and/or TensorBoard scalars (main process only).

    When a run resumes from step ``s``, records after ``s`` (written by the interrupted run after its last
    checkpoint) are dropped, so the file reads as one uninterrupted run.
    """

    def __init__(self, output_dir: Path, kind: str, *, enabled: bool, resume_step: Optional[int]):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        kept = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by the kill
                    continue
                if record.get("step", 0) <= resume_step:
                    kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self.jsonl = kind in ("jsonl", "both")
        if kind in ("tensorboard", "both"):
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(output_dir / "tensorboard"),
                                        purge_step=None if resume_step is None else resume_step + 1)

    def log(self, step: int, **values) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in values.items() if v is not None}}
        if self.jsonl:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(output_dir: str | os.PathLike) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------------
# evaluation and small helpers


@torch.no_grad()
def evaluate(model, rows: dict[str, torch.Tensor], *, batch_size: int, accepts_segment_ids: bool, device,
             rank: int = 0, world_size: int = 1, reduce: Optional[Callable] = None,
             autocast=None) -> float:
    """Mean next-token loss per predicted token over ``rows`` (each process takes every ``world_size``-th row)."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    n = rows["input_ids"].shape[0]
    mine = torch.arange(rank, n, world_size)
    for start in range(0, mine.numel(), batch_size):
        batch = {k: v[mine[start:start + batch_size]].to(device) for k, v in rows.items()}
        with autocast() if autocast is not None else contextlib.nullcontext():
            out = model(**model_inputs(batch, accepts_segment_ids))
        targets = (batch["labels"][:, 1:] != -100).sum()
        total += out.loss.double() * targets
        count += targets
    if reduce is not None:
        total, count = reduce(total), reduce(count)
    model.train(was_training)
    return float(total / count.clamp_min(1))


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def format_duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


__all__ = [
    "CheckpointError", "ConfigError", "DataConfig", "DemoConfig", "MetricsLog", "ModelConfig", "OptimConfig",
    "PackedRows", "RunConfig", "StreamRows", "TrainConfig", "WarmupCosine", "all_keys", "build_scheduler",
    "checkpoint_name", "checkpoint_root", "dump_run_config", "evaluate", "finalize_checkpoint", "list_checkpoints",
    "load_run_config", "load_splits", "load_tokenizer", "model_inputs", "pack_split", "parse_overrides",
    "perplexity", "prune_checkpoints", "read_metrics", "recipe_differences", "rng_state", "set_rng_state",
    "verify_checkpoint", "write_manifest",
]
