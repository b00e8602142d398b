"""Training throughput of HELM models next to transformers' Euclidean models of the same shape, in one run.

Pairs (``--pairs``) at three sets of shapes (``--shapes``):

* ``helm-d``: ``tiny-helm-d`` (ambient 129 = 1 + 128, 4 layers, 4 heads) vs ``tiny-llama`` (``LlamaForCausalLM``);
  paper and gpu: ``helm-d-115m`` vs ``llama-115m``
* ``mice``: ``tiny-helm-mice`` (HMLA + MiCE, 4 routed / 2 active / 1 shared) vs ``tiny-deepseek-v3``
  (``DeepseekV3ForCausalLM``); paper and gpu: ``helm-mice-120m`` vs ``deepseek-v3-120m``

``tiny`` runs 8 rows x 256 tokens by default; ``paper`` (opt-in: minutes per pair on 2 CPU cores, 128k vocabulary)
1 row x 256 and x 1024 tokens; ``gpu`` the paper's presets at 8 rows x 2048 tokens, for ``--device cuda``
(``--batch-size``, ``--seq-len`` override all three).

Each step is ``helm.training.train_step``, the step ``train.py`` takes: forward on packed rows (segment ids /
restarting positions, so attention stays within documents), backward, gradient clipping, the optimiser step of
``helm.optim.build_optimizer`` (AdamW, plus RiemannianAdam for manifold points) and, for HELM-MiCE and DeepSeek-V3
alike, the balance loss and the routing-bias update. ``--dtype bf16`` is ``train.py``'s
``train.mixed_precision=bf16``: the accelerator's bf16 autocast over fp32 master weights (CPU autocast on a CPU).
``--attn-impl`` sets the HELM models' ``attn_implementation`` (``sdpa``, ``triton``, ...; several values time one HELM model
per value beside the same twin, so the kernel and SDPA are compared in one run).

Measurements of the models of a pair alternate, so a change in machine load hits all of them. On a CPU the reported
time is the best of the repeats (other processes only ever add time; the median is printed too); on CUDA it is the
median of all timed steps, each timed by CUDA events (the device is the benchmark's alone, and events time the
queue without a host sync inside the step), with the peak memory of each model's steps
(``torch.cuda.max_memory_allocated`` less what the pair's other models hold). The ratio is HELM time / Euclidean
time per token (the paper reports 1.5–1.8x for its implementation).

``--compile`` also times all models under ``torch.compile`` (``--backend``, default inductor; one graph where the
model says it can: ``_can_compile_fullgraph``), after warm-up steps that include the compilation (its time is
printed); all pairs run eager first, then compiled (``--compiled-only``: compiled alone).

**MFU** = 6 · N_active · tokens/s ÷ F, F the FLOP/s of one ``torch.mm`` of the HELM model's MLP shape
(``[tokens, hidden] @ [hidden, intermediate]``) in the compute dtype (bf16 for ``--dtype bf16``) measured on the
device in the same run: 100% would be every parameter's forward and backward matmuls at that GEMM's speed (the
**roofline ratio** printed beside it is 1 / MFU; on CUDA the header also gives a dense 8192³ GEMM's FLOP/s). N_active
counts the parameters a token uses: all but the input embedding table (a lookup), with routed experts scaled by
top-k / routed (shared experts and routers count fully); attention's ``T²`` matmuls are not in it.

``--profile`` times nothing: it runs ``--warmup`` steps of each pair's HELM model, then one step under
``torch.profiler``, and prints the top ops (``--profile-rows``) by self device time and by inclusive device time
(by CPU time on a CPU).

Usage: ``python benchmarks/train_step.py [--device cpu|cuda] [--dtype fp32|bf16] [--shapes tiny paper gpu]
[--pairs helm-d mice] [--attn-impl sdpa triton ...] [--batch-size B] [--seq-len T ...]
[--compile | --compiled-only] [--backend inductor] [--steps 3] [--repeats 5] [--warmup 2] [--threads N]
[--profile [--profile-rows 25]]``
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import helm  # noqa: E402
from cli import check_device, packed_batch  # noqa: E402
from helm.models.routing import attach_balancing  # noqa: E402
from helm.ops import ATTENTION_IMPLEMENTATIONS  # noqa: E402
from helm.optim import build_optimizer  # noqa: E402
from helm.training import train_step  # noqa: E402


PAPER = {"helm-d": ("helm-d-115m", "llama-115m"), "mice": ("helm-mice-120m", "deepseek-v3-120m")}
SHAPES = {"tiny": {"helm-d": ("tiny-helm-d", "tiny-llama"), "mice": ("tiny-helm-mice", "tiny-deepseek-v3")},
          "paper": PAPER, "gpu": PAPER}
DEFAULT_BATCH = {"tiny": (8, [256]), "paper": (1, [256, 1024]), "gpu": (8, [2048])}  # rows, sequence lengths
# --dtype: the dtype the GEMMs run in, and the accelerator's mixed_precision that gives it (as train.py sets it)
DTYPES = {"fp32": (torch.float32, "no"), "bf16": (torch.bfloat16, "bf16")}
GiB = 2 ** 30


def active_parameters(model) -> int:
    """Parameters one token's forward multiplies with: all but the input embedding table (unless tied to the LM
    head), routed experts counted at ``num_experts_per_tok / n_routed_experts``."""
    config = model.config
    routed = config.num_experts_per_tok / config.n_routed_experts if getattr(config, "n_routed_experts", None) else 1
    table = model.get_input_embeddings().weight
    tied = table is getattr(model.get_output_embeddings(), "weight", None)
    return round(sum(p.numel() * (routed if ".experts." in name else 1) for name, p in model.named_parameters()
                     if p is not table or tied))


def gemm_flops(m: int, k: int, n: int, device: torch.device = torch.device("cpu"), dtype: torch.dtype = torch.float32,
               repeats: int = 50) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` on ``device`` (best of ``repeats``)."""
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    if device.type == "cuda":
        # one product takes tens of microseconds on a GPU: time 10 back to back between events, so that neither the
        # launch nor the host's clock is in the figure
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            for _ in range(10):
                torch.mm(a, b)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / 10)
    else:
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


