#!/usr/bin/env python
"""Collect result JSON files into one markdown table, models × tasks, like the HELM paper's Table 1.

Reads every ``.json`` file given (folders are searched recursively) that holds results in lm-eval's layout
``{"model_name": ..., "results": {task: {metric: value}}}`` — the files ``lm_eval --output_path`` writes,
``eval/harness.py --output`` writes, and ``eval/perplexity.py --output`` writes — or a list of such records
under ``"runs"`` (``eval/length_extrapolation.py``, ``eval/curvature.py``). Other JSON files are skipped
with a note on stderr.

Columns: one per (task, metric). By default a task shows the metrics its record names under
``primary_metrics`` (curvature: mean, median, fraction negative), else ``acc_norm`` if it has it, else
``acc``, ``exact_match``, ``word_perplexity`` or ``perplexity``, else every metric it has;
``--metric TASK=METRIC`` picks one. Subtasks of a group that is itself in the results (MMLU's 57
subjects) are hidden. Accuracies are shown in percent (``--raw`` shows the stored numbers); ``Avg`` is the
mean of the accuracy columns when there are at least two, as in the paper. When a model appears in
several files, later files win per task.

Usage::

    python eval/compare.py results/ --output results/table.md
    python eval/compare.py helm-d=results/helm-d.json llama=results/llama.json --stderr
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _shared import EvalError, run_main  # noqa: E402

PREFERRED_METRICS = ("acc_norm", "acc", "exact_match", "word_perplexity", "perplexity")
ACCURACY_METRICS = ("acc", "acc_norm", "exact_match")
PAPER_TASK_NAMES = {"commonsense_qa": "CommonsenseQA", "hellaswag": "HellaSwag", "openbookqa": "OpenBookQA",
                    "mmlu": "MMLU", "arc_challenge": "ARC-Challenge", "arc_easy": "ARC-Easy"}
SKIP_KEYS = {"alias", "name", "sample_len", " ", ""}


def metric_name(key: str) -> str:
    """lm-eval keys are ``metric,filter``; the default filter ``none`` is dropped from the column name."""
    metric, _, filt = key.partition(",")
    return metric if filt in ("", "none") else f"{metric} ({filt})"


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def model_label(record: dict, fallback: str) -> str:
    name = record.get("model_name")
    if not name:
        args = (record.get("config") or {}).get("model_args")
        if isinstance(args, dict):
            name = args.get("pretrained")
        elif isinstance(args, str):
            parts = dict(p.split("=", 1) for p in args.split(",") if "=" in p)
            name = parts.get("pretrained")
    if not name:
        return fallback
    return Path(str(name).rstrip("/")).name if "/" in str(name) else str(name)


def hidden_subtasks(record: dict) -> set:
    """Tasks listed under a group (recursively) when that group is in the results itself."""
    groups = record.get("group_subtasks") or {}
    results = record.get("results") or {}
    hidden, stack = set(), [g for g in groups if g in results]
    while stack:
        for sub in groups.get(stack.pop(), []):
            if sub not in hidden:
                hidden.add(sub)
                stack.append(sub)
    return hidden


def records_from_file(path: Path, name_override: str | None) -> list[dict]:
    """The result records in one JSON file (one, or several under ``runs``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        print(f"note: skipping {path}: not JSON ({error})", file=sys.stderr)
        return []
    if not isinstance(data, dict):
        return []
    records = data["runs"] if isinstance(data.get("runs"), list) else [data]
    out = []
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("results"), dict):
            print(f"note: skipping {path}: no 'results' mapping", file=sys.stderr)
            continue
        label = name_override if name_override and len(records) == 1 else model_label(record, path.stem)
        out.append({**record, "_label": label, "_file": str(path)})
    return out


def collect(inputs: list[str]) -> list[dict]:
    """Records from files and folders (``NAME=PATH`` renames the model of a single-record file)."""
    records = []
    for spec in inputs:
        name, _, path = spec.rpartition("=") if "=" in spec else (None, "", spec)
        target = Path(path).expanduser()
        if not target.exists():
            raise EvalError(f"result file or folder not found: {path}")
        files = sorted(target.rglob("*.json")) if target.is_dir() else [target]
        for file in files:
            records += records_from_file(file, name or None)
    if not records:
        raise EvalError(f"no result files with a 'results' mapping under {inputs}")
    return records


