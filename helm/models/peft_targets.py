"""PEFT's default adapter targets for the HELM model types, so ``LoraConfig()`` without ``target_modules`` works as
it does for Llama.

PEFT picks the modules of a config without ``target_modules`` from its tables keyed by ``config.model_type``
(``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` and the tables of the LoRA-like
methods, copies of it). HELM's entries follow Llama's choice, the query and value projections (plain ``nn.Linear``s
whose outputs the layers lift, so adapted outputs stay on the hyperboloid): ``q_proj`` and ``v_proj``; HMLA makes
its values in ``kv_b_proj``, so HELM-MiCE names that too. The entries are added when PEFT's tables exist: at once if
PEFT is already imported, else right after it is (helm does not import PEFT, an optional dependency that takes
seconds to import).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

DEFAULT_TARGETS = {"helm_d": ["q_proj", "v_proj"], "helm_mice": ["q_proj", "v_proj", "kv_b_proj"]}
_CONSTANTS = "peft.utils.constants"


def add_targets(constants) -> None:
    """Add :data:`DEFAULT_TARGETS` to LoRA's table and to every table that copies it (the same ``llama`` entry),
    keeping any entry already there."""
    lora = constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    for name, table in vars(constants).items():
        if name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_TARGET_MODULES_MAPPING") and \
                isinstance(table, dict) and (table is lora or table.get("llama") == lora.get("llama")):
            for model_type, targets in DEFAULT_TARGETS.items():
                table.setdefault(model_type, list(targets))


class _AddTargetsOnImport(importlib.abc.MetaPathFinder):
    """Finds ``peft.utils.constants`` like the regular path finder and runs :func:`add_targets` right after the
    module has executed; every other import is left to the other finders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _CONSTANTS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        exec_module = spec.loader.exec_module

        def exec_then_add(module):
            exec_module(module)
            add_targets(module)

        spec.loader.exec_module = exec_then_add
        return spec


def register_peft_targets() -> None:
    """Make :data:`DEFAULT_TARGETS` PEFT's defaults now (PEFT imported) or when PEFT is imported."""
    if _CONSTANTS in sys.modules:
        add_targets(sys.modules[_CONSTANTS])
    elif not any(isinstance(finder, _AddTargetsOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AddTargetsOnImport())


__all__ = ["DEFAULT_TARGETS", "add_targets", "register_peft_targets"]
