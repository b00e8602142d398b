"""PEFT support for the HELM models: PEFT's default adapter targets for the HELM model types, and adapters checked
against the model they are loaded onto.

**Default targets.** PEFT picks the modules of a config without ``target_modules`` from its tables keyed by
``config.model_type`` (``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` and the tables of
the LoRA-like methods, copies of it). HELM's entries follow Llama's choice, the query and value projections (plain
``nn.Linear``s whose outputs the layers lift, so adapted outputs stay on the hyperboloid): ``q_proj`` and ``v_proj``;
HMLA makes its values in ``kv_b_proj``, so HELM-MiCE names that too.

**Adapters of another model.** PEFT loads an adapter onto any model whose modules have the adapter's names and
shapes: a HELM-D adapter loads onto a HELM-MiCE model with ``attention_type="mha"`` (both have ``q_proj`` and
``v_proj`` of the same shapes), and adapter weights for modules the model lacks (``v_proj`` of a HMLA model, layers
beyond its depth) are dropped without a word. :func:`adapter_problem` names both before PEFT loads anything:
``PeftModel.load_adapter`` (which ``PeftModel.from_pretrained`` calls) is wrapped for HELM base models, and
``HelmPreTrainedModel.load_adapter`` (``transformers``' PEFT integration) checks first. The same check names a
path that is no adapter folder (:func:`adapter_path_problem`: a missing folder, a file, a model folder), which PEFT
and ``transformers`` would look up on the hub ("Repo id must be in the form ..."), an adapter of a model of another
width (a LoRA weight's saved shape that does not fit its module: ``transformers``' "You set
``ignore_mismatched_sizes`` to False ...") and a damaged ``adapter_config.json`` or weights file (a bare
``JSONDecodeError`` / ``SafetensorError`` naming no file).

Both hooks are installed when PEFT's modules exist: at once if PEFT is already imported, else right after it is (helm
does not import PEFT, an optional dependency that takes seconds to import).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
from pathlib import Path

from .loading import ADAPTER_CONFIG, ADAPTER_WEIGHTS

DEFAULT_TARGETS = {"helm_d": ["q_proj", "v_proj"], "helm_mice": ["q_proj", "v_proj", "kv_b_proj"]}
# the prefix PEFT gives the keys of an adapter's saved weights (prompt-learning methods: "base_model." only)
_SAVED_PREFIX = "base_model.model."


def add_targets(constants) -> None:
    """Add :data:`DEFAULT_TARGETS` to LoRA's table and to every table that copies it (the same ``llama`` entry),
    keeping any entry already there."""
    lora = constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    for name, table in vars(constants).items():
        if name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_TARGET_MODULES_MAPPING") and \
                isinstance(table, dict) and (table is lora or table.get("llama") == lora.get("llama")):
            for model_type, targets in DEFAULT_TARGETS.items():
                table.setdefault(model_type, list(targets))


def _read_json(file: Path):
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # unreadable: the loader that reads it next reports it


def _base_model_type(base) -> str | None:
    """The ``model_type`` in the ``config.json`` of ``base`` (an adapter's ``base_model_name_or_path``): a local
    folder, or a hub id whose config is in the local cache (nothing is downloaded); None where unknown."""
    if not isinstance(base, str) or not base:
        return None
    folder = Path(base).expanduser()
    file = folder / "config.json" if folder.is_dir() else None
    if file is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(base, "config.json")
        except Exception:  # noqa: BLE001 - not a valid repo id: nothing to compare
            cached = None
        file = Path(cached) if isinstance(cached, str) else None
    config = _read_json(file) if file is not None and file.is_file() else None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def _class_model_type(name) -> str | None:
    """The ``model_type`` of the model class named ``name`` (an adapter's ``auto_mapping.base_model_class``, which
    PEFT records when the adapter has no ``task_type``): a HELM class, or one of transformers' Auto mappings; None
    where unknown. Nothing is imported by name (PEFT's ``import_allowlist`` guards that)."""
    from transformers.models.auto import modeling_auto

    from .modeling_common import HelmPreTrainedModel

    pending, helm_classes = [HelmPreTrainedModel], []
    while pending:  # the HELM classes defined so far (relative imports only: the remote-code bundle has no helm)
        helm_classes.append(pending.pop())
        pending.extend(helm_classes[-1].__subclasses__())
    cls = next((cls for cls in helm_classes if cls.__name__ == name), None)
    if cls is not None and isinstance(getattr(getattr(cls, "config_class", None), "model_type", None), str):
        return cls.config_class.model_type
    for table_name, table in vars(modeling_auto).items():
        if table_name.startswith("MODEL_") and table_name.endswith("_MAPPING_NAMES") and isinstance(table, dict):
            found = next((model_type for model_type, names in table.items()
                          if name == names or (isinstance(names, tuple) and name in names)), None)
            if found is not None:
                return found
    return None


def _adapter_shapes(folder: Path) -> tuple[dict[str, list[int]], str | None]:
    """The keys and shapes of the adapter weights saved in ``folder`` (from the safetensors header, or a memory-mapped
    ``.bin``: no tensor is read), and why the file cannot be read (None when it can): PEFT's own error named neither
    the file nor what is wrong with it (``SafetensorError: Error while deserializing header: invalid header
    length``). ``({}, None)`` when the folder holds no weights file."""
    for name in ADAPTER_WEIGHTS:
        file = folder / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(file, framework="pt") as f:
                    return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}, None
            import torch

            try:
                weights = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a file of torch's legacy format cannot be memory-mapped; PEFT reads it whole
                weights = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(weights, dict):
                raise TypeError(f"it holds a {type(weights).__name__}, not a dict of tensors")
            return {key: list(getattr(value, "shape", ())) for key, value in weights.items()}, None
        except Exception as error:  # noqa: BLE001 - any failure to read the file is a damaged file
            return {}, (f"{str(file)!r} cannot be read ({type(error).__name__}: {error}): the file is truncated or "
                        "corrupted; save the adapter again")
    return {}, None


# the LoRA weights whose saved shape fixes a size of the module they adapt: (axis of the saved weight, the module's
# attribute, how this model's module is described): lora_A is [r, in_features], lora_B [out_features, r] (AdaLoRA
# saves the same). Embeddings are left out: PEFT cannot adapt HELM's LorentzEmbedding.
_LORA_SIZES = {"lora_A": (1, "in_features", "takes"), "lora_B": (0, "out_features", "gives")}


def _shape_mismatch(model, shapes: dict[str, list[int]], prefix: str) -> str | None:
    """The first saved weight in ``shapes`` (in key order) whose shape does not fit the module of ``model`` it
    adapts (:data:`_LORA_SIZES`), as a sentence, or None; weights of other kinds, or of modules without integer
    ``in_features`` / ``out_features``, are not compared."""
    modules = dict(model.named_modules())
    for key in sorted(shapes):
        parts = key[len(_SAVED_PREFIX):].split(".") if key.startswith(_SAVED_PREFIX) else key.split(".")
        cut = next((i for i, part in enumerate(parts) if part.startswith(prefix)), None)
        size = _LORA_SIZES.get(parts[cut]) if cut else None
        module = modules.get(".".join(parts[:cut])) if size else None
        if module is None or len(shapes[key]) != 2:
            continue
        axis, attribute, verb = size
        actual = getattr(module, attribute, None)
        if isinstance(actual, int) and shapes[key][axis] != actual:
            return (f"the adapter's {'.'.join(parts[:cut + 1])} holds {shapes[key]} ({attribute} "
                    f"{shapes[key][axis]}), this model's {parts[cut - 1]} {verb} {actual}: it was trained on a model "
                    "of another width; load it onto the model it was trained on")
    return None


def _lora_settings_problem(config: dict, shapes: dict[str, list[int]]) -> str | None:
    """Why a LoRA adapter's settings (``adapter_config.json`` read as ``config``) do not fit, or cannot build, the
    weights saved beside them (``shapes``): ``r`` not a positive integer or ``lora_alpha`` not a number (PEFT: a
    ``TypeError`` such as "'<=' not supported between instances of 'str' and 'int'"), or an ``r`` other than the
    rank of the saved ``lora_A`` weights (transformers: "look at the above report"; a ``rank_pattern`` of per-module
    ranks is not compared). None otherwise, and for other PEFT methods."""
    if config.get("peft_type") != "LORA":
        return None
    rank, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        return f"{ADAPTER_CONFIG} has r={json.dumps(rank)}, not a positive integer (the LoRA rank); fix it or save the " \
               "adapter again"
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        return f"{ADAPTER_CONFIG} has lora_alpha={json.dumps(alpha)}, not a number; fix it or save the adapter again"
    if config.get("rank_pattern"):
        return None
    for key in sorted(shapes):
        parts = key.split(".")
        if "lora_A" in parts and len(shapes[key]) == 2 and shapes[key][0] != rank:
            return (f"{ADAPTER_CONFIG} has r={rank}, but the saved {'.'.join(parts[:parts.index('lora_A') + 1])} "
                    f"holds {shapes[key]} (rank {shapes[key][0]}): these settings are not the ones the weights were "
                    "saved with; fix r or save the adapter again")
    return None


def _tuner_prefix(peft_type) -> str | None:
    """The prefix of the parameters a PEFT method adds to a module (``lora_`` for LoRA), from PEFT's own table."""
    try:
        from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING
    except ImportError:
        return None
    return next((prefix for kind, prefix in PEFT_TYPE_TO_PREFIX_MAPPING.items()
                 if str(getattr(kind, "value", kind)) == str(peft_type)), None)


def _peft_knows_types() -> bool:
    """Whether PEFT's table of methods can be read (PEFT installed), so an unknown ``peft_type`` can be named."""
    try:
        from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING
    except ImportError:
        return False
    return bool(PEFT_TYPE_TO_PREFIX_MAPPING)


def adapter_path_problem(adapter, *, subfolder: str = "", need_config: bool = False) -> str | None:
    """Why ``adapter`` (with ``subfolder``) is no PEFT adapter folder, as a sentence that follows ``load(adapter)``,
    or None. PEFT and ``transformers`` read a path that does not exist as a hub id (their message: "Repo id must be
    in the form 'repo_name' or 'namespace/repo_name'"), and a folder without ``adapter_config.json`` too; named
    here:

    * a path no hub id matches (:func:`~helm.models.loading.looks_like_local_path`) that does not exist, or a ``~``
      path (neither expands it);
    * an existing file;
    * a ``subfolder`` the folder lacks;
    * a folder without ``adapter_config.json``: always when it holds no adapter weights either (a model folder, say),
      and when ``need_config`` (the loader reads the adapter's settings from the folder, no config was passed).

    A str that may be a hub id, an empty one and a non-path (None: ``peft_config=`` and ``adapter_state_dict=``
    were passed) are left to the loader."""
    from .loading import folder_entry_problem, unloadable_path_problem

    if not isinstance(adapter, (str, os.PathLike)) or not os.fspath(adapter).strip():
        return None
    text = os.fspath(adapter)
    path = Path(text)
    if not path.exists():
        return unloadable_path_problem(adapter)  # PEFT reads paths as transformers does: '~', no such folder
    if path.is_file():
        use = f"; use {str(path.parent)!r}" if path.name in (ADAPTER_CONFIG, *ADAPTER_WEIGHTS) else ""
        return f"is a file, not an adapter folder (the folder PeftModel.save_pretrained writes){use}"
    folder = path / subfolder if subfolder else path
    if not folder.is_dir():
        return f"has no subfolder {subfolder!r} (subfolder=)"
    if (folder / ADAPTER_CONFIG).is_file():
        return None
    if problem := folder_entry_problem(folder, [ADAPTER_CONFIG], "PeftModel.save_pretrained"):
        return f"{problem}; save the adapter again"
    weights = [name for name in ADAPTER_WEIGHTS if (folder / name).is_file()]
    if weights and not need_config:
        return None
    where = f"its subfolder {subfolder!r}" if subfolder else "the folder"
    if weights:
        hint = f"it holds {', '.join(weights)} only; pass the adapter's settings (a PEFT config) with them"
    elif (folder / "config.json").is_file():
        hint = "it is a model folder (config.json), which loads with from_pretrained"
    elif adapters := sorted(str(sub) for sub in folder.iterdir() if (sub / ADAPTER_CONFIG).is_file()):
        hint = f"its subfolders hold adapters: load one of {', '.join(map(repr, adapters))}"
    else:
        hint = "a model folder loads with from_pretrained"
    return f"{where} has no {ADAPTER_CONFIG}: not a PEFT adapter folder; {hint}"


def adapter_problem(model, adapter, *, subfolder: str = "", need_config: bool = False) -> str | None:
    """Why the PEFT adapter ``adapter`` (``/subfolder``) cannot be loaded onto ``model`` (a HELM model: the one PEFT
    adapts), or None: a path that is no adapter folder (:func:`adapter_path_problem`, given ``need_config``), a
    damaged adapter in a local folder, which PEFT reported without naming the file (a raw ``JSONDecodeError`` or
    ``SafetensorError``), or one that does not belong to ``model``:

    * its ``adapter_config.json`` is no JSON object (named with the line and column,
      :func:`~helm.models.loading.json_file_problem`);
    * its weights file cannot be read (truncated, corrupted: :func:`_adapter_shapes`);
    * its ``adapter_config.json`` names a base model (``base_model_name_or_path``) whose ``config.json``, found
      locally or in the hub cache, has another ``model_type`` than ``model``;
    * its weights adapt modules ``model`` does not have (PEFT would load the others and drop these);
    * a LoRA weight's saved shape does not fit the module it adapts (``lora_A`` ``[r, in_features]``, ``lora_B``
      ``[out_features, r]``): an adapter of a model of another width, which ``transformers`` refused with "You set
      ``ignore_mismatched_sizes`` to False ... look at the above report" (:func:`_shape_mismatch`, the first one).

    Shapes come from the safetensors header (no tensor is read). A hub adapter not downloaded yet, or a base model
    that cannot be found, is not checked (nothing is downloaded here)."""
    from .loading import folder_entry_problem, json_file_problem

    if problem := adapter_path_problem(adapter, subfolder=subfolder, need_config=need_config):
        return problem
    if not isinstance(adapter, (str, os.PathLike)) or not os.fspath(adapter):
        return None
    folder = Path(adapter).expanduser() / (subfolder or "")
    if not folder.is_dir():
        return None
    if (folder / ADAPTER_CONFIG).is_file() and (problem := json_file_problem(folder / ADAPTER_CONFIG,
                                                                              holds="the adapter's settings")):
        return f"{subfolder + '/' if subfolder else ''}{problem}; fix it or save the adapter again"
    if problem := folder_entry_problem(folder, (ADAPTER_CONFIG, *ADAPTER_WEIGHTS), "PeftModel.save_pretrained"):
        return f"{problem}; save the adapter again"
    shapes, problem = _adapter_shapes(folder)
    if problem:
        return problem
    if (folder / ADAPTER_CONFIG).is_file() and not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        return (f"the adapter folder has {ADAPTER_CONFIG} but no weights ({' or '.join(ADAPTER_WEIGHTS)}, which "
                "PeftModel.save_pretrained writes beside it); copy the adapter's files")
    config = _read_json(folder / ADAPTER_CONFIG)
    if not isinstance(config, dict):
        return None
    if "peft_type" in config and not isinstance(config["peft_type"], str):
        return (f"{ADAPTER_CONFIG} has peft_type={json.dumps(config['peft_type'])}, not the name of a PEFT method "
                "(e.g. \"LORA\"); fix it or save the adapter again")
    if (kind := config.get("peft_type")) is not None and _tuner_prefix(kind) is None and _peft_knows_types():
        return (f"{ADAPTER_CONFIG} has peft_type={kind!r}, which is no PEFT method this PEFT knows; fix it or save "
                "the adapter again")
    if problem := _lora_settings_problem(config, shapes):
        return problem
    ours = getattr(model.config, "model_type", None)
    base = config.get("base_model_name_or_path")
    theirs = _base_model_type(base)
    if theirs is None and isinstance(mapping := config.get("auto_mapping"), dict):
        theirs = _class_model_type(mapping.get("base_model_class"))
        base = mapping.get("base_model_class") if theirs is not None else base
    if theirs is not None and ours is not None and theirs != ours:
        return (f"the adapter was trained on {base!r}, a {theirs} model, and this model is a {ours} model: PEFT would "
                f"apply its weights to this model's modules of the same names and shapes; load it onto a {theirs} "
                "model")
    prefix = _tuner_prefix(config.get("peft_type"))
    if not prefix:
        return None
    modules = {name for name, _ in model.named_modules()}
    lacking = set()
    for key in shapes:
        parts = key[len(_SAVED_PREFIX):].split(".") if key.startswith(_SAVED_PREFIX) else key.split(".")
        cut = next((i for i, part in enumerate(parts) if part.startswith(prefix)), None)
        if cut and ".".join(parts[:cut]) not in modules:
            lacking.add(".".join(parts[:cut]))
    if lacking:
        shown = sorted(lacking)
        listed = ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
        trained = f"; it was trained on {base!r}" if isinstance(base, str) and base else ""
        return (f"the adapter holds weights for {len(shown)} module(s) this {type(model).__name__} does not have "
                f"({listed}): PEFT would load the others and drop these without a word{trained}; load it onto the "
                "model it was trained on")
    return _shape_mismatch(model, shapes, prefix)


def check_adapter(name: str, model, adapter, *, subfolder: str = "", need_config: bool = False) -> None:
    """``ValueError`` naming the call ``name`` and the adapter when :func:`adapter_problem` finds one.
    ``need_config``: the loader reads the adapter's settings from the folder (no PEFT config was passed), so a
    folder of adapter weights without ``adapter_config.json`` is refused; False, the default, lets such a folder
    through, as it loads when a config is passed."""
    problem = adapter_problem(model, adapter, subfolder=subfolder, need_config=need_config)
    if problem is not None:
        raise ValueError(f"{name}({os.fspath(adapter)!r}): {problem}")


def _is_helm(model) -> bool:
    from .modeling_common import HelmPreTrainedModel

    return isinstance(model, HelmPreTrainedModel)


def wrap_load_adapter(peft_model) -> None:
    """Make ``PeftModel.from_pretrained`` and ``PeftModel.load_adapter`` (of the module ``peft.peft_model``) check an
    adapter loaded onto a HELM base model first (:func:`check_adapter`), before PEFT injects any layer into the
    model; other models are untouched. ``PeftModel.save_pretrained`` refuses an empty, ``~`` or file path for every
    model (:func:`~helm.models.loading.checking_save_directory`: PEFT would create a folder named ``~``).
    Idempotent."""
    from .loading import checking_save_directory

    cls = peft_model.PeftModel
    cls.save_pretrained = checking_save_directory(cls.__dict__["save_pretrained"])
    if getattr(cls.load_adapter, "_helm_checked", False):
        return
    load, build = cls.load_adapter, cls.from_pretrained.__func__

    @functools.wraps(load)
    def load_adapter(self, model_id, *args, **kwargs):
        base = self.get_base_model()
        if _is_helm(base):
            # PEFT reads adapter_config.json only for an adapter name it does not know yet (from_pretrained with
            # config= adds the name first)
            name = inspect.signature(load).bind_partial(self, model_id, *args, **kwargs).arguments.get("adapter_name")
            check_adapter("PeftModel.load_adapter", base, model_id, subfolder=kwargs.get("subfolder") or "",
                          need_config=name not in self.peft_config)
        return load(self, model_id, *args, **kwargs)

    @functools.wraps(build)
    def from_pretrained(klass, model, model_id, *args, **kwargs):
        if _is_helm(model):
            config = inspect.signature(build).bind_partial(klass, model, model_id, *args, **kwargs).arguments.get(
                "config")
            check_adapter(f"{klass.__name__}.from_pretrained", model, model_id, subfolder=kwargs.get("subfolder") or "",
                          need_config=config is None)
        return build(klass, model, model_id, *args, **kwargs)

    load_adapter._helm_checked = True
    cls.load_adapter, cls.from_pretrained = load_adapter, classmethod(from_pretrained)


def check_config_path(peft_config) -> None:
    """Make ``PeftConfigMixin.from_pretrained`` (of the module ``peft.config``; ``AutoPeftModel*`` and
    ``LoraConfig.from_pretrained`` read an adapter's settings through it) refuse a path that can load nothing or a
    file before PEFT reads it as a hub id (:func:`~helm.models.loading.checking_folder`), and its ``save_pretrained``
    a folder it must not write (:func:`~helm.models.loading.checking_save_directory`); idempotent."""
    from .loading import checking_folder, checking_save_directory

    cls = peft_config.PeftConfigMixin
    cls.from_pretrained = classmethod(checking_folder(cls.__dict__["from_pretrained"].__func__, ADAPTER_CONFIG,
                                                      ADAPTER_CONFIG))
    cls.save_pretrained = checking_save_directory(cls.__dict__["save_pretrained"])


# module name -> what runs once it has executed
_AFTER_IMPORT = {"peft.utils.constants": add_targets, "peft.config": check_config_path,
                 "peft.peft_model": wrap_load_adapter}


class _RunAfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`_AFTER_IMPORT` like the regular path finder and runs their hook right after the
    module has executed; every other import is left to the other finders."""

    def find_spec(self, fullname, path=None, target=None):
        hook = _AFTER_IMPORT.get(fullname)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        exec_module = spec.loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_then_hook
        return spec


def register_peft_support() -> None:
    """Install the hooks of :data:`_AFTER_IMPORT` now (PEFT imported) or when PEFT is imported."""
    for name, hook in _AFTER_IMPORT.items():
        if name in sys.modules:
            hook(sys.modules[name])
    if any(name not in sys.modules for name in _AFTER_IMPORT) and \
            not any(isinstance(finder, _RunAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RunAfterImport())


__all__ = ["ADAPTER_CONFIG", "DEFAULT_TARGETS", "adapter_path_problem", "adapter_problem", "add_targets",
           "check_adapter", "check_config_path", "register_peft_support", "wrap_load_adapter"]
