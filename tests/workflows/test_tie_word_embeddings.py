"""Issue 23 item 9 (first half): ``from_pretrained(folder, tie_word_embeddings=True)`` is refused as the constructor
refuses it (the token table holds points or space parts, the LM head maps the full vector), for both families and
for a remote-code folder loaded where helm is not installed; it is never accepted with the weights left untied."""

import pytest
from transformers import AutoModelForCausalLM

import helm
from tests.helpers import run_without_helm, tiny_model


@pytest.mark.parametrize("family", ["helm_d", "helm_mice"])
def test_from_pretrained_refuses_tying_as_the_constructor_does(family, tmp_path):
    tiny_model(family).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as constructor:
        helm.load_config(f"tiny-{family.replace('_', '-')}", tie_word_embeddings=True)
    with pytest.raises(ValueError) as loading:
        AutoModelForCausalLM.from_pretrained(tmp_path, tie_word_embeddings=True)
    assert "tie_word_embeddings" in str(loading.value) and "tie_word_embeddings" in str(constructor.value)
    proc = run_without_helm(f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True, tie_word_embeddings=True)
            print("REPORT accepted")
        except ValueError as error:
            print("REPORT " + str(error))
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tie_word_embeddings" in proc.stdout.split("REPORT ")[-1]
