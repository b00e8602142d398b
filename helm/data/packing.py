"""Document packing: documents back to back, each followed by eos, cut into rows of ``seq_len`` tokens.

Not the paper's recipe (App. C: 2048-token samples with the tails dropped, packed at ratio 3, right-padded, BOS
first): no tail is dropped, a document crossing a row boundary continues in the next row; eos (what ``generate``
stops on) ends each document. Only the last partial row is dropped.

Every row comes with, all ``[N, L]`` int64, named as the HELM models' forward takes them (``model(**rows)``):

* ``segment_ids``: 0, 1, 2, ... per document *segment* of the row (a document crossing a row boundary starts
  again at 0 in the next row); attention restricted to equal ids, and causal, never crosses documents.
* ``position_ids``: restart at 0 at every segment start, so they never exceed ``L - 1``.
* ``labels``: equal to ``input_ids`` (the model shifts them): the eos is a target, and the eos position predicts
  the next document's first token from its own document only, which is how generation starts a new document.
  ``mask_document_starts=True`` sets ``-100`` on segment starts after column 0 instead.
* ``attention_mask``: all ones (the rows hold no padding), for models that expect one.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import torch


def _pack_flat(tokens: list[int], owner: list[int], seq_len: int, *,
               mask_document_starts: bool) -> dict[str, torch.Tensor]:
    """Cut ``tokens [T]`` (eos included; ``owner [T]`` = document index of each token) into rows, the last partial
    one dropped."""
    n_rows = len(tokens) // seq_len
    input_ids = torch.tensor(tokens[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)
    docs = torch.tensor(owner[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    columns = torch.arange(seq_len).expand(n_rows, seq_len)
    # The running maximum of "column where the current segment began" turns columns into in-segment offsets.
    begin = torch.where(starts, columns, torch.zeros_like(columns)).cummax(dim=1).values
    labels = input_ids.clone()
    if mask_document_starts:
        labels[starts & (columns > 0)] = -100
    return {"input_ids": input_ids, "labels": labels, "segment_ids": torch.cumsum(starts.long(), dim=1) - 1,
            "position_ids": columns - begin, "attention_mask": torch.ones_like(input_ids)}


def _packed_chunks(token_id_lists: Iterable[Sequence[int]], seq_len: int, *, eos_id: int, mask_document_starts: bool,
                   rows_per_chunk: float) -> Iterator[dict[str, torch.Tensor]]:
    """The rows of the documents, read lazily, ``[n, L]`` tensors of about ``rows_per_chunk`` rows at a time."""
    tokens: list[int] = []
    owners: list[int] = []
    for index, ids in enumerate(token_id_lists):
        tokens.extend(ids)
        tokens.append(eos_id)
        owners.extend(itertools.repeat(index, len(ids) + 1))
        if len(tokens) >= rows_per_chunk * seq_len:
            # Global document indices survive the cut: a document running into the next chunk stays one document.
            n = len(tokens) // seq_len * seq_len
            yield _pack_flat(tokens[:n], owners[:n], seq_len, mask_document_starts=mask_document_starts)
            del tokens[:n], owners[:n]
    yield _pack_flat(tokens, owners, seq_len, mask_document_starts=mask_document_starts)


def pack_documents(token_id_lists: Iterable[Sequence[int]], seq_len: int, *, eos_id: int,
                   mask_document_starts: bool = False) -> dict[str, torch.Tensor]:
    """Pack tokenised documents (without eos; empty ones allowed) into rows (see the module docstring).

    Returns ``input_ids, labels, segment_ids, position_ids, attention_mask``, each ``[N, seq_len]`` int64 with
    ``N = floor(T / seq_len)`` for ``T`` tokens including the eos tokens.
    """
    return next(_packed_chunks(token_id_lists, seq_len, eos_id=eos_id, mask_document_starts=mask_document_starts,
                               rows_per_chunk=math.inf))


def iter_packed(token_id_lists: Iterable[Sequence[int]], seq_len: int, *, eos_id: int,
                mask_document_starts: bool = False, rows_per_chunk: int = 256) -> Iterator[dict[str, torch.Tensor]]:
    """The rows of :func:`pack_documents` one at a time (``[L]`` tensors), reading documents lazily (streams)."""
    for rows in _packed_chunks(token_id_lists, seq_len, eos_id=eos_id, mask_document_starts=mask_document_starts,
                               rows_per_chunk=rows_per_chunk):
        for i in range(rows["input_ids"].shape[0]):
            yield {key: value[i] for key, value in rows.items()}


def tokenize(dataset, tokenizer, *, text_column: str = "text"):
    """``dataset`` (``Dataset`` or ``IterableDataset``) mapped to one ``input_ids`` list per document, no special
    tokens, with ``datasets.map(batched=True)`` (lazily for streams)."""
    def encode(batch):
        texts = batch[text_column]
        if bad := [text for text in texts if not isinstance(text, str)]:  # a stream is checked here, as it is read
            raise ValueError(f"field {text_column!r} must hold strings, got a record with {bad[0]!r}")
        return {"input_ids": tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]}

    import datasets

    kwargs = {} if isinstance(dataset, datasets.IterableDataset) else {"keep_in_memory": True}
    return dataset.map(encode, batched=True, remove_columns=dataset.column_names, **kwargs)


def pack_rows(token_id_lists: Iterable[Sequence[int]], seq_len: int, *, eos_id: int, max_rows: int | None = None,
              mask_document_starts: bool = False) -> dict[str, torch.Tensor]:
    """:func:`pack_documents`, or only its first ``max_rows`` rows read lazily (``{}`` when there are none)."""
    rows = next(_packed_chunks(token_id_lists, seq_len, eos_id=eos_id, mask_document_starts=mask_document_starts,
                               rows_per_chunk=math.inf if max_rows is None else max_rows))
    rows = {key: value[:max_rows] for key, value in rows.items()}
    return rows if max_rows is None or len(rows["input_ids"]) else {}


def packed_inputs(model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward kwargs of packed rows (``[B, L]`` tensors) with document-causal attention.

    HELM models take the rows' ``segment_ids`` (document index within the row); ``transformers``' own models,
    whose forward has no ``segment_ids``, detect packed rows from ``position_ids`` restarting at 0 with no
    attention mask, which gives the same attention pattern.
    """
    inputs = {"input_ids": batch["input_ids"]}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    if "segment_ids" in batch and "segment_ids" in inspect.signature(model.forward).parameters:
        inputs["segment_ids"] = batch["segment_ids"]
    return inputs
