#!/usr/bin/env python
"""Ollivier-Ricci curvature of final-layer token embeddings (the HELM paper's Fig. 1), for any causal LM.

--max-points final hidden states (duplicates dropped), each joined to its --knn nearest (eval/README.md); for
every edge kappa(x, y) = 1 - W1(m_x, m_y) / d(x, y), m_x keeping mass --alpha at x and spreading the rest over
the neighbours, d the shortest-path distance, W1 exact optimal transport (ot.emd2). kappa < 0: hyperbolic.

    python eval/curvature.py --model helm-d=runs/helm-d --model llama=runs/llama \\
        --files data/validation.jsonl --max-points 1000 --knn 10 --output-dir results/curvature
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from matplotlib.figure import Figure
import networkx as nx
import numpy as np
import ot
import torch
from scipy.sparse.csgraph import dijkstra
from tqdm.auto import tqdm

from helm.evaluation import (
    MODEL_SPEC_HELP, EvalError, add_loading_arguments, add_text_arguments, at_least, check_window, check_writable,
    data_files, load_checkpoint, model_names, run_script, texts_of, token_stream, user_path, write_json)
from helm.manifold.math import curvature_to_k


def pairwise_distances(points: torch.Tensor, *, metric: str, k: float = 1.0) -> np.ndarray:
    """``[N, N]`` fp64 distances: ``euclidean``, or ``lorentz`` (geodesic on the hyperboloid ``<x,x>_L = -k``).

    The geodesic ``sqrt(k)·arcosh(-<x, y>_L / k)`` is evaluated as ``2·sqrt(k)·arsinh(|x - y|_L / (2·sqrt(k)))``
    with ``|x - y|_L² = |x_s - y_s|² - (x_t - y_t)²``, which avoids the cancellation of ``arcosh`` near 1.
    """
    x = points.double()  # fp64: the distances of close points cancel
    if metric == "euclidean":
        return torch.cdist(x, x).numpy()
    chord = (torch.cdist(x[:, 1:], x[:, 1:]).pow(2) - (x[:, :1] - x[:, :1].T).pow(2)).clamp_min(0.0).sqrt()
    return (2.0 * math.sqrt(k) * torch.asinh(chord / (2.0 * math.sqrt(k)))).numpy()


def knn_graph(dist: np.ndarray, knn: int) -> nx.Graph:
    """Each point joined to its ``knn`` nearest others, each edge of length 1 (hops)."""
    n = dist.shape[0]
    if not 1 <= knn < n:
        raise EvalError(f"--knn must lie in [1, number of points - 1 = {n - 1}], got {knn}")
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    nearest = np.argsort(dist + np.diag(np.full(n, np.inf)), axis=1)[:, :knn]
    graph.add_weighted_edges_from((i, int(j), 1.0) for i in range(n) for j in nearest[i])
    return graph


def ollivier_ricci(graph: nx.Graph, *, alpha: float = 0.5, progress: bool = True) -> dict:
    """``{(x, y): κ(x, y)}`` for every edge of a weighted graph of nodes 0 .. n-1 (see the top of this file)."""
    shortest = dijkstra(nx.to_scipy_sparse_array(graph, nodelist=range(len(graph)), weight="weight"), directed=False)

    def measure(node):
        neighbours = list(graph.neighbors(node))
        return [node, *neighbours], np.array([alpha] + [(1.0 - alpha) / len(neighbours)] * len(neighbours))

    curvature = {}
    for x, y in tqdm(list(graph.edges), desc="Ollivier-Ricci", unit="edge", disable=not progress):
        (sx, mx), (sy, my) = measure(x), measure(y)
        curvature[(x, y)] = 1.0 - float(ot.emd2(mx, my, shortest[np.ix_(sx, sy)])) / shortest[x, y]
    return curvature


def check_hyperboloid(points: torch.Tensor, k: float, *, dtype: torch.dtype, where: str) -> None:
    """An :class:`EvalError` unless every row of ``points`` is a point of the hyperboloid ``<x, x>_L = -k``, time
    coordinate first and positive, up to the rounding of ``dtype`` (the hidden states' own): the Lorentz distance of
    other vectors (a Euclidean model's hidden states) is no distance of theirs. ``where`` names the model."""
    x = points.double()
    inner = x[:, 1:].pow(2).sum(-1) - x[:, 0].pow(2)
    scale = x.pow(2).sum(-1)  # the rounding error of <x, x>_L grows with the squared coordinates
    off = (inner + k).abs() > 1e-3 * k + 8 * torch.finfo(dtype).eps * scale
    if bool(off.any()) or bool((x[:, 0] <= 0).any()):
        raise EvalError(f"--distance lorentz: the final hidden states of {where} are not points of the hyperboloid "
                        f"<x, x>_L = -{k:g} ({int(off.sum())} of {x.shape[0]} off it): use --distance euclidean")


def embedding_sample(name: str, path: str, texts: list[str], args) -> tuple[torch.Tensor, dict]:
    """``--max-points`` final hidden states of one checkpoint (``[N, D]``, fp64, before duplicates are dropped) and
    how to measure them: ``{"distance", "k", "seq_len"}``; a Lorentz distance only between points of its
    hyperboloid (:func:`check_hyperboloid`)."""
    model, tokenizer = load_checkpoint(path, device=args.device, dtype=args.dtype,
                                       trust_remote_code=args.trust_remote_code)
    seq_len = args.seq_len or min(model.config.max_position_embeddings, 512)
    check_window(model, seq_len, "--seq-len")
    # 4x more tokens than points keeps the sample spread over many contexts and positions
    ids = token_stream(texts, tokenizer, eos_id=tokenizer.eos_token_id)[:4 * args.max_points]
    with torch.no_grad():  # the decoder without its LM head, one unpadded window at a time
        hidden = torch.cat([model.base_model(input_ids=w[None].to(model.device), use_cache=False).last_hidden_state[0]
                            for w in tqdm(ids.split(seq_len), desc="embeddings", disable=args.no_progress)]).cpu()
    pick = torch.randperm(hidden.shape[0], generator=torch.Generator().manual_seed(args.seed))[:args.max_points]
    distance = args.distance
    if distance == "auto":
        distance = "lorentz" if str(model.config.model_type).startswith("helm") else "euclidean"
    k = curvature_to_k(getattr(model.config, "curvature", -1.0)) if distance == "lorentz" else 1.0
    points = hidden[pick].double()
    if distance == "lorentz":
        check_hyperboloid(points, k, dtype=hidden.dtype,
                          where=f"--model {name!r} (model_type {model.config.model_type!r})")
    return points, {"distance": distance, "k": k, "seq_len": seq_len}


def curvature_of_points(points: torch.Tensor, measure: dict, args) -> tuple[np.ndarray, dict]:
    """Edge curvatures and summary statistics for one checkpoint's :func:`embedding_sample`."""
    distance, seq_len = measure["distance"], measure["seq_len"]
    dist = pairwise_distances(points, metric=distance, k=measure["k"])
    # a zero-length edge has no curvature: keep the first of every group of (numerically) equal points
    keep = ~np.triu(dist <= 1e-9 * (float(np.median(dist)) or 1.0), k=1).any(axis=0)
    graph = knn_graph(dist[np.ix_(keep, keep)], args.knn)
    values = np.array(list(ollivier_ricci(graph, alpha=args.alpha, progress=not args.no_progress).values()))
    q05, q25, median, q75, q95 = np.quantile(values, [0.05, 0.25, 0.5, 0.75, 0.95]).tolist()
    stats = {"mean": float(values.mean()), "std": float(values.std()), "median": median, "min": float(values.min()),
             "max": float(values.max()), "q05": q05, "q25": q25, "q75": q75, "q95": q95,
             "fraction_negative": float((values < 0).mean()), "edges": int(values.size), "points": int(keep.sum()),
             "duplicates_dropped": int((~keep).sum()), "knn": args.knn, "alpha": args.alpha, "distance": distance,
             "seq_len": seq_len}
    return values, stats


def plot(curvatures: dict, output: Path, *, title: str):
    """Overlaid density histograms of edge curvature, one per model."""
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    bins = np.linspace(min(v.min() for v in curvatures.values()), max(v.max() for v in curvatures.values()), 41)
    for name, values in curvatures.items():
        ax.hist(values, bins=bins, density=True, alpha=0.5, label=f"{name} (mean {values.mean():+.3f})")
    ax.axvline(0.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("Ollivier-Ricci curvature κ(x, y) of kNN-graph edges")
    ax.set_ylabel("density")
    ax.set_title(title)
    ax.legend(title="model")
    fig.savefig(output, dpi=120)
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                        help=f"checkpoint folder (repeat to overlay several models); {MODEL_SPEC_HELP}")
    add_text_arguments(parser)
    parser.add_argument("--max-points", type=at_least(3), default=1000,
                        help="token embeddings in the graph (default 1000)")
    parser.add_argument("--knn", type=at_least(1), default=10, help="neighbours per point (default 10)")
    parser.add_argument("--alpha", type=float, default=0.5, help="idleness: mass kept at the node (default 0.5)")
    parser.add_argument("--distance", choices=["auto", "euclidean", "lorentz"], default="auto",
                        help="lorentz: geodesic on the hyperboloid <x, x>_L = -1/|K| (the model's curvature K), "
                             "only for hidden states that are its points (a HELM model's), refused (before any "
                             "curvature is computed) for others, e.g. a Llama's; euclidean: straight-line distance; "
                             "auto (default): lorentz for HELM models, euclidean otherwise")
    parser.add_argument("--seq-len", type=at_least(1),
                        help="window length (default: min(max_position_embeddings, 512))")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token sample")
    add_loading_arguments(parser)
    parser.add_argument("--output-dir", type=user_path, default=Path("curvature"), help="where the PNG and JSON go")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if not args.knn < args.max_points:  # duplicates dropped later may lower the bound again (knn_graph)
        raise EvalError(f"--knn must lie in [1, --max-points - 1 = {args.max_points - 1}], got {args.knn}")
    if not 0.0 <= args.alpha < 1.0:
        raise EvalError(f"--alpha must lie in [0, 1), got {args.alpha}")
    models = model_names(args.model)
    check_writable(args.output_dir, "--output-dir", folder=True, inputs=data_files(args.data, args.split),
                   files=["curvature.png", "curvature.json"],
                   models=[path for _, path in models])
    texts = texts_of(args)
    curvatures, runs = {}, []
    # every model's sample (and its check) before the first graph, whose optimal transport takes the time
    samples = {name: embedding_sample(name, path, texts, args) for name, path in models}
    for name, path in models:
        values, stats = curvature_of_points(*samples[name], args)
        curvatures[name] = values
        runs.append({"model_name": name, "model_path": path, "source": "eval/curvature.py",
                     "results": {"ricci_curvature": stats},
                     "primary_metrics": {"ricci_curvature": ["mean", "median", "fraction_negative"]}})
        print(f"{name}: {stats['edges']} edges over {stats['points']} tokens ({stats['distance']} distance), "
              f"κ mean {stats['mean']:+.4f}, median {stats['median']:+.4f}, "
              f"{100 * stats['fraction_negative']:.1f}% negative")
    label = "+".join(Path(source).stem for source in args.data)
    plot(curvatures, args.output_dir / "curvature.png",
         title=f"Ollivier-Ricci curvature of final-layer token embeddings ({label}, kNN k={args.knn})")
    record = {"text": label, "runs": runs}
    write_json(args.output_dir / "curvature.json", record)
    print(f"wrote {args.output_dir / 'curvature.png'} and {args.output_dir / 'curvature.json'}")
    return record


if __name__ == "__main__":
    run_script(main)
