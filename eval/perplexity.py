#!/usr/bin/env python
"""Sliding-window perplexity of a causal LM over local text files or a ``datasets`` split.

Works for any checkpoint that ``AutoModelForCausalLM`` loads: our HELM models (``import helm`` registers
them) and Euclidean baselines such as ``LlamaForCausalLM``.

How the text becomes windows
----------------------------
Every document is tokenized without special tokens and followed by the eos token, and the documents are
concatenated into one token stream: the packing convention of ``helm.data.pack_documents`` (and of
``train.py``). The stream is then cut into windows of ``--seq-len`` tokens that start every ``--stride``
tokens:

* ``--stride`` equal to ``--seq-len`` (the default) gives packed, non-overlapping windows: exactly the rows
  of ``pack_documents``, the trailing partial row dropped (``--keep-last`` keeps it). Every token but the
  first of each window is scored, so the mean NLL equals the mean of ``model(w, labels=w).loss`` over the
  windows ``w``: the number ``train.py`` reports as validation loss on the same text and ``seq_len``.
* a smaller stride gives overlapping windows: each window scores only the tokens that no earlier window
  scored, with the rest of the window as context (every token after the first window sees at least
  ``seq_len - stride`` tokens of context). ``--stride 1`` scores each token with exactly ``seq_len - 1``
  tokens of context, the strict sliding window.

Attention inside a window crosses document boundaries, as in plain ``model(input_ids)``. With
``--document-attention`` (packed windows only) each token attends only to its own document and positions
restart at every document, like ``train.py``'s training and validation batches: the rows, positions and
document ids come from ``helm.data.pack_documents``; HELM models get the document ids as ``segment_ids``, and
``transformers``' own models recognise packed rows from the restarting ``position_ids``.
``--mask-document-starts`` drops the targets at document starts (``data.mask_document_starts`` of
``train.py``) and ``--max-windows`` keeps the first N windows (``train.eval_rows``).

Usage::

    python eval/perplexity.py --model runs/helm-d --files data/validation.jsonl --seq-len 512
    python eval/perplexity.py --model runs/helm-d --dataset wikitext --dataset-config wikitext-2-raw-v1 \\
        --split test --seq-len 1024 --stride 512 --output results/helm-d-wikitext.json

Output: the perplexity on stdout, and with ``--output`` a JSON result file that ``eval/compare.py`` reads.

From Python (``eval`` is not a package: load this file by path with ``importlib.util.spec_from_file_location``):
``perplexity(model, tokenizer, texts, seq_len=...)`` returns the numbers above; ``rows_nll(model, rows)``
scores the output of ``helm.data.pack_documents`` as it is, and ``mean_nll_of_rows(model, input_ids)`` any
packed ``[N, L]`` ids with plain attention.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from _shared import (  # noqa: E402
    EvalError,
    add_text_arguments,
    default_device,
    load_model,
    load_tokenizer,
    model_max_length,
    parse_named,
    run_main,
    text_label,
    texts_from_args,
    write_json,
)


# ----------------------------------------------------------------------------------------------------------
# text -> token stream -> windows


def token_stream(texts: list[str], tokenizer, *, eos_id: int | None = None) -> torch.Tensor:
    """``[T]`` ids: each document tokenized without special tokens, followed by ``eos_id`` (if not None)."""
    ids: list[int] = []
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    for doc in encoded:
        ids.extend(doc)
        if eos_id is not None:
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` of the stream; targets are the tokens at ``first_scored .. end-1``.

    The token at ``begin`` is never a target (nothing precedes it in the window), so ``first_scored >= begin+1``.
    """

    begin: int
    end: int
    first_scored: int

    @property
    def n_scored(self) -> int:
        return self.end - self.first_scored


def make_windows(n_tokens: int, seq_len: int, stride: int | None = None, *, keep_last: bool = False) -> list[Window]:
    """Windows over a stream of ``n_tokens`` tokens (see the module docstring).

    ``stride = seq_len`` (default): consecutive non-overlapping windows; the trailing partial window is
    dropped unless ``keep_last``. ``stride < seq_len``: windows start at ``0, stride, 2·stride, ...`` until
    one reaches the end of the stream, and each scores only the tokens after the previous window's end.
    """
    stride = seq_len if stride is None else stride
    if seq_len < 2:
        raise EvalError(f"--seq-len must be at least 2 (one context token and one target), got {seq_len}")
    if not 1 <= stride <= seq_len:
        raise EvalError(f"--stride must lie in [1, seq_len={seq_len}], got {stride}")
    windows: list[Window] = []
    if stride == seq_len:
        for begin in range(0, n_tokens, seq_len):
            end = min(begin + seq_len, n_tokens)
            if end - begin == seq_len or (keep_last and end - begin >= 2):
                windows.append(Window(begin, end, begin + 1))
        return windows
    scored_until = 1  # the stream's first token is never a target
    for begin in range(0, max(n_tokens - 1, 1), stride):
        end = min(begin + seq_len, n_tokens)
        if end - begin >= 2:
            windows.append(Window(begin, end, max(scored_until, begin + 1)))
            scored_until = end
        if end == n_tokens:
            break
    return windows


