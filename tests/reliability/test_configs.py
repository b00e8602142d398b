"""Configs validate once, where they are built: every field by its rule from every source, unknown keys refused,
cross-field checks; transformers' own keywords accepted as ``LlamaConfig`` accepts them.

Error rows assert the exception type and the culprit the message must name (field, key, value), not the wording.
The documented ranges live in :mod:`helm.nn.validation` (``*_RANGE``) and the config docstrings; MiCE expert
curvatures are kept inside their range by a smooth parametrisation instead of a zero-gradient clamp (last tests).
"""

import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import helm
from helm.manifold import curvature_to_k
from helm.models import HelmDConfig, HelmMiCEConfig
from helm.nn import LorentzResidual
from helm.nn.mice import CurvatureExpert
from tests.helpers import tiny_config, tiny_model

NAN, INF = float("nan"), float("inf")


def _refused(culprits, call, *args, **kwargs):
    """``call`` raises ``ValueError`` whose message names every culprit (a field, a key, a value's repr)."""
    with pytest.raises(ValueError) as err:
        call(*args, **kwargs)
    for culprit in culprits:
        assert culprit in str(err.value), (culprit, str(err.value))
    return err.value


# Every float field of both configs refuses nan.
FLOAT_FIELDS = [(HelmDConfig, name) for name in (
    "initializer_range", "rms_norm_eps", "rope_theta", "curvature", "rope3d_chunk_base", "hope_boost_theta_prime",
    "hope_boost_angle_scale", "sinusoidal_scale", "tau_init", "residual_weight", "residual_space_scale_factor")] + \
    [(HelmMiCEConfig, name) for name in ("aux_loss_alpha", "bias_update_speed")]


@pytest.mark.parametrize("cls,name", FLOAT_FIELDS, ids=[f"{c.__name__}-{n}" for c, n in FLOAT_FIELDS])
def test_non_finite_float_fields_are_refused(cls, name):
    _refused([name, "nan"], cls, **{name: NAN})


# Values outside a field's rule (range, type, vocabulary), one row per rule and side. (class, field, value)
OUT_OF_RANGE = [
    (HelmDConfig, "curvature", -INF),
    (HelmDConfig, "curvature", 0.0),
    (HelmDConfig, "curvature", 1.0),
    (HelmDConfig, "curvature", -1e-5),
    (HelmDConfig, "curvature", -1e5),
    (HelmDConfig, "rms_norm_eps", 0.0),
    (HelmDConfig, "rms_norm_eps", 0.1),
    (HelmDConfig, "rms_norm_eps", "1e-6"),
    (HelmDConfig, "initializer_range", 0.0),
    (HelmDConfig, "initializer_range", 5.0),
    (HelmDConfig, "tau_init", 1e-6),
    (HelmDConfig, "tau_init", 1e6),
    (HelmDConfig, "residual_weight", 0.0),
    (HelmDConfig, "residual_weight", 1e6),
    (HelmDConfig, "residual_space_scale_factor", 0.0),
    (HelmDConfig, "residual_space_scale_factor", 1e3),
    (HelmDConfig, "hidden_size", 1),
    (HelmDConfig, "num_hidden_layers", 0),
    (HelmDConfig, "rope3d_chunk_base", 1.0),
    (HelmDConfig, "hidden_act", "swish-ish"),
    (HelmDConfig, "positional", "rope"),
    (HelmDConfig, "embedding_mode", "poincare"),
    (HelmDConfig, "head_merge", "concat"),
    (HelmDConfig, "tie_word_embeddings", True),  # HELM models cannot tie the LM head to the token table
    (HelmMiCEConfig, "routed_curvatures", [-1.0, -1.0, NAN, -1.0]),
    (HelmMiCEConfig, "routed_curvatures", [-1e-5, -1.0, -1.0, -1.0]),
    (HelmMiCEConfig, "expert_curvature_range", [-0.1, -1e6]),
    (HelmMiCEConfig, "expert_curvature_range", [-0.1, -0.5, -1.0]),
    (HelmMiCEConfig, "aux_loss_alpha", -1e-3),
    (HelmMiCEConfig, "bias_update_speed", -1.0),
    (HelmMiCEConfig, "expert_combine", "sum"),
    (HelmMiCEConfig, "attention_type", "gqa"),
    (HelmMiCEConfig, "q_lora_rank", 1),
    # numpy and tensor scalars: configs are saved as JSON, which holds Python numbers
    (HelmDConfig, "num_hidden_layers", np.int64(2)),
    (HelmDConfig, "rms_norm_eps", np.float32(1e-5)),
    (HelmDConfig, "num_attention_heads", torch.tensor(2)),
]
# Every boolean field: a string "false" (or 0, 1) would be truthy (or falsy) and build another model.
BOOLEAN_FIELDS = [(HelmDConfig, name, "false") for name in (
    "use_cache", "attention_bias", "mlp_bias", "hope_boost_learnable_decay", "final_proj",
    "fused_lm_loss")] + [(HelmDConfig, "use_cache", 0)] + \
    [(HelmMiCEConfig, name, "no") for name in ("norm_topk_prob", "trainable_curvatures", "hmla_absorb")]


