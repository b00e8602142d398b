#!/usr/bin/env python
"""Train a HELM model (or a Euclidean baseline) from a recipe, with Riemannian optimisation under accelerate.

    python train.py --config configs/train/tiny-helm-d.yaml [--section.key=value ...] [--resume [CHECKPOINT]]

One process, or data parallel over several (DDP; FSDP when the recipe asks for it):

    accelerate launch --multi_gpu --num_processes 8 train.py --config configs/train/helm-d-115m.yaml
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 train.py --config configs/train/tiny-helm-d.yaml

The procedure, top to bottom: read the recipe; build the offline default corpus if the recipe uses it and it is
missing; load the tokenizer and check it against the model; tokenise, pack (documents never attend to each
other) and hold out validation rows; build the model and its optimiser (geoopt RiemannianAdam for manifold
points, AdamW for the rest, see ``helm/optim.py``); resume from a checkpoint if asked; train with a warmup +
cosine schedule, gradient accumulation and clipping, logging, periodic validation and atomic checkpoints;
save the final model with ``save_pretrained``, reload it with ``AutoModelForCausalLM``, report the validation
perplexity before and after, and print a sample. Every recipe key is explained in ``configs/train/*.yaml``;
the library pieces live in ``helm/training.py``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"geoopt(\..*)?")

import torch  # noqa: E402

import helm  # noqa: E402  (registers the HELM model types with the transformers Auto classes)
from helm import training as T  # noqa: E402
from helm.optim import build_optimizer, group_parameters  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Any recipe key can be overridden as --section.key=value (value in YAML syntax), e.g. "
               "--train.max_steps=50 --optim.lr=1e-3 --model.overrides.num_hidden_layers=2.")
    parser.add_argument("--config", required=True, help="training recipe (YAML), e.g. configs/train/tiny-helm-d.yaml")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                        help="continue from CHECKPOINT, or (no value) from the newest one in train.output_dir")
    args, rest = parser.parse_known_args(argv)
    args.overrides = T.parse_overrides(rest)
    return args


# ---------------------------------------------------------------------------------------------- setup


def make_accelerator(cfg: T.RunConfig):
    from accelerate import Accelerator

    precision = cfg.train.mixed_precision
    bf16_gpu = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if precision == "auto":
        precision = "bf16" if bf16_gpu else "no"
    elif precision == "bf16" and torch.cuda.is_available() and not bf16_gpu:
        raise T.ConfigError("train.mixed_precision=bf16: this GPU has no bf16 support; use auto (fp32 here) or no")
    kwargs = {}
    if cfg.train.distributed == "fsdp":
        from accelerate import FullyShardedDataParallelPlugin

        # Layers named in the model's _no_split_modules are the FSDP units; the full state dict is gathered
        # for save_pretrained.
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", state_dict_type="FULL_STATE_DICT")
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=cfg.train.grad_accum,
                       step_scheduler_with_optimizer=False, **kwargs)


def prepare_output_dir(cfg: T.RunConfig, resume, accelerator) -> Path:
    """Refuse to silently mix a fresh run into an old one: resuming, or overwrite, or an empty output_dir."""
    out = Path(cfg.train.output_dir)
    previous = [p for p in (T.checkpoint_root(out), out / "final", out / "metrics.jsonl") if p.exists()]
    if resume is None and previous:
        if not cfg.train.overwrite:
            raise T.ConfigError(f"train.output_dir {str(out)!r} already holds a run ({previous[0].name}); pass "
                                "--resume to continue it, set train.overwrite: true to start over, or choose "
                                "another output_dir")
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for path in previous:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(T.dump_run_config(cfg), encoding="utf-8")
    return out


def find_resume_checkpoint(resume, out: Path):
    """The checkpoint to resume from (verified), or None for a fresh start."""
    if resume is None:
        return None
    if resume == "latest":
        found = T.list_checkpoints(T.checkpoint_root(out))
        if not found:
            print(f"[train] --resume: no checkpoint in {T.checkpoint_root(out)}; starting from step 0", flush=True)
            return None
        path = found[-1][1]
    else:
        path = Path(resume)
    T.verify_checkpoint(path)
    return path


def ensure_default_data(cfg: T.RunConfig, accelerator) -> None:
    """Build helm's offline corpus and tokenizer into data.dataset when the recipe asks for it and it is missing."""
    root = Path(cfg.data.dataset)
    if not cfg.data.build_default or (root / "manifest.json").is_file():
        return
    from helm.data import MissingSourceError, build_default_data

    if accelerator.is_main_process:
        print(f"[train] {root} has no built corpus; building the offline default data (well under a minute)",
              flush=True)
        try:
            build_default_data(root)
        except MissingSourceError as error:
            raise T.ConfigError(f"data.build_default: {error}") from None
    accelerator.wait_for_everyone()


