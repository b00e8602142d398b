"""The kernels as ``torch.library`` custom ops (issue 22 item 4): ``opcheck`` of ``helm::lorentz_attention_fwd``,
``_bwd`` and ``_decode`` (schema, fake implementations against the real outputs, autograd registration, AOT
dispatch), a ``torch.compile(fullgraph=True)`` training step of a tiny model with ``attn_implementation="triton"``
against eager, the sm90 autotuning configurations and their pruning, and decoding from a cache's centred value norms.

On CPU the kernels run in the Triton interpreter (conftest.py), so shapes are small and ragged (T = 63, 1+16 and a
value head 1+32 against key heads 1+17 where it matters).
"""

import pytest
import torch

from helm.manifold import lift, sqnorm
from helm.ops import lorentz_attention

from tests.helpers import RTOL, assert_close, relative_error, tiny_model
from tests.ops.lorentz_attention_triton.device import DEVICE, ON_GPU


def _prepared(lk, *, Tq=63, Tk=63, d=16, dv=32, segments=True, alibi=True, grad=True, seed=0, qk_dtype=None):
    """Kernel-ready inputs (:func:`~helm.ops.lorentz_attention_triton.common.prepare`) of a packed, padded, ALiBi
    problem, as leaves where gradients flow (``q, qt, k, kt, w``, scale, slopes, curvature; ``e`` is None: centred)."""
    gen = torch.Generator().manual_seed(seed)
    B, H = 2, 2
    q = lift(torch.randn(B, H, Tq, d, generator=gen) * 0.4, k=0.7)
    kk = lift(torch.randn(B, H, Tk, d, generator=gen) * 0.4, k=0.7)
    v = lift(torch.randn(B, H, Tk, dv, generator=gen) * 0.4, k=0.7)
    am = torch.ones(B, Tk, dtype=torch.long)
    am[1, :5] = 0
    seg = torch.zeros(B, Tk, dtype=torch.long)
    seg[:, Tk // 2:] = 1
    p = lk.common.prepare(q.to(DEVICE), kk.to(DEVICE), v.to(DEVICE), k=torch.tensor([0.7], device=DEVICE),
                          tau=torch.tensor([1.1, 0.9], device=DEVICE), causal=True, attention_mask=am.to(DEVICE),
                          segment_ids=seg.to(DEVICE) if segments else None,
                          alibi_slopes=torch.tensor([0.5, 0.25], device=DEVICE) if alibi else None,
                          qk_dtype=qk_dtype)

    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_(grad)

    return (leaf(p.q), leaf(p.qt), leaf(p.k), leaf(p.kt), leaf(p.v), leaf(p.e), p.c, leaf(p.scale), leaf(p.slopes),
            leaf(p.kc), p.qid, p.kid, p.causal)


@pytest.mark.parametrize("qk_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-qk"])
def test_opcheck_forward_with_autograd(lk, qk_dtype):
    args = _prepared(lk, qk_dtype=qk_dtype)
    torch.library.opcheck(torch.ops.helm.lorentz_attention_fwd.default, (*args, True, True))


def test_opcheck_forward_without_statistics_and_without_masks(lk):
    args = _prepared(lk, segments=False, alibi=False, grad=False)
    torch.library.opcheck(torch.ops.helm.lorentz_attention_fwd.default, (*args, True, False))


