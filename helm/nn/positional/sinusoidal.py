"""Sinusoidal absolute positions (Vaswani et al. 2017; seeds 001 and 004), added to the token space parts."""

from __future__ import annotations

import torch

from ...precision import stat_dtype
from ..validation import check, check_dim, positive
from .base import PositionalEncoding, check_position_ids, inverse_frequencies
from .rotary import AngleTable


class SinusoidalPositionalEncoding(PositionalEncoding):
    """``embed(x_s, p) = x_s + α·PE(p)``, the textbook table added to the token space parts; the caller lifts.

    ``PE(p)_{2i} = sin(p ω_i)``, ``PE(p)_{2i+1} = cos(p ω_i)``, ``ω_i = base^(-2i/n)`` over the ``n`` space
    dims (seed 001; ``d_model`` of the formula is ``n``, the Lorentz time coordinate is not a feature; for odd
    ``n`` the last ``cos`` is dropped). ``α = scale`` (default 1: the seeds' "directly added"). The Lorentz form
    is the HRC pattern of the ``learned`` kind, ``lift(x_s + α·PE(p))``: a Euclidean sum on the space part with
    the time coordinate recomputed, so the result is on the hyperboloid for any position and the two absolute
    kinds differ only in the table.

    No parameters and no buffers (nothing in the ``state_dict``); no position limit (``max_positions = None``).
    Angles ``p ω_i`` come from :class:`~helm.nn.positional.rotary.AngleTable` (base-256 digits of ``p``,
    per-digit tables in float64), accurate to a few fp32 ulps for every ``|p| < 2^32``, where the naive fp32
    product ``p·ω`` is off by ``ulp(p)`` (0.06 rad at ``p = 10^6``). The table is built in fp32 (fp64 for fp64
    inputs), the sum formed in that dtype and cast back to the dtype of ``x_s``.
    """

    kind = "sinusoidal"
    relative = False
    absolute = True
    options = {"hidden_space_dim": None, "scale": "sinusoidal_scale"}

    def __init__(self, hidden_space_dim: int, *, scale: float = 1.0, base: float = 10000.0):
        super().__init__()
        self.hidden_space_dim = check_dim(hidden_space_dim, "hidden_space_dim")
        self.scale = float(check(scale, "scale", positive))
        self.base = float(check(base, "base", positive))
        self.angles = AngleTable(inverse_frequencies(hidden_space_dim, self.base))

    @classmethod
    def build(cls, *, head_dim: int, hidden_space_dim: int | None = None, scale: float = 1.0, **_):
        return cls(head_dim if hidden_space_dim is None else hidden_space_dim, scale=scale)

    def table(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``position_ids [...]`` (integers) -> ``PE [..., n]`` in ``dtype`` (unscaled; interleaved sin, cos)."""
        cos, sin = self.angles(position_ids, dtype=dtype)
        return torch.stack((sin, cos), dim=-1).flatten(-2)[..., : self.hidden_space_dim]

    def embed(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token space parts ``[B, T, n]`` at ``position_ids [B, T]`` -> ``x_s + α·PE`` ``[B, T, n]``."""
        check_position_ids(x_s, position_ids)
        if x_s.shape[-1] != self.hidden_space_dim:
            raise ValueError(f"sinusoidal: x_s has space dim {x_s.shape[-1]}, expected hidden_space_dim="
                             f"{self.hidden_space_dim}")
        acc = stat_dtype(x_s.dtype)
        pe = self.table(position_ids.to(x_s.device), acc)
        return (x_s.to(acc) + self.scale * pe).to(x_s.dtype)

    def extra_repr(self) -> str:
        return f"hidden_space_dim={self.hidden_space_dim}, scale={self.scale:g}, base={self.base:g}"


__all__ = ["SinusoidalPositionalEncoding"]
