"""Probe 8, X002/X008/X014 and X003/X009/X015: the task heads refuse targets their loss cannot use with a
ValueError naming them and the expected shape, dtype or range, where torch failed deep in the loss (``IndexError:
Target 5 is out of bounds``, ``Expected input batch_size (4) to match target batch_size (3)``, BCE's dtype error) or
MSE broadcast silently. Every case runs on HELM-D and on HELM-MiCE with HMLA and with MHA attention.

The table states, for each case, the head, the config's ``num_labels`` / ``problem_type``, the targets, and the
message fragment (None: accepted, with a finite loss). Sequence classification checks the targets for the problem
type its loss will use (``config.problem_type``, else transformers' inference from ``num_labels`` and the labels'
dtype).

Re-probe 9 (K052/K127/K202, K053/K128/K203, K054/K129/K204): every target ignored gave a NaN loss, now 0 as the
causal-LM head's; answer positions outside ``[0, T]`` were clamped without a word, now a ValueError.
"""

import functools
import math

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
SINGLE = "single_label_classification"
MULTI = "multi_label_classification"


@functools.lru_cache(maxsize=None)
def head(family: str, task: str, num_labels: int):
    name, overrides = FAMILIES[family]
    torch.manual_seed(0)
    return HEADS[task].from_config(tiny_config(name, num_labels=num_labels, pad_token_id=0, **overrides)).eval()


def ids():
    return torch.randint(2, 100, (B, T), generator=torch.Generator().manual_seed(0))


def labels(*values, dtype=None):
    return torch.tensor(values, dtype=dtype)


