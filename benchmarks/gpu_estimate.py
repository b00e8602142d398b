"""Estimated training-step time on an H100 / H200 from a dispatch trace of one step on the CPU.

No GPU needed. One training step (forward, backward, gradient clipping, optimiser step; bf16 autocast over fp32
weights, as ``train.py --train.mixed_precision=bf16``) of a preset runs under ``FakeTensorMode`` at any shape
(default 8 x 2048, the shape of the H200 figures), so nothing is computed and the full shape costs seconds. A
``TorchDispatchMode`` records every aten op (and every Triton launch, whose kernels are not run): its FLOPs by
dtype (``torch.utils.flop_counter``'s formulas; SDPA and the Lorentz attention kernel by their own), the bytes it
reads and writes, and the region of the model it belongs to (backward ops inherit the region of the forward op
whose autograd node runs them):

* ``head+loss``: everything after the decoder's last norm (LM head, cross-entropy, their backward);
* ``attention``: the attention core of each layer (``bmm``-type products, SDPA, the kernel and the elementwise work
  around them: positional encoding, centring, normalisation); the projections are GEMMs;
* ``gemms``: the other matrix products (projections, MLP, experts, routers);
* ``bookkeeping``: every other op of forward and backward (elementwise, copies, reductions, norms, routing);
* ``optimiser``: gradient clipping and the optimiser step (torch's optimisers as on CUDA: ``foreach``).

**Cost model** (:class:`Gpu`). Each op that launches a kernel takes ``max(floor, FLOPs / (peak · efficiency),
bytes / (bandwidth · efficiency))`` on the GPU; ops that launch nothing (views, allocations) take no GPU time.
The host issues ops one after another at ``host_us`` each (``view_us`` for views) and the GPU runs each one when
both it and its predecessor are ready, so a step of many small kernels is bound by the host (eager PyTorch), a step
of large ones by the GPU. Matrix products whose row strides are not 16-byte aligned (hidden width 390, ``1 + 64``
heads) run cuBLAS' unaligned kernels at ``unaligned_efficiency``. Host synchronisations (``.item()``, ``nonzero``)
drain the queue. The Lorentz kernel's value side is costed at the fp32 CUDA-core rate where it multiplies fp32
operands with ``input_precision="ieee"`` (up to issue 35 item 2), at six bf16 tensor-core products since.

**Fused RMSNorm.** ``F.rms_norm`` (HELM's RMSNorm_L) is one kernel each way on CUDA (``aten::_fused_rms_norm``), which
a CPU trace decomposes: :func:`patch_fused_rms_norm` records it as CUDA runs it. Llama's and DeepSeek-V3's norms are
written out as separate ops and traced as they run.

**Calibration.** Four constants (:data:`CALIBRATED`: the unaligned GEMM efficiency, the host time per op, the
kernel's fp32 dot efficiency, the bandwidth of strided ops) were fitted on a grid (``--calibrate``) to the six steps
measured on one H200 at d2fa12e (:data:`MEASURED_D2FA12E`), traced on a worktree of that commit; every estimate
lands within 5% of its measurement, and the estimated device-busy time (helm-d-115m with the kernel 243 ms,
llama-115m 75 ms) is within 7% of that run's profile (228 and 77 ms of CUDA time per step), which the fit did not
use. The fit is loose: 32 grid points fit within a percentage point of the best (``--calibrate --save-fits``
writes them; ``benchmarks/gpu_estimate_fits.json`` holds d2fa12e's), and ``--fits`` prints the range of each ratio
across them (docs/benchmarks.md, "GPU step estimate", has the tables and those ranges). The other constants are
data-sheet rates and typical efficiencies.

Usage::

    python benchmarks/gpu_estimate.py [--pairs helm-d mice] [--attn-impl sdpa triton] [--batch-size 8]
        [--seq-len 2048] [--gpu h200] [--top N] [--fits benchmarks/gpu_estimate_fits.json]
    git worktree add --detach /tmp/old d2fa12e && PYTHONPATH=/tmp/old python benchmarks/gpu_estimate.py ...

(``PYTHONPATH`` puts an older checkout's ``helm`` first: the script reads only public names present in both.)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.flop_counter import flop_registry  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import helm  # noqa: E402
from helm.models.routing import attach_balancing  # noqa: E402
from helm.optim import build_optimizer  # noqa: E402

try:
    from helm.data import packed_inputs
except ImportError:  # older checkouts
    from helm.evaluation import packed_inputs
try:
    from benchmarks.cli import packed_batch
except ImportError:  # run as a script: this folder is on sys.path
    from cli import packed_batch


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Peak rates (dense, from the vendor's data sheets) and the efficiencies of the cost model."""

    name: str
    bf16_tflops: float = 989.0  # tensor cores, dense
    fp32_tflops: float = 67.0  # CUDA cores (torch's fp32 matmul without TF32, the kernel's ieee dots)
    bandwidth_tbs: float = 4.8
    gemm_efficiency: float = 0.7  # aligned cuBLAS GEMMs of these sizes
    unaligned_efficiency: float = 0.46  # calibrated (module docstring)
    attention_efficiency: float = 0.4  # flash / memory-efficient SDPA and the Triton kernel's tensor-core dots
    kernel_fp32_efficiency: float = 0.15  # the kernel's fp32 ieee dots (CUDA-core FMAs); calibrated
    bandwidth_efficiency: float = 0.75
    strided_efficiency: float = 0.06  # bandwidth of ops with a non-contiguous operand (time / space slices); calibrated
    floor_us: float = 2.5  # the shortest kernel
    host_us: float = 23.0  # host time per launched op in eager PyTorch (Python included); calibrated
    view_us: float = 2.0  # host time per op that launches nothing
    sync_us: float = 20.0  # a device-to-host read, on top of draining the queue

    def rate(self, kind: str) -> float:
        """FLOP/s of a kind of work (:attr:`Op.work`)."""
        return 1e12 * {"gemm": self.bf16_tflops * self.gemm_efficiency,
                       "gemm_unaligned": self.bf16_tflops * self.unaligned_efficiency,
                       "fp32": self.fp32_tflops * self.gemm_efficiency,
                       "kernel_fp32": self.fp32_tflops * self.kernel_fp32_efficiency,
                       "attention": self.bf16_tflops * self.attention_efficiency,
                       "alu": self.fp32_tflops * 0.5}[kind]

    def device_seconds(self, op: "Op") -> float:
        if not op.launches:
            return 0.0
        compute = sum(flops / self.rate(kind) for kind, flops in op.work.items())
        efficiency = self.strided_efficiency if op.strided else self.bandwidth_efficiency
        return max(self.floor_us * 1e-6, compute, op.bytes / (self.bandwidth_tbs * 1e12 * efficiency))

    def host_seconds(self, op: "Op") -> float:
        return 1e-6 * (self.host_us if op.launches else self.view_us)


