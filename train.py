#!/usr/bin/env python
"""Train a HELM model (or a Euclidean baseline) from a recipe, with Riemannian optimisation under accelerate.

    python train.py --config configs/train/tiny-helm-d.yaml [--section.key=value ...] [--resume [CHECKPOINT]]
    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/train/helm-d-115m.yaml
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train.py --config configs/train/tiny-helm-d.yaml

Top to bottom: read the recipe; find the checkpoint to resume from; lock output_dir; build the offline default
corpus if it is missing; check the tokenizer, the sequence length and a two-token forward of the model; tokenise,
pack (documents never attend to each other) and hold out validation rows; build the model and its optimiser
(geoopt RiemannianAdam for manifold points, AdamW for the rest: ``helm/optim.py``) and the warmup + cosine schedule;
restore the checkpoint (``accelerator.load_state``); then loop: the DataLoader hands this process its micro-batches
(``helm.training.training_batches``), ``helm.training.train_step`` takes the optimiser step (gradient
accumulation, clipping, MiCE routing-bias balancing), and the loop logs metrics, validates and writes atomic
checkpoints; save with ``save_pretrained``, reload with ``AutoModelForCausalLM``, print the validation perplexity
before and after and a sample. ``python train.py --help`` lists every recipe key with its default;
``--print-config`` prints the recipe a command line resolves to.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import pickle
import shutil
import signal
import sys
import time
from pathlib import Path


def interrupted_while_loading(signum, frame):
    """A Ctrl-C while torch and transformers load (seconds): one line and exit 130, as later (main installs the
    run's handler); nothing has been written yet."""
    print("error: interrupted before training started; nothing was written", file=sys.stderr, flush=True)
    os._exit(130)


if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, interrupted_while_loading)

import datasets  # noqa: E402  (after the handler: these imports take seconds)
import torch
import transformers
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.utils import set_seed
from omegaconf import OmegaConf
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

import helm  # registers the HELM model types with the transformers Auto classes (and quiets geoopt's warnings)
from helm.data import MissingSourceError, build_default_data, check_path, interrupted_build
from helm.data.paths import MODEL_FILES
from helm.distributed import use_fsdp_on_cpu
from helm.evaluation import format_perplexity, perplexity, rows_nll
from helm.manifest import RUN_MARKER, is_run_folder
from helm.models.routing import attach_balancing
from helm.ops.lm_loss import default_chunk_size
from helm.optim import build_optimizer, group_parameters
from helm.training import (LOCK, CheckpointError, ConfigError, JSONLTracker, PackedRows, StepMetrics, StreamRows,
                           TrainerState, cli_overrides, data_fingerprint, describe, find_checkpoint,
                           fingerprint_differences, load_run_config, load_splits, load_tokenizer, output_lock,
                           pack_split, read_trainer_state, recipe_differences, save_checkpoint, save_final, train_step,
                           training_batches)
from helm.training.checkpoint import (OVERWRITTEN, list_checkpoints, not_overwritable, remove_stale_tmp_checkpoints,
                                      write_run_marker)
from helm.training.config import DATA_STREAM_KEYS


def make_accelerator(cfg, out: Path, resume_step):
    precision = cfg.train.mixed_precision
    bf16_gpu = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if precision == "auto":
        precision = "bf16" if bf16_gpu else "no"
    elif precision == "bf16" and torch.cuda.is_available() and not bf16_gpu:
        raise ConfigError("train.mixed_precision=bf16: this GPU has no bf16 support; use auto (fp32 here) or no")
    # FSDP units are the layers the model names in _no_split_modules; the full state dict feeds save_pretrained.
    fsdp = None if cfg.train.distributed != "fsdp" else FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", state_dict_type="FULL_STATE_DICT")
    trackers = [JSONLTracker(out, resume_step, cfg.train.max_steps)] if cfg.train.logger in ("jsonl", "both") else []
    trackers += ["tensorboard"] if cfg.train.logger in ("tensorboard", "both") else []
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.train.grad_accum,
                              step_scheduler_with_optimizer=False, fsdp_plugin=fsdp, log_with=trackers, project_dir=out)
    use_fsdp_on_cpu(accelerator, fsdp)  # accelerate alone would run DDP on CPU processes
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ConfigError("train.mixed_precision=fp16 needs a GPU (fp16 with loss scaling); use no or bf16 on a CPU")
    return accelerator


