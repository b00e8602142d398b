"""Issue 11, item 4: configs and layer constructors refuse non-finite and absurd values, naming the field.

Every case of the tables states the input, the exception and a fragment of its message (or, for the accepted
boundary values, the value the config keeps). The documented ranges live in :mod:`helm.nn.validation`
(``*_RANGE`` constants) and in the config docstrings; MiCE expert curvatures are kept inside their range by a
smooth parametrisation instead of a zero-gradient clamp (last tests).
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import helm
from helm.manifold import curvature_to_k
from helm.models import HelmDConfig, HelmMiCEConfig
from helm.nn import HMLA, LorentzEmbedding, LorentzLinear, LorentzLMHead, LorentzResidual, LorentzRMSNorm
from helm.nn import LorentzSelfAttention, LorentzSwiGLU
from helm.nn.mice import CurvatureExpert, MiCE

NAN, INF = float("nan"), float("inf")

# Every float field of both configs: nan and +inf are refused with a message that starts with the field name.
FLOAT_FIELDS = {
    HelmDConfig: ["initializer_range", "rms_norm_eps", "rope_theta", "curvature", "rope3d_chunk_base",
                  "hope_boost_theta_prime", "hope_boost_angle_scale", "tau_init", "residual_weight",
                  "residual_space_scale_factor"],
    HelmMiCEConfig: ["curvature", "rms_norm_eps", "tau_init", "residual_weight", "aux_loss_alpha",
                     "bias_update_speed"],
}
NON_FINITE = [(cls, name, value) for cls, names in FLOAT_FIELDS.items() for name in names for value in (NAN, INF)]


@pytest.mark.parametrize("cls,name,value", NON_FINITE,
                         ids=[f"{c.__name__}-{n}-{v}" for c, n, v in NON_FINITE])
def test_non_finite_float_fields_are_refused(cls, name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be .*finite.*got {value!r}"):
        cls(**{name: value})


# (config class, field, value, message fragment after "<field> must be")
OUT_OF_RANGE = [
    # curvature K: |K| in [1e-4, 1e4] so that k = -1/K, sqrt(k) and k·(Σw)² stay well inside fp32
    (HelmDConfig, "curvature", -INF, "finite"),
    (HelmDConfig, "curvature", 0.0, "negative"),
    (HelmDConfig, "curvature", 1.0, "negative"),
    (HelmDConfig, "curvature", -1e-5, r"\|K\| in \[0.0001, 10000\]"),
    (HelmDConfig, "curvature", -1e5, r"\|K\| in \[0.0001, 10000\]"),
    (HelmDConfig, "curvature", -1e300, r"\|K\| in \[0.0001, 10000\]"),
    # RMSNorm eps in (0, 1e-2]
    (HelmDConfig, "rms_norm_eps", 0.0, r"positive finite number in \(0, 0.01\]"),
    (HelmDConfig, "rms_norm_eps", -1e-6, r"positive finite number in \(0, 0.01\]"),
    (HelmDConfig, "rms_norm_eps", 0.1, r"positive finite number in \(0, 0.01\]"),
    # initializer_range in (0, 1]
    (HelmDConfig, "initializer_range", 0.0, r"in \(0, 1\]"),
    (HelmDConfig, "initializer_range", 5.0, r"in \(0, 1\]"),
    # attention temperature in [1e-3, 1e4]
    (HelmDConfig, "tau_init", -1.0, r"in \[0.001, 10000\]"),
    (HelmDConfig, "tau_init", 1e-6, r"in \[0.001, 10000\]"),
    (HelmDConfig, "tau_init", 1e6, r"in \[0.001, 10000\]"),
    # residual weight in [1e-4, 1e4]
    (HelmDConfig, "residual_weight", 0.0, r"in \[0.0001, 10000\]"),
    (HelmDConfig, "residual_weight", 1e-6, r"in \[0.0001, 10000\]"),
    (HelmDConfig, "residual_weight", 1e3 * 1e3, r"in \[0.0001, 10000\]"),
    # residual space scale factor in [1e-2, 1e2]
    (HelmDConfig, "residual_space_scale_factor", 0.0, r"in \[0.01, 100\]"),
    (HelmDConfig, "residual_space_scale_factor", 1e3, r"in \[0.01, 100\]"),
    # strings are not numbers
    (HelmDConfig, "rms_norm_eps", "1e-6", "positive finite"),
    # MiCE: expert curvatures inside the same range, refused at config time
    (HelmMiCEConfig, "routed_curvatures", [-1.0, -1.0, NAN, -1.0], "list of negative"),
    (HelmMiCEConfig, "routed_curvatures", [-1.0, -INF, -1.0, -1.0], "list of negative"),
    (HelmMiCEConfig, "routed_curvatures", [-1e-5, -1.0, -1.0, -1.0], r"\|K\| in \[0.0001, 10000\]"),
    (HelmMiCEConfig, "routed_curvatures", [-1.0, -1.0, -1.0, -2e4], r"\|K\| in \[0.0001, 10000\]"),
    (HelmMiCEConfig, "expert_curvature_range", [-0.1, -1e6], r"\|K\| in \[0.0001, 10000\]"),
    (HelmMiCEConfig, "expert_curvature_range", [-0.1, INF], "list of negative"),
    (HelmMiCEConfig, "aux_loss_alpha", -1e-3, "non-negative"),
    (HelmMiCEConfig, "bias_update_speed", -1.0, "non-negative"),
    (HelmMiCEConfig, "curvature", -2e4, r"\|K\| in \[0.0001, 10000\]"),
    (HelmMiCEConfig, "rms_norm_eps", 1.0, r"\(0, 0.01\]"),
    # switches typed as booleans: a string "false" would be truthy
    (HelmDConfig, "validate_inputs", "false", "a bool"),
    (HelmMiCEConfig, "final_proj", "no", "a bool"),
    (HelmDConfig, "head_merge", "concat", "one of"),
    (HelmMiCEConfig, "expert_combine", "sum", "one of"),
    # issue 25 item 4: every boolean field, strings and ints that would read as true (or false) are refused
    (HelmDConfig, "attention_bias", "false", "a bool"),
    (HelmDConfig, "mlp_bias", "no", "a bool"),
    (HelmDConfig, "use_cache", "no", "a bool"),
    (HelmDConfig, "use_cache", 0, "a bool"),
    (HelmDConfig, "hope_boost_learnable_decay", "true", "a bool"),
    (HelmDConfig, "fused_lm_loss", 1, "a bool"),
    (HelmMiCEConfig, "norm_topk_prob", "false", "a bool"),
    (HelmMiCEConfig, "trainable_curvatures", "no", "a bool"),
    (HelmMiCEConfig, "hmla_absorb", "False", "a bool"),
    # issue 23 item 9: HELM models cannot tie the LM head to the token table
    (HelmDConfig, "tie_word_embeddings", True, r"False \(tying is not supported"),
    (HelmMiCEConfig, "tie_word_embeddings", "false", r"False \(tying is not supported"),
]


@pytest.mark.parametrize("cls,name,value,fragment", OUT_OF_RANGE,
                         ids=[f"{c.__name__}-{n}-{v}" for c, n, v, _ in OUT_OF_RANGE])
def test_absurd_values_are_refused_naming_the_field(cls, name, value, fragment):
    with pytest.raises(ValueError, match=rf"^{name} must be .*{fragment}") as err:
        cls(**{name: value})
    assert repr(value) in str(err.value)


# Boundary values of each documented range are accepted and kept as given.
ACCEPTED = [
    (HelmDConfig, "curvature", -1e-4),
    (HelmDConfig, "curvature", -1e4),
    (HelmDConfig, "rms_norm_eps", 1e-2),
    (HelmDConfig, "rms_norm_eps", 1e-30),
    (HelmDConfig, "initializer_range", 1.0),
    (HelmDConfig, "tau_init", 1e-3),
    (HelmDConfig, "tau_init", 1e4),
    (HelmDConfig, "residual_weight", 1e-4),
    (HelmDConfig, "residual_weight", 1e4),
    (HelmDConfig, "residual_space_scale_factor", 1e-2),
    (HelmDConfig, "residual_space_scale_factor", 1e2),
    (HelmDConfig, "curvature", -1),  # ints are numbers
    (HelmMiCEConfig, "routed_curvatures", [-1e-4, -0.1, -2.0, -1e4]),
    (HelmMiCEConfig, "aux_loss_alpha", 0.0),
    (HelmMiCEConfig, "bias_update_speed", 0.0),
]


@pytest.mark.parametrize("cls,name,value", ACCEPTED, ids=[f"{c.__name__}-{n}-{v}" for c, n, v in ACCEPTED])
def test_documented_boundaries_are_accepted(cls, name, value):
    assert getattr(cls(**{name: value}), name) == value


# Special token ids must be ids of the vocabulary (vocab_size 512 here): checked in validate_architecture.
# (config class, field, value)
TOKEN_IDS = [
    (HelmDConfig, "pad_token_id", 99999),
    (HelmDConfig, "pad_token_id", 512),
    (HelmDConfig, "bos_token_id", -1),
    (HelmDConfig, "eos_token_id", [0, 512]),
    (HelmDConfig, "eos_token_id", []),
    (HelmDConfig, "pad_token_id", 1.0),
    (HelmMiCEConfig, "pad_token_id", 99999),
    (HelmMiCEConfig, "eos_token_id", [1, -2]),
]


@pytest.mark.parametrize("cls,name,value", TOKEN_IDS, ids=[f"{c.__name__}-{n}-{v}" for c, n, v in TOKEN_IDS])
def test_special_token_ids_outside_the_vocabulary_are_refused(cls, name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be a token id \(or list of ids\) in \[0, vocab_size=512\)"):
        cls(vocab_size=512, **{name: value})


@pytest.mark.parametrize("cls", [HelmDConfig, HelmMiCEConfig])
def test_special_token_ids_inside_the_vocabulary_are_kept(cls):
    config = cls(vocab_size=512, pad_token_id=511, bos_token_id=0, eos_token_id=[1, 2])
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (511, 0, [1, 2])


# helm.load_config: an override that is not a field of the preset's config class is refused, naming the key and
# the closest field (difflib). (preset, overrides, message fragment)
UNKNOWN_OVERRIDES = [
    ("tiny-helm-d", dict(hiden_size=64), r"unknown config field 'hiden_size' for HelmDConfig; did you mean 'hidden_size'"),
    ("tiny-helm-d", dict(attention_dropout=1.5), r"unknown config field 'attention_dropout' for HelmDConfig"),
    ("tiny-helm-d", dict(curvture=-2.0), r"'curvture'.*did you mean 'curvature'"),
    ("tiny-helm-d", dict(qk_rope_head_dim=9), r"'qk_rope_head_dim' for HelmDConfig"),  # a MiCE field
    ("tiny-helm-mice", dict(n_routed_expert=4), r"'n_routed_expert' for HelmMiCEConfig; did you mean 'n_routed_experts'"),
    ("tiny-llama", dict(num_hiden_layers=2), r"'num_hiden_layers' for LlamaConfig; did you mean 'num_hidden_layers'"),
    ("tiny-deepseek-v3", dict(kv_lora_rnk=8), r"'kv_lora_rnk' for DeepseekV3Config; did you mean 'kv_lora_rank'"),
    ("tiny-helm-d", dict(pad_token_id=99999), r"^pad_token_id must be a token id"),  # a field, refused by its check
]


@pytest.mark.parametrize("preset,overrides,match", UNKNOWN_OVERRIDES,
                         ids=[f"{p}-{next(iter(o))}" for p, o, _ in UNKNOWN_OVERRIDES])
def test_load_config_refuses_unknown_overrides(preset, overrides, match):
    import helm

    with pytest.raises(ValueError, match=match):
        helm.load_config(preset, **overrides)


# Fields, standard PreTrainedConfig attributes and the legacy keys transformers converts are accepted.
KNOWN_OVERRIDES = [
    ("tiny-helm-d", dict(hidden_size=65, num_attention_heads=4, head_dim=17, intermediate_size=97)),
    ("tiny-helm-d", dict(num_labels=3, output_attentions=False, dtype="float32")),
    ("tiny-helm-d", dict(residual_space_scale=8.0)),  # legacy name, upgraded by the config
    ("tiny-helm-mice", dict(qk_rope_head_dim=9, n_routed_experts=4)),
    ("tiny-llama", dict(attention_dropout=0.1, rope_theta=5e5)),
]


@pytest.mark.parametrize("preset,overrides", KNOWN_OVERRIDES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(KNOWN_OVERRIDES)])
def test_load_config_accepts_fields_and_standard_attributes(preset, overrides):
    import helm

    helm.load_config(preset, **overrides)


PRESET_FILES = [("not JSON", '{"model_type": ', "is not valid JSON"), ("a list", "[1, 2]", "must hold a JSON object"),
                ("no model_type", '{"hidden_size": 33}', 'must hold a JSON object with a "model_type"')]


@pytest.mark.parametrize("case,text,match", PRESET_FILES, ids=[c[0] for c in PRESET_FILES])
def test_bad_preset_files_are_refused_naming_the_file(case, text, match, tmp_path):
    path = tmp_path / "preset.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"preset file '{path}' {match}"):
        helm.load_config(str(path))


def test_saved_configs_with_extra_keys_still_load(tmp_path):
    """from_pretrained / AutoConfig of a saved config is not subject to the override check (auto_map etc.)."""
    import helm
    from transformers import AutoConfig

    config = helm.load_config("tiny-helm-d")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert loaded.hidden_size == config.hidden_size and "transformers_version" in config.to_dict()


def test_ranges_are_documented_in_the_config_docstrings():
    from helm.models.configuration_common import HelmConfigBase
    from helm.nn import validation

    assert (validation.CURVATURE_RANGE, validation.NORM_EPS_RANGE, validation.INIT_STD_RANGE,
            validation.TEMPERATURE_RANGE, validation.RESIDUAL_WEIGHT_RANGE,
            validation.RESIDUAL_SCALE_FACTOR_RANGE) == ((1e-4, 1e4), (0, 1e-2), (0, 1), (1e-3, 1e4), (1e-4, 1e4),
                                                        (1e-2, 1e2))

    for text in ("(0, 1e-2]", "[1e-4, 1e4]", "[1e-3, 1e4]", "[1e-2, 1e2]", "(0, 1]"):
        assert text in HelmConfigBase.__doc__, text
    assert "[1e-4, 1e4]" in HelmMiCEConfig.__doc__ and "aux_loss_alpha >= 0" in HelmMiCEConfig.__doc__


# Layer constructors use the same rules (helm.nn.validation), so a config edited after construction, or a layer
# built by hand, is refused as well. (factory, message fragment)
LAYERS = [
    (lambda: LorentzRMSNorm(9, eps=NAN), r"^eps must be .*\(0, 0.01\]"),
    (lambda: LorentzRMSNorm(9, eps=0.5), r"^eps must be .*\(0, 0.01\]"),
    (lambda: LorentzLinear(9, 9, k=NAN), r"^k must be a positive"),
    (lambda: LorentzLinear(9, 9, k=1e5), r"^k must be a positive finite number in \[0.0001, 10000\]"),
    (lambda: LorentzLinear(9, 9, k_out=1e-6), r"^k_out must be a positive finite number in \[0.0001, 10000\]"),
    (lambda: LorentzSwiGLU(9, 9, k=INF), r"^k must be a positive"),
    (lambda: LorentzResidual(weight=1e5), r"^weight must be .*\[0.0001, 10000\]"),
    (lambda: LorentzResidual(weight=NAN), r"^weight must be .*finite"),
    (lambda: LorentzResidual(space_scale=INF), r"^space_scale must be .*finite"),
    (lambda: LorentzSelfAttention(9, 2, 5, tau_init=1e6), r"^tau_init must be .*\[0.001, 10000\]"),
    (lambda: LorentzSelfAttention(9, 2, 5, tau_init=NAN), r"^tau_init must be .*finite"),
    (lambda: HMLA(17, 2, kv_lora_rank=9, qk_nope_head_dim=5, qk_rope_head_dim=5, v_head_dim=5, rms_norm_eps=NAN),
     r"^eps must be .*\(0, 0.01\]"),
    (lambda: LorentzEmbedding(10, 9, init_std=NAN), r"^init_std must be .*\(0, 1\]"),
    (lambda: LorentzEmbedding(10, 9, init_std=5.0), r"^init_std must be .*\(0, 1\]"),
    (lambda: LorentzLMHead(9, 10, init_std=NAN), r"^init_std must be .*\(0, 1\]"),
    (lambda: LorentzLMHead(9, 10, mode="distance", tau=INF), r"^tau must be .*finite"),
    (lambda: MiCE(9, 9, n_routed_experts=2, num_experts_per_tok=1, routed_curvatures=[-1.0, -1e-6]),
     r"^routed_curvatures must be .*\|K\| in \[0.0001, 10000\]"),
    (lambda: MiCE(9, 9, n_routed_experts=2, num_experts_per_tok=1, aux_loss_alpha=-1.0),
     r"^aux_loss_alpha must be a non-negative"),
    (lambda: MiCE(9, 9, n_routed_experts=2, num_experts_per_tok=1, bias_update_speed=NAN),
     r"^bias_update_speed must be a non-negative"),
    (lambda: CurvatureExpert(9, 9, k=1.0, k_expert=2e4, trainable=True), r"^k_expert must be .*\[0.0001, 10000\]"),
]


@pytest.mark.parametrize("factory,match", LAYERS, ids=[f"layer{i}" for i in range(len(LAYERS))])
def test_layer_constructors_refuse_the_same_values(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


# Issue 25 item 5: one validation path for every source of a value. (field, value, message fragment after
# "<field> must be"); each is refused the same way from every source in SOURCES, naming the field.
EVERY_SOURCE = [
    ("curvature", 2.0, "a negative finite number"),
    ("hidden_size", -3, "an integer >= 2"),
    ("rms_norm_eps", 0.5, r"positive finite number in \(0, 0.01\]"),
    ("attention_bias", "false", "a bool"),
    ("use_cache", "no", "a bool"),
    ("tie_word_embeddings", True, "False"),
    ("residual_weight", float("nan"), "finite"),
    ("return_dict", "no", "a bool"),  # transformers' own boolean fields: strings are truthy there
    ("output_hidden_states", "false", "a bool"),
    ("is_encoder_decoder", 1, "a bool"),
    ("output_attentions", "false", "a bool"),
    # issue 27 item 2: transformers' other inherited fields take their own types only (transformers kept "1")
    ("chunk_size_feed_forward", "1", "an integer >= 0"),
    ("chunk_size_feed_forward", -1, "an integer >= 0"),
    ("problem_type", "regresion", r"one of \('regression', 'single_label_classification'"),
    ("num_labels", "3", "an integer >= 1"),  # transformers: a TypeError from range()
    ("id2label", "x", "a dict"),  # transformers: an AttributeError from .items()
    ("dtype", "float99", r"a torch.dtype or the name of one"),  # transformers: an AttributeError from getattr(torch)
    ("is_encoder_decoder", True, r"False \(HELM models are decoder-only: there is no encoder\)"),
]


def _saved(tmp_path, family="helm_d"):
    from tests.helpers import tiny_config

    tiny_config(family).save_pretrained(tmp_path)
    return tmp_path


def _edited_config_json(tmp_path, name, value):
    import json

    from transformers import AutoConfig

    folder = _saved(tmp_path)
    data = json.loads((folder / "config.json").read_text())
    data[name] = value
    (folder / "config.json").write_text(json.dumps(data))
    return AutoConfig.from_pretrained(folder)


def _preset_file(tmp_path, name, value):
    import json

    data = json.loads((helm.presets.preset_path("tiny-helm-d")).read_text())
    data[name] = value
    (tmp_path / "preset.json").write_text(json.dumps(data))
    return helm.load_config(str(tmp_path / "preset.json"))


def _model_from_pretrained(tmp_path, name, value):
    from transformers import AutoModelForCausalLM

    from tests.helpers import tiny_model

    tiny_model("helm_d").save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path, **{name: value})


SOURCES = {
    "constructor": lambda tmp_path, name, value: HelmDConfig(**{name: value}),
    "load_config-override": lambda tmp_path, name, value: helm.load_config("tiny-helm-d", **{name: value}),
    "preset-file": _preset_file,
    "config.json": _edited_config_json,
    "AutoConfig.from_pretrained-keyword": lambda tmp_path, name, value: __import__("transformers").AutoConfig
    .from_pretrained(_saved(tmp_path), **{name: value}),
    "model.from_pretrained-keyword": _model_from_pretrained,
    "assigned-after-construction": lambda tmp_path, name, value: setattr(HelmDConfig(), name, value),
}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("name, value, fragment", EVERY_SOURCE, ids=[f"{n}={v!r}" for n, v, _ in EVERY_SOURCE])
def test_every_source_of_a_value_is_validated_naming_the_field(source, name, value, fragment, tmp_path):
    with pytest.raises(ValueError, match=rf"^{name} must be .*{fragment}"):
        SOURCES[source](tmp_path, name, value)


# Issue 27 items 2 and 3: names that are not fields of transformers 5's PreTrainedConfig but that the task heads read
# (classifier_dropout, hidden_dropout) or that older configs and transformers-4 habits carry (pruned_heads,
# is_decoder, add_cross_attention, tie_encoder_decoder). transformers dropped them from AutoConfig keywords (and
# from_pretrained then failed in the model's __init__) or stored any value; now each takes its rule from every
# source that accepts it, and helm.load_config (overrides, preset files) refuses them as unknown fields.
# (field, value, message fragment after "<field> must be")
INHERITED_EXTRAS = [
    ("pruned_heads", "x", r"empty \(\{\}\): HELM models do not prune attention heads"),
    ("pruned_heads", {0: [1]}, r"empty \(\{\}\)"),
    ("classifier_dropout", "0.1", r"a number in \[0, 1\]"),
    ("hidden_dropout", 2.0, r"a number in \[0, 1\]"),
    ("is_decoder", False, r"True \(HELM models are causal decoders"),
    ("is_decoder", "yes", "a bool"),
    ("add_cross_attention", True, r"False \(HELM models are decoder-only: there is no cross-attention\)"),
    ("tie_encoder_decoder", 1, "a bool"),
]
CONFIG_SOURCES = ["constructor", "config.json", "AutoConfig.from_pretrained-keyword", "model.from_pretrained-keyword",
                  "assigned-after-construction"]


@pytest.mark.parametrize("source", CONFIG_SOURCES + ["load_config-override", "preset-file"])
@pytest.mark.parametrize("name, value, fragment", INHERITED_EXTRAS, ids=[f"{n}={v!r}" for n, v, _ in INHERITED_EXTRAS])
def test_inherited_extras_are_validated_from_every_source(source, name, value, fragment, tmp_path):
    match = rf"^{name} must be .*{fragment}" if source in CONFIG_SOURCES else rf"unknown config field '{name}'"
    with pytest.raises(ValueError, match=match):
        SOURCES[source](tmp_path, name, value)


def test_harmless_inherited_values_are_accepted_and_used(tmp_path):
    """is_decoder=True (what HELM models are) is accepted from AutoConfig and model keywords, and reads True (it
    was an AttributeError); pruned_heads={} and chunk_size_feed_forward=0 of older configs load; classifier_dropout
    from a keyword reaches the token-classification head (transformers dropped the keyword, then failed in
    __init__)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from tests.helpers import tiny_model

    tiny_model("helm_d").save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path, is_decoder=True).is_decoder is True
    assert HelmDConfig().is_decoder is True and "is_decoder" not in HelmDConfig().to_dict()
    assert AutoModelForCausalLM.from_pretrained(tmp_path, is_decoder=True).config.is_decoder is True
    config = HelmDConfig(pruned_heads={}, chunk_size_feed_forward=0, problem_type="regression", num_labels=1)
    assert (config.chunk_size_feed_forward, config.problem_type, config.num_labels) == (0, "regression", 1)
    head = AutoModelForTokenClassification.from_pretrained(tmp_path, classifier_dropout=0.25)
    assert head.dropout.p == 0.25 and head.config.classifier_dropout == 0.25


