"""The training recipe: OmegaConf structured configs, one dataclass per YAML section (``configs/train/*.yaml``
explain every key). Unknown keys, wrong types and out-of-range values raise :class:`ConfigError` naming the key."""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A problem with the recipe, the command line or the inputs they name, found before training starts."""


@dataclass
class ModelConfig:
    preset: Optional[str] = None
    pretrained: Optional[str] = None
    overrides: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False


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


@dataclass
class TrainConfig:
    output_dir: str = MISSING
    overwrite: bool = False
    max_steps: int = MISSING
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
    gradient_checkpointing: bool = False
    compile: bool = False
    compile_backend: str = "inductor"


@dataclass
class DemoConfig:
    prompt: Optional[str] = None
    max_new_tokens: int = 48
    do_sample: bool = True
    temperature: float = 0.8
    top_k: int = 40


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def all_keys() -> list[str]:
    """Every ``section.key`` a recipe may set, in declaration order."""
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(RunConfig) for f in dataclasses.fields(s.default_factory)]


def cli_overrides(args: list[str]) -> list[str]:
    """``["--train.max_steps=5", "--optim.lr", "1e-3"]`` → the dotlist ``["train.max_steps=5", "optim.lr=1e-3"]``."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognised argument {arg!r}: overrides are written --section.key=value")
        if "=" not in arg and i + 1 == len(args):
            raise ConfigError(f"override {arg!r} has no value (write {arg}=VALUE)")
        out.append(arg[2:] if "=" in arg else f"{arg[2:]}={args[i + 1]}")
        i += 1 if "=" in arg else 2
    return out


def _message(error: OmegaConfBaseException) -> str:
    key = error.full_key or "?"
    if isinstance(error, (ConfigKeyError, ConfigAttributeError)):
        close = difflib.get_close_matches(key, all_keys() + [f.name for f in dataclasses.fields(RunConfig)], n=1)
        return f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")
    return f"{key}: {str(error).splitlines()[0]}"


def load_run_config(path: str | os.PathLike, overrides: list[str] = ()) -> RunConfig:
    """Read a recipe, merge the dotlist ``overrides`` (e.g. ``["optim.lr=1e-3"]``), type-check and validate it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {str(path)!r}: no such file")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path),
                                 OmegaConf.from_dotlist(list(overrides)))
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"{missing[0]} is required but {path} does not set it")
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(_message(error)) from None
    except (ValueError, TypeError, yaml.YAMLError) as error:  # YAML syntax, or a recipe that is not a mapping
        raise ConfigError(f"--config {str(path)!r} or an override is not a valid recipe: "
                          f"{' '.join(str(error).split())}") from None
    validate(config)
    return config


MINIMUM = {"data.seq_len": 2, "data.holdout_documents": 0, "optim.weight_decay": 0, "optim.stabilize": 1,
           "train.seed": 0, "train.max_steps": 1, "train.batch_size": 1, "train.grad_accum": 1, "train.log_every": 1,
           "train.eval_every": 0, "train.eval_rows": 1, "train.save_every": 0, "train.keep_last": 1,
           "demo.max_new_tokens": 1, "demo.top_k": 0}
POSITIVE = ("optim.lr", "optim.manifold_lr", "optim.eps", "optim.grad_clip", "demo.temperature")
CHOICES = {"train.mixed_precision": ("no", "bf16", "fp16", "auto"), "train.distributed": ("ddp", "fsdp"),
           "train.logger": ("jsonl", "tensorboard", "both"), "train.compile_backend": ("inductor", "aot_eager")}


def validate(c: RunConfig) -> None:
    """Range checks the types cannot express (``null`` passes where a key is optional)."""
    def value(key):
        section, name = key.split(".")
        return getattr(getattr(c, section), name)

    problems = [(k, f"must be >= {low}") for k, low in MINIMUM.items() if value(k) is not None and value(k) < low]
    problems += [(k, "must be positive") for k in POSITIVE if value(k) is not None and not value(k) > 0]
    problems += [(k, f"must be one of {options}") for k, options in CHOICES.items() if value(k) not in options]
    problems += [(key, requirement) for key, ok, requirement in (
        ("optim.betas", len(c.optim.betas) == 2 and all(0 <= b < 1 for b in c.optim.betas), "must be two in [0, 1)"),
        ("train.output_dir", bool(c.train.output_dir), "must be set"),
        ("train.seed", c.train.seed < 2**32, "must be < 2**32 (numpy's seed range)"),
        ("optim.warmup_ratio", 0 <= c.optim.warmup_ratio < 1, "must be in [0, 1)"),
        ("optim.final_lr_ratio", 0 <= c.optim.final_lr_ratio <= 1, "must be in [0, 1]"),
        ("data.holdout_documents", c.data.validation_split is not None or c.data.holdout_documents >= 1,
         "must be >= 1 when data.validation_split is null (documents held out of the training split for validation)"),
        ("model.preset", (c.model.preset is None) != (c.model.pretrained is None), "and model.pretrained: set exactly "
         "one of model.preset (a preset name or JSON file) and model.pretrained (a save_pretrained folder or hub "
         f"name); got pretrained={c.model.pretrained!r}, preset")) if not ok]
    if problems:
        key, requirement = problems[0]
        raise ConfigError(f"{key} {requirement}, got {value(key)!r}")
    if c.train.logger != "jsonl":
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(f"train.logger={c.train.logger!r} needs the tensorboard package "
                              "(pip install tensorboard), or use train.logger: jsonl") from None


# Keys that may change on resume (they do not change what is computed); any other difference is refused.
RESUMABLE_CHANGES = frozenset({
    "model.trust_remote_code", "train.output_dir", "train.overwrite", "train.log_every", "train.eval_every",
    "train.eval_rows", "train.eval_at_start", "train.save_every", "train.keep_last", "train.logger",
    "train.progress_bar", "train.gradient_checkpointing", "train.compile", "train.compile_backend",
    "data.build_default", "demo.prompt", "demo.max_new_tokens", "demo.do_sample", "demo.temperature", "demo.top_k",
})


def recipe_differences(saved: dict, current: dict) -> list[str]:
    """``section.key: saved -> current`` for every key that differs and may not change on resume."""
    return [f"{section}.{key}: {saved.get(section, {}).get(key)!r} in the checkpoint, {value!r} now"
            for section, body in current.items() for key, value in body.items()
            if f"{section}.{key}" not in RESUMABLE_CHANGES and saved.get(section, {}).get(key) != value]
