"""Optimisers for HELM models: Riemannian Adam for manifold points, AdamW for everything else.

Every trainable parameter falls in exactly one of three groups (:func:`group_parameters`):

* ``manifold``: ``geoopt.ManifoldParameter`` tensors (the Lorentz token table of ``embedding_mode="lorentz"``,
  the class prototypes of ``lm_head_mode="distance"``). They are points of the hyperboloid, so they are
  updated by ``geoopt.optim.RiemannianAdam`` (Riemannian gradient, exponential-map retraction, momentum
  transported to the new point) and never decayed: shrinking a point towards zero throws it off the manifold.
* ``no_decay``: Euclidean parameters that are not weight matrices: biases, curvatures (``log_k``),
  temperatures (``log_tau``), residual weights (``raw_weight``), positional decay rates (``decay_raw``), norm
  gains, and any other scalar or vector. Decay would pull them towards values (zero gain, ``k = 1``,
  ``τ = 1``) that have no reason to be preferred.
* ``decay``: the remaining Euclidean tensors (weight matrices, the ``space`` embedding table), AdamW with
  decoupled weight decay.

:class:`HybridAdamW` runs both optimisers behind one ``torch.optim.Optimizer``, so a learning-rate scheduler,
``accelerate`` and checkpointing see a single object whose ``state_dict`` covers every parameter.

Under FSDP2 (``fully_shard``, ``train.distributed: fsdp``) the optimiser is built before sharding, as
``accelerate`` expects: the groups are fixed then, by name and class, and :class:`RiemannianAdam` records each point's
manifold, so after sharding (plain ``DTensor`` parameters) the points still get Riemannian updates on their local rows
and no weight decay.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import geoopt

GROUPS = ("decay", "no_decay", "manifold")
# Parameter names that are never decayed, whatever their shape (see the module docstring).
NO_DECAY_NAMES = frozenset({"bias", "log_k", "log_tau", "raw_weight", "decay_raw"})


def _is_norm(module: nn.Module) -> bool:
    """Normalisation layers of any family: HELM's LorentzRMSNorm, torch's, and transformers' *RMSNorm/*LayerNorm."""
    from .nn.norm import LorentzRMSNorm

    if isinstance(module, (LorentzRMSNorm, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)):
        return True
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm", "GroupNorm"))


def classify_parameter(module: nn.Module, name: str, param: torch.Tensor) -> str:
    """Group of ``param``, registered as ``name`` directly on ``module``: ``decay``, ``no_decay`` or ``manifold``.

    Manifold points are ``geoopt.ManifoldParameter``s, or the parameters a HELM module lists in
    ``_manifold_parameters`` (which stay points after ``fully_shard`` made them plain ``DTensor`` parameters)."""
    if isinstance(param, geoopt.ManifoldParameter) or name in getattr(module, "_manifold_parameters", ()):
        return "manifold"
    if name in NO_DECAY_NAMES or _is_norm(module) or param.ndim < 2:
        return "no_decay"
    return "decay"


def group_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Trainable parameters of ``model`` split into :data:`GROUPS`, as ``(qualified name, parameter)`` lists.

    The split is a partition: every parameter with ``requires_grad`` appears exactly once (a tensor registered
    under two names, e.g. tied weights, counts once, under its first name); frozen ones (a fixed MiCE
    curvature) appear nowhere. The order is ``model.named_modules()`` order, so it is the same every time the
    same architecture is built, which is what lets an optimiser ``state_dict`` be reloaded.
    """
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {g: [] for g in GROUPS}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            qualified = f"{module_name}.{name}" if module_name else name
            groups[classify_parameter(module, name, param)].append((qualified, param))
    return groups


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a ``DTensor`` (FSDP2's sharded parameters, gradients and moments), else the tensor: a
    view, so in-place updates of it update the sharded tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _manifold_of(model: nn.Module, name: str, param: torch.Tensor):
    """The manifold of a point: its own, or (sharded into a plain tensor) its HELM module's Lorentz manifold."""
    if isinstance(param, geoopt.ManifoldParameter):
        return param.manifold
    from .manifold.lorentz import Lorentz

    return Lorentz(model.get_submodule(name.rpartition(".")[0]).k)


