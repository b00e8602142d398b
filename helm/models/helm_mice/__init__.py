"""HELM-MiCE: registered with the ``transformers`` Auto classes on import."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_helm_mice import HelmMiCEConfig
from .modeling_helm_mice import HelmMiCEForCausalLM, HelmMiCEModel

AutoConfig.register(HelmMiCEConfig.model_type, HelmMiCEConfig, exist_ok=True)
AutoModel.register(HelmMiCEConfig, HelmMiCEModel, exist_ok=True)
AutoModelForCausalLM.register(HelmMiCEConfig, HelmMiCEForCausalLM, exist_ok=True)

__all__ = ["HelmMiCEConfig", "HelmMiCEModel", "HelmMiCEForCausalLM"]
