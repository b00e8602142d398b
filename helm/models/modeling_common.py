"""The model code HELM-D and HELM-MiCE share, as ``transformers``' modular files share Llama's: the base class (weight
init, geometry), one decoder-stack forward (:class:`HelmDecoderModel`) and one causal-LM forward
(:class:`HelmCausalLMBase`); each family supplies its decoder layer and output classes. Loading and saving live in
:mod:`.hub`."""

from __future__ import annotations

import copy
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Cache, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.masking_utils import create_masks_for_generate
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import can_return_tuple, logging

from ..manifold.lorentz import Lorentz
from ..manifold.math import lift, manifold_error
from ..nn.attention import LorentzAttentionBase, PagedBatch
from ..nn.embedding import LorentzEmbedding
from ..nn.head import LorentzLMHead
from ..nn.linear import LorentzLinear
from ..nn.norm import LorentzRMSNorm
from ..nn.positional import PositionalEncoding, PositionalTables
from ..nn.positional.registry import build_positional_encoding, positional_encoding_class
from ..nn.residual import LorentzResidual
from ..ops.attention import (
    ATTENTION_ALIASES,
    AttentionMask,
    check_attention_implementation,
    continuous_batching_attention,
    record_attention_weights,
)
from ..precision import stat_dtype
from .hub import HelmHubMixin, built_config_fields

logger = logging.get_logger(__name__)


