"""Issue 14, item 4: FSDP2 (``torch.distributed.fsdp.fully_shard``) for HELM models.

* every parameter is at least 1-dim (``fully_shard`` refuses 0-dim tensors), in every optional layout;
* checkpoints saved with the old 0-dim scalars load through ``from_pretrained`` and give the same logits;
* after sharding, manifold points still get Riemannian Adam (no decay) on their local rows: a 1-rank in-process
  FSDP2 model trains like the unsharded one, even with the optimiser built after sharding;
* ``train.py`` under ``torchrun --nproc_per_node 2`` on CPU (gloo) with ``train.distributed: fsdp`` really shards
  (FSDP2, not accelerate's silent DDP fallback) and matches one process with the same global batch: same losses
  within 1e-5 for 10 steps, Lorentz token table and distance-head prototypes on the manifold afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import helm  # noqa: F401  (registers the HELM Auto classes)
from helm.manifold import manifold_error
from helm.optim import build_optimizer, group_parameters
from tests.helpers import TINY_SHAPES, synthetic_text, tiny_config

REPO = Path(__file__).resolve().parents[2]
POINTS = dict(embedding_mode="lorentz", lm_head_mode="distance")
LAYOUTS = {  # every optional scalar: official MiCE combination, learnable boost decay, distance-head temperature
    "helm_d": dict(POINTS, positional="hope_boost", hope_boost_learnable_decay=True),
    "helm_mice": dict(POINTS, expert_combine="lresnet_official"),
}


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_every_parameter_has_a_dimension_to_shard(family):
    model = AutoModelForCausalLM.from_config(tiny_config(family, **LAYOUTS[family]))
    scalars = [n for n, p in model.named_parameters() if p.numel() == 1]
    assert scalars and all(p.dim() >= 1 for p in model.parameters()), [n for n, p in model.named_parameters()
                                                                        if p.dim() == 0]


@pytest.mark.parametrize("family", sorted(LAYOUTS))
def test_checkpoint_with_zero_dim_scalars_loads_with_the_same_logits(family, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **LAYOUTS[family])).eval()
    model.save_pretrained(tmp_path)
    (tmp_path / "manifest.json").unlink()  # rewritten by hand below, as a folder saved before manifests
    weights = load_file(tmp_path / "model.safetensors")
    old = {k: v.reshape(()) if v.shape == (1,) else v for k, v in weights.items()}  # the format before FSDP2
    assert sum(v.dim() == 0 for v in old.values()) >= 5
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert {n: p.shape for n, p in loaded.named_parameters()} == {n: p.shape for n, p in model.named_parameters()}
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert len(group_parameters(loaded)["manifold"]) == 2  # token table and prototypes re-wrapped as points
    loaded.save_pretrained(tmp_path / "again")  # and saved in the new shape
    assert all(load_file(tmp_path / "again" / "model.safetensors")[k].shape == (1,) for k, v in old.items()
               if v.dim() == 0)


@pytest.fixture
def one_rank_group():
    """A 1-process gloo group in this process, for fully_shard (its local shards are the whole tensors)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_points_get_riemannian_updates_without_decay(one_rank_group):
    """The optimiser built after ``fully_shard`` (the points are plain DTensor parameters then; built before, as
    accelerate does, it is the two-process train.py test below) steps like the unsharded model's."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    def make():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config("helm_d", **LAYOUTS["helm_d"]))

    plain, sharded = make(), make()
    options = dict(lr=1e-2, manifold_lr=5e-2, weight_decay=0.1, betas=(0.9, 0.95), stabilize=1)
    reference = build_optimizer(plain, **options)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    optimizer = build_optimizer(sharded, **options)  # the points are grouped by their modules' names
    assert [n for n, _ in group_parameters(sharded)["manifold"]] == ["model.embed_tokens.weight", "lm_head.weight"]
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, opt in ((plain, reference), (sharded, optimizer)):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
        torch.testing.assert_close(q.full_tensor(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        points = dict(sharded.named_parameters())[name].full_tensor()
        assert float(manifold_error(points, 1.0).max()) < 1e-5, name


# ---------------------------------------------------------------------------------------- train.py, 2 processes


def write_recipe(folder: Path, data: Path, name: str, **train) -> Path:
    recipe = yaml.safe_load((REPO / "configs" / "train" / "tiny-helm-mice.yaml").read_text())
    recipe["model"]["overrides"] = dict(TINY_SHAPES["helm_mice"], vocab_size=320, max_position_embeddings=64,
                                        first_k_dense_replace=1, **POINTS)
    recipe["data"].update(dataset=str(data), tokenizer=str(data / "tokenizer"), build_default=False, seq_len=32)
    recipe["train"].update(output_dir=str(folder / name), max_steps=10, batch_size=2, log_every=1, eval_every=0,
                           eval_rows=8, save_every=0, eval_at_start=False, progress_bar=False, distributed="fsdp",
                           **train)
    recipe.setdefault("optim", {}).update(lr=1e-2)
    recipe["demo"].update(prompt=None)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_mice_experts_sharded_as_their_own_units_give_the_unsharded_loss(one_rank_group):
    """``fully_shard`` on each curvature expert as well as on the layers: the layer reads no expert's sharded ``log_k``
    outside that expert's forward (MiCE's one-vector scales fall back to each expert's own), so the loss and the
    curvatures' gradients are the unsharded model's."""
    from torch.distributed.fsdp import fully_shard

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for shard in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("helm_mice")).train()
        if shard:
            for layer in model.model.layers:
                for expert in getattr(layer.mlp, "experts", []):
                    fully_shard(expert)
                fully_shard(layer)
            fully_shard(model)
        loss = model(ids, labels=ids).loss
        loss.backward()
        grads = [e.log_k.grad.full_tensor() if shard else e.log_k.grad for e in model.model.layers[-1].mlp.experts]
        runs.append((loss.detach(), torch.cat(grads)))
    torch.testing.assert_close(runs[1][0], runs[0][0])
    torch.testing.assert_close(runs[1][1], runs[0][1])


def test_torchrun_two_process_fsdp2_matches_one_process(tmp_path, tokenizer):
    """HELM-MiCE with a Lorentz token table and a distance head (both manifold points): 2 processes x batch 2
    under FSDP2 against 1 process x batch 2 x grad_accum 2, the same rows in every step."""
    data = tmp_path / "data"
    data.mkdir()
    for split, n, seed in (("train", 300, 0), ("validation", 30, 1)):
        lines = synthetic_text(seed, 5 * n)
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"text": " ".join(lines[i:i + 5])}) + "\n"
                                                     for i in range(0, len(lines), 5)))
    tokenizer.save_pretrained(data / "tokenizer")
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    single = write_recipe(tmp_path, data, "single", grad_accum=2)
    sharded = write_recipe(tmp_path, data, "fsdp", grad_accum=1)
    runs = [subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", str(single)], env=env,
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(29500 + os.getpid() % 1000 + 7), str(REPO / "train.py"),
                              "--config", str(sharded)], env=dict(env, ACCELERATE_USE_CPU="1"), cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    (one, _), (two, _) = (run.communicate(timeout=300) for run in runs)
    assert runs[0].returncode == 0, one
    assert runs[1].returncode == 0, two
    assert "2 process(es) on cpu" in two and "(FSDP)" in two, two  # sharded, not accelerate's DDP fallback
    a = [r for r in metrics(tmp_path / "single") if "loss" in r]
    b = [r for r in metrics(tmp_path / "fsdp") if "loss" in r]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 11))
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-5, (ra, rb)
        assert ra["lr"] == rb["lr"]
    assert a[-1]["loss"] < a[0]["loss"] - 0.3, "the runs did not train"
    va, vb = ([r["val_loss"] for r in metrics(tmp_path / run) if "val_loss" in r] for run in ("single", "fsdp"))
    assert abs(va[-1] - vb[-1]) <= 1e-5
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "final")
    for points in (final.model.embed_tokens.weight, final.lm_head.weight):
        assert float(manifold_error(points.detach(), final.config.k).max()) < 1e-5
