"""Sharded state dict of the sharded modules, for ``torch.distributed.checkpoint`` (DCP).

``state_dict()`` of a sharded module gathers every table to every rank (two all-reduces of all the rows):
simple, but it cannot scale to large tables. :func:`sharded_state_dict` instead describes each table as a
``ShardedTensor`` whose global shape is the unsharded table and whose local shards are *views* of this rank's
kernel storage (no copy, no collective): DCP's ``save`` lets every rank write its own rows, and DCP's
``load`` reads into the views whatever rows of the saved tables overlap them, so a checkpoint written by N
ranks with one plan loads on M ranks with another (table-wise, row-wise, any mix).

Keys (for every table of which this rank holds a shard in a kernel with ``split_embedding_weights()``):

- ``f"{table}.weight"``: ``[num_embeddings, embedding_dim]``, the local shard at ``[row_start, 0]``;
- ``f"{table}.momentum"``: ``[num_embeddings]`` row-wise Adagrad state, when the kernel exposes one
  (``split_optimizer_states()``).

Tables in other kernels (key-value tables) are not included: they stream their rows through their own
checkpoint API.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharded_tensor.shard import Shard

from vbe_lookup._sharding_errors import ShardingPlanError

if TYPE_CHECKING:
    from vbe_lookup.sharding import _ShardedModule

__all__ = ["load_sharded_state_dict", "sharded_state_dict"]


def _global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _sharded(module: _ShardedModule, table: int, local: Tensor, shape: tuple[int, ...]) -> ShardedTensor:
    """A ShardedTensor of global ``shape`` over the table's shards; ``local`` is this rank's (a view)."""
    group = module.process_group
    shards = module.layout.shards[table]
    device = local.device
    metas = [
        ShardMetadata(
            shard_offsets=[s.row_start, *([0] * (len(shape) - 1))],
            shard_sizes=[s.num_rows, *shape[1:]],
            placement=f"rank:{_global_rank(group, s.rank)}/{device}",
        )
        for s in shards
    ]
    mine = next(i for i, s in enumerate(shards) if s.rank == module.rank)
    properties = TensorProperties(
        dtype=local.dtype,
        layout=local.layout,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=False,
    )
    global_metadata = ShardedTensorMetadata(
        shards_metadata=metas, size=torch.Size(shape), tensor_properties=properties
    )
    local_shard = Shard(tensor=local.view(metas[mine].shard_sizes), metadata=metas[mine])
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [local_shard], global_metadata, process_group=group
    )


def sharded_state_dict(module: _ShardedModule) -> dict[str, ShardedTensor]:
    """This rank's tables as ShardedTensors over views of the kernel storage (no copy, no collective).

    Every rank holding shards of a table must call this (the ShardedTensors name every rank's shard); ranks
    call it independently, nothing is exchanged.
    """
    tables = module.layout.tables
    out: dict[str, ShardedTensor] = {}
    with torch.no_grad():
        for shard, weight, momentum in module._local_shards():
            table = tables[shard.table]
            if not weight.is_contiguous():
                raise ShardingPlanError(
                    f"table `{table.name}`: its kernel's weight view is not contiguous; a sharded state dict "
                    "needs views of the kernel storage"
                )
            out[f"{table.name}.weight"] = _sharded(
                module, shard.table, weight.detach(), (table.num_embeddings, table.embedding_dim)
            )
            if momentum is not None:
                out[f"{table.name}.momentum"] = _sharded(
                    module, shard.table, momentum.detach().reshape(-1), (table.num_embeddings,)
                )
    return out


def load_sharded_state_dict(module: _ShardedModule, state: Mapping[str, Any]) -> None:
    """Copy the local shards of ``state`` (from :func:`sharded_state_dict`, filled by DCP's ``load``) into the
    kernels. A no-op for shards that are still views of the kernel storage (DCP loaded in place).

    Raises:
        ShardingPlanError: a table of this rank is missing from ``state`` or has another local shape.
    """
    tables = module.layout.tables
    with torch.no_grad():
        for shard, weight, momentum in module._local_shards():
            name = tables[shard.table].name
            targets: list[tuple[str, Tensor]] = [(f"{name}.weight", weight)]
            if momentum is not None:
                targets.append((f"{name}.momentum", momentum))
            for key, target in targets:
                value = state.get(key)
                if not isinstance(value, ShardedTensor):
                    raise ShardingPlanError(f"`state` has no sharded tensor `{key}` for this rank's shard")
                local = value.local_shards()
                if len(local) != 1 or local[0].tensor.numel() != target.numel():
                    got = [tuple(s.tensor.shape) for s in local]
                    raise ShardingPlanError(
                        f"`state[{key!r}]` holds local shards {got}, expected one of {target.numel()} elements"
                    )
                source = local[0].tensor
                if source.data_ptr() != target.data_ptr():
                    target.copy_(source.reshape(target.shape))
