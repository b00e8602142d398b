"""Expert-load balancing shared by HELM-MiCE and its Euclidean baseline, transformers' DeepSeek-V3.

The paper (App. C.2) trains HELM-MiCE and DeepSeek-V3 with the same balancing: DeepSeek-V3's aux-loss-free
routing-bias update plus its sequence-wise balance loss. ``transformers``' ``DeepseekV3ForCausalLM`` keeps the
routing bias (``e_score_correction_bias``) but never updates it and has no balance loss, so
:func:`attach_balancing` adds both to it with forward hooks, leaving the class and its checkpoints untouched.
Its coefficients are read from the config (``aux_loss_alpha``, ``bias_update_speed``; the baseline presets
set them to HELM-MiCE's values, and ``routed_scaling_factor`` to 1 as in HELM-MiCE).

The training loop sees one interface for both families: a list of routed layers, each with
``last_expert_load [N_r]`` (tokens routed to each expert by the last forward) and ``update_bias()``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import TrainerCallback

from ..nn.mice import sequence_balance_loss, update_routing_bias_


class RouterBalancing:
    """The balancing of one ``DeepseekV3TopkRouter``: hooked on its forward, it records the expert load and, in
    training, the balance loss of the scores it computed (sigmoid of its logits, as the router selects with)."""

    def __init__(self, router: nn.Module, *, alpha: float, speed: float):
        self.router, self.alpha, self.speed = router, float(alpha), float(speed)
        self.last_expert_load = torch.zeros(router.num_experts, device=router.weight.device)
        self.aux_loss: Optional[torch.Tensor] = None
        router.register_forward_hook(self._record)

    def _record(self, router, args, output) -> None:
        router_logits, _, topk_indices = output
        batch_shape = args[0].shape[:-1]
        selected = torch.zeros_like(router_logits, dtype=torch.bool).scatter_(-1, topk_indices, True)
        self.last_expert_load = selected.float().sum(0).detach()
        self.aux_loss = None
        if router.training and self.alpha > 0 and len(batch_shape) == 2:
            shape = (*batch_shape, router.num_experts)
            self.aux_loss = sequence_balance_loss(router_logits.sigmoid().view(shape), selected.view(shape),
                                                  top_k=router.top_k, alpha=self.alpha)

    def update_bias(self) -> None:
        update_routing_bias_(self.router.e_score_correction_bias, self.last_expert_load, self.speed)


def _add_balance_loss(layers: list):
    def hook(model, args, kwargs, output):
        losses = [layer.aux_loss for layer in layers if layer.aux_loss is not None]
        if not model.training or not losses:
            return output
        output["aux_loss"] = torch.stack(losses).sum()
        if output.get("loss") is not None:
            output["loss"] = output["loss"] + output["aux_loss"]
        return output
    return hook


def attach_balancing(model: nn.Module) -> list:
    """The routed layers of ``model`` for the training loop (empty for dense models).

    HELM-MiCE balances itself (its MiCE layers are returned). A ``transformers`` DeepSeek-V3 gets hooks, once:
    each router records its load and balance loss, and the model's output gains ``aux_loss``, added to ``loss``
    in training, like HELM-MiCE's. The routing bias then moves under ``update_bias()``.
    """
    if hasattr(model, "mice_layers"):
        return model.mice_layers()
    if getattr(model, "_helm_balancing", None) is not None:
        return model._helm_balancing
    routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    if not routers:
        return []
    alpha = getattr(model.config, "aux_loss_alpha", 0.0) or 0.0
    speed = getattr(model.config, "bias_update_speed", 0.0) or 0.0
    layers = [RouterBalancing(router, alpha=alpha, speed=speed) for router in routers]
    model.register_forward_hook(_add_balance_loss(layers), with_kwargs=True)
    model._helm_balancing = layers
    return layers


class RoutingBiasCallback(TrainerCallback):
    """``transformers.Trainer`` callback: the aux-loss-free routing-bias update after every optimiser step, from
    the expert load of the step's micro-batches (HELM-MiCE, or a DeepSeek-V3 after :func:`attach_balancing`).

    Under several processes each updates from its own load (``train.py`` sums the load over processes first).
    """

    def __init__(self):
        self.load: Optional[list] = None

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        self._add(attach_balancing(getattr(model, "module", model)))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        layers = attach_balancing(getattr(model, "module", model))  # unwrapped from DDP
        self._add(layers)
        for layer, load in zip(layers, self.load or []):
            layer.last_expert_load.copy_(load)
            layer.update_bias()
        self.load = None

    def _add(self, layers: list) -> None:
        loads = [layer.last_expert_load.clone() for layer in layers]
        self.load = loads if self.load is None else [a + b for a, b in zip(self.load, loads)]


__all__ = ["RouterBalancing", "RoutingBiasCallback", "attach_balancing"]