def test_a_preset_file_with_a_typo_key_is_refused_like_the_keyword(tmp_path):
    import json

    data = json.loads(helm.presets.preset_path("tiny-helm-d").read_text())
    data["hiden_size"] = 65
    (tmp_path / "preset.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"preset file .*preset\.json': unknown config field 'hiden_size' for "
                                         r"HelmDConfig; did you mean 'hidden_size'"):
        helm.load_config(str(tmp_path / "preset.json"))


def test_keywords_of_from_pretrained_that_are_valid_are_kept(tmp_path):
    from transformers import AutoConfig

    config, unused = AutoConfig.from_pretrained(_saved(tmp_path), curvature=-2.0, use_cache=False,
                                                return_unused_kwargs=True, not_a_field=3)
    assert (config.curvature, config.use_cache, unused) == (-2.0, False, {"not_a_field": 3})


def test_a_valid_assignment_after_construction_is_kept_and_a_bad_one_changes_nothing(tiny_config):
    config = tiny_config("helm_d")
    config.rms_norm_eps = 1e-6
    with pytest.raises(ValueError, match=r"^rms_norm_eps must be"):
        config.rms_norm_eps = 0.5
    assert config.rms_norm_eps == 1e-6


# re-probe 6: a field assigned after construction passes its own rule only; the cross-field checks ran when the
# config was built, so these built another model than asked (all layers dense) or one whose save did not reload
ASSIGNED_ACROSS_FIELDS = [
    ("helm_mice", "first_k_dense_replace", 5, "first_k_dense_replace=5 exceeds num_hidden_layers"),
    ("helm_d", "pad_token_id", 9000, r"pad_token_id must be a token id .* in \[0, vocab_size=512\), got 9000"),
    ("helm_mice", "eos_token_id", 9000, r"eos_token_id must be a token id .* in \[0, vocab_size=512\), got 9000"),
]


