"""Fixtures shared by the whole suite; plain helpers live in ``tests/helpers.py``."""

import json
import warnings

import pytest
import torch

from tests.helpers import synthetic_text, tiny_config as _tiny_config

warnings.filterwarnings("ignore", category=DeprecationWarning)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def tiny_config():
    """Factory ``tiny_config(family="helm_d", **overrides)`` for unit-test-sized configs (see tests.helpers)."""
    return _tiny_config


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A synthetic ``.jsonl`` corpus (one sentence per record) for tokenizers and micro training runs."""
    path = tmp_path_factory.mktemp("corpus") / "synthetic.jsonl"
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in synthetic_text(0, 400)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tokenizer(corpus, tmp_path_factory):
    """A 320-token byte-level BPE trained on :func:`corpus` (``<|endoftext|>`` = eos = bos, ``<|pad|>``)."""
    from helm.data import train_tokenizer

    return train_tokenizer(corpus, tmp_path_factory.mktemp("tokenizer"), vocab_size=320)
