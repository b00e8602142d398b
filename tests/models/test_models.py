"""HELM-D and HELM-MiCE as ``transformers`` models: presets, forward/backward, impls, cache, save/load, remote
code, MiCE routing, configs (derived values, validators, old field names), the mask and positional tables
built once per forward, and the positional registry."""

import copy
import json
import math
import os
import subprocess
import sys
import textwrap

import geoopt
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, DeepseekV3ForCausalLM, LlamaForCausalLM

import helm
import helm.ops.attention as ops_attention
from helm.manifold import curvature_to_k, lift, manifold_error
from helm.models import HelmDConfig, HelmDForCausalLM, HelmMiCEConfig, HelmMiCEForCausalLM
from helm.nn.mice import MiCE
from helm.nn.positional import (
    POSITIONAL_ENCODINGS,
    PositionalEncoding,
    PositionalTables,
    register_positional_encoding,
)
from helm.nn.validation import CURVATURE_RANGE
from tests.helpers import MANIFOLD_TOL, assert_close, paper_parameter_count, tiny_model
from tests.references import change_curvature, weighted_centroid

FAMILIES = ["helm_d", "helm_mice"]


def count(model):
    return sum(p.numel() for p in model.parameters())


def active(model):
    total = count(model)
    for m in model.mice_layers():
        total -= sum(p.numel() for p in m.experts[0].parameters()) * (m.n_routed - m.top_k)
    return total


# The presets' counts are summed from the paper's layer shapes (tests.helpers.paper_parameter_count), not pinned
# from this implementation. The paper's counts (114,770,253; ≈126.4M / ≈117M active; ≈967M / ≈520M active) were
# measured on the official code; for helm-d-115m the official model is larger by exactly 292,036 (0.25%), read
# off the official state dict (tests/fixtures/official/helm_d_tiny.pt has the same layout): a Lorentz token
# table of 390 columns where ours stores the 389 space parts (+128,256 = vocab), a final_proj HLT 390 -> 390
# before the last norm (+389·390 + 389 = 152,099), output projections fed the flattened heads 6·65 = 390 instead
# of HCat's 385 (+5·389 per layer, +11,670), one learned score bias per layer (+6, it cancels in the softmax), the
# embedding's positional residual weight and scale (+2) and three trainable model-level curvatures (+3); the
# first three are the official switches, whose count tests/test_convert.py ties to 114,770,253. The MiCE presets
# differ by the same kinds of terms (≈0.36M, 0.28%; ≈1.5M, 0.15%).
PAPER_PRESETS = ["helm-d-115m", "helm-d-115m-learned", "helm-mice-120m", "helm-mice-120m-const",
                 "helm-mice-120m-hmha", "helm-mice-120m-learned", "helm-mice-1b", "tiny-helm-d", "tiny-helm-mice"]


@pytest.mark.parametrize("preset", PAPER_PRESETS)
def test_preset_parameter_counts_are_the_papers_layer_shapes(preset):
    config = helm.load_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert next(model.parameters()).device.type == "meta"  # nothing allocated
    total, act = paper_parameter_count(config)
    assert count(model) == total
    assert (active(model) if config.model_type == "helm_mice" else count(model)) == act


def test_documented_helm_d_115m_count():
    assert paper_parameter_count(helm.load_config("helm-d-115m"))[0] == 114_478_217  # FIDELITY.md


@pytest.mark.parametrize("preset,cls", [("llama-115m", LlamaForCausalLM), ("deepseek-v3-120m", DeepseekV3ForCausalLM),
                                         ("tiny-llama", LlamaForCausalLM), ("tiny-deepseek-v3", DeepseekV3ForCausalLM)])
def test_euclidean_baselines_are_transformers_classes(preset, cls):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(helm.load_config(preset))
    assert type(model) is cls


def test_paper_shape_deepseek_v3_twin_trains_on_its_preset():
    """At the paper's hidden size 390 the rows are not 16-byte aligned, which transformers' default grouped-GEMM
    experts refuse (a RuntimeError); the preset selects the per-expert loop, so its model trains as loaded
    (two of its six layers and a small vocabulary, the paper's widths)."""
    config = helm.load_config("deepseek-v3-120m", num_hidden_layers=2, vocab_size=512)
    assert config.hidden_size == 390 and config._experts_implementation == "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 512, (2, 37))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    experts = model.model.layers[1].mlp.experts
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in experts.parameters())


