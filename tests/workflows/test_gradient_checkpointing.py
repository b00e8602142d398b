"""Issue 14, item 2 (and 13, item 5): gradient checkpointing gives the same loss and gradients, through
``gradient_checkpointing_enable()`` and through ``TrainingArguments(gradient_checkpointing=True)``, as for Llama."""

import pytest
import torch
from transformers import Trainer, TrainingArguments

from tests.helpers import tiny_model

FAMILIES = ["helm_d", "helm_mice", "llama"]


def batch():
    return torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_layers_give_the_same_loss_and_gradients(family):
    model = tiny_model(family, train=True)
    assert model.supports_gradient_checkpointing
    x = batch()
    results = []
    for enabled in (False, True):
        if enabled:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            assert model.is_gradient_checkpointing
        model.zero_grad()
        loss = model(x, labels=x).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (plain_loss, plain), (ckpt_loss, ckpt) = results
    assert torch.equal(ckpt_loss, plain_loss) and plain.keys() == ckpt.keys()
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_with_gradient_checkpointing(family, tmp_path):
    """Three Trainer steps on one batch train the same weights with and without checkpointing, and the loss on
    that batch goes down."""
    rows = [{"input_ids": row, "labels": row} for row in batch()]
    trained = {}
    for enabled in (False, True):
        model = tiny_model(family, train=True)
        args = TrainingArguments(output_dir=str(tmp_path / str(enabled)), per_device_train_batch_size=2, max_steps=3,
                                 learning_rate=1e-3, use_cpu=True, gradient_checkpointing=enabled, report_to=[],
                                 save_strategy="no", logging_steps=1)
        Trainer(model=model, args=args, train_dataset=rows).train()
        assert model.is_gradient_checkpointing == enabled
        trained[enabled] = model
    plain, ckpt = (dict(trained[e].named_parameters()) for e in (False, True))
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-6, atol=1e-7, msg=name)
    x = batch()
    with torch.no_grad():
        before = tiny_model(family)(x, labels=x).loss
        after = trained[True].eval()(x, labels=x).loss
    assert after < before - 0.01
