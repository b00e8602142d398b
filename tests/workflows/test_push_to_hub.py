"""``save_pretrained(push_to_hub=True)`` and ``push_to_hub()`` upload the flattened code and the SHA-256 manifest
with the weights (transformers uploads inside its own save, before HELM's additions were written). The hub is
replaced by a recorder of the commit's files; nothing leaves the machine."""

from types import SimpleNamespace

import pytest

from tests.helpers import tiny_model


class _Hub:
    """Stands in for transformers' ``hf_api()``: records the files of each commit."""

    def __init__(self):
        self.commits = []

    def create_repo(self, repo_id, exist_ok=False, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        self.commits.append({op.path_in_repo: op.path_or_fileobj for op in operations})


@pytest.fixture
def hub(monkeypatch):
    import transformers.modeling_utils
    import transformers.utils.hub

    recorder = _Hub()
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", recorder)
    card = SimpleNamespace(save=lambda path: open(path, "w").write("card"))
    for module in (transformers.modeling_utils, transformers.utils.hub):  # the card would be read from the hub
        monkeypatch.setattr(module, "create_and_tag_model_card", lambda *a, **k: card)
    return recorder


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
@pytest.mark.parametrize("how", ["save_pretrained(push_to_hub=True)", "push_to_hub()"])
def test_the_hub_copy_has_the_code_and_the_manifest(hub, tmp_path, family, how):
    model = tiny_model(family)
    if how == "push_to_hub()":
        model.push_to_hub("someone/tiny")
    else:
        model.save_pretrained(tmp_path / "tiny", push_to_hub=True, repo_id="someone/tiny")
    [files] = hub.commits
    code = f"modeling_{family}.py"
    assert {"config.json", "model.safetensors", "manifest.json", code} <= set(files), sorted(files)
    if how != "push_to_hub()":  # the local folder is the uploaded one, and loads
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(tmp_path / "tiny") is not None
