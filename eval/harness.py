#!/usr/bin/env python
"""Benchmark a checkpoint with lm-evaluation-harness: the paper's suite, the offline local tasks, or any tasks.

A saved HELM checkpoint works with the stock `lm_eval --model hf`; this wrapper runs a suite (groups of
tasks, each with its own number of shots) on one loaded model into one lm-eval-style result file.

    python eval/harness.py --model runs/helm-d --suite paper --batch-size 16 --output results/helm-d.json
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
from pathlib import Path

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

from helm.evaluation import (MODEL_SPEC_HELP, EvalError, add_loading_arguments, at_least, check_device,
                             check_model_folder, check_vocabulary, check_writable, loaded, run_script, split_model_spec,
                             user_path, write_json)

TASK_DIR = Path(__file__).resolve().parent / "tasks"
# A suite is (task, shots, reported metric) rows. "paper" is Table 1 of the HELM paper (§5.1, App. C.3),
# tabulated in eval/README.md: accuracy everywhere, OpenBookQA with letter choices (eval/tasks/).
SUITES = {"paper": [("commonsense_qa", 0, "acc"), ("hellaswag", 0, "acc"), ("helm_openbookqa_letters", 0, "acc"),
                    ("mmlu", 5, "acc"), ("arc_challenge", 5, "acc")], "local": [("helm_local", 0, None)]}


def runs(suite: list) -> list[tuple[list[str], int]]:
    """lm-eval applies one number of shots per run: the suite's tasks grouped by shots, in order."""
    return [([task for task, n, _ in suite if n == shots], shots) for shots in dict.fromkeys(n for _, n, _ in suite)]


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
    parser.add_argument("--num-fewshot", type=at_least(0), default=0, help="shots for --tasks (default 0)")
    parser.add_argument("--batch-size", default="1", help="an integer or 'auto' (default 1)")
    add_loading_arguments(parser)
    parser.add_argument("--limit", type=float, help="at most this many documents per task (or a fraction < 1)")
    parser.add_argument("--output", type=user_path, metavar="JSON", help="write the merged results here (a .json file)")
    parser.add_argument("--log-samples", action="store_true", help="keep per-document outputs in the result file")
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    name, path = split_model_spec(args.model)
    path, _ = check_model_folder(path)  # lm-eval reads the tokenizer from the model folder
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
    device = str(check_device(args.device))  # the default (cuda if available, else cpu), or a one-line error
    return evaluate(args, name, path, groups, device)


def evaluate(args, name: str, path: str, groups: list[tuple[list[str], int]], device: str) -> dict | None:
    """Run the checked ``groups`` (tasks, shots) of ``args`` on the checkpoint ``path`` into one result record."""
    manager = TaskManager(include_path=str(TASK_DIR))  # before loading the model, so a typo fails fast
    names = manager.all_tasks  # tasks, groups and tags; lm-eval also takes a path to a task YAML file
    if unknown := [task for tasks, _ in groups for task in tasks if task not in names and not Path(task).is_file()]:
        raise EvalError("--tasks: no lm-eval task, group or tag " + ", ".join(f"{task!r}" + "".join(
            f" (did you mean {near!r}?)" for near in difflib.get_close_matches(task, names, 1)) for task in unknown))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    # importing helm (with helm.evaluation) registered the HELM model types, so HFLM needs no remote code for them
    lm = loaded("--model", path, lambda name: HFLM(pretrained=name, trust_remote_code=args.trust_remote_code,
                                                   batch_size=args.batch_size, device=device, dtype=args.dtype))
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
