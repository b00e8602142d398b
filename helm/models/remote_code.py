"""Make a saved HELM directory self-contained for ``trust_remote_code=True`` (and hence ``push_to_hub``).

``transformers`` copies a custom model's module file and the files it imports with single-dot relative
imports (``from .x import y``) into its module cache. Our code is a package (``helm.models`` imports
``helm.nn``, ``helm.manifold``, ...), so the saved directory gets a *flattened* copy instead: every module the
configuration and modeling files reach through relative imports is written next to them under a flat name
(``helm.nn.linear`` → ``helm_nn_linear.py``) with its relative imports rewritten to single-dot form.
Absolute imports (``torch``, ``geoopt``, ``transformers``) are left as they are: the loading environment
needs those packages, not ``helm``. The ``auto_map`` in ``config.json`` points at the flattened files.
"""

from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path
from typing import Dict


def _module_file(name: str) -> Path:
    return Path(importlib.import_module(name).__file__)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """Absolute dotted name of a relative ``from ... import`` inside ``module``."""
    is_pkg = _module_file(module).name == "__init__.py"
    base = module.split(".")
    base = base if is_pkg else base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    if not node.module:
        raise ValueError(f"{module}: 'from . import x' is not supported in remote code; import from the module")
    return ".".join(base + node.module.split("."))


def _flat_name(module: str, entries: Dict[str, str]) -> str:
    """The file stem of ``module`` in a bundle: ``helm.nn.linear`` -> ``helm_nn_linear``; a module of a bundle loaded
    as remote code (``transformers_modules.<folder>.helm_nn_linear``) keeps its stem, so a re-saved bundle has the
    same files (prefixing them again grew the names until the file system refused them)."""
    if module.startswith("transformers_modules."):
        return module.rsplit(".", 1)[-1]
    return entries.get(module) or module.replace(".", "_")


def _collect(entries: Dict[str, str]) -> Dict[str, str]:
    """All modules reachable from ``entries`` through relative imports, mapped to their flat file stems."""
    seen: Dict[str, str] = {}
    todo = list(entries)
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen[mod] = _flat_name(mod, entries)
        tree = ast.parse(_module_file(mod).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                todo.append(_resolve(mod, node))
    return seen


def _rewrite(module: str, flat: Dict[str, str]) -> str:
    """Source of ``module`` with each relative import turned into ``from .<flat name> import ...``."""
    source = _module_file(module).read_text()
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            target = flat[_resolve(module, node)]
            names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
            indent = lines[node.lineno - 1][: node.col_offset]
            edits.append((node.lineno, node.end_lineno, f"{indent}from .{target} import {names}\n"))
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1:end] = [text]
    return "".join(lines)


def _direct_imports(entry: str, flat: Dict[str, str]) -> str:
    """Lines importing, from the entry module ``entry``, every bundled module it reaches. ``transformers`` before
    5.10 copies into its module cache only the files an entry module imports directly, and the bundle is a tree."""
    reached = sorted(flat[m] for m in _collect({entry: flat[entry]}) if m != entry)
    return "\n# every bundled module, imported here so that older transformers copy them all\n" + "".join(
        f"from .{stem} import __name__ as _bundled_{stem}  # noqa: E402,F401\n" for stem in reached)


# Auto class -> the suffix of the family's class it loads (``HelmD`` + suffix); every one the modeling module defines
# goes into ``auto_map``, so a folder saved from any of them loads into any other with ``trust_remote_code=True``
AUTO_CLASSES = {"AutoModel": "Model", "AutoModelForCausalLM": "ForCausalLM",
                "AutoModelForSequenceClassification": "ForSequenceClassification",
                "AutoModelForTokenClassification": "ForTokenClassification",
                "AutoModelForQuestionAnswering": "ForQuestionAnswering"}


def write_remote_code(save_directory, model_class) -> list:
    """Write the flattened code for ``model_class`` into ``save_directory`` and set ``auto_map`` there.

    Returns the written file names. ``model_class`` is any HELM model class (``*Model``, ``*ForCausalLM`` or a task
    head); its ``config_class`` and every class of :data:`AUTO_CLASSES` in its modeling module are mapped.
    """
    save_directory = Path(save_directory)
    modeling = model_class.__module__
    config_class = model_class.config_class
    configuration = config_class.__module__
    entries = {modeling: modeling.rsplit(".", 1)[-1], configuration: configuration.rsplit(".", 1)[-1]}
    flat = _collect(entries)
    written = []
    for module, stem in sorted(flat.items()):
        source = _rewrite(module, flat)
        if module in entries:
            source += _direct_imports(module, flat)
        target = save_directory / f"{stem}.py"
        if target.is_symlink():  # replaced, never written through (a hub snapshot's files are links into its blobs)
            target.unlink()
        target.write_text(source)
        written.append(f"{stem}.py")
    modeling_stem, config_stem = entries[modeling], entries[configuration]
    family = config_class.__name__[: -len("Config")]
    classes = vars(importlib.import_module(modeling))
    auto_map = {"AutoConfig": f"{config_stem}.{config_class.__name__}"}
    auto_map.update({auto: f"{modeling_stem}.{family}{suffix}" for auto, suffix in AUTO_CLASSES.items()
                     if f"{family}{suffix}" in classes})
    config_path = save_directory / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = auto_map
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written


__all__ = ["AUTO_CLASSES", "write_remote_code"]
