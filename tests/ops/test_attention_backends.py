"""SDPA's backends on the ``sdpa`` attention implementation (issue 22 item 3A).

``sdpa`` pads ``q``, ``k`` and the centred values ``[w | e]`` to one head width, a multiple of 8
(:func:`helm.ops.attention._pad_heads`), so the flash kernel is eligible, on the CPU too. The tolerance is
FlashAttention's rule (:data:`tests.helpers.LOW_PRECISION_FACTOR`) with the fp32 math path as the baseline: flash's
error against the fp64 model is at most twice the largest error the fp32 math path makes on any of the model's
outputs (logits, loss, the gradient of every parameter). Applied per output it does not hold: flash's gradients are
further from fp64 than the math path's (plain Euclidean SDPA of these shapes, fp32 against fp64: flash 2-3x the math
path's error on ``dq, dk`` and on the gradient of a scale on ``q``; through the model, up to ~9x on the temperature's
gradient, ~2e-5 relative), but no further than the fp32 model's own worst rounding (~1e-4 on the residual weights'
gradients, math and flash alike).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import helm.ops.attention as attention_ops
from tests.helpers import LOW_PRECISION_FACTOR, relative_error, tiny_model


def _step(model, ids, backend) -> dict:
    """Logits, loss and every parameter's gradient of one forward + backward under ``backend``."""
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(backend):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    result = {"logits": out.logits.detach(), "loss": out.loss.detach()}
    result.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return result


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_flash_backend_runs_and_matches_math(family, seed):
    model = tiny_model(family, seed=seed, model_kwargs={"attn_implementation": "sdpa"})
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    reference = _step(copy.deepcopy(model).double(), ids, SDPBackend.MATH)
    math = _step(model, ids, SDPBackend.MATH)
    flash = _step(model, ids, SDPBackend.FLASH_ATTENTION)  # raises "no available kernel" if flash is not eligible
    assert set(flash) == set(math) == set(reference) and len(reference) > 2
    bound = LOW_PRECISION_FACTOR * max(relative_error(math[n], reference[n]) for n in reference)
    assert 0 < bound < 1e-3
    for name in reference:
        assert torch.isfinite(flash[name]).all(), name
        err = relative_error(flash[name], reference[name])
        assert err <= bound, f"{name}: flash vs fp64 {err:.2e} > {bound:.2e}"
        diff = relative_error(flash[name], math[name])
        assert diff <= bound, f"{name}: flash vs math {diff:.2e} > {bound:.2e}"


def test_padded_heads_are_multiples_of_eight_and_exact():
    """Zero columns change neither ``<q, k>_L`` nor the sliced output: padded equals unpadded (math backend)."""
    g = torch.Generator().manual_seed(0)
    q, kk = (torch.randn(2, 2, 5, 17, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 2, 5, 18, generator=g, dtype=torch.float64)
    padded = attention_ops._pad_heads(q, kk, v)
    assert {t.shape[-1] for t in padded} == {24}
    assert all(torch.equal(p[..., :t.shape[-1]], t) and not p[..., t.shape[-1]:].any() for p, t in zip(padded, (q, kk, v)))
    assert torch.allclose(padded[0] @ padded[1].transpose(-1, -2), q @ kk.transpose(-1, -2), rtol=0, atol=1e-12)
