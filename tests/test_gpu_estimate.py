"""benchmarks/gpu_estimate.py: the trace records what the cost model needs, and the model costs it as stated."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks import gpu_estimate as est


def _traced(fn, *shapes, dtype=torch.bfloat16):
    trace = est.Trace(nonzero_fraction=0.5, value_side="bf16x6")
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(torch.empty(s, dtype=dtype)) for s in shapes]
        with trace:
            fn(*args)
    return trace.ops


def test_aligned_and_unaligned_products_are_told_apart():
    (aligned,) = [op for op in _traced(torch.mm, (64, 64), (64, 32)) if op.launches]
    (unaligned,) = [op for op in _traced(torch.mm, (64, 65), (65, 32)) if op.launches]
    assert aligned.work == {"gemm": 2 * 64 * 64 * 32}
    assert unaligned.work == {"gemm_unaligned": 2 * 64 * 65 * 32}
    (eight_bytes,) = [op for op in _traced(torch.mm, (64, 68), (68, 32)) if op.launches]  # 136-byte rows: 8, not 16
    assert eight_bytes.work == {"gemm_unaligned": 2 * 64 * 68 * 32}
    assert aligned.bytes == 2 * (64 * 64 + 64 * 32 + 64 * 32)


def test_views_launch_nothing_and_slices_are_strided():
    ops = _traced(lambda x: x[:, 1:].exp(), (8, 65), dtype=torch.float32)
    assert [(op.name, op.launches, op.strided) for op in ops] == [("slice", False, False), ("exp", True, True)]


def test_host_reads_drain_the_queue_and_nonzero_gets_the_balanced_count():
    counts = []
    ops = _traced(lambda m: counts.append(m.nonzero().shape[0]), (10, 4), dtype=torch.bool)
    assert counts == [20] and [op.sync for op in ops] == [True]


def test_simulation_is_bound_by_the_host_or_the_device():
    gpu = dataclasses.replace(est.GPUS["h200"], host_us=10.0, floor_us=1.0)
    small = [est.Op("add", "bookkeeping", {}, bytes=8) for _ in range(100)]  # 1 µs each on the device
    big = [est.Op("mm", "gemms", {"gemm": gpu.rate("gemm") * 1e-3})]  # 1 ms
    assert est.simulate(small, gpu) == pytest.approx(100 * 10e-6 + 1e-6)
    assert est.simulate(big + small, gpu) == pytest.approx(1e-3 + 10e-6 + 100 * 1e-6)


def test_rms_norm_is_recorded_as_cudas_two_fused_kernels_with_its_gradients_unchanged():
    """``F.rms_norm`` (HELM's norms) is one kernel each way on CUDA: recorded so, after a strided copy of a
    non-contiguous operand, the decomposition the CPU runs muted; the gradients are the plain function's."""
    x0 = torch.randn(4, 7, 66)
    weight0 = torch.rand(65) + 0.5
    trace = est.Trace(nonzero_fraction=0.5, value_side="bf16x6")
    undo = est.patch_fused_rms_norm(trace)
    try:
        x, weight = x0.clone().requires_grad_(), weight0.clone().requires_grad_()
        with trace:
            y = torch.nn.functional.rms_norm(x[..., 1:], (65,), weight, 1e-6)
            y.backward(torch.ones_like(y))
    finally:
        undo()
    assert torch.nn.functional.rms_norm.__name__ == "rms_norm"
    launched = [(op.name, op.strided) for op in trace.ops if op.launches]
    # the slice is copied for each kernel (the backward reads the saved input again); slice_backward is the slice's
    assert [op for op in launched if op[0] not in ("ones_like", "slice_backward")] == [
        ("contiguous", True), ("_fused_rms_norm", False), ("contiguous", True), ("_fused_rms_norm_backward", False)]
    x_ref, w_ref = x0.clone().requires_grad_(), weight0.clone().requires_grad_()
    y_ref = torch.nn.functional.rms_norm(x_ref[..., 1:], (65,), w_ref, 1e-6)
    y_ref.backward(torch.ones_like(y_ref))
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(weight.grad, w_ref.grad)


def test_a_small_step_of_each_family_is_estimated_and_nothing_stays_changed(capsys):
    from helm.ops import lm_loss

    interpret = os.environ.get("TRITON_INTERPRET")
    rows = est.main(["--pairs", "helm-d", "mice", "--attn-impl", "sdpa", "triton", "--batch-size", "1",
                     "--seq-len", "128"])
    assert "cpu" not in lm_loss._CHUNK_ELEMENTS_ON and lm_loss._epilogue.__name__ == "_epilogue"
    assert torch.nn.functional.rms_norm.__name__ == "rms_norm"
    from triton.runtime.jit import KernelInterface

    assert KernelInterface.__getitem__.__qualname__ == "KernelInterface.__getitem__"
    assert os.environ.get("TRITON_INTERPRET") == interpret
    assert [(r["preset"], r["impl"]) for r in rows] == [
        ("llama-115m", None), ("helm-d-115m", "sdpa"), ("helm-d-115m", "triton"),
        ("deepseek-v3-120m", None), ("helm-mice-120m", "sdpa"), ("helm-mice-120m", "triton")]
    assert all(r["ms"] > 0 and r["kernels"] > 100 for r in rows)
    kernel = rows[2]
    assert kernel["syncs"] == 0 and kernel["regions"]["attention"] > 0
    assert "helm-mice-120m | triton" in capsys.readouterr().out
