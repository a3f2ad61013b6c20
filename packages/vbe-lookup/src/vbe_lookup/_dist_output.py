"""Output distribution: send each source rank its block of the lookup output and assemble it there.

The owner's lookup output is 1-D, source rank → kernel group → feature → sample (or id) → dim, so the
block of every source rank is contiguous: one ``all_to_all_single`` with explicit splits returns every
block to its source, and its backward sends the gradient blocks back to the owners (whose fused
optimizers then update their rows). On the source, one cached-index ``index_add`` places pooled blocks
into ``[B, sum(dims)]`` (adding the partial sums of row-wise shards); on CPU, when every feature has one
owner (table-wise), that placement is a permutation: one gather forward and one gather backward (no zeroed
output, no scatter-add). Sequence blocks are gathered back into the original id order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from vbe_lookup._dist_comm import Communicator
from vbe_lookup._dist_input import DistributedFeatures, SourceContext
from vbe_lookup._sharding_plan import ShardingLayout
from vbe_lookup.errors import BatchLayoutError

__all__ = ["OutputDistBase", "PooledOutputDist", "SequenceOutputDist"]

_MAX_CACHE = 64


class OutputDistBase:
    def __init__(self, layout: ShardingLayout, comm: Communicator) -> None:
        self.layout = layout
        self.comm = comm
        self.world = layout.world_size
        self.rank = comm.rank
        self.s_max = max(1, *(len(r.slots) for r in layout.ranks))
        self.feature_dims = [layout.tables[t].embedding_dim for t in layout.feature_table]
        self.feature_index = {f: i for i, f in enumerate(layout.features)}
        self._inverse_key_cache: dict[tuple[str, ...], Tensor] = {}
        # Run while the host waits for the exchange (``Communicator.all_to_all``); set by the sharded module's
        # ``set_output_dist_overlap``.
        self.while_in_flight: Callable[[], None] | None = None

    def inverse_keys(self, src: SourceContext) -> Tensor:
        """``[F_global]`` position in the source's input keys of every module feature (cached per key order)."""
        keys = src.keys
        cached = self._inverse_key_cache.get(keys)
        if cached is None:
            if len(self._inverse_key_cache) >= _MAX_CACHE:
                self._inverse_key_cache.clear()
            position = {k: i for i, k in enumerate(keys)}
            cached = torch.tensor(
                [position[f] for f in self.layout.features], dtype=torch.int64, device=self.comm.device
            )
            self._inverse_key_cache[keys] = cached
        return cached

    def _exchange(
        self,
        lookup_out: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        anchor: Tensor | None,
        what: str,
    ) -> Tensor:
        if lookup_out.numel() != sum(in_splits):
            raise BatchLayoutError(
                f"rank {self.rank}: the lookup returned {lookup_out.numel()} elements but the distributed "
                f"batch needs {sum(in_splits)} ({in_splits} per source rank)"
            )
        flat = lookup_out if lookup_out.dim() == 1 else lookup_out.reshape(-1)  # no view node when 1-D
        return self.comm.all_to_all_autograd(flat, out_splits, in_splits, what, anchor, self.while_in_flight)


