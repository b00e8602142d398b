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
import math
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import torch
import yaml
from accelerate.utils import load as accelerate_load
from safetensors import SafetensorError, safe_open

from ..manifest import (MANIFEST, RUN_MARKER, STATE_FILE, fsync_dir, is_run_folder, manifest_problem, read_manifest,
                        write_manifest)
from .config import ConfigError

logger = logging.getLogger(__name__)

# what a full disk raises while a folder is written: OSError, torch.save's RuntimeError ("unexpected pos"), or
# safetensors' SafetensorError (a model.safetensors written by save_state or save_pretrained)
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)

LOCK = "train.lock"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# a checkpoint later than the one a run was resumed from, set aside (set_aside_later_checkpoints)
_ABANDONED_DIR = re.compile(r"^abandoned-step-\d{8}(-\d+)?$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or incompatible with the current recipe."""


class TrainerState:
    """The optimiser step (which is also the data position: step ``s`` reads global rows ``[s·G, (s+1)·G)``), the
    recipe it was trained with, the fingerprint of its data stream (:func:`helm.training.data.data_fingerprint`)
    and the divergence monitor's state; registered with ``accelerator.register_for_checkpointing``."""

    def __init__(self, config: dict, step: int = 0, data: dict | None = None, divergence=None):
        self.config, self.step, self.data, self.divergence = config, step, data, divergence

    def state_dict(self) -> dict:
        state = {"step": self.step, "config": self.config}
        if self.data is not None:
            state["data"] = self.data
        if self.divergence is not None:
            state["divergence"] = self.divergence.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        if self.divergence is not None:
            self.divergence.load_state_dict(state.get("divergence"))


@contextlib.contextmanager
def unloadable_files(checkpoint: Path):
    """Turn what ``accelerator.load_state`` raises for readable files that do not fit this run (another model's
    weights, an optimiser state of other parameter groups) into a :class:`CheckpointError` naming the file."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError, EOFError, SafetensorError) as error:
        text = " ".join(str(error).split())
        name = ("model.safetensors" if re.search(r"state_dict|size mismatch|[Mm]issing key|[Uu]nexpected key", text)
                else "optimizer.bin" if re.search(r"parameter group|optimizer", text)
                else "scheduler.bin" if "scheduler" in text else "one of its files")
        raise CheckpointError(f"checkpoint {str(checkpoint)!r}: {name} cannot be loaded into this run "
                              f"({type(error).__name__}: {text[:300]}); was it written by another model or "
                              "recipe? Resume from another checkpoint") from None


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
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    advice = "delete it and resume from an earlier checkpoint with --resume PATH, or start over"
    try:
        manifest = read_manifest(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: it has no {MANIFEST}, so it was interrupted "
                              f"while being written; {advice}") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: {MANIFEST} is unreadable ({error}); "
                              f"{advice}") from None
    files = manifest["files"]
    if STATE_FILE not in files or "random_states_0.pkl" not in files or not any(
            name.startswith(("model", "pytorch_model")) for name in files):
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: its manifest lacks the trainer state, RNG "
                              f"state or model weights; {advice}")
    problem = manifest_problem(path, manifest)
    if problem:
        raise CheckpointError(f"checkpoint {str(path)!r} {problem}; {advice}")
    unlisted = sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                      if p.is_file() and p.name != MANIFEST and p.relative_to(path).as_posix() not in files)
    if unlisted:
        raise CheckpointError(f"checkpoint {str(path)!r} holds {unlisted[0]}, which its manifest does not list, so it "
                              f"was not written with the checkpoint; remove it, or {advice}")
    extra = sorted(name for name in files if _CUSTOM.match(name) and name != STATE_FILE)
    if extra:  # accelerate would fail on it: train.py registers one object (its TrainerState)
        raise CheckpointError(f"checkpoint {str(path)!r} holds {extra[0]}, which train.py never writes (it saves one "
                              f"custom object, {STATE_FILE}); {advice}")
    for name in files:
        reason = _unreadable(path / name)
        if reason:
            raise CheckpointError(f"checkpoint {str(path)!r}: {name} matches its manifest but cannot be read "
                                  f"({reason}): it was damaged before its manifest was written; {advice}")
    return manifest


_CUSTOM = re.compile(r"^custom_checkpoint_\d+\.pkl$")


def _unreadable(file: Path) -> str | None:
    """Why ``file`` (a checkpoint file) cannot be read, or None: safetensors headers are parsed, torch.save's zip
    archives (``.bin``, ``.pkl``, ``.pt``) checked member by member (CRCs), without loading any tensor."""
    try:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as handle:
                handle.keys()
        elif file.suffix in (".bin", ".pkl", ".pt"):
            with zipfile.ZipFile(file) as archive:
                bad = archive.testzip()
            if bad is not None:
                return f"its member {bad} is corrupted"
    except (OSError, SafetensorError, zipfile.BadZipFile, ValueError) as error:
        return " ".join(str(error).split()) or type(error).__name__
    return None


def find_checkpoint(resume: str | None, output_dir: Path) -> Path | None:
    """The verified checkpoint ``--resume`` names (``"latest"``: the newest in ``output_dir``), or ``None``. A file
    is refused naming its folder when that is a checkpoint (``--resume .../step-00000004/model.safetensors``)."""
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir / "checkpoints")
        if not found:
            logger.warning("--resume: no checkpoint in %s; starting from step 0", output_dir / "checkpoints")
            return None
        resume = found[-1][1]
    if os.path.isfile(resume):
        folder = os.path.dirname(os.path.abspath(resume))
        hint = (f"give its checkpoint folder: --resume {folder}" if os.path.isfile(os.path.join(folder, MANIFEST))
                else "give a checkpoint folder (OUTPUT_DIR/checkpoints/step-XXXXXXXX)")
        raise CheckpointError(f"--resume {str(resume)!r} is a file, and a checkpoint is a folder; {hint}")
    if problem := not_a_checkpoint(Path(resume), output_dir):
        raise CheckpointError(problem)
    verify_checkpoint(resume)
    return Path(resume)


def _newest_complete(root: Path) -> Path | None:
    """The newest checkpoint under ``root`` that has its manifest (so was written completely), or None."""
    complete = [path for _, path in list_checkpoints(root) if (path / MANIFEST).is_file()]
    return complete[-1] if complete else None


def not_a_checkpoint(folder: Path, output_dir: Path) -> str | None:
    """Why ``--resume folder`` names another folder of a run than a checkpoint, saying what it is and what to pass
    (a run folder: ``--resume`` with no value, or its newest checkpoint; its ``checkpoints/``: the newest one in it;
    its ``final/`` or another ``save_pretrained`` folder: the newest checkpoint, or ``--model.pretrained`` for a new
    run); None for a checkpoint, or a folder named like one (``step-XXXXXXXX``, ``.tmp-step-XXXXXXXX``, or holding
    a trainer state), which :func:`verify_checkpoint` judges. Without this, such folders were reported as
    half-written checkpoints to delete: the advice would have deleted the run or its final model."""
    name = str(folder)
    if not folder.is_dir() or (folder / STATE_FILE).is_file() or re.match(r"^(\.tmp-)?step-\d{8}$", folder.name):
        return None
    if is_run_folder(folder):
        newest = _newest_complete(folder / "checkpoints")
        if newest is None:
            return (f"--resume {name!r} is a run folder of train.py, not a checkpoint, and it holds no complete "
                    "checkpoint to resume from; start the run over with --train.overwrite=true")
        plain = ("--resume with no value" if folder.resolve() == output_dir.resolve() else
                 f"--resume with no value and --train.output_dir={folder}")
        return (f"--resume {name!r} is a run folder of train.py, not a checkpoint: pass {plain} to continue from its "
                f"newest checkpoint, or --resume={newest}")
    if folder.name == "checkpoints" and (is_run_folder(folder.parent) or list_checkpoints(folder)):
        newest = _newest_complete(folder)
        where = (f"pass its newest checkpoint, --resume={newest}" if newest is not None else
                 "it holds no complete checkpoint to resume from")
        return f"--resume {name!r} is the checkpoints/ folder of a train.py run, not a checkpoint: {where}"
    run = folder.parent if is_run_folder(folder.parent) else None
    if (folder / "config.json").is_file() or (run is not None and folder.name == "final"):
        what = ("the exported model (save_pretrained) of a train.py run" if run is not None and folder.name == "final"
                else "a model folder written by save_pretrained")
        newest = _newest_complete(run / "checkpoints") if run is not None else None
        resume = f"resume the run from its newest checkpoint, --resume={newest}, or " if newest is not None else ""
        return (f"--resume {name!r} is {what}, not a training checkpoint (which holds the optimiser and trainer "
                f"state too): {resume}start a new run from this model with --model.pretrained={folder}")
    if not (folder / MANIFEST).is_file():
        return (f"--resume {name!r} is not a training checkpoint of train.py (no {MANIFEST}, no trainer state): give "
                "a checkpoint folder, OUTPUT_DIR/checkpoints/step-XXXXXXXX")
    return None


def read_trainer_state(checkpoint: Path) -> dict:
    """The :class:`TrainerState` of a checkpoint, plus ``world_size`` (processes that saved it), without loading it."""
    rng_files = sorted(checkpoint.glob("random_states_*.pkl"))
    with refused_pickles(checkpoint):
        state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
        for path in rng_files:  # accelerate's load_state would skip an unreadable one silently (resume not exact)
            accelerate_load(path, map_location="cpu")
    state["world_size"] = len(rng_files)
    return state


@contextlib.contextmanager
def refused_pickles(checkpoint: Path):
    """Turn torch's refusal to unpickle anything but tensors and plain data (``weights_only``) into a
    :class:`CheckpointError` naming the checkpoint: its files were replaced after the manifest was written."""
    try:
        yield
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} holds a file that is not plain tensors and data, so "
                              f"it was not loaded ({str(error).splitlines()[0]}); resume from another checkpoint"
                              ) from None


def save_checkpoint(accelerator, output_dir: Path, step: int, *, keep_last: int, val_loss: float | None = None,
                    keep_best: bool = False) -> None:
    """``accelerator.save_state`` into a ``.tmp-`` folder, manifest last (with ``val_loss``), rename into place,
    prune old ones: all but the last ``keep_last`` and, with ``keep_best``, the one of lowest validation loss."""
    root = output_dir / "checkpoints"
    tmp, final = root / f".tmp-step-{step:08d}", root / f"step-{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(tmp)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            finalize(tmp, final, step, val_loss=val_loss)
    except CheckpointError:  # a RuntimeError, but no full disk: finalize refused to delete a file of someone else's
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except WRITE_ERRORS as error:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = [str(path) for _, path in list_checkpoints(root)[-1:]] or ["none"]
        raise CheckpointError(f"could not write the checkpoint of step {step}: {error}; the previous checkpoint "
                              f"({kept[0]}) is intact: free space, then continue with --resume") from None
    except KeyboardInterrupt:  # Ctrl-C while writing: the half-written folder goes (it was never listed)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        best = best_checkpoint(root) if keep_best else None
        for _, path in list_checkpoints(root)[:-keep_last]:
            if path != best:
                remove_checkpoint(path)
        remove_stale_tmp_checkpoints(output_dir)
    accelerator.wait_for_everyone()


def best_checkpoint(root: Path) -> Path | None:
    """The checkpoint under ``root`` whose manifest records the lowest finite validation loss (the newest of equal
    ones), or None when none records one."""
    scored = []
    for step, path in list_checkpoints(root):
        try:
            loss = read_manifest(path).get("val_loss")
        except (OSError, ValueError):  # unreadable: not a candidate; --resume reports it when it is chosen
            continue
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            scored.append((loss, -step, path))
    return min(scored)[2] if scored else None


def unlisted_files(folder: Path, fallback) -> list[Path]:
    """The files (and links) under ``folder`` that its manifest does not list, which train.py therefore did not
    write with it; a folder without a readable manifest: those ``fallback(relative_name)`` does not accept."""
    folder = Path(folder)
    try:
        listed = set(read_manifest(folder)["files"]) | {MANIFEST, MANIFEST + ".tmp"}
    except (OSError, ValueError):
        listed = None
    found = []
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if (path.is_file() or path.is_symlink()) and (
                name not in listed if listed is not None else not fallback(name)):
            found.append(path)
    return found


def remove_checkpoint(path: Path) -> bool:
    """Delete the checkpoint folder ``path`` (rotation), unless it holds a file its manifest does not list (put
    there by someone else, even while this run was going): then it is kept, with a warning naming the file.
    Checked just before deleting. Returns whether it was deleted."""
    foreign = unlisted_files(path, _accelerate_file)
    if foreign:
        logger.warning("checkpoint rotation kept %s: it holds %s, which its manifest does not list (train.py did not "
                       "write it), and rotation never deletes such a file; move it out, then delete the folder "
                       "yourself", path, ", ".join(p.relative_to(path).as_posix() for p in foreign[:4])
                       + f" and {len(foreign) - 4} more" * (len(foreign) > 4))
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


# the files accelerate's save_state writes: what a checkpoint folder without a manifest (an interrupted write of an
# older train.py) may hold; anything else there was put there by someone else
_ACCELERATE_FILE = re.compile(r"^(model|pytorch_model|optimizer|scheduler|sampler|random_states|custom_checkpoint"
                              r"|scaler|dl_state_dict)[\w.-]*(/[\w.-]+)*$")


def _accelerate_file(name: str) -> bool:
    return bool(_ACCELERATE_FILE.match(name))


RUN_FILES = ("config.yaml", "metrics.jsonl", "tensorboard", "checkpoints", "final", ".tmp-final", RUN_MARKER)
# what train.py deletes on train.overwrite: these entries of a run folder (other files there stay)
OVERWRITTEN = ("checkpoints", "final", ".tmp-final", "metrics.jsonl", "tensorboard")
_TMP_STEP_DIR = re.compile(r"^\.tmp-step-\d{8}$")
# the files save_pretrained writes for a model and its tokenizer: a final/ written before final/ had a manifest
_SAVE_PRETRAINED = re.compile(r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors"
                              r"|model\.safetensors\.index\.json|tokenizer(_config)?\.json|special_tokens_map\.json"
                              r"|added_tokens\.json|chat_template\.(jinja|json)|vocab\.(json|txt)|merges\.txt"
                              r"|tokenizer\.model|[\w.-]+\.py)$")


def write_run_marker(output_dir: Path) -> None:
    """Mark ``output_dir`` as a run folder of train.py, the only kind train.overwrite deletes files from."""
    (Path(output_dir) / RUN_MARKER).write_text(json.dumps({"written_by": "train.py"}) + "\n", encoding="utf-8")


def model_folder_problem(folder: Path, name: str, option: str) -> str | None:
    """Why the existing folder ``folder`` (given as ``name``) is not a model folder written by ``save_pretrained``
    (it has no config.json), beginning with ``name`` and saying what to pass instead: a training checkpoint, the
    checkpoints/ folder of a run or a run folder point to the run's ``final/`` (suggested as ``{option}PATH``, e.g.
    ``--model.pretrained=`` or ``--model ``) and to ``train.py --resume``; None when it has a config.json.
    Loading such a folder would fail with transformers' "Unrecognized model ... should have a `model_type` key"."""
    folder = Path(folder).expanduser()
    if (folder / "config.json").is_file():
        return None

    def final_of(run: Path) -> str:
        final = run / "final"
        return f"{option}{final}" + ("" if (final / "config.json").is_file() else
                                     " (it has none yet: finish the run with train.py --resume)")

    if (folder / STATE_FILE).is_file():
        run = folder.parent.parent if folder.parent.name == "checkpoints" else None
        final = final_of(run) if run is not None else "the run's final/ folder"
        return (f"{name!r} is a training checkpoint of train.py (accelerate state, no config.json), not a "
                f"save_pretrained folder: use the run's final/ model, {final}, or continue training from it with "
                f"train.py --resume {name}")
    if folder.name == "checkpoints" and list_checkpoints(folder):
        return (f"{name!r} is the checkpoints/ folder of a train.py run, not a save_pretrained folder: use the run's "
                f"final/ model, {final_of(folder.parent)}, or continue training with train.py --resume "
                f"{list_checkpoints(folder)[-1][1]}")
    if is_run_folder(folder):
        return (f"{name!r} is a run folder of train.py (checkpoints, metrics, the recipe), not a save_pretrained "
                f"folder: use its final/ model, {final_of(folder)}")
    return (f"{name!r} has no config.json; expected a folder written by save_pretrained (config.json and the "
            "weights)")


