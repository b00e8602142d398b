"""MiCE layer forward+backward on the CPU: dense dispatch (every routed expert on every token) against sparse
dispatch (each routed expert on the tokens that chose it), measured alternately in the same run.

Shapes: tiny-helm-mice (ambient 129, experts 129) and helm-mice-120m (ambient 390, experts 780), 4 routed
experts with 2 active and 1 shared, as the presets. Ratio = dense time / sparse time (above 1: sparse faster).
``MiCE(dispatch="auto")`` is dense (no host read in a step); ``"sparse"`` is opt-in and reads the per-expert
counts once per layer forward.

Usage: ``python benchmarks/mice_dispatch.py [--tokens 32 128 256 1024] [--repeats 5] [--threads 2]``
"""

from __future__ import annotations

import argparse
import time

import torch

from helm.manifold import lift
from helm.nn.mice import MiCE

SHAPES = {"tiny": (129, 129), "120m": (390, 780)}


def step_time(mice: MiCE, x: torch.Tensor, mode: str, repeats: int) -> float:
    mice.dispatch = mode
    mice(x).sum().backward()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        mice(x).sum().backward()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| shape | tokens | dense ms | sparse ms | dense / sparse |\n| --- | --- | --- | --- | --- |")
    for name, (hidden, inter) in SHAPES.items():
        torch.manual_seed(0)
        mice = MiCE(hidden, inter, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1).train()
        for tokens in args.tokens:
            x = lift(torch.randn(1, tokens, hidden - 1), k=1.0).requires_grad_(True)
            dense = sparse = 0.0
            for _ in range(2):  # alternate, so drift on a noisy machine hits both
                dense += step_time(mice, x, "dense", args.repeats)
                sparse += step_time(mice, x, "sparse", args.repeats)
            print(f"| {name} | {tokens} | {dense * 500:.2f} | {sparse * 500:.2f} | {dense / sparse:.2f} |")


if __name__ == "__main__":
    main()
