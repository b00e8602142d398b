"""Pieces shared by the HELM-D and HELM-MiCE models: base class, embeddings, input checks, the decoder loop."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache

from ..manifold.lorentz import Lorentz
from ..manifold.math import curvature_to_k
from ..manifold.math import lift
from ..nn.attention import LorentzSelfAttention
from ..nn.embedding import LorentzEmbedding
from ..nn.head import LorentzLMHead
from ..nn.hmla import HMLA
from ..nn.linear import LorentzLinear
from ..nn.norm import LorentzRMSNorm
from ..nn.positional import LearnedPositionalEncoding
from ..nn.residual import LorentzResidual


class HelmPreTrainedModel(PreTrainedModel):
    """Weight init and geometry bookkeeping common to every HELM model."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["HelmDDecoderLayer", "HelmMiCEDecoderLayer"]
    _supports_sdpa = True
    _can_compile_fullgraph = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (LorentzEmbedding, LearnedPositionalEncoding)):
            module.reset_parameters()
        elif isinstance(module, LorentzLMHead):
            module.reset_parameters()
        elif isinstance(module, LorentzRMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, LorentzResidual):
            module.reset_parameters()
        elif isinstance(module, (LorentzSelfAttention, HMLA)):
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

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        model = super().from_pretrained(*args, **kwargs)
        return model.restore_geometry()

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """Every saved HELM directory already carries its code and ``auto_map`` (see :meth:`save_pretrained`).

        ``transformers``' own copier follows only single-dot relative imports and would fail on our package
        layout, so this only validates the name and leaves saving to :mod:`.remote_code`.
        """
        name = auto_class if isinstance(auto_class, str) else auto_class.__name__
        if name not in ("AutoModel", "AutoModelForCausalLM"):
            raise ValueError(f"auto_class must be 'AutoModel' or 'AutoModelForCausalLM', got {auto_class!r}")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``transformers``' save plus a flattened copy of the code and ``auto_map`` (see :mod:`.remote_code`), so
        the directory loads with ``trust_remote_code=True`` where ``helm`` is not installed."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            from .remote_code import write_remote_code

            write_remote_code(save_directory, type(self))



class HelmEmbeddings(nn.Module):
    """Token embedding (``lorentz`` or ``space`` mode) plus the ``learned`` absolute positions when chosen."""

    def __init__(self, config, k: float):
        super().__init__()
        self.k = k
        self.embed_tokens = LorentzEmbedding(config.vocab_size, config.hidden_size, k=k,
                                             mode=config.embedding_mode, init_std=config.initializer_range)
        self.embed_positions = None
        if config.positional == "learned":
            self.embed_positions = LearnedPositionalEncoding(config.max_position_embeddings, config.hidden_size - 1,
                                                             init_std=config.initializer_range)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_positions is not None:
            x = lift(self.embed_positions.embed(x[..., 1:], position_ids), k=self.k)
        return x


