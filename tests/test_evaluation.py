"""helm.evaluation: windows, summed NLL and perplexity against independent computations with the models' own loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from helm.data import pack_documents
from helm.evaluation import (
    ROPE_SCALINGS, EvalError, check_model_folder, load_checkpoint, load_texts, perplexity, rows_nll, sliding_windows,
    text_perplexity, token_stream, with_rope_scaling,
)
from tests.helpers import assert_close, synthetic_text

FAMILIES = ["helm_d", "helm_mice", "llama"]


def tiny_model(tiny_config, family, tokenizer):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family, vocab_size=len(tokenizer))).eval()


def labelled(rows):
    """``[(row, column, token)]`` of every target, row by row: labels from column 1 on that are not -100."""
    scored = (rows["labels"][:, 1:] != -100).nonzero().tolist()
    return [(r, c + 1, int(rows["labels"][r, c + 1])) for r, c in scored]


@pytest.mark.parametrize("n_tokens,seq_len", [(100, 10), (99, 10), (10, 10), (9, 10), (1, 4)])
def test_packed_windows_are_the_rows_of_pack_documents(n_tokens, seq_len):
    document = torch.arange(2, 2 + n_tokens - 1)  # pack_documents appends the eos (0)
    rows = sliding_windows(torch.cat([document, torch.tensor([0])]), seq_len)
    packed = pack_documents([document.tolist()], seq_len, eos_id=0)
    assert rows["input_ids"].shape[0] == n_tokens // seq_len
    assert torch.equal(rows["input_ids"], packed["input_ids"]) and torch.equal(rows["labels"], packed["labels"])


@pytest.mark.parametrize("n_tokens,seq_len,stride", [(100, 16, 5), (100, 16, 15), (17, 16, 1), (50, 8, 3), (5, 8, 2)])
def test_sliding_windows_score_every_token_once_with_enough_context(n_tokens, seq_len, stride):
    ids = torch.arange(1000, 1000 + n_tokens)
    rows = sliding_windows(ids, seq_len, stride)
    assert rows["input_ids"].shape[1] <= seq_len
    targets = labelled(rows)
    assert [token for _, _, token in targets] == ids[1:].tolist()  # every token but the first, once, in order
    for row, column, token in targets:
        assert int(rows["input_ids"][row, column]) == token  # the label sits on its own token: shifted by one
        if row > 0:  # after the first window a target sees at least seq_len - stride tokens
            assert column >= seq_len - stride


def test_keep_last_pads_the_partial_window_without_scoring_the_padding():
    rows = sliding_windows(torch.arange(5, 105), 16, keep_last=True)
    assert rows["input_ids"].shape == (7, 16)
    assert [token for _, _, token in labelled(rows)] == [t for t in range(5, 105) if (t - 5) % 16]
    assert (rows["labels"][-1, 4:] == -100).all()


def test_bad_window_arguments_name_the_argument():
    with pytest.raises(EvalError, match="stride must lie in"):
        sliding_windows(torch.arange(100), 8, 9)
    with pytest.raises(EvalError, match="seq_len must be at least 2"):
        sliding_windows(torch.arange(100), 1)


def test_perplexity_is_exp_and_saturates():
    assert perplexity(math.log(12.5)) == pytest.approx(12.5, rel=1e-12)
    assert perplexity(1e6) == math.exp(700.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_nll_equals_the_models_loss_over_packed_rows(tiny_config, tokenizer, family):
    """The validation number of train.py: document-causal packed rows, against each row's own ``labels=`` loss."""
    model = tiny_model(tiny_config, family, tokenizer)
    texts = [text[:20 + 23 * i] for i, text in enumerate(synthetic_text(3, 12))]
    rows = pack_documents(tokenizer(texts, add_special_tokens=False)["input_ids"], 24, eos_id=tokenizer.eos_token_id,
                          mask_document_starts=True)
    assert int(rows["segment_ids"].max()) >= 1  # several documents share a row
    segments = {"segment_ids": rows["segment_ids"]} if family != "llama" else {}
    expected, n_expected = 0.0, 0
    with torch.no_grad():
        for i in range(rows["input_ids"].shape[0]):
            # no cache: with one, transformers' models would not detect the packed rows from position_ids
            extra = {key: value[i:i + 1] for key, value in segments.items()}
            out = model(input_ids=rows["input_ids"][i:i + 1], position_ids=rows["position_ids"][i:i + 1],
                        labels=rows["labels"][i:i + 1], use_cache=False, **extra)
            n = int((rows["labels"][i, 1:] != -100).sum())
            expected, n_expected = expected + float(out.loss) * n, n_expected + n
    nll, count = rows_nll(model, rows, batch_size=3)
    assert int(count) == n_expected
    assert_close(nll / count, torch.tensor(expected / n_expected, dtype=torch.float64), rtol=1e-5)
    plain, _ = rows_nll(model, rows, batch_size=3, document_attention=False)
    assert abs(float(plain - nll)) > 1e-5 * float(nll)  # attention across documents changes the numbers


