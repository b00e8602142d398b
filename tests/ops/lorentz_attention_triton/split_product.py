"""A one-block kernel around the value side's split product (``common._dot_v``), imported by the test once the
kernel package is loaded for this machine (interpreted on a CPU)."""

import triton
import triton.language as tl

from helm.ops.lorentz_attention_triton.common import INTERPRET, _dot_v


@triton.jit
def product_kernel(A, B, OUT, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, SPLIT: tl.constexpr):
    """``OUT [M, N] = A [M, K] @ B [K, N]``, row-major, through ``_dot_v``."""
    o_m, o_k, o_n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(A + o_m[:, None] * K + o_k[None, :])
    b = tl.load(B + o_k[:, None] * N + o_n[None, :])
    tl.store(OUT + o_m[:, None] * N + o_n[None, :], _dot_v(a, b, INTERPRET, SPLIT))