class HelmPreTrainedModel(HelmHubMixin, PreTrainedModel):
    """Weight init and geometry bookkeeping common to every HELM model; strict loading and remote-code saving come
    from :class:`~helm.models.hub.HelmHubMixin`.

    ``dtype=torch.float16`` (or ``bfloat16``) stores weight matrices and tables in that dtype, while the scalars
    that parametrise the geometry (temperatures, residual weights, curvatures) stay fp32 parameters: the GEMMs run
    in the weights' dtype, every time coordinate, norm and softmax statistic in fp32 (:mod:`helm.precision`)."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True  # the decoder layers are transformers GradientCheckpointingLayers
    _supports_sdpa = True
    # the forward has no graph break and no host read under torch.compile (a static cache's length stays a tensor):
    # tests/workflows/test_static_cache.py
    _can_compile_fullgraph = True

    def __init__(self, config, *args, **kwargs):
        # the cross-field rules again: a field assigned after the config was built passes its own rule only, and would
        # build another model than the config describes (or one its save cannot reload)
        config.validate_architecture()
        super().__init__(config, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, LorentzRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, (LorentzEmbedding, LorentzLMHead, LorentzResidual, LorentzAttentionBase,
                                 PositionalEncoding)) and hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif hasattr(module, "reset_geometry"):
            module.reset_geometry()

    def restore_geometry(self) -> "HelmPreTrainedModel":
        """Re-wrap manifold parameters and re-freeze fixed curvatures after loading.

        ``transformers`` materialises checkpoints into plain ``nn.Parameter`` objects (and may flip
        ``requires_grad``); a Lorentz embedding table left as a plain parameter would silently be optimised
        as a Euclidean one, so every module that owns geometry restores it here.
        """
        import geoopt

        for module in self.modules():
            for name in getattr(module, "_manifold_parameters", ()):
                p = getattr(module, name)
                if not isinstance(p, geoopt.ManifoldParameter):
                    setattr(module, name, geoopt.ManifoldParameter(p.data, manifold=Lorentz(module.k),
                                                                   requires_grad=p.requires_grad))
            if hasattr(module, "restore_frozen"):
                module.restore_frozen()
        return self

    def manifold_error(self) -> dict[str, float]:
        """The largest relative violation of ``<x, x>_L = -k`` (:func:`helm.manifold.manifold_error`) of each
        manifold parameter (Lorentz token tables, distance-head prototypes), by name. The zoo's Riemannian
        optimiser (:func:`helm.optim.build_optimizer`) keeps it at rounding; a stock one (AdamW, ``Trainer``'s
        default) moves the points off the hyperboloid. One read per table: for saving and loading, not for a step."""
        errors = {}
        for prefix, module in self.named_modules():
            for name in getattr(module, "_manifold_parameters", ()):
                table = getattr(module, name)
                if table.device.type != "meta" and not hasattr(table, "device_mesh"):  # sharded: each rank's own
                    errors[f"{prefix}.{name}" if prefix else name] = float(manifold_error(table, module.k).max())
        return errors

    def balance_loss(self) -> Optional[torch.Tensor]:
        """The training-time auxiliary loss of the last forward that heads add to theirs (None: the model has none;
        HELM-MiCE sums its sequence-wise balance losses)."""
        return None

    def resize_token_embeddings(self, new_num_tokens: Optional[int] = None, pad_to_multiple_of: Optional[int] = None,
                                mean_resizing: bool = True):
        """``transformers``' resize for the Lorentz token table and LM head (either mode): old rows kept, new rows
        the mean of the old ones (a point for point tables) or, with ``mean_resizing=False``, fresh ones;
        ``config.vocab_size`` follows. Returns the input embedding module, as in ``transformers``."""
        embeddings = self.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embeddings
        size = embeddings.num_embeddings if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            size = -(-size // pad_to_multiple_of) * pad_to_multiple_of
        embeddings.resize(size, mean_resizing=mean_resizing)
        head = self.get_output_embeddings()
        if head is not None:
            head.resize(size, mean_resizing=mean_resizing)
        self.config.vocab_size = size
        if getattr(self, "_config_as_built", None) is not None:  # the layers now hold this size (no save warning)
            self._config_as_built["vocab_size"] = size
        return embeddings

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """As in ``transformers``: ``exclude_embeddings`` leaves out the token (and learned position) tables, which
        are :class:`~helm.nn.LorentzEmbedding` / ``nn.Embedding`` modules here; the LM head is counted, as for Llama."""
        excluded = set()
        if exclude_embeddings:
            excluded = {id(p) for m in self.modules() if isinstance(m, (LorentzEmbedding, nn.Embedding))
                        for p in m.parameters(recurse=False)}
        return sum(p.numel() for p in self.parameters()
                   if id(p) not in excluded and (p.requires_grad or not only_trainable))

    def post_init(self):
        """``transformers``' post-init; the fields the layers read when they are built are recorded
        (:func:`~helm.models.hub.built_config_fields`): ``save_pretrained`` warns about those changed since."""
        super().post_init()
        self._config_as_built = built_config_fields(self.config)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """True: every HELM attention layer reads ``config._attn_implementation`` at each call (``transformers``
        would guess it from the module's source)."""
        return True

    def _check_and_adjust_attn_implementation(self, attn_implementation: Optional[str], is_init_check: bool = False,
                                              allow_all_kernels: bool = False) -> str:
        """``transformers``' hook for ``attn_implementation=`` (``from_config``, ``from_pretrained``,
        ``set_attn_implementation``), whose result is stored in ``config._attn_implementation``: HELM's own names
        only (:meth:`get_correct_attn_implementation`), never a hub kernel or FlashAttention."""
        return self.get_correct_attn_implementation(attn_implementation, is_init_check)

    def get_correct_attn_implementation(self, requested_attention: Optional[str], is_init_check: bool = False) -> str:
        """``eager``, ``sdpa``, ``triton`` (the zoo's Triton kernel) or ``auto`` (also when none is requested: the
        kernel on CUDA where it can run, else sdpa); any other name is a ``ValueError`` naming it and these
        (:func:`helm.ops.attention.check_attention_implementation`). What runs at each call is decided by
        :func:`helm.ops.attention.resolve_attention`."""
        return check_attention_implementation(requested_attention)

    def create_masks_for_generate(self, config, **kwargs):
        """``generate``'s 4-D mask for a compilable (static) cache, built as for ``attn_implementation="sdpa"`` (a
        boolean keep-mask) whatever HELM implementation runs: :class:`helm.ops.AttentionMask` reads that form for
        all of them, while ``transformers`` builds no mask at all for names it does not know (``auto``, ``triton``),
        which would drop the padding."""
        as_sdpa = copy.copy(config)
        as_sdpa._attn_implementation_internal = "sdpa"
        return create_masks_for_generate(as_sdpa, **kwargs)


class HelmDecoderLayer(GradientCheckpointingLayer):
    """``x ← x ⊕ Attn(RMSNorm_L(x))``, then ``x ← x ⊕ MLP(RMSNorm_L(x))`` (⊕: Lorentz residual); each family builds its
    ``self_attn`` and ``mlp`` and passes them in. Points ``[B, T, 1+n] -> [B, T, 1+n]``."""

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        norm, residual = dict(k=config.k, eps=config.rms_norm_eps), dict(
            k=config.k, weight=config.residual_weight, space_scale=config.residual_space_scale)
        self.input_layernorm, self.self_attn = LorentzRMSNorm(config.hidden_size, **norm), self_attn
        self.attn_residual = LorentzResidual(**residual)
        self.post_attention_layernorm, self.mlp = LorentzRMSNorm(config.hidden_size, **norm), mlp
        self.mlp_residual = LorentzResidual(**residual)

    def forward(self, hidden_states: torch.Tensor, *, position_embeddings: PositionalTables,
                attention_mask: Optional[AttentionMask], past_key_values: Optional[Cache] = None,
                cache: Optional[Cache] = None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                              attention_mask=attention_mask, past_key_values=resolve_cache(past_key_values, cache))
        hidden_states = self.attn_residual(hidden_states, attn)
        return self.mlp_residual(hidden_states, self.mlp(self.post_attention_layernorm(hidden_states)))


class HelmDecoderModel(HelmPreTrainedModel):
    """Token embeddings, ``num_hidden_layers`` decoder layers (``decoder_layer_class``, the family's) and the final
    RMSNorm_L; returns points ``[B, T, 1+n]`` in ``output_class``.

    ``segment_ids [B, T_past+T]`` are document ids of packed rows: attention never crosses documents.
    ``inputs_embeds [B, T, 1+n]`` are points: their space part is read and the time coordinate recomputed, so an
    input off the hyperboloid is projected onto it."""

    decoder_layer_class: type
    output_class: type = BaseModelOutputWithPast
    # loading the bare model from a causal-LM checkpoint leaves its LM head unused, as in transformers
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = LorentzEmbedding(config.vocab_size, config.hidden_size, k=config.k,
                                             mode=config.embedding_mode, init_std=config.initializer_range)
        self.pos_encoding = positional_encoding(config)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        # the official models' extra HLT before the final norm (config.final_proj; not in the paper)
        self.final_proj = (LorentzLinear(config.hidden_size, config.hidden_size, k=config.k) if config.final_proj
                           else None)
        self.norm = LorentzRMSNorm(config.hidden_size, k=config.k, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable, as on Llama's decoder
        self.post_init()

    @can_return_tuple
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[Cache] = None,
                inputs_embeds: Optional[torch.Tensor] = None, use_cache: Optional[bool] = None,
                segment_ids: Optional[torch.LongTensor] = None, output_hidden_states: Optional[bool] = None,
                output_attentions: Optional[bool] = None, **kwargs):
        """``kwargs`` takes what ``transformers`` hands every model (``cache=``, ``cache_position``,
        ``num_items_in_batch``, ...); HELM reads ``cache=``, the cache's name from transformers 5.24 on, and, with
        continuous batching's paged cache, the batch's layout (``PagedBatch.KWARGS``; the requests flattened into one
        row, each at its own ``position_ids``, under the 4-D block-diagonal ``attention_mask`` ``transformers``
        builds for ``sdpa`` and ``paged|eager``; :class:`helm.nn.attention.PagedBatch`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        past_key_values = resolve_cache(past_key_values, kwargs.get("cache"))
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # as transformers' models: checkpointed layers would leave a cache empty that looks filled
            logger.warning_once("use_cache=True is incompatible with gradient checkpointing in training; "
                                "setting use_cache=False")
            use_cache = False
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None \
            else output_hidden_states
        attentions = AttentionWeights(self, output_attentions)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        given = input_ids if input_ids is not None else inputs_embeds
        (batch, seq_len), device = given.shape[:2], given.device
        if position_ids is not None and position_ids.is_floating_point():  # positional tables index by integers
            raise ValueError(f"position_ids must be integers, got {position_ids.dtype}: pass position_ids.long()")
        paged = None
        if PagedBatch.is_paged(past_key_values):  # continuous batching: the layers write through a PagedBatch
            past_key_values = paged = continuous_batch(past_key_values, kwargs, batch=batch, seq_len=seq_len,
                                                       position_ids=position_ids, attention_mask=attention_mask,
                                                       segment_ids=segment_ids, device=device)
        else:
            # past length (a tensor for a static cache: no host sync), keys per layer, where the queries sit
            layout = cache_layout(past_key_values, seq_len)
            check_mask_lengths(layout, seq_len, attention_mask=attention_mask, segment_ids=segment_ids)
            if position_ids is None:
                position_ids = default_position_ids(attention_mask, layout, seq_len, batch, device)

        hidden_states = (self.embed_tokens(input_ids) if inputs_embeds is None
                         else lift(inputs_embeds[..., 1:], k=self.config.k))
        if self.pos_encoding.absolute:
            hidden_states = lift(self.pos_encoding.embed(hidden_states[..., 1:], position_ids), k=self.config.k)
        # built once here, read by every layer
        if paged is not None:
            # the biases compare index positions, whose differences within a request are position differences
            position_embeddings = self.pos_encoding.tables(
                position_ids, paged.query_index.view(1, seq_len),
                torch.arange(paged.kv_len, device=device).view(1, paged.kv_len), stat_dtype(hidden_states.dtype))
            mask = AttentionMask(1, seq_len, paged.kv_len, dense=attention_mask, device=device,
                                 segment_ids=paged.key_request.view(1, paged.kv_len), query_index=paged.query_index)
        else:
            position_embeddings = self.pos_encoding(position_ids, kv_len=layout.kv_len, dtype=hidden_states.dtype,
                                                    q_offset=layout.q_offset)
            mask = attention_mask_for(layout, batch, seq_len, attention_mask, segment_ids, device)

        # transformers' convention: the embeddings, every layer's output, the last one after the final norm
        all_hidden_states = [hidden_states]
        with attentions:
            for layer in self.layers:
                # under the name transformers' GradientCheckpointingLayer clears in training
                hidden_states = layer(hidden_states, position_embeddings=position_embeddings, attention_mask=mask,
                                      **{CACHE_FIELD: past_key_values})
                all_hidden_states.append(hidden_states)
        if self.final_proj is not None:
            hidden_states = self.final_proj(hidden_states)
        all_hidden_states[-1] = hidden_states = self.norm(hidden_states)
        if paged is not None:
            past_key_values = paged.cache
        return self.output_class(last_hidden_state=hidden_states,
                                 **{CACHE_FIELD: past_key_values if use_cache else None},
                                 hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
                                 attentions=attentions.weights)


class HelmCausalLMBase(HelmPreTrainedModel, GenerationMixin):
    """A :class:`HelmDecoderModel` (``base_model_class``, the family's) with the LM head; ``segment_ids`` (document
    ids of packed rows) keep attention within documents. In training with labels the loss is fused and ``logits``
    is None (:func:`lm_logits_and_loss`); a model with a balance loss (MiCE) adds it and returns it as ``aux_loss``
    when ``output_class`` has that field."""

    base_model_class: type
    output_class: type

    def __init__(self, config):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.lm_head = LorentzLMHead(config.hidden_size, config.vocab_size, k=config.k, mode=config.lm_head_mode,
                                     init_std=config.initializer_range)
        self.post_init()

    @torch.no_grad()
    def init_continuous_batching(self, *args, **kwargs):
        """``transformers``' continuous batching (``generate_batch``, ``transformers serve --continuous-batching``)
        on its paged KV cache, after two checks of its own: every attention layer's per-token cache fits the rows the
        paged cache allocates (:meth:`check_paged_cache`), and the implementation is one ``transformers`` accepts
        there: ``auto`` and ``triton`` run as ``sdpa`` for the session (the implementation every call of theirs
        would take under its block-diagonal mask, :func:`helm.ops.attention.continuous_batching_attention`) and
        are restored when the manager stops, as ``transformers`` restores its own switch of ``eager`` to
        ``paged|eager``. Arguments and result are ``transformers``' (``generation_config``,
        ``continuous_batching_config``, ...; a ``ContinuousBatchingManager``)."""
        self.check_paged_cache()
        requested = self.config._attn_implementation
        serving = continuous_batching_attention(requested)
        if serving != requested:
            self.set_attn_implementation(serving)
        try:
            manager = super().init_continuous_batching(*args, **kwargs)
        except BaseException:
            if serving != requested:
                self.set_attn_implementation(requested)
            raise
        if serving != requested and getattr(manager, "_original_attn_impl", None) is None:
            manager._original_attn_impl = requested  # what ContinuousBatchingManager.stop() restores
        return manager

    def check_paged_cache(self) -> None:
        """``ValueError`` naming the config fields when an attention layer caches more per token than continuous
        batching's paged cache allocates for this model (two rows of ``num_key_value_heads x head_dim`` numbers of
        the model's dtype, read from ``config.get_text_config()``; :class:`helm.nn.attention.PagedBatch`). HELM
        caches points in the statistics dtype: a half-precision model's cache takes each fp32 number as two of its
        columns, which HELM-D's keys and values (exactly one fp32 model's rows) do not fit."""
        config, cache_dtype = self.config.get_text_config(), self.dtype
        for name, module in self.named_modules():
            if callable(getattr(module, "cache_payload", None)):
                numbers, what = module.cache_payload()
                PagedBatch.check_fit(config, cache_dtype, stat_dtype(cache_dtype), numbers, what, name)

    @can_return_tuple
    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values: Optional[Cache] = None,
                inputs_embeds: Optional[torch.Tensor] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, segment_ids: Optional[torch.LongTensor] = None,
                output_hidden_states: Optional[bool] = None, output_attentions: Optional[bool] = None,
                logits_to_keep: Union[int, torch.Tensor] = 0, skip_logits: Optional[bool] = None, **kwargs):
        # continuous batching's description of its flattened batch goes to the decoder, not to the loss
        batch_kwargs = {key: kwargs.pop(key) for key in PagedBatch.KWARGS if key in kwargs}
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=resolve_cache(past_key_values, kwargs.pop("cache", None)),
                             inputs_embeds=inputs_embeds, use_cache=use_cache, segment_ids=segment_ids,
                             output_hidden_states=output_hidden_states, output_attentions=output_attentions,
                             **batch_kwargs)
        hidden_states = outputs.last_hidden_state
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits, loss = lm_logits_and_loss(self, hidden_states[:, kept], labels, skip_logits, **kwargs)
        extra = {}
        if "aux_loss" in self.output_class.__dataclass_fields__:
            extra["aux_loss"] = aux_loss = self.balance_loss()
            if loss is not None and aux_loss is not None:
                loss = loss + aux_loss
        return self.output_class(loss=loss, logits=logits, **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
                                 hidden_states=outputs.hidden_states, attentions=outputs.attentions, **extra)


def positional_encoding(config) -> PositionalEncoding:
    """The model's positional encoding from ``config``: the space dims per head of ``config.positional_dims()`` get
    it in attention;
    ``absolute`` kinds act on the token stream, whose ``hidden_size - 1`` space dims they receive as
    ``hidden_space_dim`` (BiPE kinds do both). Other kind-specific options come from the config fields the kind
    names in its ``options``."""
    kind = positional_encoding_class(config.positional)
    (head_dim,) = config.positional_dims().values()
    options = {name: getattr(config, field) for name, field in kind.options.items() if field is not None}
    if "hidden_space_dim" in kind.options:
        options["hidden_space_dim"] = config.hidden_size - 1
    return build_positional_encoding(config.positional, head_dim=head_dim,
                                     num_heads=config.num_attention_heads,
                                     max_position_embeddings=config.max_position_embeddings,
                                     rope_theta=config.rope_theta, **options)


# transformers 5.24 renamed the cache argument and output field ``past_key_values`` to ``cache`` (generate passes
# ``cache=``; output classes rename ``past_key_values=`` with a deprecation warning); earlier 5.x use the old name
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def resolve_cache(past_key_values, cache):
    """The cache of a forward called as ``forward(past_key_values=...)`` (transformers < 5.24, users' code) or
    ``forward(cache=...)`` (``generate`` from transformers 5.24 on)."""
    return past_key_values if cache is None else cache


def continuous_batch(cache, kwargs: dict, *, batch: int, seq_len: int, position_ids: Optional[torch.Tensor],
                     attention_mask, segment_ids: Optional[torch.Tensor], device) -> PagedBatch:
    """The :class:`~helm.nn.attention.PagedBatch` of a continuous-batching forward on ``transformers``' paged
    ``cache``, from its keywords in ``kwargs``, after the checks of what that forward must be given: one flattened
    row, per-request ``position_ids``, the 4-D block-diagonal ``attention_mask`` (``transformers`` builds it for
    ``sdpa`` and ``paged|eager`` only), no ``segment_ids`` (the requests are the segments)."""
    missing = [key for key in ("cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index") if key not in kwargs]
    if missing:
        raise ValueError(f"a forward on transformers' paged cache (continuous batching) needs its keywords {missing}")
    if batch != 1:
        raise ValueError(f"continuous batching flattens its requests into one row; got a batch of {batch}")
    if position_ids is None:
        raise ValueError("continuous batching gives each request its own position_ids; none were passed")
    if segment_ids is not None:
        raise ValueError("segment_ids cannot be combined with continuous batching, whose requests are the segments")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise ValueError("continuous batching must pass its 4-D block-diagonal attention mask, which transformers "
                         "builds for attn_implementation 'sdpa' and 'paged|eager' only; got "
                         f"{type(attention_mask).__name__}")
    return PagedBatch(cache, {key: kwargs[key] for key in PagedBatch.KWARGS if key in kwargs}, q_len=seq_len,
                      device=device)


class CacheLayout(NamedTuple):
    """Where the new tokens sit among the keys every attention layer sees (:func:`cache_layout`).

    ``past_len``: tokens already cached: an int, or a static cache's 0-dim length tensor (kept a tensor so the
    decode step compiles without a host synchronisation, as in ``transformers``). ``kv_len``: keys per layer, an
    int: ``past_len + T`` for a growing cache, ``max_cache_len`` for a static one. ``q_offset``: None when the new
    tokens are the last ``T`` keys, else the key index of the first one (``past_len``: static caches, whose slots
    past ``past_len + T`` are not written yet and are masked)."""

    past_len: Union[int, torch.Tensor]
    kv_len: int
    q_offset: Optional[Union[int, torch.Tensor]]


def cache_layout(past_key_values, seq_len: int) -> CacheLayout:
    """The :class:`CacheLayout` of ``seq_len`` new tokens on ``past_key_values`` (a ``transformers`` cache or None),
    read as ``LlamaModel`` reads it: ``get_seq_length()`` (a tensor for static caches) and ``get_mask_sizes``. A
    cache that drops old keys (a sliding window) is a ``ValueError`` naming it: HELM attends to the whole cache."""
    if past_key_values is None:
        return CacheLayout(0, seq_len, None)
    past_len = past_key_values.get_seq_length()
    if isinstance(past_len, torch.Tensor):
        # a copy: the static cache counts its length up in place when the first layer writes to it, and the mask
        # and positions (built lazily) must see the length before this forward
        past_len = past_len.clone()
    kv_len, kv_offset = past_key_values.get_mask_sizes(seq_len, 0)
    if kv_offset:
        raise ValueError(f"{type(past_key_values).__name__} drops old keys (a sliding window); HELM models attend to "
                         "the whole cache: use a DynamicCache or a StaticCache")
    static = isinstance(past_len, torch.Tensor) or past_len + seq_len != kv_len
    return CacheLayout(past_len, kv_len, past_len if static else None)


class AttentionWeights:
    """``output_attentions`` of a forward, as ``LlamaModel`` returns them: with ``attn_implementation="eager"`` one
    ``[B, H, T, T_kv]`` tensor of softmax weights per layer (statistics dtype, recorded by
    :class:`helm.ops.attention.record_attention_weights`); with another implementation, which never forms them, a
    warning (once) and an empty tuple, as Llama's sdpa gives. ``with AttentionWeights(model, output_attentions) as
    record:`` around the decoder layers; ``record.weights`` is then that tuple, or None when not requested."""

    def __init__(self, model, output_attentions: Optional[bool]):
        config = model.config
        self.wanted = bool(config.output_attentions if output_attentions is None else output_attentions)
        self.eager = ATTENTION_ALIASES.get(config._attn_implementation, config._attn_implementation) == "eager"
        if self.wanted and not self.eager:
            logger.warning_once(f"output_attentions=True: attn_implementation={config._attn_implementation!r} does not "
                                "form the attention weights (the attentions returned are empty); load the model with "
                                "attn_implementation='eager' or call model.set_attn_implementation('eager')")
        self.weights, self._record = None, None

    def __enter__(self):
        if self.wanted and self.eager:
            self._record = record_attention_weights().__enter__()
        return self

    def __exit__(self, *exc):
        if self._record is not None:
            self._record.__exit__(*exc)
        if self.wanted:
            self.weights = () if self._record is None else tuple(self._record.weights)


def check_mask_lengths(layout: CacheLayout, seq_len: int, **masks: Optional[torch.Tensor]) -> None:
    """A 2-D ``attention_mask`` or ``segment_ids`` that covers fewer positions than the cached and the new tokens is
    refused naming it: padded as a static cache's free slots, the last tokens would be cut off from the rest. A
    ``ValueError`` from the shapes; with a static cache, whose length is a tensor, a ``RuntimeError`` from
    ``torch._assert_async`` (at once on a CPU, no host synchronisation on a GPU). ``generate`` passes the segment
    ids of the prompt unchanged at every step, so they are refused there (an ``attention_mask`` grows)."""
    for name, mask in masks.items():
        if mask is None or mask.dim() != 2:
            continue
        problem = (f"{name} covers {mask.shape[-1]} positions, fewer than the cached and new tokens: give it as "
                   "[batch, cached + new tokens]" + ("; generate does not extend segment_ids (pass an attention_mask "
                                                     "for padding)" if name == "segment_ids" else ""))
        if isinstance(layout.past_len, torch.Tensor):
            torch._assert_async(layout.past_len + seq_len <= mask.shape[-1], problem)
        elif mask.shape[-1] < layout.past_len + seq_len:
            raise ValueError(problem.replace("the cached and new tokens", f"the {layout.past_len} cached + {seq_len} "
                                             "new tokens"))


def default_position_ids(attention_mask: Optional[torch.Tensor], layout: CacheLayout, seq_len: int,
                         batch: int, device) -> torch.Tensor:
    """``[B, T]`` positions: from a 2-D padding mask (left padding starts real tokens at 0) or a plain range
    ``past_len + (0 .. T-1)`` (also for a 4-D mask, as in ``LlamaModel``). The mask is read as a boolean (nonzero =
    real token), like :class:`helm.ops.AttentionMask`."""
    steps = torch.arange(seq_len, device=device)
    if attention_mask is not None and attention_mask.dim() == 2:
        pos = (attention_mask.bool().long().cumsum(-1) - 1).clamp_min(0)
        if not isinstance(layout.past_len, torch.Tensor) and pos.shape[-1] == layout.past_len + seq_len:
            return pos[:, -seq_len:]
        return pos.index_select(1, steps + layout.past_len)  # a mask over a static cache's slots
    return (steps + layout.past_len).expand(batch, seq_len)


def attention_mask_for(layout: CacheLayout, batch: int, seq_len: int, attention_mask: Optional[torch.Tensor],
                       segment_ids: Optional[torch.Tensor], device) -> AttentionMask:
    """The forward's one :class:`~helm.ops.AttentionMask`: a 4-D ``attention_mask`` is used as given (the dense
    form); 2-D masks and ``segment_ids`` shorter than a static cache are padded to its length (as masked slots and
    segment ``-1``), and the queries are placed at ``layout.q_offset``."""
    dense = None
    if attention_mask is not None and attention_mask.dim() == 4:
        dense, attention_mask = attention_mask, None
    if attention_mask is not None and attention_mask.shape[-1] < layout.kv_len:
        attention_mask = F.pad(attention_mask.bool(), (0, layout.kv_len - attention_mask.shape[-1]))
    if segment_ids is not None and segment_ids.shape[-1] < layout.kv_len:
        segment_ids = F.pad(segment_ids, (0, layout.kv_len - segment_ids.shape[-1]), value=-1)
    return AttentionMask(batch, seq_len, layout.kv_len, padding=attention_mask, segment_ids=segment_ids,
                         device=device, q_offset=layout.q_offset, dense=dense)


def _loss_kwargs(labels: torch.Tensor, kwargs: dict) -> dict:
    """``kwargs`` with ``num_items_in_batch = max(#labelled, 1)`` computed on the device (no synchronisation) unless
    the caller passes it (gradient accumulation): the mean over labelled tokens whenever one is labelled, and 0 with
    zero gradients when none is, where transformers' mean is ``0/0 = NaN`` (``LlamaForCausalLM`` returns NaN there)."""
    if kwargs.get("num_items_in_batch") is None:
        ignore = kwargs.get("ignore_index", -100)
        shifted = kwargs.get("shift_labels")
        shifted = labels[..., 1:] if shifted is None else shifted
        kwargs = {**kwargs, "num_items_in_batch": (shifted != ignore).sum().clamp_min(1)}
    return kwargs


def causal_lm_loss(model, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """``model.loss_function`` (transformers' ``ForCausalLMLoss``: labels shifted inside, ``-100`` ignored),
    normalised by the number of labelled tokens, at least 1 (:func:`_loss_kwargs`)."""
    return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size,
                               **_loss_kwargs(labels, kwargs))


def fused_causal_lm_loss(model, hidden_states: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """:func:`causal_lm_loss` of ``model.lm_head(hidden_states)`` without the ``[B, T, V]`` logits: the LM head's
    fused, chunked cross-entropy (:func:`helm.ops.linear_cross_entropy`), same shift (``labels[:, 1:]`` or the
    caller's ``shift_labels``), ``ignore_index``, ``num_items_in_batch`` and normalisation, same loss and
    gradients. The loss is fp32 (fp64 for an fp64 model, where ``ForCausalLMLoss`` would round it to fp32)."""
    kwargs = _loss_kwargs(labels, kwargs)
    ignore = kwargs.get("ignore_index", -100)
    targets = kwargs.get("shift_labels")
    if targets is None:
        targets = nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
    total = model.get_output_embeddings()(hidden_states, targets=targets, ignore_index=ignore)
    count = kwargs["num_items_in_batch"]
    return total / (count.to(total.device) if torch.is_tensor(count) else count)


def lm_logits_and_loss(model, hidden_states: torch.Tensor, labels: Optional[torch.Tensor],
                       skip_logits: Optional[bool], **kwargs) -> tuple:
    """``(logits, loss)`` of a HELM ``…ForCausalLM.forward``: the LM head on ``hidden_states``, and the causal-LM
    loss when ``labels`` are given.

    With ``skip_logits`` the loss is :func:`fused_causal_lm_loss` and ``logits`` is None (the name and rule of
    Liger's fused loss, which ``transformers.Trainer`` passes in evaluation with ``use_liger_kernel``).
    ``skip_logits=None`` (the default) means ``config.fused_lm_loss and model.training and labels is not None``:
    training steps never build the ``[B, T, V]`` logits, while evaluation, generation and ``skip_logits=False``
    return them. ``skip_logits=True`` without labels is a ``ValueError``.
    """
    if skip_logits is None:
        skip_logits = bool(getattr(model.config, "fused_lm_loss", True)) and model.training and labels is not None
    if skip_logits:
        if labels is None:
            raise ValueError("skip_logits=True computes only the loss and needs labels; pass labels, or "
                             "skip_logits=False / None for the logits")
        return None, fused_causal_lm_loss(model, hidden_states, labels, **kwargs)
    logits = model.get_output_embeddings()(hidden_states)
    return logits, None if labels is None else causal_lm_loss(model, logits, labels, **kwargs)


__all__ = ["CACHE_FIELD", "AttentionWeights", "CacheLayout", "HelmCausalLMBase", "HelmDecoderModel",
           "HelmPreTrainedModel", "attention_mask_for", "cache_layout", "causal_lm_loss", "continuous_batch",
           "default_position_ids", "fused_causal_lm_loss", "lm_logits_and_loss", "positional_encoding",
           "resolve_cache"]