def foreign_run_entries(output_dir: Path, replaced_only: bool = False) -> list[str]:
    """The paths (relative to ``output_dir``) inside ``checkpoints/``, ``final/`` and ``tensorboard/`` that train.py
    did not write (in ``tensorboard/``: files other than TensorBoard's ``events.out.tfevents.*``),
    which train.overwrite would delete with them: entries of ``checkpoints/`` other than ``step-XXXXXXXX``,
    ``abandoned-step-XXXXXXXX`` and ``.tmp-step-XXXXXXXX`` folders, and files of a checkpoint or of ``final/`` that
    its manifest does not list (a checkpoint without a manifest: files other than those accelerate's ``save_state``
    writes; a ``final/`` without a manifest: files other than those ``save_pretrained`` writes).
    ``replaced_only``: only those that a resumed run could delete, in ``step-XXXXXXXX`` checkpoints (rotation) and
    in ``final/`` (replaced at the end)."""
    output_dir, found = Path(output_dir), []

    def unlisted(folder: Path, fallback) -> None:
        found.extend(path.relative_to(output_dir).as_posix() for path in unlisted_files(folder, fallback))

    root = output_dir / "checkpoints"
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if _STEP_DIR.match(path.name) and path.is_dir():
            unlisted(path, _accelerate_file)  # no manifest: an interrupted write of an older train.py's
        elif _ABANDONED_DIR.match(path.name) and path.is_dir():
            if not replaced_only:  # resuming never deletes them
                unlisted(path, _accelerate_file)
        elif not (_TMP_STEP_DIR.match(path.name) and path.is_dir()) and not replaced_only:
            found.append(path.relative_to(output_dir).as_posix())
    if (output_dir / "final").is_dir():
        unlisted(output_dir / "final", _save_pretrained_file)
    # TensorBoard writes only event files (in run sub-folders); anything else there is the user's
    tensorboard = output_dir / "tensorboard"
    for path in sorted(tensorboard.rglob("*")) if tensorboard.is_dir() and not replaced_only else ():
        if path.is_file() and not path.name.startswith("events.out.tfevents."):
            found.append(path.relative_to(output_dir).as_posix())
    return found