def prepare_output_dir(cfg, out: Path, checkpoint: Path | None, step: int | None, asked: bool, accelerator) -> None:
    """Never mix a fresh run into an old one, nor delete one unasked: --resume (``asked``) of this folder's newest
    ``checkpoint`` (of step ``step``; an earlier one while later ones exist would mix two histories),
    train.overwrite, or no old files (a checkpoint of another folder starts a new run here).
    train.overwrite deletes only what train.py wrote (:data:`OVERWRITTEN`) in a folder marked as a run folder (or
    holding the config.yaml of an older train.py), never a folder of other files, nor what the recipe reads."""
    resuming = checkpoint is not None and Path(checkpoint).resolve().parent == (out / "checkpoints").resolve()
    if later := [p.name for s, p in list_checkpoints(out / "checkpoints") if resuming and s > step]:
        raise CheckpointError(f"--resume {str(checkpoint)!r}: this run has later checkpoints ({', '.join(later)}), "
                              "whose history resuming here would replace: move them out of checkpoints/ first")
    run_folder = is_run_folder(out)
    ours = (LOCK, RUN_MARKER, "config.yaml") if run_folder else (LOCK,)
    previous = sorted(p.name for p in out.iterdir() if p.name not in ours) if out.is_dir() else []
    found = f"({', '.join(previous[:4])}{', ...' * (len(previous) > 4)})"
    if previous and not run_folder:
        raise ConfigError(f"train.output_dir {str(out)!r} holds files {found} but is no run folder of train.py (no "
                          f"{RUN_MARKER}), so train.py neither writes into it nor deletes them: choose another one")
    if unwritable := [name for name in ("checkpoints", "final") if (out / name).is_dir()
                      and not os.access(out / name, os.W_OK)]:  # found now, not after training
        raise ConfigError(f"train.output_dir {str(out)!r}: {' and '.join(unwritable)} cannot be written (train.py "
                          "writes checkpoints and replaces final/ there); make them writable")
    if previous and not resuming and cfg.train.overwrite:  # what the overwrite below would delete: only train.py's
        if kept := not_overwritable(out):
            raise ConfigError(f"train.overwrite would delete what train.py did not write in {str(out)!r}: "
                              f"{', '.join(kept[:4])}{', ...' * (len(kept) > 4)}; move it out first, nothing was "
                              "deleted")
        doomed = [(out / name).resolve() for name in previous if name in OVERWRITTEN]
        for key, value in (("model.pretrained", cfg.model.pretrained), ("data.tokenizer", cfg.data.tokenizer),
                           ("data.dataset", cfg.data.dataset), ("--resume", checkpoint)):
            path = Path(value).resolve() if value is not None and os.path.exists(value) else None
            if path is not None and any(d == path or d in path.parents for d in doomed):
                raise ConfigError(f"{key} {str(value)!r} lies in what train.overwrite would delete in {str(out)!r}; "
                                  "copy it out first (nothing was deleted)")
    if previous and not resuming and not cfg.train.overwrite:
        remedy = ("a checkpoint of another folder starts a new run here: choose an empty train.output_dir, or "
                  "--train.overwrite=true to replace this run" if checkpoint is not None else
                  "it has no complete checkpoint to --resume from; --train.overwrite=true starts over" if asked else
                  "--resume continues from its newest checkpoint, --train.overwrite=true starts over")
        raise ConfigError(f"train.output_dir {str(out)!r} already holds a run {found}: {remedy}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # output_lock created out; only what a run writes goes, other files stay
        for path in (out / name for name in previous if not resuming and name in OVERWRITTEN):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        write_run_marker(out)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)), encoding="utf-8")
        remove_stale_tmp_checkpoints(out)


def ensure_default_data(cfg, accelerator) -> None:
    """Build helm's offline corpus and tokenizer into data.dataset when the recipe asks and it is missing (no such
    path, or an empty folder). A file, or a folder of other files (the user's own data, given with a recipe that
    builds the default), is used as it is: building there would overwrite its train.jsonl, validation.jsonl and
    tokenizer/."""
    root = Path(cfg.data.dataset)
    if not cfg.data.build_default or root.is_file() or root.is_dir() and any(root.iterdir()) \
            and not interrupted_build(root):  # a build cut short is finished
        return
    if accelerator.is_main_process:
        print(f"[train] {root} has no built corpus; building the offline default data (seconds)", flush=True)
        logging.basicConfig(format="[%(name)s] %(message)s")
        logging.getLogger("helm.data").setLevel(logging.INFO)
        try:
            build_default_data(root)
        except MissingSourceError as error:
            raise ConfigError(f"data.build_default: {error}") from None
    accelerator.wait_for_everyone()


