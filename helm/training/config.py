"""The training recipe: OmegaConf structured configs, one dataclass per YAML section, each key documented where it
is declared (``python train.py --help`` prints them all). A recipe (``configs/train/*.yaml``) sets only the keys
that differ from these defaults. Unknown keys, wrong types and out-of-range values raise :class:`ConfigError`
naming the key."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import os
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    """A problem with the recipe, the command line or the inputs they name, found before training starts."""


@dataclass
class ModelConfig:
    preset: Optional[str] = None
    """Model to train from scratch: a preset name from ``helm/presets/`` (without ``.json``) or a path to a JSON
    config. Set exactly one of preset and pretrained."""
    pretrained: Optional[str] = None
    """Or continue from trained weights: a ``save_pretrained`` folder or a hub name."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields set on top of the preset / pretrained config, e.g. ``{num_hidden_layers: 2, rope_theta: 5e5}``.
    On the command line one field at a time: ``--model.overrides.num_hidden_layers=2``."""
    attn_implementation: Optional[str] = None
    """Attention implementation, passed as transformers' ``attn_implementation``: eager, sdpa, triton (the zoo's
    Triton kernel; HELM models) or auto; null: the model's default."""
    trust_remote_code: bool = False
    """Run the code saved with a pretrained folder or hub model whose type neither helm nor transformers knows (its
    config.json has an auto_map). HELM folders never need it."""


