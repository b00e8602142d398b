"""RoPE scaling for the rotary encodings (``hope``, ``rope3d``, HMLA's decoupled HoPE), configured like
``transformers``' ``rope_parameters`` and computed by :mod:`transformers.modeling_rope_utils`.

A HELM config's ``rope_parameters`` is a Llama rope dict, e.g. ``{"rope_type": "yarn", "factor": 4.0,
"original_max_position_embeddings": 256}``. :class:`RopeScaling` turns it into

* the rotation frequencies ``θ'_l`` (``[d/2]``, float64) of one forward: ``transformers``' scaled inverse
  frequencies, as a ratio to its own default ones, times HELM's float64 default ``θ_l = base^(-2l/d)``::

      θ'_l = θ_l · inv_freq_l(rope_type) / inv_freq_l(default)        (both from transformers, fp32)

  so the scaling is ``transformers``' own (every ``ROPE_INIT_FUNCTIONS`` entry) while the unscaled frequencies
  keep the float64 precision the exact-angle tables need, and a scaling that is the identity in ``transformers``
  (``linear`` with ``factor = 1``, ``dynamic`` up to ``max_position_embeddings``) leaves ``θ_l`` bit for bit;
* the attention factor ``a`` of ``yarn`` / ``longrope``: ``transformers`` multiplies ``cos`` and ``sin`` by ``a``,
  which scales ``q·k`` by ``a²``. A Lorentz rotation cannot be scaled (``lift`` would move the point), so HELM
  multiplies the logit scale instead: ``logits = a²·(2/τ)·<q, k>_L`` (:attr:`logit_scale` ``= a²``), the same
  change of the softmax (``softmax(-d²/τ) = softmax((2/τ)<q, k>_L)``; the constant ``-2k/τ`` cancels).

``resonance`` (Resonance RoPE, Wang et al. 2024; seed 002's related work) has no ``transformers`` type: it is a
boolean key combinable with every ``rope_type`` (``"resonance": true`` on ``default`` is plain Resonance RoPE, on
``yarn`` Resonance YaRN, as in the paper). After the type's scaling, every dim whose wavelength ``λ_l = 2π/θ'_l``
is shorter than ``L = original_max_position_embeddings`` (default ``max_position_embeddings``) gets the nearest
integer wavelength, ``θ''_l = 2π / round(λ_l)``, so its rotation repeats exactly every ``round(λ_l)`` positions
and a position beyond ``L`` meets no angle that training did not.

``dynamic`` and ``longrope`` choose their frequencies from the length ``S = max(position_ids) + 1`` of each forward
(``transformers``' ``dynamic_rope_update``; ``dynamic``: NTK with ``base·(factor·S/M - factor + 1)^(d/(d-2))`` for
``S > M = max_position_embeddings``; ``longrope``: ``long_factor`` once ``S > original_max_position_embeddings``,
else ``short_factor``). HELM recomputes them from ``S`` at every forward (stateless; ``transformers`` also keeps the
largest length seen, which differs only when a later call is shorter than an earlier one beyond ``M``). Cached
keys keep the frequencies of the forward that wrote them, so past that length a cached decode cannot equal a full
forward, whose every token uses the frequencies of the whole length: by construction, as in ``transformers``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Optional

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RotaryEmbeddingConfigMixin

from ..validation import _is_number
from .base import inverse_frequencies

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# rope types whose frequencies depend on the length of the forward (transformers' dynamic_rope_update)
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
# kinds of positional encoding that take rope_parameters (the rotary ones with RoPE frequencies)
SCALABLE_KINDS = ("hope", "rope3d")

# (required, optional) keys per rope_type: transformers' _validate_<type>_rope_parameters, plus HELM's keys
_KEYS = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "yarn": ({"factor", "original_max_position_embeddings"},
             {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "longrope": ({"short_factor", "long_factor", "original_max_position_embeddings"}, {"attention_factor", "factor"}),
    "llama3": ({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}, set()),
}
_COMMON_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "resonance"}


def _fail(key: str, message: str):
    raise ValueError(f"rope_parameters[{key!r}] {message}")


def _number(params: dict, key: str, *, minimum: float | None = None, strict: bool = False) -> None:
    value = params[key]
    ok = _is_number(value) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if strict else value >= minimum
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        _fail(key, f"must be a finite number{bound}, got {value!r}")


def check_rope_parameters(params: Any, *, kind: str = "hope", rope_dims: Optional[int] = None) -> dict:
    """Validate a Llama-style rope dict for the encoding ``kind`` and return a standardised copy.

    Args:
        params: ``None`` (no scaling) or a dict with ``rope_type`` (legacy name ``type``) in :data:`ROPE_TYPES`
            and that type's keys, exactly as ``transformers`` reads them; optional ``rope_theta``,
            ``partial_rotary_factor`` (only ``1.0``: HELM rotates every space dim the encoding acts on) and
            ``resonance`` (a bool).
        kind: the positional encoding (``rope3d`` takes ``original_max_position_embeddings`` with ``linear``).
        rope_dims: space dims ``d`` per head the rotation acts on (checks the length of LongRoPE's factor lists).

    Returns:
        A new dict with ``rope_type`` set (``{"rope_type": "default"}`` for ``None``); ``rope_theta`` is kept if given.

    Raises:
        ValueError: naming the bad key: not a dict, unknown ``rope_type``, a missing required key, a key the type
        does not read (``transformers`` only warns; here it would silently have no effect), or a bad value.
    """
    if params is None:
        return {"rope_type": "default"}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict like transformers' (e.g. {{'rope_type': 'linear', "
                         f"'factor': 4.0}}) or None, got {params!r}")
    params = dict(params)
    if "type" in params:  # transformers' legacy name of rope_type
        legacy = params.pop("type")
        params.setdefault("rope_type", legacy)
    params.setdefault("rope_type", "default")
    rope_type = params["rope_type"]
    if rope_type not in ROPE_TYPES:
        _fail("rope_type", f"must be one of {ROPE_TYPES}, got {rope_type!r}")
    required, optional = _KEYS[rope_type]
    allowed = required | optional | _COMMON_KEYS
    resonance = params.get("resonance", False)
    if not isinstance(resonance, bool):
        _fail("resonance", f"must be a bool, got {resonance!r}")
    if resonance or (kind == "rope3d" and rope_type == "linear"):
        allowed = allowed | {"original_max_position_embeddings"}
    missing = sorted(required - set(params))
    if missing:
        _fail(missing[0], f"is required for rope_type={rope_type!r} (required keys: {sorted(required)})")
    unknown = sorted(set(params) - allowed)
    if unknown:
        _fail(unknown[0], f"is not read by rope_type={rope_type!r}{' with resonance' if resonance else ''} for "
                          f"positional={kind!r}; accepted keys: {sorted(allowed)}")
    if "rope_theta" in params:
        _number(params, "rope_theta", minimum=0, strict=True)
    if "partial_rotary_factor" in params and params["partial_rotary_factor"] != 1.0:
        _fail("partial_rotary_factor", f"must be 1.0: HELM's rotary encodings rotate every space dim they act on "
                                       f"(HMLA's rope dims are already a separate part), got "
                                       f"{params['partial_rotary_factor']!r}")
    if "factor" in params:
        _number(params, "factor", minimum=1)
    if "original_max_position_embeddings" in params:
        value = params["original_max_position_embeddings"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail("original_max_position_embeddings", f"must be an integer >= 1, got {value!r}")
    if params.get("attention_factor") is not None:
        _number(params, "attention_factor", minimum=0, strict=True)
    for key in ("beta_fast", "beta_slow", "low_freq_factor", "high_freq_factor"):
        if params.get(key) is not None:
            _number(params, key, minimum=0, strict=True)
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            _number(params, key)
    if (params.get("beta_fast") or 32) <= (params.get("beta_slow") or 1):
        _fail("beta_fast", f"must exceed beta_slow (defaults 32 and 1), got {params.get('beta_fast')!r} and "
                           f"{params.get('beta_slow')!r}")
    if "truncate" in params and not isinstance(params["truncate"], bool):
        _fail("truncate", f"must be a bool, got {params['truncate']!r}")
    if rope_type == "llama3":
        if params["high_freq_factor"] <= params["low_freq_factor"]:
            _fail("high_freq_factor", f"must exceed low_freq_factor, got {params['high_freq_factor']!r} <= "
                                      f"{params['low_freq_factor']!r}")
    for key in ("short_factor", "long_factor"):
        if key in params:
            value = params[key]
            if not (isinstance(value, (list, tuple)) and value
                    and all(_is_number(v) and math.isfinite(v) and v > 0 for v in value)):
                _fail(key, f"must be a non-empty list of positive finite numbers, got {value!r}")
            if rope_dims is not None and len(value) != rope_dims // 2:
                _fail(key, f"must have one entry per rotated pair, {rope_dims // 2} (= {rope_dims} space dims / 2), "
                           f"got {len(value)}")
            params[key] = [float(v) for v in value]
    return params


class _RopeConfigView(RotaryEmbeddingConfigMixin):
    """The attributes ``transformers``' ``ROPE_INIT_FUNCTIONS`` read from a model config: ``head_dim`` (here the
    ``d`` space dims the encoding rotates), ``hidden_size`` / ``num_attention_heads`` (consistent with it),
    ``max_position_embeddings`` and ``rope_parameters`` (with ``rope_theta``). Standardisation is the mixin's."""

    def __init__(self, *, head_dim: int, max_position_embeddings: int, rope_parameters: dict):
        self.head_dim, self.hidden_size, self.num_attention_heads = head_dim, head_dim, 1
        self.max_position_embeddings = max_position_embeddings
        self.rope_parameters = {k: v for k, v in rope_parameters.items() if k != "resonance"}


