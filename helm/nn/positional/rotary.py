"""Rotary encodings: ``hope`` (HELM Eq. 4) and ``rope3d`` (3D-RPE, seed 002 Eq. 4–5).

Rotation angles never pass through a large fp32 product ``p·θ`` (whose rounding, ``ulp(65536) ≈ 0.008`` rad,
would break Prop. 4.1 at long range): positions are split into base-256 digits and the angle is assembled
from per-digit ``cos``/``sin`` tables built in float64, so angles are accurate to a few fp32 ulps for every
position ``|p| < 2^32`` (derivation in ``POSITIONAL.md``).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ..validation import check, check_dim, greater_than, integer, positive
from .base import PositionalEncoding, PositionalTables, inverse_frequencies
from .scaling import RopeScaling

_DIGIT_BITS = 8
_NUM_DIGITS = 4  # positions are exact for |p| < 256**4 = 2**32


def check_pairs(dim: int, kind: str) -> int:
    check_dim(dim, "head_dim")
    if dim % 2:
        raise ValueError(f"head_dim must be even for {kind!r} (it acts on pairs of space dims), got {dim}")
    return dim


class AngleTable:
    """``cos(p·θ_l)``, ``sin(p·θ_l)`` for integer positions ``p`` without a large floating product.

    ``|p| = Σ_k d_k 256^k`` with digits ``d_k < 256``; ``cos/sin(d·256^k·θ_l)`` are tabulated in float64
    (argument reduced mod 2π) and combined by angle addition, ``e^{i p θ} = Π_k e^{i d_k 256^k θ}``, in the
    working dtype; ``sin`` takes the sign of ``p``. The error is a few ulps of the working dtype whatever
    ``p`` (exact for ``|p| < 2^32``), so ``R_{p+s}`` and ``R_p`` differ by the same rounding everywhere and
    Prop. 4.1 holds to fp32 precision at 64K positions.

    Tables live in a per-(device, dtype) cache, not in buffers: ``module.to(torch.bfloat16)`` must not round
    them, and they never enter a ``state_dict`` or the meta-device construction of ``from_pretrained``.
    """

    def __init__(self, freqs: torch.Tensor):
        self.freqs = freqs.detach().to("cpu", torch.float64)
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _tables(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        if key not in self._cache:
            digit = torch.arange(1 << _DIGIT_BITS, dtype=torch.float64, device="cpu")
            place = torch.tensor([float(1 << (_DIGIT_BITS * k)) for k in range(_NUM_DIGITS)], dtype=torch.float64,
                                 device="cpu")
            # reduce each place value's angle first so the digit product stays small and exact
            step = torch.remainder(place[:, None] * self.freqs[None, :], 2 * math.pi)  # [D, P]
            angle = torch.remainder(digit[None, :, None] * step[:, None, :], 2 * math.pi)  # [D, 256, P]
            tables = (angle.cos().to(device, dtype), angle.sin().to(device, dtype))
            if torch.compiler.is_compiling():  # built in the graph: filling the cache would recompile the next call
                return tables
            self._cache[key] = tables
        return self._cache[key]

    def __call__(self, positions: torch.Tensor, *, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [...]`` (integer) -> ``cos, sin`` of shape ``[..., P]`` in ``dtype`` (fp32 or fp64)."""
        cos_t, sin_t = self._tables(positions.device, dtype)
        mag = positions.abs()
        mask = (1 << _DIGIT_BITS) - 1
        cos = sin = None
        for k in range(_NUM_DIGITS):
            d = (mag >> (_DIGIT_BITS * k)) & mask
            c, s = cos_t[k][d], sin_t[k][d]
            if cos is None:
                cos, sin = c, s
            else:
                cos, sin = cos * c - sin * s, sin * c + cos * s
        return cos, torch.where((positions < 0).unsqueeze(-1), -sin, sin)


