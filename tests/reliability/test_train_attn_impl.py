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
@pytest.mark.parametrize("base", ["tiny-helm-d", "tiny-helm-mice"])  # MiCE: HMLA's absorbed probe must refuse too
def test_triton_override_without_cuda_exits_2_with_one_clear_line(tmp_path, run_data, capsys, base):
    recipe = write_recipe(tmp_path, run_data, base=base, train={"max_steps": 4, "save_every": 2},
                          demo={"prompt": None})
    assert train_script.main(["--config", str(recipe), "--model.attn_implementation=triton"]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, captured.out + captured.err
    assert re.search(r"model\.attn_implementation='triton'.*cpu", errors[0]), errors[0]
    assert "Traceback" not in captured.out + captured.err
    assert "[train] data:" not in captured.out, "the problem was found only after loading the data"
