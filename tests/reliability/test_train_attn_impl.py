"""``--model.attn_implementation=triton`` (issue 22 item 3B, issue 33 item 2): train.py passes the recipe's
attention implementation through transformers' ``attn_implementation`` and validates it by building the model and
running it forward on the device it trains on. Where the kernel cannot run (a CPU without the Triton interpreter)
that is the one-line exit 2 of tests/reliability/test_train_cli.py, naming the key and the device; on a GPU the
choice is accepted (the forward runs on CUDA, where the kernel does)."""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.test_train import fresh_accelerate_state, run_data, train_script, write_recipe  # noqa: F401  (fixtures)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the kernel can run here")
def test_triton_override_without_cuda_exits_2_with_one_clear_line(tmp_path, run_data, capsys):
    recipe = write_recipe(tmp_path, run_data, train={"max_steps": 4, "save_every": 2}, demo={"prompt": None})
    assert train_script.main(["--config", str(recipe), "--model.attn_implementation=triton"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, captured.out + captured.err
    assert re.search(r"model\.attn_implementation='triton'.*cpu", errors[0]), errors[0]
    assert "Traceback" not in captured.out + captured.err
    assert "[train] data:" not in captured.out, "the problem was found only after loading the data"


def test_build_model_probes_on_the_training_device(monkeypatch):
    """The probe forward runs on the device passed in (the accelerator's), not always on the CPU."""
    import inspect

    assert "device" in inspect.signature(train_script.build_model).parameters
