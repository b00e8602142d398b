"""The precision policy: which dtype each computation of the zoo runs in, and the helpers that apply it.

Two working dtypes, decided here and nowhere else (ARCHITECTURE.md, "Precision policy"):

* the **compute dtype** (:func:`compute_dtype`): the autocast dtype when autocast is on for the tensor's device,
  else the dtype of the layer's weights (fp64 stays fp64: autocast leaves it alone). Every GEMM runs in it: the
  projections (``q/k/v/o``, ``gate/up/down``, ``kv_a/kv_b/k_rope``, the MiCE gate), attention's ``q·k`` (SDPA, the
  eager spec's and HMLA's absorbed decode's score matmuls) and the LM head (:mod:`helm.ops.lm_loss`).
* the **statistics dtype** (:func:`stat_dtype`): fp32 for fp16/bf16/fp32 tensors, fp64 only for fp64 ones (tests
  run fp64 end to end against fp64 references). Everything else runs in it: time coordinates (``lift``),
  Minkowski norms and inner products used for normalisation (centroids, the Lorentz residual, attention's
  ``N = k + E - <D, D>_L``, MiCE's mixture), RMS statistics, softmax statistics and logits, ``logsumexp``,
  curvatures, temperatures, residual weights, routing scores, positional angles and biases.

Nothing is widened beyond the statistics dtype: no fp64 on fp32/bf16/fp16 inputs in any forward or backward. The
fp32 products below (the named exceptions) assume fp32 matmuls are fp32: leave TF32 off (PyTorch's default; not
``torch.backends.cuda.matmul.allow_tf32 = True`` nor the Trainer's ``tf32=True``), which would round them to 10 bits.
Accuracy far from the origin comes from the formulations instead: difference forms ``<x - y, x - y>_L`` for
nearby points (:func:`helm.manifold.sqdist`, the residual), centred sums (attention's values, MiCE's
:func:`helm.nn.mice.mixture_norm2`), the pairwise norm of :func:`helm.manifold.centroid`. The plain
:func:`helm.manifold.inner` and a :func:`helm.manifold.normalize` without ``norm2`` carry fp32's rounding of
their two cancelling terms; no layer evaluates them where that matters.

**Activations.** A point between layers (hidden states, the residual stream, the KV cache's values) is stored in
the statistics dtype, its time coordinate derived from its space part in fp32 (``lift``), so it lies on the
hyperboloid to fp32 rounding by construction; the space parts a half-precision GEMM produced are exact in fp32,
so storing them beside an fp32 time coordinate loses nothing. Under autocast this is ``LlamaForCausalLM``'s
layout (fp32 master weights: fp32 hidden states, logits in the compute dtype from the linear LM head). A model
*cast* to bf16 differs from Llama (fp32 hidden states where Llama's are bf16): a bf16 time coordinate moves
``<x, x>_L`` by ``x_t² · 2^-8``, which the Lorentz residual and the tests' manifold bound would see.

**A time coordinate inside a half-precision GEMM** (attention's ``q·k``) enters as a pair ``hi + lo``
(:func:`split_hi_lo`): ``q_t k_t`` cancels against ``q_s·k_s`` far from the origin, and the pair carries 16 bits
into the fp32 accumulation where one bf16 number carries 8.

**Named exceptions** (each with its reason; nothing else leaves these rules):

* MiCE's mixture sums ``Σ_j w_j x_j`` and ``Σ_j w_j e_j`` (:func:`helm.nn.mice.mixture_centroid`), products over
  the ``N`` experts in the statistics dtype for the reason of attention's value side, just below.

* attention's value side, ``ν·[w | e]`` (and HMLA's ``W_v (c - c_0)``, ``Σ a c``, ``Σ a [u | e]``), runs in the
  statistics dtype on the fp32 softmax weights: the normaliser ``N = k + E - <D, D>_L`` cancels ``E`` against
  ``<D, D>_L`` down to the scale of ``k`` (a one-hot row gives exactly ``k``), so ``D`` and ``E`` need fp32
  *outputs*; a half-precision GEMM returns half-precision outputs on CPU (and SDPA does everywhere), and rounding
  them moves ``N`` by ``2^-8 |D|²``, all of ``k`` once the values' norms reach ~10. In half precision the
  attention weights are therefore materialised (``sdpa`` included, as CPU's SDPA fallback did for these head
  widths) and only ``q·k`` runs in half precision. The Triton kernel has fp32 accumulators and outputs.
* the fused LM loss in ``distance`` mode keeps the time coordinates out of its half-precision GEMMs: ``x_0 p_0``
  and its gradients are fp32 rank-1 and matrix-vector products (:mod:`helm.ops.lm_loss`).
* the Triton kernel (``impl="triton"``) takes the space parts of ``q, k`` in the compute dtype and their time
  coordinates as separate fp32 inputs (so ``q_t k_t`` never passes through half precision), the values in their own
  dtype (fp32 points: fp32 value-side products, as above). Its per-row normaliser accumulates ``<D, D>_L``, and
  each key's ``e_j``, in fp64 inside the kernels (``O(T·d_v)`` per head and key block, off the tensor cores; the
  host's preparation has none): a one-hot row needs ``E - <D, D>_L = 0`` to ``u·k`` from two terms of size ``|v|²``
  summed over a key block's tile and a query block's, whose reduction orders differ on a GPU, which fp32 misses by
  ``u·|v|²`` (7e-4 output error at ``|v| = 100``); ``helm.ops`` gets it in fp32 because there both norms come from
  one function on bitwise-equal inputs of one layout.
* :func:`helm.manifold.manifold_error`: a diagnostic in fp64, never called by a forward.
* positional tables (rotary per-digit angle tables, frequencies, sinusoidal tables): built once per
  ``(device, dtype)`` in fp64 on the host and cached, read by the forward in the statistics dtype; the first
  forward on a device builds them (a one-off, not per-step work).
* ``resize_token_embeddings`` (:func:`helm.nn.embedding.grown_table`): the mean row of the table in fp64, a
  one-off edit of the weights outside any forward.
"""

