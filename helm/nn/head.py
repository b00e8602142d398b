"""Language-model heads on Lorentz features."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..manifold.lorentz import Lorentz
from ..manifold.math import positive_exp
from ..ops.lm_loss import linear_cross_entropy
from ..precision import autocast_dtype, compute_dtype, to_stat
from .validation import LM_HEAD_MODES, check, check_choice, check_dim, temperature
from .embedding import grown_table, replace_table, wrapped_normal_
from .storage import RealignAfterLoading


class LorentzLMHead(RealignAfterLoading, nn.Module):
    """Logits from points ``x`` of ``H^n_k`` (apply the final ``LorentzRMSNorm`` before it).

    Modes:
        ``linear`` (paper code): a Euclidean linear map on the full vector, ``logits = W x (+ b)``.
        ``distance`` (fully hyperbolic): class prototypes ``p_c`` on ``H^n_k`` (a ``ManifoldParameter``),
            ``logits_c = -d²(x, p_c) / τ + b_c = (2k + 2<x, p_c>_L) / τ + b_c`` with learnable ``τ > 0``.

    Shapes: ``[..., 1+n] -> [..., V]``; logits in at least fp32, except ``linear`` under autocast: there the
    autocast dtype, as ``nn.Linear`` (Llama's ``lm_head``) gives, and the loss upcasts them (transformers'
    ``ForCausalLMLoss``). ``head(x, targets=t)`` returns the summed cross-entropy instead, fused and chunked (no
    ``[..., V]`` logits; the training path of ``…ForCausalLM``).

    Precision: the GEMM over the (space) coordinates runs in :func:`~helm.precision.compute_dtype` (the autocast
    dtype under autocast, else the weights'); in ``distance`` mode the time coordinates stay out of it:
    ``<x, p>_L = x_s·p_s - x_t p_t`` adds the fp32 product ``x_t p_t`` to the upcast GEMM, and ``2k + 2<x, p>_L``
    and the division by ``τ`` are fp32.

    The config checks the sizes, ``k`` and ``init_std`` once; the layer checks only what would otherwise pass
    silently or fail without naming the argument: ``mode`` (any other string was ``distance``) and ``tau``
    (``log τ``). ``Lorentz`` checks ``k`` of the prototypes.
    """

    def __init__(self, hidden_size: int, vocab_size: int, *, k: float = 1.0, mode: str = "linear",
                 bias: bool = False, init_std: float = 0.02, tau: float = 1.0):
        super().__init__()
        check_choice(mode, "mode", LM_HEAD_MODES)
        check(tau, "tau", temperature)
        self.k, self.mode, self.init_std, self.init_tau = float(k), mode, init_std, float(tau)
        if mode == "linear":
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        else:
            import geoopt

            self._manifold_parameters = ("weight",)
            self.weight = geoopt.ManifoldParameter(torch.empty(vocab_size, hidden_size), manifold=Lorentz(self.k))
            self.log_tau = nn.Parameter(torch.empty(1, dtype=torch.float32))  # [1], not []: FSDP2 shards dim 0
        self.bias = nn.Parameter(torch.empty(vocab_size)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.mode == "linear":
                nn.init.normal_(self.weight, 0.0, self.init_std)
            else:
                wrapped_normal_(self.weight, k=self.k, std=self.init_std)
                self.log_tau.fill_(math.log(self.init_tau))
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def resize(self, vocab_size: int, *, mean_resizing: bool = True) -> None:
        """Keep the first ``vocab_size`` rows (and biases), or append new ones: rows as in
        :func:`helm.nn.embedding.grown_table` (prototypes on ``H_k`` in ``distance`` mode), biases 0."""
        check_dim(vocab_size, "vocab_size")
        replace_table(self, "weight", grown_table(self.weight, vocab_size, k=self.k, std=self.init_std,
                                                  on_manifold=self.mode == "distance", mean_resizing=mean_resizing))
        if self.bias is not None:
            bias = self.bias.detach()
            replace_table(self, "bias", torch.cat([bias, bias.new_zeros(max(vocab_size - len(bias), 0))])[:vocab_size])

    def forward(self, x: torch.Tensor, *, targets: Optional[torch.Tensor] = None, ignore_index: int = -100,
                chunk_size: Optional[int] = None) -> torch.Tensor:
        """Logits ``[..., V]``; with ``targets`` (integer ``[...]``, ``ignore_index`` where unlabelled) instead the
        summed cross-entropy of those logits over the labelled positions, computed by
        :func:`helm.ops.linear_cross_entropy` in chunks of ``chunk_size`` tokens without the ``[..., V]`` logits
        (same loss and gradients; ``distance`` mode drops the constant ``2k/τ``, which cancels in the softmax)."""
        if targets is not None:
            return self._cross_entropy(x, targets, ignore_index=ignore_index, chunk_size=chunk_size)
        mm, w = compute_dtype(x, self.weight), self.weight
        if self.mode == "linear":
            if autocast_dtype(x.device.type) is not None:
                return nn.functional.linear(x.to(mm), w, self.bias)  # the autocast dtype, as nn.Linear
            logits = to_stat(nn.functional.linear(x.to(mm), w.to(mm)))
        else:
            inner = to_stat(x[..., 1:].to(mm) @ w[:, 1:].to(mm).T) - to_stat(x[..., :1]) * to_stat(w[:, 0])  # <x, p>_L
            logits = (2 * self.k + 2 * inner) / positive_exp(self.log_tau.reshape(()))
        return logits if self.bias is None else logits + self.bias.to(logits.dtype)

    def _cross_entropy(self, x: torch.Tensor, targets: torch.Tensor, *, ignore_index: int,
                       chunk_size: Optional[int]) -> torch.Tensor:
        """The head as the affine map ``s·(x Wᵀ) + b`` of :func:`helm.ops.linear_cross_entropy`: ``linear`` is
        ``s = 1``; ``distance`` is the Minkowski product ``<x, p_c>_L`` (``minkowski=True``: time coordinates in
        fp32) with ``s = 2/τ``. The loss runs its GEMMs in the same compute dtype as the logits."""
        x, targets = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        if self.mode == "linear":
            return linear_cross_entropy(x, self.weight, targets, bias=self.bias, ignore_index=ignore_index,
                                        chunk_size=chunk_size)
        return linear_cross_entropy(x, self.weight, targets, scale=2 / positive_exp(self.log_tau.reshape(())),
                                    bias=self.bias, ignore_index=ignore_index, chunk_size=chunk_size, minkowski=True)
