"""FSDP2 for the zoo: sharding HELM models with ``torch.distributed.fsdp.fully_shard`` (through ``accelerate``).

What makes a HELM model shardable, and where each piece lives:

* every parameter has at least one dimension (``fully_shard`` shards dim 0 and refuses 0-dim tensors): the learnable
  scalars (temperatures ``log_tau``, residual weights ``raw_weight``, curvatures ``log_k``, ...) are ``[1]``; older
  checkpoints with 0-dim scalars are migrated on load (``HelmPreTrainedModel._load_pretrained_model``);
* manifold points (Lorentz token tables, distance-head prototypes) keep Riemannian updates without weight decay
  after sharding turns them into plain ``DTensor`` parameters: :class:`helm.optim.RiemannianAdam` records their
  manifolds before sharding and steps on the local rows (rows are points; FSDP2 shards rows);
* ``accelerate`` only runs FSDP on accelerators; on CPU processes (gloo) it silently falls back to DDP.
  :func:`use_fsdp_on_cpu` switches such a run to FSDP2, so a recipe that asks for FSDP gets it everywhere (and the
  CPU test suite can check it against one process).
"""

from __future__ import annotations

from typing import Optional


def use_fsdp_on_cpu(accelerator, fsdp_plugin: Optional[object]) -> bool:
    """Make a multi-process CPU ``accelerator`` shard with ``fsdp_plugin`` (FSDP2 on gloo) instead of DDP.

    ``accelerate`` decides the distributed type when the ``Accelerator`` is built and keeps FSDP for accelerator
    devices; ``fully_shard`` itself runs on CPU meshes with the gloo backend. This sets the type (in both of
    ``accelerate``'s shared states, as ``accelerate`` does when it picks FSDP itself) before anything is prepared.
    Returns whether it switched; anything else (no plugin, one process, GPUs) is left unchanged.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if fsdp_plugin is None or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    if getattr(fsdp_plugin, "fsdp_version", 1) != 2:
        raise ValueError("FSDP on CPU processes needs fsdp_version=2 (fully_shard)")
    accelerator.state.fsdp_plugin = fsdp_plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def clip_grad_norm(accelerator, parameters, max_norm: float):
    """``accelerator.clip_grad_norm_`` returning a plain tensor: under FSDP2 the total norm of sharded gradients
    comes back as a (replicated) ``DTensor``, which cannot be mixed with the loop's plain tensors."""
    from torch.distributed.tensor import DTensor

    norm = accelerator.clip_grad_norm_(parameters, max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


__all__ = ["clip_grad_norm", "use_fsdp_on_cpu"]