GPUS = {"h200": Gpu("H200"), "h100": Gpu("H100", bandwidth_tbs=3.35)}
PAIRS = {"helm-d": ("helm-d-115m", "llama-115m"), "mice": ("helm-mice-120m", "deepseek-v3-120m")}
REGIONS = ("head+loss", "attention", "gemms", "bookkeeping", "optimiser")
MEASURED_D2FA12E = {  # ms per step, one H200, bf16, 8 x 2048 (issue 35)
    ("helm-d-115m", "sdpa"): 211, ("helm-d-115m", "triton"): 238, ("helm-mice-120m", "sdpa"): 235,
    ("helm-mice-120m", "triton"): 253, ("llama-115m", None): 80, ("deepseek-v3-120m", None): 109}

VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze",
         "as_strided", "detach", "alias", "split", "split_with_sizes", "unbind", "chunk", "narrow", "diagonal",
         "unflatten", "lift_fresh", "_reshape_alias", "reshape", "view_as", "expand_as", "empty", "empty_like",
         "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_", "movedim", "squeeze_",
         "unsqueeze_", "t_", "transpose_", "is_same_size", "sym_size", "sym_stride", "sym_numel",
         "sym_storage_offset", "dim", "size", "stride"}
SYNCS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "tolist"}
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_grouped_mm", "addbmm"}
SDPA_PREFIX = "_scaled_dot_product_"


def tensors(tree) -> list[torch.Tensor]:
    out = []
    for item in tree if isinstance(tree, (list, tuple)) else [tree]:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, (list, tuple)):
            out.extend(tensors(item))
    return out


def nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(tree))


def aligned(t: torch.Tensor) -> bool:
    """Whether every stride but the unit one is a multiple of 16 bytes (what cuBLAS' fast kernels need)."""
    return all(s * t.element_size() % 16 == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


@dataclasses.dataclass
class Op:
    """One recorded op: FLOPs by kind of work (:meth:`Gpu.rate`), bytes read and written, whether it launches a
    kernel, whether the host waits for it."""

    name: str
    region: str
    work: dict
    bytes: int = 0
    launches: bool = True
    sync: bool = False
    strided: bool = False


class Region:
    """Where the forward is: set by module hooks; read by the modes."""

    current = "bookkeeping"


class TagOutputs(TorchFunctionMode):
    """Tags the autograd node of every forward output with the region it was made in, so that its backward ops
    are costed to the same region."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors(out):
            if t.grad_fn is not None and "region" not in t.grad_fn.metadata:
                t.grad_fn.metadata["region"] = Region.current
        return out


class Trace(TorchDispatchMode):
    """Records every aten op of a step as an :class:`Op`; answers host reads without data (fake tensors hold
    none): a flag reads False, a number 1, ``equal`` False, and ``nonzero`` of a routing mask gives the balanced
    count (``nonzero_fraction`` of its elements)."""

    def __init__(self, nonzero_fraction: float, value_side: str):
        super().__init__()
        self.nonzero_fraction, self.value_side = nonzero_fraction, value_side
        self.ops: list[Op] = []
        self.muted = False  # inside a function CUDA runs compiled: recorded as its fused kernels instead

    def region(self, name: str) -> str:
        node = torch._C._current_autograd_node()
        region = node.metadata.get("region", Region.current) if node is not None else Region.current
        if region == "attention-block":
            return "gemms" if name in ("mm", "addmm", "linear", "matmul") else "attention"
        return "gemms" if region == "bookkeeping" and name in GEMMS else region

    def add(self, name: str, work: dict, moved: int = 0, *, launches: bool = True, sync: bool = False,
            region: str | None = None, strided: bool = False) -> None:
        self.ops.append(Op(name, region or self.region(name), work, moved, launches, sync, strided))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.muted:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name in SYNCS:
            if name == "nonzero":
                source = args[0]
                out = torch.empty((round(source.numel() * self.nonzero_fraction), source.dim()), dtype=torch.long)
            elif name == "equal":  # the general path (e.g. MiCE's one-time check that a step changed the gate)
                out = False
            else:
                out = False if args[0].dtype == torch.bool else 1
            if Region.current == "optimiser":  # torch's optimisers keep their step counts on the host
                self.add(name, {}, launches=False)
            else:
                self.add(name, {}, nbytes(args), sync=True)
            return out
        out = func(*args, **kwargs)
        if name == "device" or "prim" in str(func):  # fake tensors' .device queries: attribute reads in eager
            pass
        elif name in VIEWS:
            self.add(name, {}, launches=False)
        elif "lorentz_attention" in str(func):
            self.lorentz_kernel(str(func), args)
        elif name.startswith(SDPA_PREFIX):
            self.add(name, {"attention": sdpa_flops(name, args, kwargs)}, nbytes(args) + nbytes(out),
                     region="attention")
        else:
            work = {}
            if func.overloadpacket in flop_registry:
                mats = [m for m in tensors(args) if m.dim() >= 2][:2]
                kind = "fp32" if mats[0].dtype in (torch.float32, torch.float64) else \
                    "gemm" if all(aligned(m) for m in mats) else "gemm_unaligned"
                work[kind] = flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
            strided = not work and any(not t.is_contiguous() for t in tensors(args) + tensors(out) if t.numel() > 1)
            self.add(name, work, moved_bytes(name, args, out), strided=strided)
        return out

    def lorentz_kernel(self, name: str, args) -> None:
        """The Lorentz attention kernel's custom ops: causal halves of the products over every (query, key) pair;
        forward ``q·k`` and ``P·[w | e]``; backward (two kernels) ``q·k`` twice, ``dS·k``, ``dSᵀ·q`` and the value
        side three times (``dO·wᵀ`` twice, ``Pᵀ·dO``)."""
        q, k, w = args[0], args[2], args[4]
        B, H, Tq, D = q.shape
        causal = bool(args[12]) if "fwd" in name else bool(args[-1])
        qk, v = (1, 1) if "fwd" in name else (4, 3)
        self.kernel(name, B * H, Tq, k.shape[2], causal, D, w.shape[-1] + 1, qk, v, nbytes(args), q.dtype)

    def kernel(self, name: str, heads: int, Tq: int, Tk: int, causal: bool, D: int, DV: int, qk: int, v: int,
               moved: int, qk_dtype: torch.dtype) -> None:
        """``qk`` products over the query-key dimension ``D`` (tensor cores for half-precision ``q, k``, CUDA-core
        ieee dots for fp32 ones), ``v`` over the value width ``DV`` (fp32 on CUDA cores, or six bf16 products of the
        three-part split), four fp32 ALU operations per pair and product (exp, mask, scale)."""
        pairs = heads * Tq * Tk * (0.5 + 64 / (2 * Tk) if causal else 1.0)
        side = "kernel_fp32" if qk_dtype == torch.float32 else "attention"
        work = {side: qk * 2 * pairs * D, "alu": (qk + v) * 4 * pairs}
        if self.value_side == "fp32":
            work["kernel_fp32"] = work.get("kernel_fp32", 0) + v * 2 * pairs * DV
        else:
            work["attention"] += 6 * v * 2 * pairs * DV
        self.add(name, work, moved, region="attention")


GATHERS = {"gather", "index_select", "embedding", "index", "take_along_dim"}
SCATTERS_IN_PLACE = {"scatter_add_", "scatter_", "scatter_reduce_", "index_add_", "index_put_", "index_copy_",
                     "index_fill_", "masked_scatter_"}


def moved_bytes(name: str, args, out) -> int:
    """Bytes an op reads and writes: its tensor arguments and results, except that a gather reads only the
    elements it returns and an in-place scatter touches only the elements it writes (not the whole tensor)."""
    if name in GATHERS:
        return 2 * nbytes(out) + nbytes([t for t in tensors(args) if not t.is_floating_point()])
    if name in SCATTERS_IN_PLACE:
        return 2 * nbytes(list(args[1:]))
    return nbytes(args) + nbytes(out)


def sdpa_flops(name: str, args, kwargs) -> float:
    """Flash-style FLOPs of SDPA forward (``4·B·H·Tq·Tk·d``) or backward (2.5x), halved when causal without a
    mask; a mask tensor visits every block."""
    q, k = args[0], args[1]
    if "backward" in name:
        q, k = args[1], args[2]
    B, H, Tq, D = q.shape
    Tk = k.shape[-2]
    has_mask = any(isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[-1] == Tk and a.shape[-2] == Tq
                   for a in list(args[3:]) + list(kwargs.values()))
    causal = bool(kwargs.get("is_causal", False)) or any(a is True for a in args[3:9])  # backward: args[7]
    flops = 4 * B * H * Tq * Tk * D * (0.5 if causal and not has_mask else 1.0)
    return flops * (2.5 if "backward" in name else 1.0)


def patch_compiled_epilogue(trace: Trace):
    """The LM loss's per-chunk epilogue, which CUDA runs compiled (``helm.ops.lm_loss._epilogue``, since issue 35
    item 4): traced muted and recorded as inductor's kernels would run it, three passes over the ``[C, V]`` GEMM
    output (row statistics; ``dl`` written in the compute dtype; column sums)."""
    try:
        from helm.ops import lm_loss
    except ImportError:
        return lambda: None
    if not hasattr(lm_loss, "_compiled_epilogue"):
        return lambda: None
    eager = lm_loss._epilogue

    def fused(z, *args, **kwargs):
        trace.muted = True
        try:
            out = eager(z, *args, **{**kwargs, "fused": True})
        finally:
            trace.muted = False
        written = nbytes([t for t in out[1:] if t is not None])
        for part, moved in (("stats", nbytes(z)), ("dl", nbytes(z) + written), ("columns", nbytes(z))):
            trace.add(f"fused_epilogue_{part}", {}, moved, region="head+loss")
        return out

    lm_loss._epilogue = fused
    return lambda: setattr(lm_loss, "_epilogue", eager)


def patch_fused_rms_norm(trace: Trace):
    """``torch.nn.functional.rms_norm`` (HELM's RMSNorm_L; Llama's and DeepSeek-V3's norms are written out and stay
    unfused), which CUDA runs as one fused kernel each way (``aten::_fused_rms_norm`` and its backward, since
    torch 2.9) where the CPU decomposes it into a handful of elementwise ops and their gradients: traced muted and
    recorded as those two kernels, each reading and writing its tensors once, after a strided copy of any
    non-contiguous operand (the kernels take contiguous ones)."""
    original = torch.nn.functional.rms_norm

    def record(name: str, region: str, inputs: list, outputs: list) -> None:
        for t in inputs:
            if t is not None and not t.is_contiguous():
                trace.add("contiguous", {}, 2 * nbytes(t), region=region, strided=True)
        trace.add(name, {}, nbytes([t for t in inputs + outputs if t is not None]), region=region)

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, shape, eps):
            ctx.save_for_backward(x, weight)
            ctx.shape, ctx.eps, ctx.region = shape, eps, trace.region("_fused_rms_norm")
            trace.muted = True
            try:
                out = original(x, shape, weight, eps)
            finally:
                trace.muted = False
            record("_fused_rms_norm", ctx.region, [x, weight], [out])
            return out

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            trace.muted = True
            try:
                with torch.enable_grad():
                    leaves = [t.detach().requires_grad_() for t in (x, weight) if t is not None]
                    grads = torch.autograd.grad(original(leaves[0], ctx.shape, *leaves[1:], ctx.eps), leaves, grad)
            finally:
                trace.muted = False
            record("_fused_rms_norm_backward", ctx.region, [grad, x, weight], list(grads))
            return grads[0], grads[1] if weight is not None else None, None, None

    def fused(input, normalized_shape, weight=None, eps=None):
        return Fused.apply(input, weight, tuple(normalized_shape), eps)

    torch.nn.functional.rms_norm = fused
    return lambda: setattr(torch.nn.functional, "rms_norm", original)


def patch_triton_launches(trace: Trace):
    """Older checkouts call the Triton kernels from Python (no custom op): their launches are recorded instead of
    run, costed like the custom ops."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return lambda: None
    original = KernelInterface.__getitem__

    def launch(self, grid):
        def record(*args, **kwargs):
            fn = getattr(self, "fn", self)
            fn = getattr(fn, "fn", fn)
            name = getattr(fn, "__name__", "triton")
            q, k, w = args[0], args[1], args[2]
            if "preprocess" in name or q.dim() != 4:
                trace.add(name, {}, nbytes(list(args)), region="attention")
                return
            B, H, Tq, Dq = q.shape
            qk, v = {"fwd": (1, 1), "dkdv": (2, 2), "dq": (2, 1)}[
                "dkdv" if "dkdv" in name else "dq" if "dq" in name else "fwd"]
            # q and k hold the time coordinate in column 0; w is [w_t | w_s], e beside it
            trace.kernel(name, B * H, Tq, k.shape[2], bool(kwargs.get("CAUSAL", True)), Dq - 1, w.shape[-1] + 1,
                         qk, v, nbytes(list(args)), q.dtype)
        return record

    KernelInterface.__getitem__ = launch
    return lambda: setattr(KernelInterface, "__getitem__", original)


