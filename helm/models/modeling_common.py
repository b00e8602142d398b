"""What the HELM-D and HELM-MiCE models share: the base class (init, geometry, strict loading, save hooks) and
the functions their ``forward`` calls: input checks, default positions, the positional encoding built from a
config, and the causal-LM loss."""

from __future__ import annotations

import copy
import difflib
import functools
import json
import math
import numbers
import os
import re
import uuid
import warnings
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import Cache, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.cache_utils import StaticLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.utils import can_return_tuple as _transformers_can_return_tuple
from transformers.utils import logging

from ..manifest import MANIFEST, write_manifest
from ..manifold.lorentz import Lorentz
from ..manifold.math import lift
from ..nn.attention import LorentzAttentionBase
from ..nn.embedding import LorentzEmbedding
from ..nn.head import LorentzLMHead
from ..nn.norm import LorentzRMSNorm
from ..nn.positional import PositionalEncoding
from ..nn.positional.registry import build_positional_encoding, positional_encoding_class
from ..nn.residual import LorentzResidual
from ..nn.validation import check_tensor
from ..ops.attention import AttentionMask
from .loading import (WEIGHT_FILE, WEIGHT_FILES, check_local_folder, check_save_directory, device_map_problem,
                      weights_identity)
from .peft_support import check_adapter, register_peft_support


logger = logging.get_logger(__name__)

# LoraConfig() without target_modules picks HELM's projections, as it picks Llama's (also in remote code)
register_peft_support()

# Checkpoints saved before the attention and MLP projections became plain linears under Llama's names
# (``q_proj.linear.weight`` is now ``q_proj.weight``); ``final_proj`` is still a LorentzLinear.
LEGACY_KEY_MAPPING = {r"\.(q|k|v|o|q_a|q_b|kv_a|kv_b|k_rope|gate|up|down)_proj\.linear\.": r".\1_proj."}


