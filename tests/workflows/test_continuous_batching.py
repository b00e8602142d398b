"""Issue 36, continuous batching: HELM-D and HELM-MiCE generate under ``transformers``' continuous batching
(``generate_batch``, the manager of ``init_continuous_batching`` that ``transformers serve --continuous-batching``
runs), on its paged KV cache, each request getting what ``model.generate(do_sample=False)`` gives it alone: the same
tokens, and the same log-probability of each (to fp32 rounding), which a wrong key, position or centre changes even
where an untrained model's argmax does not move.

The prompts (1, 7, 16 and 11 tokens) share steps under ``max_batch_tokens=8``: the long ones are prefilled in
chunks, mixed with the decode steps of the others, over pages of 4 tokens. Tiny-llama is the control: the stock
model under the same harness.
"""

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from helm.nn.hmla import HMLA
from tests.helpers import assert_close, tiny_model

LENGTHS = (1, 7, 16, 11)
NEW_TOKENS = 6


def prompts(vocab_size: int = 512) -> list:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def batching(**overrides) -> ContinuousBatchingConfig:
    """Small pages and cache, chunked prefill, the sampled token's log-probability returned."""
    return ContinuousBatchingConfig(**{"page_size": 4, "num_blocks": 32, "max_batch_tokens": 8,
                                       "return_logprobs": True, **overrides})


def greedy(n: int = NEW_TOKENS) -> GenerationConfig:
    return GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=-1, pad_token_id=1)


def alone(model, prompt: list, n: int = NEW_TOKENS) -> tuple:
    """``model.generate``'s greedy tokens for ``prompt`` on its own, and the log-probability of each."""
    out = model.generate(torch.tensor([prompt]), generation_config=GenerationConfig(
        do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=1, output_logits=True,
        return_dict_in_generate=True))
    tokens = out.sequences[0, len(prompt):]
    logprobs = torch.stack([step[0].float().log_softmax(-1)[t] for step, t in zip(out.logits, tokens)])
    return tokens.tolist(), logprobs


def assert_as_alone(model, results: dict, inputs: list, n: int = NEW_TOKENS) -> None:
    for i, prompt in enumerate(inputs):
        got = results[f"req_{i}"]
        assert got.error is None, got.error
        tokens, logprobs = alone(model, prompt, n)
        assert got.generated_tokens == tokens, f"prompt of {len(prompt)} tokens"
        assert_close(torch.tensor(got.logprobs), logprobs, msg=f"prompt of {len(prompt)} tokens")


# id -> (tiny_model arguments, attn_implementation); None: the model's default (HELM's "auto")
# (HELM-MiCE under eager: test_hmla_decodes_absorbed_on_the_paged_cache)
CASES = {"helm_d": (dict(family="helm_d"), None), "helm_d-eager": (dict(family="helm_d"), "eager"),
         "helm_mice": (dict(family="helm_mice"), None), "llama": (dict(family="llama"), None)}


@pytest.mark.parametrize("name", list(CASES))
def test_each_request_gets_what_it_gets_alone(name):
    """Under the default ``auto`` (run as ``sdpa`` for the session) and ``eager`` (which ``transformers`` switches
    to ``paged|eager``); the requested implementation is back afterwards."""
    arguments, implementation = CASES[name]
    model = tiny_model(**arguments, model_kwargs={"attn_implementation": implementation} if implementation else {})
    requested = model.config._attn_implementation
    inputs = prompts()
    results = model.generate_batch(inputs=inputs, generation_config=greedy(), continuous_batching_config=batching())
    assert model.config._attn_implementation == requested
    assert_as_alone(model, results, inputs)


@pytest.mark.parametrize("positional", ["alibi", "hope_boost", "bipe_alibi"])
def test_positional_encodings_that_compare_or_add_positions(positional):
    """Score biases (ALiBi's, the boost's, BiPE's segment ALiBi) compare query and key positions, which the
    flattened batch gives as key indices (differences within a request are position differences); BiPE's absolute
    part reads each request's own ``position_ids``."""
    model = tiny_model("helm_d", positional=positional)
    inputs = prompts()
    results = model.generate_batch(inputs=inputs, generation_config=greedy(), continuous_batching_config=batching())
    assert_as_alone(model, results, inputs)


@pytest.fixture
def hmla_paths(monkeypatch):
    """``[(new tokens of the step, absorbed?)]`` of every HMLA layer call while the fixture is active."""
    calls = []
    forward, absorbed = HMLA.forward, HMLA._attend_absorbed

    def record_forward(self, x, **kwargs):
        calls.append([x.shape[1], False])
        return forward(self, x, **kwargs)

    def record_absorbed(self, *args, **kwargs):
        calls[-1][1] = True
        return absorbed(self, *args, **kwargs)

    monkeypatch.setattr(HMLA, "forward", record_forward)
    monkeypatch.setattr(HMLA, "_attend_absorbed", record_absorbed)
    return calls


