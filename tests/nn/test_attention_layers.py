"""Attention layers (Eq. 3 self-attention and HMLA): impls agree, incremental decoding, packed rows, the HMLA cache."""

import math

import pytest
import torch
from transformers import DynamicCache, PreTrainedConfig

import helm.nn.attention as attention_module
from helm.manifold import lift, manifold_error
from helm.nn import HMLA, POSITIONAL_ENCODINGS, LorentzSelfAttention, build_positional_encoding
from helm.ops import AttentionMask
from tests import references
from tests.helpers import MANIFOLD_TOL, assert_close

HIDDEN = 1 + 47
ATTENTION_KINDS = [name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.absolute]


def chosen(impl):
    """A config that requests ``impl``, as a model's does (the layers read ``config._attn_implementation``)."""
    return PreTrainedConfig(attn_implementation=impl)


def make_layer(kind, impl="sdpa", k=1.0):
    torch.manual_seed(0)
    if kind == "mha":
        layer = LorentzSelfAttention(HIDDEN, 3, 1 + 16, k=k, config=chosen(impl), layer_idx=0)
    else:
        layer = HMLA(HIDDEN, 3, kv_lora_rank=1 + 20, qk_nope_head_dim=1 + 8, qk_rope_head_dim=1 + 8,
                     v_head_dim=1 + 12, k=k, config=chosen(impl), layer_idx=0)
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
    tables = pe(pos, kv_len=past + T, dtype=x.dtype)
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


@pytest.mark.parametrize("kind", ["mha", "hmla"])
def test_temperature_init_gradient_and_range(kind):
    """``τ = exp(log τ)`` starts at its documented value, ``sqrt(d)`` (MHA, head dim ``1+16``) or ``sqrt(d_n + d_r)``
    (HMLA, ``8 + 8``; paper Eq. 18), or at ``tau_init`` when given; it gets a non-zero finite gradient; and far
    below 1 it is still ``exp(log τ)`` (no clamp, no underflow to 0) with finite outputs."""
    layer = make_layer(kind)
    assert layer.tau.dtype == torch.float32 and layer.tau.item() == pytest.approx(4.0, rel=1e-6)
    dims = dict(kv_lora_rank=21, qk_nope_head_dim=1 + 10, qk_rope_head_dim=1 + 6, v_head_dim=13)
    assert HMLA(HIDDEN, 3, **dims).tau.item() == pytest.approx(4.0, rel=1e-6)  # sqrt(10 + 6), not sqrt(10)
    other = LorentzSelfAttention(HIDDEN, 3, 17, tau_init=2.5) if kind == "mha" else \
        HMLA(HIDDEN, 3, tau_init=2.5, **dims)
    assert other.tau.item() == pytest.approx(2.5, rel=1e-6)
    x, pos = inputs(), torch.arange(40).expand(2, 40)
    out = run(layer, encoding(kind, "hope"), x, pos)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    assert torch.isfinite(layer.log_tau.grad).all() and layer.log_tau.grad.abs().max() > 0
    with torch.no_grad():
        layer.log_tau.fill_(-50.0)
        assert layer.tau.item() == pytest.approx(math.exp(-50.0), rel=1e-6)
        assert torch.isfinite(run(layer, encoding(kind, "hope"), x, pos)).all()


BAD = [
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, tau_init=0.0), "tau_init"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 1), "head_dim"),
    (lambda: LorentzSelfAttention(1, 3, 17), "hidden_size"),
    (lambda: LorentzSelfAttention(HIDDEN, 0, 17), "num_heads"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, k=-1.0), "k must be"),
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