@pytest.mark.parametrize("qk_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-qk"])
def test_opcheck_backward(lk, qk_dtype):
    args = _prepared(lk, grad=False, qk_dtype=qk_dtype)
    o, s, ebar, lse, full = torch.ops.helm.lorentz_attention_fwd(*args, True, True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    # the backward takes the forward's inputs but e (centred values: the kernels compute it)
    torch.library.opcheck(torch.ops.helm.lorentz_attention_bwd.default,
                          (*args[:5], *args[6:12], s, ebar, lse, full, do, args[12]))


def test_opcheck_decode(lk):
    args = _prepared(lk, Tq=3, Tk=63, grad=False)
    torch.library.opcheck(torch.ops.helm.lorentz_attention_decode.default, (*args, True))


def _step(model, forward, ids, documents, autocast=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = forward(input_ids=ids, labels=ids, segment_ids=documents, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("autocast", [False, pytest.param(True, marks=pytest.mark.skipif(
    ON_GPU, reason="CPU autocast; the GPU runs the fp32 case"))], ids=["fp32", "bf16-autocast"])
def test_compiled_training_step_with_the_kernel_matches_eager(lk, monkeypatch, autocast):
    """``fullgraph=True`` needs dynamo to trace around the kernel: the custom ops and their fake implementations.
    Same loss and gradients as the eager step with the same kernel (both run the same kernels; under CPU bf16
    autocast the kernel gets bf16 space parts of ``q, k``), and the compiled step really launches the forward and
    backward kernels."""
    launched = []
    for name in ("_launch_fwd", "_launch_bwd"):
        real = getattr(lk.fwd_bwd, name)
        monkeypatch.setattr(lk.fwd_bwd, name,
                            lambda p, *a, _real=real, _name=name, **kw: launched.append((_name, p.q.dtype))
                            or _real(p, *a, **kw))
    model = tiny_model("helm_d", train=True, num_hidden_layers=1, vocab_size=64,
                       model_kwargs={"attn_implementation": "triton"})
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    documents = torch.tensor([[0] * 7 + [1] * 9, [0] * 16])
    loss_e, grads_e = _step(model, model, ids, documents, autocast)
    qk = torch.bfloat16 if autocast else torch.float32
    assert launched == [("_launch_fwd", qk), ("_launch_bwd", qk)]
    torch._dynamo.reset()
    with torch._functorch.config.patch(backward_pass_autocast="off"):  # eager's backward runs without autocast
        loss_c, grads_c = _step(model, torch.compile(model, fullgraph=True, backend="aot_eager"), ids, documents,
                                autocast)
    assert launched[2:] == [("_launch_fwd", qk), ("_launch_bwd", qk)]
    assert relative_error(loss_c, loss_e) <= RTOL[torch.float32]
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        assert relative_error(grads_c[name], grads_e[name]) <= (2e-3 if autocast else 1e-4), name


@pytest.mark.parametrize("d", [16, 48, 64, 128, 256])
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                    (torch.float32, torch.float32)], ids=["bf16", "bf16-qk-fp32-v", "fp32"])
def test_sm90_configs_are_pruned_to_what_fits(lk, d, dtypes, monkeypatch):
    """The GPU candidate lists (built here as on a GPU) keep, for every head width and dtype pair, at least one
    configuration and only configurations estimated to fit sm90's shared memory and register budget; with
    HELM_TRITON_AUTOTUNE=0 exactly one, the first that fits (the hand-picked blocks lead the lists)."""
    common = lk.common
    monkeypatch.setattr(common, "INTERPRET", False)
    lists = {
        "fwd": common.autotune_configs([(128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 2), (64, 32, 8, 2)],
                                       (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)),
        "dkdv": common.autotune_configs([(64, 64, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2), (32, 32, 8, 2)],
                                        (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)),
    }
    lists["dq"] = lists["dkdv"]
    assert len(lists["fwd"]) == len(lists["dkdv"]) == 36  # the preferred blocks are counted once
    q, v = torch.empty(0, dtype=dtypes[0]), torch.empty(0, dtype=dtypes[1])
    bd = common.block_d(d)
    for kind, cfgs in lists.items():
        kept = common.prune_configs(kind)(cfgs, {"Q": q, "V": v}, BLOCK_D=bd, BLOCK_DV=bd)
        assert kept, (kind, d, dtypes)
        fitting = []
        for c in cfgs:
            smem, regs = common.estimate_resources(kind, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], bd, bd,
                                                   q.element_size(), v.element_size(), c.num_warps, c.num_stages)
            if smem <= common.SM90_SMEM_BYTES and regs <= common.REG_BUDGET:
                fitting.append(c)
        assert kept == (fitting or kept), (kind, d, dtypes)
        monkeypatch.setattr(common, "AUTOTUNE", False)
        assert common.prune_configs(kind)(cfgs, {"Q": q, "V": v}, BLOCK_D=bd, BLOCK_DV=bd) == kept[:1]
        monkeypatch.setattr(common, "AUTOTUNE", True)
    if dtypes == (torch.bfloat16, torch.bfloat16) and d == 64:  # the paper's head: the hand-picked blocks fit
        assert lists["fwd"][0] in common.prune_configs("fwd")(lists["fwd"], {"Q": q, "V": v}, BLOCK_D=bd,
                                                               BLOCK_DV=bd)
        assert lists["dkdv"][0].kwargs == {"BLOCK_M": 64, "BLOCK_N": 64}


@pytest.mark.skipif(ON_GPU, reason="the interpreter's single configuration")
def test_one_configuration_under_the_interpreter(lk):
    fwd_bwd, decode = lk.fwd_bwd, lk.decode
    assert len(fwd_bwd.FWD_CONFIGS) == len(fwd_bwd.BWD_CONFIGS) == len(decode.DECODE_CONFIGS) == 1