class HelmPreTrainedModel(PreTrainedModel):
    """Weight init, geometry bookkeeping, strict loading and remote-code saving common to every HELM model.

    ``from_pretrained`` is strict: a checkpoint with weights missing (they would silently stay randomly
    initialised), weights the model does not use, or weights of the wrong shape raises ``RuntimeError`` instead
    of ``transformers``' logged load report. The only exceptions are ``transformers``' own: the LM head of a
    causal-LM checkpoint loaded into the bare model (``_keys_to_ignore_on_load_unexpected``), a head that the
    checkpoint's class does not have (a base-model or other-head checkpoint into a head class: the head is newly
    initialised with a warning, see :meth:`_allow_new_head`) and ``ignore_mismatched_sizes=True``, which re-initialises mismatched weights on request. A missing
    ``model.safetensors`` is ``transformers``' ``OSError``; a corrupt or truncated one (``SafetensorError`` or an
    ``OSError`` from reading it) is re-raised as an ``OSError`` naming the file, chained from the original.

    ``dtype=torch.float16`` (or ``bfloat16``) is applied, on CPU too: weight matrices and tables are stored in
    that dtype, while the scalars that parametrise the geometry (temperatures, residual weights, curvatures) stay
    fp32 parameters: the GEMMs run in the weights' dtype, every time coordinate, norm and softmax statistic in fp32
    (:mod:`helm.precision`), so outputs stay finite and on the manifold (``tests/reliability/test_inputs.py``).
    """

    base_model_prefix = "model"
    supports_gradient_checkpointing = True  # the decoder layers are transformers GradientCheckpointingLayers
    _supports_sdpa = True
    # the forward has no graph break and no host read under torch.compile (checks that read the device are skipped
    # while compiling; a static cache's length stays a tensor): tests/workflows/test_static_cache.py
    _can_compile_fullgraph = True

    def __init__(self, config, *args, **kwargs):
        # the cross-field checks again: a field assigned after construction (c.first_k_dense_replace = 5) passes its
        # own rule only, and would build another model than the config describes (or one its save cannot reload)
        config.validate_architecture()
        super().__init__(config, *args, **kwargs)
        # which weights fill a KV cache (CacheOrigin): a new model's own; copy.deepcopy keeps it, and from_pretrained
        # names the files it loaded (two loads of one checkpoint are the same weights)
        self.weights_id = uuid.uuid4().hex

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

    def _set_gradient_checkpointing(self, enable: bool = True, **kwargs) -> None:
        """``transformers``' hook behind ``gradient_checkpointing_enable()``; also lets ``torch.compile`` trace the
        checkpointed layers in one graph (``fullgraph=True``). Their forwards have side effects that eager
        recomputation repeats to no effect (the attention mask's shared dense form, MiCE's balance loss and expert
        load, recomputed with the same values): dynamo is told it may skip them in the recompute, a global flag that
        accelerate's regional compilation sets too."""
        if enable:
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        super()._set_gradient_checkpointing(enable=enable, **kwargs)

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

    @staticmethod
    def _load_pretrained_model(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        """``transformers``' loader, with the migration of checkpoints saved when the learnable scalars
        (``log_tau``, ``raw_weight``, ``log_k``, ...) were 0-dim tensors: they are ``[1]`` now, because FSDP2 shards
        every parameter along dim 0. Generic: every ``[1]`` parameter that the checkpoint holds as a 0-dim tensor is
        swapped for a 0-dim placeholder while ``transformers`` loads (so its device, dtype and offload handling apply
        unchanged), then reshaped back to ``[1]``; new checkpoints (``[1]``) load untouched."""
        def stem(key: str) -> str:  # a base-model checkpoint loads into …ForCausalLM and back
            return key[len(model.base_model_prefix) + 1:] if key.startswith(model.base_model_prefix + ".") else key

        shapes = {}
        if state_dict is not None:
            shapes = {stem(k): tuple(v.shape) for k, v in state_dict.items()}
        for file in checkpoint_files or ():
            if str(file).endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(file, framework="pt") as f:
                    shapes.update({stem(k): tuple(f.get_slice(k).get_shape()) for k in f.keys()})
            elif str(file).endswith(".bin"):
                try:
                    loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                except Exception:  # noqa: BLE001 - unreadable: transformers' own load below reports it
                    continue
                shapes.update({stem(k): tuple(v.shape) for k, v in loaded.items()})
        swapped = {}
        for name, p in model.named_parameters():
            if p.shape == (1,) and shapes.get(stem(name)) == ():
                module, _, leaf = name.rpartition(".")
                swapped[name] = (model.get_submodule(module), leaf)
                setattr(swapped[name][0], leaf, nn.Parameter(p.detach().reshape(()), requires_grad=p.requires_grad))
        result = PreTrainedModel._load_pretrained_model(model, state_dict, checkpoint_files, load_config,
                                                        *args, **kwargs)
        for module, leaf in swapped.values():
            loaded = getattr(module, leaf)
            if loaded.dim() == 0 and loaded.device.type != "meta":  # left 0-dim where offloaded (still computes)
                fixed = nn.Parameter(loaded.detach().reshape(1), requires_grad=loaded.requires_grad)
                fixed._is_hf_initialized = getattr(loaded, "_is_hf_initialized", False)
                setattr(module, leaf, fixed)
        return result

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``transformers``' loader, strict about the weights (see the class docstring), then
        :meth:`restore_geometry`. ``output_loading_info=True`` returns ``(model, info)`` as in ``transformers``."""
        want_info = kwargs.pop("output_loading_info", False)
        where = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        check_local_folder(cls.__name__, where, config=args[1] if len(args) > 1 else kwargs.get("config"),
                            subfolder=kwargs.get("subfolder") or "", gguf_file=kwargs.get("gguf_file"))
        if kwargs.get("device_map") is not None and (problem := device_map_problem(kwargs["device_map"])):
            raise ValueError(f"{cls.__name__}.from_pretrained({str(where)!r}): {problem}")
        check_dtype_arguments(f"{cls.__name__}.from_pretrained({str(where)!r})", kwargs)
        if (args[1] if len(args) > 1 else kwargs.get("config")) is None:
            check_model_type(cls, where, subfolder=kwargs.get("subfolder") or "")
        try:
            # transformers would refuse mismatched shapes with "look at the above report"; check_loading_info
            # names them instead (and honours the caller's ignore_mismatched_sizes)
            model, info = super().from_pretrained(
                *args, output_loading_info=True,
                **{**kwargs, "ignore_mismatched_sizes": True,
                   "key_mapping": {**LEGACY_KEY_MAPPING, **(kwargs.get("key_mapping") or {})}})
        except TypeError as err:
            # a keyword that is neither a config field nor a loading option reaches the model's __init__
            unexpected = re.search(r"__init__\(\) got an unexpected keyword argument '(\w+)'", str(err))
            if unexpected is None:
                raise
            from .configuration_common import LOADING_KWARGS, config_fields, unknown_field_error

            key = unexpected.group(1)
            candidates = config_fields(cls.config_class) | {k for k in LOADING_KWARGS if not k.startswith("_")}
            raise unknown_field_error(cls.config_class, key, candidates,
                                      f"keyword {key}= of {cls.__name__}.from_pretrained: {cls.config_class.__name__} "
                                      "has no such field, and transformers no such loading option") from None
        except (SafetensorError, OSError) as err:
            files = _local_weight_files(where)
            if not files or (isinstance(err, OSError) and not isinstance(err, SafetensorError)
                             and not _mentions_weights(err, files)):
                raise  # missing files, unreachable repos, ...: transformers' message already says which
            raise OSError(f"{cls.__name__}.from_pretrained({str(where)!r}): the weights file "
                          f"{', '.join(str(f) for f in files)} is corrupted or truncated and cannot be read "
                          f"({type(err).__name__}: {err}); re-save or re-download the checkpoint") from err
        info = model._allow_new_head(where, info)
        check_loading_info(cls.__name__, where, info, ignore_mismatched_sizes=kwargs.get("ignore_mismatched_sizes"))
        # transformers re-saves a renamed checkpoint in its old layout; a migrated one is saved in the current one
        model._weight_conversions = [c for c in getattr(model, "_weight_conversions", None) or []
                                     if list(c.source_patterns) != list(LEGACY_KEY_MAPPING)]
        model.restore_geometry()
        check_finite_weights(cls.__name__, where, model, subfolder=kwargs.get("subfolder") or "")
        identity = weights_identity(where, subfolder=kwargs.get("subfolder") or "",
                                    revision=getattr(model.config, "_commit_hash", None) or kwargs.get("revision"))
        for module in model.modules():
            if isinstance(module, HelmPreTrainedModel):
                module.weights_id = identity
        return (model, info) if want_info else model

    @classmethod
    def _from_config(cls, config, **kwargs):
        """``transformers``' constructor behind ``AutoModel*.from_config(config, **kwargs)``, with ``dtype=`` (and
        ``torch_dtype=``) checked first (:func:`check_dtype_arguments`; transformers' own error is an
        ``AttributeError`` from ``torch``). ``dtype="auto"`` builds the model in ``config.dtype`` (the default dtype
        when the config records none), as ``from_pretrained`` reads ``config.json``'s."""
        check_dtype_arguments(f"from_config of {cls.__name__}", kwargs)
        # without dtype= (or torch_dtype=), transformers builds the model in config.dtype
        kwargs = {name: value for name, value in kwargs.items()
                  if not (name in ("dtype", "torch_dtype") and value == "auto")}
        return super()._from_config(config, **kwargs)

    def load_adapter(self, peft_model_id=None, *args, **kwargs):
        """``transformers``' PEFT adapter loading, after :func:`~helm.models.peft_support.check_adapter`: an adapter
        saved for another model type, or holding weights for modules this model lacks, is a ``ValueError``, and so
        is a folder of adapter weights without ``adapter_config.json`` when no ``peft_config`` is passed (the
        settings would be read from the folder).

        As ``from_pretrained`` does, ``subfolder=`` is taken (transformers' own takes it in ``adapter_kwargs`` only and
        fails on it with a ``TypeError`` from an internal class), and a local adapter saved with
        ``safe_serialization=False`` (``adapter_model.bin`` only) loads (transformers looks for
        ``adapter_model.safetensors`` unless ``use_safetensors=False`` is passed)."""
        if "subfolder" in kwargs:
            kwargs["adapter_kwargs"] = {**(kwargs.get("adapter_kwargs") or {}), "subfolder": kwargs.pop("subfolder")}
        adapter_kwargs = kwargs.get("adapter_kwargs") or {}
        peft_config = args[1] if len(args) > 1 else kwargs.get("peft_config")  # after adapter_name
        subfolder = adapter_kwargs.get("subfolder") or ""
        check_adapter(f"{type(self).__name__}.load_adapter", self, peft_model_id, subfolder=subfolder,
                      need_config=peft_config is None)
        if isinstance(peft_model_id, (str, os.PathLike)) and "use_safetensors" not in kwargs:
            folder = Path(peft_model_id) / subfolder
            if (folder / "adapter_model.bin").is_file() and not (folder / "adapter_model.safetensors").exists():
                kwargs["use_safetensors"] = False
        return super().load_adapter(peft_model_id, *args, **kwargs)

    def _allow_new_head(self, where, info: dict) -> dict:
        """The loading info with a missing head accepted, as ``transformers`` accepts it for Llama: from a checkpoint
        saved from another class (a base model, or another head; ``config.architectures``) the head weights it lacks
        are newly initialised, and a warning names them; the other head's weights it brings and this model does not
        have are unused. A checkpoint of this very class stays strict (:func:`check_loading_info`: a missing head
        weight there is a damaged checkpoint), and so do weights that exist but do not fit, and the decoder's."""
        prefix = self.base_model_prefix + "."
        if self.base_model_prefix not in dict(self.named_children()):
            return info  # the bare model: it has no head
        saved = list(getattr(self.config, "architectures", None) or [])
        if not saved or type(self).__name__ in saved:
            return info
        head = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(prefix))
        if head:
            logger.warning(f"{type(self).__name__}.from_pretrained({str(where)!r}): the checkpoint was saved from "
                           f"{', '.join(saved)} and has no weights for {head}; they are newly initialised. Train the "
                           "model on a downstream task before using it for predictions.")
        other = {k for k in info.get("unexpected_keys", ()) if not k.startswith(prefix)}
        return {**info, "missing_keys": set(info.get("missing_keys", ())) - set(head),
                "unexpected_keys": set(info.get("unexpected_keys", ())) - other}

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
        """``transformers``' post-init, then every attention layer bound to this model's config
        (:meth:`~helm.nn.attention.LorentzAttentionBase.bind_config`): ``config.attn_impl`` (or
        ``config._attn_implementation``) assigned after the model is built reaches the layers at their next call. The
        fields the layers read when they are built are recorded (:func:`built_config_fields`): :meth:`save_pretrained`
        warns about those changed since."""
        super().post_init()
        self._bind_attention_to_config()
        self._config_as_built = built_config_fields(self.config)

    def _bind_attention_to_config(self) -> None:
        for module in self.modules():
            if isinstance(module, LorentzAttentionBase):
                module.bind_config(self.config)

    def set_attn_implementation(self, attn_implementation, allow_all_kernels: bool = False) -> None:
        """``"eager"`` / ``"sdpa"`` (transformers' names) switch every attention layer to that implementation of
        :func:`helm.ops.lorentz_attention`; anything else is a ``ValueError`` (see
        :attr:`HelmConfigBase.attn_impl` for ``"triton"`` / ``"auto"``)."""
        self.config._attn_implementation = attn_implementation  # validated and mapped to attn_impl by the config
        self._bind_attention_to_config()  # the layers read config.attn_impl (also if self.config was replaced)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        """Every saved HELM directory already carries its code and ``auto_map`` (see :meth:`save_pretrained`).

        ``transformers``' own copier follows only single-dot relative imports and would fail on our package
        layout, so this only validates the name and leaves saving to :mod:`.remote_code`.
        """
        name = auto_class if isinstance(auto_class, str) else auto_class.__name__
        from .remote_code import AUTO_CLASSES

        if name not in AUTO_CLASSES:
            raise ValueError(f"auto_class must be one of {sorted(AUTO_CLASSES)}, got {auto_class!r}")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``transformers``' save plus a flattened copy of the code and ``auto_map`` (see :mod:`.remote_code`), so
        the directory loads with ``trust_remote_code=True`` where ``helm`` is not installed, and a ``manifest.json``
        with the SHA-256 of the weight files it wrote (:func:`helm.manifest.write_manifest`, ``"step": null``):
        :meth:`from_pretrained` refuses the folder when they change on disk afterwards (bit rot, truncation, a
        partial copy). A manifest already there (``train.py``'s, or an older save's) describes the old weights: it
        is removed before saving and replaced by the new one. The manifest lists the weight files only (tokenizer,
        config and code files may be edited). With ``push_to_hub=True`` the code and the manifest are written
        before ``transformers`` uploads the folder (:meth:`_upload_modified_files`), so the hub copy has both.

        A ``save_directory`` that is an existing file (or lies under one) is a ``NotADirectoryError`` naming it
        (``transformers`` would log an error and save nothing); one that cannot be created an ``OSError`` naming
        it and the reason. An empty ``save_directory`` is a ``ValueError``, and so are one starting with ``~``
        (``transformers`` would create a folder named ``~`` in the current directory; the message gives the
        expanded path) and a model whose weights are on the meta device (:func:`unloaded_weights`; unless
        ``state_dict=`` gives the weights), refused before anything is written."""
        call = f"{type(self).__name__}.save_pretrained({str(save_directory)!r})"
        check_save_directory(self, save_directory)
        if note := changed_config_note(getattr(self, "_config_as_built", None), self.config):
            warnings.warn(f"{call}: {note}", UserWarning, stacklevel=2)
        if kwargs.get("state_dict") is None and (unloaded := unloaded_weights(self)):
            raise ValueError(f"{call}: the model's weights are on the meta device (shapes without values: "
                             f"{len(unloaded)} tensors, e.g. {unloaded[0]!r}; built with device='meta' or "
                             "init_empty_weights, or moved with .to('meta'), and never loaded), so there is nothing "
                             "to save and nothing was written; load the weights (from_pretrained) or materialise "
                             "them (model.to_empty(device=...) and initialise) first")
        path = Path(save_directory)
        main = kwargs.get("is_main_process", True)
        if main:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise OSError(f"{type(self).__name__}.save_pretrained({str(save_directory)!r}): cannot create the "
                              f"save directory ({error.strerror or error}: {error.filename or path}); give a "
                              "folder in a writable place") from error
            (path / MANIFEST).unlink(missing_ok=True)
        super().save_pretrained(save_directory, *args, **kwargs)
        if main and not kwargs.get("push_to_hub"):  # pushed: written by _upload_modified_files already
            self._write_code_and_manifest(path)

    def _write_code_and_manifest(self, folder: Path) -> None:
        from .remote_code import write_remote_code

        write_remote_code(folder, type(self))
        if folder.is_dir():
            write_manifest(folder, None, which=WEIGHT_FILE.match)

    def _upload_modified_files(self, working_dir, *args, **kwargs):
        """``transformers``' upload, which ``save_pretrained(push_to_hub=True)`` runs at the end of its own save
        (before :meth:`save_pretrained` gets to write the code and the manifest): they are written first."""
        if not (Path(working_dir) / MANIFEST).is_file():  # push_to_hub() saved with save_pretrained: written
            self._write_code_and_manifest(Path(working_dir))
        return super()._upload_modified_files(working_dir, *args, **kwargs)


def _local_weight_files(where) -> list:
    """The weight files of a local checkpoint directory (empty for a hub id or a missing directory)."""
    try:
        folder = Path(where)
        return [folder / name for name in WEIGHT_FILES if (folder / name).is_file()] if folder.is_dir() else []
    except TypeError:
        return []


def _mentions_weights(err: BaseException, files: list) -> bool:
    """Whether an ``OSError`` comes from reading the weights (not from a missing config or tokenizer file)."""
    text = str(err)
    return any(f.name in text or str(f) in text for f in files) or "safetensors" in text.lower() \
        or "header" in text.lower()


# the dtypes a HELM model is built and run in (helm.precision); transformers also reads their names
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# config fields a HELM model reads at each call, or that describe no layer: a change after the model is built is
# followed (or changes nothing built); any other field is read by the layers when they are built
RUNTIME_CONFIG_FIELDS = frozenset({
    "attn_impl", "validate_inputs", "fused_lm_loss", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "pad_token_id", "bos_token_id", "eos_token_id", "architectures", "dtype", "torch_dtype",
    "transformers_version", "problem_type", "id2label", "label2id", "initializer_range", "auto_map",
    "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class"})