@dataclass
class DataConfig:
    dataset: str = "data/default"
    """Training text: a folder with ``{train,validation}.{jsonl,txt}``, a .jsonl or .txt file (a .jsonl holds one
    document per record, a .txt file is one document), or a hub dataset name (streamed). ``data/default`` is
    helm's offline corpus (Bible translations, Shakespeare, Python docs; see build_default)."""
    dataset_config: Optional[str] = None
    """Hub dataset configuration (e.g. 20231101.en for wikimedia/wikipedia); null for local data."""
    build_default: bool = False
    """Build the offline default corpus and its tokenizer into dataset if it is not there yet: no such path, or an
    empty folder (``helm.data.build_default_data``, as ``python scripts/build_data.py --out data/default``). A
    dataset that is a file, or a folder holding other files, is used as it is and never written to."""
    tokenizer: str = "data/default/tokenizer"
    """Tokenizer: a local folder or a hub name. Its vocabulary must fit the model's vocab_size."""
    text_column: str = "text"
    """Field (JSONL) or column (hub) holding the text of each document."""
    train_split: str = "train"
    """Split to train on."""
    validation_split: Optional[str] = "validation"
    """Split to validate on; null to hold out the first holdout_documents training documents instead (needed for a
    single-file dataset, which has no named splits)."""
    holdout_documents: int = 0
    """Documents held out of the training split for validation when validation_split is null (ignored
    otherwise)."""
    streaming: Optional[bool] = None
    """Read the dataset as a stream (null: stream hub datasets, load local files into memory)."""
    seq_len: int = 256
    """Tokens per packed row; documents are packed back to back, each followed by eos, and never attend to each
    other."""
    mask_document_starts: bool = False
    """Do not train the prediction of a document's first token from the end of the previous one."""
    shuffle: bool = True
    """Reshuffle the packed rows every epoch (in-memory data only; streams are read in order)."""
    resume_on_changed_data: bool = False
    """Let --resume continue on a data stream other than the checkpoint's: changed dataset files (recorded as a
    fingerprint in every checkpoint), or another dataset, dataset_config, tokenizer, text_column, train_split,
    validation_split, holdout_documents, streaming, seq_len, mask_document_starts or shuffle. The run goes on from
    the saved step on the new stream, so it is no longer the run that was interrupted. false: such a resume exits
    with status 2 naming what changed. The model, optim and batch keys stay refused either way."""
    num_workers: int = 0
    """DataLoader worker processes preparing the next batches while the model trains. 0: the training process
    fetches them, best for in-memory rows (an indexing away) and on a CPU, where workers take cores from the
    model. A stream, tokenised and packed as it is read, uses one worker at most (its rows come in sequence).
    Does not change the batches: a run may resume with another value."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate of the Euclidean parameters (AdamW); the paper used 2e-4 dense and 4e-4 MoE at ~100M
    parameters, tiny models take a higher one."""
    manifold_lr: Optional[float] = None
    """Peak learning rate of manifold parameters (geoopt RiemannianAdam); null = lr."""
    weight_decay: float = 0.01
    """Decoupled weight decay of weight matrices only (never manifold points, curvatures, temperatures, norm
    gains, residual weights or biases)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas, shared by AdamW and RiemannianAdam."""
    eps: float = 1e-8
    """Adam epsilon, shared by AdamW and RiemannianAdam."""
    warmup_ratio: float = 0.03
    """Share of the steps spent on linear warmup (paper: 3%)."""
    final_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of the peak (paper: 0.1)."""
    grad_clip: Optional[float] = 1.0
    """Clip the global gradient norm to this value; null = no clipping."""
    stabilize: Optional[int] = 1
    """Every this many steps RiemannianAdam re-projects manifold points onto the hyperboloid and their momenta
    onto its tangent spaces (null = never). Every step (1) is cheap and keeps geoopt's fp32 transport finite for
    points far from the origin."""


@dataclass
class TrainConfig:
    output_dir: str = MISSING
    """Where checkpoints, metrics.jsonl, config.yaml (the resolved recipe) and the final model (final/) go.
    Required."""
    overwrite: bool = False
    """false: refuse to start when output_dir already holds a run (or other files) and --resume is not given;
    true: delete its checkpoints, metrics and final model and start over (e.g. --train.overwrite=true once). Only
    in a run folder train.py wrote (its .helm-train-run marker, or an older train.py's config.yaml), and never files
    it did not write inside checkpoints/ or final/: those are refused (exit 2), nothing deleted."""
    max_steps: int = MISSING
    """Optimiser steps. Required. May change on --resume, to a step past the checkpoint's (extend a run, or end it
    earlier), as with transformers' Trainer: the warmup + cosine schedule is then recomputed for the new length
    (warmup_ratio x max_steps warmup steps, cosine to max_steps) and the learning rate continues on it from the
    resumed step, so it jumps there to the new curve (up when extending during the decay)."""
    batch_size: int = 8
    """Packed rows per process per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimiser step (rows per step = batch_size x processes x grad_accum)."""
    mixed_precision: str = "no"
    """Autocast precision: no, bf16, fp16 (GPUs only, with loss scaling), or auto (bf16 on GPUs that support it,
    else no). A bare ``no``, which YAML reads as false, means no."""
    distributed: str = "ddp"
    """Multi-process strategy when launched with several processes: ddp, or fsdp (FSDP2: parameters, gradients
    and optimiser state sharded over the processes; on GPUs, or on CPU processes with gloo)."""
    seed: int = 0
    """Seed of the initialisation, the data order and the demo sample."""
    log_every: int = 10
    """Log the mean training loss, learning rate, gradient norm and tokens/s every this many steps."""
    eval_every: int = 0
    """Validate every this many steps (0 = only before and after training)."""
    eval_rows: int = 64
    """Validation rows (of seq_len tokens) used for the validation loss and perplexity."""
    eval_at_start: bool = True
    """Measure the validation perplexity before the first step."""
    save_every: int = 0
    """Checkpoint every this many steps (0 = only at the end); written atomically."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted)."""
    logger: str = "jsonl"
    """accelerate trackers: jsonl (output_dir/metrics.jsonl), tensorboard (output_dir/tensorboard; needs
    ``pip install tensorboard``), or both."""
    progress_bar: bool = True
    """Show a tqdm progress bar (loss, tokens/s, ETA) when stdout and stderr are a terminal; otherwise (or when
    false, or when the output goes to a file) print a line with loss, tokens/s and ETA every log_every steps."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them: less activation memory
    for about one more forward pass of compute (``model.gradient_checkpointing_enable()``)."""
    compile: str = "auto"
    """Compile the training forward and backward with torch.compile, as one graph (fullgraph) where the model
    allows; validation, checkpoints and the saved model use the plain module. true, false, or auto: on one CUDA
    process, where it pays (fused elementwise kernels, fewer launches), not on a CPU, where the first step would
    take a minute or two longer (inductor generates its kernels) for little gain, nor under DDP or FSDP."""
    compile_backend: str = "inductor"
    """torch.compile backend: inductor (fused kernels) or aot_eager (no code generation: quick to start, no
    faster; for testing)."""


@dataclass
class DemoConfig:
    prompt: Optional[str] = None
    """Text the reloaded model continues at the end (sampled: temperature 0.8, top-k 40, seed train.seed); null =
    no sample."""
    max_new_tokens: int = 48
    """Tokens to generate."""


@dataclass
class RunConfig:
    """A training recipe: ``configs/train/*.yaml`` set the keys that differ from these defaults."""

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


def key_docs() -> dict[str, str]:
    """``{"section.key": documentation}``: the docstring under each field of the section dataclasses, on one line
    (rst ``code`` written as `code`)."""
    docs = {}
    for section in dataclasses.fields(RunConfig):
        body = ast.parse(textwrap.dedent(inspect.getsource(section.default_factory))).body[0].body
        for node, after in zip(body, body[1:]):
            documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and documented:
                text = " ".join(inspect.cleandoc(after.value.value).split())
                docs[f"{section.name}.{node.target.id}"] = text.replace("``", "`")
    return docs


