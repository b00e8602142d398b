"""Lorentz attention on the CPU: forward+backward time and activation memory of ``eager`` and ``sdpa`` next to
Euclidean SDPA of the same shape, measured in the same run.

Shapes follow the helm-d-115m preset: 6 heads of ambient dim 65 (1 + 64), causal. Two Euclidean baselines,
both ``torch.nn.functional.scaled_dot_product_attention``: ``euclid65`` on the very same ``[B, 6, T, 65]`` shape
(the acceptance ratio: what the Lorentz reduction itself costs) and ``euclid64`` on ``[B, 6, T, 64]``, the
head of a Llama of that width (odd head sizes are slower in the fused kernels).

Memory is the total size of the tensors autograd saves for the backward pass (recorded with
``torch.autograd.graph.saved_tensors_hooks``): it is what a training step keeps alive, it is exact and
repeatable on the CPU, and it is where the eager path's ``T × T`` matrices show up.

Usage: ``python benchmarks/attention.py [--lengths 256 1024 2048] [--batch 1] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from helm.manifold import lift
from helm.ops import lorentz_attention

HEADS, HEAD_DIM = 6, 64  # Lorentz heads are 1 + HEAD_DIM


def saved_bytes(fn) -> int:
    """Bytes autograd saves for backward while running ``fn`` (storage counted once)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def timed_interleaved(steps: dict, repeats: int) -> dict:
    """Best-of-``repeats`` seconds per step, the implementations taking turns so that load from other
    processes hits them alike (the minimum is the least noisy estimate on a shared machine)."""
    for step in steps.values():
        step()  # warm-up
    best = {name: float("inf") for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def make_step(impl: str, B: int, T: int):
    g = torch.Generator().manual_seed(0)
    if impl.startswith("euclid"):
        dim = int(impl[len("euclid"):])
        q, k, v = (torch.randn(B, HEADS, T, dim, generator=g).requires_grad_() for _ in range(3))

        def run():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        q, k, v = (lift(torch.randn(B, HEADS, T, HEAD_DIM, generator=g), k=1.0).requires_grad_() for _ in range(3))
        tau = torch.tensor(8.0, requires_grad=True)

        def run():
            return lorentz_attention(q, k, v, k=1.0, tau=tau, causal=True, impl=impl)

    def step():
        run().sum().backward()

    return run, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B={args.batch}, H={HEADS}, "
          f"Lorentz head 1+{HEAD_DIM}, causal, fp32, forward+backward, best of {args.repeats}")
    print(f"{'T':>6} {'impl':>10} {'ms':>10} {'saved MiB':>10}")
    results = {}
    impls = ("euclid65", "euclid64", "sdpa", "eager")
    for T in args.lengths:
        made = {impl: make_step(impl, args.batch, T) for impl in impls}
        seconds = timed_interleaved({impl: step for impl, (_, step) in made.items()}, args.repeats)
        for impl, (run, _) in made.items():
            results[T, impl] = (1e3 * seconds[impl], saved_bytes(run) / 2**20)
            print(f"{T:>6} {impl:>10} {results[T, impl][0]:>10.2f} {results[T, impl][1]:>10.2f}")
    print()
    for T in args.lengths:
        (e_ms, _), (e64_ms, _), (s_ms, s_mib), (x_ms, x_mib) = (results[T, i] for i in impls)
        print(f"T={T}: sdpa / euclidean same shape (65) time = {s_ms / e_ms:.2f}x")
        print(f"T={T}: sdpa / euclidean head 64 time = {s_ms / e64_ms:.2f}x")
        print(f"T={T}: eager / sdpa time = {x_ms / s_ms:.2f}x")
        print(f"T={T}: eager / sdpa saved memory = {x_mib / s_mib:.2f}x")
    first, last = args.lengths[0], args.lengths[-1]
    growth = results[last, "sdpa"][1] / results[first, "sdpa"][1]
    print(f"sdpa saved memory T={last} / T={first} = {growth:.2f}x for {last / first:.0f}x the length (linear: "
          f"{last / first:.0f}x)")


if __name__ == "__main__":
    main()
