"""GPU benchmark: the Lorentz attention Triton kernel vs torch SDPA vs helm's eager attention.

For T in {512, 2048, 8192} and heads of 1+64 and 1+128 coordinates, bf16, causal, it measures forward and
forward+backward time (median of ``triton.testing.do_bench``) and throughput of

* ``triton``: :func:`helm.ops.lorentz_attention_triton.lorentz_flash_attention` on bf16 points (the time coordinate
  apart, no padding);
* ``triton-model``: the kernel as a HELM model under bf16 autocast calls it: fp32 points (cast from the bf16
  inputs inside the timed call), ``q·k`` space parts in bf16 (``qk_dtype``) with fp32 time coordinates, the value
  side in fp32 (the precision policy's named exception), fp32 out;
* ``sdpa``:   ``torch.nn.functional.scaled_dot_product_attention`` on ``(J q · 2/τ, k, v)`` with the head dim
  zero-padded to a multiple of 8 (65 -> 72, 129 -> 136) so the fused FlashAttention backend accepts it, then
  the Lorentz normalisation in fp32. Note it forms ``<q, k>_L`` in bf16, which the kernel avoids;
* ``eager``:  ``helm.ops.lorentz_attention(..., impl="eager")`` (materialises the ``T x T`` scores in fp32;
  reported as out of memory where it does not fit).

TFLOP/s count the useful work of the unpadded heads for every implementation: forward
``2 · B·H·T²·(1+d + 1+dv) / 2`` (two products, causal half), backward 2.5x the forward. Each ratio is
printed on its own line as ``time(other) / time(triton)`` (> 1: the kernel is faster). A decoding section
times one query row against a cache of T keys.

Usage, from the repository root on a CUDA machine::

    python benchmarks/attention_triton.py [--tokens 16384] [--heads 16] [--seq 512 2048 8192]

``--dry-run-cpu`` (with ``TRITON_INTERPRET=1`` and tiny sizes) only exercises the script on a CPU; its
timings mean nothing.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="batch × sequence length per run")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="space dims d of a 1+d head")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager baseline")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="run every code path on CPU under TRITON_INTERPRET=1 (timings meaningless)")
    return parser.parse_args(argv)


def _wall_clock_ms(fn, grad_to_none=None, **_):
    """Stand-in for ``do_bench`` in a CPU dry run: one call, wall clock."""
    fn()
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def main(argv=None) -> int:
    args = _parse(argv)
    import torch

    if args.dry_run_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        print("--dry-run-cpu needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
        return 1
    if not torch.cuda.is_available() and not args.dry_run_cpu:
        print("benchmarks/attention_triton.py needs a CUDA GPU: torch.cuda.is_available() is False, so nothing "
              "was measured. Run it on a machine with an NVIDIA GPU (the kernel tests run on CPU under "
              "TRITON_INTERPRET=1, but timings there mean nothing).", file=sys.stderr)
        return 1
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import torch.nn.functional as F
    from triton.testing import do_bench as triton_do_bench

    from helm.manifold import lift, normalize
    from helm.ops import lorentz_attention
    from helm.ops.lorentz_attention_triton import lorentz_flash_attention

    device = torch.device("cpu" if args.dry_run_cpu else "cuda")
    do_bench = _wall_clock_ms if args.dry_run_cpu else triton_do_bench
    dtype = torch.bfloat16
    name = "CPU dry run" if args.dry_run_cpu else torch.cuda.get_device_name(device)
    print(f"device: {name}; torch {torch.__version__}; bf16 inputs, causal, "
          f"{args.heads} heads, {args.tokens} tokens per run")

    def triton_impl(q, k, v, tau):
        return lorentz_flash_attention(q, k, v, k=1.0, tau=tau, causal=True)

    def triton_model_impl(q, k, v, tau):
        return lorentz_flash_attention(q.float(), k.float(), v.float(), k=1.0, tau=tau, causal=True,
                                       qk_dtype=torch.bfloat16)

    def sdpa_impl(q, k, v, tau):
        width = 8 * math.ceil(q.shape[-1] / 8)
        width_v = 8 * math.ceil(v.shape[-1] / 8)
        q_j = (torch.cat([-q[..., :1], q[..., 1:]], dim=-1) * (2.0 / tau)).to(q.dtype)
        pad = (0, width - q.shape[-1])
        out = F.scaled_dot_product_attention(F.pad(q_j, pad), F.pad(k, pad), F.pad(v, (0, width_v - v.shape[-1])),
                                             is_causal=q.shape[2] == k.shape[2], scale=1.0)
        return normalize(out[..., : v.shape[-1]].float(), k=1.0, floor=1.0)

    def eager_impl(q, k, v, tau):
        return lorentz_attention(q, k, v, k=1.0, tau=tau, causal=True, impl="eager")

    impls = {"triton": triton_impl, "triton-model": triton_model_impl, "sdpa": sdpa_impl}
    if not args.no_eager:
        impls["eager"] = eager_impl

    def inputs(B, Tq, Tk, d, grad):
        gen = torch.Generator(device=device).manual_seed(0)

        def points(T):
            x = lift(0.5 * torch.randn(B, args.heads, T, d, device=device, generator=gen), k=1.0).to(dtype)
            return x.requires_grad_(grad)
        tau = torch.tensor(math.sqrt(1 + d), device=device, requires_grad=grad)
        return points(Tq), points(Tk), points(Tk), tau

    def timed(fn, **kw):
        """Median ms of ``fn``, or None when it runs out of GPU memory."""
        try:
            return do_bench(fn, **kw)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None

    def forward_times(q, k, v, tau):
        with torch.no_grad():
            return {name: timed(functools.partial(f, q, k, v, tau), warmup=25, rep=100) for name, f in impls.items()}

    def forward_backward_times(q, k, v, tau, grad_out):
        def step(f):
            f(q, k, v, tau).backward(grad_out)

        return {name: timed(functools.partial(step, f), warmup=10, rep=50, grad_to_none=[q, k, v, tau])
                for name, f in impls.items()}

    def report(label, times, flops):
        cells = []
        for name, ms in times.items():
            cells.append(f"{name} OOM" if ms is None else f"{name} {ms:8.3f} ms {flops / ms * 1e-9:7.1f} TFLOP/s")
        print(f"{label:28s} " + " | ".join(cells))
        base = times["triton"]
        for name, ms in times.items():
            if name != "triton":
                ratio = "n/a (out of memory)" if ms is None or base is None else f"{ms / base:.2f}x"
                print(f"ratio {label} {name}/triton: {ratio}")

    # Sanity check first: the kernel against eager (fp32 maths on the same bf16 inputs) at a small size.
    t_check, d_check = min(512, *args.seq), args.dims[0]
    q, k, v, tau = inputs(2, t_check, t_check, d_check, grad=False)
    err = (triton_impl(q, k, v, tau) - eager_impl(q, k, v, tau)).abs().max().item()
    print(f"check: max |triton - eager| at T={t_check}, d=1+{d_check}: {err:.2e}")

    for T in args.seq:
        B = max(1, args.tokens // T)
        for d in args.dims:
            label = f"T={T} d=1+{d} B={B}"
            fwd_flops = 2.0 * B * args.heads * T * T * (2 * (1 + d)) / 2
            report(f"fwd     {label}", forward_times(*inputs(B, T, T, d, grad=False)), fwd_flops)
            grad_out = torch.randn(B, args.heads, T, 1 + d, device=device)
            times = forward_backward_times(*inputs(B, T, T, d, grad=True), grad_out)
            report(f"fwd+bwd {label}", times, 3.5 * fwd_flops)

    # Decoding: one new token against a cache of T keys (the split-K kernel), forward only.
    for T in args.seq:
        for d in args.dims:
            B = 8
            times = forward_times(*inputs(B, 1, T, d, grad=False))
            report(f"decode  Tq=1 Tk={T} d=1+{d} B={B}", times, 2.0 * B * args.heads * T * 2 * (1 + d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
