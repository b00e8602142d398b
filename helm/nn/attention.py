"""Hyperbolic multi-head self-attention (paper Eq. 3) with a ``transformers`` cache."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer, StaticLayer

try:  # transformers' continuous batching: its paged KV cache and how it sizes the cache's rows (5.24's modules)
    from transformers.generation.continuous_batching import PagedAttentionCache
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads
except ImportError:  # another layout of transformers: no forward gets a paged cache HELM would recognise
    PagedAttentionCache = None

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
               value_centre: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None,
               key_time: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Eq. 3 on points ``q, key [B, H, T, 1+d]``, ``value [B, H, Tk, 1+dv]`` (with ``value_centre``: one more
        column, the values' centred norms; with ``key_time``, ``key`` is the keys' space parts: see
        :func:`helm.ops.lorentz_attention`); ``q_pe, k_pe`` are the space
        coordinates the positional encoding acts on (its score bias reads them). The logit scale is
        ``position_embeddings.logit_scale · 2/τ`` (:meth:`logit_tau`). ``dtype``: the GEMM dtype of ``q·k``, that of
        the projections' outputs (:mod:`helm.precision`)."""
        tau = self.logit_tau(position_embeddings)
        bias = position_embeddings.score_bias(q_pe, k_pe, 2.0 / tau)
        return lorentz_attention(q, key, value, k=self.k, tau=tau, mask=attention_mask, position_bias=bias,
                                 alibi_slopes=position_embeddings.alibi_slopes, impl=self.attn_implementation,
                                 value_centre=value_centre, dtype=dtype, key_time=key_time)


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
    The cache stores per-head Lorentz keys (after the positional rotation) and values with one more column
    ``[B, H, T, 1+d+1] = [v | e]``: the centred norm ``e = <v - c, v - c>_L`` for the centre ``c`` = the value of
    the cache's first key (per batch row and head, fixed for the life of the cache). Where the compute dtype (that
    of the projections' outputs) is not the points' (bf16 under bf16 autocast), the keys are stored as the ``q·k``
    products read them, their space parts ``[B, H, T, d]`` in the compute dtype, and their time coordinates ``k_t``
    as a last value column, ``[v | e | k_t]`` in the values' dtype (fp32); the first write fixes the layout and
    dtype. Not in training mode, whose forward with a cache stays that of ``helm.ops``. A decode step then reads the
    cache as it is: the kernel takes the keys' space parts and ``k_t`` without a cast over the cache, and normalises
    the centroid from ``Σ ν [v | e]`` (``sdpa`` too, and ``eager`` as a half-precision fallback; requested,
    ``eager`` recomputes its centres, the reference), instead of re-centring the whole cache every step
    (:func:`helm.ops.lorentz_attention`, ``value_centre``, ``key_time``). Caches other than ``transformers``'
    dynamic and static ones, and a cache written without the columns, keep plain keys and values: among them
    continuous batching's paged cache (a :class:`PagedBatch`), whose rows hold exactly the keys and values
    (:meth:`cache_payload`)."""

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
        centre = key_time = None
        # not in training mode: its forward keeps the per-document centres of helm.ops (outputs and gradients)
        if past_key_values is not None and not self.training and extends_cache(
                past_key_values, self.layer_idx, values=True, plain_width=self.head_dim):
            centre = first_cached(past_key_values, self.layer_idx, value, values=True).detach()
            # keys as q·k reads them where its dtype is not the points' (autocast), in the layout and dtype of the
            # cache's first write from then on (a static cache's buffers take no other)
            stored = past_key_values.layers[self.layer_idx] if self.layer_idx < len(past_key_values.layers) else None
            written = stored is not None and stored.is_initialized
            split = stored.keys.shape[-1] < self.head_dim if written else q_s.dtype != key.dtype
            value = torch.cat([value, sqnorm(value - centre, keepdim=True), *([key[..., :1]] if split else [])], -1)
            key = key[..., 1:].to(stored.keys.dtype if written else q_s.dtype) if split else key
            key, value = past_key_values.update(key, value, self.layer_idx)
            key_time, value = (value[..., -1], value[..., :-1]) if split else (None, value)
        elif past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out = self.attend(q, key, value, q_pe=q[..., 1:], k_pe=key if key_time is not None else key[..., 1:],
                          position_embeddings=pos, attention_mask=attention_mask, value_centre=centre,
                          dtype=q_s.dtype, key_time=key_time)
        return lorentz_linear(self.o_proj, self.merge_heads(out), k=self.k)

    def cache_payload(self) -> tuple[int, str]:
        """What one token costs this layer in continuous batching's paged cache, in numbers of the statistics dtype
        (the cached points'), and how that count is made up, naming the config fields: keys and values, ``H`` heads
        of ``1 + d`` each (:meth:`PagedBatch.check_fit`)."""
        n = 2 * self.num_heads * self.head_dim
        return n, f"2 x num_attention_heads {self.num_heads} x head_dim {self.head_dim} = {n}"


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


class PagedBatch:
    """One forward of ``transformers``' continuous batching on its paged KV cache (``PagedAttentionCache``), as the
    attention layers see it: a cache whose :meth:`update` takes what a layer caches per token, of any widths, and
    returns what every request of the step reads.

    The step's requests come flattened into one row (batch 1): their new tokens one request after another
    (``Tq``), each request reading its cached tokens and its new ones (``Tk`` keys, request after request, as
    ``cu_seq_lens_k`` counts them). The per-forward keywords of ``transformers`` (``cu_seq_lens_q``,
    ``cu_seq_lens_k``, ``read_index``, ``write_index``, ...: ``batch_kwargs``) are handed to the cache's ``update``
    as a fresh dict at every call, since it rewrites some of them in place.

    The cache allocates, per token and layer, a key row and a value row of ``[num_key_value_heads, head_dim]``
    numbers of the model's dtype, both read from the text config as ``transformers`` reads them
    (``num_attention_heads`` and ``hidden_size // num_attention_heads`` where the config has no such field). A layer's
    keys ``[1, h_k, T, W_k]`` and values ``[1, h_v, T, W_v]`` are laid out per token as one vector of
    ``h_k·W_k + h_v·W_v`` numbers, stored bit for bit (a cache of a narrower dtype takes each number as several of
    its columns, as HMLA's scalars in a half-precision cache), zero-padded to the two rows and split between them;
    reading reverses it. HELM-D's keys and values (``H`` heads of ``1 + d``, fp32) fill an fp32 model's two rows
    exactly; HMLA's latent, its absorbed-decoding scalars and rotary key use the start of them.

    Derived once per forward (int64, on the device, no host read):

    * ``query_index [Tq]``: the key index of each new token among the ``Tk`` keys (its own key), the queries' place
      for :class:`helm.ops.AttentionMask`;
    * ``first_index [Tq]``: the key index of the first token of each new token's request (HMLA's centre);
    * ``key_request [Tk]``: the request of each key, the mask's segment ids (values are centred per request).
    """

    # the keywords of a continuous-batching forward that describe its batch (transformers' PagedAttentionArgs)
    KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "read_index", "write_index",
              "block_table")

    def __init__(self, cache, batch_kwargs: dict, *, q_len: int, device):
        if batch_kwargs.get("block_table") is not None:
            raise ValueError("continuous batching's block-table decoding (flash attention's paged kernel) reads the "
                             "cache inside the kernel; HELM attention needs the keys: use attn_implementation 'sdpa' "
                             "or 'eager'")
        read_index = batch_kwargs["read_index"]
        cu_k = batch_kwargs["cu_seq_lens_k"]
        if isinstance(cu_k, dict):
            if len(cu_k) != 1:
                raise ValueError(f"HELM layers are all full attention; the paged cache has layer groups {list(cu_k)}")
            (cu_k,) = cu_k.values()
        self.cache, self.batch_kwargs = cache, dict(batch_kwargs)
        # every request reads its whole cache after the write; none read (pure prefill): the new tokens only
        self.kv_len = read_index[0].numel() or q_len
        cu_q = batch_kwargs["cu_seq_lens_q"].to(device=device, dtype=torch.int64)
        cu_k = cu_k.to(device=device, dtype=torch.int64)
        new = torch.arange(q_len, device=device)
        # the request of each new token (cumulative lengths may plateau: padding requests of length 0; a padding
        # token after the last request counts as the last one's, its row being masked)
        request = torch.searchsorted(cu_q[1:], new, right=True).clamp_max(cu_q.numel() - 2)
        self.query_index = (new + cu_k[request + 1] - cu_q[request + 1]).clamp(0, self.kv_len - 1)
        self.first_index = cu_k[request].clamp_max(self.kv_len - 1)
        self.key_request = torch.searchsorted(cu_k[1:], torch.arange(self.kv_len, device=device), right=True)

    @staticmethod
    def is_paged(cache) -> bool:
        """Whether ``cache`` is ``transformers``' paged cache of continuous batching."""
        return PagedAttentionCache is not None and isinstance(cache, PagedAttentionCache)

    @staticmethod
    def rows(config) -> tuple[int, int]:
        """``(heads, head_dim)`` of the paged cache's key row and value row for ``config`` (a text config), as
        ``transformers`` allocates them."""
        return find_num_key_value_heads(config), find_head_dim(config)

    @staticmethod
    def stored_width(numbers: int, payload_dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
        """Columns of a ``cache_dtype`` cache that ``numbers`` of ``payload_dtype`` take, stored bit for bit."""
        return numbers * max(1, payload_dtype.itemsize // cache_dtype.itemsize)

    @classmethod
    def check_fit(cls, config, cache_dtype: torch.dtype, payload_dtype: torch.dtype, numbers: int,
                  what: str, layer: str) -> None:
        """``ValueError`` naming the config fields when ``numbers`` of ``payload_dtype`` per token (``what``: how
        the count is made up) do not fit the two rows a ``cache_dtype`` paged cache allocates for ``config``."""
        heads, head_dim = cls.rows(config)
        capacity = 2 * heads * head_dim
        width = cls.stored_width(numbers, payload_dtype, cache_dtype)
        if width > capacity:
            stored = "" if width == numbers else f", stored bit for bit as {width} {cache_dtype} columns"
            hint = (f"; load the model in {payload_dtype} (dtype={payload_dtype}) to serve it with continuous "
                    "batching" if width > numbers else "")
            raise ValueError(f"continuous batching's paged cache holds 2 x {heads} x {head_dim} = {capacity} "
                             f"{cache_dtype} numbers per token and layer (num_key_value_heads, else "
                             f"num_attention_heads, times head_dim, else hidden_size // num_attention_heads, of the "
                             f"config), but {layer} caches {what} {payload_dtype} numbers{stored}{hint}")

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *,
               write_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' ``key [1, h_k, Tq, W_k]`` and ``value [1, h_v, Tq, W_v]`` to layer ``layer_idx``
        and return every key and value the step's requests read, ``[1, h_k, Tk, W_k]`` and ``[1, h_v, Tk, W_v]``,
        in their dtypes. ``write_only``: write, and return the inputs (nothing is read)."""
        _, hk, T, wk = key.shape
        hv, wv = value.shape[1], value.shape[-1]
        dtype = torch.promote_types(key.dtype, value.dtype)
        payload = torch.cat([x.transpose(1, 2).reshape(1, T, -1).to(dtype) for x in (key, value)], dim=-1)
        heads, head_dim = self.rows(self.cache.config)
        cache_dtype = self.cache.dtype
        width = self.stored_width(payload.shape[-1], dtype, cache_dtype)
        if width > 2 * heads * head_dim:
            self.check_fit(self.cache.config, cache_dtype, dtype, payload.shape[-1], str(payload.shape[-1]),
                           f"layer {layer_idx}")
        stored = payload.contiguous().view(cache_dtype) if width > payload.shape[-1] else payload.to(cache_dtype)
        rows = F.pad(stored, (0, 2 * heads * head_dim - width)).view(1, T, 2, heads, head_dim)
        kwargs = dict(self.batch_kwargs)
        if write_only:
            kwargs["read_index"] = [index[:0] for index in kwargs["read_index"]]
        k_rows, v_rows = self.cache.update(rows[:, :, 0].transpose(1, 2), rows[:, :, 1].transpose(1, 2), layer_idx,
                                           kwargs)
        if write_only:
            return key, value
        read = torch.stack([k_rows, v_rows], dim=2).transpose(1, 3).reshape(1, -1, 2 * heads * head_dim)[..., :width]
        read = read.contiguous().view(dtype) if width > payload.shape[-1] else read.to(dtype)
        Tk = read.shape[1]
        keys, values = read.split([hk * wk, hv * wv], dim=-1)
        return (keys.reshape(1, Tk, hk, wk).transpose(1, 2).to(key.dtype),
                values.reshape(1, Tk, hv, wv).transpose(1, 2).to(value.dtype))


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
