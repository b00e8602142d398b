"""HELM-MiCE configuration: DeepSeek-V3 field names for MoE/MLA; HELM-specific fields after them."""

from __future__ import annotations

from ...nn.validation import (
    ATTENTION_TYPES,
    SCORING_FUNCS,
    boolean,
    curvature_pair,
    field,
    integer,
    negative_list,
    non_negative,
    one_of,
    optional,
)
from ...nn.mice import EXPERT_COMBINES, MOE_DISPATCHES
from ..configuration_common import HelmConfigBase


class HelmMiCEConfig(HelmConfigBase):
    r"""Configuration of HELM-MiCE (HMLA attention + Mixture-of-Curvature Experts, paper §4.2–4.3).

    Dimensions are ambient (they count the time coordinate): the 120M preset has ``hidden_size=390``,
    ``kv_lora_rank=65``, ``qk_nope_head_dim=33``, ``qk_rope_head_dim=17``, ``v_head_dim=33``.
    The first ``first_k_dense_replace`` layers use a dense SwiGLU_L of ``intermediate_size``; the others MiCE
    with ``n_routed_experts`` experts of ``moe_intermediate_size`` (``num_experts_per_tok`` active) plus
    ``n_shared_experts`` always-on experts.

    HELM-specific fields (besides those of :class:`HelmConfigBase`):
        routed_curvatures: paper curvatures ``K_j < 0`` of the routed experts, each with ``|K_j|`` in
            ``[1e-4, 1e4]`` like ``curvature`` (refused at config time otherwise); default (None, also assigned
            after construction): evenly spaced from ``expert_curvature_range[0]`` to ``[1]`` (paper: -0.1 … -2.0).
        trainable_curvatures: learn the expert curvatures (fp32 ``log k``, mapped smoothly into the range with
            at most a factor 10 of margin, never clamped with a zero gradient: :func:`helm.nn.mice.bounded_log_k`).
        attention_type: ``hmla`` (paper) or ``mha`` (the MiCE-HMHA ablation: Eq. 3 self-attention).
        aux_loss_alpha: weight α of the sequence-wise balance loss (``aux_loss_alpha >= 0``, finite);
            bias_update_speed: γ of the aux-loss-free routing-bias update (``bias_update_speed >= 0``, finite).
        expert_combine: ``centroid`` (paper Eq. 6: one weighted centroid) or ``lresnet_official`` (the official
            code's chain of LResNets; needs ``n_shared_experts=1``; see :class:`helm.nn.MiCE` and FIDELITY.md).
        moe_dispatch: ``auto`` and ``dense`` run every routed expert on every token and weight the outputs (no host
            read in a step); ``sparse`` runs each expert on its own tokens only (one sort, and one host read of the
            per-expert counts per layer forward: opt-in, faster on the CPU at the paper's shapes). The same outputs
            and gradients either way.
        hmla_absorb: absorbed HMLA decoding (:class:`helm.nn.HMLA`): the cache also keeps three fp32 scalars per
            head and token (key and value time coordinates, centred value norm), and a cached forward of a few
            tokens attends in the latent space, ``O(T_cache·(n_kv + d_r))`` per head instead of re-running
            ``kv_b_proj`` over the cache; outputs equal the plain path to fp32 rounding. Training and long prefills
            are unchanged. Ignored with ``attention_type="mha"``.
    """

    model_type = "helm_mice"
    moe_intermediate_size: int = field(integer(2), 780)
    n_routed_experts: int = field(integer(1), 4)
    n_shared_experts: int = field(integer(0), 1)
    num_experts_per_tok: int = field(integer(1), 2)
    first_k_dense_replace: int = field(integer(0), 1)
    norm_topk_prob: bool = field(boolean, True)
    scoring_func: str = field(one_of(SCORING_FUNCS), "sigmoid")
    kv_lora_rank: int = field(integer(2), 65)
    q_lora_rank: int | None = field(optional(integer(0)), None)
    qk_nope_head_dim: int = field(integer(2), 33)
    qk_rope_head_dim: int = field(integer(2), 17)
    v_head_dim: int = field(integer(2), 33)
    routed_curvatures: list[float] | None = field(optional(negative_list), None)
    expert_curvature_range: list[float] | None = field(optional(curvature_pair), None)
    trainable_curvatures: bool = field(boolean, True)
    attention_type: str = field(one_of(ATTENTION_TYPES), "hmla")
    aux_loss_alpha: float = field(non_negative, 1e-4)
    bias_update_speed: float = field(non_negative, 1e-3)
    expert_combine: str = field(one_of(EXPERT_COMBINES), "centroid")
    moe_dispatch: str = field(one_of(MOE_DISPATCHES), "auto")
    hmla_absorb: bool = field(boolean, True)

    def derive_defaults(self) -> None:
        """``head_dim`` as :class:`HelmConfigBase` derives it, with ``attention_type="mha"`` only (HMLA's widths are
        ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``), and ``routed_curvatures`` spread over
        ``expert_curvature_range`` (:meth:`spread_curvatures`); at construction and again whenever the config is
        validated, so ``attention_type="mha"`` or a None assigned after construction builds what the keywords
        would."""
        if self.attention_type == "mha":
            super().derive_defaults()
        if self.routed_curvatures is None:
            self.routed_curvatures = self.spread_curvatures(self.n_routed_experts)

    def spread_curvatures(self, n: int) -> list[float]:
        """The curvatures of ``n`` routed experts spread evenly over ``expert_curvature_range`` (default
        ``(-0.1, -2.0)``), what ``routed_curvatures=None`` stands for."""
        lo, hi = self.expert_curvature_range or (-0.1, -2.0)
        return [lo + (hi - lo) * i / max(n - 1, 1) for i in range(n)]

    def positional_dims(self) -> dict[str, int]:
        if self.attention_type == "mha":
            return super().positional_dims()
        return {"qk_rope_head_dim": self.qk_rope_head_dim - 1}

    def validate_architecture(self) -> None:
        super().validate_architecture()
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} cannot exceed n_routed_experts="
                             f"{self.n_routed_experts}")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} exceeds num_hidden_layers="
                             f"{self.num_hidden_layers}")
        if len(self.routed_curvatures) != self.n_routed_experts and \
                list(self.routed_curvatures) == self.spread_curvatures(len(self.routed_curvatures)):
            # derived for another n_routed_experts (a saved config loaded with n_routed_experts=..., or the field
            # assigned after construction): derived again, as a config built with this count would be
            self.routed_curvatures = self.spread_curvatures(self.n_routed_experts)
        if len(self.routed_curvatures) != self.n_routed_experts:
            raise ValueError(f"routed_curvatures has {len(self.routed_curvatures)} entries, expected "
                             f"n_routed_experts={self.n_routed_experts}")
        if self.q_lora_rank == 1:
            raise ValueError("q_lora_rank must be None or 0 (no query compression) or an ambient dim >= 2, got 1")
        if self.expert_combine == "lresnet_official" and self.n_shared_experts != 1:
            raise ValueError(f"expert_combine='lresnet_official' needs n_shared_experts=1 (the official code's only "
                             f"setting), got n_shared_experts={self.n_shared_experts}")


__all__ = ["HelmMiCEConfig"]
