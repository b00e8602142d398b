"""Lorentz attention kernels vs helm's eager attention in float64: outputs and gradients of q, k, v, τ (and
of the curvature and ALiBi slopes), causal / packed / padded / ALiBi / decoding shapes.

On CPU the kernels run in the Triton interpreter (see conftest.py), so shapes are small and chosen to be
ragged against the 64-wide blocks (T = 63, 100, 200). Every kernel buffer is NaN-filled before launch.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from helm.manifold import lift, manifold_error
from helm.ops import lorentz_attention

from tests.helpers import assert_close
from tests.ops.lorentz_attention_triton.device import DEVICE, ON_GPU

REPO = pathlib.Path(__file__).resolve().parents[3]
FP32_TOL = 1e-4  # issue: relative error of the fp32 kernel against the fp64 eager reference
# Half inputs: P, dS and dz are rounded to the input dtype before the tensor-core products (as FlashAttention
# rounds P and dO). Measured in the interpreter: bf16 <= 2.7e-2, fp16 <= 1.6e-3.
HALF_TOL = {torch.bfloat16: 5e-2, torch.float16: 5e-3}


def _points(shape, d, gen, scale=0.4):
    return lift(torch.randn(*shape, d, generator=gen) * scale, k=1.0)


def _segments(B, T, gen, n_docs=4):
    """Packed rows: document ids increasing along each row, random document boundaries."""
    cuts = torch.stack([torch.randperm(T - 1, generator=gen)[: n_docs - 1] + 1 for _ in range(B)])
    ids = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for c in cuts[b]:
            ids[b, c:] += 1
    return ids


def _case(name, *, B=2, H=2, Tq=100, Tk=None, d=64, dv=None, causal=True, mask=None, segments=False,
          alibi=False, tau_per_head=False, k_grad=False, transposed=False, seed=0):
    """Inputs (fp32 leaves) and keyword arguments for one configuration."""
    Tk = Tq if Tk is None else Tk
    dv = d if dv is None else dv
    gen = torch.Generator().manual_seed(seed)
    if transposed:  # [B, T, H, 1+d] storage seen as [B, H, T, 1+d], as a projection layer produces it
        q = _points((B, Tq, H), d, gen).transpose(1, 2)
    else:
        q = _points((B, H, Tq), d, gen)
    kk = _points((B, H, Tk), d, gen)
    u = torch.randn(B, H, Tk, dv, generator=gen) * 0.4  # values are lift(u): see _values
    tau = (torch.rand(H, generator=gen) + 0.7) if tau_per_head else torch.tensor(1.3)
    kw = dict(causal=causal)
    kw["k"] = torch.tensor(0.7) if k_grad else 1.0
    if mask == "left":
        am = torch.ones(B, Tk, dtype=torch.long)
        am[0, :37] = 0
        am[-1, :5] = 0
        kw["attention_mask"] = am
    elif mask == "right":
        am = torch.ones(B, Tk, dtype=torch.long)
        am[0, Tk - 20:] = 0
        kw["attention_mask"] = am
    elif mask == "all_pad_row":
        am = torch.ones(B, Tk, dtype=torch.long)
        am[0] = 0
        am[-1, :11] = 0
        kw["attention_mask"] = am
    if segments:
        seg = 7 * _segments(B, Tk, gen) - 5  # arbitrary (here negative) ids: only equality matters
        if segments == "interleaved":  # a document comes back after another: no block skipping, the same result
            seg = seg % 2
        if mask == "right":  # padding forms its own document: its queries keep no key at all
            seg[0, Tk - 20:] = 1000
        kw["segment_ids"] = seg
    if alibi:
        kw["alibi_slopes"] = torch.tensor([0.5 ** (h + 1) for h in range(H)])
    return name, q, kk, u, tau, kw


def _values(u, kw):
    """Values ``lift(u)`` on the curvature of the case. Gradients are compared for ``u``, as a model produces
    values (an HLT ends in ``lift``): for a row with a single key the centroid floor ``max(|<S,S>_L|, k)``
    is tied and eager's gradient of ``v`` flips with the rounding, by a multiple of ``J v`` that ``lift``
    maps to zero."""
    return lift(u, k=kw["k"])


FWD_BWD_CASES = [
    _case("causal", transposed=True),
    _case("noncausal-d128-tau-per-head", B=1, Tq=63, d=128, causal=False, tau_per_head=True, seed=1),
    _case("packed-d48-dv32", d=48, dv=32, segments=True, seed=2),
    _case("left-padding-alibi-k-grad", d=16, mask="left", alibi=True, k_grad=True, seed=3),
    _case("noncausal-packed-right-padding", Tq=63, d=16, dv=32, causal=False, mask="right", segments=True,
          alibi=True, seed=4),
    _case("four-blocks-packed-left-padding-alibi", Tq=200, d=16, mask="left", segments=True, alibi=True, seed=13),
    _case("four-blocks-packed-noncausal", Tq=200, d=16, causal=False, segments=True, seed=18),
    _case("four-blocks-interleaved-documents", Tq=200, d=16, segments="interleaved", seed=19),
    _case("decode-shape-left-padding", Tq=3, Tk=100, mask="left", segments=True, tau_per_head=True, seed=5),
    _case("decode-shape-one-row", Tq=1, Tk=100, d=32, alibi=True, seed=6),
]


def _leaves(q, kk, u, tau, kw, dtype=torch.float32, device=DEVICE):
    """Fresh leaf copies (``dtype`` on ``device``) of everything that takes a gradient."""
    def leaf(t, dt):
        return t.detach().to(device=device, dtype=dt).requires_grad_()

    args = [leaf(q, dtype), leaf(kk, dtype), leaf(u, dtype), leaf(tau, torch.float64 if dtype == torch.float64
                                                                  else torch.float32)]
    kw = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    for name in ("k", "alibi_slopes"):
        if isinstance(kw.get(name), torch.Tensor):
            kw[name] = leaf(kw[name], torch.float64 if dtype == torch.float64 else torch.float32)
    return args, kw


def _grad_names(kw):
    extra = {"k": "dcurvature", "alibi_slopes": "dslopes"}
    return ["dq", "dk", "dv_space", "dtau"] + [extra[n] for n in extra if isinstance(kw.get(n), torch.Tensor)]


def _grads(out, args, kw, do):
    wrt = args + [kw[n] for n in ("k", "alibi_slopes") if isinstance(kw.get(n), torch.Tensor)]
    return torch.autograd.grad(out, wrt, do)


def _reference(q, kk, u, tau, kw, do):
    args, kw = _leaves(q, kk, u, tau, kw, torch.float64, "cpu")
    out = lorentz_attention(args[0], args[1], _values(args[2], kw), tau=args[3], impl="eager", **kw)
    return out, _grads(out, args, kw, do.double().cpu())


@pytest.mark.parametrize("case", FWD_BWD_CASES, ids=[c[0] for c in FWD_BWD_CASES])
def test_forward_backward_match_eager_fp64(lk, case):
    name, q, kk, u, tau, kw = case
    do = torch.randn(*q.shape[:3], 1 + u.shape[-1], generator=torch.Generator().manual_seed(7))
    ref_out, ref_grads = _reference(q, kk, u, tau, kw, do)

    args, kkw = _leaves(q, kk, u, tau, kw)
    out = lk.lorentz_flash_attention(args[0], args[1], _values(args[2], kkw), tau=args[3], **kkw)
    assert out.dtype == torch.float32 and out.shape == ref_out.shape
    assert_close(out, ref_out, rtol=FP32_TOL)
    assert manifold_error(out, 1.0 if not isinstance(kw["k"], torch.Tensor) else kw["k"]).max() <= 1e-5
    grads = _grads(out, args, kkw, do.to(DEVICE))
    assert len(grads) == len(ref_grads)
    for gname, g, r in zip(_grad_names(kw), grads, ref_grads, strict=True):
        assert_close(g, r, rtol=FP32_TOL, msg=f"{name}: {gname}")


def test_document_runs(lk):
    """The span of each position's document, where the row's documents come one after another; the whole row where a
    document comes back (the kernels then skip no block)."""
    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 1, 1, 3, 3], [-4, -4, -4, 9, 9, 9]])
    first, end = lk.common.document_runs(seg)
    assert first.tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6, [0, 0, 0, 3, 3, 3]]
    assert end.tolist() == [[2, 2, 5, 5, 5, 6], [6] * 6, [3, 3, 3, 6, 6, 6]]


def test_gradient_of_a_sum(lk):
    """``out.sum()`` hands the backward a stride-0 ``dO``."""
    _, q, kk, u, tau, kw = _case("sum", B=1, Tq=63, d=16, seed=14)
    args, rkw = _leaves(q, kk, u, tau, kw, torch.float64, "cpu")
    lorentz_attention(args[0], args[1], _values(args[2], rkw), tau=args[3], impl="eager", **rkw).sum().backward()
    kargs, kkw = _leaves(q, kk, u, tau, kw)
    lk.lorentz_flash_attention(kargs[0], kargs[1], _values(kargs[2], kkw), tau=kargs[3], **kkw).sum().backward()
    for gname, g, r in zip(_grad_names(kw), kargs, args, strict=True):
        assert_close(g.grad, r.grad, rtol=FP32_TOL, msg=gname)


DECODE_CASES = [
    _case("one-row", Tq=1, Tk=100),
    _case("padded-packed-alibi-all-pad-row", Tq=3, Tk=100, d=16, mask="all_pad_row", segments=True, alibi=True,
          seed=8),
    _case("noncausal-d128-dv64", B=1, Tq=2, Tk=100, d=128, dv=64, causal=False, seed=9),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_kernel_matches_eager_fp64(lk, case, monkeypatch):
    _, q, kk, u, tau, kw = case
    v = _values(u, kw)
    calls = []
    real = lk.decode.lorentz_attention_decode_fwd
    monkeypatch.setattr(lk.decode, "lorentz_attention_decode_fwd", lambda p: calls.append(1) or real(p))
    with torch.no_grad():
        ref = lorentz_attention(q.double(), kk.double(), v.double(), tau=tau.double(), impl="eager",
                                **{n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                                   for n, t in kw.items()})
        dev_kw = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
        out = lk.lorentz_flash_attention(q.to(DEVICE), kk.to(DEVICE), v.to(DEVICE), tau=tau, **dev_kw)
        direct = lk.lorentz_decode_attention(q.to(DEVICE), kk.to(DEVICE), v.to(DEVICE), tau=tau, **dev_kw)
    assert calls, "lorentz_flash_attention did not use the decoding kernel for a short query without grad"
    assert_close(out, ref, rtol=FP32_TOL)
    assert torch.equal(out, direct)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(lk, dtype):
    """Half inputs: fp32 output; error set by rounding P, dS and dz to the input dtype (as on tensor cores)."""
    _, q, kk, u, tau, kw = _case("half", B=1, d=64, mask="left", segments=True, seed=10)
    q, kk = (t.to(dtype).float() for t in (q, kk))  # the reference sees the same rounded inputs
    do = torch.randn(1, 2, 100, 65, generator=torch.Generator().manual_seed(11))
    ref_values = _values(u, kw).to(dtype).double()
    ref_out = lorentz_attention(q.double(), kk.double(), ref_values, tau=tau.double(), impl="eager", **kw)
    args, kkw = _leaves(q, kk, u, tau, kw, dtype)
    out = lk.lorentz_flash_attention(args[0], args[1], _values(args[2], kkw).to(dtype), tau=args[3], **kkw)
    assert out.dtype == torch.float32
    assert_close(out, ref_out, rtol=HALF_TOL[dtype])
    ref_grads = _reference(q, kk, u, tau, kw, do)[1]
    for gname, g, r in zip(["dq", "dk", "dv_space", "dtau"], _grads(out, args, kkw, do.to(DEVICE)), ref_grads,
                               strict=True):
        assert g.dtype == (dtype if gname != "dtau" else torch.float32), gname
        assert_close(g, r, rtol=HALF_TOL[dtype], msg=gname)


def test_space_parts_reach_the_kernel_aligned_in_the_compute_dtype(lk):
    """The cast to the GEMM dtype writes the space parts as rows of ``d`` from column 0 (16-byte aligned: vectorised
    loads); without a cast they stay views of the points (no copy)."""
    _, q, kk, u, tau, kw = _case("aligned", B=1, Tq=9, d=64, seed=16)
    args = dict(k=1.0, tau=tau, causal=True, attention_mask=None, segment_ids=None, alibi_slopes=None)
    q, kk, v = q.to(DEVICE), kk.to(DEVICE), _values(u, kw).to(DEVICE)
    cast = lk.common.prepare(q, kk, v, qk_dtype=torch.bfloat16, **args)
    for name, t in (("q", cast.q), ("k", cast.k)):
        assert t.dtype == torch.bfloat16 and t.shape[-1] == 64 and t.is_contiguous(), name
        assert t.data_ptr() % 16 == 0 and t.stride(-2) * t.element_size() % 16 == 0, name
    same = lk.common.prepare(q, kk, v, **args)
    assert same.q.data_ptr() == q[..., 1:].data_ptr() and same.k.data_ptr() == kk[..., 1:].data_ptr()


def test_cached_keys_reach_the_kernel_as_they_are(lk, prepared):
    """A cache's keys (:class:`helm.nn.LorentzSelfAttention`): space parts stored in bf16, fp32 time coordinates
    beside them (``key_time``). The kernel reads the stored space parts without a copy and gives exactly what it
    gives for the points, which its preparation casts: outputs and gradients, and on the decoding kernel."""
    _, q, kk, u, tau, kw = _case("cached-keys", B=1, Tq=63, d=16, mask="left", seed=15)
    kw = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    q, v = q.to(DEVICE), _values(u, kw).to(DEVICE)
    points = kk.to(DEVICE).requires_grad_()
    space = kk[..., 1:].to(device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    time = kk[..., 0].to(DEVICE).requires_grad_()
    want = lk.lorentz_flash_attention(q, points, v, tau=tau, qk_dtype=torch.bfloat16, **kw)
    got = lk.lorentz_flash_attention(q, space, v, tau=tau, qk_dtype=torch.bfloat16, key_time=time, **kw)
    assert prepared[-1].k.data_ptr() == space.data_ptr()
    assert torch.equal(got, want)
    do = torch.randn(want.shape, generator=torch.Generator().manual_seed(17)).to(DEVICE)
    (dpoints,) = torch.autograd.grad(want, points, do)
    dspace, dtime = torch.autograd.grad(got, (space, time), do)
    assert torch.equal(dspace.float(), dpoints[..., 1:]) and torch.equal(dtime, dpoints[..., 0])
    with torch.no_grad():
        step = [lk.lorentz_flash_attention(q[:, :, -1:], key, v, tau=tau, qk_dtype=torch.bfloat16, **extra, **kw)
                for key, extra in ((points, {}), (space, {"key_time": time}))]
    assert torch.equal(step[0], step[1])


def test_helm_entry_point_impl_triton(lk):
    """``helm.ops.lorentz_attention(impl="triton")`` runs the kernel (forward kernel without grad: Tq > 16)."""
    _, q, kk, u, tau, kw = _case("entry", Tq=63, mask="left", alibi=True, seed=12)
    v = _values(u, kw)
    dev_kw = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    with torch.no_grad():
        out = lorentz_attention(q.to(DEVICE), kk.to(DEVICE), v.to(DEVICE), tau=tau, impl="triton", **dev_kw)
        ref = lorentz_attention(q.double(), kk.double(), v.double(), tau=tau.double(), impl="eager", **kw)
    assert_close(out, ref, rtol=FP32_TOL)


def test_naive_reference_matches_eager():
    """The reference (its own masks and centring, from the equations) agrees with eager on every row that sees a
    key; a row that sees none (all of batch row 0, the first query of row 1: padding) has an output callers
    ignore."""
    _, q, kk, u, tau, kw = _case("naive", Tq=20, Tk=30, d=8, mask="all_pad_row", segments=True, alibi=True)
    from helm.ops.lorentz_attention_triton.naive import naive_lorentz_attention

    args = [t.double() for t in (q, kk, _values(u, kw), tau)]
    ref = lorentz_attention(*args[:3], tau=args[3], impl="eager", **kw)
    seen = kw["attention_mask"][:, 10:].bool()  # a query that is not padding sees at least itself
    assert seen.sum() == 19
    assert_close(naive_lorentz_attention(*args[:3], tau=args[3], **kw).transpose(1, 2)[seen],
                 ref.transpose(1, 2)[seen], rtol=1e-12)


def test_naive_reference_catches_a_centre_shared_across_documents(monkeypatch):
    """Far from the origin in fp32, eager centred with one centre for the whole row (documents mixed) leaves the
    pairwise normaliser inexact; the reference, which shares no centring code with eager, sees the difference."""
    from helm.ops import attention
    from helm.ops.lorentz_attention_triton.naive import naive_lorentz_attention

    _, q, kk, u, tau, kw = _case("far", B=1, H=1, Tq=24, d=8, segments=True, seed=5)
    doc = (kw["segment_ids"] - kw["segment_ids"][:, :1]).div(7).view(1, 1, -1, 1)  # 0, 1, 2, ... per document
    v = _values(u + 3e3 * (1 + doc), kw)  # each document clustered, 3e3 from the next one
    ref = naive_lorentz_attention(q.double(), kk.double(), v.double(), tau=tau, **kw)
    assert_close(lorentz_attention(q, kk, v, tau=tau, impl="eager", **kw), ref, rtol=1e-5)
    monkeypatch.setattr(attention.AttentionMask, "groups", lambda self: None)  # one centre for all keys
    wrong = lorentz_attention(q, kk, v, tau=tau, impl="eager", **kw)
    assert ((wrong - ref).abs() / ref.abs().clamp_min(1)).max() > 0.1


def test_invalid_arguments_raise(lk):
    q = lift(torch.randn(1, 2, 8, 16), k=1.0).to(DEVICE)
    with pytest.raises(ValueError, match="float64"):
        lk.lorentz_flash_attention(q.double(), q.double(), q.double(), k=1.0, tau=1.0)
    wide = lift(torch.randn(1, 2, 8, 300), k=1.0).to(DEVICE)
    with pytest.raises(ValueError, match="head dims"):
        lk.lorentz_flash_attention(wide, wide, wide, k=1.0, tau=1.0)
    with pytest.raises(ValueError, match="tau"):
        lk.lorentz_flash_attention(q, q, q, k=1.0, tau=torch.ones(3))
    with pytest.raises(ValueError, match="Tq <= Tk"):
        lk.lorentz_flash_attention(q, q[:, :, :4], q[:, :, :4], k=1.0, tau=1.0)
    with pytest.raises(ValueError, match="key_time"):  # the keys' points where their space parts belong
        lk.lorentz_flash_attention(q, q, q, k=1.0, tau=1.0, key_time=q[..., 0])
    am = torch.ones(1, 8, dtype=torch.long, device=DEVICE)
    other = lk.common.kernel_ids(None, am[:, :6], 6, DEVICE)  # the id rows of another mask
    with pytest.raises(ValueError, match="ids"):
        lk.lorentz_flash_attention(q, q, q, k=1.0, tau=1.0, attention_mask=am, ids=other)
    with pytest.raises(RuntimeError, match="forward only"):
        lk.lorentz_decode_attention(q.requires_grad_(), q, q, k=1.0, tau=1.0)


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def _env_without_interpreter() -> dict:
    env = {n: val for n, val in os.environ.items() if n != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.skipif(ON_GPU, reason="checks the CPU error path")
def test_triton_impl_on_cpu_without_interpreter_raises_clearly():
    proc = _python("""
        import sys, torch
        from helm.manifold import lift
        from helm.ops import lorentz_attention
        q = lift(torch.randn(1, 2, 5, 16), k=1.0)
        try:
            lorentz_attention(q, q, q, k=1.0, tau=1.0, impl="triton")
        except ValueError as err:
            print("helm:", err)
        from helm.ops.lorentz_attention_triton import lorentz_flash_attention
        try:
            lorentz_flash_attention(q, q, q, k=1.0, tau=1.0)
        except ValueError as err:
            print("kernel:", err)
    """, _env_without_interpreter())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("helm:") and "TRITON_INTERPRET" in line for line in lines), proc.stdout
    assert any(line.startswith("kernel:") and "TRITON_INTERPRET" in line for line in lines), proc.stdout


@pytest.mark.skipif(ON_GPU, reason="checks the no-CUDA exit path")
def test_gpu_benchmark_exits_clearly_without_cuda():
    env = _env_without_interpreter()
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "attention_triton.py")], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode != 0
    assert "CUDA" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the real benchmark")
def test_gpu_benchmark_dry_run_on_cpu():
    """Every code path of the benchmark script, at a toy size in the interpreter (timings meaningless)."""
    env = _env_without_interpreter()
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "attention_triton.py"), "--dry-run-cpu",
                           "--seq", "64", "--tokens", "64", "--heads", "2", "--dims", "16"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ratios = [line for line in proc.stdout.splitlines() if line.startswith("ratio ")]
    assert len(ratios) == 9, proc.stdout  # (fwd, fwd+bwd, decode) x (triton-model, sdpa, eager)