def build_table(records: list[dict], *, metrics: dict | None = None, tasks: list[str] | None = None,
                raw: bool = False, stderr: bool = False, digits: int = 1) -> str:
    """The markdown table (see the module docstring for the choice of columns)."""
    metrics = metrics or {}
    cells: dict[str, dict[tuple, tuple]] = {}  # model -> (task, metric) -> (value, stderr)
    shots: dict[str, int] = {}
    columns: list[tuple] = []
    for record in records:
        hidden = hidden_subtasks(record)
        shots.update({t: n for t, n in (record.get("n-shot") or {}).items() if isinstance(n, int)})
        row = cells.setdefault(record["_label"], {})
        for task, values in record["results"].items():
            if task in hidden or (tasks and task not in tasks) or not isinstance(values, dict):
                continue
            available = {metric_name(k): v for k, v in values.items()
                         if k not in SKIP_KEYS and "_stderr" not in k and (is_number(v) or v is None)}
            errors = {metric_name(k).replace("_stderr", ""): v for k, v in values.items() if "_stderr" in k}
            chosen = choose_metrics(task, available, metrics, (record.get("primary_metrics") or {}).get(task))
            for metric in chosen:
                key = (task, metric)
                if key not in columns:
                    columns.append(key)
                row[key] = (available.get(metric), errors.get(metric))
    if tasks:
        columns.sort(key=lambda c: tasks.index(c[0]))
    if not columns:
        raise EvalError("no metrics to show (check --tasks / --metric)")
    accuracy_cols = [c for c in columns if c[1] in ACCURACY_METRICS]
    show_avg = len(accuracy_cols) >= 2

    def header(col):
        task, metric = col
        title = PAPER_TASK_NAMES.get(task, task)
        shot = f", {shots[task]}-shot" if task in shots else ""
        return f"{title} ({metric}{shot})"

    def fmt(col, cell):
        value, err = cell if cell else (None, None)
        if not is_number(value):
            return "—"
        scale = 100.0 if (col[1] in ACCURACY_METRICS and not raw) else 1.0
        text = f"{value * scale:.{digits}f}" if scale == 100.0 else f"{value:.4g}"
        if stderr and is_number(err):
            text += f" ± {err * scale:.{digits}f}" if scale == 100.0 else f" ± {err:.2g}"
        return text

    head = ["Model"] + [header(c) for c in columns] + (["Avg"] if show_avg else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for model, row in cells.items():
        if not row:
            continue
        parts = [model] + [fmt(c, row.get(c)) for c in columns]
        if show_avg:
            values = [row[c][0] for c in accuracy_cols if c in row and is_number(row[c][0])]
            scale = 1.0 if raw else 100.0
            parts.append(f"{scale * sum(values) / len(values):.{digits}f}" if len(values) == len(accuracy_cols)
                         else "—")
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def choose_metrics(task: str, available: dict, overrides: dict, primary: list | None = None) -> list[str]:
    """``--metric`` override, else the record's own ``primary_metrics``, else the first preferred metric."""
    if task in overrides:
        return [overrides[task]] if overrides[task] in available else []
    if primary:
        return [m for m in primary if m in available]
    for metric in PREFERRED_METRICS:
        if metric in available:
            return [metric]
    return list(available)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the top of this file for which files and metrics are used.")
    parser.add_argument("inputs", nargs="+", metavar="[NAME=]PATH", help="result JSON files or folders")
    parser.add_argument("--metric", action="append", default=[], metavar="TASK=METRIC",
                        help="show METRIC for TASK (repeatable), e.g. hellaswag=acc")
    parser.add_argument("--tasks", help="comma-separated tasks to show, in this order (default: all)")
    parser.add_argument("--raw", action="store_true", help="show accuracies as stored (0-1), not in percent")
    parser.add_argument("--stderr", action="store_true", help="append ± standard error where known")
    parser.add_argument("--digits", type=int, default=1, help="decimals for percentages (default 1)")
    parser.add_argument("--output", metavar="MD", help="also write the table to this file")
    return parser


def main(argv: list[str] | None = None) -> str:
    args = build_parser().parse_args(argv)
    overrides = {}
    for spec in args.metric:
        task, sep, metric = spec.partition("=")
        if not sep or not task or not metric:
            raise EvalError(f"--metric expects TASK=METRIC, got {spec!r}")
        overrides[task] = metric
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    table = build_table(collect(args.inputs), metrics=overrides, tasks=tasks, raw=args.raw, stderr=args.stderr,
                        digits=args.digits)
    print(table, end="")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(table, encoding="utf-8")
    return table


if __name__ == "__main__":
    run_main(main)
