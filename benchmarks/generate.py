"""Generation speed of HELM models next to transformers' Euclidean models of the same shape, in one run.

For each model and context length (random prompts of 256, 1k and 4k tokens, batch 1):

* ``generate``: greedy, ``max_new_tokens`` new tokens with the model's default cache; new tokens per second,
  prefill included (what a user sees);
* decode step: one cached forward of one token after a prefill of the context, in ms: the cost of a step as
  the cache grows (it should stay nearly flat; attention over the cache is the only part that grows).

Models (``--shapes tiny``, the default; ``--shapes paper``: ``helm-d-115m``, ``helm-mice-120m``, ``llama-115m``,
``deepseek-v3-120m``): ``tiny-helm-d``, ``tiny-helm-mice`` with ``hmla_absorb=False`` (plain HMLA: the latent cache is
re-expanded by ``kv_b_proj`` at every step), ``tiny-helm-mice`` with ``hmla_absorb=True`` (the absorbed decoding of
issue 13, the default), ``tiny-llama`` and ``tiny-deepseek-v3``. Models alternate within each repeat so that a change in
machine load hits all of them; the best of the repeats is reported. Ratios at the end: HELM-MiCE / HELM-D decode
step (issue 13's target is <= 1.2 at 1k) and each HELM model / its Euclidean twin.

``--device cuda`` runs the same models on the GPU (timed between ``torch.cuda.synchronize()`` calls); ``--dtype bf16``
runs them under bf16 autocast over fp32 weights, the layout the training runs use (``helm.precision``: under
autocast HELM keeps Llama's layout, where a model cast to bf16 would not). ``--attn-impl`` sets the HELM models'
``attn_implementation`` (default ``auto``: the Triton kernel on CUDA where it can run, else SDPA).

Usage: ``python benchmarks/generate.py [--device cpu|cuda] [--dtype fp32|bf16] [--attn-impl IMPL]
[--contexts 256 1024 4096] [--new-tokens 32] [--steps 16] [--repeats 3] [--threads N] [--shapes tiny|paper]``
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings

warnings.filterwarnings("ignore", category=DeprecationWarning)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import helm  # noqa: E402
from cli import check_device  # noqa: E402
from helm.ops import ATTENTION_IMPLEMENTATIONS  # noqa: E402

MODELS = {"helm-d": ("helm-d", {}), "helm-mice": ("helm-mice", {"hmla_absorb": False}),
          "helm-mice-absorbed": ("helm-mice", {"hmla_absorb": True}),
          "llama": ("llama", {}), "deepseek-v3": ("deepseek-v3", {})}
PRESETS = {"tiny": {"helm-d": "tiny-helm-d", "helm-mice": "tiny-helm-mice", "llama": "tiny-llama",
                    "deepseek-v3": "tiny-deepseek-v3"},
           "paper": {"helm-d": "helm-d-115m", "helm-mice": "helm-mice-120m", "llama": "llama-115m",
                     "deepseek-v3": "deepseek-v3-120m"}}


def build(name: str, max_len: int, shapes: str = "tiny", device: torch.device = torch.device("cpu"),
          attn_impl: str | None = None):
    family, options = MODELS[name]
    preset = PRESETS[shapes][family]
    config = helm.load_config(preset, max_position_embeddings=max_len)
    if any(not hasattr(config, key) for key in options):
        return None  # this version of the zoo lacks the switch
    for key, value in options.items():
        setattr(config, key, value)
    helm_model = config.model_type.startswith("helm")  # transformers' models keep their own attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, **({"attn_implementation": attn_impl} if attn_impl and helm_model
                                                       else {})).to(device).eval()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queue, so that the host's clock times the work, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate_rate(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """New tokens per second of greedy ``generate`` (prefill included)."""
    synchronize(prompt.device)
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=model.config.pad_token_id)
    synchronize(prompt.device)
    return new_tokens / (time.perf_counter() - start)


@torch.inference_mode()
def decode_step(model, prompt: torch.Tensor, steps: int) -> float:
    """Mean seconds of one cached single-token forward after a prefill of ``prompt``."""
    out = model(prompt, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    synchronize(prompt.device)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    synchronize(prompt.device)
    return (time.perf_counter() - start) / steps


def measure(models: dict, args, device: torch.device) -> tuple[dict, dict]:
    """Decode-step seconds and ``generate`` tokens/s, keyed by (model, context)."""
    step, rate = {}, {}
    for context in args.contexts:
        prompt = torch.randint(2, 512, (1, context), generator=torch.Generator().manual_seed(context)).to(device)
        for model in models.values():  # warm-up
            decode_step(model, prompt[:, :64], 2)
        for _ in range(args.repeats):
            for name, model in models.items():
                s = decode_step(model, prompt, args.steps)
                step[name, context] = min(step.get((name, context), float("inf")), s)
                r = generate_rate(model, prompt, args.new_tokens)
                rate[name, context] = max(rate.get((name, context), 0.0), r)
    return step, rate


def report(models: dict, step: dict, rate: dict, contexts: list[int]) -> None:
    """The table, then the ratios of decode steps between models and between contexts."""
    print(f"\n{'model':<20}" + "".join(f"{f'decode ms @{c}':>16}{f'gen tok/s @{c}':>17}" for c in contexts))
    for name in models:
        print(f"{name:<20}" + "".join(f"{step[name, c] * 1e3:16.2f}{rate[name, c]:17.1f}" for c in contexts))
    ratios = [("helm-mice", "helm-d"), ("helm-mice-absorbed", "helm-d"), ("helm-d", "llama"),
              ("helm-mice", "deepseek-v3"), ("helm-mice-absorbed", "deepseek-v3")]
    print()
    for a, b in ratios:
        if a in models and b in models:
            print(f"  decode step {a} / {b}: " + ", ".join(f"{step[a, c] / step[b, c]:.2f}x @{c}"
                                                              for c in contexts))
    for name in models:
        first, last = contexts[0], contexts[-1]
        print(f"  {name}: decode step @{last} / @{first} = {step[name, last] / step[name, first]:.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="fp32, or bf16 autocast over fp32 weights")
    parser.add_argument("--attn-impl", choices=ATTENTION_IMPLEMENTATIONS, default=None,
                        help="the HELM models' attn_implementation (default: auto)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--shapes", choices=sorted(PRESETS), default="tiny",
                        help="tiny presets (default) or the paper's 115M/120M presets (128k vocabulary)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 is steadier on a shared machine")
    args = parser.parse_args(argv)
    device = check_device(parser, args)
    max_len = max(args.contexts) + args.new_tokens + args.steps + 1
    models = {name: build(name, max_len, args.shapes, device, args.attn_impl) for name in args.models}
    for name in [n for n, m in models.items() if m is None]:
        print(f"  {name}: skipped, this version has no {', '.join(MODELS[name][1])} switch")
        del models[name]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    precision = "bf16 autocast" if args.dtype == "bf16" else "fp32"
    print(f"{args.shapes} presets; torch {torch.__version__}, {where}, {precision}; batch 1, greedy, {args.new_tokens} "
          f"new tokens per generate, {args.steps} decode steps per repeat, best of {args.repeats} repeats")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()
    with autocast:
        step, rate = measure(models, args, device)
    report(models, step, rate, args.contexts)


if __name__ == "__main__":
    main()