def _save_pretrained_file(name: str) -> bool:
    return "/" not in name and bool(_SAVE_PRETRAINED.match(name))


def set_aside_later_checkpoints(root: Path, step: int) -> list[tuple[Path, Path]]:
    """Rename the checkpoints under ``root`` later than ``step`` (the one a run was resumed from: they belong to
    the history that the resumed run replaces) to ``abandoned-step-XXXXXXXX`` (``-2``, ``-3``, ... when that name is
    taken), so that neither rotation nor a plain ``--resume`` takes one of them for the resumed run's newest; they
    are kept (``--resume`` one of them explicitly, or delete them) and ``train.overwrite`` deletes them with the
    other checkpoints. Returns ``(old, new)`` paths."""
    moved = []
    for later, path in list_checkpoints(root):
        if later <= step:
            continue
        target, n = root / f"abandoned-{path.name}", 1
        while target.exists():
            n += 1
            target = root / f"abandoned-{path.name}-{n}"
        path.rename(target)
        moved.append((path, target))
    if moved:
        fsync_dir(root)
    return moved


def remove_stale_tmp_checkpoints(output_dir: Path) -> None:
    """Delete ``checkpoints/.tmp-step-XXXXXXXX`` folders, left by a write that was interrupted (train.py's names
    only)."""
    root = Path(output_dir) / "checkpoints"
    for path in root.iterdir() if root.is_dir() else ():
        if _TMP_STEP_DIR.match(path.name) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def check_no_links(output_dir: Path) -> None:
    """Refuse a run folder in which a file or folder that ``train.py`` writes, deletes or replaces
    (:data:`RUN_FILES`, and the entries of ``checkpoints/``) is a symbolic link: writing in place through it would
    change (or delete) what it points to, outside the run folder. ``output_dir`` itself may be a link."""
    output_dir = Path(output_dir)
    candidates = [output_dir / name for name in RUN_FILES]
    if (output_dir / "checkpoints").is_dir() and not (output_dir / "checkpoints").is_symlink():
        candidates += sorted((output_dir / "checkpoints").iterdir())
    for path in candidates:
        if path.is_symlink():
            raise ConfigError(f"train.output_dir: {str(path)!r} is a symbolic link (to {os.readlink(path)!r}); "
                              "train.py writes its run files in place, never through a link, which would change or "
                              "delete what it points to: remove the link (copy its target there if you need it), "
                              "or choose another output_dir")


