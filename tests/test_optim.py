"""helm.optim: parameter groups, weight-decay exclusions, Riemannian updates staying on the manifold."""

from __future__ import annotations

import copy as copy_module

import geoopt
import pytest
import torch
from transformers import AutoModelForCausalLM

import helm
from helm.manifold.math import manifold_error
from helm.nn.norm import LorentzRMSNorm
from helm.optim import GROUPS, NO_DECAY_NAMES, HybridAdamW, build_optimizer, group_parameters

# Micro shapes: ambient 33 = 1 + 32, four heads of 1 + 8, so every model builds and steps in milliseconds.
MICRO = dict(num_hidden_layers=2, hidden_size=33, num_attention_heads=4, intermediate_size=40, vocab_size=97,
             max_position_embeddings=64)
MICE = dict(MICRO, moe_intermediate_size=20, kv_lora_rank=9, qk_nope_head_dim=9, qk_rope_head_dim=9, v_head_dim=9,
            first_k_dense_replace=1)

MODELS = {
    "helm-d": ("tiny-helm-d", dict(MICRO, head_dim=9)),
    "helm-d-lorentz-distance": ("tiny-helm-d-lorentz", dict(MICRO, head_dim=9, lm_head_mode="distance")),
    "helm-d-learned": ("tiny-helm-d-learned", dict(MICRO, head_dim=9)),
    "helm-d-hope_boost": ("tiny-helm-d-hope_boost", dict(MICRO, head_dim=9)),
    "mice": ("tiny-helm-mice", MICE),
    "mice-fixed-curvature": ("tiny-helm-mice", dict(MICE, trainable_curvatures=False)),
    "llama": ("tiny-llama", dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                                 head_dim=8, intermediate_size=40, vocab_size=97)),
}


def micro_model(name: str, **extra):
    preset, overrides = MODELS[name]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(helm.load_config(preset, **{**overrides, **extra}))


def tokens(vocab: int = 97, batch: int = 3, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def train_steps(model, optimizer, steps: int, ids: torch.Tensor) -> float:
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_groups_partition_trainable_parameters(name):
    model = micro_model(name)
    groups = group_parameters(model)
    assert set(groups) == set(GROUPS)
    grouped = [p for members in groups.values() for _, p in members]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(grouped) == len({id(p) for p in grouped}), "a parameter is in two groups"
    assert {id(p) for p in grouped} == {id(p) for p in trainable}
    # the optimiser's groups are the same partition, with the group kind recorded
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
    assert sorted(map(id, in_optimizer)) == sorted(map(id, trainable))
    for g in optimizer.param_groups:
        assert [n for n, _ in groups[g["group"]]] == g["param_names"]


def test_frozen_curvatures_are_left_out():
    model = micro_model("mice-fixed-curvature")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.endswith("log_k") for n in frozen)
    names = {n for members in group_parameters(model).values() for n, _ in members}
    assert not names & set(frozen)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_excluded_kinds_are_never_decayed(name):
    model = micro_model(name)
    groups = group_parameters(model)
    modules = dict(model.named_modules())
    decayed = {n for n, _ in groups["decay"]}
    for full, p in model.named_parameters():
        module_name, _, leaf = full.rpartition(".")
        module = modules[module_name]
        excluded = (isinstance(p, geoopt.ManifoldParameter) or leaf in NO_DECAY_NAMES
                    or isinstance(module, LorentzRMSNorm) or type(module).__name__.endswith("RMSNorm")
                    or p.ndim < 2)
        if excluded:
            assert full not in decayed, f"{full} would be decayed"
    # manifold points are exactly the ManifoldParameters
    assert {n for n, _ in groups["manifold"]} == {n for n, p in model.named_parameters()
                                                  if isinstance(p, geoopt.ManifoldParameter) and p.requires_grad}
    kinds = {n.rpartition(".")[2] for n, _ in groups["no_decay"]}
    if name.startswith(("helm", "mice")):
        assert {"bias", "log_tau", "raw_weight", "weight"} <= kinds
    if name == "mice":
        assert "log_k" in kinds


@pytest.mark.parametrize("name", ["helm-d-lorentz-distance", "mice", "llama"])
def test_weight_decay_touches_only_the_decay_group(name):
    """With zero gradients Adam's update is zero, so only decoupled decay can move a parameter."""
    model = micro_model(name)
    lr, wd = 0.1, 0.5
    optimizer = build_optimizer(model, lr=lr, weight_decay=wd)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    optimizer.step()
    decayed = {n for n, _ in group_parameters(model)["decay"]}
    for n, p in model.named_parameters():
        if n in decayed:
            torch.testing.assert_close(p.detach(), before[n] * (1 - lr * wd))
        else:
            torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=1e-6, msg=f"{n} changed")


