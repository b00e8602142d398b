"""The path checks of HELM's own ``from_pretrained`` and ``save_pretrained``: the two cases where ``transformers``
gives a silently wrong result or loses the work, for Llama as for HELM.

* ``save_pretrained(path)`` where ``path`` is an existing file (or lies under one): ``transformers`` logs an error and
  returns without writing anything, so a script goes on as if the model were saved (:func:`check_save_directory`).
* ``HelmDConfig.from_pretrained(folder)`` where ``folder`` has no ``config.json``: ``transformers`` returns a default
  config, a different model than the one meant (:func:`check_config_folder`).

Everything else a path can do wrong (a missing folder read as a hub id, a damaged tokenizer or adapter file) is
answered by ``transformers`` and PEFT, as for any model."""

from __future__ import annotations

import os
import re
from pathlib import Path

# weight files and their shard indexes (not the code, config or tokenizer files, which users edit): what a
# save_pretrained manifest lists
# (with transformers' variant names too: model.v1.safetensors, model.v1-00001-of-00002.safetensors and
# model.safetensors.index.v1.json)
WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(\.[^./]+)?(-\d+-of-\d+)?\.(safetensors|bin)(\.index(\.[^./]+)?\.json)?$")


def check_save_directory(owner, save_directory) -> None:
    """``NotADirectoryError`` naming ``save_directory`` when it is an existing file or lies under one, before
    ``type(owner).save_pretrained`` writes anything."""
    if not isinstance(save_directory, (str, os.PathLike)):
        return
    path = Path(save_directory)
    blocking = next((p for p in (path, *path.parents) if p.is_file()), None)
    if blocking is not None:
        where = "is an existing file" if blocking == path else f"lies under {str(blocking)!r}, an existing file"
        raise NotADirectoryError(f"{type(owner).__name__}.save_pretrained({str(save_directory)!r}): the save "
                                 f"directory {where}; give a folder (it is created if missing)")


def check_config_folder(name: str, where, *, subfolder: str = "") -> None:
    """``OSError`` naming ``config.json`` when ``where`` (``/subfolder``) is an existing local folder without one;
    a file, a hub id or a missing path is left to ``transformers``."""
    if not isinstance(where, (str, os.PathLike)):
        return
    folder = Path(where) / subfolder
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise OSError(f"{name}.from_pretrained({os.fspath(where)!r}): the folder {str(folder)!r} has no config.json "
                      "(transformers would return a default config); give the folder save_pretrained wrote")


__all__ = ["WEIGHT_FILE", "check_config_folder", "check_save_directory"]
