"""Validation shared by the HELM configs (kept free of torch so configs load fast)."""

from __future__ import annotations

import math

from transformers import PreTrainedConfig

EMBEDDING_MODES = ("lorentz", "space")
LM_HEAD_MODES = ("linear", "distance")
POSITIONALS = ("hope", "learned", "none", "alibi", "rope3d", "hope_boost")
ATTN_IMPLS = ("eager", "sdpa", "triton", "auto")


def _choice(value, name, accepted):
    if value not in accepted:
        raise ValueError(f"{name} must be one of {accepted}, got {value!r}")


def _positive_int(value, name, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def validate_helm_common(cfg) -> None:
    """Checks every HELM config needs: dims (ambient, counting the time coordinate), curvature, choices."""
    _positive_int(cfg.vocab_size, "vocab_size")
    _positive_int(cfg.hidden_size, "hidden_size", 2)
    _positive_int(cfg.num_hidden_layers, "num_hidden_layers")
    _positive_int(cfg.num_attention_heads, "num_attention_heads")
    _positive_int(cfg.max_position_embeddings, "max_position_embeddings")
    if not (isinstance(cfg.curvature, (int, float)) and math.isfinite(cfg.curvature) and cfg.curvature < 0):
        raise ValueError(f"curvature must be a negative number (paper convention K < 0), got {cfg.curvature!r}")
    _choice(cfg.embedding_mode, "embedding_mode", EMBEDDING_MODES)
    _choice(cfg.lm_head_mode, "lm_head_mode", LM_HEAD_MODES)
    _choice(cfg.positional, "positional", POSITIONALS)
    _choice(cfg.attn_impl, "attn_impl", ATTN_IMPLS)
    if cfg.residual_space_scale is not None and not cfg.residual_space_scale > 0:
        raise ValueError(f"residual_space_scale must be positive or None, got {cfg.residual_space_scale!r}")
    if not cfg.residual_weight > 0:
        raise ValueError(f"residual_weight must be positive, got {cfg.residual_weight!r}")
    if cfg.tau_init is not None and not cfg.tau_init > 0:
        raise ValueError(f"tau_init must be positive or None, got {cfg.tau_init!r}")


class RemoteCodeConfigMixin:
    """Saved HELM configs get ``auto_map`` from the model's code bundle; see ``HelmPreTrainedModel``."""

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        if (auto_class if isinstance(auto_class, str) else auto_class.__name__) != "AutoConfig":
            raise ValueError(f"auto_class must be 'AutoConfig', got {auto_class!r}")


class HelmConfigBase(RemoteCodeConfigMixin, PreTrainedConfig):
    """Fields shared by both families: Llama names first, then the HELM-specific ones (documented on the
    family configs). Dimensions are ambient: they count the time coordinate."""

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

    def default_head_dim(self) -> None:
        """``head_dim = 1 + (hidden_size - 1) / num_attention_heads`` when not given."""
        if self.head_dim is None:
            if (self.hidden_size - 1) % self.num_attention_heads:
                raise ValueError(f"hidden_size - 1 = {self.hidden_size - 1} is not divisible by num_attention_heads="
                                 f"{self.num_attention_heads}; set head_dim explicitly")
            self.head_dim = 1 + (self.hidden_size - 1) // self.num_attention_heads

    def check_no_tying(self) -> None:
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings is not supported: the token table holds points (or space parts) "
                             "while the LM head maps the full vector")
