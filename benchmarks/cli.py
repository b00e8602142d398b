"""Argument checks shared by the benchmark scripts (run as ``python benchmarks/<script>.py``, so this folder is on
``sys.path``)."""

import argparse

import torch


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
