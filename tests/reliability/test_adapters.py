"""Re-probe 7 (D118, D242): a PEFT adapter saved for one HELM family loaded onto the other without a word, wherever
the module names and shapes matched (PEFT's behaviour for any pair of models; Llama's is the same).

Before PEFT injects anything, ``PeftModel.from_pretrained``, ``PeftModel.load_adapter`` and the model's own
``load_adapter`` (``transformers``' integration) check the adapter (``helm.models.peft_support.adapter_problem``):
its base model's ``model_type`` (from ``adapter_config.json``'s ``base_model_name_or_path``) and the modules its
weights adapt. The table states, for each case, where the adapter was trained, where it is loaded, and the message
fragment (None: it loads, and gives the logits it was saved with).

Probe 8 (P302, P326, P350): a path that is no adapter folder (missing, a file, a model folder) is named by the same
check; PEFT and ``transformers`` looked it up on the hub ("Repo id must be in the form ...").

Re-probe 9: an adapter of a model of another width (K072/K147/K222), a damaged ``adapter_config.json`` or weights
file (K073/K148/K223, K074/K149/K224) and adapter weights without their config loaded with ``model.load_adapter``
(K067/K142/K217) are named by the same check, before PEFT or ``transformers`` fail."""

import json
import re

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from helm.models.peft_support import adapter_path_problem
from tests.helpers import tiny_config

IDS = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0))
MHA = dict(attention_type="mha", q_lora_rank=None)


