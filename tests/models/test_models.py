import json
import subprocess
import sys
import textwrap

import geoopt
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, DeepseekV3ForCausalLM, LlamaForCausalLM

import helm
from helm.manifold import manifold_error
from helm.models import HelmDForCausalLM, HelmMiCEConfig, HelmMiCEForCausalLM
from helm.nn.mice import MiCE

FAMILIES = {"helm_d": "tiny-helm-d", "helm_mice": "tiny-helm-mice"}
SMALL = dict(num_hidden_layers=2, vocab_size=512, max_position_embeddings=128)


def tiny(family, **overrides):
    torch.manual_seed(0)
    cfg = helm.load_config(FAMILIES[family], **{**SMALL, **overrides})
    return AutoModelForCausalLM.from_config(cfg)


def count(model):
    return sum(p.numel() for p in model.parameters())


def active(model):
    total = count(model)
    for m in model.mice_layers():
        total -= sum(p.numel() for p in m.experts[0].parameters()) * (m.n_routed - m.top_k)
    return total


@pytest.mark.parametrize("preset,total,act", [
    ("helm-d-115m", 114_770_253, None),
    ("helm-mice-120m", 126.4e6, 117e6),
    ("helm-mice-1b", 967.0e6, 520e6),
])
def test_paper_preset_parameter_counts_on_meta_device(preset, total, act):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(helm.load_config(preset))
    assert next(model.parameters()).device.type == "meta"  # nothing allocated
    assert abs(count(model) / total - 1) <= 0.02, f"{count(model):,} vs {total:,.0f}"
    if act is not None:
        assert abs(active(model) / act - 1) <= 0.02, f"active {active(model):,} vs {act:,.0f}"


@pytest.mark.parametrize("preset,cls", [("llama-115m", LlamaForCausalLM), ("deepseek-v3-120m", DeepseekV3ForCausalLM),
                                         ("tiny-llama", LlamaForCausalLM), ("tiny-deepseek-v3", DeepseekV3ForCausalLM)])
def test_euclidean_baselines_are_transformers_classes(preset, cls):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(helm.load_config(preset))
    assert type(model) is cls


def test_all_presets_load():
    for name in helm.available_presets():
        cfg = helm.load_config(name)
        assert cfg.model_type in ("helm_d", "helm_mice", "llama", "deepseek_v3")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forward_backward_layers_on_manifold_and_bf16(family):
    model = tiny(family)
    ids = torch.randint(0, 512, (2, 37))
    out = model(ids, labels=ids, output_hidden_states=True)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    for h in out.hidden_states:
        assert manifold_error(h, 1.0).max() <= 1e-5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    assert torch.isfinite(loss)
    assert abs(loss.item() - out.loss.item()) < 0.05 * out.loss.item()


