#!/usr/bin/env python
"""Perplexity at 1×, 2×, 4×, 8× the training length for a set of checkpoints (e.g. one per PE variant).

The seeds' length-extrapolation tables, reproducible on our models: every checkpoint is scored with packed,
non-overlapping windows of ``factor × L`` tokens (``L`` = the training length) over the same text, using
``perplexity.py``'s windows and scoring. For one model all factors score the same tokens: the token stream
is cut to a multiple of ``max(factor) × L`` first, so only the window length changes between columns (the
first token of each window has no target, so the number of scored tokens differs by one per window).

A checkpoint that cannot run a length at all (``learned`` positions beyond their table) gets an empty cell
and a note in the CSV instead of aborting the run.

Usage::

    python eval/length_extrapolation.py \\
        --model hope=runs/tiny-hope --model alibi=runs/tiny-alibi --model learned=runs/tiny-learned \\
        --files data/validation.jsonl --train-length 256 --output-dir results/extrapolation

Outputs in ``--output-dir``: ``extrapolation.csv`` (one row per model × factor), ``extrapolation.png``
(perplexity against the length factor, one line per model) and ``extrapolation.json`` (the result format
``eval/compare.py`` reads: task ``length_extrapolation``, metrics ``ppl@1x``, ``ppl@2x``, ...).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tqdm.auto import tqdm  # noqa: E402

from _shared import (  # noqa: E402
    EvalError,
    add_text_arguments,
    load_model,
    load_tokenizer,
    matplotlib_pyplot,
    model_max_length,
    parse_named,
    run_main,
    text_label,
    texts_from_args,
    write_json,
)
from perplexity import make_windows, token_stream, window_nll  # noqa: E402

CSV_FIELDS = ["model", "path", "positional", "train_length", "factor", "seq_len", "windows", "scored_tokens",
              "mean_nll", "perplexity", "note"]


def extrapolation_rows(name: str, path: str, texts: list[str], *, factors: list[int], train_length: int | None,
                       batch_size: int, max_tokens: int | None, device: str | None, dtype: str,
                       progress: bool) -> list[dict]:
    """One CSV row per factor for one checkpoint."""
    model = load_model(path, device=device, dtype=dtype)
    tokenizer = load_tokenizer(path)
    length = train_length or model_max_length(model)
    ids = token_stream(texts, tokenizer, eos_id=tokenizer.eos_token_id)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    span = max(factors) * length
    usable = ids.numel() // span * span
    if usable == 0:
        raise EvalError(f"{name}: the text has {ids.numel()} tokens, fewer than {max(factors)} × {length} = {span}; "
                        "use more text, a smaller --train-length or fewer --factors")
    ids = ids[:usable]
    rows = []
    for factor in factors:
        seq_len = factor * length
        windows = make_windows(usable, seq_len)
        positional = getattr(model.config, "positional", None) or model.config.model_type
        row = {"model": name, "path": path, "positional": positional,
               "train_length": length, "factor": factor, "seq_len": seq_len, "windows": len(windows),
               "scored_tokens": "", "mean_nll": "", "perplexity": "", "note": ""}
        try:
            nll, count = window_nll(model, ids, windows, batch_size=batch_size, progress=progress,
                                    desc=f"{name} {factor}x")
        except ValueError as error:  # e.g. learned positions past their table: record, keep going
            row["note"] = str(error).split("\n")[0]
            print(f"warning: {name} at {factor}x ({seq_len} tokens) failed: {row['note']}", file=sys.stderr)
        else:
            row.update(scored_tokens=count, mean_nll=nll / count, perplexity=math.exp(nll / count))
        rows.append(row)
    return rows


def plot(rows: list[dict], output: str | Path, *, title: str):
    """Perplexity against the length factor (log2 scale), one line per model; log y once it spans 10x."""
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    factors = sorted({row["factor"] for row in rows})
    values = [row["perplexity"] for row in rows if row["perplexity"] != ""]
    for name in dict.fromkeys(row["model"] for row in rows):
        points = [(r["factor"], r["perplexity"]) for r in rows if r["model"] == name and r["perplexity"] != ""]
        if points:
            x, y = zip(*points, strict=True)
            ax.plot(x, y, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(factors, [f"{f}×" for f in factors])
    log_y = bool(values) and max(values) > 10 * min(values)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("evaluation length / training length")
    ax.set_ylabel("perplexity (log scale)" if log_y else "perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="checkpoint")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return fig


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def result_records(rows: list[dict], label: str) -> dict:
    """The rows as result records for ``compare.py``: one run per model, metrics ``ppl@<factor>x``."""
    runs = {}
    for row in rows:
        run = runs.setdefault(row["model"], {"model_name": row["model"], "model_path": row["path"],
                                             "source": "eval/length_extrapolation.py",
                                             "results": {"length_extrapolation": {}}})
        value = row["perplexity"] if row["perplexity"] != "" else None
        run["results"]["length_extrapolation"][f"ppl@{row['factor']}x"] = value
    return {"text": label, "runs": list(runs.values())}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the top of this file for how windows and tokens are chosen.")
    parser.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                        help="checkpoint folder (repeat for several; NAME labels its line)")
    add_text_arguments(parser)
    parser.add_argument("--train-length", type=int, metavar="L",
                        help="training sequence length (default: each model's max_position_embeddings)")
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8], help="length factors (default 1 2 4 8)")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="use only the first N tokens of the text")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-dir", default="length_extrapolation", help="where the CSV, PNG and JSON go")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if any(f < 1 for f in args.factors):
        raise EvalError(f"--factors must be positive integers, got {args.factors}")
    factors = sorted(set(args.factors))
    models = [parse_named(spec) for spec in args.model]
    texts = texts_from_args(args)
    rows: list[dict] = []
    for name, path in tqdm(models, desc="checkpoints", disable=args.no_progress):
        rows += extrapolation_rows(name, path, texts, factors=factors, train_length=args.train_length,
                                   batch_size=args.batch_size, max_tokens=args.max_tokens, device=args.device,
                                   dtype=args.dtype, progress=not args.no_progress)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "extrapolation.csv")
    label = text_label(args)
    plot(rows, out / "extrapolation.png", title=f"Length extrapolation on {label}")
    write_json(out / "extrapolation.json", result_records(rows, label))
    for row in rows:
        ppl = f"{row['perplexity']:.3f}" if row["perplexity"] != "" else f"— ({row['note']})"
        print(f"{row['model']:>20}  {row['factor']}x  seq_len={row['seq_len']:<6}  perplexity={ppl}")
    print(f"wrote {out / 'extrapolation.csv'}, {out / 'extrapolation.png'}, {out / 'extrapolation.json'}")
    return rows


if __name__ == "__main__":
    run_main(main)