# (case id, head, num_labels, problem_type (None: inferred), targets, message fragment or None when accepted)
TARGETS = [
    # single-label sequence classification: X002 / X008 / X014 ("IndexError: Target 5 is out of bounds.")
    ("seq label >= num_labels", "sequence", 3, None, dict(labels=labels(1, 5)),
     r"^labels must lie in \[0, num_labels=3\) or equal -100 \(ignored\); got values in \[5, 5\] "
     r"\(problem_type='single_label_classification', inferred from num_labels=3"),
    ("seq label < 0", "sequence", 3, SINGLE, dict(labels=labels(-1, 2)),
     r"^labels must lie in \[0, num_labels=3\) .*got values in \[-1, -1\] \(problem_type='single_label_classification'\)"),
    ("seq labels of another batch", "sequence", 3, None, dict(labels=labels(1, 2, 0)),
     r"^labels must be \[B\] = \[2\] \(or \[B, 1\]\), got \(3,\) \(problem_type='single_label_classification'"),
    ("seq labels int32", "sequence", 3, None, dict(labels=labels(1, 2, dtype=torch.int32)),
     r"^labels must be an int64 tensor of class indices, got torch.int32 .*convert it with labels.long\(\)"),
    ("seq single-label float", "sequence", 3, SINGLE, dict(labels=labels(1.0, 2.0, dtype=torch.float32)),
     r"^labels must be an int64 tensor of class indices, got torch.float32"),
    ("seq label ignored", "sequence", 3, None, dict(labels=labels(1, -100)), None),
    ("seq labels [B, 1]", "sequence", 3, None, dict(labels=labels([1], [2])), None),
    # re-probe 9 K052: every label -100 gave a NaN loss (0/0); now 0, as the causal-LM head
    ("seq labels all ignored", "sequence", 3, None, dict(labels=labels(-100, -100)), None),
    # multi-label: BCE needs floating [B, num_labels] targets in [0, 1]
    ("multi uint8 (inferred)", "sequence", 3, None, dict(labels=labels([1, 0, 1], [0, 1, 1], dtype=torch.uint8)),
     r"^labels must be a floating-point tensor .*got torch.uint8 \(problem_type='multi_label_classification', "
     r"inferred from num_labels=3 and the labels' dtype torch.uint8"),
    ("multi int64 (set)", "sequence", 3, MULTI, dict(labels=labels([1, 0, 1], [0, 1, 1])),
     r"^labels must be a floating-point tensor .*got torch.int64 \(problem_type='multi_label_classification'\)"),
    ("multi [B]", "sequence", 3, None, dict(labels=labels(1.0, 2.0)),
     r"^labels must be \[B, num_labels\] = \[2, 3\], got \(2,\) \(problem_type='multi_label_classification'"),
    ("multi value 2", "sequence", 3, None, dict(labels=labels([1.0, 0, 2], [0, 1, 1])),
     r"^labels must lie in \[0, 1\] .*got values in \[2.0, 2.0\]"),
    ("multi accepted", "sequence", 3, None, dict(labels=labels([1.0, 0, 0.5], [0, 1, 1])), None),
    # regression: MSE broadcast [B] against [B, 2] with only a warning
    ("regression [B, 2]", "sequence", 1, None, dict(labels=labels([1.0, 2.0], [0.5, 1.0])),
     r"^labels must be \[B\] = \[2\] \(or \[B, 1\]\), got \(2, 2\) \(problem_type='regression', inferred from "
     r"num_labels=1; set config.problem_type"),
    ("regression of 2 outputs [B]", "sequence", 2, "regression", dict(labels=labels(1.0, 2.0)),
     r"^labels must be \[B, num_labels\] = \[2, 2\], got \(2,\) \(problem_type='regression'\)"),
    ("regression [B]", "sequence", 1, None, dict(labels=labels(1.0, 2.0)), None),
    ("regression [B, 1] int64", "sequence", 1, None, dict(labels=labels([1], [2])), None),
    # token classification: X003 / X009 / X015 ("Expected input batch_size (4) to match target batch_size (3)")
    ("token labels [B, T-1]", "token", 3, None, dict(labels=labels([0, 1, 2], [0, 1, 2])),
     r"^labels must be \[B, T\] = \[2, 4\], got \(2, 3\)$"),
    ("token labels [B*T]", "token", 3, None, dict(labels=labels(*[0] * (B * T))),
     r"^labels must be \[B, T\] = \[2, 4\], got \(8,\)$"),
    ("token label >= num_labels", "token", 3, None, dict(labels=labels([0, 1, 2, 3], [0, 1, 2, 0])),
     r"^labels must lie in \[0, num_labels=3\) or equal -100 \(ignored\); got values in \[3, 3\]$"),
    ("token label float", "token", 3, None, dict(labels=labels([0, 1, 2, 0], [0, 1, 2, 0], dtype=torch.float32)),
     r"^labels must be an int64 tensor of class indices, got torch.float32; convert it with labels.long\(\)$"),
    ("token labels ignored", "token", 3, None, dict(labels=labels([0, 1, 2, -100], [-100, 1, 2, 0])), None),
    ("token labels all ignored", "token", 3, None, dict(labels=labels([-100] * T, [-100] * T)), None),
    # question answering: torch's batch-size and dtype errors of cross-entropy; a lone position gave no loss
    ("qa positions of another batch", "qa", 3, None, dict(start_positions=labels(1, 2, 0), end_positions=labels(3, 3, 1)),
     r"^start_positions must be \[B\] = \[2\] \(or \[B, 1\]\), got \(3,\)$"),
    ("qa end float", "qa", 3, None, dict(start_positions=labels(1, 2), end_positions=labels(3.0, 3.0)),
     r"^end_positions must be an int64 tensor of token positions, got torch.float32"),
    ("qa start only", "qa", 3, None, dict(start_positions=labels(1, 2)),
     r"^start_positions without end_positions: the loss needs both"),
    ("qa end only", "qa", 3, None, dict(end_positions=labels(1, 2)), r"^end_positions without start_positions"),
    # re-probe 9 K053 / K054: positions outside [0, T] were clamped without a word (9 to T, ignored: a NaN loss;
    # -3 to 0, scored); T itself is transformers' "answer outside the window", ignored by the loss
    ("qa start beyond T", "qa", 3, None, dict(start_positions=labels(1, 9), end_positions=labels(3, 3)),
     r"^start_positions must lie in \[0, T\] \(T = sequence length = 4, which marks an answer outside the window, "
     r"ignored by the loss\), got values in \[9, 9\]$"),
    ("qa end negative", "qa", 3, None, dict(start_positions=labels(1, 2), end_positions=labels(-3, 3)),
     r"^end_positions must lie in \[0, T\] \(T = sequence length = 4, .*got values in \[-3, -3\]$"),
    ("qa positions [B, 1], one at T", "qa", 3, None,
     dict(start_positions=labels([1], [T]), end_positions=labels([3], [T])), None),
    ("qa every position at T", "qa", 3, None, dict(start_positions=labels(T, T), end_positions=labels(T, T)), None),
    ("qa positions 0 and T", "qa", 3, None, dict(start_positions=labels(0, T), end_positions=labels(T, 0)), None),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case, task, num_labels, problem_type, targets, match", TARGETS,
                         ids=[c[0] for c in TARGETS])
def test_task_head_targets_are_checked_for_their_loss(family, case, task, num_labels, problem_type, targets, match):
    model = head(family, task, num_labels)
    model.config.problem_type = problem_type  # (the loss stores the type it inferred; each case starts afresh)
    if match is None:
        with torch.no_grad():
            loss = model(ids(), **targets).loss
        assert math.isfinite(float(loss))
        return
    with pytest.raises(ValueError, match=match):
        model(ids(), **targets)


@pytest.mark.parametrize("family", FAMILIES)
def test_label_values_are_not_read_with_validate_inputs_off(family):
    """The value checks follow ``config.validate_inputs`` (one device read each), as the token-id checks do; shapes
    and dtypes are checked always (free)."""
    model = head(family, "token", 3)
    model.config.validate_inputs = False
    try:
        with pytest.raises(IndexError):
            model(ids(), labels=labels([0, 1, 2, 7], [0, 1, 2, 0]))
        with pytest.raises(ValueError, match=r"^labels must be \[B, T\]"):
            model(ids(), labels=labels([0, 1, 2], [0, 1, 2]))
    finally:
        model.config.validate_inputs = True
    qa = head(family, "qa", 3)
    qa.config.validate_inputs = False
    try:
        with torch.no_grad():  # transformers' clamping: 9 becomes T (ignored), -3 becomes 0
            assert math.isfinite(float(qa(ids(), start_positions=labels(9, -3), end_positions=labels(1, 2)).loss))
    finally:
        qa.config.validate_inputs = True


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
