"""HELM-D: dense fully hyperbolic decoder (hyperbolic self-attention + hyperbolic SwiGLU), paper §4."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ...manifold.math import lift, trusted_points
from ...nn.attention import LorentzSelfAttention
from ...nn.embedding import LorentzEmbedding
from ...nn.head import LorentzLMHead
from ...nn.linear import LorentzLinear
from ...nn.mlp import LorentzSwiGLU
from ...nn.norm import LorentzRMSNorm
from ...nn.positional import PositionalTables
from ...nn.residual import LorentzResidual
from ...ops.attention import AttentionMask
from ..modeling_common import (
    CACHE_FIELD,
    FORWARD_KWARGS,
    LOSS_KWARGS,
    AttentionWeights,
    HelmDynamicCache,
    HelmGenerationMixin,
    HelmPreTrainedModel,
    attention_mask_for,
    can_return_tuple,
    check_flags,
    check_forward_kwargs,
    check_inputs,
    check_logits_to_keep,
    default_position_ids,
    kept_positions,
    lift_inputs_embeds,
    lm_logits_and_loss,
    positional_encoding,
    resolve_cache,
    weights_device,
)
from ..task_heads import QuestionAnsweringHead, SequenceClassificationHead, TokenClassificationHead
from .configuration_helm_d import HelmDConfig


class HelmDDecoderLayer(GradientCheckpointingLayer):
    """``x ← x ⊕ Attn(RMSNorm_L(x))``, then ``x ← x ⊕ SwiGLU_L(RMSNorm_L(x))`` (⊕: Lorentz residual)."""

    def __init__(self, config: HelmDConfig, layer_idx: int):
        super().__init__()
        k = config.k
        self.input_layernorm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)
        self.self_attn = LorentzSelfAttention(config.hidden_size, config.num_attention_heads, config.head_dim, k=k,
                                              tau_init=config.tau_init, attn_impl=config.attn_impl,
                                              layer_idx=layer_idx, bias=config.attention_bias,
                                              head_merge=config.head_merge)
        self.attn_residual = LorentzResidual(k=k, weight=config.residual_weight,
                                             space_scale=config.residual_space_scale)
        self.post_attention_layernorm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)
        self.mlp = LorentzSwiGLU(config.hidden_size, config.intermediate_size, k=k, hidden_act=config.hidden_act,
                                 bias=config.mlp_bias)
        self.mlp_residual = LorentzResidual(k=k, weight=config.residual_weight,
                                            space_scale=config.residual_space_scale)

    @trusted_points  # also when gradient checkpointing recomputes the layer
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


class HelmDModel(HelmDPreTrainedModel):
    """Token embeddings, ``num_hidden_layers`` decoder layers and the final RMSNorm_L; returns points
    ``[B, T, 1+n]``. ``segment_ids [B, T_past+T]`` are document ids of packed rows: attention never crosses
    documents. ``inputs_embeds [B, T, 1+n]`` are points: their space part is read and the time coordinate
    recomputed, so an input off the hyperboloid is projected onto it. Bad inputs raise a ``ValueError`` naming the
    argument and the expected shape (:func:`helm.models.modeling_common.check_inputs`)."""

    # loading the bare model from a causal-LM checkpoint leaves its LM head unused, as in transformers
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config: HelmDConfig):
        super().__init__(config)
        self.embed_tokens = LorentzEmbedding(config.vocab_size, config.hidden_size, k=config.k,
                                             mode=config.embedding_mode, init_std=config.initializer_range)
        self.pos_encoding = positional_encoding(config, head_dim=config.head_dim - 1)
        self.layers = nn.ModuleList(HelmDDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        # the official models' extra HLT before the final norm (config.final_proj; not in the paper)
        self.final_proj = (LorentzLinear(config.hidden_size, config.hidden_size, k=config.k) if config.final_proj
                           else None)
        self.norm = LorentzRMSNorm(config.hidden_size, k=config.k, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    @can_return_tuple
    @trusted_points
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[Cache] = None,
                cache: Optional[Cache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                use_cache: Optional[bool] = None,
                segment_ids: Optional[torch.LongTensor] = None, output_hidden_states: Optional[bool] = None,
                output_attentions: Optional[bool] = None, **kwargs) -> BaseModelOutputWithPast:
        check_forward_kwargs(self, kwargs, FORWARD_KWARGS)
        check_flags(use_cache=use_cache, output_hidden_states=output_hidden_states,
                    output_attentions=output_attentions)
        attentions = AttentionWeights(self, output_attentions)
        past_key_values = resolve_cache(past_key_values, cache)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        if use_cache and past_key_values is None:
            past_key_values = HelmDynamicCache(config=self.config)
        # layout: past length (a tensor for a static cache: no host sync), keys per layer, where the queries sit
        batch, seq_len, layout = check_inputs(self.config, input_ids, inputs_embeds, past_key_values, attention_mask,
                                              position_ids, segment_ids, dtype=self.embed_tokens.weight.dtype,
                                              device=weights_device(self.embed_tokens),
                                              cache_position=kwargs.get("cache_position"), owner=self.weights_id)
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, layout, seq_len, batch, device)

        hidden_states = (self.embed_tokens(input_ids) if inputs_embeds is None
                         else lift_inputs_embeds(self.config, inputs_embeds))
        if self.pos_encoding.absolute:
            hidden_states = lift(self.pos_encoding.embed(hidden_states[..., 1:], position_ids), k=self.config.k)
        # built once here, read by every layer
        position_embeddings = self.pos_encoding(position_ids, kv_len=layout.kv_len, dtype=hidden_states.dtype,
                                                q_offset=layout.q_offset)
        mask = attention_mask_for(layout, batch, seq_len, attention_mask, segment_ids, device)

        # transformers' convention: the embeddings, every layer's output, the last one after the final norm
        all_hidden_states = [hidden_states]
        with attentions:
            for layer in self.layers:
                # under the name transformers' GradientCheckpointingLayer clears in training
                hidden_states = layer(hidden_states, position_embeddings=position_embeddings, attention_mask=mask,
                                      **{CACHE_FIELD: past_key_values})
                all_hidden_states.append(hidden_states)
        if self.final_proj is not None:
            hidden_states = self.final_proj(hidden_states)
        all_hidden_states[-1] = hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states,
                                       **{CACHE_FIELD: past_key_values if use_cache else None},
                                       hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
                                      attentions=attentions.weights)


class HelmDForCausalLM(HelmDPreTrainedModel, HelmGenerationMixin):
    """HELM-D with the LM head; ``segment_ids`` (document ids of packed rows) keep attention within documents."""

    def __init__(self, config: HelmDConfig):
        super().__init__(config)
        self.model = HelmDModel(config)
        self.lm_head = LorentzLMHead(config.hidden_size, config.vocab_size, k=config.k, mode=config.lm_head_mode,
                                     init_std=config.initializer_range)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    @can_return_tuple
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[Cache] = None,
                cache: Optional[Cache] = None, inputs_embeds: Optional[torch.Tensor] = None,
                labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, segment_ids: Optional[torch.LongTensor] = None,
                output_hidden_states: Optional[bool] = None, output_attentions: Optional[bool] = None,
                logits_to_keep: int = 0, skip_logits: Optional[bool] = None, **kwargs) -> CausalLMOutputWithPast:
        check_forward_kwargs(self, kwargs, FORWARD_KWARGS | LOSS_KWARGS)
        check_logits_to_keep(logits_to_keep)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=resolve_cache(past_key_values, cache), inputs_embeds=inputs_embeds,
                             use_cache=use_cache,
                             segment_ids=segment_ids, output_hidden_states=output_hidden_states,
                             output_attentions=output_attentions, cache_position=kwargs.get("cache_position"))
        hidden_states = outputs.last_hidden_state
        # in training with labels (config.fused_lm_loss) the loss is fused and logits is None: lm_logits_and_loss
        kept = kept_positions(hidden_states, logits_to_keep)
        logits, loss = lm_logits_and_loss(self, kept, labels, skip_logits, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


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
