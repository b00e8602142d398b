"""Attention layers (Eq. 3 self-attention and HMLA): impls agree, incremental decoding, packed rows, the HMLA cache."""

import pytest
import torch
from transformers import DynamicCache

import helm.nn.attention as attention_module
from helm.manifold import lift, manifold_error
from helm.nn import HMLA, POSITIONAL_ENCODINGS, LorentzSelfAttention, build_positional_encoding
from helm.ops import AttentionMask
from tests.helpers import MANIFOLD_TOL, assert_close

HIDDEN = 1 + 47
ATTENTION_KINDS = [name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.absolute]


def make_layer(kind, impl="sdpa", k=1.0):
    torch.manual_seed(0)
    if kind == "mha":
        layer = LorentzSelfAttention(HIDDEN, 3, 1 + 16, k=k, attn_impl=impl, layer_idx=0)
    else:
        layer = HMLA(HIDDEN, 3, kv_lora_rank=1 + 20, qk_nope_head_dim=1 + 8, qk_rope_head_dim=1 + 8,
                     v_head_dim=1 + 12, k=k, attn_impl=impl, layer_idx=0)
    with torch.no_grad():  # non-trivial projections (the default init is tiny)
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return layer


def encoding(kind, positional):
    """The model-level encoding for the layer's positional dims (MHA: 16 per head; HMLA: the 8 rope dims)."""
    return build_positional_encoding(positional, head_dim=16 if kind == "mha" else 8, num_heads=3,
                                     max_position_embeddings=128)


def run(layer, pe, x, pos, *, padding=None, segment_ids=None, cache=None):
    """One model-style call: tables and mask built once, as the models do, then the layer."""
    past = cache.get_seq_length() if cache is not None else 0
    B, T, _ = x.shape
    tables = pe(pos, kv_len=past + T)
    mask = AttentionMask(B, T, past + T, padding=padding, segment_ids=segment_ids)
    return layer(x, position_embeddings=tables, attention_mask=mask, past_key_values=cache)