@pytest.mark.parametrize("family, name, value, match", ASSIGNED_ACROSS_FIELDS,
                         ids=[f"{f}-{n}={v}" for f, n, v, _ in ASSIGNED_ACROSS_FIELDS])
def test_building_a_model_checks_fields_assigned_after_construction(tiny_config, family, name, value, match):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    setattr(config, name, value)
    with pytest.raises(ValueError, match=match):
        AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family, name, value, match", ASSIGNED_ACROSS_FIELDS,
                         ids=[f"{f}-{n}={v}" for f, n, v, _ in ASSIGNED_ACROSS_FIELDS])
def test_saving_a_config_checks_fields_assigned_after_construction(tiny_config, family, name, value, match, tmp_path):
    """re-probe 7: such a config was saved (save_pretrained, to_json_file) and then refused when loaded."""
    config = tiny_config(family)
    setattr(config, name, value)
    for save in (config.save_pretrained, lambda folder: config.to_json_file(folder / "config.json")):
        with pytest.raises(ValueError, match=match):
            save(tmp_path)
        assert not (tmp_path / "config.json").exists()


def test_derived_expert_curvatures_follow_a_new_expert_count(tiny_config, tmp_path):
    """routed_curvatures derived from expert_curvature_range (not set) are derived again for another
    n_routed_experts: from a saved config.json with the keyword, or assigned after construction (re-probe 6:
    "routed_curvatures has 4 entries, expected n_routed_experts=2", a field the user never set)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = tiny_config("helm_mice")
    config.save_pretrained(tmp_path)
    two = [-0.1, -2.0]
    assert AutoConfig.from_pretrained(tmp_path, n_routed_experts=2, num_experts_per_tok=1).routed_curvatures == two
    config.n_routed_experts, config.num_experts_per_tok = 2, 1
    assert AutoModelForCausalLM.from_config(config).config.routed_curvatures == two
    with pytest.raises(ValueError, match="routed_curvatures has 3 entries, expected n_routed_experts=2"):
        tiny_config("helm_mice", routed_curvatures=[-1.0, -0.5, -2.0], n_routed_experts=2, num_experts_per_tok=1)


FOREIGN_SCALARS = [
    ("numpy int", "num_hidden_layers", np.int64(2), r"got np.int64\(2\) \(a numpy scalar: pass int\(\.\.\.\) or float"),
    ("numpy float32", "rms_norm_eps", np.float32(1e-5), r"got np.float32\(1e-05\) \(a numpy scalar"),
    ("0-dim tensor", "num_attention_heads", torch.tensor(2), r"got tensor\(2\) \(a 0-dim tensor: pass \.item\(\)\)"),
]


@pytest.mark.parametrize("case, name, value, match", FOREIGN_SCALARS, ids=[c[0] for c in FOREIGN_SCALARS])
def test_numpy_and_tensor_scalars_are_refused_saying_what_to_pass(case, name, value, match):
    """Configs are saved as JSON, which holds Python numbers; re-probe 6 read "must be an integer >= 1, got
    np.int64(2)" as unclear."""
    with pytest.raises(ValueError, match=rf"^{name} must be .*{match}"):
        helm.load_config("tiny-helm-d", **{name: value})


