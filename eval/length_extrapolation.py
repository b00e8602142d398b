#!/usr/bin/env python
"""Perplexity at 1x, 2x, 4x, 8x the training length for a set of checkpoints (e.g. one per PE variant).

Packed windows of factor x L tokens over the same tokens at every factor, so only the window length changes;
a model that cannot run a length gets an empty cell and a note (when no cell at all can be scored: exit 2, and
nothing is written). Outputs: see eval/README.md.

    python eval/length_extrapolation.py --model hope=runs/tiny-hope --model learned=runs/tiny-learned \\
        --files data/validation.jsonl --train-length 256 --output-dir results/extrapolation
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from matplotlib.figure import Figure
from tqdm.auto import tqdm

from helm.evaluation import (
    MODEL_SPEC_HELP, ROPE_SCALINGS, EvalError, add_loading_arguments, add_text_arguments, at_least, check_window,
    check_writable, data_files, format_perplexity, load_checkpoint, model_names, perplexity, rows_nll, run_script,
    sliding_windows, texts_of, token_stream, user_path, with_rope_scaling, write_json)

OUTPUT_FILES = ("extrapolation.csv", "extrapolation.png", "extrapolation.json")
CSV_FIELDS = ["model", "path", "positional", "train_length", "factor", "seq_len", "windows", "scored_tokens",
              "mean_nll", "perplexity", "note"]


def extrapolation_rows(name: str, path: str, texts: list[str], args, scaling: str = "none") -> list[dict]:
    """One CSV row per factor for one checkpoint, with the RoPE ``scaling`` applied at each factor > 1."""
    model, tokenizer = load_checkpoint(path, device=args.device, dtype=args.dtype,
                                       trust_remote_code=args.trust_remote_code)
    length = model.config.max_position_embeddings if args.train_length is None else args.train_length
    ids = token_stream(texts, tokenizer, eos_id=tokenizer.eos_token_id)[:args.max_tokens]
    span = max(args.factors) * length
    if ids.numel() < span:
        raise EvalError(f"{name}: the text has {ids.numel()} tokens, fewer than {max(args.factors)} x {length}; "
                        "use more text, a smaller --train-length or fewer --factors")
    ids = ids[:ids.numel() // span * span]
    rows, name = [], name if scaling == "none" else f"{name}+{scaling}"
    for factor in args.factors:
        windows = sliding_windows(ids, factor * length)
        row = dict.fromkeys(CSV_FIELDS, "")
        row.update(model=name, path=path, positional=getattr(model.config, "positional", model.config.model_type),
                   train_length=length, factor=factor, seq_len=factor * length, windows=len(windows["input_ids"]))
        try:  # a scaling the model's encoding does not take is recorded as a note, like a length it cannot run
            # learned positions past their table: transformers' models would fail with an IndexError
            check_window(model, factor * length, "seq_len")
            nll, count = rows_nll(with_rope_scaling(model, scaling, factor, length), windows,
                                  batch_size=args.batch_size, progress=not args.no_progress, desc=f"{name} {factor}x")
        except ValueError as error:  # e.g. learned positions past their table: record it, keep going
            row["note"] = str(error).split("\n")[0]
            print(f"warning: {name} at {factor}x ({row['seq_len']} tokens) failed: {row['note']}", file=sys.stderr)
        else:
            mean = float(nll / count)
            row.update(scored_tokens=int(count), mean_nll=mean, perplexity=perplexity(mean))
        rows.append(row)
    return rows


def plot(rows: list[dict], output: Path, *, title: str):
    """Perplexity against the length factor (log2 axis), one line per model; log y once it spans 10x."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    scored = [row for row in rows if row["perplexity"] != ""]
    for name in dict.fromkeys(row["model"] for row in rows):
        points = [(row["factor"], row["perplexity"]) for row in scored if row["model"] == name]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
    factors = sorted({row["factor"] for row in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(factors, [f"{factor}×" for factor in factors])
    values = [row["perplexity"] for row in scored]
    log_y = bool(values) and max(values) > 10 * min(values)
    ax.set_yscale("log" if log_y else "linear")
    ax.set_xlabel("evaluation length / training length")
    ax.set_ylabel("perplexity (log scale)" if log_y else "perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(title="checkpoint")
    fig.savefig(output, dpi=120)
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                        help=f"checkpoint folder (repeat for several); {MODEL_SPEC_HELP}")
    add_text_arguments(parser)
    parser.add_argument("--train-length", type=at_least(1), metavar="L",
                        help="training sequence length (default: each model's max_position_embeddings)")
    parser.add_argument("--factors", type=at_least(1), nargs="+", default=[1, 2, 4, 8],
                        help="length factors (default 1 2 4 8)")
    parser.add_argument("--max-tokens", type=at_least(1), metavar="N", help="use only the first N tokens of the text")
    parser.add_argument("--rope-scaling", nargs="+", choices=ROPE_SCALINGS, default=["none"],
                        help="RoPE scalings applied at evaluation to rotary models, each its own line (default none)")
    parser.add_argument("--batch-size", type=at_least(1), default=1)
    add_loading_arguments(parser)
    parser.add_argument("--output-dir", type=user_path, default=Path("length_extrapolation"),
                        help="where the CSV, PNG and JSON go")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    args.factors = sorted(set(args.factors))
    models = model_names(args.model)
    check_writable(args.output_dir, "--output-dir", folder=True, files=OUTPUT_FILES,
                   inputs=data_files(args.data, args.split), models=[path for _, path in models])
    texts = texts_of(args)
    rows = []
    for name, path in tqdm(models, desc="checkpoints", disable=args.no_progress):
        for scaling in args.rope_scaling:
            rows += extrapolation_rows(name, path, texts, args, scaling)
    if not any(row["perplexity"] != "" for row in rows):  # a table of notes only: exit 2, not a result
        raise EvalError(f"no length could be scored: every one of the {len(rows)} model x factor x scaling cells "
                        f"failed (see the warnings above); nothing was written to {str(args.output_dir)!r}")
    csv_file, png_file, json_file = (args.output_dir / file for file in OUTPUT_FILES)
    with csv_file.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()} for row in rows)
    label = "+".join(Path(source).stem for source in args.data)
    plot(rows, png_file, title=f"Length extrapolation on {label}")
    runs = {}
    for row in rows:
        run = runs.setdefault(row["model"], {"model_name": row["model"], "model_path": row["path"],
                                             "source": "eval/length_extrapolation.py",
                                             "results": {"length_extrapolation": {}}})
        run["results"]["length_extrapolation"][f"ppl@{row['factor']}x"] = row["perplexity"] or None
        ppl = format_perplexity(row['perplexity'], 3) if row["perplexity"] != "" else f"— ({row['note']})"
        print(f"{row['model']:>20}  {row['factor']}x  seq_len={row['seq_len']:<6}  perplexity={ppl}")
    write_json(json_file, {"text": label, "runs": list(runs.values())})
    print(f"wrote {csv_file}, {png_file}, {json_file}")
    return rows


if __name__ == "__main__":
    run_script(main)
