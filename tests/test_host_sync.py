"""Issue 33, Build item 3: no host synchronisation in a default training step or a decoding step.

A host read of a tensor's value (``.item()``, ``bool(t)``, ``nonzero``, ``torch.equal``) stalls a GPU's launch queue
until every queued kernel has run. On the CPU they still go through the aten ops counted here, so the count is the
same on either device. HELM's two families are held to what transformers' twins (Llama, DeepSeek-V3) do: zero,
in a training step (forward with labels, backward, and the routing-bias update ``train.py`` makes after each
optimiser step) and in a decoding step (one new token against a filled cache).
"""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helm.models.routing import attach_balancing
from tests.helpers import tiny_model

SYNC_OPS = {torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero, torch.ops.aten.nonzero,
            torch.ops.aten.equal, torch.ops.aten.item}
FAMILIES = ["helm_d", "helm_mice", "llama", "deepseek_v3"]
# 2 x 64 tokens: at and above the token count from which a MiCE layer used to switch to the sparse dispatch
BATCH, SEQ = 2, 64


class HostSyncs(TorchDispatchMode):
    """Counts the aten ops that read a tensor's value on the host, and ``Tensor.tolist`` (which reads a CPU tensor
    without going through aten, so it is wrapped while the mode is on); keeps the Python stack of the first hit."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.first: list = []

    def __enter__(self):
        self.tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: (self.record("tolist"), self.tolist(t))[1]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in SYNC_OPS:
            self.record(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def record(self, op: str) -> None:
        self.counts[op] = self.counts.get(op, 0) + 1
        if not self.first:
            self.first = traceback.extract_stack()[:-2]

    def report(self) -> str:
        where = "".join(traceback.format_list([f for f in self.first if "/torch/" not in f.filename][-6:]))
        return f"host syncs {self.counts}; first at:\n{where}"


def ids(seed: int, shape=(BATCH, SEQ)) -> torch.Tensor:
    return torch.randint(2, 512, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_never_reads_the_device(family):
    """The first step and the one after an optimiser step (AdamW, as ``train.py``'s), each with the routing-bias update;
    the optimiser step itself is not counted (on the CPU its step counters are host tensors that it reads)."""
    model = tiny_model(family, train=True)
    layers = attach_balancing(model)  # DeepSeek-V3 gets the hooks train.py gives it
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, seed in enumerate((1, 2)):
        batch = ids(seed)
        with HostSyncs() as syncs:
            model(batch, labels=batch).loss.backward()
            # helm/training/step.py's routing-bias update, from the step's load (here one micro-batch, one process)
            load = torch.stack([layer.last_expert_load for layer in layers]) if layers else []
            for layer, layer_load in zip(layers, load):
                layer.last_expert_load.copy_(layer_load)
                layer.update_bias()
        assert not syncs.counts, f"step {step}: {syncs.report()}"
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)  # the backward did run
        optimizer.step()
        optimizer.zero_grad()
    assert (family in ("helm_mice", "deepseek_v3")) == bool(layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decoding_step_never_reads_the_device(family):
    model = tiny_model(family)
    prompt = ids(3)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
        step = ids(4, (BATCH, 1))
        with HostSyncs() as syncs:
            out = model(step, past_key_values=cache, use_cache=True)
        full = model(torch.cat([prompt, step], 1)).logits[:, -1]
    assert not syncs.counts, syncs.report()
    torch.testing.assert_close(out.logits[:, -1], full, rtol=1e-4, atol=1e-4)  # the cached step is the step
