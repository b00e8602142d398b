"""Training throughput of HELM models next to transformers' Euclidean models of the same shape, in one run.

Pairs (``--pairs``) at two sets of shapes (``--shapes``):

* ``helm-d``: ``tiny-helm-d`` (ambient 129 = 1 + 128, 4 layers, 4 heads) vs ``tiny-llama`` (``LlamaForCausalLM``);
  paper: ``helm-d-115m`` vs ``llama-115m``
* ``mice``: ``tiny-helm-mice`` (HMLA + MiCE, 4 routed / 2 active / 1 shared) vs ``tiny-deepseek-v3``
  (``DeepseekV3ForCausalLM``); paper: ``helm-mice-120m`` vs ``deepseek-v3-120m``

``tiny`` runs 8 rows x 256 tokens by default; ``paper`` (opt-in: minutes per pair on 2 CPU cores, 128k vocabulary)
1 row x 256 and x 1024 tokens (``--batch-size``, ``--seq-len`` override both).

Each step is ``helm.training.train_step``, the step ``train.py`` takes: forward on packed rows (segment ids /
restarting positions, so attention stays within documents), backward, gradient clipping, the optimiser step of
``helm.optim.build_optimizer`` (AdamW, plus RiemannianAdam for manifold points) and, for HELM-MiCE and DeepSeek-V3
alike, the balance loss and the routing-bias update. Measurements of the two models alternate, so a change in
machine load hits both; the reported time is the best of the repeats (other processes only ever add time; the
median is printed too). The ratio is HELM time / Euclidean time per token (the paper reports 1.5–1.8x for its
implementation).

``--compile`` also times both models under ``torch.compile`` (``--backend``, default inductor; one graph where
the model says it can: ``_can_compile_fullgraph``), after warm-up steps that include the compilation (its time is
printed). The **roofline ratio** is step time / (6 · N_active · tokens / F), F the fp32 FLOP/s of one
``torch.mm`` of the HELM model's MLP shape (``[tokens, hidden] @ [hidden, intermediate]``) measured in the same
run: 1.0 would be every parameter's forward and backward matmuls at that GEMM's speed. N_active counts the
parameters a token uses: all but the input embedding table (a lookup), with routed experts scaled by
top-k / routed (shared experts and routers count fully); attention's ``T²`` matmuls are not in it.

Usage: ``python benchmarks/train_step.py [--shapes tiny paper] [--pairs helm-d mice] [--batch-size B]
[--seq-len T ...] [--compile [--backend inductor]] [--steps 3] [--repeats 5] [--warmup 2] [--threads N]``
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import helm  # noqa: E402
from helm.data import pack_documents  # noqa: E402
from helm.models.routing import attach_balancing  # noqa: E402
from helm.optim import build_optimizer  # noqa: E402
from helm.training import train_step  # noqa: E402


def packed_batch(batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of random documents (lengths 20–400 tokens) packed like train.py packs real text."""
    g = torch.Generator().manual_seed(seed)
    docs, total = [], 0
    while total < batch_size * seq_len:
        n = int(torch.randint(20, 400, (), generator=g))
        docs.append(torch.randint(2, vocab, (n,), generator=g).tolist())
        total += n + 1
    rows = pack_documents(docs, seq_len, eos_id=0)
    return {k: v[:batch_size] for k, v in rows.items()}


SHAPES = {"tiny": {"helm-d": ("tiny-helm-d", "tiny-llama"), "mice": ("tiny-helm-mice", "tiny-deepseek-v3")},
          "paper": {"helm-d": ("helm-d-115m", "llama-115m"), "mice": ("helm-mice-120m", "deepseek-v3-120m")}}
DEFAULT_BATCH = {"tiny": (8, [256]), "paper": (1, [256, 1024])}  # rows, sequence lengths


def active_parameters(model) -> int:
    """Parameters one token's forward multiplies with: all but the input embedding table (unless tied to the LM
    head), routed experts counted at ``num_experts_per_tok / n_routed_experts``."""
    config = model.config
    routed = config.num_experts_per_tok / config.n_routed_experts if getattr(config, "n_routed_experts", None) else 1
    table = model.get_input_embeddings().weight
    tied = table is getattr(model.get_output_embeddings(), "weight", None)
    return round(sum(p.numel() * (routed if ".experts." in name else 1) for name, p in model.named_parameters()
                     if p is not table or tied))