def built_config_fields(config) -> dict:
    """The fields of ``config`` that a model's layers read when they are built (not :data:`RUNTIME_CONFIG_FIELDS`,
    not transformers' private ``_`` fields), as ``config.to_dict()`` gives them."""
    return {key: value for key, value in config.to_dict().items()
            if not key.startswith("_") and key not in RUNTIME_CONFIG_FIELDS}


def changed_config_note(built: Optional[dict], config) -> Optional[str]:
    """Why saving ``config`` would describe another model than the one built from ``built``
    (:func:`built_config_fields` when it was built): the fields changed since, with both values; None when none did.
    The layers read them when they were built, so the model does not follow the change, while the saved
    ``config.json`` would build a model that does (transformers' models, Llama's too, save the new value silently)."""
    if built is None:
        return None
    now = built_config_fields(config)
    changed = sorted(key for key in built.keys() | now.keys() if built.get(key) != now.get(key))
    if not changed:
        return None
    shown = ", ".join(f"{key} ({built.get(key)!r} -> {now.get(key)!r})" for key in changed[:4]) + \
        (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return (f"config field(s) changed after the model was built: {shown}. The layers read them when they were built "
            "and do not follow the change, but config.json is saved with the new values, so the saved model would "
            "reload as a different model; set them back before saving, or build a new model from the changed config "
            "(from_config) and load these weights into it")


def check_dtype_arguments(call: str, kwargs: dict) -> None:
    """``ValueError`` naming ``dtype=`` (or ``torch_dtype=``) of ``call`` unless it is None, ``"auto"``, one of
    :data:`MODEL_DTYPES` or the name of one (``"float32"``, ``"bfloat16"``, ``"half"``, ...), or a dict of such
    values (transformers' per-sub-config form); transformers would fail with torch's ``AttributeError`` on an unknown
    name, or build a model in an integer dtype."""
    def accepted(value) -> bool:
        if isinstance(value, str):
            return value == "auto" or getattr(torch, value, None) in MODEL_DTYPES
        return value is None or value in MODEL_DTYPES

    for name in ("dtype", "torch_dtype"):
        value = kwargs.get(name)
        if not (all(map(accepted, value.values())) if isinstance(value, dict) else accepted(value)):
            names = ", ".join(repr(str(d).removeprefix("torch.")) for d in MODEL_DTYPES)
            raise ValueError(f"{call}: {name}={value!r} is not a dtype a HELM model runs in; pass a torch dtype "
                             f"({', '.join(map(str, MODEL_DTYPES))}), its name ({names}) or 'auto'")


def check_model_type(cls, where, *, subfolder: str = "") -> None:
    """``ValueError`` when the local checkpoint folder ``where`` holds a ``config.json`` whose ``model_type`` is not
    ``cls``'s (a HELM-MiCE folder given to ``HelmDForCausalLM``, or a Llama one), naming both types and the classes
    that load it; the config class would otherwise refuse the other family's fields one by one ("unknown config
    field"). Folders without a readable ``config.json`` or without ``model_type``, and hub ids, are left to the
    loader."""
    try:
        folder = Path(os.fspath(where)) / subfolder
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (TypeError, OSError, ValueError):
        return
    found, own = config.get("model_type") if isinstance(config, dict) else None, cls.config_class.model_type
    if not isinstance(found, str) or found == own:
        return
    from .remote_code import AUTO_CLASSES

    family = cls.config_class.__name__.removesuffix("Config")
    suffix = cls.__name__.removeprefix(family)
    auto = next((name for name, ending in AUTO_CLASSES.items() if ending == suffix), "AutoModel")
    other = _model_class_name(auto, found)
    use = f"{other} or {auto}" if other else auto
    raise ValueError(f"{cls.__name__}.from_pretrained({str(where)!r}): the folder holds a {found} model (config.json "
                     f"has model_type={found!r}), not a {own} one; load it with {use}")


def _model_class_name(auto: str, model_type: str) -> Optional[str]:
    """The class ``transformers``' Auto class ``auto`` picks for ``model_type``, or None where it knows none."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        chosen = getattr(transformers, auto)._model_mapping[CONFIG_MAPPING[model_type]]
    except (KeyError, AttributeError, ImportError, ValueError):
        return None
    return (chosen[0] if isinstance(chosen, (tuple, list)) else chosen).__name__


def unloaded_weights(model: nn.Module) -> list:
    """The names of ``model``'s parameters and persistent buffers (what ``save_pretrained`` writes) that are on the
    meta device without being offloaded: a model built with ``device="meta"`` or ``init_empty_weights`` and never
    loaded, or moved with ``.to("meta")``. A tensor that accelerate offloaded (a ``_hf_hook`` on its module or an
    ancestor holds its values, as with a ``device_map`` that places layers on ``"cpu"`` or ``"disk"``) is not
    counted: ``transformers``' save reads it back (:func:`weights_device` treats such modules the same way)."""
    buffers = [(f"{prefix}.{name}" if prefix else name, t) for prefix, module in model.named_modules()
               for name, t in module.named_buffers(recurse=False)
               if name not in module._non_persistent_buffers_set]
    return [name for name, t in [*model.named_parameters(), *buffers]
            if t.device.type == "meta" and not _offloaded(model, name)]


def _offloaded(model: nn.Module, name: str) -> bool:
    """Whether an accelerate hook on the module of the tensor ``name``, or on one of its ancestors, holds it."""
    parts = name.split(".")[:-1]
    return any(hasattr(model.get_submodule(".".join(parts[:i])), "_hf_hook") for i in range(len(parts) + 1))


# no trained weight comes near it; products of such weights overflow fp32 (a scaled or damaged checkpoint)
HUGE_WEIGHT = 1e15


def check_finite_weights(name: str, where, model: nn.Module, *, subfolder: str = "") -> None:
    """``OSError`` naming the first parameter that holds a NaN or an inf after loading, and the weight file it came
    from (a checkpoint of a diverged run, or one damaged and re-saved): every output of such a model is NaN. The
    same for a finite weight beyond :data:`HUGE_WEIGHT`. Parameters on the CPU only (reading the result there is
    no device synchronisation; a model loaded onto an accelerator with ``device_map`` is not checked), one fused
    max-|x| per dtype and one read."""
    params = [(n, p) for n, p in model.named_parameters()
              if p.device.type == "cpu" and p.is_floating_point() and p.numel()]
    if not params:
        return
    largest = torch.stack([m.float() for m in torch._foreach_norm([p.detach() for _, p in params], float("inf"))])
    finite = largest.isfinite()
    if bool(finite.all()):
        if bool((largest > HUGE_WEIGHT).any()):
            index = int(largest.argmax())
            weight = params[index][0]
            file = _weight_file_of(where, weight, model.base_model_prefix, subfolder)
            raise OSError(f"{name}.from_pretrained({str(where)!r}): the weight {weight!r} holds values up to "
                          f"{float(largest[index]):.3g} in {file}, beyond {HUGE_WEIGHT:g}, far past any trained "
                          "weight: the checkpoint is damaged (the outputs would overflow to inf or NaN); load an "
                          "earlier checkpoint")
        return
    bad = [n for (n, _), ok in zip(params, finite.tolist()) if not ok]
    more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" if len(bad) > 1 \
        else ""
    raise OSError(f"{name}.from_pretrained({str(where)!r}): the weight {bad[0]!r}{more} holds NaN or inf values in "
                  f"{_weight_file_of(where, bad[0], model.base_model_prefix, subfolder)}; every output of this "
                  "model would be NaN: load an earlier checkpoint (this one comes from a diverged run or was damaged)")


def _weight_file_of(where, name: str, prefix: str, subfolder: str = "") -> str:
    """The file of a local checkpoint that holds the weight ``name`` (by the shard index when sharded), or a
    description of the checkpoint when that cannot be told."""
    try:
        folder = Path(where) / subfolder
        if folder.is_dir():
            for index in sorted(folder.glob("*.index.json")):
                weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
                stem = name[len(prefix) + 1:] if name.startswith(prefix + ".") else None
                for key in (name, f"{prefix}.{name}", stem):
                    if key in weight_map:
                        return str(folder / weight_map[key])
            files = [f for f in _local_weight_files(folder) if not f.name.endswith(".index.json")]
            if len(files) == 1:
                return str(files[0])
    except (TypeError, OSError, ValueError, AttributeError):
        pass
    return f"the checkpoint {str(where)!r}"


def check_loading_info(name: str, where, info: dict, *, ignore_mismatched_sizes: bool = False) -> None:
    """Raise ``RuntimeError`` listing the weights a checkpoint lacks, has in excess or has in the wrong shape."""
    problems = []
    if info.get("missing_keys"):
        keys = sorted(info["missing_keys"])
        problems.append(f"{len(keys)} weights missing from the checkpoint (they would stay randomly initialised): "
                        f"{keys}")
    if info.get("unexpected_keys"):
        keys = sorted(info["unexpected_keys"])
        problems.append(f"{len(keys)} weights in the checkpoint not used by the model: {keys}")
    if info.get("mismatched_keys") and not ignore_mismatched_sizes:
        problems.append(f"weights of the wrong shape (key, checkpoint, model): {sorted(info['mismatched_keys'])}")
    if info.get("error_msgs"):
        problems.extend(info["error_msgs"])
    if problems:
        raise RuntimeError(f"{name}.from_pretrained({str(where)!r}): the checkpoint does not match the model: "
                           + "; ".join(problems))


def positional_encoding(config, *, head_dim: int) -> PositionalEncoding:
    """The model's positional encoding from ``config``: ``head_dim`` space dims per head get it in attention;
    ``absolute`` kinds act on the token stream, whose ``hidden_size - 1`` space dims they receive as
    ``hidden_space_dim`` (BiPE kinds do both). Other kind-specific options come from the config fields the kind
    names in its ``options``."""
    kind = positional_encoding_class(config.positional)
    options = {name: getattr(config, field) for name, field in kind.options.items() if field is not None}
    if "hidden_space_dim" in kind.options:
        options["hidden_space_dim"] = config.hidden_size - 1
    return build_positional_encoding(config.positional, head_dim=head_dim,
                                     num_heads=config.num_attention_heads,
                                     max_position_embeddings=config.max_position_embeddings,
                                     rope_theta=config.rope_theta, **options)


def check_flags(**flags) -> None:
    """``ValueError`` naming the first forward switch (``use_cache``, ``return_dict``, ``output_hidden_states``,
    ``output_attentions``, ``skip_logits``) that is neither a bool nor None: ``"false"`` or ``1`` would read as
    true (or, for ``output_attentions``, ask for eager attention). Type checks only: free, also while compiling."""
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool (True or False) or None for the config's default, got {value!r}")


def _transformers_kwargs() -> frozenset:
    try:
        from transformers.utils import TransformersKwargs
    except ImportError:  # an older transformers: the names below cover it
        return frozenset()
    return frozenset(TransformersKwargs.__optional_keys__) | frozenset(TransformersKwargs.__required_keys__)


# The keywords a HELM forward takes beyond its named parameters, because transformers passes them to every model:
# TransformersKwargs (Trainer's num_items_in_batch, DataCollatorWithFlattening's packing kwargs cu_seq_lens_* /
# max_length_* / seq_idx, is_causal, output_router_logits), generate's model_kwargs (cache_position for remote code,
# token_type_ids from tokenizers that make them: ignored, as LlamaForCausalLM ignores them) and return_dict. HELM
# reads none of the packing kwargs: packed rows take segment_ids.
FORWARD_KWARGS = _transformers_kwargs() | frozenset({
    "num_items_in_batch", "output_hidden_states", "output_attentions", "output_router_logits", "cu_seq_lens_q",
    "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "is_causal", "seq_idx", "cache_position",
    "return_dict", "token_type_ids", "use_cache"})
# the keywords of transformers' ForCausalLMLoss that a …ForCausalLM passes on to its loss
LOSS_KWARGS = frozenset({"num_items_in_batch", "ignore_index", "shift_labels"})


def check_forward_kwargs(model, kwargs: dict, accepted: frozenset) -> None:
    """``TypeError`` naming the keywords of ``kwargs`` (a forward's ``**kwargs``) that are not in ``accepted``
    (:data:`FORWARD_KWARGS`, plus :data:`LOSS_KWARGS` for a causal LM), with the closest known name: a misspelt
    ``attention_masks=`` would otherwise be ignored without a word. A membership test per keyword (no tensor is
    read), also while compiling."""
    unknown = [key for key in kwargs if key not in accepted]
    if unknown:
        _refuse_kwargs(model, unknown, accepted)


def _refuse_kwargs(model, unknown: list, accepted: frozenset) -> None:
    import inspect

    named = [n for n, p in inspect.signature(type(model).forward).parameters.items()
             if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    known = sorted(set(named) | accepted)
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(f"{type(model).__name__}.forward() got unexpected keyword argument(s) {', '.join(hints)}; it "
                    f"takes {', '.join(named)} and transformers' {', '.join(sorted(accepted - set(named)))}")


def check_logits_to_keep(logits_to_keep) -> None:
    """``ValueError`` naming ``logits_to_keep`` unless it is an int >= 0 (0: every position; ``n``: the last ``n``)
    or a 1-D integer tensor of sequence positions (transformers' two forms). Type checks only."""
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() != 1 or logits_to_keep.dtype.is_floating_point or logits_to_keep.dtype.is_complex \
                or logits_to_keep.dtype == torch.bool:
            raise ValueError(f"logits_to_keep as a tensor must hold 1-D integer sequence positions, got a "
                             f"{logits_to_keep.dim()}-D {logits_to_keep.dtype} tensor")
    elif isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, numbers.Integral) or logits_to_keep < 0:
        raise ValueError("logits_to_keep must be an int >= 0 (0 keeps every position, n the last n) or a 1-D tensor "
                         f"of positions, got {logits_to_keep!r}")


def kept_positions(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The positions of ``hidden_states [B, T, ...]`` the LM head scores (:func:`check_logits_to_keep`); positions
    of a CPU tensor outside ``[-T, T)`` are a ``ValueError`` naming ``logits_to_keep`` (one read, skipped while
    compiling; on an accelerator indexing fails as in ``transformers``)."""
    check_logits_to_keep(logits_to_keep)
    if isinstance(logits_to_keep, torch.Tensor):
        length = hidden_states.shape[1]
        if logits_to_keep.device.type == "cpu" and logits_to_keep.numel() and not torch.compiler.is_compiling() \
                and not bool(((logits_to_keep >= -length) & (logits_to_keep < length)).all()):
            raise ValueError(f"logits_to_keep holds positions outside [-T, T) = [-{length}, {length}) of the "
                             f"{length} tokens of this forward, got values in [{int(logits_to_keep.min())}, "
                             f"{int(logits_to_keep.max())}]")
        return hidden_states[:, logits_to_keep]
    return hidden_states[:, -int(logits_to_keep):] if logits_to_keep else hidden_states


def can_return_tuple(forward):
    """``transformers``' ``can_return_tuple`` (``return_dict=False``, or ``config.return_dict = False``, returns the
    output as a tuple) with ``return_dict`` checked by :func:`check_flags` first: ``transformers`` pops it and
    reads ``"false"`` as true."""
    wrapped = _transformers_can_return_tuple(forward)

    @functools.wraps(wrapped)
    def wrapper(self, *args, **kwargs):
        check_flags(return_dict=kwargs.get("return_dict"))
        return wrapped(self, *args, **kwargs)

    return wrapper


# generate's integer lengths and counts, with their least value (transformers compares them with ints, and a
# string fails deep inside with "'<=' not supported"; prompt-lookup decoding with 0 for either of its sizes says
# "Invalid max_matching_ngram_size or num_output_tokens", naming neither argument)
GENERATION_INTEGERS = {"max_new_tokens": 1, "max_length": 1, "min_new_tokens": 0, "min_length": 0,
                       "num_return_sequences": 1, "num_beams": 1, "prompt_lookup_num_tokens": 1,
                       "max_matching_ngram_size": 1}


def check_generation_lengths(kwargs: dict) -> None:
    """``ValueError`` naming the first of :data:`GENERATION_INTEGERS` that ``generate``'s keywords (or the
    ``generation_config`` they pass) set to something other than None or an int (not a bool) >= its least value."""
    config = kwargs.get("generation_config")
    for name, least in GENERATION_INTEGERS.items():
        for value, where in ((kwargs.get(name), name), (getattr(config, name, None), f"generation_config.{name}")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                      or value < least):
                raise ValueError(f"{where} must be an int >= {least} (or None for the default), got {value!r}")


# generate's switches (transformers reads a truthy string such as "yes" as True), and its numbers with their ranges
GENERATION_BOOLEANS = ("do_sample", "use_cache", "output_scores", "output_logits", "return_dict_in_generate",
                       "output_attentions", "output_hidden_states", "renormalize_logits", "early_stopping")
GENERATION_RANGES = {  # name: (test, what the message says it must be)
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "typical_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "temperature": (lambda v: v > 0 and math.isfinite(v), "a positive finite number"),
    "repetition_penalty": (lambda v: v > 0 and math.isfinite(v), "a positive finite number (1.0: no penalty)"),
    "top_k": (lambda v: v >= 0 and float(v).is_integer(), "an int >= 0"),
}
GENERATION_TOKENS = ("eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id")


def check_generation_arguments(kwargs: dict, vocab_size: Optional[int]) -> None:
    """``ValueError`` naming the first of ``generate``'s keywords (or fields of the ``generation_config`` passed)
    that ``transformers`` would accept although it cannot mean what it says: a switch that is not a bool
    (:data:`GENERATION_BOOLEANS`), a probability, temperature or penalty out of its range
    (:data:`GENERATION_RANGES`), a special token id outside ``[0, vocab_size)`` (an ``eos_token_id`` that can never
    be generated), ``min_new_tokens > max_new_tokens``; and the integer lengths (:func:`check_generation_lengths`)."""
    check_generation_lengths(kwargs)
    config = kwargs.get("generation_config")

    def given(name):
        yield kwargs.get(name), name
        yield getattr(config, name, None), f"generation_config.{name}"

    for name in GENERATION_BOOLEANS:
        for value, where in given(name):
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{where} must be True or False (or None for the default), got {value!r}")
    for name, (ok, what) in GENERATION_RANGES.items():
        for value, where in given(name):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value)):
                raise ValueError(f"{where} must be {what}, got {value!r}")
    for name in GENERATION_TOKENS:
        for value, where in given(name):
            ids = value.tolist() if isinstance(value, torch.Tensor) else value
            for token in ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids]:
                if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0 or (
                        vocab_size is not None and token >= vocab_size):
                    raise ValueError(f"{where} must be a token id in [0, vocab_size={vocab_size}) (or a list of "
                                     f"them), got {value!r}")
    for value, where in given("bad_words_ids"):
        rows = value if isinstance(value, (list, tuple)) else None
        if value is not None and (rows is None or not all(
                isinstance(row, (list, tuple)) and row and all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < (vocab_size or t + 1)
                    for t in row) for row in rows)):
            raise ValueError(f"{where} must be a list of token-id lists, each id in [0, vocab_size={vocab_size}), "
                             f"got {value!r}")
    low, high = kwargs.get("min_new_tokens"), kwargs.get("max_new_tokens")
    if low is not None and high is not None and low > high:
        raise ValueError(f"min_new_tokens={low} is more than max_new_tokens={high}: generate would stop at "
                         f"{high} tokens; lower min_new_tokens or raise max_new_tokens")


# the generate arguments (or generation-config fields) that select assisted decoding
ASSISTED_DECODING = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def _assisted_decoding(model, kwargs: dict) -> Optional[str]:
    """``name=value`` of the argument or generation-config field that makes ``generate(**kwargs)`` assisted
    decoding, or None."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    for name in ASSISTED_DECODING:
        value = kwargs.get(name, getattr(config, name, None))
        if value is not None:
            return f"{name}={type(value).__name__ if isinstance(value, nn.Module) else repr(value)}"
    return None


