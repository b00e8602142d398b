"""Model presets: ``load_config("helm-d-115m")`` returns the ``transformers`` config of a named preset.

Presets are JSON files shipped inside this package (``helm/presets/*.json``, installed as package data) (paper sizes, ablations, tiny CPU models and
the Euclidean ``LlamaConfig`` / ``DeepseekV3Config`` baselines at matching shapes). A path to any JSON
config file works too, and keyword overrides are applied on top.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PreTrainedConfig

PRESET_DIR = Path(__file__).resolve().parent


def available_presets() -> tuple:
    return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))


def preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return path
    candidate = PRESET_DIR / f"{name_or_path}.json"
    if candidate.is_file():
        return candidate
    raise ValueError(f"unknown preset {name_or_path!r}: not a JSON file, and not one of {available_presets()}")


def load_config(name_or_path: str, **overrides) -> PreTrainedConfig:
    """The config of a preset (by name or JSON path), with ``overrides`` applied; HELM types are registered."""
    from .. import models  # noqa: F401  (registers helm_d / helm_mice with AutoConfig)

    data = json.loads(preset_path(name_or_path).read_text())
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **{**data, **overrides})


__all__ = ["PRESET_DIR", "available_presets", "load_config", "preset_path"]
