"""HELM-D: registered with the ``transformers`` Auto classes on import (the base model, the causal LM and the
task heads Llama has)."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_helm_d import HelmDConfig
from .modeling_helm_d import (
    HelmDForCausalLM,
    HelmDForQuestionAnswering,
    HelmDForSequenceClassification,
    HelmDForTokenClassification,
    HelmDModel,
)

AutoConfig.register(HelmDConfig.model_type, HelmDConfig, exist_ok=True)
for auto_class, model_class in ((AutoModel, HelmDModel), (AutoModelForCausalLM, HelmDForCausalLM),
                                (AutoModelForSequenceClassification, HelmDForSequenceClassification),
                                (AutoModelForTokenClassification, HelmDForTokenClassification),
                                (AutoModelForQuestionAnswering, HelmDForQuestionAnswering)):
    auto_class.register(HelmDConfig, model_class, exist_ok=True)

__all__ = ["HelmDConfig", "HelmDModel", "HelmDForCausalLM", "HelmDForSequenceClassification",
           "HelmDForTokenClassification", "HelmDForQuestionAnswering"]
