"""Attention entry point: one function, implementations registered by name and chosen by one resolver, one mask object
per forward, the values' centring (:mod:`helm.ops.centring`); and the fused, chunked LM-head cross-entropy
(:mod:`helm.ops.lm_loss`).

The Triton kernels of ``impl="triton"`` live in :mod:`helm.ops.lorentz_attention_triton`, which this package does not
import (it imports triton): :mod:`helm.ops.attention` loads it on first use."""

from .attention import (
    ATTENTION_FUNCTIONS,
    ATTENTION_IMPLEMENTATIONS,
    AttentionMask,
    alibi_bias,
    build_attention_mask,
    check_attention_implementation,
    lorentz_attention,
    resolve_attention,
)
from .lm_loss import linear_cross_entropy, linear_cross_entropy_reference

__all__ = [
    "ATTENTION_FUNCTIONS",
    "ATTENTION_IMPLEMENTATIONS",
    "AttentionMask",
    "alibi_bias",
    "build_attention_mask",
    "check_attention_implementation",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "lorentz_attention",
    "resolve_attention",
]
