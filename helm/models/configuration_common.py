"""Fields and checks shared by the HELM configs (written like ``transformers``' ``LlamaConfig``).

A config validates once, where it is built: every field carries its rule (:func:`helm.nn.validation.field`, checked
on every assignment by :meth:`HelmConfigBase.__setattr__`), a constructor key no field reads is refused naming it
(:meth:`HelmConfigBase.refuse_unknown_keys`), and ``__post_init__`` runs :meth:`HelmConfigBase.validate_architecture`:
the derived defaults (:meth:`HelmConfigBase.derive_defaults`: a None ``head_dim`` or ``routed_curvatures``, also when
assigned after construction), then the checks across fields. Derived values are properties, never stored: ``k``
(from ``curvature``) and ``residual_space_scale`` (from ``residual_space_scale_factor`` and ``hidden_size``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math

import numpy as np
from transformers import GenerationConfig, PreTrainedConfig
from transformers.utils import logging

from ..manifold.math import curvature_to_k
from ..nn.activation import ACTIVATIONS
from ..nn.positional.registry import POSITIONAL_ENCODINGS, positional_encoding_class
from ..nn.positional.rotary import interpolated_chunk_size
from ..nn.positional.scaling import SCALABLE_KINDS, RopeScaling, check_rope_parameters
from ..nn.validation import (
    EMBEDDING_MODES,
    HEAD_MERGES,
    LM_HEAD_MODES,
    boolean,
    check,
    check_decay_above,
    field,
    greater_than,
    init_std,
    integer,
    negative,
    norm_eps,
    one_of,
    optional,
    positive,
    residual_scale_factor,
    residual_weight,
    temperature,
)

logger = logging.get_logger(__name__)

# Old field names read from saved configs: (old name -> new name). ``pe_options`` keys map to typed fields.
_PE_OPTION_FIELDS = {"chunk_size": "rope3d_chunk_size", "chunk_base": "rope3d_chunk_base",
                     "theta_prime": "hope_boost_theta_prime", "angle_scale": "hope_boost_angle_scale",
                     "learnable_decay": "hope_boost_learnable_decay"}


@functools.lru_cache(maxsize=None)
def known_keys(config_class: type) -> frozenset:
    """The keys the constructor of ``config_class`` takes (hence a ``config.json``, a preset file, an override of
    ``helm.load_config``): its fields, settable properties and legacy names, and what ``PreTrainedConfig`` itself
    consumes (``model_type``, ``auto_map``, the attention and experts implementations, the generation parameters it
    drops from old configs). Keys starting with ``_`` are transformers' bookkeeping and always pass."""
    names = {f.name for f in dataclasses.fields(config_class)} | set(config_class.legacy_kwargs)
    names |= {n for n, v in inspect.getmembers(config_class) if isinstance(v, property) and v.fset is not None}
    names |= set(getattr(GenerationConfig, "_get_default_generation_params", dict)())
    return frozenset(names | {"model_type", "auto_map", "attn_implementation", "experts_implementation"})


