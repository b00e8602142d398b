"""Issue 22, items 2 and 5: the fused LM-head loss under autocast runs its GEMMs in the compute dtype (bf16/fp16,
fp32 accumulation inside the GEMM) and keeps statistics, time coordinates and the summed weight gradient in fp32.

Precision is held to flash-attention's rule: under bf16 autocast the fused loss and gradients are no further from
the fp64 values than twice the plain path's (the same head under the same autocast, cross-entropy of its logits),
so the fused path adds no error of its own beyond bf16 rounding. A ``TorchDispatchMode`` checks the dtypes of every
matrix product, and ``torch.compile(fullgraph=True)`` traces the op under autocast (no autocast query inside the
``autograd.Function``).
"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helm.manifold import lift
from helm.nn.head import LorentzLMHead
from tests.helpers import RTOL, relative_error

D, V, T, CHUNK = 33, 257, 63, 7  # rows 2·63 = 126 = 18 chunks of 7; no two sizes alike, so shapes name operands
MODES = ["linear", "distance"]
GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul"}
GEMVS = {"mv", "addmv", "dot", "vdot", "addr"}


def head_and_points(mode, far=False):
    """An fp32 head with a bias (and τ = 1.3 in distance mode), points ``[2, T, D]`` (space parts ×8 when ``far``:
    time coordinates ~ 45) and targets with ignored positions."""
    torch.manual_seed(0)
    head = LorentzLMHead(D, V, k=0.5, mode=mode, bias=True, tau=1.3)
    with torch.no_grad():
        head.bias.normal_()
    g = torch.Generator().manual_seed(1)
    x = lift(torch.randn(2, T, D - 1, generator=g, dtype=torch.float64) * (8 if far else 1), k=0.5)
    t = torch.randint(0, V, (2, T), generator=g)
    t[:, -1] = -100
    t[0, :4] = -100
    return head, x, t


def loss_and_grads(head, x, t, *, fused, autocast=None, **kwargs):
    """Summed loss and the gradients of ``x`` and every head parameter; the plain path is cross-entropy of the
    head's logits (upcast inside ``cross_entropy`` under CPU autocast, as transformers' loss does)."""
    x = x.detach().to(head.weight.dtype).requires_grad_()
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        if fused:
            loss = head(x, targets=t, **kwargs)
        else:
            loss = torch.nn.functional.cross_entropy(head(x).flatten(0, 1), t.flatten(), reduction="sum")
    return (loss, *torch.autograd.grad(loss, [x, *head.parameters()]))


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
@pytest.mark.parametrize("mode", MODES)
def test_fused_loss_under_bf16_autocast_is_as_close_as_the_plain_path(mode, far):
    """Loss and gradients (x, weight, bias, log τ) of the fused path under bf16 autocast: dtypes those of the fp32
    inputs, within bf16 tolerance of the plain path under the same autocast, and no further from the fp64 values
    (and from the fp32 fused result) than twice the plain bf16 path's error, for the default chunk and 7 rows."""
    head, x, t = head_and_points(mode, far)
    names = ["loss", "x", *(n for n, _ in head.named_parameters())]
    exact = loss_and_grads(copy.deepcopy(head).double(), x, t, fused=False)
    fp32 = loss_and_grads(head, x, t, fused=True, chunk_size=CHUNK)
    plain = loss_and_grads(head, x, t, fused=False, autocast=torch.bfloat16)
    for chunk in (CHUNK, None):
        fused = loss_and_grads(head, x, t, fused=True, autocast=torch.bfloat16, chunk_size=chunk)
        assert [a.dtype for a in fused] == [torch.float32] * len(names)
        for name, a, p, e, f in zip(names, fused, plain, exact, fp32):
            bound = 2 * relative_error(p, e) + 1e-5  # + fp32 rounding, for the terms bf16 leaves exact
            msg = f"{name} (chunk {chunk})"
            assert relative_error(a, p) <= RTOL[torch.bfloat16], msg
            assert relative_error(a, e) <= bound, f"{msg}: {relative_error(a, e):.2e} > {bound:.2e}"
            assert relative_error(a, f) <= bound, f"{msg} vs fp32 fused: {relative_error(a, f):.2e} > {bound:.2e}"


class MatmulDtypes(TorchDispatchMode):
    """Records ``(op, input dtypes, input shapes)`` of every matrix product and the names of ops touching fp64."""

    def __init__(self):
        super().__init__()
        self.products, self.fp64 = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if name in GEMMS | GEMVS:
            self.products.append((name, tuple(a.dtype for a in tensors), tuple(tuple(a.shape) for a in tensors)))
        results = out if isinstance(out, (tuple, list)) else (out,)
        if any(a.dtype == torch.float64 for a in (*tensors, *results) if isinstance(a, torch.Tensor)):
            self.fp64.append(name)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", MODES)
