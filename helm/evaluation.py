"""Scoring text with a causal LM: token streams, windows, summed NLL and perplexity.

``train.py`` reports validation perplexity with :func:`rows_nll` and the ``eval/`` scripts build on the same
functions, so a number printed during training and one printed by ``eval/perplexity.py`` on the same rows
are the same computation.

Conventions: targets are ``labels`` shifted by one (``-100`` is never scored); log-softmax in fp32, sums in
fp64; packed rows (``helm.data`` output: ``input_ids``, ``labels``, ``position_ids``, ``document_ids``, all
``[N, L]``) are scored with document-causal attention, so no token sees another document.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Callable, Optional

import torch

__all__ = ["packed_inputs", "perplexity", "rows_nll", "shifted_nll"]


def perplexity(mean_nll: float) -> float:
    """``exp(mean NLL)``, saturating instead of overflowing for a diverged model."""
    return math.exp(min(float(mean_nll), 700.0))


def packed_inputs(model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward kwargs of a packed batch with document-causal attention.

    HELM models take ``segment_ids`` (document ids); ``transformers``' own models detect packed rows from
    ``position_ids`` restarting at 0 with no attention mask, which gives the same attention pattern.
    """
    inputs = {"input_ids": batch["input_ids"]}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
    if "document_ids" in batch and "segment_ids" in inspect.signature(model.forward).parameters:
        inputs["segment_ids"] = batch["document_ids"]
    return inputs


def shifted_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL (fp64) of ``labels[:, 1:]`` under ``logits[:, :-1]`` (fp32 log-softmax) and the target count."""
    logits = logits[:, :-1].float()
    targets = labels[:, 1:].to(logits.device)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            ignore_index=-100, reduction="sum")
    return nll.double(), (targets != -100).sum().double()


@torch.no_grad()
def rows_nll(model, rows: dict[str, torch.Tensor], *, batch_size: int = 8, document_attention: bool = True,
             rank: int = 0, world_size: int = 1, autocast: Optional[Callable] = None, progress: bool = False,
             desc: str = "perplexity") -> tuple[torch.Tensor, torch.Tensor]:
    """Summed NLL and number of scored targets over packed ``rows``, as fp64 tensors on the model's device.

    Each process scores every ``world_size``-th row starting at ``rank``; the caller sums the two tensors
    across processes (``accelerator.reduce``) and divides. ``document_attention=False`` feeds ``input_ids``
    alone (plain causal attention over the whole row). ``autocast`` is a context-manager factory (e.g.
    ``accelerator.autocast``). The model is put in eval mode and restored.
    """
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    mine = torch.arange(rank, rows["input_ids"].shape[0], world_size)
    for start in tqdm(range(0, mine.numel(), batch_size), desc=desc, unit="batch", disable=not progress):
        batch = {key: value[mine[start:start + batch_size]].to(device) for key, value in rows.items()}
        inputs = packed_inputs(model, batch) if document_attention else {"input_ids": batch["input_ids"]}
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits = model(**inputs, use_cache=False).logits
        nll, n = shifted_nll(logits, batch["labels"])
        total += nll
        count += n
    model.train(was_training)
    return total, count
