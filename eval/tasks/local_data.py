"""Dataset loader for the local lm-eval tasks in this folder (used through ``custom_dataset: !function``).

lm-eval hands ``dataset_kwargs`` to ``datasets.load_dataset`` as they are, so a relative ``data_files``
path would resolve against the *working directory* of whoever runs the harness. The task YAMLs here
instead name this function as their ``custom_dataset``; it resolves every ``data_files`` entry against
the folder of this file (= the folder of the task YAML) and then loads it with the stock ``json`` builder.
Running ``lm_eval --include_path eval/tasks`` therefore works from any directory, offline.
"""

from __future__ import annotations

from pathlib import Path

TASK_DIR = Path(__file__).resolve().parent


def resolve(path: str) -> str:
    """An absolute path for ``path``, taken relative to the task folder unless already absolute."""
    full = Path(path) if Path(path).is_absolute() else TASK_DIR / path
    if not full.is_file():
        raise FileNotFoundError(f"local task data file not found: {full} (named {path!r} in a task YAML under "
                                f"{TASK_DIR})")
    return str(full)


def load(data_files: dict, **_ignored):
    """``datasets.load_dataset("json", data_files=...)`` with the paths made absolute.

    ``data_files`` maps split names to paths relative to the task folder. lm-eval also passes the task's
    ``metadata`` (and model arguments) as keyword arguments; they are not needed here and are ignored.
    """
    import datasets

    return datasets.load_dataset("json", data_files={split: resolve(path) for split, path in data_files.items()})
