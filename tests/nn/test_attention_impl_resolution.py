"""One function decides what each attention call runs (issue 33 item 2): :func:`helm.ops.resolve_attention`, from the
requested name (``config._attn_implementation``), the device and what the call needs."""

from __future__ import annotations

import pytest
import torch

import helm.ops.attention as ops
from helm.ops.attention import AttentionMask, resolve_attention

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def kernel_loads(monkeypatch):
    """The Triton kernel importable and the interpreter on, without importing it into this process."""
    monkeypatch.setattr(ops, "_load_kernel", lambda: (object(), None))
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_each_name_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert [resolve_attention(n, CPU) for n in ("eager", "sdpa", "auto", None)] == ["eager", "sdpa", "sdpa", "sdpa"]
    with pytest.raises(ValueError, match="'triton'.*'cpu'.*'sdpa'.*'auto'"):
        resolve_attention("triton", CPU)
    with pytest.raises(ValueError, match="'flash'"):
        resolve_attention("flash", CPU)
    # also where HMLA would take its absorbed decode: train.py's cached probe forward must see the refusal
    with pytest.raises(ValueError, match="'triton'.*'cpu'"):
        resolve_attention("triton", CPU, absorbable=True)


def test_auto_takes_the_kernel_on_cuda_only_where_it_takes_the_call(kernel_loads):
    assert resolve_attention("auto", CUDA) == "triton"
    assert resolve_attention("auto", CPU) == "sdpa"
    assert resolve_attention("auto", CUDA, dense_bias=True) == "sdpa"
    assert resolve_attention("auto", CUDA, mask=AttentionMask(1, 1, 8, q_offset=3)) == "sdpa"


def test_triton_falls_back_to_sdpa_where_the_kernel_cannot_take_the_call(kernel_loads):
    static = AttentionMask(1, 1, 8, q_offset=3)  # a static cache: queries not bottom-right
    four_d = AttentionMask(1, 2, 8, dense=torch.ones(1, 1, 2, 8, dtype=torch.bool))
    assert resolve_attention("triton", CPU) == "triton"
    assert resolve_attention("triton", CPU, mask=AttentionMask(2, 8, 8, padding=torch.ones(2, 8))) == "triton"
    for mask, bias in ((static, False), (four_d, False), (None, True)):
        assert resolve_attention("triton", CPU, mask=mask, dense_bias=bias) == "sdpa"


def test_fallbacks_in_half_precision_are_eager_not_a_flash_kernel_that_does_not_run(kernel_loads, monkeypatch):
    """Issue 35 item 7: ``sdpa`` in half precision materialises the weights as eager does (its SDPA call would round
    ``[D | E]`` to bf16), so where ``auto`` or ``triton`` fall back for a half-precision call they name it ``eager``;
    an explicit ``sdpa`` stays what was asked for, and in fp32 the fallback is SDPA proper."""
    static = AttentionMask(1, 1, 8, q_offset=3)
    assert resolve_attention("auto", CUDA, half=True) == "triton"
    assert resolve_attention("auto", CUDA, dense_bias=True, half=True) == "eager"
    assert resolve_attention("auto", CUDA, mask=static, half=True) == "eager"
    assert resolve_attention("triton", CPU, dense_bias=True, half=True) == "eager"
    assert resolve_attention("auto", CPU, half=True) == "eager"
    assert resolve_attention("sdpa", CUDA, half=True) == "sdpa"
    assert resolve_attention("auto", CUDA, dense_bias=True, half=False) == "sdpa"
    chosen = []  # and lorentz_attention tells it the call's GEMM dtype: bf16 under autocast
    monkeypatch.setattr(ops, "resolve_attention", lambda *a, **kw: chosen.append(kw["half"]) or "eager")
    q = ops.lift(torch.randn(1, 1, 4, 8), k=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ops.lorentz_attention(q, q, q, k=1.0, tau=1.0, impl="auto")
    ops.lorentz_attention(q, q, q, k=1.0, tau=1.0, impl="auto")
    assert chosen == [True, False]


def test_hmla_absorbed_decode_is_a_path_of_every_name_but_eager(kernel_loads):
    assert [resolve_attention(n, CUDA, absorbable=True) for n in ("auto", "sdpa", "triton", None)] == ["absorbed"] * 4
    assert resolve_attention("eager", CUDA, absorbable=True) == "eager"
    assert resolve_attention("sdpa", CUDA, absorbable=False) == "sdpa"


def test_the_registry_names_every_implementation():
    assert set(ops.ATTENTION_FUNCTIONS) == {"eager", "sdpa", "triton"}
    assert set(ops.ATTENTION_IMPLEMENTATIONS) == {"eager", "sdpa", "triton", "auto"}
