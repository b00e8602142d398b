"""``hope_boost`` (seed 000): a damped Lorentz boost, entering the Lorentz logits as an additive bias."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...precision import stat_dtype
from ..validation import boolean, check, check_decay_above, optional, positive
from .base import PositionalEncoding, PositionalTables, Scale, inverse_frequencies
from .rotary import check_pairs

_BOOST_CHANNELS_PER_SEGMENT = 8
_MIN_DECAY_GAP = 1e-4  # learnable θ' >= (1 + 1e-4)·max θ_l


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
    acc = stat_dtype(q_s)
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


class HoPEBoost(PositionalEncoding):
    """Seed 000's HoPE (damped Lorentz boost), entering the Lorentz logits through a score bias.

    It does not rotate (the boost is not norm-preserving, so it cannot act on points); the logits become
    ``scale·(-q_t k_t + q_sᵀ M(Δ) k_s)`` with ``M(Δ) = ⊕_l e^{-|Δ|θ'} B(Δθ_l)``, see :func:`hope_boost_bias`.
    ``θ_l = angle_scale · base^(-2l/d)`` and ``θ' > max θ_l`` (``= angle_scale`` for ``base > 1``; default
    ``θ' = 1.1·max θ_l``). ``‖M(Δ)‖₂ <= e^{-|Δ|(θ' - max θ)} <= 1``, so the logit stays ``<= -scale·k`` like a
    true ``-d²`` term would. With ``learnable_decay``, ``θ' = max θ + max(softplus(ρ), 1e-4·max θ)`` with a
    trainable fp32 ``ρ`` (one per model: the model owns the encoding), which keeps ``θ' > max θ`` (also after
    fp32 rounding) throughout training.
    """

    kind = "hope_boost"
    pairs = True
    has_score_bias = True
    options = {"theta_prime": "hope_boost_theta_prime", "angle_scale": "hope_boost_angle_scale",
               "learnable_decay": "hope_boost_learnable_decay"}

    def __init__(self, head_dim: int, *, base: float = 10000.0, theta_prime: float | None = None,
                 angle_scale: float = 1.0, learnable_decay: bool = False):
        super().__init__()
        self.head_dim = check_pairs(head_dim, self.kind)
        self.base = float(check(base, "rope_theta", positive))
        self.angle_scale = float(check(angle_scale, "angle_scale", positive))
        check(theta_prime, "theta_prime", optional(positive))
        self.learnable_decay = check(learnable_decay, "learnable_decay", boolean)
        freqs = inverse_frequencies(head_dim, base) * self.angle_scale
        self.max_theta = float(freqs.max())
        check_decay_above(theta_prime, self.max_theta, "theta_prime")
        self.theta_prime_init = 1.1 * self.max_theta if theta_prime is None else float(theta_prime)
        self._freqs64 = freqs
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        if learnable_decay:
            self.decay_raw = nn.Parameter(torch.empty(1, dtype=torch.float32))  # [1], not []: FSDP2 shards dim 0
            self.reset_parameters()

    @classmethod
    def build(cls, *, head_dim: int, rope_theta: float = 10000.0, theta_prime: float | None = None,
              angle_scale: float = 1.0, learnable_decay: bool = False, **_):
        return cls(head_dim, base=rope_theta, theta_prime=theta_prime, angle_scale=angle_scale,
                   learnable_decay=learnable_decay)

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
            gap = nn.functional.softplus(self.decay_raw.float().reshape(())).clamp_min(_MIN_DECAY_GAP * self.max_theta)
            return self.max_theta + gap
        return self.theta_prime_init

    def _freqs(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._cache:
            if torch.compiler.is_compiling():  # filling the cache in a compiled call would recompile the next one
                return self._freqs64.to(device, dtype)
            self._cache[key] = self._freqs64.to(device, dtype)
        return self._cache[key]

    def tables(self, position_ids, q_pos, k_pos, dtype) -> PositionalTables:
        theta_prime = self.theta_prime

        def bias(q_s, k_s, scale):
            if q_s.shape[-1] != self.head_dim or k_s.shape[-1] != self.head_dim:
                raise ValueError(f"hope_boost was built for head_dim={self.head_dim}, got q_s/k_s with last dims "
                                 f"{q_s.shape[-1]}/{k_s.shape[-1]}")
            acc = stat_dtype(q_s)
            return hope_boost_bias(q_s, k_s, q_pos, k_pos, freqs=self._freqs(q_s.device, acc),
                                   theta_prime=theta_prime, scale=scale)

        return PositionalTables(bias=bias)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, base={self.base:g}, angle_scale={self.angle_scale:g}, "
                f"theta_prime={self.theta_prime_init:g}, learnable_decay={self.learnable_decay}")


__all__ = ["HoPEBoost", "hope_boost_bias"]
