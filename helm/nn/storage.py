"""Where a layer's tensors live in memory, which CPU kernels' results depend on."""

from __future__ import annotations

import itertools

from torch import nn

# bytes: every allocation of PyTorch's CPU allocator starts on this boundary
CPU_ALIGNMENT = 64


def realign_(module: nn.Module) -> None:
    """Give every CPU parameter and buffer of ``module`` (children included) whose data does not start on a
    ``CPU_ALIGNMENT``-byte boundary a freshly allocated copy of its values (the same ``Parameter`` objects, so ties
    and ``ManifoldParameter`` classes stay).

    Why: a checkpoint's tensors come out of ``from_pretrained`` at the byte offsets they have in the safetensors file,
    and the CPU GEMM / GEMV kernels split their vectorised loops by the address of the weight rows, so a linear of
    odd width (HELM's ``1+n`` inputs) on a misaligned weight sums in another order than on the same values freshly
    allocated: a reloaded model's logits would differ from the saved model's in the last bits (issue 23 item 8).
    Aligned tensors are left alone (a second call copies nothing)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.device.type == "cpu" and tensor.numel() and tensor.data_ptr() % CPU_ALIGNMENT:
            tensor.data = tensor.data.clone()


class RealignAfterLoading:
    """Mixin of the layers that hold weights: ``restore_frozen``, the hook
    :meth:`helm.models.modeling_common.HelmPreTrainedModel.restore_geometry` calls on every module after loading,
    realigns the layer's tensors (:func:`realign_`)."""

    def restore_frozen(self) -> None:
        realign_(self)


__all__ = ["CPU_ALIGNMENT", "RealignAfterLoading", "realign_"]
