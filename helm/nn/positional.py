"""Positional encodings for Lorentz attention (shared/DESIGN.md §5; derivations in ``POSITIONAL.md``).

Every encoding is a :class:`PositionalEncoding` with three hooks the attention and the embedding call:

* ``rotate(x_s, position_ids)`` — applied to the *space parts* of queries and keys before the time coordinate
  is recomputed. Rotary kinds return ``R_p x_s`` with ``R_p`` orthogonal, so ``lift(R_p x_s)`` is a Lorentz
  rotation ``diag(1, R_p)·lift(x_s)`` (time coordinate unchanged). Identity for the other kinds.
* ``score_bias(q_s, k_s, q_pos, k_pos, *, scale)`` — an additive term on the final logits
  ``scale·<q, k>_L`` (``scale = 2/τ``), or ``None``.
* ``embed(x_s, position_ids)`` — absolute position embeddings added to token space parts (``learned`` only).

Kinds (``POSITIONAL_ENCODINGS``):

========== ======================================================================= ========== ==========
kind       what it does                                                            relative   hook
========== ======================================================================= ========== ==========
hope       HELM Eq. 4: RoPE on interleaved pairs of the space part                 yes        rotate
learned    absolute learned table added to the token space parts (HELM-D-L)        no         embed
none       nothing                                                                 yes        —
alibi      ``-slope_h·(m - n)`` on the logits (Press et al.)                       yes        score_bias
rope3d     3D-RPE (seed 002 Eq. 4): in-chunk RoPE + per-chunk Bloch-sphere phase  no         rotate
hope_boost seed 000: damped Lorentz boost ``e^{-|Δ|θ'} B(Δθ)`` on the space form   yes        score_bias
========== ======================================================================= ========== ==========

Rotation angles never pass through a large fp32 product ``p·θ`` (whose rounding, ``ulp(65536) ≈ 0.008`` rad,
would break Prop. 4.1 at long range): positions are split into base-256 digits and the angle is assembled
from per-digit ``cos``/``sin`` tables built in float64, so angles are accurate to a few fp32 ulps for every
position ``|p| < 2^32``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._checks import check_choice, check_dim, check_positive

__all__ = [
    "POSITIONAL_ENCODINGS",
    "ALiBi",
    "HoPE",
    "HoPEBoost",
    "LearnedPositionalEncoding",
    "NoPositionalEncoding",
    "PositionalEncoding",
    "RoPE3D",
    "alibi_bias",
    "alibi_slopes",
    "build_positional_encoding",
    "hope_boost_bias",
    "rope_frequencies",
    "rotate_pairs",
]

POSITIONAL_ENCODINGS = ("hope", "learned", "none", "alibi", "rope3d", "hope_boost")

Scale = torch.Tensor | float

_DIGIT_BITS = 8
_NUM_DIGITS = 4  # positions are exact for |p| < 256**4 = 2**32
_BOOST_CHANNELS_PER_SEGMENT = 8
_MIN_DECAY_GAP = 1e-4  # learnable θ' >= (1 + 1e-4)·max θ_l


# ----------------------------------------------------------------------------------------------------------
# pure functions
# ----------------------------------------------------------------------------------------------------------


def rope_frequencies(head_dim: int, base: float, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """RoPE angles ``θ_l = base^(-2l/d)`` for ``l = 0 .. d/2 - 1`` (so ``max θ_l = θ_0 = 1``). Shape ``[d/2]``."""
    exponents = torch.arange(0, head_dim // 2, dtype=torch.float64, device="cpu") * (-2.0 / head_dim)
    return torch.pow(torch.tensor(float(base), dtype=torch.float64, device="cpu"), exponents).to(dtype)


def alibi_slopes(num_heads: int) -> tuple[float, ...]:
    """ALiBi head slopes (Press et al.): ``2^(-8h/n)`` for ``h = 1..n`` when ``n`` is a power of two.

    Otherwise the slopes of the largest power of two ``p < n`` followed by every other slope of ``2p``
    (the reference implementation's rule), so slopes stay a geometric-like spread in ``(0, 1)``.
    """

    def power_of_two(n: int) -> list:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if num_heads & (num_heads - 1) == 0:
        return tuple(power_of_two(num_heads))
    p = 1 << (num_heads.bit_length() - 1)
    return tuple(power_of_two(p) + power_of_two(2 * p)[0::2][: num_heads - p])


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x_{2l}, x_{2l+1})`` by the angle whose cosine/sine are given.

    ``[x_{2l}, x_{2l+1}] ↦ [x_{2l} cos - x_{2l+1} sin, x_{2l} sin + x_{2l+1} cos]`` (RoFormer / HELM Eq. 4).
    Shapes: ``x [..., T, d]``, ``cos, sin`` broadcastable to ``[..., T, d/2]``; returns ``[..., T, d]`` in
    the dtype of ``x · cos``.
    """
    pairs = x.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def alibi_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
    """ALiBi logits bias ``b[b, h, i, j] = -slope_h · (q_pos[b, i] - k_pos[b, j])``.

    Shapes: ``q_pos [B, Tq]``, ``k_pos [B, Tk]`` (integers), ``slopes [H]`` -> ``[B, H, Tq, Tk]`` in the
    dtype of ``slopes``. Keys after the query (``Δ < 0``) get a positive bias; the causal mask removes them.
    """
    delta = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)).to(slopes.dtype)
    return -slopes.view(-1, 1, 1) * delta.unsqueeze(-3)