def gemm_flops(m: int, k: int, n: int, repeats: int = 50) -> float:
    """fp32 FLOP/s of ``[m, k] @ [k, n]`` (best of ``repeats``)."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


class Trainer:
    """One model (compiled with ``backend`` unless None), its optimiser and a fixed batch; ``run(n)`` times ``n``
    training steps."""

    def __init__(self, preset: str, batch: dict[str, torch.Tensor], lr: float = 1e-3, backend: str | None = None):
        torch.manual_seed(0)
        self.name = preset
        config = helm.load_config(preset)
        model = AutoModelForCausalLM.from_config(config)
        model.train()
        self.params = sum(p.numel() for p in model.parameters())
        self.active = active_parameters(model)
        attach_balancing(model)  # before compiling, as train.py does: DeepSeek-V3's balancing hooks are traced too
        # an accelerator of its own, so that its models are freed with the Trainer; one CPU process as measured
        self.accelerator = Accelerator(cpu=True)
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

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            metrics = train_step(self.accelerator, self.model, self.optimizer, None, [self.batch], grad_clip=1.0,
                                 forward=self.forward)
        self.loss = float(metrics.loss)  # waits for the last step to finish
        return (time.perf_counter() - start) / steps


def compare(helm_preset: str, euclid_preset: str, batch_size: int, seq_len: int, backend, args) -> tuple:
    """Time the pair (eager, or compiled with ``backend``); returns (HELM s/step, Euclidean s/step, roofline ratios)."""
    config = helm.load_config(helm_preset)
    batch = packed_batch(batch_size, seq_len, config.vocab_size)
    trainers = [Trainer(helm_preset, batch, backend=backend), Trainer(euclid_preset, batch, backend=backend)]
    mode = backend or "eager"
    for t in trainers:  # warm-up: compilation, allocator, thread pools, first-call dispatch
        start = time.perf_counter()
        t.run(args.warmup)
        if backend is not None:
            print(f"  [{mode}] {t.name}: {args.warmup} warm-up steps, compilation included: "
                  f"{time.perf_counter() - start:.0f} s")
    gemm = (batch_size * seq_len, config.hidden_size, config.intermediate_size)
    flops = gemm_flops(*gemm)
    times = {t.name: [] for t in trainers}
    for _ in range(args.repeats):
        for t in trainers:
            times[t.name].append(t.run(args.steps))
    best = [min(times[t.name]) for t in trainers]
    flops = max(flops, gemm_flops(*gemm))  # before and after the steps: the machine's best
    roofline = []
    for t, sec in zip(trainers, best):
        roofline.append(sec / (6 * t.active * t.tokens / flops))
        print(f"  {mode:<9} {t.name:<17} {type(t.model).__name__:<23} {t.params / 1e6:7.2f}M params "
              f"({t.active / 1e6:.2f}M active)  {sec * 1e3:8.1f} ms/step  {t.tokens / sec:8,.0f} tokens/s  roofline "
              f"{roofline[-1]:5.1f}x  (median {statistics.median(times[t.name]) * 1e3:.1f} ms, loss {t.loss:.3f})")
    print(f"  => {mode}: {helm_preset} / {euclid_preset} training time per token: {best[0] / best[1]:.2f}x "
          f"(GEMM {batch_size * seq_len}x{config.hidden_size} @ {config.hidden_size}x{config.intermediate_size}: "
          f"{flops / 1e9:.1f} GFLOP/s)")
    return best[0], best[1], roofline


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["tiny"],
                        help="tiny presets, and/or the paper's 115M/120M shapes (opt-in: minutes per pair)")
    parser.add_argument("--pairs", nargs="+", choices=sorted(SHAPES["tiny"]), default=list(SHAPES["tiny"]))
    parser.add_argument("--batch-size", type=int, default=None, help="rows per step (default: tiny 8, paper 1)")
    parser.add_argument("--seq-len", type=int, nargs="+", default=None,
                        help="tokens per row, one or more (default: tiny 256, paper 256 1024)")
    parser.add_argument("--compile", action="store_true", help="also time both models of each pair compiled")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend for --compile")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (e.g. 1 on a shared machine)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.repeats} repeats x "
          f"{args.steps} steps")
    rows = []
    for shape in args.shapes:
        batch_size = args.batch_size or DEFAULT_BATCH[shape][0]
        for seq_len in args.seq_len or DEFAULT_BATCH[shape][1]:
            for pair in args.pairs:
                helm_preset, euclid_preset = SHAPES[shape][pair]
                print(f"\n{helm_preset} vs {euclid_preset}: {batch_size} x {seq_len} packed tokens")
                for backend in [None] + ([args.backend] if args.compile else []):
                    h, e, (rh, re) = compare(helm_preset, euclid_preset, batch_size, seq_len, backend, args)
                    rows.append((helm_preset, seq_len, backend or "eager", h, e, rh, re))
    print("\n| HELM model | T | mode | HELM ms/step | Euclidean ms/step | HELM / Euclidean | roofline HELM | "
          "roofline Euclidean |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, seq_len, mode, h, e, rh, re in rows:
        print(f"| {name} | {seq_len} | {mode} | {h * 1e3:,.0f} | {e * 1e3:,.0f} | {h / e:.2f}x | {rh:.1f}x "
              f"| {re:.1f}x |")


if __name__ == "__main__":
    main()