def test_rows_nll_shares_rows_between_ranks(tiny_config, tokenizer):
    model = tiny_model(tiny_config, "helm_d", tokenizer)
    rows = pack_documents(tokenizer(synthetic_text(4, 40), add_special_tokens=False)["input_ids"], 16,
                          eos_id=tokenizer.eos_token_id)
    whole = rows_nll(model, rows, batch_size=4)
    parts = [rows_nll(model, rows, batch_size=2, rank=rank, world_size=3) for rank in range(3)]
    assert_close(sum(p[0] for p in parts), whole[0], rtol=1e-6)  # fp32 logits, batched differently
    assert sum(p[1] for p in parts) == whole[1]


def test_stride_scoring_equals_full_scoring_when_one_window_covers_the_text(tiny_config, tokenizer):
    model = tiny_model(tiny_config, "helm_mice", tokenizer)
    ids = token_stream(synthetic_text(5, 4), tokenizer, eos_id=tokenizer.eos_token_id)
    with torch.no_grad():
        full = float(model(input_ids=ids[None], labels=ids[None]).loss) * (ids.numel() - 1)
    for stride in (1, 7, ids.numel()):
        nll, count = rows_nll(model, sliding_windows(ids, ids.numel(), stride))
        assert int(count) == ids.numel() - 1
        assert_close(nll, torch.tensor(full, dtype=torch.float64), rtol=1e-5)


def test_stride_one_is_the_strict_sliding_window(tiny_config, tokenizer):
    """Stride 1: every token after the first window is scored with exactly seq_len - 1 tokens of context."""
    model = tiny_model(tiny_config, "helm_d", tokenizer)
    ids = token_stream(synthetic_text(6, 3), tokenizer, eos_id=tokenizer.eos_token_id)[:30]
    seq_len = 8
    nll, count = rows_nll(model, sliding_windows(ids, seq_len, 1), batch_size=5)
    expected = 0.0
    with torch.no_grad():
        for t in range(1, ids.numel()):
            logits = model(input_ids=ids[None, max(0, t - seq_len + 1):t]).logits[0, -1].double()
            expected -= float(torch.log_softmax(logits, -1)[ids[t]])
    assert int(count) == ids.numel() - 1
    assert_close(nll, torch.tensor(expected, dtype=torch.float64), rtol=1e-5)


def test_text_perplexity_is_exp_of_the_mean_loss_over_packed_rows(tiny_config, tokenizer):
    model = tiny_model(tiny_config, "llama", tokenizer)
    texts = synthetic_text(7, 30)
    result = text_perplexity(model, tokenizer, texts, seq_len=20, batch_size=3)
    rows = pack_documents(tokenizer(texts, add_special_tokens=False)["input_ids"], 20, eos_id=tokenizer.eos_token_id)
    with torch.no_grad():
        losses = torch.stack([model(input_ids=row[None], labels=row[None]).loss for row in rows["input_ids"]])
    assert result["windows"] == len(losses) and result["scored_tokens"] == len(losses) * 19
    assert result["perplexity"] == pytest.approx(float(losses.double().mean().exp()), rel=1e-5)
    with pytest.raises(EvalError, match="do not combine with stride"):
        text_perplexity(model, tokenizer, texts, seq_len=20, stride=5, document_attention=True)


