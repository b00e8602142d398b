"""Packaging hazards (DESIGN §7): our top-level ``kernels`` folder vs the PyPI ``kernels`` package, and
``import helm`` without triton."""

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_transformers_does_not_mistake_our_kernels_for_the_hub_package():
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and pathlib.Path(spec.origin).resolve().is_relative_to(REPO), (
        "the project's kernels folder must be what `import kernels` finds")
    proc = _run("""
        import transformers.utils.import_utils as iu
        assert not iu.is_kernels_available(), "transformers thinks the HF `kernels` hub package is installed"
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2)
        import torch
        out = LlamaForCausalLM(cfg)(torch.tensor([[1, 2, 3]]))
        assert out.logits.shape == (1, 3, 32)
        import helm
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_import_helm_without_triton():
    proc = _run("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        import helm, helm.nn, helm.ops
        from helm.manifold import lift
        q = lift(torch.randn(1, 2, 5, 8), k=1.0)
        out = helm.ops.lorentz_attention(q, q, q, k=1.0, tau=1.0, impl="auto")
        assert out.shape == q.shape
        assert "triton" not in sys.modules or sys.modules["triton"] is None
        try:
            helm.ops.lorentz_attention(q, q, q, k=1.0, tau=1.0, impl="triton")
        except ValueError as err:
            print("raised:", err)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "raised:" in proc.stdout and "triton" in proc.stdout