# ----------------------------------------------------------------------------------------------------------
# scoring


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, windows: list[Window], *, batch_size: int = 1,
               progress: bool = True, desc: str = "perplexity") -> tuple[float, int]:
    """Summed NLL (nats) of the scored tokens of ``windows`` and their number.

    Windows of one batch are right-padded to the longest; the padding is masked out of attention and never
    scored (a causal model cannot see right padding anyway). The log-softmax is taken in fp32 and summed in
    fp64.
    """
    device = next(model.parameters()).device
    total, count = 0.0, 0
    batches = [windows[i:i + batch_size] for i in range(0, len(windows), batch_size)]
    for batch in tqdm(batches, desc=desc, unit="batch", disable=not progress):
        width = max(w.end - w.begin for w in batch)
        input_ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)
        for row, w in enumerate(batch):
            n = w.end - w.begin
            input_ids[row, :n] = ids[w.begin:w.end]
            mask[row, :n] = 1
            lo = w.first_scored - w.begin
            targets[row, lo:n] = ids[w.first_scored:w.end]
        padded = bool((mask == 0).any())
        out = model(input_ids=input_ids.to(device), attention_mask=mask.to(device) if padded else None,
                    use_cache=False)
        # logits at position t predict the token at t+1
        logits = out.logits[:, :-1].float()
        labels = targets[:, 1:].to(device)
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                ignore_index=-100, reduction="sum")
        total += float(nll.double())
        count += int((labels != -100).sum())
    return total, count


@torch.no_grad()
def rows_nll(model, rows: dict, *, batch_size: int = 1, document_attention: bool = True, progress: bool = True,
             desc: str = "perplexity") -> tuple[float, int]:
    """Summed NLL and number of targets of packed rows (``helm.data.pack_documents`` output, all ``[N, L]``).

    Targets are ``rows["labels"]`` shifted by one (``-100`` is skipped). With ``document_attention`` the model
    also gets ``position_ids`` and, if its ``forward`` takes them, ``segment_ids = document_ids``, so no token
    attends across a document boundary (``train.py``'s batches); otherwise only ``input_ids``.
    """
    device = next(model.parameters()).device
    takes_segments = "segment_ids" in inspect.signature(model.forward).parameters
    total, count = 0.0, 0
    starts = range(0, rows["input_ids"].shape[0], batch_size)
    for start in tqdm(starts, desc=desc, unit="batch", disable=not progress):
        batch = {key: value[start:start + batch_size].to(device) for key, value in rows.items()}
        inputs = {"input_ids": batch["input_ids"]}
        if document_attention:
            inputs["position_ids"] = batch["position_ids"]
            if takes_segments:
                inputs["segment_ids"] = batch["document_ids"]
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()
        labels = batch["labels"][:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                ignore_index=-100, reduction="sum")
        total += float(nll.double())
        count += int((labels != -100).sum())
    return total, count


def mean_nll_of_rows(model, input_ids: torch.Tensor, *, batch_size: int = 8, progress: bool = False) -> float:
    """Mean token NLL of packed ids ``[N, L]`` with plain attention and ``labels = input_ids``.

    Equals the mean of ``model(row, labels=row).loss`` over the rows (every row has ``L - 1`` targets).
    """
    rows = {"input_ids": input_ids, "labels": input_ids}
    nll, count = rows_nll(model, rows, batch_size=batch_size, document_attention=False, progress=progress)
    return nll / count


