#!/usr/bin/env python
"""Attention score versus relative distance for each positional encoding of the zoo (seed 000, Fig. 4-5).

A query sits at position D and keys at D, D-1, ..., 0. With q = lift(q_s), k = lift(k_s) on the hyperboloid
and a head at temperature tau = 2 (logit scale 1), the logit of a pair splits as

    logit(m, n) = <q_m, k_n>_L + bias = -q_t k_t  +  [ q_s'ᵀ k_s' + bias(m, n) ]
                                        time term    space score (plotted)

where q_s', k_s' are the space parts after the variant's rotation (hope, rope3d) or absolute embedding
(learned) and bias its logit bias (alibi, hope_boost). Rotations fix the time coordinate, so all the distance
dependence lives in the space score, the analogue of seed 000's qᵀ M k.
Panels, over --samples draws per head: aligned k_s = q_s (Fig. 4, mean), and a Gaussian query with a fresh
Gaussian key per position (Fig. 5: the mean, and the standard deviation = how much content can still move a
logit). ``learned`` uses a fresh table; ``alibi`` shows its last head (gentlest slope). Distance axis: linear to 1,
then logarithmic.

    python eval/pe_decay.py --output figures/pe_decay.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

from matplotlib.figure import Figure
import torch
from tqdm.auto import tqdm

from helm.evaluation import EvalError, at_least, check_writable, run_script, user_path
from helm.manifold.math import curvature_to_k, lift
from helm.nn.positional import (POSITIONAL_ENCODINGS, NoPositionalEncoding, alibi_slopes,
                                build_positional_encoding)

PANELS = (("aligned", "mean", "aligned: k = q (mean over draws)"),
          ("random", "mean", "random Gaussian q, k: mean over draws"),
          ("random", "std", "random Gaussian q, k: std over draws"))


@torch.no_grad()
def scores_by_distance(pe, q_s: torch.Tensor, k_s: torch.Tensor, *, max_distance: int,
                       k: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Space scores and time terms, each ``[S, H, D+1]``, of the query ``q_s [S, H, d]`` at position ``D``.

    ``k_s`` is ``[S, H, d]`` (the same key at every position) or ``[S, H, D+1, d]`` (key ``Δ`` at position
    ``D - Δ``). Column ``Δ`` is relative distance ``Δ = m - n``; the logit is ``space - time``.
    """
    S, H, d = q_s.shape
    n_keys = max_distance + 1
    q_pos = torch.full((S, 1), max_distance, dtype=torch.long)
    k_pos = (max_distance - torch.arange(n_keys)).expand(S, n_keys)
    q = q_s.unsqueeze(2)  # [S, H, 1, d]
    kk = k_s.unsqueeze(2).expand(S, H, n_keys, d) if k_s.dim() == 3 else k_s
    if pe.absolute:
        q = pe.embed(q.reshape(S * H, 1, d), q_pos.repeat_interleave(H, 0)).reshape(S, H, 1, d)
        kk = pe.embed(kk.reshape(S * H, n_keys, d), k_pos.repeat_interleave(H, 0)).reshape(S, H, n_keys, d)
    qp, kp = lift(pe.rotate(q, q_pos), k=k), lift(pe.rotate(kk, k_pos), k=k)
    space = qp[..., 1:] @ kp[..., 1:].transpose(-1, -2)  # [S, H, 1, D+1]
    time = qp[..., :1] @ kp[..., :1].transpose(-1, -2)
    bias = pe.score_bias(q, kk, q_pos, k_pos, scale=1.0)
    if bias is not None:
        space = space + bias
    return space[:, :, 0, :], time[:, :, 0, :]


def check_arguments(args) -> None:
    """The options argparse's types cannot check alone, refused as one line before anything is computed."""
    if args.head_dim % 2:
        raise EvalError(f"--head-dim (space dims per head) must be even for the rotary variants, got {args.head_dim}")
    if not args.curvature < 0:
        raise EvalError(f"--curvature must be negative (the paper's K < 0), got {args.curvature}")


