"""PEFT support for the HELM models: PEFT's default adapter targets for the HELM model types, and the check
``model.load_adapter`` makes that an adapter belongs to the model.

**Default targets.** PEFT picks the modules of a config without ``target_modules`` from its tables keyed by
``config.model_type`` (``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` and the tables of
the LoRA-like methods, copies of it); PEFT 0.21 offers no other way, neither a registration function nor a hook on the
model. HELM's entries follow Llama's choice, the query and value projections (plain ``nn.Linear``s whose outputs the
layers lift, so adapted outputs stay on the hyperboloid): ``q_proj`` and ``v_proj``; HMLA makes its values in
``kv_b_proj``, so HELM-MiCE names that too. :func:`register_default_targets` adds the two model types to those tables
when a HELM model is built and PEFT is already imported (helm never imports PEFT, which takes seconds); nothing of
PEFT is replaced, and an entry PEFT already has is kept.

**Adapters of another model.** PEFT loads an adapter onto any model whose modules have the adapter's names and
shapes, and drops the weights of modules the model lacks, without a word (for Llama as well). ``load_adapter`` of a
HELM model refuses both before loading (:func:`adapter_problem`), from the adapter's ``adapter_config.json`` and the
header of its safetensors file: no tensor is read."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DEFAULT_TARGETS = {"helm_d": ["q_proj", "v_proj"], "helm_mice": ["q_proj", "v_proj", "kv_b_proj"]}
# the prefix PEFT gives the keys of an adapter's saved weights
_SAVED_PREFIX = "base_model.model."


def register_default_targets() -> None:
    """Add :data:`DEFAULT_TARGETS` to LoRA's table and to every table that copies it (the same ``llama`` entry),
    keeping any entry already there; nothing when PEFT is not imported."""
    constants = sys.modules.get("peft.utils.constants")
    lora = getattr(constants, "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING", None)
    if not isinstance(lora, dict):
        return
    for name, table in vars(constants).items():
        if name.endswith("_TARGET_MODULES_MAPPING") and isinstance(table, dict) and \
                (table is lora or table.get("llama") == lora.get("llama")):
            for model_type, targets in DEFAULT_TARGETS.items():
                table.setdefault(model_type, list(targets))


def _recorded_model_type(settings: dict, model) -> str | None:
    """The ``model_type`` of the model an adapter was trained on, from its settings: the ``config.json`` of a local
    ``base_model_name_or_path``, or the HELM family of the class PEFT records in ``auto_mapping`` (when the adapter
    has no ``task_type``); None where unknown."""
    base = settings.get("base_model_name_or_path")
    if isinstance(base, str) and (Path(base) / "config.json").is_file():
        try:
            return json.loads((Path(base) / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            return None
    name = (settings.get("auto_mapping") or {}).get("base_model_class")
    families = {"HelmMiCE": "helm_mice", "HelmD": "helm_d"}  # class-name prefixes (HelmMiCE before HelmD)
    return next((kind for prefix, kind in families.items() if isinstance(name, str) and name.startswith(prefix)),
                None)


def adapter_problem(model, adapter, *, subfolder: str = "") -> str | None:
    """Why the PEFT adapter in the local folder ``adapter`` (``/subfolder``) does not belong to ``model``, or None:

    * it was trained on a model of another ``model_type`` (:func:`_recorded_model_type`): PEFT would apply its
      weights to this model's modules of the same names and shapes;
    * its weights adapt modules ``model`` does not have: PEFT would load the others and drop these.

    A hub id, or a folder PEFT cannot read (no ``adapter_config.json``, a damaged file), is left to PEFT."""
    if not isinstance(adapter, (str, os.PathLike)):
        return None
    folder = Path(adapter) / subfolder
    try:
        settings = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict):
        return None
    theirs, ours = _recorded_model_type(settings, model), getattr(model.config, "model_type", None)
    if theirs is not None and theirs != ours:
        return (f"the adapter was trained on a {theirs} model, and this model is a {ours} model: PEFT would apply its "
                f"weights to this model's modules of the same names; load it onto a {theirs} model")
    if not (folder / "adapter_model.safetensors").is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(folder / "adapter_model.safetensors", framework="pt") as f:
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - a damaged file is PEFT's to report
        return None
    modules = {name for name, _ in model.named_modules()}
    lacking = sorted({key.removeprefix(_SAVED_PREFIX).rsplit(".lora_", 1)[0] for key in keys if ".lora_" in key}
                     - modules)
    if lacking:
        listed = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        return (f"the adapter holds weights for {len(lacking)} module(s) this {type(model).__name__} does not have "
                f"({listed}): PEFT would load the others and drop these; load it onto the model it was trained on")
    return None


__all__ = ["DEFAULT_TARGETS", "adapter_problem", "register_default_targets"]
