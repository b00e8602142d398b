"""Attention entry point: one function, implementations registered by name."""

from .attention import (
    ATTENTION_IMPLS,
    alibi_bias,
    available_attention_impls,
    build_attention_mask,
    lorentz_attention,
    register_attention_impl,
)

__all__ = [
    "ATTENTION_IMPLS",
    "alibi_bias",
    "available_attention_impls",
    "build_attention_mask",
    "lorentz_attention",
    "register_attention_impl",
]