def model_config(cfg: T.RunConfig):
    """The model's transformers config, read before any weights are built (for the input checks)."""
    from transformers import AutoConfig

    try:
        if cfg.model.preset is not None:
            return helm.load_config(cfg.model.preset, **cfg.model.overrides)
        return AutoConfig.from_pretrained(cfg.model.pretrained, **cfg.model.overrides)
    except (OSError, ValueError, TypeError) as error:
        key = "model.preset" if cfg.model.preset is not None else "model.pretrained"
        raise T.ConfigError(f"{key}: {error}") from None


def check_inputs(cfg: T.RunConfig, config, tokenizer) -> None:
    """Tokenizer and sequence length against the model, before any data is tokenised."""
    source = cfg.model.preset or cfg.model.pretrained
    if len(tokenizer) > config.vocab_size:
        raise T.ConfigError(f"data.tokenizer {cfg.data.tokenizer!r} has {len(tokenizer)} tokens but the model "
                            f"({source}) has vocab_size={config.vocab_size}: ids past the embedding table would "
                            "crash training; use a matching tokenizer or set model.overrides.vocab_size")
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and cfg.data.seq_len > limit:
        raise T.ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings={limit} "
                            f"({source}); lower data.seq_len or set model.overrides.max_position_embeddings")


def load_data(cfg: T.RunConfig, tokenizer, accelerator, skip_rows: int):
    """Training rows (PackedRows in memory, or StreamRows) and the fixed validation rows."""
    rank, world = accelerator.process_index, accelerator.num_processes
    train_set, validation_set, streaming = T.load_splits(cfg.data, rank=rank, world_size=world)
    validation = T.pack_split(validation_set, tokenizer, cfg.data, max_rows=cfg.train.eval_rows)
    if not validation:
        raise T.ConfigError(f"the validation data holds fewer than data.seq_len={cfg.data.seq_len} tokens; "
                            "use a larger validation split or data.holdout_documents")
    if streaming:
        return T.StreamRows(train_set, tokenizer, cfg.data, skip_rows=skip_rows), validation, streaming
    rows = T.pack_split(train_set, tokenizer, cfg.data)
    if not rows or rows["input_ids"].shape[0] == 0:
        raise T.ConfigError(f"data.dataset: the training split holds fewer than data.seq_len={cfg.data.seq_len} "
                            "tokens")
    return T.PackedRows(rows, seed=cfg.train.seed, shuffle=cfg.data.shuffle), validation, streaming


def build_model(cfg: T.RunConfig, config, checkpoint):
    """From the checkpoint when resuming, else from the pretrained weights or freshly from the preset's config.

    ``from_pretrained`` of a HELM model re-wraps the Lorentz tables as ``ManifoldParameter`` (transformers
    loads them as plain tensors), so the optimiser built afterwards sees the geometry.
    """
    from transformers import AutoModelForCausalLM

    if checkpoint is not None:
        return AutoModelForCausalLM.from_pretrained(checkpoint / "model", dtype=torch.float32)
    if cfg.model.pretrained is not None:
        return AutoModelForCausalLM.from_pretrained(cfg.model.pretrained, dtype=torch.float32, **cfg.model.overrides)
    return AutoModelForCausalLM.from_config(config)


# ---------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(out: Path, step: int, *, accelerator, model, optimizer, scheduler, trainer_state, keep_last):
    """Write checkpoint ``step`` into a temporary folder, manifest last, then rename it into place."""
    root = T.checkpoint_root(out)
    tmp = root / f".tmp-{T.checkpoint_name(step)}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(T.rng_state(), tmp / f"rng-rank{accelerator.process_index}.pt")
    state_dict = accelerator.get_state_dict(model)  # every process takes part (FSDP gathers the shards)
    optimizer_state = optimizer_state_dict(accelerator, model, optimizer)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(tmp / "model", state_dict=state_dict)
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1), encoding="utf-8")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        T.write_manifest(tmp, step)
        T.finalize_checkpoint(tmp, root / T.checkpoint_name(step))
        T.prune_checkpoints(root, keep_last)
    accelerator.wait_for_everyone()