def test_a_saved_config_json_is_a_preset_file(tiny_config, tmp_path):
    """load_config(<save_pretrained folder>/config.json): transformers' keys there (auto_map, architectures,
    transformers_version) are not typos (re-probe 6: "unknown config field 'auto_map'")."""
    from helm.models import HelmDForCausalLM

    from helm.models.configuration_common import TRANSFORMERS_KEYS

    HelmDForCausalLM(tiny_config("helm_d")).save_pretrained(tmp_path)
    assert "auto_map" in (tmp_path / "config.json").read_text()

    def fields(config):
        return {k: v for k, v in config.to_dict().items() if k not in TRANSFORMERS_KEYS}

    assert fields(helm.load_config(str(tmp_path / "config.json"))) == fields(tiny_config("helm_d"))


# re-probe 8 (S031): HelmDConfig.from_pretrained(<a HELM-MiCE folder>) refused the first MiCE field as an unknown
# field ("did you mean 'attention_bias'?"); the saved model_type is compared first. (saved family, class loading it,
# the class the message suggests)
OTHER_MODEL_TYPE = [("helm_mice", HelmDConfig, "HelmMiCEConfig"), ("helm_d", HelmMiCEConfig, "HelmDConfig"),
                    ("llama", HelmDConfig, "LlamaConfig")]


