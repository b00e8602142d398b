"""Hyperbolic Multi-head Latent Attention, HMLA (paper §4.3, App. B.2)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..manifold.math import lift
from ..ops.attention import AttentionMask
from .attention import LorentzAttentionBase
from .linear import LorentzLinear
from .norm import LorentzRMSNorm
from .positional import PositionalTables
from .validation import check_dim

_NO_POSITIONS = PositionalTables()


class HMLA(LorentzAttentionBase):
    """Latent-compressed Lorentz attention with a decoupled rotary part.

    All dims are ambient (they count the time coordinate, like the paper's 65 / 33 / 17):

    * ``c_KV = RMSNorm_L(HLT_kv_a(x))`` ``[1+n_kv]`` — the latent, the only per-head-free state cached;
    * ``k^R = PE(HLT_kr(x)_s)`` ``[1+d_r]`` — one rotary key shared by all heads, also cached (the positional
      encoding acts on the ``d_r`` rope coordinates only: rotation, and the score bias of ``hope_boost``);
    * ``k^C_h, v^C_h = HLT_kv_b(c_KV)`` per head ``[1+d_n]``, ``[1+d_v]`` — rebuilt from the cache every step;
    * ``q^C_h, q^R_h`` from ``HLT_q(x)`` (or through a latent ``c_Q`` when ``q_lora_rank > 0``), ``q^R`` rotated;
    * ``q_h = HCat(q^C_h, q^R_h)``, ``k_h = HCat(k^C_h, k^R)``, Eq. 3 with ``τ`` initialised to
      ``sqrt(d_n + d_r)``; heads joined by HCat (``head_merge="flatten"``: the official code's flattened
      per-head points, see :class:`~helm.nn.attention.LorentzAttentionBase`), then ``HLT_o``.

    The cache (a ``transformers`` ``DynamicCache``; ``layer_idx`` selects the layer) holds exactly
    ``c_KV`` as its "keys" ``[B, 1, T, 1+n_kv]`` and ``k^R`` as its "values" ``[B, 1, T, 1+d_r]``.

    ``forward(x [B, T, 1+n], *, position_embeddings: PositionalTables | None, attention_mask: AttentionMask |
    None, past_key_values) -> [B, T, 1+n]`` (tables and mask built once per forward by the model).
    """

    def __init__(self, hidden_size: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int = 0, k: float = 1.0,
                 tau_init: Optional[float] = None, attn_impl: str = "auto", layer_idx: Optional[int] = None,
                 bias: bool = True, rms_norm_eps: float = 1e-12, head_merge: str = "hcat"):
        check_dim(hidden_size, "hidden_size", minimum=2)
        check_dim(kv_lora_rank, "kv_lora_rank", minimum=2)
        check_dim(qk_nope_head_dim, "qk_nope_head_dim", minimum=2)
        check_dim(qk_rope_head_dim, "qk_rope_head_dim", minimum=2)
        check_dim(v_head_dim, "v_head_dim", minimum=2)
        check_dim(q_lora_rank, "q_lora_rank", minimum=0)
        if q_lora_rank == 1:
            raise ValueError("q_lora_rank must be 0 (no query compression) or an ambient dim >= 2, got 1")
        dn, dr, dv = qk_nope_head_dim - 1, qk_rope_head_dim - 1, v_head_dim - 1
        super().__init__(num_heads=num_heads, k=k, tau_init=math.sqrt(dn + dr) if tau_init is None else tau_init,
                         attn_impl=attn_impl, layer_idx=layer_idx, head_merge=head_merge)
        self.dn, self.dr, self.dv = dn, dr, dv
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        H = num_heads
        if q_lora_rank:
            self.q_a_proj = LorentzLinear(hidden_size, q_lora_rank, k=k, bias=bias)
            self.q_a_layernorm = LorentzRMSNorm(q_lora_rank, k=k, eps=rms_norm_eps)
            self.q_b_proj = LorentzLinear(q_lora_rank, 1 + H * (dn + dr), k=k, bias=bias)
        else:
            self.q_proj = LorentzLinear(hidden_size, 1 + H * (dn + dr), k=k, bias=bias)
        self.kv_a_proj = LorentzLinear(hidden_size, kv_lora_rank, k=k, bias=bias)
        self.kv_a_layernorm = LorentzRMSNorm(kv_lora_rank, k=k, eps=rms_norm_eps)
        self.k_rope_proj = LorentzLinear(hidden_size, qk_rope_head_dim, k=k, bias=bias)
        self.kv_b_proj = LorentzLinear(kv_lora_rank, 1 + H * (dn + dv), k=k, bias=bias)
        self.o_proj = LorentzLinear(self.merged_dim(v_head_dim), hidden_size, k=k, bias=bias)

    def latent(self, x: torch.Tensor, position_embeddings: PositionalTables) -> tuple:
        """What the cache stores for new tokens: ``c_KV [B, 1, T, 1+n_kv]``, rotated ``k^R [B, 1, T, 1+d_r]``."""
        c_kv = self.kv_a_layernorm(self.kv_a_proj(x)).unsqueeze(1)
        k_rope = position_embeddings.rotate(self.k_rope_proj.space(x).unsqueeze(1))
        return c_kv, lift(k_rope, k=self.k)

    def forward(self, x: torch.Tensor, *, position_embeddings: Optional[PositionalTables] = None,
                attention_mask: Optional[AttentionMask] = None, past_key_values=None) -> torch.Tensor:
        B, T, _ = x.shape
        H, dn, dr, dv = self.num_heads, self.dn, self.dr, self.dv
        pos = _NO_POSITIONS if position_embeddings is None else position_embeddings
        q_in = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora_rank else x
        q_s = (self.q_b_proj if self.q_lora_rank else self.q_proj).space(q_in).view(B, T, H, dn + dr).transpose(1, 2)
        q_s = torch.cat([q_s[..., :dn], pos.rotate(q_s[..., dn:])], dim=-1)

        c_kv, k_rope = self.latent(x, pos)
        if past_key_values is not None:
            c_kv, k_rope = past_key_values.update(c_kv, k_rope, self.layer_idx)
        Tk = c_kv.shape[-2]
        kv_s = self.kv_b_proj.space(c_kv.squeeze(1)).view(B, Tk, H, dn + dv).transpose(1, 2)
        # HCat(k^C_h, k^R): concatenated space parts, one recomputed time coordinate (lift).
        k_s = torch.cat([kv_s[..., :dn].to(k_rope.dtype), k_rope[..., 1:].expand(B, H, Tk, dr)], dim=-1)
        q, key, value = lift(q_s, k=self.k), lift(k_s, k=self.k), lift(kv_s[..., dn:], k=self.k)
        out = self.attend(q, key, value, q_pe=q[..., 1 + dn:], k_pe=key[..., 1 + dn:], position_embeddings=pos,
                          attention_mask=attention_mask)
        return self.o_proj(self.merge_heads(out))
