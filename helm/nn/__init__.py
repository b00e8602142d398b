"""Hyperbolic layers: each ``nn.Module`` is built from explicit keyword arguments and maps points to points."""

from .activation import ACTIVATIONS, LorentzActivation, get_activation
from .attention import LorentzSelfAttention
from .embedding import LorentzEmbedding, wrapped_normal_
from .head import LorentzLMHead
from .hmla import HMLA
from .linear import LorentzLinear
from .mlp import LorentzSwiGLU
from .norm import LorentzRMSNorm
from .positional import (
    POSITIONAL_ENCODINGS,
    PositionalEncoding,
    PositionalTables,
    build_positional_encoding,
    register_positional_encoding,
)
from .residual import LorentzResidual
from .validation import EMBEDDING_MODES, LM_HEAD_MODES

__all__ = [
    "ACTIVATIONS",
    "EMBEDDING_MODES",
    "HMLA",
    "LM_HEAD_MODES",
    "POSITIONAL_ENCODINGS",
    "LorentzActivation",
    "LorentzEmbedding",
    "LorentzLMHead",
    "LorentzLinear",
    "LorentzRMSNorm",
    "LorentzResidual",
    "LorentzSelfAttention",
    "LorentzSwiGLU",
    "PositionalEncoding",
    "PositionalTables",
    "build_positional_encoding",
    "get_activation",
    "register_positional_encoding",
    "wrapped_normal_",
]