@pytest.mark.parametrize("saved, cls, suggested", OTHER_MODEL_TYPE, ids=[f"{c[0]} into {c[1].__name__}"
                                                                          for c in OTHER_MODEL_TYPE])
def test_a_config_of_another_model_type_is_named(tiny_config, saved, cls, suggested, tmp_path):
    tiny_config(saved).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: the config is of a {saved} model \(model_type='{saved}'\), "
                                         rf"not a {cls.model_type} one; load it with {suggested} or AutoConfig$"):
        cls.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("kind", [str, Path], ids=["str", "Path"])
def test_a_config_saved_to_a_tilde_path_is_refused_before_writing(tiny_config, family, kind, tmp_path, monkeypatch):
    """re-probe 10 L032/L066/L100: config.save_pretrained('~/cfg') made a folder named '~' in the current directory
    (transformers does not expand it), as the models' save_pretrained did before it was refused."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^Helm\w+Config\.save_pretrained\('~/cfg'\): '~' is not expanded by "
                                         r"transformers or PEFT \(the save would create a folder named '~' in the "
                                         r"current directory\); pass os\.path\.expanduser\(\.\.\.\) = '\S+/cfg'; "
                                         r"nothing was written$"):
        tiny_config(family).save_pretrained(kind("~/cfg"))
    assert not (tmp_path / "~").exists()


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


# Issue 25 item 6: documented ranges hold, or a cross-field check refuses the combination.
# (config keywords, message fragment, or None: accepted, and the model's logits at initialisation are finite)
CROSS_FIELD = [
    (dict(initializer_range=1.0, curvature=-1e4, embedding_mode="lorentz", lm_head_mode="distance"),
     r"initializer_range=1.0 with curvature=-10000.0 .*embedding_mode='lorentz' and lm_head_mode='distance' at radius"),
    (dict(initializer_range=1.0, curvature=-1e2, embedding_mode="lorentz"), r"embedding_mode='lorentz' at radius"),
    (dict(initializer_range=0.3, curvature=-1e4, lm_head_mode="distance"), r"lm_head_mode='distance' at radius"),
    (dict(initializer_range=1.0, curvature=-1e4), None),  # no wrapped-normal table: every initialisation is fine
    (dict(initializer_range=0.1, curvature=-1e3, embedding_mode="lorentz", lm_head_mode="distance"), None),
    (dict(initializer_range=1.0, curvature=-10.0, embedding_mode="lorentz", lm_head_mode="distance"), None),
    (dict(initializer_range=0.02, curvature=-1e4, embedding_mode="lorentz", lm_head_mode="distance"), None),
    (dict(residual_weight=710.0), None),  # log(expm1(710)) overflowed in reset_parameters
    (dict(residual_weight=1e4), None),
    (dict(positional="learned", max_position_embeddings=2**27), r"max_position_embeddings=134217728 with "
                                                               r"positional='learned' needs .*GiB in fp32"),
    (dict(positional="hope", max_position_embeddings=2**27), None),  # no table
]


@pytest.mark.parametrize("overrides, match", CROSS_FIELD, ids=[str(o) for o, _ in CROSS_FIELD])
def test_cross_field_ranges(overrides, match):
    from transformers import AutoModelForCausalLM

    from tests.helpers import tiny_config

    if match is not None:
        with pytest.raises(ValueError, match=match):
            tiny_config("helm_d", **overrides)
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("helm_d", **overrides))
    logits = model(input_ids=torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(0))).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("weight", [1e-4, 0.5, 1.0, 709.0, 710.0, 1e3, 1e4])
def test_residual_weight_is_exact_over_its_documented_range(weight):
    """Issue 25 item 6: the overflow-free inverse softplus gives the initial weight to fp32 rounding up to 1e4."""
    assert float(LorentzResidual(weight=weight).weight.detach()) == pytest.approx(weight, rel=1e-6)


# Issue 25 item 4 for the Euclidean baselines: transformers' LlamaConfig / DeepseekV3Config take "false" as truthy,
# so helm.load_config checks their boolean fields (overrides and preset files). (preset, overrides)
BASELINE_BOOLEANS = [
    ("tiny-llama", dict(attention_bias="false")),
    ("tiny-llama", dict(mlp_bias="no")),
    ("tiny-llama", dict(use_cache=0)),
    ("tiny-deepseek-v3", dict(norm_topk_prob="false")),
    ("tiny-deepseek-v3", dict(attention_bias="true")),
]


@pytest.mark.parametrize("preset, overrides", BASELINE_BOOLEANS, ids=[f"{p}-{o}" for p, o in BASELINE_BOOLEANS])
def test_baseline_boolean_fields_take_booleans_only(preset, overrides):
    [(name, value)] = overrides.items()
    with pytest.raises(ValueError, match=rf"^{name} must be a bool, got {value!r}"):
        helm.load_config(preset, **overrides)
    assert getattr(helm.load_config(preset, **{name: False}), name) is False


# Probe items 1 and 2: a key no field reads, in a saved config.json or as a keyword of from_pretrained (or of the
# constructor), is refused like an unknown override of helm.load_config, naming it and the closest field;
# transformers kept it as a stray attribute (config.json, constructor) or dropped it (keyword), silently.
# (source, key, value, the field suggested)
UNKNOWN_KEYS = [
    ("config.json", "hiden_size", 129, "hidden_size"),
    ("config.json", "curvatur", -2.0, "curvature"),
    ("config.json", "posistional", "alibi", "positional"),
    ("AutoConfig.from_pretrained-keyword", "curvatur", -2.0, "curvature"),
    ("AutoConfig.from_pretrained-keyword", "hiden_size", 129, "hidden_size"),
    ("AutoConfig.from_pretrained-keyword", "revison", "main", "revision"),  # a loading option, misspelt
    ("HelmDConfig.from_pretrained-keyword", "use_cahce", False, "use_cache"),
    ("constructor", "hiden_size", 129, "hidden_size"),
    ("constructor", "curvatur", -2.0, "curvature"),
    # the model's loader hands the keywords its config returns unused to the model's __init__
    ("AutoModelForCausalLM.from_pretrained-keyword", "curvatur", -2.0, "curvature"),
]
UNKNOWN_KEY_WHERE = {"config.json": r"a key of the saved config \(config\.json\)",
                     "AutoConfig.from_pretrained-keyword": "keyword {key}={value} of from_pretrained",
                     "HelmDConfig.from_pretrained-keyword": "keyword {key}={value} of from_pretrained",
                     "constructor": "constructor keywords must be fields",
                     "AutoModelForCausalLM.from_pretrained-keyword":
                         "keyword {key}= of HelmDForCausalLM.from_pretrained"}
SOURCES["HelmDConfig.from_pretrained-keyword"] = lambda tmp_path, name, value: HelmDConfig.from_pretrained(
    _saved(tmp_path), **{name: value})


def _model_from_pretrained(tmp_path, name, value):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "model"
    AutoModelForCausalLM.from_config(HelmDConfig.from_pretrained(_saved(tmp_path))).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, **{name: value})


SOURCES["AutoModelForCausalLM.from_pretrained-keyword"] = _model_from_pretrained


def test_an_unknown_field_assigned_after_construction_is_named_in_a_warning():
    """Second re-probe: ``config.curvatur = -2.0`` was kept as a stray attribute and the model built the default
    curvature without a word. It warns with the did-you-mean (not an error: other libraries hang their own attributes
    on configs); known fields and transformers' keys stay silent."""
    import warnings

    config = HelmDConfig()
    with pytest.warns(UserWarning, match=r"^unknown config field 'curvatur' for HelmDConfig; did you mean "
                                         r"'curvature'\? \(assigned after construction"):
        config.curvatur = -2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.curvature = -2.0
        config.architectures = ["HelmDForCausalLM"]
        config._private_note = 1


