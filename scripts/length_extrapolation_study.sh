#!/usr/bin/env bash
# Issue 15's length-extrapolation study, rerun from a fresh clone (after the README's install command):
#
#   bash scripts/length_extrapolation_study.sh
#
# Trains tiny-helm-d once per positional encoding and tiny-llama (RoPE) at T=256 on the default data, with the same
# recipe, budget and seed (configs/train/tiny-helm-d.yaml, STEPS optimiser steps of 8 x 256 tokens), then evaluates
# every checkpoint at 256 ... 4096 tokens with eval/length_extrapolation.py; the rotary models (hope, rope3d,
# tiny-llama) also with each RoPE scaling applied at evaluation (factor = evaluation length / 256). Writes
# $OUT/extrapolation.{csv,png,json} and the README's figure $OUT/study.png, and prints the README's table
# (perplexity, encoding x length).
# Environment: STEPS (default 300), OUT (results/length_extrapolation), RUNS (runs/pe-study),
# ENCODINGS (the tiny-helm-d presets' encodings), SCALINGS, MAX_TOKENS (evaluation tokens, default 32768).
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
OUT=${OUT:-results/length_extrapolation}
RUNS=${RUNS:-runs/pe-study}
ENCODINGS=${ENCODINGS:-"hope learned sinusoidal alibi rope3d hope_boost bipe_hope bipe_alibi none"}
SCALINGS=${SCALINGS:-"none linear dynamic yarn longrope resonance"}
MAX_TOKENS=${MAX_TOKENS:-32768}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

train() {  # train <name> <recipe> <preset>: skipped when $RUNS/<name>/final exists (rerun after an interruption)
  if [ -f "$RUNS/$1/final/config.json" ]; then echo "[study] $1: trained already"; return; fi
  echo "[study] training $1 ($3, $STEPS steps)"
  python train.py --config "$2" --model.preset="$3" --train.output_dir="$RUNS/$1" --train.max_steps="$STEPS" \
    --train.overwrite=true --train.eval_every=0 --train.save_every=0 --train.eval_at_start=false \
    --train.progress_bar=false --train.log_every=100 --demo.prompt=null
}

models=()
for enc in $ENCODINGS; do
  preset=tiny-helm-d-$enc
  [ "$enc" = hope ] && preset=tiny-helm-d
  train "$enc" configs/train/tiny-helm-d.yaml "$preset"
  models+=(--model "$enc=$RUNS/$enc/final")
done
train llama-rope configs/train/tiny-llama.yaml tiny-llama
models+=(--model "llama-rope=$RUNS/llama-rope/final")

# a scaling the model's encoding does not take becomes a note row, not a failure
python eval/length_extrapolation.py "${models[@]}" --files data/default --split validation --train-length 256 \
  --factors 1 2 4 8 16 --max-tokens "$MAX_TOKENS" --rope-scaling $SCALINGS --output-dir "$OUT" --no-progress \
  | tail -n 1

# the README's table and figure: unscaled encodings (left), the rotary models with each scaling (right)
python - "$OUT" <<'EOF'
import csv, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

out = sys.argv[1]
rows = [r for r in csv.DictReader(open(f"{out}/extrapolation.csv")) if r["perplexity"]]
lengths = sorted({int(r["seq_len"]) for r in rows})
curves = {}
for r in rows:
    curves.setdefault(r["model"], {})[int(r["seq_len"])] = float(r["perplexity"])
# a scaling changes nothing at the training length: keep the scaled rows that were measured past it
curves = {name: c for name, c in curves.items() if len(c) > 1 or "+" not in name}
print("| model | " + " | ".join(str(n) for n in lengths) + " |")
print("| --- " * (len(lengths) + 1) + "|")
for name, c in curves.items():
    print(f"| {name} | " + " | ".join(f"{c[n]:,.1f}" if n in c else "—" for n in lengths) + " |")

scaled = {name.split("+")[0] for name in curves if "+" in name}
style = {s: i % 6 for i, s in enumerate(dict.fromkeys(name.partition("+")[2] for name in curves))}  # "" first
fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
panels = [(axes[0], [n for n in curves if "+" not in n], "each encoding, no scaling"),
          (axes[1], [n for n in curves if n.split("+")[0] in scaled], "rotary encodings with RoPE scalings at evaluation")]
for ax, names, title in panels:
    bases = list(dict.fromkeys(n.split("+")[0] for n in names))
    for name in names:
        base, _, scaling = name.partition("+")
        i = style[scaling]  # one colour per model, one line style and marker per scaling
        xs = sorted(curves[name])
        ax.plot(xs, [curves[name][x] for x in xs], marker="osv^Dx"[i], ms=4, label=name,
                linestyle=["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))][i], color=f"C{bases.index(base) % 10}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("evaluation length (trained at 256)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
axes[0].set_ylabel("validation perplexity")
fig.tight_layout()
fig.savefig(f"{out}/study.png", dpi=110)
print(f"[study] figure: {out}/study.png")
EOF
echo "[study] done in $((SECONDS / 60)) min $((SECONDS % 60)) s"