@pytest.mark.parametrize("cls,name,value", OUT_OF_RANGE + BOOLEAN_FIELDS,
                         ids=[f"{c.__name__}-{n}-{v!r}" for c, n, v in OUT_OF_RANGE + BOOLEAN_FIELDS])
def test_values_outside_a_fields_rule_are_refused_naming_field_and_value(cls, name, value):
    _refused([name], cls, **{name: value})


# Boundary values of each documented range are accepted and kept as given.
ACCEPTED = [
    (HelmDConfig, "curvature", -1e-4),
    (HelmDConfig, "curvature", -1e4),
    (HelmDConfig, "curvature", -1),  # ints are numbers
    (HelmDConfig, "rms_norm_eps", 1e-2),
    (HelmDConfig, "rms_norm_eps", 1e-30),
    (HelmDConfig, "initializer_range", 1.0),
    (HelmDConfig, "tau_init", 1e-3),
    (HelmDConfig, "tau_init", 1e4),
    (HelmDConfig, "residual_weight", 1e-4),
    (HelmDConfig, "residual_weight", 1e4),
    (HelmDConfig, "residual_space_scale_factor", 1e-2),
    (HelmDConfig, "residual_space_scale_factor", 1e2),
    (HelmMiCEConfig, "routed_curvatures", [-1e-4, -0.1, -2.0, -1e4]),
    (HelmMiCEConfig, "aux_loss_alpha", 0.0),
    (HelmMiCEConfig, "bias_update_speed", 0.0),
]


@pytest.mark.parametrize("cls,name,value", ACCEPTED, ids=[f"{c.__name__}-{n}-{v}" for c, n, v in ACCEPTED])
def test_documented_boundaries_are_accepted(cls, name, value):
    assert getattr(cls(**{name: value}), name) == value


# Special token ids must be ids of the vocabulary (vocab_size 512 here). (class, field, value)
TOKEN_IDS = [
    (HelmDConfig, "pad_token_id", 512),
    (HelmDConfig, "bos_token_id", -1),
    (HelmDConfig, "eos_token_id", [0, 512]),
    (HelmDConfig, "eos_token_id", []),
    (HelmDConfig, "pad_token_id", 1.0),
    (HelmMiCEConfig, "eos_token_id", [1, -2]),
]


@pytest.mark.parametrize("cls,name,value", TOKEN_IDS, ids=[f"{c.__name__}-{n}-{v}" for c, n, v in TOKEN_IDS])
def test_special_token_ids_outside_the_vocabulary_are_refused(cls, name, value):
    _refused([name, repr(value), "512"], cls, vocab_size=512, **{name: value})


@pytest.mark.parametrize("cls", [HelmDConfig, HelmMiCEConfig])
def test_special_token_ids_inside_the_vocabulary_are_kept(cls):
    config = cls(vocab_size=512, pad_token_id=511, bos_token_id=0, eos_token_id=[1, 2])
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (511, 0, [1, 2])


