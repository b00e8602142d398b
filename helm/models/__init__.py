"""The zoo's model families, registered with ``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` and the task-head
Auto classes (sequence and token classification, extractive question answering). Importing it makes the Auto
classes' loading failures on a local path name the problem (:mod:`.loading`)."""

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
from .loading import install_auto_load_messages

install_auto_load_messages()

__all__ = ["HelmDConfig", "HelmDForCausalLM", "HelmDForQuestionAnswering", "HelmDForSequenceClassification",
           "HelmDForTokenClassification", "HelmDModel", "HelmMiCEConfig", "HelmMiCEForCausalLM",
           "HelmMiCEForQuestionAnswering", "HelmMiCEForSequenceClassification", "HelmMiCEForTokenClassification",
           "HelmMiCEModel"]
