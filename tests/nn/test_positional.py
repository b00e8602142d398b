"""Positional encodings: HELM Prop. 4.1 (relative scores), Lorentz rotations, 3D-RPE, boost HoPE, ALiBi, learned."""

import itertools
import math

import mpmath
import pytest
import torch

from helm.manifold import inner, lift
from helm.nn.positional import (
    POSITIONAL_ENCODINGS,
    PositionalTables,
    alibi_slopes,
    build_positional_encoding,
    hope_boost_bias,
    inverse_frequencies,
)
from tests.helpers import assert_close, space

K = 1.0
TAU = 8.0
SCALE = 2.0 / TAU
MAX_POS = 4096


def build(name, head_dim=16, num_heads=3, **options):
    return build_positional_encoding(name, head_dim=head_dim, num_heads=num_heads,
                                     max_position_embeddings=MAX_POS, **options)


def logits(pe, q_s, k_s, q_pos, k_pos, *, scale=SCALE):
    """Final attention logits ``scale·<lift(R q), lift(R k)>_L + bias`` ``[B, H, Tq, Tk]``."""
    rq, rk = pe.rotate(q_s, q_pos), pe.rotate(k_s, k_pos)
    out = scale * inner(lift(rq, k=K).unsqueeze(-2), lift(rk, k=K).unsqueeze(-3))
    bias = pe.score_bias(rq, rk, q_pos, k_pos, scale=scale)
    return out if bias is None else out + bias


def causal_probs(scores, q_pos, k_pos):
    allowed = (k_pos.unsqueeze(-2) <= q_pos.unsqueeze(-1)).unsqueeze(1)
    return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).softmax(-1)


def complex_pairs(x):
    return torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())




def test_registry_attributes():
    relative = {name for name in POSITIONAL_ENCODINGS if build(name).relative}
    assert relative == {"hope", "none", "alibi", "hope_boost"}
    assert build("learned").max_positions == MAX_POS
    assert all(build(name).max_positions is None for name in POSITIONAL_ENCODINGS if name != "learned")
    assert {name for name in POSITIONAL_ENCODINGS if build(name).has_score_bias} == {"alibi", "hope_boost",
                                                                                      "bipe_alibi"}
    assert {name for name in POSITIONAL_ENCODINGS if build(name).absolute} == {"learned", "sinusoidal", "bipe_hope",
                                                                                "bipe_alibi"}
    assert all(build(name).kind == name for name in POSITIONAL_ENCODINGS)


@pytest.mark.parametrize("name, kwargs, words", [
    ("rope", {}, ["positional encoding name", "hope", "hope_boost"]),
    ("hope", {"head_dim": 15}, ["head_dim", "even"]),
    ("rope3d", {"head_dim": 15}, ["head_dim", "even"]),
    ("hope_boost", {"head_dim": 15}, ["head_dim", "even"]),
    ("hope", {"head_dim": 0}, ["head_dim"]),
    ("alibi", {"head_dim": True}, ["head_dim"]),
    ("alibi", {"num_heads": 0}, ["num_heads"]),
    ("none", {"max_position_embeddings": -1}, ["max_position_embeddings"]),
    ("hope", {"rope_theta": 0.0}, ["rope_theta"]),
    ("hope", {"rope_theta": float("inf")}, ["rope_theta"]),
    ("hope", {"chunk_size": 8}, ["chunk_size", "accepted"]),
    ("alibi", {"theta_prime": 2.0}, ["theta_prime", "accepted"]),
    ("rope3d", {"chunk_size": 0}, ["chunk_size"]),
    ("rope3d", {"chunk_base": 1.0}, ["chunk_base"]),
    ("hope_boost", {"theta_prime": 0.5}, ["theta_prime"]),
    ("hope_boost", {"theta_prime": 1.0}, ["theta_prime"]),
    ("hope_boost", {"angle_scale": 0.1, "theta_prime": 0.1}, ["theta_prime"]),
    ("hope_boost", {"angle_scale": -1.0}, ["angle_scale"]),
    ("hope_boost", {"learnable_decay": "yes"}, ["learnable_decay"]),
    ("learned", {"hidden_space_dim": 0}, ["hidden_space_dim"]),
    ("learned", {"init_std": 0.0}, ["init_std"]),
])
def test_bad_arguments_name_the_argument(name, kwargs, words):
    args = {"head_dim": 16, "num_heads": 3, "max_position_embeddings": MAX_POS, **kwargs}
    with pytest.raises(ValueError) as err:
        build_positional_encoding(name, **args)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_odd_head_dim_is_fine_where_nothing_is_paired():
    """Kinds that do not act on pairs take an odd head dim as any other: space parts stay unrotated, logits are
    ``scale·<q, k>_L`` (ALiBi: minus ``slope_h·(i - j)``, slopes ``2^(-8h/H)``), the learned table is added to
    odd-width space parts."""
    d, H, T = 15, 4, 6
    q, k, pos = space(2, H, T, d, seed=1), space(2, H, T, d, seed=2), torch.arange(T).expand(2, T)
    plain = SCALE * inner(lift(q, k=K).unsqueeze(-2), lift(k, k=K).unsqueeze(-3))
    slopes = torch.tensor([2.0 ** (-8 * h / H) for h in range(1, H + 1)])
    distance = (pos[:, :, None] - pos[:, None, :]).unsqueeze(1)
    for name, bias in (("none", 0.0), ("alibi", -slopes[:, None, None] * distance)):
        pe = build(name, head_dim=d, num_heads=H)
        assert torch.equal(pe.rotate(q, pos), q)
        assert_close(logits(pe, q, k, pos, pos), plain + bias)
    learned, x = build("learned", head_dim=d), space(2, T, d, seed=3)
    assert torch.equal(learned.embed(x, pos), x + learned.weight[pos])


