"""The fused, chunked LM-head cross-entropy against the plain path: loss and gradients of features, weights, logit
scale and bias, awkward shapes, ignored rows, both LM-head modes, bf16."""

import functools

import pytest
import torch

from helm.manifold import lift
from helm.nn.head import LorentzLMHead
from helm.ops import linear_cross_entropy, linear_cross_entropy_reference
from helm.ops import lm_loss
from helm.ops.lm_loss import default_chunk_size
from tests.helpers import assert_close, relative_error

N, D, V = 63, 9, 37  # tokens not a multiple of any chunk below, vocabulary not a multiple of the chunk either


def inputs(dtype, *, scale=True, bias=True, ignored=(0, 5, 17, 62), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = torch.randn(V, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    s = torch.tensor(0.7, dtype=dtype, requires_grad=True) if scale else None
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    t[list(ignored)] = -100
    return x, w, s, b, t


def loss_and_grads(fn, x, w, s, b, t, **kwargs):
    params = [p for p in (x, w, s, b) if p is not None]
    loss = fn(x, w, t, scale=s, bias=b, **kwargs)
    return (loss, *torch.autograd.grad(1.7 * loss, params))  # an incoming gradient other than 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("chunk_size", [1, 10, 63, 64, None])
@pytest.mark.parametrize("affine", ["plain", "scale", "bias", "both"])
def test_chunked_equals_reference_in_loss_and_gradients(dtype, chunk_size, affine):
    x, w, s, b, t = inputs(dtype, scale=affine in ("scale", "both"), bias=affine in ("bias", "both"))
    expected = loss_and_grads(linear_cross_entropy_reference, x, w, s, b, t)
    actual = loss_and_grads(linear_cross_entropy, x, w, s, b, t, chunk_size=chunk_size)
    assert actual[0].dtype == dtype
    for name, a, e in zip(("loss", "x", "weight", "scale/bias", "bias"), actual, expected):
        assert a.dtype == e.dtype
        assert_close(a, e, factor=10.0, msg=name)  # a sum over 63 rows and chunks in a different order


def test_ignored_rows_get_no_loss_and_no_gradient():
    x, w, s, b, t = inputs(torch.float64)
    keep = t != -100
    full = loss_and_grads(linear_cross_entropy, x, w, s, b, t, chunk_size=10)
    kept = loss_and_grads(linear_cross_entropy, x[keep].detach().requires_grad_(), w, s, b, t[keep], chunk_size=10)
    assert_close(full[0], kept[0])
    assert not full[1][~keep].any()
    assert_close(full[1][keep], kept[1])
    for a, e in zip(full[2:], kept[2:]):
        assert_close(a, e)
    # every row ignored: zero loss, zero (finite) gradients
    loss, *grads = loss_and_grads(linear_cross_entropy, x, w, s, b, torch.full_like(t, -100), chunk_size=10)
    assert loss == 0 and all(torch.isfinite(g).all() and not g.any() for g in grads)
    # another ignore_index
    t7 = torch.where(keep, t, 7)
    assert_close(linear_cross_entropy(x, w, t7, scale=s, bias=b, ignore_index=7, chunk_size=10),
                 linear_cross_entropy_reference(x, w, t7, scale=s, bias=b, ignore_index=7))


def test_only_the_requested_gradients_and_no_graph_without_grad():
    x, w, s, b, t = inputs(torch.float64)
    expected = loss_and_grads(linear_cross_entropy_reference, x, w, s, b, t)
    x_frozen = x.detach()
    loss = linear_cross_entropy(x_frozen, w, t, scale=s, bias=b, chunk_size=10)
    grads = torch.autograd.grad(1.7 * loss, [w, s, b])
    for a, e in zip(grads, expected[2:]):
        assert_close(a, e)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, scale=s, bias=b, chunk_size=10)
    assert loss.grad_fn is None
    assert_close(loss, expected[0])


def test_a_second_backward_through_the_same_loss_is_refused():
    x, w, s, b, t = inputs(torch.float64)
    loss = linear_cross_entropy(x, w, t, scale=s, bias=b, chunk_size=10)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_bad_arguments_are_refused():
    x, w, s, b, t = inputs(torch.float64)
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(x, w, t[:-1])
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(x, w, t.double())
    with pytest.raises(ValueError, match="weight"):
        linear_cross_entropy(x, w[:, :-1], t)
    with pytest.raises(ValueError, match="bias"):
        linear_cross_entropy(x, w, t, bias=b[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(x, w, t, chunk_size=0)


def test_default_chunk_holds_about_2_to_25_logits():
    assert default_chunk_size(128256) == 261 and default_chunk_size(512) == 65536 and default_chunk_size(1 << 30) == 1
    assert default_chunk_size(128256, torch.device("cpu")) == 261


def test_default_chunk_on_cuda_fills_a_quarter_of_the_free_memory_read_once(monkeypatch):
    reads = []
    monkeypatch.setattr(lm_loss, "_CHUNK_ELEMENTS_ON", {})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: reads.append(device) or (120 << 30, 141 << 30))
    gpu = torch.device("cuda:0")
    assert default_chunk_size(128256, gpu) == (120 << 30) // 4 // 12 // 128256 == 20929  # > 8 x 2048: one chunk
    assert default_chunk_size(1024, gpu) == (120 << 30) // 4 // 12 // 1024 and reads == [gpu]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 20, 141 << 30))  # nearly full: the floor
    assert default_chunk_size(128256, torch.device("cuda:1")) == 261


def head_and_points(mode, dtype, k=0.5, T=63):
    torch.manual_seed(0)
    head = LorentzLMHead(D, V, k=k, mode=mode, bias=True, tau=1.3).to(dtype)
    with torch.no_grad():
        head.bias.normal_()
    g = torch.Generator().manual_seed(1)
    x = lift(torch.randn(2, T, D - 1, generator=g, dtype=torch.float64), k=k).to(dtype).requires_grad_()
    t = torch.randint(0, V, (2, T), generator=g)
    t[:, -1] = -100
    t[0, :4] = -100
    return head, x, t


def head_loss_and_grads(head, x, t, fused, **kwargs):
    if fused:
        loss = head(x, targets=t, **kwargs)
    else:
        loss = torch.nn.functional.cross_entropy(head(x).flatten(0, 1), t.flatten(), reduction="sum")
    params = [x, *head.parameters()]
    return (loss, *torch.autograd.grad(loss, params))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("mode", ["linear", "distance"])
def test_head_fused_loss_equals_cross_entropy_of_its_logits(mode, dtype):
    head, x, t = head_and_points(mode, dtype)
    names = ["loss", "x", *(n for n, _ in head.named_parameters())]
    assert (mode == "distance") == ("log_tau" in names)
    expected = head_loss_and_grads(head, x, t, fused=False)
    for chunk in (7, None):
        actual = head_loss_and_grads(head, x, t, fused=True, chunk_size=chunk)
        for name, a, e in zip(names, actual, expected):
            assert_close(a, e, factor=10.0, msg=f"{name} (chunk {chunk})")


@pytest.mark.parametrize("mode", ["linear", "distance"])
def test_head_fused_loss_under_bf16(mode):
    """bf16 autocast and bf16 weights: logsumexp in fp32, and (flash-attention's rule) the fused loss and gradients
    are no further from the fp32 values than twice the plain path's under the same bf16 setting."""
    head, x, t = head_and_points(mode, torch.float32)
    names = ["loss", "x", *(n for n, _ in head.named_parameters())]
    expected = head_loss_and_grads(head, x, t, fused=False)

    def check(fused, plain):
        assert fused[0].dtype == torch.float32
        assert [g.dtype for g in fused[1:]] == [g.dtype for g in plain[1:]]
        for name, a, p, e in zip(names, fused, plain, expected):
            bound = 2 * relative_error(p, e) + 1e-5
            assert relative_error(a, e) <= bound, f"{name}: {relative_error(a, e):.3e} > {bound:.3e}"

    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = head_loss_and_grads(head, x, t, fused=False)
        fused = head_loss_and_grads(head, x, t, fused=True, chunk_size=7)
    check(fused, plain)
    head.weight.data = head.weight.data.bfloat16()  # bf16 weights (scalars stay fp32, as in the models)
    head.bias.data = head.bias.data.bfloat16()
    check(head_loss_and_grads(head, x, t, fused=True, chunk_size=7), head_loss_and_grads(head, x, t, fused=False))


@pytest.mark.parametrize("minkowski", [False, True], ids=["linear", "minkowski"])
def test_compiled_epilogue_equals_the_eager_one_in_loss_and_gradients(minkowski, monkeypatch):
    """CUDA runs each chunk's epilogue compiled (fused: the time products as reductions, not matrix-vector
    products); here the same compiled function (fullgraph, so no graph break either) stands in for the eager one
    on the CPU, under bf16 autocast, against the reference in fp64."""
    x, w, s, b, t = inputs(torch.float32)
    expected = loss_and_grads(linear_cross_entropy_reference, *(p.double() if p is not None else p for p in (x, w, s, b)),
                              t, minkowski=minkowski)
    eager = lm_loss._epilogue
    monkeypatch.setattr(lm_loss, "_epilogue", torch.compile(functools.partial(eager, fused=True), backend="aot_eager",
                                                            fullgraph=True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = loss_and_grads(linear_cross_entropy, x, w, s, b, t, chunk_size=10, minkowski=minkowski)
    monkeypatch.setattr(lm_loss, "_epilogue", eager)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = loss_and_grads(linear_cross_entropy, x, w, s, b, t, chunk_size=10, minkowski=minkowski)
    for name, f, p, e in zip(["loss", "x", "w", "s", "b"], fused, plain, expected):
        assert_close(f, p, factor=10.0, msg=name)
        assert relative_error(f, e) <= 2 * relative_error(p, e) + 1e-6, name


def test_the_compiled_epilogue_lowers_with_inductor():
    """One chunk through inductor (as CUDA compiles it) equals the eager epilogue."""
    g = torch.Generator().manual_seed(3)
    z, xt = torch.randn(5, 37, generator=g).bfloat16(), torch.rand(5, generator=g) + 1
    wt, b = torch.rand(37, generator=g) + 1, torch.randn(37, generator=g)
    kc, tc = torch.tensor([True, False, True, True, True]), torch.randint(0, 37, (5, 1), generator=g)
    args = dict(acc=torch.float32, mm=torch.bfloat16, need=(True, True, True, True))
    eager = lm_loss._epilogue(z.clone(), kc, tc, xt, wt, torch.tensor(0.7), b, **args)
    compiled = torch.compile(functools.partial(lm_loss._epilogue, fused=True), fullgraph=True)(
        z.clone(), kc, tc, xt, wt, torch.tensor(0.7), b, **args)
    for e, c in zip(eager, compiled):
        assert_close(c, e, factor=4.0)
