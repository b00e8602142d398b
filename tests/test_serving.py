"""``python -m helm.serve`` (transformers' own ``serve`` with HELM's classes reachable) on a saved tiny HELM-D and
HELM-MiCE folder, on the loopback address: every completion, streamed or not, plain or chat, alone or beside three
others of different lengths, equals ``model.generate``'s greedy continuation of its prompt, decoded; with and without
``--continuous-batching`` (small paged cache, chunked prefill) and with ``--compile`` (a static cache).

One server per family and mode, all started together when the module starts and stopped (their process groups)
when it ends, whatever the tests did.
"""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai  # the serving extra
import pytest
import torch
from transformers import AutoModelForCausalLM

from helm import serve
from benchmarks.serving import ServerProcess
from tests.helpers import tiny_model


REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("helm_d", "helm_mice")
# Pages of 4 tokens, 64 of them (room for the eight concurrent requests below), at most 24 tokens a step: the two
# longer prompts' prefill is chunked, prefill and decoding requests share steps, and HELM-MiCE's HMLA takes both of
# its paths on the paged cache (absorbed for steps of up to 15 new tokens at these shapes, plain above).
MODES = {
    "plain": (),
    "continuous-batching": ("--continuous-batching", "--cb-block-size", "4", "--cb-num-blocks", "64",
                            "--cb-max-batch-tokens", "24"),
    "compile": ("--compile",),
}
# Four prompts of different lengths whose greedy continuations differ (checked below), so a request answered with
# another one's tokens fails.
PROMPTS = ("the", "one two three four", "red blue green cat dog bird river stone tree house light runs",
           "a dog and a bird sing over the house near the river")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def folders(tokenizer, tmp_path_factory):
    """``{family: folder}``: a 2-layer model saved with ``save_pretrained`` and the suite's tokenizer (which
    carries the chat template ``helm.data.train_tokenizer`` writes)."""
    # A lone byte of a multi-byte character decodes to U+FFFD in a whole-sequence decode but to nothing in the
    # server's incremental one; a random model picks such bytes, so its generation config suppresses them.
    partial_bytes = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    folders = {}
    for family in FAMILIES:
        # initialised 3x wider than the default (0.02), whose random models continue most prompts alike: a request
        # that attended to another's keys in a shared step then went unnoticed for HELM-MiCE
        model = tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                           bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                           initializer_range=0.06)
        model.generation_config.suppress_tokens = partial_bytes
        folders[family] = tmp_path_factory.mktemp(family)
        model.save_pretrained(folders[family])
        tokenizer.save_pretrained(folders[family])
    return folders


@pytest.fixture(scope="module")
def servers(folders, tmp_path_factory):
    """``{(family, mode): ServerProcess}``, all started at once (loading overlaps) and all stopped at the end."""
    logs = tmp_path_factory.mktemp("server-logs")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    started = {(family, mode): ServerProcess(folders[family], "--device", "cpu", "--log-level", "info", *args,
                                             log=logs / f"{family}-{mode}.log", env=env, startup_timeout=180)
               for family in FAMILIES for mode, args in MODES.items()}
    try:
        for server in started.values():
            server.launch()
        for server in started.values():
            server.wait_ready()
        # continuous batching takes its sampling settings from the first request it serves: greedy, so that the
        # greedy tests hold in whatever order they run
        for (family, mode), server in started.items():
            complete(server, folders[family], PROMPTS[0], 1)
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(ServerProcess.stop, started.values()))


@pytest.fixture(scope="module")
def reference(folders, tokenizer):
    """``reference(family, ids, n)``: the text of ``model.generate``'s greedy continuation of ``ids`` (a list of
    token ids) by the saved folder's model, decoded as the server decodes it."""
    models = {family: AutoModelForCausalLM.from_pretrained(folder) for family, folder in folders.items()}
    cache = {}

    def continuation(family, ids, n=NEW_TOKENS):
        key = (family, tuple(ids), n)
        if key not in cache:
            with torch.no_grad():
                out = models[family].generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
            cache[key] = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        return cache[key]

    return continuation


def post(server, path, body, timeout=120):
    """POST ``body`` as JSON; the parsed answer, or for ``"stream": true`` the list of server-sent events' data."""
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        if not body.get("stream"):
            return json.loads(answer.read())
        events = [json.loads(line[len(b"data: "):]) for line in answer if line.startswith(b"data: ")]
    errors = [event["error"] for event in events if "error" in event]
    assert not errors, f"{errors}\n{server.log_tail()}"
    return events