def _saved(tmp_path, family="helm_d"):
    tiny_config(family).save_pretrained(tmp_path)
    return tmp_path


def _edited_config_json(tmp_path, name, value, family="helm_d"):
    folder = _saved(tmp_path, family)
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, name: value}))
    return AutoConfig.from_pretrained(folder)


def _preset_file(tmp_path, name, value):
    data = json.loads(helm.presets.preset_path("tiny-helm-d").read_text())
    (tmp_path / "preset.json").write_text(json.dumps({**data, name: value}))
    return helm.load_config(str(tmp_path / "preset.json"))


def _model_from_pretrained(tmp_path, name, value):
    tiny_model("helm_d").save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, **{name: value})


SOURCES = {
    "constructor": lambda tmp_path, name, value: HelmDConfig(**{name: value}),
    "load_config-override": lambda tmp_path, name, value: helm.load_config("tiny-helm-d", **{name: value}),
    "preset-file": _preset_file,
    "config.json": _edited_config_json,
    "AutoConfig.from_pretrained-keyword": lambda tmp_path, name, value: AutoConfig.from_pretrained(
        _saved(tmp_path), **{name: value}),
    "model.from_pretrained-keyword": _model_from_pretrained,
    "assigned-after-construction": lambda tmp_path, name, value: setattr(HelmDConfig(), name, value),
    "config.update": lambda tmp_path, name, value: HelmDConfig().update({name: value}),
}
EVERY_SOURCE = [("curvature", 2.0), ("use_cache", "no"), ("residual_weight", NAN)]


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("name, value", EVERY_SOURCE, ids=[f"{n}={v!r}" for n, v in EVERY_SOURCE])
def test_every_source_of_a_value_is_validated_naming_the_field(source, name, value, tmp_path):
    _refused([name, repr(value)], SOURCES[source], tmp_path, name, value)


# A key no field reads (a typo) is refused from every source that builds a config, naming it and the closest field:
# transformers would keep it as a stray attribute and build the default. (source, key, the field suggested)
UNKNOWN_KEYS = [
    ("constructor", "hiden_size", "hidden_size"),
    ("config.json", "curvatur", "curvature"),
    ("preset-file", "posistional", "positional"),
    ("load_config-override", "curvture", "curvature"),
    ("config.update", "hiden_size", "hidden_size"),  # issue 34: update stored the typo and ignored it
]


@pytest.mark.parametrize("source, key, suggested", UNKNOWN_KEYS, ids=[f"{s}-{k}" for s, k, _ in UNKNOWN_KEYS])
def test_unknown_keys_are_refused_naming_them_and_the_closest_field(source, key, suggested, tmp_path):
    _refused([repr(key), repr(suggested)], SOURCES[source], tmp_path, key, 1)


def test_an_unknown_key_of_a_mice_config_json_is_refused(tmp_path):
    _refused(["'n_routed_expert'", "'n_routed_experts'"], _edited_config_json, tmp_path, "n_routed_expert", 8,
             family="helm_mice")


# helm.load_config of a transformers baseline: its config class keeps any key, so load_config names the typo.
@pytest.mark.parametrize("preset, key, suggested", [("tiny-llama", "num_hiden_layers", "num_hidden_layers"),
                                                    ("tiny-deepseek-v3", "kv_lora_rnk", "kv_lora_rank")])
def test_load_config_refuses_unknown_overrides_of_the_baselines(preset, key, suggested):
    _refused([repr(key), repr(suggested)], helm.load_config, preset, **{key: 2})


