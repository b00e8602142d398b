"""Issue 33's acceptance test for "nothing outside helm changes": importing helm, building, saving, reloading and
generating with both families, adapting one with PEFT, and loading a saved folder's remote code where helm is not
installed, leave every attribute of every class and every module-level function of ``transformers`` and PEFT as it
was, ``sys.meta_path`` and the warning filters too; ``gradient_checkpointing_enable`` leaves ``torch._dynamo.config``
and ``sys.meta_path`` as they were.

The record is taken in a fresh interpreter before anything of helm is imported: the objects themselves are kept (so
an id is never reused) and compared by identity afterwards. The one registration HELM makes in another library is
named here: PEFT's default LoRA targets for ``helm_d`` and ``helm_mice``, two keys added to PEFT's target tables
(``helm/models/peft_support.py``); the contents of every module-level dict of PEFT are compared to prove nothing
else is added."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from tests.helpers import run_without_helm, tiny_model

REPO = Path(__file__).resolve().parents[1]

# record() -> a snapshot; changes(snapshot) -> what differs now, as sorted strings. Every module named transformers*
# or peft* imported at record time: each class found in it (vars(cls): one entry per attribute, added or removed
# ones too) and each module-level function; for PEFT, the keys of every module-level dict.
RECORDER = textwrap.dedent("""
    import sys, types, warnings

    def _ours(name):
        return name.split(".")[0] in ("transformers", "peft")

    def record():
        classes, functions, tables = {}, {}, {}
        for name, module in list(sys.modules.items()):
            if module is None or not _ours(name):
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, type) and _ours(getattr(value, "__module__", "") or ""):
                    classes.setdefault(id(value), (value, dict(vars(value))))
                elif isinstance(value, types.FunctionType):
                    functions[(name, attr)] = value
                elif isinstance(value, dict) and name.startswith("peft"):
                    tables[(name, attr)] = (value, set(value))
        return {"classes": classes, "functions": functions, "tables": tables, "meta_path": list(sys.meta_path),
                "filters": list(warnings.filters)}

    def changes(before):
        found = []
        for cls, attrs in before["classes"].values():
            now = dict(vars(cls))
            # (__slotnames__: the cache copy and pickle add to a class they copy an instance of)
            for attr in (attrs.keys() | now.keys()) - {"__slotnames__"}:
                if attrs.get(attr, found) is not now.get(attr, found):
                    found.append(f"{cls.__module__}.{cls.__qualname__}.{attr}")
        for (module, attr), value in before["functions"].items():
            if getattr(sys.modules[module], attr, None) is not value:
                found.append(f"{module}.{attr}")
        for (module, attr), (table, keys) in before["tables"].items():
            for key in sorted(map(str, set(table) ^ keys)):
                found.append(f"{module}.{attr}[{key!r}]")
        if list(sys.meta_path) != before["meta_path"]:
            found.append(f"sys.meta_path: {sys.meta_path}")
        if list(warnings.filters) != before["filters"]:
            found.append("warnings.filters")
        return sorted(found)
""")

# the keys HELM adds to PEFT's target tables (LoRA's and its copies, as each PEFT module that imports one names it),
# the only change expected
REGISTERED = r"peft\.[\w.]+\.TRANSFORMERS_MODELS_TO_\w+_TARGET_MODULES_MAPPING\['helm_(d|mice)'\]"

WITH_HELM = RECORDER + textwrap.dedent("""
    import json, tempfile
    import torch
    import peft
    from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, GenerationConfig,
                              LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast)

    before = record()
    sys.path.insert(0, REPO)
    import helm
    from tests.helpers import tiny_model

    folder = tempfile.mkdtemp()
    ids = torch.tensor([[1, 2, 3, 4]])
    for family in ("helm_d", "helm_mice"):
        tiny_model(family).save_pretrained(f"{folder}/{family}")
        model = AutoModelForCausalLM.from_pretrained(f"{folder}/{family}")
        model.generate(ids, max_new_tokens=3, do_sample=False)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2))
    adapted(ids, labels=ids).loss.backward()
    print("CHANGES", json.dumps(changes(before)))
""")

WITHOUT_HELM = RECORDER + textwrap.dedent("""
    import json
    import torch
    import peft
    from transformers import AutoModelForCausalLM

    before = record()
    ids = torch.tensor([[1, 2, 3, 4]])
    for family in ("helm_d", "helm_mice"):
        model = AutoModelForCausalLM.from_pretrained(family, trust_remote_code=True)
        model.generate(ids, max_new_tokens=3, do_sample=False)
    peft.get_peft_model(model, peft.LoraConfig(r=2))
    assert "helm" not in sys.modules, "the child imported helm"
    print("CHANGES", json.dumps(changes(before)))
""")


def _changes(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("CHANGES ")[-1])


def test_importing_and_using_helm_changes_nothing_outside_it(tmp_path):
    import re

    proc = subprocess.run([sys.executable, "-c", f"REPO = {str(REPO)!r}\n" + WITH_HELM], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    changed = _changes(proc)
    assert [c for c in changed if not re.fullmatch(REGISTERED, c)] == [], changed
    assert any(c.endswith("LORA_TARGET_MODULES_MAPPING['helm_d']") for c in changed), changed


def test_loading_remote_code_without_helm_changes_nothing(tmp_path):
    import re

    for family in ("helm_d", "helm_mice"):
        tiny_model(family).save_pretrained(tmp_path / family)
    changed = _changes(run_without_helm(WITHOUT_HELM, tmp_path))
    assert [c for c in changed if not re.fullmatch(REGISTERED, c)] == [], changed


def test_gradient_checkpointing_leaves_dynamo_and_meta_path_alone():
    import torch._dynamo

    model = tiny_model("helm_mice", train=True)
    config, finders = torch._dynamo.config.get_config_copy(), list(sys.meta_path)
    model.gradient_checkpointing_enable()
    ids = torch.tensor([[1, 2, 3, 4]])
    model(ids, labels=ids).loss.backward()
    assert list(sys.meta_path) == finders
    now = torch._dynamo.config.get_config_copy()
    assert {key: now[key] for key in config if now[key] != config[key]} == {}
