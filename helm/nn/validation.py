"""The one place where arguments and config fields are checked, and where the string vocabularies live.

A *rule* is a function ``rule(value) -> None`` that raises ``ValueError("must be ..., got ...")``; :func:`check`
prefixes the name of the argument or config field, so every error says which value is wrong and what is
accepted. Layers call the ``check_*`` helpers on their keyword arguments; configs attach the same rules to
their fields with :func:`field` (huggingface_hub's ``validated_field``: the rule sits in the dataclass field's
``metadata["validator"]``, as in ``transformers``' strict configs) and run them with :func:`check_fields`.

Vocabularies that map names to code live with that code, as registries: activations
(:data:`helm.nn.activation.ACTIVATIONS`), positional encodings (:data:`helm.nn.positional.POSITIONAL_ENCODINGS`,
with each kind's properties) and attention implementations (:func:`helm.ops.available_attention_impls`).
The plain string vocabularies are defined here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Container, Iterable

from huggingface_hub.dataclasses import validated_field

from ..manifold.math import check_k

Rule = Callable[[Any], None]

EMBEDDING_MODES = ("lorentz", "space")
LM_HEAD_MODES = ("linear", "distance")
SCORING_FUNCS = ("sigmoid", "softmax")
ATTENTION_TYPES = ("hmla", "mha")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(minimum: int = 1) -> Rule:
    """An ``int`` (not a bool) ``>= minimum``; Lorentz dims count the time coordinate, so they use 2."""

    def rule(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"must be an integer >= {minimum}, got {value!r}")

    return rule


def positive(value) -> None:
    """A finite number ``> 0``."""
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive finite number, got {value!r}")


def non_negative(value) -> None:
    """A finite number ``>= 0``."""
    if not (_is_number(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"must be a non-negative finite number, got {value!r}")


def greater_than(bound: float) -> Rule:
    def rule(value):
        if not (_is_number(value) and math.isfinite(value) and value > bound):
            raise ValueError(f"must be a finite number > {bound:g}, got {value!r}")

    return rule


def negative(value) -> None:
    """A finite number ``< 0`` (the paper's curvature ``K``)."""
    if not (_is_number(value) and math.isfinite(value) and value < 0):
        raise ValueError(f"must be a negative number (paper convention K < 0), got {value!r}")


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


def negative_list(value) -> None:
    if not (isinstance(value, (list, tuple)) and all(_is_number(v) and math.isfinite(v) and v < 0 for v in value)):
        raise ValueError(f"must be a list of negative numbers (paper K < 0), got {value!r}")


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


def check_choice(value, name: str, accepted: Iterable) -> str:
    return check(value, name, one_of(accepted))


def check_decay_above(theta_prime, max_theta: float, name: str) -> None:
    """Seed 000's ``θ' > max θ_l``: otherwise the boost outgrows its damping at long range."""
    if theta_prime is not None and not theta_prime > max_theta:
        raise ValueError(f"{name} must exceed max θ_l = {max_theta:g} (seed 000: θ' > max θ_i, else the boost "
                         f"outgrows its damping), got {theta_prime!r}")


def field(rule: Rule, default=None):
    """A config dataclass field checked by ``rule`` (see :func:`check_fields`)."""
    return validated_field(rule, default=default)


def check_fields(config) -> None:
    """Run every rule attached with :func:`field` on ``config``; the error names the field."""
    for f in dataclasses.fields(config):
        for rule in f.metadata.get("validator", ()):
            check(getattr(config, f.name), f.name, rule)


__all__ = [
    "ATTENTION_TYPES",
    "EMBEDDING_MODES",
    "LM_HEAD_MODES",
    "SCORING_FUNCS",
    "boolean",
    "check",
    "check_choice",
    "check_decay_above",
    "check_dim",
    "check_fields",
    "check_k",
    "check_positive",
    "field",
    "greater_than",
    "integer",
    "negative",
    "negative_list",
    "non_negative",
    "one_of",
    "optional",
    "positive",
]
