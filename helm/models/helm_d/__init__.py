"""HELM-D: registered with the ``transformers`` Auto classes on import."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_helm_d import HelmDConfig
from .modeling_helm_d import HelmDForCausalLM, HelmDModel

AutoConfig.register(HelmDConfig.model_type, HelmDConfig, exist_ok=True)
AutoModel.register(HelmDConfig, HelmDModel, exist_ok=True)
AutoModelForCausalLM.register(HelmDConfig, HelmDForCausalLM, exist_ok=True)

__all__ = ["HelmDConfig", "HelmDModel", "HelmDForCausalLM"]
