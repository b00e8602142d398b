"""LM head + causal-LM cross-entropy, forward and backward on the CPU: the plain path (``[T, V]`` fp32 logits, then
transformers' ``ForCausalLMLoss``) against the fused, chunked one (``head(x, targets=...)``,
:func:`helm.ops.linear_cross_entropy`), measured alternately in the same run.

Shapes: batch 1, ``T = 2048``, the Llama-3 vocabulary ``V = 128256``, hidden ``1+389`` (the helm-d-115m preset) and
``1+768``, both LM-head modes. Each measurement runs in a fresh child process: it builds the head and the final
hidden states, runs one warm-up step (so the parameter gradients stay allocated), resets the peak resident memory
(``/proc/self/clear_refs``), and reports the peak the next step adds above the memory held before it and the mean
time of ``--repeats`` steps. (``tracemalloc`` cannot see torch's CPU allocations, hence resident memory.)
Memory ratio = plain / fused, time ratio = plain / fused (above 1: fused better). ``--dtype bf16`` runs both
paths under CPU bf16 autocast (the training setting; the fp32 head is the master copy), so the fused path's GEMMs
run in bf16 like the plain path's; ``--dtype fp32 bf16`` measures both settings.

Usage: ``python benchmarks/lm_head_loss.py [--hidden 390 769] [--modes linear distance] [--seq-len 2048]
[--vocab 128256] [--chunk-size N] [--repeats 2] [--threads 2] [--dtype fp32 bf16]``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def child(fused: bool, hidden: int, mode: str, seq_len: int, vocab: int, chunk_size: int, repeats: int,
          threads: int, dtype: str) -> None:
    import time

    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    from helm.manifold import lift
    from helm.nn.head import LorentzLMHead

    def status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    head = LorentzLMHead(hidden, vocab, mode=mode)
    x = lift(torch.randn(1, seq_len, hidden - 1), k=1.0).requires_grad_()
    labels = torch.randint(0, vocab, (1, seq_len))
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    count = (targets != -100).sum()

    def step() -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            if fused:
                loss = head(x, targets=targets, chunk_size=chunk_size or None) / count
            else:
                loss = ForCausalLMLoss(head(x), labels, vocab, num_items_in_batch=count)
        loss.backward()
        return time.perf_counter() - start

    step()  # warm-up: allocates the gradients of x and of the head
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident memory to the current one
    before = status_kib("VmRSS")
    seconds = step()
    extra = status_kib("VmHWM") - before
    for _ in range(repeats - 1):
        seconds += step()
    print(json.dumps({"extra_mib": max(extra, 0) / 1024, "seconds": seconds / repeats}))


def measure(fused: bool, hidden: int, mode: str, dtype: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", str(int(fused)), str(hidden), mode, str(args.seq_len), str(args.vocab),
           str(args.chunk_size or 0), str(args.repeats), str(args.threads), dtype]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        fused, hidden, mode, seq_len, vocab, chunk, repeats, threads, dtype = sys.argv[2:]
        child(bool(int(fused)), int(hidden), mode, int(seq_len), int(vocab), int(chunk), int(repeats), int(threads),
              dtype)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[390, 769])
    parser.add_argument("--modes", nargs="+", default=["linear", "distance"], choices=["linear", "distance"])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: the op's)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                        help="bf16: both paths under CPU bf16 autocast")
    args = parser.parse_args()
    from helm.ops.lm_loss import default_chunk_size

    logits_mib = args.seq_len * args.vocab * 4 / 2**20
    print(f"T={args.seq_len}, V={args.vocab}: one fp32 [T, V] tensor is {logits_mib:.0f} MiB; fused chunks of "
          f"{args.chunk_size or default_chunk_size(args.vocab)} tokens\n")
    print("| hidden | head | dtype | plain MiB | fused MiB | memory plain / fused | plain s | fused s "
          "| time plain / fused |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for hidden in args.hidden:
        for mode in args.modes:
            for dtype in args.dtype:
                runs = {True: [], False: []}
                for _ in range(2):  # alternate, so drift on a noisy machine hits both
                    for fused in (False, True):
                        runs[fused].append(measure(fused, hidden, mode, dtype, args))
                mem = {f: min(r["extra_mib"] for r in runs[f]) for f in runs}
                sec = {f: sum(r["seconds"] for r in runs[f]) / len(runs[f]) for f in runs}
                print(f"| 1+{hidden - 1} | {mode} | {dtype} | {mem[False]:.0f} | {mem[True]:.0f} "
                      f"| {mem[False] / mem[True]:.1f} | {sec[False]:.2f} | {sec[True]:.2f} "
                      f"| {sec[False] / sec[True]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
