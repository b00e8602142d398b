"""Loading and saving of HELM models: ``transformers``' own ``from_pretrained`` / ``save_pretrained``, made strict
about weights (a missing or unused weight is an error, not a log line), with the migration of old checkpoint layouts,
the geometry restored after loading, and a self-contained remote-code bundle plus a SHA-256 manifest on saving.

:class:`HelmHubMixin` is mixed into :class:`helm.models.modeling_common.HelmPreTrainedModel` ahead of
``PreTrainedModel``: every method here overrides ``transformers``' on HELM's classes only."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from ..manifest import MANIFEST, manifest_problem, read_manifest, write_manifest
from .loading import WEIGHT_FILE, check_save_directory
from .peft_support import adapter_problem, register_default_targets

logger = logging.get_logger(__name__)

# Checkpoints saved before the attention and MLP projections became plain linears under Llama's names
# (``q_proj.linear.weight`` is now ``q_proj.weight``); ``final_proj`` is still a LorentzLinear.
LEGACY_KEY_MAPPING = {r"\.(q|k|v|o|q_a|q_b|kv_a|kv_b|k_rope|gate|up|down)_proj\.linear\.": r".\1_proj."}


class HelmHubMixin:
    """``from_pretrained``, ``load_adapter`` and ``save_pretrained`` of HELM models (see the module docstring), and
    ``post_init`` registering PEFT's default adapter targets for them (:mod:`.peft_support`)."""

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
        """``transformers``' loader, strict about the weights (:func:`check_loading_info`), then
        :meth:`restore_geometry`. ``output_loading_info=True`` returns ``(model, info)`` as in ``transformers``;
        ``ignore_mismatched_sizes=True`` re-initialises mismatched weights on request, as there."""
        want_info = kwargs.pop("output_loading_info", False)
        where = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        check_manifest(cls.__name__, where, kwargs.get("subfolder") or "")
        check_shards(cls.__name__, where, kwargs.get("subfolder") or "")
        # mismatched shapes are reported by check_loading_info, naming them (transformers: "look at the above report")
        try:
            model, info = super().from_pretrained(
                *args, output_loading_info=True,
                **{**kwargs, "ignore_mismatched_sizes": True,
                   "key_mapping": {**LEGACY_KEY_MAPPING, **(kwargs.get("key_mapping") or {})}})
        except pickle.UnpicklingError as error:  # torch's advice, weights_only=False, would run the file's code
            folder = Path(where, kwargs.get("subfolder") or "") if isinstance(where, (str, os.PathLike)) else None
            bins = sorted(p.name for p in folder.glob("*.bin") if WEIGHT_FILE.match(p.name)) if folder else []
            culprit = " or ".join(bins) or "a .bin file"
            raise OSError(f"{cls.__name__}.from_pretrained({str(where)!r}): {culprit} holds more than "
                          "tensors (a pickled object torch refuses to load safely); do not load it with "
                          "weights_only=False unless you trust its source: re-save the model from a trusted copy "
                          "(safetensors)") from error
        info = model._allow_new_head(where, info)
        check_loading_info(cls.__name__, where, info, ignore_mismatched_sizes=kwargs.get("ignore_mismatched_sizes"))
        # transformers re-saves a renamed checkpoint in its old layout; a migrated one is saved in the current one
        model._weight_conversions = [c for c in getattr(model, "_weight_conversions", None) or []
                                     if list(c.source_patterns) != list(LEGACY_KEY_MAPPING)]
        model.restore_geometry()
        check_finite_weights(cls.__name__, where, model)
        warn_off_manifold(model, f"{cls.__name__}.from_pretrained({str(where)!r})")
        return (model, info) if want_info else model

    @classmethod
    def _from_config(cls, config, **kwargs):
        """``transformers``' constructor behind ``AutoModel*.from_config(config, **kwargs)``. ``dtype="auto"`` builds
        the model in ``config.dtype`` (the default dtype when the config records none), as ``from_pretrained`` reads
        ``config.json``'s."""
        # without dtype= (or torch_dtype=), transformers builds the model in config.dtype
        kwargs = {name: value for name, value in kwargs.items()
                  if not (name in ("dtype", "torch_dtype") and value == "auto")}
        return super()._from_config(config, **kwargs)

    def post_init(self):
        """``transformers``' post-init, after PEFT's default adapter targets for the HELM model types are registered
        (:func:`~helm.models.peft_support.register_default_targets`; nothing when PEFT is not imported)."""
        register_default_targets()
        super().post_init()

    def load_adapter(self, peft_model_id=None, *args, **kwargs):
        """``transformers``' PEFT adapter loading, after :func:`~helm.models.peft_support.adapter_problem`: an
        adapter trained on a model of another type, or holding weights for modules this model lacks, is a
        ``ValueError`` naming the adapter, before anything is loaded."""
        subfolder = (kwargs.get("adapter_kwargs") or {}).get("subfolder") or ""
        if problem := adapter_problem(self, peft_model_id, subfolder=subfolder):
            raise ValueError(f"{type(self).__name__}.load_adapter({os.fspath(peft_model_id)!r}): {problem}")
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

        Config fields the layers read when they were built and that changed since are a ``UserWarning`` naming
        them (:func:`changed_config_note`): the saved ``config.json`` would reload as another model."""
        call = f"{type(self).__name__}.save_pretrained({str(save_directory)!r})"
        warn_off_manifold(self, call)
        check_save_directory(self, save_directory)
        if note := changed_config_note(getattr(self, "_config_as_built", None), self.config):
            warnings.warn(f"{call}: {note}", UserWarning, stacklevel=2)
        path = Path(save_directory)
        main = kwargs.get("is_main_process", True)
        if main:
            path.mkdir(parents=True, exist_ok=True)
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


# config fields a HELM model reads at each call, or that describe no layer: a change after the model is built is
# followed (or changes nothing built); any other field is read by the layers when they are built
RUNTIME_CONFIG_FIELDS = frozenset({
    "fused_lm_loss", "use_cache", "output_attentions", "output_hidden_states",
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


def check_finite_weights(name: str, where, model: nn.Module) -> None:
    """``OSError`` naming the first parameter holding a NaN or an inf after loading (a checkpoint of a diverged run,
    or one damaged and re-saved: every output of such a model is NaN). CPU parameters only, one fused max-|x| and
    one read per load (not per step)."""
    params = [(n, p) for n, p in model.named_parameters()
              if p.device.type == "cpu" and p.is_floating_point() and p.numel()]
    if not params:
        return
    largest = torch.stack([m.float() for m in torch._foreach_norm([p.detach() for _, p in params], float("inf"))])
    finite = largest.isfinite().tolist()
    if not all(finite):
        bad = next(n for (n, _), ok in zip(params, finite) if not ok)
        dtype = model.get_parameter(bad).dtype
        cause = (f" in {dtype}, the dtype it was loaded in (a finite weight above {torch.finfo(dtype).max:,.0f} "
                 "overflows it): load it in float32 or bfloat16, or" if dtype == torch.float16 else ";")
        raise OSError(f"{name}.from_pretrained({str(where)!r}): the weight {bad!r} holds NaN or inf values{cause} "
                      "every output of this model would be NaN: load an earlier checkpoint")


def check_manifest(name: str, where, subfolder: str = "") -> None:
    """``OSError`` when a local folder written by ``save_pretrained`` or ``train.py`` holds a ``manifest.json`` and its
    weight files no longer match it (truncation, bit rot, a partial copy), naming the file."""
    if not isinstance(where, (str, os.PathLike)):
        return
    folder = Path(where) / subfolder
    if not (folder / MANIFEST).is_file():
        return
    try:
        problem = manifest_problem(folder, read_manifest(folder), WEIGHT_FILE.match)
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = f"has an unreadable {MANIFEST} ({error})"
    if problem:
        raise OSError(f"{name}.from_pretrained({str(where)!r}): the checkpoint {problem}; re-save or re-download it "
                      f"(or delete {MANIFEST} to load it anyway)")


# the largest relative manifold error a table keeps under the zoo's optimiser is fp32 rounding (about 1e-7); a stock
# optimiser's first steps move points by the learning rate (0.7 after three AdamW steps at 3e-3)
MANIFOLD_TOLERANCE = 1e-4


def warn_off_manifold(model, call: str) -> None:
    """A ``UserWarning`` from ``call`` naming the manifold parameters of ``model`` off the hyperboloid
    (``model.manifold_error()`` above :data:`MANIFOLD_TOLERANCE`) and what moved them: every result of the model
    (logits, distances, saved checkpoints) is then that of points that are not on the manifold."""
    def tolerance(name):  # a table stored in half precision is as far off as its rounding (bf16: 4e-3 relative)
        return max(MANIFOLD_TOLERANCE, 8 * torch.finfo(model.get_parameter(name).dtype).eps)

    off = {name: error for name, error in model.manifold_error().items() if not error <= tolerance(name)}
    if off:
        shown = ", ".join(f"{name} ({error:.2g})" for name, error in off.items())
        warnings.warn(f"{call}: manifold parameters off the hyperboloid, largest relative error {shown}: an optimiser "
                      "that is not Riemannian moved them (AdamW, transformers.Trainer's default). Train with "
                      "helm.optim.build_optimizer (with Trainer: optimizers=(optimizer, scheduler))", UserWarning,
                      stacklevel=3)


def check_shards(name: str, where, subfolder: str = "") -> None:
    """For a local sharded checkpoint: a shard its index (``*.index.json``) names that is no plain file name of the
    folder (``../../etc/passwd``) is a ``ValueError`` naming the shard and the index: transformers follows such a
    name out of the folder. A missing shard (transformers names it) and an index that is not JSON are left to
    transformers."""
    if not isinstance(where, (str, os.PathLike)) or not (folder := Path(where) / subfolder).is_dir():
        return
    for index in sorted(folder.glob("*.index*.json")):  # variant indexes too: model.safetensors.index.v1.json
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted({str(shard) for shard in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        for shard in shards:
            if Path(shard).name != shard or shard in (".", ".."):
                raise ValueError(f"{name}.from_pretrained({str(where)!r}): {index.name} names the shard {shard!r}, "
                                 "which is not a file of the checkpoint folder; refusing to read outside it")