def config_for(preset: str, impl: str | None):
    config = helm.load_config(preset)
    if impl is not None:
        fields = getattr(config, "__dataclass_fields__", {})
        if "attn_impl" in fields:  # older checkouts
            config.attn_impl = impl
        else:
            config._attn_implementation = impl
    return config


def trace_step(preset: str, impl: str | None, batch_size: int, seq_len: int) -> Trace:
    """One bf16 training step of ``preset`` at ``batch_size x seq_len`` under fake tensors, after two unrecorded
    warm-up steps (as the measurements are of steps after warm-up), recorded."""
    config = config_for(preset, impl)
    batch = packed_batch(batch_size, seq_len, config.vocab_size)
    routed = getattr(config, "num_experts_per_tok", None) and getattr(config, "n_routed_experts", None)
    fraction = config.num_experts_per_tok / config.n_routed_experts if routed else 1.0
    # the kernel path resolves on a CPU as under the Triton interpreter (nothing is launched), and the LM loss
    # sizes its chunk from the free device memory, an H200's 120 GiB or so: all undone when the trace ends
    undo = [interpreted()]
    try:
        trace = Trace(fraction, "bf16x6" if _kernel_has_split_value_side() else "fp32")
        undo += [patch_triton_launches(trace), patch_compiled_epilogue(trace), patch_fused_rms_norm(trace)]
        from helm.ops import lm_loss
        chunks = getattr(lm_loss, "_CHUNK_ELEMENTS_ON", {})  # older checkouts: fixed chunks
        chunks["cpu"] = (120 << 30) // 4 // 12
        undo.append(lambda: chunks.pop("cpu", None))
        return _trace(trace, config, batch)
    finally:
        for restore in undo:
            restore()