def decay_curves(args) -> dict:
    """``{setting: {variant: {"mean", "std", "time_mean"}}}``, each a ``[D+1]`` tensor over distances.

    ``mean``/``std`` are of the space score, ``time_mean`` of the time term ``q_t k_t``, over ``--samples``
    draws and all heads (alibi: every head's draws with the slope of the last head).
    """
    heads, dim, distance = args.num_heads, args.head_dim, args.max_distance
    k = curvature_to_k(args.curvature)
    generator = torch.Generator().manual_seed(args.seed)
    q_s = torch.randn(args.samples, heads, dim, generator=generator, dtype=torch.float64)
    k_random = torch.randn(args.samples, heads, distance + 1, dim, generator=generator, dtype=torch.float64)
    curves: dict = {"aligned": {}, "random": {}}
    for kind in tqdm(args.variants, desc="positional encodings", disable=args.no_progress):
        torch.manual_seed(args.seed)  # the learned table's init
        options = {"chunk_size": args.rope3d_chunk_size, "hidden_space_dim": dim}  # the options the kind takes
        pe = build_positional_encoding(kind, head_dim=dim, num_heads=heads, max_position_embeddings=distance + 1,
                                       **{o: v for o, v in options.items() if o in POSITIONAL_ENCODINGS[kind].options}
                                       ).double()
        for setting, k_s in (("aligned", q_s), ("random", k_random)):
            space, time = scores_by_distance(pe, q_s, k_s, max_distance=distance, k=k)
            if kind == "alibi":  # every head's content with one head's slope: the bias is content-free
                plain, _ = scores_by_distance(NoPositionalEncoding(), q_s, k_s, max_distance=distance, k=k)
                space = plain + (space - plain)[:, -1:]
            space, time = space.reshape(-1, space.shape[-1]), time.reshape(-1, time.shape[-1])
            curves[setting][kind] = {"mean": space.mean(0), "std": space.std(0), "time_mean": time.mean(0)}
    return curves


def plot(curves: dict, *, output: str | Path, title: str, alibi_label: str):
    """Three panels against distance (log scale past 1): aligned mean, random mean, random spread."""
    fig = Figure(figsize=(17, 4.8), layout="constrained")
    axes = fig.subplots(1, len(PANELS))
    for ax, (setting, stat, panel_title) in zip(axes, PANELS, strict=True):
        for kind, curve in curves[setting].items():
            y = curve[stat].numpy()
            ax.plot(range(len(y)), y, label=alibi_label if kind == "alibi" else kind, linewidth=1.1, alpha=0.9)
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlim(0, len(y) - 1)
        ax.set_xlabel("relative distance m − n (tokens)")
        what = "std of the space score" if stat == "std" else "space score  q_s′ᵀ k_s′ + bias"
        ax.set_ylabel(f"{what}  (τ = 2)")
        ax.set_title(panel_title)
        ax.grid(alpha=0.3)
        ax.legend(title="positional encoding", fontsize=8)
    fig.suptitle(title)
    fig.savefig(output, dpi=110)
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(POSITIONAL_ENCODINGS), choices=POSITIONAL_ENCODINGS,
                        help="positional encodings to compare (default: all)")
    parser.add_argument("--head-dim", type=at_least(2), default=64,
                        help="space dims per head (default 64: a 65-dim head)")
    parser.add_argument("--num-heads", type=at_least(1), default=8, help="heads (ALiBi slopes; more draws per sample)")
    parser.add_argument("--max-distance", type=at_least(1), default=1024, help="largest relative distance D")
    parser.add_argument("--samples", type=at_least(2), default=16, help="random draws per head")
    parser.add_argument("--curvature", type=float, default=-1.0, help="the paper's K < 0 (default -1)")
    parser.add_argument("--rope3d-chunk-size", type=at_least(1), default=512, help="rope3d chunk size (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=user_path, default="pe_decay.png",
                        help="figure to write, its format taken from the suffix (.png, .pdf, .svg, ...; refused "
                             "before anything is computed if matplotlib cannot write it) (default: pe_decay.png)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None):
    args = build_parser().parse_args(argv)
    check_arguments(args)
    check_writable(args.output, "--output")
    formats = Figure().canvas.get_supported_filetypes()
    if args.output.suffix.lstrip(".").lower() not in formats:
        raise EvalError(f"--output {str(args.output)!r}: matplotlib writes no {args.output.suffix or 'suffix-less'!r} "
                        f"figure; give one of {', '.join('.' + f for f in sorted(formats))}")
    curves = decay_curves(args)
    slope = alibi_slopes(args.num_heads)[-1]
    fig = plot(curves, output=args.output, alibi_label=f"alibi (head {args.num_heads - 1}, slope {slope:.3g})",
               title=f"Score vs relative distance: {args.head_dim} space dims per head, K = {args.curvature:g}, "
                     f"{args.samples}×{args.num_heads} draws")
    print(f"wrote {args.output}")
    return curves, fig


if __name__ == "__main__":
    run_script(main)
