"""Independent fp64 references written from the paper's equations (HELM, ``shared/seeds/003_*``), for tests.

Nothing here imports ``helm``: a test compares the code under test against these, so a bug in ``helm`` cannot
also be in the reference. Conventions as in the package: a point is ``[x_t, x_s]`` with ``<x, x>_L = -k``,
``k = -1/K > 0``. Every function computes in float64 and returns float64.
"""

from __future__ import annotations

import math

import torch


def minkowski(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``<x, y>_L = -x_t y_t + x_s · y_s`` over the last dimension."""
    x, y = x.double(), y.double()
    return -x[..., 0] * y[..., 0] + (x[..., 1:] * y[..., 1:]).sum(-1)


def to_hyperboloid(x_s: torch.Tensor, k: float) -> torch.Tensor:
    """``[sqrt(|x_s|² + k), x_s]``: the point of ``<x, x>_L = -k`` with space part ``x_s``."""
    x_s = x_s.double()
    return torch.cat([(x_s.pow(2).sum(-1, keepdim=True) + k).sqrt(), x_s], dim=-1)


def weighted_centroid(points: torch.Tensor, weights: torch.Tensor, k: float) -> torch.Tensor:
    """Paper Eq. 3's centroid: ``sqrt(k) · s / sqrt(|<s, s>_L|)`` with ``s = Σ_i w_i x_i``.

    ``points [..., N, 1+n]``, ``weights [..., N]`` (broadcast against the points' batch dimensions).
    """
    s = (weights.double().unsqueeze(-1) * points.double()).sum(-2)
    return math.sqrt(k) * s / minkowski(s, s).abs().sqrt().unsqueeze(-1)


def change_curvature(x: torch.Tensor, k_in: float, k_out: float) -> torch.Tensor:
    """``sqrt(k_out / k_in) · x``: maps ``<x, x>_L = -k_in`` onto ``<y, y>_L = -k_out``."""
    return math.sqrt(k_out / k_in) * x.double()


def lorentz_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k: float, tau, allowed: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Paper Eq. 3, one query row at a time: ``o_i = weighted_centroid({v_j}, ν_i)`` over the allowed keys ``j``,
    ``ν_ij = softmax_j(-d²(q_i, k_j) / τ_h + b_ij)``, ``d²(q, k) = -2k - 2<q, k>_L``.

    ``q [B, H, Tq, 1+d]``, ``key [B, H, Tk, 1+d]``, ``value [B, H, Tk, 1+dv]``; ``tau`` a number or ``[H]``;
    ``allowed [B, Tq, Tk]`` booleans; ``bias`` broadcastable to ``[B, H, Tq, Tk]`` or None. A row with no allowed
    key has no attention defined: it is returned as zeros (compare only rows with an allowed key). Differentiable
    in ``q``, ``key``, ``value``, ``tau`` and ``bias``.
    """
    B, H, Tq, _ = q.shape
    taus = [tau[h] for h in range(H)] if isinstance(tau, torch.Tensor) and tau.dim() == 1 else [tau] * H
    bias = None if bias is None else bias.double().expand(B, H, Tq, key.shape[-2])
    rows = []
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                js = allowed[b, i].nonzero().squeeze(-1)
                if js.numel() == 0:
                    rows.append(value.new_zeros(value.shape[-1], dtype=torch.float64))
                    continue
                d2 = -2 * k - 2 * minkowski(q[b, h, i].expand(js.numel(), -1), key[b, h, js])
                scores = -d2 / taus[h] + (0.0 if bias is None else bias[b, h, i, js])
                rows.append(weighted_centroid(value[b, h, js], scores.softmax(-1), k))
    return torch.stack(rows).view(B, H, Tq, value.shape[-1])


def softplus(r: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^r)``, written as ``max(r, 0) + log1p(e^{-|r|})`` so it stays finite for any ``r``."""
    r = r.double()
    return r.clamp_min(0) + torch.log1p(torch.exp(-r.abs()))


def silu(z: torch.Tensor) -> torch.Tensor:
    """``SiLU(z) = z / (1 + e^{-z})``."""
    z = z.double()
    return z / (1 + torch.exp(-z))


def gelu(z: torch.Tensor) -> torch.Tensor:
    """Exact GELU: ``z · Φ(z) = z/2 · (1 + erf(z / sqrt(2)))``."""
    z = z.double()
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2.0)))


def hlt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k_in: float,
        k_out: float | None = None) -> torch.Tensor:
    """HLT ``H_{k_in} -> H_{k_out}`` (paper Eq. 1): ``y_s = W x + b`` on the full vector ``x`` (time
    coordinate included), ``y = sqrt(k_out/k_in) · [sqrt(|y_s|² + k_in), y_s]``.

    Eq. 1 as printed, ``sqrt(K2/K1) · [sqrt(|y_s|² - 1/K2), y_s]``, has ``<y, y>_L = 1/K1``: it lands on the
    input manifold. Lifting on the input curvature and then scaling by ``sqrt(k_out/k_in)``, which maps one
    hyperboloid onto the other (HyperCore's ``LorentzLinear``, which HELM builds on), is the reading that lands on
    ``<y, y>_L = -k_out``, and the one written here. Both agree when ``k_out = k_in``.
    """
    y_s = x.double() @ weight.double().T
    if bias is not None:
        y_s = y_s + bias.double()
    y = to_hyperboloid(y_s, k_in)
    return y if k_out is None else change_curvature(y, k_in, k_out)


def lresnet(x: torch.Tensor, fx: torch.Tensor, raw_weight: torch.Tensor, k: float,
            space_scale: float | None = None) -> torch.Tensor:
    """LResNet (paper Eq. 2): ``x ⊕ f(x) = centroid([x, f(x)], [1, w])``, ``w = softplus(raw_weight) > 0``.

    Eq. 2's ``α_i = w_i / (sqrt(-K) |‖w_1 x + w_2 f(x)‖_L|)`` is the Eq. 3 centroid with weights ``[w_1, w_2]``;
    it depends on ``w_2 / w_1`` only, so ``w_1 = 1``. With ``space_scale`` (the official code's constant,
    FIDELITY.md) the centroid's space part is multiplied by it and the time coordinate recomputed.
    """
    w = softplus(raw_weight).reshape(())
    weights = torch.stack([torch.ones_like(w), w])
    c = weighted_centroid(torch.stack([x.double(), fx.double()], dim=-2), weights, k)
    return c if space_scale is None else to_hyperboloid(space_scale * c[..., 1:], k)


def rms_norm_l(x: torch.Tensor, gain: torch.Tensor, eps: float, k: float) -> torch.Tensor:
    """RMSNorm_L (paper Eq. 7): ``lift(g ⊙ x_s / sqrt(mean(x_s²) + eps))``; ``x_t`` is not used."""
    x_s = x.double()[..., 1:]
    rms = (x_s.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return to_hyperboloid(gain.double() * x_s / rms, k)


def activation_l(x: torch.Tensor, f, k: float) -> torch.Tensor:
    """HRC activation (paper §3): ``f_L(x) = lift(f(x_s))``; ``x_t`` is not used."""
    return to_hyperboloid(f(x.double()[..., 1:]), k)


def swiglu_l(x: torch.Tensor, w1, b1, w3, b3, w2, b2, k: float, act=silu) -> torch.Tensor:
    """Hyperbolic SwiGLU (paper App. B.3, Eq. 20): ``y = SiLU(HLT(x; W1, b1)_s) ⊙ HLT(x; W3, b3)_s``,
    ``out = HLT(lift(y); W2, b2)``, every HLT on the one curvature ``k``."""
    gate = hlt(x, w1, b1, k)[..., 1:]
    up = hlt(x, w3, b3, k)[..., 1:]
    return hlt(to_hyperboloid(act(gate) * up, k), w2, b2, k)


def sqdist(x: torch.Tensor, y: torch.Tensor, k: float) -> torch.Tensor:
    """Squared Lorentz distance as the paper writes it for points of ``H_k``: ``d²(x, y) = -2k - 2<x, y>_L``
    (``<x - y, x - y>_L`` there; this form is linear in each point, so its ambient gradients are the ones the
    layers use)."""
    return -2 * k - 2 * minkowski(x, y)


def linear_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The official LM head: a Euclidean linear map on the full vector, ``logits = W x (+ b)``."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def distance_logits(x: torch.Tensor, prototypes: torch.Tensor, log_tau: torch.Tensor, k: float,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Distance LM head: ``logits_c = -d²(x, p_c) / τ + b_c``, ``τ = exp(log_tau)``; ``[..., 1+n] -> [..., V]``."""
    d2 = sqdist(x.double().unsqueeze(-2), prototypes.double(), k)
    out = -d2 / log_tau.double().exp().reshape(())
    return out if bias is None else out + bias.double()


def logmap0_space(x: torch.Tensor, k: float) -> torch.Tensor:
    """Space part of the log map at the origin ``o = (sqrt(k), 0)``: ``sqrt(k) · arcosh(x_t / sqrt(k)) ·
    x_s / |x_s|`` (its time part is 0)."""
    x = x.double()
    x_s = x[..., 1:]
    r = x_s.norm(dim=-1, keepdim=True)
    theta = torch.acosh((x[..., :1] / math.sqrt(k)).clamp_min(1.0))
    return math.sqrt(k) * theta * x_s / r.clamp_min(torch.finfo(torch.float64).tiny)


def manifold_violation(x: torch.Tensor, k: float) -> torch.Tensor:
    """``|<x, x>_L + k| / |x|²`` per point (the scale of fp rounding in ``<x, x>_L``), ``inf`` where ``x_t <= 0``."""
    x = x.double()
    err = (minkowski(x, x) + k).abs() / x.pow(2).sum(-1)
    return torch.where(x[..., 0] > 0, err, torch.full_like(err, float("inf")))
