"""Issue 22, item 5: a training step (forward with labels, backward) of both families compiles as one graph
(``fullgraph=True``) under CPU bf16 autocast and gives eager's loss and gradients to bf16 rounding.

Two ways of running autocast, as users do:

* autocast inside the compiled region (``accelerate``'s way, which ``train.py`` uses: ``prepare`` wraps
  ``model.forward`` in autocast, so the compiled forward enters it and its backward runs outside it, as in eager);
* autocast around the compiled call. There torch's ``backward_pass_autocast = "same_as_forward"`` (the default up
  to at least torch 2.13) traces the backward under autocast too, so products the forward runs in fp32 (the
  attention's scores and values, autocast off inside ``helm.ops.attention``) get bf16 backward GEMMs that eager
  never runs (pytorch#153044, #179804; the log-temperature gradient of an attention layer comes out ~6x further
  from fp32 than eager's). ``backward_pass_autocast = "off"`` is eager's behaviour, and the test sets it.

Precision rule (flash-attention's): each gradient of the compiled bf16 step is no further from the fp32 eager
step's than twice the eager bf16 step's. Backend ``aot_eager``: dynamo and AOT autograd trace exactly the graphs
inductor compiles, without inductor's code generation (minutes per model on the 2-core CI machine).
"""

import pytest
import torch

from tests.helpers import RTOL, relative_error, tiny_model

# id -> tiny_model arguments; MiCE dispatches densely under compile (see test_compiled_training.py)
CASES = {
    "helm_d": dict(family="helm_d"),
    "helm_d-distance-head": dict(family="helm_d", lm_head_mode="distance"),
    "helm_d-plain-loss": dict(family="helm_d", fused_lm_loss=False),
    "helm_mice": dict(family="helm_mice", moe_dispatch="dense"),
}


def step(model, forward, autocast=True):
    """Loss and parameter gradients of one training step through ``forward``, under CPU bf16 autocast."""
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    documents = torch.tensor([[0] * 7 + [1] * 9, [0] * 16])
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = forward(input_ids=ids, labels=ids, segment_ids=documents, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_bf16_step(compiled, eager, fp32):
    (loss, grads), (loss_e, grads_e), (loss_32, grads_32) = compiled, eager, fp32
    assert loss.dtype == torch.float32 and relative_error(loss, loss_e) <= RTOL[torch.float32]
    assert relative_error(loss, loss_32) <= RTOL[torch.bfloat16]
    assert grads.keys() == grads_e.keys() == grads_32.keys()
    for name in grads:
        assert grads[name].dtype == grads_32[name].dtype, name
        bound = 2 * relative_error(grads_e[name], grads_32[name]) + RTOL[torch.float32]
        err = relative_error(grads[name], grads_32[name])
        assert err <= bound, f"{name}: {err:.2e} from fp32 > {bound:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_step_under_autocast_matches_eager(name):
    """Autocast around the compiled model (backward traced without autocast, as eager runs it)."""
    model = tiny_model(**CASES[name], train=True)
    fp32, eager = step(model, model, autocast=False), step(model, model)
    torch._dynamo.reset()
    with torch._functorch.config.patch(backward_pass_autocast="off"):  # read when the graphs are traced
        compiled = step(model, torch.compile(model, fullgraph=True, backend="aot_eager"))
    check_bf16_step(compiled, eager, fp32)


def test_compiled_step_with_autocast_inside_the_forward_matches_eager():
    """accelerate's mixed precision (train.py): autocast wraps ``model.forward``, the compiled region enters it,
    and torch's default backward tracing already matches eager."""
    model = tiny_model("helm_d", train=True)
    fp32, eager = step(model, model, autocast=False), step(model, model)
    plain_forward = model.forward
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(plain_forward)
    torch._dynamo.reset()
    try:
        compiled = step(model, torch.compile(model, fullgraph=True, backend="aot_eager"), autocast=False)
    finally:
        model.forward = plain_forward
    check_bf16_step(compiled, eager, fp32)