def _base(family, folder=None, **overrides):
    """A tiny model of ``family``; saved to and reloaded from ``folder`` when given (so PEFT records the folder as
    the adapter's ``base_model_name_or_path``)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    if folder is None:
        return model
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


# (case, adapter trained on (family, overrides, saved base), loaded onto (family, overrides), how, message or None)
ADAPTERS = [
    ("helm_d adapter onto helm_mice (mha)", ("helm_d", {}, True), ("helm_mice", MHA), "PeftModel",
     r"the adapter was trained on '.*base', a helm_d model, and this model is a helm_mice model: PEFT would apply its "
     r"weights to this model's modules of the same names and shapes; load it onto a helm_d model"),
    ("helm_mice (mha) adapter onto helm_d", ("helm_mice", MHA, True), ("helm_d", {}), "PeftModel",
     r"the adapter was trained on '.*base', a helm_mice model, and this model is a helm_d model"),
    ("helm_d adapter onto helm_mice, load_adapter", ("helm_d", {}, True), ("helm_mice", MHA), "load_adapter",
     r"^HelmMiCEForCausalLM\.load_adapter\('.*adapter'\): the adapter was trained on '.*base', a helm_d model"),
    ("helm_d adapter, base unknown, onto hmla", ("helm_d", {}, False), ("helm_mice", {}), "PeftModel",
     r"the adapter was trained on 'HelmDForCausalLM', a helm_d model, and this model is a helm_mice model"),
    ("4-layer adapter onto 2 layers", ("helm_d", dict(num_hidden_layers=4), False), ("helm_d", {}), "PeftModel",
     r"the adapter holds weights for 4 module\(s\) this HelmDForCausalLM does not have \(model\.layers\.2\.self_attn"
     r"\.q_proj, model\.layers\.2\.self_attn\.v_proj, model\.layers\.3\.self_attn\.q_proj and 1 more\)"),
    # re-probe 9 K072/K147/K222: transformers' "You set `ignore_mismatched_sizes` to `False` ... look at the above
    # report", naming neither the adapter nor the module
    ("helm_d adapter onto a wider helm_d", ("helm_d", {}, True), ("helm_d", dict(hidden_size=37, head_dim=19)),
     "load_adapter", r"^HelmDForCausalLM\.load_adapter\('.*adapter'\): the adapter's model\.layers\.0\.self_attn"
     r"\.q_proj\.lora_A holds \[4, 33\] \(in_features 33\), this model's q_proj takes 37: it was trained on a "
     r"model of another width; load it onto the model it was trained on$"),
    ("helm_d adapter onto helm_d of wider heads", ("helm_d", {}, False), ("helm_d", dict(head_dim=21)), "PeftModel",
     r"^PeftModel\.from_pretrained\('.*adapter'\): the adapter's model\.layers\.0\.self_attn\.q_proj\.lora_B holds "
     r"\[64, 4\] \(out_features 64\), this model's q_proj gives 40: it was trained on a model of another width"),
    ("hmla adapter onto a wider hmla", ("helm_mice", {}, False), ("helm_mice", dict(hidden_size=37)), "PeftModel",
     r"^PeftModel\.from_pretrained\('.*adapter'\): the adapter's model\.layers\.0\.self_attn\.q_proj\.lora_A holds "
     r"\[4, 33\] \(in_features 33\), this model's q_proj takes 37"),
    ("mha adapter onto a wider mha", ("helm_mice", MHA, True), ("helm_mice", dict(MHA, hidden_size=37)),
     "load_adapter", r"^HelmMiCEForCausalLM\.load_adapter\('.*adapter'\): the adapter's model\.layers\.0\."
     r"self_attn\.q_proj\.lora_A holds \[4, 33\] \(in_features 33\), this model's q_proj takes 37"),
    # re-probe 11 M166-M168: with no saved base (a model built from a config), the class PEFT records in
    # auto_mapping names the model type; the same names and shapes loaded without a word
    ("helm_d adapter, base unknown, onto mha", ("helm_d", {}, False), ("helm_mice", MHA), "load_adapter",
     r"^HelmMiCEForCausalLM\.load_adapter\('.*adapter'\): the adapter was trained on 'HelmDForCausalLM', a helm_d "
     r"model, and this model is a helm_mice model"),
    ("mha adapter, base unknown, onto helm_d", ("helm_mice", MHA, False), ("helm_d", {}), "PeftModel",
     r"^PeftModel\.from_pretrained\('.*adapter'\): the adapter was trained on 'HelmMiCEForCausalLM', a helm_mice "
     r"model, and this model is a helm_d model"),
    ("own base, saved", ("helm_d", {}, True), ("helm_d", {}), "PeftModel", None),
    ("own base, built from config", ("helm_mice", {}, False), ("helm_mice", {}), "PeftModel", None),
    ("own base, load_adapter", ("helm_mice", {}, True), ("helm_mice", {}), "load_adapter", None),
]


@pytest.mark.parametrize("case, source, target, how, match", ADAPTERS, ids=[c[0] for c in ADAPTERS])
@torch.no_grad()
def test_an_adapter_of_another_model_is_refused(case, source, target, how, match, tmp_path):
    family, overrides, saved = source
    trained = peft.get_peft_model(_base(family, tmp_path / "base" if saved else None, **overrides),
                                  peft.LoraConfig(r=4, init_lora_weights=False))
    trained.save_pretrained(tmp_path / "adapter")
    expected = trained(IDS).logits
    if saved:
        assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] \
            == str(tmp_path / "base")
    onto = _base(target[0], **target[1])
    modules = sorted(name for name, _ in onto.named_modules())

    def load():
        if how == "PeftModel":
            return peft.PeftModel.from_pretrained(onto, tmp_path / "adapter")
        onto.load_adapter(str(tmp_path / "adapter"))
        return onto

    if match is None:
        torch.testing.assert_close(load()(IDS).logits, expected, rtol=0, atol=1e-5)
        return
    with pytest.raises(ValueError, match=match):
        load()
    assert sorted(name for name, _ in onto.named_modules()) == modules, "PEFT injected layers before the refusal"


def test_a_llama_adapter_is_left_to_peft(tmp_path):
    """The check applies to HELM base models only: onto Llama, PEFT's behaviour is unchanged."""
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    peft.get_peft_model(llama, peft.LoraConfig(r=4)).save_pretrained(tmp_path / "adapter")
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    assert isinstance(peft.PeftModel.from_pretrained(other, tmp_path / "adapter"), peft.PeftModel)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A folder holding a saved HELM-D adapter (``adapter``), a saved model (``model``), an empty folder
    (``empty``) and the adapter's weights without its ``adapter_config.json`` (``weights``)."""
    root = tmp_path_factory.mktemp("folders")
    peft.get_peft_model(_base("helm_d"), peft.LoraConfig(r=4)).save_pretrained(root / "adapter")
    _base("helm_d").save_pretrained(root / "model")
    (root / "empty").mkdir()
    (root / "weights").mkdir()
    (root / "weights" / "adapter_model.safetensors").write_bytes(
        (root / "adapter" / "adapter_model.safetensors").read_bytes())
    return root


