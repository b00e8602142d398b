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
import numbers
from typing import Any, Callable, Container, Iterable, Optional, Sequence

import torch
from huggingface_hub.dataclasses import validated_field

Rule = Callable[[Any], None]

# Documented ranges (inclusive unless the lower bound is 0, which is excluded). Each is justified by the maths in
# fp32, the precision every norm, time coordinate and curvature is computed in (README.md, Conventions: precision):
#
# * CURVATURE_RANGE bounds |K| of the paper's curvature, hence also geoopt's k = -1/K: k in [1e-4, 1e4] keeps
#   k, 1/k, sqrt(k) and the centroid floor k·(Σw)² far from fp32 overflow and underflow, keeps the curvature
#   change factor sqrt(k_out/k_in) between two layers <= 1e4, and keeps <x, x>_L = -k resolvable: fp32 resolves
#   k next to |x_s|² only while |x_s|² < k/ε₃₂ ≈ 8e6·k, i.e. |x_s| < 29 at k = 1e-4. It covers the paper's
#   -0.1 … -2.0 by three orders of magnitude on either side.
# * NORM_EPS_RANGE: RMSNorm_L adds eps to the mean square of the space part; at 1e-2 it already scales unit-scale
#   activations by 1/sqrt(1.01) (0.5%) and breaks Prop. 4.5's scale invariance for small ones, so larger values
#   are not a regulariser any more; any positive value down to the fp32 denormals is harmless.
# * INIT_STD_RANGE: Llama-style inits are 0.02. The Lorentz token table and the distance prototypes are expmap0
#   of vectors of norm ≈ std·sqrt(n), with time coordinate sqrt(k)·cosh(std·sqrt(n/k)), which overflows fp32
#   once std·sqrt(n/k) > 89: at std <= 1 and k = 1 that needs n > 7900, beyond every preset; a std of a few
#   units overflows the 115M model's table to inf.
# * TEMPERATURE_RANGE: attention logits are -d²/τ; the defaults sqrt(d) are 4–11. Below 1e-3 a squared-distance
#   gap of 0.1 is a logit gap of 100 (e^-100 underflows fp32's normal range): the softmax is one-hot and its
#   gradient vanishes; above 1e4 gaps of O(1) are logit gaps of 1e-4: attention is uniform and its gradient
#   scaled by 1e-4. τ itself is learned as log τ, so any value in range stays positive.
# * RESIDUAL_WEIGHT_RANGE: the sublayer's weight w in centroid([x, f(x)], [1, w]); in [1e-4, 1e4] both terms
#   contribute at least 1e-4 relative (well above ε₃₂ = 1.2e-7), softplus⁻¹(w) = log(expm1(w)) is finite
#   (expm1 overflows at 709), and k·(1 + w)² is far from overflow.
# * RESIDUAL_SCALE_FACTOR_RANGE: after each residual the space part is scaled by factor·sqrt(n), so its squared
#   norm is ≈ factor²·n·|c_s|² and its mean square ≈ factor²·|c_s|² (official runs: 1 and 4). Above 1e2 the
#   squared norm exceeds k/ε₃₂ ≈ 8e6·k (k = 1, |c_s| = 1) from n ≈ 800 on, so the time coordinate no longer
#   resolves k; below 1e-2 the mean square drops to 1e-4·|c_s|², towards RMSNorm_L's eps (up to 1e-2).
CURVATURE_RANGE = (1e-4, 1e4)
NORM_EPS_RANGE = (0, 1e-2)
INIT_STD_RANGE = (0, 1)
TEMPERATURE_RANGE = (1e-3, 1e4)
RESIDUAL_WEIGHT_RANGE = (1e-4, 1e4)
RESIDUAL_SCALE_FACTOR_RANGE = (1e-2, 1e2)

EMBEDDING_MODES = ("lorentz", "space")
LM_HEAD_MODES = ("linear", "distance")
SCORING_FUNCS = ("sigmoid", "softmax")
HEAD_MERGES = ("hcat", "flatten")
ATTENTION_TYPES = ("hmla", "mha")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _foreign_scalar(value) -> str:
    """A hint for a numpy or torch scalar given where a Python number is needed (configs are saved as JSON, which
    holds Python numbers), else ''."""
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)):
        return f" (a {type(value).__module__.split('.')[0]} scalar: pass int(...) or float(...))"
    if type(value).__module__.split(".")[0] == "torch" and getattr(value, "dim", lambda: 1)() == 0:
        return " (a 0-dim tensor: pass .item())"
    return ""


