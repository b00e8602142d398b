"""The model's public surface (both HELM families): what ``forward`` and ``generate`` take (everything transformers
hands Llama's), the loss's guarantees (all-ignored labels give 0, not NaN), ``inputs_embeds`` projected onto the
hyperboloid, and ``from_pretrained`` refusing damaged checkpoints (missing, unused or misshapen weights, NaN weights,
weights changed after a manifest was written), each naming the culprit. Nothing here reads a tensor on the host in a
step: value checks of ids and masks are torch's (``tests/test_host_sync.py``)."""

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helm.manifold import lift, manifold_error
from tests.helpers import MANIFOLD_TOL, assert_close, tiny_config, tiny_model

FAMILIES = ["helm_d", "helm_mice"]
B, T, V = 2, 5, 512  # tiny configs: vocab 512


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in FAMILIES + ["llama"]}


def ids(b=B, t=T):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
def test_exactly_one_of_input_ids_and_inputs_embeds(models, family):
    model = models[family]
    with pytest.raises(ValueError, match="input_ids.*inputs_embeds"):
        model()
    with pytest.raises(ValueError, match="input_ids.*inputs_embeds"):
        model(ids(), inputs_embeds=model.model.embed_tokens(ids()))


@pytest.mark.parametrize("family", FAMILIES)
def test_position_ids_of_one_row_broadcast_like_llama(models, family):
    model = models[family]
    x = ids()
    default = model(x).logits
    assert torch.equal(model(x, position_ids=torch.arange(T)[None]).logits, default)
    assert torch.equal(model(x, position_ids=torch.arange(T).expand(B, T)).logits, default)