@pytest.mark.parametrize("source, key, value, suggested", UNKNOWN_KEYS,
                         ids=[f"{s}-{k}" for s, k, _, _ in UNKNOWN_KEYS])
def test_unknown_keys_of_saved_configs_and_keywords_are_refused_naming_them(source, key, value, suggested, tmp_path):
    import re

    where = UNKNOWN_KEY_WHERE[source].format(key=key, value=re.escape(repr(value)))
    with pytest.raises(ValueError, match=rf"^unknown config field '{key}' for HelmDConfig; did you mean "
                                         rf"'{suggested}'\? \({where}"):
        SOURCES[source](tmp_path, key, value)


def test_an_unknown_key_of_a_mice_config_json_is_refused(tmp_path):
    import json

    from transformers import AutoConfig

    folder = _saved(tmp_path, "helm_mice")
    data = json.loads((folder / "config.json").read_text())
    data["n_routed_expert"] = 8
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"^unknown config field 'n_routed_expert' for HelmMiCEConfig; did you mean "
                                         r"'n_routed_experts'\? \(a key of the saved config"):
        AutoConfig.from_pretrained(folder)


# What transformers itself writes into config.json, or passes to from_pretrained, still loads: keys of older
# transformers versions (generation parameters, private bookkeeping), its loading options and documented model
# keywords, and return_unused_kwargs=True still hands back what no field reads. (source, keywords or keys)
KEPT_KEYS = [
    ("config.json", dict(_name_or_path="x", _attn_implementation_autoset=True, torch_dtype="float32")),
    ("config.json", dict(max_length=20, do_sample=False, tokenizer_class=None, use_bfloat16=False, prefix=None)),
    ("config.json", dict(quantization_config={"quant_method": "bitsandbytes"}, custom_pipelines={})),
    ("config.json", dict(pruned_heads={}, is_decoder=True, output_attentions=False, architectures=["X"])),
    ("AutoConfig", dict(cache_dir="unused-cache", revision="main", local_files_only=True, token=None,
                        force_download=False, subfolder="", trust_remote_code=True, code_revision=None)),
    ("AutoConfig", dict(attn_implementation="eager", dtype="bfloat16", name_or_path="x", num_labels=3)),
    ("AutoConfig", dict(_from_auto=True, _from_pipeline="text-generation", _commit_hash=None)),
    ("AutoConfig", dict(device_map="cpu", low_cpu_mem_usage=True, output_loading_info=True)),  # pipeline(model_kwargs)
    ("model", dict(attn_implementation="eager")),
    ("model", dict(dtype=torch.bfloat16)),
    ("model", dict(device_map="cpu")),
    ("model", dict(output_loading_info=True, use_safetensors=True, curvature=-2.0)),
]


