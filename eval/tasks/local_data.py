"""The ``custom_dataset`` of the task YAMLs in this folder.

lm-eval hands ``dataset_kwargs.data_files`` to ``datasets.load_dataset`` unchanged (relative to the working
directory); :func:`load` resolves them against this folder instead, so the tasks run from anywhere, offline.
"""

from pathlib import Path

import datasets

TASK_DIR = Path(__file__).resolve().parent


def load(data_files: dict, **_metadata):
    files = {split: TASK_DIR / path for split, path in data_files.items()}
    missing = [str(file) for file in files.values() if not file.is_file()]
    if missing:
        raise FileNotFoundError(f"local task data not found: {missing} (named in a task YAML under {TASK_DIR})")
    return datasets.load_dataset("json", data_files={split: str(file) for split, file in files.items()})
