"""Token embeddings on the hyperboloid (paper App. C.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..manifold.lorentz import Lorentz
from ..manifold.math import expmap0, lift
from .validation import EMBEDDING_MODES, check, check_choice, check_dim, check_k, init_std as init_std_rule


def wrapped_normal_(weight: torch.Tensor, *, k: float, std: float) -> torch.Tensor:
    """Fill ``weight [V, 1+n]`` in place with ``expmap0([0, ε])``, ``ε ~ N(0, std² I_n)`` (wrapped normal)."""
    with torch.no_grad():
        u = torch.zeros_like(weight)
        u[..., 1:].normal_(0.0, std)
        weight.copy_(expmap0(u, k=k).to(weight.dtype))
    return weight


class LorentzEmbedding(nn.Module):
    """Lookup table of points of ``H^n_k``.

    Modes:
        ``lorentz``: ``weight [V, 1+n]`` is a ``geoopt.ManifoldParameter`` on :class:`helm.manifold.Lorentz`,
            initialised from a wrapped normal and trained by a Riemannian optimiser.
        ``space``: ``weight [V, n]`` is a Euclidean table of space parts; the time coordinate is computed
            on the fly (the stable choice the paper used at 1B).

    Shapes: ``input_ids [...] -> [..., 1+n]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, k: float = 1.0, mode: str = "space",
                 init_std: float = 0.02, padding_idx: int | None = None):
        super().__init__()
        check_dim(num_embeddings, "num_embeddings")
        check_dim(embedding_dim, "embedding_dim", minimum=2)
        check_k(k, "k")
        check_choice(mode, "mode", EMBEDDING_MODES)
        check(init_std, "init_std", init_std_rule)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.k, self.mode, self.init_std, self.padding_idx = float(k), mode, init_std, padding_idx
        if mode == "lorentz":
            import geoopt

            self._manifold_parameters = ("weight",)
            self.weight = geoopt.ManifoldParameter(torch.empty(num_embeddings, embedding_dim),
                                                   manifold=Lorentz(self.k))
        else:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim - 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.mode == "lorentz":
            wrapped_normal_(self.weight, k=self.k, std=self.init_std)
        else:
            nn.init.normal_(self.weight, 0.0, self.init_std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.weight)
        if self.mode == "lorentz":
            return rows
        return lift(rows, k=self.k)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, k={self.k:g}, mode={self.mode!r}"