NOT_ADAPTER = r"has no adapter_config\.json: not a PEFT adapter folder; "
# (case, the path given (folders: the fixture's folder), message fragment after "load(path): "): probe 8 P302, P326,
# P350: PEFT and transformers read a path that is no adapter folder as a hub id ("Repo id must be in the form
# 'repo_name' or 'namespace/repo_name'") before
NOT_ADAPTER_PATHS = [
    ("no such folder", lambda root: root / "no-such-adapter", "no such folder$"),
    ("no such relative folder", lambda root: "./no/such/adapter", "no such folder$"),
    ("tilde path", lambda root: "~/no/such/adapter",
     r"'~' is not expanded by transformers or PEFT \(it would be read as a hub id[^)]*\); pass os\.path\.expanduser"
     r"\(\.\.\.\) = '\S*no/such/adapter' \(there is no such folder either\)"),
    ("the adapter's weights file", lambda root: root / "adapter" / "adapter_model.safetensors",
     r"is a file, not an adapter folder \(the folder PeftModel\.save_pretrained writes\); use '\S*adapter'"),
    ("a model folder", lambda root: root / "model",
     "the folder " + NOT_ADAPTER + r"it is a model folder \(config\.json\), which loads with from_pretrained"),
    ("an empty folder", lambda root: root / "empty", "the folder " + NOT_ADAPTER + "a model folder loads with "
     "from_pretrained"),
    ("a folder of adapters", lambda root: root, "the folder " + NOT_ADAPTER + r"its subfolders hold adapters: load "
     r"one of '\S*adapter'$"),
]
ADAPTER_LOADERS = ["model.load_adapter", "PeftModel.from_pretrained", "PeftModel.load_adapter"]


def _load_onto(model, how, path, **kwargs):
    """Load the adapter at ``path`` onto ``model`` the way ``how`` names (a new adapter, for PeftModel.load_adapter)."""
    if how == "model.load_adapter":
        return model.load_adapter(path, **kwargs)
    if how == "PeftModel.from_pretrained":
        return peft.PeftModel.from_pretrained(model, path, **kwargs)
    return peft.get_peft_model(model, peft.LoraConfig(r=4)).load_adapter(path, "other", **kwargs)


@pytest.mark.parametrize("how", ADAPTER_LOADERS)
@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("case, where, match", NOT_ADAPTER_PATHS, ids=[c[0] for c in NOT_ADAPTER_PATHS])
def test_a_path_that_is_no_adapter_folder_is_named(folders, family, how, case, where, match):
    path = where(folders)
    call = {"model.load_adapter": rf"Helm\w+ForCausalLM\.load_adapter"}.get(how, re.escape(how))
    model = _base(family)
    modules = sorted(name for name, _ in model.named_modules())
    with pytest.raises(ValueError, match=rf"^{call}\({re.escape(repr(str(path)))}\): {match}"):
        _load_onto(model, how, path)
    if how != "PeftModel.load_adapter":
        assert sorted(name for name, _ in model.named_modules()) == modules, "PEFT injected layers before the refusal"


@pytest.mark.parametrize("how", ADAPTER_LOADERS)
def test_adapter_weights_without_their_config_are_named(folders, how):
    """PEFT reads the adapter's settings from the folder when none are passed (a new adapter name; no
    ``peft_config=`` for ``model.load_adapter``, re-probe 9 K067/K142/K217: PEFT's "adapter model file not found in
    ..." before)."""
    with pytest.raises(ValueError, match=r"the folder has no adapter_config\.json: not a PEFT adapter folder; it holds "
                       r"adapter_model\.safetensors only; pass the adapter's settings \(a PEFT config\) with them"):
        _load_onto(_base("helm_d"), how, folders / "weights")


@pytest.mark.parametrize("how", ["model.load_adapter", "PeftModel.from_pretrained"])
def test_adapter_weights_load_with_the_config_passed(folders, how):
    """A folder of adapter weights alone is an adapter when its settings are passed (``peft_config=``, ``config=``):
    not refused."""
    settings = peft.LoraConfig.from_pretrained(folders / "adapter")
    keyword = {"model.load_adapter": "peft_config", "PeftModel.from_pretrained": "config"}[how]
    model = _base("helm_d")
    loaded = _load_onto(model, how, str(folders / "weights"), **{keyword: settings})
    peft_model = loaded if isinstance(loaded, peft.PeftModel) else model
    assert any("lora_A" in name for name, _ in peft_model.named_parameters())


