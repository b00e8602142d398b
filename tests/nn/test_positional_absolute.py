"""Absolute and bilevel positional encodings (issue 15): ``sinusoidal`` (seeds 001/004) and BiPE (seed 000,
``bipe_hope`` / ``bipe_alibi``): textbook values at any position, points on the manifold, BiPE's segment-level
Prop. 4.1, and tiny HELM-D models (manifold, gradients, causality, cached decoding past the table and across
segment boundaries, left padding, save/load)."""

import math

import mpmath
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

from helm.manifold import inner, lift, manifold_error
from helm.models import HelmDConfig
from helm.nn.positional import (
    POSITIONAL_ENCODINGS,
    BiPEALiBi,
    BiPEHoPE,
    SinusoidalPositionalEncoding,
    alibi_slopes,
    build_positional_encoding,
)
from helm.nn.positional.bipe import BIPE_ALIBI_SLOPE_SCALE, split_positions
from tests.helpers import MANIFOLD_TOL, assert_close, space, tiny_model

K = 1.0
SCALE = 2.0 / 8.0
NEW_KINDS = ["sinusoidal", "bipe_hope", "bipe_alibi"]
BIPE_KINDS = ["bipe_hope", "bipe_alibi"]
# positions that stress the angle arithmetic: 0, small, around 2^8 / 2^16 digit carries, 1e6 and 2^31 - 1
POSITIONS = [0, 1, 2, 255, 256, 65_535, 65_536, 999_999, 1_000_000, 2**31 - 1]


def build(name, head_dim=16, num_heads=3, **options):
    return build_positional_encoding(name, head_dim=head_dim, num_heads=num_heads, max_position_embeddings=64,
                                     **options)