def complete(server, folder, prompt, n=NEW_TOKENS, stream=False, **fields):
    """The text of ``/v1/completions`` for ``prompt`` (``n`` tokens, greedy unless ``fields`` say otherwise)."""
    body = {"model": str(folder), "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream, **fields}
    answer = post(server, "/v1/completions", body)
    if stream:
        return "".join(event["choices"][0]["text"] for event in answer)
    return answer["choices"][0]["text"]


def params():
    return [pytest.param(family, mode, id=f"{family}-{mode}") for family in FAMILIES for mode in MODES]


@pytest.mark.parametrize(("family", "mode"), params())
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_equals_generate(servers, folders, reference, tokenizer, family, mode, stream):
    prompt = PROMPTS[2]
    text = complete(servers[family, mode], folders[family], prompt, stream=stream)
    assert text == reference(family, tokenizer(prompt)["input_ids"])


@pytest.mark.parametrize(("family", "mode"), params())
def test_concurrent_completions_of_different_lengths(servers, folders, reference, tokenizer, family, mode):
    """Four prompts of 3, 5, 36 and 27 tokens, each asked for a different number of tokens, whole and streamed:
    eight requests at once, each answered with its own greedy continuation."""
    ids = [tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert len({len(i) for i in ids}) == len(PROMPTS)
    lengths = [NEW_TOKENS - 2 + i for i in range(len(PROMPTS))]
    expected = [reference(family, i, n) for i, n in zip(ids, lengths)]
    assert len(set(expected)) == len(PROMPTS), expected  # the prompts tell the requests apart
    jobs = [(prompt, n, stream) for prompt, n in zip(PROMPTS, lengths) for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: complete(servers[family, mode], folders[family], job[0], job[1],
                                                   stream=job[2]), jobs))
    assert texts == [text for text in expected for _ in (False, True)]


@pytest.mark.parametrize(("family", "mode"), params())
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completion_with_the_openai_client(servers, folders, reference, tokenizer, family, mode, stream):
    """The README's client: the prompt of the chat template the tokenizer was saved with, continued greedily."""
    messages = [{"role": "system", "content": "count"}, {"role": "user", "content": "one two three"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "system: count\nuser: one two three\nassistant:"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    client = openai.OpenAI(base_url=servers[family, mode].url + "/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(model=str(folders[family]), messages=messages, max_tokens=NEW_TOKENS,
                                            temperature=0, stream=stream)
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    else:
        text = answer.choices[0].message.content
    assert text == reference(family, ids["input_ids"])


@pytest.mark.parametrize(("family", "mode"), params())
def test_sampled_completion(servers, folders, reference, tokenizer, family, mode):
    """Sampling at temperature 0.8 with a seed gives the requested number of tokens. A saved generation config
    does not sample (``do_sample`` unset, as train.py and ``save_pretrained`` leave it), so the request switches it on
    through the server's ``generation_config`` field. Without continuous batching the seed makes the text
    reproducible and it is not the greedy one; continuous batching keeps the sampling settings of the first request
    it served (transformers' behaviour: greedy here), so there the length is checked only."""
    server, folder, prompt = servers[family, mode], folders[family], PROMPTS[1]
    body = {"model": str(folder), "prompt": prompt, "max_tokens": 12, "temperature": 0.8, "seed": 7,
            "generation_config": json.dumps({"do_sample": True})}
    answer = post(server, "/v1/completions", body)
    assert answer["usage"]["completion_tokens"] == 12, answer
    assert answer["choices"][0]["finish_reason"] == "length"
    if mode != "continuous-batching":
        again = post(server, "/v1/completions", body)
        assert again["choices"][0]["text"] == answer["choices"][0]["text"]
        assert answer["choices"][0]["text"] != reference(family, tokenizer(prompt)["input_ids"], 12)


def test_launcher_refuses_a_folder_without_a_model(tokenizer, tmp_path, capsys):
    """The model argument is checked before transformers' CLI runs: one line naming it, exit 2."""
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        serve.main(["--port", "1", str(tmp_path), "--device", "cpu"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"helm.serve: model {str(tmp_path)!r}: holds none of config.json\n"


def test_launcher_usage_names_the_launcher():
    """Third re-probe: a bad option's usage line advised 'python -m helm.transformers serve', which does not exist.
    (A process of its own: the launcher binds HELM's classes on transformers before the CLI parses its options.)"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "helm.serve", "--port", "notaport"], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=REPO, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Usage: python -m helm.serve [OPTIONS]" in done.stderr and "--port" in done.stderr
    assert "helm.transformers" not in done.stderr


def test_classes_reach_transformers_only_through_the_launcher():
    """``import helm.serve`` binds nothing on ``transformers``; :func:`expose_model_classes` adds HELM's model
    classes under their names to the namespace it is given and refuses, before adding any, a name bound to another
    object."""
    import types

    import transformers

    classes = serve.model_classes()
    assert {"HelmDForCausalLM", "HelmMiCEForCausalLM"} <= set(classes)
    assert not any(hasattr(transformers, name) for name in classes)
    namespace = types.SimpleNamespace(LlamaForCausalLM=transformers.LlamaForCausalLM)
    assert sorted(serve.expose_model_classes(namespace)) == sorted(classes)
    assert namespace.HelmDForCausalLM is classes["HelmDForCausalLM"]
    assert serve.expose_model_classes(namespace) == []  # already there: nothing to add
    taken = types.SimpleNamespace(HelmMiCEForCausalLM=transformers.LlamaForCausalLM)
    with pytest.raises(RuntimeError, match="transformers already defines HelmMiCEForCausalLM"):
        serve.expose_model_classes(taken)
    assert vars(taken) == {"HelmMiCEForCausalLM": transformers.LlamaForCausalLM}
