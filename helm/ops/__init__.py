"""Attention entry point: one function, implementations registered by name, one mask object per forward."""

from .attention import (
    ATTENTION_IMPLS,
    AttentionMask,
    alibi_bias,
    available_attention_impls,
    build_attention_mask,
    lorentz_attention,
)

__all__ = [
    "ATTENTION_IMPLS",
    "AttentionMask",
    "alibi_bias",
    "available_attention_impls",
    "build_attention_mask",
    "lorentz_attention",
]
