"""Token embeddings on the hyperboloid (paper App. C.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..manifold.lorentz import Lorentz
from ..manifold.math import expmap0, lift, normalize
from .validation import EMBEDDING_MODES
from .storage import RealignAfterLoading


def wrapped_normal_(weight: torch.Tensor, *, k: float, std: float) -> torch.Tensor:
    """Fill ``weight [V, 1+n]`` in place with ``expmap0([0, ε])``, ``ε ~ N(0, std² I_n)`` (wrapped normal)."""
    with torch.no_grad():
        u = torch.zeros_like(weight)
        u[..., 1:].normal_(0.0, std)
        weight.copy_(expmap0(u, k=k).to(weight.dtype))
    return weight


def grown_table(weight: torch.Tensor, num_rows: int, *, k: float, std: float, on_manifold: bool,
                mean_resizing: bool = True) -> torch.Tensor:
    """``weight [V, D]`` cut or grown to ``[num_rows, D]``: the first rows kept, new rows appended.

    New rows are, with ``mean_resizing`` (``transformers``' default for ``resize_token_embeddings``), the mean of
    the old rows; for a table of points (``on_manifold``) that mean is projected back onto ``H_k`` (the Lorentz
    centroid of the table, Eq. 3 with equal weights), so new rows are points too. Otherwise they are a fresh
    draw of the layer's initialisation (normal with ``std``, or wrapped normal for points).
    """
    old = weight.detach()
    kept, extra = old[:num_rows], num_rows - old.shape[0]
    if extra <= 0:
        return kept.clone()
    if mean_resizing:
        # fp64: a one-off edit of the weights outside any forward, named in helm.precision (the naive norm of the
        # mean in normalize needs it far from the origin)
        mean = old.double().mean(0, keepdim=True)
        new = (normalize(mean, k=k) if on_manifold else mean).to(old.dtype).expand(extra, -1)
    else:
        new = old.new_empty(extra, old.shape[1])
        wrapped_normal_(new, k=k, std=std) if on_manifold else nn.init.normal_(new, 0.0, std)
    return torch.cat([kept, new])


def replace_table(module: nn.Module, name: str, table: torch.Tensor) -> None:
    """Set ``module.<name>`` to a new parameter holding ``table``, of the same kind (a ``ManifoldParameter`` stays
    one, on the same manifold) and with the same ``requires_grad``."""
    old = getattr(module, name)
    if hasattr(old, "manifold"):
        import geoopt

        new = geoopt.ManifoldParameter(table, manifold=old.manifold, requires_grad=old.requires_grad)
    else:
        new = nn.Parameter(table, requires_grad=old.requires_grad)
    setattr(module, name, new)


class LorentzEmbedding(RealignAfterLoading, nn.Module):
    """Lookup table of points of ``H^n_k``.

    Modes:
        ``lorentz``: ``weight [V, 1+n]`` is a ``geoopt.ManifoldParameter`` on :class:`helm.manifold.Lorentz`,
            initialised from a wrapped normal and trained by a Riemannian optimiser.
        ``space``: ``weight [V, n]`` is a Euclidean table of space parts; the time coordinate is computed
            on the fly (the stable choice the paper used at 1B).

    Shapes: ``input_ids [...] -> [..., 1+n]``. There is no ``padding_idx``: the padding token's row is trained
    like any other, and padded positions are masked in attention and in the loss.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, k: float = 1.0, mode: str = "space",
                 init_std: float = 0.02):
        super().__init__()
        if mode not in EMBEDDING_MODES:  # any other name would build a table of space parts, silently
            raise ValueError(f"mode must be one of {EMBEDDING_MODES}, got {mode!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.k, self.mode, self.init_std = float(k), mode, init_std
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

    def resize(self, num_embeddings: int, *, mean_resizing: bool = True) -> None:
        """Keep the first ``num_embeddings`` rows, or append new ones (see :func:`grown_table`)."""
        if num_embeddings < 1:  # a negative count would cut the table from its end, silently
            raise ValueError(f"num_embeddings must be >= 1, got {num_embeddings!r}")
        replace_table(self, "weight", grown_table(self.weight, num_embeddings, k=self.k, std=self.init_std,
                                                  on_manifold=self.mode == "lorentz", mean_resizing=mean_resizing))
        self.num_embeddings = num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.weight)
        if self.mode == "lorentz":
            return rows
        return lift(rows, k=self.k)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, k={self.k:g}, mode={self.mode!r}"
