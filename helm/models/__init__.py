"""The zoo's model families, registered with ``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` and the task-head
Auto classes (sequence and token classification, extractive question answering) through their public ``register``;
nothing of ``transformers`` or PEFT is replaced."""

from .helm_d import (
    HelmDConfig,
    HelmDForCausalLM,
    HelmDForQuestionAnswering,
    HelmDForSequenceClassification,
    HelmDForTokenClassification,
    HelmDModel,
)
from .helm_mice import (
    HelmMiCEConfig,
    HelmMiCEForCausalLM,
    HelmMiCEForQuestionAnswering,
    HelmMiCEForSequenceClassification,
    HelmMiCEForTokenClassification,
    HelmMiCEModel,
)

__all__ = ["HelmDConfig", "HelmDForCausalLM", "HelmDForQuestionAnswering", "HelmDForSequenceClassification",
           "HelmDForTokenClassification", "HelmDModel", "HelmMiCEConfig", "HelmMiCEForCausalLM",
           "HelmMiCEForQuestionAnswering", "HelmMiCEForSequenceClassification", "HelmMiCEForTokenClassification",
           "HelmMiCEModel"]
