"""``attn_implementation=`` selects every implementation the zoo has (issue 33 item 2), through ``from_config``,
``from_pretrained`` and ``set_attn_implementation``, stored in ``config._attn_implementation`` and read by the layers
at every call; save and reload keep it as they do for Llama; a ``config.json`` with the former field ``attn_impl``
loads and runs that implementation; a bad name is a ``ValueError`` naming it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import helm.ops.attention as ops
from tests.helpers import assert_close, tiny_model

FAMILIES = ["helm_d", "helm_mice"]
NAMES = ["eager", "sdpa", "triton", "auto"]
RUNS_ON_CPU = {"eager": "eager", "sdpa": "sdpa", "triton": "triton", "auto": "sdpa"}


@pytest.fixture
def ran(monkeypatch):
    """The implementation each attention call ran. ``triton`` is recorded, reported runnable and computed by sdpa
    (the same maths), so that the routing is tested on any machine; the kernel itself is tested against eager in
    tests/ops/lorentz_attention_triton/."""
    called = []
    monkeypatch.setattr(ops, "_triton_unavailable", lambda device: None)
    for name, fn in list(ops.ATTENTION_FUNCTIONS.items()):
        def spy(*args, _fn=ops.sdpa_attention if name == "triton" else fn, _name=name, **kwargs):
            called.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setitem(ops.ATTENTION_FUNCTIONS, name, spy)
    return called


def _runs(model, ran) -> list:
    ran.clear()
    model(input_ids=torch.tensor([[3, 4, 5, 6]]), use_cache=False)
    return list(ran)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", NAMES)
def test_each_name_is_selected_by_from_config_from_pretrained_and_set_attn_implementation(family, name, ran,
                                                                                          tmp_path):
    expected = [RUNS_ON_CPU[name]] * 2  # two layers
    built = tiny_model(family, model_kwargs={"attn_implementation": name})
    assert built.config._attn_implementation == name and _runs(built, ran) == expected

    tiny_model(family).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name)
    assert loaded.config._attn_implementation == name and _runs(loaded, ran) == expected

    switched = tiny_model(family, model_kwargs={"attn_implementation": "eager" if name != "eager" else "sdpa"})
    switched.set_attn_implementation(name)
    assert switched.config._attn_implementation == name and _runs(switched, ran) == expected
    assert switched.model.config is switched.config  # the base model inside the head follows the same config


@pytest.mark.parametrize("family", FAMILIES)
def test_no_request_is_auto(family, ran):
    model = tiny_model(family)
    assert model.config._attn_implementation == "auto" and _runs(model, ran) == ["sdpa", "sdpa"]


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_reload_keep_the_choice_as_for_llama(family, tmp_path):
    """transformers does not save ``attn_implementation``: a reloaded Llama is back on its default (sdpa), a
    reloaded HELM model on its own (auto), unless ``from_pretrained`` asks for one."""
    for which, default in ((family, "auto"), ("llama", "sdpa")):
        folder = tmp_path / which
        tiny_model(which, model_kwargs={"attn_implementation": "eager"}).save_pretrained(folder)
        saved = json.loads((folder / "config.json").read_text())
        assert not {key for key in saved if "attn" in key}, saved
        assert AutoModelForCausalLM.from_pretrained(folder).config._attn_implementation == default
        assert AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").config._attn_implementation \
            == "eager"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["eager", "triton"])
def test_an_old_config_with_attn_impl_loads_and_runs_that_implementation(family, name, ran, tmp_path):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "attn_impl": name}))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config._attn_implementation == name and not hasattr(loaded.config, "attn_impl")
    assert _runs(loaded, ran) == [RUNS_ON_CPU[name]] * 2
    assert AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").config._attn_implementation \
        == "sdpa"  # an explicit request wins


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bad_name_is_refused_naming_it(family, tmp_path):
    with pytest.raises(ValueError, match="'flash_attention_2'.*'triton'"):
        tiny_model(family, model_kwargs={"attn_implementation": "flash_attention_2"})
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'bogus'"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="bogus")
    with pytest.raises(ValueError, match="'kernels-community/flash-attn'"):
        model.set_attn_implementation("kernels-community/flash-attn")
    assert model.config._attn_implementation == "auto"


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_and_sdpa_agree_through_the_model(family):
    """Outputs and gradients of the same weights under eager and sdpa (the kernel against eager:
    tests/ops/lorentz_attention_triton/test_triton_model_on_cpu.py)."""
    model = tiny_model(family, train=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    results = {}
    for name in ("eager", "sdpa"):
        model.set_attn_implementation(name)
        model.zero_grad()
        out = model(input_ids=ids, labels=ids, skip_logits=False)
        out.loss.backward()
        results[name] = out.logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert_close(results["sdpa"][0], results["eager"][0], dtype=torch.float32)
    for g_sdpa, g_eager in zip(results["sdpa"][1], results["eager"][1], strict=True):
        assert_close(g_sdpa, g_eager, rtol=1e-3)
