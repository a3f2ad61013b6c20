"""The tiers below the device cache: a host-DRAM row cache (:class:`HostTier`) over the key-value store
(:class:`StoreTier`), both behind one narrow interface (:class:`RowTier`).

Rows cross these tiers as :class:`TierRows`: ``(table, id)`` keys, float32 weights padded to the widest table
(``D_max`` columns; columns past the table's ``D`` are zero), one float32 optimizer state per row (0 for
SGD) and a dirty flag (the row is newer than the store). The tiers are *exclusive*: a row lives in exactly
one of device cache, host tier or store at a time (the store may also hold an older copy), so taking a row
from a tier removes it there and no two copies can both be updated.

Not thread-safe: the device path calls them from the thread running prefetch/forward.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from ssd_tbe_adapter._records import RecordLayout
from ssd_tbe_adapter._tier import CacheTier
from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = ["HostTier", "RowTier", "StoreTier", "TierMetrics", "TierRows", "rows_into"]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TierRows:
    """Rows moving between tiers, all on the host (pinned when the module is on CUDA).

    Args:
        tables: ``[K]`` int64 table numbers.
        ids: ``[K]`` int64 ids (``(table, id)`` unique).
        weights: ``[K, D_max]`` float32 (zero past each table's ``D``).
        state: ``[K]`` float32 row-wise optimizer state.
        dirty: ``[K]`` bool, newer than the store.
    """

    tables: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    state: torch.Tensor
    dirty: torch.Tensor

    def __post_init__(self) -> None:
        k = self.ids.shape[0]
        shapes = (self.tables.shape, self.weights.shape[:1], self.state.shape, self.dirty.shape)
        if any(tuple(shape) != (k,) for shape in shapes):
            raise InvalidArgumentError(f"TierRows fields disagree on the row count: ids {k}, others {shapes}")

    def select(self, index: torch.Tensor) -> TierRows:
        """The rows at ``index`` (host int64 positions or a bool mask)."""
        return TierRows(
            tables=self.tables[index],
            ids=self.ids[index],
            weights=self.weights[index],
            state=self.state[index],
            dirty=self.dirty[index],
        )


@dataclass(slots=True)
class TierMetrics:
    """Counters of one tier since construction or the last reset."""

    lookups: int = 0  # rows asked for
    hits: int = 0  # rows found here
    rows_in: int = 0  # rows handed down into this tier
    rows_out: int = 0  # rows taken up from this tier
    evicted_rows: int = 0  # rows this tier pushed down to its lower tier
    written_rows: int = 0  # dirty rows written to the store (store tier: rows put)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0  # wall time inside this tier's own calls (lower tiers included)

    def summary(self, prefix: str) -> dict[str, float]:
        """Every counter as ``<prefix>_<name>`` plus ``<prefix>_hit_rate``."""
        out = {f"{prefix}_{name}": float(getattr(self, name)) for name in self.__slots__}
        out[f"{prefix}_hit_rate"] = self.hits / self.lookups if self.lookups else 0.0
        return out


class RowTier(Protocol):
    """What the device cache asks of the tier below it."""

    keeps_clean_rows: bool
    """Whether handing down clean rows is useful (a cache); the store only wants dirty rows."""

    def take(self, tables: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> TierRows:
        """The rows of ``(tables[i], ids[i])`` (host int64, unique pairs), in that order; removes them here.

        ``out`` (optional ``[K, D_max + 2]`` float32 host buffer, e.g. the device cache's pinned staging): the
        rows are written into it (weights, state, dirty as 0/1) and the returned weights / state are views of
        it, so the caller need not copy them again."""
        ...

    def give(self, rows: TierRows) -> None:
        """Hand rows down (this tier keeps what it can, pushes the rest down; clean rows may be dropped)."""
        ...

    def persist(self, rows: TierRows) -> None:
        """Write dirty rows that stay cached above straight to the store (``flush``)."""
        ...

    def flush(self) -> None:
        """Write every dirty row this tier holds to the store (they stay here, clean)."""
        ...

    def clear(self) -> None:
        """Forget every row (after :meth:`flush`; checkpoint restore)."""
        ...

    def summary(self) -> dict[str, float]:
        """Counters of this tier and the tiers below."""
        ...

    def reset_metrics(self) -> None:
        """Zero the counters of this tier and the tiers below."""
        ...


def _table_runs(tables: torch.Tensor, count: int) -> list[tuple[int, torch.Tensor]]:
    """Per table present in ``tables`` (host int64), the positions of its rows (one pass, no per-row Python)."""
    if tables.numel() == 0:
        return []
    order = torch.argsort(tables, stable=True)
    counts = torch.bincount(tables, minlength=count).tolist()
    runs = []
    start = 0
    for table, n in enumerate(counts):
        if n:
            runs.append((table, order[start : start + n]))
            start += n
    return runs


def rows_into(rows: TierRows, out: torch.Tensor | None) -> TierRows:
    """``rows`` as written into ``out`` (see :meth:`RowTier.take`), or unchanged when ``out`` is ``None``."""
    if out is None:
        return rows
    dmax = out.shape[1] - 2
    out[:, :dmax] = rows.weights
    out[:, dmax] = rows.state
    out[:, dmax + 1] = rows.dirty
    return replace(rows, weights=out[:, :dmax], state=out[:, dmax])


class StoreTier:
    """The key-value store as a tier: reads initialise absent rows; writes encode the records.

    Store calls go through the module's :class:`~ssd_tbe_adapter._tier.CacheTier` (its record reads with
    first-touch initialisation, its writes and store counters), under its lock.

    Args:
        tier: the module's cache tier (store, record layout, initialisation).
        dims: per table, its ``D``.
        pin: unused (rows come back in pageable memory: the device cache copies them through its own reused
            pinned buffer, so no call allocates pinned memory).
    """

    keeps_clean_rows = False

    def __init__(self, tier: CacheTier, dims: Sequence[int], pin: bool) -> None:
        self._tier = tier
        self._layout: RecordLayout = tier.layout
        self._dims = list(dims)
        self._dmax = max(self._dims)
        self._pin = pin
        self.metrics = TierMetrics()

    def take(self, tables: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> TierRows:
        """Rows from the store, initialised where absent (clean); written straight into ``out`` if given."""
        start = time.perf_counter()
        k = ids.numel()
        if out is None:
            weights = torch.zeros(k, self._dmax, dtype=torch.float32)
            state = torch.zeros(k, dtype=torch.float32)
        else:
            out.zero_()  # the padding past each table's D, and clean rows
            weights, state = out[:, : self._dmax], out[:, self._dmax]
        weights_np, state_np = weights.numpy(), state.numpy()  # numpy: faster row scatters on the host
        for table, positions in _table_runs(tables, len(self._dims)):
            w, s = self._tier.read_rows(table, ids.index_select(0, positions))
            at = positions.numpy()
            weights_np[at, : self._dims[table]] = w.to(torch.float32).numpy()
            if s.shape[1]:
                state_np[at] = s[:, 0].to(torch.float32).numpy()
        self.metrics.lookups += k
        self.metrics.hits += k
        self.metrics.rows_out += k
        self.metrics.bytes_out += k * (self._dmax + 1) * 4
        self.metrics.seconds += time.perf_counter() - start
        return TierRows(
            tables=tables, ids=ids, weights=weights, state=state, dirty=torch.zeros(k, dtype=torch.bool)
        )

    def give(self, rows: TierRows) -> None:
        """Write the dirty rows to the store (clean ones are already there)."""
        self.persist(rows.select(rows.dirty) if not bool(rows.dirty.all()) else rows)

    def persist(self, rows: TierRows) -> None:
        """Write ``rows`` to the store, one batch per table."""
        if rows.ids.numel() == 0:
            return
        start = time.perf_counter()
        with self._tier.lock:
            all_weights, all_state = rows.weights.numpy(), rows.state.numpy()
            for table, positions in _table_runs(rows.tables, len(self._dims)):
                at = positions.numpy()
                weights = torch.from_numpy(all_weights[at, : self._dims[table]])
                state = torch.from_numpy(all_state[at])[:, None]
                records = self._layout.encode(
                    table,
                    weights.to(self._layout.weight_dtype),
                    state if self._layout.state_width else state[:, :0],
                )
                self._tier.store_put(table, rows.ids.index_select(0, positions).contiguous(), records)
        n = rows.ids.numel()
        self.metrics.rows_in += n
        self.metrics.written_rows += n
        self.metrics.bytes_in += n * (self._dmax + 1) * 4
        self.metrics.seconds += time.perf_counter() - start

    def flush(self) -> None:
        """Nothing: the store holds no dirty rows of its own (the module flushes the store itself)."""

    def clear(self) -> None:
        """Nothing to forget."""

    def summary(self) -> dict[str, float]:
        """The store tier's counters (``store_tier_*``)."""
        return self.metrics.summary("store_tier")

    def reset_metrics(self) -> None:
        """Zero the counters."""
        self.metrics = TierMetrics()


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_EMPTY, _REMOVED = -1, -2


class _HashIndex:
    """``(table, id) -> slot`` of the host tier: open addressing with linear probing over at least 4x the
    capacity, each batch of keys probed together (numpy, one pass per probe step), so a batch costs time in
    proportion to its size, never to the capacity. Removal leaves a tombstone; the table is rebuilt once live
    entries and tombstones fill half of it, i.e. after at least a quarter of it was removed (amortised O(1)).

    Entries hold only the slot; the keys are the tier's own ``slot_tables`` / ``slot_ids`` arrays (a slot's
    entry is removed before the slot is reused).
    """

    def __init__(
        self,
        capacity: int,
        slot_tables: np.ndarray[Any, np.dtype[np.int64]],
        slot_ids: np.ndarray[Any, np.dtype[np.int64]],
    ) -> None:
        size = 1 << max(4, (4 * capacity - 1).bit_length())
        self._mask = np.uint64(size - 1)
        self._entries = np.full(size, _EMPTY, dtype=np.int64)
        self._tables, self._ids = slot_tables, slot_ids
        self._used = 0  # live entries plus tombstones

    def _home(
        self, tables: np.ndarray[Any, np.dtype[np.int64]], ids: np.ndarray[Any, np.dtype[np.int64]]
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        x = ids.astype(np.uint64) ^ (tables.astype(np.uint64) * _MIX[0])
        x = (x ^ (x >> np.uint64(30))) * _MIX[1]
        x = (x ^ (x >> np.uint64(27))) * _MIX[2]
        home: np.ndarray[Any, np.dtype[np.int64]] = ((x ^ (x >> np.uint64(31))) & self._mask).astype(np.int64)
        return home

    def find(
        self, tables: np.ndarray[Any, np.dtype[np.int64]], ids: np.ndarray[Any, np.dtype[np.int64]]
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """Slots of the keys (``-1`` where absent) and their entries' positions (for :meth:`remove`)."""
        k = ids.shape[0]
        slots = np.full(k, -1, dtype=np.int64)
        where = np.zeros(k, dtype=np.int64)
        active = np.arange(k)
        position = self._home(tables, ids)
        mask = int(self._mask)
        while active.shape[0]:
            entry = self._entries[position]
            held = entry >= 0
            slot = np.where(held, entry, 0)
            match = held & (self._tables[slot] == tables[active]) & (self._ids[slot] == ids[active])
            slots[active[match]] = entry[match]
            where[active[match]] = position[match]
            going = ~match & (entry != _EMPTY)
            active, position = active[going], (position[going] + 1) & mask
        return slots, where

    def remove(self, positions: np.ndarray[Any, np.dtype[np.int64]]) -> None:
        """Forget the entries at ``positions`` (from :meth:`find`, distinct)."""
        self._entries[positions] = _REMOVED

    def add(
        self,
        tables: np.ndarray[Any, np.dtype[np.int64]],
        ids: np.ndarray[Any, np.dtype[np.int64]],
        slots: np.ndarray[Any, np.dtype[np.int64]],
    ) -> None:
        """Add absent, distinct keys at ``slots``."""
        if ids.shape[0] == 0:
            return
        if self._used + ids.shape[0] > self._entries.shape[0] // 2:
            live = self._entries[self._entries >= 0]
            self._entries.fill(_EMPTY)
            self._used = 0
            self._insert(self._tables[live], self._ids[live], live)
        self._insert(tables, ids, slots)

    def _insert(
        self,
        tables: np.ndarray[Any, np.dtype[np.int64]],
        ids: np.ndarray[Any, np.dtype[np.int64]],
        slots: np.ndarray[Any, np.dtype[np.int64]],
    ) -> None:
        pending = np.arange(ids.shape[0])
        position = self._home(tables, ids)
        mask = int(self._mask)
        while pending.shape[0]:
            free = np.flatnonzero(self._entries[position] < 0)
            # One key per free position this round; the others probe on.
            taken, first = np.unique(position[free], return_index=True)
            winners = free[first]
            self._used += int((self._entries[taken] == _EMPTY).sum())
            self._entries[taken] = slots[pending[winners]]
            going = np.ones(pending.shape[0], dtype=np.bool_)
            going[winners] = False
            pending, position = pending[going], (position[going] + 1) & mask


class HostTier:
    """``capacity`` rows in host memory (pinned on CUDA) between the device cache and ``lower``, LRU eviction.

    Rows handed down (``give``) are kept, dirty or clean (a victim cache of the device cache); when it is
    full the least recently given rows leave, dirty ones written to the store. ``take`` moves rows up and
    asks ``lower`` for the rest. Host work per call is proportional to its rows, not to the capacity: a hash
    index (:class:`_HashIndex`), a stack of free slots and a queue of the slots in the order given (victims
    are popped from its head, skipping slots taken since; compacted when it outgrows twice the capacity).

    Args:
        capacity: rows held, ``>= 1``.
        dims: per table, its ``D``.
        lower: the tier below (the store tier).
        pin: unused: rows reach the device through the device cache's reused pinned buffers, so this tier's
            buffer is ordinary host memory.
    """

    keeps_clean_rows = True

    def __init__(self, capacity: int, dims: Sequence[int], lower: RowTier, pin: bool) -> None:
        del pin
        self.capacity = capacity
        self._dims = list(dims)
        self._dmax = max(self._dims)
        self._lower = lower
        self.weights = torch.zeros(capacity, self._dmax, dtype=torch.float32)
        self.state = torch.zeros(capacity, dtype=torch.float32)
        # numpy views of the same memory: numpy's row gathers/scatters are 2-4x faster than torch's on the CPU
        self._weights_np, self._state_np = self.weights.numpy(), self.state.numpy()
        self.slot_tables = np.zeros(capacity, dtype=np.int64)
        self.slot_ids = np.zeros(capacity, dtype=np.int64)
        self.valid = np.zeros(capacity, dtype=np.bool_)
        self.dirty = np.zeros(capacity, dtype=np.bool_)
        self.stamp = np.zeros(capacity, dtype=np.int64)  # the give (clock) that brought the row
        self._clock = 0
        self._reset_slots()
        self.metrics = TierMetrics()

    def _reset_slots(self) -> None:
        self._index = _HashIndex(self.capacity, self.slot_tables, self.slot_ids)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack: pop from the end
        self._free_count = self.capacity
        # Slots in the order given, one (slots, stamps) chunk per give, oldest first; an entry is live while
        # its slot is valid with that stamp.
        self._queue: deque[tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]]
        self._queue = deque()
        self._queue_len = 0

    @property
    def cached_rows(self) -> int:
        """Rows held now."""
        return self.capacity - self._free_count

    def _push_free(self, slots: np.ndarray[Any, np.dtype[np.int64]]) -> None:
        self._free[self._free_count : self._free_count + slots.shape[0]] = slots
        self._free_count += slots.shape[0]

    def _pop_free(self, count: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        self._free_count -= count
        slots: np.ndarray[Any, np.dtype[np.int64]] = self._free[
            self._free_count : self._free_count + count
        ].copy()
        return slots

    def _fill(
        self,
        weights_np: np.ndarray[Any, Any],
        state_np: np.ndarray[Any, Any],
        dirty_np: np.ndarray[Any, Any],
        slots: np.ndarray[Any, Any],
        found: np.ndarray[Any, Any],
        missing: np.ndarray[Any, Any],
        below: TierRows | None,
    ) -> None:
        """Rows asked for, in order, into the given arrays: those held here from their slots, the rest from
        the rows the tier below returned."""
        if found.any():
            hit_pos, held = np.flatnonzero(found), slots[found]
            weights_np[hit_pos] = self._weights_np[held]
            state_np[hit_pos] = self._state_np[held]
            dirty_np[hit_pos] = self.dirty[held]
        if below is not None:
            weights_np[missing] = below.weights.numpy()
            state_np[missing] = below.state.numpy()
            dirty_np[missing] = below.dirty.numpy()

    def take(self, tables: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> TierRows:
        """Rows from here where held (removed here), the rest from ``lower``; in the order asked (written
        straight into ``out`` if given: one gather, no second copy)."""
        start = time.perf_counter()
        k = ids.numel()
        slots, at = self._index.find(tables.numpy(), ids.numpy())
        found = slots >= 0
        n_found = int(found.sum())
        missing = np.flatnonzero(~found)
        # Read the rest first: a failing store read leaves this tier unchanged.
        below = self._lower.take(tables[missing], ids[missing]) if missing.shape[0] else None
        if out is not None:
            out_np = out.numpy()
            weights_np, state_np = out_np[:, : self._dmax], out_np[:, self._dmax]
            dirty_np = np.zeros(k, dtype=np.bool_)
            if n_found == k:  # every row here (the DRAM tier's steady state): one gather into `out`
                np.take(self._weights_np, slots, axis=0, out=weights_np, mode="clip")
                np.take(self._state_np, slots, out=state_np, mode="clip")
                dirty_np[:] = self.dirty[slots]
            else:
                self._fill(weights_np, state_np, dirty_np, slots, found, missing, below)
            out_np[:, self._dmax + 1] = dirty_np
        elif n_found == k:  # every row here (the DRAM tier's steady state): one gather
            weights_np, state_np, dirty_np = self._weights_np[slots], self._state_np[slots], self.dirty[slots]
        else:
            weights_np = np.empty((k, self._dmax), dtype=np.float32)
            state_np = np.empty(k, dtype=np.float32)
            dirty_np = np.zeros(k, dtype=np.bool_)
            self._fill(weights_np, state_np, dirty_np, slots, found, missing, below)
        if out is not None:
            weights, state = out[:, : self._dmax], out[:, self._dmax]
        else:
            weights, state = torch.from_numpy(weights_np), torch.from_numpy(state_np)
        dirty = torch.from_numpy(dirty_np)
        if n_found:
            held = slots[found]
            self.valid[held] = False
            self.dirty[held] = False
            self._index.remove(at[found])
            self._push_free(held)
        self.metrics.lookups += k
        self.metrics.hits += n_found
        self.metrics.rows_out += n_found
        self.metrics.bytes_out += n_found * (self._dmax + 1) * 4
        self.metrics.seconds += time.perf_counter() - start
        return TierRows(tables=tables, ids=ids, weights=weights, state=state, dirty=dirty)

    def give(self, rows: TierRows) -> None:
        """Keep ``rows`` (absent here); the least recently given rows make room, dirty ones go to ``lower``."""
        k = rows.ids.numel()
        if k == 0:
            return
        start = time.perf_counter()
        if k > self.capacity:  # the first rows would be pushed out by the last ones at once
            self._lower.give(rows.select(torch.arange(k - self.capacity)))
            rows = rows.select(torch.arange(k - self.capacity, k))
            k = self.capacity
        need = k - self._free_count
        if need > 0:
            self._evict(self._oldest(need))
        free = self._pop_free(k)
        self._clock += 1
        self._weights_np[free] = rows.weights.numpy()
        self._state_np[free] = rows.state.numpy()
        tables_np, ids_np = rows.tables.numpy(), rows.ids.numpy()
        self.slot_tables[free] = tables_np
        self.slot_ids[free] = ids_np
        self.valid[free] = True
        self.dirty[free] = rows.dirty.numpy()
        self.stamp[free] = self._clock
        self._index.add(tables_np, ids_np, free)
        self._queue.append((free, np.full(k, self._clock, dtype=np.int64)))
        self._queue_len += k
        if self._queue_len > 2 * self.capacity:  # drop the entries of rows taken since (amortised O(1))
            slots, stamps = (
                np.concatenate([q for q, _ in self._queue]),
                np.concatenate([t for _, t in self._queue]),
            )
            live = self.valid[slots] & (self.stamp[slots] == stamps)
            self._queue = deque([(slots[live], stamps[live])])
            self._queue_len = int(live.sum())
        self.metrics.rows_in += k
        self.metrics.bytes_in += k * (self._dmax + 1) * 4
        self.metrics.seconds += time.perf_counter() - start

    def _oldest(self, count: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Pop the ``count`` least recently given rows still held off the queue (``count`` <= rows held)."""
        picked: list[np.ndarray[Any, np.dtype[np.int64]]] = []
        got = 0
        while got < count and self._queue:
            slots, stamps = self._queue[0]
            live = np.flatnonzero(self.valid[slots] & (self.stamp[slots] == stamps))[: count - got]
            picked.append(slots[live])
            got += live.shape[0]
            cut = int(live[-1]) + 1 if got == count else slots.shape[0]
            if cut < slots.shape[0]:
                self._queue[0] = (slots[cut:], stamps[cut:])
            else:
                self._queue.popleft()
            self._queue_len -= cut
        return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)

    def load(self, tables: torch.Tensor, ids: torch.Tensor) -> None:
        """Read rows (absent here and from every tier above) from the tier below into this tier (warm start)."""
        self.give(self._lower.take(tables, ids))

    def persist(self, rows: TierRows) -> None:
        """Straight to the store."""
        self._lower.persist(rows)

    def flush(self) -> None:
        """Write every dirty row held here to the store; they stay, clean."""
        dirty = np.flatnonzero(self.dirty)
        if dirty.shape[0]:
            self._lower.persist(self._rows(dirty))
            self.dirty[dirty] = False
            self.metrics.written_rows += dirty.shape[0]
        self._lower.flush()

    def clear(self) -> None:
        """Forget every row."""
        self.valid[:] = False
        self.dirty[:] = False
        self._reset_slots()
        self._lower.clear()

    def summary(self) -> dict[str, float]:
        """``host_tier_*`` counters plus ``host_tier_cached_rows``, and the lower tier's."""
        out = self.metrics.summary("host_tier")
        out["host_tier_cached_rows"] = float(self.cached_rows)
        out.update(self._lower.summary())
        return out

    def reset_metrics(self) -> None:
        """Zero the counters here and below."""
        self.metrics = TierMetrics()
        self._lower.reset_metrics()

    def _rows(self, slots: np.ndarray[Any, np.dtype[np.int64]]) -> TierRows:
        index = torch.from_numpy(slots)
        return TierRows(
            tables=torch.from_numpy(self.slot_tables[slots]),
            ids=torch.from_numpy(self.slot_ids[slots]),
            weights=self.weights.index_select(0, index),
            state=self.state.index_select(0, index),
            dirty=torch.from_numpy(self.dirty[slots]),
        )

    def _evict(self, slots: np.ndarray[Any, np.dtype[np.int64]]) -> None:
        """Push the rows of ``slots`` out: dirty ones to ``lower``; the slots become free."""
        rows = self._rows(slots)
        dirty = rows.dirty
        if bool(dirty.any()):
            self._lower.give(rows.select(dirty))
            self.metrics.written_rows += int(dirty.sum())
        self.metrics.evicted_rows += slots.shape[0]
        self._index.remove(self._index.find(self.slot_tables[slots], self.slot_ids[slots])[1])
        self.valid[slots] = False
        self.dirty[slots] = False
        self._push_free(slots)