def test_load_texts_reads_jsonl_records_and_drops_empty_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    records = [{"text": "first one"}, {"text": "  "}, {"text": "second"}, {"text": "third"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert load_texts(path) == ["first one", "second", "third"]
    assert load_texts(str(path), max_documents=2) == ["first one", "second"]
    (tmp_path / "test.jsonl").write_text(path.read_text())
    assert load_texts(tmp_path, "test") == ["first one", "second", "third"]  # a folder of splits
    with pytest.raises(EvalError, match="text file not found: .*nope.jsonl"):
        load_texts(tmp_path / "nope.jsonl")
    with pytest.raises(EvalError, match="text_column='body'"):
        load_texts(path, text_column="body")


def test_load_texts_reads_txt_files_as_one_document_each(tmp_path):
    """Needs the ``helm.data`` loader of issue 10 (lists of files; a ``.txt`` file is one document)."""
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_text("line one\nline two\n")
    files[1].write_text("another\n")
    assert load_texts(files) == ["line one\nline two\n", "another\n"]


def test_check_model_folder_names_the_option_and_the_path(tmp_path):
    """A missing folder, a file, a folder without config.json or without tokenizer files: an EvalError naming the
    option and the path, before any weights load; a hub id is left to from_pretrained."""
    with pytest.raises(EvalError, match=r"--model '.*missing': no such folder"):
        check_model_folder(str(tmp_path / "missing"))
    with pytest.raises(EvalError, match=r"--model '.*missing'"):
        load_checkpoint(tmp_path / "missing")
    with pytest.raises(EvalError, match=r"--model '.*': holds none of config\.json"):
        check_model_folder(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(EvalError, match=r"--model.*tokenizer\.json"):
        check_model_folder(tmp_path)
    with pytest.raises(EvalError, match=r"--model '.*config\.json': is a file"):
        check_model_folder(tmp_path / "config.json")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert check_model_folder(tmp_path) == (str(tmp_path), str(tmp_path))
    assert check_model_folder("owner/model") == ("owner/model", "owner/model")


@pytest.mark.parametrize("family", ["helm_d", "helm_mice", "llama"])
def test_with_rope_scaling_rebuilds_the_same_weights_with_each_scaling(tiny_config, tokenizer, family):
    model = tiny_model(tiny_config, family, tokenizer)
    ids = torch.randint(3, len(tokenizer), (1, 48), generator=torch.Generator().manual_seed(0))
    assert with_rope_scaling(model, "yarn", 1, 16) is model and with_rope_scaling(model, "none", 4, 16) is model
    with torch.no_grad():
        plain = model(ids).logits
        for scaling in [s for s in ROPE_SCALINGS if s != "none" and not (s == "resonance" and family == "llama")]:
            scaled = with_rope_scaling(model, scaling, 3, 16)
            params = scaled.config.rope_parameters
            assert params["rope_type"] == ("default" if scaling == "resonance" else scaling)
            assert params.get("resonance", False) == (scaling == "resonance")
            # dynamic NTK reads the training length from max_position_embeddings, the others get factor x it
            assert scaled.config.max_position_embeddings == (16 if scaling == "dynamic" else 48)
            state = scaled.state_dict()
            assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
            assert not torch.allclose(scaled(ids).logits, plain), scaling  # 48 > 16 positions: a different encoding
    if family == "llama":
        with pytest.raises(EvalError, match="resonance"):
            with_rope_scaling(model, "resonance", 2, 16)
    with pytest.raises(EvalError, match="rope scaling must be one of"):
        with_rope_scaling(model, "ntk", 2, 16)


def test_with_rope_scaling_refuses_an_encoding_without_rope_frequencies(tiny_config, tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("helm_d", vocab_size=len(tokenizer), positional="alibi"))
    with pytest.raises(EvalError, match="linear scaling: rope_parameters"):
        with_rope_scaling(model, "linear", 2, 16)
