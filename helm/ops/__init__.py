"""Attention entry point: one function, implementations registered by name, one mask object per forward; and the
fused, chunked LM-head cross-entropy (:mod:`helm.ops.lm_loss`).

The Triton kernels of ``impl="triton"`` live in :mod:`helm.ops.lorentz_attention_triton`, which this package does not
import (it imports triton): :mod:`helm.ops.attention` loads it on first use."""

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
