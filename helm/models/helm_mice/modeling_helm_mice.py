"""HELM-MiCE: HMLA attention + Mixture-of-Curvature Experts (paper §4.2–4.3)."""

from __future__ import annotations

from typing import Optional

import torch
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from ...nn.attention import LorentzSelfAttention
from ...nn.hmla import HMLA
from ...nn.mice import MiCE
from ...nn.mlp import LorentzSwiGLU
from ..modeling_common import HelmCausalLMBase, HelmDecoderLayer, HelmDecoderModel, HelmPreTrainedModel
from ..task_heads import QuestionAnsweringHead, SequenceClassificationHead, TokenClassificationHead
from .configuration_helm_mice import HelmMiCEConfig


class HelmMiCEDecoderLayer(HelmDecoderLayer):
    """:class:`~helm.models.modeling_common.HelmDecoderLayer` with HMLA and MiCE (dense SwiGLU_L in the first
    ``first_k_dense_replace`` layers; Eq. 3 self-attention instead of HMLA when ``attention_type="mha"``); a MiCE
    layer keeps its balance loss in ``mlp.aux_loss``."""

    def __init__(self, config: HelmMiCEConfig, layer_idx: int):
        k = config.k
        if config.attention_type == "hmla":
            attention = HMLA(config.hidden_size, config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
                             q_lora_rank=config.q_lora_rank or 0, qk_nope_head_dim=config.qk_nope_head_dim,
                             qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim, k=k,
                             tau_init=config.tau_init, layer_idx=layer_idx, bias=config.attention_bias,
                             rms_norm_eps=config.rms_norm_eps, head_merge=config.head_merge,
                             absorb=config.hmla_absorb, config=config)
        else:
            attention = LorentzSelfAttention(config.hidden_size, config.num_attention_heads, config.head_dim, k=k,
                                             tau_init=config.tau_init, layer_idx=layer_idx, bias=config.attention_bias,
                                             head_merge=config.head_merge, config=config)
        if layer_idx < config.first_k_dense_replace:
            mlp = LorentzSwiGLU(config.hidden_size, config.intermediate_size, k=k, hidden_act=config.hidden_act,
                                bias=config.mlp_bias)
        else:
            mlp = MiCE(config.hidden_size, config.moe_intermediate_size, n_routed_experts=config.n_routed_experts,
                       num_experts_per_tok=config.num_experts_per_tok, n_shared_experts=config.n_shared_experts,
                       k=k, routed_curvatures=config.routed_curvatures,
                       trainable_curvatures=config.trainable_curvatures, scoring_func=config.scoring_func,
                       norm_topk_prob=config.norm_topk_prob, aux_loss_alpha=config.aux_loss_alpha,
                       bias_update_speed=config.bias_update_speed, hidden_act=config.hidden_act,
                       bias=config.mlp_bias, expert_combine=config.expert_combine, dispatch=config.moe_dispatch)
        super().__init__(config, attention, mlp)


class HelmMiCEPreTrainedModel(HelmPreTrainedModel):
    config_class = HelmMiCEConfig
    config: HelmMiCEConfig
    _no_split_modules = ["HelmMiCEDecoderLayer"]

    def mice_layers(self) -> list:
        return [m for m in self.modules() if isinstance(m, MiCE)]

    def update_routing_bias(self) -> None:
        """DeepSeek-V3 aux-loss-free balancing step; the training loop calls it after each optimiser step."""
        for m in self.mice_layers():
            m.update_bias()

    def balance_loss(self) -> Optional[torch.Tensor]:
        """The summed sequence-wise balance losses of the last forward's MiCE layers, in training (else None)."""
        balance = [m.aux_loss for m in self.mice_layers() if m.aux_loss is not None]
        return torch.stack(balance).sum() if self.training and balance else None

    def expert_load(self) -> torch.Tensor:
        """Tokens routed to each expert in the last forward, ``[num MiCE layers, n_routed_experts]``."""
        return torch.stack([m.last_expert_load for m in self.mice_layers()])


class HelmMiCEModel(HelmDecoderModel, HelmMiCEPreTrainedModel):
    """HELM-MiCE's decoder stack (:class:`~helm.models.modeling_common.HelmDecoderModel`); with HMLA the positional
    encoding acts on the decoupled rotary part of each head only."""

    decoder_layer_class = HelmMiCEDecoderLayer
    output_class = MoeModelOutputWithPast


class HelmMiCEForCausalLM(HelmCausalLMBase, HelmMiCEPreTrainedModel):
    """HELM-MiCE with the LM head (:class:`~helm.models.modeling_common.HelmCausalLMBase`); in training the summed
    balance loss is ``aux_loss`` and is added to ``loss``."""

    base_model_class = HelmMiCEModel
    output_class = MoeCausalLMOutputWithPast


class HelmMiCEForSequenceClassification(SequenceClassificationHead, HelmMiCEPreTrainedModel):
    """HELM-MiCE with a sequence-classification head (:class:`helm.models.task_heads.SequenceClassificationHead`);
    in training the balance loss is added to ``loss``."""

    base_model_class = HelmMiCEModel


class HelmMiCEForTokenClassification(TokenClassificationHead, HelmMiCEPreTrainedModel):
    """HELM-MiCE with a token-classification head (:class:`helm.models.task_heads.TokenClassificationHead`)."""

    base_model_class = HelmMiCEModel


class HelmMiCEForQuestionAnswering(QuestionAnsweringHead, HelmMiCEPreTrainedModel):
    """HELM-MiCE with an extractive question-answering head (:class:`helm.models.task_heads.QuestionAnsweringHead`)."""

    base_model_class = HelmMiCEModel


__all__ = ["HelmMiCEPreTrainedModel", "HelmMiCEModel", "HelmMiCEForCausalLM", "HelmMiCEDecoderLayer",
           "HelmMiCEForSequenceClassification", "HelmMiCEForTokenClassification", "HelmMiCEForQuestionAnswering"]