def _light_cone(x: torch.Tensor) -> torch.Tensor:
    """Per interleaved pair ``(a, b)`` the light-cone coordinates ``u = (a+b)/√2``, ``v = (a-b)/√2``.

    An orthogonal change of basis in which the boost ``B(φ) = [[cosh φ, sinh φ], [sinh φ, cosh φ]]`` is
    diagonal, ``diag(e^{φ}, e^{-φ})``. Shapes ``[..., d] -> [..., d]`` laid out ``[u_0..u_{d/2-1},
    v_0..v_{d/2-1}]``.
    """
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.cat((a + b, a - b), dim=-1) * math.sqrt(0.5)


def _boost_segment(xq: torch.Tensor, xk: torch.Tensor, dist: torch.Tensor, forward: torch.Tensor,
                   rate_fwd: torch.Tensor, rate_bwd: torch.Tensor) -> torch.Tensor:
    """``Σ_c expm1(-|Δ| r_c(Δ)) · xq_c xk_cᵀ`` over the channels of one segment, one channel at a time.

    Looping keeps the working set at a few ``[B, H, Tq, Tk]`` tensors instead of ``[B, H, Tq, Tk, d]``.
    """
    out = None
    for c in range(xq.shape[-1]):
        weight = torch.expm1(-dist * torch.where(forward, rate_fwd[c], rate_bwd[c]))
        term = weight * (xq[..., c].unsqueeze(-1) * xk[..., c].unsqueeze(-2))
        out = term if out is None else out + term
    return out


