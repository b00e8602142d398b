"""The one text loader of training and evaluation: local files or a folder, else a Hugging Face Hub dataset."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text"}


def local_files(source, split: str) -> list[Path] | None:
    """The files ``source`` names, or ``None`` when it names no local path (a hub dataset then)."""
    if isinstance(source, (list, tuple)):
        return [f for s in source for f in local_files(s, split) or [Path(s)]]
    path = Path(source).expanduser()
    if path.is_dir():
        candidates = [path / f"{split}{suffix}" for suffix in BUILDERS]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{path}: no file for split {split!r} (looked for "
                                    f"{', '.join(c.name for c in candidates)})")
        return [found]
    if path.is_file() or path.suffix.lower() in BUILDERS or str(source).startswith((".", "/", "~")):
        return [path]
    return None


JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}


@contextlib.contextmanager
def _quiet_json_loader():
    """Silence the ``Failed to load JSON ...`` line that datasets' JSON builder logs before raising: the error
    raised then (:func:`_json_problem`) says where the file is wrong, once."""
    quiet = logging.getLogger("datasets.packaged_modules.json.json")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        quiet.setLevel(level)


def _json_problem(file: Path, text_column: str, nulls: bool = False) -> str | None:
    """The first line of a JSON (Lines) file that is not valid JSON, or whose ``text_column`` holds a value other
    than a string (or null, or is missing, when ``nulls``), as a message; ``None`` when Python's json finds nothing
    wrong. Read only after datasets refused the file, so valid data costs no second pass."""
    text = file.read_text(encoding="utf-8")
    if file.suffix.lower() == ".json":
        try:  # one JSON document (an array of records) rather than JSON Lines
            document = json.loads(text)
        except json.JSONDecodeError as error:
            if error.msg != "Extra data":
                return f"line {error.lineno} is not valid JSON ({error.msg}, column {error.colno})"
        else:
            records = document if isinstance(document, list) else [document]
            return next(filter(None, (_record_problem(r, text_column, f"record {i}", nulls)
                                      for i, r in enumerate(records, start=1))), None)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            return f"line {number} is not valid JSON ({error.msg}, column {error.colno})"
        problem = _record_problem(record, text_column, f"line {number}", nulls)
        if problem:
            return problem
    return None


def _record_problem(record, text_column: str, where: str, nulls: bool = False) -> str | None:
    if not isinstance(record, dict):
        return f"{where} holds {JSON_TYPES.get(type(record), type(record).__name__)}, not a record (object)"
    if nulls and text_column not in record:
        return f"{where} has no field {text_column!r}"
    if nulls and record[text_column] is None:
        return f"field {text_column!r} must hold strings, got null on {where}"
    value = record.get(text_column)
    if value is not None and not isinstance(value, str):
        return (f"field {text_column!r} must hold strings, got {JSON_TYPES.get(type(value), type(value).__name__)} "
                f"({json.dumps(value)[:40]}) on {where}")
    return None


def text_problem(source, split: str, text_column: str = "text") -> str | None:
    """``FILE: line N ...``: the first record of ``source``'s local JSON (Lines) files whose ``text_column`` is not a
    string (null, missing, another type) or that is not valid JSON; ``None`` when they have none (or ``source`` is
    no local file). For a stream, which meets such a record as it is read, after its whole split was accepted."""
    try:
        files = local_files(source, split)
    except FileNotFoundError:
        return None
    for file in files or ():
        if BUILDERS.get(file.suffix.lower()) == "json" and file.is_file():
            problem = _json_problem(file, text_column, nulls=True)
            if problem:
                return f"{file}: {problem}"
    return None


def load_text_dataset(source, split: str = "train", *, text_column: str = "text", streaming: bool | None = None,
                      allow_hub: bool | None = None, cache_dir: str | os.PathLike | None = None, **hub_kwargs: Any):
    """One split of a text dataset as a ``datasets.Dataset`` (``IterableDataset`` when streaming) with a
    ``text_column`` column.

    ``source`` is one of
      * a ``.txt`` file: ONE document (its whole text, ``load_dataset("text", sample_by="document")``);
      * a ``.jsonl`` / ``.json`` file: one document per record, its text in the field ``text_column``;
      * a list of such files (concatenated in order);
      * a folder holding ``{split}.jsonl``, ``{split}.json`` or ``{split}.txt`` (e.g. ``data/default``);
      * otherwise a Hub dataset name, streamed by default (``hub_kwargs`` go to ``datasets.load_dataset``, e.g.
        ``name=`` for a configuration); refused with a clear error when ``allow_hub`` is false, which is the
        default under ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` / ``TRANSFORMERS_OFFLINE``.

    Local files load with ``streaming=bool(streaming)``; their paths are made absolute first.
    """
    import datasets

    files = local_files(source, split)
    cache = None if cache_dir is None else str(cache_dir)
    if files is not None:
        parts = []
        for file in files:
            builder = BUILDERS.get(file.suffix.lower())
            if not file.is_file():
                raise FileNotFoundError(f"{file}: no such file or folder")
            if builder is None:
                raise ValueError(f"{file}: expected one of {sorted(BUILDERS)}")
            try:  # datasets reports an empty, non-UTF-8 or malformed file obscurely or not at all
                with file.open(encoding="utf-8") as handle:
                    if not sum(1 for _ in iter(lambda: handle.read(1 << 24), "")):
                        raise ValueError(f"{file}: the file is empty")
                with _quiet_json_loader():
                    part = datasets.load_dataset(builder, data_files={split: str(file.resolve())}, split=split,
                                                 streaming=bool(streaming), cache_dir=cache,
                                                 **({"sample_by": "document"} if builder == "text" else {}))
            except UnicodeDecodeError as error:
                raise ValueError(f"{file}: not valid UTF-8 {builder} data ({error})") from None
            except datasets.exceptions.DatasetGenerationError as error:  # the file was decoded: its JSON is wrong
                problem = _json_problem(file, text_column) if builder == "json" else None
                raise ValueError(f"{file}: {problem or f'not valid {builder} data ({error.__cause__ or error})'}"
                                 ) from None
            if builder == "text" and text_column != "text":
                part = part.rename_column("text", text_column)
            if part.column_names is not None and text_column not in part.column_names:
                raise KeyError(f"{file}: no column {text_column!r} (columns: {part.column_names})")
            if part.features is not None and getattr(part.features[text_column], "dtype", None) != "string":
                problem = _json_problem(file, text_column) if builder == "json" else None
                raise ValueError(f"{file}: {problem or f'field {text_column!r} must hold strings'}")
            missing = part.data.column(text_column).null_count if isinstance(part, datasets.Dataset) else 0
            if missing:  # a record without text ({"text": null}, or the field absent), read by Arrow as null
                first = _json_problem(file, text_column, nulls=True) if builder == "json" else None
                raise ValueError(f"{file}: {first or f'field {text_column!r} must hold strings'} ({missing} "
                                 "record(s) hold null or lack it); give every record a text or remove those lines")
            parts.append(part.select_columns([text_column]) if len(files) > 1 else part)
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    if allow_hub is None:  # read now, not at import, so that a test or a launcher may set it late
        allow_hub = not any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
                            for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if not allow_hub:
        raise RuntimeError(f"{str(source)!r} is neither a local file nor a folder, and loading it as a Hugging Face "
                           f"Hub dataset is disabled (offline mode). Pass a local .jsonl/.txt file or a folder with "
                           f"{split}.jsonl, e.g. the output of `python scripts/build_data.py --out data/default`.")
    try:
        return datasets.load_dataset(str(source), split=split, streaming=True if streaming is None else streaming,
                                     cache_dir=cache, **hub_kwargs)
    except Exception as error:
        raise RuntimeError(f"could not load {str(source)!r} from the Hugging Face Hub ({type(error).__name__}: "
                           f"{error}). Without network access pass a local .jsonl/.txt file or a folder.") from error
