"""HELM-D: dense fully hyperbolic decoder (hyperbolic self-attention + hyperbolic SwiGLU), paper §4."""

from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ...nn.attention import LorentzSelfAttention
from ...nn.mlp import LorentzSwiGLU
from ...nn.norm import LorentzRMSNorm
from ...nn.positional import PositionalTables
from ...nn.residual import LorentzResidual
from ...ops.attention import AttentionMask
from ..modeling_common import HelmCausalLMBase, HelmDecoderModel, HelmPreTrainedModel, resolve_cache
from ..task_heads import QuestionAnsweringHead, SequenceClassificationHead, TokenClassificationHead
from .configuration_helm_d import HelmDConfig


class HelmDDecoderLayer(GradientCheckpointingLayer):
    """``x ← x ⊕ Attn(RMSNorm_L(x))``, then ``x ← x ⊕ SwiGLU_L(RMSNorm_L(x))`` (⊕: Lorentz residual)."""

    def __init__(self, config: HelmDConfig, layer_idx: int):
        super().__init__()
        k = config.k
        self.input_layernorm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)
        self.self_attn = LorentzSelfAttention(config.hidden_size, config.num_attention_heads, config.head_dim, k=k,
                                              tau_init=config.tau_init, layer_idx=layer_idx,
                                              bias=config.attention_bias, head_merge=config.head_merge,
                                              config=config)
        self.attn_residual = LorentzResidual(k=k, weight=config.residual_weight,
                                             space_scale=config.residual_space_scale)
        self.post_attention_layernorm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)
        self.mlp = LorentzSwiGLU(config.hidden_size, config.intermediate_size, k=k, hidden_act=config.hidden_act,
                                 bias=config.mlp_bias)
        self.mlp_residual = LorentzResidual(k=k, weight=config.residual_weight,
                                            space_scale=config.residual_space_scale)

    def forward(self, hidden_states: torch.Tensor, *, position_embeddings: PositionalTables,
                attention_mask: Optional[AttentionMask], past_key_values: Optional[Cache] = None,
                cache: Optional[Cache] = None) -> torch.Tensor:
        """Points ``[B, T, 1+n] -> [B, T, 1+n]``."""
        attn = self.self_attn(self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                              attention_mask=attention_mask, past_key_values=resolve_cache(past_key_values, cache))
        hidden_states = self.attn_residual(hidden_states, attn)
        return self.mlp_residual(hidden_states, self.mlp(self.post_attention_layernorm(hidden_states)))


class HelmDPreTrainedModel(HelmPreTrainedModel):
    config_class = HelmDConfig
    config: HelmDConfig
    _no_split_modules = ["HelmDDecoderLayer"]


class HelmDModel(HelmDecoderModel, HelmDPreTrainedModel):
    """HELM-D's decoder stack (:class:`~helm.models.modeling_common.HelmDecoderModel`)."""

    decoder_layer_class = HelmDDecoderLayer
    output_class = BaseModelOutputWithPast


class HelmDForCausalLM(HelmCausalLMBase, HelmDPreTrainedModel):
    """HELM-D with the LM head (:class:`~helm.models.modeling_common.HelmCausalLMBase`)."""

    base_model_class = HelmDModel
    output_class = CausalLMOutputWithPast


class HelmDForSequenceClassification(SequenceClassificationHead, HelmDPreTrainedModel):
    """HELM-D with a sequence-classification head (:class:`helm.models.task_heads.SequenceClassificationHead`)."""

    base_model_class = HelmDModel


class HelmDForTokenClassification(TokenClassificationHead, HelmDPreTrainedModel):
    """HELM-D with a token-classification head (:class:`helm.models.task_heads.TokenClassificationHead`)."""

    base_model_class = HelmDModel


class HelmDForQuestionAnswering(QuestionAnsweringHead, HelmDPreTrainedModel):
    """HELM-D with an extractive question-answering head (:class:`helm.models.task_heads.QuestionAnsweringHead`)."""

    base_model_class = HelmDModel


__all__ = ["HelmDPreTrainedModel", "HelmDModel", "HelmDForCausalLM", "HelmDDecoderLayer",
           "HelmDForSequenceClassification", "HelmDForTokenClassification", "HelmDForQuestionAnswering"]
