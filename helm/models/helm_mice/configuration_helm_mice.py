"""HELM-MiCE configuration: DeepSeek-V3 field names for MoE/MLA; HELM-specific fields after them."""

from __future__ import annotations

from ..configuration_common import HelmConfigBase, _choice, _positive_int, validate_helm_common


class HelmMiCEConfig(HelmConfigBase):
    r"""Configuration of HELM-MiCE (HMLA attention + Mixture-of-Curvature Experts, paper §4.2–4.3).

    Dimensions are ambient (they count the time coordinate): the 120M preset has ``hidden_size=390``,
    ``kv_lora_rank=65``, ``qk_nope_head_dim=33``, ``qk_rope_head_dim=17``, ``v_head_dim=33``.
    The first ``first_k_dense_replace`` layers use a dense SwiGLU_L of ``intermediate_size``; the others MiCE
    with ``n_routed_experts`` experts of ``moe_intermediate_size`` (``num_experts_per_tok`` active) plus
    ``n_shared_experts`` always-on experts.

    HELM-specific fields (besides those of :class:`HelmDConfig`):
        routed_curvatures: paper curvatures ``K_j < 0`` of the routed experts; default: evenly spaced from
            ``expert_curvature_range[0]`` to ``[1]`` (paper: -0.1 … -2.0).
        trainable_curvatures: learn the expert curvatures (fp32, log-parametrised, always valid).
        attention_type: ``hmla`` (paper) or ``mha`` (the MiCE-HMHA ablation: Eq. 3 self-attention).
        aux_loss_alpha: weight α of the sequence-wise balance loss; bias_update_speed: γ of the
            aux-loss-free routing-bias update.
    """

    model_type = "helm_mice"
    moe_intermediate_size: int = 780
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    kv_lora_rank: int = 65
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 33
    qk_rope_head_dim: int = 17
    v_head_dim: int = 33
    routed_curvatures: list[float] | None = None
    expert_curvature_range: list[float] | None = None
    trainable_curvatures: bool = True
    attention_type: str = "hmla"
    aux_loss_alpha: float = 1e-4
    bias_update_speed: float = 1e-3

    def __post_init__(self, **kwargs):
        validate_helm_common(self)
        _positive_int(self.n_routed_experts, "n_routed_experts")
        _positive_int(self.num_experts_per_tok, "num_experts_per_tok")
        _positive_int(self.n_shared_experts, "n_shared_experts", 0)
        _positive_int(self.first_k_dense_replace, "first_k_dense_replace", 0)
        _positive_int(self.moe_intermediate_size, "moe_intermediate_size", 2)
        _positive_int(self.intermediate_size, "intermediate_size", 2)
        _choice(self.scoring_func, "scoring_func", ("sigmoid", "softmax"))
        _choice(self.attention_type, "attention_type", ("hmla", "mha"))
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} cannot exceed n_routed_experts="
                             f"{self.n_routed_experts}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} exceeds num_hidden_layers="
                             f"{self.num_hidden_layers}")
        if self.routed_curvatures is None:
            lo, hi = self.expert_curvature_range or (-0.1, -2.0)
            n = self.n_routed_experts
            self.routed_curvatures = [lo + (hi - lo) * i / max(n - 1, 1) for i in range(n)]
        if len(self.routed_curvatures) != self.n_routed_experts:
            raise ValueError(f"routed_curvatures has {len(self.routed_curvatures)} entries, expected "
                             f"n_routed_experts={self.n_routed_experts}")
        if any(not (isinstance(K, (int, float)) and K < 0) for K in self.routed_curvatures):
            raise ValueError(f"routed_curvatures must all be negative (paper K < 0), got {self.routed_curvatures}")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive_int(getattr(self, name), name, 2)
        if self.q_lora_rank not in (None, 0):
            _positive_int(self.q_lora_rank, "q_lora_rank", 2)
        rotary = self.positional in ("hope", "rope3d", "hope_boost")
        if self.attention_type == "hmla" and rotary and (self.qk_rope_head_dim - 1) % 2:
            raise ValueError(f"qk_rope_head_dim must be 1 + an even number for positional={self.positional!r}, "
                             f"got {self.qk_rope_head_dim}")
        if self.attention_type == "mha":
            self.default_head_dim()
        if self.attention_type == "mha" and rotary and (self.head_dim - 1) % 2:
            raise ValueError(f"head_dim must be 1 + an even number for positional={self.positional!r}")
        self.check_no_tying()
        super().__post_init__(**kwargs)


__all__ = ["HelmMiCEConfig"]
