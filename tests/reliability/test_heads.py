"""The task heads' losses where every target is ignored: 0 with zero gradients, as the causal-LM head's (Llama:
``0/0 = NaN``, which poisons a training step), on HELM-D and on HELM-MiCE with HMLA and with MHA attention. Targets
of the wrong shape, dtype or range are torch's and transformers' to report, as for Llama."""

import functools

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from tests.helpers import tiny_config

FAMILIES = {"helm_d": ("helm_d", {}), "helm_mice-hmla": ("helm_mice", {"attention_type": "hmla"}),
            "helm_mice-mha": ("helm_mice", {"attention_type": "mha"})}
HEADS = {"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification,
         "qa": AutoModelForQuestionAnswering}
B, T = 2, 4


@functools.lru_cache(maxsize=None)
def head(family: str, task: str, num_labels: int):
    name, overrides = FAMILIES[family]
    torch.manual_seed(0)
    return HEADS[task].from_config(tiny_config(name, num_labels=num_labels, pad_token_id=0, **overrides)).eval()


def ids():
    return torch.randint(2, 100, (B, T), generator=torch.Generator().manual_seed(0))


def labels(*values, dtype=None):
    return torch.tensor(values, dtype=dtype)


# (case, head, targets whose every entry is ignored)
ALL_IGNORED = [
    ("token", "token", dict(labels=labels([-100] * T, [-100] * T))),
    ("sequence", "sequence", dict(labels=labels(-100, -100))),
    ("qa", "qa", dict(start_positions=labels(T, T), end_positions=labels(T, T))),
    ("causal-lm", "causal-lm", dict(labels=labels([-100] * T, [-100] * T))),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case, task, targets", ALL_IGNORED, ids=[c[0] for c in ALL_IGNORED])
def test_targets_all_ignored_give_a_zero_loss_as_the_causal_lm_head(family, case, task, targets):
    """Re-probe 9 K052 / K053: every target ignored (-100; a position equal to T) gave ``0/0 = NaN`` (Llama: the
    same), which poisons a training step. Each head now gives what the causal-LM head gives there: 0, with zero
    gradients."""
    if task == "causal-lm":
        name, overrides = FAMILIES[family]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(name, **overrides)).eval()
    else:
        model = head(family, task, 3)
        model.config.problem_type = None
    model.zero_grad()
    loss = model(ids(), **targets).loss
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(not bool(p.grad.any()) for p in model.parameters() if p.grad is not None)