def model_config(cfg):
    """The model's transformers config, read before any weights are built (for the input checks)."""
    key = f"model.preset {cfg.model.preset!r}" if cfg.model.preset else f"model.pretrained {cfg.model.pretrained!r}"
    if cfg.model.pretrained is not None:
        check_path(cfg.model.pretrained, "model.pretrained", ConfigError, needs=MODEL_FILES, hub=True)
    try:
        if cfg.model.preset is not None:
            return helm.load_config(cfg.model.preset, **cfg.model.overrides)
        return AutoConfig.from_pretrained(cfg.model.pretrained, trust_remote_code=cfg.model.trust_remote_code,
                                          **cfg.model.overrides)
    except Exception as error:  # whatever a config class raises for a bad preset, folder or override
        hint = "; pass --model.trust_remote_code=true to run it, if you trust it" * ("trust_remote_code" in str(error))
        raise ConfigError(f"{key}: {type(error).__name__}: {' '.join(str(error).split())}{hint}") from None


SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_special_ids(cfg, tokenizer) -> dict:
    """The tokenizer's bos/eos/pad ids, which the model's config and generation config take over (a preset's, or a
    pretrained folder's, belong to another tokenizer: generation would never stop at this one's eos); an id set
    in model.overrides is the user's choice and stays."""
    return {name: getattr(tokenizer, name) for name in SPECIAL_IDS if name not in cfg.model.overrides}


def check_inputs(cfg, config, tokenizer) -> None:
    source = cfg.model.preset or cfg.model.pretrained
    if len(tokenizer) > config.vocab_size:
        raise ConfigError(f"data.tokenizer {cfg.data.tokenizer!r} has {len(tokenizer)} tokens but the model ({source}) "
                          f"has vocab_size={config.vocab_size}: ids past the embedding table would crash training; "
                          "use a matching tokenizer or set model.overrides.vocab_size")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and cfg.data.seq_len > limit:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings={limit} "
                          f"({source}); lower data.seq_len or set model.overrides.max_position_embeddings")


def load_data(cfg, tokenizer, accelerator):
    """Training rows (PackedRows, or StreamRows for streamed data) and the fixed validation rows."""
    train_set, validation_set, streaming = load_splits(cfg.data, rank=accelerator.process_index,
                                                       world_size=accelerator.num_processes)
    try:
        validation = pack_split(validation_set, tokenizer, cfg.data, max_rows=cfg.train.eval_rows)
    except ValueError as error:  # a record whose text is not a string (a stream is checked as it is read)
        raise ConfigError(f"data.validation_split {cfg.data.validation_split!r}: {error}") from None
    if not validation:
        raise ConfigError(f"the validation data holds fewer than data.seq_len={cfg.data.seq_len} tokens; use a "
                          "larger validation split or data.holdout_documents")
    if streaming:
        return StreamRows(train_set, tokenizer, cfg.data), validation, True
    try:
        rows = pack_split(train_set, tokenizer, cfg.data)
    except ValueError as error:
        raise ConfigError(f"data.dataset {cfg.data.dataset!r}: {' '.join(str(error).split())}") from None
    if len(rows["input_ids"]) < (need := cfg.train.batch_size * cfg.train.grad_accum * accelerator.num_processes):
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} x grad_accum x processes = {need} rows per step, "
                          f"but the training data packs into only {len(rows['input_ids'])} rows of data.seq_len tokens")
    return PackedRows(rows, seed=cfg.train.seed, shuffle=cfg.data.shuffle), validation, False


