"""transformers' text-generation pipeline and streamer on a saved HELM checkpoint, as on a Llama one."""

import pytest
from transformers import TextIteratorStreamer, pipeline

from tests.helpers import tiny_model


@pytest.mark.parametrize("family", ["helm_d", "helm_mice", "llama"])
def test_text_generation_pipeline_and_streamer(family, tokenizer, tmp_path):
    tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    [result] = generator("the cat sat on", max_new_tokens=6, do_sample=False)
    model = generator.model
    ids = tokenizer("the cat sat on", return_tensors="pt").input_ids
    # the pipeline's text is the prompt followed by what generate continues it with, decoded
    continued = model.generate(ids, max_new_tokens=6, do_sample=False)
    continuation = tokenizer.decode(continued[0, ids.shape[1]:], skip_special_tokens=True)
    assert continuation and result["generated_text"] == "the cat sat on" + continuation
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6, streamer=streamer)
    assert "".join(streamer) == tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=False)
