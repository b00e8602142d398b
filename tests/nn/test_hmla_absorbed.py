"""Absorbed HMLA decoding (issue 13 item 3): the key up-projection absorbed into the query, the value up-projection
applied after the weighted sum, the per-head time coordinates (and centred value norms) cached beside c_KV. It must
give what the plain path gives (re-expanding the whole cache with kv_b_proj every step) to fp32 rounding."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import Cache, StaticLayer

from helm.manifold import lift
from helm.nn import HMLA, build_positional_encoding
from helm.nn.hmla import _pack, _unpack
from helm.ops import AttentionMask
from tests.helpers import assert_close, relative_error, tiny_config

HIDDEN, HEADS, LATENT = 1 + 47, 3, 1 + 20


def make_layer(absorb, dtype=torch.float32, value_offset=0.0):
    torch.manual_seed(0)
    layer = HMLA(HIDDEN, HEADS, kv_lora_rank=LATENT, qk_nope_head_dim=1 + 8, qk_rope_head_dim=1 + 8,
                 v_head_dim=1 + 12, layer_idx=0, absorb=absorb)
    with torch.no_grad():  # non-trivial projections (the default init is tiny)
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
        if value_offset:  # values clustered far from the origin: a large common bias on every v^C_h
            layer.kv_b_proj.bias.view(HEADS, 8 + 12)[:, 8:] += value_offset
    return layer.to(dtype).eval()  # in training mode the layer never absorbs (see the test at the end)


def decode(layer, x, *, prefill, cache, padding=None, positional="hope", start=0):
    """Prefill ``x[:, start:prefill]`` (``start``: the tokens already in ``cache``) then feed the rest one token at a
    time; returns every output, concatenated."""
    B, T, _ = x.shape
    pe = build_positional_encoding(positional, head_dim=8, num_heads=HEADS, max_position_embeddings=128)
    outs = []
    for stop in [prefill, *range(prefill + 1, T + 1)]:
        static = isinstance(cache.layers[0] if cache.layers else None, StaticLayer)
        kv_len = cache.layers[0].max_cache_len if static else stop
        q_offset = start if static else None
        pad = None
        if padding is not None:
            pad = torch.zeros(B, kv_len, dtype=torch.bool)
            pad[:, :stop] = padding[:, :stop]
        pos = (torch.arange(start, stop) - (~padding).sum(1, keepdim=True) if padding is not None
               else torch.arange(start, stop).expand(B, -1)).clamp_min(0)
        tables = pe(pos, kv_len=kv_len, dtype=x.dtype, q_offset=q_offset)
        mask = AttentionMask(B, stop - start, kv_len, padding=pad, q_offset=q_offset)
        outs.append(layer(x[:, start:stop], position_embeddings=tables, attention_mask=mask, past_key_values=cache))
        start = stop
    return torch.cat(outs, dim=1)


def inputs(B=2, T=24, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return lift(torch.randn(B, T, HIDDEN - 1, generator=g, dtype=torch.float64), k=1.0).to(dtype)


@pytest.mark.parametrize("positional", ["hope", "hope_boost", "alibi", "rope3d", "none"])
@pytest.mark.parametrize("prefill", [3, 20])  # 20 > absorb_max_query (19): the plain prefill writes the scalars
def test_absorbed_layer_equals_plain_in_float64(positional, prefill):
    absorbed, plain = make_layer(True, torch.float64), make_layer(False, torch.float64)
    assert prefill > absorbed.absorb_max_query or prefill == 3
    x = inputs(dtype=torch.float64)
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, :2] = False  # left padding
    got = decode(absorbed, x, prefill=prefill, cache=DynamicCache(), padding=padding, positional=positional)
    want = decode(plain, x, prefill=prefill, cache=DynamicCache(), padding=padding, positional=positional)
    assert_close(got[padding], want[padding], rtol=1e-12)


def static_cache(max_len=32):
    """A one-layer cache of transformers' static layers (what StaticCache builds from a model config)."""
    return Cache(layers=[StaticLayer(max_len)])


@pytest.mark.parametrize("static", [False, True])
def test_absorbed_layer_equals_plain_in_float32(static):
    x = inputs()
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[0, :4] = False
    got = decode(make_layer(True), x, prefill=5, cache=static_cache() if static else DynamicCache(), padding=padding)
    want = decode(make_layer(False), x, prefill=5, cache=static_cache() if static else DynamicCache(),
                  padding=padding)
    assert_close(got[padding], want[padding], rtol=1e-5)


@pytest.mark.parametrize("offset", [1e3, 1e4])
def test_far_from_the_origin_absorbed_is_as_precise_as_plain(offset):
    """Values clustered at |v_s| ~ offset: the centred normalisation, with the centred values taken from latent
    differences, keeps the absorbed fp32 path at fp32 rounding of the fp64 result (the plain fp32 path loses ~1e-5
    at 1e3, ~1e-4 at 1e4: its values are rounded at their norm before they are centred)."""
    x = inputs()
    exact = decode(make_layer(False, torch.float64, offset), x.double(), prefill=4, cache=DynamicCache())
    plain = decode(make_layer(False, torch.float32, offset), x, prefill=4, cache=DynamicCache())
    absorbed = decode(make_layer(True, torch.float32, offset), x, prefill=4, cache=DynamicCache())
    plain_err, absorbed_err = relative_error(plain, exact), relative_error(absorbed, exact)
    assert absorbed_err <= min(plain_err, 1e-6), (absorbed_err, plain_err)