@pytest.mark.parametrize("preset, overrides", [
    ("tiny-helm-d", dict(hidden_size=65, num_attention_heads=4, head_dim=17, intermediate_size=97)),
    ("tiny-helm-d", dict(num_labels=3, output_attentions=False, dtype="float32", attn_implementation="eager")),
    ("tiny-helm-mice", dict(qk_rope_head_dim=9, n_routed_experts=4)),
    ("tiny-llama", dict(attention_dropout=0.1, rope_theta=5e5)),
], ids=["fields", "transformers-attributes", "mice-fields", "llama-fields"])
def test_load_config_accepts_fields_and_transformers_attributes(preset, overrides):
    config = helm.load_config(preset, **overrides)
    for key, value in overrides.items():
        if key == "rope_theta":  # transformers moves it into rope_parameters
            assert config.rope_parameters["rope_theta"] == value
        elif key not in ("dtype", "attn_implementation"):
            assert getattr(config, key) == value


PRESET_FILES = [("not JSON", '{"model_type": '), ("a list", "[1, 2]"), ("no model_type", '{"hidden_size": 33}')]


@pytest.mark.parametrize("case,text", PRESET_FILES, ids=[c[0] for c in PRESET_FILES])
def test_bad_preset_files_are_refused_naming_the_file(case, text, tmp_path):
    path = tmp_path / "preset.json"
    path.write_text(text)
    _refused([str(path)], helm.load_config, str(path))


# transformers' own keys and keywords load as LlamaConfig's do: what save_pretrained writes, loading options, the
# dtype / attention keywords of from_pretrained (dtype="auto" raised from __setattr__ before). (source, keywords)
TRANSFORMERS_KEYWORDS = [
    ("config.json", dict(_name_or_path="x", torch_dtype="float32", architectures=["X"], max_length=20)),
    ("AutoConfig", dict(dtype="auto", attn_implementation="eager", device_map="cpu", revision="main",
                        trust_remote_code=True, name_or_path="x", num_labels=3)),
    ("model", dict(dtype="auto", attn_implementation="eager", device_map="cpu", curvature=-2.0)),
    ("model", dict(dtype=torch.bfloat16, output_loading_info=True, use_safetensors=True)),
]


@pytest.mark.parametrize("source, keys", TRANSFORMERS_KEYWORDS, ids=[f"{s}-{i}" for i, (s, _) in
                                                                     enumerate(TRANSFORMERS_KEYWORDS)])
def test_transformers_keys_and_keywords_load(source, keys, tmp_path):
    tiny_model("helm_d").save_pretrained(tmp_path)
    if source == "config.json":
        data = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**data, **keys}))
        assert AutoConfig.from_pretrained(tmp_path).hidden_size == data["hidden_size"]
    elif source == "AutoConfig":
        assert isinstance(AutoConfig.from_pretrained(tmp_path, **keys), HelmDConfig)
    else:
        model = AutoModelForCausalLM.from_pretrained(tmp_path, **keys)
        model = model[0] if isinstance(model, tuple) else model
        assert model.config.curvature == keys.get("curvature", -1.0)


def test_keywords_of_from_pretrained_are_kept_and_unknown_ones_returned(tmp_path):
    config, unused = AutoConfig.from_pretrained(_saved(tmp_path), curvature=-2.0, use_cache=False,
                                                return_unused_kwargs=True, not_a_field=3)
    assert (config.curvature, config.use_cache, unused) == (-2.0, False, {"not_a_field": 3})


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("head", ["AutoModelForCausalLM", "AutoModelForSequenceClassification",
                                  "AutoModelForTokenClassification"])
def test_every_config_json_the_repo_saves_loads(family, head, tmp_path):
    """Nothing lost: both families and the task heads (labels, problem type) through save_pretrained,
    from_pretrained of the config and of the model, and from_dict(to_dict())."""
    import transformers

    extra = {} if head == "AutoModelForCausalLM" else dict(num_labels=3, id2label={0: "a", 1: "b", 2: "c"},
                                                           label2id={"a": 0, "b": 1, "c": 2},
                                                           problem_type="single_label_classification")
    config = tiny_config(family, **extra)
    auto = getattr(transformers, head)
    auto.from_config(config).save_pretrained(tmp_path)

    def fields(c):
        return {k: v for k, v in c.to_dict().items() if k not in ("_name_or_path", "auto_map", "architectures")}

    assert fields(AutoConfig.from_pretrained(tmp_path)) == fields(type(config).from_dict(config.to_dict())) == \
        fields(config)
    assert auto.from_pretrained(tmp_path).config.num_labels == config.num_labels