def test_all_presets_load():
    for name in helm.available_presets():
        cfg = helm.load_config(name)
        assert cfg.model_type in ("helm_d", "helm_mice", "llama", "deepseek_v3")


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_backward_layers_on_manifold_and_bf16(family):
    model = tiny_model(family, train=True)
    ids = torch.randint(0, 512, (2, 37))
    out = model(ids, labels=ids, output_hidden_states=True)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    for h in out.hidden_states:
        assert manifold_error(h, 1.0).max() <= MANIFOLD_TOL[torch.float32]
    # against the same weights in fp64: fp32 to its rounding; bf16 autocast logits within 2x the error of the
    # model run entirely in bf16 (FlashAttention's rule); and the bf16 loss within what that logit error can
    # move a cross-entropy (its gradient in the logits has l1 norm <= 2, so |Δloss| <= 2 max|Δlogit|)
    with torch.no_grad():
        exact = tiny_model(family, train=True).double()(ids, labels=ids, skip_logits=False)  # the same weights
        naive = tiny_model(family, train=True).to(torch.bfloat16)(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = model(ids).logits, model(ids, labels=ids).loss
    assert_close(out.loss, exact.loss, dtype=torch.float32)
    assert_close(logits, exact.logits, baseline=naive)
    logit_error = (logits.double() - exact.logits).abs().max()
    assert_close(loss, exact.loss, rtol=float(2 * logit_error / exact.loss.abs()))


OFFICIAL_SWITCHES = [("hcat", False), ("flatten", False), ("hcat", True), ("flatten", True)]


@pytest.mark.parametrize("head_merge,final_proj", OFFICIAL_SWITCHES,
                         ids=[f"{m}-{'final_proj' if f else 'no_final_proj'}" for m, f in OFFICIAL_SWITCHES])
@pytest.mark.parametrize("family", FAMILIES)
def test_fidelity_switches_stay_on_the_manifold_and_causal(family, head_merge, final_proj):
    """Issue 12: every head merge and the official final projection give points on the manifold, finite
    gradients, and outputs at t that do not depend on tokens after t; cached decoding equals the full forward."""
    model = tiny_model(family, head_merge=head_merge, final_proj=final_proj, attn_implementation="eager", train=True)
    assert (model.model.final_proj is not None) == final_proj
    c = model.config
    heads, value_dim = c.num_attention_heads, c.v_head_dim if family == "helm_mice" else c.head_dim  # 1 + d_v
    merged = heads * value_dim if head_merge == "flatten" else 1 + heads * (value_dim - 1)
    assert model.model.layers[0].self_attn.o_proj.in_features == merged
    ids = torch.randint(0, 512, (2, 31), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids, output_hidden_states=True)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    for h in (*out.hidden_states, model.model(ids).last_hidden_state):
        assert manifold_error(h.detach(), 1.0).max() <= MANIFOLD_TOL[torch.float32]
    model.eval()
    changed = ids.clone()
    changed[:, 20:] = (changed[:, 20:] + 7) % 512
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
        assert_close(a[:, :20], b[:, :20], rtol=1e-6)
        assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-3
        step = model(ids[:, :30], use_cache=True)
        last = model(ids[:, 30:], past_key_values=step.past_key_values).logits
        assert_close(last[:, -1], a[:, -1], rtol=1e-4)


@pytest.mark.parametrize("positional", list(POSITIONAL_ENCODINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_eager_and_sdpa_give_the_same_logits(family, positional):
    ids = torch.randint(0, 512, (2, 29))
    logits = {}
    for impl in ("eager", "sdpa"):
        model = tiny_model(family, attn_implementation=impl, positional=positional, rope3d_chunk_size=8)
        logits[impl] = model(ids).logits
    assert_close(logits["sdpa"], logits["eager"], rtol=1e-4)


def full_forward_decode(model, ids, mask, steps, pick):
    """``steps`` tokens, each ``pick(last-position logits)`` of a full forward over everything so far (no cache),
    positions counted from each row's first unpadded token as ``generate`` counts them."""
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
            token = pick(logits[:, -1].float())
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    return ids, mask


def full_forward_beam_search(model, ids, mask, steps, width):
    """The ``width`` beams after ``steps`` tokens, best first, with their scores: each step keeps the ``width``
    highest sums of token log-probabilities over every extension of every beam (full forwards, no cache)."""
    scores = torch.zeros(1)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
            scores, best = (scores[:, None] + logits[:, -1].float().log_softmax(-1)).flatten().topk(width)
            parent, token = best // logits.shape[-1], best[:, None] % logits.shape[-1]
            ids, mask = torch.cat([ids[parent], token], 1), torch.cat([mask[parent], torch.ones_like(token)], 1)
    return ids, scores


def top_k_sample(k):
    def pick(logits):
        kth = logits.topk(k, dim=-1).values[:, -1:]
        return torch.multinomial(logits.masked_fill(logits < kth, float("-inf")).softmax(-1), 1)
    return pick


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_cache_equals_without(family):
    model = tiny_model(family)
    prompt = torch.randint(2, 512, (2, 6))
    mask = torch.ones_like(prompt)
    prompt[1, :2], mask[1, :2] = 1, 0  # left padding (pad id 1)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=None)
    with_cache = model.generate(prompt, use_cache=True, output_logits=True, return_dict_in_generate=True, **kw)
    no_cache = model.generate(prompt, use_cache=False, output_logits=True, return_dict_in_generate=True, **kw)
    assert torch.equal(with_cache.sequences, no_cache.sequences)
    for a, b in zip(with_cache.logits, no_cache.logits):
        assert_close(a, b, rtol=1e-4)
    # greedy is the argmax of full forwards, token by token
    greedy, _ = full_forward_decode(model, prompt, mask, 12, lambda logits: logits.argmax(-1, keepdim=True))
    assert torch.equal(with_cache.sequences, greedy)
    # the left-padded row generates what it generates alone
    alone = model.generate(prompt[1:, 2:], max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=None)
    assert torch.equal(alone[0, -12:], with_cache.sequences[1, -12:])
    # top-k sampling through the cache draws what torch.multinomial draws from full forwards' top-k softmax with
    # the same seed; top_k=1 sampling is greedy
    sample = dict(attention_mask=mask, max_new_tokens=5, do_sample=True, pad_token_id=1, eos_token_id=None)
    torch.manual_seed(1)
    sampled = model.generate(prompt, top_k=20, **sample)
    torch.manual_seed(1)
    assert torch.equal(sampled, full_forward_decode(model, prompt, mask, 5, top_k_sample(20))[0])
    assert torch.equal(model.generate(prompt, top_k=1, **sample), greedy[:, :11])
    # beam search reorders the cache between beams: its beams and their scores (length_penalty 0: sums of token
    # log-probabilities) are those of a search over full forwards
    width = 5  # enough beams that they part before the last step, so a beam's cache is not its neighbour's
    beams = model.generate(prompt, attention_mask=mask, max_new_tokens=5, num_beams=width,
                           num_return_sequences=width, do_sample=False, length_penalty=0.0, pad_token_id=1,
                           eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    for row in range(2):
        sequences, scores = full_forward_beam_search(model, prompt[row:row + 1], mask[row:row + 1], 5, width)
        assert torch.equal(beams.sequences[width * row:width * (row + 1)], sequences)
        assert_close(beams.sequences_scores[width * row:width * (row + 1)], scores, rtol=1e-5)


@pytest.mark.parametrize("absorb", [False, True])
def test_mice_cache_is_the_latent(absorb):
    """c_KV and k^R, nothing per head but (absorbed decoding) three scalars per head after c_KV."""
    model = tiny_model("helm_mice", hmla_absorb=absorb)
    out = model(torch.randint(0, 512, (1, 9)), use_cache=True)
    cfg = model.config
    for layer in out.past_key_values.layers:
        assert tuple(layer.keys.shape) == (1, 1, 9, cfg.kv_lora_rank + 3 * cfg.num_attention_heads * absorb)
        assert tuple(layer.values.shape) == (1, 1, 9, cfg.qk_rope_head_dim)


@pytest.mark.parametrize("family,overrides", [
    ("helm_d", {"embedding_mode": "lorentz", "lm_head_mode": "distance"}),
    ("helm_mice", {"embedding_mode": "lorentz", "trainable_curvatures": False}),
    ("helm_mice", {}),
])
def test_save_and_load_round_trip_keeps_geometry(tmp_path, family, overrides):
    model = tiny_model(family, **overrides)
    ids = torch.randint(0, 512, (2, 13))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    if overrides.get("embedding_mode") == "lorentz":
        table = loaded.model.embed_tokens.weight
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


@pytest.mark.parametrize("family", FAMILIES)
def test_remote_code_loads_without_helm(tmp_path, family):
    model = tiny_model(family)
    type(model).register_for_auto_class("AutoModelForCausalLM")
    type(model.config).register_for_auto_class()
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert set(auto_map) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                             "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"}
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
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(expected.tolist())


def mice_reference(mice, x):
    """Eq. 5-6 written out in fp64: sigmoid scores of the space part, top-k of score + routing bias, weights
    renormalised over the selected; each routed expert's SwiGLU_L (the layer, tested on its own) run on
    ``H_{k_j}`` between two curvature changes; one Eq. 3 centroid of routed (weights g_j) and shared (weight 1)
    outputs."""
    # scores in fp32, as the layer routes: training saturates the sigmoid, and the tie at 1.0 must break alike
    scores = (x[..., 1:].float() @ mice.gate.weight.float().T).sigmoid()
    chosen = (scores + mice.e_score_correction_bias.float()).topk(mice.top_k, dim=-1).indices
    x, scores = x.double(), scores.double()
    g = torch.zeros_like(scores).scatter(-1, chosen, scores.gather(-1, chosen))
    g = g / g.sum(-1, keepdim=True)
    outs = []
    for e in mice.experts:
        k_j = float(e.k_expert)
        expert = copy.deepcopy(e.mlp).double()
        outs.append(change_curvature(expert(change_curvature(x, mice.k, k_j), k=k_j), k_j, mice.k))
    outs += [copy.deepcopy(s).double()(x) for s in mice.shared_experts]
    weights = torch.cat([g, torch.ones(*g.shape[:-1], len(mice.shared_experts), dtype=g.dtype)], -1)
    return weighted_centroid(torch.stack(outs, -2), weights, mice.k)


def test_mice_layer_is_the_eq_6_centroid_and_curvatures_stay_within_their_margin():
    """The fp32 layer's value against :func:`mice_reference` to fp32 rounding, before and after training has
    pushed every expert curvature out of the config range: k_j may then move at most a factor 10 beyond
    CURVATURE_RANGE (helm.nn.mice.CurvatureExpert), smoothly, so its gradient never vanishes."""
    torch.manual_seed(0)
    mice = MiCE(1 + 16, 1 + 24, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, k=1.0,
                routed_curvatures=[-0.1, -0.7, -1.3, -2.0])
    ks = [float(e.k_expert.detach()) for e in mice.experts]
    assert ks == pytest.approx([10.0, 1 / 0.7, 1 / 1.3, 0.5], rel=1e-5)
    x = lift(torch.randn(3, 11, 16) * 3, k=1.0)

    def check_value():
        with torch.no_grad():
            assert_close(mice(x), mice_reference(mice, x), dtype=torch.float32)

    check_value()
    opt = torch.optim.Adam(mice.parameters(), lr=10.0)
    for _ in range(100):
        opt.zero_grad()
        (mice(x)[..., 1:].pow(2).sum() + mice.aux_loss * 1e3).backward()
        opt.step()
    ks = torch.stack([e.k_expert.detach() for e in mice.experts])
    assert (ks < CURVATURE_RANGE[0]).all()  # training left the config range ...
    assert (ks > CURVATURE_RANGE[0] / 10).all() and (ks < CURVATURE_RANGE[1] * 10).all()  # ... within the margin
    assert all(e.log_k.grad.abs() > 0 for e in mice.experts)
    check_value()


def test_bias_update_moves_load_towards_uniform():
    torch.manual_seed(0)
    mice = MiCE(1 + 8, 1 + 8, n_routed_experts=4, num_experts_per_tok=1, n_shared_experts=0, k=1.0,
                bias_update_speed=0.002)
    with torch.no_grad():
        mice.gate.weight.normal_(0, 0.3)
        mice.gate.weight[0] += 0.5  # expert 0 is favoured on the skewed batch below
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


def test_mice_aux_loss_is_added_in_training_only():
    model = tiny_model("helm_mice")
    ids = torch.randint(0, 512, (2, 17))
    model.train()
    out = model(ids, labels=ids, skip_logits=False)  # the logits too (training with labels skips them by default)
    layers = model.mice_layers()
    assert len(layers) == model.config.num_hidden_layers - model.config.first_k_dense_replace
    expected = torch.stack([m.aux_loss for m in layers]).sum()
    assert out.aux_loss is not None and torch.equal(out.aux_loss, expected) and out.aux_loss > 0
    lm_loss = model.loss_function(logits=out.logits, labels=ids, vocab_size=model.config.vocab_size)
    assert_close(out.loss, lm_loss + expected)
    model.eval()
    out = model(ids, labels=ids)
    assert out.aux_loss is None
    assert_close(out.loss, model.loss_function(logits=out.logits, labels=ids, vocab_size=model.config.vocab_size))
    assert model.expert_load().shape == (len(layers), model.config.n_routed_experts)


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
    (dict(q_lora_rank=1), "q_lora_rank"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(aux_loss_alpha=-1.0), "aux_loss_alpha"),
])
def test_inconsistent_mice_settings_raise_at_config_time(kw, match):
    with pytest.raises(ValueError, match=match):
        HelmMiCEConfig(**kw)


@pytest.mark.parametrize("field,value,accepted", [
    ("hidden_size", 1, "integer >= 2"),
    ("vocab_size", 0, "integer >= 1"),
    ("num_attention_heads", True, "integer >= 1"),
    ("rms_norm_eps", 0.0, "positive"),
    ("rope_theta", float("inf"), "positive finite"),
    ("curvature", float("nan"), "negative"),
    ("lm_head_mode", "mlr", "one of"),
    ("hidden_act", "swish-ish", "one of"),
    ("positional", "rope", "one of"),
    ("rope3d_chunk_size", 0, "integer >= 1"),
    ("rope3d_chunk_base", 1.0, "> 1"),
    ("hope_boost_angle_scale", -1.0, "positive"),
    ("hope_boost_learnable_decay", "yes", "bool"),
    ("residual_space_scale_factor", 0.0, "positive"),
    ("tau_init", -1.0, "positive"),
])
def test_config_validators_name_the_bad_field(field, value, accepted):
    """The culprit is named: the field and the value (the wording of what is accepted is free)."""
    with pytest.raises(ValueError, match=field) as err:
        HelmDConfig(**{field: value})
    assert repr(value) in str(err.value)


@pytest.mark.parametrize("kw,match", [
    (dict(head_dim=1 + 15), "head_dim.*hope"),
    (dict(positional="hope_boost", hope_boost_theta_prime=1.0), "hope_boost_theta_prime"),
    (dict(hidden_size=3, num_attention_heads=4), "head_dim"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
])
def test_cross_field_checks_name_the_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        HelmDConfig(**kw)
    if "head_dim" in kw:  # kinds that do not act on pairs accept odd head dims
        assert HelmDConfig(**kw, positional="alibi").head_dim == 16


def test_head_dim_defaults_to_the_papers_split():
    assert HelmDConfig().head_dim == 65  # 390 ambient, 6 heads of 1 + 64 (paper §4)
    assert HelmDConfig(hidden_size=129, num_attention_heads=4).head_dim == 33
    assert HelmMiCEConfig(attention_type="mha", hidden_size=910, num_attention_heads=14).head_dim == 65


def test_config_k_is_derived_from_curvature():
    cfg = HelmDConfig(curvature=-0.25)
    assert cfg.k == curvature_to_k(-0.25) == 4.0
    cfg.curvature = -2.0
    assert cfg.k == 0.5
    assert "k" not in cfg.to_dict()  # derived, never stored
    assert HelmMiCEConfig(curvature=-0.5).k == 2.0


@pytest.mark.parametrize("preset,factor", [("helm-d-115m", 4.0), ("helm-mice-120m", 1.0), ("tiny-helm-d", 4.0),
                                            ("tiny-helm-mice", 1.0), ("helm-mice-1b", 1.0)])
def test_residual_scale_is_a_factor_of_sqrt_space_dim_and_follows_hidden_size(preset, factor):
    cfg = helm.load_config(preset)
    assert cfg.residual_space_scale_factor == factor
    assert cfg.residual_space_scale == factor * math.sqrt(cfg.hidden_size - 1)
    mice = dict(qk_rope_head_dim=9) if "mice" in preset else {}  # overrides must be fields of the config
    small = helm.load_config(preset, hidden_size=65, num_attention_heads=4, head_dim=17, **mice)
    assert small.residual_space_scale == factor * 8.0
    if mice:
        mice.update(kv_lora_rank=17, moe_intermediate_size=33)
    model = AutoModelForCausalLM.from_config(helm.load_config(preset, hidden_size=65, num_attention_heads=4,
                                                              head_dim=17, vocab_size=64, num_hidden_layers=1,
                                                              intermediate_size=65, **mice))
    assert model.model.layers[0].attn_residual.space_scale == factor * 8.0
    assert HelmDConfig(residual_space_scale_factor=None).residual_space_scale is None
    assert "residual_space_scale" not in cfg.to_dict()


def test_configs_saved_with_old_field_names_still_load():
    """``residual_space_scale`` (absolute) and ``pe_options`` were renamed; old configs convert on load."""
    old = HelmDConfig(hidden_size=65, num_attention_heads=4, residual_space_scale=32.0,
                      pe_options={"chunk_size": 8, "theta_prime": 1.5})
    assert old.residual_space_scale_factor == 4.0 and old.residual_space_scale == 32.0
    assert (old.rope3d_chunk_size, old.hope_boost_theta_prime) == (8, 1.5)
    with pytest.raises(ValueError, match="pe_options: unknown option 'chunk'"):
        HelmDConfig(pe_options={"chunk": 8})


@pytest.mark.parametrize("family,layer", [("helm_d", "HelmDDecoderLayer"), ("helm_mice", "HelmMiCEDecoderLayer")])
def test_no_split_modules_name_the_familys_decoder_layer(family, layer):
    model = tiny_model(family)
    assert type(model)._no_split_modules == [layer] and set(model._no_split_modules) == {layer}
    assert {type(m).__name__ for m in model.model.layers} == {layer}


@pytest.mark.parametrize("family", FAMILIES)
def test_mask_and_positional_tables_are_built_once_per_forward(family, monkeypatch):
    """Two layers share one AttentionMask (its dense form computed once) and one PositionalTables."""
    model = tiny_model(family, num_hidden_layers=3, attn_implementation="eager")
    counts = {"dense": 0, "tables": 0}
    dense = ops_attention._dense_keep

    def counting_dense(mask):
        counts["dense"] += 1
        return dense(mask)

    monkeypatch.setattr(ops_attention, "_dense_keep", counting_dense)
    encoding = model.model.pos_encoding
    tables = type(encoding).tables
    monkeypatch.setattr(type(encoding), "tables",
                        lambda self, *a: counts.__setitem__("tables", counts["tables"] + 1) or tables(self, *a))
    seen = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append((kwargs["attention_mask"], kwargs["position_embeddings"])),
            with_kwargs=True)
    ids = torch.randint(0, 512, (2, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    model(ids, attention_mask=mask)
    assert counts == {"dense": 1, "tables": 1}
    assert len(seen) == 3 and all(m is seen[0][0] and t is seen[0][1] for m, t in seen)
    assert isinstance(seen[0][0], ops_attention.AttentionMask) and isinstance(seen[0][1], PositionalTables)


def test_a_registered_encoding_works_in_configs_and_models(tiny_config):
    """Adding an encoding is one class and one registry entry: configs accept it, models build and apply it."""

    class Reverse(PositionalEncoding):
        """Test encoding: a position-independent sign flip of every other coordinate (norm preserving)."""

        kind = "flip_test"
        rotary = True
        pairs = True

        @classmethod
        def build(cls, *, head_dim, **_):
            return cls()

        def tables(self, position_ids, q_pos, k_pos, dtype):
            B, T = position_ids.shape
            angle = torch.full((B, T, 1), math.pi / 2, dtype=dtype)
            return PositionalTables(cos=angle.cos(), sin=angle.sin())

    with pytest.raises(ValueError, match="positional must be one of"):
        tiny_config("helm_d", positional="flip_test")
    try:
        register_positional_encoding(Reverse)
        assert POSITIONAL_ENCODINGS["flip_test"] is Reverse
        model = tiny_model("helm_d", positional="flip_test")
        assert isinstance(model.model.pos_encoding, Reverse)
        ids = torch.randint(0, 512, (1, 9))
        plain = tiny_model("helm_d", positional="none")
        plain.load_state_dict(model.state_dict())
        assert not torch.equal(model(ids).logits, plain(ids).logits)
        with pytest.raises(ValueError, match=r"head_dim.*'flip_test'"):
            tiny_config("helm_d", positional="flip_test", head_dim=16, hidden_size=31)
    finally:
        POSITIONAL_ENCODINGS.pop("flip_test", None)


def test_input_errors_are_not_silent():
    """Token ids outside the vocabulary fail in the embedding lookup (torch's error, as for Llama; no host read of
    the ids in a step), and positions beyond a learned table fail naming position_ids (torch._assert_async)."""
    model = tiny_model("helm_d")
    with pytest.raises(IndexError):
        model(torch.tensor([[1, 2, 512]]))
    learned = tiny_model("helm_d", positional="learned", max_position_embeddings=16)
    learned(torch.randint(0, 512, (1, 16)))
    with pytest.raises(RuntimeError, match="position_ids"):
        learned(torch.randint(0, 512, (1, 17)))
    # relative encodings extend beyond the configured maximum
    assert torch.isfinite(tiny_model("helm_d", max_position_embeddings=16)(
        torch.randint(0, 512, (1, 40))).logits).all()


def test_packed_documents_do_not_interact_in_the_model():
    model = tiny_model("helm_mice")
    ids = torch.randint(0, 512, (1, 30))
    seg = torch.tensor([[0] * 12 + [1] * 18])
    pos = torch.cat([torch.arange(12), torch.arange(18)]).unsqueeze(0)
    a = model(ids, segment_ids=seg, position_ids=pos).logits
    ids2 = ids.clone()
    ids2[0, :12] = torch.randint(0, 512, (12,))
    b = model(ids2, segment_ids=seg, position_ids=pos).logits
    assert torch.equal(a[:, 12:], b[:, 12:])
    alone = model(ids[:, 12:]).logits
    assert_close(alone, a[:, 12:], rtol=1e-4)


def test_isinstance_and_registration():
    assert isinstance(tiny_model("helm_d"), HelmDForCausalLM)
    assert isinstance(tiny_model("helm_mice"), HelmMiCEForCausalLM)


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lms_generate_and_cache_like_transformers_models(family):
    """``…ForCausalLM`` is a generating model for transformers; the bare model does not generate. A forward's own
    cache is transformers' DynamicCache."""
    from transformers import DynamicCache, GenerationMixin

    model = tiny_model(family)
    assert type(model).can_generate() and isinstance(model, GenerationMixin) and model.generation_config is not None
    assert not type(model.model).can_generate()
    cache = model(torch.randint(0, 512, (1, 4)), use_cache=True).past_key_values
    assert type(cache) is DynamicCache and cache.get_seq_length() == 4


def test_attention_weights_of_a_decode_step_on_an_absorbed_mice_cache():
    """A decode step that returns attention weights on a cache written by absorbed HMLA decoding (latents plus
    per-token scalars): it attends on the plain path and extends the cache in its absorbed layout (it wrote
    plain-width latents before, which did not fit: a torch.cat error), with the logits of a step without weights."""
    model = tiny_model("helm_mice", attn_implementation="eager")
    prompt, step = torch.randint(0, 512, (2, 5)), torch.randint(0, 512, (2, 1))
    with torch.no_grad():  # a cache without autograd history can be copied
        cache = model(prompt, use_cache=True).past_key_values
    width = cache.layers[0].keys.shape[-1]
    assert width > model.config.kv_lora_rank  # the absorbed layout
    reference = model(step, past_key_values=copy.deepcopy(cache)).logits
    out = model(step, past_key_values=cache, use_cache=True, output_attentions=True)
    assert_close(out.logits, reference, rtol=1e-4)
    assert [tuple(w.shape) for w in out.attentions] == [(2, model.config.num_attention_heads, 1, 6)] * 2
    assert cache.layers[0].keys.shape[-2:] == (6, width)
    assert all(m.absorb_max_query > 0 for m in model.modules() if hasattr(m, "absorb_max_query"))  # restored
    assert model(step, past_key_values=cache).logits.shape == (2, 1, 512)
