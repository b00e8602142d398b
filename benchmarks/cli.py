"""Argument checks and inputs shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, so this folder
is on ``sys.path``)."""

import argparse

import torch

from helm.data import pack_documents


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """``args.device`` as a device, after exiting 2 (one line naming the option) when it cannot run: ``--device cuda``
    without a CUDA device, or ``--dtype bf16`` on a GPU without bf16; applies ``--threads``."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: --device cuda, but torch {torch.__version__} sees no CUDA device "
                       "(torch.cuda.is_available() is False)\n")
    if args.device == "cuda" and args.dtype == "bf16" and not torch.cuda.is_bf16_supported():
        parser.exit(2, f"{parser.prog}: error: --dtype bf16, but {torch.cuda.get_device_name()} has no bf16\n")
    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.device(args.device)


def packed_batch(batch_size: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of random documents (lengths 20–400 tokens) packed like train.py packs real text."""
    g = torch.Generator().manual_seed(seed)
    docs, total = [], 0
    while total < batch_size * seq_len:
        n = int(torch.randint(20, 400, (), generator=g))
        docs.append(torch.randint(2, vocab, (n,), generator=g).tolist())
        total += n + 1
    rows = pack_documents(docs, seq_len, eos_id=0)
    return {k: v[:batch_size] for k, v in rows.items()}