class PooledOutputDist(OutputDistBase):
    """Pooled output dist: owners' ``[source, slot, sample, dim]`` blocks → ``[B, sum(dims)]`` per source."""

    def __init__(self, layout: ShardingLayout, comm: Communicator) -> None:
        super().__init__(layout, comm)
        self.dim_per_rank = [sum(r.slot_dims) for r in layout.ranks]
        self.col_offset = [0]
        for d in self.feature_dims:
            self.col_offset.append(self.col_offset[-1] + d)
        self.total_dim = self.col_offset[-1]
        mean = [layout.tables[layout.feature_table[f]].pooling == "mean" for f in range(len(layout.features))]
        self.has_mean = any(mean)
        col_feature = torch.cat(
            [torch.full((d,), f, dtype=torch.int64) for f, d in enumerate(self.feature_dims)]
        )
        self._col_feature = col_feature.to(comm.device)
        self._col_mean = torch.tensor(mean, dtype=torch.bool)[col_feature].to(comm.device)
        self._target_cache: dict[int, Tensor] = {}
        # Every feature in one shard: each output element comes from one received element (a permutation).
        # CPU only (a gather instead of a zeroed output and a scatter-add, measured there).
        self._permutation = comm.device.type == "cpu" and all(
            len(layout.shards[t]) == 1 for t in layout.feature_table
        )
        self._inverse_cache: dict[int, Tensor] = {}
        # Segments of the received buffer, one per (owner rank, slot) in receive order: first column in the
        # output and width. _target expands them for any batch size with a few device ops (no host loop).
        seg_col = [self.col_offset[slot.feature] for rl in layout.ranks for slot in rl.slots]
        seg_dim = [dim for rl in layout.ranks for dim in rl.slot_dims]
        self._seg_col = torch.tensor(seg_col, dtype=torch.int64).to(comm.device)
        self._seg_dim = torch.tensor(seg_dim, dtype=torch.int64).to(comm.device)
        self._seg_width = sum(seg_dim)
        # A group of one: the output column of each column of its lookup's [B, sum(dims)] block (slot order);
        # `None` when the slot order is the feature order (the block is the output).
        self._alone_columns: Tensor | None = None
        if self.world == 1:
            columns = [
                self.col_offset[slot.feature] + k
                for slot in layout.ranks[0].slots
                for k in range(self.feature_dims[slot.feature])
            ]
            if columns != list(range(self.total_dim)):
                inverse = [0] * self.total_dim
                for j, c in enumerate(columns):
                    inverse[c] = j
                self._alone_columns = torch.tensor(inverse, dtype=torch.int64).to(comm.device)

    def __call__(self, lookup_out: Tensor, dist: DistributedFeatures, anchor: Tensor | None) -> Tensor:
        """Return ``[B, sum(dims)]`` pooled embeddings of the local batch, keys in global feature order."""
        batch = dist.source.batch_size
        in_splits = [b * self.dim_per_rank[self.rank] for b in dist.batch_size_per_rank]
        out_splits = [batch * self.dim_per_rank[d] for d in range(self.world)]
        recv = self._exchange(lookup_out, out_splits, in_splits, anchor, "pooled output dist")
        out: Tensor
        if self._permutation:
            target, inverse = self._target(batch), self._inverse(batch)
            out = _Permute.apply(recv, inverse, target)  # type: ignore[no-untyped-call]  # Function.apply is untyped
        else:
            out = recv.new_zeros(batch * self.total_dim).index_add(0, self._target(batch), recv)
        return self._mean(out.view(batch, self.total_dim), dist)

    def from_batch_major(self, block: Tensor, dist: DistributedFeatures, anchor: Tensor | None) -> Tensor:
        """``[B, sum(dims)]`` pooled embeddings of a group of one from its lookup's own ``[B, sum(dims)]`` block
        (columns in slot order, ``GroupedVBELookup._batch_major``): nothing to exchange or to place per sample,
        only the columns put in the module's feature order (none moved when the orders agree) and mean pooling.
        """
        batch = dist.source.batch_size
        if tuple(block.shape) != (batch, self.total_dim):
            raise BatchLayoutError(
                f"rank {self.rank}: the lookup returned a block of shape {tuple(block.shape)} but the local batch "
                f"needs ({batch}, {self.total_dim})"
            )
        # A group of one: the block itself, kept in the graph under grad mode (an empty batch too).
        out = self.comm.all_to_all_autograd(
            block, [block.shape[0]], [block.shape[0]], "pooled output dist", anchor
        )
        if self._alone_columns is not None:
            out = out.index_select(1, self._alone_columns)
        return self._mean(out, dist)

    def _mean(self, out: Tensor, dist: DistributedFeatures) -> Tensor:
        """``out`` ``[B, sum(dims)]`` with the columns of mean-pooled features divided by their bags' lengths."""
        batch = out.shape[0]
        if self.has_mean and batch:
            src = dist.source
            lengths = src.lengths.view(len(src.keys), batch).index_select(0, self.inverse_keys(src))
            # Mean pooling of the whole bag: the (partial) sums divided by the bag's length (empty: 0).
            inv = lengths.t().to(out.dtype).clamp(min=1).reciprocal()  # [B, F]
            scale = torch.where(
                self._col_mean, inv[:, self._col_feature], torch.ones((), dtype=out.dtype, device=out.device)
            )
            out = out * scale
        return out

    def _target(self, batch: int) -> Tensor:
        """Flat position in ``[B, sum(dims)]`` of every element received (owner → slot → sample → dim)."""
        cached = self._target_cache.get(batch)
        if cached is None:
            if len(self._target_cache) >= _MAX_CACHE:
                self._target_cache.clear()
            # Segment s holds batch * dim_s elements, sample-major: element t of it is sample t // dim_s,
            # column seg_col[s] + t % dim_s of the [B, sum(dims)] output.
            sizes = self._seg_dim * batch
            total = batch * self._seg_width
            segment = torch.repeat_interleave(
                torch.arange(sizes.numel(), device=sizes.device), sizes, output_size=total
            )
            first = torch.cumsum(sizes, 0) - sizes
            within = torch.arange(total, device=sizes.device) - first[segment]
            dim = self._seg_dim[segment]
            sample = torch.div(within, dim, rounding_mode="floor")
            cached = sample * self.total_dim + self._seg_col[segment] + (within - sample * dim)
            self._target_cache[batch] = cached
        return cached

    def _inverse(self, batch: int) -> Tensor:
        """Position in the received buffer of every element of ``[B, sum(dims)]`` (``_permutation`` only)."""
        cached = self._inverse_cache.get(batch)
        if cached is None:
            if len(self._inverse_cache) >= _MAX_CACHE:
                self._inverse_cache.clear()
            target = self._target(batch)
            cached = torch.empty_like(target)
            cached[target] = torch.arange(target.numel(), device=target.device)
            self._inverse_cache[batch] = cached
        return cached