def test_decode_from_cached_centred_norms_matches_eager(lk):
    """A cache's ``[v | e]`` with ``e = <v - c, v - c>_L`` for one centre ``c`` (helm.nn's KV cache): the kernels
    read the values as they are (``D = Σ P v - c``), decoding (Tq <= 16) and a longer prefill alike, and give eager's
    output, with the values clustered far from the origin where centring matters."""
    gen = torch.Generator().manual_seed(3)
    B, H, Tk, d = 2, 2, 63, 16
    v = lift(torch.randn(B, H, Tk, d, generator=gen) * 0.05 + 3.0, k=1.0)
    keys = lift(torch.randn(B, H, Tk, d, generator=gen) * 0.4, k=1.0)
    am = torch.ones(B, Tk, dtype=torch.long)
    am[1, :4] = 0
    centre = v[:, :, :1]
    cached = torch.cat([v, sqnorm(v - centre, keepdim=True)], dim=-1)
    for Tq in (1, 3, 40):
        q = lift(torch.randn(B, H, Tq, d, generator=gen) * 0.4, k=1.0)
        ref = lorentz_attention(q.double(), keys.double(), v.double(), k=1.0, tau=1.3, attention_mask=am,
                                impl="eager")
        with torch.no_grad():
            out = lk.lorentz_flash_attention(q.to(DEVICE), keys.to(DEVICE), cached.to(DEVICE), k=1.0, tau=1.3,
                                             attention_mask=am.to(DEVICE), value_centre=centre.to(DEVICE))
            via_helm = lorentz_attention(q.to(DEVICE), keys.to(DEVICE), cached.to(DEVICE), k=1.0, tau=1.3,
                                         attention_mask=am.to(DEVICE), value_centre=centre.to(DEVICE),
                                         impl="triton")
        assert_close(out, ref, rtol=1e-4, msg=f"Tq={Tq}")
        assert torch.equal(out, via_helm)


def test_cached_norms_with_gradients_are_refused_by_the_kernel_and_dropped_by_helm(lk):
    gen = torch.Generator().manual_seed(4)
    v = lift(torch.randn(1, 2, 20, 8, generator=gen), k=1.0)
    q = lift(torch.randn(1, 2, 2, 8, generator=gen), k=1.0).to(DEVICE).requires_grad_()
    centre = v[:, :, :1]
    cached = torch.cat([v, sqnorm(v - centre, keepdim=True)], dim=-1).to(DEVICE)
    with pytest.raises(ValueError, match="inference"):
        lk.lorentz_flash_attention(q, v.to(DEVICE), cached, k=1.0, tau=1.0, value_centre=centre.to(DEVICE))
    out = lorentz_attention(q, v.to(DEVICE), cached, k=1.0, tau=1.0, value_centre=centre.to(DEVICE), impl="triton")
    ref = lorentz_attention(q.detach().double().cpu(), v.double(), v.double(), k=1.0, tau=1.0, impl="eager")
    assert_close(out, ref, rtol=1e-4)


