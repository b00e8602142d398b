"""Issue 11, item 7 for the Triton kernel: fp32 kernel vs fp64 eager on the same fp32 inputs, with queries, keys
and values far from the origin (space norms 1 to 1e4). Same scenarios and bound as
``tests/reliability/test_numerics.py`` (which covers eager and sdpa); run in the interpreter on CPU."""

import pytest
import torch

from helm.ops import lorentz_attention
from tests.helpers import assert_close
from tests.ops.lorentz_attention_triton.device import DEVICE
from tests.reliability.test_numerics import ATTN_KINDS, ATTN_TOL, K, NORM_IDS, NORMS, TAU, _attention_inputs


@pytest.mark.parametrize("path", ["fwd", "decode"])
@pytest.mark.parametrize("r", NORMS, ids=NORM_IDS)
@pytest.mark.parametrize("kind", ATTN_KINDS)
def test_kernel_far_from_origin(lk, kind, r, path):
    q, k, v = (t.float() for t in _attention_inputs(kind, r))
    ref = lorentz_attention(q.double(), k.double(), v.double(), k=K, tau=TAU, impl="eager")
    q, k, v = (t.to(DEVICE) for t in (q, k, v))
    if path == "fwd":  # gradients requested: the forward kernel (Tq = 16 without gradients goes to decode)
        q.requires_grad_()
        out = lk.lorentz_flash_attention(q, k, v, k=K, tau=TAU)
    else:
        out = lk.lorentz_decode_attention(q, k, v, k=K, tau=TAU)
    assert_close(out.detach().cpu(), ref, rtol=ATTN_TOL, msg=f"triton {path} {kind} at |x_s| = {r:g}")


@pytest.mark.parametrize("kind", ["cluster"])
def test_kernel_gradients_match_eager_far_from_origin(lk, kind):
    """Outputs and gradients of the kernel against eager in fp32 at |x_s| = 1e3 (padding and packing on, so the
    per-document centres are exercised). Only the clustered values: with a saturated softmax ("all") the exact
    query/key gradients are ~0 and both paths return rounding noise of different sizes, and with spread far
    values ("values") the kernel's FlashAttention-style ``δ = dD·D + dE E`` loses ~1e-5·|v|² relative accuracy
    in dq (a known limit, see the report of issue 11 item 7)."""
    q, k, v = (t.float() for t in _attention_inputs(kind, 1e3))
    seg = torch.tensor([[0] * 7 + [1] * 9])
    am = torch.ones(1, 16, dtype=torch.long)
    am[0, :2] = 0
    res = {}
    for impl in ("eager", "triton"):
        leaves = [t.detach().to(DEVICE).requires_grad_() for t in (q, k, v)]
        out = lorentz_attention(*leaves, k=K, tau=TAU, impl=impl, segment_ids=seg.to(DEVICE),
                                attention_mask=am.to(DEVICE))
        weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
        res[impl] = (out, torch.autograd.grad((out * weights).sum(), leaves))
    (o_e, g_e), (o_t, g_t) = res["eager"], res["triton"]
    assert_close(o_t.cpu(), o_e.cpu(), rtol=ATTN_TOL)
    for name, a, b in zip("qkv", g_t, g_e):
        assert_close(a.cpu(), b.cpu(), rtol=1e-3, msg=f"grad {name}")