def optimizer_state_dict(accelerator, model, optimizer):
    if accelerator.is_fsdp2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def restore_training_state(checkpoint: Path, cfg: T.RunConfig, *, accelerator, model, optimizer, scheduler) -> dict:
    """Optimizer, scheduler and RNG state of ``checkpoint`` (the model was loaded from it already)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    differences = T.recipe_differences(state["config"], cfg.to_dict())
    if state["world_size"] != accelerator.num_processes:
        differences.append(f"number of processes: {state['world_size']} in the checkpoint, "
                           f"{accelerator.num_processes} now")
    if differences:
        raise T.CheckpointError(f"cannot resume from {str(checkpoint)!r} with a different setup, because the run "
                                "would no longer continue where it stopped:\n  " + "\n  ".join(differences))
    optimizer_state = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    if accelerator.is_fsdp2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer.optimizer, optimizer_state,
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
    rng = checkpoint / f"rng-rank{accelerator.process_index}.pt"
    T.set_rng_state(torch.load(rng, weights_only=True))
    return state


# ---------------------------------------------------------------------------------------------- training


def train(cfg: T.RunConfig, resume) -> dict:
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    accelerator = make_accelerator(cfg)
    main = accelerator.is_main_process
    say = (lambda *a: tqdm.write(" ".join(str(x) for x in a))) if main else (lambda *a: None)
    rank, world = accelerator.process_index, accelerator.num_processes

    # -- inputs: everything that can be wrong is checked here, before any heavy work
    out = prepare_output_dir(cfg, resume, accelerator)
    checkpoint = find_resume_checkpoint(resume, out)
    ensure_default_data(cfg, accelerator)
    tokenizer = T.load_tokenizer(cfg.data.tokenizer)
    config = model_config(cfg)
    check_inputs(cfg, config, tokenizer)

    B, accum, L = cfg.train.batch_size, cfg.train.grad_accum, cfg.data.seq_len
    rows_per_step = B * world * accum
    start_step = 0
    if checkpoint is not None:
        start_step = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))["step"]
    clock = time.perf_counter()
    train_rows, validation, streaming = load_data(cfg, tokenizer, accelerator, skip_rows=start_step * accum * B)
    say(f"[train] data: {'streamed' if streaming else f'{len(train_rows):,} packed rows'} of {L} tokens, "
        f"{validation['input_ids'].shape[0]} validation rows ({time.perf_counter() - clock:.1f} s)")

    # -- model and optimiser
    set_seed(cfg.train.seed)
    model = build_model(cfg, config, checkpoint)
    model.train()
    groups = group_parameters(model)
    if cfg.train.distributed == "fsdp" and groups["manifold"] and world > 1:
        raise T.ConfigError("train.distributed=fsdp would shard geoopt ManifoldParameters into plain tensors and "
                            "train them as Euclidean; use ddp, or embedding_mode='space' and lm_head_mode='linear'")
    optimizer = build_optimizer(model, lr=cfg.optim.lr, manifold_lr=cfg.optim.manifold_lr,
                                weight_decay=cfg.optim.weight_decay, betas=cfg.optim.betas, eps=cfg.optim.eps,
                                stabilize=cfg.optim.stabilize)
    scheduler = T.build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    if accelerator.is_fsdp2:
        # The FSDP units are the decoder layers; _no_split_modules names both families' layer classes, and
        # accelerate refuses a name the model does not contain.
        present = {type(m).__name__ for m in model.modules()}
        accelerator.state.fsdp_plugin.transformer_cls_names_to_wrap = [
            name for name in model._no_split_modules if name in present]
    model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    accepts_segment_ids = "segment_ids" in inspect.signature(unwrapped.forward).parameters
    routing = hasattr(unwrapped, "update_routing_bias")
    if checkpoint is not None:
        restore_training_state(checkpoint, cfg, accelerator=accelerator, model=model, optimizer=optimizer,
                               scheduler=scheduler)
        say(f"[train] resumed from {checkpoint} at step {start_step}")

    n_params = sum(p.numel() for p in unwrapped.parameters())
    say(f"[train] {type(unwrapped).__name__} ({cfg.model.preset or cfg.model.pretrained}): {n_params:,} parameters; "
        + ", ".join(f"{g}: {sum(p.numel() for _, p in ps):,}" for g, ps in groups.items()))
    say(f"[train] {world} process(es) on {accelerator.device} ({accelerator.distributed_type.value}), mixed precision "
        f"{accelerator.mixed_precision}; "
        f"{rows_per_step} rows x {L} tokens = {rows_per_step * L:,} tokens per step, {cfg.train.max_steps} steps")

    metrics = T.MetricsLog(out, cfg.train.logger, enabled=main,
                           resume_step=start_step if checkpoint is not None else None)

    def validation_loss(m, distributed=True) -> float:
        # Processes split the rows, except under FSDP, whose forwards are collective: there every process
        # runs every row.
        split = distributed and not accelerator.is_fsdp2
        return T.evaluate(m, validation, batch_size=B, accepts_segment_ids=accepts_segment_ids,
                          device=accelerator.device, rank=rank if split else 0, world_size=world if split else 1,
                          reduce=(lambda t: accelerator.reduce(t, "sum")) if split else None,
                          autocast=accelerator.autocast)

    initial = None
    if start_step == 0 and cfg.train.eval_at_start:
        initial = validation_loss(unwrapped)
        metrics.log(0, val_loss=initial, val_ppl=T.perplexity(initial))
        say(f"[train] step 0: validation loss {initial:.4f}, perplexity {T.perplexity(initial):,.1f}")

    def micro_batch(step: int, micro: int) -> dict:
        if streaming:
            batch = train_rows.next(B)
        else:
            batch = train_rows.take(step * rows_per_step + (micro * world + rank) * B, B)
        return {k: v.to(accelerator.device) for k, v in batch.items()}

    # -- the loop
    # A live bar on a terminal; in a log file (CI, nohup) one line per log_every steps reads better.
    live = main and cfg.train.progress_bar and sys.stderr.isatty()
    bar = tqdm(total=cfg.train.max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
               disable=not live, mininterval=1.0)
    window = {"loss": torch.zeros((), device=accelerator.device), "aux": torch.zeros((), device=accelerator.device),
              "steps": 0, "start": time.perf_counter()}
    run_start, tokens_per_step = time.perf_counter(), rows_per_step * L
    for step in range(start_step, cfg.train.max_steps):
        load = None
        for micro in range(accum):
            batch = micro_batch(step, micro)
            with accelerator.accumulate(model):
                out_ = model(**T.model_inputs(batch, accepts_segment_ids))
                accelerator.backward(out_.loss)
                aux = getattr(out_, "aux_loss", None)
                window["loss"] += (out_.loss - (aux if aux is not None else 0)).detach() / accum
                if aux is not None:
                    window["aux"] += aux.detach() / accum
                if routing:
                    load = unwrapped.expert_load() if load is None else load + unwrapped.expert_load()
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
                    lr = scheduler.get_last_lr()[0]
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
        if routing:
            update_routing_bias(accelerator, unwrapped, load)
        done = step + 1
        window["steps"] += 1
        bar.update(1)

        if done % cfg.train.log_every == 0 or done == cfg.train.max_steps:
            elapsed = time.perf_counter() - window["start"]
            loss = accelerator.reduce(window["loss"], "mean").item() / window["steps"]
            aux_mean = accelerator.reduce(window["aux"], "mean").item() / window["steps"] if routing else None
            speed = window["steps"] * tokens_per_step / max(elapsed, 1e-9)
            metrics.log(done, loss=loss, aux_loss=aux_mean, lr=lr, grad_norm=float(grad_norm), tokens_per_s=speed,
                        tokens=done * tokens_per_step, elapsed_s=time.perf_counter() - run_start)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{speed:,.0f}", refresh=False)
            if not live:
                eta = (time.perf_counter() - run_start) / (done - start_step) * (cfg.train.max_steps - done)
                say(f"[train] step {done}/{cfg.train.max_steps} loss {loss:.4f} lr {lr:.3e} {speed:,.0f} tok/s "
                    f"eta {T.format_duration(eta)}")
            window.update(loss=window["loss"].zero_(), aux=window["aux"].zero_(), steps=0, start=time.perf_counter())

        if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done != cfg.train.max_steps:
            val = validation_loss(unwrapped)
            metrics.log(done, val_loss=val, val_ppl=T.perplexity(val))
            say(f"[train] step {done}: validation loss {val:.4f}, perplexity {T.perplexity(val):,.1f}")

        if (cfg.train.save_every and done % cfg.train.save_every == 0) or done == cfg.train.max_steps:
            trainer_state = {"step": done, "tokens": done * tokens_per_step, "world_size": world,
                             "rows_per_step": rows_per_step, "rows_consumed_per_process": done * accum * B,
                             "config": cfg.to_dict()}
            save_checkpoint(out, done, accelerator=accelerator, model=model, optimizer=optimizer,
                            scheduler=scheduler, trainer_state=trainer_state, keep_last=cfg.train.keep_last)
    bar.close()
    train_time = time.perf_counter() - run_start
    return finish(cfg, out, accelerator, model, tokenizer, validation_loss, metrics, initial,
                  trained_steps=cfg.train.max_steps - start_step, train_time=train_time,
                  tokens_per_step=tokens_per_step, say=say)


def update_routing_bias(accelerator, model, load: torch.Tensor) -> None:
    """MiCE aux-loss-free balancing after an optimiser step, from the expert load of the whole step.

    ``load [MiCE layers, experts]`` is summed over the micro-batches here and over the processes below, so
    every process moves its routing biases identically (a per-process update would let them drift apart).
    """
    load = accelerator.reduce(load, "sum")
    for layer, layer_load in zip(model.mice_layers(), load):
        layer.last_expert_load.copy_(layer_load)
    model.update_routing_bias()


def finish(cfg, out, accelerator, model, tokenizer, validation_loss, metrics, initial, *, trained_steps,
           train_time, tokens_per_step, say) -> dict:
    """Save with save_pretrained, reload with AutoModelForCausalLM, report perplexity and a sample."""
    from transformers import AutoModelForCausalLM

    final = out / "final"
    unwrapped = accelerator.unwrap_model(model)
    state_dict = accelerator.get_state_dict(model)
    result = {}
    if accelerator.is_main_process:
        tmp = out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        T.finalize_checkpoint(tmp, final)

        reloaded = AutoModelForCausalLM.from_pretrained(final).to(accelerator.device)
        after = validation_loss(reloaded, distributed=False)
        metrics.log(cfg.train.max_steps, val_loss=after, val_ppl=T.perplexity(after))
        metrics.close()
        result = {"val_loss_before": initial, "val_loss_after": after, "final_dir": str(final)}
        tokens = trained_steps * tokens_per_step
        say(f"\n[train] trained {trained_steps} steps, {tokens:,} tokens in {T.format_duration(train_time)} "
            f"({tokens / max(train_time, 1e-9):,.0f} tokens/s)")
        say(f"[train] saved to {final}  (reload: import helm; "
            f"transformers.AutoModelForCausalLM.from_pretrained({str(final)!r}))")
        if initial is not None:
            before_ppl, after_ppl = T.perplexity(initial), T.perplexity(after)
            say(f"[train] validation perplexity: {before_ppl:,.1f} before training -> {after_ppl:,.1f} after "
                f"({before_ppl / after_ppl:,.1f}x lower; measured on the reloaded model)")
        else:
            say(f"[train] validation perplexity after training (reloaded model): {T.perplexity(after):,.1f}")
        if cfg.demo.prompt:
            result["sample"] = sample(reloaded, tokenizer, cfg)
            say(f"[train] sample for the prompt {cfg.demo.prompt!r}:\n{result['sample']}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


@torch.no_grad()
def sample(model, tokenizer, cfg: T.RunConfig) -> str:
    """Text generated from the demo prompt (seeded), as a document start, like the packed training rows."""
    torch.manual_seed(cfg.train.seed)
    inputs = tokenizer(cfg.demo.prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
    model.eval()
    kwargs = dict(do_sample=True, temperature=cfg.demo.temperature, top_k=cfg.demo.top_k) if cfg.demo.do_sample \
        else dict(do_sample=False)
    ids = model.generate(**inputs, max_new_tokens=cfg.demo.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                         else tokenizer.eos_token_id, **kwargs)
    return tokenizer.decode(ids[0], skip_special_tokens=True)


def quiet_libraries() -> None:
    """The progress bar and log lines of train.py are the output; the libraries' own per-file bars are noise."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def main(argv=None) -> int:
    try:
        quiet_libraries()
        args = parse_args(argv)
        cfg = T.load_run_config(args.config, args.overrides)
        train(cfg, args.resume)
    except (T.ConfigError, T.CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
