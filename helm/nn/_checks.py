"""Argument validation shared by the layers: every error names the argument and what is accepted."""

from __future__ import annotations

from ..manifold.math import check_k


def check_dim(value, name: str, *, minimum: int = 1) -> int:
    """Raise ``ValueError`` unless ``value`` is an int >= ``minimum`` (Lorentz dims count the time coordinate)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_choice(value, name: str, accepted) -> str:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {tuple(accepted)}, got {value!r}")
    return value


def check_positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


__all__ = ["check_dim", "check_choice", "check_positive", "check_k"]