class HoPE(PositionalEncoding):
    """HELM Eq. 4: ``HoPE(z) = lift(R_{p,Θ} z_s)``, ``R_{p,Θ} = ⊕_l R(p θ_l)`` on interleaved pairs.

    ``θ_l = base^(-2l/d)``. ``R`` is orthogonal, so the time coordinate is unchanged and
    ``<HoPE(q_m), HoPE(k_n)>_L = -q_t k_t + q_sᵀ R((n - m)Θ) k_s`` depends on ``m - n`` only (Prop. 4.1).

    ``rope_parameters`` (a Llama rope dict, :mod:`helm.nn.positional.scaling`) replaces ``θ_l`` by the scaled
    ``θ'_l`` of ``transformers``' ``rope_type`` (and Resonance RoPE's integer wavelengths) and sets the tables'
    ``logit_scale`` to the squared attention factor; positions stay integers, so the angles stay exact. ``dynamic``
    and ``longrope`` pick the frequency set from the forward's length ``max(position_ids) + 1`` (one device read).
    """

    kind = "hope"
    rotary = True
    pairs = True
    options = {"rope_parameters": "rope_parameters"}

    def __init__(self, head_dim: int, *, base: float = 10000.0, rope_parameters: dict | None = None,
                 max_position_embeddings: int = 2048):
        super().__init__()
        self.head_dim, self.base = check_pairs(head_dim, self.kind), float(check(base, "rope_theta", positive))
        self.scaling = RopeScaling(rope_parameters, head_dim=head_dim, base=base,
                                   max_position_embeddings=max_position_embeddings, kind=self.kind)
        self.angles = AngleTable(self.scaling.frequencies())
        self._length_angles: OrderedDict[int, AngleTable] = OrderedDict()

    @classmethod
    def build(cls, *, head_dim: int, rope_theta: float = 10000.0, max_position_embeddings: int = 2048,
              rope_parameters: dict | None = None, **_):
        return cls(head_dim, base=rope_theta, rope_parameters=rope_parameters,
                   max_position_embeddings=max_position_embeddings)

    @property
    def logit_scale(self) -> float:
        """Factor on the attention logits, ``attention_factor²`` of ``yarn`` / ``longrope`` (else 1)."""
        return self.scaling.logit_scale

    def angle_table(self, position_ids: torch.Tensor) -> AngleTable:
        """The exact-angle table of this forward: one per frequency set. Length-dependent types read the length
        ``max(position_ids) + 1`` from the device, as ``transformers``' ``dynamic_rope_update`` does."""
        if not self.scaling.length_dependent:
            return self.angles
        key = self.scaling.length_key(int(position_ids.max()) + 1)
        if key == self.scaling.length_key(None):
            return self.angles
        if key not in self._length_angles:
            self._length_angles[key] = AngleTable(self.scaling.frequencies(key))
            while len(self._length_angles) > 8:
                self._length_angles.popitem(last=False)
        return self._length_angles[key]

    def angle_cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.angle_table(position_ids)(position_ids, dtype=dtype)

    def tables(self, position_ids, q_pos, k_pos, dtype) -> PositionalTables:
        cos, sin = self.angle_cos_sin(position_ids, dtype)
        return PositionalTables(cos=cos, sin=sin, logit_scale=self.logit_scale)

    def extra_repr(self) -> str:
        scaled = "" if self.scaling.rope_type == "default" and not self.scaling.resonance else \
            f", rope_parameters={self.scaling.params}"
        return f"head_dim={self.head_dim}, base={self.base:g}{scaled}"