# 0/1 masks of every dtype mean the same: (case id, fill value, dtype)
MASK_VALUES = [("1.0 float", 1.0, torch.float32), ("bool", True, torch.bool), ("int32", 1, torch.int32),
               ("fp16", 1.0, torch.float16)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,value,dtype", MASK_VALUES, ids=[c for c, *_ in MASK_VALUES])
def test_attention_masks_of_0_and_1_in_any_dtype_agree(models, family, case, value, dtype):
    """A 0/1 mask of any dtype gives the logits of the long one, with and without left padding."""
    model = models[family]
    x = ids()
    ones = torch.ones(B, T, dtype=torch.long)
    mask = torch.full((B, T), value, dtype=dtype)
    assert torch.equal(model(x, attention_mask=mask).logits, model(x, attention_mask=ones).logits)
    ones[0, :2] = 0
    mask[0, :2] = 0
    assert torch.equal(model(x, attention_mask=mask).logits, model(x, attention_mask=ones).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_4d_additive_mask_is_used_as_given(models, family):
    model, x = models[family], ids()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    additive = torch.zeros(B, 1, T, T).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert_close(model(x, attention_mask=additive).logits, model(x).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_to_keep_forms(models, family):
    """transformers' two forms: an int n (0: every position) and a 1-D tensor of positions."""
    model, x = models[family], ids()
    full = model(x).logits
    assert torch.equal(model(x, logits_to_keep=0).logits, full)
    assert_close(model(x, logits_to_keep=2).logits, full[:, -2:])  # fewer GEMM rows: rounding may differ
    assert_close(model(x, logits_to_keep=torch.tensor([0, 3])).logits, full[:, [0, 3]])


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
def test_transformers_keywords_are_accepted(models, family, tokenizer):
    """What Trainer, generate and packing collators pass to every model (Llama ignores what it does not read)."""
    model, x = models[family], ids()
    extra = dict(num_items_in_batch=torch.tensor(3), cache_position=torch.arange(T), return_dict=True,
                 token_type_ids=torch.zeros(B, T, dtype=torch.long), output_router_logits=False,
                 tokenizer=tokenizer, assistant_tokenizer=None, ignore_index=-100, shift_labels=None)
    assert model(x, labels=x, **extra).loss is not None
    assert model.model(x, **extra).last_hidden_state.shape[:2] == (B, T)


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
def test_generate_with_stop_strings_and_tokenizer(models, family, tokenizer):
    """``generate(stop_strings=..., tokenizer=tok)``: transformers passes ``tokenizer`` down to the forward."""
    model = models[family]
    prompt = torch.randint(0, min(V, len(tokenizer)), (1, 4), generator=torch.Generator().manual_seed(1))
    out = model.generate(prompt, max_new_tokens=6, do_sample=False, stop_strings=["."], tokenizer=tokenizer,
                         pad_token_id=0)
    plain = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape[0] == 1 and 4 < out.shape[1] <= 10
    assert torch.equal(out, plain[:, :out.shape[1]])  # stopping cuts the same greedy continuation


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
def test_labels_all_ignored_give_a_zero_loss_and_zero_gradients(models, family):
    """transformers' ``ForCausalLMLoss`` takes the mean over the labelled tokens, 0/0 = NaN when none is labelled
    (``LlamaForCausalLM`` returns NaN, checked below), which poisons a whole accumulation step. HELM normalises by
    ``max(#labelled, 1)`` on the device: 0 with zero gradients here."""
    model = models[family]
    x = ids()
    labels = torch.full_like(x, -100)
    if family == "llama":
        assert torch.isnan(model(x, labels=labels).loss)
        return
    model.zero_grad()
    loss = model(x, labels=labels).loss
    assert loss == 0.0
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and not g.any() for g in grads)
    model.zero_grad()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_partially_ignored_labels_average_over_the_labelled_tokens(models, family, fused):
    model = models[family]
    x = ids()
    labels = x.clone()
    labels[0, :3] = -100
    logits = model(x).logits
    shifted = labels[:, 1:].reshape(-1)
    keep = shifted != -100
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V)[keep], shifted[keep])
    assert_close(model(x, labels=labels, skip_logits=fused).loss, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_are_read_as_points_and_projected(models, family):
    """Only the space part of ``inputs_embeds`` is read and the time coordinate recomputed (``lift``), so an input
    off the hyperboloid is projected onto it instead of corrupting the Lorentz residuals."""
    model = models[family]
    x = ids()
    on = model.model.embed_tokens(x)
    assert torch.equal(model(inputs_embeds=on).logits, model(x).logits)
    off = on.clone()
    off[..., 0] = 123.0  # time coordinate off the hyperboloid
    out = model(inputs_embeds=off, output_hidden_states=True)
    assert torch.equal(out.logits, model(inputs_embeds=lift(off[..., 1:], k=model.config.k)).logits)
    for h in out.hidden_states:
        assert manifold_error(h, model.config.k).max() <= MANIFOLD_TOL[torch.float32]


# ---- from_pretrained of damaged checkpoints ---------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("saved")
    for family in FAMILIES:
        models[family].save_pretrained(root / family)
    return root


def _rewrite(fn):
    """The weights edited and re-saved with a matching manifest (as if saved so): the load checks behind it act."""
    def edit(path):
        from helm.manifest import write_manifest

        sd = load_file(path / "model.safetensors")
        fn(sd)
        save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
        write_manifest(path, None, which=lambda name: name == "model.safetensors")
    return edit


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _flip_one_bit(path):
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-100] ^= 0x40  # an exponent bit of a weight: still a valid file, a different model
    (path / "model.safetensors").write_bytes(bytes(data))