def describe(config: Optional[RunConfig] = None, width: int = 116) -> str:
    """A recipe as YAML with every key's documentation above it: ``config``'s values, or the defaults (required
    keys shown as ``'???'``). Loading the text back gives the same recipe."""
    values = OmegaConf.to_container(OmegaConf.structured(RunConfig if config is None else config))
    docs, lines = key_docs(), []
    for section, body in values.items():
        lines.append(f"{section}:")
        for key, value in body.items():
            lines += textwrap.wrap(docs[f"{section}.{key}"], width, initial_indent="  # ", subsequent_indent="  # ")
            flow = yaml.safe_dump([value], default_flow_style=True, width=float("inf")).strip()[1:-1]
            lines.append(f"  {key}: {flow}")
        lines.append("")
    return "\n".join(lines)


def cli_overrides(args: list[str]) -> list[str]:
    """``["--train.max_steps=5", "--optim.lr=1e-3"]`` → the dotlist ``["train.max_steps=5", "optim.lr=1e-3"]``."""
    for arg in args:
        if not arg.startswith("--") or "=" not in arg or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unrecognised argument {arg!r}: overrides are written --section.key=value")
    return [arg[2:] for arg in args]


def _message(error: OmegaConfBaseException) -> str:
    key = error.full_key or "?"
    if isinstance(error, (ConfigKeyError, ConfigAttributeError)):
        sections = [f.name for f in dataclasses.fields(RunConfig)]  # a key of a known section is matched to keys only
        close = difflib.get_close_matches(key, all_keys() if key.split(".")[0] in sections else sections, n=1)
        return f"unknown key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "")
    return f"{key}: {str(error).splitlines()[0]}"


def load_run_config(path: str | os.PathLike, overrides: list[str] = ()) -> RunConfig:
    """Read a recipe, merge the dotlist ``overrides`` (e.g. ``["optim.lr=1e-3"]``), type-check and validate it."""
    path = Path(path).expanduser()
    if not path.is_file():
        problem = "a folder, not a recipe file" if path.is_dir() else "no such file"
        raise ConfigError(f"--config {str(path)!r}: {problem}")
    try:
        recipe, dotlist = OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides))
        for section, name in (key.split(".") for key in RETIRED):
            body = recipe.get(section) if isinstance(recipe, DictConfig) else None  # another shape is refused below
            if isinstance(body, DictConfig) and name in body:
                warnings.warn(f"--config {str(path)!r}: {section}.{name} is no longer a recipe key; ignored")
                del body[name]
        if placeholders := sorted(OmegaConf.missing_keys(dotlist)):  # the merge would drop such an override
            raise ConfigError(f"--{placeholders[0]}=???: '???' marks a required key, it is not a value")
        # a required key left unset is OmegaConf's MissingMandatoryValue, which names it
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), recipe, dotlist))
    except OmegaConfBaseException as error:
        raise ConfigError(_message(error)) from None
    except (ValueError, TypeError, yaml.YAMLError) as error:  # YAML syntax, or a recipe that is not a mapping
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"--config {str(path)!r} or an override is not a valid recipe: "
                          f"{' '.join(str(error).split())}") from None
    expand_home(config)
    validate(config)
    return config


# Keys that earlier versions of train.py wrote into every config.yaml: such a recipe still loads, without them.
RETIRED = ("train.keep_best", "demo.do_sample", "demo.temperature", "demo.top_k")


# The recipe keys that name local paths (model.preset and model.pretrained may also name a preset or a hub id,
# which never begin with "~"): "~" and "~user" expanded once, here, so that every reader (transformers' Trainer
# and save_pretrained would write to a folder literally named "~" in the current directory) gets the same path.
PATH_KEYS = ("model.preset", "model.pretrained", "data.dataset", "data.tokenizer", "train.output_dir")


def expand_home(c: RunConfig) -> None:
    """Expand a leading ``~`` in the path-valued recipe keys (:data:`PATH_KEYS`) of ``c``, in place."""
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(c, section), name)
        if isinstance(value, str) and value.startswith("~"):
            setattr(getattr(c, section), name, os.path.expanduser(value))


MINIMUM = {"data.seq_len": 2, "data.holdout_documents": 0, "data.num_workers": 0, "optim.weight_decay": 0,
           "optim.stabilize": 1, "train.seed": 0, "train.max_steps": 1, "train.batch_size": 1, "train.grad_accum": 1,
           "train.log_every": 1, "train.eval_every": 0, "train.eval_rows": 1, "train.save_every": 0,
           "train.keep_last": 1, "demo.max_new_tokens": 1}