def _generation_prompt(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The prompt of ``generate(*args, **kwargs)``: ``inputs`` (first positional) or ``input_ids`` when a tensor is
    given, else ``inputs_embeds``; None when none is."""
    inputs = kwargs.get("inputs", args[0] if args else None)
    for prompt in (inputs, kwargs.get("input_ids"), kwargs.get("inputs_embeds")):
        if isinstance(prompt, torch.Tensor):
            return prompt
    return None


def check_generation_mask(attention_mask, prompt: Optional[torch.Tensor]) -> None:
    """``ValueError`` naming ``attention_mask`` unless it is ``[B, T]`` of ``generate``'s prompt (``input_ids [B, T]``
    or ``inputs_embeds [B, T, ...]``): ``generate`` derives the positions from it and extends it by one column per
    new token, so a longer mask was continued silently and a shorter one failed as a ``position_ids`` shape error.
    A shape comparison (no device read)."""
    if attention_mask is None or not isinstance(prompt, torch.Tensor) or prompt.dim() < 2:
        return
    batch, length = prompt.shape[:2]
    check_tensor(attention_mask, "attention_mask", (batch, length), "[B, T]",
                 note=" (one entry per prompt token; generate adds one per new token)")


def _transformers_warns_right_padding(model, kwargs: dict, prompt: torch.Tensor) -> bool:
    """Whether ``transformers``' ``generate`` logs its own right-padding warning for this call: for a batch of more
    than one row of token ids, where a pad token id (or an eos token id standing in for it) is set by the call, its
    ``generation_config`` or the model's."""
    if prompt.dim() != 2 or prompt.shape[0] < 2:
        return False
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    return any(kwargs.get(name) is not None or any(getattr(c, name, None) is not None for c in configs)
               for name in ("pad_token_id", "eos_token_id"))