WEIGHT = "model.layers.0.attn_residual.raw_weight"
MATRIX = "model.layers.1.self_attn.o_proj.weight"
# (case id, damage to the saved directory, exception, the culprit the message names)
DAMAGED = [
    ("one byte flipped", _flip_one_bit, OSError, r"model\.safetensors"),
    ("truncated, manifest kept", _truncate, OSError, r"model\.safetensors"),
    ("weights deleted, manifest kept", lambda p: os.remove(p / "model.safetensors"), OSError,
     r"model\.safetensors"),
    ("NaN weight", _rewrite(lambda sd: sd[MATRIX].view(-1)[0].fill_(float("nan"))), OSError, MATRIX),
    ("inf scalar", _rewrite(lambda sd: sd[WEIGHT].fill_(float("inf"))), OSError, WEIGHT),
    ("missing key", _rewrite(lambda sd: sd.pop(MATRIX)), RuntimeError, MATRIX),
    ("missing lm_head", _rewrite(lambda sd: sd.pop("lm_head.weight")), RuntimeError, "lm_head.weight"),
    ("unexpected key", _rewrite(lambda sd: sd.__setitem__("model.layers.0.extra", torch.zeros(3))), RuntimeError,
     r"model\.layers\.0\.extra"),
    ("wrong shape", _rewrite(lambda sd: sd.__setitem__(MATRIX, torch.zeros(3, 3))), RuntimeError, MATRIX),
    ("wrong scalar shape", _rewrite(lambda sd: sd.__setitem__(WEIGHT, torch.zeros(2))), RuntimeError, WEIGHT),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case,damage,exc,culprit", DAMAGED, ids=[c[0] for c in DAMAGED])
def test_damaged_checkpoints_fail_loudly(saved, tmp_path, family, case, damage, exc, culprit):
    path = tmp_path / family
    shutil.copytree(saved / family, path)
    damage(path)
    with pytest.raises(exc, match=culprit):
        AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_save_replaces_the_manifest_and_remote_code_checks_it(saved, tmp_path, family):
    from helm.manifest import read_manifest

    path = tmp_path / family
    shutil.copytree(saved / family, path)
    AutoModelForCausalLM.from_config(tiny_config(family)).save_pretrained(path)
    manifest = read_manifest(path)
    assert manifest["step"] is None and list(manifest["files"]) == ["model.safetensors"]
    AutoModelForCausalLM.from_pretrained(path)
    _flip_one_bit(path)
    with pytest.raises(OSError, match=r"model\.safetensors"):
        AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_saved_under_a_variant_name_are_in_the_manifest(models, tmp_path, family):
    """Issue 34 re-probe: save_pretrained(variant=...) wrote an empty manifest, so damaged weights loaded."""
    models[family].save_pretrained(tmp_path, variant="v1")
    from helm.manifest import read_manifest

    assert list(read_manifest(tmp_path)["files"]) == ["model.v1.safetensors"]
    data = bytearray((tmp_path / "model.v1.safetensors").read_bytes())
    data[-100] ^= 0x40
    (tmp_path / "model.v1.safetensors").write_bytes(bytes(data))
    with pytest.raises(OSError, match=r"model\.v1\.safetensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path, variant="v1")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["attention_mask", "segment_ids"])
def test_a_2d_mask_shorter_than_the_tokens_is_named(models, family, name):
    """Issue 34 re-probe: short segment_ids were padded as a static cache's free slots (the last tokens became a
    document of their own: logits 0.46 off); a short attention_mask failed in an index_select."""
    mask = torch.ones(B, T - 1, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"{name} covers {T - 1} positions.* 0 cached \+ {T} new"):
        models[family](ids(), **{name: mask})
    cache = models[family](ids(), use_cache=True).past_key_values
    with pytest.raises(ValueError, match=rf"{name} covers {T} positions.* {T} cached \+ 1 new"):
        models[family](ids(t=1), past_key_values=cache, **{name: torch.ones(B, T, dtype=torch.long)})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["attention_mask", "segment_ids"])
def test_a_2d_mask_shorter_than_a_static_caches_tokens_is_named(models, family, name):
    """Second re-probe: the length check skipped static caches (their length is a tensor): short segment_ids changed
    the logits (0.08) without a word, a short mask failed in an index_select. torch._assert_async: no host sync."""
    from transformers import StaticCache

    model = models[family]
    cache = StaticCache(config=model.config, max_cache_len=16)
    model(ids(t=6), past_key_values=cache, use_cache=True)
    with pytest.raises(RuntimeError, match=rf"{name} covers 2 positions"):
        model(ids(t=2), past_key_values=cache, **{name: torch.ones(B, 2, dtype=torch.long)})


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_names_the_segment_ids_it_cannot_extend(models, family):
    with pytest.raises(ValueError, match=r"segment_ids covers 5 positions.*generate does not extend segment_ids"):
        models[family].generate(ids(), segment_ids=torch.zeros(B, T, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("family", FAMILIES + ["llama"])
def test_training_with_gradient_checkpointing_returns_no_cache_as_llama(family):
    """Issue 34 re-probe: HELM returned an empty cache that looked filled; continuing from it dropped the prompt."""
    model = tiny_model(family).train()
    model.gradient_checkpointing_enable({"use_reentrant": False})
    out = model(ids(), use_cache=True)
    assert out.past_key_values is None
    with torch.no_grad():
        assert model(ids(), use_cache=True).past_key_values.get_seq_length() == T  # no gradients: nothing checkpointed


# ---- manifold parameters moved off the hyperboloid (issue 34 item 3) --------------------------------------

def _three_steps(model, optimizer):
    for seed in range(3):
        x = torch.randint(0, V, (B, 16), generator=torch.Generator().manual_seed(seed))
        model(x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("family", FAMILIES)
def test_tables_moved_off_the_hyperboloid_are_named_when_saved_and_loaded(family, tmp_path):
    """A stock optimiser (AdamW, the Trainer's default) moves Lorentz token tables and distance-head prototypes off
    the hyperboloid; the model kept training and saving without a word. save_pretrained and from_pretrained now warn,
    naming each table and the remedy; the zoo's optimiser keeps them on it (no warning). No read in a step."""
    from helm.optim import build_optimizer

    model = tiny_model(family, train=True, embedding_mode="lorentz", lm_head_mode="distance")
    _three_steps(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    errors = model.manifold_error()
    assert set(errors) == {"model.embed_tokens.weight", "lm_head.weight"} and min(errors.values()) > 1e-4
    with pytest.warns(UserWarning, match=r"save_pretrained.*model\.embed_tokens\.weight.*lm_head\.weight.*"
                                         r"helm\.optim\.build_optimizer"):
        model.save_pretrained(tmp_path / "adamw")
    with pytest.warns(UserWarning, match=r"from_pretrained.*model\.embed_tokens\.weight"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "adamw")

    model = tiny_model(family, train=True, embedding_mode="lorentz", lm_head_mode="distance")
    _three_steps(model, build_optimizer(model, lr=3e-3, stabilize=1))
    assert max(model.manifold_error().values()) < 1e-5
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.save_pretrained(tmp_path / "zoo")


# ---- sharded and pickled checkpoints (issue 34 item 4) -------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_a_shard_name_outside_the_folder_is_refused(family, tmp_path):
    """transformers followed a shard index's ../../etc/passwd out of the checkpoint folder."""
    tiny_model(family).save_pretrained(tmp_path, max_shard_size="100KB")
    os.remove(tmp_path / "manifest.json")  # a folder saved before manifests: the index itself is read
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    key = next(iter(data["weight_map"]))
    data["weight_map"][key] = "../../etc/passwd"
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape("../../etc/passwd")):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_variant_shard_name_outside_the_folder_is_refused(family, tmp_path):
    """Second re-probe: the check read *.index.json only, so model.safetensors.index.v1.json was followed out."""
    tiny_model(family).save_pretrained(tmp_path, max_shard_size="100KB", variant="v1")
    os.remove(tmp_path / "manifest.json")
    index = tmp_path / "model.safetensors.index.v1.json"
    data = json.loads(index.read_text())
    data["weight_map"][next(iter(data["weight_map"]))] = "../elsewhere/model.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.v1\.json.*\.\./elsewhere"):
        AutoModelForCausalLM.from_pretrained(tmp_path, variant="v1")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tables_stored_in_half_precision_are_not_called_off_the_hyperboloid(tmp_path, dtype):
    """Second re-probe: a fresh Lorentz model loaded in bf16 was told an optimiser had moved its tables."""
    tiny_model("helm_d", embedding_mode="lorentz", lm_head_mode="distance").save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)


def test_a_linked_code_file_in_the_save_folder_is_replaced_not_written_through(tmp_path):
    """Second re-probe: save_pretrained wrote HELM's code through a symlinked modeling_helm_d.py into the file it
    pointed at (a hub snapshot's files are such links)."""
    mine = tmp_path / "mine.py"
    mine.write_text("my own code\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "modeling_helm_d.py").symlink_to(mine)
    tiny_model("helm_d").save_pretrained(tmp_path / "model")
    assert mine.read_text() == "my own code\n"
    assert not (tmp_path / "model" / "modeling_helm_d.py").is_symlink()


def test_a_bundle_loaded_as_remote_code_saves_again_under_the_same_file_names(tmp_path):
    """Fourth re-probe: without helm, each save of a model loaded with trust_remote_code prefixed its code files again
    (transformers_modules_<folder>_...), until the sixth save failed with 'File name too long'."""
    import subprocess
    import sys

    tiny_model("helm_d").save_pretrained(tmp_path / "0")
    child = """
import os, sys
sys.modules["helm"] = None  # a process without helm: the bundle's own code runs
from transformers import AutoModelForCausalLM
root = sys.argv[1]
for i in range(1, 4):
    AutoModelForCausalLM.from_pretrained(f"{root}/{i - 1}", trust_remote_code=True).save_pretrained(f"{root}/{i}")
    print(sorted(n for n in os.listdir(f"{root}/{i}") if n.endswith(".py")))
"""
    done = subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    saved = done.stdout.strip().splitlines()
    first = sorted(n for n in os.listdir(tmp_path / "0") if n.endswith(".py"))
    assert saved == [repr(first)] * 3


def test_a_pickled_weights_file_is_named_without_torchs_unsafe_advice(tmp_path):
    """A pytorch_model.bin holding a pickled object: torch's refusal advised weights_only=False, which would run it."""
    model = tiny_model("helm_d")
    model.save_pretrained(tmp_path)
    for name in ("manifest.json", "model.safetensors"):
        os.remove(tmp_path / name)
    torch.save({**model.state_dict(), "extra": Path("planted")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(OSError, match="pytorch_model.bin") as error:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "trust" in str(error.value)
    os.rename(tmp_path / "pytorch_model.bin", tmp_path / "pytorch_model.v1.bin")  # third re-probe: the file is named
    with pytest.raises(OSError, match=r"\): pytorch_model\.v1\.bin holds more than tensors"):
        AutoModelForCausalLM.from_pretrained(tmp_path, variant="v1")


def test_float_position_ids_are_named():
    """Third re-probe: a float position_ids failed in the rotary tables' bit shift ('rshift_cpu' not implemented)."""
    with pytest.raises(ValueError, match=r"position_ids must be integers, got torch\.float32"):
        tiny_model("helm_d")(ids(), position_ids=torch.arange(T, dtype=torch.float32)[None])


def test_a_weight_that_overflows_float16_names_the_dtype(tmp_path):
    """Third re-probe: a finite fp32 weight above fp16's range, loaded with dtype=float16, was called a damaged
    checkpoint ('load an earlier checkpoint'); the culprit is the dtype."""
    model = tiny_model("helm_d")
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight[0, 0] = 1e5
    model.save_pretrained(tmp_path)
    with pytest.raises(OSError, match=r"in torch\.float16, the dtype it was loaded in .*load it in float32 or bfloat16"):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
