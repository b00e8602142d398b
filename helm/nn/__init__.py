"""Hyperbolic layers: each ``nn.Module`` is built from explicit keyword arguments and maps points to points."""

from .attention import ATTENTION_POSITIONALS, LorentzSelfAttention
from .activation import ACTIVATIONS, LorentzActivation, get_activation
from .embedding import EMBEDDING_MODES, LorentzEmbedding, wrapped_normal_
from .head import HEAD_MODES, LorentzLMHead
from .linear import LorentzLinear
from .mlp import LorentzSwiGLU
from .norm import LorentzRMSNorm
from .hmla import HMLA
from .positional import POSITIONAL_ENCODINGS, PositionalEncoding, build_positional_encoding
from .residual import LorentzResidual

__all__ = [
    "ATTENTION_POSITIONALS",
    "HMLA",
    "LorentzSelfAttention",
    "POSITIONAL_ENCODINGS",
    "PositionalEncoding",
    "build_positional_encoding",
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