def test_position_ids_must_be_integer_and_match_tokens():
    pe, x = build("hope"), space(1, 2, 5, 16)
    with pytest.raises(TypeError, match="position_ids"):
        pe.rotate(x, torch.arange(5.0)[None])
    with pytest.raises(ValueError, match="position_ids"):
        pe.rotate(x, torch.arange(4)[None])




@pytest.mark.parametrize("name", [n for n, cls in POSITIONAL_ENCODINGS.items() if cls.relative])
@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("shift", [1, 997, 65_000])
def test_prop_4_1_relative_scores_are_shift_invariant(name, d, shift):
    pe = build(name, head_dim=d)
    assert pe.relative
    B, H, T = 2, 3, 63
    q, k = space(B, H, T, d, seed=1), space(B, 1, T, d, seed=2)  # keys shared across heads (H = 1 broadcast)
    pos = torch.arange(T)[None] + torch.tensor([[0], [5]])  # rows at different offsets (e.g. left padding)
    s0, s1 = logits(pe, q, k, pos, pos), logits(pe, q, k, pos + shift, pos + shift)
    assert s0.shape == (B, H, T, T) and s0.dtype == torch.float32
    assert (s0 - s1).abs().max() <= 1e-6
    assert (causal_probs(s0, pos, pos) - causal_probs(s1, pos + shift, pos + shift)).abs().max() <= 1e-6


@pytest.mark.parametrize("name", ["learned", "rope3d"])
def test_prop_4_1_test_detects_a_non_relative_encoding(name):
    """The shift check above fails for the absolute kinds: shifting positions changes their scores."""
    pe = build(name, chunk_size=16) if name == "rope3d" else build(name, head_dim=16, hidden_space_dim=16)
    assert not pe.relative
    B, H, T, d = 1, 3, 20, 16
    q, k = space(B, H, T, d, seed=1), space(B, H, T, d, seed=2)
    pos = torch.arange(T)[None]

    def scores(p):
        if pe.absolute:  # learned positions enter through the token embedding, per head here
            return logits(pe, pe.embed(q.flatten(0, 1), p.expand(B * H, T)).view_as(q),
                          pe.embed(k.flatten(0, 1), p.expand(B * H, T)).view_as(k), p, p)
        return logits(pe, q, k, p, p)

    assert (scores(pos) - scores(pos + 5)).abs().max() > 1e-3


def test_hope_scores_depend_on_the_offset():
    pe = build("hope")
    q, k = space(1, 1, 1, 16, seed=3), space(1, 1, 1, 16, seed=4)
    pos = torch.zeros(1, 1, dtype=torch.long)
    s = [logits(pe, q, k, pos + m, pos).item() for m in range(4)]
    assert min(abs(a - b) for a, b in itertools.pairwise(s)) > 1e-4




