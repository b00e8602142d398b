import pytest
import torch
from transformers import DynamicCache

from helm.manifold import lift, manifold_error
from helm.nn import ATTENTION_POSITIONALS, HMLA, LorentzSelfAttention

HIDDEN = 1 + 47


def make_layer(kind, positional="hope", impl="sdpa", k=1.0):
    torch.manual_seed(0)
    if kind == "mha":
        layer = LorentzSelfAttention(HIDDEN, 3, 1 + 16, k=k, positional=positional, attn_impl=impl, layer_idx=0)
    else:
        layer = HMLA(HIDDEN, 3, kv_lora_rank=1 + 20, qk_nope_head_dim=1 + 8, qk_rope_head_dim=1 + 8,
                     v_head_dim=1 + 12, k=k, positional=positional, attn_impl=impl, layer_idx=0)
    with torch.no_grad():  # non-trivial projections (the default init is tiny)
        for p in layer.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return layer


def inputs(B=2, T=40, k=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    return lift(torch.randn(B, T, HIDDEN - 1, generator=g), k=k)


@pytest.mark.parametrize("positional", ATTENTION_POSITIONALS)
@pytest.mark.parametrize("kind", ["mha", "hmla"])
def test_layer_outputs_on_manifold_and_impls_agree(kind, positional):
    x = inputs()
    pos = torch.arange(40).expand(2, 40)
    outs = {}
    for impl in ("eager", "sdpa"):
        layer = make_layer(kind, positional, impl)
        outs[impl] = layer(x, position_ids=pos)
        assert manifold_error(outs[impl], 1.0).max() <= 1e-5
    assert torch.allclose(outs["eager"], outs["sdpa"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positional", ATTENTION_POSITIONALS)
@pytest.mark.parametrize("kind", ["mha", "hmla"])
def test_incremental_decoding_matches_full_forward_with_left_padding(kind, positional):
    """Prefill 4 tokens, then decode token by token for 36 steps; row 1 is left-padded by 5."""
    B, T = 2, 40
    layer = make_layer(kind, positional)
    x = inputs(B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    full = layer(x, position_ids=pos, attention_mask=mask)
    cache = DynamicCache()
    steps = [layer(x[:, :4], position_ids=pos[:, :4], attention_mask=mask[:, :4], past_key_values=cache)]
    for t in range(4, T):
        steps.append(layer(x[:, t:t + 1], position_ids=pos[:, t:t + 1], attention_mask=mask[:, :t + 1],
                           past_key_values=cache))
    inc = torch.cat(steps, dim=1)
    real = mask.bool()
    assert (inc - full).abs()[real].max() <= 1e-4
    assert cache.get_seq_length() == T


def test_hmla_cache_holds_only_latent_and_shared_rope_key(capsys):
    """The cache of HMLA stores c_KV [B, 1, T, 1+n_kv] and k^R [B, 1, T, 1+d_r] per layer, nothing per head.

    Also reports the cache bytes per token per layer at the helm-mice-120m shapes (ambient 390, 6 heads,
    kv-latent 65, nope 33, rope 17, v 33) next to full per-head caching of keys and values.
    """
    layer = HMLA(390, 6, kv_lora_rank=65, qk_nope_head_dim=33, qk_rope_head_dim=17, v_head_dim=33, layer_idx=0)
    cache = DynamicCache()
    x = inputs(2, 9, seed=3)
    x = lift(torch.randn(2, 9, 389), k=1.0)
    layer(x, position_ids=torch.arange(9).expand(2, 9), past_key_values=cache)
    keys, values = cache.layers[0].keys, cache.layers[0].values
    assert tuple(keys.shape) == (2, 1, 9, 65) and tuple(values.shape) == (2, 1, 9, 17)
    latent_bytes = (keys[0, 0, 0].numel() + values[0, 0, 0].numel()) * keys.element_size()
    # what caching the reconstructed per-head keys [1 + 32 + 16] and values [1 + 32] would take
    full_bytes = 6 * ((1 + 32 + 16) + 33) * keys.element_size()
    print(f"HMLA cache per token per layer: {latent_bytes} B (latent 65 + rope key 17) vs {full_bytes} B "
          f"for full-head caching ({full_bytes / latent_bytes:.1f}x)")
    assert latent_bytes == (65 + 17) * 4
    assert full_bytes / latent_bytes > 5.9
    assert "HMLA cache per token" in capsys.readouterr().out


def test_packed_documents_in_layers():
    layer = make_layer("hmla")
    x = inputs(1, 30)
    seg = torch.zeros(1, 30, dtype=torch.long)
    seg[:, 12:] = 1
    pos = torch.cat([torch.arange(12), torch.arange(18)]).unsqueeze(0)
    out = layer(x, position_ids=pos, segment_ids=seg)
    x2 = x.clone()
    x2[:, :12] = inputs(1, 12, seed=7)
    out2 = layer(x2, position_ids=pos, segment_ids=seg)
    assert torch.equal(out[:, 12:], out2[:, 12:])
    # the second document alone, from position 0, gives the same outputs (HoPE is relative)
    alone = layer(x[:, 12:], position_ids=torch.arange(18).unsqueeze(0))
    assert torch.allclose(alone, out[:, 12:], atol=1e-5)


def test_temperature_gradient_and_positivity():
    layer = make_layer("mha")
    out = layer(inputs(), position_ids=torch.arange(40).expand(2, 40))
    out.sum().backward()
    assert layer.log_tau.grad is not None and torch.isfinite(layer.log_tau.grad)
    with torch.no_grad():
        layer.log_tau.fill_(-50.0)
    assert layer.tau > 0


BAD = [
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, positional="rope9"), "positional must be one of"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, positional="learned"), "positional must be one of"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, attn_impl="flash"), "attn_impl must be one of"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 17, tau_init=0.0), "tau_init"),
    (lambda: LorentzSelfAttention(HIDDEN, 3, 1 + 15), "head_dim"),
    (lambda: LorentzSelfAttention(HIDDEN, 0, 17), "num_heads"),
    (lambda: HMLA(HIDDEN, 3, kv_lora_rank=21, qk_nope_head_dim=9, qk_rope_head_dim=1 + 7, v_head_dim=13),
     "qk_rope_head_dim must be 1 \\+ an even"),
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
    out = layer(inputs(), position_ids=torch.arange(40).expand(2, 40))
    assert manifold_error(out, 1.0).max() <= 1e-5
