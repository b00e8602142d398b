"""The one check of a path a command line names (train.py's recipe keys, the eval/ and scripts/ options), made at the
boundary, before any work: ``~`` expanded, and a missing path, a file where a folder is expected, or a folder
without the files it must hold named in one line with the argument it came from."""

from __future__ import annotations

import os
from pathlib import Path

# what a model folder written by save_pretrained holds, and what transformers builds a tokenizer from
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def looks_local(name: str | os.PathLike) -> bool:
    """Whether ``name`` can only mean a local path: it exists, or no hub id (``name`` or ``owner/name``) has its
    form (a leading ``.``, ``/`` or ``~``, more than one ``/``, an empty part, or a data-file suffix)."""
    text = os.fspath(name)
    parts = text.replace(os.sep, "/").split("/")
    return (isinstance(name, os.PathLike) or Path(text).expanduser().exists() or text.startswith((".", "/", "~"))
            or len(parts) > 2 or not all(parts) or Path(text).suffix.lower() in (".json", ".jsonl", ".txt"))


def path_problem(name: str | os.PathLike, *, folder: bool = True, needs: tuple[str, ...] = (),
                 hub: bool = False) -> str | None:
    """Why ``name`` (``~`` expanded) is not a usable input, or None: it does not exist, is a file where a folder
    is expected (or the reverse), or is a folder holding none of ``needs``. With ``hub``, a name of a hub id's
    form that is no local path passes: the hub answers for it."""
    path = Path(name).expanduser()
    if hub and not looks_local(name):
        return None
    if not path.exists():
        return f"no such {'folder' if folder else 'file'}"
    if path.is_dir() != folder:
        return f"is a {'file' if folder else 'folder'}, not a {'folder' if folder else 'file'}"
    if needs and not any((path / file).is_file() for file in needs):
        return f"holds none of {', '.join(needs)}"
    return None


def check_path(name: str | os.PathLike, argument: str, error: type[Exception] = ValueError, **kwargs) -> str:
    """``name`` with ``~`` expanded (a hub id unchanged), or ``error("ARGUMENT 'NAME': PROBLEM")`` for the
    :func:`path_problem` of ``name``; ``kwargs`` go to it."""
    if problem := path_problem(name, **kwargs):
        raise error(f"{argument} {os.fspath(name)!r}: {problem}")
    return os.fspath(Path(name).expanduser()) if looks_local(name) else os.fspath(name)