@pytest.mark.parametrize("source, keys", KEPT_KEYS, ids=[f"{s}-{'-'.join(k)}" for s, k in KEPT_KEYS])
def test_keys_and_keywords_of_transformers_still_load(source, keys, tmp_path):
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers import tiny_model

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


def test_return_unused_kwargs_keeps_its_meaning(tmp_path):
    from transformers import AutoConfig

    config, unused = AutoConfig.from_pretrained(_saved(tmp_path), curvatur=-2.0, curvature=-3.0,
                                                return_unused_kwargs=True)
    assert config.curvature == -3.0 and unused == {"curvatur": -2.0}


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("head", ["AutoModelForCausalLM", "AutoModelForSequenceClassification",
                                  "AutoModelForTokenClassification"])
def test_every_config_json_the_repo_saves_loads(family, head, tmp_path):
    """Round trips of both families and the task heads (labels, problem type): save_pretrained, from_pretrained of
    the config and of the model, and from_dict(to_dict()) (helm.evaluation rebuilds scaled configs that way)."""
    import transformers
    from transformers import AutoConfig

    from tests.helpers import tiny_config

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


# Probe item 3: load_config's preset argument of the wrong type names the argument and lists the presets (was a
# pathlib TypeError). (argument)
PRESET_ARGUMENTS = [None, 3, ["tiny-helm-d"]]


