#!/usr/bin/env python
"""Ollivier-Ricci curvature of final-layer token embeddings (the HELM paper's Fig. 1), for any causal LM.

The paper motivates hyperbolic LLMs by the curvature of the token-embedding geometry of an ordinary
Euclidean LLM: a kNN graph over its final-layer token embeddings has mostly negative Ollivier-Ricci
curvature, i.e. it is tree-like. This script measures the same for any checkpoint that
``AutoModelForCausalLM`` loads (HELM models or Euclidean baselines):

1. Run the model over a text sample (packed windows of ``--seq-len`` tokens, documents separated by eos)
   and take the final hidden state of every token: the output of the final norm, ``model.base_model(...)
   .last_hidden_state`` — Lorentz points ``[1+n]`` for HELM models, vectors for Euclidean ones.
2. Sample ``--max-points`` of these token embeddings (dropping exact duplicates, e.g. a token that starts
   two windows), and join each to its ``--knn`` nearest neighbours
   (an undirected graph, built with ``networkx``). Neighbours are chosen by geodesic distance on the
   hyperboloid for HELM models (``sqrt(k)·arcosh(-<x, y>_L / k)``) and by Euclidean distance otherwise
   (``--distance`` overrides). Edges have unit length by default, so κ lies in ``[-2, 1]`` and only the
   neighbourhood structure matters; ``--edge-weights distance`` uses the embedding distances instead (then
   very short edges can reach large negative κ).
3. For every edge ``(x, y)``, the Ollivier-Ricci curvature ``κ(x, y) = 1 - W1(m_x, m_y) / d(x, y)``, where
   ``m_x`` keeps mass ``α`` (``--alpha``, the idleness) at ``x`` and spreads ``1 - α`` uniformly over its
   neighbours, ``d`` is the weighted shortest-path distance in the graph, and the Wasserstein-1 distance
   ``W1`` is solved exactly with the optimal-transport library POT (``ot.emd2``).
   κ > 0: neighbourhoods overlap (clustered, sphere-like); κ < 0: they spread apart (tree-like, hyperbolic).

Usage::

    python eval/curvature.py --model helm-d=runs/helm-d --model llama=runs/llama \\
        --files data/validation.jsonl --max-points 1000 --knn 10 --output-dir results/curvature

Outputs in ``--output-dir``: ``curvature.png`` (histogram of κ per model), ``curvature.json`` (summary
statistics per model, in the result format ``eval/compare.py`` reads: task ``ricci_curvature``) and
``curvature_<name>.csv`` (κ of every edge).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from _shared import (  # noqa: E402
    EvalError,
    add_text_arguments,
    load_model,
    load_tokenizer,
    matplotlib_pyplot,
    model_max_length,
    parse_named,
    require,
    run_main,
    text_label,
    texts_from_args,
    write_json,
)
from perplexity import make_windows, token_stream  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# 1. token embeddings


def is_lorentz_model(model) -> bool:
    return str(getattr(model.config, "model_type", "")).startswith("helm")


@torch.no_grad()
def final_token_embeddings(model, ids: torch.Tensor, *, seq_len: int, max_tokens: int,
                           progress: bool = True) -> torch.Tensor:
    """``[N, D]`` final hidden states (after the final norm) of the first ``max_tokens`` tokens of ``ids``.

    One window at a time, so no padding enters any embedding.
    """
    ids = ids[:max_tokens]
    device = next(model.parameters()).device
    body = model.base_model  # the decoder without the LM head (HelmDModel, LlamaModel, ...)
    out = []
    for w in tqdm(make_windows(ids.numel(), seq_len, keep_last=True), desc="embeddings", unit="window",
                  disable=not progress):
        hidden = body(input_ids=ids[w.begin:w.end].unsqueeze(0).to(device), use_cache=False).last_hidden_state
        out.append(hidden[0].double().cpu())
    return torch.cat(out)


# ----------------------------------------------------------------------------------------------------------
# 2. kNN graph


def pairwise_distances(points: torch.Tensor, *, metric: str, k: float = 1.0) -> np.ndarray:
    """``[N, N]`` distances in fp64: ``euclidean``, or ``lorentz`` (geodesic on the hyperboloid ``<x,x>_L = -k``).

    The geodesic distance ``sqrt(k)·arcosh(-<x, y>_L / k)`` is evaluated as ``2·sqrt(k)·arsinh(|x - y|_L /
    (2·sqrt(k)))`` with ``|x - y|_L² = |x_s - y_s|² - (x_t - y_t)²``: the same number, without the
    cancellation of ``arcosh`` near 1 for close points.
    """
    x = points.double()
    if metric == "euclidean":
        return torch.cdist(x, x).numpy()
    if metric != "lorentz":
        raise EvalError(f"unknown distance {metric!r}")
    space = torch.cdist(x[:, 1:], x[:, 1:]).pow(2)
    time = (x[:, :1] - x[:, :1].T).pow(2)
    chord = (space - time).clamp_min(0.0).sqrt()
    return (2.0 * math.sqrt(k) * torch.asinh(chord / (2.0 * math.sqrt(k)))).numpy()


def drop_duplicates(points: torch.Tensor, dist: np.ndarray, *, tol: float = 1e-9) -> tuple[torch.Tensor, np.ndarray]:
    """Keep the first of every group of points closer than ``tol·(typical distance)`` (e.g. the same token at
    the start of two windows, whose embedding has no context); a zero-length edge has no curvature."""
    scale = float(np.median(dist)) or 1.0
    close = np.triu(dist <= tol * scale, k=1)
    keep = ~close.any(axis=0)
    return points[torch.from_numpy(keep)], dist[np.ix_(keep, keep)]


def knn_graph(dist: np.ndarray, knn: int, *, weighted: bool = False):
    """Undirected ``networkx`` graph joining each point to its ``knn`` nearest others.

    Edge weight 1 (hop distance), or the embedding distance with ``weighted``.
    """
    nx = require("networkx", "the kNN graph")
    n = dist.shape[0]
    if not 1 <= knn < n:
        raise EvalError(f"--knn must lie in [1, number of points - 1 = {n - 1}], got {knn}")
    graph = nx.Graph()
    graph.add_nodes_from(range(n))
    order = np.argsort(dist + np.diag(np.full(n, np.inf)), axis=1)[:, :knn]
    for i in range(n):
        for j in order[i]:
            graph.add_edge(i, int(j), weight=float(dist[i, j]) if weighted else 1.0)
    return graph


# ----------------------------------------------------------------------------------------------------------
# 3. Ollivier-Ricci curvature


def ollivier_ricci(graph, *, alpha: float = 0.5, progress: bool = True) -> dict:
    """``{(x, y): κ(x, y)}`` for every edge of a weighted ``networkx`` graph (see the module docstring)."""
    ot = require("ot", "Ollivier-Ricci curvature (optimal transport)")
    nx = require("networkx", "Ollivier-Ricci curvature")
    csgraph = require("scipy.sparse.csgraph", "shortest paths")
    if not 0.0 <= alpha < 1.0:
        raise EvalError(f"--alpha must lie in [0, 1), got {alpha}")
    nodes = list(graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    adjacency = nx.to_scipy_sparse_array(graph, nodelist=nodes, weight="weight")
    shortest = csgraph.dijkstra(adjacency, directed=False)

    def measure(node):
        neighbours = list(graph.neighbors(node))
        support = [index[node]] + [index[v] for v in neighbours]
        mass = np.array([alpha] + [(1.0 - alpha) / len(neighbours)] * len(neighbours))
        return support, mass

    curvature = {}
    for x, y in tqdm(list(graph.edges), desc="Ollivier-Ricci", unit="edge", disable=not progress):
        sx, mx = measure(x)
        sy, my = measure(y)
        cost = shortest[np.ix_(sx, sy)]
        w1 = float(ot.emd2(mx, my, cost))
        curvature[(x, y)] = 1.0 - w1 / shortest[index[x], index[y]]
    return curvature


def summary(values: np.ndarray) -> dict:
    q = np.quantile(values, [0.05, 0.25, 0.5, 0.75, 0.95])
    return {"mean": float(values.mean()), "std": float(values.std()), "median": float(q[2]),
            "min": float(values.min()), "max": float(values.max()), "q05": float(q[0]), "q25": float(q[1]),
            "q75": float(q[3]), "q95": float(q[4]), "fraction_negative": float((values < 0).mean()),
            "edges": int(values.size)}


def curvature_of_model(path: str, texts: list[str], *, max_points: int, knn: int, alpha: float,
                       seq_len: int | None, distance: str, edge_weights: str = "unit", seed: int,
                       device: str | None, dtype: str, progress: bool) -> tuple[np.ndarray, dict]:
    """Edge curvatures and summary statistics for one checkpoint."""
    model = load_model(path, device=device, dtype=dtype)
    tokenizer = load_tokenizer(path)
    seq_len = seq_len or min(model_max_length(model), 512)
    ids = token_stream(texts, tokenizer, eos_id=tokenizer.eos_token_id)
    # a margin of 4x over the sample keeps the sampled tokens spread over many contexts and positions
    hidden = final_token_embeddings(model, ids, seq_len=seq_len, max_tokens=4 * max_points, progress=progress)
    if hidden.shape[0] <= knn:
        raise EvalError(f"only {hidden.shape[0]} tokens of text; need more than --knn {knn}")
    generator = torch.Generator().manual_seed(seed)
    pick = torch.randperm(hidden.shape[0], generator=generator)[:max_points]
    points = hidden[pick]
    if distance == "auto":
        distance = "lorentz" if is_lorentz_model(model) else "euclidean"
    k = 1.0
    if distance == "lorentz":
        from helm.manifold.math import curvature_to_k

        k = curvature_to_k(getattr(model.config, "curvature", -1.0))
    points, dist = drop_duplicates(points, pairwise_distances(points, metric=distance, k=k))
    graph = knn_graph(dist, knn, weighted=edge_weights == "distance")
    values = np.array(list(ollivier_ricci(graph, alpha=alpha, progress=progress).values()))
    stats = {**summary(values), "points": int(points.shape[0]),
             "duplicates_dropped": int(pick.numel() - points.shape[0]), "knn": knn, "alpha": alpha,
             "distance": distance, "edge_weights": edge_weights, "seq_len": seq_len}
    return values, stats


def plot(curvatures: dict, output: str | Path, *, title: str):
    """Overlaid histograms (density) of edge curvature, one per model."""
    plt = matplotlib_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    bins = np.linspace(min(v.min() for v in curvatures.values()), max(v.max() for v in curvatures.values()), 41)
    for name, values in curvatures.items():
        ax.hist(values, bins=bins, density=True, alpha=0.5, label=f"{name} (mean {values.mean():+.3f})")
    ax.axvline(0.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("Ollivier-Ricci curvature κ(x, y) of kNN-graph edges")
    ax.set_ylabel("density")
    ax.set_title(title)
    ax.legend(title="model")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=120)
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the top of this file for the exact construction.")
    parser.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                        help="checkpoint folder (repeat to overlay several models)")
    add_text_arguments(parser)
    parser.add_argument("--max-points", type=int, default=1000, help="token embeddings in the graph (default 1000)")
    parser.add_argument("--knn", type=int, default=10, help="neighbours per point (default 10)")
    parser.add_argument("--alpha", type=float, default=0.5, help="idleness: mass kept at the node (default 0.5)")
    parser.add_argument("--distance", choices=["auto", "euclidean", "lorentz"], default="auto",
                        help="auto: geodesic on the hyperboloid for HELM models, Euclidean otherwise")
    parser.add_argument("--edge-weights", choices=["unit", "distance"], default="unit",
                        help="edge lengths of the kNN graph: unit (hop count, default) or the embedding distance")
    parser.add_argument("--seq-len", type=int, help="window length (default: min(max_position_embeddings, 512))")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token sample")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-dir", default="curvature", help="where the PNG, JSON and CSVs go")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.max_points < 3:
        raise EvalError(f"--max-points must be at least 3, got {args.max_points}")
    require("ot", "Ollivier-Ricci curvature (optimal transport)")
    require("networkx", "the kNN graph")
    texts = texts_from_args(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    curvatures, runs = {}, []
    for name, path in [parse_named(spec) for spec in args.model]:
        values, stats = curvature_of_model(path, texts, max_points=args.max_points, knn=args.knn, alpha=args.alpha,
                                           seq_len=args.seq_len, distance=args.distance, edge_weights=args.edge_weights,
                                           seed=args.seed,
                                           device=args.device, dtype=args.dtype, progress=not args.no_progress)
        curvatures[name] = values
        runs.append({"model_name": name, "model_path": path, "source": "eval/curvature.py",
                     "results": {"ricci_curvature": stats},
                     "primary_metrics": {"ricci_curvature": ["mean", "median", "fraction_negative"]}})
        np.savetxt(out / f"curvature_{name}.csv", values, fmt="%.6f", header="ollivier_ricci_curvature", comments="")
        print(f"{name}: {stats['edges']} edges over {stats['points']} tokens ({stats['distance']} distance), "
              f"κ mean {stats['mean']:+.4f}, median {stats['median']:+.4f}, "
              f"{100 * stats['fraction_negative']:.1f}% negative")
    label = text_label(args)
    plot(curvatures, out / "curvature.png",
         title=f"Ollivier-Ricci curvature of final-layer token embeddings ({label}, kNN k={args.knn})")
    record = {"text": label, "runs": runs}
    write_json(out / "curvature.json", record)
    print(f"wrote {out / 'curvature.png'} and {out / 'curvature.json'}")
    return record


if __name__ == "__main__":
    run_main(main)
