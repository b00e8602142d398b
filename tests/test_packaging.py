"""Packaging hazards: no top-level ``kernels`` package of ours to clash with the PyPI ``kernels`` package (which
``transformers`` probes for), ``import helm`` without triton (the kernels in ``helm/ops/lorentz_attention_triton`` are
loaded lazily, ARCHITECTURE.md), and a saved model's remote code that needs neither triton nor the kernel files."""

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


def test_no_top_level_kernels_package_of_ours():
    """The kernels live inside ``helm``: ``import kernels`` finds Hugging Face's package (if installed), never a
    folder of this repository, and ``transformers`` works next to ``helm``."""
    assert not (REPO / "kernels").exists()
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not pathlib.Path(spec.origin or "").resolve().is_relative_to(REPO)
    proc = _run("""
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


def test_remote_code_needs_neither_triton_nor_the_kernel_files(tmp_path):
    """``save_pretrained`` writes the flattened modules the model reaches by relative imports; the kernel package is
    imported by absolute name inside ``try`` (``helm.ops.attention._load_kernel``), so it is not copied and
    ``transformers`` lists neither ``triton`` nor ``helm`` among the bundle's requirements."""
    import torch
    from transformers.dynamic_module_utils import get_imports

    import helm
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = helm.load_config("tiny-helm-d", num_hidden_layers=1, hidden_size=33, num_attention_heads=2, head_dim=17,
                           intermediate_size=65, vocab_size=64, max_position_embeddings=64, attn_impl="triton")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    files = sorted(tmp_path.glob("*.py"))
    assert any(f.name == "helm_ops_attention.py" for f in files), [f.name for f in files]
    assert not [f.name for f in files if "lorentz_attention_triton" in f.name]
    needed = set().union(*(get_imports(f) for f in files))
    assert not needed & {"triton", "helm", "kernels"}, needed


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
    shutil.copytree(REPO / "helm", src / "helm", ignore=ignore)
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
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "helm/ops/lorentz_attention_triton/fwd_bwd.py" in names
    assert not [n for n in names if n.startswith("kernels/")]

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