def _damage(root, name, damage):
    """A copy of the fixture's adapter at ``root / name``, damaged by ``damage(folder)``."""
    folder = root / name
    if not folder.exists():
        folder.mkdir()
        for file in (root / "adapter").iterdir():
            (folder / file.name).write_bytes(file.read_bytes())
        damage(folder)
    return folder


def _cut(file, keep):
    file.write_bytes(file.read_bytes()[:keep(file.stat().st_size)])


WEIGHTS = "adapter_model.safetensors"
DAMAGE = r"\): the file is truncated or corrupted; save the adapter again$"
# (case, damage done to a copy of a saved adapter, message fragment after "load(path): "): re-probe 9 K073/K148/K223
# (a bare JSONDecodeError) and K074/K149/K224 (a bare SafetensorError), naming neither the file nor the folder
DAMAGED_ADAPTERS = [
    ("adapter_config.json not JSON", lambda f: (f / "adapter_config.json").write_text("{nope"),
     r"adapter_config\.json is not valid JSON \(Expecting property name enclosed in double quotes at line 1, "
     r"column 2\); fix it or save the adapter again$"),
    ("adapter_config.json a list", lambda f: (f / "adapter_config.json").write_text("[]"),
     r"adapter_config\.json holds a JSON list, not an object of the adapter's settings; fix it or save the adapter "
     r"again$"),
    ("weights cut to 100 bytes", lambda f: _cut(f / WEIGHTS, lambda size: 100),
     rf"'\S*/{WEIGHTS}' cannot be read \(SafetensorError: Error while deserializing header: invalid header length"
     + DAMAGE),
    ("weights short of their end", lambda f: _cut(f / WEIGHTS, lambda size: size - 10),
     rf"'\S*/{WEIGHTS}' cannot be read \(SafetensorError: .*" + DAMAGE),
    # re-probe 10 L017/L020: a KeyError from inside PEFT, and "OSError: No such device (os error 19)"
    # re-probe 12 S2181: PeftModel.from_pretrained gave the hub's "Repo id must be in the form ..."
    ("no weights file", lambda f: (f / WEIGHTS).unlink(),
     r"the adapter folder has adapter_config\.json but no weights \(adapter_model\.safetensors or adapter_model\.bin, "
     r"which PeftModel\.save_pretrained writes beside it\); copy the adapter's files$"),
    ("peft_type null", lambda f: _set_setting(f, "peft_type", None),  # re-probe 11 M035: a bare KeyError: None
     r'adapter_config\.json has peft_type=null, not the name of a PEFT method \(e\.g\. "LORA"\); fix it or save the '
     r"adapter again$"),
    ("unknown peft_type", lambda f: _set_setting(f, "peft_type", "NOPE"),
     r"adapter_config\.json has peft_type='NOPE', which is no PEFT method this PEFT knows; fix it or save the adapter "
     r"again$"),
    ("weights file a folder", lambda f: ((f / WEIGHTS).unlink(), (f / WEIGHTS).mkdir()),
     rf"{WEIGHTS} is a folder, not the file PeftModel\.save_pretrained writes; save the adapter again$"),
    # settings that cannot build the saved weights: PEFT's TypeError ("'<=' not supported between instances of 'str'
    # and 'int'") or transformers' "look at the above report"
    ("r a string", lambda f: _set_setting(f, "r", "4"),
     r'adapter_config\.json has r="4", not a positive integer \(the LoRA rank\); fix it or save the adapter again$'),
    ("r 0", lambda f: _set_setting(f, "r", 0), r"adapter_config\.json has r=0, not a positive integer"),
    ("r true", lambda f: _set_setting(f, "r", True), r"adapter_config\.json has r=true, not a positive integer"),
    ("lora_alpha a string", lambda f: _set_setting(f, "lora_alpha", "x"),
     r'adapter_config\.json has lora_alpha="x", not a number; fix it or save the adapter again$'),
    ("r other than the weights' rank", lambda f: _set_setting(f, "r", 8),
     r"adapter_config\.json has r=8, but the saved base_model\.model\.model\.layers\.0\.self_attn\.\w+\.lora_A holds "
     r"\[4, 33\] \(rank 4\): these settings are not the ones the weights were saved with; fix r or save the adapter "
     r"again$"),
]