@pytest.mark.parametrize("argument", PRESET_ARGUMENTS, ids=[repr(a) for a in PRESET_ARGUMENTS])
def test_load_config_names_its_preset_argument(argument):
    import re

    with pytest.raises(TypeError, match=rf"^load_config: the preset argument name_or_path must be a preset name or the "
                                        rf"path of a JSON config file .*got {re.escape(repr(argument))}; the presets "
                                        r"are \(.*'tiny-helm-d'"):
        helm.load_config(argument)


# Probe item 4: a head_dim derived from hidden_size and num_attention_heads that the positional encoding (or a head)
# cannot use names those two fields and the derived width (the user never set head_dim). (source, keywords, match)
DERIVED_HEAD_DIMS = [
    (HelmDConfig, dict(hidden_size=130), r"^head_dim must be 1 \+ an even number for positional='hope' .*got 22 = 1 "
                                         r"\+ \(hidden_size - 1\) // num_attention_heads with hidden_size=130 and "
                                         r"num_attention_heads=6 .*e\.g\. 121 or 133"),
    (HelmDConfig, dict(hidden_size=61, num_attention_heads=4, positional="rope3d"),
     r"got 16 = .*hidden_size=61 and num_attention_heads=4.*e\.g\. 57 or 65"),
    (HelmMiCEConfig, dict(attention_type="mha", hidden_size=130), r"got 22 = .*hidden_size=130 and "
                                                                  r"num_attention_heads=6"),
    (HelmDConfig, dict(hidden_size=4, num_attention_heads=6), r"^head_dim must be an integer >= 2, got 1 = 1 \+ "
                                                              r"\(hidden_size - 1\) // num_attention_heads with "
                                                              r"hidden_size=4 and num_attention_heads=6"),
    ("tiny-helm-d", dict(hidden_size=125, head_dim=None), r"got 32 = .*hidden_size=125 and num_attention_heads=4"),
]


@pytest.mark.parametrize("source, kwargs, match", DERIVED_HEAD_DIMS, ids=[str(k) for _, k, _ in DERIVED_HEAD_DIMS])
def test_a_derived_head_dim_names_hidden_size_and_num_attention_heads(source, kwargs, match):
    with pytest.raises(ValueError, match=match):
        helm.load_config(source, **kwargs) if isinstance(source, str) else source(**kwargs)


def test_an_explicit_head_dim_keeps_its_own_message():
    with pytest.raises(ValueError, match=r"^head_dim must be 1 \+ an even number for positional='hope' \(it acts on "
                                         r"pairs of space dims\), got 40$"):
        HelmDConfig(head_dim=40)


# Probe 8 P097/P099/S040: a field whose default None means "derived" (head_dim; MiCE's routed_curvatures), set to
# None (or made needed, by attention_type='mha') after construction, is derived again when the model is built or the
# config saved, as the same keywords derive it: it was a TypeError deep in positional_dims. (family, keywords the
# config is built with, fields assigned afterwards, the derived field)
DERIVED_AFTER_CONSTRUCTION = [
    ("helm_d", {}, {"head_dim": None}, "head_dim"),
    ("helm_d", {}, {"hidden_size": 65, "head_dim": None}, "head_dim"),
    ("helm_d", {"positional": "rope3d"}, {"head_dim": None}, "head_dim"),
    ("helm_mice", {"attention_type": "mha"}, {"head_dim": None}, "head_dim"),
    ("helm_mice", {"attention_type": "hmla"}, {"attention_type": "mha"}, "head_dim"),
    ("helm_mice", {"attention_type": "hmla"}, {"routed_curvatures": None}, "routed_curvatures"),
    ("helm_mice", {"attention_type": "mha"}, {"routed_curvatures": None, "expert_curvature_range": [-0.5, -1.5]},
     "routed_curvatures"),
]


@pytest.mark.parametrize("family, built, assigned, derived", DERIVED_AFTER_CONSTRUCTION,
                         ids=[f"{f}-{b}-{a}" for f, b, a, _ in DERIVED_AFTER_CONSTRUCTION])
def test_a_derived_field_assigned_none_is_derived_again(tiny_config, family, built, assigned, derived, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    expected = getattr(tiny_config(family, **{**built, **assigned}), derived)
    assert expected is not None
    config = tiny_config(family, **built)
    for name, value in assigned.items():
        setattr(config, name, value)
    assert getattr(AutoModelForCausalLM.from_config(config).config, derived) == expected
    config.save_pretrained(tmp_path)
    assert getattr(AutoConfig.from_pretrained(tmp_path), derived) == expected
    config.validate()
    config.to_json_file(tmp_path / "again.json")


def test_a_derived_head_dim_refused_after_construction_names_its_fields_and_stays_none(tiny_config, tmp_path):
    from transformers import AutoModelForCausalLM

    config = tiny_config("helm_d")
    config.hidden_size, config.head_dim = 67, None
    match = r"^head_dim must be 1 \+ an even number for positional='hope' .*got 34 = .*hidden_size=67"
    for use in (AutoModelForCausalLM.from_config, lambda c: c.save_pretrained(tmp_path), lambda c: c.validate()):
        with pytest.raises(ValueError, match=match):
            use(config)
    assert config.head_dim is None and not (tmp_path / "config.json").exists()
