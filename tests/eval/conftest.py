"""Fixtures for the eval/ scripts: briefly trained micro checkpoints saved with save_pretrained, held-out text,
and an offline environment. The shared ``tokenizer`` and ``corpus`` fixtures come from tests/conftest.py.

The checkpoints are trained for a few dozen Adam steps so that their predictions are peaked rather than
uniform: batch-size and padding comparisons then test real differences, not ties.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.eval.script_loader import REPO
from tests.helpers import synthetic_text, tiny_config

# one intra-op thread: on a busy 2-core machine OpenMP's spin-waiting threads made the same runs up to 10x slower
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
MAX_POSITIONS = 64  # small, so lm-eval's rolling windows and the extrapolation factors really split the text
# model options by checkpoint kind, kept here so that a change of the config fields is a one-line edit
CHECKPOINTS = {
    "helm_d": ("helm_d", {"num_hidden_layers": 1}),
    "helm_d:learned": ("helm_d", {"num_hidden_layers": 1, "positional": "learned"}),
    "helm_mice": ("helm_mice", {}),
    "llama": ("llama", {}),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def offline_env():
    """Environment for subprocesses: offline hub, the repository importable."""
    env = {**os.environ, **OFFLINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="session", autouse=True)
def _offline(tmp_path_factory):
    """Offline hub and a private datasets cache for the in-process runs."""
    saved = {key: os.environ.get(key) for key in (*OFFLINE_ENV, "HF_DATASETS_CACHE")}
    os.environ.update(OFFLINE_ENV)
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("datasets-cache"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def make_checkpoint(tokenizer, corpus, tmp_path_factory):
    """``make_checkpoint(kind)`` -> folder with a briefly trained micro model of ``CHECKPOINTS[kind]`` and the
    tokenizer (cached per session)."""
    from transformers import AutoModelForCausalLM

    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    ids = torch.tensor(tokenizer(" ".join(texts), add_special_tokens=False)["input_ids"])
    cache = {}

    def make(kind: str):
        if kind not in cache:
            family, options = CHECKPOINTS[kind]
            torch.manual_seed(0)
            config = tiny_config(family, vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS, **options)
            model = AutoModelForCausalLM.from_config(config)
            generator = torch.Generator().manual_seed(0)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
            model.train()
            for _ in range(40):
                starts = torch.randint(0, ids.numel() - 32, (8,), generator=generator).tolist()
                rows = torch.stack([ids[s:s + 32] for s in starts])
                optimizer.zero_grad()
                model(input_ids=rows, labels=rows).loss.backward()
                optimizer.step()
            folder = tmp_path_factory.mktemp(kind.replace(":", "-"))
            model.eval().save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            cache[kind] = folder
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """Held-out ``.jsonl`` text (a different seed from the training corpus), 20 documents of 6 sentences."""
    path = tmp_path_factory.mktemp("text") / "heldout.jsonl"
    lines = synthetic_text(1, 120)
    path.write_text("".join(json.dumps({"text": " ".join(lines[i:i + 6])}) + "\n" for i in range(0, 120, 6)))
    return path
