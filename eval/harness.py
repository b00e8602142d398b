#!/usr/bin/env python
"""Benchmark a checkpoint with lm-evaluation-harness: the paper's suite, the offline local tasks, or any tasks.

A saved HELM checkpoint works with the stock harness as it is::

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --tasks hellaswag --num_fewshot 0

This wrapper adds suites (several task groups, each with its own number of shots, merged into one result
file) and the local tasks of ``eval/tasks/``. It uses the stock ``hf`` model of lm-eval (``HFLM``) and
imports ``helm`` first, so HELM checkpoints load with or without remote code.

Suites:

* ``paper`` — the HELM paper's evaluation (needs network access to download the datasets):
  CommonsenseQA, HellaSwag, OpenBookQA 0-shot; MMLU, ARC-Challenge 5-shot.
* ``local`` — the small offline tasks in ``eval/tasks/`` (tag ``helm_local``: multiple choice, rolling
  perplexity, greedy generation), whose data ships with the repository.

Usage::

    python eval/harness.py --model runs/helm-d --suite paper --batch-size 16 --output results/helm-d.json
    python eval/harness.py --model runs/helm-d --suite local
    python eval/harness.py --model runs/helm-d --tasks arc_easy,piqa --num-fewshot 0
    python eval/harness.py --model runs/helm-d --suite paper --dry-run   # print the stock lm_eval commands

The result file has lm-eval's layout (``results``, ``n-shot``, ``versions``, ...) plus ``model_name``; pass
it to ``eval/compare.py`` for a models × tasks table.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _shared import (  # noqa: E402
    TASK_DIR,
    EvalError,
    check_checkpoint,
    default_device,
    parse_named,
    require,
    run_main,
    write_json,
)

# (tasks, shots) groups; lm-eval applies one --num_fewshot per run, so a suite is several runs
SUITES = {
    "paper": [(["commonsense_qa", "hellaswag", "openbookqa"], 0), (["mmlu", "arc_challenge"], 5)],
    "local": [(["helm_local"], 0)],
}


def stock_commands(path: str, groups, *, batch_size, device: str, limit, output_dir: str | None) -> list[str]:
    """The equivalent plain ``lm_eval`` command lines (one per group of shots)."""
    lines = []
    for tasks, shots in groups:
        argv = ["lm_eval", "--model", "hf", "--model_args", f"pretrained={path},trust_remote_code=True",
                "--tasks", ",".join(tasks), "--num_fewshot", str(shots), "--batch_size", str(batch_size),
                "--device", device]
        if any(t.startswith("helm_local") for t in tasks):
            argv += ["--include_path", str(TASK_DIR)]
        if limit is not None:
            argv += ["--limit", str(limit)]
        if output_dir:
            argv += ["--output_path", output_dir]
        lines.append(shlex.join(argv))
    return lines


def evaluate(path: str, groups, *, batch_size=1, device: str | None = None, dtype: str = "float32", limit=None,
             log_samples: bool = False) -> dict:
    """Run every ``(tasks, shots)`` group on one loaded model; merge the results into one lm-eval-style dict."""
    require("lm_eval", "lm-evaluation-harness benchmarking")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import helm  # noqa: F401  (registers the HELM model types; remote code is then not needed)

    path = check_checkpoint(path)
    lm = HFLM(pretrained=path, trust_remote_code=True, batch_size=batch_size, device=device or default_device(),
              dtype=dtype)
    manager = TaskManager(include_path=str(TASK_DIR))
    merged: dict = {"results": {}, "group_subtasks": {}, "configs": {}, "versions": {}, "n-shot": {},
                    "higher_is_better": {}, "n-samples": {}, "samples": {}}
    for tasks, shots in groups:
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=shots, limit=limit, task_manager=manager,
                                      log_samples=log_samples)
        if out is None:  # non-zero ranks of a distributed run
            continue
        for key in merged:
            merged[key].update(out.get(key) or {})
        merged["lm_eval_version"] = out.get("lm_eval_version")
    if not log_samples:
        merged.pop("samples")
    return merged


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the top of this file for the suites and the stock lm_eval command.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="[NAME=]PATH", help="checkpoint folder (save_pretrained)")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--suite", choices=sorted(SUITES), help="a preset list of tasks and shots")
    choice.add_argument("--tasks", help="comma-separated lm-eval tasks (with --num-fewshot)")
    parser.add_argument("--num-fewshot", type=int, default=0, help="shots for --tasks (default 0)")
    parser.add_argument("--batch-size", default="1", help="an integer or 'auto' (default 1)")
    parser.add_argument("--device", default=None, help=f"torch device (default: {default_device()})")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or auto")
    parser.add_argument("--limit", type=float, help="at most this many documents per task (or a fraction < 1)")
    parser.add_argument("--output", metavar="JSON", help="write the merged results here")
    parser.add_argument("--log-samples", action="store_true", help="keep per-document outputs in the result file")
    parser.add_argument("--dry-run", action="store_true", help="print the equivalent stock lm_eval commands and exit")
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    name, path = parse_named(args.model)
    path = check_checkpoint(path)
    if args.num_fewshot < 0:
        raise EvalError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.tasks:
        groups = [([t.strip() for t in args.tasks.split(",") if t.strip()], args.num_fewshot)]
    else:
        groups = SUITES[args.suite or "local"]
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    device = args.device or default_device()
    commands = stock_commands(path, groups, batch_size=batch_size, device=device, limit=limit,
                              output_dir=str(Path(args.output).parent) if args.output else None)
    print("equivalent stock lm-eval commands:\n  " + "\n  ".join(commands))
    if args.dry_run:
        return None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = evaluate(path, groups, batch_size=batch_size, device=device, dtype=args.dtype, limit=limit,
                       log_samples=args.log_samples)
    record = {"model_name": name, "model_path": path, "source": "eval/harness.py",
              "suite": args.suite if not args.tasks else None, **results}
    from lm_eval.utils import make_table

    print(make_table(record))
    if args.output:
        write_json(args.output, record)
        print(f"wrote {args.output}")
    return record


if __name__ == "__main__":
    run_main(main)
