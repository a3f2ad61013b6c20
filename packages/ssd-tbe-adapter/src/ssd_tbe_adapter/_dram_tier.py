"""The host-DRAM tier indexed on the device: rows in (pinned) host memory, their index and metadata on the device.

Between the device cache and the store. The device cache asks it, all on the device and without a sync: which
of a batch's missing rows it holds (:meth:`DramTier.locate`), to move those rows up (:meth:`DramTier.take_up`)
and to keep the rows the device cache evicts (:meth:`DramTier.keep`); rows move by one gather / scatter kernel
each way straight between pinned host memory and the device (:mod:`~ssd_tbe_adapter._row_moves`). Only the
rows it lacks (:meth:`DramTier.read_below`: a store read on the host) and room made when it is full
(:meth:`DramTier.make_room`: the least recently kept rows leave, dirty ones written to the store, after one
wait) involve the host. So with the tier holding the rows a training run touches, a prefetch does no host work
per row and reads nothing back but the device cache's counts.

Exclusive like the other tiers: a row taken up leaves this tier; the store may hold an older copy. Slots
``[0, capacity)`` hold rows, the last slot is a trash slot that masked scatters write to (never valid).

Streams (CUDA): every call runs on the current stream, which the device path orders after the last
assignment (:meth:`~ssd_tbe_adapter._device_path.DevicePath._wait_insert`), so one stream sync makes every
row written here readable on the host (flush, eviction).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from ssd_tbe_adapter._hash_index import HashSlotIndex, new_slot_index
from ssd_tbe_adapter._host_tier import RowTier, TierMetrics, TierRows
from ssd_tbe_adapter._row_moves import StagingBuffers, gather_rows, scatter_rows

__all__ = ["DramTier"]

_NEVER = (1 << 63) - 1  # eviction key of a slot that must not leave


class DramTier:
    """``capacity`` rows in host memory (pinned on CUDA) over ``lower``, indexed on ``device``.

    Args:
        capacity: rows held, ``>= 1``.
        dims: per table, its ``D``.
        lower: the tier below (the store tier).
        device: where the index, the metadata and the row moves run.
    """

    keeps_clean_rows = True

    def __init__(self, capacity: int, dims: Sequence[int], lower: RowTier, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self._cuda = device.type == "cuda"
        self._lower = lower
        self._dmax = max(dims)
        self.width = self._dmax + 1  # a row: weights (padded to D_max), then the row-wise optimizer state
        # Rows in host memory, the trash slot last.
        self.rows = torch.zeros(capacity + 1, self.width, dtype=torch.float32, pin_memory=self._cuda)
        slots = capacity + 1
        self.slot_tables = torch.zeros(slots, dtype=torch.int64, device=device)
        self.slot_ids = torch.zeros(slots, dtype=torch.int64, device=device)
        self.valid = torch.zeros(slots, dtype=torch.bool, device=device)
        self.dirty = torch.zeros(slots, dtype=torch.bool, device=device)
        self.stamp = torch.zeros(slots, dtype=torch.int64, device=device)  # the keep (clock) that brought it
        self._slot_numbers = torch.arange(capacity, device=device)
        self._clock = torch.zeros(
            (), dtype=torch.int64, device=device
        )  # counts keeps (on the device: graphs)
        self._index = new_slot_index(self.valid, self.slot_tables, self.slot_ids)
        self._staging = StagingBuffers(device)
        self._kept = torch.zeros((), dtype=torch.int64, device=device)  # rows kept since the last fold
        self.metrics = TierMetrics()

    @property
    def trash(self) -> int:
        """The slot masked scatters write to (never valid)."""
        return self.capacity

    # ------------------------------------------------------------------ the device cache's calls

    def locate(
        self, tables: torch.Tensor, ids: torch.Tensor, wanted: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of the ``wanted`` pairs held here (``[N]`` int64, ``-1`` where absent or not wanted) and the free
        slots now (0-dim). No sync."""
        slots = self._index.find(tables, ids, self.valid, self.slot_tables, self.slot_ids)
        free = self.capacity - self.valid[: self.capacity].sum()
        return torch.where(wanted, slots, -1), free

    def index_entries(self) -> torch.Tensor | None:
        """The hash index's entry count (0-dim, on the device; see ``HashSlotIndex``), None for a sorted one."""
        return self._index.entries if isinstance(self._index, HashSlotIndex) else None

    def rebuild_index_if_crowded(self, entries: int) -> None:
        """Rebuild the hash index if ``entries`` (its count as last read on the host) passed half of it."""
        if isinstance(self._index, HashSlotIndex):
            self._index.rebuild_if_crowded(entries, self.valid)

    def read_below(self, keys: torch.Tensor, absent: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rows of the ``absent`` keys not held here, read from the tier below (host work; a failing read
        changes nothing), as ``(positions, rows)`` on the device: their positions in ``keys`` (``[A]``) and their
        weights, state and dirty flag (``[A, D_max + 2]``). ``None`` when ``absent`` is 0.

        ``keys``: ``[M, 3]`` int64 on the host: table, id, and the slot :meth:`locate` gave (``-1``: absent)."""
        if not absent:
            return None
        start = time.perf_counter()
        keys_np = keys.numpy()
        at = np.flatnonzero(keys_np[:, 2] < 0)
        positions = self._staging.get("positions", at.shape[0], 1, torch.int64)
        positions.numpy()[:, 0] = at
        rows = self._staging.get("rows", at.shape[0], self._dmax + 2, torch.float32)
        picked = torch.from_numpy(keys_np[at])
        self._lower.take(picked[:, 0].clone(), picked[:, 1].clone(), out=rows)
        self.metrics.seconds += time.perf_counter() - start
        return (
            self._staging.copy_up("positions", positions, self.device)[:, 0],
            self._staging.copy_up("rows", rows, self.device),
        )

    def make_room(self, count: int, keep: torch.Tensor) -> None:
        """Free ``count`` slots (if that many are held): the least recently kept rows other than those in
        ``keep`` (``[M]`` slots, ``-1`` ignored) leave, dirty ones written to the tier below. Syncs once.

        Failure-safe: the tier below is written before any slot is freed, so a failing write changes nothing
        here (the rows stay; the store may hold newer copies of some)."""
        if count <= 0:
            return
        start = time.perf_counter()
        held = torch.zeros_like(self.valid).index_fill_(0, torch.where(keep >= 0, keep, self.trash), True)
        key = torch.where(self.valid & ~held, self.stamp, _NEVER)
        order = torch.argsort(key[: self.capacity])[: min(count, self.capacity)]
        picked = torch.stack(
            [
                order,
                self.slot_tables[order],
                self.slot_ids[order],
                self.dirty[order].long(),
                (key[order] < _NEVER).long(),
            ],
            1,
        ).cpu()  # host sync: the victims (and every row written here so far is readable on the host)
        victims = picked.numpy()  # numpy: host-side picks (torch masks would look data-dependent)
        victims = victims[victims[:, 4] != 0]
        if victims.shape[0] == 0:
            return
        dirty = victims[victims[:, 3] != 0]
        if dirty.shape[0]:
            rows = self._host_rows(*(torch.from_numpy(dirty[:, k].copy()) for k in range(3)))
            self._lower.give(rows)
            self.metrics.written_rows += dirty.shape[0]
        freed = torch.from_numpy(victims[:, 0].copy()).to(self.device)
        self.valid.index_fill_(0, freed, False)
        self.dirty.index_fill_(0, freed, False)
        self.metrics.evicted_rows += victims.shape[0]
        self.metrics.seconds += time.perf_counter() - start

    def take_up(
        self, slots: torch.Tensor, below: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor
    ) -> None:
        """Rows for the device cache into ``out`` (``[M, D_max + 2]`` on the device: weights, state, dirty): those
        in ``slots`` (``[M]``, ``-1`` where absent) from here, which then leave this tier, and ``below``
        (:meth:`read_below`'s) at its positions. No sync, no host work."""
        found = slots >= 0
        rows = out[:, : self.width]
        gather_rows(self.rows, slots, rows)
        out[:, self.width] = torch.where(found, self.dirty.index_select(0, slots.clamp(min=0)), False)
        if below is not None:
            positions, read = below
            out.index_copy_(0, positions, read)
        gone = torch.where(found, slots, self.trash)
        self.valid.index_fill_(0, gone, False)
        self.dirty.index_fill_(0, gone, False)

    def count_taken(self, *, asked: int, found: int) -> None:
        """Count a take: ``asked`` rows, ``found`` of them here (host counts: :meth:`take_up` may be replayed)."""
        self.metrics.lookups += asked
        self.metrics.hits += found
        self.metrics.rows_out += found
        self.metrics.bytes_out += found * self.width * 4

    def keep(
        self,
        tables: torch.Tensor,
        ids: torch.Tensor,
        rows: torch.Tensor,
        dirty: torch.Tensor,
        occupied: torch.Tensor,
    ) -> None:
        """Hold the ``occupied`` rows of ``[M]`` victims (``rows`` ``[M, D_max + 1]`` on the device) in free slots
        (the caller made room: at least as many free slots as occupied victims). No sync, no host work."""
        m = occupied.numel()
        if m == 0:
            return
        free = ~self.valid[: self.capacity]
        rank = torch.cumsum(free, 0) - 1
        free_list = torch.full((m + 1,), self.trash, dtype=torch.int64, device=self.device).index_copy_(
            0, torch.where(free & (rank < m), rank, m), self._slot_numbers
        )
        order = (torch.cumsum(occupied, 0) - 1).clamp_(min=0)
        target = torch.where(occupied, free_list.index_select(0, order), self.trash)
        scatter_rows(rows, target, self.rows)
        self._clock += 1  # in place: a graph replaying this reads and bumps the same tensor
        self.slot_tables.index_copy_(0, target, tables)
        self.slot_ids.index_copy_(0, target, ids)
        self.valid.index_copy_(0, target, occupied)
        self.dirty.index_copy_(0, target, dirty & occupied)
        self.stamp.index_copy_(
            0, target, self._clock.expand(m)
        )  # not index_fill_: it reads the value on the host
        self._index.set_keys(target, tables, ids)
        self._index.merge(self.valid, target)
        self._kept += occupied.sum()

    # ------------------------------------------------------------------ the rest of a tier

    def load(self, tables: torch.Tensor, ids: torch.Tensor) -> None:
        """Read rows (host int64, absent here and from every tier above) from the tier below into this tier
        (warm start); the first ones are left out when they are more than the capacity."""
        k = ids.numel()
        if k > self.capacity:
            tables, ids, k = tables[k - self.capacity :], ids[k - self.capacity :], self.capacity
        free = self.capacity - int(self.valid[: self.capacity].sum())  # host sync: warm start only
        self.make_room(k - free, torch.full((1,), -1, dtype=torch.int64, device=self.device))
        rows = self._lower.take(tables, ids)
        weights = torch.cat([rows.weights, rows.state[:, None]], 1).to(self.device)
        everything = torch.ones(k, dtype=torch.bool, device=self.device)
        self.keep(
            tables.to(self.device), ids.to(self.device), weights, rows.dirty.to(self.device), everything
        )

    def persist(self, rows: TierRows) -> None:
        """Straight to the store."""
        self._lower.persist(rows)

    def flush(self) -> None:
        """Write every dirty row held here to the store; they stay, clean."""
        slots = self.dirty.nonzero().flatten()  # host sync: flush only
        if slots.numel():
            host = torch.stack([slots, self.slot_tables[slots], self.slot_ids[slots]], 1).cpu()
            self._lower.persist(self._host_rows(host[:, 0], host[:, 1], host[:, 2]))
            self.dirty.index_fill_(0, slots, False)
            self.metrics.written_rows += int(slots.numel())
        self._lower.flush()

    def clear(self) -> None:
        """Forget every row."""
        self.valid.zero_()
        self.dirty.zero_()
        self.stamp.zero_()
        self._index.rebuild(self.valid)
        self._lower.clear()

    def cached_rows(self) -> int:
        """Rows held now (host sync: metrics only)."""
        return int(self.valid.sum())

    def summary(self) -> dict[str, float]:
        """``host_tier_*`` counters plus ``host_tier_cached_rows`` (a host sync: metrics), and the lower tier's."""
        kept = int(self._kept)
        self._kept.zero_()
        self.metrics.rows_in += kept
        self.metrics.bytes_in += kept * self.width * 4
        out = self.metrics.summary("host_tier")
        out["host_tier_cached_rows"] = float(self.cached_rows())
        out.update(self._lower.summary())
        return out

    def reset_metrics(self) -> None:
        """Zero the counters here and below."""
        self._kept.zero_()
        self.metrics = TierMetrics()
        self._lower.reset_metrics()

    def _host_rows(self, slots: torch.Tensor, tables: torch.Tensor, ids: torch.Tensor) -> TierRows:
        """The rows in ``slots`` (host int64) read on the host, marked dirty (after a sync of the current
        stream: the rows written here are in host memory)."""
        rows = self.rows.index_select(0, slots)
        return TierRows(
            tables=tables,
            ids=ids,
            weights=rows[:, : self._dmax],
            state=rows[:, self._dmax],
            dirty=torch.ones(slots.numel(), dtype=torch.bool),
        )
