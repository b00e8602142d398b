"""Fused Lorentz (distance-based) attention: FlashAttention-style forward/backward and a decoding kernel.

Importing this package imports triton; set ``TRITON_INTERPRET=1`` *before* importing it to run the kernels
on CPU in the Triton interpreter.
"""

from .decode import lorentz_decode_attention
from .fwd_bwd import lorentz_flash_attention
from .naive import naive_lorentz_attention

__all__ = ["lorentz_flash_attention", "lorentz_decode_attention", "naive_lorentz_attention"]
