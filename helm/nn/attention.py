"""Hyperbolic multi-head self-attention (paper Eq. 3) with a ``transformers`` cache."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..manifold.math import hcat, lift
from ..ops.attention import available_attention_impls, lorentz_attention
from ._checks import check_choice, check_dim, check_k, check_positive
from .linear import LorentzLinear
from .positional import POSITIONAL_ENCODINGS, ALiBi, build_positional_encoding


ATTENTION_POSITIONALS = tuple(p for p in POSITIONAL_ENCODINGS if p != "learned")


def _index_positions(batch: int, q_len: int, kv_len: int, device) -> tuple:
    """Positions of the queries and keys in the key index space, ``[B, Tq]`` and ``[B, Tk]``.

    Relative encodings only see differences, and within one row (or one packed document, or the real tokens
    of a left-padded row) index differences equal position differences.
    """
    k_pos = torch.arange(kv_len, device=device).expand(batch, kv_len)
    return k_pos[:, kv_len - q_len:], k_pos


class LorentzAttentionBase(nn.Module):
    """Shared pieces of the two attention layers: temperature, positional encoding, impl and cache plumbing."""

    def __init__(self, *, num_heads: int, k: float, positional: str, pe_dim: int, max_position_embeddings: int,
                 rope_theta: float, tau_init: float, attn_impl: str, layer_idx: Optional[int], pe_options: dict):
        super().__init__()
        check_dim(num_heads, "num_heads")
        check_k(k, "k")
        check_positive(tau_init, "tau_init")
        # 'learned' positions are absolute and belong to the embedding (one table per model, not per layer).
        check_choice(positional, "positional", ATTENTION_POSITIONALS)
        check_choice(attn_impl, "attn_impl", available_attention_impls())
        self.num_heads, self.k, self.attn_impl, self.layer_idx = num_heads, float(k), attn_impl, layer_idx
        self.positional, self.tau_init = positional, float(tau_init)
        self.log_tau = nn.Parameter(torch.empty((), dtype=torch.float32))
        self.pe = build_positional_encoding(positional, head_dim=pe_dim, num_heads=num_heads,
                                            max_position_embeddings=max_position_embeddings,
                                            rope_theta=rope_theta, **pe_options)
        self.pe_offset = 0
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Temperature back to ``tau_init`` (projections are ``nn.Linear``, initialised by their owner)."""
        with torch.no_grad():
            self.log_tau.fill_(math.log(self.tau_init))
        if hasattr(self.pe, "reset_parameters"):
            self.pe.reset_parameters()

    @property
    def tau(self) -> torch.Tensor:
        """``τ = exp(log τ)``: positive under any optimiser step, kept in fp32."""
        return self.log_tau.float().exp()

    def _attend(self, q, key, value, *, attention_mask, segment_ids):
        """Scores with the encoding's bias (ALiBi as slopes so every impl supports it), Lorentz attention."""
        B, _, Tq, _ = q.shape
        slopes, bias = None, None
        if isinstance(self.pe, ALiBi):  # as slopes: every impl, the Triton kernel included, supports them
            slopes = self.pe.slopes_tensor(q.device, torch.float32)
        elif self.pe.has_score_bias:
            q_pos, k_pos = _index_positions(B, Tq, key.shape[-2], q.device)
            start = 1 + self.pe_offset  # the encoding sees only the coordinates it was built for (HMLA: rope part)
            bias = self.pe.score_bias(q[..., start:], key[..., start:], q_pos, k_pos, scale=2.0 / self.tau)
        return lorentz_attention(q, key, value, k=self.k, tau=self.tau, causal=True, attention_mask=attention_mask,
                                 segment_ids=segment_ids, position_bias=bias, alibi_slopes=slopes,
                                 impl=self.attn_impl)


class LorentzSelfAttention(LorentzAttentionBase):
    """Per-head Lorentz ``q, k, v`` (HLT), positional encoding, ``softmax(-d²/τ)`` centroid, HCat, HLT out.

    Args:
        hidden_size: ambient dim ``1+n`` of the residual stream.
        num_heads: ``H``.
        head_dim: ambient dim ``1+d`` of one head (the 115M preset: 65).
        k: curvature parameter.
        positional: one of :data:`POSITIONAL_ENCODINGS`.
        tau_init: initial temperature (default ``sqrt(d)``).
        attn_impl: ``eager`` / ``sdpa`` / ``triton`` / ``auto``.
        layer_idx: index into a ``transformers`` cache.

    ``forward(x [B, T, 1+n], position_ids [B, T], attention_mask [B, T_past+T] | None,
    segment_ids [B, T_past+T] | None, past_key_values: Cache | None) -> [B, T, 1+n]``.
    The cache stores per-head Lorentz keys (after the positional rotation) and values ``[B, H, T, 1+d]``.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, k: float = 1.0,
                 positional: str = "hope", max_position_embeddings: int = 2048, rope_theta: float = 10000.0,
                 tau_init: Optional[float] = None, attn_impl: str = "auto", layer_idx: Optional[int] = None,
                 bias: bool = True, pe_options: Optional[dict] = None):
        check_dim(hidden_size, "hidden_size", minimum=2)
        check_dim(head_dim, "head_dim", minimum=2)
        d = head_dim - 1
        super().__init__(num_heads=num_heads, k=k, positional=positional, pe_dim=d,
                         max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                         tau_init=math.sqrt(d) if tau_init is None else tau_init, attn_impl=attn_impl,
                         layer_idx=layer_idx, pe_options=pe_options or {})
        self.head_dim = head_dim
        # One HLT per head; stacked into one matmul (same parameters as H separate HLTs).
        self.q_proj = LorentzLinear(hidden_size, 1 + num_heads * d, k=k, bias=bias)
        self.k_proj = LorentzLinear(hidden_size, 1 + num_heads * d, k=k, bias=bias)
        self.v_proj = LorentzLinear(hidden_size, 1 + num_heads * d, k=k, bias=bias)
        self.o_proj = LorentzLinear(1 + num_heads * d, hidden_size, k=k, bias=bias)

    def _heads(self, proj: LorentzLinear, x: torch.Tensor) -> torch.Tensor:
        """Space parts ``[B, H, T, d]`` of one projection."""
        B, T, _ = x.shape
        return proj.space(x).view(B, T, self.num_heads, self.head_dim - 1).transpose(1, 2)

    def forward(self, x: torch.Tensor, *, position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                segment_ids: Optional[torch.Tensor] = None, past_key_values=None) -> torch.Tensor:
        q_s = self.pe.rotate(self._heads(self.q_proj, x), position_ids)
        k_s = self.pe.rotate(self._heads(self.k_proj, x), position_ids)
        q, key, value = lift(q_s, k=self.k), lift(k_s, k=self.k), lift(self._heads(self.v_proj, x), k=self.k)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out = self._attend(q, key, value, attention_mask=attention_mask, segment_ids=segment_ids)
        return self.o_proj(hcat(out.transpose(1, 2), k=self.k, dim=-2))
