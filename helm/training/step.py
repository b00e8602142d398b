"""One optimiser step, as ``train.py`` takes it and ``benchmarks/train_step.py`` times it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..distributed import clip_grad_norm
from ..data import packed_inputs
from ..models.routing import attach_balancing


@dataclass
class StepMetrics:
    """What one step measured. The tensors are 0-dim, detached and stay on the device (reading them syncs)."""

    loss: torch.Tensor
    """Language-model loss, the mean over the micro-batches, the balance loss not included."""
    aux_loss: torch.Tensor
    """Sequence-wise balance loss of routed models (HELM-MiCE, DeepSeek-V3), the mean over the micro-batches; 0
    for dense models."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate of the first parameter group that this step used (before the scheduler moved it)."""


def train_step(accelerator, model, optimizer, scheduler, micro_batches: Sequence[dict[str, torch.Tensor]], *,
               grad_clip: Optional[float] = 1.0, forward: Optional[Callable] = None) -> StepMetrics:
    """Forward and backward over the micro-batches of one step, then clip, step the optimiser and the scheduler,
    zero the gradients, and move the routing biases of routed models.

    Inputs:

    * ``accelerator``: the ``accelerate.Accelerator`` the model was prepared with; its
      ``gradient_accumulation_steps`` must equal ``len(micro_batches)`` (gradients are synchronised between
      processes on the last micro-batch only, and each loss is divided by that number before the backward).
    * ``model``, ``optimizer``, ``scheduler``: as ``accelerator.prepare`` returned them (``scheduler`` may be
      None: a constant learning rate).
    * ``micro_batches``: packed batches (``helm.data.pack_documents`` rows: ``input_ids``, ``labels``,
      ``position_ids``, ``segment_ids``, each ``[B, L]``), on the CPU or already on ``accelerator.device``; they
      are copied there non-blocking (overlapping the copy from pinned memory), all before the first forward.
      ``segment_ids`` reach models whose forward takes them (HELM); ``transformers``' models see packed rows
      from the restarting ``position_ids`` (:func:`helm.data.packed_inputs`).
    * ``grad_clip``: maximum global gradient norm; None measures the norm without clipping.
    * ``forward``: what runs the forward, e.g. ``torch.compile(model)``; default ``model``.

    Routed layers (:func:`helm.models.routing.attach_balancing`: HELM-MiCE's MiCE layers, or hooks on DeepSeek-V3's
    routers) move their biases by DeepSeek-V3's aux-loss-free rule from the expert load of the whole step: summed
    over the micro-batches and over the processes, so that every process moves them identically.

    Returns the step's :class:`StepMetrics`.
    """
    device, count = accelerator.device, len(micro_batches)
    micro_batches = [{key: value.to(device, non_blocking=True) for key, value in batch.items()}
                     for batch in micro_batches]
    unwrapped = accelerator.unwrap_model(model)
    routed = attach_balancing(unwrapped)
    forward = model if forward is None else forward
    loss = aux_loss = torch.zeros((), device=device)
    load = 0  # tokens per routed expert, summed over the micro-batches
    for batch in micro_batches:
        with accelerator.accumulate(model):
            output = forward(**packed_inputs(unwrapped, batch), labels=batch["labels"], use_cache=False)
            accelerator.backward(output.loss)
            aux = output.aux_loss.detach() if getattr(output, "aux_loss", None) is not None else 0
            loss = loss + (output.loss.detach() - aux) / count
            aux_loss = aux_loss + aux / count
            if routed:
                load = load + torch.stack([layer.last_expert_load for layer in routed])
            if accelerator.sync_gradients:
                grad_norm = clip_grad_norm(accelerator, model.parameters(),
                                           float("inf") if grad_clip is None else grad_clip)
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
    if routed:
        for layer, layer_load in zip(routed, accelerator.reduce(load, "sum")):
            layer.last_expert_load.copy_(layer_load)
            layer.update_bias()
    return StepMetrics(loss=loss, aux_loss=aux_loss, grad_norm=grad_norm, lr=lr)