def test_a_saved_config_json_is_a_preset_file(tmp_path):
    tiny_model("helm_d").save_pretrained(tmp_path)

    def fields(config):
        return {k: v for k, v in config.to_dict().items() if k not in ("auto_map", "architectures", "_name_or_path", "dtype")}

    assert fields(helm.load_config(str(tmp_path / "config.json"))) == fields(tiny_config("helm_d"))


def test_a_config_saved_under_an_old_field_name_loads():
    """``residual_space_scale`` (an absolute scale) was renamed ``residual_space_scale_factor`` (a factor of
    ``sqrt(hidden_size - 1)``); ``pe_options`` keys became fields."""
    config = HelmDConfig(hidden_size=65, num_attention_heads=4, residual_space_scale=16.0,
                         pe_options={"chunk_size": 64})
    assert config.residual_space_scale == pytest.approx(16.0) and config.rope3d_chunk_size == 64


def test_a_config_json_with_the_former_validate_inputs_switch_loads(tmp_path):
    """The switch of the input value checks (host reads in every step, removed) is dropped on loading."""
    tiny_config("helm_d").save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "validate_inputs": False}))
    config = AutoConfig.from_pretrained(tmp_path)
    assert "validate_inputs" not in config.to_dict()


@pytest.mark.parametrize("saved, cls", [("helm_mice", HelmDConfig), ("helm_d", HelmMiCEConfig),
                                        ("llama", HelmDConfig)], ids=["mice-into-d", "d-into-mice", "llama-into-d"])
def test_a_config_of_another_model_type_is_named(saved, cls, tmp_path):
    tiny_config(saved).save_pretrained(tmp_path)
    _refused([f"model_type={saved!r}", cls.__name__], cls.from_pretrained, tmp_path)


@pytest.mark.parametrize("family, other", [("helm_d", "helm_mice"), ("helm_mice", "helm_d")],
                         ids=["d-relabelled-mice", "mice-relabelled-d"])
def test_a_config_json_relabelled_as_the_other_family_is_refused(family, other, tmp_path):
    """Issue 34: a HELM-D config.json whose model_type says helm_mice loaded as a MiCE config with defaults; its
    architectures name the family it was saved from."""
    tiny_model(family).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "model_type": other}))
    _refused(["architectures", repr(other)], AutoConfig.from_pretrained, tmp_path)


def test_update_keeps_known_fields_and_runs_the_cross_field_rules():
    config = HelmDConfig()
    config.update({"hidden_size": 65, "num_attention_heads": 4})
    assert (config.hidden_size, config.num_attention_heads) == (65, 4)
    head_dim = config.head_dim
    _refused(["head_dim"], config.update, {"head_dim": 16})
    assert config.head_dim == head_dim, "a refused update changed the config"


@pytest.mark.parametrize("update, culprit", [({"hidden_size": 65, "curvature": 5.0}, "curvature"),
                                             ({"head_dim": 6}, "head_dim")], ids=["field-rule", "cross-field"])
def test_a_refused_update_changes_nothing(update, culprit):
    """Issue 34 re-probe: the fields set before the failing one stayed set (another valid model, or a head_dim that
    the cross-field rules refused)."""
    config = tiny_config("helm_d")
    before = config.to_dict()
    _refused([culprit], config.update, update)
    assert config.to_dict() == before


@pytest.mark.parametrize("options", [["chunk_size", 64], "chunk_size=64"], ids=["list", "string"])
def test_old_pe_options_that_are_no_mapping_are_named(options, tmp_path):
    tiny_config("helm_d").save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "pe_options": options}))
    _refused(["pe_options"], AutoConfig.from_pretrained, tmp_path)