def test_compute_dtype_space_parts_with_fp32_time_coordinates(lk):
    """``qk_dtype=bf16`` (what helm passes under bf16 autocast): the space parts of ``q, k`` in bf16, their time
    coordinates in fp32, fp32 values. Away from the origin (``q_t k_t`` ~ 40) the output and gradients are as
    close to fp64 as helm's eager attention with the same compute dtype (flash-attention's rule: within twice its
    error, plus fp32 rounding), and far closer than with the time coordinates rounded to bf16 too."""
    gen = torch.Generator().manual_seed(5)
    B, H, T, d = 1, 2, 63, 64
    q = lift(torch.randn(B, H, T, d, generator=gen) * 0.8, k=1.0)
    kk = lift(torch.randn(B, H, T, d, generator=gen) * 0.8, k=1.0)
    u = torch.randn(B, H, T, d, generator=gen) * 0.4
    do = torch.randn(B, H, T, 1 + d, generator=torch.Generator().manual_seed(6))

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, kk, u)]
        out = fn(leaves[0], leaves[1], lift(leaves[2], k=1.0))
        return (out, *torch.autograd.grad(out, leaves, do.to(out.device, out.dtype)))

    ref = run(lambda a, b, v: lorentz_attention(a, b, v, k=1.0, tau=1.3, impl="eager"), torch.float64)
    eager = run(lambda a, b, v: lorentz_attention(a, b, v, k=1.0, tau=1.3, impl="eager", dtype=torch.bfloat16),
                torch.float32)

    def kernel(a, b, v):
        return lk.lorentz_flash_attention(a.to(DEVICE), b.to(DEVICE), v.to(DEVICE), k=1.0, tau=1.3,
                                          qk_dtype=torch.bfloat16)

    def kernel_bf16_time(a, b, v):  # the time coordinates rounded to bf16 with the space parts
        return lk.lorentz_flash_attention(a.bfloat16().float().to(DEVICE), b.bfloat16().float().to(DEVICE),
                                          v.to(DEVICE), k=1.0, tau=1.3, qk_dtype=torch.bfloat16)

    ours = run(kernel, torch.float32)
    coarse = run(kernel_bf16_time, torch.float32)
    assert float(q[..., 0].max() * kk[..., 0].max()) > 20
    for name, o, e, c, r in zip(["out", "dq", "dk", "du"], ours, eager, coarse, ref, strict=True):
        assert o.dtype == torch.float32, name
        err, bound = relative_error(o, r), 2 * relative_error(e, r) + RTOL[torch.float32]
        assert err <= bound, f"{name}: {err:.2e} > {bound:.2e}"
        if name == "out":
            assert err < relative_error(c, r) / 4, (err, relative_error(c, r))


def test_decoding_with_bf16_products_matches_the_forward_kernel(lk):
    """The split-K decoding kernel reads the fp32 time inputs and bf16 space parts as the forward kernel does: the
    same rows (the last 3 of 63) come out of both to fp32 rounding."""
    gen = torch.Generator().manual_seed(7)
    q = lift(torch.randn(1, 2, 63, 64, generator=gen) * 0.8, k=1.0).to(DEVICE)
    kk = lift(torch.randn(1, 2, 63, 64, generator=gen) * 0.8, k=1.0).to(DEVICE)
    v = lift(torch.randn(1, 2, 63, 64, generator=gen) * 0.4, k=1.0).to(DEVICE)
    with torch.no_grad():
        full = lk.lorentz_flash_attention(q, kk, v, k=1.0, tau=1.3, qk_dtype=torch.bfloat16)
        last = lk.lorentz_decode_attention(q[:, :, -3:], kk, v, k=1.0, tau=1.3, qk_dtype=torch.bfloat16)
    assert_close(last, full[:, :, -3:], rtol=1e-5)


def test_model_decoding_reads_the_cached_norms(lk, monkeypatch):
    """A HELM-D model generating with ``attn_implementation="triton"`` and a dynamic cache hands the kernel the cache's
    ``[v | e]`` and centre on every decoding step (no re-centring of the cache) and gives the sdpa model's logits."""
    seen = []
    kernel = lk.lorentz_flash_attention
    monkeypatch.setattr("helm.ops.lorentz_attention_triton.lorentz_flash_attention",
                        lambda *a, **kw: seen.append(kw.get("value_centre") is not None) or kernel(*a, **kw))
    model = tiny_model("helm_d", num_hidden_layers=1, vocab_size=64, model_kwargs={"attn_implementation": "triton"})
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    triton = model.generate(ids, **kw)
    assert len(seen) == 4 and all(seen), seen  # prefill and three decoding steps, each with the cache's norms
    model.set_attn_implementation("sdpa")
    sdpa = model.generate(ids, **kw)
    assert torch.equal(triton.sequences, sdpa.sequences)
    assert_close(torch.stack(triton.logits), torch.stack(sdpa.logits), rtol=1e-5)


