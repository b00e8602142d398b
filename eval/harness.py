#!/usr/bin/env python
"""Benchmark a checkpoint with lm-evaluation-harness: the paper's suite, the offline local tasks, or any tasks.

A saved HELM checkpoint works with the stock `lm_eval --model hf`; this wrapper runs a suite (groups of
tasks, each with its own number of shots) on one loaded model into one lm-eval-style result file, and prints
the equivalent stock commands (--dry-run: only them).

    python eval/harness.py --model runs/helm-d --suite paper --batch-size 16 --output results/helm-d.json
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import os
import shlex
import sys
from pathlib import Path

import lm_eval
import torch
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

from helm.evaluation import (MODEL_SPEC_HELP, EvalError, add_loading_arguments, check_checkpoint, check_hub_model,
                             check_suffix, check_tokenizer, check_vocabulary, check_writable, run_script,
                             split_model_spec, user_path, write_json)

TASK_DIR = Path(__file__).resolve().parent / "tasks"
# A suite is (task, shots, reported metric) rows. "paper" is Table 1 of the HELM paper (§5.1, App. C.3),
# tabulated in eval/README.md: accuracy everywhere, OpenBookQA with letter choices (eval/tasks/).
SUITES = {"paper": [("commonsense_qa", 0, "acc"), ("hellaswag", 0, "acc"), ("helm_openbookqa_letters", 0, "acc"),
                    ("mmlu", 5, "acc"), ("arc_challenge", 5, "acc")], "local": [("helm_local", 0, None)]}


def runs(suite: list) -> list[tuple[list[str], int]]:
    """lm-eval applies one number of shots per run: the suite's tasks grouped by shots, in order."""
    return [([task for task, n, _ in suite if n == shots], shots) for shots in dict.fromkeys(n for _, n, _ in suite)]


def stock_command(path: str, tasks: list[str], shots: int, args, device: str) -> str:
    argv = ["lm_eval", "--model", "hf", "--model_args", f"pretrained={path},trust_remote_code=True",
            "--tasks", ",".join(tasks), "--num_fewshot", str(shots), "--batch_size", str(args.batch_size),
            "--device", device]
    if any(task.startswith("helm_") for task in tasks):
        argv += ["--include_path", str(TASK_DIR)]
    if args.limit is not None:
        argv += ["--limit", f"{args.limit:g}"]
    if args.output:
        argv += ["--output_path", str(Path(args.output).parent)]
    return shlex.join(argv)