def test_a_missing_preset_file_is_named_as_missing(tmp_path):
    """Fifth re-probe: a missing .json path was 'not a JSON file, and not one of (35 presets)'."""
    import helm

    _refused([str(tmp_path / "nope.json"), "no such file"], helm.load_config, tmp_path / "nope.json")


def test_a_preset_refuses_a_model_type_override():
    import helm

    _refused(["model_type='helm_d'", "tiny-helm-mice.json"], helm.load_config, "tiny-helm-mice", model_type="helm_d")
    assert helm.load_config("tiny-helm-mice", model_type="helm_mice").model_type == "helm_mice"  # its own: fine


@pytest.mark.parametrize("name, value, python", [("curvature", np.float32(-2.0), "float"),
                                                 ("num_hidden_layers", np.int64(2), "int")], ids=["float32", "int64"])
def test_numpy_scalars_are_refused_naming_their_type(name, value, python):
    """Second re-probe: np.float32(-2.0) was refused as if out of range ('got np.float32(-2.0)'); the culprit is the
    type (a config is saved as JSON), as LlamaConfig says."""
    _refused([name, type(value).__name__, f"pass {python}(value)"], tiny_config, "helm_d", **{name: value})


def test_the_derived_residual_scale_names_the_field_to_set():
    """Fourth re-probe: update / assignment of residual_space_scale was a bare 'property has no setter'."""
    config = tiny_config("helm_d")
    _refused(["residual_space_scale=2.0", "residual_space_scale_factor"], config.update, {"residual_space_scale": 2.0})
    _refused(["residual_space_scale_factor"], setattr, config, "residual_space_scale", 2.0)


def test_update_with_no_mapping_names_update():
    with pytest.raises(TypeError, match=r"HelmDConfig\.update takes a dict.*list"):
        tiny_config("helm_d").update([("hidden_size", 131)])


def test_an_old_residual_scale_beside_the_new_factor_keeps_the_new_one(tmp_path):
    """Second re-probe: the legacy residual_space_scale silently replaced a residual_space_scale_factor given with it."""
    tiny_config("helm_d").save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "residual_space_scale": 10.0,
                                                      "residual_space_scale_factor": 2.0}))
    assert AutoConfig.from_pretrained(tmp_path).residual_space_scale_factor == 2.0


def test_a_valid_assignment_after_construction_is_kept_and_a_bad_one_changes_nothing():
    config = tiny_config("helm_d")
    config.rms_norm_eps = 1e-6
    _refused(["rms_norm_eps", "0.5"], setattr, config, "rms_norm_eps", 0.5)
    assert config.rms_norm_eps == 1e-6


# A field assigned after construction passes its own rule only; the cross-field checks run again when a model is
# built from the config or the config is saved (otherwise: another model than asked, or a save that does not reload).
# (family, field, value)
ASSIGNED_ACROSS_FIELDS = [("helm_mice", "first_k_dense_replace", 5), ("helm_d", "pad_token_id", 9000),
                          ("helm_mice", "eos_token_id", 9000)]


@pytest.mark.parametrize("family, name, value", ASSIGNED_ACROSS_FIELDS,
                         ids=[f"{f}-{n}={v}" for f, n, v in ASSIGNED_ACROSS_FIELDS])
def test_building_or_saving_checks_fields_assigned_after_construction(family, name, value, tmp_path):
    config = tiny_config(family)
    setattr(config, name, value)
    _refused([name, str(value)], AutoModelForCausalLM.from_config, config)
    for save in (config.save_pretrained, lambda folder: config.to_json_file(folder / "config.json")):
        _refused([name, str(value)], save, tmp_path)
        assert not (tmp_path / "config.json").exists()


