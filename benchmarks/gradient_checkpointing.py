"""Activation memory and time of a training step with and without gradient checkpointing, in one run.

Each measurement runs in a fresh child process (so one run's freed memory cannot hide another's peak): it builds
the model, runs one warm-up step, then reports the peak resident memory the next step adds above the memory held
before it (weights, gradients and optimiser state are already allocated by then) and the step's time. With
``gradient_checkpointing_enable()`` each decoder layer keeps only its input and recomputes its activations in
backward, so the step's extra memory should fall by about the number of layers' activations, for about one more
forward of compute.

Usage: ``python benchmarks/gradient_checkpointing.py [--presets helm-d-115m helm-mice-120m llama-115m]
[--seq-len 1024] [--batch-size 1]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def child(preset: str, seq_len: int, batch_size: int, checkpointing: bool) -> None:
    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM

    import helm
    from helm.optim import build_optimizer

    def rss_kib() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024

    torch.manual_seed(0)
    config = helm.load_config(preset, max_position_embeddings=max(seq_len, 512))
    model = AutoModelForCausalLM.from_config(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    optimizer = build_optimizer(model, lr=1e-4)
    ids = torch.randint(2, config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients allocated: the next step's baseline holds them
        return time.perf_counter() - start

    step()
    before = rss_kib()
    seconds = step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"extra_mib": max(peak - before, 0) / 1024, "seconds": seconds}))


def measure(preset: str, args, checkpointing: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", preset, str(args.seq_len), str(args.batch_size), str(int(checkpointing))]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["helm-d-115m", "helm-mice-120m", "llama-115m"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"batch {args.batch_size} x {args.seq_len} tokens; extra = peak resident memory of a training step above "
          "what is held before it (weights, gradients, optimiser state)")
    for preset in args.presets:
        plain, ckpt = measure(preset, args, False), measure(preset, args, True)
        print(f"  {preset:<16} extra memory {plain['extra_mib']:8.0f} MiB -> {ckpt['extra_mib']:8.0f} MiB "
              f"({plain['extra_mib'] / max(ckpt['extra_mib'], 1e-9):.2f}x less); step {plain['seconds']:.2f} s -> "
              f"{ckpt['seconds']:.2f} s ({ckpt['seconds'] / plain['seconds']:.2f}x)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), bool(int(sys.argv[5])))
    else:
        main()