def build_model(cfg, config, device, special_ids: dict):
    """The model, built and run forward on two tokens on ``device`` (the one it trains on) before any data is read,
    so that bad overrides fail early, and a kernel that runs only there (``attn_implementation: triton`` on CUDA)
    passes. ``special_ids`` (the tokenizer's) go into its config and generation config."""
    attention = {} if cfg.model.attn_implementation is None else {"attn_implementation": cfg.model.attn_implementation}
    try:  # HELM's from_pretrained re-wraps the Lorentz tables as ManifoldParameters
        model = AutoModelForCausalLM.from_config(config, **attention) if cfg.model.pretrained is None else \
            AutoModelForCausalLM.from_pretrained(cfg.model.pretrained, config=config, dtype=torch.float32,
                                                 trust_remote_code=cfg.model.trust_remote_code, **attention)
        if model.generation_config is not None:  # a pretrained folder's generation_config.json was read as saved
            model.generation_config.update(**special_ids)
        with torch.no_grad():
            model.to(device).eval()(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device))
    except OSError as error:  # the weights of model.pretrained (missing, truncated, not matching their manifest)
        raise ConfigError(f"model.pretrained: {' '.join(str(error).split())}") from None
    except Exception as error:
        raise ConfigError(f"model.overrides={dict(cfg.model.overrides)}, model.attn_implementation="
                          f"{cfg.model.attn_implementation!r}: the model cannot be built and run forward on {device} "
                          f"({type(error).__name__}: {' '.join(str(error).split())})") from None
    if cfg.train.gradient_checkpointing:  # layers recompute activations in the backward (transformers' new name first)
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)({"use_reentrant": False})
    return model.train()


def check_resumable(cfg, checkpoint: Path, saved: dict, world_size: int) -> None:
    """Refuse to resume with a recipe the run could not continue under: :func:`recipe_differences` (the keys of the
    data stream may change with data.resume_on_changed_data), another number of processes, or a train.max_steps
    changed to one not past the checkpoint (a run only goes forward; its schedule is then re-planned)."""
    differences = recipe_differences(saved["config"], cfg.to_dict(), changed_data=cfg.data.resume_on_changed_data)
    if cfg.train.max_steps != saved["config"]["train"]["max_steps"] and cfg.train.max_steps <= saved["step"]:
        differences.append(f"train.max_steps={cfg.train.max_steps} is not past the checkpoint's step {saved['step']}")
    if saved["world_size"] != world_size:
        differences.append(f"number of processes: {saved['world_size']} in the checkpoint, {world_size} now")
    if differences:
        stream = any(line.split(":", 1)[0] in DATA_STREAM_KEYS for line in differences)
        raise CheckpointError(f"--resume {str(checkpoint)!r}: the run would no longer continue where it stopped: "
                              + "; ".join(differences) + " (--data.resume_on_changed_data=true allows another data "
                              "stream)" * stream)


def replan_schedule(optimizer, scheduler, step: int) -> tuple[float, float]:
    """After loading a checkpoint saved with another train.max_steps: the learning rates of the next step are the
    new schedule's at ``step`` (the scheduler built for the new length keeps its own warmup and cosine: its
    lambdas are not in the checkpoint, only its step count), not the old schedule's that the optimiser state
    holds. Returns the first group's learning rate before and after."""
    before, inner = optimizer.param_groups[0]["lr"], scheduler.scheduler
    inner.last_epoch -= 1
    inner.step()  # LambdaLR sets every group's rate to the new lambdas' at ``step`` (and its last_lr)
    return before, optimizer.param_groups[0]["lr"]


def check_same_data(cfg, checkpoint: Path, saved: dict, fingerprint: dict) -> None:
    """Refuse to resume on a data stream other than the checkpoint's, unless data.resume_on_changed_data: the
    step is a position in the stream it was saved with."""
    changes = fingerprint_differences(saved.get("data"), fingerprint)
    if changes and not cfg.data.resume_on_changed_data:
        raise CheckpointError(f"--resume {str(checkpoint)!r}: the data changed since ({', '.join(changes)}); restore "
                              "it, or continue on the new stream knowingly with --data.resume_on_changed_data=true")


def divergence_causes(cfg) -> str:
    """The settings to look at when training diverges, with their values (both learning rates: either can be it)."""
    manifold = cfg.optim.manifold_lr if cfg.optim.manifold_lr is not None else "null (= optim.lr)"
    clip = "null" if cfg.optim.grad_clip is None else cfg.optim.grad_clip
    return (f"Likely causes: optim.lr={cfg.optim.lr:g}, optim.manifold_lr={manifold}, optim.warmup_ratio="
            f"{cfg.optim.warmup_ratio:g}, optim.grad_clip={clip} or train.mixed_precision={cfg.train.mixed_precision}")