def test_hybrid_matches_separate_adamw_and_riemannian_adam():
    a, b = micro_model("helm-d-lorentz-distance"), micro_model("helm-d-lorentz-distance")
    hybrid = build_optimizer(a, lr=1e-2, manifold_lr=0.05, weight_decay=0.1, betas=(0.9, 0.95))
    groups = group_parameters(b)
    adamw = torch.optim.AdamW([{"params": [p for _, p in groups["decay"]], "weight_decay": 0.1},
                               {"params": [p for _, p in groups["no_decay"]], "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95))
    radam = geoopt.optim.RiemannianAdam([p for _, p in groups["manifold"]], lr=0.05, betas=(0.9, 0.95))
    ids = tokens()
    for _ in range(3):
        for model, opts in ((a, [hybrid]), (b, [adamw, radam])):
            model(input_ids=ids, labels=ids).loss.backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=n)


def test_state_dict_round_trip_continues_identically():
    ids = tokens()
    model = micro_model("helm-d-lorentz-distance")
    optimizer = build_optimizer(model, lr=1e-2, manifold_lr=0.1, weight_decay=0.1)
    train_steps(model, optimizer, 3, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    saved = copy_module.deepcopy(optimizer.state_dict())  # state_dict() shares the moment tensors

    copy = micro_model("helm-d-lorentz-distance")
    copy.load_state_dict(state)
    restored = build_optimizer(copy, lr=1e-2, manifold_lr=0.1, weight_decay=0.1)
    restored.load_state_dict(saved)
    # the inner optimisers must see the restored groups and moments, not the ones built at construction
    assert restored.riemannian.state is restored.state and restored.euclidean.state is restored.state
    assert all(g in restored.param_groups for g in restored.riemannian.param_groups)
    train_steps(model, optimizer, 2, ids)
    train_steps(copy, restored, 2, ids)
    for (n, p), q in zip(model.named_parameters(), copy.parameters()):
        torch.testing.assert_close(p, q, msg=n)


def _assert_on_manifold(model, tol=1e-5):
    points = [(n, p) for n, p in model.named_parameters() if isinstance(p, geoopt.ManifoldParameter)]
    assert points, "the model has no manifold parameters"
    for n, p in points:
        k = float(p.manifold.k)
        assert torch.isfinite(p).all(), n
        assert manifold_error(p, k).max() <= tol, f"{n} left the hyperboloid"


def test_embedding_points_stay_on_manifold_with_large_lr_and_after_reload(tmp_path):
    """200 Riemannian Adam steps at manifold_lr=0.2 (500x the paper's rate), then again after a
    save_pretrained / from_pretrained round trip with a freshly built optimiser. ``stabilize=1`` (the recipes'
    setting) re-projects points and momenta every step; without it geoopt's fp32 momentum transport turns NaN
    at manifold_lr >= 0.5 once the points drift to time coordinates of about 1e3."""
    ids = tokens(batch=2, length=16)
    model = micro_model("helm-d-lorentz-distance", num_hidden_layers=1)
    start = model.model.embed_tokens.weight.detach().clone()
    optimizer = build_optimizer(model, lr=1e-3, manifold_lr=0.2, weight_decay=0.1, stabilize=1)
    first = model(input_ids=ids, labels=ids).loss.item()
    last = train_steps(model, optimizer, 200, ids)
    assert last < first
    moved = (model.model.embed_tokens.weight - start).norm(dim=-1)
    assert moved.max() > 1.0, "the large learning rate did not move the points far"
    _assert_on_manifold(model)

    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(reloaded.model.embed_tokens.weight, geoopt.ManifoldParameter)
    assert isinstance(reloaded.lm_head.weight, geoopt.ManifoldParameter)
    optimizer = build_optimizer(reloaded, lr=1e-3, manifold_lr=0.2, weight_decay=0.1, stabilize=1)
    manifold = {n for n, _ in group_parameters(reloaded)["manifold"]}
    assert manifold == {"model.embed_tokens.weight", "lm_head.weight"}
    train_steps(reloaded, optimizer, 200, tokens(batch=2, length=16, seed=1))
    _assert_on_manifold(reloaded)


def test_bad_hyperparameters_are_named():
    model = micro_model("helm-d")
    with pytest.raises(ValueError, match="lr"):
        HybridAdamW(model, lr=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        HybridAdamW(model, lr=1e-3, weight_decay=-1.0)
    with pytest.raises(ValueError, match="stabilize"):
        HybridAdamW(model, lr=1e-3, stabilize=0)