from __future__ import annotations

import contextlib

from typing import Optional

import torch

__all__ = ["HALF", "autocast_dtype", "compute_dtype", "no_autocast", "split_hi_lo", "stat_dtype", "to_stat"]

HALF = (torch.float16, torch.bfloat16)

# device types with an autocast state: torch.is_autocast_enabled raises for the others (meta, lazy, ...)
_AUTOCAST_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "ipu"})


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype when autocast is on for ``device_type``, else None.

    Reads only ``torch.is_autocast_enabled`` / ``torch.get_autocast_dtype`` (dynamo constant-folds both), so
    compiled code specialises on the autocast state instead of breaking the graph."""
    known = device_type in _AUTOCAST_DEVICES or device_type == torch._C._get_privateuse1_backend_name()
    if known and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def no_autocast(device_type: str):
    """A context that switches autocast off for ``device_type`` where it is on (the operands inside are cast
    explicitly), else a no-op context: entering ``torch.autocast`` for a device type without an autocast state
    (meta, for shape inference) raises."""
    return torch.autocast(device_type, enabled=False) if autocast_dtype(device_type) else contextlib.nullcontext()


def compute_dtype(x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.dtype:
    """The GEMM dtype for ``x`` (times ``weight``, when given): fp64 if either is fp64; else the autocast dtype
    when autocast is on for ``x``'s device; else ``weight``'s dtype (a bf16 model computes in bf16 whatever its
    fp32 points), or ``x``'s without a weight."""
    if x.dtype == torch.float64 or weight is not None and weight.dtype == torch.float64:
        return torch.float64
    return autocast_dtype(x.device.type) or (x.dtype if weight is None else weight.dtype)


def stat_dtype(x: torch.Tensor | torch.dtype) -> torch.dtype:
    """fp64 for fp64, fp32 for everything else (fp32, bf16, fp16): the dtype of norms, time coordinates,
    softmax statistics, curvatures and temperatures."""
    dtype = x if isinstance(x, torch.dtype) else x.dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_stat(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`stat_dtype` (half precision promoted to fp32, written contiguous whatever ``x``'s layout, so
    the ops after the cast read whole rows; fp32 and fp64 returned as they are)."""
    return x.to(torch.float32, memory_format=torch.contiguous_format) if x.dtype in HALF else x


def split_hi_lo(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (statistics dtype) as ``hi + lo`` in ``dtype``: ``hi = round(x)``, ``lo = round(x - hi)``; for bf16
    ``hi + lo`` carries 16 significant bits (fp16: 22). Products ``hi·hi' + hi·lo' + lo·hi'`` are exact in an
    fp32 accumulator and leave ``x·x'`` with a relative error of ``2^-16`` (bf16) instead of ``2^-8``.
    Differentiable: ``lo``'s two paths (through ``x`` and through ``hi``) cancel, so ``x`` receives the gradient
    of ``hi``, which is what ``x·x' ≈ hi·(hi' + lo')`` asks for."""
    hi = x.to(dtype)
    return hi, (x - hi.to(x.dtype)).to(dtype)
