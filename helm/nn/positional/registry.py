"""The vocabulary of positional encodings: name -> class. A new encoding is one new file and one line here
(or a :func:`register_positional_encoding` call); configs, models and layers read kinds from this table."""

from __future__ import annotations

from .alibi import ALiBi
from .base import NoPositionalEncoding, PositionalEncoding
from .bipe import BiPEALiBi, BiPEHoPE
from .boost import HoPEBoost
from .learned import LearnedPositionalEncoding
from .rotary import HoPE, RoPE3D
from .sinusoidal import SinusoidalPositionalEncoding

POSITIONAL_ENCODINGS: dict[str, type[PositionalEncoding]] = {
    "hope": HoPE,
    "learned": LearnedPositionalEncoding,
    "none": NoPositionalEncoding,
    "alibi": ALiBi,
    "rope3d": RoPE3D,
    "hope_boost": HoPEBoost,
    "sinusoidal": SinusoidalPositionalEncoding,
    "bipe_hope": BiPEHoPE,
    "bipe_alibi": BiPEALiBi,
}


def register_positional_encoding(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
    """Add ``cls`` under ``cls.kind`` (usable as a class decorator); its properties are its class attributes."""
    if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
        raise TypeError(f"a positional encoding must subclass PositionalEncoding, got {cls!r}")
    POSITIONAL_ENCODINGS[cls.kind] = cls
    return cls


def positional_encoding_class(name: str) -> type[PositionalEncoding]:
    if name not in POSITIONAL_ENCODINGS:
        raise ValueError(f"positional encoding name must be one of {tuple(POSITIONAL_ENCODINGS)}, got {name!r}")
    return POSITIONAL_ENCODINGS[name]


def build_positional_encoding(name: str, *, head_dim: int, num_heads: int, max_position_embeddings: int,
                              rope_theta: float = 10000.0, **options) -> PositionalEncoding:
    """Build the positional encoding ``name``.

    Args:
        head_dim: number of *space* dims per head that get the encoding (even for kinds that act on pairs);
            ``absolute`` kinds take the model's space dim ``n`` as ``hidden_space_dim`` (default ``head_dim``).
        num_heads: heads of the attention (ALiBi slopes).
        max_position_embeddings: table size of ``learned``.
        rope_theta: base of the rotary angles (``hope``, ``rope3d``, ``hope_boost``).
        options: the kind's own options, listed in its class attribute ``options`` —
            ``rope3d``: ``chunk_size`` (512), ``chunk_base`` (> 1, default ``rope_theta``);
            ``hope_boost``: ``theta_prime`` (> max θ_l = angle_scale, default ``1.1·angle_scale``),
            ``angle_scale`` (1.0), ``learnable_decay`` (False);
            ``learned``: ``hidden_space_dim`` (default ``head_dim``), ``init_std`` (0.02);
            ``sinusoidal``: ``hidden_space_dim`` (default ``head_dim``), ``scale`` (1.0);
            ``bipe_hope``, ``bipe_alibi``: ``segment_length`` (32), ``hidden_space_dim`` (default ``head_dim``),
            ``init_std`` (0.02).

    Raises:
        ValueError: unknown ``name`` or option, or an invalid value; the message names the argument.
    """
    from ..validation import check_dim, check_positive

    cls = positional_encoding_class(name)
    check_dim(head_dim, "head_dim")
    check_dim(num_heads, "num_heads")
    check_dim(max_position_embeddings, "max_position_embeddings")
    check_positive(rope_theta, "rope_theta")
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for positional encoding {name!r}; accepted options: "
                         f"{tuple(cls.options) or 'none'}")
    return cls.build(head_dim=head_dim, num_heads=num_heads, max_position_embeddings=max_position_embeddings,
                     rope_theta=rope_theta, **options)


__all__ = ["POSITIONAL_ENCODINGS", "build_positional_encoding", "positional_encoding_class",
           "register_positional_encoding"]
