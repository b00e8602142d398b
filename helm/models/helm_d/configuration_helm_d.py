"""HELM-D configuration: Llama field names; HELM-specific fields after them."""

from __future__ import annotations

from ..configuration_common import HelmConfigBase, validate_helm_common


class HelmDConfig(HelmConfigBase):
    r"""Configuration of a dense HELM model (hyperbolic self-attention + hyperbolic SwiGLU, paper §4).

    Dimensions are *ambient*: they count the time coordinate, like the paper (the 115M model has
    ``hidden_size=390 = 1 + 389`` and heads of ``head_dim=65 = 1 + 64``).

    HELM-specific fields:
        curvature: the paper's ``K < 0`` of the whole model (``k = -1/K`` internally).
        embedding_mode: ``space`` (Euclidean table of space parts, time computed on the fly) or ``lorentz``
            (a ``geoopt.ManifoldParameter`` table trained by Riemannian Adam).
        positional: ``hope`` (default), ``learned``, ``none``, ``alibi``, ``rope3d``, ``hope_boost``.
        pe_options: extra options of the positional encoding (e.g. ``{"chunk_size": 512}`` for rope3d).
        attn_impl: ``auto`` / ``sdpa`` / ``eager`` / ``triton``.
        tau_init: initial attention temperature (default ``sqrt(head_dim - 1)``).
        residual_weight: initial weight of the sublayer in the Lorentz residual centroid.
        residual_space_scale: the official code's constant space-part scale after each residual (None = off;
            presets use ``4·sqrt(hidden_size - 1)`` dense and ``sqrt(hidden_size - 1)`` MiCE, as the official
            runs; see :class:`helm.nn.LorentzResidual`).
        lm_head_mode: ``linear`` (paper code) or ``distance`` (fully hyperbolic prototypes).
        validate_inputs: check token ids against the vocabulary (one device read per forward).
    """

    model_type = "helm_d"

    def __post_init__(self, **kwargs):
        self.default_head_dim()
        validate_helm_common(self)
        if self.head_dim < 2:
            raise ValueError(f"head_dim must be >= 2 (1 + space dims), got {self.head_dim}")
        if self.positional in ("hope", "rope3d", "hope_boost") and (self.head_dim - 1) % 2:
            raise ValueError(f"head_dim must be 1 + an even number for positional={self.positional!r}, "
                             f"got {self.head_dim}")
        if self.intermediate_size < 2:
            raise ValueError(f"intermediate_size must be >= 2, got {self.intermediate_size}")
        self.check_no_tying()
        super().__post_init__(**kwargs)


__all__ = ["HelmDConfig"]
