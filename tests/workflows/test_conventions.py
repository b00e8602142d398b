"""Issue 14, item 8: transformers' calling conventions behave for HELM as for Llama (tiny models side by side)."""

import pytest
import torch

from tests.helpers import assert_close, tiny_model

HELM = ["helm_d", "helm_mice"]
ALL = HELM + ["llama"]


def ids():
    return torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", ALL)
def test_return_dict_false_gives_the_tuple(family):
    model = tiny_model(family)
    with torch.no_grad():
        as_tuple = model(ids(), labels=ids(), return_dict=False)
        as_dict = model(ids(), labels=ids())
    assert isinstance(as_tuple, tuple)
    assert torch.equal(as_tuple[0], as_dict.loss) and torch.equal(as_tuple[1], as_dict.logits)
    assert isinstance(model.model(ids(), return_dict=False), tuple)


@pytest.mark.parametrize("family", ALL)
def test_hidden_states_are_embeddings_then_layers_then_the_normed_output(family):
    model = tiny_model(family)
    with torch.no_grad():
        out = model(ids(), output_hidden_states=True)
        states = out.hidden_states
        assert len(states) == model.config.num_hidden_layers + 1
        assert torch.equal(states[0], model.get_input_embeddings()(ids()))
        assert torch.equal(states[-1], model.model(ids()).last_hidden_state)
        # the config default is honoured as in transformers
        model.config.output_hidden_states = True
        assert len(model(ids()).hidden_states) == len(states)


@pytest.mark.parametrize("family", ALL)
def test_num_parameters_without_embeddings_leaves_out_the_input_table(family):
    model = tiny_model(family)
    table = model.get_input_embeddings().weight.numel()
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())
    assert model.num_parameters(exclude_embeddings=True) == model.num_parameters() - table


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", HELM)
def test_attn_implementation_selects_our_implementation(family, impl):
    """As for Llama: the request is config._attn_implementation, which the layers read at every call."""
    model = tiny_model(family, model_kwargs={"attn_implementation": impl})
    assert model.config._attn_implementation == impl
    other = "sdpa" if impl == "eager" else "eager"
    with torch.no_grad():
        before = model(ids()).logits
        model.set_attn_implementation(other)
        assert model.config._attn_implementation == other
        assert_close(model(ids()).logits, before, rtol=1e-4)


@pytest.mark.parametrize("family", ALL)
def test_unknown_attn_implementation_is_refused(family):
    with pytest.raises(ValueError, match="bogus"):
        tiny_model(family, model_kwargs={"attn_implementation": "bogus"})
