"""The path checks of HELM's own classes (``helm/models/loading.py``): the two cases where ``transformers`` gives a
silently wrong result or loses the work, for Llama as for HELM, and ``~`` expanded by HELM's own path helpers. Damaged
weights (strict loading, the manifest, NaN weights) are ``tests/reliability/test_inputs.py``'s; how ``transformers``,
tokenizers and PEFT answer other bad paths is theirs (tests/test_lane.py: nothing of theirs is replaced)."""

import re
import shutil
from pathlib import Path

import pytest

from helm.models import HelmDConfig, HelmMiCEConfig
from tests.helpers import tiny_model


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("where", ["file", "under a file"])
def test_saving_to_a_file_is_refused_before_writing(tmp_path, family, where):
    """``transformers`` logs an error and returns without saving anything (Llama too): the run would go on as if
    the model were saved."""
    (tmp_path / "taken").write_text("a file")
    target = tmp_path / "taken" if where == "file" else tmp_path / "taken" / "model"
    with pytest.raises(NotADirectoryError, match=re.escape(repr(str(target)))):
        tiny_model(family).save_pretrained(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert (tmp_path / "taken").read_text() == "a file"


@pytest.mark.parametrize("config_class", [HelmDConfig, HelmMiCEConfig], ids=["helm_d", "helm_mice"])
@pytest.mark.parametrize("subfolder", ["", "sub"])
def test_a_config_folder_without_config_json_is_refused(tmp_path, config_class, subfolder):
    """``PreTrainedConfig.from_pretrained`` of a folder without ``config.json`` returns a default config (Llama's
    too): a model other than the one meant. A folder that holds one loads."""
    (tmp_path / "model" / subfolder).mkdir(parents=True)
    with pytest.raises(OSError, match=r"config\.json"):
        config_class.from_pretrained(tmp_path / "model", subfolder=subfolder)
    config_class(num_hidden_layers=3).save_pretrained(tmp_path / "model" / subfolder)
    assert config_class.from_pretrained(tmp_path / "model", subfolder=subfolder).num_hidden_layers == 3


def test_helpers_expand_a_tilde_path(tmp_path, monkeypatch):
    """re-probe 11 M269-M272, O015: list_checkpoints('~/run/checkpoints') returned [] for a folder that held
    checkpoints; verify_checkpoint, load_config and convert_official_checkpoint said a '~' path "does not exist"."""
    from helm import convert_official_checkpoint, load_config
    from helm.training.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run" / "checkpoints" / "step-00000002").mkdir(parents=True)
    assert list_checkpoints("~/run/checkpoints") == [(2, tmp_path / "run" / "checkpoints" / "step-00000002")]
    with pytest.raises(CheckpointError) as err:  # found, and refused for what it lacks
        verify_checkpoint("~/run/checkpoints/step-00000002")
    assert "does not exist" not in str(err.value)
    load_config("helm-d-115m").save_pretrained(tmp_path / "cfg")
    assert load_config("~/cfg/config.json").hidden_size == load_config("helm-d-115m").hidden_size
    shutil.copy(Path(__file__).parents[1] / "fixtures" / "official" / "helm_d_tiny.pt", tmp_path / "off.pt")
    assert convert_official_checkpoint("~/off.pt") is not None
