"""Fused Lorentz (distance-based) attention in Triton: FlashAttention-style forward/backward and a split-K decoding
kernel, registered as the ``torch.library`` custom ops ``helm::lorentz_attention_fwd``, ``helm::lorentz_attention_bwd``
and ``helm::lorentz_attention_decode``.

Not imported by ``import helm``: :mod:`helm.ops.attention` loads it lazily for ``impl="triton"``. Importing it
imports triton; set ``TRITON_INTERPRET=1`` *before* triton is first imported to run the kernels on CPU in the
Triton interpreter. (Named ``lorentz_attention_triton``, not ``lorentz_attention``: a subpackage of that name
would replace the function :func:`helm.ops.lorentz_attention` as an attribute of :mod:`helm.ops` once imported.)
"""

from .decode import lorentz_decode_attention
from .fwd_bwd import lorentz_flash_attention
from .naive import naive_lorentz_attention

__all__ = ["lorentz_flash_attention", "lorentz_decode_attention", "naive_lorentz_attention"]
