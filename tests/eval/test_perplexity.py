"""eval/perplexity.py on saved checkpoints: the numbers against independent computations, result files, CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helm.data import pack_documents
from helm.evaluation import EvalError, rows_nll
from tests.eval.script_loader import EVAL_DIR, load_script
from tests.helpers import assert_close

perplexity = load_script("perplexity")


def load(folder):
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def read_texts(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def run(folder, data, *options) -> dict:
    [result] = perplexity.main(["--model", str(folder), "--files", str(data), "--no-progress", *options])[
        "results"].values()
    return result


@pytest.mark.parametrize("kind", ["helm_d", "helm_mice", "llama"])
def test_mean_nll_equals_the_plain_loss_over_packed_rows(make_checkpoint, text_file, kind):
    """The default windows are pack_documents' rows: the mean of ``model(row, labels=row).loss`` over them."""
    folder = make_checkpoint(kind)
    result = run(folder, text_file, "--seq-len", "24", "--batch-size", "3")
    model, tok = load(folder)
    rows = pack_documents(tok(read_texts(text_file), add_special_tokens=False)["input_ids"], 24,
                          eos_id=tok.eos_token_id)
    with torch.no_grad():
        losses = torch.stack([model(input_ids=row[None], labels=row[None]).loss for row in rows["input_ids"]])
    assert result["windows"] == len(losses) and result["scored_tokens"] == len(losses) * 23
    assert_close(torch.tensor(result["mean_nll"]), losses.double().mean(), rtol=1e-5)
    assert_close(torch.tensor(result["perplexity"]), losses.double().mean().exp(), rtol=1e-5)


@pytest.mark.parametrize("kind", ["helm_d", "helm_mice"])
def test_padded_batches_give_the_same_nll(make_checkpoint, text_file, kind):
    """A trailing short window and overlapping windows are right-padded in a batch; batch size must not matter."""
    folder = make_checkpoint(kind)
    for stride in ("20", "7"):
        common = ("--seq-len", "20", "--stride", stride, "--keep-last")
        one, four = (run(folder, text_file, *common, "--batch-size", size) for size in ("1", "4"))
        unscored = one["windows"] if stride == "20" else 1  # packed: each window's first token is context only
        assert one["scored_tokens"] == four["scored_tokens"] == one["stream_tokens"] - unscored
        assert_close(torch.tensor(four["mean_nll"]), torch.tensor(one["mean_nll"]), rtol=1e-5)


def test_stream_options_cut_the_token_stream(make_checkpoint, text_file):
    folder = make_checkpoint("helm_d")
    _, tok = load(folder)
    documents = tok(read_texts(text_file), add_special_tokens=False)["input_ids"]
    n_tokens = sum(map(len, documents))
    assert run(folder, text_file, "--seq-len", "16", "--keep-last")["stream_tokens"] == n_tokens + len(documents)
    assert run(folder, text_file, "--seq-len", "16", "--keep-last", "--no-eos")["stream_tokens"] == n_tokens
    assert run(folder, text_file, "--seq-len", "16", "--max-tokens", "100")["windows"] == 6
    assert run(folder, text_file, "--seq-len", "16", "--max-windows", "3")["scored_tokens"] == 3 * 15


def test_bad_stride_is_a_clear_error(make_checkpoint, text_file):
    with pytest.raises(EvalError, match="stride.*17"):
        run(make_checkpoint("helm_d"), text_file, "--seq-len", "16", "--stride", "17")
    with pytest.raises(EvalError, match="fewer than one window"):
        run(make_checkpoint("helm_d"), text_file, "--seq-len", "16", "--max-tokens", "10")


def segment_by_segment_nll(model, rows) -> tuple[float, int]:
    """Reference for document attention: every document segment of a row run through the model on its own.

    The target at column ``t + 1`` is predicted from column ``t``, whose segment alone is visible to it.
    """
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, docs in zip(rows["input_ids"], rows["segment_ids"], strict=True):
            for doc in docs.unique().tolist():
                cols = (docs == doc).nonzero().flatten()
                a, b = int(cols[0]), int(cols[-1]) + 1
                logprobs = torch.log_softmax(model(input_ids=ids[None, a:b]).logits[0].double(), -1)
                for t in range(a, min(b, ids.numel() - 1)):
                    total -= float(logprobs[t - a, ids[t + 1]])
                    count += 1
    return total, count


