"""Issue 13, item 1: sparse MiCE dispatch (each routed expert on its own tokens) equals the dense path on outputs
and on the gradients of the input and of every parameter."""

import os
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helm.manifold import lift, manifold_error
from helm.nn.mice import MiCE

aten = torch.ops.aten

CASES = [("shared-1", 1, (2, 37)), ("shared-0", 0, (3, 21)), ("shared-2", 2, (1, 63))]


def layer(n_shared, **kwargs):
    torch.manual_seed(0)
    mice = MiCE(1 + 16, 1 + 24, n_routed_experts=5, num_experts_per_tok=2, n_shared_experts=n_shared, k=0.7,
                routed_curvatures=[-0.2, -0.7, -1.0, -1.5, -2.0], **kwargs).double()
    with torch.no_grad():
        mice.gate.weight.normal_(0.0, 0.5)
        mice.e_score_correction_bias[4] = -10.0  # expert 4 is never selected: an empty slice
    return mice


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("case,n_shared,shape", CASES, ids=[c[0] for c in CASES])
def test_sparse_dispatch_equals_dense_on_outputs_and_gradients(case, n_shared, shape, scoring):
    mice = layer(n_shared, scoring_func=scoring, norm_topk_prob=scoring == "sigmoid")
    x0 = lift(torch.randn(*shape, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2, k=0.7)
    results = {}
    for mode in ("dense", "sparse"):
        mice.dispatch = mode
        mice.zero_grad()
        x = x0.clone().requires_grad_(True)
        out = mice.train()(x)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        results[mode] = (out.detach(), x.grad, {n: p.grad.clone() for n, p in mice.named_parameters()
                                               if p.grad is not None}, mice.last_expert_load.clone())
    (out_d, gx_d, gp_d, load_d), (out_s, gx_s, gp_s, load_s) = results["dense"], results["sparse"]
    assert load_d[4] == 0 and torch.equal(load_d, load_s)
    torch.testing.assert_close(out_s, out_d, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx_s, gx_d, rtol=1e-10, atol=1e-12)
    # the expert no token selected gets zero gradients both ways (DDP needs a gradient for every parameter)
    assert gp_d.keys() == gp_s.keys() and all(gp_s[n].abs().max() == 0 for n in gp_s if n.startswith("experts.4."))
    for name in gp_d:
        torch.testing.assert_close(gp_s[name], gp_d[name], rtol=1e-10, atol=1e-12, msg=name)
    assert manifold_error(out_s, 0.7).max() <= 1e-12


def test_only_an_explicit_sparse_dispatch_runs_sparse():
    """``auto`` (the default) is dense, which never reads the device; ``sparse`` is opted into, outside compile."""
    mice = layer(1)
    assert mice.dispatch == "auto" and not mice.sparse_dispatch()
    mice.dispatch = "sparse"
    assert mice.sparse_dispatch()
    with pytest.raises(ValueError, match="dispatch"):
        layer(1, dispatch="grouped")


class HostReads(TorchDispatchMode):
    """The aten ops that read a tensor's value on the host, made by helm/nn/mice.py itself (a bare layer also runs
    the manifold functions' input checks, which the model's forward skips: tests/test_host_sync.py counts those)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (aten._local_scalar_dense, aten.is_nonzero, aten.nonzero, aten.equal):
            self.record(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def record(self, op: str) -> None:
        helm = [f.filename for f in traceback.extract_stack() if f"{os.sep}helm{os.sep}" in f.filename]
        if helm and helm[-1].endswith(os.path.join("nn", "mice.py")):
            self.ops.append(op)


@pytest.mark.parametrize("shape", [(2, 70), (1, 1)], ids=["140-tokens", "decode-1-token"])
def test_sparse_dispatch_reads_the_device_once_per_forward_and_never_in_backward(shape, monkeypatch):
    """The per-expert counts (one ``tolist``, which skips aten on a CPU tensor) are the sparse path's one host read;
    the dense path has none."""
    mice = layer(1).train()
    x = lift(torch.randn(*shape, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)), k=0.7)
    tolist = torch.Tensor.tolist
    for mode, expected in (("dense", []), ("sparse", ["tolist"])):
        mice.dispatch = mode
        reads = HostReads()
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (reads.record("tolist"), tolist(t))[1])
        with reads:
            out = mice(x)
            forward = list(reads.ops)
            out.sum().backward()
        assert forward == expected and reads.ops == expected, mode


@pytest.mark.parametrize("shape", [(1, 1), (2, 3)], ids=["decode-1-token", "2x3-tokens"])
def test_no_grad_sparse_dispatch_runs_only_the_chosen_experts_and_equals_dense(shape):
    """Without autograd the sparse path runs the top-k experts some token chose (and the shared one), not all."""
    mice = layer(1).eval()
    x = lift(torch.randn(*shape, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2)), k=0.7)
    calls = []
    hooks = [e.register_forward_hook(lambda m, i, o, j=j: calls.append(j)) for j, e in enumerate(mice.experts)]
    with torch.no_grad():
        mice.dispatch = "dense"
        dense = mice(x)
        dense_calls, calls[:] = list(calls), []
        mice.dispatch = "sparse"
        sparse = mice(x)
    for h in hooks:
        h.remove()
    chosen = set(mice.route(x)[2].reshape(-1, 5).any(0).nonzero().flatten().tolist())
    assert dense_calls == list(range(5)) and set(calls) == chosen and 4 not in calls
    if shape == (1, 1):
        assert len(calls) == 2
    torch.testing.assert_close(sparse, dense, rtol=1e-12, atol=1e-12)


def test_expert_scales_from_one_vector_equal_each_experts_own_on_outputs_and_gradients(monkeypatch):
    """Under autograd the layer computes its routed experts' curvature scales from one vector of their ``log k``: the
    outputs and every gradient (the curvatures' included) equal those of each expert computing its own. Without
    autograd, or with a ``log_k`` on another device than the input (where an offload hook keeps it), each expert
    computes its own."""
    mice = layer(1)
    x0 = lift(torch.randn(2, 9, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 2, k=0.7)
    results = []
    for own in (False, True):
        if own:
            monkeypatch.setattr(mice, "expert_scales", lambda x: [None] * len(mice.experts))
        mice.zero_grad()
        x = x0.clone().requires_grad_(True)
        out = mice.train()(x)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        results.append((out.detach(), x.grad, {n: p.grad.clone() for n, p in mice.named_parameters()
                                               if p.grad is not None}))
    (out_v, gx_v, gp_v), (out_o, gx_o, gp_o) = results
    assert any(name.endswith("log_k") and gp_v[name].abs().max() > 0 for name in gp_v)
    torch.testing.assert_close(out_v, out_o, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gx_v, gx_o, rtol=1e-12, atol=1e-13)
    assert gp_v.keys() == gp_o.keys()
    for name in gp_v:
        torch.testing.assert_close(gp_v[name], gp_o[name], rtol=1e-12, atol=1e-13, msg=name)
    monkeypatch.undo()
    assert all(scales is not None for scales in mice.expert_scales(x0))
    with torch.no_grad():
        assert mice.expert_scales(x0) == [None] * 5
    flat = layer(1)
    flat.experts[0].log_k = torch.nn.Parameter(torch.empty(0, dtype=torch.float64))  # an FSDP1 rank's empty shard
    assert flat.expert_scales(x0) == [None] * 5
    mice.experts[2].to("meta")
    assert mice.expert_scales(x0) == [None] * 5
