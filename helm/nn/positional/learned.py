"""Absolute learned positions (the HELM-D-L / HELM-MiCE-L ablation)."""

from __future__ import annotations

import torch
from torch import nn

from ..validation import check, check_dim, init_std as init_std_rule
from .base import PositionalEncoding, check_position_ids


class LearnedPositionalEncoding(PositionalEncoding):
    """``embed(x_s, p) = x_s + P[p]``: a table added to the token space parts, not an attention-time encoding.

    ``P [max_positions, n]`` is a Euclidean table of space parts added to the token space parts (HRC: the
    caller lifts, so the result is a point); ``n`` is the model's space dim, not a head dim.
    """

    kind = "learned"
    relative = False
    absolute = True
    options = {"hidden_space_dim": None, "init_std": "initializer_range"}

    def __init__(self, max_positions: int, hidden_space_dim: int, *, init_std: float = 0.02):
        super().__init__()
        self.max_positions = check_dim(max_positions, "max_position_embeddings")
        self.hidden_space_dim = check_dim(hidden_space_dim, "hidden_space_dim")
        self.init_std = float(check(init_std, "init_std", init_std_rule))
        self.weight = nn.Parameter(torch.empty(max_positions, hidden_space_dim))
        self.reset_parameters()

    @classmethod
    def build(cls, *, head_dim: int, max_position_embeddings: int, hidden_space_dim: int | None = None,
              init_std: float = 0.02, **_):
        return cls(max_position_embeddings, head_dim if hidden_space_dim is None else hidden_space_dim,
                   init_std=init_std)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.init_std)

    def check_positions(self, position_ids: torch.Tensor) -> None:
        """Every position must be in ``[0, max)`` (a negative one would index the table from its end): a
        ``RuntimeError`` naming ``position_ids``, raised by ``torch._assert_async`` without a host synchronisation
        on accelerators (on the CPU at once)."""
        if torch.compiler.is_compiling():
            return
        inside = ((position_ids >= 0) & (position_ids < self.max_positions)).all()
        torch._assert_async(inside, f"position_ids must lie in [0, max_positions={self.max_positions}) for the "
                                    f"learned positional encoding (its table has {self.max_positions} rows)")

    def embed(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        check_position_ids(x_s, position_ids)
        if x_s.shape[-1] != self.hidden_space_dim:
            raise ValueError(f"learned: x_s has space dim {x_s.shape[-1]}, expected hidden_space_dim="
                             f"{self.hidden_space_dim}")
        self.check_positions(position_ids)
        return x_s + self.weight[position_ids.to(self.weight.device)].to(x_s.dtype)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, hidden_space_dim={self.hidden_space_dim}"


__all__ = ["LearnedPositionalEncoding"]
