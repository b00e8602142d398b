"""RoPE scaling of the rotary encodings (``hope``, ``rope3d``, HMLA's decoupled HoPE), configured by a Llama-style
``rope_parameters`` dict: frequencies and attention factors equal ``transformers.modeling_rope_utils``', Prop. 4.1
with scaling, ``factor = 1`` is the identity, the attention factor enters as a logit scale in every attention path,
cached decoding equals the full forward, and configs round-trip (``helm/nn/positional/POSITIONAL.md``)."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import helm
from helm.manifold import inner, lift
from helm.models import HelmDConfig, HelmMiCEConfig
from helm.nn.positional import build_positional_encoding, inverse_frequencies
from helm.nn.positional.rotary import interpolated_chunk_size
from helm.nn.positional.scaling import ROPE_TYPES, RopeScaling, resonance_frequencies
from tests.helpers import assert_close, space

K = 1.0
SCALE = 2.0 / 8.0
BASE = 10000.0
ORIG = 256  # pre-training length of the scaled presets
# space dims the zoo rotates: HELM-MiCE-120M's rope part (17 - 1), tiny presets' heads (33 - 1), the 115M / 1B heads
ZOO_DIMS = [8, 16, 32, 64]


def ramp(d, top):
    """LongRoPE factors ``1 … top`` over the ``d/2`` pairs (a monotone stand-in for searched factors)."""
    P = d // 2
    return [1.0 + (top - 1.0) * l / max(P - 1, 1) for l in range(P)]


def rope_dict(case, d, orig=ORIG, factor=4.0):
    """The Llama rope dict of ``case`` for ``d`` rotated dims, pre-training length ``orig``."""
    return {
        "linear": {"rope_type": "linear", "factor": factor},
        "dynamic": {"rope_type": "dynamic", "factor": factor},
        "yarn": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig},
        "yarn_mscale": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
        "yarn_attention_factor": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                                  "attention_factor": 1.7},
        "longrope": {"rope_type": "longrope", "factor": factor, "original_max_position_embeddings": orig,
                     "short_factor": ramp(d, 1.5), "long_factor": ramp(d, factor)},
        "llama3": {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": orig,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        "resonance": {"rope_type": "default", "resonance": True, "original_max_position_embeddings": orig},
        "resonance_yarn": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                           "resonance": True},
    }[case]


TRANSFORMERS_CASES = ["linear", "dynamic", "yarn", "yarn_mscale", "yarn_attention_factor", "longrope", "llama3"]
STATIC_CASES = ["linear", "yarn", "yarn_attention_factor", "llama3", "resonance", "resonance_yarn"]
LENGTH_DEPENDENT_CASES = ["dynamic", "longrope"]


def build(name="hope", d=16, rope_parameters=None, max_position_embeddings=4 * ORIG, **options):
    return build_positional_encoding(name, head_dim=d, num_heads=2, max_position_embeddings=max_position_embeddings,
                                     rope_parameters=rope_parameters, **options)


def logits(pe, q_s, k_s, pos):
    """``s·(2/τ)·<lift(R q), lift(R k)>_L`` ``[B, H, T, T]`` with the tables' logit scale ``s``, one forward; the
    product of the rotated fp32 points in fp64, so only the rotations' rounding is measured (``inner`` is fp32)."""
    tables = pe(pos, kv_len=pos.shape[-1])
    rq, rk = tables.rotate(q_s), tables.rotate(k_s)
    rq, rk = lift(rq, k=K).double(), lift(rk, k=K).double()
    return tables.logit_scale * SCALE * inner(rq.unsqueeze(-2), rk.unsqueeze(-3))


def llama_config(params, d, max_position_embeddings):
    return LlamaConfig(hidden_size=2 * d, num_attention_heads=2, head_dim=d, num_hidden_layers=1,
                       max_position_embeddings=max_position_embeddings, rope_parameters=dict(params))


# (a) frequencies and attention factors are transformers' ---------------------------------------------------------