@pytest.mark.parametrize("name", ["hope", "rope3d"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-13), (torch.bfloat16, 2e-2)])
def test_rotation_preserves_norm_and_time_coordinate(name, dtype, tol):
    pe = build(name, head_dim=64, chunk_size=100) if name == "rope3d" else build(name, head_dim=64)
    x = space(2, 3, 63, 64, std=1.0, dtype=dtype)
    pos = torch.randint(0, 70_000, (2, 63), generator=torch.Generator().manual_seed(5))
    y = pe.rotate(x, pos)
    assert y.dtype == dtype and y.shape == x.shape
    assert (y - x).abs().max() > 0.1  # it did rotate
    torch.testing.assert_close(y.double().norm(dim=-1), x.double().norm(dim=-1), rtol=tol, atol=0)
    torch.testing.assert_close(lift(y.double(), k=K)[..., 0], lift(x.double(), k=K)[..., 0], rtol=tol, atol=0)


@pytest.mark.parametrize("name", ["learned", "none", "alibi", "hope_boost"])
def test_non_rotary_kinds_do_not_rotate(name):
    pe = build(name)
    x = space(2, 3, 9, 16)
    pos = torch.arange(9).expand(2, 9)
    assert torch.equal(pe.rotate(x, pos), x)
    if name != "learned":
        assert torch.equal(pe.embed(x[:, 0], pos), x[:, 0])


@pytest.mark.parametrize("name", ["hope", "learned", "none", "rope3d"])
def test_kinds_without_bias_return_none(name):
    x = space(1, 3, 4, 16)
    pos = torch.arange(4)[None]
    assert build(name).score_bias(x, x, pos, pos, scale=SCALE) is None