def interpreted():
    """Set ``TRITON_INTERPRET=1`` and the kernel modules' ``INTERPRET`` flags (read when they were imported) for a
    trace; returns what undoes both."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    flags = {module: module.INTERPRET for name, module in list(sys.modules.items())
             if name.endswith(("lorentz_attention_triton.common", "lorentz_attention.common"))}
    for module in flags:
        module.INTERPRET = True

    def undo():
        for module, flag in flags.items():
            module.INTERPRET = flag
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
    return undo


def _trace(trace: Trace, config, batch) -> Trace:
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = AutoModelForCausalLM.from_config(config).train()
        routed = attach_balancing(model) or []
        optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
        for inner in getattr(optimizer, "optimizers", [optimizer]):
            for group in inner.param_groups:
                if "foreach" in group:
                    group["foreach"] = True  # what torch picks for CUDA parameters
        hooks = region_hooks(model)
        fake = {key: mode.from_tensor(value) for key, value in batch.items()}

        def step():
            Region.current = "bookkeeping"
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = model(**packed_inputs(model, fake), labels=fake["labels"], use_cache=False)
            Region.current = "bookkeeping"  # backward ops whose autograd node carries no region (AccumulateGrad)
            output.loss.backward()
            Region.current = "optimiser"
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            norms = torch._foreach_norm(grads)  # clip_grad_norm_ on CUDA
            total = torch.linalg.vector_norm(torch.stack(norms))
            torch._foreach_mul_(grads, torch.clamp(1.0 / (total + 1e-6), max=1.0))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if routed:  # the routing-bias update of helm.training.train_step (one process)
                load = torch.stack([layer.last_expert_load for layer in routed])
                for layer, layer_load in zip(routed, load):
                    layer.last_expert_load.copy_(layer_load)
                    layer.update_bias()
            Region.current = "bookkeeping"

        with TagOutputs(), trace:
            for _ in range(2):  # warm-up, not recorded: optimiser state and one-time checks of the first steps
                step()
            trace.ops.clear()
            step()
        for hook in hooks:
            hook.remove()
    return trace


def _kernel_has_split_value_side() -> bool:
    try:
        from helm.ops.lorentz_attention_triton import common
    except ImportError:
        return False
    return hasattr(common, "_dot_v")


def region_hooks(model) -> list:
    """Forward hooks that set :attr:`Region.current`: ``attention-block`` inside each attention module, ``head+loss``
    once the decoder has returned."""
    hooks = []

    def enter(region):
        def hook(module, args, kwargs=None):
            Region.current = region
        return hook

    for name, module in model.named_modules():
        if name.endswith(("self_attn", "attention", "attn")) and name.count(".") >= 2:
            hooks.append(module.register_forward_pre_hook(enter("attention-block")))
            hooks.append(module.register_forward_hook(lambda *a: setattr(Region, "current", "bookkeeping")))
    hooks.append(model.base_model.register_forward_hook(lambda *a: setattr(Region, "current", "head+loss")))
    return hooks


def simulate(ops: list[Op], gpu: Gpu) -> float:
    """Seconds from the first issued op to the last kernel's end: the host issues in order, the GPU runs each op
    once it is issued and the previous one is done; a host read waits for the queue."""
    host = device = 0.0
    for op in ops:
        host += gpu.host_seconds(op)
        if op.launches:
            device = max(device, host) + gpu.device_seconds(op)
        if op.sync:
            host = device = device + gpu.sync_us * 1e-6
    return max(host, device)


def summary(ops: list[Op], gpu: Gpu) -> dict:
    """The step's estimate, and each region's alone (its ops run back to back: the regions' times need not add up
    to the step's, as the host overlaps one region's launches with another's kernels)."""
    flops = collections.Counter()
    for op in ops:
        flops.update(op.work)
    regions = {region: 1e3 * simulate([op for op in ops if op.region == region], gpu) for region in REGIONS}
    return {"ms": 1e3 * simulate(ops, gpu), "regions": regions, "kernels": sum(op.launches for op in ops),
            "busy": 1e3 * sum(gpu.device_seconds(op) for op in ops),
            "syncs": sum(op.sync for op in ops), "tflop": {k: v / 1e12 for k, v in flops.items()},
            "gb": sum(op.bytes for op in ops) / 1e9}


CALIBRATED = ("unaligned_efficiency", "host_us", "kernel_fp32_efficiency", "strided_efficiency")


def calibrate(traces: dict, gpu: Gpu, save: str | None = None) -> Gpu:
    """The :data:`CALIBRATED` constants (on a grid) whose estimates come closest to the measured d2fa12e steps of
    the traced models (the largest relative error the smallest): :func:`simulate` over every grid point at once;
    ``save``: a JSON file for the grid points that fit within a percentage point of the best (``--fits``)."""
    known = {key: ops for key, ops in traces.items() if key in MEASURED_D2FA12E}
    if not known:
        raise SystemExit("--calibrate needs models with measured figures (the paper presets, sdpa / triton)")
    grid = np.stack(np.meshgrid(np.arange(0.04, 0.51, 0.02), np.arange(2.0, 30.1, 1.0), np.arange(0.05, 0.61, 0.05),
                                np.arange(0.02, 0.76, 0.01), indexing="ij"), -1).reshape(-1, 4)
    unaligned, host, fp32, strided = grid.T
    error = np.zeros(len(grid))
    for key, ops in known.items():
        t_host = t_device = np.zeros(len(grid))
        for op in ops:
            t_host = t_host + (host * 1e-6 if op.launches else gpu.view_us * 1e-6)
            if op.launches:
                fixed = dataclasses.replace(op, work={k: v for k, v in op.work.items()
                                                      if k not in ("gemm_unaligned", "kernel_fp32")})
                compute = sum(f / gpu.rate(k) for k, f in fixed.work.items()) \
                    + op.work.get("gemm_unaligned", 0) / (gpu.bf16_tflops * 1e12 * unaligned) \
                    + op.work.get("kernel_fp32", 0) / (gpu.fp32_tflops * 1e12 * fp32)
                memory = op.bytes / (gpu.bandwidth_tbs * 1e12 * (strided if op.strided else gpu.bandwidth_efficiency))
                t_device = np.maximum(t_device, t_host) + np.maximum(np.maximum(compute, memory), gpu.floor_us * 1e-6)
            if op.sync:
                t_host = t_device = t_device + gpu.sync_us * 1e-6
        error = np.maximum(error, np.abs(1e3 * np.maximum(t_host, t_device) / MEASURED_D2FA12E[key] - 1))
    u, h, f, b = grid[int(np.argmin(error))]
    best = dataclasses.replace(gpu, unaligned_efficiency=round(float(u), 2), host_us=round(float(h), 1),
                               kernel_fp32_efficiency=round(float(f), 2), strided_efficiency=round(float(b), 2))
    print(f"calibrated on {len(known)} measured steps: "
          + ", ".join(f"{name}={getattr(best, name):g}" for name in CALIBRATED)
          + f" (largest error {float(error.min()):.1%})")
    near = grid[error <= error.min() + 0.01]  # fits as good within a percentage point: the constants' spread
    print(f"{len(near)} grid points fit within {float(error.min()) + 0.01:.1%}: "
          + ", ".join(f"{name} {lo:g}-{hi:g}" for name, lo, hi in zip(CALIBRATED, near.min(0), near.max(0))))
    if save:  # for --fits on another checkout: how far the fit's looseness moves an estimate
        Path(save).write_text(json.dumps([dict(zip(CALIBRATED, map(float, point))) for point in near]) + "\n")
    return best


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=sorted(PAIRS))
    parser.add_argument("--attn-impl", nargs="+", default=["sdpa", "triton"],
                        help="HELM attention implementations to trace (default: sdpa triton)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    parser.add_argument("--measured", action="store_true",
                        help="print the measured d2fa12e H200 figures beside the estimates (meaningful on d2fa12e)")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="also list each model's N costliest op names per region (device ms, count)")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit unaligned_efficiency and host_us to the twins' measured figures (on d2fa12e)")
    parser.add_argument("--save-fits", metavar="JSON", help="with --calibrate: write the near-best constants here")
    parser.add_argument("--fits", metavar="JSON", help="also print each HELM / twin ratio's range across these "
                        "constants (--save-fits of a calibration)")
    args = parser.parse_args(argv)
    gpu = GPUS[args.gpu]
    traces = {}
    for pair in args.pairs:
        helm_preset, twin = PAIRS[pair]
        for preset, impl in [(twin, None)] + [(helm_preset, impl) for impl in args.attn_impl]:
            traces[(preset, impl)] = trace_step(preset, impl, args.batch_size, args.seq_len).ops
    if args.calibrate:
        gpu = calibrate(traces, gpu, args.save_fits)
    print(f"estimated {gpu.name} training step, bf16 autocast, {args.batch_size} x {args.seq_len} tokens, eager ("
          + ", ".join(f"{name}={getattr(gpu, name):g}" for name in CALIBRATED) + ")")
    header = "| model | attention | ms | / twin | GPU busy ms | " + " | ".join(f"{r} ms" for r in REGIONS)
    header += " | kernels | host reads | TC TFLOP | fp32 TFLOP | GB moved |" + " measured ms |" * args.measured
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows, twin_ms = [], None
    for (preset, impl), ops in traces.items():
        row = summary(ops, gpu)
        twin_ms = row["ms"] if impl is None else twin_ms
        row.update(preset=preset, impl=impl, ratio=row["ms"] / twin_ms)
        rows.append(row)
        regions = " | ".join(f"{row['regions'][r]:.1f}" for r in REGIONS)
        tf = row["tflop"]
        tensor_cores = sum(tf.get(kind, 0) for kind in ("gemm", "gemm_unaligned", "attention"))
        line = (f"| {preset} | {impl or '(own)'} | {row['ms']:.0f} | {row['ratio']:.2f} | {row['busy']:.0f} | {regions} | "
                f"{row['kernels']} | {row['syncs']} | {tensor_cores:.1f} | {tf.get('fp32', 0):.2f} | {row['gb']:.0f} |")
        if args.measured:
            measured = MEASURED_D2FA12E.get((preset, impl))
            line += f" {measured} ({row['ms'] / measured - 1:+.0%}) |" if measured else " |"
        print(line)
    fits = [dataclasses.replace(gpu, **fit) for fit in json.loads(Path(args.fits).read_text())] if args.fits else []
    for pair, impl in [(pair, impl) for pair in args.pairs for impl in args.attn_impl] if fits else ():
        helm_ops, twin_ops = traces[(PAIRS[pair][0], impl)], traces[(PAIRS[pair][1], None)]
        ratios = [simulate(helm_ops, fit) / simulate(twin_ops, fit) for fit in fits]
        print(f"{PAIRS[pair][0]} ({impl}) / {PAIRS[pair][1]} across the {len(fits)} near-best fits: "
              f"{min(ratios):.2f}-{max(ratios):.2f}")
    for (preset, impl), ops in traces.items() if args.top else ():
        print(f"\n{preset} ({impl or 'own attention'}): costliest ops per region, device ms (count)")
        for region in REGIONS:
            cost = collections.defaultdict(lambda: [0.0, 0])
            for op in ops:
                if op.region == region and op.launches:
                    cost[op.name][0] += 1e3 * gpu.device_seconds(op)
                    cost[op.name][1] += 1
            top = sorted(cost.items(), key=lambda item: -item[1][0])[:args.top]
            print(f"  {region}: " + ", ".join(f"{name} {ms:.1f} ({n})" for name, (ms, n) in top))
    return rows


if __name__ == "__main__":
    main()