def rms_norm_reference(norm, u, k):
    """RMSNorm_L (paper Eq. 7) of the point ``lift(u)``: ``lift(g ⊙ u / sqrt(mean(u²) + eps))``."""
    return references.to_hyperboloid(norm.weight * u / (u.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt(), k)


def rotate_reference(x_s, tables):
    """HoPE (paper Eq. 4) from the encoding's angle tables ``cos, sin [B, T, d/2]``: each interleaved pair
    ``(x_2l, x_2l+1)`` of the space part ``[B, h, T, d]`` rotated by its angle, ``(x cos - y sin, x sin + y cos)``."""
    if tables.cos is None:
        return x_s
    cos, sin = tables.cos.double().unsqueeze(1), tables.sin.double().unsqueeze(1)
    x, y = x_s[..., 0::2], x_s[..., 1::2]
    return torch.stack([x * cos - y * sin, x * sin + y * cos], dim=-1).flatten(-2)


def hmla_reference(layer, x, tables):
    """HMLA (paper App. B.2, Eq. 13-19) from the layer's weights, causal, in fp64; an HLT is ``lift(W x + b)`` on the
    full vector, HCat concatenates space parts under one time coordinate.

    ``c^Q = RMSNorm_L(HLT_qa(x))`` when ``q_lora_rank > 0`` (else ``c^Q = x``); ``[q^C_h, q^R_h] = HLT_qb(c^Q)_s`` per
    head, ``q^R`` rotated by HoPE; ``c^KV = RMSNorm_L(HLT_kva(x))``; ``k^R = HoPE(HLT_kr(x))``, shared by the heads;
    ``[k^C_h, v^C_h] = HLT_kvb(c^KV)_s``; ``q_h = HCat(q^C_h, q^R_h)``, ``k_h = HCat(k^C_h, k^R)``; Eq. 3 with τ;
    ``out = HLT_o(HCat_h(o_h))``."""
    k, H, dn, dr, dv = layer.k, layer.num_heads, layer.dn, layer.dr, layer.dv
    B, T, _ = x.shape
    hlt = lambda lin, z: z @ lin.weight.T + lin.bias  # the space part of HLT(z)
    if layer.q_lora_rank:
        c_q = rms_norm_reference(layer.q_a_layernorm, hlt(layer.q_a_proj, x), k)
        q_all = hlt(layer.q_b_proj, c_q)
    else:
        q_all = hlt(layer.q_proj, x)
    q_all = q_all.view(B, T, H, dn + dr).transpose(1, 2)
    q = references.to_hyperboloid(torch.cat([q_all[..., :dn], rotate_reference(q_all[..., dn:], tables)], -1), k)
    c_kv = rms_norm_reference(layer.kv_a_layernorm, hlt(layer.kv_a_proj, x), k)
    k_rope = rotate_reference(hlt(layer.k_rope_proj, x).unsqueeze(1), tables).expand(B, H, T, dr)
    kv = hlt(layer.kv_b_proj, c_kv).view(B, T, H, dn + dv).transpose(1, 2)
    key = references.to_hyperboloid(torch.cat([kv[..., :dn], k_rope], -1), k)
    value = references.to_hyperboloid(kv[..., dn:], k)
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    o = references.lorentz_attention(q, key, value, k, layer.tau.double(), causal)
    merged = references.to_hyperboloid(o[..., 1:].transpose(1, 2).reshape(B, T, H * dv), k)
    return references.to_hyperboloid(hlt(layer.o_proj, merged), k)


@pytest.mark.parametrize("positional", ["none", "hope"])
@pytest.mark.parametrize("q_lora_rank", [0, 25], ids=["no-query-latent", "query-latent"])
def test_hmla_matches_reference_from_its_weights(q_lora_rank, positional):
    """HMLA, with and without the query latent ``c^Q`` (``q_lora_rank > 0``), equals :func:`hmla_reference` in fp64,
    at k = 0.6 with non-trivial RMSNorm gains and biases."""
    torch.manual_seed(0)
    layer = HMLA(HIDDEN, 3, kv_lora_rank=1 + 20, q_lora_rank=q_lora_rank, qk_nope_head_dim=1 + 8,
                 qk_rope_head_dim=1 + 8, v_head_dim=1 + 12, k=0.6, config=chosen("eager")).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name != "log_tau":
                p.normal_(1.0 if name.endswith("layernorm.weight") else 0.0, 0.2)
        layer.log_tau.fill_(math.log(2.3))
    x = references.to_hyperboloid(torch.randn(2, 23, HIDDEN - 1, generator=torch.Generator().manual_seed(1),
                                              dtype=torch.float64), 0.6)
    pos = torch.arange(23).expand(2, 23)
    tables = encoding("hmla", positional)(pos, kv_len=23, dtype=torch.float64)
    assert tables.bias is None and tables.alibi_slopes is None and tables.logit_scale == 1.0
    assert (tables.cos is None) == (positional == "none")
    with torch.no_grad():
        out = run(layer, encoding("hmla", positional), x, pos)
        assert_close(out, hmla_reference(layer, x, tables), rtol=1e-10)