@contextlib.contextmanager
def progress_bars(enabled: bool):
    """Within the block, no progress bars when not ``enabled``: lm-eval's (building each task's requests, running
    them; it takes no option for the first), transformers' (loading the weights) and datasets' (preparing a task's
    data). Restored on leaving, so that an in-process caller keeps its own."""
    if enabled:
        yield
        return
    import datasets
    from tqdm import tqdm
    from transformers.utils import logging as transformers_logging

    class QuietTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    # the lm_eval modules that bound tqdm's class with `from tqdm import tqdm`
    bound = [(module, name) for module_name, module in list(sys.modules.items())
             if module_name.split(".")[0] == "lm_eval" and module is not None
             for name in ("tqdm",) if isinstance(getattr(module, name, None), type)
             and issubclass(getattr(module, name), tqdm)]
    saved = [(module, name, getattr(module, name)) for module, name in bound]
    transformers_on = transformers_logging.is_progress_bar_enabled()
    datasets_on = datasets.is_progress_bar_enabled()
    try:
        for module, name in bound:
            setattr(module, name, QuietTqdm)
        transformers_logging.disable_progress_bar()
        datasets.disable_progress_bars()
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        if transformers_on:
            transformers_logging.enable_progress_bar()
        if datasets_on:
            datasets.enable_progress_bars()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, metavar="[NAME=]PATH",
                        help=f"checkpoint folder (save_pretrained); {MODEL_SPEC_HELP}")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--suite", choices=sorted(SUITES), default="local",
                        help="paper: CommonsenseQA, HellaSwag, OpenBookQA (letter choices) 0-shot, MMLU, "
                             "ARC-Challenge 5-shot, accuracy (needs network); local: the offline tasks of eval/tasks "
                             "(default)")
    choice.add_argument("--tasks", help="comma-separated lm-eval tasks, run with --num-fewshot")
    parser.add_argument("--num-fewshot", type=int, default=0, help="shots for --tasks (default 0)")
    parser.add_argument("--batch-size", default="1", help="an integer or 'auto' (default 1)")
    add_loading_arguments(parser)
    parser.add_argument("--limit", type=float, help="at most this many documents per task (or a fraction < 1)")
    parser.add_argument("--output", type=user_path, metavar="JSON", help="write the merged results here (a .json file)")
    parser.add_argument("--log-samples", action="store_true", help="keep per-document outputs in the result file")
    parser.add_argument("--dry-run", action="store_true", help="print the equivalent stock lm_eval commands and exit")
    parser.add_argument("--no-progress", action="store_true",
                        help="hide the progress bars: lm-eval's (building and running each task's requests), "
                             "transformers' (loading the weights) and datasets' (preparing a task's data); lm-eval's "
                             "log lines stay")
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    name, path = split_model_spec(args.model)
    path = check_checkpoint(path, args.trust_remote_code)
    if args.num_fewshot < 0:
        raise EvalError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    # lm-eval would find no documents and raise (<= 0), or int() would raise (inf, nan)
    if args.limit is not None and not (math.isfinite(args.limit) and args.limit > 0):
        raise EvalError(f"--limit must be a positive count or fraction, got {args.limit:g}")
    if args.batch_size != "auto" and not (args.batch_size.isdigit() and int(args.batch_size) >= 1):
        raise EvalError(f"--batch-size must be an integer >= 1 or 'auto', got {args.batch_size!r}")
    if args.tasks is not None and not any(task.strip() for task in args.tasks.split(",")):
        raise EvalError(f"--tasks {args.tasks!r} names no task; give comma-separated lm-eval tasks, or leave it out to "
                        f"run --suite (default {build_parser().get_default('suite')!r})")
    groups = [([task.strip() for task in args.tasks.split(",") if task.strip()], args.num_fewshot)] if args.tasks \
        else runs(SUITES[args.suite])
    if args.output:  # a task may be a YAML file, an input like the model
        check_writable(args.output, "--output", models=[path],
                       inputs=[Path(task) for tasks, _ in groups for task in tasks if Path(task).is_file()])
        check_suffix(args.output, "--output", ".json", "harness.py")  # after: an input named as --output is worse
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    commands = [stock_command(path, tasks, shots, args, device) for tasks, shots in groups]
    print("equivalent stock lm-eval commands:\n  " + "\n  ".join(commands))
    if args.dry_run:
        return None
    with progress_bars(not args.no_progress):
        return evaluate(args, name, path, groups, device)


def evaluate(args, name: str, path: str, groups: list[tuple[list[str], int]], device: str) -> dict | None:
    """Run the checked ``groups`` (tasks, shots) of ``args`` on the checkpoint ``path`` into one result record."""
    manager = TaskManager(include_path=str(TASK_DIR))  # before loading the model, so a typo fails fast
    names = manager.all_tasks  # tasks, groups and tags; lm-eval also takes a path to a task YAML file
    if unknown := [task for tasks, _ in groups for task in tasks if task not in names and not Path(task).is_file()]:
        raise EvalError("--tasks: no lm-eval task, group or tag " + ", ".join(f"{task!r}" + "".join(
            f" (did you mean {near!r}?)" for near in difflib.get_close_matches(task, names, 1)) for task in unknown))
    # lm-eval's HFLM loads both from the folder, with transformers' messages for a missing model or tokenizer
    check_hub_model(path)
    check_tokenizer(path, "--model", "lm-eval reads the tokenizer from the model folder: save it there with "
                                     "tokenizer.save_pretrained(folder)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    # importing helm (with helm.evaluation) registered the HELM model types, so HFLM needs no remote code for them
    lm = HFLM(pretrained=path, trust_remote_code=args.trust_remote_code, batch_size=batch_size, device=device,
              dtype=args.dtype)
    check_vocabulary(lm.model, lm.tokenizer, f"the tokenizer saved with --model {path!r}")
    record = {"model_name": name or Path(path.rstrip("/")).name, "model_path": path, "source": "eval/harness.py",
              "suite": None if args.tasks else args.suite, "primary_metrics": {
                  task: [metric] for task, _, metric in ([] if args.tasks else SUITES[args.suite]) if metric}}
    keys = ["results", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples"]
    keys += ["samples"] if args.log_samples else []
    record.update({key: {} for key in keys})
    for tasks, shots in groups:
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=shots, limit=limit, task_manager=manager,
                                      log_samples=args.log_samples)
        if out is None:  # the non-zero ranks of a distributed run
            return None
        for key in keys:
            record[key].update(out.get(key) or {})
        record["lm_eval_version"] = out.get("lm_eval_version")
    print(make_table(record))
    if args.output:
        print(f"wrote {write_json(args.output, record)}")
    return record


if __name__ == "__main__":
    run_script(main)
