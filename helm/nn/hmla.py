"""Hyperbolic Multi-head Latent Attention, HMLA (paper §4.3, App. B.2)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import StaticLayer

from ..manifold.math import lift
from ..ops.attention import AttentionMask, _normalise, alibi_bias, resolve_attention
from ..precision import HALF, no_autocast, split_hi_lo, stat_dtype, to_stat
from .attention import _NO_POSITIONS, LorentzAttentionBase, PagedBatch, extends_cache, first_cached
from .linear import linear_space, lorentz_linear, space_linear
from .norm import LorentzRMSNorm
from .positional import PositionalTables
from .validation import check_dim


class HMLA(LorentzAttentionBase):
    """Latent-compressed Lorentz attention with a decoupled rotary part.

    All dims are ambient (they count the time coordinate, like the paper's 65 / 33 / 17):

    * ``c_KV = RMSNorm_L(HLT_kv_a(x))`` ``[1+n_kv]`` — the latent, the only per-head-free state cached;
    * ``k^R = PE(HLT_kr(x)_s)`` ``[1+d_r]`` — one rotary key shared by all heads, also cached (the positional
      encoding acts on the ``d_r`` rope coordinates only: rotation, and the score bias of ``hope_boost``);
    * ``k^C_h, v^C_h = HLT_kv_b(c_KV)`` per head ``[1+d_n]``, ``[1+d_v]`` — rebuilt from the cache every step
      (the plain path; absorbed decoding, below, never rebuilds them);
    * ``q^C_h, q^R_h`` from ``HLT_q(x)`` (or through a latent ``c_Q`` when ``q_lora_rank > 0``), ``q^R`` rotated;
    * ``q_h = HCat(q^C_h, q^R_h)``, ``k_h = HCat(k^C_h, k^R)``, Eq. 3 with ``τ`` initialised to
      ``sqrt(d_n + d_r)``; heads joined by HCat (``head_merge="flatten"``: the official code's flattened
      per-head points, see :class:`~helm.nn.attention.LorentzAttentionBase`), then ``HLT_o``.

    The cache (a ``transformers`` ``DynamicCache`` or ``StaticCache``; ``layer_idx`` selects the layer) holds
    ``c_KV`` as its "keys" ``[B, 1, T, 1+n_kv]`` and ``k^R`` as its "values" ``[B, 1, T, 1+d_r]``.

    **Absorbed decoding** (``absorb=True``, config ``hmla_absorb``). The space parts of ``k^C_h`` and ``v^C_h`` are
    linear in the latent ``c = c_KV`` (``kv_b_proj`` is ``W c + b`` on the full ambient latent), so for a query
    ``q_h = [q_t, q^C, q^R]`` and cached token ``j``::

        <q_h, k_hj>_L = (W_k,h^T q^C)·c_j + q^R·k^R_j - q_t k_t,hj + q^C·b_k,h      (the last term: constant in j)
        Σ_j a_j v^C_s,hj = W_v,h Σ_j a_j c_j + b_v,h                                 (Σ_j a_j = 1)

    The key up-projection is absorbed into the query and the value up-projection applied after the weighted
    sum; what the Lorentz lift adds is not linear, so the cache keeps it: per head and token the key time
    ``k_t = sqrt(k + |k^C_s|² + |k^R_s|²)``, and for the centred value ``w = v - c_h`` its time part ``u = v_t - c_t``
    and ``e = <w, w>_L`` (fp32), three scalars appended to the cached ``c_KV`` as columns
    (``[B, 1, T, 1+n_kv+3H]`` in fp32/fp64 caches; in a half-precision cache each fp32 scalar is stored bit for bit
    in two columns). The centroid is then normalised exactly as :mod:`helm.ops.attention` does, ``N = k + E -
    <D, D>_L`` with ``D = Σ a w = [Σ a u, W_v,h (Σ a c - c_0)]``, for a per-head centre ``c_h`` = the value of the
    cache's first key (index 0, latent ``c_0``), read from the cache: fixed for the life of the cache, so the
    scalars of old tokens stay valid (the normalisation is the same for any centre; centring keeps it precise far
    from the origin, and ``w_s = W_v (c - c_0)`` comes from latent differences, so the absorbed path is at least as
    precise as the plain one there). A cached forward of ``T <= absorb_max_query`` tokens (where it costs
    fewer multiply-adds than re-expanding the cache: ``T < n_kv(d_n+d_v)/(2 n_kv - d_n - d_v)``, 31 tiny / 63 at
    120M / 85 at 1B) then costs ``O(T_cache·(n_kv + d_r))`` per head and never runs ``kv_b_proj`` over the cache;
    longer prefills take the plain path, which writes the same scalars; in training mode (``model.train()``) the
    layer never writes them and always takes the plain path (outputs and gradients as before). The absorbed path is
    a named path of :func:`helm.ops.attention.resolve_attention`, taken under every implementation but ``eager``
    (the reference, which forms the weights ``output_attentions`` returns, attends on the plain path while the cache
    keeps the scalars). The result equals the plain path to fp32 rounding (``tests/nn/test_hmla_absorbed.py``).
    Other cache classes (offloaded, quantised), a wrapped ``kv_b_proj`` (PEFT's LoRA) and a cache written without
    the scalars keep the plain layout and path.

    **Continuous batching** (``transformers``' paged cache, seen through :class:`~helm.nn.attention.PagedBatch`):
    the same per-token payload, latent (and scalars) then rotary key, packed into the key and value rows the cache
    allocates (:meth:`cache_payload`; a payload that does not fit is refused naming the config fields); each request
    of the flattened batch is centred on its own first key (:meth:`_update_paged_absorbed`), so the absorbed path
    runs on the varlen layout as it does on a request alone, whenever the step's new tokens (all requests together)
    are at most ``absorb_max_query``.

    Precision (:mod:`helm.precision`): the projections and the absorbed path's score GEMM run in the compute dtype,
    the latter with each head's key time coordinate as ``hi + lo`` columns of its own (``3H`` columns beside the
    latent and the rotary key); the value side (``W_v (c - c_0)``, ``Σ a c``, ``Σ a [u | e]``) and the
    normalisation in the statistics dtype, the named exception of :func:`helm.ops.attention._explicit_attention`.

    Cache bytes per token per layer (fp32: the cached points are fp32 in bf16 models too, their time coordinates
    being computed in fp32; HMHA = ``attention_type="mha"``, per-head keys ``H(1+d)`` and values ``H(1+d)``, plus
    one centred norm per head and token in eval mode, see :class:`~helm.nn.LorentzSelfAttention`)::

        shape            HMHA                         HMLA (1+n_kv + 1+d_r)        absorbed HMLA (+3H)
        helm-mice-120m   780 (+6) floats = 3144 B     65+17 = 82 floats = 328 B    100 floats = 400 B
        helm-mice-1b     1820 (+14) floats = 7336 B   257+65 = 322 floats = 1288 B 364 floats = 1456 B

    ``forward(x [B, T, 1+n], *, position_embeddings: PositionalTables | None, attention_mask: AttentionMask |
    None, past_key_values) -> [B, T, 1+n]`` (tables and mask built once per forward by the model).
    """

    def __init__(self, hidden_size: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int = 0, k: float = 1.0,
                 tau_init: Optional[float] = None, layer_idx: Optional[int] = None, bias: bool = True,
                 rms_norm_eps: float = 1e-12, head_merge: str = "hcat", absorb: bool = False, config=None):
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
                         layer_idx=layer_idx, head_merge=head_merge, config=config)
        self.dn, self.dr, self.dv = dn, dr, dv
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        H = num_heads
        if q_lora_rank:
            self.q_a_proj = space_linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = LorentzRMSNorm(q_lora_rank, k=k, eps=rms_norm_eps)
            self.q_b_proj = space_linear(q_lora_rank, 1 + H * (dn + dr), bias=bias)
        else:
            self.q_proj = space_linear(hidden_size, 1 + H * (dn + dr), bias=bias)
        self.kv_a_proj = space_linear(hidden_size, kv_lora_rank, bias=bias)
        self.kv_a_layernorm = LorentzRMSNorm(kv_lora_rank, k=k, eps=rms_norm_eps)
        self.k_rope_proj = space_linear(hidden_size, qk_rope_head_dim, bias=bias)
        self.kv_b_proj = space_linear(kv_lora_rank, 1 + H * (dn + dv), bias=bias)
        self.o_proj = space_linear(self.merged_dim(v_head_dim), hidden_size, bias=bias)
        self.absorb = bool(absorb)
        # the query length up to which the absorbed path needs fewer multiply-adds than re-expanding the cache
        self.absorb_max_query = max(1, kv_lora_rank * (dn + dv) // max(2 * kv_lora_rank - dn - dv, 1))

    def latent(self, x: torch.Tensor, position_embeddings: PositionalTables) -> tuple:
        """What the cache stores for new tokens: ``c_KV [B, 1, T, 1+n_kv]``, rotated ``k^R [B, 1, T, 1+d_r]``."""
        c_kv = self.kv_a_layernorm(lorentz_linear(self.kv_a_proj, x, k=self.k)).unsqueeze(1)
        k_rope = position_embeddings.rotate(linear_space(self.k_rope_proj, x).unsqueeze(1))
        return c_kv, lift(k_rope, k=self.k)

    def forward(self, x: torch.Tensor, *, position_embeddings: Optional[PositionalTables] = None,
                attention_mask: Optional[AttentionMask] = None, past_key_values=None) -> torch.Tensor:
        B, T, _ = x.shape
        H, dn, dr, dv = self.num_heads, self.dn, self.dr, self.dv
        pos = _NO_POSITIONS if position_embeddings is None else position_embeddings
        q_in = self.q_a_layernorm(lorentz_linear(self.q_a_proj, x, k=self.k)) if self.q_lora_rank else x
        q_proj = self.q_b_proj if self.q_lora_rank else self.q_proj
        q_s = linear_space(q_proj, q_in).view(B, T, H, dn + dr).transpose(1, 2)
        q_s = torch.cat([q_s[..., :dn], pos.rotate(q_s[..., dn:])], dim=-1)

        c_kv, k_rope = self.latent(x, pos)
        L = self.kv_lora_rank
        # a wrapped kv_b_proj (PEFT's LoRA, a quantised linear) is not W c + b with the weight we could absorb, and
        # an offloaded one (accelerate) holds its weight only inside its own forward (meta outside it)
        # (not in training mode: a training forward with a cache stays the plain one, outputs and gradients)
        foreign = past_key_values is not None and foreign_static_layer(past_key_values, self.layer_idx,
                                                                         latent=L, rope=k_rope.shape[-1])
        paged = isinstance(past_key_values, PagedBatch)
        absorbed = (self.absorb and not self.training and past_key_values is not None and not foreign
                    and type(self.kv_b_proj) is nn.Linear and self.kv_b_proj.weight.device.type != "meta"
                    and (paged or extends_cache(past_key_values, self.layer_idx, values=False, plain_width=L)))
        if absorbed and paged:
            c_kv, k_rope, first, centre = self._update_paged_absorbed(past_key_values, c_kv, k_rope)
        elif absorbed:  # the scalars of the new tokens, relative to the centre fixed by the cache's first key
            first = first_cached(past_key_values, self.layer_idx, c_kv, values=False).detach()
            centre = lift(self._kv_heads(first)[..., dn:], k=self.k)
            scalars = self._token_scalars(c_kv, k_rope, first, centre)
            c_kv = torch.cat([c_kv, _pack(scalars, c_kv.dtype)], dim=-1)
        if foreign:
            c_kv, k_rope = update_packed(past_key_values, self.layer_idx, c_kv, k_rope)
        elif past_key_values is not None and not (absorbed and paged):
            c_kv, k_rope = past_key_values.update(c_kv, k_rope, self.layer_idx)
        if resolve_attention(self.attn_implementation, x.device,
                             absorbable=absorbed and T <= self.absorb_max_query) == "absorbed":
            out = self._attend_absorbed(q_s, c_kv, k_rope, first, centre, pos, attention_mask)
            return lorentz_linear(self.o_proj, self.merge_heads(out), k=self.k)
        c_kv = c_kv[..., :L]
        Tk = c_kv.shape[-2]
        kv_s = self._kv_heads(c_kv)
        # HCat(k^C_h, k^R): concatenated space parts, one recomputed time coordinate (lift).
        k_s = torch.cat([kv_s[..., :dn].to(k_rope.dtype), k_rope[..., 1:].expand(B, H, Tk, dr)], dim=-1)
        q, key, value = lift(q_s, k=self.k), lift(k_s, k=self.k), lift(kv_s[..., dn:], k=self.k)
        out = self.attend(q, key, value, q_pe=q[..., 1 + dn:], k_pe=key[..., 1 + dn:], position_embeddings=pos,
                          attention_mask=attention_mask, dtype=q_s.dtype)
        return lorentz_linear(self.o_proj, self.merge_heads(out), k=self.k)

    def _update_paged_absorbed(self, batch: PagedBatch, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple:
        """Absorbed decoding on continuous batching's paged cache (:class:`~helm.nn.attention.PagedBatch`): the
        centre of each request is the value of its own first key, which for a request with cached tokens only the
        cache holds, so the new latents ``c_kv [1, 1, Tq, 1+n_kv]`` and rotary keys ``k_rope [1, 1, Tq, 1+d_r]`` are
        written with their scalars zero, everything the step reads comes back, and the new tokens are written again
        with their scalars, relative to their request's first latent. Returns the latents with scalars and the rotary
        keys every request reads (``[1, 1, Tk, ·]``), and per new token (= per query) the first latent
        ``[1, 1, Tq, 1+n_kv]`` and the value centre ``[1, H, Tq, 1+d_v]`` it fixes, for :meth:`_attend_absorbed`."""
        L, H = self.kv_lora_rank, self.num_heads
        columns = _pack(c_kv.new_zeros(*c_kv.shape[:-1], 3 * H, dtype=stat_dtype(c_kv)), c_kv.dtype)
        keys, rope_keys = batch.update(torch.cat([c_kv, columns], dim=-1), k_rope, self.layer_idx)
        first = keys[..., :L].index_select(2, batch.first_index).detach()  # each new token's request's first key
        centre = lift(self._kv_heads(first)[..., self.dn:], k=self.k)
        scalars = self._token_scalars(c_kv, k_rope, first, centre)
        c_kv = torch.cat([c_kv, _pack(scalars, c_kv.dtype)], dim=-1)
        batch.update(c_kv, k_rope, self.layer_idx, write_only=True)
        return keys.index_copy(2, batch.query_index, c_kv.to(keys.dtype)), rope_keys, first, centre

    def cache_payload(self) -> tuple[int, str]:
        """What one token costs this layer in continuous batching's paged cache, in numbers of the statistics dtype,
        and how that count is made up, naming the config fields (the latent, with absorbed decoding its ``3H``
        scalars, and the rotary key; :meth:`PagedBatch.check_fit`)."""
        scalars = 3 * self.num_heads if self.absorb else 0
        n = self.kv_lora_rank + scalars + 1 + self.dr
        absorbed = f" + 3 x num_attention_heads {self.num_heads} (hmla_absorb)" if scalars else ""
        return n, f"kv_lora_rank {self.kv_lora_rank}{absorbed} + qk_rope_head_dim {1 + self.dr} = {n}"

    def _kv_heads(self, c_kv: torch.Tensor) -> torch.Tensor:
        """``kv_b_proj`` space parts per head: latents ``[B, 1, T, 1+n_kv]`` -> ``[B, H, T, d_n + d_v]``."""
        B, _, T, _ = c_kv.shape
        return linear_space(self.kv_b_proj, c_kv.squeeze(1)).view(B, T, self.num_heads, self.dn + self.dv).transpose(1, 2)

    def _token_scalars(self, c_kv: torch.Tensor, k_rope: torch.Tensor, first: torch.Tensor,
                       centre: torch.Tensor) -> torch.Tensor:
        """``[B, 1, T, 3H]`` for new latents ``c_kv [B, 1, T, 1+n_kv]``: per head the key time coordinate (as the plain
        path lifts ``HCat(k^C, k^R)``), and for the centred value ``w = v - c`` (``c``: the value of the first key's
        latent ``first``) its time part ``u = v_t - c_t`` and ``e = <w, w>_L``; laid out ``[k_t | u | e]``, fp32 (fp64
        for fp64 inputs).

        ``w_s = W_v (c_KV - c_0)`` is taken from the latent difference and ``u = w_s·(w_s + 2 c_s) / (v_t + c_t)``
        without cancellation, so both stay precise when the values cluster far from the origin; ``w_s`` is on the
        value side, in the statistics dtype like the ``W_v (Σ a c - c_0)`` it is normalised against."""
        B, _, T, _ = c_kv.shape
        H, dn, dv = self.num_heads, self.dn, self.dv
        k_c = to_stat(self._kv_heads(c_kv)[..., :dn])
        k_t = (k_c.square().sum(-1) + to_stat(k_rope[..., 1:]).square().sum(-1) + self.k).sqrt()  # [B, H, T]
        acc = k_c.dtype
        w_v = self.kv_b_proj.weight.view(H, dn + dv, -1)[:, dn:].to(acc)
        with no_autocast(c_kv.device.type):
            w_s = torch.matmul((c_kv - first).to(acc), w_v.transpose(-1, -2))  # [B, H, T, d_v]
        c_s, c_t = centre[..., 1:], centre[..., 0]
        v_t = ((c_s + w_s).square().sum(-1) + self.k).sqrt()
        u = (w_s * (w_s + 2 * c_s)).sum(-1) / (v_t + c_t)
        e = w_s.square().sum(-1) - u.square()
        return torch.stack([k_t.to(u.dtype), u, e], dim=-1).permute(0, 2, 3, 1).reshape(B, 1, T, 3 * H)

    def _attend_absorbed(self, q_s: torch.Tensor, keys: torch.Tensor, k_rope: torch.Tensor, first: torch.Tensor,
                         centre: torch.Tensor, pos: PositionalTables, mask: Optional[AttentionMask]) -> torch.Tensor:
        """Eq. 3 in the latent space (see the class docstring): queries ``q_s [B, H, Tq, d_n+d_r]`` (space parts,
        rotated), the cache's ``keys [B, 1, Tk, 1+n_kv+…]`` (latents and scalars) and ``k_rope [B, 1, Tk, 1+d_r]``,
        the first key's latent ``first [B, 1, 1, 1+n_kv]`` and the value centres ``[B, H, 1, 1+d_v]`` it fixes (or one
        per query, ``[1, 1, Tq, 1+n_kv]`` and ``[1, H, Tq, 1+d_v]``: a flattened continuous batch, each query with
        its request's).
        Returns the per-head centroids ``[B, H, Tq, 1+d_v]`` (fp32, or fp64 for fp64 inputs)."""
        B, H, Tq, _ = q_s.shape
        L, dn, dr, Tk = self.kv_lora_rank, self.dn, self.dr, keys.shape[-2]
        gemm = q_s.dtype  # the projections' output dtype: the compute dtype
        acc = stat_dtype(gemm)
        z = keys[:, 0, :, :L].to(acc)  # [B, Tk, 1+n_kv] and [B, Tk, 3H]: views of the cache in fp32 caches
        scalars = _unpack(keys[:, 0, :, L:], acc).to(acc)
        w = self.kv_b_proj.weight.to(acc).view(H, dn + self.dv, L)
        scale = (2.0 / self.logit_tau(pos)).to(acc)  # s·2/τ, s = pos.logit_scale (YaRN's a²)
        q_f = q_s.to(acc)
        q_t = (q_f.square().sum(-1, keepdim=True) + self.k).sqrt()  # [B, H, Tq, 1]
        k_r = k_rope[:, 0, :, 1:].to(acc)  # [B, Tk, d_r]
        # <q, k>_L up to a constant in j as one GEMM: [W_k^T q^C | q^R | time] · [c_j | k^R_j | k_t,j], the time
        # columns of head h (-q_t against k_t,hj; a hi + lo pair in half precision) zero in the other heads' rows
        with no_autocast(q_s.device.type):
            q_lat = torch.matmul(q_s[..., :dn], w[:, :dn].to(gemm))  # [B, H, Tq, 1+n_kv] (q^C·b_k: constant in j)
            k_t = scalars[..., :H]  # [B, Tk, H]
            if gemm in HALF:
                q_hi, q_lo = split_hi_lo(-q_t, gemm)
                k_hi, k_lo = split_hi_lo(k_t, gemm)
                q_time, k_time = torch.cat([q_hi, q_hi, q_lo], -1), torch.stack([k_hi, k_lo, k_hi], -1)
            else:
                q_time, k_time = (-q_t).to(gemm), k_t.to(gemm).unsqueeze(-1)
            c = q_time.shape[-1]
            own = torch.eye(H, dtype=gemm, device=q_s.device).view(1, H, 1, H, 1)
            q_time = (own * q_time.unsqueeze(-2)).reshape(B, H, Tq, H * c)
            qm = torch.cat([q_lat, q_s[..., dn:], q_time], dim=-1).reshape(B, H * Tq, -1)
            km = torch.cat([z.to(gemm), k_r.to(gemm), k_time.reshape(B, Tk, H * c)], dim=-1)
            logits = to_stat(torch.bmm(qm, km.transpose(1, 2))).view(B, H, Tq, Tk).to(acc) * scale
        bias = pos.score_bias(q_f[..., dn:], k_r.unsqueeze(1), scale)
        if bias is not None:
            logits = logits + bias.to(acc)
        if mask is None:
            mask = AttentionMask(B, Tq, Tk, device=q_s.device)
        if pos.alibi_slopes is not None:
            logits = logits + alibi_bias(pos.alibi_slopes, Tq, Tk, query_index=mask.query_index()).to(acc)
        keep = mask.keep()
        if keep is not None:
            logits = logits.masked_fill(~keep, torch.finfo(acc).min)
        a = logits.softmax(-1).view(B, H * Tq, Tk)
        # the value side in the statistics dtype (helm.precision): D = Σ a w, the space part W_v (Σ a c_j - c_0)
        # (Σ a = 1), the time part Σ a u and E = Σ a e from the scalars
        with no_autocast(q_s.device.type):
            lat = torch.bmm(a, z).view(B, H, Tq, L) - first.to(acc)
            d_s = torch.matmul(lat, w[:, dn:].transpose(-1, -2))  # [B, H, Tq, d_v]
            # Σ_j a_hj [u | e]_j,h': every head against every head's scalars (2H columns), then the diagonal h' = h
            ue = torch.bmm(a, scalars[..., H:]).view(B, H, Tq, 2, H).diagonal(dim1=1, dim2=4).permute(0, 3, 1, 2)
        return _normalise(torch.cat([ue[..., :1], d_s, ue[..., 1:]], dim=-1), centre.to(acc), self.k)


def foreign_static_layer(cache, layer_idx: int, *, latent: int, rope: int) -> bool:
    """Whether layer ``layer_idx`` of ``cache`` is a ``StaticLayer`` allocated before HMLA wrote to it with a shape
    that is not HMLA's (``keys [B, 1, T, latent (+ scalars)]``, ``values [B, 1, T, rope]``): the ``[B, h, T, D]`` of
    ``transformers.configuration_utils.get_head_shapes`` that ``StaticCache.early_initialization`` gives every layer,
    which ``transformers``' ExecuTorch export calls (keys and values of one width, the config's heads). HMLA then
    stores its two latents packed in those slots (:func:`update_packed`)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or layer_idx >= len(layers):
        return False
    layer = layers[layer_idx]
    if type(layer) is not StaticLayer or not layer.is_initialized:
        return False
    keys, values = layer.keys, layer.values
    return not (keys.shape[1] == 1 and values.shape[1] == 1 and keys.shape[-1] >= latent and values.shape[-1] == rope)


def update_packed(cache, layer_idx: int, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple:
    """Write ``c_kv [B, 1, T, W_k]`` and ``k_rope [B, 1, T, W_r]`` into a foreign static layer's keys and values
    ``[B, h, T_max, D]`` (:func:`foreign_static_layer`), each token's latent zero-padded to ``h·D`` numbers and laid
    out over the ``h`` rows, and read the whole cache back in HMLA's layout ``[B, 1, T_max, W]``."""
    layer = cache.layers[layer_idx]
    keys, values = cache.update(_to_rows(c_kv, layer.keys, "kv_lora_rank"),
                                _to_rows(k_rope, layer.values, "qk_rope_head_dim"), layer_idx)
    return _from_rows(keys, c_kv.shape[-1]), _from_rows(values, k_rope.shape[-1])


def _to_rows(x: torch.Tensor, stored: torch.Tensor, name: str) -> torch.Tensor:
    B, _, T, W = x.shape
    h, D = stored.shape[1], stored.shape[-1]
    if W > h * D:
        raise ValueError(f"the static cache was allocated with {h} heads x head_dim {D} = {h * D} numbers per token, "
                         f"but HMLA stores {W} per token for its latent ({name}); allocate it with "
                         f"num_heads x head_dim >= {W}")
    return F.pad(x, (0, h * D - W)).to(stored.dtype).view(B, T, h, D).transpose(1, 2)


def _from_rows(stored: torch.Tensor, width: int) -> torch.Tensor:
    B, h, T, D = stored.shape
    return stored.transpose(1, 2).reshape(B, T, h * D)[..., :width].unsqueeze(1)


def _pack(scalars: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scalars as columns of a cache of ``dtype``: as they are, or (a half-precision cache) their fp32 bytes
    reinterpreted as two columns each, so they are stored exactly."""
    return scalars.to(dtype) if scalars.dtype.itemsize <= dtype.itemsize else scalars.contiguous().view(dtype)


def _unpack(columns: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_pack` (``acc``: the fp32 / fp64 accumulation dtype)."""
    width = torch.float64 if acc == torch.float64 else torch.float32
    return columns if columns.dtype.itemsize >= width.itemsize else columns.contiguous().view(width)