def test_derived_expert_curvatures_follow_a_new_expert_count(tmp_path):
    """routed_curvatures derived from expert_curvature_range (not set) are derived again for another
    n_routed_experts, from a keyword of from_pretrained or assigned after construction; set ones are checked."""
    config = tiny_config("helm_mice")
    config.save_pretrained(tmp_path)
    two = [-0.1, -2.0]
    assert AutoConfig.from_pretrained(tmp_path, n_routed_experts=2, num_experts_per_tok=1).routed_curvatures == two
    config.n_routed_experts, config.num_experts_per_tok = 2, 1
    assert AutoModelForCausalLM.from_config(config).config.routed_curvatures == two
    _refused(["routed_curvatures", "n_routed_experts=2"], tiny_config, "helm_mice",
             routed_curvatures=[-1.0, -0.5, -2.0], n_routed_experts=2, num_experts_per_tok=1)


# A head_dim derived from hidden_size and num_attention_heads that a head or the positional encoding cannot use
# names those two fields and the derived width (the user never set head_dim). (source, keywords, culprits)
DERIVED_HEAD_DIMS = [
    (HelmDConfig, dict(hidden_size=130), ["head_dim", "22", "hidden_size=130", "num_attention_heads=6"]),
    (HelmDConfig, dict(hidden_size=61, num_attention_heads=4, positional="rope3d"), ["16", "hidden_size=61"]),
    (HelmMiCEConfig, dict(attention_type="mha", hidden_size=130), ["22", "hidden_size=130"]),
    (HelmDConfig, dict(hidden_size=4, num_attention_heads=6), ["head_dim", "got 1", "hidden_size=4"]),
    ("tiny-helm-d", dict(hidden_size=125, head_dim=None), ["32", "hidden_size=125", "num_attention_heads=4"]),
]


@pytest.mark.parametrize("source, kwargs, culprits", DERIVED_HEAD_DIMS, ids=[str(k) for _, k, _ in DERIVED_HEAD_DIMS])
def test_a_derived_head_dim_names_hidden_size_and_num_attention_heads(source, kwargs, culprits):
    _refused(culprits, helm.load_config if isinstance(source, str) else source,
             *([source] if isinstance(source, str) else []), **kwargs)


def test_an_explicit_odd_head_dim_is_refused_naming_it():
    error = _refused(["head_dim", "40"], HelmDConfig, head_dim=40)
    assert "hidden_size" not in str(error)


# A field whose default None means "derived" (head_dim; MiCE's routed_curvatures), set to None (or made needed, by
# attention_type='mha') after construction, is derived again when the model is built or the config saved, as the
# same keywords derive it. (family, keywords the config is built with, fields assigned afterwards, the derived field)
DERIVED_AFTER_CONSTRUCTION = [
    ("helm_d", {}, {"hidden_size": 65, "head_dim": None}, "head_dim"),
    ("helm_mice", {"attention_type": "hmla"}, {"attention_type": "mha"}, "head_dim"),
    ("helm_mice", {"attention_type": "mha"}, {"routed_curvatures": None, "expert_curvature_range": [-0.5, -1.5]},
     "routed_curvatures"),
]


@pytest.mark.parametrize("family, built, assigned, derived", DERIVED_AFTER_CONSTRUCTION,
                         ids=[f"{f}-{b}-{a}" for f, b, a, _ in DERIVED_AFTER_CONSTRUCTION])
def test_a_derived_field_assigned_none_is_derived_again(family, built, assigned, derived, tmp_path):
    expected = getattr(tiny_config(family, **{**built, **assigned}), derived)
    assert expected is not None
    config = tiny_config(family, **built)
    for name, value in assigned.items():
        setattr(config, name, value)
    assert getattr(AutoModelForCausalLM.from_config(config).config, derived) == expected
    config.save_pretrained(tmp_path)
    assert getattr(AutoConfig.from_pretrained(tmp_path), derived) == expected


def test_a_derived_head_dim_refused_after_construction_stays_none(tmp_path):
    config = tiny_config("helm_d")
    config.hidden_size, config.head_dim = 67, None
    for use in (AutoModelForCausalLM.from_config, lambda c: c.save_pretrained(tmp_path), lambda c: c.validate()):
        _refused(["head_dim", "hidden_size=67"], use, config)
    assert config.head_dim is None and not (tmp_path / "config.json").exists()


