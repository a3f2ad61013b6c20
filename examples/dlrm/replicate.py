"""The dense part replicated over the ranks with ``DistributedDataParallel``.

The DLRM's dense parameters (bottom and top MLPs) are replicated; its sparse part is sharded and updated by fused
optimizers inside the embedding kernels' backward. As torchrec's ``DistributedModelParallel`` does, the whole
training loss module is wrapped in DDP with every parameter and buffer of the sparse part ignored: DDP's
gradient all-reduce of the dense parameters then runs in buckets *during* the backward, overlapped with the
embedding backward, instead of one flat all-reduce after it. With one rank nothing is wrapped. On gloo (CPU),
small buckets are exchanged by :func:`~examples.dlrm.gather_hook.gather_mean_hook` (an all-gather and a local
sum: less CPU than gloo's all-reduce at this model's size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from examples.dlrm.data import DLRMBatch
from examples.dlrm.gather_hook import gather_mean_hook
from examples.dlrm.model import DLRM

__all__ = ["TrainLoss", "replicate_dense"]


class TrainLoss(nn.Module):
    """``forward(batch) -> loss``: the model's :meth:`DLRM.train_loss` as a module DDP can wrap."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: DLRMBatch) -> torch.Tensor:
        return self.model.train_loss(batch)


def replicate_dense(model: DLRM, *, world_size: int) -> Callable[[DLRMBatch], torch.Tensor]:
    """The training-loss callable: DDP over the dense parameters when ``world_size > 1``, else the model's own."""
    if world_size <= 1:
        return model.train_loss
    wrapper = TrainLoss(model)
    sparse = {id(p) for p in model.sparse_arch.parameters()} | {id(b) for b in model.sparse_arch.buffers()}
    ignored = [
        name
        for name, tensor in [*wrapper.named_parameters(), *wrapper.named_buffers()]
        if id(tensor) in sparse
    ]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrapper, ignored)  # type: ignore[no-untyped-call]  # unannotated in torch (the hook torchrec uses too)
    device = next(model.bottom.parameters()).device
    ddp = DistributedDataParallel(
        wrapper,
        device_ids=[device] if device.type == "cuda" else None,
        process_group=dist.group.WORLD,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )
    if dist.get_backend(dist.group.WORLD) == "gloo":
        ddp.register_comm_hook(dist.group.WORLD, gather_mean_hook)
    return ddp
