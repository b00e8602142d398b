"""Attention entry point: one function, implementations registered by name, one mask object per forward; and the
fused, chunked LM-head cross-entropy (:mod:`helm.ops.lm_loss`)."""

from .attention import (
    ATTENTION_IMPLS,
    AttentionMask,
    alibi_bias,
    available_attention_impls,
    build_attention_mask,
    lorentz_attention,
)
from .lm_loss import linear_cross_entropy, linear_cross_entropy_reference

__all__ = [
    "ATTENTION_IMPLS",
    "AttentionMask",
    "alibi_bias",
    "available_attention_impls",
    "build_attention_mask",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "lorentz_attention",
]