def inputs(B=2, T=40, k=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return lift(torch.randn(B, T, HIDDEN - 1, generator=g), k=k)


@pytest.mark.parametrize("positional", ATTENTION_KINDS)
@pytest.mark.parametrize("kind", ["mha", "hmla"])
def test_layer_outputs_on_manifold_and_impls_agree(kind, positional):
    x = inputs()
    pos = torch.arange(40).expand(2, 40)
    outs = {}
    for impl in ("eager", "sdpa"):
        outs[impl] = run(make_layer(kind, impl), encoding(kind, positional), x, pos)
        assert manifold_error(outs[impl], 1.0).max() <= MANIFOLD_TOL[torch.float32]
    assert_close(outs["sdpa"], outs["eager"])


@pytest.mark.parametrize("positional", ATTENTION_KINDS)
@pytest.mark.parametrize("kind", ["mha", "hmla"])
def test_incremental_decoding_matches_full_forward_with_left_padding(kind, positional):
    """Prefill 4 tokens, then decode token by token for 36 steps; row 1 is left-padded by 5."""
    B, T = 2, 40
    layer, pe = make_layer(kind), encoding(kind, positional)
    x = inputs(B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    full = run(layer, pe, x, pos, padding=mask)
    cache = DynamicCache()
    steps = [run(layer, pe, x[:, :4], pos[:, :4], padding=mask[:, :4], cache=cache)]
    for t in range(4, T):
        steps.append(run(layer, pe, x[:, t:t + 1], pos[:, t:t + 1], padding=mask[:, :t + 1], cache=cache))
    inc = torch.cat(steps, dim=1)
    real = mask.bool()
    assert_close(inc[real], full[real], factor=10, msg="incremental vs full")
    assert cache.get_seq_length() == T


def test_hmla_cache_holds_only_latent_and_shared_rope_key(monkeypatch):
    """At the helm-mice-120m shapes (ambient 390, 6 heads, kv-latent 65, nope 33, rope 17, v 33) the cache holds
    c_KV [B, 1, T, 65] and k^R [B, 1, T, 17] per layer, nothing per head: measured against the per-head keys and
    values the layer actually attends with, it is more than 5.9x smaller."""
    layer = HMLA(390, 6, kv_lora_rank=65, qk_nope_head_dim=33, qk_rope_head_dim=17, v_head_dim=33, layer_idx=0)
    attended = {}
    real = attention_module.lorentz_attention

    def spy(q, key, value, **kw):
        attended["bytes"] = key.nbytes + value.nbytes
        attended["shapes"] = (tuple(key.shape), tuple(value.shape))
        return real(q, key, value, **kw)

    monkeypatch.setattr(attention_module, "lorentz_attention", spy)
    cache = DynamicCache()
    x = lift(torch.randn(2, 9, 389), k=1.0)
    pe = build_positional_encoding("hope", head_dim=16, num_heads=6, max_position_embeddings=2048)
    layer(x, position_embeddings=pe(torch.arange(9).expand(2, 9), kv_len=9), past_key_values=cache)
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert tuple(keys.shape) == (2, 1, 9, 65) and tuple(values.shape) == (2, 1, 9, 17)
    assert attended["shapes"] == ((2, 6, 9, 1 + 32 + 16), (2, 6, 9, 33))
    cache_bytes = keys.nbytes + values.nbytes
    assert attended["bytes"] / cache_bytes > 5.9, (attended["bytes"], cache_bytes)


def test_packed_documents_in_layers():
    layer, pe = make_layer("hmla"), encoding("hmla", "hope")
    x = inputs(1, 30)
    seg = torch.zeros(1, 30, dtype=torch.long)
    seg[:, 12:] = 1
    pos = torch.cat([torch.arange(12), torch.arange(18)]).unsqueeze(0)
    out = run(layer, pe, x, pos, segment_ids=seg)
    x2 = x.clone()
    x2[:, :12] = inputs(1, 12, seed=7)
    out2 = run(layer, pe, x2, pos, segment_ids=seg)
    assert torch.equal(out[:, 12:], out2[:, 12:])
    # the second document alone, from position 0, gives the same outputs (HoPE is relative)
    alone = run(layer, pe, x[:, 12:], torch.arange(18).unsqueeze(0))
    assert_close(alone, out[:, 12:], factor=10)


def test_without_tables_or_mask_the_layer_is_plain_causal_attention():
    """None means: no positional encoding, causal over the cache and the new tokens."""
    layer = make_layer("mha")
    x, pos = inputs(), torch.arange(40).expand(2, 40)
    plain = layer(x)
    assert torch.equal(plain, run(layer, encoding("mha", "none"), x, pos))
    assert not torch.equal(plain, run(layer, encoding("mha", "hope"), x, pos))


def test_temperature_gradient_and_positivity():
    layer = make_layer("mha")
    out = run(layer, encoding("mha", "hope"), inputs(), torch.arange(40).expand(2, 40))
    out.sum().backward()
    assert layer.log_tau.grad is not None and torch.isfinite(layer.log_tau.grad)
    with torch.no_grad():
        layer.log_tau.fill_(-50.0)
    assert layer.tau > 0


BAD = [
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, attn_impl="flash"), "attn_impl must be one of"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, tau_init=0.0), "tau_init"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 1), "head_dim"),
    (lambda: LorentzSelfAttention(1, 3, 17), "hidden_size"),
    (lambda: LorentzSelfAttention(HIDDEN, 0, 17), "num_heads"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, k=-1.0), "k must be a positive"),
    (lambda: HMLA(HIDDEN, 3, kv_lora_rank=21, qk_nope_head_dim=9, qk_rope_head_dim=1, v_head_dim=13),
     "qk_rope_head_dim"),
    (lambda: HMLA(HIDDEN, 3, kv_lora_rank=21, qk_nope_head_dim=9, qk_rope_head_dim=9, v_head_dim=13, tau_init=-1.0),
     "tau_init"),
    (lambda: HMLA(HIDDEN, 3, kv_lora_rank=1, qk_nope_head_dim=9, qk_rope_head_dim=9, v_head_dim=13),
     "kv_lora_rank"),
    (lambda: HMLA(HIDDEN, 3, kv_lora_rank=21, qk_nope_head_dim=9, qk_rope_head_dim=9, v_head_dim=13, q_lora_rank=1),
     "q_lora_rank"),
]


@pytest.mark.parametrize("make,match", BAD, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_layer_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_hmla_with_query_compression_runs():
    layer = HMLA(HIDDEN, 3, kv_lora_rank=21, q_lora_rank=25, qk_nope_head_dim=9, qk_rope_head_dim=9, v_head_dim=13)
    out = run(layer, encoding("hmla", "hope"), inputs(), torch.arange(40).expand(2, 40))
    assert manifold_error(out, 1.0).max() <= MANIFOLD_TOL[torch.float32]