class RoPE3D(HoPE):
    """3D-RPE (seed 002 Eq. 4) on interleaved pairs: ``R(p) = ⊕_l R((p mod c)θ_l + ψ_{⌊p/c⌋})``.

    The in-chunk angle is HoPE's at the in-chunk index ``p mod c``; the between-chunk angle is one phase
    per chunk shared by all pairs, the Bloch-sphere angle ``π/2 - φ_j`` with ``φ_j = base_c^{-j}`` of the
    paper shifted by the constant ``π/2 - φ_0`` (which cancels in every score) so that chunk 0 gets no extra
    rotation::

        ψ_j = φ_0 - φ_j = 1 - base_c^{-j}            (odd extension ψ_{-j} = -ψ_j for negative positions)

    Hence ``rope3d`` equals ``hope`` exactly for ``0 <= p < c``, and a query in chunk ``i`` at in-chunk index
    ``m`` against a key in chunk ``j`` at index ``n`` scores ``Re Σ_l z_q,l z̄_k,l e^{i((m-n)θ_l + ψ_i - ψ_j)}``
    — the paper's Eq. 5 (``ψ_i - ψ_j = φ_j - φ_i``). Norm-preserving, but not relative across chunk
    boundaries (``relative = False``).

    ``rope_parameters`` with ``rope_type="linear"`` is seed 002's linear interpolation of 3D-RPE (App. C, proof
    of Theorem 1/2): the ``n = ⌊L_p/c⌋`` chunks of the pre-training length ``L_p``
    (``original_max_position_embeddings``, default ``max_position_embeddings``) share the ``L - L_p`` extra tokens
    of the extended length ``L = ⌊factor·L_p⌋`` evenly, so the chunk size becomes ``c' = c + ⌊(L - L_p)/n⌋`` (the
    seed's ``⌊L/n⌋`` when ``c`` divides ``L_p``) and in-chunk indices run over ``0 … c'-1`` with the *unscaled*
    ``θ_l`` (resolution 1 between neighbours, the theorem's point); chunk phases are unchanged. Every other
    ``rope_type`` scales the in-chunk frequencies as for ``hope``.
    """

    kind = "rope3d"
    relative = False
    options = {"chunk_size": "rope3d_chunk_size", "chunk_base": "rope3d_chunk_base", **HoPE.options}

    def __init__(self, head_dim: int, *, base: float = 10000.0, chunk_size: int = 512,
                 chunk_base: float | None = None, rope_parameters: dict | None = None,
                 max_position_embeddings: int = 2048):
        super().__init__(head_dim, base=base, rope_parameters=rope_parameters,
                         max_position_embeddings=max_position_embeddings)
        self.chunk_size = check(chunk_size, "chunk_size", integer(1))
        self.chunk_base = float(check(base if chunk_base is None else chunk_base, "chunk_base", greater_than(1)))
        self._log_chunk_base = math.log(self.chunk_base)
        if self.scaling.interpolates_chunks:
            self.chunk_size = interpolated_chunk_size(self.chunk_size, self.scaling.params["factor"],
                                                      self.scaling.original_max_position_embeddings)

    @classmethod
    def build(cls, *, head_dim: int, rope_theta: float = 10000.0, chunk_size: int = 512,
              chunk_base: float | None = None, max_position_embeddings: int = 2048,
              rope_parameters: dict | None = None, **_):
        return cls(head_dim, base=rope_theta, chunk_size=chunk_size, chunk_base=chunk_base,
                   rope_parameters=rope_parameters, max_position_embeddings=max_position_embeddings)

    def angle_cos_sin(self, position_ids, dtype):
        in_chunk = position_ids.abs() % self.chunk_size
        chunk = position_ids.abs() // self.chunk_size
        table = self.angle_table(position_ids)
        cos, sin = table(torch.where(position_ids < 0, -in_chunk, in_chunk), dtype=dtype)
        # ψ_j = 1 - base^{-j} = -expm1(-j ln base): accurate near j = 0 and exactly 0 in chunk 0
        psi = -torch.expm1(-chunk.to(dtype) * self._log_chunk_base)
        psi = torch.where(position_ids < 0, -psi, psi).unsqueeze(-1)
        cp, sp = psi.cos(), psi.sin()
        return cos * cp - sin * sp, sin * cp + cos * sp

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}, chunk_base={self.chunk_base:g}"


def interpolated_chunk_size(chunk_size: int, factor: float, original_max_position_embeddings: int) -> int:
    """3D-RPE's chunk size after linear interpolation by ``factor`` (seed 002, App. C).

    ``n = ⌊L_p/c⌋`` chunks cover the pre-training length ``L_p``; the extended length ``L = ⌊factor·L_p⌋`` adds
    ``L - L_p`` tokens, spread evenly over the ``n`` chunks: ``c' = c + ⌊(L - L_p)/n⌋``. With ``factor = 1``,
    ``c' = c``. Needs ``c <= L_p`` (at least one chunk in the pre-training length)."""
    if chunk_size > original_max_position_embeddings:
        raise ValueError(f"rope3d_chunk_size (chunk_size) = {chunk_size} must be <= rope_parameters"
                         f"['original_max_position_embeddings'] = {original_max_position_embeddings} for 3D-RPE's "
                         "linear interpolation (it spreads the extra tokens over the ⌊L_p/c⌋ chunks of the "
                         "pre-training length L_p)")
    n = original_max_position_embeddings // chunk_size
    extended = math.floor(factor * original_max_position_embeddings)
    return chunk_size + (extended - original_max_position_embeddings) // n


__all__ = ["AngleTable", "HoPE", "RoPE3D", "check_pairs", "interpolated_chunk_size"]
