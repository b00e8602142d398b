"""HELM-D configuration: Llama field names; HELM-specific fields after them."""

from __future__ import annotations

from transformers import PreTrainedConfig

from ..configuration_common import RemoteCodeConfigMixin, validate_helm_common


class HelmDConfig(RemoteCodeConfigMixin, PreTrainedConfig):
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
        residual_space_scale: the official code's constant space-part scale after each residual (None = off).
        lm_head_mode: ``linear`` (paper code) or ``distance`` (fully hyperbolic prototypes).
        validate_inputs: check token ids against the vocabulary (one device read per forward).
    """

    model_type = "helm_d"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 128256
    hidden_size: int = 390
    intermediate_size: int = 1560
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-12
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    attention_bias: bool = True
    mlp_bias: bool = True
    curvature: float = -1.0
    embedding_mode: str = "space"
    positional: str = "hope"
    pe_options: dict | None = None
    attn_impl: str = "auto"
    tau_init: float | None = None
    residual_weight: float = 1.0
    residual_space_scale: float | None = None
    lm_head_mode: str = "linear"
    validate_inputs: bool = True

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            if (self.hidden_size - 1) % self.num_attention_heads:
                raise ValueError(f"hidden_size - 1 = {self.hidden_size - 1} is not divisible by num_attention_heads="
                                 f"{self.num_attention_heads}; set head_dim explicitly")
            self.head_dim = 1 + (self.hidden_size - 1) // self.num_attention_heads
        validate_helm_common(self)
        if self.head_dim < 2:
            raise ValueError(f"head_dim must be >= 2 (1 + space dims), got {self.head_dim}")
        if self.positional in ("hope", "rope3d", "hope_boost") and (self.head_dim - 1) % 2:
            raise ValueError(f"head_dim must be 1 + an even number for positional={self.positional!r}, "
                             f"got {self.head_dim}")
        if self.intermediate_size < 2:
            raise ValueError(f"intermediate_size must be >= 2, got {self.intermediate_size}")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings is not supported: the token table holds points (or space parts) "
                             "while the LM head maps the full vector")
        super().__post_init__(**kwargs)


__all__ = ["HelmDConfig"]
