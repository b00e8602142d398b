"""The zoo's model families, registered with ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM``."""

from .helm_d import HelmDConfig, HelmDForCausalLM, HelmDModel
from .helm_mice import HelmMiCEConfig, HelmMiCEForCausalLM, HelmMiCEModel

__all__ = ["HelmDConfig", "HelmDForCausalLM", "HelmDModel", "HelmMiCEConfig", "HelmMiCEForCausalLM", "HelmMiCEModel"]
