"""Mixture-of-Curvature Experts, MiCE (paper §4.2, Eq. 5–6)."""

from __future__ import annotations

import math
import warnings
from typing import Optional, Sequence

import torch
from torch import nn

from ..manifold.math import curvature_to_k, lift, normalize, origin, positive_exp, sqdist_one_pass, sqnorm
from ..precision import no_autocast, to_stat
from .validation import (
    CURVATURE_RANGE,
    SCORING_FUNCS,
    check,
    check_choice,
    check_dim,
    check_k,
    negative_list,
    non_negative,
)
from .linear import linear_input
from .mlp import LorentzSwiGLU
from .storage import RealignAfterLoading, realign_

# The config range of log k (identity there) and the margin, in log k, the parametrisation may add beyond it.
LOG_K_RANGE = (math.log(CURVATURE_RANGE[0]), math.log(CURVATURE_RANGE[1]))
LOG_K_MARGIN = math.log(10.0)

# How MiCE combines its expert outputs (see :class:`MiCE`): ``centroid`` (ours, the paper's one centroid) or
# ``lresnet_official`` (the official HELM code's chain of LResNets, kept so official checkpoints convert exactly).
EXPERT_COMBINES = ("centroid", "lresnet_official")
# "auto" is "dense" (the dispatch that never reads the device); the name stays so that configs holding it load
MOE_DISPATCHES = ("auto", "dense", "sparse")
# lresnet_official: the fixed space scale of each step of the routed-expert chain (official ``weighted_sum``)
OFFICIAL_CHAIN_SCALE = 2.0
# lresnet_official: relative floor on |<a, a>_L| / k in the final LResNet, whose weight is unconstrained (the
# official code clamps at 1e-4 with k = 1); it never acts for a weight >= 0, where |<a, a>_L| >= k (1 + w)²
OFFICIAL_NORM_FLOOR = 1e-4


def bounded_log_k(log_k: torch.Tensor) -> torch.Tensor:
    """Map a raw ``log k`` smoothly into ``(LOG_K_RANGE[0] - margin, LOG_K_RANGE[1] + margin)``.

    The identity on ``LOG_K_RANGE`` (the config range of expert curvatures, so a config value and a saved
    ``log_k`` mean exactly what they say); beyond it the excess ``e`` is squashed to ``margin · u / (1 + u)``,
    ``u = e / margin``: continuous with a continuous first derivative (1 at the boundary), bounded by the margin
    (k stays within a factor 10 of the config range, finite and positive under any optimiser step) and with
    the derivative ``1 / (1 + u)²`` that never becomes exactly zero in fp32 for any finite parameter (a clamp
    would freeze a curvature that crossed the boundary: zero gradient, no way back).
    """
    lo, hi = LOG_K_RANGE
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    offset = log_k - mid
    excess = (offset.abs() - half).clamp_min(0.0) / LOG_K_MARGIN
    squashed = half + LOG_K_MARGIN * excess / (1 + excess)
    return mid + torch.where(offset.abs() <= half, offset, offset.sign() * squashed)


