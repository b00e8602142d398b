"""Issue 23 item 9: HELM-MiCE under the stock ``transformers.Trainer`` without ``RoutingBiasCallback`` never updates its
routing bias. The update stays with the training loop (it sums the load of every micro-batch and process first), so
the model says so: once, when an optimiser step has gone by without an update. With the callback, with
``model.update_routing_bias()`` in a loop of one's own, or with balancing switched off, it stays silent."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from helm.models.routing import RoutingBiasCallback
from tests.helpers import tiny_config

MESSAGE = "without a routing-bias update"


def mice(**overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("helm_mice", **overrides))


def trainer_warnings(model, tmp_path, **trainer_kwargs) -> list:
    """Train 4 steps (2 micro-batches each) with the stock Trainer; the routing warnings a user sees (Python's default
    filter: each warning once per place)."""
    rows = [{"input_ids": row, "labels": row} for row in torch.randint(0, 512, (16, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=4, learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        Trainer(model=model, args=args, train_dataset=rows, **trainer_kwargs).train()
    return [w for w in caught if MESSAGE in str(w.message)]


def test_the_stock_trainer_without_the_callback_warns_once(tmp_path):
    model = mice()
    caught = trainer_warnings(model, tmp_path)
    assert len(caught) == 1 and caught[0].category is UserWarning
    assert "RoutingBiasCallback" in str(caught[0].message)
    assert all(torch.equal(m.e_score_correction_bias, torch.zeros_like(m.e_score_correction_bias))
               for m in model.mice_layers())  # what the warning is about: the bias never moved


def test_the_callback_updates_the_bias_and_nothing_is_said(tmp_path):
    model = mice()
    assert not trainer_warnings(model, tmp_path, callbacks=[RoutingBiasCallback()])
    assert all(m.e_score_correction_bias.abs().sum() > 0 for m in model.mice_layers())


@pytest.mark.parametrize("update", [True, False], ids=["update_routing_bias", "bias_update_speed_0"])
def test_a_loop_of_ones_own_that_balances_or_opts_out_is_silent(update):
    model = mice(**({} if update else {"bias_update_speed": 0.0})).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if update:
                model.update_routing_bias()
    assert not [w for w in caught if MESSAGE in str(w.message)]


def test_the_same_loop_without_the_update_warns():
    model = mice().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=MESSAGE):
        for _ in range(2):
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