@pytest.mark.parametrize("implementation", [None, "eager"])
def test_hmla_decodes_absorbed_on_the_paged_cache(hmla_paths, implementation):
    """With ``hmla_absorb`` (the default) HMLA caches its latent, three scalars per head and its rotary key in the
    pages; every step of at most ``absorb_max_query`` new tokens (all requests together: the decode steps here)
    attends in the latent space, the longer first step (three prompts, 32 tokens) re-expands the cache; ``eager``,
    the reference, never takes the absorbed path."""
    model = tiny_model("helm_mice", model_kwargs={"attn_implementation": implementation} if implementation else {})
    limit = model.model.layers[0].self_attn.absorb_max_query
    inputs = prompts()
    results = model.generate_batch(inputs=inputs, generation_config=greedy(),
                                   continuous_batching_config=batching(max_batch_tokens=32))
    steps = [(t, absorbed) for t, absorbed in hmla_paths]
    assert any(t > limit for t, _ in steps) and any(t == len(LENGTHS) for t, _ in steps)
    if implementation == "eager":
        assert not any(absorbed for _, absorbed in steps)
    else:
        assert all(absorbed == (t <= limit) for t, absorbed in steps), steps
    hmla_paths.clear()
    assert_as_alone(model, results, inputs)


def test_hmla_without_absorbed_decoding():
    model = tiny_model("helm_mice", hmla_absorb=False)
    inputs = prompts()
    results = model.generate_batch(inputs=inputs, generation_config=greedy(), continuous_batching_config=batching())
    assert_as_alone(model, results, inputs)


def test_the_manager_as_the_server_runs_it(hmla_paths):
    """``init_continuous_batching`` + ``add_request`` (each request its own length and token budget), as
    ``transformers serve --continuous-batching`` drives it: HELM's ``auto`` runs as ``sdpa`` while the manager runs
    and is restored when it stops. A prompt sent again later shares the pages its first run completed (prefix
    sharing: 12 of its 16 tokens, three pages of 4), HMLA's absorbed-decoding scalars among them, and still gets what
    it gets alone."""
    model = tiny_model("helm_mice")
    assert model.config._attn_implementation == "auto"
    manager = model.init_continuous_batching(generation_config=greedy(), continuous_batching_config=batching())
    assert model.config._attn_implementation == "sdpa"
    manager.start()
    try:
        inputs, budgets = prompts(), (5, 3, 6, 2)
        ids = [manager.add_request(prompt, max_new_tokens=n) for prompt, n in zip(inputs, budgets)]
        results = {}
        while len(results) < len(ids):  # in the order they finish
            result = manager.get_result(timeout=60)
            assert result is not None, f"no result within 60 s; finished: {sorted(results)}"
            results[result.request_id] = result
        hmla_paths.clear()
        again = manager.add_request(inputs[2], max_new_tokens=budgets[2])
        results[again] = manager.get_result(again, timeout=60)
        first_step = hmla_paths[0][0]
    finally:
        manager.stop(block=True)
    assert model.config._attn_implementation == "auto"
    assert first_step == len(inputs[2]) - 12
    for rid, prompt, n in zip([*ids, again], [*inputs, inputs[2]], [*budgets, budgets[2]]):
        assert results[rid] is not None and results[rid].error is None, rid
        tokens, logprobs = alone(model, prompt, n)
        assert results[rid].generated_tokens == tokens
        assert_close(torch.tensor(results[rid].logprobs), logprobs)


def test_a_cache_too_small_for_helm_is_refused_naming_the_fields():
    """A bf16 model's paged cache is bf16, while HELM caches fp32 points (:mod:`helm.precision`): HELM-D's keys and
    values, which fill an fp32 model's rows exactly, do not fit. Refused before anything runs, the implementation
    left as it was."""
    model = tiny_model("helm_d", model_kwargs={"dtype": torch.bfloat16})
    with pytest.raises(ValueError, match=r"num_key_value_heads.*head_dim.*self_attn caches 2 x num_attention_heads"
                                         r".*dtype=torch.float32"):
        model.generate_batch(inputs=prompts(), generation_config=greedy(), continuous_batching_config=batching())
    assert model.config._attn_implementation == "auto"


def test_paged_names_are_accepted_as_transformers_accepts_them():
    """``transformers``' continuous batching switches ``eager`` to ``paged|eager`` (and back): HELM keeps the name
    (``transformers`` reads it to build its mask) and runs its eager reference under it; the former ``paged|sdpa``
    is ``sdpa``, as for Llama; other names stay refused."""
    from helm.ops.attention import resolve_attention

    model = tiny_model("helm_d")
    model.set_attn_implementation("paged|eager")
    assert model.config._attn_implementation == "paged|eager"
    assert resolve_attention("paged|eager", torch.device("cpu"), absorbable=True) == "eager"
    model.set_attn_implementation("paged|sdpa")
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="'flash_attention_2' is not available for HELM models"):
        model.set_attn_implementation("paged|flash_attention_2")
