import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import helm.ops.attention as ops_attention
from helm.manifold import lift, manifold_error
from helm.ops import AttentionMask, alibi_bias, build_attention_mask, lorentz_attention
from helm.ops.centring import key_groups, value_centres
from tests import references
from tests.helpers import MANIFOLD_TOL, assert_close, relative_error


def qkv(B=2, H=3, Tq=63, Tk=63, d=16, dv=12, k=0.5, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda T, n: lift(scale * torch.randn(B, H, T, n, generator=g, dtype=torch.float64), k=k).to(dtype)
    return mk(Tq, d).requires_grad_(), mk(Tk, d).requires_grad_(), mk(Tk, dv).requires_grad_()


def case_kwargs(case, B, Tq, Tk, H, dtype):
    g = torch.Generator().manual_seed(1)
    kw = {"causal": True}
    if case == "noncausal":
        kw["causal"] = False
    if case in ("left_padding", "mixed"):
        m = torch.ones(B, Tk, dtype=torch.long)
        m[1, :7] = 0
        kw["attention_mask"] = m
    if case == "right_padding":
        m = torch.ones(B, Tk, dtype=torch.long)
        m[0, -9:] = 0
        kw["attention_mask"] = m
    if case in ("packed", "mixed"):
        seg = torch.zeros(B, Tk, dtype=torch.long)
        seg[:, 20:] = 1
        seg[0, 45:] = 2
        kw["segment_ids"] = seg
    if case in ("alibi", "mixed"):
        kw["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125][:H], dtype=dtype)
    if case == "bias":
        kw["position_bias"] = torch.randn(1, H, Tq, Tk, generator=g, dtype=torch.float64).to(dtype)
    return kw


CASES = ["causal", "noncausal", "left_padding", "right_padding", "packed", "alibi", "bias", "mixed", "decode"]


def _eager_and_sdpa(case, dtype, impls=("eager", "sdpa")):
    """Outputs and the gradients of q, k, v, τ of each implementation on one case."""
    B, H = 2, 3
    Tq, Tk = (3, 63) if case == "decode" else (63, 63)
    q, k, v = qkv(B, H, Tq, Tk, dtype=dtype)
    tau = torch.tensor([0.7, 1.3, 2.9], dtype=dtype, requires_grad=True)
    kw = case_kwargs(case, B, Tq, Tk, H, dtype)
    results = {}
    for impl in impls:
        out = lorentz_attention(q, k, v, k=0.5, tau=tau, impl=impl, **kw)
        weights = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), [q, k, v, tau])
        results[impl] = (out, *grads)
        assert manifold_error(out, 0.5).max() <= MANIFOLD_TOL[dtype]
    return results


NAMES = ("output", "grad q", "grad k", "grad v", "grad τ")


@pytest.mark.parametrize("backend", ["fp64", "fp32-math"])
@pytest.mark.parametrize("case", CASES)
def test_eager_and_sdpa_agree_on_outputs_and_gradients(case, backend):
    """fp64 (flash), or fp32 on SDPA's math backend: sdpa is eager to the dtype's rounding."""
    dtype = torch.float64 if backend == "fp64" else torch.float32
    with sdpa_kernel(SDPBackend.MATH) if backend == "fp32-math" else contextlib.nullcontext():
        results = _eager_and_sdpa(case, dtype)
    for name, a, b in zip(NAMES, results["sdpa"], results["eager"]):
        assert_close(a, b, msg=name)


@pytest.mark.parametrize("case", CASES)
def test_sdpa_on_flash_in_fp32_is_within_its_documented_bound(case):
    """fp32 through SDPA's flash kernel (the default: padded operands) against fp64: within the documented
    ``sdpa_flash_fp32`` figure on the output and every gradient; the fp32 math path (eager) is 10-20x closer on
    ``dq`` (``helm.ops.attention._pad_heads``)."""
    reference = _eager_and_sdpa(case, torch.float64, impls=("eager",))["eager"]
    flash = _eager_and_sdpa(case, torch.float32, impls=("sdpa",))["sdpa"]
    for name, a, b in zip(NAMES, flash, reference):
        assert_close(a, b, claim="sdpa_flash_fp32", msg=name)