def test_multi_config_autotuning_path_in_the_interpreter(lk, monkeypatch):
    """The GPU's autotuning path (several candidates: pruning with the launch arguments, a timing per candidate,
    grids sized by the chosen block) run in the interpreter with a wall-clock timer in place of CUDA events: the
    tuned kernels, each given two candidates with different blocks, still match fp64 eager in outputs and gradients
    (causal, packed, padded, ALiBi, T = 63 against 32- and 64-wide blocks; decoding with 32- and 64-key blocks)."""
    import time

    triton = pytest.importorskip("triton")

    def wall_clock(fn, quantiles=None, **_):
        start = time.perf_counter()
        fn()
        ms = 1e3 * (time.perf_counter() - start)
        return [ms, ms, ms] if quantiles else ms

    pruned = []

    def tuned(module, name, kind, candidates):
        kernel = getattr(module, name)
        prune = lk.common.prune_configs(kind)

        def recording_prune(configs, named_args, **kwargs):
            pruned.append(name)
            return prune(configs, named_args, **kwargs)

        configs = [triton.Config(c, num_warps=4, num_stages=1) for c in candidates]
        autotune = triton.autotune(configs=configs, key=["D", "DV", "CAUSAL"], do_bench=wall_clock,
                                   prune_configs_by={"early_config_prune": recording_prune})
        monkeypatch.setattr(module, name, autotune(kernel.fn))

    blocks = [{"BLOCK_M": 32, "BLOCK_N": 64}, {"BLOCK_M": 64, "BLOCK_N": 32}]
    tuned(lk.fwd_bwd, "lorentz_attention_fwd_kernel", "fwd", blocks)
    tuned(lk.fwd_bwd, "lorentz_attention_bwd_dkdv_kernel", "dkdv", blocks)
    tuned(lk.fwd_bwd, "lorentz_attention_bwd_dq_kernel", "dq", blocks)
    tuned(lk.decode, "lorentz_attention_decode_split_kernel", "fwd", [{"BLOCK_N": 32}, {"BLOCK_N": 64}])

    gen = torch.Generator().manual_seed(8)
    B, H, T, d = 2, 2, 63, 16
    q = lift(torch.randn(B, H, T, d, generator=gen) * 0.4, k=1.0)
    kk = lift(torch.randn(B, H, T, d, generator=gen) * 0.4, k=1.0)
    u = torch.randn(B, H, T, d, generator=gen) * 0.4
    am = torch.ones(B, T, dtype=torch.long)
    am[1, :6] = 0
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[:, 40:] = 1
    slopes = torch.tensor([0.5, 0.25])
    do = torch.randn(B, H, T, 1 + d, generator=gen)

    def run(fn, dtype, device):
        leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, kk, u)]
        out = fn(*leaves[:2], lift(leaves[2], k=1.0), am.to(device), seg.to(device), slopes.to(device, dtype))
        return (out, *torch.autograd.grad(out, leaves, do.to(device, out.dtype)))

    ref = run(lambda a, b, v, m, s, sl: lorentz_attention(a, b, v, k=1.0, tau=1.3, attention_mask=m, segment_ids=s,
                                                          alibi_slopes=sl, impl="eager"), torch.float64, "cpu")
    ours = run(lambda a, b, v, m, s, sl: lk.lorentz_flash_attention(a, b, v, k=1.0, tau=1.3, attention_mask=m,
                                                                    segment_ids=s, alibi_slopes=sl),
               torch.float32, DEVICE)
    for name, o, r in zip(["out", "dq", "dk", "du"], ours, ref, strict=True):
        assert_close(o, r, rtol=1e-4, msg=name)
    with torch.no_grad():
        dec = lk.lorentz_decode_attention(q[:, :, -2:].to(DEVICE), kk.to(DEVICE), lift(u, k=1.0).to(DEVICE), k=1.0,
                                          tau=1.3, attention_mask=am.to(DEVICE), segment_ids=seg.to(DEVICE),
                                          alibi_slopes=slopes.to(DEVICE))
    assert_close(dec, ref[0][:, :, -2:], rtol=1e-4)
    assert sorted(set(pruned)) == ["lorentz_attention_bwd_dkdv_kernel", "lorentz_attention_bwd_dq_kernel",
                                   "lorentz_attention_decode_split_kernel", "lorentz_attention_fwd_kernel"]


BLOCK_PAIRS = [(m, n) for m in (32, 64, 128) for n in (32, 64, 128)]


