"""A full HELM-D model trained with the Triton kernel (interpreter on CPU) follows the sdpa losses."""

import torch
from transformers import AutoModelForCausalLM

import helm


def _train(impl, state, ids, steps):
    cfg = helm.load_config("tiny-helm-d", num_hidden_layers=1, hidden_size=33, num_attention_heads=2, head_dim=17,
                           intermediate_size=65, vocab_size=64, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_tiny_helm_d_trains_identically_with_triton_and_sdpa(lk, monkeypatch):
    from helm.ops import attention

    calls = []
    kernel = attention.ATTENTION_FUNCTIONS["triton"]
    monkeypatch.setitem(attention.ATTENTION_FUNCTIONS, "triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    torch.manual_seed(0)
    cfg = helm.load_config("tiny-helm-d", num_hidden_layers=1, hidden_size=33, num_attention_heads=2, head_dim=17,
                           intermediate_size=65, vocab_size=64, max_position_embeddings=64)
    state = AutoModelForCausalLM.from_config(cfg).state_dict()
    ids = torch.randint(0, 64, (2, 48))
    sdpa = _train("sdpa", state, ids, 20)
    triton = _train("triton", state, ids, 20)
    assert len(calls) == 20  # one attention layer, one call per step: the kernel really ran
    assert sdpa[-1] < sdpa[0] - 0.5  # it actually learns
    assert max(abs(a - b) for a, b in zip(sdpa, triton)) <= 1e-4, (sdpa, triton)
