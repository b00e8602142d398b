"""ALiBi (Press et al.): a per-head linear distance penalty on the logits."""

from __future__ import annotations

import torch

from ...precision import stat_dtype
from ..validation import check_dim
from .base import PositionalEncoding, PositionalTables


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi head slopes (Press et al.): ``2^(-8h/n)`` for ``h = 1..n`` when ``n`` is a power of two.

    Otherwise the slopes of the largest power of two ``p < n`` followed by every other slope of ``2p``
    (the reference implementation's rule), so slopes stay a geometric-like spread in ``(0, 1)``.
    """

    def power_of_two(n: int) -> list:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if num_heads & (num_heads - 1) == 0:
        return tuple(power_of_two(num_heads))
    p = 1 << (num_heads.bit_length() - 1)
    return tuple(power_of_two(p) + power_of_two(2 * p)[0::2][: num_heads - p])


def alibi_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """ALiBi logits bias ``b[b, h, i, j] = -slope_h · (q_pos[b, i] - k_pos[b, j])``.

    Shapes: ``q_pos [B, Tq]``, ``k_pos [B, Tk]`` (integers), ``slopes [H]`` -> ``[B, H, Tq, Tk]`` in the
    dtype of ``slopes``. Keys after the query (``Δ < 0``) get a positive bias; the causal mask removes them.
    """
    delta = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)).to(slopes.dtype)
    return -slopes.view(-1, 1, 1) * delta.unsqueeze(-3)


class ALiBi(PositionalEncoding):
    """ALiBi: ``bias[b, h, i, j] = -slope_h · (q_pos_i - k_pos_j)``, data-independent and linear in distance.

    Added to the final logits as is (not multiplied by ``scale``), like the original on ``q·k/√d``. In a
    model the tables carry only the slopes: every attention implementation, the Triton kernel included,
    applies them itself at index positions.
    """

    kind = "alibi"
    has_score_bias = True

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = check_dim(num_heads, "num_heads")
        self.slopes = alibi_slopes(num_heads)
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @classmethod
    def build(cls, *, num_heads: int, **_):
        return cls(num_heads)

    def slopes_tensor(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._cache:
            slopes = torch.tensor(self.slopes, dtype=dtype, device=device)
            if torch.compiler.is_compiling():  # filling the cache in a compiled call would recompile the next one
                return slopes
            self._cache[key] = slopes
        return self._cache[key]

    def tables(self, position_ids, q_pos, k_pos, dtype) -> PositionalTables:
        return PositionalTables(alibi_slopes=self.slopes_tensor(position_ids.device, torch.float32))

    def score_bias(self, q_s, k_s, q_pos, k_pos, *, scale):
        """Stand-alone use: the dense bias ``[B, H, Tq, Tk]`` the attention builds from the slopes."""
        if q_s.shape[-3] != self.num_heads:
            raise ValueError(f"alibi was built for num_heads={self.num_heads}, got q_s with {q_s.shape[-3]} heads")
        dtype = stat_dtype(q_s)
        return alibi_bias(q_pos.to(q_s.device), k_pos.to(q_s.device), self.slopes_tensor(q_s.device, dtype))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


__all__ = ["ALiBi", "alibi_bias", "alibi_slopes"]