class HelmConfigBase(PreTrainedConfig):
    r"""Fields shared by both families: Llama names first, then the HELM-specific ones.

    Dimensions are *ambient*: they count the time coordinate, like the paper (the 115M model has
    ``hidden_size=390 = 1 + 389`` and heads of ``head_dim=65 = 1 + 64``).

    Every float field is finite (nan and inf are refused, naming the field), and those below lie in documented
    ranges, justified in :mod:`helm.nn.validation` (fp32 is the precision of every norm, time coordinate and
    curvature):

    ==============================  ==================  ==================================================
    field                           range               why
    ==============================  ==================  ==================================================
    ``curvature``                   ``|K| in [1e-4, 1e4]``, ``K < 0``  ``k = -1/K``, ``sqrt(k)``, ``k·(Σw)²`` far from
                                                        fp32 limits; ``<x,x>_L = -k`` resolvable next to ``|x_s|²``
    ``rms_norm_eps``                ``(0, 1e-2]``       a regulariser, not a change of unit-scale outputs
    ``initializer_range``           ``(0, 1]``          and, with ``embedding_mode='lorentz'`` or
                                                        ``lm_head_mode='distance'`` (wrapped-normal tables),
                                                        ``(sqrt(n) + 5)·std/sqrt(k) <= 40``: ``cosh`` of it,
                                                        squared, stays inside fp32 (``n = hidden_size - 1``)
    ``tau_init``                    ``[1e-3, 1e4]``     softmax of ``-d²/τ`` neither one-hot nor uniform
    ``residual_weight``             ``[1e-4, 1e4]``     both centroid terms above fp32 resolution
    ``residual_space_scale_factor`` ``[1e-2, 1e2]``     ``|x_s|²`` below ``k/ε₃₂``, above RMSNorm's eps
    ``rope_theta``, ``hope_boost_*``  ``> 0``, finite   (``rope3d_chunk_base > 1``)
    ``sinusoidal_scale``            ``> 0``, finite
    ==============================  ==================  ==================================================

    Every field is checked by its rule from every source (constructor keywords, ``config.json``, keywords of
    ``from_pretrained``, ``helm.load_config``, assignment after construction); the error names the field and the
    value. ``tie_word_embeddings`` accepts only ``False`` (the token table holds points or space parts while the LM
    head maps the full vector). With ``positional='learned'`` the table of ``max_position_embeddings x hidden_size``
    entries is at most ``2**31``.

    The attention implementation is ``transformers``' ``attn_implementation`` (``config._attn_implementation``, not
    saved, as for Llama): ``eager``, ``sdpa``, ``triton`` or ``auto``, checked by the model
    (``HelmPreTrainedModel.get_correct_attn_implementation``); a ``config.json`` with the former field ``attn_impl``
    loads as that request.

    HELM-specific fields:
        curvature: the paper's ``K < 0`` of the whole model; ``config.k = -1/K`` is geoopt's parameter.
        embedding_mode: ``space`` (Euclidean table of space parts, time computed on the fly) or ``lorentz``
            (a ``geoopt.ManifoldParameter`` table trained by Riemannian Adam).
        positional: a kind of :data:`helm.nn.positional.POSITIONAL_ENCODINGS` (``hope`` default, ``learned``,
            ``none``, ``alibi``, ``rope3d``, ``hope_boost``, ``sinusoidal``, ``bipe_hope``, ``bipe_alibi``).
        rope_parameters: RoPE scaling of the rotary encodings (``hope``, ``rope3d``, HMLA's decoupled HoPE), a dict
            exactly as ``transformers``' ``LlamaConfig.rope_parameters`` (``rope_type`` in ``default``, ``linear``,
            ``dynamic``, ``yarn``, ``longrope``, ``llama3``, with that type's keys: ``factor``,
            ``original_max_position_embeddings``, ``attention_factor``, ``short_factor``/``long_factor``, ...), plus
            HELM's ``"resonance": true`` (Resonance RoPE, combinable with any type). The legacy ``rope_scaling``
            keyword is read into it, and ``rope_theta`` stays a field mirrored in ``rope_parameters["rope_theta"]``
            (the dict's value wins when given; two different explicit values are an error). Frequencies and attention
            factors come from ``transformers.modeling_rope_utils``; see ``helm/nn/positional/scaling.py``.
        rope3d_chunk_size, rope3d_chunk_base: 3D-RPE chunk length ``c`` and chunk-phase base (> 1; default
            ``rope_theta``).
        hope_boost_theta_prime, hope_boost_angle_scale, hope_boost_learnable_decay: seed 000's damping ``θ'``
            (> max θ_l = angle_scale; default ``1.1·angle_scale``), the angle scale, and a trainable ``θ'``.
        sinusoidal_scale: factor ``α`` of the sinusoidal table added to the token space parts (1: the textbook).
        bipe_segment_length: BiPE's segment length ``L`` (fixed-length segments: intra index ``p mod L``, segment
            index ``⌊p/L⌋``).
        tau_init: initial attention temperature (default ``sqrt(d)``, ``d`` the space dims a head scores).
        residual_weight: initial weight of the sublayer in the Lorentz residual centroid.
        residual_space_scale_factor: the official code's constant space-part scale after each residual, as a
            factor of ``sqrt(hidden_size - 1)`` (None = off). The official runs used 4 (dense) and 1 (MiCE),
            and so do the presets; ``config.residual_space_scale`` is the resulting scale, so a ``hidden_size``
            override keeps it consistent. See :class:`helm.nn.LorentzResidual` for its effect.
        lm_head_mode: ``linear`` (paper code) or ``distance`` (fully hyperbolic prototypes).
        head_merge: how attention heads are joined before the output HLT: ``hcat`` (HCat, one recomputed time
            coordinate) or ``flatten`` (the official code's flattened per-head points); see FIDELITY.md.
        final_proj: one more HLT ``hidden_size -> hidden_size`` before the final norm, as the official models
            have (False: the paper's architecture).
        fused_lm_loss: in training with ``labels``, compute the loss with the fused, chunked LM head +
            cross-entropy (:func:`helm.ops.linear_cross_entropy`: no ``[B, T, V]`` logits, same loss and gradients)
            and return ``logits=None``; ``forward(skip_logits=False)`` asks for the logits anyway (see
            :func:`helm.models.modeling_common.lm_logits_and_loss`). False: always the plain path.
    """

    keys_to_ignore_at_inference = ["past_key_values"]
    # A learned position table beyond this many entries (8 GiB in fp32) is refused before the allocator fails on it.
    max_learned_positions_entries = 2**31
    # Wrapped-normal tables (Lorentz token embeddings, distance-head prototypes) hold points expmap0(u) with
    # x_t = sqrt(k)·cosh(|u|/sqrt(k)); their largest row, about (sqrt(n) + 5)·initializer_range in tangent norm,
    # must keep its squared time coordinate (products, distances) inside fp32: radius |u|/sqrt(k) <= 40.
    max_wrapped_normal_radius = 40.0
    # ... and at |K| = 1e4 (k = 1e-4) their fp32 gradients overflow in one step (both families; 3e3 and below finite)
    max_table_curvature = 1e3
    # constructor keywords of older saved configs, read by :meth:`upgrade_old_fields` (not fields)
    legacy_kwargs = ("residual_space_scale", "pe_options", "rope_scaling", "partial_rotary_factor", "attn_impl",
                     "validate_inputs")

    vocab_size: int = field(integer(1), 128256)
    hidden_size: int = field(integer(2), 390)
    intermediate_size: int = field(integer(2), 1560)
    num_hidden_layers: int = field(integer(1), 6)
    num_attention_heads: int = field(integer(1), 6)
    head_dim: int | None = field(optional(integer(2)), None)
    hidden_act: str = field(one_of(ACTIVATIONS), "silu")
    max_position_embeddings: int = field(integer(1), 2048)
    initializer_range: float = field(init_std, 0.02)
    rms_norm_eps: float = field(norm_eps, 1e-12)
    use_cache: bool = field(boolean, True)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = field(one_of((False,)), False)
    rope_theta: float = field(positive, 10000.0)
    rope_parameters: dict | None = None
    attention_bias: bool = field(boolean, True)
    mlp_bias: bool = field(boolean, True)
    curvature: float = field(negative, -1.0)
    embedding_mode: str = field(one_of(EMBEDDING_MODES), "space")
    positional: str = field(one_of(POSITIONAL_ENCODINGS), "hope")
    rope3d_chunk_size: int = field(integer(1), 512)
    rope3d_chunk_base: float | None = field(optional(greater_than(1)), None)
    hope_boost_theta_prime: float | None = field(optional(positive), None)
    hope_boost_angle_scale: float = field(positive, 1.0)
    hope_boost_learnable_decay: bool = field(boolean, False)
    sinusoidal_scale: float = field(positive, 1.0)
    bipe_segment_length: int = field(integer(1), 32)
    tau_init: float | None = field(optional(temperature), None)
    residual_weight: float = field(residual_weight, 1.0)
    residual_space_scale_factor: float | None = field(optional(residual_scale_factor), None)
    lm_head_mode: str = field(one_of(LM_HEAD_MODES), "linear")
    head_merge: str = field(one_of(HEAD_MERGES), "hcat")
    final_proj: bool = field(boolean, False)
    fused_lm_loss: bool = field(boolean, True)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """Saved HELM configs get ``auto_map`` from the model's code bundle; see ``HelmPreTrainedModel``."""
        if (auto_class if isinstance(auto_class, str) else auto_class.__name__) != "AutoConfig":
            raise ValueError(f"auto_class must be 'AutoConfig', got {auto_class!r}")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``transformers``' loader, after :func:`helm.models.loading.check_config_folder`: a local folder without
        ``config.json`` is an ``OSError`` naming it (``transformers`` would return a default config)."""
        from .loading import check_config_folder

        check_config_folder(cls.__name__, pretrained_model_name_or_path, subfolder=kwargs.get("subfolder") or "")
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    def __post_init__(self, **kwargs):
        self.upgrade_old_fields(kwargs)
        self.refuse_unknown_keys(kwargs)
        self.validate_architecture()  # (fills the derived defaults first: head_dim, routed_curvatures)
        super().__post_init__(**kwargs)

    @property
    def k(self) -> float:
        """geoopt's curvature parameter ``k = -1/K > 0`` (``<x, x>_L = -k``)."""
        return curvature_to_k(self.curvature)

    @property
    def residual_space_scale(self) -> float | None:
        """``residual_space_scale_factor · sqrt(hidden_size - 1)``, or None when the scale is off."""
        if self.residual_space_scale_factor is None:
            return None
        return self.residual_space_scale_factor * math.sqrt(self.hidden_size - 1)

    @residual_space_scale.setter
    def residual_space_scale(self, value) -> None:
        raise ValueError(f"residual_space_scale={value!r}: derived (the field of older configs); set "
                         "residual_space_scale_factor, its factor of sqrt(hidden_size - 1)")

    def upgrade_old_fields(self, kwargs: dict) -> None:
        """Read configs saved before the fields were renamed (``residual_space_scale``, ``pe_options``), and the
        legacy RoPE keywords (:meth:`standardize_rope_keywords`). The former field ``attn_impl`` becomes the request
        ``attn_implementation`` (``config._attn_implementation``), unless one is given too."""
        self.standardize_rope_keywords(kwargs)
        if "attn_impl" in kwargs:
            kwargs.setdefault("attn_implementation", kwargs.pop("attn_impl"))
        kwargs.pop("validate_inputs", None)  # the switch of value checks that no longer exist (no host read in a step)
        if "residual_space_scale" in kwargs:
            scale = kwargs.pop("residual_space_scale")
            if self.residual_space_scale_factor is not None:  # the new field, given too, wins (as for attn_impl)
                logger.warning("config fields residual_space_scale (old) and residual_space_scale_factor both given; "
                               "keeping residual_space_scale_factor=%r", self.residual_space_scale_factor)
            else:
                logger.warning("config field residual_space_scale is now residual_space_scale_factor, a factor of "
                               "sqrt(hidden_size - 1); converting %r", scale)
                self.residual_space_scale_factor = None if scale is None else scale / math.sqrt(self.hidden_size - 1)
        options = kwargs.pop("pe_options", None) or {}
        if not isinstance(options, dict):
            raise ValueError(f"pe_options (a field of old configs) must be a mapping of option names to values, got "
                             f"{options!r}")
        for key, value in options.items():
            if key not in _PE_OPTION_FIELDS:
                raise ValueError(f"pe_options: unknown option {key!r}; the options are now config fields "
                                 f"{tuple(_PE_OPTION_FIELDS.values())}")
            setattr(self, _PE_OPTION_FIELDS[key], value)

    def standardize_rope_keywords(self, kwargs: dict) -> None:
        """``rope_parameters`` as ``transformers`` builds it: the legacy ``rope_scaling`` (and
        ``partial_rotary_factor``) keywords are read into it, ``rope_theta`` is mirrored, and ``transformers``'
        :meth:`standardize_rope_params` fills ``rope_type`` and ``original_max_position_embeddings``
        (``max_position_embeddings`` for ``yarn``, ``longrope``, ``llama3``). Saved configs without
        ``rope_parameters`` load as ``{"rope_type": "default"}``."""
        legacy = kwargs.pop("rope_scaling", None)
        params = legacy if legacy is not None else self.rope_parameters
        if params is None:
            params = {}
        if not isinstance(params, dict):
            check_rope_parameters(params)  # raises, naming rope_parameters
        params = dict(params)
        if "partial_rotary_factor" in kwargs:
            params.setdefault("partial_rotary_factor", kwargs.pop("partial_rotary_factor"))
        default_theta = type(self).__dataclass_fields__["rope_theta"].default
        if "rope_theta" in params and self.rope_theta != params["rope_theta"]:
            if self.rope_theta != default_theta:
                raise ValueError(f"rope_theta={self.rope_theta!r} disagrees with rope_parameters['rope_theta']="
                                 f"{params['rope_theta']!r}; set one of them")
            self.rope_theta = params["rope_theta"]
        self.rope_parameters = params
        self.standardize_rope_params()

    def validate(self) -> None:
        """The class validators ``save_pretrained`` runs, after :meth:`validate_architecture` (a field assigned after
        construction passed its own rule only) and with :meth:`validate_rope_scaling` for ``transformers``'
        ``validate_rope``, which wants an even ``head_dim`` where HELM's counts the time coordinate (33 = 1 + 32)."""
        from huggingface_hub.errors import StrictDataclassClassValidationError

        self.validate_architecture()
        for validator in type(self).__class_validators__:
            if validator.__name__ == "validate_rope":
                validator = type(self).validate_rope_scaling
            try:
                validator(self)
            except (ValueError, TypeError) as err:
                raise StrictDataclassClassValidationError(validator=validator.__name__, cause=err) from err

    def to_json_file(self, json_file_path, use_diff: bool = True) -> None:
        """``transformers``' writer after the checks :meth:`validate` runs for ``save_pretrained``."""
        self.validate()
        super().to_json_file(json_file_path, use_diff=use_diff)

    def validate_rope_scaling(self) -> None:
        """``rope_parameters`` against the positional encoding: only the rotary kinds with RoPE frequencies
        (``hope``, ``rope3d``) scale; every rotated width (``positional_dims``) gets its frequencies and attention
        factor computed once, so every error (naming the key) surfaces here rather than when the model is built."""
        params = check_rope_parameters(self.rope_parameters, kind=self.positional)
        if params["rope_type"] == "default" and not params.get("resonance", False):
            return
        if self.positional not in SCALABLE_KINDS:
            raise ValueError(f"rope_parameters={params!r} scales RoPE frequencies, which only positional in "
                             f"{SCALABLE_KINDS} has; got positional={self.positional!r}")
        for name, dims in self.positional_dims().items():
            try:
                scaling = RopeScaling(params, head_dim=dims, base=self.rope_theta,
                                      max_position_embeddings=self.max_position_embeddings, kind=self.positional)
                scaling.frequencies()
            except ValueError as err:
                raise ValueError(f"{err} (for {name}={dims + 1}: {dims} rotated space dims)") from None
        if self.positional == "rope3d" and params["rope_type"] == "linear":
            interpolated_chunk_size(self.rope3d_chunk_size, params["factor"],
                                    params.get("original_max_position_embeddings", self.max_position_embeddings))

    def to_dict(self) -> dict:
        """``transformers``' dict, with ``rope_parameters`` written as None where it only restates ``rope_theta``
        (``{"rope_type": "default", "rope_theta": rope_theta}``, what :meth:`standardize_rope_keywords` rebuilds from
        None). Where helm's code is not loaded (``AutoTokenizer`` on a saved folder without ``helm`` or
        ``trust_remote_code``), ``transformers`` reads ``config.json`` into its generic config class, which applies
        Llama's even-rotary-width rule to ``head_dim`` whenever ``rope_parameters`` is set; a HELM head is ``1 + 2m``
        wide (the time coordinate is not rotated), so a stored default would make the tokenizer fail to load."""
        output = super().to_dict()
        if output.get("rope_parameters") == {"rope_type": "default", "rope_theta": self.rope_theta}:
            output["rope_parameters"] = None
        return output

    def refuse_unknown_keys(self, kwargs: dict) -> None:
        """Constructor keywords left after :meth:`upgrade_old_fields` that no field reads are refused, naming the
        closest field: transformers would keep a typo (``hiden_size``) as a stray attribute and build the default."""
        known = known_keys(type(self))
        for key in kwargs:
            if not (key.startswith("_") or key in known):
                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown config field {key!r} for {type(self).__name__}{hint}")

    def derive_defaults(self) -> None:
        """Fill the fields whose default None means "derived from other fields": ``head_dim = 1 + ⌊(hidden_size - 1)
        / num_attention_heads⌋`` (the paper's 115M model: 390 ambient, 6 heads of 1 + 64). Run by
        :meth:`validate_architecture`, so a None assigned after construction is derived again exactly as a
        constructor keyword None is; a field given a value is kept. A derived width a head or the positional encoding
        cannot use is refused naming ``hidden_size`` and ``num_attention_heads`` (the user never set ``head_dim``)."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        if self.head_dim is not None:
            return
        head_dim = 1 + (hidden - 1) // heads
        pairs = positional_encoding_class(self.positional).pairs
        if head_dim < 2 or (pairs and (head_dim - 1) % 2):
            need = "1 + an even number >= 2" if pairs else "an integer >= 2"
            raise ValueError(f"head_dim must be {need} for positional={self.positional!r}, got {head_dim} = 1 + "
                             f"(hidden_size={hidden} - 1) // num_attention_heads={heads}; set head_dim or change them")
        self.head_dim = head_dim

    def positional_dims(self) -> dict[str, int]:
        """Config field -> space dims the attention's positional encoding acts on (per head)."""
        return {"head_dim": self.head_dim - 1}

    def validate_architecture(self) -> None:
        """Cross-field checks, after the derived defaults are filled (:meth:`derive_defaults`); each field passed its
        own rule when it was assigned."""
        self.derive_defaults()
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, (list, tuple)) else [value]
            if value is not None and not (ids and all(isinstance(i, int) and not isinstance(i, bool)
                                                      and 0 <= i < self.vocab_size for i in ids)):
                raise ValueError(f"{name} must be a token id (or list of ids) in [0, vocab_size={self.vocab_size}), "
                                 f"got {value!r}")
        if positional_encoding_class(self.positional).pairs:
            for name, dims in self.positional_dims().items():
                if dims % 2:
                    raise ValueError(f"{name} must be 1 + an even number for positional={self.positional!r} (it acts "
                                     f"on pairs of space dims), got {dims + 1}")
        self.validate_rope_scaling()
        if self.positional == "hope_boost":
            check_decay_above(self.hope_boost_theta_prime, self.hope_boost_angle_scale, "hope_boost_theta_prime")
        wrapped = self.embedding_mode == "lorentz" or self.lm_head_mode == "distance"
        radius = self.initializer_range * (math.sqrt(self.hidden_size - 1) + 5) / math.sqrt(self.k)
        if wrapped and radius > self.max_wrapped_normal_radius:
            raise ValueError(f"initializer_range={self.initializer_range!r} with curvature={self.curvature!r} puts the "
                             f"wrapped-normal tables (embedding_mode='lorentz' or lm_head_mode='distance') at radius "
                             f"{radius:.3g} > {self.max_wrapped_normal_radius:g}, overflowing fp32; lower either")
        if wrapped and abs(self.curvature) > self.max_table_curvature:
            raise ValueError(f"curvature={self.curvature!r} with embedding_mode='lorentz' or lm_head_mode='distance': "
                             f"|K| above {self.max_table_curvature:g} gives the Lorentz tables non-finite fp32 gradients; "
                             "lower |K| or use the space modes")
        entries = self.max_position_embeddings * self.hidden_size
        if self.positional == "learned" and entries > self.max_learned_positions_entries:
            raise ValueError(f"max_position_embeddings={self.max_position_embeddings} with positional='learned' needs "
                             f"{entries:,} table entries, more than {self.max_learned_positions_entries:,}")

    def __setattr__(self, name, value):
        """Every assignment of a field (construction included) is checked by the field's rule, so a bad value
        changes nothing and the error names the field; cross-field checks run in :meth:`validate_architecture`."""
        spec = type(self).__dataclass_fields__.get(name)
        if spec is not None and isinstance(value, np.generic):  # as LlamaConfig: a config is saved as JSON
            raise ValueError(f"{name} must be a Python number, not numpy's {type(value).__name__} ({value.item()!r}): "
                             f"pass {type(value.item()).__name__}(value)")
        for rule in spec.metadata.get("validator", ()) if spec is not None else ():
            check(value, name, rule)
        super().__setattr__(name, value)

    def update(self, config_dict: dict) -> None:
        """``transformers``' ``update``, refusing unknown keys as the constructor does (transformers would store
        ``hiden_size`` as a stray attribute and save it), then the cross-field rules; what fails them changes
        nothing (the fields set so far are restored)."""
        if not isinstance(config_dict, dict):
            raise TypeError(f"{type(self).__name__}.update takes a dict of field names to values, got "
                            f"{type(config_dict).__name__}")
        self.refuse_unknown_keys(config_dict)
        before = {key: getattr(self, key) for key in config_dict if key in type(self).__dataclass_fields__}
        try:
            super().update(config_dict)
            self.validate_architecture()
        except Exception:
            for key, value in before.items():
                setattr(self, key, value)
            raise

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """``transformers``' ``from_dict``, with keyword fields (``from_pretrained(folder, curvature=-2.0)``) merged
        into the dict: they pass the cross-field checks as constructor keywords do (transformers sets them after). A
        dict of another family (its ``model_type``, or ``architectures`` naming the other family's classes, as a
        HELM-D ``config.json`` relabelled ``helm_mice`` has) is refused naming them: it would load with defaults."""
        saved = config_dict.get("model_type", cls.model_type)
        if saved != cls.model_type:
            raise ValueError(f"model_type={saved!r}: {cls.__name__} reads {cls.model_type!r} configs; load it with "
                             "AutoConfig")
        family = cls.__name__.removesuffix("Config")
        foreign = [a for a in config_dict.get("architectures") or () if isinstance(a, str) and a.startswith("Helm")
                   and not (a.startswith(family) and a[len(family):][:1].isupper())]
        if foreign:
            raise ValueError(f"architectures={foreign!r} belong to another HELM family than model_type={saved!r} "
                             f"({cls.__name__}); the config.json was relabelled: restore its model_type")
        own = {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(PreTrainedConfig)}
        merged = {key: kwargs.pop(key) for key in list(kwargs) if key in own or key in cls.legacy_kwargs}
        return super().from_dict({**config_dict, **merged}, **kwargs)
