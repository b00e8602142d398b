"""``eval`` is a Python builtin, so ``eval/`` is a folder of scripts, not a package: tests load them by path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EVAL_DIR = REPO / "eval"
TASK_DIR = EVAL_DIR / "tasks"


def load_script(name: str):
    """``eval/<name>.py`` (or ``eval/tasks/<name>.py``) as a module under a private name, never ``eval.<name>``."""
    module_name = f"helm_eval_script_{name.replace('/', '_')}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EVAL_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]
