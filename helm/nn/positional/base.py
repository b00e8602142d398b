"""What every positional encoding is: a model-level module whose ``forward`` builds one :class:`PositionalTables`
per model forward, which every attention layer then applies (as Llama's ``rotary_emb`` builds ``cos, sin``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch
from torch import nn

from ...precision import stat_dtype

Scale = torch.Tensor | float
ScoreBias = Callable[[torch.Tensor, torch.Tensor, Scale], torch.Tensor]


@dataclass(frozen=True)
class PositionalTables:
    """Position-dependent tensors of one forward, built once by the model and read by every layer.

    * ``cos, sin`` ``[B, T, P]``: rotation of the new tokens' space parts (rotary kinds), ``P = d/2`` pairs;
    * ``alibi_slopes`` ``[H]``: per-head linear distance penalty (every attention impl takes slopes);
    * ``bias``: ``bias(q_s, k_s, scale) -> [B, H, Tq, Tk]``, an additive term on the logits ``scale·<q, k>_L``
      that depends on the content (``hope_boost``); its positions are bound when the tables are built;
    * ``logit_scale``: a float ``s`` multiplying the logit scale, ``scale = s·2/τ`` (every attention path applies
      it, as the temperature ``τ/s``): YaRN's / LongRoPE's attention factor ``a`` enters as ``s = a²``, what
      ``transformers``' ``cos·a, sin·a`` does to ``q·k`` (``POSITIONAL.md``). 1.0 for every unscaled encoding.
    """

    cos: Optional[torch.Tensor] = None
    sin: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None
    bias: Optional[ScoreBias] = None
    logit_scale: float = 1.0

    def rotate(self, x_s: torch.Tensor) -> torch.Tensor:
        """Space parts ``[B, H, T, d]`` (``H`` may be 1) -> ``[B, H, T, d]``; identity without rotary tables."""
        if self.cos is None:
            return x_s
        x = x_s.to(self.cos.dtype)
        cos, signed_sin = (_per_token(t, x) for t in self.pair_tables(x.shape[-1] // 2))
        # x_{2l} cos - x_{2l+1} sin, x_{2l+1} cos + x_{2l} sin (RoFormer / HELM Eq. 4 on interleaved pairs), with the
        # per-coordinate tables (their negation and interleaving) built once per forward instead of in every call
        swapped = x.unflatten(-1, (-1, 2)).roll(1, -1).flatten(-2)  # (x1, x0) per pair; roll is the cheapest swap
        return (x * cos + swapped * signed_sin).to(x_s.dtype)

    def pair_tables(self, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` per coordinate, ``[B, T, 2P]`` for ``P = pairs``: ``(cos_l, cos_l)`` and
        ``(-sin_l, sin_l)`` for pair ``l`` (tables of one shared angle, ``[B, T, 1]``, are broadcast to ``P``); built on
        first use for each ``P`` and shared by every layer of the forward (a cache, not a field: the tables stay
        frozen)."""
        cache = self.__dict__.get("_pair_tables")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_pair_tables", cache)
        tables = cache.get(pairs)
        if tables is None:
            cos, sin = (t.expand(*t.shape[:-1], pairs) for t in (self.cos, self.sin))
            tables = cache[pairs] = (torch.stack((cos, cos), dim=-1).flatten(-2),
                                     torch.stack((-sin, sin), dim=-1).flatten(-2))
        return tables

    def score_bias(self, q_s: torch.Tensor, k_s: torch.Tensor, scale: Scale) -> Optional[torch.Tensor]:
        """``[B, H, Tq, Tk]`` bias on the logits for queries ``q_s [B, H, Tq, d]`` and keys ``k_s``, or None."""
        return None if self.bias is None else self.bias(q_s, k_s, scale)


