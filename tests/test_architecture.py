"""ARCHITECTURE.md's dependency direction, read off the source: every ``import`` of a helm module (module level and
inside functions) is an edge; there is no import cycle, and no module imports one of a higher layer or of another
package of its own layer."""

import ast
from pathlib import Path

import pytest

import helm

ROOT = Path(helm.__file__).parent

# ARCHITECTURE.md's layers, lowest first: helm.models -> helm.nn -> helm.ops -> helm.manifold (-> helm.precision);
# presets and optimiser above the models, conversion above the presets; data, then training and evaluation on top
LAYERS = {
    "helm.precision": 0, "helm.manifest": 0, "helm.distributed": 0,
    "helm.manifold": 1,
    "helm.ops": 2,
    "helm.nn": 3,
    "helm.models": 4,
    "helm.presets": 5, "helm.optim": 5,
    "helm.convert": 6, "helm.data": 6,
    "helm.training": 7, "helm.evaluation": 7,
    "helm.serve": 8,
}


def modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` for every module under helm/ but the package facade ``helm``."""
    found = {}
    for file in ROOT.rglob("*.py"):
        parts = list(file.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (file, package)
    found.pop("helm")
    return found


def imports(name: str, file: Path, package: bool, known) -> set[str]:
    """The helm modules ``name`` imports (``from x import y`` counts as ``x.y`` where that is a module)."""
    targets = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + (node.module.split(".") if node.module else []))
            else:
                target = node.module or ""
            targets |= {f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names}
        elif isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
    return {t for t in targets if (t == "helm" or t.startswith("helm.")) and t != name}


def unit(name: str) -> str:
    """The entry of :data:`LAYERS` that ``name`` belongs to."""
    return next(u for u in sorted(LAYERS, key=len, reverse=True) if name == u or name.startswith(u + "."))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, file, package, known) for name, (file, package) in known.items()}


def test_every_module_has_a_layer(graph):
    assert all(unit(name) for name in graph)


def test_no_module_imports_the_helm_facade(graph):
    assert [name for name, targets in graph.items() if "helm" in targets] == []


def test_no_import_cycle(graph):
    """Depth-first search for a back edge; the message names the cycle."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(name, path):
        state[name] = 1
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_lower_layers_never_import_higher_ones(graph):
    wrong = sorted(f"{name} -> {target}" for name, targets in graph.items() for target in targets
                   if target in graph and (LAYERS[unit(target)] > LAYERS[unit(name)] or (
                       LAYERS[unit(target)] == LAYERS[unit(name)] and unit(target) != unit(name))))
    assert wrong == []


def test_the_graph_sees_every_form_of_import(tmp_path):
    """Relative (one and two dots), absolute and function-level imports are all edges, so none can hide a cycle."""
    file = tmp_path / "attention.py"
    file.write_text("from .centring import a\nfrom ..manifold import math\nimport helm.precision\n"
                    "def f():\n    from helm.nn import attention\n", encoding="utf-8")
    known = {"helm.ops.centring", "helm.manifold.math", "helm.precision", "helm.nn.attention"}
    assert imports("helm.ops.attention", file, False, known) == known