def transformers_rope(params: dict, *, head_dim: int, base: float, max_position_embeddings: int,
                      seq_len: Optional[int] = None) -> tuple[torch.Tensor, float]:
    """``transformers``' ``(inv_freq [d/2] fp32 on the CPU, attention_factor)`` for ``params`` at ``seq_len``
    (``None``: the frequencies a model starts with). ``default`` is Llama's ``compute_default_rope_parameters``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    view = _RopeConfigView(head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                           rope_parameters={**params, "rope_theta": float(base)})
    with torch.device("cpu"):  # host tables, also while from_pretrained builds the model on the meta device
        if params["rope_type"] == "default":
            return LlamaRotaryEmbedding.compute_default_rope_parameters(view)
        return ROPE_INIT_FUNCTIONS[params["rope_type"]](view, "cpu", seq_len=seq_len)


class RopeScaling:
    """The frequencies and logit scale of one rope dict for ``d = head_dim`` rotated space dims (module docstring).

    ``frequencies(seq_len) -> [d/2]`` float64 ``θ'_l`` for a forward of length ``seq_len``; :meth:`length_key`
    maps a length to the frequency set it uses (one set unless :attr:`length_dependent`), ``logit_scale = a²``.
    """

    def __init__(self, params: Optional[dict], *, head_dim: int, base: float, max_position_embeddings: int,
                 kind: str = "hope"):
        self.params = check_rope_parameters(params, kind=kind, rope_dims=head_dim)
        if "rope_theta" in self.params and float(self.params["rope_theta"]) != float(base):
            _fail("rope_theta", f"= {self.params['rope_theta']!r} disagrees with rope_theta = {base!r}; "
                                "set one of them")
        self.head_dim, self.base, self.max_position_embeddings = head_dim, float(base), max_position_embeddings
        self.rope_type: str = self.params["rope_type"]
        self.resonance: bool = self.params.get("resonance", False)
        self.original_max_position_embeddings: int = self.params.get("original_max_position_embeddings",
                                                                     max_position_embeddings)
        self.length_dependent = self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES
        # 3D-RPE's linear interpolation (seed 002, App. C) lengthens the chunks and keeps the frequencies
        self.interpolates_chunks = kind == "rope3d" and self.rope_type == "linear"
        _, self.attention_factor = transformers_rope(self.params, head_dim=head_dim, base=base,
                                                     max_position_embeddings=max_position_embeddings)
        self.attention_factor = float(self.attention_factor)
        self.logit_scale = self.attention_factor ** 2
        self._default_fp32 = transformers_rope({"rope_type": "default"}, head_dim=head_dim, base=base,
                                               max_position_embeddings=max_position_embeddings)[0].double()
        self._cache: OrderedDict[int, torch.Tensor] = OrderedDict()

    def length_key(self, seq_len: Optional[int]) -> int:
        """The length that decides the frequency set of a forward of ``seq_len`` tokens: ``dynamic`` uses
        ``max(seq_len, M)`` (at ``M`` it is the default), ``longrope`` ``L_orig + 1`` beyond ``L_orig`` (long
        factors) else 0 (short factors); other types 0 (one set)."""
        if self.rope_type == "dynamic":
            return max(int(seq_len or 0), self.max_position_embeddings)
        if self.rope_type == "longrope" and seq_len is not None and seq_len > self.original_max_position_embeddings:
            return self.original_max_position_embeddings + 1
        return 0

    def frequencies(self, seq_len: Optional[int] = None) -> torch.Tensor:
        """``θ'_l`` ``[d/2]`` float64 for a forward of ``seq_len`` tokens (see the module docstring)."""
        key = self.length_key(seq_len)
        if key not in self._cache:
            theta = inverse_frequencies(self.head_dim, self.base)
            if self.rope_type != "default" and not self.interpolates_chunks:
                scaled, _ = transformers_rope(self.params, head_dim=self.head_dim, base=self.base,
                                              max_position_embeddings=self.max_position_embeddings,
                                              seq_len=key or None)
                theta = theta * (scaled.double() / self._default_fp32)
            if self.resonance:
                theta = resonance_frequencies(theta, self.original_max_position_embeddings)
            self._cache[key] = theta
            while len(self._cache) > 16:
                self._cache.popitem(last=False)
        return self._cache[key]


def resonance_frequencies(theta: torch.Tensor, original_max_position_embeddings: int) -> torch.Tensor:
    """Resonance RoPE: ``θ_l ↦ 2π / round(2π/θ_l)`` for every dim whose wavelength ``2π/θ_l`` is shorter than
    ``L = original_max_position_embeddings``; the others are unchanged. ``theta [d/2]`` float64 -> ``[d/2]``."""
    wavelength = 2 * math.pi / theta
    rounded = torch.round(wavelength)
    short = wavelength < original_max_position_embeddings
    if bool((short & (rounded < 2)).any()):
        raise ValueError("rope_parameters['resonance'] needs wavelengths 2π/θ >= 1.5 (a rounded wavelength of 1 is no "
                         f"rotation at all); the scaled frequencies have a wavelength of {float(wavelength.min()):.3g}")
    return torch.where(short, 2 * math.pi / rounded, theta)


__all__ = ["LENGTH_DEPENDENT_ROPE_TYPES", "ROPE_TYPES", "RopeScaling", "SCALABLE_KINDS", "check_rope_parameters",
           "resonance_frequencies", "transformers_rope"]
