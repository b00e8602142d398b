"""HELM-D and HELM-MiCE: the fused LM-head loss (training with labels) against the plain logits path, and the
rule for when ``logits`` is None."""

import pytest
import torch

from tests.helpers import assert_close, tiny_model

FAMILIES = ["helm_d", "helm_mice"]


def batch(T=63):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, T), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, 40:] = -100
    return ids, labels


def targets_of(labels, extra):
    shifted = extra.get("shift_labels")
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:] if shifted is None else shifted


def loss_and_grads(model, ids, labels, extra, *, fused):
    """The model's fused loss, or the same loss written out on its logits (in the model's dtype: transformers'
    ForCausalLMLoss would round an fp64 loss to fp32), and the gradients of every parameter."""
    model.zero_grad()
    out = model(ids, labels=labels, **({} if fused else {"skip_logits": False}), **extra)
    loss = out.loss
    if not fused:
        targets = targets_of(labels, extra)
        count = extra.get("num_items_in_batch", (targets != -100).sum())
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten(), reduction="sum") / count
        loss = loss + (out.aux_loss if getattr(out, "aux_loss", None) is not None else 0)
        assert_close(out.loss, loss, dtype=torch.float32)  # transformers' loss, in fp32
    loss.backward()
    return out, loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("head", ["linear", "distance"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_loss_equals_the_plain_path_in_loss_and_gradients(family, head, dtype):
    model = tiny_model(family, train=True, lm_head_mode=head).to(dtype)
    ids, labels = batch()
    for extra in ({}, {"num_items_in_batch": torch.tensor(200)}, {"shift_labels": labels.roll(-1, 1)}):
        plain, plain_loss, g_plain = loss_and_grads(model, ids, labels, extra, fused=False)
        fused, fused_loss, g_fused = loss_and_grads(model, ids, labels, extra, fused=True)
        assert fused.logits is None and plain.logits is not None and fused_loss.dtype == dtype
        assert_close(fused_loss, plain_loss, factor=10.0, msg=str(extra))
        assert g_fused.keys() == g_plain.keys() and "lm_head.weight" in g_fused
        assert (head == "distance") == ("lm_head.log_tau" in g_fused)
        if dtype == torch.float64:
            for name in g_plain:
                assert_close(g_fused[name], g_plain[name], factor=10.0, msg=f"{name} {extra}")
        else:  # fp32: relative to the largest gradient entry (small scalar gradients are sums that cancel)
            assert_close(torch.cat([g.flatten() for g in g_fused.values()]),
                         torch.cat([g.flatten() for g in g_plain.values()]), factor=10.0, msg=str(extra))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_are_skipped_only_in_training_with_labels(family):
    model = tiny_model(family, train=True)
    ids, labels = batch(17)
    with torch.no_grad():
        assert model(ids, labels=labels).logits is None
        assert model(ids, labels=labels, skip_logits=False).logits.shape == (2, 17, 512)
        assert model(ids).logits is not None  # no labels: logits
        with pytest.raises(ValueError, match="needs labels"):
            model(ids, skip_logits=True)
        as_tuple = model(ids, labels=labels, return_dict=False)
        assert torch.equal(as_tuple[0], model(ids, labels=labels).loss)  # the loss first, then no logits
        model.eval()
        out = model(ids, labels=labels)
        assert out.logits is not None  # evaluation keeps the logits
        fused = model(ids, labels=labels, skip_logits=True)
        assert fused.logits is None and torch.allclose(fused.loss, out.loss, rtol=1e-5)
        model.train()
        model.config.fused_lm_loss = False
        assert model(ids, labels=labels).logits is not None