def hope_boost_bias(q_s: torch.Tensor, k_s: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
                    freqs: torch.Tensor, theta_prime: torch.Tensor | float, scale: Scale,
                    checkpoint_segments: bool | None = None) -> torch.Tensor:
    """Logits bias that turns the plain space form into the damped-boost form of seed 000 (Eq. 9).

    With ``Δ = q_pos - k_pos``, per interleaved pair ``l`` (angle ``θ_l``, damping ``θ' > max θ_l``)::

        M_l(Δ) = e^{-|Δ|θ'} B(Δθ_l),            B(φ) = [[cosh φ, sinh φ], [sinh φ, cosh φ]]
        bias   = scale · (q_sᵀ M(Δ) k_s - q_s·k_s)
               = scale · Σ_l Σ_{σ=±1} expm1(-|Δ|θ' + σΔθ_l) · w^σ_{q,l} w^σ_{k,l}

    where ``w^+ = (a+b)/√2``, ``w^- = (a-b)/√2`` are the light-cone coordinates of the pair ``(a, b)``. Every
    exponent is ``<= -|Δ|(θ' - θ_l) <= 0``, so each weight lies in ``[-1, 0]``: finite for any distance,
    exactly zero at ``Δ = 0``, and a function of ``Δ`` alone (relative). For ``Δ >= 0`` this is seed 000's
    ``e^{-(m-n)θ'} q B(θ, m-n) k`` exactly; for ``Δ < 0`` (keys after the query) the damping uses ``|Δ|``,
    where the seed's factor ``e^{(n-m)θ'}`` would overflow — those entries are causally masked anyway.

    Shapes: ``q_s [B, H, Tq, d]``, ``k_s [B, H or 1, Tk, d]``, ``q_pos [B, Tq]``, ``k_pos [B, Tk]`` (integer),
    ``freqs [d/2]`` (``θ_l``), ``theta_prime`` scalar (float or 0-dim tensor, may require grad), ``scale``
    broadcastable to ``[B, H, Tq, Tk]``. Returns ``[B, H, Tq, Tk]`` in ``promote(q_s.dtype, fp32)``.

    When gradients are recorded, channel segments are checkpointed (recomputed in backward) so autograd keeps
    ``O(B·H·Tq·Tk)`` memory rather than one ``[B, Tq, Tk]`` weight per channel; ``checkpoint_segments``
    overrides that choice.
    """
    acc = torch.promote_types(q_s.dtype, torch.float32)
    xq = _light_cone(q_s.to(acc))
    xk = _light_cone(k_s.to(acc))
    # integer difference first, so Δ (hence the bias) is bit-identical for shifted positions; exact in fp32
    # for |Δ| < 2^24
    delta = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)).unsqueeze(-3).to(acc)  # [B, 1, Tq, Tk]
    forward = delta >= 0
    dist = delta.abs()
    freqs = freqs.to(device=xq.device, dtype=acc)
    theta_p = theta_prime.to(device=xq.device, dtype=acc) if isinstance(theta_prime, torch.Tensor) else theta_prime
    signed = torch.cat((freqs, -freqs))  # σ θ_l for the u (σ=+1) then v (σ=-1) channels
    rate_fwd = theta_p - signed  # exponent -Δ(θ' - σθ_l) for Δ >= 0
    rate_bwd = theta_p + signed  # exponent -|Δ|(θ' + σθ_l) for Δ < 0
    if checkpoint_segments is None:
        checkpoint_segments = torch.is_grad_enabled() and any(
            t.requires_grad for t in (xq, xk, rate_fwd) if isinstance(t, torch.Tensor))
    out = None
    for c0 in range(0, xq.shape[-1], _BOOST_CHANNELS_PER_SEGMENT):
        seg = slice(c0, c0 + _BOOST_CHANNELS_PER_SEGMENT)
        args = (xq[..., seg], xk[..., seg], dist, forward, rate_fwd[seg], rate_bwd[seg])
        part = checkpoint(_boost_segment, *args, use_reentrant=False) if checkpoint_segments else _boost_segment(*args)
        out = part if out is None else out + part
    return out * scale


# ----------------------------------------------------------------------------------------------------------
# exact rotation angles for integer positions
# ----------------------------------------------------------------------------------------------------------


class _AngleTable:
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
            self._cache[key] = (angle.cos().to(device, dtype), angle.sin().to(device, dtype))
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


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (gradcheck, references); everything else rotates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_position_ids(x: torch.Tensor, position_ids: torch.Tensor, name: str = "position_ids") -> None:
    """Static checks only (dtype/shape): no host synchronisation."""
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise TypeError(f"{name} must be an integer tensor (int64), got {position_ids.dtype}")
    if position_ids.dim() != 2 or position_ids.shape[-1] != x.shape[-2]:
        raise ValueError(f"{name} must have shape [B, T] with T = {x.shape[-2]} (the token dim of the input), "
                         f"got {tuple(position_ids.shape)}")