class RiemannianAdam(geoopt.optim.RiemannianAdam):
    """``geoopt.optim.RiemannianAdam`` that keeps working when FSDP2 has sharded the points.

    ``fully_shard`` replaces every parameter by a plain ``nn.Parameter`` holding a ``DTensor`` sharded along dim 0,
    so a ``ManifoldParameter`` loses its class and ``geoopt`` would silently update it as a Euclidean tensor. Here
    each point's manifold is recorded when the optimiser is built (``manifolds``, aligned with the parameters of the
    one group), and the step (``geoopt``'s algorithm, the same operations in the same order) runs on the local
    shards: rows are points and FSDP2 shards rows, so every Riemannian operation (gradient conversion, component
    inner product, retraction, transport, projection) is row-wise and local. Moments are created like the point
    (``DTensor`` for a sharded point), so distributed checkpointing of the state works as for AdamW.
    """

    def __init__(self, params, *args, manifolds: Optional[list] = None, **kwargs):
        super().__init__(params, *args, **kwargs)
        if len(self.param_groups) != 1 or (manifolds is not None
                                           and len(manifolds) != len(self.param_groups[0]["params"])):
            raise ValueError("RiemannianAdam takes one parameter group and one manifold per parameter")
        self.manifolds = manifolds

    def _manifold(self, index: int, point: torch.Tensor):
        if isinstance(point, (geoopt.ManifoldParameter, geoopt.ManifoldTensor)):
            return point.manifold
        return self.manifolds[index] if self.manifolds is not None else self._default_manifold

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        (beta1, beta2), eps, lr, weight_decay = group["betas"], group["eps"], group["lr"], group["weight_decay"]
        if group["amsgrad"]:
            raise NotImplementedError("amsgrad is not supported")
        stabilize = False
        for index, param in enumerate(group["params"]):
            if param.grad is None:
                continue
            manifold = self._manifold(index, param)
            state = self.state[param]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            state["step"] += 1
            point, grad = _local(param), _local(param.grad)
            exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            grad.add_(point, alpha=weight_decay)
            grad = manifold.egrad2rgrad(point, grad)
            exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).add_(manifold.component_inner(point, grad), alpha=1 - beta2)
            denom = exp_avg_sq.div(1 - beta2 ** state["step"]).sqrt_()
            direction = exp_avg.div(1 - beta1 ** state["step"]) / denom.add_(eps)
            new_point, exp_avg_new = manifold.retr_transp(point, -lr * direction, exp_avg)
            point.copy_(new_point)
            exp_avg.copy_(exp_avg_new)
            stabilize |= group["stabilize"] is not None and state["step"] % group["stabilize"] == 0
        if stabilize:
            self.stabilize_group(group)
        return loss

    @torch.no_grad()
    def stabilize_group(self, group):
        for index, param in enumerate(group["params"]):
            state = self.state[param]
            if not state:  # no gradient yet
                continue
            manifold, point, exp_avg = self._manifold(index, param), _local(param), _local(state["exp_avg"])
            point.copy_(manifold.projx(point))
            exp_avg.copy_(manifold.proju(point, exp_avg))


class HybridAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` for Euclidean groups and :class:`RiemannianAdam` (``geoopt``'s, shard-aware) for manifold
    points, in one.

    The two inner optimisers share this object's ``param_groups`` dicts and its ``state``, so anything that
    edits ``param_groups`` (an LR scheduler, ``accelerate``) reaches both, and ``state_dict()`` /
    ``load_state_dict()`` are the standard ``torch.optim.Optimizer`` ones over all parameters. Every group
    carries a ``"group"`` key (one of :data:`GROUPS`) and ``"param_names"``.

    Args:
        model: the model whose trainable parameters are optimised (split by :func:`group_parameters`).
        lr: learning rate of the Euclidean groups.
        manifold_lr: learning rate of the manifold group (default ``lr``).
        weight_decay: decoupled weight decay of the ``decay`` group only.
        betas, eps: Adam hyper-parameters, shared by both optimisers.
        stabilize: every this many steps RiemannianAdam projects the points back onto the manifold and their
            momentum onto the tangent space (``None``: never; the retraction already projects each update).
    """

    def __init__(self, model: nn.Module, *, lr: float, manifold_lr: Optional[float] = None, weight_decay: float = 0.0,
                 betas: Iterable[float] = (0.9, 0.999), eps: float = 1e-8, stabilize: Optional[int] = None):
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr!r}")
        if manifold_lr is not None and not manifold_lr > 0:
            raise ValueError(f"manifold_lr must be positive or None, got {manifold_lr!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if stabilize is not None and (isinstance(stabilize, bool) or not isinstance(stabilize, int) or stabilize < 1):
            raise ValueError(f"stabilize must be a positive integer or None, got {stabilize!r}")
        betas = tuple(float(b) for b in betas)
        groups = group_parameters(model)
        if not any(groups.values()):
            raise ValueError("the model has no trainable parameters")

        def named(group: str, **options) -> list[dict]:
            # Named parameters make torch record ``param_names`` in the group (and in the state_dict).
            return [dict(params=groups[group], group=group, **options)] if groups[group] else []

        euclidean = named("decay", weight_decay=weight_decay) + named("no_decay", weight_decay=0.0)
        manifold = named("manifold", weight_decay=0.0, stabilize=stabilize)
        self.euclidean = torch.optim.AdamW(euclidean, lr=lr, betas=betas, eps=eps) if euclidean else None
        # the points' manifolds, recorded before FSDP2 can shard them into plain tensors
        self.riemannian = (RiemannianAdam(manifold, lr=manifold_lr or lr, betas=betas, eps=eps,
                                          manifolds=[_manifold_of(model, n, p) for n, p in groups["manifold"]])
                           if manifold else None)
        inner_groups = [g for opt in (self.euclidean, self.riemannian) if opt is not None for g in opt.param_groups]
        super().__init__(inner_groups, defaults={})
        self._link()

    def _link(self) -> None:
        """Point the inner optimisers at this optimiser's groups and state (again after a ``load_state_dict``)."""
        if self.euclidean is not None:
            self.euclidean.param_groups = [g for g in self.param_groups if g["group"] != "manifold"]
            self.euclidean.state = self.state
        if self.riemannian is not None:
            self.riemannian.param_groups = [g for g in self.param_groups if g["group"] == "manifold"]
            self.riemannian.state = self.state

    def __setstate__(self, state: dict) -> None:
        # ``load_state_dict`` installs new group dicts and a new state through here.
        super().__setstate__(state)
        if "riemannian" in self.__dict__:
            self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in (self.euclidean, self.riemannian):
            if opt is not None:
                opt.step()
        return loss


def build_optimizer(model: nn.Module, *, lr: float, manifold_lr: Optional[float] = None, weight_decay: float = 0.0,
                    betas: Iterable[float] = (0.9, 0.999), eps: float = 1e-8,
                    stabilize: Optional[int] = None) -> HybridAdamW:
    """The training optimiser of any model in the zoo (HELM or a Euclidean baseline): see :class:`HybridAdamW`."""
    return HybridAdamW(model, lr=lr, manifold_lr=manifold_lr, weight_decay=weight_decay, betas=betas, eps=eps,
                       stabilize=stabilize)


__all__ = ["GROUPS", "NO_DECAY_NAMES", "HybridAdamW", "RiemannianAdam", "build_optimizer", "classify_parameter",
           "group_parameters"]
