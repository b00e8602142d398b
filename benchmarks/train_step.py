"""Training throughput of HELM models next to transformers' Euclidean models of the same shape, in one run.

Pairs (tiny presets, the shapes of the README's CPU runs):

* ``tiny-helm-d``    (ambient 129 = 1 + 128, 4 layers, 4 heads)  vs  ``tiny-llama``       (``LlamaForCausalLM``, 128)
* ``tiny-helm-mice`` (HMLA + MiCE, 4 routed / 2 active / 1 shared)  vs  ``tiny-deepseek-v3`` (``DeepseekV3ForCausalLM``)

Each step is what ``train.py`` does per optimiser step: forward on packed rows (document ids / restarting
positions, so attention stays within documents), backward, gradient clipping, the optimiser step of
``helm.optim.build_optimizer`` (AdamW, plus RiemannianAdam for manifold points) and, for MiCE, the routing
bias update. Measurements of the two models alternate, so a change in machine load hits both; the
reported time is the best of the repeats (other processes only ever add time; the median is printed too).
The ratio is HELM time / Euclidean time per token (the paper reports 1.5–1.8x for its implementation).

Usage: ``python benchmarks/train_step.py [--batch-size 8] [--seq-len 256] [--steps 3] [--repeats 5]
[--pairs helm-d mice]``
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import helm  # noqa: E402
from helm.data import pack_documents  # noqa: E402
from helm.optim import build_optimizer  # noqa: E402
from helm.evaluation import packed_inputs  # noqa: E402

PAIRS = {"helm-d": ("tiny-helm-d", "tiny-llama"), "mice": ("tiny-helm-mice", "tiny-deepseek-v3")}


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


class Trainer:
    """One model, its optimiser and a fixed batch; ``run(n)`` times ``n`` training steps."""

    def __init__(self, preset: str, batch: dict[str, torch.Tensor], lr: float = 1e-3):
        torch.manual_seed(0)
        self.name = preset
        self.model = AutoModelForCausalLM.from_config(helm.load_config(preset))
        self.model.train()
        self.params = sum(p.numel() for p in self.model.parameters())
        self.optimizer = build_optimizer(self.model, lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
        self.inputs = {**packed_inputs(self.model, batch), "labels": batch["labels"]}
        self.routing = hasattr(self.model, "update_routing_bias")
        self.tokens = batch["input_ids"].numel()
        self.loss = float("nan")

    def step(self) -> None:
        out = self.model(**self.inputs)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.routing:
            self.model.update_routing_bias()
        self.loss = out.loss.item()

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - start) / steps


def compare(helm_preset: str, euclid_preset: str, args) -> tuple[float, float]:
    vocab = helm.load_config(helm_preset).vocab_size
    batch = packed_batch(args.batch_size, args.seq_len, vocab)
    trainers = [Trainer(helm_preset, batch), Trainer(euclid_preset, batch)]
    for t in trainers:  # warm-up: allocator, thread pools, first-call dispatch
        t.run(args.warmup)
    times = {t.name: [] for t in trainers}
    for _ in range(args.repeats):
        for t in trainers:
            times[t.name].append(t.run(args.steps))
    best = [min(times[t.name]) for t in trainers]
    for t, sec in zip(trainers, best):
        median = statistics.median(times[t.name])
        print(f"  {t.name:<18} {type(t.model).__name__:<24} {t.params / 1e6:6.2f}M params  "
              f"{sec * 1e3:8.1f} ms/step  {t.tokens / sec:9,.0f} tokens/s  (median {median * 1e3:.1f} ms, "
              f"final loss {t.loss:.3f})")
    print(f"  => {helm_preset} / {euclid_preset} training time per token: {best[0] / best[1]:.2f}x")
    return best[0], best[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=list(PAIRS))
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch_size} x "
          f"{args.seq_len} packed tokens; best of {args.repeats} repeats x {args.steps} steps")
    for name in args.pairs:
        compare(*PAIRS[name], args)


if __name__ == "__main__":
    main()
