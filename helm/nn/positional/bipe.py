"""BiPE, bilevel positional encoding (He et al. 2024, used by seed 000 §4.2 and App. 8.3.1): an absolute encoding
of the position inside a segment plus a relative encoding of the segment index.

Seed 000 segments text at full stops and newlines; this zoo uses fixed-length segments of ``L`` tokens (see
``POSITIONAL.md``), so position ``p`` splits as

    p = L·s + r,     s = ⌊p / L⌋ (segment index),     r = p mod L ∈ [0, L) (intra-segment index)

(floor division, so negative positions split the same way). Both parts are functions of ``p`` alone: cached
decoding needs no state beyond the position ids.
"""

from __future__ import annotations

import torch
from torch import nn

from ..validation import check, check_dim, init_std as init_std_rule, integer, positive
from .alibi import alibi_slopes
from .base import PositionalEncoding, PositionalTables, check_position_ids, inverse_frequencies
from .rotary import AngleTable, check_pairs

BIPE_ALIBI_SLOPE_SCALE = 96.0  # seed 000 App. 8.3.1: "the slope values are set to 96 times of the original ALiBi's"


def split_positions(position_ids: torch.Tensor, segment_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``p -> (s, r)`` with ``p = L·s + r``, ``s = ⌊p/L⌋``, ``r = p mod L ∈ [0, L)``: integer tensors like ``p``."""
    return (torch.div(position_ids, segment_length, rounding_mode="floor"),
            torch.remainder(position_ids, segment_length))


class BiPE(PositionalEncoding):
    """Intra-segment part of every BiPE kind: ``embed(x_s, p) = x_s + P[p mod L]`` (then the caller lifts).

    ``P [L, n]`` is a learned Euclidean table of space parts (the seed's "learnable absolute positional encoding"
    for the intra-segment level), ``init_std`` 0.02 like ``learned``; ``n`` is the model's space dim. Every
    position is valid (``max_positions = None``): the table is indexed by ``p mod L``. Subclasses add the
    inter-segment encoding on the segment index ``⌊p/L⌋`` inside attention.
    """

    relative = False
    absolute = True
    options = {"segment_length": "bipe_segment_length", "hidden_space_dim": None, "init_std": "initializer_range"}

    def __init__(self, segment_length: int, hidden_space_dim: int, *, init_std: float = 0.02):
        super().__init__()
        self.segment_length = check(segment_length, "segment_length", integer(1))
        self.hidden_space_dim = check_dim(hidden_space_dim, "hidden_space_dim")
        self.init_std = float(check(init_std, "init_std", init_std_rule))
        self.weight = nn.Parameter(torch.empty(segment_length, hidden_space_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.init_std)

    def split(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids [...]`` -> ``(segment ⌊p/L⌋, intra p mod L)``."""
        return split_positions(position_ids, self.segment_length)

    def embed(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token space parts ``[B, T, n]`` at ``position_ids [B, T]`` -> ``x_s + P[p mod L]`` ``[B, T, n]``."""
        check_position_ids(x_s, position_ids)
        if x_s.shape[-1] != self.hidden_space_dim:
            raise ValueError(f"{self.kind}: x_s has space dim {x_s.shape[-1]}, expected hidden_space_dim="
                             f"{self.hidden_space_dim}")
        _, intra = self.split(position_ids.to(self.weight.device))
        return x_s + self.weight[intra].to(x_s.dtype)

    def extra_repr(self) -> str:
        return f"segment_length={self.segment_length}, hidden_space_dim={self.hidden_space_dim}"


class BiPEHoPE(BiPE):
    """``bipe_hope``: intra-segment table + HoPE (HELM Eq. 4) at the segment index (the seed's BiPE-RoPE).

    Queries and keys at position ``p`` are rotated by ``R_{s,Θ} = ⊕_l R(s θ_l)``, ``s = ⌊p/L⌋``,
    ``θ_l = base^(-2l/d)`` (``base = rope_theta``, "kept the same as the original setting"), a Lorentz rotation.
    Hence ``<HoPE_s(q), HoPE_t(k)>_L = -q_t k_t + q_sᵀ R((t - s)Θ) k_s``: the inter-segment part depends on the
    segment difference only (Prop. 4.1 over segments), and tokens of one segment are told apart only by the
    intra-segment table.
    """

    kind = "bipe_hope"
    rotary = True
    pairs = True
    options = {**BiPE.options}

    def __init__(self, segment_length: int, hidden_space_dim: int, head_dim: int, *, base: float = 10000.0,
                 init_std: float = 0.02):
        super().__init__(segment_length, hidden_space_dim, init_std=init_std)
        self.head_dim, self.base = check_pairs(head_dim, self.kind), float(check(base, "rope_theta", positive))
        self.angles = AngleTable(inverse_frequencies(head_dim, self.base))

    @classmethod
    def build(cls, *, head_dim: int, rope_theta: float = 10000.0, segment_length: int = 32,
              hidden_space_dim: int | None = None, init_std: float = 0.02, **_):
        return cls(segment_length, head_dim if hidden_space_dim is None else hidden_space_dim, head_dim,
                   base=rope_theta, init_std=init_std)

    def tables(self, position_ids, q_pos, k_pos, dtype) -> PositionalTables:
        segment, _ = self.split(position_ids)
        cos, sin = self.angles(segment, dtype=dtype)
        return PositionalTables(cos=cos, sin=sin)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, head_dim={self.head_dim}, base={self.base:g}"


class BiPEALiBi(BiPE):
    """``bipe_alibi``: intra-segment table + ALiBi on segment indices with slopes ``96·slope_h`` (seed 000).

    ``bias[b, h, i, j] = -96·slope_h · (⌊p_i/L⌋ - ⌊p_j/L⌋)`` on the logits (not multiplied by ``scale``, like
    ``alibi``); ``slope_h`` are ALiBi's slopes. It depends on the segment difference only.

    Keys' positions are not stored in the cache; the bias reads them from the query's: ``p_j = p_i - (i - j)``
    with ``i, j`` the index positions (:func:`~helm.nn.positional.base.index_positions`), exact wherever index
    differences equal position differences (one row, one packed document, the real tokens of a left-padded row
    — the premise of ``alibi`` and ``hope_boost`` too). Hence the bias needs only the new tokens' position ids,
    in a full forward and in cached decoding alike.
    """

    kind = "bipe_alibi"
    has_score_bias = True
    options = {**BiPE.options}

    def __init__(self, segment_length: int, hidden_space_dim: int, num_heads: int, *, init_std: float = 0.02):
        super().__init__(segment_length, hidden_space_dim, init_std=init_std)
        self.num_heads = check_dim(num_heads, "num_heads")
        self.slopes = tuple(BIPE_ALIBI_SLOPE_SCALE * s for s in alibi_slopes(num_heads))

    @classmethod
    def build(cls, *, head_dim: int, num_heads: int, segment_length: int = 32, hidden_space_dim: int | None = None,
              init_std: float = 0.02, **_):
        return cls(segment_length, head_dim if hidden_space_dim is None else hidden_space_dim, num_heads,
                   init_std=init_std)

    def segment_bias(self, position_ids: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
        """``[B, H, Tq, Tk]`` bias in ``dtype`` for queries at positions ``position_ids [B|1, Tq]`` (index positions
        ``q_pos [B, Tq]``) and keys at index positions ``k_pos [B, Tk]``."""
        key_positions = position_ids.unsqueeze(-1) - (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2))  # [B, Tq, Tk]
        q_seg, _ = self.split(position_ids)
        k_seg, _ = self.split(key_positions)
        delta = (q_seg.unsqueeze(-1) - k_seg).to(dtype).unsqueeze(-3)  # [B, 1, Tq, Tk], exact integers
        slopes = torch.tensor(self.slopes, dtype=dtype, device=position_ids.device)
        return -slopes.view(-1, 1, 1) * delta

    def tables(self, position_ids, q_pos, k_pos, dtype) -> PositionalTables:
        segment_bias = self.segment_bias(position_ids, q_pos, k_pos, dtype)  # once per forward, read by every layer

        def bias(q_s, k_s, scale):
            if q_s.shape[-3] != self.num_heads:
                raise ValueError(f"bipe_alibi was built for num_heads={self.num_heads}, got {q_s.shape[-3]} heads")
            return segment_bias

        return PositionalTables(bias=bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_heads={self.num_heads}"


__all__ = ["BIPE_ALIBI_SLOPE_SCALE", "BiPE", "BiPEALiBi", "BiPEHoPE", "split_positions"]
