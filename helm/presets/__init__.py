"""Model presets: ``load_config("helm-d-115m")`` returns the ``transformers`` config of a named preset.

Presets are JSON files shipped inside this package (``helm/presets/*.json``, installed as package data) (paper sizes, ablations, tiny CPU models and
the Euclidean ``LlamaConfig`` / ``DeepseekV3Config`` baselines at matching shapes). A path to any JSON
config file works too, and keyword overrides are applied on top.

Overrides are checked by name (``load_config("tiny-helm-d", hiden_size=64)`` is a ``ValueError`` suggesting
``hidden_size``), for the HELM configs and the Euclidean baselines alike: a key must be a field of the preset's
config class (its dataclass fields, ``attribute_map`` aliases and declared legacy names), a standard
``PreTrainedConfig`` attribute, or (Euclidean baselines only) a key of the preset file itself. The keys of a HELM
preset file (shipped or a user's JSON path) are checked the same way, naming the file. ``from_pretrained`` /
``AutoConfig`` loading of saved HELM configs refuses unknown keys with the same error, accepting besides the fields
the keys transformers itself writes (``auto_map``, ``architectures``, ...; see
:data:`helm.models.configuration_common.TRANSFORMERS_KEYS`). The values are checked by the config class itself
(field rules and ``validate_architecture`` for the HELM types).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
from pathlib import Path

from transformers import AutoConfig, PreTrainedConfig

PRESET_DIR = Path(__file__).resolve().parent


def available_presets() -> tuple:
    return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))


def preset_path(name_or_path: str) -> Path:
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"load_config: the preset argument name_or_path must be a preset name or the path of a JSON "
                        f"config file (str or os.PathLike), got {name_or_path!r}; the presets are "
                        f"{available_presets()}")
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" and path.is_file():
        return path
    candidate = PRESET_DIR / f"{name_or_path}.json"
    if candidate.is_file():
        return candidate
    raise ValueError(f"unknown preset {name_or_path!r}: not a JSON file, and not one of {available_presets()}")


def _standard_attributes() -> set:
    """``PreTrainedConfig``'s own fields and settable public properties (``num_labels``, ``output_attentions``, ...)."""
    names = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    names |= {n for n, v in inspect.getmembers(PreTrainedConfig)
              if isinstance(v, property) and v.fset is not None and not n.startswith("_")}
    return names | {"attn_implementation"}


def known_override_keys(config_class: type) -> set:
    """Keys ``load_config`` accepts as overrides for ``config_class`` (see the module docstring)."""
    keys = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    keys |= set(getattr(config_class, "attribute_map", {}) or {})
    keys |= set(getattr(config_class, "legacy_kwargs", ()))
    if "rope_parameters" in keys:  # transformers converts the legacy RoPE keys into rope_parameters
        keys |= {"rope_theta", "rope_scaling", "partial_rotary_factor"}
    return keys | _standard_attributes()


def check_overrides(config_class: type, overrides: dict, preset_keys=()) -> None:
    """``ValueError`` naming the first override that is not a known key, with the closest field as suggestion."""
    known = known_override_keys(config_class) | set(preset_keys)
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown config field {key!r} for {config_class.__name__}{hint} (overrides must be "
                             f"fields of the config class; {config_class.__name__} has no such option)")


def _is_boolean_field(field_type) -> bool:
    """Whether a dataclass field's annotation is ``bool`` or ``bool | None`` (strings or types)."""
    text = field_type if isinstance(field_type, str) else str(field_type).replace("<class 'bool'>", "bool")
    return text.replace("Optional[bool]", "bool | None").replace(" ", "") in ("bool", "bool|None", "None|bool")


def check_booleans(config_class: type, values: dict, where: str) -> None:
    """``ValueError`` naming the first boolean field of ``config_class`` given something else than ``True`` /
    ``False`` (``None`` where optional): ``"false"`` is truthy and would build the opposite model. The HELM configs
    check this themselves; ``transformers``' baselines (``LlamaConfig``, ``DeepseekV3Config``) do not."""
    if not dataclasses.is_dataclass(config_class):
        return
    fields = {f.name: f.type for f in dataclasses.fields(config_class)}
    for key, value in values.items():
        if key in fields and _is_boolean_field(fields[key]) and not isinstance(value, bool) and \
                not (value is None and "None" in str(fields[key])):
            raise ValueError(f"{key} must be a bool, got {value!r} ({where})")


def load_config(name_or_path: str, **overrides) -> PreTrainedConfig:
    """The config of a preset (by name or JSON path), with ``overrides`` applied; HELM types are registered.

    An override that is not a field of the config class (a typo such as ``hiden_size``, or an option the model
    does not have such as ``attention_dropout`` for HELM) raises ``ValueError`` naming it and the closest field."""
    from .. import models  # noqa: F401  (registers helm_d / helm_mice with AutoConfig)
    from ..models.configuration_common import HelmConfigBase
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = preset_path(name_or_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"preset file {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"preset file {str(path)!r} must hold a JSON object with a \"model_type\" "
                         "(e.g. \"helm_d\"), like the files in helm/presets/")
    model_type = data.pop("model_type")
    if model_type in CONFIG_MAPPING:
        config_class = CONFIG_MAPPING[model_type]
        # A HELM preset file's own keys pass the same check as keyword overrides (a typo there is no less a typo);
        # the baselines' files may carry attributes their transformers class lacks but the zoo reads (DeepSeek-V3's
        # aux_loss_alpha for helm.models.routing), so only their overrides are checked.
        helm_type = issubclass(config_class, HelmConfigBase)
        if helm_type:
            from ..models.configuration_common import TRANSFORMERS_KEYS

            try:  # a save_pretrained config.json also holds transformers' keys (auto_map, architectures, ...)
                check_overrides(config_class, {k: v for k, v in data.items() if k not in TRANSFORMERS_KEYS})
            except ValueError as error:
                raise ValueError(f"preset file {str(path)!r}: {error}") from None
        check_overrides(config_class, overrides, preset_keys=() if helm_type else data)
        check_booleans(config_class, data, f"preset file {str(path)!r}")
        check_booleans(config_class, overrides, "override")
    return AutoConfig.for_model(model_type, **{**data, **overrides})


__all__ = ["PRESET_DIR", "available_presets", "check_booleans", "check_overrides", "known_override_keys", "load_config",
           "preset_path"]