@contextlib.contextmanager
def output_lock(output_dir: Path, enabled: bool = True):
    """Hold ``output_dir/train.lock`` (this pid) while training, creating ``output_dir``: a lock whose process is
    gone is taken over, a live one is refused with :class:`ConfigError`, so two runs never share a folder."""
    lock = Path(output_dir) / LOCK
    try:
        while enabled:
            lock.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(lock, "x", encoding="utf-8") as handle:
                    handle.write(str(os.getpid()))
                break
            except FileExistsError:
                owner = lock.read_text(encoding="utf-8").strip() if lock.exists() else ""
            if _alive(owner):
                raise ConfigError(f"train.output_dir {str(output_dir)!r} is in use by another training run (pid "
                                  f"{owner or '?'}); wait for it or stop it, or delete {lock} if that is no run")
            logger.warning("taking over the stale lock %s of process %s, which is gone", lock, owner)
            lock.unlink(missing_ok=True)
    except OSError as error:
        raise ConfigError(f"train.output_dir {str(output_dir)!r} is not a writable folder: {error}") from None
    try:
        yield
    finally:
        if enabled:
            lock.unlink(missing_ok=True)


def _alive(pid: str) -> bool:
    try:
        return os.kill(int(pid), 0) is None  # raises ProcessLookupError when the process is gone
    except (ValueError, PermissionError):  # "": the lock vanished; not a pid: being written; another user's process
        return bool(pid)
    except ProcessLookupError:
        return False


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
        if check is not None:
            check(tmp)
        finalize(tmp, final, step, manifest=False)
    except CheckpointError:  # a RuntimeError, but no full disk: final/ holds a file of someone else's
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except WRITE_ERRORS as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write the final model to {str(final)!r}: {' '.join(str(error).split())}; "
                              "the checkpoints are intact: free space, then rerun with --resume") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def non_finite_weights(state_dict: dict) -> list[str]:
    """The names of the floating-point tensors of ``state_dict`` that hold a NaN or an inf."""
    return [name for name, value in state_dict.items()
            if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all())]