def perplexity(model, tokenizer, texts: list[str], *, seq_len: int, stride: int | None = None,
               batch_size: int = 1, keep_last: bool = False, max_tokens: int | None = None,
               max_windows: int | None = None, add_eos: bool = True, document_attention: bool = False,
               mask_document_starts: bool = False, progress: bool = True) -> dict:
    """Mean token NLL and perplexity of ``model`` on ``texts`` (see the module docstring for the windows)."""
    eos_id = tokenizer.eos_token_id if add_eos else None
    if add_eos and eos_id is None:
        raise EvalError("the tokenizer has no eos token to separate documents; pass --no-eos")
    if document_attention or mask_document_starts:
        if stride not in (None, seq_len) or keep_last or max_tokens is not None or not add_eos:
            raise EvalError("--document-attention / --mask-document-starts score packed rows: they do not combine "
                            "with --stride, --keep-last, --max-tokens or --no-eos")
        from helm.data import pack_documents

        token_lists = tokenizer(texts, add_special_tokens=False)["input_ids"]
        rows = pack_documents(token_lists, seq_len, eos_id=eos_id, mask_document_starts=mask_document_starts)
        rows = {key: value[:max_windows] for key, value in rows.items()}
        n_windows, stream_tokens = rows["input_ids"].shape[0], sum(len(t) + 1 for t in token_lists)
        if n_windows == 0:
            raise EvalError(f"the text has {stream_tokens} tokens, fewer than one window of --seq-len {seq_len}")
        nll, count = rows_nll(model, rows, batch_size=batch_size, document_attention=document_attention,
                              progress=progress)
    else:
        ids = token_stream(texts, tokenizer, eos_id=eos_id)
        if max_tokens is not None:
            ids = ids[:max_tokens]
        windows = make_windows(ids.numel(), seq_len, stride, keep_last=keep_last)[:max_windows]
        if not windows:
            raise EvalError(f"the text has {ids.numel()} tokens, fewer than one window of --seq-len {seq_len}; "
                            "use more text, a shorter --seq-len, or --keep-last")
        nll, count = window_nll(model, ids, windows, batch_size=batch_size, progress=progress)
        n_windows, stream_tokens = len(windows), int(ids.numel())
    mean = nll / count
    return {"mean_nll": mean, "perplexity": math.exp(mean), "bits_per_token": mean / math.log(2),
            "scored_tokens": count, "stream_tokens": stream_tokens, "windows": n_windows,
            "seq_len": seq_len, "stride": stride or seq_len, "document_attention": document_attention}


# ----------------------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="See the module docstring (top of this file) for how windows are built.")
    parser.add_argument("--model", required=True, metavar="[NAME=]PATH",
                        help="checkpoint folder (save_pretrained) or hub id; NAME labels the result")
    parser.add_argument("--tokenizer", metavar="PATH", help="tokenizer folder if not saved with the model")
    add_text_arguments(parser)
    parser.add_argument("--seq-len", type=int, metavar="L",
                        help="window length in tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--stride", type=int, metavar="S", help="window start spacing (default: --seq-len)")
    parser.add_argument("--keep-last", action="store_true", help="also score the trailing partial window")
    parser.add_argument("--no-eos", action="store_true", help="do not put an eos token after each document")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="use only the first N tokens of the stream")
    parser.add_argument("--max-windows", type=int, metavar="N", help="score only the first N windows")
    parser.add_argument("--document-attention", action="store_true",
                        help="packed rows with attention and positions restricted to each document (train.py)")
    parser.add_argument("--mask-document-starts", action="store_true",
                        help="no targets at document starts (train.py's data.mask_document_starts)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default=None, help=f"torch device (default: {default_device()})")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or auto")
    parser.add_argument("--label", help="task name in the result file (default: derived from the text source)")
    parser.add_argument("--output", metavar="JSON", help="write the result here (the format eval/compare.py reads)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    name, path = parse_named(args.model)
    texts = texts_from_args(args)
    tokenizer = load_tokenizer(args.tokenizer or path)
    model = load_model(path, device=args.device, dtype=args.dtype)
    seq_len = args.seq_len or model_max_length(model)
    result = perplexity(model, tokenizer, texts, seq_len=seq_len, stride=args.stride, batch_size=args.batch_size,
                        keep_last=args.keep_last, max_tokens=args.max_tokens, max_windows=args.max_windows,
                        add_eos=not args.no_eos, document_attention=args.document_attention,
                        mask_document_starts=args.mask_document_starts, progress=not args.no_progress)
    task = f"perplexity:{args.label or text_label(args)}"
    print(f"{name}  {task}  seq_len={result['seq_len']} stride={result['stride']}  tokens={result['scored_tokens']}  "
          f"mean NLL={result['mean_nll']:.4f}  perplexity={result['perplexity']:.3f}")
    record = {"model_name": name, "model_path": path, "source": "eval/perplexity.py",
              "results": {task: result},
              "config": {k: v for k, v in vars(args).items() if k not in ("model",)}}
    if args.output:
        write_json(args.output, record)
    return record


if __name__ == "__main__":
    run_main(main)
