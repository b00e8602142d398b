"""Model presets: ``load_config("helm-d-115m")`` returns the ``transformers`` config of a named preset.

Presets are JSON files shipped inside this package (``helm/presets/*.json``, installed as package data): paper
sizes, ablations, tiny CPU models and the Euclidean ``LlamaConfig`` / ``DeepseekV3Config`` baselines at matching
shapes. A path to any JSON config file works too, and keyword overrides are applied on top.

The config class checks the values and, for the HELM types, refuses a key no field reads (a preset file's or an
override), naming it and the closest field. ``transformers``' baselines keep any key as an attribute, so for them
``load_config`` refuses an override that is neither a field nor a key of the preset file (``num_hiden_layers``).
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


def preset_path(name_or_path: str | os.PathLike) -> Path:
    """The JSON file of a preset name, or ``name_or_path`` itself when it is a ``.json`` file."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".json" and path.is_file():
        return path
    candidate = PRESET_DIR / f"{name_or_path}.json"
    if candidate.is_file():
        return candidate
    if path.suffix == ".json":  # a path, not a preset name
        raise ValueError(f"preset file {str(path)!r}: " + ("a folder" if path.is_dir() else "no such file"))
    raise ValueError(f"unknown preset {name_or_path!r}: not a JSON file, and not one of {available_presets()}")


def check_overrides(config_class: type, overrides: dict, preset_keys=()) -> None:
    """``ValueError`` naming the first override of a baseline preset that is neither a field of ``config_class``
    (dataclass fields, ``attribute_map`` aliases, settable properties such as ``num_labels``) nor a key of its
    preset file, with the closest as suggestion."""
    known = {f.name for f in dataclasses.fields(config_class)} | set(getattr(config_class, "attribute_map", {}))
    known |= {n for n, v in inspect.getmembers(config_class) if isinstance(v, property) and v.fset is not None}
    known |= set(preset_keys) | {"attn_implementation", "rope_theta", "rope_scaling", "partial_rotary_factor"}
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown config field {key!r} for {config_class.__name__}{hint}")


def load_config(name_or_path: str | os.PathLike, **overrides) -> PreTrainedConfig:
    """The config of a preset (by name or JSON path), with ``overrides`` applied; HELM types are registered.

    An override or a preset file's key that is not a field of the config class (a typo such as ``hiden_size``)
    raises ``ValueError`` naming it and the closest field."""
    from .. import models  # noqa: F401  (registers helm_d / helm_mice with AutoConfig)
    from ..models.configuration_common import HelmConfigBase
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = preset_path(name_or_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"preset file {str(path)!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"preset file {str(path)!r} must hold a JSON object with a \"model_type\"")
    model_type = data.pop("model_type")
    if (asked := overrides.pop("model_type", model_type)) != model_type:  # AutoConfig.for_model takes it once
        raise ValueError(f"model_type={asked!r}: a preset's model type is its file's ({model_type!r} in "
                         f"{str(path)!r}); load a preset of the other type")
    config_class = CONFIG_MAPPING[model_type] if model_type in CONFIG_MAPPING else None
    if config_class is not None and not issubclass(config_class, HelmConfigBase):
        check_overrides(config_class, overrides, preset_keys=data)
    try:
        return AutoConfig.for_model(model_type, **{**data, **overrides})
    except ValueError as error:  # the culprit may be a key of the file as well as an override
        raise ValueError(f"{error} (preset file {str(path)!r})") from None


__all__ = ["PRESET_DIR", "available_presets", "check_overrides", "load_config", "preset_path"]