def validation_loss(model, validation, accelerator, batch_size: int, distributed: bool = True) -> float:
    """Mean NLL of the validation rows. Processes split the rows, except under FSDP, whose forwards are
    collective: there every process runs every row."""
    split = distributed and not accelerator.is_fsdp2
    rank, world = (accelerator.process_index, accelerator.num_processes) if split else (0, 1)
    nll, count = rows_nll(model, validation, batch_size=batch_size, rank=rank, world_size=world,
                          autocast=accelerator.autocast)
    if split:
        nll, count = accelerator.reduce(nll, "sum"), accelerator.reduce(count, "sum")
    return float(nll / count.clamp_min(1))


def say_line(*parts) -> None:
    """Print a line of the run's output on stdout, above the progress bar when one is shown."""
    tqdm.write(" ".join(str(part) for part in parts))
    sys.stdout.flush()


class Progress:
    """Training metrics since the last log line, summed on the device and read (a sync) only when logged; a live
    progress bar over the optimiser steps where stdout and stderr are a terminal (train.progress_bar), or, in a
    log file (CI, nohup), one line per log_every steps, which reads better."""

    def __init__(self, cfg, accelerator, start_step: int, tokens_per_step: int, say):
        self.accelerator, self.say, self.start_step, self.max_steps = accelerator, say, start_step, cfg.train.max_steps
        self.tokens_per_step, self.run_start = tokens_per_step, time.perf_counter()
        # the bar (tqdm draws on stderr) stands in for the log lines (stdout): only when both reach a terminal
        self.live = (accelerator.is_main_process and cfg.train.progress_bar and sys.stdout.isatty()
                     and sys.stderr.isatty())
        self.bar = tqdm(total=self.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not self.live, mininterval=1.0)
        self.loss, self.aux_loss = (torch.zeros((), device=accelerator.device) for _ in range(2))
        self.steps, self.window_start = 0, time.perf_counter()

    def add(self, metrics: StepMetrics) -> None:
        self.loss += metrics.loss
        self.aux_loss += metrics.aux_loss
        self.steps += 1
        self.bar.update(1)

    def log(self, done: int, metrics: StepMetrics, routed: bool) -> None:
        """Log the means since the last log and the last step's learning rate and gradient norm; start over."""
        loss = self.accelerator.reduce(self.loss, "mean").item() / self.steps
        now = time.perf_counter()
        speed = self.steps * self.tokens_per_step / max(now - self.window_start, 1e-9)
        values = {"loss": loss, "lr": metrics.lr, "grad_norm": float(metrics.grad_norm), "tokens_per_s": speed,
                  "tokens": done * self.tokens_per_step, "elapsed_s": now - self.run_start}
        if routed:
            values["aux_loss"] = self.accelerator.reduce(self.aux_loss, "mean").item() / self.steps
        self.accelerator.log(values, step=done)
        self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{metrics.lr:.2e}", tok_s=f"{speed:,.0f}", refresh=False)
        if not self.live:
            eta = (now - self.run_start) / (done - self.start_step) * (self.max_steps - done)
            self.say(f"[train] step {done}/{self.max_steps} loss {loss:.4f} lr {metrics.lr:.3e} {speed:,.0f} tok/s "
                     f"eta {time.strftime('%H:%M:%S', time.gmtime(eta))}")
        self.loss.zero_(), self.aux_loss.zero_()
        self.steps, self.window_start = 0, time.perf_counter()