def non_finite_parameters(model: torch.nn.Module) -> list[str]:
    """The names of the floating-point parameters of ``model`` that hold a NaN or an inf: one reduction on the
    device and one read on the host (the names are looked up only when some parameter is not finite). For a check
    after loading a checkpoint, never in the training loop."""
    params = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
    if not params:
        return []
    device = params[0][1].device
    finite = torch.stack([p.detach().isfinite().all().to(device) for _, p in params])
    if bool(finite.all()):
        return []
    return [name for (name, _), ok in zip(params, finite.tolist()) if not ok]


def non_finite_optimizer_state(optimizer, scheduler=None, names: dict | None = None) -> list[str]:
    """What in ``optimizer``'s state (its moments, per parameter) and hyperparameters, and in ``scheduler``'s
    learning rates, is NaN or inf, e.g. ``exp_avg of model.embed_tokens.weight``, ``lr of param group 0``:
    ``names`` maps parameters to their names. One reduction on the device and one read on the host; for a check
    after loading a checkpoint, never in the training loop."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    names = names or {}
    found, tensors = [], []
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.is_floating_point():
                local = value.to_local() if hasattr(value, "to_local") else value  # an FSDP shard: this process's
                tensors.append((f"{key} of {names.get(param, 'a parameter')}", local))
    for index, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            numbers = value if isinstance(value, (tuple, list)) else [value]
            if key != "params" and any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
                found.append(f"{key} of param group {index}")
    if scheduler is not None:
        state = getattr(scheduler, "scheduler", scheduler).state_dict()
        for key in ("base_lrs", "_last_lr"):
            if any(isinstance(v, float) and not math.isfinite(v) for v in state.get(key) or ()):
                found.append(f"{key} of the learning-rate schedule")
    if tensors:
        device = tensors[0][1].device
        finite = torch.stack([t.detach().isfinite().all().to(device) for _, t in tensors])
        if not bool(finite.all()):
            found = [name for (name, _), ok in zip(tensors, finite.tolist()) if not ok] + found
    return found


def finalize(tmp: Path, final: Path, step: int, val_loss: float | None = None, manifest: bool = True) -> None:
    """Write the manifest of a fully written folder last (unless ``manifest`` is false: written already), then
    rename it into place (replacing an older one of the same name)."""
    if manifest:
        write_manifest(tmp, step, val_loss=val_loss)
    if final.exists():
        # checked just before deleting: a file put into the folder after the run started is never deleted with it
        fallback = _save_pretrained_file if final.name == "final" else _accelerate_file
        if foreign := unlisted_files(final, fallback):
            names = ", ".join(p.relative_to(final).as_posix() for p in foreign[:4]) + \
                f" and {len(foreign) - 4} more" * (len(foreign) > 4)
            raise CheckpointError(f"{str(final)!r} holds {names}, which its manifest does not list (train.py did not "
                                  "write it), so it was not replaced (nor the file deleted) and the new one was not "
                                  "saved there: move the file out, then rerun with --resume")
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(final.parent)
