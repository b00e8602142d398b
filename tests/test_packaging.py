"""Packaging hazards: no top-level ``kernels`` package of ours to clash with the PyPI ``kernels`` package (which
``transformers`` probes for), ``import helm`` without triton (the kernels in ``helm/ops/lorentz_attention_triton`` are
loaded lazily, ARCHITECTURE.md), and a saved model's remote code that needs neither triton nor the kernel files and
patches nothing."""

import ast
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
                           intermediate_size=65, vocab_size=64, max_position_embeddings=64, attn_implementation="triton")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    files = sorted(tmp_path.glob("*.py"))
    assert any(f.name == "helm_ops_attention.py" for f in files), [f.name for f in files]
    assert not [f.name for f in files if "lorentz_attention_triton" in f.name]
    needed = set().union(*(get_imports(f) for f in files))
    assert not needed & {"triton", "helm", "kernels"}, needed


def _foreign_methods() -> set[str]:
    """The names of the methods of transformers' and PEFT's base classes (and ``torch.nn.Module``'s)."""
    import peft
    import torch
    from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    owners = (PreTrainedModel, PreTrainedConfig, PreTrainedTokenizerBase, GenerationConfig, peft.PeftModel,
              peft.PeftConfig, torch.nn.Module)
    return {name for owner in owners for klass in owner.__mro__ if klass is not object
            for name, value in vars(klass).items() if callable(value) or isinstance(value, (classmethod, staticmethod))}


def _patches(source: str) -> list[str]:
    """The lines of ``source`` that change something another package owns: an assignment to an attribute of a name
    bound by an absolute import (``transformers.X.y = ...``, ``PreTrainedModel.save_pretrained = ...``), one to a
    method of transformers', PEFT's or torch's base classes on anything but ``self`` (``cls.load_adapter = ...``),
    a ``setattr`` / ``delattr`` call on an imported name, or any mention of ``sys.meta_path``."""
    methods = _foreign_methods()
    tree = ast.parse(source)
    foreign = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0)
               for alias in node.names}

    def root(node):
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        targets = [t for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
        if any(isinstance(t, ast.Attribute) and (root(t) in foreign or t.attr in methods and root(t) != "self")
               for t in targets):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and root(node.args[0]) in foreign:
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
        if isinstance(node, ast.Attribute) and node.attr == "meta_path":
            found.append(f"line {node.lineno}: sys.meta_path")
    return found


def test_the_remote_code_bundle_patches_nothing(tmp_path):
    """Issue 33: a saved folder's code replaces no method of transformers, PEFT or torch and installs no import hook
    (its one registration, PEFT's default LoRA targets, adds two keys to PEFT's tables: tests/test_lane.py)."""
    import helm
    from transformers import AutoModelForCausalLM

    for family in ("tiny-helm-d", "tiny-helm-mice"):
        AutoModelForCausalLM.from_config(helm.load_config(family)).save_pretrained(tmp_path / family)
        found = {f.name: problems for f in sorted((tmp_path / family).glob("*.py"))
                 if (problems := _patches(f.read_text()))}
        assert found == {}, found
    assert _patches("import transformers\ntransformers.PreTrainedModel.save_pretrained = None\n")
    assert _patches("from peft import PeftModel\nsetattr(PeftModel, 'load_adapter', None)\n")
    assert _patches("def hook(module):\n    cls = module.PeftModel\n    cls.load_adapter = None\n")


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
