"""Hyperbolic multi-head self-attention (paper Eq. 3) with a ``transformers`` cache."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, StaticLayer

from ..manifold.math import hcat, lift, positive_exp, sqnorm
from ..ops.attention import AttentionMask, lorentz_attention
from .linear import linear_space, lorentz_linear, space_linear
from .positional import PositionalTables
from .validation import HEAD_MERGES, check, check_choice, check_dim, check_k, temperature
from .storage import RealignAfterLoading

_NO_POSITIONS = PositionalTables()


class LorentzAttentionBase(RealignAfterLoading, nn.Module):
    """What both attention layers share: the temperature, the call into :func:`helm.ops.lorentz_attention` and
    the merge of the heads before the output projection.

    ``head_merge``: ``hcat`` (paper Eq. 19 as HCat: the heads' space parts concatenated under one recomputed
    time coordinate, ``1 + H·d_v`` features) or ``flatten`` (the official code: the ``H`` per-head points, each
    with its own time coordinate, flattened to ``H·(1 + d_v)`` features, which the output HLT reads as they are).

    ``config``: the model's config, whose ``_attn_implementation`` (``eager`` / ``sdpa`` / ``triton`` / ``auto``,
    set by ``attn_implementation=`` and ``set_attn_implementation``) the layer reads at every call, as Llama's
    layers do; :func:`helm.ops.attention.resolve_attention` turns it into what runs. None (a layer on its own):
    ``auto``.
    """

    def __init__(self, *, num_heads: int, k: float, tau_init: float, layer_idx: Optional[int],
                 head_merge: str = "hcat", config=None):
        super().__init__()
        check_dim(num_heads, "num_heads")
        check_k(k, "k")
        check(tau_init, "tau_init", temperature)
        check_choice(head_merge, "head_merge", HEAD_MERGES)
        self.num_heads, self.k, self.layer_idx, self.config = num_heads, float(k), layer_idx, config
        self.head_merge = head_merge
        self.tau_init = float(tau_init)
        self.log_tau = nn.Parameter(torch.empty(1, dtype=torch.float32))  # [1], not []: FSDP2 shards dim 0
        self.reset_parameters()

    @property
    def attn_implementation(self) -> Optional[str]:
        """The requested implementation, ``config._attn_implementation`` (None: ``auto``)."""
        return None if self.config is None else self.config._attn_implementation

    def reset_parameters(self) -> None:
        """Temperature back to ``tau_init`` (projections are ``nn.Linear``, initialised by their owner)."""
        with torch.no_grad():
            self.log_tau.fill_(math.log(self.tau_init))

    @property
    def tau(self) -> torch.Tensor:
        """``τ = exp(log τ)``: positive under any optimiser step, kept in fp32 (:func:`positive_exp`)."""
        return positive_exp(self.log_tau.reshape(()))

    def logit_tau(self, position_embeddings: PositionalTables) -> torch.Tensor:
        """The temperature the logits see, ``τ / s`` with ``s = position_embeddings.logit_scale`` (YaRN's ``a²``):
        ``softmax(-d²·s/τ) = softmax(s·(2/τ)·<q, k>_L)``, the constant ``-2k·s/τ`` cancelling. ``τ`` itself when
        ``s = 1``."""
        scale = position_embeddings.logit_scale
        return self.tau if scale == 1.0 else self.tau / scale

    def merged_dim(self, value_head_dim: int) -> int:
        """Features of the merged heads for per-head values of ambient dim ``value_head_dim = 1 + d_v``."""
        dv = value_head_dim - 1
        return 1 + self.num_heads * dv if self.head_merge == "hcat" else self.num_heads * (1 + dv)

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, H, T, 1+d_v] -> [B, T, merged_dim]`` (see the class docstring)."""
        out = out.transpose(1, 2)
        return hcat(out, k=self.k, dim=-2) if self.head_merge == "hcat" else out.flatten(-2)

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, q_pe: torch.Tensor,
               k_pe: torch.Tensor, position_embeddings: PositionalTables, attention_mask: Optional[AttentionMask],
               value_centre: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Eq. 3 on points ``q, key [B, H, T, 1+d]``, ``value [B, H, Tk, 1+dv]`` (with ``value_centre``: one more
        column, the values' centred norms, see :func:`helm.ops.lorentz_attention`); ``q_pe, k_pe`` are the space
        coordinates the positional encoding acts on (its score bias reads them). The logit scale is
        ``position_embeddings.logit_scale · 2/τ`` (:meth:`logit_tau`). ``dtype``: the GEMM dtype of ``q·k``, that of
        the projections' outputs (:mod:`helm.precision`)."""
        tau = self.logit_tau(position_embeddings)
        bias = position_embeddings.score_bias(q_pe, k_pe, 2.0 / tau)
        return lorentz_attention(q, key, value, k=self.k, tau=tau, mask=attention_mask, position_bias=bias,
                                 alibi_slopes=position_embeddings.alibi_slopes, impl=self.attn_implementation,
                                 value_centre=value_centre, dtype=dtype)


class LorentzSelfAttention(LorentzAttentionBase):
    """Per-head Lorentz ``q, k, v`` (HLT), positional encoding, ``softmax(-d²/τ)`` centroid, HCat, HLT out.

    Args:
        hidden_size: ambient dim ``1+n`` of the residual stream.
        num_heads: ``H``.
        head_dim: ambient dim ``1+d`` of one head (the 115M preset: 65).
        k: curvature parameter.
        tau_init: initial temperature (default ``sqrt(d)``).
        layer_idx: index into a ``transformers`` cache.
        bias: biases in the projections.
        head_merge: ``hcat`` or ``flatten`` (see :class:`LorentzAttentionBase`).
        config: the model's config, read for ``_attn_implementation`` (see :class:`LorentzAttentionBase`).

    ``forward(x [B, T, 1+n], *, position_embeddings: PositionalTables | None, attention_mask: AttentionMask |
    None, past_key_values: Cache | None) -> [B, T, 1+n]``; the model builds the tables and the mask once per
    forward (None: no positional encoding; plain causal attention over the new tokens and the cache).
    The cache stores per-head Lorentz keys (after the positional rotation) ``[B, H, T, 1+d]`` and values, each with
    one more column ``[B, H, T, 1+d+1]``: its centred norm ``e = <v - c, v - c>_L`` (fp32) for the centre
    ``c`` = the value of the cache's first key (per batch row and head, fixed for the life of the cache; not in
    training mode, whose forward with a cache stays that of ``helm.ops``). A decode
    step then normalises the centroid from ``SDPA(·, ·, [v | e])`` directly on the cache tensors (``sdpa``; ``eager``
    recomputes its centres, the reference), instead of re-centring and re-casting the whole cache every step
    (:func:`helm.ops.lorentz_attention`, ``value_centre``). Caches other than ``transformers``' dynamic and static
    ones, and a cache written without the column, keep plain values.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, k: float = 1.0,
                 tau_init: Optional[float] = None, layer_idx: Optional[int] = None, bias: bool = True,
                 head_merge: str = "hcat", config=None):
        check_dim(hidden_size, "hidden_size", minimum=2)
        check_dim(head_dim, "head_dim", minimum=2)
        d = head_dim - 1
        super().__init__(num_heads=num_heads, k=k, tau_init=math.sqrt(d) if tau_init is None else tau_init,
                         layer_idx=layer_idx, head_merge=head_merge, config=config)
        self.head_dim = head_dim
        # One HLT per head; stacked into one matmul (same parameters as H separate HLTs). The Euclidean maps
        # are plain linears under Llama's names, lifted here (see helm.nn.linear.space_linear).
        self.q_proj = space_linear(hidden_size, 1 + num_heads * d, bias=bias)
        self.k_proj = space_linear(hidden_size, 1 + num_heads * d, bias=bias)
        self.v_proj = space_linear(hidden_size, 1 + num_heads * d, bias=bias)
        self.o_proj = space_linear(self.merged_dim(head_dim), hidden_size, bias=bias)

    def _heads(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Space parts ``[B, H, T, d]`` of one projection."""
        B, T, _ = x.shape
        return linear_space(proj, x).view(B, T, self.num_heads, self.head_dim - 1).transpose(1, 2)

    def forward(self, x: torch.Tensor, *, position_embeddings: Optional[PositionalTables] = None,
                attention_mask: Optional[AttentionMask] = None, past_key_values=None) -> torch.Tensor:
        pos = _NO_POSITIONS if position_embeddings is None else position_embeddings
        q_s = pos.rotate(self._heads(self.q_proj, x))
        k_s = pos.rotate(self._heads(self.k_proj, x))
        q, key, value = lift(q_s, k=self.k), lift(k_s, k=self.k), lift(self._heads(self.v_proj, x), k=self.k)
        centre = None
        if past_key_values is not None:
            # not in training mode: its forward keeps the per-document centres of helm.ops (outputs and gradients)
            if not self.training and extends_cache(past_key_values, self.layer_idx, values=True,
                                                   plain_width=self.head_dim):
                centre = first_cached(past_key_values, self.layer_idx, value, values=True).detach()
                value = torch.cat([value, sqnorm(value - centre, keepdim=True)], dim=-1)
            key, value = past_key_values.update(key, value, self.layer_idx)
        out = self.attend(q, key, value, q_pe=q[..., 1:], k_pe=key[..., 1:], position_embeddings=pos,
                          attention_mask=attention_mask, value_centre=centre, dtype=q_s.dtype)
        return lorentz_linear(self.o_proj, self.merge_heads(out), k=self.k)


def extends_cache(cache, layer_idx: int, *, values: bool, plain_width: int) -> bool:
    """Whether layer ``layer_idx`` of ``cache`` takes extra columns after the plain ones (the keys', or with
    ``values`` the values'), that a layer computes once per token instead of every decode step: a ``transformers``
    dynamic or static layer (not offloaded), not already written with the plain width ``plain_width``."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or getattr(cache, "offloading", False):
        return False
    if layer_idx >= len(layers):
        return getattr(cache, "layer_class_to_replicate", None) is DynamicLayer
    layer = layers[layer_idx]
    if type(layer) not in (DynamicLayer, StaticLayer):
        return False
    stored = getattr(layer, "values" if values else "keys", None) if layer.is_initialized else None
    return not (isinstance(stored, torch.Tensor) and stored.dim() == 4 and stored.shape[-1] == plain_width)


def first_cached(cache, layer_idx: int, new: torch.Tensor, *, values: bool) -> torch.Tensor:
    """``[B, h, 1, C]``: the first ``C = new.shape[-1]`` columns of the key (or value) at cache index 0 once the new
    tokens ``new [B, h, T, C]`` are written, read before the update (a static cache's length is a tensor: chosen with
    ``where``, no host read). The per-token columns that :func:`extends_cache` allows are relative to it."""
    first = new[:, :, :1]
    past = cache.get_seq_length(layer_idx)
    if isinstance(past, int) and past == 0:
        return first
    layer = cache.layers[layer_idx]
    stored = (layer.values if values else layer.keys)[:, :, :1, :new.shape[-1]].to(new.dtype)
    return torch.where(past > 0, stored, first) if isinstance(past, torch.Tensor) else stored