POSITIVE = ("optim.lr", "optim.manifold_lr", "optim.eps", "optim.grad_clip")
CHOICES = {"train.mixed_precision": ("no", "bf16", "fp16", "auto"), "train.distributed": ("ddp", "fsdp"),
           "train.logger": ("jsonl", "tensorboard", "both"), "train.compile_backend": ("inductor", "aot_eager"),
           "train.compile": ("auto", "true", "false")}


def validate(c: RunConfig) -> None:
    """Range checks the types cannot express (``null`` passes where a key is optional)."""
    if c.train.mixed_precision == "False":  # YAML 1.1 reads a bare no as false
        c.train.mixed_precision = "no"
    c.train.compile = c.train.compile.lower()  # true / false written as booleans arrive as True / False

    def value(key):
        section, name = key.split(".")
        return getattr(getattr(c, section), name)

    # nan and inf pass every comparison below (or, as optim.eps=inf, train nothing): refused first
    problems = [(k, "must be a finite number") for k in all_keys()
                if any(isinstance(v, float) and not math.isfinite(v)
                       for v in (value(k) if isinstance(value(k), list) else [value(k)]))]
    problems += [(k, f"must be >= {low}") for k, low in MINIMUM.items() if value(k) is not None and value(k) < low]
    problems += [(k, "must be positive") for k in POSITIVE if value(k) is not None and not value(k) > 0]
    problems += [(k, f"must be one of {options}") for k, options in CHOICES.items() if value(k) not in options]
    problems += [(key, requirement) for key, ok, requirement in (
        ("optim.betas", len(c.optim.betas) == 2 and all(0 <= b < 1 for b in c.optim.betas),
         "must be two numbers in [0, 1)"),
        ("train.output_dir", bool(c.train.output_dir), "must be set"),
        ("train.seed", c.train.seed < 2**32, "must be < 2**32 (numpy's seed range)"),
        ("optim.warmup_ratio", 0 <= c.optim.warmup_ratio < 1, "must be in [0, 1)"),
        ("optim.final_lr_ratio", 0 <= c.optim.final_lr_ratio <= 1, "must be in [0, 1]"),
        ("data.holdout_documents", c.data.validation_split is not None or c.data.holdout_documents >= 1,
         "must be >= 1 when data.validation_split is null (documents held out of the training split for validation)"),
        ) if not ok]
    if problems:
        key, requirement = problems[0]
        raise ConfigError(f"{key} {requirement}, got {value(key)!r}")
    if (c.model.preset is None) == (c.model.pretrained is None):
        raise ConfigError(f"model.preset ({c.model.preset!r}) and model.pretrained ({c.model.pretrained!r}): set "
                          "exactly one (a preset to train from scratch, a save_pretrained folder to continue)")


# Keys that may change on resume (they do not change what is computed up to the saved step; train.max_steps past
# it, which re-plans the learning-rate schedule from there on); any other difference is refused.
RESUMABLE_CHANGES = frozenset({
    "model.attn_implementation", "model.trust_remote_code", "train.output_dir", "train.overwrite", "train.max_steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_rows", "train.eval_at_start", "train.save_every", "train.keep_last",
    "train.logger", "train.progress_bar",
    "train.gradient_checkpointing", "train.compile", "train.compile_backend",
    "data.build_default", "data.num_workers", "data.resume_on_changed_data", "demo.prompt", "demo.max_new_tokens",
})


# Keys that define the data stream (the checkpoint's data fingerprint adds the files' and the tokenizer's
# contents): they may change on resume with data.resume_on_changed_data=true.
DATA_STREAM_KEYS = frozenset({
    "data.dataset", "data.dataset_config", "data.tokenizer", "data.text_column", "data.train_split",
    "data.validation_split", "data.holdout_documents", "data.streaming", "data.seq_len", "data.mask_document_starts",
    "data.shuffle",
})


def recipe_differences(saved: dict, current: dict, changed_data: bool = False) -> list[str]:
    """``section.key: saved -> current`` for every key that differs and may not change on resume; with
    ``changed_data`` (data.resume_on_changed_data) the keys of the data stream may change too."""
    allowed = RESUMABLE_CHANGES | DATA_STREAM_KEYS if changed_data else RESUMABLE_CHANGES
    return [f"{section}.{key}: {saved.get(section, {}).get(key)!r} in the checkpoint, {value!r} now"
            for section, body in current.items() for key, value in body.items()
            if f"{section}.{key}" not in allowed and saved.get(section, {}).get(key) != value]
