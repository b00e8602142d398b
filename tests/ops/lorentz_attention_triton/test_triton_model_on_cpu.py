"""A model built on the CPU with ``attn_implementation="triton"``, saved and reloaded with it, runs there in the Triton
interpreter (on CUDA when there is a GPU) and gives the sdpa model's logits."""

import torch
from transformers import AutoModelForCausalLM

import helm
from tests.helpers import relative_error
from tests.ops.lorentz_attention_triton.device import DEVICE


def test_triton_model_built_on_cpu_saves_reloads_and_runs(lk, tmp_path, monkeypatch):
    from helm.ops import attention

    calls = []
    kernel = attention.ATTENTION_FUNCTIONS["triton"]
    monkeypatch.setitem(attention.ATTENTION_FUNCTIONS, "triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    torch.manual_seed(0)
    cfg = helm.load_config("tiny-helm-d", num_hidden_layers=1, hidden_size=33, num_attention_heads=2, head_dim=17,
                           intermediate_size=65, vocab_size=64, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(cfg, attn_implementation="triton").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="triton").to(DEVICE).eval()
    assert model.config._attn_implementation == "triton"
    ids = torch.randint(0, 64, (2, 16), device=DEVICE)
    with torch.no_grad():
        triton = model(input_ids=ids).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(input_ids=ids).logits
    assert calls == [1]  # one attention layer: the kernel ran once, for the triton forward
    assert relative_error(triton, sdpa) <= 1e-5


def test_decode_steps_read_the_cached_keys_as_stored(lk, prepared):
    """Under bf16 autocast each HELM-D decode step hands the kernel the cache's keys as they are stored, space parts
    in bf16 (no cast of the cache per step), and gives the logits of the forward over the whole sequence."""
    torch.manual_seed(0)
    cfg = helm.load_config("tiny-helm-d", num_hidden_layers=1, hidden_size=33, num_attention_heads=2, head_dim=17,
                           intermediate_size=65, vocab_size=64, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="triton").to(DEVICE).eval()
    ids = torch.randint(0, 64, (2, 12), device=DEVICE)
    with torch.no_grad(), torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        whole = model(input_ids=ids).logits
        cache = model(input_ids=ids[:, :9], use_cache=True).past_key_values
        steps = [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(9, 12)]
    keys = cache.layers[0].keys
    assert keys.dtype == torch.bfloat16 and keys.shape[-1] == 16
    assert prepared[-1].k.data_ptr() == keys.data_ptr()
    assert relative_error(torch.cat(steps, 1), whole[:, 9:]) <= 2e-2
