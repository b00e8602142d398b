"""A full HELM-D model trained with the Triton kernel (interpreter on CPU) follows the sdpa losses."""

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

import helm
from tests.test_precision import recorded_step


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


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_training_step_with_the_kernel_runs_nothing_in_fp64(lk, autocast):
    """The kernel's preparation has no fp64 op (``e_j`` is computed inside the kernels): over one training step of
    HELM-D with ``attn_implementation="triton"``, no aten op outside the kernels touches an fp64 tensor
    (``tests/test_precision.py``'s check, here with the kernel)."""
    _, _, rec = recorded_step("helm_d", autocast=autocast, model_kwargs={"attn_implementation": "triton"})
    assert any(op[0] == "lorentz_attention_fwd" for op in rec.ops), "the kernel did not run"
    fp64 = Counter(op[0] for op in rec.ops if torch.float64 in rec.dtypes(op))
    assert not fp64, f"ops on fp64 tensors: {dict(fp64)}"
