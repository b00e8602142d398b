"""Helpers shared by every test module: one ``assert_close``, seeded inputs with edge cases, synthetic text.

Import as ``from tests.helpers import ...``; fixtures built from these live in ``tests/conftest.py``.
"""

from __future__ import annotations

import random

import torch

# Relative-error bounds keyed by the dtype the computation ran in. bf16 results that leave our layers in fp32
# (time coordinates are always computed in fp32) are held to the bf16 rounding of their inputs.
RTOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

# Acceptance bounds for manifold_error (fp32 <= 1e-5, fp64 <= 1e-12). Points produced under bf16 autocast are
# stored in fp32, so the bf16 bound is the fp32 one.
MANIFOLD_TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-5}

CURVATURES = [0.1, 1.0, 10.0]
BATCH_SHAPES = [(1,), (3, 5), (2, 7, 3)]
EDGE_KINDS = ["zero", "huge", "random"]

WORDS = ("the a one two three four five six seven red blue green cat dog bird river stone tree house light "
         "runs sits sings flows over under near slowly quickly and then water ice rain spring summer").split()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|actual - expected| / max(max|expected|, tiny)``, computed in fp64."""
    actual, expected = actual.detach().double(), expected.detach().double()
    scale = expected.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return float((actual - expected).abs().max() / scale)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype | None = None,
                 rtol: float | None = None, factor: float = 1.0, msg: str = "") -> None:
    """Assert ``relative_error(actual, expected) <= factor · RTOL[dtype]`` (or ``rtol`` when given).

    ``dtype`` is the precision the computation ran in (default: ``actual.dtype``). Shapes must match exactly.
    """
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)} {msg}"
    assert torch.isfinite(actual).all(), f"non-finite values {msg}"
    bound = factor * (RTOL[dtype or actual.dtype] if rtol is None else rtol)
    err = relative_error(actual, expected)
    assert err <= bound, f"relative error {err:.3e} > {bound:.1e} {msg}"


def space_parts(shape, n, kind, dtype=torch.float64, seed=0):
    """Space parts ``[*shape, n]``: all zero, of norm 1e4, or standard normal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, n, generator=g, dtype=torch.float64)
    if kind == "zero":
        x = torch.zeros_like(x)
    elif kind == "huge":
        x = 1e4 * x / x.norm(dim=-1, keepdim=True)
    return x.to(dtype)


def synthetic_text(seed: int, n_lines: int) -> list[str]:
    """Seeded sentences from a small vocabulary, every fifth a counting phrase a tiny model can learn."""
    rng = random.Random(seed)
    counting = "one two three four five six seven".split()
    lines = []
    for i in range(n_lines):
        if i % 5 == 0:
            start = rng.randrange(0, 4)
            lines.append(" ".join(counting[start:start + 4]) + ".")
        else:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ".")
    return lines


TINY_PRESETS = {"helm_d": "tiny-helm-d", "helm_mice": "tiny-helm-mice", "llama": "tiny-llama",
                "deepseek_v3": "tiny-deepseek-v3"}
TINY_SHAPES = {
    "helm_d": dict(num_hidden_layers=2, hidden_size=33, num_attention_heads=2, intermediate_size=65),
    "helm_mice": dict(num_hidden_layers=2, hidden_size=33, num_attention_heads=2, intermediate_size=65,
                      moe_intermediate_size=33, kv_lora_rank=17, qk_nope_head_dim=9, qk_rope_head_dim=9,
                      v_head_dim=9),
    "llama": dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16),
    "deepseek_v3": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8),
}


def tiny_config(family: str = "helm_d", **overrides):
    """A config of ``family`` small enough for a unit test (vocab 512, 128 positions), with ``overrides``."""
    import helm

    fields = {"vocab_size": 512, "max_position_embeddings": 128, **TINY_SHAPES[family], **overrides}
    return helm.load_config(TINY_PRESETS[family], **fields)
