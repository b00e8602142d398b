"""HELM-D: dense fully hyperbolic decoder (hyperbolic self-attention + hyperbolic SwiGLU), paper §4."""

from __future__ import annotations


from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ...nn.attention import LorentzSelfAttention
from ...nn.mlp import LorentzSwiGLU
from ..modeling_common import HelmCausalLMBase, HelmDecoderLayer, HelmDecoderModel, HelmPreTrainedModel
from ..task_heads import QuestionAnsweringHead, SequenceClassificationHead, TokenClassificationHead
from .configuration_helm_d import HelmDConfig


class HelmDDecoderLayer(HelmDecoderLayer):
    """:class:`~helm.models.modeling_common.HelmDecoderLayer` with Eq. 3 self-attention and SwiGLU_L."""

    def __init__(self, config: HelmDConfig, layer_idx: int):
        super().__init__(config, LorentzSelfAttention(
            config.hidden_size, config.num_attention_heads, config.head_dim, k=config.k, tau_init=config.tau_init,
            layer_idx=layer_idx, bias=config.attention_bias, head_merge=config.head_merge, config=config),
            LorentzSwiGLU(config.hidden_size, config.intermediate_size, k=config.k, hidden_act=config.hidden_act,
                          bias=config.mlp_bias))


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