def _set_setting(folder, key, value):
    settings = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**settings, key: value}))


@pytest.mark.parametrize("how", ADAPTER_LOADERS)
@pytest.mark.parametrize("case, damage, match", DAMAGED_ADAPTERS, ids=[c[0] for c in DAMAGED_ADAPTERS])
def test_a_damaged_adapter_names_its_file(folders, how, case, damage, match):
    path = _damage(folders, "damaged-" + re.sub(r"\W+", "-", case), damage)
    call = {"model.load_adapter": r"HelmDForCausalLM\.load_adapter"}.get(how, re.escape(how))
    model = _base("helm_d")
    with pytest.raises(ValueError, match=rf"^{call}\({re.escape(repr(str(path)))}\): {match}"):
        _load_onto(model, how, str(path))


@pytest.mark.parametrize("adapter", ["owner/adapter", "adapter"])
def test_hub_ids_are_left_to_peft(adapter):
    """A str that may be a hub id and is not a local path is PEFT's (nothing is looked up here)."""
    assert adapter_path_problem(adapter) is None


@pytest.mark.parametrize("subfolder, match", [("nope", r"has no subfolder 'nope' \(subfolder=\)$"), ("sub", None)],
                         ids=["missing", "present"])
def test_load_adapter_takes_a_subfolder(folders, tmp_path, subfolder, match):
    """re-probe 11 M045: model.load_adapter(path, subfolder=...) raised transformers' TypeError "LoadStateDictConfig
    .__init__() got an unexpected keyword argument 'subfolder'" (Llama too); it is taken as from_pretrained takes it."""
    (tmp_path / "sub").mkdir()
    for file in (folders / "adapter").iterdir():
        (tmp_path / "sub" / file.name).write_bytes(file.read_bytes())
    model = _base("helm_d")
    if match is None:
        model.load_adapter(str(tmp_path), subfolder=subfolder)
        assert any("lora_A" in name for name, _ in model.named_parameters())
        return
    with pytest.raises(ValueError, match=rf"^HelmDForCausalLM\.load_adapter\('\S+'\): {match}"):
        model.load_adapter(str(tmp_path), subfolder=subfolder)


@torch.no_grad()
def test_an_adapter_saved_without_safetensors_loads_with_load_adapter(tmp_path):
    """re-probe 11 M051: an adapter saved with safe_serialization=False (adapter_model.bin) failed in
    model.load_adapter with "No such file or directory: adapter_model.safetensors" (Llama too); it loads as
    PeftModel.from_pretrained loads it, with the same outputs."""
    trained = peft.get_peft_model(_base("helm_d"), peft.LoraConfig(r=4, init_lora_weights=False))
    trained.save_pretrained(tmp_path / "adapter", safe_serialization=False)
    assert sorted(p.name for p in (tmp_path / "adapter").glob("adapter_model.*")) == ["adapter_model.bin"]
    model = _base("helm_d")
    model.load_adapter(str(tmp_path / "adapter"))
    torch.testing.assert_close(model(IDS).logits, trained(IDS).logits, rtol=0, atol=1e-5)


def test_auto_peft_names_a_damaged_adapter_config(folders, tmp_path):
    """re-probe 11 M049: AutoPeftModelForCausalLM with a non-JSON adapter_config.json raised a bare JSONDecodeError
    naming no file (PEFT's config loader; Llama too)."""
    path = _damage(folders, "damaged-for-auto-peft", lambda f: (f / "adapter_config.json").write_text("{nope"))
    with pytest.raises(OSError, match=rf"^PeftConfig\.from_pretrained\({re.escape(repr(str(path)))}\): "
                                      r"adapter_config\.json is not valid JSON \(Expecting property name enclosed in "
                                      r"double quotes at line 1, column 2\); fix it or save it again$"):
        peft.AutoPeftModelForCausalLM.from_pretrained(str(path))