def flops_text(flops: float) -> str:
    return f"{flops / 1e12:.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.1f} GFLOP/s"


def cell(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """``value`` scaled and formatted for the table, or a dash where there is none (the twin failed; no peak memory
    on a CPU)."""
    return "–" if value is None else format(value * scale, spec) + suffix


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class Trainer:
    """One model (compiled with ``backend`` unless None), its optimiser and a fixed batch on ``device``, trained in
    ``precision`` (accelerate's ``mixed_precision``); ``run(n)`` times ``n`` training steps."""

    def __init__(self, preset: str, batch: dict[str, torch.Tensor], device: torch.device, precision: str = "no",
                 overrides: dict | None = None, label: str | None = None, lr: float = 1e-3,
                 backend: str | None = None):
        torch.manual_seed(0)
        self.name = label or preset
        self.device = device
        config = helm.load_config(preset, **(overrides or {}))
        model = AutoModelForCausalLM.from_config(config)
        model.train()
        self.params = sum(p.numel() for p in model.parameters())
        self.active = active_parameters(model)
        attach_balancing(model)  # before compiling, as train.py does: DeepSeek-V3's balancing hooks are traced too
        # an accelerator of its own, so that its models are freed with the Trainer; one process as measured
        self.accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=precision)
        self.model, self.optimizer = self.accelerator.prepare(
            model, build_optimizer(model, lr=lr, weight_decay=0.01, betas=(0.9, 0.95)))
        self.batch = batch
        self.tokens = batch["input_ids"].numel()
        # transformers' per-expert loop (the deepseek-v3-120m preset's experts_implementation: its 390-wide rows are
        # not 16-byte aligned for torch._grouped_mm) breaks the compiled graph: compiled without fullgraph
        expert_loop = getattr(config, "_experts_implementation", None) == "eager"
        self.forward = self.model if backend is None else torch.compile(
            self.model, backend=backend, fullgraph=self.model._can_compile_fullgraph and not expert_loop)
        self.loss = float("nan")
        self.resident = 0  # device bytes this model holds between steps (weights, optimiser state), set by the caller

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def run(self, steps: int) -> list[float]:
        """Seconds of each of ``steps`` training steps."""
        marks = [self._mark()]
        for _ in range(steps):
            metrics = train_step(self.accelerator, self.model, self.optimizer, None, [self.batch], grad_clip=1.0,
                                 forward=self.forward)
            marks.append(self._mark())
        self.loss = float(metrics.loss)  # waits for the last step to finish
        if self.device.type == "cuda":
            marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        return [b - a for a, b in zip(marks, marks[1:])]