def test_hope_angles_are_exact_at_long_range():
    """fp32 rotation matches a float64 reference at positions far beyond 64K; a naive fp32 ``p·θ`` does not."""
    d = 64
    pe = build("hope", head_dim=d)
    x = space(1, 1, 6, d, std=1.0)
    pos = torch.tensor([[0, 1, 65_535, 65_536, 1_000_003, 2**31 + 7]])
    theta = inverse_frequencies(d, 10000.0)
    angle = torch.remainder(pos[0, :, None].double() * theta, 2 * math.pi)
    ref = torch.view_as_real(complex_pairs(x) * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    err = (pe.rotate(x, pos).double() - ref).abs().max()
    assert err < 3e-6
    naive = pos[0, :, None].float() * theta.float()
    naive_ref = torch.view_as_real(complex_pairs(x) * torch.polar(torch.ones_like(angle), naive.double())).flatten(-2)
    assert (naive_ref - ref).abs().max() > 1e-3  # the test would catch the usual fp32 angle


def test_negative_positions_rotate_backwards():
    pe = build("hope")
    x = space(1, 2, 5, 16, dtype=torch.float64)
    pos = torch.tensor([[0, 3, 300, 70_000, 12]])
    torch.testing.assert_close(pe.rotate(pe.rotate(x, pos), -pos), x, rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", ["hope", "rope3d"])
def test_rotation_broadcasts_over_heads_and_batch(name):
    pe = build(name, chunk_size=4) if name == "rope3d" else build(name)
    x = space(2, 3, 11, 16)
    pos = torch.arange(11)[None] + 7
    full = pe.rotate(x, pos.expand(2, 11))
    assert torch.equal(pe.rotate(x, pos), full)  # position_ids [1, T] broadcast over the batch
    assert torch.equal(pe.rotate(x[:, :1], pos), full[:, :1])  # a single shared key head


def test_rotation_is_interleaved_pairs():
    """Eq. 4 rotates (x0, x1), (x2, x3), ...: a vector living on one pair stays on that pair."""
    pe = build("hope", head_dim=8)
    x = torch.zeros(1, 1, 1, 8)
    x[..., 2] = 1.0
    y = pe.rotate(x, torch.tensor([[1]]))
    theta1 = 10000.0 ** (-2 / 8)
    torch.testing.assert_close(y[0, 0, 0], torch.tensor([0, 0, math.cos(theta1), math.sin(theta1), 0, 0, 0, 0]))




def test_rope3d_equals_hope_within_one_chunk():
    hope, rope3d = build("hope", head_dim=64), build("rope3d", head_dim=64, chunk_size=64)
    x = space(2, 3, 63, 64)
    pos = torch.arange(63).expand(2, 63)
    assert torch.equal(rope3d.rotate(x, pos), hope.rotate(x, pos))


def test_rope3d_same_chunk_scores_equal_hope_at_in_chunk_positions():
    c = 16
    hope, rope3d = build("hope"), build("rope3d", chunk_size=c)
    q, k = space(1, 2, c, 16, seed=6), space(1, 2, c, 16, seed=7)
    local = torch.arange(c)[None]
    for chunk in (1, 3, 1000):
        pos = local + chunk * c
        torch.testing.assert_close(logits(rope3d, q, k, pos, pos), logits(hope, q, k, local, local),
                                   rtol=0, atol=1e-6)


def test_rope3d_cross_chunk_scores_follow_eq_5():
    """``q·k = Re Σ_l z_q z̄_k e^{i((m-n)θ_l + ψ_i - ψ_j)}`` with ``ψ_j = 1 - base^-j`` (seed 002 Eq. 5)."""
    c, d, base = 8, 16, 10000.0
    pe = build("rope3d", head_dim=d, chunk_size=c, chunk_base=base)
    q, k = space(1, 1, 1, d, seed=8, dtype=torch.float64), space(1, 1, 1, d, seed=9, dtype=torch.float64)
    theta = inverse_frequencies(d, base)
    for qp, kp in [(9, 3), (17, 2), (40, 39), (5, 21), (8 * 1000 + 1, 5)]:
        (i, m), (j, n) = divmod(qp, c), divmod(kp, c)
        phase = (m - n) * theta + (1 - base ** -i) - (1 - base ** -j)
        ref = (complex_pairs(q) * complex_pairs(k).conj() * torch.polar(torch.ones_like(phase), phase)).real.sum()
        got = (pe.rotate(q, torch.tensor([[qp]])) * pe.rotate(k, torch.tensor([[kp]]))).sum()
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)


def test_rope3d_is_relative_inside_chunks_but_not_across_boundaries():
    c = 16
    pe = build("rope3d", chunk_size=c)
    assert not pe.relative
    q, k = space(1, 2, 6, 16, seed=10), space(1, 2, 6, 16, seed=11)
    pos = torch.arange(6)[None] + 2 * c
    base = logits(pe, q, k, pos, pos)
    for shift in (3, 10, 5 * c):  # stays inside one chunk, or moves the whole window by whole chunks
        torch.testing.assert_close(logits(pe, q, k, pos + shift, pos + shift), base, rtol=0, atol=1e-6)
    straddle = logits(pe, q, k, pos + 13, pos + 13)  # positions 45..50 cross the boundary at 48
    assert (straddle - base).abs().max() > 1e-3




def boost_reference(q, k, qp, kp, theta, theta_prime):
    """Seed 000 Algorithm 1 verbatim, in 40-digit arithmetic: the naive form multiplies factors up to
    ``e^{±50}`` that cancel, which float64 cannot follow."""
    with mpmath.workdps(40):
        total = mpmath.mpf(0)
        for pair, th in enumerate(theta.tolist()):
            a, b, c, e = (mpmath.mpf(v) for v in q[2 * pair:2 * pair + 2] + k[2 * pair:2 * pair + 2])
            cq, sq = mpmath.cosh(qp * th), mpmath.sinh(qp * th)
            ck, sk = mpmath.cosh(kp * th), -mpmath.sinh(kp * th)
            fq = [mpmath.exp(-qp * theta_prime) * (cq * a + sq * b), mpmath.exp(-qp * theta_prime) * (sq * a + cq * b)]
            fk = [mpmath.exp(kp * theta_prime) * (ck * c + sk * e), mpmath.exp(kp * theta_prime) * (sk * c + ck * e)]
            total += fq[0] * fk[0] + fq[1] * fk[1]
        return float(total)


def test_hope_boost_matches_seed_algorithm_1():
    d = 16
    pe = build("hope_boost", head_dim=d, theta_prime=1.3)
    theta = inverse_frequencies(d, 10000.0)
    q, k = space(1, 1, 12, d, std=1.0, dtype=torch.float64, seed=12), space(1, 1, 12, d, std=1.0,
                                                                                 dtype=torch.float64, seed=13)
    pos = torch.arange(12)[None] * 2
    bias = pe.score_bias(q, k, pos, pos, scale=SCALE)
    assert bias.dtype == torch.float64
    for i in range(12):
        for j in range(i + 1):  # causal entries: Δ >= 0, where the seed's form is finite
            want = boost_reference(q[0, 0, i].tolist(), k[0, 0, j].tolist(), 2 * i, 2 * j, theta, 1.3)
            got = (q[0, 0, i] * k[0, 0, j]).sum() + bias[0, 0, i, j] / SCALE
            assert abs(float(got) - want) <= 1e-13 * (1 + abs(want))


def test_hope_boost_future_keys_use_symmetric_damping():
    """Δ < 0: ``e^{-|Δ|θ'} B(Δθ)`` (the seed's ``e^{-Δθ'}`` would grow), finite and decaying."""
    d, tp = 16, 1.2
    pe = build("hope_boost", head_dim=d, theta_prime=tp)
    theta = inverse_frequencies(d, 10000.0)
    q, k = space(1, 1, 1, d, std=1.0, dtype=torch.float64, seed=14), space(1, 1, 1, d, std=1.0,
                                                                                dtype=torch.float64, seed=15)
    for delta in (-1, -5, -30):
        bias = pe.score_bias(q, k, torch.tensor([[0]]), torch.tensor([[-delta]]), scale=1.0)[0, 0, 0, 0]
        a, b = q[0, 0, 0, 0::2], q[0, 0, 0, 1::2]
        c, e = k[0, 0, 0, 0::2], k[0, 0, 0, 1::2]
        ch, sh = torch.cosh(delta * theta), torch.sinh(delta * theta)
        want = math.exp(-abs(delta) * tp) * (ch * (a * c + b * e) + sh * (a * e + b * c)).sum()
        torch.testing.assert_close(bias + (q * k).sum(), want, rtol=1e-10, atol=1e-13)
    far = pe.score_bias(q.float(), k.float(), torch.tensor([[0]]), torch.tensor([[65_535]]), scale=SCALE)
    assert torch.isfinite(far).all()


def test_hope_boost_finite_and_relative_at_64k_positions():
    d = 64
    pe = build("hope_boost", head_dim=d)
    q, k = space(1, 3, 63, d, std=1.0, seed=16), space(1, 1, 63, d, std=1.0, seed=17)
    q_pos = 65_535 - torch.arange(63).flip(0)[None]
    k_pos = torch.cat([torch.arange(31), 65_535 - torch.arange(32).flip(0)])[None]
    s = logits(pe, q, k, q_pos, k_pos)
    assert torch.isfinite(s).all()
    bias = pe.score_bias(q, k, q_pos, k_pos, scale=SCALE)
    assert torch.equal(bias, pe.score_bias(q, k, q_pos - 60_000, k_pos - 60_000, scale=SCALE))
    # keys ~65K tokens back: the damped space form has vanished, leaving only -q_t k_t
    plain = SCALE * (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1)
    torch.testing.assert_close(bias[..., :31], -plain[..., :31], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hope_boost_scores_decay_monotonically_for_aligned_query_and_key(dtype):
    """Seed 000's locality: with ``q = k``, ``q_sᵀM(Δ)q_s = Σ_c e^{-Δ(θ'∓θ_l)} w_c²`` decreases with Δ."""
    d, T = 16, 65_536
    pe = build("hope_boost", head_dim=d)
    x = space(1, 1, 1, d, std=1.0, dtype=dtype, seed=18)
    keys = x.expand(1, 1, T, d)
    q_pos, k_pos = torch.tensor([[T - 1]]), torch.arange(T)[None]
    s = logits(pe, x, keys, q_pos, k_pos)[0, 0, 0].flip(0)  # indexed by distance Δ = 0 .. 65535
    assert torch.isfinite(s).all()
    steps = s[1:] - s[:-1]
    assert (steps <= 0).all()
    assert (steps[:30] < 0).all()
    assert s[0] > s[-1] + 0.1


def test_hope_boost_keeps_scores_below_minus_scale_k():
    """``‖M(Δ)‖₂ <= 1`` keeps ``scale(-q_t k_t + q_sᵀMk_s) <= -scale·k`` (the pseudo ``d²`` stays >= 0)."""
    pe = build("hope_boost", head_dim=16, theta_prime=1.01)
    for norm in (0.01, 1.0, 30.0):
        q, k = space(2, 3, 20, 16, std=norm, dtype=torch.float64, seed=19), space(2, 3, 20, 16, std=norm,
                                                                                   dtype=torch.float64, seed=20)
        k = torch.cat([q[:, :, :10], k[:, :, 10:]], dim=2)  # include aligned pairs, the tight case
        pos = torch.arange(20)[None]
        s = logits(pe, q, k, pos, pos)
        qt_kt = lift(q, k=K)[..., 0].unsqueeze(-1) * lift(k, k=K)[..., 0].unsqueeze(-2)
        assert (s + SCALE * K <= 1e-14 * SCALE * qt_kt).all()  # rounding of the cancelling terms only
        assert (torch.diagonal(s[:, :, :10, :10], dim1=-2, dim2=-1) + SCALE * K).abs().max() < 1e-9 * norm ** 2


def test_hope_boost_learnable_decay_trains_and_stays_above_max_theta():
    pe = build("hope_boost", head_dim=16, theta_prime=1.5, learnable_decay=True)
    assert abs(pe.theta_prime.item() - 1.5) < 1e-6
    q = space(1, 3, 8, 16, std=1.0).requires_grad_()
    pos = torch.arange(8)[None]
    pe.score_bias(q, q, pos, pos, scale=SCALE).sum().backward()
    assert pe.decay_raw.grad is not None and pe.decay_raw.grad.abs() > 0 and q.grad.abs().sum() > 0
    with torch.no_grad():
        pe.decay_raw.fill_(-50.0)
    assert pe.theta_prime.item() > pe.max_theta  # the fp32 floor keeps θ' strictly above max θ_l




def test_alibi_slopes_follow_press_et_al():
    assert alibi_slopes(8) == tuple(2.0 ** -i for i in range(1, 9))
    assert alibi_slopes(6) == (2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3)
    assert len(set(alibi_slopes(12))) == 12


def test_alibi_penalty_grows_linearly_with_distance_per_head():
    pe = build("alibi", num_heads=6)
    x = space(2, 6, 63, 16)
    pos = torch.arange(63).expand(2, 63)
    bias = pe.score_bias(x, x[:, :1], pos, pos, scale=SCALE)
    assert bias.shape == (2, 6, 63, 63) and bias.dtype == torch.float32
    row = bias[:, :, -1, :]  # last query against every key: distance 62 .. 0
    assert (row[..., 2:] - 2 * row[..., 1:-1] + row[..., :-2]).abs().max() < 1e-6  # zero second difference
    slope = row[..., 1:] - row[..., :-1]  # penalty per extra token of distance, constant per head
    torch.testing.assert_close(slope, torch.tensor(alibi_slopes(6)).view(1, 6, 1).expand_as(slope))
    assert len(set(slope[0, :, 0].tolist())) == 6
    assert torch.equal(torch.diagonal(bias, dim1=-2, dim2=-1), torch.zeros(2, 6, 63))
    assert (bias[:, :, -1, 0] < bias[:, :, -1, -2]).all()  # farther keys are penalised more




def test_learned_adds_a_table_row_and_rejects_positions_past_the_table():
    pe = build_positional_encoding("learned", head_dim=8, num_heads=2, max_position_embeddings=32,
                                   hidden_space_dim=24)
    assert pe.max_positions == 32 and pe.weight.shape == (32, 24)
    x = space(2, 7, 24)
    pos = torch.arange(7)[None] + torch.tensor([[0], [25]])
    y = pe.embed(x, pos)
    torch.testing.assert_close(y, x + pe.weight[pos])
    y.sum().backward()
    assert pe.weight.grad[pos].abs().sum() > 0 and pe.weight.grad[8:25].abs().sum() == 0
    for bad in (pos + 1, pos - 1):  # 32 is past the table; -1 is not a position
        with pytest.raises(RuntimeError, match=r"position_ids .*max_positions=32"):
            pe.embed(x, bad)
    with pytest.raises(ValueError, match="hidden_space_dim"):
        pe.embed(space(2, 7, 16), pos)




@pytest.mark.parametrize("name", POSITIONAL_ENCODINGS)
def test_output_dtypes(name):
    pe = build(name)
    x = space(1, 3, 5, 16, dtype=torch.bfloat16)
    pos = torch.arange(5)[None]
    assert pe.rotate(x, pos).dtype == torch.bfloat16
    assert pe.embed(x[:, 0], pos).dtype == torch.bfloat16
    bias = pe.score_bias(x, x, pos, pos, scale=SCALE)
    assert bias is None or (bias.dtype == torch.float32 and bias.shape == (1, 3, 5, 5))


@pytest.mark.parametrize("name", ["hope", "rope3d"])
def test_rotate_gradcheck(name):
    pe = build(name, head_dim=4, chunk_size=3) if name == "rope3d" else build(name, head_dim=4)
    x = space(1, 2, 5, 4, dtype=torch.float64).requires_grad_()
    pos = torch.tensor([[0, 2, 4, 65_535, 7]])
    assert torch.autograd.gradcheck(lambda t: pe.rotate(t, pos), (x,))


@pytest.mark.parametrize("segments", [True, False])
def test_hope_boost_bias_gradcheck(segments):
    d = 20  # 20 light-cone channels: three checkpointed segments of 8, 8 and 4
    q = space(1, 2, 3, d, std=1.0, dtype=torch.float64, seed=21).requires_grad_()
    k = space(1, 1, 4, d, std=1.0, dtype=torch.float64, seed=22).requires_grad_()
    tp = torch.tensor(1.2, dtype=torch.float64, requires_grad=True)
    q_pos, k_pos = torch.tensor([[3, 5, 6]]), torch.tensor([[0, 4, 5, 9]])  # includes Δ < 0
    theta = inverse_frequencies(d, 10000.0)

    def f(q, k, tp):
        return hope_boost_bias(q, k, q_pos, k_pos, freqs=theta, theta_prime=tp, scale=SCALE,
                               checkpoint_segments=segments)

    assert torch.autograd.gradcheck(f, (q, k, tp))


def test_registry_properties_describe_each_kind():
    """One vocabulary: each kind's properties are its class attributes, read by configs, models and layers."""
    props = {name: (cls.rotary, cls.pairs, cls.has_score_bias, cls.absolute) for name, cls in
             POSITIONAL_ENCODINGS.items()}
    assert props == {"hope": (True, True, False, False), "learned": (False, False, False, True),
                     "none": (False, False, False, False), "alibi": (False, False, True, False),
                     "rope3d": (True, True, False, False), "hope_boost": (False, True, True, False),
                     "sinusoidal": (False, False, False, True), "bipe_hope": (True, True, False, True),
                     "bipe_alibi": (False, False, True, True)}


@pytest.mark.parametrize("name", ["hope", "rope3d", "alibi", "hope_boost", "none"])
def test_model_tables_equal_the_stand_alone_encoding(name):
    """``pe(position_ids, kv_len)`` (what a model builds once per forward) applies the same rotation and bias
    as the stand-alone ``rotate`` / ``score_bias`` at index positions."""
    pe = build(name, chunk_size=8) if name == "rope3d" else build(name)
    B, H, T, past = 2, 3, 5, 7
    position_ids = torch.arange(past, past + T)[None] + torch.tensor([[0], [3]])
    tables = pe(position_ids, kv_len=past + T)
    assert isinstance(tables, PositionalTables)
    x = space(B, H, T, 16)
    assert torch.equal(tables.rotate(x), pe.rotate(x, position_ids))
    q, k = space(B, H, T, 16, seed=3), space(B, H, past + T, 16, seed=4)
    q_pos, k_pos = torch.arange(past, past + T).expand(B, T), torch.arange(past + T).expand(B, past + T)
    want = pe.score_bias(q, k, q_pos, k_pos, scale=SCALE)
    got = tables.score_bias(q, k, SCALE)
    if name == "alibi":  # the model hands ALiBi to the attention as slopes, which builds this same bias
        from helm.ops import alibi_bias as ops_alibi_bias

        assert got is None
        assert_close(ops_alibi_bias(tables.alibi_slopes, T, past + T).expand_as(want), want)
    elif want is None:
        assert got is None and tables.alibi_slopes is None
    else:
        assert torch.equal(got, want)


def test_tables_follow_the_model_dtype():
    pe = build("hope")
    pos = torch.arange(4)[None]
    assert pe(pos, kv_len=4).cos.dtype == torch.float32
    assert pe(pos, kv_len=4, dtype=torch.bfloat16).cos.dtype == torch.float32
    assert pe(pos, kv_len=4, dtype=torch.float64).cos.dtype == torch.float64


def test_unknown_options_list_what_the_kind_accepts():
    with pytest.raises(ValueError, match=r"theta_prime.*'chunk_size'"):
        build("rope3d", theta_prime=2.0)
