"""Atomic, verifiable checkpoints around ``accelerator.save_state`` / ``load_state``.

``output_dir/checkpoints/step-XXXXXXXX/`` holds what ``save_state`` writes (model, optimiser, scheduler, RNG of
each process, the registered :class:`TrainerState`) and, written last, ``manifest.json`` with the size and SHA-256
of every other file. It is assembled in a ``.tmp-`` folder and renamed into place after the manifest exists, so
a checkpoint that looks complete is complete; :func:`verify_checkpoint` refuses one that does not match.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from safetensors import SafetensorError

from ..data.paths import path_problem
from ..manifest import MANIFEST, RUN_MARKER, STATE_FILE, fsync_dir, manifest_problem, read_manifest, write_manifest
from .config import ConfigError

logger = logging.getLogger(__name__)

# what a full disk raises while a folder is written: OSError, torch.save's RuntimeError ("unexpected pos"), or
# safetensors' SafetensorError (a model.safetensors written by save_state or save_pretrained)
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)

LOCK = "train.lock"
# the remedy for a damaged checkpoint (an earlier one of a run resumes only once the later ones are moved out)
ANOTHER = "resume from another checkpoint (of this run: move this one out of checkpoints/ first)"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or incompatible with the current recipe."""


class TrainerState:
    """The optimiser step (which is also the data position: step ``s`` reads global rows ``[s·G, (s+1)·G)``), the
    recipe it was trained with and the fingerprint of its data stream (:func:`helm.training.data.data_fingerprint`);
    registered with ``accelerator.register_for_checkpointing``."""

    def __init__(self, config: dict, step: int = 0):
        self.config, self.step, self.data = config, step, None

    def state_dict(self) -> dict:
        return {"step": self.step, "config": self.config, "data": self.data}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the checkpoint folders under ``root`` (``~`` expanded), oldest first (``.tmp-`` folders
    excluded)."""
    root = Path(root).expanduser()
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))] if root.is_dir() else []
    return sorted(found)


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """The manifest of a complete, intact checkpoint at ``path`` (``~`` expanded); :class:`CheckpointError` saying what
    is wrong otherwise."""
    path = Path(path).expanduser()
    if problem := path_problem(path):
        raise CheckpointError(f"--resume {str(path)!r}: {problem}")
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        raise CheckpointError(f"--resume {str(path)!r}: no {MANIFEST}, so it is no complete checkpoint of train.py "
                              "(one interrupted while written, or another folder); give a checkpoint, "
                              "OUTPUT_DIR/checkpoints/step-XXXXXXXX, or --resume alone for the newest") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"--resume {str(path)!r}: {MANIFEST} is unreadable ({error}); {ANOTHER}") from None
    if STATE_FILE not in manifest["files"]:
        raise CheckpointError(f"--resume {str(path)!r}: its {MANIFEST} lists no trainer state ({STATE_FILE})")
    if problem := manifest_problem(path, manifest):
        raise CheckpointError(f"--resume {str(path)!r} {problem}; {ANOTHER}")
    return manifest


def find_checkpoint(resume: str | None, output_dir: Path) -> Path | None:
    """The verified checkpoint ``--resume`` names (``"latest"``: the newest in ``output_dir``), or ``None``."""
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir / "checkpoints")
        if not found:  # a fresh output_dir starts at step 0 (train.py says so once it has checked the folder)
            return None
        resume = found[-1][1]
    verify_checkpoint(resume)
    return Path(resume).expanduser()


def read_trainer_state(checkpoint: Path) -> dict:
    """The :class:`TrainerState` of a checkpoint, plus ``world_size`` (processes that saved it), without loading it."""
    try:
        state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's advice, weights_only=False, would run what the file holds
        raise CheckpointError(f"--resume {str(checkpoint)!r}: {STATE_FILE} holds more than tensors (a pickled object "
                              "torch refuses to load safely); do not load it unless you trust its source") from None
    state["world_size"] = len(list(checkpoint.glob("random_states_*.pkl")))
    return state


def save_checkpoint(accelerator, output_dir: Path, step: int, *, keep_last: int) -> None:
    """``accelerator.save_state`` into a ``.tmp-`` folder, manifest last, rename into place, and delete all but the
    last ``keep_last``."""
    root = output_dir / "checkpoints"
    tmp, final = root / f".tmp-step-{step:08d}", root / f"step-{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_manifest(tmp, step)  # last: a folder with a manifest is complete
            finalize(tmp, final)
    except WRITE_ERRORS as error:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = list_checkpoints(root)[-1:]
        denied = isinstance(error, PermissionError)
        fix = f"make {str(root)!r} writable" if denied else "free space (or lift a file-size limit or quota)"
        remedy = (f"the previous checkpoint ({kept[0][1]}) is intact: {fix}, then continue with --resume" if kept
                  else f"no checkpoint was written before it: {fix}, then start over with --train.overwrite=true")
        free = shutil.disk_usage(output_dir).free / 1e6
        cause = "permission denied" if denied else f"{free:,.0f} MB free on its disk"
        raise CheckpointError(f"could not write the checkpoint of step {step} ({' '.join(str(error).split())}; "
                              f"{cause}): {remedy}") from None
    if accelerator.is_main_process:
        for _, path in list_checkpoints(root)[:-keep_last]:
            if kept := foreign_files(path):  # the user's files: the folder stays
                logger.warning("kept %s past train.keep_last: it holds files train.py did not write (%s)", path,
                               ", ".join(p.name for p in kept[:4]))
            else:
                shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()


# what train.py deletes on train.overwrite: these entries of a run folder (other files there stay)
OVERWRITTEN = ("checkpoints", "final", ".tmp-final", "metrics.jsonl", "tensorboard")
_TMP_STEP_DIR = re.compile(r"^\.tmp-step-\d{8}$")
_OWN_CHECKPOINT_ENTRY = re.compile(r"^(\.tmp-|abandoned-)?step-\d{8}(-\d+)?$")


def not_overwritable(output_dir: Path) -> list[str]:
    """What ``train.overwrite`` must not delete in ``output_dir``: an entry of :data:`OVERWRITTEN` that is a link,
    and files train.py did not write under ``checkpoints/`` (entries other than its step folders) or in ``final/`` or
    a checkpoint (files its ``manifest.json`` does not list; every file, without one: train.py renames both into place
    only once their manifest is written)."""
    found = [f"{name} (a link)" for name in OVERWRITTEN if (output_dir / name).is_symlink()]
    root = output_dir / "checkpoints"
    if root.is_dir() and not root.is_symlink():
        found += [f"checkpoints/{p.name}" for p in sorted(root.iterdir()) if not _OWN_CHECKPOINT_ENTRY.match(p.name)]
    for folder in [output_dir / "final", *(path for _, path in list_checkpoints(root))]:
        if folder.is_dir() and not folder.is_symlink():
            found += [p.relative_to(output_dir).as_posix() for p in foreign_files(folder)]
    return found


def foreign_files(folder: Path) -> list[Path]:
    """The files of ``folder`` (``final/`` or a checkpoint) that its ``manifest.json`` does not list: every file,
    without one (train.py renames both into place only once their manifest is written)."""
    try:
        listed = set(read_manifest(folder)["files"]) | {MANIFEST}
    except (OSError, ValueError):
        listed = set()
    return [p for p in sorted(folder.rglob("*")) if p.is_file() and p.relative_to(folder).as_posix() not in listed]


def write_run_marker(output_dir: Path) -> None:
    """Mark ``output_dir`` as a run folder of train.py, the only kind train.overwrite deletes files from."""
    (Path(output_dir) / RUN_MARKER).write_text(json.dumps({"written_by": "train.py"}) + "\n", encoding="utf-8")


def remove_stale_tmp_checkpoints(output_dir: Path) -> None:
    """Delete ``checkpoints/.tmp-step-XXXXXXXX`` folders, left by a write that was interrupted (train.py's names
    only)."""
    root = Path(output_dir) / "checkpoints"
    for path in root.iterdir() if root.is_dir() else ():
        if _TMP_STEP_DIR.match(path.name) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def output_lock(output_dir: Path, enabled: bool = True):
    """Hold ``output_dir/train.lock`` while training, creating ``output_dir``: an OS file lock (``filelock``), which
    the OS releases when its process dies, so a run that crashed never blocks the next one; a lock another run holds
    is refused with :class:`ConfigError`, so two runs never share a folder. The file stays after release (its
    presence says nothing about a run)."""
    if not enabled:
        yield
        return
    lock = FileLock(Path(output_dir) / LOCK, timeout=0)
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except Timeout:
        raise ConfigError(f"train.output_dir {str(output_dir)!r} is in use by another training run: wait for it or "
                          "stop it") from None
    except OSError as error:
        raise ConfigError(f"train.output_dir {str(output_dir)!r} is not a writable folder: {error}") from None
    try:
        yield
    finally:  # the file stays: deleting a lock's path lets a second run lock a new file while a third holds the old
        lock.release()


def save_final(model, tokenizer, output_dir: Path, state_dict: dict, step: int, check=None) -> Path:
    """``save_pretrained`` model and tokenizer into ``output_dir/final`` atomically, with a manifest (which
    ``from_pretrained`` of a HELM model checks); a failed write leaves the checkpoints and any older final/ as
    they were and raises :class:`CheckpointError`. ``check(folder)`` runs on the complete folder before it replaces
    final/; what it raises (``FloatingPointError`` for a model whose validation loss is not finite) leaves final/
    as it was too."""
    tmp, final = output_dir / ".tmp-final", output_dir / "final"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp, step)
    except WRITE_ERRORS as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write the final model to {str(final)!r}: {' '.join(str(error).split())}; "
                              "the checkpoints are intact: free space, then rerun with --resume") from None
    try:  # what the check raises is not a full disk
        if check is not None:
            check(tmp)
        finalize(tmp, final)
    except OSError as error:  # the old final/ could not be replaced (a read-only folder): it is as it was
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not replace {str(final)!r} ({' '.join(str(error).split())}): make it writable, "
                              "then rerun with --resume (the checkpoints are intact)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def finalize(tmp: Path, final: Path) -> None:
    """Rename the fully written folder ``tmp`` into place, replacing an older ``final`` of the same name."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(final.parent)
