"""Issue 14, item 6: PEFT's LoRA with Llama's ``target_modules``, as a Llama user writes it.

The attention and MLP projections are plain ``nn.Linear`` under Llama's names and the layers lift their outputs,
so LoRA's ``W x + b + B A x`` is added before the lift: the outputs stay on the hyperboloid, and a merged adapter
is an ordinary weight update. Each family runs the user's path: wrap, train, save the adapter, reload it on a
fresh base, merge, and compare logits at each stage."""

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from helm.manifold import manifold_error
from tests.helpers import tiny_config

# Llama's usual choice; HMLA has no v_proj (its values come out of kv_b_proj), so its row adds that
TARGETS = {"helm_d": ["q_proj", "v_proj"], "helm_mice": ["q_proj", "kv_b_proj", "gate_proj"],
           "llama": ["q_proj", "v_proj"]}


def fresh_base(family):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family)).eval()


@pytest.mark.parametrize("family", ["helm_d", "helm_mice", "llama"])
def test_lora_train_save_reload_merge_gives_the_same_logits(family, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], task_type="CAUSAL_LM")
    model = peft.get_peft_model(fresh_base(family), config)
    wrapped = [name for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)]
    assert wrapped and all(name.rsplit(".", 1)[-1] in TARGETS[family] for name in wrapped)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    for _ in range(5):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        trained = model(ids, output_hidden_states=True)
    assert (trained.logits - before).abs().max() > 1e-3, "the adapter did not change the model"
    if family != "llama":  # LoRA acts before the lift: every layer's output is still a point
        assert max(manifold_error(h, model.config.k).max() for h in trained.hidden_states) <= 1e-5

    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(fresh_base(family), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained.logits, rtol=0, atol=1e-5)
        merged = reloaded.merge_and_unload()
        assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in merged.modules())
        torch.testing.assert_close(merged(ids).logits, trained.logits, rtol=1e-4, atol=1e-4)


def test_the_final_hlt_is_not_a_plain_linear():
    """``final_proj`` lifts inside its module (a LorentzLinear), so LoRA must refuse it rather than add a delta to
    a point: PEFT says the module type is not supported."""
    base = AutoModelForCausalLM.from_config(tiny_config("helm_d", final_proj=True))
    with pytest.raises(ValueError, match="not supported"):
        peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["final_proj"]))