def _per_token(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B, T, P]`` -> ``[B, 1, ..., 1, T, P]`` so it broadcasts over the head dims of ``x [B, ..., T, d]``."""
    return table.reshape(table.shape[0], *([1] * (x.dim() - 3)), *table.shape[1:])


# ----------------------------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------------------------


class PositionalEncoding(nn.Module):
    """Base class: identity ``rotate`` and ``embed``, no score bias.

    Attributes:
        kind: the registry name.
        relative: True if the attention logits depend on positions only through ``m - n``.
        max_positions: the largest position + 1 the encoding accepts, or None if unbounded.
        has_score_bias: whether :meth:`score_bias` can return a tensor (so callers can pick a fused path).
    """

    kind: str = "none"
    relative: bool = True
    max_positions: int | None = None
    has_score_bias: bool = False

    def rotate(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Space parts ``[B, H, T, d]`` (``H`` may be 1), ``position_ids [B, T]`` -> ``[B, H, T, d]``."""
        return x_s

    def score_bias(self, q_s: torch.Tensor, k_s: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, *,
                   scale: Scale) -> torch.Tensor | None:
        """Additive bias ``[B, H, Tq, Tk]`` on the logits ``scale·<q, k>_L``, or None."""
        return None

    def embed(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token space parts ``[B, T, n]`` -> ``[B, T, n]`` (the caller lifts)."""
        return x_s


class NoPositionalEncoding(PositionalEncoding):
    """``none``: no positional information at all (scores are trivially relative)."""

    kind = "none"


class HoPE(PositionalEncoding):
    """HELM Eq. 4: ``HoPE(z) = lift(R_{p,Θ} z_s)``, ``R_{p,Θ} = ⊕_l R(p θ_l)`` on interleaved pairs.

    ``θ_l = base^(-2l/d)``. ``R`` is orthogonal, so the time coordinate is unchanged and
    ``<HoPE(q_m), HoPE(k_n)>_L = -q_t k_t + q_sᵀ R((n - m)Θ) k_s`` depends on ``m - n`` only (Prop. 4.1).
    """

    kind = "hope"
    relative = True

    def __init__(self, head_dim: int, *, base: float = 10000.0):
        super().__init__()
        self.head_dim, self.base = head_dim, float(base)
        self.angles = _AngleTable(rope_frequencies(head_dim, base))

    def _cos_sin(self, x_s: torch.Tensor, position_ids: torch.Tensor):
        _check_position_ids(x_s, position_ids)
        return self.angles(position_ids.to(x_s.device), dtype=_work_dtype(x_s.dtype))

    def rotate(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self._cos_sin(x_s, position_ids)
        out = rotate_pairs(x_s.to(cos.dtype), _per_token(cos, x_s), _per_token(sin, x_s))
        return out.to(x_s.dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"


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
    """

    kind = "rope3d"
    relative = False

    def __init__(self, head_dim: int, *, base: float = 10000.0, chunk_size: int = 512,
                 chunk_base: float | None = None):
        super().__init__(head_dim, base=base)
        self.chunk_size = chunk_size
        self.chunk_base = float(base if chunk_base is None else chunk_base)
        self._log_chunk_base = math.log(self.chunk_base)

    def _cos_sin(self, x_s: torch.Tensor, position_ids: torch.Tensor):
        _check_position_ids(x_s, position_ids)
        pos = position_ids.to(x_s.device)
        dtype = _work_dtype(x_s.dtype)
        in_chunk = pos.abs() % self.chunk_size
        chunk = pos.abs() // self.chunk_size
        cos, sin = self.angles(torch.where(pos < 0, -in_chunk, in_chunk), dtype=dtype)
        # ψ_j = 1 - base^{-j} = -expm1(-j ln base): accurate near j = 0 and exactly 0 in chunk 0
        psi = -torch.expm1(-chunk.to(dtype) * self._log_chunk_base)
        psi = torch.where(pos < 0, -psi, psi).unsqueeze(-1)
        cp, sp = psi.cos(), psi.sin()
        return cos * cp - sin * sp, sin * cp + cos * sp

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}, chunk_base={self.chunk_base:g}"