def demo_sample(cfg, model, tokenizer) -> str:
    """The reloaded model's continuation of demo.prompt: seeded, and starting a document like the packed rows."""
    torch.manual_seed(cfg.train.seed)
    prompt = tokenizer(cfg.demo.prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = model.eval().generate(**prompt, max_new_tokens=cfg.demo.max_new_tokens, pad_token_id=pad,
                                eos_token_id=tokenizer.eos_token_id, do_sample=True, temperature=0.8, top_k=40)
    return tokenizer.decode(ids[0], skip_special_tokens=True)


def train(cfg, resume, state: TrainerState) -> None:
    """Run the recipe ``cfg`` (from the checkpoint ``resume`` names, if any); ``state`` (the caller's, so that it
    can say after a Ctrl-C how far the run got) holds the step reached."""
    out = Path(cfg.train.output_dir)
    checkpoint = find_checkpoint(resume, out)
    saved = read_trainer_state(checkpoint) if checkpoint is not None else None
    accelerator = make_accelerator(cfg, out, saved["step"] if saved else None)
    say = say_line if accelerator.is_main_process else (lambda *a: None)
    world = accelerator.num_processes
    if saved is not None:
        check_resumable(cfg, checkpoint, saved, world)
        state.step = saved["step"]

    # Inputs: everything that can be wrong is checked here, before any heavy work.
    prepare_output_dir(cfg, out, checkpoint, saved["step"] if saved else None, resume is not None, accelerator)
    if resume is not None and checkpoint is None:
        say(f"[train] --resume: no checkpoint in {out} yet; starting from step 0")
    ensure_default_data(cfg, accelerator)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.trust_remote_code)
    state.data = data_fingerprint(cfg.data, tokenizer)
    if saved is not None:
        check_same_data(cfg, checkpoint, saved, state.data)
    config = model_config(cfg)
    check_inputs(cfg, config, tokenizer)
    special_ids = tokenizer_special_ids(cfg, tokenizer)
    config.update(special_ids)  # before the model is built: embeddings read pad_token_id

    set_seed(cfg.train.seed)
    model = build_model(cfg, config, accelerator.device, special_ids)
    groups = group_parameters(model)

    B, accum, L = cfg.train.batch_size, cfg.train.grad_accum, cfg.data.seq_len
    rows_per_step, start_step = B * world * accum, state.step
    clock = time.perf_counter()
    train_rows, validation, streaming = load_data(cfg, tokenizer, accelerator)
    say(f"[train] data: {'streamed' if streaming else f'{len(train_rows):,} packed rows'} of {L} tokens, "
        f"{validation['input_ids'].shape[0]} validation rows ({time.perf_counter() - clock:.1f} s)")
    optimizer = build_optimizer(model, lr=cfg.optim.lr, manifold_lr=cfg.optim.manifold_lr,
                                weight_decay=cfg.optim.weight_decay, betas=cfg.optim.betas, eps=cfg.optim.eps,
                                stabilize=cfg.optim.stabilize)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=round(cfg.optim.warmup_ratio * cfg.train.max_steps),
        num_training_steps=cfg.train.max_steps, min_lr_rate=cfg.optim.final_lr_ratio)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(state)
    unwrapped = accelerator.unwrap_model(model)
    # MiCE layers, or DeepSeek-V3's routers with balancing hooks added now, before compiling, so they are traced;
    # train_step balances them and the loop logs their balance loss
    routed = bool(attach_balancing(unwrapped))
    # only the training forward is compiled (one graph where the model allows); the rest uses the plain module
    # auto: on one CUDA process (dynamo makes no single graph through DDP's or FSDP's hooks)
    single = accelerator.num_processes == 1
    compiled = cfg.train.compile == "true" or cfg.train.compile == "auto" and accelerator.device.type == "cuda" \
        and single
    if compiled and accelerator.device.type == "cuda":  # the loss's chunk comes from the free memory, read eagerly
        default_chunk_size(config.vocab_size, accelerator.device)  # (a traced graph keeps the chunk it was traced with)
    forward = torch.compile(model, backend=cfg.train.compile_backend,
                            fullgraph=unwrapped._can_compile_fullgraph and single) if compiled else model
    if compiled and cfg.train.gradient_checkpointing:
        # checkpointed layers record side effects (the dense mask shared by layers, MiCE's loads) that the recompute
        # repeats to no effect: dynamo may skip them there, a setting scoped to the compiled calls
        forward = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)(forward)
    if checkpoint is not None:
        try:
            accelerator.load_state(str(checkpoint))  # in place: ManifoldParameters stay ManifoldParameters
        except pickle.UnpicklingError:  # torch's advice, weights_only=False, would run what the file holds
            raise CheckpointError(f"--resume {str(checkpoint)!r}: a file of it holds more than tensors (a pickled "
                                  "object torch refuses to load safely); do not load it unless you trust its source")
        say(f"[train] resumed from {checkpoint} at step {start_step}")
        if (was := saved["config"]["train"]["max_steps"]) != cfg.train.max_steps:
            before, now = replan_schedule(optimizer, scheduler, start_step)
            say(f"[train] train.max_steps changed from {was} to {cfg.train.max_steps}: the schedule is re-planned, the "
                f"learning rate of step {start_step + 1} is {now:.3e} (the old schedule's: {before:.3e})")
    accelerator.init_trackers("tensorboard", init_kwargs={
        "tensorboard": {"purge_step": start_step + 1} if checkpoint is not None else {}})
    # every run and resume reads the same rows in the same order from start_step on: the data position is the step
    batches = iter(training_batches(train_rows, start_step=start_step, max_steps=cfg.train.max_steps, batch_size=B,
                                    grad_accum=accum, rank=accelerator.process_index, world_size=world,
                                    num_workers=cfg.data.num_workers, pin_memory=accelerator.device.type == "cuda"))

    say(f"[train] {type(unwrapped).__name__} ({cfg.model.preset or cfg.model.pretrained}): "
        f"{sum(p.numel() for p in unwrapped.parameters()):,} parameters; "
        + ", ".join(f"{g}: {sum(p.numel() for _, p in ps):,}" for g, ps in groups.items()))
    say(f"[train] {world} process(es) on {accelerator.device} ({accelerator.distributed_type.value}), mixed precision "
        f"{accelerator.mixed_precision}; {rows_per_step} rows x {L} tokens = {rows_per_step * L:,} tokens per step, "
        f"{cfg.train.max_steps} steps")

    initial = None
    if start_step == 0 and cfg.train.eval_at_start:
        initial = validation_loss(unwrapped, validation, accelerator, B)
        accelerator.log({"val_loss": initial, "val_ppl": perplexity(initial)}, step=0)
        say(f"[train] step 0: validation loss {initial:.4f}, perplexity {format_perplexity(perplexity(initial))}")

    progress = Progress(cfg, accelerator, start_step, rows_per_step * L, say)
    first_bad = torch.zeros(1, dtype=torch.long, device=accelerator.device)  # first non-finite step, read when synced
    with progress.bar:  # closed however the loop ends, so that an error line starts a line of its own
        for step in range(start_step, cfg.train.max_steps):
            metrics = train_step(accelerator, model, optimizer, scheduler, [next(batches) for _ in range(accum)],
                                 grad_clip=cfg.optim.grad_clip, forward=forward)
            done = state.step = step + 1
            progress.add(metrics)
            # Non-finite loss, or gradient norm unless a loss scaler skips such steps: flagged on the device, read
            # when logging or saving (which sync anyway), so that no checkpoint is ever written after it.
            finite = (metrics.loss + (0 if accelerator.scaler else metrics.grad_norm)).isfinite()
            first_bad.masked_fill_(first_bad.eq(0) & ~finite, done)
            last = done == cfg.train.max_steps
            log = last or done % cfg.train.log_every == 0
            save = last or bool(cfg.train.save_every and done % cfg.train.save_every == 0)
            if (log or save) and (bad := [s for s in accelerator.gather(first_bad).tolist() if s]):
                raise FloatingPointError(f"non-finite loss or gradient norm (NaN or inf) at step {min(bad)}; nothing "
                                         f"after it was saved. {divergence_causes(cfg)}")
            if log:
                progress.log(done, metrics, routed)
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and not last:
                val = validation_loss(unwrapped, validation, accelerator, B)
                accelerator.log({"val_loss": val, "val_ppl": perplexity(val)}, step=done)
                say(f"[train] step {done}: validation loss {val:.4f}, perplexity {format_perplexity(perplexity(val))}")
            if save:
                save_checkpoint(accelerator, out, done, keep_last=cfg.train.keep_last)
    train_time, trained = time.perf_counter() - progress.run_start, cfg.train.max_steps - start_step

    # Save with save_pretrained, reload with AutoModelForCausalLM, report perplexity and a sample.
    final, state_dict = out / "final", accelerator.get_state_dict(model)  # collective under FSDP
    if accelerator.is_main_process:
        # final/ is what users load: never written nor replaced with a model whose validation loss is not finite
        # (a resumed run whose newest checkpoint holds NaN weights trains 0 steps and would reach here)
        restored = trained == 0 and checkpoint is not None
        source = f" (restored from {checkpoint}, trained 0 steps since)" if restored else ""
        advice = "Move it out of checkpoints/ and --resume an earlier one" if restored else divergence_causes(cfg)
        reloaded, after = None, None

        def check_final(folder):
            nonlocal reloaded, after
            reloaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=cfg.model.trust_remote_code).to(
                accelerator.device)
            after = validation_loss(reloaded, validation, accelerator, B, distributed=False)
            if not math.isfinite(after):
                raise FloatingPointError(f"the validation loss of the model to be saved is {after}{source}; {final} "
                                         f"was not written (an existing one is kept). {advice}")

        save_final(unwrapped, tokenizer, out, state_dict, cfg.train.max_steps, check=check_final)
        accelerator.log({"val_loss": after, "val_ppl": perplexity(after)}, step=cfg.train.max_steps)
        tokens = trained * rows_per_step * L
        say(f"\n[train] trained {trained} steps, {tokens:,} tokens in {train_time:.0f} s "
            f"({tokens / max(train_time, 1e-9):,.0f} tokens/s)")
        say(f"[train] saved to {final}  (reload: import helm; AutoModelForCausalLM.from_pretrained({str(final)!r}))")
        before = f"{format_perplexity(perplexity(initial))} before training -> " if initial is not None else ""
        say(f"[train] validation perplexity: {before}{format_perplexity(perplexity(after))} after (measured on the "
            "reloaded model)")
        if cfg.demo.prompt:
            say(f"[train] sample for the prompt {cfg.demo.prompt!r}:\n{demo_sample(cfg, reloaded, tokenizer)}")
    accelerator.wait_for_everyone()
    accelerator.end_training()