def textbook(position: int, dim: int, base: float = 10000.0) -> list:
    """Seed 001: ``PE(p, 2i) = sin(p / base^{2i/d})``, ``PE(p, 2i+1) = cos(...)``, in 40-digit arithmetic."""
    with mpmath.workdps(40):
        out = []
        for j in range(dim):
            angle = mpmath.mpf(position) / mpmath.power(base, mpmath.mpf(2 * (j // 2)) / dim)
            out.append(float(mpmath.sin(angle) if j % 2 == 0 else mpmath.cos(angle)))
    return out


# ---------------------------------------------------------------------------------------------------- sinusoidal


@pytest.mark.parametrize("dim", [6, 7, 128], ids=lambda d: f"n={d}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_sinusoidal_equals_the_textbook_formula_at_any_position(dim, dtype):
    """Every coordinate equals seed 001's formula (40-digit reference), up to 2^31 - 1: in fp32 to a few ulps of 1;
    in fp64 to ``1e-14 + p·1e-16`` (the float64 angle tables reduce ``p·ω`` modulo a rounded ``2π``). For odd ``n``
    the last coordinate is the last ``sin``."""
    pe = SinusoidalPositionalEncoding(dim)
    pos = torch.tensor(POSITIONS)
    table = pe.table(pos, dtype)
    assert table.shape == (len(POSITIONS), dim) and table.dtype == dtype
    expected = torch.tensor([textbook(p, dim) for p in POSITIONS], dtype=torch.float64)
    tol = 2e-6 if dtype == torch.float32 else 1e-14 + pos.double()[:, None] * 1e-16
    assert ((table.double() - expected).abs() <= tol).all()


def test_sinusoidal_angles_avoid_the_large_fp32_product():
    """The naive ``float32(p)·float32(ω)`` is off by ``ulp(p·ω)`` at ``p = 10^6`` (> 1e-2); ours is not."""
    dim, p = 128, 1_000_000
    omega = torch.tensor([10000.0 ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float32)
    naive = torch.stack(((p * omega).sin(), (p * omega).cos()), -1).flatten().double()
    expected = torch.tensor(textbook(p, dim), dtype=torch.float64)
    assert (naive - expected).abs().max() > 1e-2
    ours = SinusoidalPositionalEncoding(dim).table(torch.tensor([p]))[0].double()
    assert (ours - expected).abs().max() <= 2e-6


@pytest.mark.parametrize("offset", [0, 997, 1_000_000], ids=lambda o: f"offset={o}")
def test_sinusoidal_dot_products_depend_on_the_offset_only(offset):
    """Seed 001: ``PE(p)·PE(p+k) = Σ_i cos(k ω_i)`` depends on ``k`` only, also at ``p = 10^6`` (fp32)."""
    dim = 64
    pe = SinusoidalPositionalEncoding(dim)
    k = torch.arange(0, 50)
    a, b = pe.table(torch.full_like(k, offset)), pe.table(offset + k)
    omega = torch.tensor([10000.0 ** (-2 * i / dim) for i in range(dim // 2)], dtype=torch.float64)
    expected = torch.cos(k.double()[:, None] * omega).sum(-1)
    assert ((a * b).sum(-1).double() - expected).abs().max() <= 2e-5


@pytest.mark.parametrize("scale", [1.0, 0.02], ids=lambda s: f"scale={s}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_sinusoidal_embed_adds_the_table_and_lifts_onto_the_manifold(scale, dtype):
    pe = build("sinusoidal", hidden_space_dim=31, scale=scale)
    x = space(2, 13, 31, dtype=dtype, seed=1)
    pos = torch.tensor([[0, 5, 17, 63, 64, 65, 1000, 65_536, 999_999, 10**6, 3, 2, 1],
                        list(range(40_000, 40_013))])
    y = pe.embed(x, pos)
    assert y.dtype == dtype and y.shape == x.shape
    expected = x.double() + scale * torch.tensor([[textbook(int(p), 31) for p in row] for row in pos],
                                                 dtype=torch.float64)
    assert (y.double() - expected).abs().max() <= (2e-2 if dtype == torch.bfloat16 else 2e-6)
    point = lift(y.float() if dtype == torch.bfloat16 else y, k=K)
    assert manifold_error(point, K).max() <= MANIFOLD_TOL[point.dtype]


def test_sinusoidal_has_no_parameters_and_no_position_limit():
    pe = build("sinusoidal", hidden_space_dim=12)
    assert list(pe.parameters()) == [] and list(pe.buffers()) == [] and pe.state_dict() == {}
    assert pe.max_positions is None and pe.absolute and not pe.relative
    x = space(1, 3, 12)
    far = torch.tensor([[2**31 - 3, 2**31 - 2, 2**31 - 1]])
    assert torch.isfinite(pe.embed(x, far)).all()
    # the angles are odd in p: sin flips sign, cos does not
    table = pe.table(torch.tensor([-7, 7]))
    assert torch.equal(table[0, 0::2], -table[1, 0::2]) and torch.equal(table[0, 1::2], table[1, 1::2])


def test_sinusoidal_refuses_bad_inputs():
    pe = build("sinusoidal", hidden_space_dim=12)
    with pytest.raises(ValueError, match="hidden_space_dim=12"):
        pe.embed(space(1, 3, 11), torch.arange(3)[None])
    with pytest.raises(TypeError, match="position_ids"):
        pe.embed(space(1, 3, 12), torch.arange(3.0)[None])
    with pytest.raises(ValueError, match="scale"):
        build("sinusoidal", scale=0.0)
    with pytest.raises(ValueError, match="sinusoidal_scale"):
        HelmDConfig(positional="sinusoidal", sinusoidal_scale=float("nan"))


# ---------------------------------------------------------------------------------------------------------- BiPE


@pytest.mark.parametrize("length", [1, 7, 32], ids=lambda n: f"L={n}")
def test_positions_split_into_segment_and_intra_index(length):
    """``p = L·⌊p/L⌋ + (p mod L)`` with the intra index in ``[0, L)``, negative positions included."""
    pos = torch.tensor([-15, -8, -7, -1, 0, 1, 6, 7, 8, 31, 32, 33, 999_999, 2**31 - 1])
    seg, intra = split_positions(pos, length)
    assert torch.equal(seg * length + intra, pos)
    assert ((intra >= 0) & (intra < length)).all()
    assert seg.tolist() == [p // length for p in pos.tolist()]


@pytest.mark.parametrize("name", BIPE_KINDS)
def test_bipe_intra_table_is_periodic_in_the_segment_length(name):
    """``embed(x, p) = x + P[p mod L]``: same at ``p`` and ``p + L``, any position valid, gradients reach only the
    rows in use."""
    pe = build(name, hidden_space_dim=10, segment_length=7)
    assert pe.weight.shape == (7, 10) and pe.max_positions is None
    x = space(2, 5, 10, seed=2)
    pos = torch.tensor([[0, 1, 2, 3, 4], [8, 9, 10, 11, 1_000_001]])
    y = pe.embed(x, pos)
    assert torch.equal(y, x + pe.weight[pos % 7])
    assert torch.equal(pe.embed(x, pos + 7 * 123_457), y)
    y.sum().backward()
    used = torch.zeros(7, dtype=torch.bool)
    used[(pos % 7).flatten()] = True
    assert (pe.weight.grad[used].abs().sum(-1) > 0).all() and (pe.weight.grad[~used] == 0).all()
    assert manifold_error(lift(y.detach(), k=K), K).max() <= MANIFOLD_TOL[torch.float32]


def test_bipe_hope_rotates_by_the_segment_index_only():
    """The rotation at ``p`` is HoPE's rotation at ``⌊p/L⌋`` (same angle tables), so tokens of one segment share
    it; it is a Lorentz rotation (norm, hence time coordinate, preserved)."""
    L = 5
    pe, hope = build("bipe_hope", head_dim=16, segment_length=L), build("hope", head_dim=16)
    x = space(2, 3, 9, 16, std=1.0, seed=3)
    pos = torch.tensor([[0, 1, 4, 5, 9, 10, 24, 999_999, 1_000_000], [3, 4, 5, 6, 7, 8, 9, 10, 11]])
    y = pe.rotate(x, pos)
    assert_close(y, hope.rotate(x, pos // L), rtol=1e-6)
    assert torch.equal(y, pe.rotate(x, (pos // L) * L))
    assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6)


def inter_logits(pe, q_s, k_s, q_pos, k_pos):
    """Logits ``scale·<lift(R q), lift(R k)>_L + bias`` ``[B, H, Tq, Tk]`` of the inter-segment part alone."""
    rq, rk = pe.rotate(q_s, q_pos), pe.rotate(k_s, k_pos)
    out = SCALE * inner(lift(rq, k=K).unsqueeze(-2), lift(rk, k=K).unsqueeze(-3))
    bias = pe.score_bias(rq, rk, q_pos, k_pos, scale=SCALE)
    return out if bias is None else out + bias


@pytest.mark.parametrize("name", BIPE_KINDS)
@pytest.mark.parametrize("segments", [1, 997, 31_250], ids=lambda s: f"shift={s}_segments")
def test_bipe_inter_segment_part_keeps_prop_4_1_over_segments(name, segments):
    """Shifting every position by whole segments (up to 10^6 positions) leaves the inter-segment logits unchanged:
    they depend on the segment difference only (Prop. 4.1 on segment indices)."""
    L = 32
    pe = build(name, head_dim=16, segment_length=L)
    B, H, T = 2, 3, 70
    q, k = space(B, H, T, 16, seed=4), space(B, 1, T, 16, seed=5)
    pos = torch.arange(T)[None] + torch.tensor([[0], [13]])
    s0 = inter_logits(pe, q, k, pos, pos)
    s1 = inter_logits(pe, q, k, pos + segments * L, pos + segments * L)
    assert s0.shape == (B, H, T, T) and s0.dtype == torch.float32
    assert (s0 - s1).abs().max() <= 1e-6


@pytest.mark.parametrize("name", BIPE_KINDS)
def test_bipe_inter_segment_part_depends_on_segment_indices_not_on_intra_indices(name):
    """Moving a query or key inside its segment changes nothing in attention; crossing a boundary does."""
    L = 8
    pe = build(name, head_dim=16, segment_length=L)
    q, k = space(1, 3, 1, 16, seed=6), space(1, 3, 1, 16, seed=7)

    def score(m, n):
        return inter_logits(pe, q, k, torch.tensor([[m]]), torch.tensor([[n]])).flatten()

    base = score(3 * L + 2, 1 * L + 5)
    for m, n in [(3 * L, 1 * L), (3 * L + 7, 1 * L + 7), (3 * L + 1, 1 * L + 6), (7 * L + 4, 5 * L)]:
        assert (score(m, n) - base).abs().max() <= 1e-6
    assert (score(4 * L, 1 * L + 5) - base).abs().max() > 1e-3


def test_bipe_alibi_bias_is_96_times_alibi_on_segment_differences():
    """``bias = -96·slope_h·(⌊m/L⌋ - ⌊n/L⌋)``, exactly, and zero inside a segment."""
    L, H = 4, 6
    pe = build("bipe_alibi", num_heads=H, segment_length=L)
    q_pos, k_pos = torch.tensor([[0, 3, 4, 9, 17]]), torch.tensor([[0, 1, 3, 4, 8, 9, 12, 17, 21]])
    bias = pe.score_bias(space(1, H, 5, 16), space(1, 1, 9, 16), q_pos, k_pos, scale=SCALE)
    slopes = torch.tensor(alibi_slopes(H), dtype=torch.float64) * BIPE_ALIBI_SLOPE_SCALE
    delta = (q_pos[0, :, None] // L - k_pos[0, None, :] // L).double()
    expected = -slopes[:, None, None] * delta
    assert bias.shape == (1, H, 5, 9) and bias.dtype == torch.float32
    assert_close(bias[0], expected.float(), rtol=1e-7)
    assert (bias[0][:, delta == 0] == 0).all()
    with pytest.raises(ValueError, match="num_heads=6"):
        pe.score_bias(space(1, 2, 5, 16), space(1, 1, 9, 16), q_pos, k_pos, scale=SCALE)


@pytest.mark.parametrize("past, shift", [(0, 0), (7, 0), (7, -3), (30, 5)], ids=lambda v: str(v))
def test_bipe_alibi_model_tables_read_key_positions_from_the_query(past, shift):
    """In a model the keys are index positions ``0 .. past+T-1``; with ``position_ids = index + shift`` (rows left-
    padded by ``-shift`` tokens, or not starting at 0) the bias equals the stand-alone one at true positions."""
    L, H, T = 4, 3, 5
    pe = build("bipe_alibi", num_heads=H, segment_length=L)
    q_idx = torch.arange(past, past + T)[None]
    k_idx = torch.arange(past + T)[None]
    tables = pe(q_idx + shift, kv_len=past + T)
    q, k = space(1, H, T, 16), space(1, 1, past + T, 16)
    expected = pe.score_bias(q, k, q_idx + shift, k_idx + shift, scale=SCALE)
    assert torch.equal(tables.score_bias(q, k, SCALE), expected)


def test_bipe_full_scores_depend_on_intra_indices_and_segment_difference():
    """With the intra table on the tokens and the inter encoding in attention, shifting all positions by whole
    segments leaves every logit unchanged (also at 10^6), shifting by a non-multiple of ``L`` does not."""
    L, n = 6, 16
    for name in BIPE_KINDS:
        pe = build(name, head_dim=n, num_heads=1, hidden_space_dim=n, segment_length=L)
        with torch.no_grad():
            pe.weight.normal_(0, 0.5)
        tokens = space(1, 20, n, seed=8)

        def logits(pos):
            x = pe.embed(tokens, pos).unsqueeze(1)  # the token points as queries and keys, one head
            return inter_logits(pe, x, x, pos, pos)

        pos = torch.arange(20)[None]
        s0 = logits(pos)
        assert (logits(pos + L * 166_667) - s0).abs().max() <= 1e-6
        assert (logits(pos + 1) - s0).abs().max() > 1e-3


@pytest.mark.parametrize("name, options, words", [
    ("bipe_hope", {"head_dim": 15}, ["head_dim", "even"]),
    ("bipe_hope", {"segment_length": 0}, ["segment_length"]),
    ("bipe_alibi", {"segment_length": 2.5}, ["segment_length"]),
    ("bipe_alibi", {"init_std": 0.0}, ["init_std"]),
    ("bipe_alibi", {"chunk_size": 8}, ["chunk_size", "accepted"]),
], ids=["odd-head-dim", "zero-length", "float-length", "zero-std", "foreign-option"])
def test_bipe_refuses_bad_options(name, options, words):
    with pytest.raises(ValueError) as err:
        build(name, **options)
    assert all(w in str(err.value) for w in words)


def test_bipe_config_fields_are_checked():
    with pytest.raises(ValueError, match="bipe_segment_length"):
        HelmDConfig(positional="bipe_hope", bipe_segment_length=0)
    with pytest.raises(ValueError, match="head_dim must be 1 \\+ an even number"):
        HelmDConfig(positional="bipe_hope", hidden_size=33, num_attention_heads=2, head_dim=16)


# --------------------------------------------------------------------------------------------- tiny HELM-D models


def tiny(name, **overrides):
    fields = dict(positional=name, max_position_embeddings=16, bipe_segment_length=5, attn_implementation="sdpa")
    model = tiny_model("helm_d", train=True, **{**fields, **overrides})
    with torch.no_grad():  # intra tables as large as the sinusoid, so that positions visibly matter
        for name_, p in model.named_parameters():
            if name_.endswith("pos_encoding.weight"):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("name", NEW_KINDS)
def test_model_points_on_manifold_and_finite_gradients(name):
    model = tiny(name)
    ids = torch.randint(0, 512, (2, 37))
    out = model(ids, labels=ids, output_hidden_states=True)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for p in model.parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all()
    for h in out.hidden_states:
        assert manifold_error(h, K).max() <= MANIFOLD_TOL[torch.float32]
    table = dict(model.named_parameters()).get("model.pos_encoding.weight")
    assert (table is None) == (name == "sinusoidal")
    if table is not None:
        assert table.grad.abs().sum() > 0


@pytest.mark.parametrize("name", NEW_KINDS)
def test_model_is_causal(name):
    model = tiny(name).eval()
    ids = torch.randint(0, 512, (2, 29))
    changed = ids.clone()
    changed[:, 17:] = (changed[:, 17:] + 11) % 512
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert torch.equal(a[:, :17], b[:, :17])
    assert (a[:, 17:] - b[:, 17:]).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", NEW_KINDS)
def test_cached_decoding_equals_the_full_forward_past_the_table_and_across_segments(name, impl):
    """Prefill 7 tokens, then decode one at a time to 41: past ``max_position_embeddings = 16`` and across eight
    boundaries of segments of 5; every step's logits equal the full forward's."""
    model = tiny(name, attn_implementation=impl).eval()
    ids = torch.randint(0, 512, (2, 41))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :7], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(7, 41):
            out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    assert_close(torch.cat(steps, dim=1), full, rtol=1e-5)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("name", NEW_KINDS)
def test_both_families_and_cache_kinds_decode_like_the_full_forward(name, family, cache_kind):
    """HELM-D and HELM-MiCE (HMLA: the inter-segment encoding on the decoupled rope dims), with a growing cache and
    a static one (queries placed at a tensor offset in 24 slots): prefill 7, decode to 20 (past the table of 16,
    across segments of 5)."""
    model = tiny_model(family, positional=name, max_position_embeddings=16, bipe_segment_length=5)
    ids = torch.randint(0, 512, (2, 20))
    cache = StaticCache(config=model.config, max_cache_len=24) if cache_kind == "static" else DynamicCache()
    with torch.no_grad():
        full = model(ids).logits
        steps = [model(ids[:, :7], past_key_values=cache, use_cache=True).logits]
        for t in range(7, 20):
            steps.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    assert_close(torch.cat(steps, dim=1), full, rtol=1e-5)


@pytest.mark.parametrize("name", NEW_KINDS)
def test_left_padded_rows_score_what_they_score_alone(name):
    """Positions come from the padding mask; BiPE-ALiBi reads key positions from the query's, so a row left-padded
    by 3 sees the same segments as its tokens alone: full forward, cached decoding (prefill 6, then one token at a
    time past the table and across segments) and the unpadded row agree on the real tokens."""
    model = tiny(name).eval()
    ids = torch.randint(2, 512, (2, 24))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 1, 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        alone = model(ids[1:, 3:]).logits
        out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for t in range(6, 24):
            out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.past_key_values
    cached = torch.cat(steps, dim=1)
    assert_close(full[1:, 3:], alone, rtol=1e-5)
    assert_close(cached[0], full[0], rtol=1e-5)
    assert_close(cached[1, 3:], full[1, 3:], rtol=1e-5)


@pytest.mark.parametrize("name, shift, same", [
    ("sinusoidal", 5, False), ("bipe_hope", 1, False), ("bipe_alibi", 1, False),
    ("bipe_hope", 5 * 1000, True), ("bipe_alibi", 5 * 1000, True),
], ids=["sinusoidal-shift-5", "bipe_hope-shift-1", "bipe_alibi-shift-1", "bipe_hope-shift-1000-segments",
        "bipe_alibi-shift-1000-segments"])
def test_model_logits_under_position_shifts(name, shift, same):
    """Absolute positions matter; for BiPE a shift by whole segments keeps every intra index and segment
    difference, hence the logits."""
    model = tiny(name).eval()
    ids = torch.randint(0, 512, (2, 23))
    pos = torch.arange(23)[None].expand(2, 23)
    with torch.no_grad():
        a, b = model(ids, position_ids=pos).logits, model(ids, position_ids=pos + shift).logits
    if same:
        assert_close(b, a, rtol=1e-5)
    else:
        assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("name", NEW_KINDS)
def test_save_and_load_round_trip(name, tmp_path):
    model = tiny(name).eval()
    ids = torch.randint(0, 512, (1, 21))
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.positional == name and loaded.config.bipe_segment_length == 5
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_new_kinds_are_registered_with_presets():
    import helm

    for name in NEW_KINDS:
        assert name in POSITIONAL_ENCODINGS
        cfg = helm.load_config(f"tiny-helm-d-{name}")
        assert cfg.positional == name
    assert POSITIONAL_ENCODINGS["bipe_hope"] is BiPEHoPE and POSITIONAL_ENCODINGS["bipe_alibi"] is BiPEALiBi
    assert math.isclose(BIPE_ALIBI_SLOPE_SCALE, 96.0)