class ALiBi(PositionalEncoding):
    """ALiBi: ``bias[b, h, i, j] = -slope_h · (q_pos_i - k_pos_j)``, data-independent and linear in distance.

    Added to the final logits as is (not multiplied by ``scale``), like the original on ``q·k/√d``.
    """

    kind = "alibi"
    relative = True
    has_score_bias = True

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.slopes = alibi_slopes(num_heads)
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def slopes_tensor(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._cache:
            self._cache[key] = torch.tensor(self.slopes, dtype=dtype, device=device)
        return self._cache[key]

    def score_bias(self, q_s, k_s, q_pos, k_pos, *, scale):
        if q_s.shape[-3] != self.num_heads:
            raise ValueError(f"alibi was built for num_heads={self.num_heads}, got q_s with {q_s.shape[-3]} heads")
        dtype = torch.promote_types(q_s.dtype, torch.float32)
        return alibi_bias(q_pos.to(q_s.device), k_pos.to(q_s.device), self.slopes_tensor(q_s.device, dtype))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"


class LearnedPositionalEncoding(PositionalEncoding):
    """Absolute learned positions (HELM ablation HELM-D-L / HELM-MiCE-L): ``embed(x_s, p) = x_s + P[p]``.

    ``P [max_positions, n]`` is a Euclidean table of space parts added to the token space parts (HRC: the
    caller lifts, so the result is a point); ``n`` is the model's space dim, not a head dim.
    """

    kind = "learned"
    relative = False

    def __init__(self, max_positions: int, hidden_space_dim: int, *, init_std: float = 0.02):
        super().__init__()
        self.max_positions, self.hidden_space_dim, self.init_std = max_positions, hidden_space_dim, init_std
        self.weight = nn.Parameter(torch.empty(max_positions, hidden_space_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.init_std)

    def check_positions(self, position_ids: torch.Tensor) -> None:
        """Validation helper (synchronises with the device once): every position must be in ``[0, max)``."""
        if torch.compiler.is_compiling():
            return
        lo, hi = torch.aminmax(position_ids.detach())
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= self.max_positions:
            raise ValueError(f"position_ids must lie in [0, max_positions={self.max_positions}) for the learned "
                             f"positional encoding (its table has {self.max_positions} rows), got range [{lo}, {hi}]")

    def embed(self, x_s: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        _check_position_ids(x_s, position_ids)
        if x_s.shape[-1] != self.hidden_space_dim:
            raise ValueError(f"learned: x_s has space dim {x_s.shape[-1]}, expected hidden_space_dim="
                             f"{self.hidden_space_dim}")
        self.check_positions(position_ids)
        return x_s + self.weight[position_ids.to(self.weight.device)].to(x_s.dtype)

    def extra_repr(self) -> str:
        return f"max_positions={self.max_positions}, hidden_space_dim={self.hidden_space_dim}"


class HoPEBoost(PositionalEncoding):
    """Seed 000's HoPE (damped Lorentz boost), entering the Lorentz logits through :meth:`score_bias`.

    ``rotate`` is the identity (the boost is not norm-preserving, so it cannot act on points); the logits
    become ``scale·(-q_t k_t + q_sᵀ M(Δ) k_s)`` with ``M(Δ) = ⊕_l e^{-|Δ|θ'} B(Δθ_l)``, see
    :func:`hope_boost_bias`. ``θ_l = angle_scale · base^(-2l/d)`` and ``θ' > max θ_l`` (``= angle_scale``
    for ``base > 1``; default ``θ' = 1.1·max θ_l``). ``‖M(Δ)‖₂ <= e^{-|Δ|(θ' - max θ)} <= 1``, so the
    logit stays ``<= -scale·k`` like a true ``-d²`` term would. With ``learnable_decay``,
    ``θ' = max θ + max(softplus(ρ), 1e-4·max θ)`` with a trainable fp32 ``ρ``, which keeps ``θ' > max θ``
    (also after fp32 rounding) throughout training.
    """

    kind = "hope_boost"
    relative = True
    has_score_bias = True

    def __init__(self, head_dim: int, *, base: float = 10000.0, theta_prime: float | None = None,
                 angle_scale: float = 1.0, learnable_decay: bool = False):
        super().__init__()
        self.head_dim, self.base, self.angle_scale = head_dim, float(base), float(angle_scale)
        freqs = rope_frequencies(head_dim, base) * self.angle_scale
        self.max_theta = float(freqs.max())
        self.theta_prime_init = 1.1 * self.max_theta if theta_prime is None else float(theta_prime)
        if not self.theta_prime_init > self.max_theta:
            raise ValueError(f"theta_prime must exceed max θ_l = {self.max_theta:g} (seed 000: θ' > max θ_i, else "
                             f"the boost outgrows its damping), got {theta_prime!r}")
        self._freqs64 = freqs
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.learnable_decay = learnable_decay
        if learnable_decay:
            self.decay_raw = nn.Parameter(torch.empty((), dtype=torch.float32))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.learnable_decay:
            gap = self.theta_prime_init - self.max_theta
            with torch.no_grad():
                self.decay_raw.fill_(gap + math.log(-math.expm1(-gap)))  # softplus^{-1}(gap)

    @property
    def theta_prime(self) -> torch.Tensor | float:
        """``θ'`` (a float, or a 0-dim fp32 tensor carrying gradient when learnable)."""
        if self.learnable_decay:
            # the floor keeps θ' - max θ representable in fp32: a vanishing gap would stop the slowest decay
            gap = nn.functional.softplus(self.decay_raw.float()).clamp_min(_MIN_DECAY_GAP * self.max_theta)
            return self.max_theta + gap
        return self.theta_prime_init

    def _freqs(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._cache:
            self._cache[key] = self._freqs64.to(device, dtype)
        return self._cache[key]

    def score_bias(self, q_s, k_s, q_pos, k_pos, *, scale):
        if q_s.shape[-1] != self.head_dim or k_s.shape[-1] != self.head_dim:
            raise ValueError(f"hope_boost was built for head_dim={self.head_dim}, got q_s/k_s with last dims "
                             f"{q_s.shape[-1]}/{k_s.shape[-1]}")
        dtype = torch.promote_types(q_s.dtype, torch.float32)
        return hope_boost_bias(q_s, k_s, q_pos.to(q_s.device), k_pos.to(q_s.device),
                               freqs=self._freqs(q_s.device, dtype), theta_prime=self.theta_prime, scale=scale)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, base={self.base:g}, angle_scale={self.angle_scale:g}, "
                f"theta_prime={self.theta_prime_init:g}, learnable_decay={self.learnable_decay}")


# ----------------------------------------------------------------------------------------------------------
# builder
# ----------------------------------------------------------------------------------------------------------

_OPTIONS = {
    "hope": (),
    "learned": ("hidden_space_dim", "init_std"),
    "none": (),
    "alibi": (),
    "rope3d": ("chunk_size", "chunk_base"),
    "hope_boost": ("theta_prime", "angle_scale", "learnable_decay"),
}
_PAIRED = ("hope", "rope3d", "hope_boost")


def _check_finite_positive(value, name: str) -> float:
    value = check_positive(value, name)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


def build_positional_encoding(name: str, *, head_dim: int, num_heads: int, max_position_embeddings: int,
                              rope_theta: float = 10000.0, **options) -> PositionalEncoding:
    """Build the positional encoding ``name`` (one of ``POSITIONAL_ENCODINGS``).

    Args:
        head_dim: number of *space* dims per head that get the encoding (even for ``hope``, ``rope3d``,
            ``hope_boost``). For ``learned`` the table width is ``hidden_space_dim`` if given, else ``head_dim``
            (pass the model's space dim ``n``).
        num_heads: heads of the attention (ALiBi slopes).
        max_position_embeddings: table size of ``learned`` (its ``max_positions``); validated for all kinds.
        rope_theta: RoPE base of ``hope``, ``rope3d`` and ``hope_boost``.
        options: per kind —
            ``learned``: ``hidden_space_dim`` (int), ``init_std`` (float, 0.02);
            ``rope3d``: ``chunk_size`` (int, 512), ``chunk_base`` (float > 1, default ``rope_theta``);
            ``hope_boost``: ``theta_prime`` (float > max θ_l = angle_scale, default ``1.1·angle_scale``),
            ``angle_scale`` (float > 0, 1.0), ``learnable_decay`` (bool, False).

    Raises:
        ValueError: unknown ``name`` or option, or an invalid value; the message names the argument and
            what is accepted.
    """
    check_choice(name, "positional encoding name", POSITIONAL_ENCODINGS)
    check_dim(head_dim, "head_dim")
    check_dim(num_heads, "num_heads")
    check_dim(max_position_embeddings, "max_position_embeddings")
    rope_theta = _check_finite_positive(rope_theta, "rope_theta")
    unknown = sorted(set(options) - set(_OPTIONS[name]))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for positional encoding {name!r}; accepted options: "
                         f"{_OPTIONS[name] or 'none'}")
    if name in _PAIRED and head_dim % 2:
        raise ValueError(f"head_dim must be even for {name!r} (it acts on pairs of space dims), got {head_dim}")

    if name == "none":
        return NoPositionalEncoding()
    if name == "hope":
        return HoPE(head_dim, base=rope_theta)
    if name == "alibi":
        return ALiBi(num_heads)
    if name == "learned":
        width = check_dim(options.get("hidden_space_dim", head_dim), "hidden_space_dim")
        init_std = _check_finite_positive(options.get("init_std", 0.02), "init_std")
        return LearnedPositionalEncoding(max_position_embeddings, width, init_std=init_std)
    if name == "rope3d":
        chunk_size = check_dim(options.get("chunk_size", 512), "chunk_size")
        chunk_base = _check_finite_positive(options.get("chunk_base", rope_theta), "chunk_base")
        if chunk_base <= 1:
            raise ValueError(f"chunk_base must be > 1 (chunk phases φ_j = chunk_base^-j), got {chunk_base!r}")
        return RoPE3D(head_dim, base=rope_theta, chunk_size=chunk_size, chunk_base=chunk_base)
    angle_scale = _check_finite_positive(options.get("angle_scale", 1.0), "angle_scale")
    theta_prime = options.get("theta_prime")
    if theta_prime is not None:
        theta_prime = _check_finite_positive(theta_prime, "theta_prime")
    learnable = options.get("learnable_decay", False)
    if not isinstance(learnable, bool):  # the builder's contract: every bad option is a ValueError
        raise ValueError(f"learnable_decay must be a bool, got {learnable!r}")  # noqa: TRY004
    return HoPEBoost(head_dim, base=rope_theta, theta_prime=theta_prime, angle_scale=angle_scale,
                     learnable_decay=learnable)
