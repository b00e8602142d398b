"""Issue 13, items 4-5: a training step (forward with labels, backward) of both families compiles as one graph
(``fullgraph=True``: a graph break is an error) and gives eager's loss, balance loss, expert loads and gradients,
also with gradient checkpointing. Packed rows (document ids) as ``train.py`` feeds them.

The backend is ``aot_eager``: dynamo and AOT autograd trace exactly the graphs inductor compiles, without
inductor's code generation (about a minute per tiny model on the 2-core CI machine); one inductor test checks
the generated kernels' numerics on the MiCE model (HMLA + a MiCE layer).
"""

import pytest
import torch

from helm.nn.mice import MiCE
from tests.helpers import assert_close, tiny_model

# id -> tiny_model arguments. MiCE under compile always dispatches densely (the sparse path slices tokens by
# expert: data-dependent shapes), so "sparse" compares compiled-dense against eager-sparse.
CASES = {"helm_d": dict(family="helm_d"), "helm_mice-dense": dict(family="helm_mice", moe_dispatch="dense"),
         "helm_mice-sparse": dict(family="helm_mice", moe_dispatch="sparse")}


def step(model, forward):
    """Loss, balance loss, expert loads and gradients of one training step through ``forward``."""
    ids = torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    documents = torch.tensor([[0] * 7 + [1] * 9, [0] * 16])
    model.zero_grad(set_to_none=True)
    out = forward(input_ids=ids, labels=ids, segment_ids=documents, use_cache=False)
    out.loss.backward()
    loads = [m.last_expert_load.clone() for m in model.modules() if isinstance(m, MiCE)]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), getattr(out, "aux_loss", None), loads, grads


def check_same_step(got, expected, rtol):
    (loss, aux, loads, grads), (loss_e, aux_e, loads_e, grads_e) = got, expected
    assert_close(loss, loss_e, rtol=rtol)
    assert (aux is None) == (aux_e is None) and (aux is None or torch.allclose(aux, aux_e, rtol=rtol))
    assert len(loads) == len(loads_e) and all(torch.equal(a, b) for a, b in zip(loads, loads_e))
    assert grads.keys() == grads_e.keys()
    for name in grads_e:
        assert_close(grads[name], grads_e[name], rtol=rtol, msg=name)


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")  # transformers' new name
@pytest.mark.parametrize("name, checkpointing", [(name, False) for name in CASES] + [
    ("helm_d", True), ("helm_mice-dense", True)])
def test_compiled_training_step_is_one_graph_and_matches_eager(name, checkpointing):
    model = tiny_model(**CASES[name], train=True)
    assert model._can_compile_fullgraph
    if checkpointing:
        model.gradient_checkpointing_enable()
    expected = step(model, model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    if checkpointing:  # as train.py does: scoped to the compiled calls, no process-wide flag (test_lane.py)
        compiled = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)(compiled)
    got = step(model, compiled)
    # exact up to rounding; the sparse case sums the experts in another order (eager sparse, compiled dense)
    check_same_step(got, expected, rtol=1e-5 if name != "helm_mice-sparse" else 1e-4)


def test_inductor_compiled_training_step_matches_eager():
    """Inductor's fused kernels for a MiCE training step (one layer: HMLA + MiCE) give eager's loss and
    gradients to fp32 rounding."""
    model = tiny_model(**CASES["helm_mice-dense"], train=True, num_hidden_layers=1, first_k_dense_replace=0)
    expected = step(model, model)
    torch._dynamo.reset()
    got = step(model, torch.compile(model, fullgraph=True))
    check_same_step(got, expected, rtol=1e-4)
