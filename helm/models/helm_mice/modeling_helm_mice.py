"""HELM-MiCE: HMLA attention + Mixture-of-Curvature Experts (paper §4.2–4.3)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from ...manifold.math import curvature_to_k
from ...nn.mice import MiCE
from ...nn.mlp import LorentzSwiGLU
from ...nn.norm import LorentzRMSNorm
from ..modeling_common import (
    HelmCausalLMMixin,
    HelmDecoderStack,
    HelmPreTrainedModel,
    build_attention,
    build_residual,
)
from .configuration_helm_mice import HelmMiCEConfig


class HelmMiCEDecoderLayer(nn.Module):
    """``x ← x ⊕ HMLA(RMSNorm_L(x))``, then ``x ← x ⊕ MiCE(RMSNorm_L(x))`` (dense SwiGLU_L in the first layers)."""

    def __init__(self, config: HelmMiCEConfig, layer_idx: int):
        super().__init__()
        k = curvature_to_k(config.curvature)
        self.input_layernorm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)
        self.self_attn = build_attention(config, k, layer_idx, config.attention_type)
        self.attn_residual = build_residual(config, k)
        self.post_attention_layernorm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)
        if layer_idx < config.first_k_dense_replace:
            self.mlp = LorentzSwiGLU(config.hidden_size, config.intermediate_size, k=k, hidden_act=config.hidden_act,
                                     bias=config.mlp_bias)
        else:
            self.mlp = MiCE(config.hidden_size, config.moe_intermediate_size, n_routed_experts=config.n_routed_experts,
                            num_experts_per_tok=config.num_experts_per_tok, n_shared_experts=config.n_shared_experts,
                            k=k, routed_curvatures=config.routed_curvatures,
                            trainable_curvatures=config.trainable_curvatures, scoring_func=config.scoring_func,
                            norm_topk_prob=config.norm_topk_prob, aux_loss_alpha=config.aux_loss_alpha,
                            bias_update_speed=config.bias_update_speed, hidden_act=config.hidden_act,
                            bias=config.mlp_bias, initializer_range=config.initializer_range)
        self.mlp_residual = build_residual(config, k)

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        x = self.attn_residual(x, self.self_attn(self.input_layernorm(x), **attn_kwargs))
        return self.mlp_residual(x, self.mlp(self.post_attention_layernorm(x)))


class HelmMiCEPreTrainedModel(HelmPreTrainedModel):
    config_class = HelmMiCEConfig
    config: HelmMiCEConfig

    def mice_layers(self) -> list:
        return [m for m in self.modules() if isinstance(m, MiCE)]

    def update_routing_bias(self) -> None:
        """DeepSeek-V3 aux-loss-free balancing step; the training loop calls it after each optimiser step."""
        for m in self.mice_layers():
            m.update_bias()

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each expert in the last forward, ``[num MiCE layers, n_routed_experts]``."""
        return torch.stack([m.last_expert_load for m in self.mice_layers()])


class HelmMiCEModel(HelmDecoderStack, HelmMiCEPreTrainedModel):
    output_class = MoeModelOutputWithPast

    def __init__(self, config: HelmMiCEConfig):
        super().__init__(config)
        self.build_stack(config, HelmMiCEDecoderLayer)
        self.post_init()


class HelmMiCEForCausalLM(HelmCausalLMMixin, HelmMiCEPreTrainedModel, GenerationMixin):
    """HELM-MiCE with the LM head; in training the summed balance loss is ``aux_loss`` and is added to ``loss``."""

    output_class = MoeCausalLMOutputWithPast

    def __init__(self, config: HelmMiCEConfig):
        super().__init__(config)
        self.build_head(config, HelmMiCEModel)
        self.post_init()

    def aux_loss(self) -> Optional[torch.Tensor]:
        """Sum of the MiCE layers' sequence-wise balance losses of the last forward (training only)."""
        losses = [m.aux_loss for m in self.mice_layers() if m.aux_loss is not None]
        return torch.stack(losses).sum() if losses and self.training else None


__all__ = ["HelmMiCEPreTrainedModel", "HelmMiCEModel", "HelmMiCEForCausalLM", "HelmMiCEDecoderLayer"]