@pytest.mark.parametrize("positional", ["hope", "alibi", "hope_boost", "learned", "rope3d", "none"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_eager_and_sdpa_give_the_same_logits(family, positional):
    ids = torch.randint(0, 512, (2, 29))
    logits = {}
    for impl in ("eager", "sdpa"):
        model = tiny(family, attn_impl=impl, positional=positional, pe_options=(
            {"chunk_size": 8} if positional == "rope3d" else None)).eval()
        logits[impl] = model(ids).logits
    assert torch.allclose(logits["eager"], logits["sdpa"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generation_with_cache_equals_without(family):
    model = tiny(family).eval()
    prompt = torch.randint(2, 512, (2, 6))
    mask = torch.ones_like(prompt)
    prompt[1, :2], mask[1, :2] = 1, 0  # left padding (pad id 1)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=None)
    with_cache = model.generate(prompt, use_cache=True, output_logits=True, return_dict_in_generate=True, **kw)
    no_cache = model.generate(prompt, use_cache=False, output_logits=True, return_dict_in_generate=True, **kw)
    assert torch.equal(with_cache.sequences, no_cache.sequences)
    for a, b in zip(with_cache.logits, no_cache.logits):
        assert (a - b).abs().max() <= 1e-4
    # the left-padded row generates what it generates alone
    alone = model.generate(prompt[1:, 2:], max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=None)
    assert torch.equal(alone[0, -12:], with_cache.sequences[1, -12:])
    # sampling and beam search run through the same cache
    torch.manual_seed(0)
    sampled = model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=20,
                             pad_token_id=1, eos_token_id=None)
    beams = model.generate(prompt, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False,
                           pad_token_id=1, eos_token_id=None)
    assert sampled.shape == beams.shape == (2, 11)


def test_mice_cache_is_the_latent():
    model = tiny("helm_mice").eval()
    out = model(torch.randint(0, 512, (1, 9)), use_cache=True)
    layer = out.past_key_values.layers[0]
    cfg = model.config
    assert tuple(layer.keys.shape) == (1, 1, 9, cfg.kv_lora_rank)
    assert tuple(layer.values.shape) == (1, 1, 9, cfg.qk_rope_head_dim)


@pytest.mark.parametrize("family,overrides", [
    ("helm_d", {"embedding_mode": "lorentz", "lm_head_mode": "distance"}),
    ("helm_mice", {"embedding_mode": "lorentz", "trainable_curvatures": False}),
    ("helm_mice", {}),
])
def test_save_and_load_round_trip_keeps_geometry(tmp_path, family, overrides):
    model = tiny(family, **overrides).eval()
    ids = torch.randint(0, 512, (2, 13))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    if overrides.get("embedding_mode") == "lorentz":
        table = loaded.model.embed.embed_tokens.weight
        assert isinstance(table, geoopt.ManifoldParameter) and isinstance(table.manifold, geoopt.Lorentz)
    if overrides.get("lm_head_mode") == "distance":
        assert isinstance(loaded.lm_head.weight, geoopt.ManifoldParameter)
    curv = [p for n, p in loaded.named_parameters() if n.endswith("log_k")]
    if family == "helm_mice":
        assert curv and all(p.requires_grad == overrides.get("trainable_curvatures", True) for p in curv)
        assert torch.equal(torch.stack(curv), torch.stack([p for n, p in model.named_parameters()
                                                            if n.endswith("log_k")]))
    assert (tmp_path / "model.safetensors").is_file()
    assert isinstance(AutoModel.from_pretrained(tmp_path), type(loaded.model))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_remote_code_loads_without_helm(tmp_path, family):
    model = tiny(family).eval()
    type(model).register_for_auto_class("AutoModelForCausalLM")
    type(model.config).register_for_auto_class()
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert set(auto_map) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    prompt = [[5, 6, 7, 8]]
    expected = model.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False, eos_token_id=None)
    code = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True).eval()
        out = m.generate(torch.tensor({prompt}), max_new_tokens=6, do_sample=False, eos_token_id=None)
        assert not any(k == "helm" or k.startswith("helm.") for k in sys.modules), "helm was imported"
        print(out.tolist())
    """)
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(expected.tolist())


def test_mice_layer_outputs_on_manifold_and_curvatures_stay_valid():
    torch.manual_seed(0)
    mice = MiCE(1 + 16, 1 + 24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, k=1.0,
                routed_curvatures=[-0.1, -0.7, -1.3, -2.0])
    ks = [float(e.k_expert.detach()) for e in mice.experts]
    assert ks == pytest.approx([10.0, 1 / 0.7, 1 / 1.3, 0.5], rel=1e-5)
    from helm.manifold import lift

    x = lift(torch.randn(3, 11, 16) * 3, k=1.0)
    assert manifold_error(mice(x), 1.0).max() <= 1e-5
    opt = torch.optim.Adam(mice.parameters(), lr=10.0)
    for _ in range(100):
        opt.zero_grad()
        mice.train()
        (mice(x)[..., 1:].pow(2).sum() + mice.aux_loss * 1e3).backward()
        opt.step()
    for e in mice.experts:
        k = e.k_expert
        assert torch.isfinite(k) and k > 0
    assert torch.isfinite(mice(x)).all() and manifold_error(mice(x), 1.0).max() <= 1e-5


def test_bias_update_moves_load_towards_uniform():
    torch.manual_seed(0)
    mice = MiCE(1 + 8, 1 + 8, n_routed_experts=4, num_experts_per_tok=1, n_shared_experts=0, k=1.0,
                bias_update_speed=0.002)
    with torch.no_grad():
        mice.gate.weight.normal_(0, 0.3)
        mice.gate.weight[0] += 0.5  # expert 0 is favoured on the skewed batch below
    from helm.manifold import lift

    xs = torch.randn(1, 256, 8)
    xs[..., :] += 1.0  # skewed batch
    x = lift(xs, k=1.0)

    def imbalance():
        mice(x)
        load = mice.last_expert_load
        return (load.max() - load.min()).item(), load

    before, load0 = imbalance()
    assert load0[0] > 0.6 * 256
    for _ in range(300):
        mice(x)
        mice.update_bias()
    after, _ = imbalance()
    assert after < 0.5 * before


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts_per_tok=5, n_routed_experts=4), "num_experts_per_tok"),
    (dict(first_k_dense_replace=9, num_hidden_layers=2), "first_k_dense_replace"),
    (dict(routed_curvatures=[-1.0, -1.0]), "routed_curvatures"),
    (dict(routed_curvatures=[-1.0, 0.5, -1.0, -1.0]), "routed_curvatures"),
    (dict(curvature=1.0), "curvature"),
    (dict(qk_rope_head_dim=8), "qk_rope_head_dim"),
    (dict(attention_type="gqa"), "attention_type"),
    (dict(embedding_mode="poincare"), "embedding_mode"),
    (dict(positional="yarn"), "positional"),
])
def test_inconsistent_mice_settings_raise_at_config_time(kw, match):
    with pytest.raises(ValueError, match=match):
        HelmMiCEConfig(**kw)


def test_input_errors_are_clear():
    model = tiny("helm_d").eval()
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=512\)"):
        model(torch.tensor([[1, 2, 512]]))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[-1, 2]]))
    learned = tiny("helm_d", positional="learned", max_position_embeddings=16).eval()
    learned(torch.randint(0, 512, (1, 16)))
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=16"):
        learned(torch.randint(0, 512, (1, 17)))
    # relative encodings extend beyond the configured maximum
    assert torch.isfinite(tiny("helm_d", max_position_embeddings=16)(torch.randint(0, 512, (1, 40))).logits).all()


def test_packed_documents_do_not_interact_in_the_model():
    model = tiny("helm_mice").eval()
    ids = torch.randint(0, 512, (1, 30))
    seg = torch.tensor([[0] * 12 + [1] * 18])
    pos = torch.cat([torch.arange(12), torch.arange(18)]).unsqueeze(0)
    a = model(ids, segment_ids=seg, position_ids=pos).logits
    ids2 = ids.clone()
    ids2[0, :12] = torch.randint(0, 512, (12,))
    b = model(ids2, segment_ids=seg, position_ids=pos).logits
    assert torch.allclose(a[:, 12:], b[:, 12:], atol=1e-6)
    alone = model(ids[:, 12:]).logits
    assert torch.allclose(alone, a[:, 12:], atol=1e-4)


def test_isinstance_and_registration():
    assert isinstance(tiny("helm_d"), HelmDForCausalLM)
    assert isinstance(tiny("helm_mice"), HelmMiCEForCausalLM)
