"""Training data: tokenizer, train/validation splits, packed rows in memory (:class:`PackedRows`, reshuffled every
epoch) or streamed (:class:`StreamRows`, this process's shard of a stream, in order), and the DataLoader that
hands this process its micro-batches in training order (:func:`training_batches`)."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator

import torch
from datasets.distributed import split_dataset_by_node
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ..data import iter_packed, load_text_dataset, looks_local, pack_rows, tokenize
from ..data.loading import local_files
from ..data.paths import TOKENIZER_FILES, check_path
from .config import ConfigError, DataConfig


def load_tokenizer(name: str, trust_remote_code: bool = False):
    """A tokenizer from a local folder or a hub name; :class:`ConfigError` naming ``data.tokenizer`` otherwise.

    ``trust_remote_code`` (the recipe's ``model.trust_remote_code``) is always passed: left unset, transformers
    would ask on a terminal whether to run the code a ``tokenizer_config.json`` names in its ``auto_map``."""
    from transformers import AutoTokenizer

    name = check_path(name, "data.tokenizer", ConfigError, needs=TOKENIZER_FILES, hub=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        hint = "; pass --model.trust_remote_code=true to run its code, if you trust it" * (
            "trust_remote_code" in str(error))
        raise ConfigError(f"data.tokenizer {name!r}: {' '.join(str(error).split())}{hint}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"data.tokenizer {name!r} has no eos token, which packing puts after every document")
    return tokenizer


def data_fingerprint(data: DataConfig, tokenizer) -> dict:
    """What defines the training and validation streams beyond the recipe's data keys (which ``--resume`` compares
    itself), for it to refuse another stream: each local data file's size and SHA-256 and a hash of the tokenizer
    (its serialised vocabulary and rules, and its special tokens)."""
    from ..manifest import hash_file

    files = {}
    for split in dict.fromkeys(s for s in (data.train_split, data.validation_split) if s is not None):
        try:
            found = local_files(data.dataset, split)
        except (FileNotFoundError, ValueError):  # reported by load_splits, with its key
            found = None
        for path in found or ():
            if path.is_file():
                digest, size = hash_file(path)
                files[str(path.resolve())] = {"bytes": size, "sha256": digest}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return {"files": files, "tokenizer": hashlib.sha256((vocabulary + specials).encode()).hexdigest()}


def fingerprint_differences(saved: dict | None, current: dict) -> list[str]:
    """What differs between two :func:`data_fingerprint` s, one entry each: the data files added, removed or
    changed, or the other keys (nothing for a checkpoint without one)."""
    if not saved:
        return []
    files = {**saved.get("files", {}), **current.get("files", {})}
    changed = [f"data file {name}" for name in sorted(files)
               if saved.get("files", {}).get(name) != current.get("files", {}).get(name)]
    keys = sorted(set(current) - {"files"})
    return changed + [key for key in keys if saved.get(key) != current.get(key)]


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
        if (files := local_files(data.dataset, data.train_split)) == local_files(data.dataset, data.validation_split) \
                and files is not None:  # a file has no named splits: it would be read for both
            raise ConfigError(f"data.validation_split {data.validation_split!r} reads the training data itself "
                              f"({', '.join(map(str, files))}); set data.validation_split=null and "
                              "data.holdout_documents=N to validate on N documents held out of it")
    elif streaming:
        validation, train = train.take(data.holdout_documents), train.skip(data.holdout_documents)
    else:
        if data.holdout_documents >= len(train):  # a .txt file is one document
            raise ConfigError(f"data.holdout_documents={data.holdout_documents} leaves no training document: "
                              f"data.dataset {data.dataset!r} holds {len(train)}; hold out fewer, or give a "
                              "validation file (a folder with train and validation files)")
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


class PackedRows(Dataset):
    """In-memory rows as the endless training stream, addressed by global row index, one epoch after another,
    each visited in a fresh seeded permutation.

    Row ``i`` of the stream is row ``perm_e[i mod N]`` of epoch ``e = i // N``, so any process (or DataLoader
    worker) can fetch any row of the stream without reading the rest, and resuming needs only the step.
    ``len()`` is ``N``, the rows of one epoch.
    """

    def __init__(self, rows: dict[str, torch.Tensor], *, seed: int, shuffle: bool = True):
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

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self._permutation(index // self.n)[index % self.n]
        return {key: value[row] for key, value in self.rows.items()}


class StepRows(Sampler[int]):
    """The global row indices one process reads, in training order, from ``start_step`` to ``max_steps``.

    A step reads ``G = batch_size x world_size x grad_accum`` rows of the stream: step ``s`` rows
    ``[s·G, (s+1)·G)``, micro-batch ``m`` of process ``r`` the ``batch_size`` rows from
    ``s·G + (m·world_size + r)·batch_size``. So the rows of a step do not depend on how it is split between
    processes and micro-batches, and the data position is the step.
    """

    def __init__(self, *, start_step: int, max_steps: int, batch_size: int, grad_accum: int, rank: int = 0,
                 world_size: int = 1):
        self.steps = range(start_step, max_steps)
        self.batch_size, self.grad_accum, self.rank, self.world_size = batch_size, grad_accum, rank, world_size

    def __iter__(self) -> Iterator[int]:
        per_step = self.batch_size * self.world_size * self.grad_accum
        for step in self.steps:
            for micro in range(self.grad_accum):
                first = step * per_step + (micro * self.world_size + self.rank) * self.batch_size
                yield from range(first, first + self.batch_size)

    def __len__(self) -> int:
        return len(self.steps) * self.grad_accum * self.batch_size


class StreamRows(IterableDataset):
    """Rows packed on the fly from this process's shard of a streamed dataset, in order, restarting at its end
    (endless), the first ``skip_rows`` skipped. Tokenising and packing happen where it is iterated: in a
    DataLoader worker when there is one, else in the DataLoader's iterator, never in the training step."""

    def __init__(self, dataset, tokenizer, data: DataConfig, *, skip_rows: int = 0):
        self.dataset, self.tokenizer, self.data, self.skip_rows = dataset, tokenizer, data, skip_rows

    def _epoch(self, epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        self.dataset.set_epoch(epoch)  # a streamed datasets.IterableDataset
        return iter_packed(_token_lists(self.dataset, self.tokenizer, self.data), self.data.seq_len,
                           eos_id=self.tokenizer.eos_token_id, mask_document_starts=self.data.mask_document_starts)

    def _rows(self) -> Iterator[dict[str, torch.Tensor]]:
        for epoch in itertools.count():
            empty = True
            try:
                for row in self._epoch(epoch):
                    empty = False
                    yield row
            except ValueError as error:  # a record whose text is not a string, met as the stream is read
                raise ConfigError(f"data.dataset {self.data.dataset!r}: {error}") from None
            if empty:
                raise ConfigError(f"data.dataset: {self.data.dataset!r} yields no complete row of "
                                  f"data.seq_len={self.data.seq_len} tokens")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        # resuming a stream re-reads it up to the saved position
        return itertools.islice(self._rows(), self.skip_rows, None)


def training_batches(rows: PackedRows | StreamRows, *, start_step: int, max_steps: int, batch_size: int,
                     grad_accum: int, rank: int = 0, world_size: int = 1, num_workers: int = 0,
                     pin_memory: bool = False) -> DataLoader:
    """The DataLoader of this process's micro-batches (``[batch_size, seq_len]`` tensors) from ``start_step`` on,
    ``grad_accum`` per step, in training order.

    Workers keep the order: in-memory rows are fetched by index (:class:`StepRows`) and handed out in sampler
    order; a stream is read by one worker at most, since its rows can only be packed in sequence (and it is
    endless: the caller takes what it needs). ``pin_memory``
    (for CUDA) lets the training step copy batches to the device without blocking.
    """
    # A DataLoader draws its workers' base seed from its generator, by default torch's global one, which the
    # checkpoint restores: drawn there, it would shift every later random number of a resumed run.
    options = dict(batch_size=batch_size, pin_memory=pin_memory, generator=torch.Generator())
    if isinstance(rows, StreamRows):  # this process's shard, read again up to where start_step begins
        rows = StreamRows(rows.dataset, rows.tokenizer, rows.data, skip_rows=start_step * grad_accum * batch_size)
        return DataLoader(rows, num_workers=min(num_workers, 1), **options)
    sampler = StepRows(start_step=start_step, max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum,
                       rank=rank, world_size=world_size)
    return DataLoader(rows, sampler=sampler, num_workers=num_workers, **options)