@pytest.mark.parametrize("d", ZOO_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("case", TRANSFORMERS_CASES)
@pytest.mark.parametrize("seq_len", [None, 3 * ORIG + 5], ids=["init", "beyond_original"])
def test_frequencies_and_attention_factor_equal_transformers(case, d, seq_len):
    """θ'_l equals ``ROPE_INIT_FUNCTIONS[rope_type]`` run on a real ``LlamaConfig`` (to fp32 rounding: transformers
    computes in fp32, HELM keeps float64), and the attention factor is exactly transformers'."""
    params, M = rope_dict(case, d), 4 * ORIG
    if case == "dynamic":
        M = ORIG  # Llama's dynamic NTK starts rescaling beyond max_position_embeddings
    want, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](llama_config(params, d, M), "cpu", seq_len=seq_len)
    scaling = RopeScaling(params, head_dim=d, base=BASE, max_position_embeddings=M)
    got = scaling.frequencies(seq_len)
    assert got.dtype == torch.float64 and got.shape == (d // 2,)
    torch.testing.assert_close(got, want.double(), rtol=1.2e-7, atol=0)
    assert scaling.attention_factor == factor and scaling.logit_scale == factor ** 2
    if case in ("linear", "dynamic") and seq_len is not None:
        assert not torch.equal(got, inverse_frequencies(d, BASE))  # it did scale


@pytest.mark.parametrize("case", LENGTH_DEPENDENT_CASES)
def test_length_dependent_frequencies_follow_transformers_rotary_module(case):
    """On a growing sequence (prefill, then decode steps across the threshold), each forward uses the frequencies
    ``LlamaRotaryEmbedding`` (``dynamic_rope_update``) uses at that length; its cos carries the attention factor."""
    d, M = 16, ORIG if case == "dynamic" else 4 * ORIG
    params = rope_dict(case, d, orig=ORIG)
    rotary = LlamaRotaryEmbedding(llama_config(params, d, M))
    pe = build(d=d, rope_parameters=params, max_position_embeddings=M)
    x = torch.zeros(1, 1, 1, d)
    for length in (7, ORIG, ORIG + 1, ORIG + 2, 3 * ORIG, 3 * ORIG + 1):
        pos = torch.arange(length)[None]
        cos_t, _ = rotary(x, pos)
        want = cos_t[0, -1, : d // 2].double() / rotary.attention_scaling  # half-split layout: first d/2 = cos(pθ)
        got = pe(pos, kv_len=length).cos[0, -1].double()
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4 * length / ORIG)
        assert pe(pos, kv_len=length).logit_scale == rotary.attention_scaling ** 2


def test_resonance_rounds_short_wavelengths_to_integers_and_keeps_the_rest():
    """Resonance RoPE: λ_l = 2π/θ_l < L become round(λ_l); λ_l >= L unchanged; combinable (Resonance YaRN)."""
    d = 32
    for case in ("resonance", "resonance_yarn"):
        params = rope_dict(case, d)
        base_params = {k: v for k, v in params.items() if k != "resonance"}
        if base_params["rope_type"] == "default":  # only resonance reads the pre-training length there
            base_params.pop("original_max_position_embeddings")
        plain = RopeScaling(base_params, head_dim=d, base=BASE, max_position_embeddings=4 * ORIG).frequencies()
        got = RopeScaling(params, head_dim=d, base=BASE, max_position_embeddings=4 * ORIG).frequencies()
        wavelength = 2 * math.pi / plain
        short = wavelength < ORIG
        assert 0 < int(short.sum()) < d // 2
        torch.testing.assert_close(got[short], 2 * math.pi / torch.round(wavelength[short]), rtol=0, atol=0)
        assert torch.equal(got[~short], plain[~short])
        assert torch.equal(resonance_frequencies(plain, 6), plain)  # every wavelength >= 2π > 6: nothing rounds


def test_resonance_rotations_repeat_exactly_after_the_integer_wavelength():
    """For a rounded pair, positions p and p + λ̃ get the same rotation (to fp32), even far beyond L."""
    d, pe = 16, build(d=16, rope_parameters=rope_dict("resonance", 16))
    theta = pe.scaling.frequencies()
    period = torch.round(2 * math.pi / theta)
    pos = torch.tensor([[3, 1_000_003, 65_537]])
    cos, sin = pe(pos, kv_len=1).cos, pe(pos, kv_len=1).sin
    for l in range(d // 2):
        if 2 * math.pi / theta[l] < ORIG:
            shifted = pe(pos + int(period[l]), kv_len=1)
            assert (shifted.cos[..., l] - cos[..., l]).abs().max() < 2e-6
            assert (shifted.sin[..., l] - sin[..., l]).abs().max() < 2e-6


# (b) Prop. 4.1 with and without scaling ---------------------------------------------------------------------------

@pytest.mark.parametrize("shift", [1, 997, 65_000, 1_000_000])
@pytest.mark.parametrize("d", [16, 32], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("case", ["unscaled", *STATIC_CASES])
def test_prop_4_1_holds_with_static_scaling(case, d, shift):
    """Scaling changes θ_l only, so Lorentz scores depend on m - n alone, at offsets up to 1e6 (fp32, 1e-6)."""
    pe = build(d=d, rope_parameters=None if case == "unscaled" else rope_dict(case, d))
    B, H, T = 2, 3, 37
    q, k = space(B, H, T, d, seed=1), space(B, 1, T, d, seed=2)
    pos = torch.arange(T)[None] + torch.tensor([[0], [5]])
    s0, s1 = logits(pe, q, k, pos), logits(pe, q, k, pos + shift)
    assert (s0 - s1).abs().max() <= 1e-6


@pytest.mark.parametrize("shift", [997, 65_000, 1_000_000])
@pytest.mark.parametrize("case", LENGTH_DEPENDENT_CASES)
def test_prop_4_1_holds_within_one_forward_of_a_length_dependent_type(case, shift):
    """``dynamic`` / ``longrope`` fix one frequency set per forward (from its length): inside a forward, scores depend
    on m - n only. Across forwards of different lengths beyond the threshold the set changes, so the same (m, n)
    scores differently — by construction of the rope type (and in transformers)."""
    d = 16
    pe = build(d=d, rope_parameters=rope_dict(case, d), max_position_embeddings=ORIG)
    B, H, T = 1, 2, 19
    q, k = space(B, H, T, d, seed=3), space(B, 1, T, d, seed=4)
    pos = torch.arange(T)[None]
    both = logits(pe, torch.cat([q, q], -2), torch.cat([k, k], -2), torch.cat([pos, pos + shift], -1))
    assert (both[..., :T, :T] - both[..., T:, T:]).abs().max() <= 1e-6
    assert (logits(pe, q, k, pos) - both[..., :T, :T]).abs().max() > 1e-4  # the short forward used other θ


# (c) factor = 1 is the unscaled encoding -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["hope", "rope3d"])
@pytest.mark.parametrize("case", ["linear", "yarn", "llama3", "longrope"])
def test_factor_one_is_the_unscaled_encoding(name, case):
    """Bit for bit: frequencies, rotations (positions up to 1e6), logit scale 1; LongRoPE with all factors 1."""
    d = 16
    params = rope_dict(case, d, factor=1.0)
    if case == "longrope":
        params.update(short_factor=[1.0] * (d // 2), long_factor=[1.0] * (d // 2))
    opts = {"chunk_size": 64} if name == "rope3d" else {}
    if name == "rope3d" and case == "linear":
        params["original_max_position_embeddings"] = 200  # c = 64 does not divide L_p: c' must still be c
    scaled, plain = build(name, d, params, **opts), build(name, d, None, **opts)
    assert torch.equal(scaled.scaling.frequencies(3 * ORIG), inverse_frequencies(d, BASE))
    x = space(2, 3, 9, d)
    pos = torch.tensor([0, 1, 63, 64, 255, 257, 1000, 65_537, 1_000_000])[None].expand(2, 9)
    assert torch.equal(scaled.rotate(x, pos), plain.rotate(x, pos))
    assert scaled(pos, kv_len=9).logit_scale == 1.0
    if name == "rope3d":
        assert scaled.chunk_size == plain.chunk_size == 64


def test_dynamic_with_factor_one_is_unscaled_up_to_max_position_embeddings_only():
    """transformers' dynamic NTK uses ``base·(factor·S/M - factor + 1)^(d/(d-2))``: at factor 1 that is still
    ``base·(S/M)^(d/(d-2))`` beyond ``M``, so only lengths <= M are the unscaled encoding (bit for bit)."""
    d, M = 16, 64
    scaled, plain = build(d=d, rope_parameters=rope_dict("dynamic", d, factor=1.0), max_position_embeddings=M), \
        build(d=d, max_position_embeddings=M)
    x = space(1, 2, M, d)
    pos = torch.arange(M)[None]
    assert torch.equal(scaled.rotate(x, pos), plain.rotate(x, pos))
    pos = torch.arange(M + 1)[None]
    assert not torch.equal(scaled.rotate(space(1, 2, M + 1, d), pos), plain.rotate(space(1, 2, M + 1, d), pos))


# 3D-RPE with linear interpolation (seed 002 App. C) ---------------------------------------------------------------

@pytest.mark.parametrize("c, orig, factor, want", [(64, 256, 4.0, 256), (64, 256, 1.0, 64), (100, 256, 2.0, 228),
                                                    (3, 10, 8.0, 26), (256, 256, 3.0, 768)])
def test_rope3d_linear_interpolation_spreads_the_extra_tokens_over_the_chunks(c, orig, factor, want):
    """c' = c + ⌊(L - L_p)/n⌋, n = ⌊L_p/c⌋, L = ⌊factor·L_p⌋: the seed's ⌊L/n⌋ when c divides L_p."""
    assert interpolated_chunk_size(c, factor, orig) == want
    n = orig // c
    if orig % c == 0:
        assert want == math.floor(factor * orig) // n


def test_rope3d_linear_keeps_frequencies_and_chunk_count_and_resolution_one():
    """Theorem 1/2: the L_p·factor tokens fall into the same n chunks as the L_p training tokens (chunk phases
    unchanged), in-chunk neighbours still differ by one step of the unscaled θ_l (resolution 1, not L_p/L);
    the encoding is ``rope3d`` with chunk size c' (bit for bit)."""
    d, c = 16, 64
    params = rope_dict("linear", d) | {"original_max_position_embeddings": ORIG}
    pe = build("rope3d", d, params, chunk_size=c)
    assert pe.chunk_size == 256 and torch.equal(pe.scaling.frequencies(), inverse_frequencies(d, BASE))
    same = build("rope3d", d, None, chunk_size=256)
    x = space(1, 2, 40, d)
    pos = torch.randint(0, 4 * ORIG, (1, 40), generator=torch.Generator().manual_seed(7))
    assert torch.equal(pe.rotate(x, pos), same.rotate(x, pos))
    assert int((torch.arange(4 * ORIG) // pe.chunk_size).max()) + 1 == ORIG // c  # n chunks cover L = 4·L_p
    tables = pe(torch.tensor([[300, 301]]), kv_len=2)  # neighbours inside chunk 1, beyond L_p
    step = torch.atan2(tables.sin[0, 1] * tables.cos[0, 0] - tables.cos[0, 1] * tables.sin[0, 0],
                       tables.cos[0, 1] * tables.cos[0, 0] + tables.sin[0, 1] * tables.sin[0, 0])
    torch.testing.assert_close(step.double(), inverse_frequencies(d, BASE), rtol=0, atol=1e-6)


# the attention factor is a logit scale in every attention path ----------------------------------------------------

@pytest.mark.parametrize("family, impl, absorb", [("helm_d", "sdpa", False), ("helm_d", "eager", False),
                                                  ("helm_mice", "sdpa", False), ("helm_mice", "eager", True)],
                         ids=["hmha-sdpa", "hmha-eager", "hmla-plain", "hmla-absorbed"])
def test_attention_factor_scales_the_logits_like_a_lower_temperature(tiny_config, family, impl, absorb):
    """YaRN with attention factor a equals the same model with a = 1 and every τ divided by a² (prefill and
    cached decode): logits = a²·(2/τ)·<q, k>_L, the Lorentz form of transformers' ``cos·a, sin·a``."""
    d = 32 if family == "helm_d" else 8
    a = 1.7
    params = rope_dict("yarn_attention_factor", d, orig=16) | {"attention_factor": a}
    extra = {"hmla_absorb": absorb} if family == "helm_mice" else {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, rope_parameters=params, attn_implementation=impl,
                                                         **extra)).eval()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(family, rope_parameters=params | {"attention_factor": 1.0},
                                                       attn_implementation=impl, **extra)).eval()
    state = model.state_dict()
    ref.load_state_dict({n: t - 2 * math.log(a) if n.endswith("log_tau") else t for n, t in state.items()})
    ids = torch.randint(2, 512, (2, 21))
    assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4)
    out, out_ref = model(ids[:, :13], use_cache=True), ref(ids[:, :13], use_cache=True)
    step = model(ids[:, 13:14], past_key_values=out.past_key_values, use_cache=True)
    step_ref = ref(ids[:, 13:14], past_key_values=out_ref.past_key_values, use_cache=True)
    assert_close(step.logits, step_ref.logits, rtol=1e-4)
    ref.load_state_dict(state)  # the same τ without the factor: different logits, so the factor is applied
    assert (model(ids).logits - ref(ids).logits).abs().max() > 1e-3


# (d) cached decoding equals the full forward ----------------------------------------------------------------------

def decode_logits(model, ids, prefill):
    """Logits ``[B, T - prefill + 1, V]``: the prefill's last position, then one cached decode step per token."""
    out = model(ids[:, :prefill], use_cache=True)
    steps, cache = [out.logits[:, -1]], out.past_key_values
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
        steps.append(out.logits[:, -1])
        cache = out.past_key_values
    return torch.stack(steps, 1)


def scaled_model(tiny_config, family, case, positional="hope", **overrides):
    d = 32 if family == "helm_d" else 8  # rotated dims of the tiny test models: head_dim 33, qk_rope_head_dim 9
    orig = 8
    params = None if case == "unscaled" else rope_dict(case, d, orig=orig)
    if positional == "rope3d" and params is not None and params["rope_type"] == "linear":
        params["original_max_position_embeddings"] = orig
    # dynamic rescales beyond max_position_embeddings: make it the short training length there
    M = orig if case == "dynamic" else 4 * orig
    torch.manual_seed(0)
    cfg = tiny_config(family, rope_parameters=params, positional=positional, max_position_embeddings=M,
                      rope3d_chunk_size=4, **overrides)
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("positional, case", [("hope", c) for c in ["unscaled", *STATIC_CASES]]
                         + [("rope3d", "linear"), ("rope3d", "yarn")])
def test_cached_decoding_equals_the_full_forward_past_the_original_length(tiny_config, family, positional, case):
    """Static frequency sets: prefill 5 tokens then decode to 27, far past original_max_position_embeddings = 8;
    every step's logits equal the full forward's (HMLA: absorbed decoding, the preset default)."""
    model = scaled_model(tiny_config, family, case, positional)
    ids = torch.randint(2, 512, (2, 27), generator=torch.Generator().manual_seed(11))
    full = model(ids).logits[:, 4:]
    assert_close(decode_logits(model, ids, 5), full, rtol=1e-4)


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("case", LENGTH_DEPENDENT_CASES)
def test_cached_decoding_of_a_length_dependent_type(tiny_config, family, case):
    """What holds for ``dynamic`` / ``longrope`` (threshold 8 tokens): (1) cached decoding equals the full forward
    up to the threshold; (2) each decode step rotates its token with the frequencies of a full forward of the same
    length (its tables equal that forward's last row); (3) past the threshold a full forward rotates *every* token
    with the frequencies of the whole length while the cache keeps those its tokens were written with, so the two
    differ by construction (as in transformers)."""
    model = scaled_model(tiny_config, family, case)
    ids = torch.randint(2, 512, (2, 20), generator=torch.Generator().manual_seed(12))
    upto = 8
    assert_close(decode_logits(model, ids[:, :upto], 3), model(ids[:, :upto]).logits[:, 2:], rtol=1e-4)
    pe = model.model.pos_encoding
    for length in (9, 12, 20):
        step = pe(torch.tensor([[length - 1]]), kv_len=length)
        full = pe(torch.arange(length)[None], kv_len=length)
        assert torch.equal(step.cos[0, 0], full.cos[0, -1]) and torch.equal(step.sin[0, 0], full.sin[0, -1])
    full = model(ids).logits[:, 2:]
    assert (decode_logits(model, ids, 3) - full).abs().max() > 1e-4


# (e) configs: Llama dicts unchanged, round trips, errors that name the key ----------------------------------------

@pytest.mark.parametrize("case", TRANSFORMERS_CASES + ["resonance"])
def test_a_llama_rope_dict_works_unchanged_and_round_trips(tmp_path, case):
    """The dict a LlamaConfig takes is accepted as is (and as legacy ``rope_scaling``); save/load keeps it."""
    d = 32
    params = rope_dict(case, d)
    cfg = HelmDConfig(hidden_size=129, num_attention_heads=4, max_position_embeddings=4 * ORIG,
                      rope_parameters=dict(params))
    assert {k: cfg.rope_parameters[k] for k in params} == params and cfg.rope_parameters["rope_theta"] == BASE
    legacy = HelmDConfig(hidden_size=129, num_attention_heads=4, max_position_embeddings=4 * ORIG,
                         rope_scaling=dict(params))
    assert legacy.rope_parameters == cfg.rope_parameters
    cfg.save_pretrained(tmp_path)
    loaded = HelmDConfig.from_pretrained(tmp_path)
    assert loaded.rope_parameters == cfg.rope_parameters and loaded.rope_theta == cfg.rope_theta
    if case != "resonance":
        llama = llama_config(params, d, 4 * ORIG)
        assert {k: llama.rope_parameters[k] for k in params} == params


def test_rope_theta_is_mirrored_and_old_configs_load(tmp_path):
    """``rope_theta`` (HELM's field) and ``rope_parameters['rope_theta']`` (transformers 5) agree; a config saved
    before ``rope_parameters`` existed loads as the default rope; different explicit values are refused."""
    assert HelmDConfig(rope_theta=5e5).rope_parameters == {"rope_type": "default", "rope_theta": 5e5}
    cfg = HelmDConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert cfg.rope_theta == 5e5
    HelmDConfig(hidden_size=65, num_attention_heads=4).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert HelmDConfig.from_pretrained(tmp_path).rope_parameters == {"rope_type": "default", "rope_theta": BASE}
    with pytest.raises(ValueError, match=r"rope_theta.*20000.*rope_parameters"):
        HelmDConfig(rope_theta=2e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5})


@pytest.mark.parametrize("preset", ["tiny-helm-d-hope-linear", "tiny-helm-d-hope-ntk", "tiny-helm-d-hope-yarn",
                                    "tiny-helm-d-hope-longrope", "tiny-helm-d-hope-resonance",
                                    "tiny-helm-d-hope-resonance-yarn", "tiny-helm-d-rope3d-linear"])
def test_scaled_presets_build_and_save_without_transformers_warnings(preset, tmp_path):
    """Each preset builds and saves; transformers' ``validate_rope`` (run by ``save_pretrained``) accepts the dict
    without warnings (HELM's own keys are declared), and the model round-trips."""
    cfg = helm.load_config(preset, num_hidden_layers=1, vocab_size=64)
    assert cfg.rope_parameters["rope_type"] in ROPE_TYPES
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(0, 64, (1, 11))
    with CaptureLogger(logging.get_logger("transformers.modeling_rope_utils")) as captured:
        model.save_pretrained(tmp_path)
    assert captured.out == "", captured.out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters == cfg.rope_parameters
    assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("overrides, words", [
    (dict(rope_parameters={"rope_type": "ntk"}), ["rope_type", "'dynamic'", "'ntk'"]),
    (dict(rope_parameters={"rope_type": "linear"}), ["'factor'", "required"]),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "scale": 2}), ["'scale'", "accepted keys"]),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}),
     ["'original_max_position_embeddings'", "not read"]),
    (dict(rope_parameters={"rope_type": "linear", "factor": 0.5}), ["'factor'", ">= 1"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "attention_factor": -1.0}), ["'attention_factor'"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "beta_fast": 1, "beta_slow": 4}), ["'beta_fast'"]),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     ["'partial_rotary_factor'", "1.0"]),
    (dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3,
                           "original_max_position_embeddings": 64}), ["'short_factor'", "8", "head_dim=17"]),
    (dict(rope_parameters={"rope_type": "default", "resonance": "yes"}), ["'resonance'", "bool"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0}, positional="alibi"), ["positional='alibi'",
                                                                                      "rope_type"]),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 16},
          positional="rope3d", rope3d_chunk_size=32), ["rope3d_chunk_size", "original_max_position_embeddings"]),
    (dict(rope_parameters=[("rope_type", "linear")]), ["rope_parameters must be a dict"]),
])
def test_bad_rope_parameters_name_the_key(overrides, words):
    with pytest.raises(ValueError) as err:
        HelmDConfig(hidden_size=33, num_attention_heads=2, max_position_embeddings=128, **overrides)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_mice_checks_longrope_factors_against_the_rope_dims():
    """HMLA's decoupled HoPE is the model's encoding on the ``qk_rope_head_dim - 1`` rope dims."""
    lists = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    params = {"rope_type": "longrope", "original_max_position_embeddings": 64, **lists}
    cfg = HelmMiCEConfig(qk_rope_head_dim=9, rope_parameters=params)
    assert cfg.rope_parameters["short_factor"] == [1.0] * 4
    with pytest.raises(ValueError, match=r"'short_factor'.*qk_rope_head_dim=17"):
        HelmMiCEConfig(qk_rope_head_dim=17, rope_parameters=params)
