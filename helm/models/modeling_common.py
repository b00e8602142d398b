"""What the HELM-D and HELM-MiCE models share: the base class (init, geometry, save hooks) and three functions
their ``forward`` calls: input checks, default positions, and the positional encoding built from a config."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel

from ..manifold.lorentz import Lorentz
from ..nn.attention import LorentzAttentionBase
from ..nn.embedding import LorentzEmbedding
from ..nn.head import LorentzLMHead
from ..nn.norm import LorentzRMSNorm
from ..nn.positional import PositionalEncoding
from ..nn.positional.registry import build_positional_encoding, positional_encoding_class
from ..nn.residual import LorentzResidual


class HelmPreTrainedModel(PreTrainedModel):
    """Weight init, geometry bookkeeping and remote-code saving common to every HELM model."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _can_compile_fullgraph = False

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


def positional_encoding(config, *, head_dim: int) -> PositionalEncoding:
    """The model's positional encoding from ``config``: ``head_dim`` space dims per head get it (``absolute``
    kinds act on the token stream, ``hidden_size - 1`` dims); kind-specific options come from the config
    fields the kind names in its ``options``."""
    kind = positional_encoding_class(config.positional)
    options = {name: getattr(config, field) for name, field in kind.options.items() if field is not None}
    return build_positional_encoding(config.positional, head_dim=config.hidden_size - 1 if kind.absolute else head_dim,
                                     num_heads=config.num_attention_heads,
                                     max_position_embeddings=config.max_position_embeddings,
                                     rope_theta=config.rope_theta, **options)


def check_inputs(config, input_ids: Optional[torch.Tensor], inputs_embeds, past_len: int, seq_len: int,
                 attention_mask: Optional[torch.Tensor], segment_ids: Optional[torch.Tensor]) -> None:
    """Clear errors for ids outside the vocabulary, masks of the wrong length, and lengths the positional
    encoding cannot reach.

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
    for name, t in (("attention_mask", attention_mask), ("segment_ids", segment_ids)):
        if t is not None and (t.dim() != 2 or t.shape[-1] != past_len + seq_len):
            raise ValueError(f"{name} must be [B, T_past+T] = [B, {past_len + seq_len}], got {tuple(t.shape)}")
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


__all__ = ["HelmPreTrainedModel", "check_inputs", "default_position_ids", "positional_encoding"]
