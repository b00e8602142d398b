"""Hyperbolic layers: each ``nn.Module`` is built from explicit keyword arguments and maps points to points."""

from .activation import ACTIVATIONS, LorentzActivation, get_activation
from .embedding import EMBEDDING_MODES, LorentzEmbedding, wrapped_normal_
from .head import HEAD_MODES, LorentzLMHead
from .linear import LorentzLinear
from .mlp import LorentzSwiGLU
from .norm import LorentzRMSNorm
from .residual import LorentzResidual

__all__ = [
    "ACTIVATIONS",
    "EMBEDDING_MODES",
    "HEAD_MODES",
    "LorentzActivation",
    "LorentzEmbedding",
    "LorentzLMHead",
    "LorentzLinear",
    "LorentzRMSNorm",
    "LorentzResidual",
    "LorentzSwiGLU",
    "get_activation",
    "wrapped_normal_",
]