def models_of(helm_preset: str, euclid_preset: str, attn_impls: list[str] | None) -> list[tuple[str, dict, str]]:
    """(preset, config overrides, label) of a pair's models: one HELM model per ``--attn-impl`` value, then the twin
    (transformers' models keep their own attention)."""
    helms = [(helm_preset, {"attn_implementation": impl}, f"{helm_preset} [{impl}]") for impl in attn_impls or []]
    return (helms or [(helm_preset, {}, helm_preset)]) + [(euclid_preset, {}, euclid_preset)]


FAILED: list[str] = []  # what failed in this run: main's exit status is 1 if anything did


def failed(what: str, error: Exception) -> None:
    """One line in the report, so that the run goes on to the next model; the traceback on stderr."""
    FAILED.append(what)
    message = str(error).strip().splitlines()
    print(f"  {what}: FAILED, {type(error).__name__}: {message[0] if message else ''}", flush=True)
    traceback.print_exc()


def release(device: torch.device, backend: str | None) -> None:
    """Free the last pair's models before the next pair is built (and its peak memory measured)."""
    gc.collect()
    if backend is not None:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def build(spec: tuple[str, dict, str], batch, backend, args, device) -> Trainer | None:
    """A trainer after its warm-up steps (compilation, allocator, thread pools, first-call dispatch, Triton's
    autotuning), or None (reported) if building or warming it up failed."""
    preset, overrides, label = spec
    before, start = allocated(device), time.perf_counter()
    try:
        trainer = Trainer(preset, batch, device, DTYPES[args.dtype][1], overrides, label, backend=backend)
        trainer.run(args.warmup)
    except Exception as error:
        failed(f"[{backend or 'eager'}] {label}", error)
        trainer = None
    if trainer is None:
        release(device, None)  # outside the handler, whose traceback holds the half-built model
        return None
    if backend is not None:
        print(f"  [{backend}] {label}: {args.warmup} warm-up steps, compilation included: "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    trainer.resident = allocated(device) - before
    return trainer


def pair_batch(helm_preset: str, batch_size: int, seq_len: int, device: torch.device):
    config = helm.load_config(helm_preset)
    batch = packed_batch(batch_size, seq_len, config.vocab_size)
    if device.type == "cuda":  # as train.py's loader pins it: train_step's copy to the device is then asynchronous
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return config, batch


def compare(helm_preset: str, euclid_preset: str, batch_size: int, seq_len: int, backend, args, device) -> list:
    """Time a pair (eager, or compiled with ``backend``); one row per HELM model for the table: its label, the
    tokens, the mode and (HELM, Euclidean) pairs of s/step, MFU and peak bytes (Euclidean None if the twin failed,
    peak None on a CPU)."""
    config, batch = pair_batch(helm_preset, batch_size, seq_len, device)
    cuda, mode = device.type == "cuda", backend or "eager"
    specs = models_of(helm_preset, euclid_preset, args.attn_impl)
    trainers = [t for t in (build(spec, batch, backend, args, device) for spec in specs) if t is not None]
    if not trainers:
        return []
    dtype = DTYPES[args.dtype][0]
    gemm = (batch_size * seq_len, config.hidden_size, config.intermediate_size)
    flops = gemm_flops(*gemm, device, dtype)
    times = {t.name: [] for t in trainers}  # per repeat, the seconds of each step
    peak = {t.name: 0 for t in trainers}
    for _ in range(args.repeats):
        for t in trainers:
            if cuda:  # the pair's other models stay on the device: count only what this one adds to theirs
                others = torch.cuda.memory_allocated(device) - t.resident
                torch.cuda.reset_peak_memory_stats(device)
            times[t.name].append(t.run(args.steps))
            if cuda:
                peak[t.name] = max(peak[t.name], torch.cuda.max_memory_allocated(device) - others)
    flops = max(flops, gemm_flops(*gemm, device, dtype))  # before and after the steps: the machine's best
    result = {}
    for t in trainers:
        if cuda:  # the GPU is the benchmark's alone: the median step
            steps = [s for r in times[t.name] for s in r]
            sec, other = statistics.median(steps), ("fastest", min(steps))
        else:  # other processes only ever add time: the best repeat
            means = [statistics.fmean(r) for r in times[t.name]]
            sec, other = min(means), ("median", statistics.median(means))
        mfu = 6 * t.active * t.tokens / sec / flops
        result[t.name] = (sec, mfu, peak[t.name] if cuda else None)
        print(f"  {mode:<9} {t.name:<24} {type(t.model).__name__:<23} {t.params / 1e6:7.2f}M params "
              f"({t.active / 1e6:.2f}M active)  {sec * 1e3:8.1f} ms/step  {t.tokens / sec:9,.0f} tokens/s  "
              f"MFU {mfu:6.1%} (roofline {1 / mfu:5.1f}x)" + (f"  peak {peak[t.name] / GiB:6.2f} GiB" if cuda else "")
              + f"  ({other[0]} {other[1] * 1e3:.1f} ms, loss {t.loss:.3f})", flush=True)
    twin = result.get(euclid_preset, (None, None, None))
    rows = []
    for _, _, label in specs[:-1]:
        if label not in result:
            continue
        rows.append({"label": label, "rows": batch_size, "seq_len": seq_len, "mode": mode,
                     **dict(zip(["sec", "mfu", "peak"], zip(result[label], twin)))})
        if twin[0] is not None:
            print(f"  => {mode}: {label} / {euclid_preset} training time per token: "
                  f"{result[label][0] / twin[0]:.2f}x")
    print(f"  GEMM {gemm[0]}x{gemm[1]} @ {gemm[1]}x{gemm[2]}, {args.dtype}: {flops_text(flops)}", flush=True)
    return rows


def profile(helm_preset: str, euclid_preset: str, batch_size: int, seq_len: int, backend, args, device) -> None:
    """Print the top ops of one training step of each of the pair's HELM models."""
    _, batch = pair_batch(helm_preset, batch_size, seq_len, device)
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    # self time names the kernels that cost; inclusive time the aten / autograd ops (and backward nodes) they are in
    keys = ["self_device_time_total", "device_time_total"] if cuda else ["self_cpu_time_total", "cpu_time_total"]
    for spec in models_of(helm_preset, euclid_preset, args.attn_impl)[:-1]:
        trainer = build(spec, batch, backend, args, device)
        if trainer is None:
            continue
        with torch.profiler.profile(activities=activities) as prof:
            step = trainer.run(1)[0]
        for key in keys:
            print(f"\n{backend or 'eager'} {trainer.name}, {batch_size} x {seq_len} tokens, {args.dtype}: one training "
                  f"step ({step * 1e3:.1f} ms under the profiler), top {args.profile_rows} ops by {key}")
            print(prof.key_averages().table(sort_by=key, row_limit=args.profile_rows, max_name_column_width=70),
                  flush=True)
        del trainer, prof
        release(device, None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="train_step.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="fp32, or bf16: train.py's mixed_precision=bf16 (autocast, fp32 master weights)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny"],
                        help="tiny presets, and/or the paper's 115M/120M shapes (opt-in: minutes per pair on a CPU), "
                             "and/or those at 8 x 2048 tokens (gpu)")
    parser.add_argument("--pairs", nargs="+", choices=sorted(SHAPES["tiny"]), default=list(SHAPES["tiny"]))
    parser.add_argument("--attn-impl", nargs="+", choices=ATTENTION_IMPLEMENTATIONS, default=None,
                        help="the HELM models' attn_implementation (default: auto); several: one HELM model each")
    parser.add_argument("--batch-size", type=int, default=None, help="rows per step (default: tiny 8, paper 1, gpu 8)")
    parser.add_argument("--seq-len", type=int, nargs="+", default=None,
                        help="tokens per row, one or more (default: tiny 256, paper 256 1024, gpu 2048)")
    parser.add_argument("--compile", action="store_true", help="also time the models of each pair compiled")
    parser.add_argument("--compiled-only", action="store_true",
                        help="time the compiled models alone (--compile without the eager run)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend for --compile")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (e.g. 1 on a shared machine)")
    parser.add_argument("--profile", action="store_true",
                        help="time nothing: profile one step of each pair's HELM model after the warm-up")
    parser.add_argument("--profile-rows", type=int, default=25, help="ops per --profile table")
    args = parser.parse_args(argv)
    device = check_device(parser, args)
    precision = "bf16 autocast, fp32 master weights" if args.dtype == "bf16" else "fp32"
    if args.profile:
        timing = f"one profiled step after {args.warmup} warm-up steps"
    else:
        timing = f"{'median' if device.type == 'cuda' else 'best'} of {args.repeats} repeats x {args.steps} steps"
    if device.type == "cuda":
        # the dense product the device is rated by, beside the model-shaped one that MFU divides by
        dense = gemm_flops(8192, 8192, 8192, device, DTYPES[args.dtype][0], repeats=5)
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)} (8192³ {args.dtype} GEMM "
              f"{flops_text(dense)}); {precision}; {timing}")
    else:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {precision}; {timing}")
    pairs = [(shape, args.batch_size or DEFAULT_BATCH[shape][0], seq_len, pair) for shape in args.shapes
             for seq_len in args.seq_len or DEFAULT_BATCH[shape][1] for pair in args.pairs]
    rows = []
    # every pair eager before any compiled: a run cut short still has the eager figures
    modes = ([] if args.compiled_only else [None]) + ([args.backend] if args.compile or args.compiled_only else [])
    for backend in modes:
        for shape, batch_size, seq_len, pair in pairs:
            helm_preset, euclid_preset = SHAPES[shape][pair]
            print(f"\n{helm_preset} vs {euclid_preset}: {batch_size} x {seq_len} packed tokens, {backend or 'eager'}",
                  flush=True)
            try:
                if args.profile:
                    profile(helm_preset, euclid_preset, batch_size, seq_len, backend, args, device)
                else:
                    rows += compare(helm_preset, euclid_preset, batch_size, seq_len, backend, args, device)
            except Exception as error:
                failed(f"{helm_preset} vs {euclid_preset}", error)
            finally:
                release(device, backend)
    if rows:
        print("\n| HELM model | tokens | mode | HELM ms/step | Euclidean ms/step | HELM / Euclidean | HELM tokens/s | "
              "MFU HELM | MFU Euclidean | peak GiB HELM | peak GiB Euclidean |\n" + "| --- " * 11 + "|")
    for row in rows:
        (h, e), (mh, me), (ph, pe) = row["sec"], row["mfu"], row["peak"]
        print(f"| {row['label']} | {row['rows']} x {row['seq_len']} | {row['mode']} | {h * 1e3:,.1f} | "
              f"{cell(e, ',.1f', 1e3)} | {cell(e and h / e, '.2f', suffix='x')} | "
              f"{row['rows'] * row['seq_len'] / h:,.0f} | {mh:.1%} | {cell(me, '.1%')} | {cell(ph, '.2f', 1 / GiB)} | "
              f"{cell(pe, '.2f', 1 / GiB)} |")
    if FAILED:
        print(f"\nfailed: {'; '.join(FAILED)}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
