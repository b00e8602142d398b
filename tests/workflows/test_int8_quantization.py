"""Issue 23 item 4: dynamic int8 quantisation, as a Llama user runs it.

``torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)`` swaps every ``nn.Linear`` for a
dynamically quantised one (int8 weights, ``weight`` a method). The HELM projections are plain ``nn.Linear``s whose
outputs the layers lift, so the quantised model is still a Lorentz model: its hidden states stay on the hyperboloid
and its logits stay within int8 rounding of the float model's, as Llama's do; greedy generation runs."""

import pytest
import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear
from transformers import AutoModelForCausalLM

from helm.manifold import manifold_error
from tests.helpers import relative_error, tiny_config

# torch.ao's own deprecation notices (the API still ships in this torch, and Llama users still call it)
pytestmark = pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning",
                                        "ignore:torch.quantize_per_tensor:UserWarning")

FAMILIES = ["helm_d", "helm_mice", "llama"]
# relative (Frobenius) error of the logits: int8 per-tensor weights carry ~1/255 of each weight matrix's range, and
# tiny-llama measures 4.2e-2 here (HELM-D 1.6e-2, HELM-MiCE 0.8e-2); a model that ignored the quantised weights or
# mangled them would be at ~1
LOGIT_BOUND = 0.1


def float_and_int8(family):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    return model, torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_logits_stay_within_int8_rounding_of_the_float_model(family):
    model, quantized = float_and_int8(family)
    swapped = [m for m in quantized.modules() if isinstance(m, DynamicQuantizedLinear)]
    assert swapped and not any(type(m) is nn.Linear for m in quantized.modules())
    ids = torch.randint(2, 512, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids, output_hidden_states=True)
        got = quantized(ids, output_hidden_states=True)
    error = relative_error(got.logits, want.logits, norm="fro")
    assert 0 < error < LOGIT_BOUND, error  # > 0: the int8 weights are the ones in use
    assert torch.isfinite(got.logits).all()
    if family != "llama":
        k = quantized.config.k
        assert max(float(manifold_error(h, k).max()) for h in got.hidden_states) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_model_generates(family):
    model, quantized = float_and_int8(family)
    prompt = torch.randint(2, 512, (2, 6), generator=torch.Generator().manual_seed(2))
    out = quantized.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=model.config.pad_token_id)
    assert out.shape == (2, 12) and torch.equal(out[:, :6], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < model.config.vocab_size
