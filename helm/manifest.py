"""SHA-256 manifests of folders written by the zoo (training checkpoints and ``train.py``'s ``final/``).

``manifest.json`` = ``{"format": 2, "step": N, "files": {relative path: {"sha256", "bytes"}}}`` (``"step": null``
and the weight files only for a ``save_pretrained`` folder), written last and
atomically, after every listed file has been flushed to disk: a folder with a manifest was written completely,
and :func:`manifest_problem` detects any later truncation or corruption of the files it lists. Also how a run folder of
``train.py`` is recognised (:func:`is_run_folder`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional

import yaml

MANIFEST = "manifest.json"
FORMAT = 2
# train.py's markers, here so that loaders below helm.training can tell its folders from model folders
STATE_FILE = "custom_checkpoint_0.pkl"  # the training state of a checkpoint (accelerate's custom object 0)
RUN_MARKER = ".helm-train-run"  # the file that marks a run folder
_RECIPE_SECTIONS = {"model", "data", "optim", "train", "demo"}  # a resolved train.py recipe, config.yaml


def is_run_folder(folder: Path) -> bool:
    """Whether train.py wrote ``folder``: it holds :data:`RUN_MARKER`, or (a run of a train.py from before the
    marker) a ``config.yaml`` that is a resolved train.py recipe (exactly the five sections, train.output_dir set)."""
    folder = Path(folder)
    if (folder / RUN_MARKER).is_file():
        return True
    try:
        recipe = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return (isinstance(recipe, dict) and set(recipe) == _RECIPE_SECTIONS and isinstance(recipe["train"], dict)
            and bool(recipe["train"].get("output_dir")))


def hash_file(path: Path, fsync: bool = False) -> tuple[str, int]:
    """``(SHA-256 hex digest, size in bytes)`` of ``path``; ``fsync`` flushes it to disk as well."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
        if fsync:
            os.fsync(handle.fileno())
    return digest.hexdigest(), size


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; a rename is still atomic there
        return
    os.fsync(fd)
    os.close(fd)


def write_manifest(folder: Path, step: Optional[int], which: Optional[Callable[[str], bool]] = None,
                   extra: Optional[dict] = None) -> None:
    """Hash (and flush to disk) every file in ``folder`` (those whose relative path ``which`` selects, when given),
    then write ``manifest.json`` atomically, last, with the keys of ``extra`` beside its own. ``step`` is None for a
    folder written outside training (``save_pretrained``, which lists only the weight files)."""
    folder = Path(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST
                       and (which is None or which(p.relative_to(folder).as_posix()))):
        digest, size = hash_file(path, fsync=True)
        files[path.relative_to(folder).as_posix()] = {"sha256": digest, "bytes": size}
    tmp = folder / (MANIFEST + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        json.dump({**(extra or {}), "format": FORMAT, "step": step, "files": files}, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    tmp.replace(folder / MANIFEST)
    fsync_dir(folder)


def read_manifest(folder: Path) -> dict:
    """The manifest of ``folder``; ``FileNotFoundError`` if there is none, ``ValueError`` if it is unreadable or of
    an unknown format."""
    manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{MANIFEST} has an unknown format")
    for name, entry in manifest["files"].items():  # each {"sha256": hex, "bytes": size}, as write_manifest writes it
        if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str) \
                or not isinstance(entry.get("bytes"), int):
            raise ValueError(f"{MANIFEST} has an unknown format (its entry for {name!r})")
    return manifest


def manifest_problem(folder: Path, manifest: dict, which: Optional[Callable[[str], bool]] = None) -> Optional[str]:
    """What is wrong with the files ``manifest`` lists (those ``which`` selects), or None when every one is
    present with its recorded size and SHA-256."""
    for name, entry in manifest["files"].items():
        if which is not None and not which(name):
            continue
        file = folder / name
        if not file.is_file():
            return f"is incomplete: {name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"is truncated or corrupted: {name} has {size} bytes, the manifest records {entry['bytes']}"
        if hash_file(file)[0] != entry["sha256"]:
            return f"is corrupted: the SHA-256 of {name} does not match its manifest"
    return None


__all__ = ["FORMAT", "MANIFEST", "fsync_dir", "hash_file", "manifest_problem", "read_manifest", "write_manifest"]
