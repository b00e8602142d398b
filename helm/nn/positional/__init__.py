"""Positional encodings for Lorentz attention (derivations and the property each keeps in ``POSITIONAL.md`` here).

A model owns one :class:`PositionalEncoding` and calls it once per forward; the returned
:class:`PositionalTables` go to every attention layer, which applies them:

* ``rotate`` — on the *space parts* of queries and keys before the time coordinate is recomputed. Rotary
  kinds return ``R_p x_s`` with ``R_p`` orthogonal, so ``lift(R_p x_s)`` is a Lorentz rotation
  ``diag(1, R_p)·lift(x_s)`` (time coordinate unchanged).
* ``alibi_slopes`` / ``score_bias`` — additive terms on the final logits ``scale·<q, k>_L`` (``scale = 2/τ``).

``learned`` and ``sinusoidal`` are ``absolute``: the model adds their table to the token embeddings (``embed``)
instead. The BiPE kinds are both: an intra-segment table on the embeddings and an inter-segment encoding in attention.

========== ======================================================================= ========== =============
kind       what it does                                                            relative   acts through
========== ======================================================================= ========== =============
hope       HELM Eq. 4: RoPE on interleaved pairs of the space part                 yes        rotate
learned    absolute learned table added to the token space parts (HELM-D-L)        no         embed
none       nothing                                                                 yes        —
alibi      ``-slope_h·(m - n)`` on the logits (Press et al.)                       yes        alibi_slopes
rope3d     3D-RPE (seed 002 Eq. 4): in-chunk RoPE + per-chunk Bloch-sphere phase  no         rotate
hope_boost seed 000: damped Lorentz boost ``e^{-|Δ|θ'} B(Δθ)`` on the space form   yes        score_bias
sinusoidal seeds 001/004: ``x_s + α·PE(p)``, interleaved ``sin, cos(p ω_i)``       no         embed
bipe_hope  BiPE (seed 000): table at ``p mod L`` + HoPE at segment ``⌊p/L⌋``       no         embed, rotate
bipe_alibi BiPE (seed 000): table at ``p mod L`` + ALiBi (96× slopes) on segments  no         embed, score_bias
========== ======================================================================= ========== =============

Files: ``base`` (the protocol and the tables), ``rotary`` (hope, rope3d), ``alibi``, ``boost`` (hope_boost),
``learned``, ``sinusoidal``, ``bipe`` (bipe_hope, bipe_alibi), ``registry`` (the vocabulary of kinds).
"""

from .alibi import ALiBi, alibi_bias, alibi_slopes
from .base import NoPositionalEncoding, PositionalEncoding, PositionalTables, index_positions, inverse_frequencies
from .bipe import BiPE, BiPEALiBi, BiPEHoPE
from .boost import HoPEBoost, hope_boost_bias
from .learned import LearnedPositionalEncoding
from .registry import (
    POSITIONAL_ENCODINGS,
    build_positional_encoding,
    positional_encoding_class,
    register_positional_encoding,
)
from .rotary import HoPE, RoPE3D
from .sinusoidal import SinusoidalPositionalEncoding

__all__ = [
    "POSITIONAL_ENCODINGS",
    "ALiBi",
    "BiPE",
    "BiPEALiBi",
    "BiPEHoPE",
    "HoPE",
    "HoPEBoost",
    "LearnedPositionalEncoding",
    "NoPositionalEncoding",
    "PositionalEncoding",
    "PositionalTables",
    "RoPE3D",
    "SinusoidalPositionalEncoding",
    "alibi_bias",
    "alibi_slopes",
    "build_positional_encoding",
    "hope_boost_bias",
    "index_positions",
    "inverse_frequencies",
    "positional_encoding_class",
    "register_positional_encoding",
]