def warn_right_padding(model, kwargs: dict, prompt: Optional[torch.Tensor]) -> None:
    """A ``UserWarning`` when ``generate``'s 2-D ``attention_mask`` ends in padding (a 0 in its last column of a row
    that holds a 1): a decoder-only model then continues after the pad tokens. Emitted where ``transformers``' own
    warning is not (:func:`_transformers_warns_right_padding`: it covers batched token ids with a pad token only), so
    each such call warns once. One device read per ``generate`` call, none per token."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not mask.numel() or prompt is None \
            or getattr(model.config, "is_encoder_decoder", False) \
            or _transformers_warns_right_padding(model, kwargs, prompt):
        return
    if bool(((mask[:, -1] == 0) & (mask != 0).any(-1)).any()):
        warnings.warn("generate: right padding was detected (attention_mask ends in 0 in some row), and a decoder-only "
                      "model continues after the padding; pad prompts on the left (tokenizer.padding_side = \"left\")",
                      UserWarning, stacklevel=3)


class HelmGenerationMixin(GenerationMixin):
    """``transformers``' ``GenerationMixin`` with ``generate``'s arguments checked before ``transformers`` reads
    them (:func:`check_generation_arguments`), and the cache: ``past_key_values`` (or ``cache``) must be a
    ``transformers`` ``Cache`` or None; ``transformers`` would fail on a string with an ``AttributeError`` from
    inside ``generate``. A cache must hold fewer tokens than the prompt (``input_ids`` or ``inputs_embeds``) and,
    where the ids it was written from are known (:meth:`CacheOrigin.record`: CPU ids) and the prompt is on the CPU,
    the prompt must begin with those ids, or with their embeddings (:meth:`_other_prompt_problem`). Assisted decoding
    (``prompt_lookup_num_tokens``, ``assistant_model``, ...) takes an empty cache only: ``transformers`` 5 feeds it
    the whole prompt again after the cached tokens (:func:`_assisted_decoding`). ``attention_mask`` must be
    ``[B, T]`` of the prompt (:func:`check_generation_mask`); a right-padded one is a ``UserWarning``
    (:func:`warn_right_padding`)."""

    def generate(self, *args, **kwargs):
        check_generation_arguments(kwargs, getattr(self.config, "vocab_size", None))
        prompt = _generation_prompt(args, kwargs)
        check_generation_mask(kwargs.get("attention_mask"), prompt)
        warn_right_padding(self, kwargs, prompt)
        for name in ("past_key_values", "cache"):
            value = kwargs.get(name)
            if value is not None and not isinstance(value, Cache):
                raise ValueError(f"{name} must be a transformers Cache (DynamicCache, StaticCache, e.g. the one a "
                                 f"previous call returned) or None for a new DynamicCache, got "
                                 f"{type(value).__name__}")
            if isinstance(value, Cache) and isinstance(prompt, torch.Tensor) and prompt.dim() in (2, 3):
                what = "input_ids" if prompt.dim() == 2 else "inputs_embeds"
                cached = int(value.get_seq_length())  # once per generate call, not per step
                assisted = _assisted_decoding(self, kwargs)
                if cached and assisted:
                    raise ValueError(f"{name} already holds {cached} tokens, and {assisted} asks for assisted "
                                     "decoding, which in transformers feeds the whole of input_ids again after the "
                                     "cached tokens (the cache would hold the prompt twice and the continuation be "
                                     "wrong; Llama's too): pass no cache (or a new one) for assisted decoding")
                if cached >= prompt.shape[1]:
                    raise ValueError(f"{name} already holds {cached} tokens but {what} has {prompt.shape[1]}: "
                                     f"generate continues a cache from {what} = the cached tokens plus at least "
                                     "one new one; pass the full sequence, or a new cache")
                origin = getattr(value, CacheOrigin.attribute, None)
                tokens = None if origin is None else origin.tokens
                if cached and tokens is not None and tokens.shape == (prompt.shape[0], cached) \
                        and prompt.device.type == "cpu":
                    if (problem := self._other_prompt_problem(tokens, prompt[:, :cached])) is not None:
                        raise ValueError(f"{name} holds the keys of other tokens than {what} begins with: of its "
                                         f"{cached} cached tokens, {problem}; pass the cache returned for this "
                                         "prompt, or a new cache")
        return super().generate(*args, **kwargs)

    def _other_prompt_problem(self, tokens: torch.Tensor, start: torch.Tensor) -> Optional[str]:
        """Where ``start`` (the first ``t`` of ``generate``'s prompt on the CPU: ids ``[B, t]`` or embeddings
        ``[B, t, 1+n]``) is not the ``tokens [B, t]`` a cache was filled from, as "token j of row i was ..., ... has
        ... there"; None where it is. Embeddings are compared with this model's embedding of ``tokens`` (space
        parts only: the model recomputes the time coordinate, :func:`lift_inputs_embeds`) in the embeddings'
        dtype, to a tolerance of ``sqrt(eps)`` of that dtype (a prompt embedded by the same weights matches to
        rounding); not where the embedding weights are off the CPU (the comparison would read the device)."""
        if start.dim() == 2:
            if torch.equal(tokens, start.long()):
                return None
            row, column = (tokens != start.long()).nonzero()[0].tolist()
            return (f"token {column} of row {row} was {int(tokens[row, column])}, input_ids has "
                    f"{int(start[row, column])} there")
        embedding = self.get_input_embeddings()
        weight = getattr(embedding, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or not start.is_floating_point():
            return None
        with torch.no_grad():
            expected = embedding(tokens)[..., 1:]
        given = start[..., 1:].detach().to(expected.dtype)
        tolerance = torch.finfo(expected.dtype).eps ** 0.5
        close = torch.isclose(given, expected, rtol=tolerance, atol=tolerance).all(-1)
        if bool(close.all()):
            return None
        row, column = (~close).nonzero()[0].tolist()
        return (f"token {column} of row {row} was {int(tokens[row, column])}, whose embedding inputs_embeds does not "
                "hold there")


# transformers 5.24 renamed the cache argument and output field ``past_key_values`` to ``cache`` (generate passes
# ``cache=``; output classes rename ``past_key_values=`` with a deprecation warning); earlier 5.x use the old name
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def resolve_cache(past_key_values, cache):
    """The cache of a forward called as ``forward(past_key_values=...)`` (transformers < 5.24, users' code) or
    ``forward(cache=...)`` (``generate`` from transformers 5.24 on); passing both is a ``ValueError``."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("pass the cache as either cache= or past_key_values=, not both")
    return past_key_values if cache is None else cache


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

    def known_past_len(self, config) -> Optional[int]:
        """``past_len`` as an int when that needs no device read (or, with ``config.validate_inputs`` and outside
        ``torch.compile``, one read); else None."""
        if not isinstance(self.past_len, torch.Tensor):
            return self.past_len
        if config.validate_inputs and not torch.compiler.is_compiling():
            return int(self.past_len)
        return None


def cache_layout(past_key_values, seq_len: int) -> CacheLayout:
    """The :class:`CacheLayout` of ``seq_len`` new tokens on ``past_key_values`` (a ``transformers`` cache or None),
    read as ``LlamaModel`` reads it: ``get_seq_length()`` (a tensor for static caches) and ``get_mask_sizes``."""
    if past_key_values is None:
        return CacheLayout(0, seq_len, None)
    if not isinstance(past_key_values, Cache):
        legacy = " (tuples of (key, value) tensors are transformers' legacy format, not accepted)" \
            if isinstance(past_key_values, (tuple, list)) else ""
        raise ValueError("past_key_values (cache=) must be a transformers Cache, e.g. DynamicCache(config=config) or "
                         f"the one a previous forward returned, got {type(past_key_values).__name__}{legacy}")
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


def cache_batch_size(cache) -> Optional[int]:
    """The number of sequences ``cache`` holds (a shape, free to read), or None while no layer has been written."""
    for layer in getattr(cache, "layers", ()):
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.dim() and keys.numel():
            return keys.shape[0]
    return None


def _written_keys(layer) -> Optional[torch.Tensor]:
    """The keys ``[B, h, T, W]`` a cache layer holds, or None while it holds none (a shape read)."""
    keys = getattr(layer, "keys", None)
    return keys if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.numel() else None


def _key_shapes(config) -> tuple[str, Callable[[object, torch.Tensor], bool]]:
    """What this model's attention layers write as cache keys: a description, and a test of a layer's written keys.

    ``LorentzSelfAttention`` (HELM-D, MiCE with ``attention_type="mha"``) writes per-head Lorentz keys ``[B, H, T,
    head_dim]``. HMLA writes latents ``[B, 1, T, kv_lora_rank]``, followed by ``3H`` scalars for absorbed decoding (in
    ``m`` columns each when stored bit for bit in a narrower cache dtype, ``m`` = 2 or 4), or, in a static layer
    allocated before its first write (``StaticCache.early_initialization``), packed into the ``[B, h, T, D]`` that
    layer was given from the config (``transformers``' ``get_head_shapes``)."""
    heads = config.num_attention_heads
    if getattr(config, "attention_type", "mha") != "hmla":
        width = config.head_dim
        return f"[B, {heads}, T, {width}]", lambda layer, keys: keys.shape[1] == heads and keys.shape[-1] == width
    latent = config.kv_lora_rank
    allocated = (getattr(config, "num_key_value_heads", None) or heads,
                 getattr(config, "head_dim", None) or config.hidden_size // heads)
    widths = {latent} | {latent + 3 * heads * m for m in (1, 2, 4)}

    def matches(layer, keys: torch.Tensor) -> bool:
        return (keys.shape[1] == 1 and keys.shape[-1] in widths) or \
            (isinstance(layer, StaticLayer) and (keys.shape[1], keys.shape[-1]) == allocated)

    return f"[B, 1, T, {latent}] (latents, optionally followed by {3 * heads} scalars)", matches


def check_cache_layers(config, cache) -> None:
    """``ValueError`` naming ``past_key_values`` when a cache that holds tokens was not written by a model of this
    architecture: fewer layers than ``config.num_hidden_layers`` (a static cache's, even empty), tokens in layers this
    model does not have, or keys
    of another shape than this model's layers write (:func:`_key_shapes`; e.g. a HELM-D cache fed to HELM-MiCE).
    Shape reads only; in the usual case (layer 0 written, no extra layers) three attribute reads."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return
    n = config.num_hidden_layers
    if layers and len(layers) < n and all(isinstance(layer, StaticLayer) for layer in layers):
        # a static cache's layers are allocated up front (a dynamic one grows): too few, even empty, is another
        # model's (the forward would index past them)
        raise ValueError(f"past_key_values (cache=) is a {type(cache).__name__} of {len(layers)} layer(s), this model "
                         f"has num_hidden_layers={n}; allocate it from this model's config "
                         f"({type(cache).__name__}(config=model.config, ...))")
    first = next(((i, keys) for i, keys in enumerate(map(_written_keys, layers)) if keys is not None), None)
    if first is None:
        return
    extra = [i for i in range(n, len(layers)) if _written_keys(layers[i]) is not None]
    if len(layers) < n or extra:
        written = 1 + max(i for i, layer in enumerate(layers) if _written_keys(layer) is not None)
        found = (f"{len(layers)} layer(s)" if len(layers) < n else
                 f"{written} layers (tokens up to layer index {written - 1})")
        raise ValueError(f"past_key_values (cache=) was written by a model with another number of layers: it has "
                         f"{found}, this model has num_hidden_layers={n}; pass the cache this model returned (or a "
                         "new DynamicCache)")
    index, keys = first
    expected, matches = _key_shapes(config)
    if not matches(layers[index], keys):
        raise ValueError(f"past_key_values (cache=) was written by another architecture: its layer {index} holds keys "
                         f"of shape [B, {keys.shape[1]}, T, {keys.shape[-1]}] (width {keys.shape[-1]}), this model's "
                         f"layers write {expected}; pass the cache this model returned (or a new DynamicCache)")


class HelmDynamicCache(DynamicCache):
    """The ``DynamicCache`` a HELM forward makes when it is asked to cache and given no cache: ``transformers``'
    ``DynamicCache``, whose :meth:`update` also refuses keys of another shape than the layer holds. A HELM forward
    checks a cache before its layers write to it (:func:`check_cache_layers`, :func:`check_cache_origin`); this
    catches the other direction, a HELM cache handed to a model that does not check it (``LlamaForCausalLM``),
    which would otherwise fail inside ``torch.cat``. One shape comparison per layer and call. A model writing keys
    of exactly this shape is not detected: ``update`` receives tensors and a layer index, nothing naming the
    caller."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        held = _written_keys(self.layers[layer_idx]) if layer_idx < len(self.layers) else None
        if held is not None and (key_states.dim() != 4 or key_states.shape[0] != held.shape[0]
                                 or key_states.shape[1] != held.shape[1] or key_states.shape[-1] != held.shape[-1]):
            origin = getattr(self, CacheOrigin.attribute, None)
            by = f"a {origin.signature['model_type']} model" if origin is not None else "a HELM model"
            raise ValueError(f"past_key_values (cache=) is a HELM cache written by {by} (layer {layer_idx} holds keys "
                             f"[B, {held.shape[1]}, T, {held.shape[-1]}] of hyperbolic points), and a model writing "
                             f"keys of shape {tuple(key_states.shape)} is extending it; a cache is only valid for the "
                             "model that filled it: pass a new DynamicCache (or none) to this model")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def __deepcopy__(self, memo):
        """A deep copy, as ``copy.deepcopy`` makes of any object. A cache filled with gradients enabled holds
        tensors of an autograd graph, which torch refuses to deepcopy ("Only Tensors created explicitly by the user
        (graph leaves) support the deepcopy protocol"): that ``RuntimeError`` is re-raised with what to do, chained
        from torch's."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        try:
            for name, value in vars(self).items():
                setattr(copied, name, copy.deepcopy(value, memo))
        except RuntimeError as error:
            if "graph leaves" not in str(error):
                raise
            raise RuntimeError("copy.deepcopy(cache): the cache holds keys and values that are part of an autograd "
                               "graph (it was filled with gradients enabled), which torch cannot deepcopy; fill it "
                               "under torch.no_grad() (as generate does), or detach its tensors first (layer.keys = "
                               "layer.keys.detach(), layer.values = layer.values.detach() for each of cache.layers)") \
                from error
        return copied


class CacheOrigin:
    """What a HELM forward records on a cache the first time it sees it (as the attribute ``helm_origin``): the
    :func:`cache_signature` of its model, the ``weights_id`` of the model that fills it (``owner``; None: unknown),
    and how many leading tokens have been checked for finite values."""

    attribute = "helm_origin"

    def __init__(self, signature: dict, owner: Optional[str] = None):
        self.signature, self.owner, self.checked = signature, owner, 0
        # the token ids the cached tokens were written from, as [B, t] chunks on the CPU (one per forward: a decode
        # step appends, it does not copy), or None where unknown (inputs embeddings, ids on an accelerator, a cache
        # filled elsewhere): generate compares its prompt with them (tokens)
        self._chunks: Optional[list[torch.Tensor]] = []
        self._length = 0

    @property
    def tokens(self) -> Optional[torch.Tensor]:
        """The ids of the cached tokens, ``[B, past]`` (``[1, 0]`` while none), or None where unknown."""
        if self._chunks is None:
            return None
        if len(self._chunks) != 1:
            self._chunks = [torch.cat(self._chunks, 1) if self._chunks else torch.zeros(1, 0, dtype=torch.long)]
        return self._chunks[0]

    def record(self, input_ids: Optional[torch.Tensor], past_len: Optional[int]) -> None:
        """Note the ids a forward is about to cache after ``past_len`` tokens (a prefix kept when a cache was
        cropped, e.g. by assisted decoding); unknown from the first forward that gives no CPU ids."""
        chunks = self._chunks
        if chunks is None or past_len is None or input_ids is None or input_ids.device.type != "cpu" \
                or self._length < past_len or past_len and chunks[0].shape[0] != input_ids.shape[0]:
            self._chunks = None
            return
        if past_len < self._length:
            chunks = self._chunks = [self.tokens[:, :past_len]]
        if not past_len:
            chunks.clear()
        chunks.append(input_ids.long())
        self._length = past_len + input_ids.shape[1]


def cache_signature(config) -> dict:
    """The config fields that give a cache's keys their meaning beyond their shapes (which
    :func:`check_cache_layers` compares): the family, the curvature of the hyperboloid the points lie on, and the
    positional encoding with the options that shape the keys (rotary angles are applied before caching; absolute
    encodings are in the token stream)."""
    kind = positional_encoding_class(config.positional)
    signature = {"model_type": config.model_type, "curvature": config.curvature, "positional": config.positional}
    if kind.rotary:
        signature["rope_theta"] = config.rope_theta
    for field in kind.options.values():
        if field not in (None, "initializer_range"):  # the initial scale of a table, not what its rows mean
            signature[field] = getattr(config, field)
    return signature


def check_cache_origin(config, cache, dtype: Optional[torch.dtype], past_len: Optional[int],
                       owner: Optional[str] = None) -> None:
    """``ValueError`` naming ``past_key_values`` when a cache holding tokens does not fit this model beyond its
    shapes:

    * written by a model of another :func:`cache_signature` (curvature, positional encoding, family): recorded on
      the cache (:class:`CacheOrigin`) the first time a HELM forward sees it, compared on every later forward;
    * keys of fp64 in a model that is not fp64, or the other way round (``dtype``: the model's weights): points and
      caches are fp64 exactly in fp64 models (:mod:`helm.precision`); ``torch.cat`` would silently promote;
    * non-finite keys or values (NaN or inf), checked only for CPU tensors, where reading the result is no
      device-host synchronisation, with ``config.validate_inputs``, and each cached token once: the tokens up to
      ``past_len`` not checked by an earlier forward (a decode step checks the one token the previous step wrote).
      Caches on an accelerator are not value-checked (that would be a synchronisation per step), nor are
      half-precision ones (HMLA may store fp32 scalars bit for bit in their columns), nor tokens changed in place
      after they were checked.

    Attribute, dtype and shape reads otherwise; nothing runs while compiling (``torch.compile`` traces the forward
    without these Python-side records)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or torch.compiler.is_compiling():
        return
    written = next((keys for keys in map(_written_keys, layers) if keys is not None), None)
    signature = cache_signature(config)
    origin = getattr(cache, CacheOrigin.attribute, None)
    if written is None or origin is None or past_len == 0:
        # a new (or reset static) cache, or one filled by hand: from now on it belongs to this model
        setattr(cache, CacheOrigin.attribute, CacheOrigin(signature, owner))
        if written is None:
            return
    elif origin.signature != signature:
        # another encoding: its name says it (the options of the two kinds are not comparable)
        differs = [name for name in ("model_type", "curvature", "positional")
                   if origin.signature.get(name) != signature[name]]
        if origin.signature["positional"] == signature["positional"]:
            differs += [name for name in signature
                        if name not in differs and origin.signature.get(name) != signature[name]]
        theirs = ", ".join(f"{name}={origin.signature.get(name)!r}" for name in differs)
        ours = ", ".join(f"{name}={signature[name]!r}" for name in differs)
        raise ValueError(f"past_key_values (cache=) was written by a model with {theirs}; this model has {ours}: its "
                         "cached keys are points of another hyperboloid or carry another positional encoding; pass "
                         "the cache this model returned (or a new DynamicCache)")
    if dtype is not None and (written.dtype == torch.float64) != (dtype == torch.float64):
        raise ValueError(f"past_key_values (cache=) holds {written.dtype} keys but this model runs in {dtype}: it "
                         "was written by a model of another precision (fp64 caches belong to fp64 models only); pass "
                         "the cache this model returned (or a new DynamicCache), or cast the model to the cache's "
                         "dtype")
    origin = getattr(cache, CacheOrigin.attribute)
    if owner is not None and origin.owner is not None and origin.owner != owner:
        warnings.warn("past_key_values (cache=) was filled by another model (the same architecture, curvature and "
                      "encoding, but another instance, not loaded from the same checkpoint files): its keys and values "
                      "are that model's, so unless the two have the same weights this continuation is wrong; pass "
                      "the cache this model returned (or a new DynamicCache). A copy.deepcopy of a model, or a second "
                      "load of the same checkpoint, counts as the same model", UserWarning, stacklevel=4)
    origin.owner = owner if owner is not None else origin.owner
    # an offloading cache copies layers to and from the host asynchronously: reading them here could race the copy
    if past_len is None or not config.validate_inputs or written.device.type != "cpu" or \
            getattr(cache, "offloading", False):
        return
    start = min(origin.checked, past_len)
    if start == past_len:
        return
    unchecked = [(index, name, t[:, :, start:past_len]) for index, layer in enumerate(layers)
                 for name, t in (("keys", getattr(layer, "keys", None)), ("values", getattr(layer, "values", None)))
                 if isinstance(t, torch.Tensor) and t.dim() == 4 and t.device.type == "cpu"
                 and t.dtype.is_floating_point and t.dtype.itemsize >= 4]
    # one fused max-|x| over all layers (NaN propagates), instead of one isfinite per tensor: a decode step's cost
    largest = torch._foreach_norm([t for *_, t in unchecked], float("inf")) if unchecked else []
    if largest and not bool(torch.stack(largest).isfinite().all()):
        index, name = next((index, name) for (index, name, _), m in zip(unchecked, largest) if not m.isfinite())
        raise ValueError(f"past_key_values (cache=) holds non-finite (NaN or inf) {name} in layer {index} among "
                         f"tokens {start}..{past_len - 1}; a cache of NaN points makes every later output NaN: pass "
                         "a new DynamicCache (and check the model that filled it)")
    origin.checked = past_len


def check_inputs(config, input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor], past_key_values,
                 attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                 segment_ids: Optional[torch.Tensor], *,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None,
                 cache_position: Optional[torch.Tensor] = None,
                 owner: Optional[str] = None) -> tuple[int, int, CacheLayout]:
    """Check a forward's inputs and return ``(B, T, layout)`` (:func:`cache_layout` of ``past_key_values``).

    Exactly one of ``input_ids [B, T]`` (integers in ``[0, vocab_size)``) and ``inputs_embeds [B, T, 1+n]``
    (floating point; points, time coordinate first), with ``B, T >= 1``; ``attention_mask [B, T_past+T]`` (with a
    static cache also ``[B, max_cache_len]``), or a 4-D mask ``[B|1, 1, T, T_kv]`` as ``transformers`` passes it
    (``T_kv = T_past+T``, or ``max_cache_len`` for a static cache; used as given, bool or additive float);
    ``segment_ids`` like a 2-D mask (integers); ``position_ids [B, T]`` or ``[1, T]`` (integers, broadcast over the
    batch as in ``transformers``); lengths the positional encoding can reach; a cache holding tokens written by a
    model of this architecture (:func:`check_cache_layers`: number of layers, key widths), of this curvature,
    positional encoding and precision, with finite values on the CPU (:func:`check_cache_origin`; ``dtype``: the
    model's weights; a cache filled by another model, ``owner`` being the ``weights_id`` of this one, is a warning)
    and, for a static cache, room for the new tokens (``past + T <= max_cache_len``);
    ``cache_position``, which ``generate`` passes and HELM does not read (the positions come from the cache), an
    integer tensor ``[T]`` or ``[B, T]`` when given: one of another length says the caller's view of where the tokens
    sit is not the cache's. Inputs on the meta device (no values) while the model's weights (on ``device``) are not,
    and the reverse, are refused (:func:`check_not_meta`). Each error is a ``ValueError`` naming the argument and the
    expected shape.

    Shapes and dtypes are free to check. The vocabulary check reads one boolean back from the device per forward
    (skipped while compiling); ``config.validate_inputs = False`` turns it off. With a static cache the exact
    length of a 2-D mask and the room left in it are checked against the cache's length, one more read (also skipped
    while compiling).
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    check_not_meta(device, input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                   position_ids=position_ids, segment_ids=segment_ids)
    if input_ids is not None:
        check_tensor(input_ids, "input_ids", (None, None), "[B, T]", dtype="index", nonempty=True)
        check_token_ids(config, input_ids, "input_ids",
                        hint=" (is the tokenizer's vocabulary larger than the model's?)")
        batch, seq_len = input_ids.shape
    else:
        check_tensor(inputs_embeds, "inputs_embeds", (None, None, config.hidden_size), "[B, T, hidden_size]",
                     dtype="floating", nonempty=True, note=" points (time coordinate first)")
        batch, seq_len = inputs_embeds.shape[:2]
    if cache_position is not None and (not isinstance(cache_position, torch.Tensor) or cache_position.dim() not in (1, 2)
                                       or cache_position.is_floating_point() or cache_position.shape[-1] != seq_len):
        got = (f"{cache_position.dtype} {tuple(cache_position.shape)}" if isinstance(cache_position, torch.Tensor)
               else type(cache_position).__name__)
        raise ValueError(f"cache_position must be an integer tensor [T] = [{seq_len}] (one entry per new token), "
                         f"got {got}")
    layout = cache_layout(past_key_values, seq_len)
    cached_batch = cache_batch_size(past_key_values)
    if cached_batch not in (None, batch):
        raise ValueError(f"past_key_values (cache=) holds {cached_batch} sequences but the inputs have batch size "
                         f"{batch}; pass the cache returned for these same sequences (or a new DynamicCache)")
    check_cache_layers(config, past_key_values)
    past = layout.known_past_len(config)
    check_cache_origin(config, past_key_values, dtype, past, owner)
    if (origin := getattr(past_key_values, CacheOrigin.attribute, None)) is not None \
            and not torch.compiler.is_compiling():
        origin.record(input_ids, past)
    if layout.q_offset is not None and past is not None and past + seq_len > layout.kv_len:
        raise ValueError(f"past_key_values (cache=) is a {type(past_key_values).__name__} of max_cache_len="
                         f"{layout.kv_len} holding {past} tokens: {seq_len} more do not fit ({past + seq_len} > "
                         f"max_cache_len); allocate it with max_cache_len >= the prompt plus max_new_tokens")
    # a 2-D mask covers the tokens so far (past + T); a static cache also takes one over all its slots
    total = None if past is None else past + seq_len
    static = None if layout.q_offset is None else (batch, layout.kv_len)
    if attention_mask is not None:
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            check_tensor(attention_mask, "attention_mask", (batch, 1, seq_len, layout.kv_len), "[B, 1, T, T_kv]",
                         alternative=(1, 1, seq_len, layout.kv_len), note=" (a 4-D mask)")
        else:
            check_tensor(attention_mask, "attention_mask", (batch, total), "[B, T_past+T]", alternative=static)
            check_mask_values(config, attention_mask)
    if segment_ids is not None:
        check_tensor(segment_ids, "segment_ids", (batch, total), "[B, T_past+T]", dtype="integer", alternative=static)
    for name, t in (("attention_mask", attention_mask), ("segment_ids", segment_ids)):
        if t is not None and t.dim() == 2 and not seq_len <= t.shape[-1] <= layout.kv_len:
            raise ValueError(f"{name} must be [B, T_past+T] with T <= T_past+T <= {layout.kv_len} (the cache's "
                             f"length), got {tuple(t.shape)}")
    if position_ids is not None:
        check_tensor(position_ids, "position_ids", (batch, seq_len), "[B, T]", alternative=(1, seq_len),
                     dtype="integer")
    if config.positional == "learned" and past is not None and past + seq_len > config.max_position_embeddings:
        raise ValueError(f"sequence length {past + seq_len} exceeds max_position_embeddings="
                         f"{config.max_position_embeddings}, and the 'learned' positional encoding cannot extend "
                         "beyond its table; use a relative encoding (e.g. positional='hope') for longer inputs")
    return batch, seq_len, layout


def weights_device(module: nn.Module) -> Optional[torch.device]:
    """The device of ``module.weight`` for :func:`check_inputs`, or None when accelerate offloads it (its hook loads
    the weight at call time: until then it is on the meta device)."""
    return None if hasattr(module, "_hf_hook") else module.weight.device


def check_not_meta(device: Optional[torch.device], **inputs) -> None:
    """``ValueError`` when some of ``inputs`` (tensors or None) are on the meta device, which holds shapes but no
    values, and the model's weights (on ``device``) are not, naming the first; or when the weights are on the meta
    device and an input is not (a model built under ``init_empty_weights`` or on ``device="meta"`` and never
    loaded; ``device`` None: not known, as for offloaded weights). Inputs and weights all on the meta device are
    allowed (shape inference)."""
    given = {name: t for name, t in inputs.items() if isinstance(t, torch.Tensor)}
    meta = [name for name, t in given.items() if t.device.type == "meta"]
    if device is not None and device.type == "meta":
        if len(meta) < len(given):
            raise ValueError("the model's weights are on the meta device (shapes without values: built with "
                             "device='meta' or init_empty_weights and never loaded); load them with from_pretrained, "
                             "or call model.to_empty(device=...) and initialise them")
    elif meta:
        where = f" (model.device is {device})" if device is not None else ""
        raise ValueError(f"{meta[0]} is on the meta device, which holds shapes but no values; create it on the "
                         f"model's device{where}")


def check_mask_values(config, attention_mask: torch.Tensor) -> None:
    """``ValueError`` naming ``attention_mask`` unless a 2-D mask holds only 1 (attend) and 0 (padding), or is a
    bool tensor: a mask of 2s or 0.5s, or an additive one (0 / -inf, which would be read backwards: -inf as a token,
    0 as padding), is refused instead of being read as a boolean. The dtype is checked always (bool, integer or
    floating); the values with ``config.validate_inputs`` for CPU tensors outside ``torch.compile`` (one read, no
    device synchronisation). A 2-D mask on an accelerator is not value-checked. 4-D masks (transformers' bool or
    additive form) are used as given and not checked here."""
    if attention_mask.dtype.is_complex:
        raise ValueError(f"attention_mask must be a bool or 0/1 integer or floating tensor, got {attention_mask.dtype}")
    if attention_mask.dtype == torch.bool or not config.validate_inputs or attention_mask.device.type != "cpu" \
            or torch.compiler.is_compiling():
        return
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bool(bad.any()):
        values = attention_mask[bad]
        shown = ", ".join(str(v) for v in values.unique()[:4].tolist())
        additive = " An additive mask (0 = attend, -inf = masked) reads backwards as a 2-D mask: pass " \
            "(mask == 0).long(), or the 4-D form [B, 1, T, T_kv], which is used as given." \
            if bool((values < 0).any()) else ""
        raise ValueError(f"attention_mask must hold only 1 (attend) and 0 (padding), or be a bool tensor; got values "
                         f"{shown}.{additive}")


def check_token_ids(config, ids: torch.Tensor, name: str, *, ignore_index: Optional[int] = None,
                    hint: str = "") -> None:
    """``ValueError`` naming ``name`` unless every id (other than ``ignore_index``) lies in ``[0, vocab_size)``.
    With ``config.validate_inputs``: one device read, skipped while compiling."""
    if not config.validate_inputs or torch.compiler.is_compiling() or ids.device.type == "meta":
        return
    vocab = config.vocab_size
    outside = (ids < 0) | (ids >= vocab)
    if ignore_index is not None:
        outside &= ids != ignore_index
    if bool(outside.any()):
        bad = ids[outside]
        also = "" if ignore_index is None else f" or equal ignore_index={ignore_index}"
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab}){also}; got values in "
                         f"[{int(bad.min())}, {int(bad.max())}]{hint}")


class AttentionWeights:
    """``output_attentions`` of a forward, as ``LlamaModel`` returns them with ``attn_implementation="eager"``: one
    ``[B, H, T, T_kv]`` tensor of softmax weights per layer (statistics dtype). ``with AttentionWeights(model,
    output_attentions) as record:`` around the decoder layers; ``record.weights`` is then the tuple, or None when
    not requested.

    Only the eager implementation forms the weights (:class:`helm.ops.attention.record_attention_weights`); with
    another one (sdpa, triton, auto) the request is a ``ValueError`` naming eager. Absorbed HMLA decoding attends in
    the latent space without them, so a forward that returns weights attends on the plain path (the same outputs to
    fp32 rounding; ``absorb_max_query = 0`` meanwhile), while the cache keeps its absorbed layout: a cache written
    with the per-token scalars must be extended with them (a plain-width write would not fit it)."""

    def __init__(self, model, output_attentions: Optional[bool]):
        config = model.config
        self.wanted = bool(config.output_attentions if output_attentions is None else output_attentions)
        if self.wanted and config.attn_impl != "eager":
            raise ValueError(f"output_attentions=True needs the eager attention (attn_impl={config.attn_impl!r} never "
                             "forms the [B, H, T, T] weights): load with attn_implementation='eager' or call "
                             "model.set_attn_implementation('eager')")
        self.model, self.weights, self._record, self._absorbing = model, None, None, []

    def __enter__(self):
        if self.wanted:
            from ..ops.attention import record_attention_weights

            self._absorbing = [(m, m.absorb_max_query) for m in self.model.modules()
                               if getattr(m, "absorb", False) is True and hasattr(m, "absorb_max_query")]
            for m, _ in self._absorbing:
                m.absorb_max_query = 0
            self._record = record_attention_weights().__enter__()
        return self

    def __exit__(self, *exc):
        if self.wanted:
            self._record.__exit__(*exc)
            for m, most in self._absorbing:
                m.absorb_max_query = most
            self.weights = tuple(self._record.weights)
            layers = self.model.config.num_hidden_layers
            if exc[0] is None and len(self.weights) != layers:
                raise RuntimeError(f"output_attentions: {len(self.weights)} attention calls recorded for {layers} "
                                   "layers")


def lift_inputs_embeds(config, inputs_embeds: torch.Tensor) -> torch.Tensor:
    """``inputs_embeds [B, T, 1+n]`` as points: the space part is read and the time coordinate recomputed.

    With ``config.validate_inputs`` (one device read, skipped while compiling) a non-finite time coordinate is
    a ``ValueError``: NaN or inf in the input, or space coordinates so large (``|x_s| >~ 1.8e19``) that their
    squared norm overflows fp32. Either would make every later layer and the logits non-finite.
    """
    points = lift(inputs_embeds[..., 1:], k=config.k)
    if config.validate_inputs and not torch.compiler.is_compiling() and not bool(torch.isfinite(points[..., 0]).all()):
        bad = "NaN or inf" if not bool(torch.isfinite(inputs_embeds[..., 1:]).all()) else \
            "space parts whose squared norm overflows fp32 (|x_s| >~ 1.8e19)"
        raise ValueError(f"inputs_embeds must be finite points; got {bad}")
    return points


def default_position_ids(attention_mask: Optional[torch.Tensor], layout: CacheLayout, seq_len: int,
                         batch: int, device) -> torch.Tensor:
    """``[B, T]`` positions: from a 2-D padding mask (left padding starts real tokens at 0) or a plain range
    ``past_len + (0 .. T-1)`` (also for a 4-D mask, as in ``LlamaModel``).

    ``attention_mask`` is read as a boolean (nonzero = real token), like :class:`helm.ops.AttentionMask`
    (:func:`check_mask_values` refuses other values than 0 and 1 where it can read them)."""
    steps = torch.arange(seq_len, device=device)
    if attention_mask is not None and attention_mask.dim() == 2:
        # the mask is boolean (nonzero = keep), as in the attention itself
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


def causal_lm_loss(model, logits: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """``model.loss_function`` (transformers' ``ForCausalLMLoss``: labels shifted inside, ``-100`` ignored),
    normalised by the number of labelled tokens, at least 1.

    ``labels`` must be integers of the logits' ``[B, T]``. Without ``num_items_in_batch`` transformers takes the
    mean over the labelled tokens, which is ``0/0 = NaN`` when every label is ``-100`` (``LlamaForCausalLM``
    returns NaN there) and turns the step's gradients into NaN. Here the count is passed as
    ``num_items_in_batch = max(#labelled, 1)``, computed on the device (no synchronisation): the same loss as the
    mean whenever a token is labelled, 0 with zero gradients when none is, and exactly transformers' value when
    the caller passes ``num_items_in_batch`` itself (gradient accumulation).
    """
    kwargs = _checked_loss_kwargs(model, tuple(logits.shape[:2]), labels, kwargs)
    return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **kwargs)


def _checked_loss_kwargs(model, shape: tuple, labels: torch.Tensor, kwargs: dict) -> dict:
    """Check ``labels`` against ``[B, T] = shape`` and the vocabulary; set ``num_items_in_batch`` (see
    :func:`causal_lm_loss`)."""
    check_tensor(labels, "labels", shape, "[B, T]", dtype="long")
    check_not_meta(weights_device(model.get_input_embeddings()), labels=labels)
    ignore = kwargs.get("ignore_index", -100)
    check_token_ids(model.config, labels, "labels", ignore_index=ignore)
    if kwargs.get("num_items_in_batch") is None:
        shifted = kwargs.get("shift_labels")
        shifted = labels[..., 1:] if shifted is None else shifted
        kwargs = {**kwargs, "num_items_in_batch": (shifted != ignore).sum().clamp_min(1)}
    return kwargs


def fused_causal_lm_loss(model, hidden_states: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
    """:func:`causal_lm_loss` of ``model.lm_head(hidden_states)`` without the ``[B, T, V]`` logits: the LM head's
    fused, chunked cross-entropy (:func:`helm.ops.linear_cross_entropy`), same shift (``labels[:, 1:]`` or the
    caller's ``shift_labels``), ``ignore_index``, ``num_items_in_batch`` and normalisation, same loss and
    gradients. The loss is fp32 (fp64 for an fp64 model, where ``ForCausalLMLoss`` would round it to fp32)."""
    kwargs = _checked_loss_kwargs(model, tuple(hidden_states.shape[:2]), labels, kwargs)
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
    return them as before. ``skip_logits=True`` without labels is a ``ValueError``.
    """
    check_flags(skip_logits=skip_logits)
    if skip_logits is None:
        skip_logits = bool(getattr(model.config, "fused_lm_loss", True)) and model.training and labels is not None
    if skip_logits:
        if labels is None:
            raise ValueError("skip_logits=True computes only the loss and needs labels; pass labels, or "
                             "skip_logits=False / None for the logits")
        return None, fused_causal_lm_loss(model, hidden_states, labels, **kwargs)
    logits = model.get_output_embeddings()(hidden_states)
    return logits, None if labels is None else causal_lm_loss(model, logits, labels, **kwargs)


__all__ = ["CACHE_FIELD", "CacheLayout", "CacheOrigin", "HelmDynamicCache", "HelmGenerationMixin",
           "HelmPreTrainedModel", "attention_mask_for", "cache_layout", "cache_signature", "can_return_tuple",
           "causal_lm_loss", "check_cache_layers", "check_cache_origin", "check_finite_weights", "check_flags",
           "check_forward_kwargs", "check_generation_lengths", "check_inputs", "check_loading_info",
           "check_logits_to_keep", "check_mask_values", "default_position_ids", "FORWARD_KWARGS", "kept_positions",
           "LOSS_KWARGS",
           "fused_causal_lm_loss", "lift_inputs_embeds", "lm_logits_and_loss", "AttentionWeights",
           "positional_encoding", "resolve_cache"]
