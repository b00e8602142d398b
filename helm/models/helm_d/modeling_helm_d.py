"""HELM-D: dense fully hyperbolic decoder (hyperbolic self-attention + hyperbolic SwiGLU), paper §4."""

from __future__ import annotations


import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ...manifold.math import curvature_to_k
from ...nn.mlp import LorentzSwiGLU
from ...nn.norm import LorentzRMSNorm
from ..modeling_common import (
    HelmCausalLMMixin,
    HelmDecoderStack,
    HelmPreTrainedModel,
    build_attention,
    build_residual,
)
from .configuration_helm_d import HelmDConfig


class HelmDDecoderLayer(nn.Module):
    """``x ← x ⊕ Attn(RMSNorm_L(x))``, then ``x ← x ⊕ SwiGLU_L(RMSNorm_L(x))`` (⊕: Lorentz residual)."""

    def __init__(self, config: HelmDConfig, layer_idx: int):
        super().__init__()
        k = curvature_to_k(config.curvature)
        self.input_layernorm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)
        self.self_attn = build_attention(config, k, layer_idx, "mha")
        self.attn_residual = build_residual(config, k)
        self.post_attention_layernorm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)
        self.mlp = LorentzSwiGLU(config.hidden_size, config.intermediate_size, k=k, hidden_act=config.hidden_act,
                                 bias=config.mlp_bias)
        self.mlp_residual = build_residual(config, k)

    def forward(self, x: torch.Tensor, **attn_kwargs) -> torch.Tensor:
        x = self.attn_residual(x, self.self_attn(self.input_layernorm(x), **attn_kwargs))
        return self.mlp_residual(x, self.mlp(self.post_attention_layernorm(x)))


class HelmDPreTrainedModel(HelmPreTrainedModel):
    config_class = HelmDConfig
    config: HelmDConfig


class HelmDModel(HelmDecoderStack, HelmDPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` decoder layers and the final RMSNorm_L; returns points ``[B, T, 1+n]``."""

    output_class = BaseModelOutputWithPast

    def __init__(self, config: HelmDConfig):
        super().__init__(config)
        self.build_stack(config, HelmDDecoderLayer)
        self.post_init()


class HelmDForCausalLM(HelmCausalLMMixin, HelmDPreTrainedModel, GenerationMixin):
    """HELM-D with the LM head; ``segment_ids`` (document ids of packed rows) keep attention within documents."""

    output_class = CausalLMOutputWithPast

    def __init__(self, config: HelmDConfig):
        super().__init__(config)
        self.build_head(config, HelmDModel)
        self.post_init()


__all__ = ["HelmDPreTrainedModel", "HelmDModel", "HelmDForCausalLM", "HelmDDecoderLayer"]