class _Permute(torch.autograd.Function):
    """``out = x[inverse]`` for a permutation (``inverse[target] = arange``); backward ``grad[target]``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, inverse: Tensor, target: Tensor) -> Tensor:
        ctx.save_for_backward(target)
        return x.index_select(0, inverse)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (target,) = ctx.saved_tensors
        return grad.index_select(0, target), None, None


class SequenceOutputDist(OutputDistBase):
    """Sequence output dist: one embedding per id, returned to the id's original position."""

    def __init__(self, layout: ShardingLayout, comm: Communicator) -> None:
        super().__init__(layout, comm)
        seg_dim = [0] * (self.world * self.s_max)
        for d, rl in enumerate(layout.ranks):
            for j, dim in enumerate(rl.slot_dims):
                seg_dim[d * self.s_max + j] = dim
        self._seg_dim = torch.tensor(seg_dim, dtype=torch.int64).to(comm.device)

    def __call__(self, lookup_out: Tensor, dist: DistributedFeatures, anchor: Tensor | None) -> list[Tensor]:
        """Return, per global feature, ``[ids of the feature in the local batch, dim]`` in input order."""
        src = dist.source
        my_dims = self.layout.ranks[self.rank].slot_dims
        counts = dist.ids_per_slot_per_rank  # [S][W]
        in_splits = [sum(counts[j][s] * my_dims[j] for j in range(len(my_dims))) for s in range(self.world)]
        out_splits = [
            sum(n * dim for n, dim in zip(src.sent[d], self.layout.ranks[d].slot_dims, strict=True))
            for d in range(self.world)
        ]
        recv = self._exchange(lookup_out, out_splits, in_splits, anchor, "sequence output dist")

        # Per padded segment (rank * S_max + slot): where it starts in the send order and in the received
        # buffer, from the device-side counts sent (no host lists, no host-to-device copy).
        dev = recv.device
        sent_counts = src.sent_counts
        elems = sent_counts * self._seg_dim
        send_start = torch.cumsum(sent_counts, 0) - sent_counts
        recv_start = torch.cumsum(elems, 0) - elems
        s, inverse_perm = src.sorted_segment, src.inverse_perm
        # A sequence module's input dist keeps the ids' order.
        assert s is not None
        assert inverse_perm is not None
        q = torch.arange(s.numel(), device=dev)
        base = recv_start[s] + (q - send_start[s]) * self._seg_dim[s]  # [N] element offset of each sent id
        base = base[inverse_perm]  # original id order (input key → sample → id)

        out: list[Tensor] = [recv] * len(self.layout.features)  # every entry is replaced below
        start = 0
        for key in src.keys:
            f = self.feature_index[key]
            n = src.ids_per_feature[f]
            index = base[start : start + n, None] + torch.arange(self.feature_dims[f], device=dev)
            out[f] = recv[index]
            start += n
        return out