def interrupted(cfg, state: TrainerState | None) -> str:
    """What a Ctrl-C (SIGINT) stopped, and how to go on: the step reached and the newest complete checkpoint (one
    being written when it came is never listed, and goes at the next start)."""
    if cfg is None or state is None:
        return "interrupted before training started; nothing was written"
    newest = list_checkpoints(Path(cfg.train.output_dir) / "checkpoints")[-1:]
    where = (f"the newest checkpoint is {newest[0][1]} (step {newest[0][0]}); continue from it with --resume"
             if newest else "no checkpoint was written yet: start over with --train.overwrite=true")
    return f"interrupted after step {state.step}; {where}"


def stop_on_first_interrupt(signum, frame):
    """The first Ctrl-C stops the run (a KeyboardInterrupt, which main reports); later ones are ignored, so that
    none breaks into the clean-up (lock, half-written folders) or the interpreter's atexit handlers with a
    traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="A recipe sets the keys that differ from the defaults below; override any key as --section.key=value "
               "(a YAML value), e.g.\n--train.max_steps=50 --optim.lr=1e-3 --model.overrides.hidden_size=65\n\n"
               "Recipe keys and their defaults ('???': required):\n\n" + describe())
    parser.add_argument("--config", required=True, help="training recipe (YAML), e.g. configs/train/tiny-helm-d.yaml")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                        help="continue from CHECKPOINT, or (no value) from the newest one in train.output_dir")
    parser.add_argument("--print-config", action="store_true",
                        help="print the recipe with the overrides applied, every key documented, and exit")
    # The progress lines of this script are the output; the libraries' per-file bars are noise.
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    cfg, state = None, None
    try:  # user errors (and OSErrors: disk full, permissions) are one line and exit status 2, non-finite losses 3
        if __name__ == "__main__" and signal.getsignal(signal.SIGINT) in (signal.default_int_handler,
                                                                         interrupted_while_loading):
            signal.signal(signal.SIGINT, stop_on_first_interrupt)  # not when the caller ignores it (background job)
        args, rest = parser.parse_known_args(argv)
        cfg = load_run_config(args.config, cli_overrides(rest))
        if args.print_config:
            print(describe(cfg))
            return 0
        with output_lock(Path(cfg.train.output_dir), enabled=os.environ.get("RANK", "0") == "0"):
            state = TrainerState(cfg.to_dict())
            train(cfg, args.resume, state)
    except (ConfigError, CheckpointError, FloatingPointError, OSError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 3 if isinstance(error, FloatingPointError) else 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT (128 + 2), and how to go on
        print(f"error: {interrupted(cfg, state)}", file=sys.stderr, flush=True)
        return 130
    finally:  # the run is over: a Ctrl-C while the interpreter shuts down (tqdm's atexit hook) changes nothing
        if signal.getsignal(signal.SIGINT) is stop_on_first_interrupt:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