def sequence_balance_loss(scores: torch.Tensor, selected: torch.Tensor, *, top_k: int, alpha: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over the batch.

    ``α Σ_j f_j P_j`` with ``f_j = N_r/(K_r T) Σ_t 1[j ∈ TopK(t)]`` and ``P_j = 1/T Σ_t s_{j,t} / Σ_i s_{i,t}``;
    ``scores [B, T, N_r]`` (non-negative gate scores), ``selected [B, T, N_r]`` (boolean top-k mask).
    """
    n_routed, seq_len = scores.shape[-1], scores.shape[1]
    f = selected.to(scores.dtype).sum(1) * (n_routed / (top_k * seq_len))
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    return alpha * (f * p).sum(-1).mean()


def mixture_norm2(weight: torch.Tensor, e: torch.Tensor, d: torch.Tensor, *, k) -> torch.Tensor:
    """``|<s, s>_L|`` of ``s = Σ_i w_i x_i`` (points ``x_i`` of ``H_k``, ``w_i >= 0``) from centred terms::

        |<s, s>_L| = k W² + W E - <D, D>_L,    W = Σ w_i,  E = Σ w_i <x_i - c, x_i - c>_L,  D = Σ w_i (x_i - c)

    for any centre ``c`` (expand ``<x_i, c>_L = (<c, c>_L - k - e_i) / 2``). With ``c`` the weighted mean ``s / W``,
    ``D ≈ 0`` and ``E`` is the weights' Lorentzian spread, so nothing of size ``|x|²`` cancels: the naive
    ``s_t² - |s_s|²`` loses everything in fp32 once the points sit ~1e4 from the origin, and :mod:`helm.precision`
    widens nothing to fp64. ``weight, e [..., 1]``, ``d [..., 1+n]`` -> ``[..., 1]``."""
    return k * weight.square() + weight * e - sqnorm(d, keepdim=True)


def mixture_centroid(points: torch.Tensor, w: torch.Tensor, *, k) -> torch.Tensor:
    """Paper Eq. 6's centroid ``sqrt(k) · s / sqrt(|<s, s>_L|)``, ``s = Σ_i w_i x_i``, of points ``[..., N, 1+n]`` with
    weights ``w [..., N]`` (``>= 0``): the norm from the points centred on their (detached) weighted mean
    (:func:`mixture_norm2`), clamped at the bound ``k (Σ w)²``. ``O(N n)``, unlike the pairwise form of
    :func:`helm.manifold.centroid`; ``D = s - W c``. The weighted sums are products ``w @ points`` in the points'
    dtype (outside autocast), whose gradients are products too, not ``[..., N, 1+n]`` temporaries of broadcast
    operands. Shapes -> ``[..., 1+n]``."""
    w_row = w.unsqueeze(-2)
    with no_autocast(points.device.type):
        s = (w_row @ points).squeeze(-2)
        weight = w.sum(-1, keepdim=True)
        c = (s / weight.clamp_min(torch.finfo(s.dtype).tiny)).detach()
        e = (w_row @ sqnorm(points - c.unsqueeze(-2), keepdim=True)).squeeze(-2)
    norm2 = mixture_norm2(weight, e, s - weight * c, k=k)
    return normalize(s, k=k, norm2=norm2, floor=k * weight.square())


def rescale_factors(log_k: torch.Tensor, k: float, dtype: torch.dtype) -> tuple:
    """Elementwise over ``log_k``: ``k_j = exp(bounded_log_k(log k_j))`` (fp32) and the factors ``sqrt(k_j / k)``,
    ``sqrt(k / k_j)`` (in ``dtype``) of ``rescale`` onto an expert's hyperboloid and back."""
    kj = bounded_log_k(to_stat(log_k)).exp()
    kd = kj.to(dtype)
    return kj, (kd / k).sqrt(), (k / kd).sqrt()


@torch.no_grad()
def update_routing_bias_(bias: torch.Tensor, load: torch.Tensor, speed: float) -> None:
    """Aux-loss-free balancing, in place: ``b_j += γ · sign(mean load - load_j)`` (overloaded experts lose)."""
    bias.add_(speed * torch.sign(load.mean() - load).to(bias.dtype))


def scaled_lresnet(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, *, k: float, space_scale,
                   floor: Optional[float] = None) -> torch.Tensor:
    """The official code's LResNet: ``lift(σ · z_s)``, ``z = sqrt(k) · a / sqrt(|<a, a>_L|)``, ``a = x + w · y``.

    ``x, y`` points of ``H_k`` ``[..., 1+n]``; ``w`` a weight broadcastable to ``[..., 1]``, used raw (no
    softplus); ``space_scale`` σ (a number or a tensor broadcastable to ``[..., 1]``). ``|<a, a>_L|`` is taken
    in the well-conditioned form ``|k (1 + w)² + w d²(x, y)|`` (equal to it for points of ``H_k``, exact far
    from the origin where ``-a_t² + |a_s|²`` cancels), in fp32 at least, and clamped from below by ``floor``
    when given (needed only for ``w < 0``: for ``w >= 0`` it is ``>= k (1 + w)²``).
    Shapes: ``[..., 1+n] -> [..., 1+n]``, at least fp32.
    """
    dtype = torch.promote_types(torch.promote_types(to_stat(x).dtype, to_stat(y).dtype), to_stat(w).dtype)
    x, y, w = x.to(dtype), y.to(dtype), w.to(dtype)
    norm2 = (k * (1 + w) ** 2 + w * sqdist_one_pass(x, y, keepdim=True)).abs()
    if floor is not None:
        norm2 = norm2.clamp_min(floor)
    z = normalize(x + w * y, k=k, norm2=norm2)
    return lift(space_scale * z[..., 1:], k=k)


class CurvatureExpert(nn.Module):
    """A SwiGLU_L expert living on its own hyperboloid ``H_{k_j}``.

    ``y = rescale_{k_j → k}(SwiGLU_{L, k_j}(rescale_{k → k_j}(x)))``; ``k_j = exp(bounded_log_k(log k_j))``
    with ``log k_j`` an fp32 parameter, trained when ``trainable`` and frozen otherwise. ``k_expert`` must lie in
    the config range :data:`helm.nn.validation.CURVATURE_RANGE` (refused here and at config time); training may
    move it at most a factor 10 beyond, smoothly (see :func:`bounded_log_k`), never with a zero-gradient clamp.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, k: float, k_expert: float,
                 trainable: bool, hidden_act: str = "silu", bias: bool = True):
        super().__init__()
        check_k(k, "k")
        check_k(k_expert, "k_expert")
        self.k, self.k_expert_init, self.trainable = float(k), float(k_expert), trainable
        self.mlp = LorentzSwiGLU(hidden_size, intermediate_size, k=k_expert, hidden_act=hidden_act, bias=bias)
        # [1], not []: FSDP2 shards dim 0
        self.log_k = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=trainable)
        self.reset_geometry()

    def reset_geometry(self) -> None:
        with torch.no_grad():
            self.log_k.fill_(math.log(self.k_expert_init))
        self.log_k.requires_grad_(self.trainable)

    def restore_frozen(self) -> None:
        """Loading may flip ``requires_grad``; a fixed curvature must stay fixed. Realigns the expert's tensors too
        (:func:`helm.nn.storage.realign_`)."""
        realign_(self)
        self.log_k.requires_grad_(self.trainable)

    @property
    def k_expert(self) -> torch.Tensor:
        return bounded_log_k(to_stat(self.log_k.reshape(()))).exp()

    def curvature_scales(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This expert's :func:`rescale_factors` (0-dim): its curvature and the factors onto its hyperboloid and back.

        Without autograd (decoding) they are computed once per value of ``log_k`` (its storage and version
        counter: an optimiser step, a load or an offload hook that swaps the tensor recomputes them), which
        saves a dozen scalar kernels per expert call; with autograd, or under ``torch.compile``, every call."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return rescale_factors(self.log_k.reshape(()), self.k, dtype)
        key = (self.log_k.data_ptr(), self.log_k._version, self.log_k.device, dtype)
        if getattr(self, "_scales_key", None) != key:
            self._scales, self._scales_key = rescale_factors(self.log_k.reshape(()), self.k, dtype), key
        return self._scales

    def forward(self, x: torch.Tensor, scales: Optional[tuple] = None) -> torch.Tensor:
        # k_j is read here, where accelerate's offload hooks have loaded log_k, unless the layer passes ``scales``
        # (MiCE.expert_scales); rescale(x, k -> k_j) = sqrt(k_j / k) x and back, as helm.manifold.rescale
        kj, up, down = self.curvature_scales(to_stat(x).dtype) if scales is None else scales
        return self.mlp(x * up, k=kj) * down


class MiCE(RealignAfterLoading, nn.Module):
    """Gate, bias-adjusted top-k routing, curvature experts, shared experts, one centroid (paper Eq. 5–6).

    * scores ``s_j = act(x_s · y_j)`` (``act``: sigmoid as in DeepSeek-V3, or softmax);
    * selection: top-``num_experts_per_tok`` of ``s_j + b_j`` (``b``: the aux-loss-free routing bias, a
      buffer updated by :meth:`update_bias`, never by gradients); weights ``g_j`` = selected scores,
      renormalised over the selected when ``norm_topk_prob``;
    * output (``expert_combine="centroid"``, the default) ``centroid({E_j(x)} ∪ {S_i(x)}, {g_j} ∪ {1})`` —
      routed experts on their own curvatures (outputs rescaled back to the layer's ``k``), shared experts on the
      layer's curvature. The Lorentz residual is applied by the decoder layer.

    ``expert_combine="lresnet_official"`` is the official HELM code's combination, kept so that official
    checkpoints convert exactly (the paper describes one centroid instead). With the official code's LResNet
    ``L(x, y; w, σ) = lift(σ · z_s)``, ``z = sqrt(k) · a / sqrt(|<a, a>_L|)``, ``a = x + w · y`` (``w`` raw, any
    sign; see :func:`scaled_lresnet`), all on the layer's ``H_k``::

        y ← o = (sqrt(k), 0, …, 0)
        for j = 0, 1, …, N_r - 1:                 # ascending expert index, not score order
            if j is selected for the token:       # unselected experts are skipped: a step with g_j = 0
                y ← L(y, E_j(x); g_j, 2)          # would still double y_s
        out = L(S(x), y; add_experts_weight, exp(add_experts_log_scale))

    ``E_j(x)`` is the routed expert's output rescaled back to ``k`` (as in the centroid mode), ``S`` the single
    shared expert (the official code supports exactly one: ``n_shared_experts`` must be 1), ``g_j`` the
    routing weights of :meth:`route`. ``add_experts_weight`` (init 1) and ``add_experts_log_scale`` (init
    ``log 2``) are 0-dim fp32 parameters that exist only in this mode (official ``add_experts.w_y`` and
    ``add_experts.scale``), so ``centroid`` checkpoints keep their keys. The skip is a ``torch.where`` on the
    selection mask: every expert still runs on every token, shapes stay static. Shapes: ``y, E_j(x), S(x)``
    ``[B, T, 1+n]``, ``g_j`` ``[B, T]``; Minkowski norms in fp32 at least. The official gate corresponds to
    ``scoring_func="softmax"``, ``norm_topk_prob=False``.

    Dispatch (``dispatch``): ``auto`` and ``dense`` run every expert on every token, and unselected ones get zero
    weight (or are skipped by a mask): no data-dependent shapes, no host synchronisation in the forward or the
    backward. ``sparse`` (:meth:`combine_sparse`) runs each routed expert on its own tokens only, saving
    ``(N_r - K_r)/N_r`` of the routed experts' FLOPs, at the price of one host read per layer forward (the
    per-expert token counts give the slices their shapes): worth it in eager CPU training from a few hundred tokens
    per call (``benchmarks/mice_dispatch.py``), a stall of the launch queue on a GPU. Each expert is a module of its
    own (LoRA, quantised or offloaded linears act inside it), so a grouped GEMM over stacked expert weights, which
    would avoid that read, is not an option here.

    After each forward the layer keeps ``last_expert_load`` (tokens routed to each expert, ``[N_r]``) and, in
    training, ``aux_loss``: the DeepSeek-V3 sequence-wise balance loss
    ``α Σ_j f_j P_j``, ``f_j = N_r/(K_r T) Σ_t 1[j ∈ TopK(t)]``, ``P_j = 1/T Σ_t s_{j,t} / Σ_i s_{i,t}``,
    averaged over sequences.

    Shapes: ``[B, T, 1+n] -> [B, T, 1+n]``.
    """

    def __init__(self, hidden_size: int, moe_intermediate_size: int, *, n_routed_experts: int,
                 num_experts_per_tok: int, n_shared_experts: int = 1, k: float = 1.0,
                 routed_curvatures: Optional[Sequence[float]] = None, trainable_curvatures: bool = True,
                 scoring_func: str = "sigmoid", norm_topk_prob: bool = True, aux_loss_alpha: float = 1e-4,
                 bias_update_speed: float = 1e-3, hidden_act: str = "silu", bias: bool = True,
                 expert_combine: str = "centroid", dispatch: str = "auto"):
        super().__init__()
        check_dim(hidden_size, "hidden_size", minimum=2)
        check_dim(moe_intermediate_size, "moe_intermediate_size", minimum=2)
        check_dim(n_routed_experts, "n_routed_experts")
        check_dim(num_experts_per_tok, "num_experts_per_tok")
        check_dim(n_shared_experts, "n_shared_experts", minimum=0)
        check_k(k, "k")
        check_choice(scoring_func, "scoring_func", SCORING_FUNCS)
        check_choice(expert_combine, "expert_combine", EXPERT_COMBINES)
        if expert_combine == "lresnet_official" and n_shared_experts != 1:
            raise ValueError(f"n_shared_experts must be 1 with expert_combine='lresnet_official' (the official "
                             f"combination has exactly one shared expert), got {n_shared_experts!r}")
        if num_experts_per_tok > n_routed_experts:
            raise ValueError(f"num_experts_per_tok={num_experts_per_tok} exceeds n_routed_experts={n_routed_experts}")
        check(aux_loss_alpha, "aux_loss_alpha", non_negative)
        check(bias_update_speed, "bias_update_speed", non_negative)
        if routed_curvatures is None:
            routed_curvatures = [-1.0] * n_routed_experts
        check(list(routed_curvatures), "routed_curvatures", negative_list)
        if len(routed_curvatures) != n_routed_experts:
            raise ValueError(f"routed_curvatures must have n_routed_experts={n_routed_experts} entries, "
                             f"got {len(routed_curvatures)}")
        self.k, self.top_k, self.n_routed = float(k), num_experts_per_tok, n_routed_experts
        self.scoring_func, self.norm_topk_prob = scoring_func, norm_topk_prob
        self.aux_loss_alpha, self.bias_update_speed = aux_loss_alpha, bias_update_speed
        self.gate = nn.Linear(hidden_size - 1, n_routed_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(n_routed_experts, dtype=torch.float32))
        self.register_buffer("last_expert_load", torch.zeros(n_routed_experts, dtype=torch.float32), persistent=False)
        self.experts = nn.ModuleList(
            CurvatureExpert(hidden_size, moe_intermediate_size, k=k, k_expert=curvature_to_k(K),
                            trainable=trainable_curvatures, hidden_act=hidden_act, bias=bias)
            for K in routed_curvatures)
        self.shared_experts = nn.ModuleList(
            LorentzSwiGLU(hidden_size, moe_intermediate_size, k=k, hidden_act=hidden_act, bias=bias)
            for _ in range(n_shared_experts))
        self.expert_combine = expert_combine
        check_choice(dispatch, "dispatch", MOE_DISPATCHES)
        self.dispatch = dispatch
        if expert_combine == "lresnet_official":
            # [1], not []: FSDP2 shards dim 0
            self.add_experts_weight = nn.Parameter(torch.empty(1, dtype=torch.float32))
            self.add_experts_log_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        self.reset_geometry()
        self.aux_loss: Optional[torch.Tensor] = None
        # routing-bias bookkeeping (:meth:`_check_bias_updates`): bias updates so far; the gate weight noted at the
        # first training forward; whether a backward ran since; whether the check has decided
        self._bias_updates = 0
        self._gate_note: Optional[tuple] = None
        self._backward_seen = False
        self._bias_check_done = False

    def reset_geometry(self) -> None:
        """Initialise the ``lresnet_official`` combination scalars (weight 1, scale 2); nothing in ``centroid`` mode.

        Named for the hook :meth:`helm.models.modeling_common.HelmPreTrainedModel._init_weights` calls. Through
        ``nn.init``, which ``transformers`` guards while loading: the hook also runs on a loaded MiCE (its
        non-persistent load buffer is never "loaded"), and must then leave the loaded scalars alone."""
        if self.expert_combine == "lresnet_official":
            nn.init.constant_(self.add_experts_weight, 1.0)
            nn.init.constant_(self.add_experts_log_scale, math.log(OFFICIAL_CHAIN_SCALE))

    def route(self, x: torch.Tensor) -> tuple:
        """Dense routing weights ``[B, T, N_r]`` (zero off the top-k), scores, and the selection mask."""
        # through the gate's own forward, so that accelerate's offload hooks load its weight
        logits = to_stat(self.gate(linear_input(self.gate, x[..., 1:])))  # the GEMM in the compute dtype
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(-1)
        chosen = (scores + self.e_score_correction_bias).topk(self.top_k, dim=-1).indices
        selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        weights = scores * selected
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)
        return weights, scores, selected

    def update_bias(self) -> None:
        """Aux-loss-free balancing: ``b_j += γ · sign(mean load - load_j)`` from the last batch's load."""
        update_routing_bias_(self.e_score_correction_bias, self.last_expert_load, self.bias_update_speed)
        self._bias_updates += 1

    def _check_bias_updates(self) -> bool:
        """Warn once when training goes on without routing-bias updates; whether the layer should watch its backward.

        Nothing in the forward or backward can tell the last micro-batch of a step, so the update stays with the
        training loop (``train.py``, :class:`helm.models.routing.RoutingBiasCallback` under ``transformers.Trainer``,
        or ``model.update_routing_bias()``), which sums the load of all micro-batches and processes first. A stock
        ``Trainer`` without the callback would leave the bias at its initial value for the whole run, silently. So the
        first training forward notes the gate weight (its version counter, a copy, the update count), and the first
        later one that sees an optimiser step gone by decides: no ``update_bias`` since the note means a warning.
        Then the check is over for good. The evidence of a step, read from the host only:

        * the version counter moved: an in-place write (foreach or per-tensor optimisers, SGD, ...);
        * else a backward has run through the layer since and the gate's gradient is gone (``zero_grad``): the
          case of optimisers that write without bumping the counter (fused AdamW, the Trainer's default). Only
          then are the values compared, which reads the device once; a gradient freed without a step (FSDP2
          between micro-batches) finds them equal and the watch goes on.

        Other micro-batches of the same step and recomputations show neither. A new weight tensor (moved,
        reloaded, swapped in by an offload hook) starts the note again. Skipped with ``bias_update_speed = 0``
        (balancing switched off), a frozen or non-tensor (quantised) gate weight, and under ``torch.compile``."""
        weight = getattr(self.gate, "weight", None)
        if (self._bias_check_done or self.bias_update_speed == 0 or not isinstance(weight, torch.Tensor)
                or not weight.requires_grad or weight.device.type == "meta" or torch.compiler.is_compiling()):
            return False
        note = self._gate_note
        if note is None or note[0] != (id(weight), weight.device):
            self._gate_note = ((id(weight), weight.device), weight._version, weight.detach().clone(),
                               self._bias_updates)
            self._backward_seen = False
            return True
        _, version, before, updates = note
        if weight._version == version:
            if not (self._backward_seen and weight.grad is None):
                return True
            self._backward_seen = False
            if torch.equal(before, weight.detach()):
                return True
        self._bias_check_done, self._gate_note = True, None
        if self._bias_updates == updates:
            warnings.warn(
                "HELM-MiCE: an optimiser step went by without a routing-bias update, so the experts are not being "
                f"balanced (aux-loss-free balancing, bias_update_speed={self.bias_update_speed:g}). Under "
                "transformers.Trainer pass callbacks=[helm.models.routing.RoutingBiasCallback()]; in your own loop "
                "call model.update_routing_bias() after each optimiser step (train.py does); set "
                "bias_update_speed=0 to train without it.", UserWarning, stacklevel=2)
        return False

    def _note_backward(self, grad: torch.Tensor) -> None:
        self._backward_seen = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        watch = self.training and torch.is_grad_enabled() and self._check_bias_updates()
        weights, scores, selected = self.route(x)
        if watch and scores.requires_grad:
            scores.register_hook(self._note_backward)
        with torch.no_grad():
            self.last_expert_load.copy_(selected.to(self.last_expert_load.dtype).sum((0, 1)))
        self.aux_loss = (sequence_balance_loss(scores, selected, top_k=self.top_k, alpha=self.aux_loss_alpha)
                         if self.training and self.aux_loss_alpha > 0 else None)
        if self.expert_combine == "lresnet_official":
            return self.combine_lresnet_official(x, weights, selected)
        if self.sparse_dispatch():
            return self.combine_sparse(x, weights, selected)
        outs = [e(x, c) for e, c in zip(self.experts, self.expert_scales(x), strict=True)]
        outs += [s(x) for s in self.shared_experts]
        points = torch.stack(outs, dim=-2)  # [B, T, N_r + N_s, 1+n]
        w = torch.cat([weights, weights.new_ones(*weights.shape[:-1], len(self.shared_experts))], dim=-1)
        return mixture_centroid(points, w, k=self.k)

    def expert_scales(self, x: torch.Tensor) -> list:
        """Each routed expert's :meth:`CurvatureExpert.curvature_scales` for input ``x``, with autograd computed from
        one vector of their ``log k`` (a dozen scalar kernels per layer, not per expert); ``None`` where each expert
        computes its own: without autograd (each then caches them), or with a ``log_k`` that only the expert's own
        forward makes whole: on another device (an offload hook), sharded (an FSDP2 ``DTensor``: ``placements``), or
        a flat shard of another size (FSDP1)."""
        log_k = [e.log_k for e in self.experts]
        if not torch.is_grad_enabled() or any(t.device != x.device or t.numel() != 1 or hasattr(t, "placements")
                                              for t in log_k):
            return [None] * len(log_k)
        return list(zip(*(t.unbind() for t in rescale_factors(torch.cat(log_k), self.k, to_stat(x).dtype))))

    def sparse_dispatch(self) -> bool:
        """Whether :meth:`combine_sparse` runs: ``dispatch="sparse"``, outside ``torch.compile`` (its slices have
        data-dependent shapes). ``auto`` is dense: a default step never reads the device."""
        return self.dispatch == "sparse" and not torch.compiler.is_compiling()

    def combine_sparse(self, x: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """The same centroid as the dense path, with routed expert ``j`` evaluated only on the tokens that
        selected it (``index_add`` of ``g_j E_j(x_t)``); the shared experts see every token.

        The ``T K_r`` (expert, token) pairs, expert-major with tokens ascending (a stable sort of the selection
        mask, a fixed shape), are cut into the experts' slices by the per-expert counts: their one host read. With
        autograd an expert no token chose still runs (on 0 rows): its parameters get zero gradients, as densely,
        which DDP needs (a parameter without a gradient stops its reduction); without, it is skipped.
        ``x [..., 1+n]``, ``weights, selected [..., N_r]`` -> ``[..., 1+n]``."""
        flat = x.reshape(-1, x.shape[-1])
        w, chosen = weights.reshape(-1, self.n_routed), selected.reshape(-1, self.n_routed)
        tokens = flat.shape[0]
        pairs = chosen.t().reshape(-1).to(torch.uint8).argsort(descending=True, stable=True)[:tokens * self.top_k]
        counts = chosen.sum(0).tolist()
        shared = [s(flat) for s in self.shared_experts]
        total = torch.stack(shared).sum(0) if shared else to_stat(flat).new_zeros(flat.shape)
        routed = []  # (rows, weights, outputs): the centred norms need every output again
        start = 0
        for j, (expert, count, scales) in enumerate(zip(self.experts, counts, self.expert_scales(x), strict=True)):
            rows = pairs[start:start + count] - j * tokens
            start += count
            if count == 0 and not torch.is_grad_enabled():
                continue
            routed.append((rows, w[rows, j:j + 1], expert(flat[rows], scales)))
            total = total.index_add(0, rows, routed[-1][1] * routed[-1][2])
        weight_sum = w.sum(-1, keepdim=True) + len(self.shared_experts)
        # the norm from the outputs centred on their weighted mean, as densely (mixture_norm2)
        centre = (total / weight_sum.clamp_min(torch.finfo(total.dtype).tiny)).detach()
        e = total.new_zeros(weight_sum.shape)
        for out in shared:
            e = e + sqnorm(out - centre, keepdim=True)
        for rows, g, out in routed:
            e = e.index_add(0, rows, g * sqnorm(out - centre[rows], keepdim=True))
        norm2 = mixture_norm2(weight_sum, e, total - weight_sum * centre, k=self.k)
        out = normalize(total, k=self.k, norm2=norm2, floor=self.k * weight_sum.square())
        return out.view(*x.shape[:-1], out.shape[-1])

    def combine_lresnet_official(self, x: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """The official code's combination (class docstring): a chain of LResNets over the selected experts from the
        origin in ascending index order, then one LResNet onto the shared expert's output.

        ``x [..., 1+n]``, ``weights`` and ``selected [..., N_r]`` from :meth:`route`; returns ``[..., 1+n]`` (fp32
        at least). Every expert runs on every token; unselected steps are discarded by ``torch.where``.
        """
        dtype = torch.promote_types(to_stat(x).dtype, weights.dtype)
        y = origin(*x.shape, k=self.k, dtype=dtype, device=x.device)
        for j, (expert, scales) in enumerate(zip(self.experts, self.expert_scales(x), strict=True)):
            g = weights[..., j:j + 1]
            step = scaled_lresnet(y, expert(x, scales), g, k=self.k, space_scale=OFFICIAL_CHAIN_SCALE)
            y = torch.where(selected[..., j:j + 1], step, y)
        w = to_stat(self.add_experts_weight.reshape(()))
        scale = positive_exp(self.add_experts_log_scale.reshape(()))
        return scaled_lresnet(self.shared_experts[0](x), y, w, k=self.k, space_scale=scale,
                              floor=OFFICIAL_NORM_FLOOR * self.k)