@pytest.mark.parametrize("block_m, block_n", BLOCK_PAIRS, ids=[f"{m}x{n}" for m, n in BLOCK_PAIRS])
def test_dq_of_padded_rows_counts_each_key_once_for_every_block_pair(lk, monkeypatch, block_m, block_n):
    """Rows whose mask keeps no key (left padding) attend to every key: the dq kernel's second pass over the keys
    past the causal horizon must start where the first pass's last key block ended, not at the horizon itself
    (keys in between were counted twice: dq 6.6% off fp64 at 64 x 64, Tq = 70 < Tk = 100, 40 padding tokens). 128-row
    blocks get a longer problem, whose horizon falls inside a key block too."""
    import triton

    kernel = lk.fwd_bwd.lorentz_attention_bwd_dq_kernel
    one = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4, num_stages=1)
    monkeypatch.setattr(lk.fwd_bwd, "lorentz_attention_bwd_dq_kernel",
                        triton.autotune(configs=[one], key=["D", "DV", "CAUSAL"])(kernel.fn))
    gen = torch.Generator().manual_seed(3)
    (Tq, Tk, padding), B, H, d = (70, 100, 40) if block_m < 128 else (150, 200, 80), 2, 2, 8
    q = lift(torch.randn(B, H, Tq, d, generator=gen) * 0.4, k=1.0)
    kk = lift(torch.randn(B, H, Tk, d, generator=gen) * 0.4, k=1.0)
    u = torch.randn(B, H, Tk, d, generator=gen) * 0.4
    am = torch.ones(B, Tk, dtype=torch.long)
    am[1, :padding] = 0
    do = torch.randn(B, H, Tq, 1 + d, generator=gen)

    def run(fn, dtype, device):
        leaves = [t.detach().to(device, dtype).requires_grad_() for t in (q, kk, u)]
        out = fn(*leaves[:2], lift(leaves[2], k=1.0), attention_mask=am.to(device), k=1.0, tau=1.3)
        return (out, *torch.autograd.grad(out, leaves, do.to(device, out.dtype)))

    ref = run(lambda *a, **kw: lorentz_attention(*a, **kw, impl="eager"), torch.float64, "cpu")
    ours = run(lk.lorentz_flash_attention, torch.float32, DEVICE)
    for name, o, r in zip(["out", "dq", "dk", "du"], ours, ref, strict=True):
        assert_close(o, r, rtol=1e-4, msg=name)


def test_split_value_products_keep_fp32_accuracy(lk):
    """The value side's fp32 products run as six bf16 dots of three-part splits (common._dot_v): as close to fp64
    as torch's fp32 matmul, and far closer than one bf16 dot."""
    from tests.ops.lorentz_attention_triton.split_product import product_kernel

    gen = torch.Generator().manual_seed(11)
    a, b = torch.randn(64, 128, generator=gen), torch.randn(128, 32, generator=gen) * 3.0
    exact = a.double() @ b.double()
    errors = {}
    for split in (True, False):
        out = torch.empty(64, 32, device=DEVICE)
        bf16 = not split
        product_kernel[(1,)](a.to(DEVICE, torch.bfloat16 if bf16 else torch.float32),
                       b.to(DEVICE, torch.bfloat16 if bf16 else torch.float32), out, M=64, K=128, N=32, SPLIT=split)
        errors[split] = relative_error(out.cpu(), exact)
    assert errors[True] <= 2 * relative_error(a @ b, exact), errors
    assert errors[False] > 100 * errors[True], errors


def test_autotuned_choices_persist_across_processes(lk):
    """Every autotuned kernel keeps its timings in Triton's cache directory (``cache_results``, Triton >= 3.4), so
    a new process reuses them instead of timing every candidate again (issue 35 item 5). Triton ignores the option
    in the interpreter, so the decorators themselves are read."""
    import ast
    import inspect

    decorators = [node for module in (lk.fwd_bwd, lk.decode) for node in ast.walk(ast.parse(inspect.getsource(module)))
                  if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "autotune"]
    assert len(decorators) == 4
    assert all(any(k.arg == "cache_results" and k.value.value is True for k in call.keywords) for call in decorators)


def test_the_layers_share_one_mask_groups_with_the_kernel(lk, monkeypatch):
    """The keys' groups (documents and padding, for the value centres) and the kernel's id rows (documents, padding
    and document spans) come from the model's one mask (``AttentionMask.groups``, ``.kernel_ids``, computed once per
    forward), not recomputed in every layer: segmented scans of small ops that each layer would otherwise launch
    again."""
    import helm.ops.attention as attention

    calls = {"mask": 0, "kernel": 0, "ids": 0}
    for module, attr, name in ((attention, "key_groups", "mask"), (lk.common, "key_groups", "kernel"),
                               (lk.common, "kernel_ids", "ids")):
        real = getattr(module, attr)
        monkeypatch.setattr(module, attr,
                            lambda *a, _real=real, _name=name: calls.__setitem__(_name, calls[_name] + 1) or _real(*a))
    model = tiny_model("helm_d", train=True, num_hidden_layers=3, vocab_size=64,
                       model_kwargs={"attn_implementation": "triton"})
    ids = torch.randint(3, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    _step(model, model, ids, torch.tensor([[0] * 7 + [1] * 9, [0] * 16]))
    assert calls == {"mask": 1, "kernel": 0, "ids": 1}
