"""eval/perplexity.py: windows, equivalence with a plain ``model(w, labels=w).loss`` evaluation, CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import EVAL_DIR, load_script

perplexity = load_script("perplexity")


def load(folder):
    import helm  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def read_texts(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("n_tokens,seq_len", [(100, 10), (99, 10), (10, 10), (9, 10), (1, 4)])
def test_packed_windows_are_the_rows_of_pack_documents(n_tokens, seq_len):
    from helm.data import pack_documents

    ids = torch.arange(2, 2 + n_tokens - 1)  # one document; pack_documents appends the eos (0)
    stream = torch.cat([ids, torch.tensor([0])])
    rows = pack_documents([ids.tolist()], seq_len, eos_id=0)["input_ids"]
    windows = perplexity.make_windows(n_tokens, seq_len)
    assert len(windows) == rows.shape[0] == n_tokens // seq_len
    for w, row in zip(windows, rows, strict=True):
        assert torch.equal(stream[w.begin:w.end], row)
        assert w.first_scored == w.begin + 1 and w.n_scored == seq_len - 1


def test_sliding_windows_score_every_token_once():
    for n_tokens, seq_len, stride in [(100, 16, 5), (100, 16, 15), (17, 16, 1), (50, 8, 3), (5, 8, 2)]:
        windows = perplexity.make_windows(n_tokens, seq_len, stride, keep_last=True)
        scored = [t for w in windows for t in range(w.first_scored, w.end)]
        assert scored == list(range(1, n_tokens)), (n_tokens, seq_len, stride)
        assert all(w.end - w.begin <= seq_len for w in windows)
        # after the first window, every target has at least seq_len - stride tokens of context
        assert all(w.first_scored - w.begin >= seq_len - stride for w in windows[1:])
    packed = perplexity.make_windows(100, 16, keep_last=True)  # packed rows: the first token of each is context
    assert [t for w in packed for t in range(w.first_scored, w.end)] == [t for t in range(100) if t % 16]


def test_bad_window_arguments_are_clear_errors():
    with pytest.raises(perplexity.EvalError, match="--stride"):
        perplexity.make_windows(100, 8, 9)
    with pytest.raises(perplexity.EvalError, match="--seq-len"):
        perplexity.make_windows(100, 1)


@pytest.mark.parametrize("kind", ["helm_d", "helm_mice", "llama"])
def test_mean_nll_equals_plain_loss_over_the_same_windows(make_checkpoint, text_file, kind):
    """The number train.py reports as validation loss: mean of ``model(w, labels=w).loss`` over packed rows."""
    from helm.data import pack_documents

    model, tok = load(make_checkpoint(kind))
    texts = read_texts(text_file)
    seq_len = 24
    result = perplexity.perplexity(model, tok, texts, seq_len=seq_len, batch_size=3, progress=False)
    rows = pack_documents(tok(texts, add_special_tokens=False)["input_ids"], seq_len, eos_id=tok.eos_token_id)
    with torch.no_grad():
        losses = [float(model(input_ids=row[None], labels=row[None]).loss) for row in rows["input_ids"]]
    plain = sum(losses) / len(losses)
    assert result["windows"] == len(losses) and result["scored_tokens"] == len(losses) * (seq_len - 1)
    assert abs(result["mean_nll"] - plain) <= 1e-5 * plain
    assert result["perplexity"] == pytest.approx(torch.tensor(plain).exp().item(), rel=1e-5)
    assert abs(perplexity.mean_nll_of_rows(model, rows["input_ids"], batch_size=4) - plain) <= 1e-5 * plain


@pytest.mark.parametrize("kind", ["helm_d", "helm_mice"])
def test_padded_batches_give_the_same_nll(make_checkpoint, text_file, kind):
    """A trailing short window and overlapping windows are right-padded in a batch; batch size must not matter."""
    model, tok = load(make_checkpoint(kind))
    texts = read_texts(text_file)
    for stride in (None, 7):
        one = perplexity.perplexity(model, tok, texts, seq_len=20, stride=stride, keep_last=True, batch_size=1,
                                    progress=False)
        four = perplexity.perplexity(model, tok, texts, seq_len=20, stride=stride, keep_last=True, batch_size=4,
                                     progress=False)
        unscored = one["windows"] if stride is None else 1  # packed: each window's first token is context
        assert one["scored_tokens"] == four["scored_tokens"] == one["stream_tokens"] - unscored
        assert abs(one["mean_nll"] - four["mean_nll"]) <= 1e-5 * one["mean_nll"]


def test_stride_one_is_the_strict_sliding_window(make_checkpoint, text_file):
    """With stride 1 every token after the first window is scored with exactly seq_len - 1 tokens of context."""
    model, tok = load(make_checkpoint("helm_d"))
    ids = perplexity.token_stream(read_texts(text_file)[:1], tok, eos_id=tok.eos_token_id)[:30]
    seq_len = 8
    windows = perplexity.make_windows(ids.numel(), seq_len, 1)
    nll, count = perplexity.window_nll(model, ids, windows, batch_size=5, progress=False)
    expected = 0.0
    with torch.no_grad():
        for t in range(1, ids.numel()):
            context = ids[max(0, t - (seq_len - 1)):t]
            logits = model(input_ids=context[None]).logits[0, -1].double()
            expected -= float(torch.log_softmax(logits, -1)[ids[t]])
    assert count == ids.numel() - 1
    assert abs(nll - expected) <= 1e-5 * expected


def test_cli_writes_result_json_and_reports_missing_inputs(make_checkpoint, text_file, offline_env, tmp_path):
    folder = make_checkpoint("helm_d")
    out = tmp_path / "ppl.json"
    cmd = [sys.executable, str(EVAL_DIR / "perplexity.py"), "--model", f"tiny={folder}", "--files", str(text_file),
           "--seq-len", "24", "--batch-size", "2", "--output", str(out)]
    proc = subprocess.run(cmd, env=offline_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["model_name"] == "tiny"
    [(task, result)] = record["results"].items()
    assert task == "perplexity:heldout"
    model, tok = load(folder)
    direct = perplexity.perplexity(model, tok, read_texts(text_file), seq_len=24, progress=False)
    assert result["mean_nll"] == pytest.approx(direct["mean_nll"], rel=1e-6)
    assert f"perplexity={result['perplexity']:.3f}" in proc.stdout
    assert "perplexity" in proc.stderr  # the tqdm progress bar

    missing = subprocess.run([*cmd[:3], str(tmp_path / "no-such-checkpoint"), *cmd[4:]], env=offline_env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "checkpoint not found" in missing.stderr
    no_file = subprocess.run([*cmd[:5], str(tmp_path / "missing.txt"), *cmd[6:]], env=offline_env,
                             capture_output=True, text=True, timeout=300)
    assert no_file.returncode == 2 and "text file not found" in no_file.stderr
    assert "Traceback" not in missing.stderr + no_file.stderr


def test_datasets_split_gives_the_same_result_as_the_files(make_checkpoint, text_file, tmp_path):
    """``--dataset`` goes through ``datasets.load_dataset``; a local folder of jsonl splits needs no network."""
    folder = make_checkpoint("helm_mice")
    data_dir = tmp_path / "ds"
    data_dir.mkdir()
    (data_dir / "test.jsonl").write_text(text_file.read_text())
    (data_dir / "train.jsonl").write_text(json.dumps({"text": "not this one"}) + "\n")
    common = ["--model", str(folder), "--seq-len", "24", "--no-progress"]
    from_files = perplexity.main([*common, "--files", str(text_file)])
    from_dataset = perplexity.main([*common, "--dataset", str(data_dir), "--split", "test",
                                    "--output", str(tmp_path / "r.json")])
    [files_result] = from_files["results"].values()
    [(task, dataset_result)] = from_dataset["results"].items()
    assert task == f"perplexity:{data_dir}/test"
    assert dataset_result["mean_nll"] == files_result["mean_nll"] and dataset_result["scored_tokens"] > 1000
    with pytest.raises(perplexity.EvalError, match="exactly one of --files and --dataset"):
        perplexity.main(common)


def segment_by_segment_nll(model, rows) -> tuple[float, int]:
    """Reference for document attention: every document segment of a row run through the model on its own.

    The target at column ``t + 1`` is predicted from column ``t``, whose segment alone is visible to it.
    """
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, docs in zip(rows["input_ids"], rows["document_ids"], strict=True):
            for doc in docs.unique().tolist():
                cols = (docs == doc).nonzero().flatten()
                a, b = int(cols[0]), int(cols[-1]) + 1
                logprobs = torch.log_softmax(model(input_ids=ids[None, a:b]).logits[0].double(), -1)
                for t in range(a, min(b, ids.numel() - 1)):
                    total -= float(logprobs[t - a, ids[t + 1]])
                    count += 1
    return total, count


@pytest.mark.parametrize("kind", ["helm_d", "helm_mice", "llama"])
def test_document_attention_sees_one_document_at_a_time(make_checkpoint, text_file, kind):
    from helm.data import pack_documents

    model, tok = load(make_checkpoint(kind))
    texts = [t[: 40 + 37 * i] for i, t in enumerate(read_texts(text_file)[:6])]  # several documents per row
    rows = pack_documents(tok(texts, add_special_tokens=False)["input_ids"], 40, eos_id=tok.eos_token_id)
    assert int(rows["document_ids"].max()) >= 1
    expected, n = segment_by_segment_nll(model, rows)
    result = perplexity.perplexity(model, tok, texts, seq_len=40, batch_size=2, document_attention=True,
                                   progress=False)
    assert result["scored_tokens"] == n
    assert abs(result["mean_nll"] - expected / n) <= 1e-5 * expected / n
    plain = perplexity.perplexity(model, tok, texts, seq_len=40, batch_size=2, progress=False)
    assert abs(plain["mean_nll"] - result["mean_nll"]) > 1e-4  # crossing documents does change the numbers


@pytest.mark.parametrize("mask_document_starts", [False, True])
def test_document_attention_equals_train_validation_loss(make_checkpoint, text_file, mask_document_starts):
    """The validation loss of train.py's own evaluation function on the same rows."""
    training = pytest.importorskip("helm.training", reason="train.py's helpers are not in this checkout")
    from helm.data import pack_documents

    model, tok = load(make_checkpoint("helm_mice"))
    texts = read_texts(text_file)
    rows = pack_documents(tok(texts, add_special_tokens=False)["input_ids"], 32, eos_id=tok.eos_token_id,
                          mask_document_starts=mask_document_starts)
    val_loss = training.evaluate(model, rows, batch_size=4, accepts_segment_ids=True, device="cpu")
    result = perplexity.perplexity(model, tok, texts, seq_len=32, batch_size=3, document_attention=True,
                                   mask_document_starts=mask_document_starts, progress=False)
    assert abs(result["mean_nll"] - val_loss) <= 1e-5 * val_loss
    assert result["perplexity"] == pytest.approx(training.perplexity(val_loss), rel=1e-4)
