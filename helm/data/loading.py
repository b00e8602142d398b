"""The one text loader of training and evaluation: local files or a folder, else a Hugging Face Hub dataset."""

from __future__ import annotations

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
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise FileNotFoundError(f"{path}: no file for split {split!r} (looked for "
                                    f"{', '.join(c.name for c in candidates)})")
        if len(found) > 1:  # reading either one alone would drop the other without a word
            raise ValueError(f"{path}: split {split!r} is ambiguous: {' and '.join(c.name for c in found)}; "
                             "keep one")
        return found
    if path.is_file() or path.suffix.lower() in BUILDERS or str(source).startswith((".", "/", "~")):
        return [path]
    return None


def load_text_dataset(source, split: str = "train", *, text_column: str = "text", streaming: bool | None = None,
                      cache_dir: str | os.PathLike | None = None, **hub_kwargs: Any):
    """One split of a text dataset as a ``datasets.Dataset`` (``IterableDataset`` when streaming) with a
    ``text_column`` column.

    ``source`` is one of
      * a ``.txt`` file: ONE document (its whole text, ``load_dataset("text", sample_by="document")``);
      * a ``.jsonl`` / ``.json`` file: one document per record, its text in the field ``text_column``;
      * a list of such files (concatenated in order);
      * a folder holding ``{split}.jsonl``, ``{split}.json`` or ``{split}.txt`` (e.g. ``data/default``);
      * otherwise a Hub dataset name, streamed by default (``hub_kwargs`` go to ``datasets.load_dataset``, e.g.
        ``name=`` for a configuration); a failure to load it (offline, no such dataset) is a RuntimeError naming
        it.

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
            if file.stat().st_size == 0:  # datasets would read it as no documents, without a word
                raise ValueError(f"{file}: the file is empty")
            try:
                part = datasets.load_dataset(builder, data_files={split: str(file.resolve())}, split=split,
                                             streaming=bool(streaming), cache_dir=cache,
                                             **({"sample_by": "document"} if builder == "text" else {}))
            except (UnicodeDecodeError, datasets.exceptions.DatasetGenerationError) as error:
                raise ValueError(f"{file}: not valid {builder} data ({error.__cause__ or error})") from None
            if builder == "text" and text_column != "text":
                part = part.rename_column("text", text_column)
            if part.column_names is not None and text_column not in part.column_names:
                raise KeyError(f"{file}: no column {text_column!r} (columns: {part.column_names})")
            nulls = part.data.column(text_column).null_count if isinstance(part, datasets.Dataset) else 0
            if nulls or part.features is not None and getattr(part.features[text_column], "dtype", None) != "string":
                raise ValueError(f"{file}: field {text_column!r} must hold strings ({nulls} record(s) hold null or "
                                 "lack it)" if nulls else f"{file}: field {text_column!r} must hold strings")
            parts.append(part.select_columns([text_column]) if len(files) > 1 else part)
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    try:  # offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), datasets refuses a name it has not cached
        return datasets.load_dataset(str(source), split=split, streaming=True if streaming is None else streaming,
                                     cache_dir=cache, **hub_kwargs)
    except Exception as error:
        raise RuntimeError(f"could not load {str(source)!r} from the Hugging Face Hub ({type(error).__name__}: "
                           f"{error}); without network access pass a local .jsonl/.txt file or a folder, e.g. "
                           "`python scripts/build_data.py --out data/default`") from None