@pytest.mark.parametrize("kind", ["helm_d", "helm_mice", "llama"])
def test_document_attention_sees_one_document_at_a_time(make_checkpoint, text_file, tmp_path, kind):
    folder = make_checkpoint(kind)
    model, tok = load(folder)
    texts = [t[: 40 + 37 * i] for i, t in enumerate(read_texts(text_file)[:6])]  # several documents per row
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    rows = pack_documents(tok(texts, add_special_tokens=False)["input_ids"], 40, eos_id=tok.eos_token_id)
    assert int(rows["segment_ids"].max()) >= 1
    expected, n = segment_by_segment_nll(model, rows)
    result = run(folder, short, "--seq-len", "40", "--batch-size", "2", "--document-attention")
    assert result["scored_tokens"] == n and result["document_attention"]
    assert_close(torch.tensor(result["mean_nll"]), torch.tensor(expected / n), rtol=1e-5)
    plain = run(folder, short, "--seq-len", "40", "--batch-size", "2")
    assert abs(plain["mean_nll"] - result["mean_nll"]) > 1e-4  # crossing documents does change the numbers


@pytest.mark.parametrize("mask_document_starts", [False, True])
def test_document_attention_reproduces_the_training_validation_loss(make_checkpoint, text_file, mask_document_starts):
    """train.py validates with ``rows_nll`` on the first ``train.eval_rows`` rows of ``pack_documents``."""
    folder = make_checkpoint("helm_mice")
    model, tok = load(folder)
    rows = pack_documents(tok(read_texts(text_file), add_special_tokens=False)["input_ids"], 32,
                          eos_id=tok.eos_token_id, mask_document_starts=mask_document_starts)
    rows = {key: value[:5] for key, value in rows.items()}
    nll, count = rows_nll(model, rows, batch_size=4)
    options = ["--mask-document-starts"] if mask_document_starts else []
    result = run(folder, text_file, "--seq-len", "32", "--batch-size", "3", "--document-attention",
                 "--max-windows", "5", *options)
    assert result["windows"] == 5 and result["scored_tokens"] == int(count)
    assert_close(torch.tensor(result["mean_nll"]), nll / count, rtol=1e-5)
    assert (int(count) < 5 * 31) == mask_document_starts


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
    assert result["mean_nll"] == pytest.approx(run(folder, text_file, "--seq-len", "24")["mean_nll"], rel=1e-6)
    assert f"perplexity={result['perplexity']:.3f}" in proc.stdout
    assert "perplexity" in proc.stderr  # the tqdm progress bar

    missing = subprocess.run([*cmd[:3], str(tmp_path / "no-such-checkpoint"), *cmd[4:]], env=offline_env,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and re.search(r"error: --model '.*no-such-checkpoint'", missing.stderr)
    no_file = subprocess.run([*cmd[:5], str(tmp_path / "missing.txt"), *cmd[6:]], env=offline_env,
                             capture_output=True, text=True, timeout=300)
    assert no_file.returncode == 2 and "error: text file not found" in no_file.stderr
    assert "Traceback" not in missing.stderr + no_file.stderr


def test_a_folder_of_splits_gives_the_same_result_as_the_file(make_checkpoint, text_file, tmp_path):
    """``--dataset`` takes what ``helm.data.load_text_dataset`` takes; a folder of jsonl splits needs no network."""
    folder = make_checkpoint("helm_mice")
    data_dir = tmp_path / "ds"
    data_dir.mkdir()
    (data_dir / "test.jsonl").write_text(text_file.read_text())
    (data_dir / "train.jsonl").write_text(json.dumps({"text": "not this one"}) + "\n")
    from_file = run(folder, text_file, "--seq-len", "24")
    record = perplexity.main(["--model", str(folder), "--dataset", str(data_dir), "--split", "test", "--seq-len", "24",
                              "--no-progress"])
    [(task, from_folder)] = record["results"].items()
    assert task == "perplexity:ds/test"
    assert from_folder["mean_nll"] == from_file["mean_nll"] and from_folder["scored_tokens"] > 1000