def test_every_gemm_of_the_fused_loss_runs_in_the_autocast_dtype(mode, dtype):
    """Forward + backward of the fused loss under autocast: three GEMMs per chunk (logits, dL/dx, dL/dW, none
    recomputed), all in the autocast dtype; in distance mode they see only the space coordinates (D - 1 wide) and
    the time coordinates' products are fp32 (a rank-1 update in the logits, two matrix-vector products per chunk
    for the gradients); nothing runs in fp64."""
    head, x, t = head_and_points(mode)
    x = x.float().requires_grad_()
    with MatmulDtypes() as rec:
        with torch.autocast("cpu", dtype=dtype):
            loss = head(x, targets=t, chunk_size=CHUNK)
        loss.backward()
    chunks = -(-x.shape[0] * x.shape[1] // CHUNK)
    gemms = [p for p in rec.products if p[0] in GEMMS]
    gemvs = [p for p in rec.products if p[0] in GEMVS]
    assert len(gemms) == 3 * chunks, gemms
    assert all(set(dtypes) == {dtype} for _, dtypes, _ in gemms), gemms
    assert rec.fp64 == []
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in head.parameters())
    if mode == "linear":
        assert gemvs == []
    else:
        assert all(D not in shape for _, _, shapes in gemms for shape in shapes), gemms
        assert len(gemvs) == 2 * chunks and all(set(dtypes) == {torch.float32} for _, dtypes, _ in gemvs), gemvs


@pytest.mark.parametrize("mode", MODES)
def test_a_bf16_head_runs_logits_and_fused_loss_in_the_weights_dtype(mode):
    """Without autocast the compute dtype is the weights' (helm.precision.compute_dtype): a head cast to bf16 takes
    the fp32 points between layers and runs the GEMMs of its logits and of its fused loss in bf16 alike."""
    head, x, t = head_and_points(mode)
    head, x = head.bfloat16(), x.float()
    with MatmulDtypes() as rec:
        head(x)
        head(x, targets=t, chunk_size=CHUNK)
    gemms = [p for p in rec.products if p[0] in GEMMS]
    assert gemms and all(set(dtypes) == {torch.bfloat16} for _, dtypes, _ in gemms), gemms


@pytest.mark.parametrize("mode", MODES)
def test_plain_logits_under_autocast(mode):
    """Plain path (eval, generation): the linear head returns the autocast dtype under autocast, exactly
    ``nn.Linear``'s logits (Llama's lm_head), fp32 without; distance logits are always fp32 and their time
    coordinates never enter the bf16 GEMM (within twice the bf16 error of the space GEMM alone)."""
    head, x, t = head_and_points(mode, far=True)
    x = x.float()
    head.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(x)
        if mode == "linear":
            linear = torch.nn.Linear(D, V)
            linear.load_state_dict({"weight": head.weight, "bias": head.bias})
            assert logits.dtype == torch.bfloat16 and torch.equal(logits, linear(x))
    assert head(x).dtype == torch.float32
    if mode == "distance":
        assert logits.dtype == torch.float32
        w = head.weight.double()
        tau = head.log_tau.double().exp()
        exact = (2 * head.k + 2 * (x[..., 1:].double() @ w[:, 1:].T - x[..., :1].double() * w[:, 0])) / tau
        space = 2 * (x[..., 1:].double() @ w[:, 1:].T) / tau  # the part a bf16 GEMM computes
        rounded = 2 * (x[..., 1:].bfloat16().double() @ w[:, 1:].bfloat16().double().T).bfloat16().double() / tau
        bf16_error = float((rounded - space).abs().max())
        assert float((logits - head.bias.double() - exact).abs().max()) <= 2 * bf16_error + 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_fused_loss_compiles_as_one_graph_under_autocast(mode):
    """``torch.compile(fullgraph=True)`` of the head's fused loss under bf16 autocast: one graph (the autocast
    dtype is read by the wrapper, which dynamo constant-folds) and eager's loss and gradients."""
    head, x, t = head_and_points(mode)
    names = ["loss", "x", *(n for n, _ in head.named_parameters())]
    expected = loss_and_grads(head, x, t, fused=True, autocast=torch.bfloat16, chunk_size=CHUNK)
    torch._dynamo.reset()
    compiled = torch.compile(head, fullgraph=True, backend="aot_eager")
    actual = loss_and_grads(compiled, x, t, fused=True, autocast=torch.bfloat16, chunk_size=CHUNK)
    for name, a, e in zip(names, actual, expected):
        assert a.dtype == e.dtype and relative_error(a, e) <= RTOL[torch.float32], name  # fp32 rounding


@pytest.mark.parametrize("family, head", [("llama", None), ("helm_d", "linear"), ("helm_d", "distance"),
                                          ("helm_mice", "linear")])
def test_model_logits_and_loss_dtypes_under_autocast(family, head):
    """Evaluation under bf16 autocast: a linear LM head gives Llama's bf16 logits, the distance head fp32; the loss
    is fp32 either way (transformers' loss upcasts the logits)."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **({} if head is None else
                                                                     {"lm_head_mode": head}))).eval()
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    assert out.logits.dtype == (torch.float32 if head == "distance" else torch.bfloat16)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
