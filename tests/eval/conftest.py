"""Fixtures for the eval/ scripts: micro checkpoints saved with save_pretrained, and loading scripts by path.

``eval`` is a Python builtin, so ``eval/`` is not a package: tests load its scripts by file path
(:func:`load_script`) or run them as subprocesses. The checkpoints are micro HELM-D, HELM-MiCE and Llama
models (one or two layers, ambient width 33) with a 320-token byte-level BPE trained on synthetic text,
each briefly trained (a few dozen Adam steps) so that its predictions are peaked rather than uniform:
batch-size and padding comparisons then test real differences, not ties.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EVAL_DIR = REPO / "eval"
TASK_DIR = EVAL_DIR / "tasks"
MAX_POSITIONS = 64  # small, so lm-eval's rolling windows and the extrapolation factors really split the text
# one intra-op thread: the micro models gain nothing from two, and on a busy 2-core machine OpenMP's spin-waiting
# threads made the same runs up to 10x slower
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

WORDS = ("the a one two three four five six seven red blue green cat dog bird river stone tree house light "
         "runs sits sings flows over under near slowly quickly and then water ice rain spring summer").split()


def load_script(name: str):
    """Import ``eval/<name>.py`` by path, under a private module name (never as ``eval.<name>``)."""
    module_name = f"helm_eval_script_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EVAL_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def synthetic_text(seed: int, n_lines: int) -> list[str]:
    rng = random.Random(seed)
    counting = "one two three four five six seven"
    lines = []
    for i in range(n_lines):
        if i % 5 == 0:
            start = rng.randrange(0, 4)
            lines.append(" ".join(counting.split()[start:start + 4]) + ".")
        else:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + ".")
    return lines


def micro_config(kind: str, vocab_size: int):
    import helm

    if kind == "llama":
        return helm.load_config("tiny-llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=16, vocab_size=vocab_size,
                                max_position_embeddings=MAX_POSITIONS)
    common = dict(hidden_size=33, num_attention_heads=2, intermediate_size=65, vocab_size=vocab_size,
                  max_position_embeddings=MAX_POSITIONS)
    if kind == "helm_mice":
        return helm.load_config("tiny-helm-mice", num_hidden_layers=2, moe_intermediate_size=33, kv_lora_rank=17,
                                qk_nope_head_dim=9, qk_rope_head_dim=9, v_head_dim=9, **common)
    positional = kind.split(":", 1)[1] if ":" in kind else "hope"
    return helm.load_config("tiny-helm-d", num_hidden_layers=1, head_dim=17, positional=positional, **common)


def train_briefly(model, ids: torch.Tensor, *, steps: int = 40, seq_len: int = 32, batch: int = 8) -> None:
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq_len, (batch,), generator=generator)
        rows = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=rows, labels=rows).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread inside the eval test modules (restored afterwards; see OFFLINE_ENV)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def offline_env():
    """Environment for subprocesses: offline hub, the repository importable, datasets cache kept per run."""
    env = {**os.environ, **OFFLINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.fixture(scope="session", autouse=True)
def _offline(tmp_path_factory):
    """Offline hub and a private datasets cache for the in-process lm-eval runs."""
    saved = {k: os.environ.get(k) for k in (*OFFLINE_ENV, "HF_DATASETS_CACHE")}
    os.environ.update(OFFLINE_ENV)
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("datasets-cache"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A synthetic text file (one sentence per line) for the tokenizer and the micro training runs."""
    path = tmp_path_factory.mktemp("corpus") / "synthetic.txt"
    path.write_text("\n".join(synthetic_text(0, 400)) + "\n")
    return path


@pytest.fixture(scope="session")
def tokenizer(corpus, tmp_path_factory):
    from helm.data import train_tokenizer

    return train_tokenizer(corpus, tmp_path_factory.mktemp("tokenizer"), vocab_size=320)


@pytest.fixture(scope="session")
def make_checkpoint(tokenizer, corpus, tmp_path_factory):
    """``make_checkpoint(kind)`` -> folder with a briefly trained micro model and the tokenizer (cached).

    ``kind``: ``helm_d``, ``helm_mice``, ``llama``, or ``helm_d:<positional>`` for a PE variant.
    """
    import helm  # noqa: F401
    from transformers import AutoModelForCausalLM

    cache: dict[str, Path] = {}
    ids = torch.tensor(tokenizer(corpus.read_text(), add_special_tokens=False)["input_ids"])

    def make(kind: str) -> Path:
        if kind not in cache:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(micro_config(kind, len(tokenizer)))
            train_briefly(model, ids)
            folder = tmp_path_factory.mktemp(kind.replace(":", "-"))
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            cache[kind] = folder
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A held-out jsonl text file (different seed from the training text)."""
    import json

    path = tmp_path_factory.mktemp("text") / "heldout.jsonl"
    lines = synthetic_text(1, 120)
    docs = [" ".join(lines[i:i + 6]) for i in range(0, len(lines), 6)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path
