"""HELM-MiCE: registered with the ``transformers`` Auto classes on import (the base model, the causal LM and the
task heads Llama has)."""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_helm_mice import HelmMiCEConfig
from .modeling_helm_mice import (
    HelmMiCEForCausalLM,
    HelmMiCEForQuestionAnswering,
    HelmMiCEForSequenceClassification,
    HelmMiCEForTokenClassification,
    HelmMiCEModel,
)

AutoConfig.register(HelmMiCEConfig.model_type, HelmMiCEConfig, exist_ok=True)
for auto_class, model_class in ((AutoModel, HelmMiCEModel), (AutoModelForCausalLM, HelmMiCEForCausalLM),
                                (AutoModelForSequenceClassification, HelmMiCEForSequenceClassification),
                                (AutoModelForTokenClassification, HelmMiCEForTokenClassification),
                                (AutoModelForQuestionAnswering, HelmMiCEForQuestionAnswering)):
    auto_class.register(HelmMiCEConfig, model_class, exist_ok=True)

__all__ = ["HelmMiCEConfig", "HelmMiCEModel", "HelmMiCEForCausalLM", "HelmMiCEForSequenceClassification",
           "HelmMiCEForTokenClassification", "HelmMiCEForQuestionAnswering"]
