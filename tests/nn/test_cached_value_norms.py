"""Decode steps of Lorentz self-attention without a pass over the cache besides attention itself (issue 13 item 3,
the elementwise part): the cache keeps each value's centred norm ``e = <v - c, v - c>_L`` beside it, for the centre
``c`` = the first cached value, and ``sdpa`` normalises from ``SDPA(·, ·, [v | e])``. Same centroid as the reference
(``eager`` re-centres every call), any centre."""

import pytest
import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import Cache, StaticLayer

import helm.ops.attention as attention_ops
from helm.manifold import lift, sqnorm
from helm.nn import LorentzSelfAttention, build_positional_encoding
from helm.ops import AttentionMask, lorentz_attention
from tests.helpers import assert_close

HIDDEN, HEADS, HEAD = 1 + 47, 3, 1 + 16


def points(*shape, dtype=torch.float64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return lift(scale * torch.randn(*shape, generator=g, dtype=torch.float64), k=0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", ["decode", "padded", "static", "alibi"])
def test_sdpa_with_cached_norms_equals_eager(case, dtype):
    B, H, Tk, d = 2, 3, 13, 8
    q, kk, v = points(B, H, 2, 1 + d, seed=1, dtype=dtype), points(B, H, Tk, 1 + d, seed=2, dtype=dtype), \
        points(B, H, Tk, 1 + d, seed=3, dtype=dtype)
    centre = points(B, H, 1, 1 + d, seed=4, dtype=dtype)  # any point: the centroid does not depend on it
    padding = torch.ones(B, Tk, dtype=torch.bool)
    mask, slopes = AttentionMask(B, 2, Tk), None
    if case == "padded":
        padding[1, :4] = False
        mask = AttentionMask(B, 2, Tk, padding=padding)
    elif case == "static":  # the queries at 7, 8 of 13 slots, the rest unwritten
        mask = AttentionMask(B, 2, Tk, q_offset=7)
    elif case == "alibi":
        slopes = torch.tensor([0.5, 0.25, 0.125])
    ve = torch.cat([v, sqnorm(v - centre, keepdim=True)], dim=-1)
    got = lorentz_attention(q, kk, ve, k=0.5, tau=1.3, mask=mask, alibi_slopes=slopes, impl="sdpa", value_centre=centre)
    want = lorentz_attention(q, kk, v, k=0.5, tau=1.3, mask=mask, alibi_slopes=slopes, impl="eager")
    # eager ignores the column (the reference re-centres)
    assert torch.equal(want, lorentz_attention(q, kk, ve, k=0.5, tau=1.3, mask=mask, alibi_slopes=slopes,
                                               impl="eager", value_centre=centre))
    assert_close(got, want, rtol=1e-12 if dtype == torch.float64 else 1e-5)


def test_value_centre_shape_is_checked():
    q, kk, v = points(1, 2, 1, 5), points(1, 2, 4, 5), points(1, 2, 4, 5)
    with pytest.raises(ValueError, match="value_centre"):
        lorentz_attention(q, kk, v, k=0.5, tau=1.0, value_centre=v[:, :, :1])


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_keys_given_as_space_parts_and_times(impl):
    """``key_time=``: the keys' space parts and time coordinates apart, as an autocast cache holds them, give the
    points' result; the points are rebuilt in the statistics dtype whatever ``key_time``'s dtype (a bf16 one does not
    round the space parts); a key with its time coordinate, or an integer ``key_time``, is refused naming it."""
    q, kk, v = points(1, 2, 3, 5, dtype=torch.float32), points(1, 2, 4, 5, dtype=torch.float32), \
        points(1, 2, 4, 5, dtype=torch.float32)
    want = lorentz_attention(q, kk, v, k=0.5, tau=1.0, impl=impl)
    assert torch.equal(lorentz_attention(q, kk[..., 1:], v, k=0.5, tau=1.0, impl=impl, key_time=kk[..., 0]), want)
    rounded = kk[..., 0].bfloat16()
    assert torch.equal(lorentz_attention(q, kk[..., 1:], v, k=0.5, tau=1.0, impl=impl, key_time=rounded),
                       lorentz_attention(q, torch.cat([rounded.float()[..., None], kk[..., 1:]], -1), v, k=0.5,
                                         tau=1.0, impl=impl))
    for key, time in ((kk, kk[..., 0]), (kk[..., 1:], kk[..., 0].long())):
        with pytest.raises(ValueError, match="key_time"):
            lorentz_attention(q, key, v, k=0.5, tau=1.0, impl=impl, key_time=time)


def make_layer(impl="sdpa", dtype=torch.float32):
    torch.manual_seed(0)
    layer = LorentzSelfAttention(HIDDEN, HEADS, HEAD, k=1.0, config=PreTrainedConfig(attn_implementation=impl),
                                 layer_idx=0)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return layer.to(dtype).eval()


def decode(layer, x, cache, prefill, padding=None):
    B, T, _ = x.shape
    pe = build_positional_encoding("hope", head_dim=HEAD - 1, num_heads=HEADS, max_position_embeddings=128)
    static = bool(cache.layers) and isinstance(cache.layers[0], StaticLayer)
    outs, start = [], 0
    for stop in [prefill, *range(prefill + 1, T + 1)]:
        kv_len = cache.layers[0].max_cache_len if static else stop
        pad = None
        if padding is not None:
            pad = torch.zeros(B, kv_len, dtype=torch.bool)
            pad[:, :stop] = padding[:, :stop]
        pos = (torch.arange(start, stop) - (0 if padding is None else (~padding).sum(1, keepdim=True))).clamp_min(0)
        pos = pos.expand(B, -1)
        mask = AttentionMask(B, stop - start, kv_len, padding=pad, q_offset=start if static else None)
        tables = pe(pos, kv_len=kv_len, dtype=x.dtype, q_offset=start if static else None)
        outs.append(layer(x[:, start:stop], position_embeddings=tables, attention_mask=mask, past_key_values=cache))
        start = stop
    return torch.cat(outs, 1)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_decoding_with_cached_norms_equals_the_reference(dtype, static):
    g = torch.Generator().manual_seed(5)
    x = lift(torch.randn(2, 20, HIDDEN - 1, generator=g, dtype=torch.float64), k=1.0).to(dtype)
    padding = torch.ones(2, 20, dtype=torch.bool)
    padding[1, :3] = False

    def cache():
        return Cache(layers=[StaticLayer(24)]) if static else DynamicCache()

    fast_cache = cache()
    got = decode(make_layer("sdpa", dtype), x, fast_cache, prefill=6, padding=padding)
    want = decode(make_layer("eager", dtype), x, cache(), prefill=6, padding=padding)
    assert fast_cache.layers[0].values.shape[-1] == HEAD + 1 and fast_cache.layers[0].keys.shape[-1] == HEAD
    assert_close(got[padding], want[padding], rtol=1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_cache_holds_the_keys_space_parts_in_the_compute_dtype_and_their_times(autocast, monkeypatch):
    """Under autocast a prefill writes each key's space part in the compute dtype (what ``q·k`` reads) and its time
    coordinate, unrounded, beside the value; in fp32 the keys stay points (the compute dtype already): bit for bit
    the key the same forward attends to without a cache. The attention over them gives the forward's output."""
    x = lift(torch.randn(2, 9, HIDDEN - 1, generator=torch.Generator().manual_seed(3)), k=1.0)
    layer, seen = make_layer(), []
    real = layer.attend
    monkeypatch.setattr(layer, "attend", lambda q, key, value, **kw: seen.append(key) or real(q, key, value, **kw))
    pe = build_positional_encoding("hope", head_dim=HEAD - 1, num_heads=HEADS, max_position_embeddings=128)
    tables, mask = pe(torch.arange(9).expand(2, 9), kv_len=9), AttentionMask(2, 9, 9)
    cache = DynamicCache()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = layer(x, position_embeddings=tables, attention_mask=mask)
        got = layer(x, position_embeddings=tables, attention_mask=mask, past_key_values=cache)
    keys, values = cache.layers[0].keys, cache.layers[0].values
    if autocast:
        assert keys.dtype == torch.bfloat16 and keys.shape == (2, HEADS, 9, HEAD - 1) and values.shape[-1] == HEAD + 2
        assert torch.equal(keys, seen[0][..., 1:].to(keys.dtype)) and torch.equal(values[..., -1], seen[0][..., 0])
    else:
        assert torch.equal(keys, seen[0]) and values.shape[-1] == HEAD + 1
    assert_close(got, want, dtype=torch.bfloat16 if autocast else torch.float32)


def test_a_decode_step_does_not_recentre_the_cache(monkeypatch):
    layer, cache = make_layer(), DynamicCache()
    x = lift(torch.randn(1, 12, HIDDEN - 1), k=1.0)
    decode(layer, x[:, :11], cache, prefill=11)

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step re-centred the cached values")

    monkeypatch.setattr(attention_ops, "value_centres", refuse)
    pe = build_positional_encoding("hope", head_dim=HEAD - 1, num_heads=HEADS, max_position_embeddings=128)
    layer(x[:, 11:], position_embeddings=pe(torch.tensor([[11]]), kv_len=12), attention_mask=AttentionMask(1, 1, 12),
          past_key_values=cache)


@pytest.mark.parametrize("impl", ["auto", "eager"])
def test_a_half_precision_decode_step_reads_the_cached_norms_unless_eager_is_asked_for(impl, monkeypatch):
    """Under bf16 autocast ``auto`` falls back to eager (what sdpa runs there), which then reads the cache's norms as
    sdpa does; requested, eager (the reference) re-centres. The outputs agree."""
    x = lift(torch.randn(1, 12, HIDDEN - 1, generator=torch.Generator().manual_seed(2)), k=1.0)
    outputs = []
    for fallback in (False, True):
        layer, cache = make_layer("auto" if fallback else impl), DynamicCache()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            decode(layer, x[:, :11], cache, prefill=11)
            calls = []
            real = attention_ops.value_centres
            monkeypatch.setattr(attention_ops, "value_centres", lambda *a, **kw: calls.append(1) or real(*a, **kw))
            pe = build_positional_encoding("hope", head_dim=HEAD - 1, num_heads=HEADS, max_position_embeddings=128)
            outputs.append(layer(x[:, 11:], position_embeddings=pe(torch.tensor([[11]]), kv_len=12),
                                 attention_mask=AttentionMask(1, 1, 12), past_key_values=cache))
            monkeypatch.setattr(attention_ops, "value_centres", real)
        assert bool(calls) == (impl == "eager" and not fallback)
    assert_close(outputs[0].float(), outputs[1].float(), rtol=2e-2)


def test_training_mode_keeps_plain_values():
    """A training forward with a cache stays the reference's (per-document centres), outputs and gradients."""
    x = lift(torch.randn(2, 10, HIDDEN - 1), k=1.0)
    layer = make_layer().train()
    cache = DynamicCache()
    out = decode(layer, x, cache, prefill=10)
    assert cache.layers[0].values.shape[-1] == HEAD
    pe = build_positional_encoding("hope", head_dim=HEAD - 1, num_heads=HEADS, max_position_embeddings=128)
    tables = pe(torch.arange(10).expand(2, 10), kv_len=10)
    assert torch.equal(out, layer(x, position_embeddings=tables, attention_mask=AttentionMask(2, 10, 10)))