def inverse_frequencies(dim: int, base: float) -> torch.Tensor:
    """``θ_l = base^(-2l/d)`` for ``l = 0 .. ⌈d/2⌉ - 1`` (``d = dim``; ``max θ_l = θ_0 = 1``), float64 ``[⌈d/2⌉]`` on
    the host: RoPE's angles for ``d`` rotated dims and the sinusoidal table's ``ω_i`` (odd ``d`` allowed there)."""
    exponents = torch.arange((dim + 1) // 2, dtype=torch.float64, device="cpu") * (-2.0 / dim)
    return torch.pow(torch.tensor(float(base), dtype=torch.float64, device="cpu"), exponents)


def index_positions(batch: int, q_len: int, kv_len: int, device,
                    q_offset: int | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of the queries and keys in the key index space, ``[B, Tq]`` and ``[B, Tk]``.

    The queries are the last ``Tq`` keys, or, with ``q_offset`` (a static cache: an int or a 0-dim tensor, read
    without synchronising), the keys ``q_offset .. q_offset + Tq - 1``. Relative encodings only see differences,
    and within one row (or one packed document, or the real tokens of a left-padded row) index differences equal
    position differences.
    """
    k_pos = torch.arange(kv_len, device=device).expand(batch, kv_len)
    if q_offset is None:
        return k_pos[:, kv_len - q_len:], k_pos
    return (torch.arange(q_len, device=device) + q_offset).expand(batch, q_len), k_pos


def check_position_ids(x: torch.Tensor, position_ids: torch.Tensor, name: str = "position_ids") -> None:
    """Static checks only (dtype/shape): no host synchronisation."""
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise TypeError(f"{name} must be an integer tensor (int64), got {position_ids.dtype}")
    if position_ids.dim() != 2 or position_ids.shape[-1] != x.shape[-2]:
        raise ValueError(f"{name} must have shape [B, T] with T = {x.shape[-2]} (the token dim of the input), "
                         f"got {tuple(position_ids.shape)}")


def _per_token(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B, T, P]`` -> ``[B, 1, ..., 1, T, P]`` so it broadcasts over the head dims of ``x [B, ..., T, d]``."""
    return table.reshape(table.shape[0], *([1] * (x.dim() - 3)), *table.shape[1:])


class PositionalEncoding(nn.Module):
    """Base class: no rotation, no bias, no embedding.

    Properties of a kind (class attributes; the registry is the one vocabulary of kinds):
        kind: the registry name.
        relative: the attention logits depend on positions only through ``m - n``.
        rotary: rotates the space parts of queries and keys (a Lorentz rotation; time coordinate unchanged).
        pairs: acts on pairs of space coordinates, so it needs an even number of them.
        has_score_bias: adds a bias to the logits.
        absolute: adds a table to the token embeddings instead of acting in attention (``learned``).
        options: the keyword options of :meth:`build`, each mapped to the config field that supplies it
            (``None``: the model derives it).

    ``forward(position_ids [B, T], *, kv_len) -> PositionalTables``: the model calls it once per forward.
    ``tables(position_ids, q_pos, k_pos, dtype)`` builds the tables from the new tokens' positions and the
    query/key positions the biases compare; subclasses override it.
    """

    kind: ClassVar[str] = "none"
    relative: ClassVar[bool] = True
    rotary: ClassVar[bool] = False
    pairs: ClassVar[bool] = False
    has_score_bias: ClassVar[bool] = False
    absolute: ClassVar[bool] = False
    options: ClassVar[dict] = {}
    max_positions: int | None = None

    @classmethod
    def build(cls, *, head_dim: int, num_heads: int, max_position_embeddings: int, rope_theta: float, **options):
        """The encoding for heads of ``head_dim`` space dims (the model's space dim for ``absolute`` kinds);
        ``options`` are those named in :attr:`options`. Kinds without arguments ignore the rest."""
        return cls()

    def tables(self, position_ids: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
               dtype: torch.dtype) -> PositionalTables:
        """Tables in ``dtype`` (fp32, or fp64 for fp64 models) for the new tokens at ``position_ids [B, T]``;
        biases compare queries at ``q_pos [B, Tq]`` with keys at ``k_pos [B, Tk]``."""
        return PositionalTables()

    def forward(self, position_ids: torch.Tensor, *, kv_len: int, dtype: torch.dtype = torch.float32,
                q_offset: int | torch.Tensor | None = None) -> PositionalTables:
        """Tables for new tokens at ``position_ids [B, T]`` attending to ``kv_len`` keys (cache + new), for
        hidden states of ``dtype``. Biases see index positions (:func:`index_positions`; ``q_offset`` places the
        queries in a static cache's ``kv_len`` slots)."""
        B, T = position_ids.shape
        q_pos, k_pos = index_positions(B, T, kv_len, position_ids.device, q_offset)
        return self.tables(position_ids, q_pos, k_pos, stat_dtype(dtype))

    def rotate(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Stand-alone use: rotate space parts ``[B, H, T, d]`` at ``position_ids [B, T]``."""
        if not self.rotary:
            return x_s
        check_position_ids(x_s, position_ids)
        pos = position_ids.to(x_s.device)
        return self.tables(pos, pos, pos, stat_dtype(x_s.dtype)).rotate(x_s)

    def score_bias(self, q_s: torch.Tensor, k_s: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
                   scale: Scale) -> torch.Tensor | None:
        """Stand-alone use: bias ``[B, H, Tq, Tk]`` for queries at ``q_pos [B, Tq]`` and keys at ``k_pos [B, Tk]``."""
        if not self.has_score_bias:
            return None
        q_pos, k_pos = q_pos.to(q_s.device), k_pos.to(q_s.device)
        return self.tables(q_pos, q_pos, k_pos, stat_dtype(q_s.dtype)).score_bias(q_s, k_s, scale)

    def embed(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token space parts ``[B, T, n]`` -> ``[B, T, n]`` (the caller lifts); identity unless ``absolute``."""
        return x_s


class NoPositionalEncoding(PositionalEncoding):
    """``none``: no positional information at all (scores are trivially relative)."""

    kind = "none"


__all__ = ["NoPositionalEncoding", "PositionalEncoding", "PositionalTables", "Scale", "ScoreBias",
           "check_position_ids", "index_positions", "inverse_frequencies"]
