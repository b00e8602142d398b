"""Training data: tokenizer, train/validation splits, packed rows in memory (:class:`PackedRows`, reshuffled every
epoch) and streamed rows (:class:`StreamRows`, this process's shard of a stream, in order)."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets.distributed import split_dataset_by_node

from ..data import iter_packed, load_text_dataset, pack_rows, tokenize
from .config import ConfigError, DataConfig


def looks_local(name: str) -> bool:
    """Whether ``name`` means a local path (existing, or written like one) rather than a hub repository id."""
    path = Path(name).expanduser()
    return (path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1
            or path.suffix.lower() in (".json", ".jsonl", ".txt"))


def load_tokenizer(name: str):
    """A tokenizer from a local folder or a hub name; :class:`ConfigError` naming ``data.tokenizer`` otherwise."""
    from transformers import AutoTokenizer

    local = looks_local(name)
    if local and not Path(name).expanduser().is_dir():
        raise ConfigError(f"data.tokenizer: no such directory {name!r}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(Path(name).expanduser()) if local else name)
    except (OSError, ValueError) as error:
        where = "local folder" if local else "local folder, nor loadable from the Hugging Face Hub"
        raise ConfigError(f"data.tokenizer: {name!r} is not a usable {where}: {error}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"data.tokenizer: {name!r} has no eos token, which packing puts after every document")
    return tokenizer


def _load_split(data: DataConfig, split: str, streaming: bool, key: str):
    kwargs = {"name": data.dataset_config} if data.dataset_config else {}
    try:
        return load_text_dataset(data.dataset, split, text_column=data.text_column, streaming=streaming, **kwargs)
    except (FileNotFoundError, KeyError, RuntimeError, ValueError) as error:
        raise ConfigError(f"{key}: {error.args[0] if isinstance(error, KeyError) else error}") from None


def load_splits(data: DataConfig, *, rank: int = 0, world_size: int = 1):
    """``(train, validation, streaming)`` datasets; streamed training data is sharded between processes.

    Without a validation split, the first ``holdout_documents`` training documents are the validation set.
    """
    streaming = data.streaming if data.streaming is not None else not looks_local(data.dataset)
    train = _load_split(data, data.train_split, streaming, "data.dataset")
    if data.validation_split is not None:
        validation = _load_split(data, data.validation_split, streaming, "data.validation_split")
    elif streaming:
        validation, train = train.take(data.holdout_documents), train.skip(data.holdout_documents)
    elif data.holdout_documents >= len(train):
        raise ConfigError(f"data.holdout_documents={data.holdout_documents} would hold out all {len(train)} "
                          "training documents")
    else:
        validation = train.select(range(data.holdout_documents))
        train = train.select(range(data.holdout_documents, len(train)))
    if streaming and world_size > 1:
        train = split_dataset_by_node(train, rank=rank, world_size=world_size)
    return train, validation, streaming


def _token_lists(dataset, tokenizer, data: DataConfig):
    return (row["input_ids"] for row in tokenize(dataset, tokenizer, text_column=data.text_column))


def pack_split(dataset, tokenizer, data: DataConfig, max_rows: int | None = None) -> dict[str, torch.Tensor]:
    """A dataset (or its first ``max_rows`` rows, for validation) packed into ``[N, seq_len]`` tensors."""
    return pack_rows(_token_lists(dataset, tokenizer, data), data.seq_len, eos_id=tokenizer.eos_token_id,
                     max_rows=max_rows, mask_document_starts=data.mask_document_starts)


class PackedRows:
    """In-memory rows, visited in a fresh seeded permutation every epoch; addressed by global row index.

    Row ``i`` of the endless training stream is row ``perm_e[i mod N]`` of epoch ``e = i // N``, so any process
    can fetch any slice of the stream without reading the rest, and resuming needs only the step.
    """

    def __init__(self, rows: dict[str, torch.Tensor], *, seed: int, shuffle: bool):
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.n = rows["input_ids"].shape[0]
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.n

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n, generator=generator) if self.shuffle else torch.arange(self.n)
            self._epoch = epoch
        return self._perm

    def take(self, start: int, count: int) -> dict[str, torch.Tensor]:
        index = torch.stack([self._permutation(i // self.n)[i % self.n] for i in range(start, start + count)])
        return {key: value[index] for key, value in self.rows.items()}


class StreamRows:
    """Rows packed on the fly from this process's shard of a streamed dataset, in order, restarting at its end."""

    def __init__(self, dataset, tokenizer, data: DataConfig, *, skip_rows: int = 0):
        self.dataset, self.tokenizer, self.data = dataset, tokenizer, data
        self.epoch, self.consumed = 0, 0
        self._rows = self._open()
        for _ in range(skip_rows):  # resuming a stream re-reads it up to the saved position
            self._next()

    def _open(self):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        return iter_packed(_token_lists(self.dataset, self.tokenizer, self.data), self.data.seq_len,
                           eos_id=self.tokenizer.eos_token_id, mask_document_starts=self.data.mask_document_starts)

    def _next(self) -> dict[str, torch.Tensor]:
        row = next(self._rows, None)
        if row is None:
            if self.consumed == 0:
                raise ConfigError(f"data.dataset: {self.data.dataset!r} yields no complete row of "
                                  f"data.seq_len={self.data.seq_len} tokens")
            self.epoch += 1
            self._rows = self._open()
            row = next(self._rows)
        self.consumed += 1
        return row

    def next(self, count: int) -> dict[str, torch.Tensor]:
        rows = [self._next() for _ in range(count)]
        return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}
