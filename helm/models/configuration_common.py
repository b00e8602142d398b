"""Fields and checks shared by the HELM configs (written like ``transformers``' ``LlamaConfig``).

Every field carries its rule (:func:`helm.nn.validation.field`); ``__post_init__`` runs
:meth:`HelmConfigBase.validate_architecture`, the one place for cross-field checks: the rules, then the derived
defaults (:meth:`HelmConfigBase.derive_defaults`: a None ``head_dim`` or ``routed_curvatures``, also when assigned
after construction), then the checks across fields.
Derived values are properties, never stored: ``k`` (from ``curvature``) and ``residual_space_scale`` (from
``residual_space_scale_factor`` and ``hidden_size``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import warnings

from transformers import PreTrainedConfig
from transformers.utils import logging

from ..manifold.math import curvature_to_k
from ..nn.activation import ACTIVATIONS
from ..nn.positional.registry import POSITIONAL_ENCODINGS, positional_encoding_class
from ..nn.positional.rotary import interpolated_chunk_size
from ..nn.positional.scaling import SCALABLE_KINDS, RopeScaling, check_rope_parameters
from ..nn.validation import (
    EMBEDDING_MODES,
    Rule,
    HEAD_MERGES,
    LM_HEAD_MODES,
    boolean,
    check_decay_above,
    check_fields,
    field,
    greater_than,
    init_std,
    integer,
    negative,
    norm_eps,
    one_of,
    optional,
    mapping,
    positive,
    probability,
    check,
    token_ids,
    torch_dtype,
    residual_scale_factor,
    residual_weight,
    temperature,
)
from ..ops.attention import available_attention_impls

logger = logging.get_logger(__name__)

# Boolean fields that HELM configs inherit from transformers' PreTrainedConfig (or that older transformers
# configs carry), checked like HELM's own on every assignment (construction, config.json, from_pretrained keywords,
# later assignment); None keeps transformers' meaning ("the default")
INHERITED_BOOLEANS = frozenset({"return_dict", "output_hidden_states", "output_attentions", "torchscript",
                                "_output_attentions"})  # output_attentions' storage, set without its setter
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def untied(value) -> None:
    """The rule of ``tie_word_embeddings``: HELM models cannot tie, so only ``False`` is accepted."""
    if value is not False:
        raise ValueError(f"must be False (tying is not supported: the token table holds points or space parts while "
                         f"the LM head maps the full vector), got {value!r}")


def decoder_only(what: str) -> Rule:
    """A boolean switch of encoder-decoder models that HELM models do not have: only ``False`` is accepted (``True``
    would be ignored by the models, or send ``generate`` down its encoder-decoder path)."""

    def rule(value):
        boolean(value)
        if value:
            raise ValueError(f"must be False (HELM models are decoder-only: {what}), got {value!r}")

    return rule


def is_decoder(value) -> None:
    """The rule of ``is_decoder``: HELM models are causal decoders, so only ``True`` is accepted."""
    boolean(value)
    if not value:
        raise ValueError("must be True (HELM models are causal decoders: every token attends to itself and earlier "
                         "tokens only, there is no bidirectional encoder mode), got False")


def unpruned(value) -> None:
    """The rule of ``pruned_heads`` (a field of transformers 4, still in older configs): nothing prunes heads."""
    if value not in (None, {}):
        raise ValueError(f"must be empty ({{}}): HELM models do not prune attention heads (and transformers 5 no "
                         f"longer does it for any model), got {value!r}")


# The fields HELM configs inherit from transformers (or that the task heads read, or older configs carry) with
# their rules, checked by :meth:`HelmConfigBase.__setattr__` from every source, like HELM's own fields.
INHERITED_FIELDS: dict = {
    **{name: optional(boolean) for name in INHERITED_BOOLEANS},
    "is_encoder_decoder": decoder_only("there is no encoder"),
    "add_cross_attention": decoder_only("there is no cross-attention"),
    "tie_encoder_decoder": decoder_only("there is no encoder"),
    "is_decoder": is_decoder,
    "chunk_size_feed_forward": integer(0),
    "num_labels": integer(1),
    "id2label": optional(mapping),
    "label2id": optional(mapping),
    "problem_type": optional(one_of(PROBLEM_TYPES)),
    "classifier_dropout": optional(probability),  # read by the token-classification head
    "hidden_dropout": optional(probability),
    "pruned_heads": unpruned,
    "dtype": optional(torch_dtype),
}


# Keys that are not fields of a HELM config but that transformers itself writes into config.json, reads from it, or
# passes to the config's constructor (PreTrainedConfig's settable properties are added in known_config_keys);
# anything else in a saved config, or as a keyword of from_pretrained, is refused as an unknown field (a typo such
# as "hiden_size" would otherwise become a stray attribute and the model be built with the default).
TRANSFORMERS_KEYS = frozenset({
    "architectures", "auto_map", "transformers_version", "model_type", "dtype", "torch_dtype", "name_or_path",
    "output_attentions", "attn_implementation", "experts_implementation", "quantization_config", "fusion_config",
    "per_layer_config", "custom_pipelines", "use_return_dict",
    # attributes of transformers 4's PretrainedConfig, written by the configs it saved (its generation parameters
    # are dropped by transformers 5 when it reads them, see known_config_keys)
    "use_bfloat16", "tf_legacy_loss", "cross_attention_hidden_size", "finetuning_task", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "gradient_checkpointing", "max_length",
    "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature",
    "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})
# Keywords of ``from_pretrained`` / ``AutoConfig.from_pretrained`` that are loading options rather than fields
# (transformers consumes most of them before the config is built; those it leaves are ignored by it)
LOADING_KWARGS = frozenset({
    "return_unused_kwargs", "cache_dir", "force_download", "local_files_only", "token", "revision", "proxies",
    "trust_remote_code", "code_revision", "subfolder", "gguf_file", "use_auth_token", "resume_download",
    "user_agent", "_from_auto", "_from_pipeline", "_configuration_file", "_commit_hash",
    # keywords of the model's from_pretrained: pipeline(model=..., model_kwargs=...) hands them to
    # AutoConfig.from_pretrained as well (without return_unused_kwargs), then to the model
    "config", "device_map", "max_memory", "offload_folder", "offload_buffers", "offload_state_dict", "state_dict",
    "output_loading_info", "quantization_config", "load_in_8bit", "load_in_4bit", "use_safetensors", "weights_only",
    "variant", "ignore_mismatched_sizes", "low_cpu_mem_usage", "tp_plan", "tp_size", "device_mesh",
    "distributed_config", "key_mapping", "adapter_name", "adapter_kwargs", "generation_config", "use_kernels",
    "kernel_config", "allow_all_kernels", "fusion_config", "disable_mmap", "tqdm_class", "from_tf", "from_flax",
    "mirror", "_fast_init", "use_flash_attention_2",
})


@functools.lru_cache(maxsize=None)
def config_fields(config_class: type) -> frozenset:
    """The fields of ``config_class`` a user sets (its dataclass fields, transformers' inherited fields with HELM
    rules, the legacy names it upgrades): the candidates of a "did you mean"."""
    names = {f.name for f in dataclasses.fields(config_class)} | set(INHERITED_FIELDS) - {"_output_attentions"}
    names |= set(getattr(config_class, "legacy_kwargs", ())) | {"rope_scaling", "partial_rotary_factor"}
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def known_config_keys(config_class: type) -> frozenset:
    """Every key a saved config (or a constructor keyword) of ``config_class`` may carry: its fields,
    :data:`TRANSFORMERS_KEYS`, ``PreTrainedConfig``'s settable properties (``num_labels``, ...) and the generation
    parameters transformers drops from older configs. Keys starting with ``_`` are transformers' bookkeeping
    (``_name_or_path``, ``_attn_implementation_autoset``, ...) and are accepted too, see :func:`is_known_key`."""
    from transformers import GenerationConfig, PreTrainedConfig

    names = set(config_fields(config_class)) | TRANSFORMERS_KEYS
    names |= {n for n, v in inspect.getmembers(PreTrainedConfig) if isinstance(v, property) and v.fset is not None}
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:
        names |= set(defaults())
    return frozenset(names)


def is_known_key(config_class: type, key) -> bool:
    return isinstance(key, str) and (key.startswith("_") or key in known_config_keys(config_class))


def unknown_field_error(config_class: type, key: str, candidates, where: str) -> ValueError:
    """The error of ``helm.load_config`` for an unknown override (``unknown config field 'hiden_size' for
    HelmDConfig; did you mean 'hidden_size'?``), saying where the key came from."""
    if key in _REPLACED_LOADING_KWARGS:
        return ValueError(f"{key}= is not a loading option of transformers 5 (nor a field of "
                          f"{config_class.__name__}): {_REPLACED_LOADING_KWARGS[key]} ({where})")
    close = difflib.get_close_matches(key, sorted(set(candidates) - {key}), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ValueError(f"unknown config field {key!r} for {config_class.__name__}{hint} ({where})")


# loading options transformers 4 took and transformers 5 does not (its models' __init__ gets them and fails)
_REPLACED_LOADING_KWARGS = {
    "load_in_8bit": "pass quantization_config=BitsAndBytesConfig(load_in_8bit=True) instead",
    "load_in_4bit": "pass quantization_config=BitsAndBytesConfig(load_in_4bit=True) instead",
    "use_flash_attention_2": "HELM models have no FlashAttention-2 path; use attn_implementation='sdpa' or the config "
                             "field attn_impl='triton'",
}


# Old field names read from saved configs: (old name -> new name). ``pe_options`` keys map to typed fields.
_PE_OPTION_FIELDS = {"chunk_size": "rope3d_chunk_size", "chunk_base": "rope3d_chunk_base",
                     "theta_prime": "hope_boost_theta_prime", "angle_scale": "hope_boost_angle_scale",
                     "learnable_decay": "hope_boost_learnable_decay"}


class RemoteCodeConfigMixin:
    """Saved HELM configs get ``auto_map`` from the model's code bundle; see ``HelmPreTrainedModel``."""

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        if (auto_class if isinstance(auto_class, str) else auto_class.__name__) != "AutoConfig":
            raise ValueError(f"auto_class must be 'AutoConfig', got {auto_class!r}")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """``transformers``' loader, after :func:`helm.models.loading.local_path_problem`: a local path that is
        not a checkpoint folder (a folder without ``config.json`` would otherwise give a default config) or a
        ``config.json`` that does not read as an object is an ``OSError`` saying which."""
        from .loading import check_local_path

        check_local_path(cls.__name__, pretrained_model_name_or_path, subfolder=kwargs.get("subfolder") or "",
                         json_file_ok=True)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)