# Documented ranges hold, or a cross-field check refuses the combination. (config keywords, culprits, or None:
# accepted, and the model's logits at initialisation are finite)
CROSS_FIELD = [
    (dict(initializer_range=1.0, curvature=-1e4, embedding_mode="lorentz"), ["initializer_range=1.0", "-10000"]),
    (dict(initializer_range=0.3, curvature=-1e4, lm_head_mode="distance"), ["initializer_range=0.3", "-10000"]),
    (dict(initializer_range=1.0, curvature=-1e4), None),  # no wrapped-normal table: every initialisation is fine
    # second re-probe of issue 34: at |K| = 1e4 the tables' fp32 gradients overflowed in one step (loss finite)
    (dict(curvature=-1e4, embedding_mode="lorentz"), ["curvature=-10000", "embedding_mode='lorentz'"]),
    (dict(curvature=-3e3, lm_head_mode="distance"), ["curvature=-3000", "lm_head_mode='distance'"]),
    (dict(initializer_range=0.1, curvature=-1e3, embedding_mode="lorentz", lm_head_mode="distance"), None),
    (dict(initializer_range=1.0, curvature=-10.0, embedding_mode="lorentz", lm_head_mode="distance"), None),
    (dict(residual_weight=710.0), None),  # log(expm1(710)) overflowed in reset_parameters
    (dict(positional="learned", max_position_embeddings=2**27), ["max_position_embeddings=134217728", "learned"]),
    (dict(positional="hope", max_position_embeddings=2**27), None),  # no table
    (dict(positional="hope_boost", hope_boost_theta_prime=0.5), ["hope_boost_theta_prime", "0.5"]),
    (dict(positional="alibi", rope_parameters={"rope_type": "linear", "factor": 2.0}), ["rope_parameters", "alibi"]),
]


@pytest.mark.parametrize("overrides, culprits", CROSS_FIELD, ids=[str(o) for o, _ in CROSS_FIELD])
def test_cross_field_ranges(overrides, culprits):
    if culprits is not None:
        _refused(culprits, tiny_config, "helm_d", **overrides)
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("helm_d", **overrides))
    logits = model(input_ids=torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("weight", [1e-4, 0.5, 1.0, 709.0, 710.0, 1e3, 1e4])
def test_residual_weight_is_exact_over_its_documented_range(weight):
    """The overflow-free inverse softplus gives the initial weight to fp32 rounding up to 1e4."""
    assert float(LorentzResidual(weight=weight).weight.detach()) == pytest.approx(weight, rel=1e-6)


# MiCE expert curvatures: log k is mapped smoothly into the runtime range (identity on the config range), so
# every optimiser step leaves k finite and positive and the gradient is never exactly zero.
@pytest.mark.parametrize("K", [-1e-4, -0.1, -1.0, -2.0, -1e4])
def test_expert_curvature_is_exact_on_the_config_range(K):
    expert = CurvatureExpert(9, 9, k=1.0, k_expert=curvature_to_k(K), trainable=True)
    assert float(expert.k_expert.detach()) == pytest.approx(curvature_to_k(K), rel=1e-6)


@pytest.mark.parametrize("log_k", [math.log(1e4) + 0.5, math.log(1e4) + 50.0, math.log(1e-4) - 3.0,
                                   math.log(1e-4) - 1e4])
def test_expert_curvature_beyond_the_range_stays_valid_with_a_nonzero_gradient(log_k):
    expert = CurvatureExpert(9, 9, k=1.0, k_expert=1.0, trainable=True)
    with torch.no_grad():
        expert.log_k.fill_(log_k)
    k = expert.k_expert
    lo, hi = 1e-4, 1e4  # the config range of k (and of |K|)
    assert torch.isfinite(k) and lo / 10 < float(k) < hi * 10
    assert (float(k) > hi) if log_k > 0 else (float(k) < lo)
    k.backward()
    assert expert.log_k.grad is not None and float(expert.log_k.grad) != 0.0
