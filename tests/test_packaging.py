"""Packaging hazards: our top-level ``kernels`` folder vs the PyPI ``kernels`` package (which ``transformers`` probes
for), and ``import helm`` without triton (``kernels/`` is loaded lazily, ARCHITECTURE.md)."""

import importlib.util
import os
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


def test_a_non_editable_install_ships_every_preset(tmp_path):
    """Build the wheel (from a copy of the sources, so the checkout gets no build/ or egg-info), check it holds
    every preset JSON, install it into a plain folder and load a preset from outside the repository."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("helm", "kernels"):
        shutil.copytree(REPO / package, src / package, ignore=ignore)
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(wheels)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("helm_zoo-*.whl")
    presets = sorted(p.name for p in (REPO / "helm" / "presets").glob("*.json"))
    with zipfile.ZipFile(wheel) as archive:
        shipped = sorted(pathlib.PurePosixPath(n).name for n in archive.namelist() if n.startswith("helm/presets/")
                         and n.endswith(".json"))
    assert presets and shipped == presets

    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    code = "import helm; c = helm.load_config('helm-mice-1b'); print(helm.__file__); print(c.hidden_size)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=outside, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(target)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, hidden = proc.stdout.strip().splitlines()[-2:]
    assert pathlib.Path(where).is_relative_to(target) and hidden == "910"