class HelmConfigBase(RemoteCodeConfigMixin, PreTrainedConfig):
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

    One validation path for every source of a value: constructor keywords, ``config.json``, keywords of
    ``from_pretrained`` / ``AutoConfig.from_pretrained`` (merged before the config is built, see :meth:`from_dict`),
    ``helm.load_config`` presets and overrides, and train.py's ``model.overrides``. A field assigned after construction
    is checked by its own rule (:meth:`__setattr__`). A key that no field reads is refused from every source, naming
    it and the closest field (``unknown config field 'hiden_size' for HelmDConfig; did you mean 'hidden_size'?``):
    a constructor keyword, a key of ``config.json`` (besides those transformers writes, :data:`TRANSFORMERS_KEYS`),
    a keyword of ``from_pretrained`` (besides transformers' loading options, :data:`LOADING_KWARGS`; with
    ``return_unused_kwargs=True``, as the models' ``from_pretrained`` asks, unknown keywords are returned instead). Boolean fields accept ``True`` / ``False`` only (``"false"``,
    ``"no"``, ``0`` are refused, naming the field); ``tie_word_embeddings`` accepts only ``False``. The fields
    inherited from ``transformers`` (or read by the task heads) go through the same path with the rules of
    :data:`INHERITED_FIELDS`: ``return_dict``, ``output_hidden_states``, ``output_attentions`` booleans or None;
    ``chunk_size_feed_forward`` an integer >= 0 (HELM models, like Llama, do not chunk their MLP); ``num_labels`` an
    integer >= 1; ``id2label`` / ``label2id`` dicts; ``problem_type`` one of :data:`PROBLEM_TYPES`;
    ``classifier_dropout`` / ``hidden_dropout`` in ``[0, 1]``; ``dtype`` a torch dtype or its name;
    ``pruned_heads`` empty; ``is_encoder_decoder``, ``add_cross_attention``, ``tie_encoder_decoder`` False; and
    ``is_decoder`` True (always, see :attr:`is_decoder`). With
    ``positional='learned'`` the table of ``max_position_embeddings x hidden_size`` entries is at most ``2**31``.

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
        attn_impl: ``auto`` / ``sdpa`` / ``eager`` / ``triton``.
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
        validate_inputs: check token ids and labels against the vocabulary and ``inputs_embeds`` for finite
            points (one device read each, skipped while compiling).
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
    # constructor keywords of older saved configs, read by :meth:`upgrade_old_fields` (not fields)
    legacy_kwargs = ("residual_space_scale", "pe_options")

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
    tie_word_embeddings: bool = field(untied, False)
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
    attn_impl: str = field(one_of(available_attention_impls()), "auto")
    tau_init: float | None = field(optional(temperature), None)
    residual_weight: float = field(residual_weight, 1.0)
    residual_space_scale_factor: float | None = field(optional(residual_scale_factor), None)
    lm_head_mode: str = field(one_of(LM_HEAD_MODES), "linear")
    head_merge: str = field(one_of(HEAD_MERGES), "hcat")
    final_proj: bool = field(boolean, False)
    validate_inputs: bool = field(boolean, True)
    fused_lm_loss: bool = field(boolean, True)

    @property
    def _attn_implementation(self):
        return self._attn_implementation_internal

    @_attn_implementation.setter
    def _attn_implementation(self, value) -> None:
        """``attn_implementation="eager"`` / ``"sdpa"`` (``from_pretrained``, ``from_config``,
        ``set_attn_implementation``) select the same-named ``attn_impl``; other names are refused. ``None`` (no
        request) keeps ``attn_impl``."""
        if isinstance(value, dict):
            value = value.get("", self._attn_implementation_internal)
        if value is not None:
            if value not in ("eager", "sdpa"):
                raise ValueError(f"attn_implementation={value!r} is not available for HELM models: use 'eager' or "
                                 "'sdpa' (or the config field attn_impl='triton' / 'auto' for the zoo's own kernels)")
            self.attn_impl = value
        self._attn_implementation_internal = value

    @property
    def k(self) -> float:
        """geoopt's curvature parameter ``k = -1/K > 0`` (``<x, x>_L = -k``)."""
        return curvature_to_k(self.curvature)

    @property
    def is_decoder(self) -> bool:
        """Always True: HELM models are causal decoders. ``transformers`` 5 has no ``is_decoder`` field any more (a
        keyword ``is_decoder=True`` to ``from_pretrained`` would be dropped, and reading it an ``AttributeError``);
        here ``True`` is accepted from every source and ``False`` refused (:data:`INHERITED_FIELDS`)."""
        return True

    @is_decoder.setter
    def is_decoder(self, value) -> None:
        pass  # checked by __setattr__ (only True passes), which is what the getter returns

    @property
    def residual_space_scale(self) -> float | None:
        """``residual_space_scale_factor · sqrt(hidden_size - 1)``, or None when the scale is off."""
        if self.residual_space_scale_factor is None:
            return None
        return self.residual_space_scale_factor * math.sqrt(self.hidden_size - 1)

    def upgrade_old_fields(self, kwargs: dict) -> None:
        """Read configs saved before the fields were renamed (``residual_space_scale``, ``pe_options``), and the
        legacy RoPE keywords (:meth:`standardize_rope_keywords`)."""
        self.standardize_rope_keywords(kwargs)
        if "residual_space_scale" in kwargs:
            scale = kwargs.pop("residual_space_scale")
            logger.warning("config field residual_space_scale is now residual_space_scale_factor, a factor of "
                           "sqrt(hidden_size - 1); converting %r", scale)
            self.residual_space_scale_factor = None if scale is None else scale / math.sqrt(self.hidden_size - 1)
        options = kwargs.pop("pe_options", None) or {}
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
        if all(isinstance(v, (int, float)) for v in (self.rope_theta, self.max_position_embeddings)):
            self.standardize_rope_params()

    def validate(self) -> None:
        """The strict validators ``save_pretrained`` runs, with :meth:`validate_rope_scaling` in place of
        ``transformers``' ``validate_rope``: that one requires an even ``head_dim`` where HELM's counts the time
        coordinate (33 = 1 + 32 rotated dims), and does not know HELM's keys (``resonance``, the pre-training length
        of Resonance RoPE and of 3D-RPE's interpolation); HELM's check covers its key schema and raises instead of
        warning."""
        from huggingface_hub.errors import StrictDataclassClassValidationError

        # the cross-field checks first: a field assigned after construction passed its own rule only, and a saved
        # config.json of such a config would be refused when loaded
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
            raise ValueError(f"rope_parameters['rope_type']={params['rope_type']!r}"
                             f"{' with resonance' if params.get('resonance') else ''} scales the RoPE frequencies of "
                             f"positional={SCALABLE_KINDS}; positional={self.positional!r} has none (use "
                             "rope_parameters={'rope_type': 'default'} or a rotary encoding)")
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
        """Constructor keywords that are no field (left after :meth:`upgrade_old_fields`) are refused, naming the
        closest field, like the overrides of ``helm.load_config`` (transformers would keep them as attributes)."""
        for key in kwargs:
            if not is_known_key(type(self), key):
                raise unknown_field_error(type(self), key, config_fields(type(self)),
                                          f"constructor keywords must be fields of the config class; "
                                          f"{type(self).__name__} has no such option")

    def default_head_dim(self) -> None:
        """``head_dim = 1 + ⌊(hidden_size - 1) / num_attention_heads⌋`` when not given (the paper's 115M model:
        390 ambient, 6 heads of 1 + 64; the output HLT maps the ``1 + H·d`` joined heads back to ``hidden_size``).
        A derived width the positional encoding cannot use is refused here, naming ``hidden_size`` and
        ``num_attention_heads`` (the user never set ``head_dim``)."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        if self.head_dim is not None or not all(isinstance(v, int) and not isinstance(v, bool) and v >= low
                                                for v, low in ((hidden, 2), (heads, 1))):
            return  # (a hidden_size or num_attention_heads outside its own rule is refused by that rule)
        # checked before it is stored: a refused width leaves head_dim None (and, after construction, the error is
        # this one rather than the field rule's "got 1")
        head_dim = 1 + (hidden - 1) // heads
        derived = (f"got {head_dim} = 1 + (hidden_size - 1) // num_attention_heads with hidden_size={hidden} and "
                   f"num_attention_heads={heads} (head_dim is derived from them when not set)")
        if head_dim < 2:
            raise ValueError(f"head_dim must be an integer >= 2, {derived}; a head needs its time and at least one "
                             f"space dim: raise hidden_size to at least {1 + heads}, lower num_attention_heads, or set "
                             "head_dim")
        space = head_dim - 1
        if space % 2 and isinstance(self.positional, str) and self.positional in POSITIONAL_ENCODINGS and \
                positional_encoding_class(self.positional).pairs:
            sizes = " or ".join(str(1 + heads * d) for d in (space - 1, space + 1) if d > 0)
            raise ValueError(f"head_dim must be 1 + an even number for positional={self.positional!r} (it acts on "
                             f"pairs of space dims), {derived}; use hidden_size = 1 + num_attention_heads · an even "
                             f"number (e.g. {sizes}), another num_attention_heads, or set head_dim")
        self.head_dim = head_dim

    def derive_defaults(self) -> None:
        """Fill the fields whose default None means "derived from other fields": ``head_dim``
        (:meth:`default_head_dim`). Run by :meth:`validate_architecture`, so a None assigned after construction
        (``config.head_dim = None`` after a ``hidden_size`` change) is derived again exactly as a constructor keyword
        None is, when the model is built or the config saved; a field given a value is kept."""
        self.default_head_dim()

    def positional_dims(self) -> dict[str, int]:
        """Config field -> space dims the attention's positional encoding acts on (per head)."""
        return {"head_dim": self.head_dim - 1}

    def validate_architecture(self) -> None:
        """Cross-field checks (single-field rules run first, from the fields' ``validator`` metadata), after the
        derived defaults are filled (:meth:`derive_defaults`)."""
        check_fields(self)
        self.derive_defaults()
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None:
                check(value, name, token_ids(self.vocab_size))
        kind = positional_encoding_class(self.positional)
        if kind.pairs:
            for name, dims in self.positional_dims().items():
                if dims % 2:
                    raise ValueError(f"{name} must be 1 + an even number for positional={self.positional!r} (it acts "
                                     f"on pairs of space dims), got {dims + 1}")
        self.validate_rope_scaling()
        if self.positional == "hope_boost":
            check_decay_above(self.hope_boost_theta_prime, self.hope_boost_angle_scale, "hope_boost_theta_prime")
        wrapped = [name for name, on in (("embedding_mode='lorentz'", self.embedding_mode == "lorentz"),
                                         ("lm_head_mode='distance'", self.lm_head_mode == "distance")) if on]
        radius = self.initializer_range * (math.sqrt(self.hidden_size - 1) + 5) / math.sqrt(self.k)
        if wrapped and radius > self.max_wrapped_normal_radius:
            raise ValueError(f"initializer_range={self.initializer_range!r} with curvature={self.curvature!r} and "
                             f"hidden_size={self.hidden_size} puts the wrapped-normal points of "
                             f"{' and '.join(wrapped)} at radius (sqrt(hidden_size - 1) + 5)·initializer_range/sqrt(k)"
                             f" = {radius:.3g}, beyond {self.max_wrapped_normal_radius:g}: their time coordinates "
                             "sqrt(k)·cosh(radius) would overflow fp32 products at initialisation; lower "
                             "initializer_range or |curvature|")
        if self.positional == "learned" and \
                self.max_position_embeddings * self.hidden_size > self.max_learned_positions_entries:
            raise ValueError(f"max_position_embeddings={self.max_position_embeddings} with positional='learned' needs "
                             f"a table of max_position_embeddings x hidden_size = "
                             f"{self.max_position_embeddings * self.hidden_size:,} entries "
                             f"({self.max_position_embeddings * self.hidden_size * 4 / 2**30:,.0f} GiB in fp32), more "
                             f"than the {self.max_learned_positions_entries:,} allowed; lower max_position_embeddings "
                             "or use a relative encoding (positional='hope', 'alibi', ...)")

    def __setattr__(self, name, value):
        """A field assigned after construction (``config.hidden_size = -3``) is checked by its own rule, so the
        error names the field rather than the argument of the layer that would meet the value. Cross-field checks
        run when the config is built (construction, ``from_pretrained`` with keywords, ``from_dict``)."""
        inherited = INHERITED_FIELDS.get(name)
        if inherited is not None:  # transformers' own fields take "no" as true, "1" as a chunk size, ...
            check(value, name.lstrip("_"), inherited)
        if self.__dict__.get("_post_init_done"):
            spec = type(self).__dataclass_fields__.get(name)
            for rule in spec.metadata.get("validator", ()) if spec is not None else ():
                check(value, name, rule)
            if spec is None and name not in self.__dict__ and not is_known_key(type(self), name):
                # transformers keeps any attribute, so "config.curvatur = -2.0" would build the default curvature
                # without a word; a warning, not an error: libraries may hang their own attributes on a config
                warnings.warn(str(unknown_field_error(type(self), name, config_fields(type(self)),
                                                      "assigned after construction: it is stored, but no HELM "
                                                      "layer reads it")), UserWarning, stacklevel=2)
        super().__setattr__(name, value)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """``transformers``' ``from_dict``, with keyword fields (``from_pretrained(folder, curvature=-2.0)``,
        ``AutoConfig.from_pretrained(..., **kwargs)``) merged into the dict before the config is built: they go
        through the same field rules and cross-field checks as constructor keywords (``transformers`` would set
        them afterwards, unchecked)."""
        # the fields HELM declares (PreTrainedConfig's own, such as dtype, keep transformers' handling)
        declared = {name for klass in cls.__mro__ if issubclass(klass, HelmConfigBase)
                    for name in klass.__dict__.get("__annotations__", {})}
        # and the inherited fields with rules (transformers would drop those it has no attribute for, such as
        # classifier_dropout, is_decoder's False); transformers itself moves dtype, num_labels, output_attentions
        # into the dict (and skips dtype="auto", a request to from_pretrained rather than a value)
        inherited = set(INHERITED_FIELDS) - {"dtype", "num_labels", "output_attentions", "_output_attentions"}
        names = declared | set(cls.legacy_kwargs) | {"rope_scaling", "partial_rotary_factor"} | inherited
        # A key of the saved config (or of the dict given) that no field reads is refused like an unknown override
        # of helm.load_config: transformers would keep it as a stray attribute, and a typo ("hiden_size") would
        # leave the field it meant at its default.
        saved_type = config_dict.get("model_type")
        if isinstance(saved_type, str) and saved_type and saved_type != cls.model_type:
            # another model's config: its fields would be refused one by one as unknown ("did you mean ...")
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            own = CONFIG_MAPPING[saved_type].__name__ if saved_type in CONFIG_MAPPING else None
            use = f"{own} or AutoConfig" if own else "its own config class"
            raise ValueError(f"{cls.__name__}: the config is of a {saved_type} model (model_type={saved_type!r}), not "
                             f"a {cls.model_type} one; load it with {use}")
        for key in config_dict:
            if not is_known_key(cls, key):
                raise unknown_field_error(cls, key, config_fields(cls), f"a key of the saved config (config.json): "
                                          f"{cls.__name__} has no such field, and transformers writes no such key")
        # An unknown keyword is refused too (transformers would drop it silently), unless the caller asks for the
        # unused keywords back (return_unused_kwargs=True, as the models' from_pretrained does with its own).
        if not kwargs.get("return_unused_kwargs", False):
            for key, value in kwargs.items():
                if key not in names and key not in LOADING_KWARGS and key not in known_config_keys(cls):
                    candidates = config_fields(cls) | {k for k in LOADING_KWARGS if not k.startswith("_")}
                    raise unknown_field_error(cls, key, candidates, f"keyword {key}={value!r} of from_pretrained: "
                                              f"{cls.__name__} has no such field, and transformers no such loading "
                                              "option; return_unused_kwargs=True returns unknown keywords instead")
        config_dict = {**config_dict, **{key: kwargs.pop(key) for key in list(kwargs) if key in names}}
        return super().from_dict(config_dict, **kwargs)
