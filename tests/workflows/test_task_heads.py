"""Issue 23 item 2: the task heads Llama has (sequence classification with last-non-padding-token pooling, token
classification, extractive question answering), for both HELM families, side by side with tiny-llama: built with the
Auto classes, trained for a few steps with the zoo's optimiser (loss decreases), the same output fields and shapes,
and the same loss semantics (``num_labels``, ``problem_type``, ``pad_token_id``, ignored labels, clamped answer
positions), computed here from the returned logits with ``torch.nn.functional``."""

import json

import geoopt
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from helm.manifold import manifold_error
from helm.optim import build_optimizer
from tests.helpers import run_without_helm, tiny_config

FAMILIES = ["helm_d", "helm_mice", "llama"]
TASKS = {"sequence": AutoModelForSequenceClassification, "token": AutoModelForTokenClassification,
         "qa": AutoModelForQuestionAnswering}
PAD = 0


def build(family, task, seed=0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, num_labels=3, pad_token_id=PAD, **overrides)
    return TASKS[task].from_config(config)


def batch(task, seed=1):
    """Token ids ``[4, 12]`` (row 1 right-padded, row 2 left-padded) and the task's targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (4, 12), generator=g)
    ids[1, 8:] = PAD
    ids[2, :3] = PAD
    mask = (ids != PAD).long()
    if task == "sequence":
        targets = {"labels": torch.tensor([0, 1, 2, 1])}
    elif task == "token":
        labels = torch.randint(0, 3, (4, 12), generator=g)
        targets = {"labels": labels.masked_fill(mask == 0, -100)}
    else:
        targets = {"start_positions": torch.tensor([1, 2, 4, 0]), "end_positions": torch.tensor([3, 5, 9, 11])}
    return ids, mask, targets


def expected_loss(task, out, targets):
    """The loss transformers' Llama heads define, from the returned logits."""
    if task == "sequence":
        return F.cross_entropy(out.logits, targets["labels"])
    if task == "token":
        return F.cross_entropy(out.logits.flatten(0, 1), targets["labels"].flatten(), ignore_index=-100)
    return (F.cross_entropy(out.start_logits, targets["start_positions"])
            + F.cross_entropy(out.end_logits, targets["end_positions"])) / 2


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_few_training_steps_beside_llama(family, task):
    model = build(family, task)
    llama = build("llama", task)
    ids, mask, targets = batch(task)
    optimizer = build_optimizer(model, lr=3e-3)
    model.train()
    losses = []
    for step in range(8):
        out = model(ids, attention_mask=mask, **targets)
        losses.append(float(out.loss.detach()))
        if step == 0:  # in training HELM-MiCE adds its balance loss, as its causal LM does
            balance = model.balance_loss() if family == "helm_mice" else 0
            assert family != "helm_mice" or balance > 0
            torch.testing.assert_close(out.loss, expected_loss(task, out, targets) + balance)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert losses[-1] < 0.8 * losses[0], losses
    model.eval()
    llama.eval()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, **targets, output_hidden_states=True)
        reference = llama(ids, attention_mask=mask, **targets)
    fields = [k for k in reference.keys() if k not in ("cache", "past_key_values")]
    assert [k for k in out.keys() if k not in ("cache", "past_key_values", "hidden_states")] == fields
    for name in fields:
        assert out[name].shape == reference[name].shape, name
    torch.testing.assert_close(out.loss, expected_loss(task, out, targets))
    if family != "llama":
        assert max(float(manifold_error(h, model.config.k).max()) for h in out.hidden_states) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_sequence_classification_pools_the_last_non_padding_token(family):
    model = build(family, "sequence").eval()
    ids, mask, _ = batch("sequence")
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        for row in range(len(ids)):
            alone = ids[row][mask[row].bool()][None]
            torch.testing.assert_close(padded[row], model(alone).logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_problem_types_and_a_missing_pad_token_as_llama(family):
    ids, mask, _ = batch("sequence")
    torch.manual_seed(0)
    regression = AutoModelForSequenceClassification.from_config(tiny_config(family, num_labels=1,
                                                                           pad_token_id=PAD)).eval()
    target = torch.randn(4)
    out = regression(ids, attention_mask=mask, labels=target)
    assert regression.config.problem_type == "regression" and out.logits.shape == (4, 1)
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), target))

    multi = build(family, "sequence").eval()
    targets = torch.tensor([[1.0, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 0]])
    out = multi(ids, attention_mask=mask, labels=targets)
    assert multi.config.problem_type == "multi_label_classification"
    torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, targets))

    torch.manual_seed(0)
    no_pad = AutoModelForSequenceClassification.from_config(tiny_config(family, num_labels=3, pad_token_id=None))
    with pytest.raises(ValueError, match="no padding token is defined"):
        no_pad(ids)
    assert no_pad(ids[:1]).logits.shape == (1, 3)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_distance_heads_save_and_reload_with_remote_code_map(family, task, tmp_path):
    """``lm_head_mode="distance"``: class points on the hyperboloid (a geoopt ``ManifoldParameter``, also after
    ``from_pretrained``); the saved folder's ``auto_map`` names every head, and it reloads to the same outputs."""
    model = build(family, task, lm_head_mode="distance").eval()
    head = model.qa_outputs if task == "qa" else model.score
    assert isinstance(head.weight, geoopt.ManifoldParameter)
    assert float(manifold_error(head.weight.detach(), model.config.k).max()) <= 1e-5
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert {"AutoModelForSequenceClassification", "AutoModelForTokenClassification",
            "AutoModelForQuestionAnswering"} <= set(auto_map)
    loaded = TASKS[task].from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    loaded_head = loaded.qa_outputs if task == "qa" else loaded.score
    assert isinstance(loaded_head.weight, geoopt.ManifoldParameter)
    ids, mask, _ = batch(task)
    with torch.no_grad():
        for name, value in model(ids, attention_mask=mask).items():
            if torch.is_tensor(value):
                torch.testing.assert_close(loaded(ids, attention_mask=mask)[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_causal_lm_checkpoint_loads_into_a_task_head(family, task, tmp_path):
    """As for Llama: the decoder's weights load, the LM head is unused and the task head is new (the warning is
    tested in test_head_from_base_folder.py); the decoder's hidden states are the causal LM's.
    (``LlamaForQuestionAnswering`` keeps its decoder under ``transformer``, so transformers 5.24 loads none of a
    causal-LM checkpoint into it; the HELM heads all keep it under ``model``.)"""
    if family == "llama" and task == "qa":
        pytest.skip("transformers' LlamaForQuestionAnswering does not load a causal-LM checkpoint's decoder")
    torch.manual_seed(0)
    causal = AutoModelForCausalLM.from_config(tiny_config(family, pad_token_id=PAD)).eval()
    causal.save_pretrained(tmp_path)
    loaded = TASKS[task].from_pretrained(tmp_path, num_labels=3).eval()
    ids, mask, _ = batch(task)
    with torch.no_grad():
        expected = causal.model(ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(loaded.model(ids, attention_mask=mask).last_hidden_state, expected,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_task_heads_load_as_remote_code_without_helm(family, tmp_path):
    """Every head of a saved folder loads with ``trust_remote_code=True`` where helm is not importable (the folder
    was saved from the sequence head; ``auto_map`` points every Auto class at the folder's own code)."""
    model = build(family, "sequence").eval()
    model.save_pretrained(tmp_path)
    ids, mask, _ = batch("sequence")
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    proc = run_without_helm(f"""
        import torch, transformers
        folder = {str(tmp_path)!r}
        ids, mask = torch.tensor({ids.tolist()}), torch.tensor({mask.tolist()})
        names = {{}}
        for auto in ("AutoModelForSequenceClassification", "AutoModelForTokenClassification",
                     "AutoModelForQuestionAnswering"):
            m = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True).eval()
            names[auto] = type(m).__name__
        m = transformers.AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True).eval()
        with torch.no_grad():
            print("REPORT", names, m(ids, attention_mask=mask).logits.tolist())
        assert not any(k == "helm" or k.startswith("helm.") for k in sys.modules), "helm was imported"
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names, logits = proc.stdout.split("REPORT ")[-1].rsplit(" [[", 1)
    prefix = type(model).__name__[: -len("ForSequenceClassification")]
    assert eval(names) == {"AutoModelForSequenceClassification": prefix + "ForSequenceClassification",
                           "AutoModelForTokenClassification": prefix + "ForTokenClassification",
                           "AutoModelForQuestionAnswering": prefix + "ForQuestionAnswering"}
    torch.testing.assert_close(torch.tensor(json.loads("[[" + logits)), expected, rtol=0, atol=1e-6)