# Reference cases: (B, H, Tq, Tk, 1+d, causal, padding, segments, alibi, score bias, far). The masks and ALiBi are
# built by the test from their definitions; the odd sizes (63 keys, 5 decode queries) stress the block edges.
# ``far``: each document's (and the padding's) values cluster at its own point |v_s| ~ 100, where the op centres
# them per document (near the origin its centres are 0 and the centring is not exercised); the fp64
# reference's naive ``|<S, S>_L|`` then cancels ~4 digits, hence the looser bounds there.
REFERENCE_CASES = {
    "plain-causal": (2, 3, 63, 63, 1 + 16, True, None, None, False, False, False),
    "pad-seg-alibi-bias": (2, 3, 63, 63, 1 + 16, True, "left", "docs", True, True, False),
    "far-pad-seg-alibi-bias": (2, 3, 63, 63, 1 + 16, True, "left", "docs", True, True, True),
    "far-noncausal-rightpad-seg": (2, 3, 63, 63, 1 + 16, False, "right", "docs", False, True, True),
    "far-decode-pad-seg-alibi": (2, 3, 5, 63, 1 + 16, True, "left", "docs", True, True, True),
    "head-dim-64": (1, 2, 63, 63, 1 + 64, True, "left", "docs", True, True, False),
}