def integer(minimum: int = 1) -> Rule:
    """An ``int`` (not a bool) ``>= minimum``; Lorentz dims count the time coordinate, so they use 2."""

    def rule(value):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"must be an integer >= {minimum}, got {value!r}{_foreign_scalar(value)}")

    return rule


def positive(value) -> None:
    """A finite number ``> 0``."""
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"must be a positive finite number, got {value!r}{_foreign_scalar(value)}")


def non_negative(value) -> None:
    """A finite number ``>= 0``."""
    if not (_is_number(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"must be a non-negative finite number, got {value!r}{_foreign_scalar(value)}")


def greater_than(bound: float) -> Rule:
    def rule(value):
        if not (_is_number(value) and math.isfinite(value) and value > bound):
            raise ValueError(f"must be a finite number > {bound:g}, got {value!r}{_foreign_scalar(value)}")

    return rule


def in_range(bounds: tuple) -> Rule:
    """A positive finite number in ``[lo, hi]`` (``(0, hi]`` when ``lo == 0``): one of the documented ranges."""
    lo, hi = bounds
    text = f"({lo:g}, {hi:g}]" if lo == 0 else f"[{lo:g}, {hi:g}]"

    def rule(value):
        if not (_is_number(value) and math.isfinite(value) and value > 0 and lo <= value <= hi):
            raise ValueError(f"must be a positive finite number in {text}, got {value!r}{_foreign_scalar(value)}")

    return rule


def _curvature_ok(value) -> bool:
    return (_is_number(value) and math.isfinite(value) and value < 0
            and CURVATURE_RANGE[0] <= -value <= CURVATURE_RANGE[1])


_CURVATURE_TEXT = f"|K| in [{CURVATURE_RANGE[0]:g}, {CURVATURE_RANGE[1]:g}]"


def negative(value) -> None:
    """The paper's curvature ``K``: a finite number ``< 0`` with ``|K|`` in :data:`CURVATURE_RANGE`."""
    if not _curvature_ok(value):
        raise ValueError(f"must be a negative finite number with {_CURVATURE_TEXT} (paper convention K < 0), "
                         f"got {value!r}{_foreign_scalar(value)}")


def k_parameter(value) -> None:
    """geoopt's curvature parameter ``k = -1/K``: a positive finite number in :data:`CURVATURE_RANGE`.

    Tensors are accepted unchecked: they come from a parametrisation that keeps them in range (MiCE experts),
    and reading them would synchronise with the device."""
    if isinstance(value, torch.Tensor):
        return
    in_range(CURVATURE_RANGE)(value)


temperature = in_range(TEMPERATURE_RANGE)
norm_eps = in_range(NORM_EPS_RANGE)
init_std = in_range(INIT_STD_RANGE)
residual_weight = in_range(RESIDUAL_WEIGHT_RANGE)
residual_scale_factor = in_range(RESIDUAL_SCALE_FACTOR_RANGE)


def boolean(value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"must be a bool, got {value!r}{_foreign_scalar(value)}")


def probability(value) -> None:
    """A finite number in ``[0, 1]`` (a dropout rate)."""
    if not (_is_number(value) and 0 <= value <= 1):
        raise ValueError(f"must be a number in [0, 1], got {value!r}{_foreign_scalar(value)}")


def mapping(value) -> None:
    """A ``dict`` (``id2label``, ``label2id``: ``transformers`` iterates their items)."""
    if not isinstance(value, dict):
        raise ValueError(f"must be a dict, got {value!r}{_foreign_scalar(value)}")


def torch_dtype(value) -> None:
    """A ``torch.dtype`` or the name of one (``"float32"``, ``"bfloat16"``), as ``transformers`` reads ``dtype``."""
    if not (isinstance(value, torch.dtype) or
            (isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype))):
        raise ValueError(f"must be a torch.dtype or the name of one ('float32', 'bfloat16', 'float16', ...), "
                         f"got {value!r}{_foreign_scalar(value)}")


def one_of(accepted: Container) -> Rule:
    """Membership in ``accepted`` (read at check time, so a registry may grow after the rule is made)."""

    def rule(value):
        if value not in accepted:
            raise ValueError(f"must be one of {tuple(accepted)}, got {value!r}{_foreign_scalar(value)}")

    return rule


def optional(rule: Rule) -> Rule:
    """``None`` or a value accepted by ``rule``."""

    def maybe(value):
        if value is not None:
            rule(value)

    return maybe