def check_inputs(config, input_ids: Optional[torch.Tensor], inputs_embeds, past_len: int, seq_len: int) -> None:
    """Clear errors for ids outside the vocabulary and lengths the positional encoding cannot reach.

    The vocabulary check reads one boolean back from the device per forward (skipped while compiling);
    ``config.validate_inputs = False`` turns it off.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None and config.validate_inputs and not torch.compiler.is_compiling():
        if input_ids.numel() and bool(((input_ids < 0) | (input_ids >= config.vocab_size)).any()):
            lo, hi = int(input_ids.min()), int(input_ids.max())
            raise ValueError(f"input_ids must lie in [0, vocab_size={config.vocab_size}); got values in [{lo}, {hi}]"
                             " (is the tokenizer's vocabulary larger than the model's?)")
    if config.positional == "learned" and past_len + seq_len > config.max_position_embeddings:
        raise ValueError(f"sequence length {past_len + seq_len} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}, and the 'learned' positional encoding cannot extend "
                         "beyond its table; use a relative encoding (e.g. positional='hope') for longer inputs")


def default_position_ids(attention_mask: Optional[torch.Tensor], past_len: int, seq_len: int,
                         batch: int, device) -> torch.Tensor:
    """``[B, T]`` positions: from the padding mask (left padding starts real tokens at 0) or a plain range."""
    if attention_mask is not None:
        pos = attention_mask.long().cumsum(-1) - 1
        return pos.clamp_min(0)[:, -seq_len:]
    return torch.arange(past_len, past_len + seq_len, device=device).expand(batch, seq_len)


class HelmDecoderStack:
    """``forward`` of the base models: embedding → decoder layers → final RMSNorm_L, with cache and masks.

    The host class calls :meth:`build_stack` and sets ``output_class`` (a ``transformers`` output).
    ``segment_ids [B, T_past+T]`` are document ids of packed rows: attention never crosses documents.
    """

    def build_stack(self, config, layer_class) -> None:
        k = curvature_to_k(config.curvature)
        self.embed = HelmEmbeddings(config, k)
        self.layers = nn.ModuleList(layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = LorentzRMSNorm(config.hidden_size, k=k, eps=config.rms_norm_eps)

    def get_input_embeddings(self):
        return self.embed.embed_tokens

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values=None,
                inputs_embeds: Optional[torch.Tensor] = None, use_cache: Optional[bool] = None,
                segment_ids: Optional[torch.LongTensor] = None, output_hidden_states: Optional[bool] = None,
                **kwargs):
        config = self.config
        use_cache = config.use_cache if use_cache is None else use_cache
        B, T = (input_ids if input_ids is not None else inputs_embeds[..., 0]).shape[:2]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=config)
        past_len = past_key_values.get_seq_length() if isinstance(past_key_values, Cache) else 0
        check_inputs(config, input_ids, inputs_embeds, past_len, T)
        for name, t in (("attention_mask", attention_mask), ("segment_ids", segment_ids)):
            if t is not None and (t.dim() != 2 or t.shape[-1] != past_len + T):
                raise ValueError(f"{name} must be [B, T_past+T] = [B, {past_len + T}], got {tuple(t.shape)}")
        device = (input_ids if input_ids is not None else inputs_embeds).device
        if position_ids is None:
            position_ids = default_position_ids(attention_mask, past_len, T, B, device)
        x = self.embed(input_ids, position_ids) if inputs_embeds is None else inputs_embeds
        hidden_states = []
        for layer in self.layers:
            x = layer(x, position_ids=position_ids, attention_mask=attention_mask, segment_ids=segment_ids,
                      past_key_values=past_key_values)
            hidden_states.append(x)
        return self.output_class(last_hidden_state=self.norm(x), past_key_values=past_key_values if use_cache else None,
                                 hidden_states=tuple(hidden_states) if output_hidden_states else None)


def build_attention(config, k: float, layer_idx: int, kind: str) -> nn.Module:
    """``mha`` (Eq. 3 self-attention) or ``hmla`` (§4.3) from a config; ``learned`` positions live in the embedding."""
    positional = "none" if config.positional == "learned" else config.positional
    common = dict(k=k, positional=positional, max_position_embeddings=config.max_position_embeddings,
                  rope_theta=config.rope_theta, tau_init=config.tau_init, attn_impl=config.attn_impl,
                  layer_idx=layer_idx, bias=config.attention_bias, pe_options=dict(config.pe_options or {}))
    if kind == "hmla":
        return HMLA(config.hidden_size, config.num_attention_heads, kv_lora_rank=config.kv_lora_rank,
                    q_lora_rank=config.q_lora_rank or 0, qk_nope_head_dim=config.qk_nope_head_dim,
                    qk_rope_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
                    rms_norm_eps=config.rms_norm_eps, **common)
    return LorentzSelfAttention(config.hidden_size, config.num_attention_heads, config.head_dim, **common)


def build_residual(config, k: float) -> LorentzResidual:
    return LorentzResidual(k=k, weight=config.residual_weight, space_scale=config.residual_space_scale)


def build_lm_head(config, k: float) -> LorentzLMHead:
    return LorentzLMHead(config.hidden_size, config.vocab_size, k=k, mode=config.lm_head_mode,
                         init_std=config.initializer_range)


class HelmCausalLMMixin:
    """``forward`` of the causal-LM wrappers: logits for the kept positions, shifted cross-entropy loss, and the
    MoE balance loss when the host's ``output_class`` carries one (added to ``loss`` in training)."""

    def build_head(self, config, model_class) -> None:
        self.model = model_class(config)
        self.lm_head = build_lm_head(config, curvature_to_k(config.curvature))

    def get_input_embeddings(self):
        return self.model.embed.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def aux_loss(self) -> Optional[torch.Tensor]:
        return None

    def forward(self, input_ids: Optional[torch.LongTensor] = None, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.LongTensor] = None, past_key_values=None,
                inputs_embeds: Optional[torch.Tensor] = None, labels: Optional[torch.LongTensor] = None,
                use_cache: Optional[bool] = None, segment_ids: Optional[torch.LongTensor] = None,
                output_hidden_states: Optional[bool] = None, logits_to_keep: int = 0, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         segment_ids=segment_ids, output_hidden_states=output_hidden_states)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        fields = dict(logits=logits, past_key_values=out.past_key_values, hidden_states=out.hidden_states)
        if "aux_loss" in self.output_class.__dataclass_fields__:
            aux = self.aux_loss()
            fields["aux_loss"] = aux
            if loss is not None and aux is not None:
                loss = loss + aux
        return self.output_class(loss=loss, **fields)


__all__ = [
    "HelmPreTrainedModel",
    "HelmEmbeddings",
    "HelmDecoderStack",
    "HelmCausalLMMixin",
    "build_attention",
    "build_residual",
    "build_lm_head",
    "check_inputs",
    "default_position_ids",
    "LorentzLinear",
]