def reference_inputs(B, H, Tq, Tk, causal, padding, segments, alibi, bias, seed=5):
    """``(allowed [B, Tq, Tk], score bias or None, kwargs for lorentz_attention, real-query rows [B, Tq], group of
    each key [B, Tk] (document, and 1000 for padding))``.

    ``allowed``: causal (key index <= the query's, queries being the last ``Tq`` keys), same document, key not
    padding, spelled out per (query, key); ALiBi adds ``-m_h (i - j)`` with ``i`` the query's key index."""
    g = torch.Generator().manual_seed(seed)
    real = torch.ones(B, Tk, dtype=torch.bool)
    if padding == "left":
        real[-1, :7] = False
    elif padding == "right":
        real[0, -9:] = False
    seg = torch.zeros(B, Tk, dtype=torch.long)
    if segments:  # documents of uneven lengths, ids not contiguous, a different split in each row
        seg[0, 20:], seg[0, 45:] = 4, 9
        seg[-1, 31:] = 2
    start = Tk - Tq
    allowed = torch.zeros(B, Tq, Tk, dtype=torch.bool)
    alibi_bias_ref = torch.zeros(1, H, Tq, Tk, dtype=torch.float64)
    slopes = [0.5 / 2 ** h for h in range(H)]
    for b in range(B):
        for i in range(Tq):
            for j in range(Tk):
                allowed[b, i, j] = (not causal or j <= start + i) and seg[b, start + i] == seg[b, j] and real[b, j]
    for h in range(H):
        for i in range(Tq):
            for j in range(Tk):
                alibi_bias_ref[0, h, i, j] = -slopes[h] * (start + i - j)
    kw = {"causal": causal}
    ref_bias = None
    if padding:
        kw["attention_mask"] = real.long()
    if segments:
        kw["segment_ids"] = seg
    if alibi:
        kw["alibi_slopes"] = torch.tensor(slopes, dtype=torch.float64)
        ref_bias = alibi_bias_ref
    if bias:
        kw["position_bias"] = torch.randn(B, H, Tq, Tk, generator=g, dtype=torch.float64)
        ref_bias = kw["position_bias"] if ref_bias is None else ref_bias + kw["position_bias"]
    rows = real[:, start:] & allowed.any(-1)  # padding queries' outputs are ignored by every caller
    return allowed, ref_bias, kw, rows, torch.where(real, seg, 1000)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_matches_loop_reference_on_outputs_and_gradients(case, impl):
    """Eq. 3 with padding, packed documents, ALiBi and a score bias, against ``references.lorentz_attention``
    (per query row: allowed keys, ``softmax(-d²/τ + b)``, centroid of the values), on the outputs of real
    queries and on the gradients of q, k, v and τ; fp64, so the two agree to rounding."""
    B, H, Tq, Tk, D, causal, padding, segments, alibi, bias, far = REFERENCE_CASES[case]
    allowed, ref_bias, kw, rows, groups = reference_inputs(B, H, Tq, Tk, causal, padding, segments, alibi, bias)
    g = torch.Generator().manual_seed(2)
    # leaves are the space parts: the op and the reference extend the centroid differently off the manifold, so
    # their gradients agree along it (through lift), not in the ambient time coordinate
    spaces = [(1.5 * torch.randn(B, H, T, n, generator=g, dtype=torch.float64)).requires_grad_()
              for T, n in ((Tq, D - 1), (Tk, D - 1), (Tk, 11))]
    offset = torch.zeros(B, 1, Tk, 11, dtype=torch.float64)
    if far:  # one random point of norm ~100 per group, the same for every head
        point = lambda gid: torch.randn(11, generator=torch.Generator().manual_seed(gid), dtype=torch.float64)
        offset = torch.stack([100 / 11 ** 0.5 * point(gid) for gid in groups.flatten().tolist()]).view(B, 1, Tk, 11)
    shifts = (0.0, 0.0, offset)
    points = lambda: [references.to_hyperboloid(s + o, 0.5) for s, o in zip(spaces, shifts)]  # a graph per backward
    q, k, v = points()
    tau = torch.tensor([0.7, 1.3, 2.9][:H], dtype=torch.float64, requires_grad=True)
    weights = torch.randn(B, H, Tq, v.shape[-1], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weights = weights * rows.view(B, 1, Tq, 1)
    out = lorentz_attention(q, k, v, k=0.5, tau=tau, impl=impl, **kw)
    grads = torch.autograd.grad((out * weights).sum(), [*spaces, tau])
    ref = references.lorentz_attention(*points(), 0.5, tau, allowed, ref_bias)
    ref_grads = torch.autograd.grad((ref * weights).sum(), [*spaces, tau])
    sel = rows.view(B, 1, Tq).expand(B, H, Tq)
    rtol = 1e-9 if far else 1e-11
    assert_close(out[sel], ref[sel], rtol=rtol)
    for name, a, b in zip("qkvτ", grads, ref_grads):
        assert_close(a, b, rtol=10 * rtol, msg=f"grad {name}")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_fp32_matches_loop_reference_far_from_the_origin(impl):
    """fp32 inputs whose values cluster at ``|v_s| ~ 1e3`` with packed documents and padding: the output is the
    fp64 reference's to fp32 rounding of the inputs (the centred normalisation keeps it so)."""
    B, H, T = 2, 2, 63
    q, k, v = qkv(B, H, T, T, d=16, dv=11, k=0.5, seed=4)
    shift = torch.zeros(11)
    shift[0] = 1e3
    v = lift(v.detach()[..., 1:] + shift, k=0.5)
    allowed, ref_bias, kw, rows, _ = reference_inputs(B, H, T, T, True, "left", "docs", True, False)
    q32, k32, v32 = (lift(t.detach()[..., 1:].float(), k=0.5) for t in (q, k, v))
    out = lorentz_attention(q32, k32, v32, k=0.5, tau=1.3, impl=impl, **kw)
    # the reference gets the exact points of the fp32 space parts: an fp32 time coordinate is itself ~1e-4 off
    ref = references.lorentz_attention(*(references.to_hyperboloid(t[..., 1:], 0.5) for t in (q32, k32, v32)),
                                       0.5, 1.3, allowed, ref_bias)
    sel = rows.view(B, 1, T).expand(B, H, T)
    assert_close(out[sel], ref[sel].float(), factor=10)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_documents_do_not_interact(impl):
    q, k, v = qkv(1, 2, 50, 50, dtype=torch.float32)
    seg = torch.zeros(1, 50, dtype=torch.long)
    seg[:, 30:] = 1
    out = lorentz_attention(q, k, v, k=0.5, tau=1.0, segment_ids=seg, impl=impl)
    # change the first document entirely: the second document's outputs must not move
    q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
    fresh = qkv(1, 2, 50, 50, dtype=torch.float32, seed=9)
    for t, f in zip((q2, k2, v2), fresh):
        t[:, :, :30] = f.detach()[:, :, :30]
    out2 = lorentz_attention(q2, k2, v2, k=0.5, tau=1.0, segment_ids=seg, impl=impl)
    assert torch.equal(out[:, :, 30:], out2[:, :, 30:])
    assert not torch.allclose(out[:, :, :30], out2[:, :, :30])


def test_padding_queries_stay_finite_and_real_tokens_ignore_padding():
    q, k, v = qkv(2, 2, 20, 20, dtype=torch.float32)
    m = torch.ones(2, 20, dtype=torch.long)
    m[1, :6] = 0
    out = lorentz_attention(q, k, v, k=0.5, tau=1.0, attention_mask=m, impl="sdpa")
    assert torch.isfinite(out).all()
    ref = lorentz_attention(q[1:, :, 6:], k[1:, :, 6:], v[1:, :, 6:], k=0.5, tau=1.0, impl="sdpa")
    assert_close(out[1:, :, 6:], ref)


def test_mask_builder_and_alibi_bias():
    keep = build_attention_mask(1, 2, 5, causal=True, device="cpu")
    assert keep[0, 0].tolist() == [[True, True, True, True, False], [True] * 5]
    bias = alibi_bias(torch.tensor([1.0, 0.5]), 3, 3)
    assert bias[0, 0].tolist() == [[0, 1, 2], [-1, 0, 1], [-2, -1, 0]]
    assert torch.equal(bias[0, 1], bias[0, 0] * 0.5)


def test_time_coordinates_and_norms_stay_fp32_under_bf16_autocast():
    """Points with bf16 space parts (as the layers make them) under autocast (helm.precision): q·k runs in bf16
    with the time coordinates as hi + lo pairs, softmax, ν·v and the normalisation in fp32, so the output is fp32,
    on the manifold to fp32 rounding, and no further from the fp64 result than twice the same attention on the
    points rounded to bf16 (time coordinates included) and computed in fp32 (measured 5.4e-2 against 8.3e-2)."""
    q, k, v = (lift(t.detach()[..., 1:].bfloat16(), k=0.5) for t in qkv(1, 2, 17, 17, dtype=torch.float32, scale=3.0))
    ref = lorentz_attention(q.double(), k.double(), v.double(), k=0.5, tau=1.0, impl="eager")
    naive = lorentz_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), k=0.5, tau=1.0, impl="eager",
                              dtype=torch.float32)
    for impl in ("eager", "sdpa"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = lorentz_attention(q, k, v, k=0.5, tau=1.0, impl=impl)
        assert out.dtype == torch.float32 and manifold_error(out, 0.5).max() <= 1e-5
        assert_close(out, ref, baseline=naive, msg=impl)


BAD = [  # the argument and the value at fault
    (dict(impl="flash"), "'flash'"),
    (dict(impl="triton"), "'triton'.*'cpu'"),
    (dict(tau=0.0), "tau.*0.0"),
    (dict(tau=-1.0), "tau.*-1.0"),
    (dict(tau=torch.ones(5)), r"tau.*\(5,\)"),
    (dict(attention_mask=torch.ones(2, 7)), r"attention_mask.*\(2, 7\)"),
    (dict(segment_ids=torch.ones(1, 9)), r"segment_ids.*\(1, 9\)"),
    (dict(position_bias=torch.zeros(9, 9)), r"position_bias.*\(9, 9\)"),
    (dict(alibi_slopes=torch.ones(2)), r"alibi_slopes.*\(2,\)"),
]


@pytest.mark.parametrize("kw,match", BAD, ids=[m for _, m in BAD])
def test_bad_inputs_raise(kw, match, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = qkv(2, 3, 9, 9, dtype=torch.float32)
    kw = {"tau": 1.0, **kw}
    with pytest.raises(ValueError, match=match):
        lorentz_attention(q, k, v, k=0.5, **kw)


@pytest.mark.parametrize("shapes,match", [
    (((2, 3, 9, 17), (2, 3, 9, 16), (2, 3, 9, 5)), "same head dim"),
    (((2, 3, 9, 17), (2, 2, 9, 17), (2, 2, 9, 5)), "share"),
    (((2, 3, 9, 17), (2, 3, 9, 17), (2, 3, 8, 5)), "same length"),
    (((2, 3, 10, 17), (2, 3, 9, 17), (2, 3, 9, 5)), "exceeds"),
    (((3, 9, 17), (3, 9, 17), (3, 9, 5)), r"\[B, H, T, 1\+d\]"),
])
def test_mismatched_shapes_raise(shapes, match):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        lorentz_attention(q, k, v, k=1.0, tau=1.0, impl="sdpa")


def test_one_mask_object_serves_every_call_and_builds_its_dense_form_once(monkeypatch):
    """What a model does: one AttentionMask per forward, passed to every layer's attention call."""
    calls = []
    dense = ops_attention._dense_keep
    monkeypatch.setattr(ops_attention, "_dense_keep", lambda m: calls.append(1) or dense(m))
    q, k, v = qkv(2, 3, 20, 20, dtype=torch.float32)
    pad = torch.ones(2, 20, dtype=torch.long)
    pad[1, :4] = 0
    seg = torch.zeros(2, 20, dtype=torch.long)
    seg[:, 12:] = 1
    mask = AttentionMask(2, 20, 20, padding=pad, segment_ids=seg)
    outs = [lorentz_attention(q, k, v, k=0.5, tau=1.0, mask=mask, impl=impl) for impl in ("eager", "sdpa", "eager")]
    assert len(calls) == 1
    ref = lorentz_attention(q, k, v, k=0.5, tau=1.0, attention_mask=pad, segment_ids=seg, impl="eager")
    for out in outs:
        assert_close(out, ref)
    assert torch.equal(mask.keep(), build_attention_mask(2, 20, 20, causal=True, attention_mask=pad, segment_ids=seg))


def test_plain_causal_mask_has_no_dense_form_for_sdpa():
    mask = AttentionMask(1, 9, 9)
    assert mask.is_plain_causal
    assert not AttentionMask(1, 3, 9).is_plain_causal and AttentionMask(1, 3, 9).keep().shape == (1, 1, 3, 9)
    assert AttentionMask(1, 9, 9, causal=False).keep() is None  # nothing masked at all


def test_mask_errors_name_the_problem():
    q, k, v = qkv(2, 3, 9, 9, dtype=torch.float32)
    with pytest.raises(ValueError, match="attention mask was built for"):
        lorentz_attention(q, k, v, k=0.5, tau=1.0, mask=AttentionMask(2, 8, 8), impl="sdpa")
    with pytest.raises(ValueError, match="either mask or attention_mask"):
        lorentz_attention(q, k, v, k=0.5, tau=1.0, mask=AttentionMask(2, 9, 9), attention_mask=torch.ones(2, 9))
    with pytest.raises(ValueError, match="segment_ids must be"):
        AttentionMask(2, 9, 9, segment_ids=torch.zeros(2, 8))


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("form", ["offset int", "offset tensor", "4-D mask", "4-D float mask"])
def test_static_cache_slots_give_the_attention_of_the_written_keys(form, impl):
    """Issue 14, item 1: queries at key indices 5..6 of 10 slots (the last 3 unwritten, zero) attend exactly as
    the last 2 of the 7 written keys do; with left padding, packed documents and ALiBi."""
    q, k, v = qkv(2, 3, 2, 7, dtype=torch.float64, seed=3)
    q, k, v = q.detach(), k.detach(), v.detach()
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, :2] = False
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]])
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    ref = lorentz_attention(q, k, v, k=0.5, tau=1.5, attention_mask=pad, segment_ids=seg, alibi_slopes=slopes,
                            impl="eager")
    zeros = lambda x: torch.cat([x, torch.zeros_like(x[:, :, :3])], dim=2)
    slot_pad = torch.cat([pad, torch.zeros(2, 3, dtype=torch.bool)], 1)
    slot_seg = torch.cat([seg, torch.full((2, 3), -1)], 1)
    if form.startswith("offset"):
        offset = 5 if form == "offset int" else torch.tensor(5)
        mask = AttentionMask(2, 2, 10, padding=slot_pad, segment_ids=slot_seg, q_offset=offset)
    else:
        keep = AttentionMask(2, 2, 10, padding=slot_pad, q_offset=5).keep()
        additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)  # transformers' eager form
        dense = keep if form == "4-D mask" else additive
        mask = AttentionMask(2, 2, 10, segment_ids=slot_seg, dense=dense, q_offset=5)
    assert not mask.bottom_right and not mask.is_plain_causal
    out = lorentz_attention(q, zeros(k), zeros(v), k=0.5, tau=1.5, mask=mask, alibi_slopes=slopes, impl=impl)
    assert_close(out, ref)


def test_value_centres_are_each_documents_own_mean():
    """The per-document centres (one segmented sum per layer) against the definition: each key gets its group's mean
    ``m`` times ``β = max(0, 1 - 100 var/|m|²)``, computed here per group with plain means (values clustered per
    document, so β > 0 and the mean itself is checked)."""
    g = torch.Generator().manual_seed(4)
    B, H, T, C = 2, 3, 37, 5
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[:, 11:] = 1
    seg[0, 30:] = 2
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[1, :4] = False
    v = torch.randn(B, H, T, C, generator=g, dtype=torch.float64) * 0.01 + seg.view(B, 1, T, 1) + 3
    got = value_centres(v, key_groups(B, T, seg, pad, "cpu"))
    for b in range(B):
        key = seg[b] * 2 + (~pad[b]).long()
        for value in key.unique():
            members = key == value
            x = v[b][:, members]
            m = x.mean(-2, keepdim=True)
            var = (x - m).square().sum(-1, keepdim=True).mean(-2, keepdim=True)
            beta = (1 - 100 * var / m.square().sum(-1, keepdim=True)).clamp_min(0)
            assert (beta > 0).all()
            assert_close(got[b][:, members], (m * beta).expand_as(x), rtol=1e-10)
