"""Argument and config-field rules, and the string vocabularies the configs and layers share.

A *rule* is a function ``rule(value) -> None`` that raises ``ValueError("must be ..., got <value>")``; :func:`check`
prefixes the name of the argument or config field, so the one-line error names the culprit, its value and what is
accepted. Configs attach rules to their fields with :func:`field` (huggingface_hub's ``validated_field``, the rule in
the dataclass field's ``metadata["validator"]`` as in ``transformers``' strict configs); the configs are the
boundary, layers built from them trust their arguments.

Vocabularies that map names to code live with that code, as registries: activations
(:data:`helm.nn.activation.ACTIVATIONS`), positional encodings (:data:`helm.nn.positional.POSITIONAL_ENCODINGS`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Container, Iterable

import torch
from huggingface_hub.dataclasses import validated_field

Rule = Callable[[Any], None]

# Documented ranges (inclusive, except a lower bound 0, which is excluded), chosen for fp32, the precision of every
# norm, time coordinate and curvature (the reasons, per field, are in HelmConfigBase's docstring):
# |K| (and k = -1/K): k, 1/k, sqrt(k) and k·(Σw)² far from fp32 limits; <x, x>_L = -k resolvable next to |x_s|².
CURVATURE_RANGE = (1e-4, 1e4)
# RMSNorm_L's eps: a regulariser; at 1e-2 it already rescales unit-scale activations by 0.5%.
NORM_EPS_RANGE = (0, 1e-2)
# initializer_range: wrapped-normal tables have time coordinates sqrt(k)·cosh(std·sqrt(n/k)), overflowing fp32 past 89.
INIT_STD_RANGE = (0, 1)
# attention temperature of -d²/τ: below 1e-3 the softmax is one-hot, above 1e4 uniform (and its gradient ~1e-4).
TEMPERATURE_RANGE = (1e-3, 1e4)
# residual weight w in centroid([x, f(x)], [1, w]): both terms resolvable in fp32, softplus⁻¹(w) finite.
RESIDUAL_WEIGHT_RANGE = (1e-4, 1e4)
# residual space scale factor: |x_s|² below k/ε₃₂ for n ≈ 800 above 1e2, mean square near RMSNorm's eps below 1e-2.
RESIDUAL_SCALE_FACTOR_RANGE = (1e-2, 1e2)

EMBEDDING_MODES = ("lorentz", "space")
LM_HEAD_MODES = ("linear", "distance")
SCORING_FUNCS = ("sigmoid", "softmax")
HEAD_MERGES = ("hcat", "flatten")
ATTENTION_TYPES = ("hmla", "mha")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_number(value) -> bool:
    return _is_number(value) and math.isfinite(value)


def integer(minimum: int = 1) -> Rule:
    """An ``int`` (not a bool) ``>= minimum``; Lorentz dims count the time coordinate, so they use 2."""

    def rule(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"must be an integer >= {minimum}, got {value!r}")

    return rule


def greater_than(bound: float) -> Rule:
    """A finite number ``> bound``."""

    def rule(value):
        if not (_finite_number(value) and value > bound):
            raise ValueError(f"must be a finite number > {bound:g}, got {value!r}")

    return rule


def positive(value) -> None:
    """A finite number ``> 0``."""
    if not (_finite_number(value) and value > 0):
        raise ValueError(f"must be a positive finite number, got {value!r}")


def non_negative(value) -> None:
    """A finite number ``>= 0``."""
    if not (_finite_number(value) and value >= 0):
        raise ValueError(f"must be a non-negative finite number, got {value!r}")


def in_range(bounds: tuple) -> Rule:
    """A finite number in ``[lo, hi]`` (``(0, hi]`` when ``lo == 0``): one of the documented ranges."""
    lo, hi = bounds
    text = f"({lo:g}, {hi:g}]" if lo == 0 else f"[{lo:g}, {hi:g}]"

    def rule(value):
        if not (_finite_number(value) and value > 0 and lo <= value <= hi):
            raise ValueError(f"must be a positive finite number in {text}, got {value!r}")

    return rule


temperature = in_range(TEMPERATURE_RANGE)
norm_eps = in_range(NORM_EPS_RANGE)
init_std = in_range(INIT_STD_RANGE)
residual_weight = in_range(RESIDUAL_WEIGHT_RANGE)
residual_scale_factor = in_range(RESIDUAL_SCALE_FACTOR_RANGE)
k_parameter = in_range(CURVATURE_RANGE)


def negative(value) -> None:
    """The paper's curvature ``K < 0`` with ``|K|`` in :data:`CURVATURE_RANGE`."""
    if not (_finite_number(value) and CURVATURE_RANGE[0] <= -value <= CURVATURE_RANGE[1]):
        raise ValueError(f"must be a negative finite number with |K| in [{CURVATURE_RANGE[0]:g}, "
                         f"{CURVATURE_RANGE[1]:g}], got {value!r}")


def negative_list(value) -> None:
    """A list of paper curvatures, each accepted by :func:`negative`."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"must be a list of curvatures, got {value!r}")
    for curvature in value:
        negative(curvature)


def curvature_pair(value) -> None:
    """Two paper curvatures ``[first, last]`` (a range of expert curvatures)."""
    negative_list(value)
    if len(value) != 2:
        raise ValueError(f"must be a pair [first, last] of curvatures, got {value!r}")


def boolean(value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"must be a bool, got {value!r}")


def one_of(accepted: Container) -> Rule:
    """Membership in ``accepted`` (read at check time, so a registry may grow after the rule is made)."""

    def rule(value):
        if value not in accepted:
            raise ValueError(f"must be one of {tuple(accepted)}, got {value!r}")

    return rule


def optional(rule: Rule) -> Rule:
    """``None`` or a value accepted by ``rule``."""

    def maybe(value):
        if value is not None:
            rule(value)

    return maybe


def check(value, name: str, rule: Rule):
    """Run ``rule`` on ``value``; the ``ValueError`` names ``name``. Returns ``value``."""
    try:
        rule(value)
    except ValueError as err:
        raise ValueError(f"{name} {err}") from None
    return value


def check_dim(value, name: str, *, minimum: int = 1) -> int:
    return check(value, name, integer(minimum))


def check_positive(value, name: str) -> float:
    return float(check(value, name, positive))


def check_k(k, name: str = "k") -> None:
    """geoopt's ``k = -1/K`` of a layer, in :data:`CURVATURE_RANGE`; tensors (MiCE's parametrised expert
    curvatures, kept in range by construction) pass unread, as reading them would synchronise with the device."""
    if not isinstance(k, torch.Tensor):
        check(k, name, k_parameter)


def check_choice(value, name: str, accepted: Iterable) -> str:
    return check(value, name, one_of(accepted))


def check_decay_above(theta_prime, max_theta: float, name: str) -> None:
    """Seed 000's ``θ' > max θ_l``: otherwise the boost outgrows its damping at long range."""
    if theta_prime is not None and not theta_prime > max_theta:
        raise ValueError(f"{name} must exceed max θ_l = {max_theta:g}, got {theta_prime!r}")


def field(rule: Rule, default=None):
    """A config dataclass field checked by ``rule`` whenever it is assigned (see ``HelmConfigBase.__setattr__``)."""
    return validated_field(rule, default=default)