def negative_list(value) -> None:
    """A list of paper curvatures, each accepted by :func:`negative`."""
    if not (isinstance(value, (list, tuple)) and all(_is_number(v) and math.isfinite(v) and v < 0 for v in value)):
        raise ValueError(f"must be a list of negative finite numbers (paper K < 0), got {value!r}"
                         f"{_foreign_scalar(value)}")
    if not all(_curvature_ok(v) for v in value):
        raise ValueError(f"must be a list of curvatures with {_CURVATURE_TEXT}, got {value!r}{_foreign_scalar(value)}")


def token_ids(vocab_size: int) -> Rule:
    """A token id or a non-empty list of token ids (``eos_token_id`` may be several), each an ``int`` in
    ``[0, vocab_size)``: a special token outside the vocabulary fails only at generation or padding time."""

    def rule(value):
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size
                                 for v in values):
            raise ValueError(f"must be a token id (or list of ids) in [0, vocab_size={vocab_size}), got {value!r}"
                             f"{_foreign_scalar(value)}")

    return rule


def curvature_pair(value) -> None:
    """Two paper curvatures ``[first, last]`` (a range of expert curvatures), each accepted by :func:`negative`."""
    negative_list(value)
    if len(value) != 2:
        raise ValueError(f"must be a pair [first, last] of curvatures, got {value!r}{_foreign_scalar(value)}")


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
    """geoopt's ``k`` of a layer (see :func:`k_parameter`)."""
    check(k, name, k_parameter)


def check_tensor(t: torch.Tensor, name: str, expected: Sequence[Optional[int]], described: str, *,
                 dtype: str = "any", alternative: Optional[Sequence[Optional[int]]] = None,
                 nonempty: bool = False, note: str = "") -> None:
    """Shape and dtype of a model input (free: no device read).

    ``expected`` is the shape (``None``: any size), ``described`` its symbolic form for the message
    (``"[B, T]"``); ``alternative`` a second accepted shape (``[1, T]`` position ids that broadcast);
    ``dtype`` ``"integer"``, ``"index"`` (int64 or int32: token ids), ``"long"`` (int64: targets),
    ``"floating"`` or ``"any"``; ``nonempty`` refuses zero-sized dimensions;
    ``note`` is appended to the expected shape in the message.
    """
    def matches(shape):
        return t.dim() == len(shape) and all(e is None or s == e for s, e in zip(t.shape, shape))

    def fmt(shape):
        return "[" + ", ".join(d if e is None else str(e) for d, e in zip(described.strip("[]").split(", "), shape)) + "]"

    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {described}, got {type(t).__name__}")
    if not (matches(expected) or (alternative is not None and matches(alternative))):
        also = f" (or {fmt(alternative)})" if alternative is not None and fmt(alternative) != fmt(expected) else ""
        concrete = "" if fmt(expected) == described else f" = {fmt(expected)}"
        raise ValueError(f"{name} must be {described}{concrete}{note}{also}, got {tuple(t.shape)}")
    if nonempty and t.numel() == 0:
        raise ValueError(f"{name} must be {described} with B >= 1 and T >= 1, got {tuple(t.shape)}")
    if dtype == "integer" and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
    if dtype == "index" and t.dtype not in (torch.int64, torch.int32) or dtype == "long" and t.dtype != torch.int64:
        # embedding lookups take int64 or int32 indices (uint8 ids wrap at 256), cross-entropy int64 targets
        accepted = "an int64 (or int32)" if dtype == "index" else "an int64"
        raise ValueError(f"{name} must be {accepted} tensor of token ids, got {t.dtype}; convert it with "
                         f"{name}.long()")
    if dtype == "floating" and not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


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
    "HEAD_MERGES",
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
    "check_tensor",
    "curvature_pair",
    "field",
    "greater_than",
    "in_range",
    "init_std",
    "integer",
    "k_parameter",
    "mapping",
    "negative",
    "negative_list",
    "non_negative",
    "norm_eps",
    "one_of",
    "optional",
    "positive",
    "probability",
    "residual_scale_factor",
    "residual_weight",
    "temperature",
    "token_ids",
    "torch_dtype",
    "CURVATURE_RANGE",
    "INIT_STD_RANGE",
    "NORM_EPS_RANGE",
    "RESIDUAL_SCALE_FACTOR_RANGE",
    "RESIDUAL_WEIGHT_RANGE",
    "TEMPERATURE_RANGE",
]
