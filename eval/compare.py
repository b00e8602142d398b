#!/usr/bin/env python
"""Collect result JSON files into one markdown table, models x tasks, like the HELM paper's Table 1.

Reads lm-eval result files ({"model_name", "results": {task: {metric: value}}}, or lists under "runs"); a task
shows its record's "primary_metrics", else the first of PREFERRED_METRICS. See eval/README.md.

    python eval/compare.py results/ --output results/table.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from helm.evaluation import MODEL_SPEC_HELP, EvalError, check_writable, run_script, split_model_spec, user_path

PREFERRED_METRICS = ("acc_norm", "acc", "exact_match", "word_perplexity", "perplexity")
ACCURACY_METRICS = ("acc", "acc_norm", "exact_match")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_name(key: str) -> str:
    """lm-eval keys are ``metric,filter``; the default filter ``none`` is left out of the column name."""
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else f"{metric} ({filt})"


def is_accuracy(metric: str) -> bool:
    return metric.partition(" (")[0] in ACCURACY_METRICS


def model_label(record: dict, fallback: str) -> str:
    """``model_name``, else the ``pretrained=`` of lm-eval's ``model_args``; a path is shortened to its last part."""
    args = (record.get("config") or {}).get("model_args")
    if isinstance(args, str):
        args = dict(part.split("=", 1) for part in args.split(",") if "=" in part)
    name = record.get("model_name") or (args or {}).get("pretrained") or fallback
    return Path(str(name).rstrip("/")).name


def input_files(inputs: list[str]) -> list[Path]:
    """The files :func:`records` reads: each named file, and the ``*.json`` files under each named folder."""
    targets = [Path(split_model_spec(spec)[1]).expanduser() for spec in inputs]
    return [file for target in targets for file in (sorted(target.rglob("*.json")) if target.is_dir() else [target])]


def records(inputs: list[str]) -> list[dict]:
    """The result records of files and folders (``NAME=PATH`` renames the model of a single-record file)."""
    out = []
    for spec in inputs:
        name, path = split_model_spec(spec)
        target = Path(path).expanduser()
        if not target.exists():
            raise EvalError(f"result file or folder not found: {path}")
        for file in sorted(target.rglob("*.json")) if target.is_dir() else [target]:
            try:
                data = json.loads(file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                print(f"note: skipping {file}: not JSON ({error})", file=sys.stderr)
                continue
            runs = data.get("runs") if isinstance(data, dict) and isinstance(data.get("runs"), list) else [data]
            for run in runs:
                if not isinstance(run, dict) or not isinstance(run.get("results"), dict):
                    print(f"note: skipping {file}: no 'results' mapping", file=sys.stderr)
                    continue
                out.append({**run, "_label": name if name and len(runs) == 1 else model_label(run, file.stem),
                            "_file": file})
    if not out:
        raise EvalError(f"no result files with a 'results' mapping under {inputs}")
    paths = {}  # one row per label: results of two models under one label (train.py's final/) would overwrite
    for run in out:
        first = paths.setdefault(run["_label"], (run.get("model_path"), run["_file"]))
        if first[0] != run.get("model_path"):
            raise EvalError(f"two models are labelled {run['_label']!r} ({first[0]} in {first[1]}, "
                            f"{run.get('model_path')} in {run['_file']}): name them, NAME=PATH")
    return out


def hidden_subtasks(record: dict) -> set:
    """Tasks listed under a group (recursively) when that group is in the results itself."""
    groups, hidden = record.get("group_subtasks") or {}, set()
    stack = [group for group in groups if group in record["results"]]
    while stack:
        for sub in groups.get(stack.pop(), []):
            if sub not in hidden:
                hidden.add(sub)
                stack.append(sub)
    return hidden


def build_table(runs: list[dict], *, metrics: dict) -> str:
    cells: dict[str, dict[tuple, float]] = {}  # model -> (task, metric) -> value
    shots, columns, sources = {}, [], {}
    for record in runs:
        hidden = hidden_subtasks(record)
        shots.update({t: n for t, n in (record.get("n-shot") or {}).items() if isinstance(n, int)})
        row = cells.setdefault(record["_label"], {})
        for task, values in record["results"].items():
            if task in hidden or not isinstance(values, dict):
                continue
            available = {metric_name(k): v for k, v in values.items()
                         if "_stderr" not in k and (is_number(v) or v is None)}
            primary = (record.get("primary_metrics") or {}).get(task)
            if task in metrics:
                chosen = [metrics[task]] if metrics[task] in available else []
            else:
                chosen = ([m for m in primary if m in available] if primary else
                          next(([m] for m in PREFERRED_METRICS if m in available), list(available)))
            for metric in chosen:
                if (task, metric) not in columns:
                    columns.append((task, metric))
                # one cell, two results (the same model measured twice, e.g. with other settings): say which
                first = sources.setdefault((record["_label"], task, metric), (available[metric], record.get("_file")))
                if first[0] != available[metric]:
                    raise EvalError(f"{record['_label']!r} has two results for {task} ({metric}): {first[0]} in "
                                    f"{first[1]}, {available[metric]} in {record.get('_file')}; name them, NAME=PATH")
                row[(task, metric)] = available[metric]
    if not columns:
        raise EvalError("no metrics to show (check --metric)")
    accuracies = [c for c in columns if is_accuracy(c[1])]

    def cell(column, value):
        if not is_number(value):
            return "—"
        return f"{100 * value:.1f}" if is_accuracy(column[1]) else f"{value:.4g}"

    head = ["Model"] + [f"{task} ({metric}"
                        + (f", {shots[task]}-shot)" if task in shots else ")") for task, metric in columns]
    head += ["Avg"] if len(accuracies) >= 2 else []
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for model, row in cells.items():
        if not row:
            continue
        parts = [model] + [cell(column, row.get(column)) for column in columns]
        if len(accuracies) >= 2:
            values = [row[c] for c in accuracies if is_number(row.get(c))]
            parts.append(f"{100 * sum(values) / len(values):.1f}" if len(values) == len(accuracies) else "—")
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", metavar="[NAME=]PATH",
                        help=f"result JSON files or folders; {MODEL_SPEC_HELP}")
    parser.add_argument("--metric", action="append", default=[], metavar="TASK=METRIC",
                        help="show METRIC for TASK (repeatable), e.g. hellaswag=acc")
    parser.add_argument("--output", type=user_path, metavar="MD",
                        help="also write the table to this file (Markdown)")
    return parser


def main(argv: list[str] | None = None) -> str:
    args = build_parser().parse_args(argv)
    overrides = dict(spec.partition("=")[::2] for spec in args.metric)
    if not all(task and metric for task, metric in overrides.items()):
        raise EvalError(f"--metric expects TASK=METRIC, got {args.metric}")
    if args.output:
        check_writable(args.output, "--output", inputs=input_files(args.inputs))
        if args.output.suffix.lower() not in ("", ".md", ".markdown", ".txt"):  # it holds a Markdown table
            raise EvalError(f"--output {str(args.output)!r}: the table is Markdown; give a .md, .markdown or .txt file")
    table = build_table(records(args.inputs), metrics=overrides)
    print(table, end="")
    if args.output:
        args.output.write_text(table, encoding="utf-8")
    return table


if __name__ == "__main__":
    run_script(main)
