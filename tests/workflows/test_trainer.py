"""Issue 14, item 5: transformers' Trainer on manifold parameters, with the zoo's optimiser and routing callback.

The stock Trainer builds AdamW: it moves Lorentz tables and prototypes off the hyperboloid and decays them. Passing
``optimizers=(helm.optim.build_optimizer(model, ...), None)`` (Riemannian Adam for manifold points, AdamW without
decay for temperatures, curvatures, gains, biases) and ``callbacks=[RoutingBiasCallback()]`` fixes both."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from helm.manifold import manifold_error
from helm.models.routing import RoutingBiasCallback
from helm.optim import build_optimizer
from tests.helpers import tiny_config

OPTIONS = dict(embedding_mode="lorentz", lm_head_mode="distance")


def train(model, tmp_path, **trainer_kwargs):
    rows = [{"input_ids": row, "labels": row} for row in torch.randint(0, 512, (40, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=20, learning_rate=3e-2, weight_decay=0.1, use_cpu=True, report_to=[],
                             save_strategy="no")
    Trainer(model=model, args=args, train_dataset=rows, **trainer_kwargs).train()


def points(model):
    return [model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()]


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_trainer_keeps_points_on_the_manifold_and_moves_the_routing_bias(family, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **OPTIONS))
    optimizer = build_optimizer(model, lr=3e-2, weight_decay=0.1)
    train(model, tmp_path, optimizers=(optimizer, None), callbacks=[RoutingBiasCallback()])
    assert all(manifold_error(p, model.config.k).max() <= 1e-5 for p in points(model))
    if family == "helm_mice":
        biases = [layer.e_score_correction_bias for layer in model.mice_layers()]
        assert all(b.abs().sum() > 0 for b in biases), "the routing bias never moved"


def test_the_stock_trainer_optimiser_leaves_the_manifold(tmp_path):
    """What the fix is for (and proof that the test above can fail)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("helm_d", **OPTIONS))
    train(model, tmp_path)
    assert max(manifold_error(p, model.config.k).max() for p in points(model)) > 1e-3