def test_decode_step_never_expands_the_cache(monkeypatch):
    """kv_b_proj sees only the new token and the first key's latent (the value centre) in an absorbed step."""
    layer, x = make_layer(True), inputs()
    cache = DynamicCache()
    decode(layer, x[:, :20], prefill=20, cache=cache)
    rows = []
    layer.kv_b_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    decode(layer, x, prefill=21, cache=cache, start=20)
    assert rows and max(rows) == 1, rows


def test_cache_layout_keeps_the_latent_and_the_length():
    absorbed, plain = make_layer(True), make_layer(False)
    x = inputs()
    caches = DynamicCache(), DynamicCache()
    decode(absorbed, x, prefill=6, cache=caches[0])
    decode(plain, x, prefill=6, cache=caches[1])
    got, want = caches[0].layers[0], caches[1].layers[0]
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 24
    assert got.keys.shape[-1] == LATENT + 3 * HEADS
    assert torch.equal(got.keys[..., :LATENT], want.keys) and torch.equal(got.values, want.values)
    # the cached scalars: k_t of HCat(k^C, k^R) as the plain path lifts it, and for the values centred on the first
    # key's value c, u = v_t - c_t and e = <v - c, v - c>_L, per head
    kv = absorbed._kv_heads(want.keys)
    k_s = torch.cat([kv[..., :8], want.values[..., 1:].expand(-1, HEADS, -1, -1)], -1)
    scalars = got.keys[..., LATENT:].unflatten(-1, (3, HEADS)).permute(0, 4, 2, 3, 1).squeeze(-1)  # [B, H, T, 3]
    assert_close(scalars[..., 0], lift(k_s, k=1.0)[..., 0])
    v = lift(kv[..., 8:].double(), k=1.0)
    w = v - v[:, :, :1]
    assert_close(scalars[..., 1].double(), w[..., 0], rtol=1e-5)
    assert_close(scalars[..., 2].double(), -w[..., 0] ** 2 + w[..., 1:].pow(2).sum(-1), rtol=1e-5)


def test_a_plain_cache_is_read_by_the_plain_path():
    """A cache written without the scalars (absorb off) keeps its layout when the layer is switched to absorb."""
    x = inputs()
    cache = DynamicCache()
    plain = make_layer(False)
    decode(plain, x[:, :8], prefill=8, cache=cache)
    switched = copy.deepcopy(plain)
    switched.absorb = True
    out = decode(switched, x[:, :9], prefill=9, cache=cache, start=8)
    assert cache.layers[0].keys.shape[-1] == LATENT and out.shape == (2, 1, HIDDEN)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_scalars_are_stored_exactly_in_any_cache_dtype(dtype):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scalars = torch.randn(2, 1, 5, 9, dtype=acc) * 1e3
    columns = _pack(scalars, dtype)
    assert columns.dtype == dtype
    stored = torch.cat([torch.zeros(2, 1, 5, 3, dtype=dtype), columns], -1)  # beside the latent, as cached
    assert torch.equal(_unpack(stored[..., 3:], acc), scalars)


def _model(absorb, **fields):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("helm_mice", hmla_absorb=absorb, **fields)).eval()


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("positional", ["hope", "hope_boost", "alibi"])
def test_generate_absorbed_equals_plain(positional, cache):
    """20 greedy steps of a left-padded batch: the same tokens, logits within fp32 rounding."""
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    runs = []
    for absorb in (False, True):
        runs.append(_model(absorb, positional=positional).generate(
            ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
            cache_implementation="static" if cache == "static" else None))
    plain, absorbed = runs
    assert torch.equal(absorbed.sequences, plain.sequences)
    assert_close(torch.stack(absorbed.logits), torch.stack(plain.logits), rtol=1e-5)
    layer = absorbed.past_key_values.layers[0]
    cfg = _model(True).config
    assert layer.keys.shape[-1] == cfg.kv_lora_rank + 3 * cfg.num_attention_heads


@pytest.mark.parametrize("fields", [{"q_lora_rank": 9, "head_merge": "flatten"}, {"positional": "rope3d"},
                                    {"positional": "learned"}, {"curvature": -0.5}])
def test_generate_absorbed_equals_plain_with_other_settings(fields):
    ids = torch.randint(3, 512, (2, 6), generator=torch.Generator().manual_seed(2))
    runs = [_model(absorb, **fields).generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                                              output_logits=True, return_dict_in_generate=True)
            for absorb in (False, True)]
    assert torch.equal(runs[1].sequences, runs[0].sequences)
    assert_close(torch.stack(runs[1].logits), torch.stack(runs[0].logits), rtol=1e-5)


def test_long_prompt_prefills_plainly_then_decodes_absorbed():
    model, plain = _model(True), _model(False)
    ids = torch.randint(3, 512, (1, 60), generator=torch.Generator().manual_seed(1))
    assert 60 > model.model.layers[0].self_attn.absorb_max_query
    got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True)
    want = plain.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5)


def test_training_mode_keeps_the_plain_path_and_its_gradients():
    """A training forward with a cache (train.py leaves use_cache on) is bit for bit the plain layer's, gradients too."""
    x = inputs()
    grads = []
    for absorb in (False, True):
        layer = make_layer(absorb).train()
        cache = DynamicCache()
        out = decode(layer, x, prefill=24, cache=cache)
        out.square().sum().backward()
        assert cache.layers[0].keys.shape[-1] == LATENT
        grads.append((out, [p.grad for p in layer.parameters()]))
    (out0, g0), (out1, g1) = grads
    assert torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
