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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ssd_tbe_adapter._records import RecordLayout
from ssd_tbe_adapter._tier import CacheTier
from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = ["HostTier", "RowTier", "StoreTier", "TierMetrics", "TierRows"]


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

    def take(self, tables: torch.Tensor, ids: torch.Tensor) -> TierRows:
        """The rows of ``(tables[i], ids[i])`` (host int64, unique pairs), in that order; removes them here."""
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


class StoreTier:
    """The key-value store as a tier: reads initialise absent rows; writes encode the records.

    Store calls go through the module's :class:`~ssd_tbe_adapter._tier.CacheTier` (its record reads with
    first-touch initialisation, its writes and store counters), under its lock.

    Args:
        tier: the module's cache tier (store, record layout, initialisation).
        dims: per table, its ``D``.
        pin: allocate returned rows in pinned memory (CUDA).
    """

    keeps_clean_rows = False

    def __init__(self, tier: CacheTier, dims: Sequence[int], pin: bool) -> None:
        self._tier = tier
        self._layout: RecordLayout = tier.layout
        self._dims = list(dims)
        self._dmax = max(self._dims)
        self._pin = pin
        self.metrics = TierMetrics()

    def take(self, tables: torch.Tensor, ids: torch.Tensor) -> TierRows:
        """Rows from the store, initialised where absent (clean)."""
        start = time.perf_counter()
        k = ids.numel()
        weights = torch.zeros(k, self._dmax, dtype=torch.float32, pin_memory=self._pin)
        state = torch.zeros(k, dtype=torch.float32, pin_memory=self._pin)
        for table, positions in _table_runs(tables, len(self._dims)):
            w, s = self._tier.read_rows(table, ids.index_select(0, positions))
            weights[positions, : self._dims[table]] = w.to(torch.float32)
            if s.shape[1]:
                state[positions] = s[:, 0]
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
            for table, positions in _table_runs(rows.tables, len(self._dims)):
                weights = rows.weights.index_select(0, positions)[:, : self._dims[table]]
                state = rows.state.index_select(0, positions)[:, None]
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


@dataclass(slots=True)
class _SortedIndex:
    """One table's ids held by the host tier: ids ascending and their slots (numpy, host)."""

    ids: np.ndarray[Any, np.dtype[np.int64]] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    slots: np.ndarray[Any, np.dtype[np.int64]] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def find(
        self, query: np.ndarray[Any, np.dtype[np.int64]]
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """Slots of ``query`` ids (``-1`` where absent) and their positions in the index (for :meth:`remove`)."""
        n = self.ids.shape[0]
        if n == 0 or query.shape[0] == 0:
            return np.full(query.shape[0], -1, dtype=np.int64), np.zeros(query.shape[0], dtype=np.int64)
        position = np.minimum(np.searchsorted(self.ids, query), n - 1)
        slots: np.ndarray[Any, np.dtype[np.int64]] = self.slots[position]
        slots[self.ids[position] != query] = -1
        return slots, position

    def remove(self, positions: np.ndarray[Any, np.dtype[np.int64]]) -> None:
        """Forget the entries at ``positions`` (from :meth:`find`, unique): one pass over the index."""
        if positions.shape[0]:
            self.ids, self.slots = np.delete(self.ids, positions), np.delete(self.slots, positions)

    def add(
        self, ids: np.ndarray[Any, np.dtype[np.int64]], slots: np.ndarray[Any, np.dtype[np.int64]]
    ) -> None:
        """Add absent ``ids`` at ``slots`` (merge, no full re-sort)."""
        if ids.shape[0] == 0:
            return
        order = np.argsort(ids, kind="stable")
        ids, slots = ids[order], slots[order]
        at = np.searchsorted(self.ids, ids)
        self.ids, self.slots = np.insert(self.ids, at, ids), np.insert(self.slots, at, slots)


class HostTier:
    """``capacity`` rows in host memory (pinned on CUDA) between the device cache and ``lower``, LRU eviction.

    Rows handed down (``give``) are kept, dirty or clean (a victim cache of the device cache); when it is
    full the least recently given rows leave, dirty ones written to the store. ``take`` moves rows up and
    asks ``lower`` for the rest.

    Args:
        capacity: rows held, ``>= 1``.
        dims: per table, its ``D``.
        lower: the tier below (the store tier).
        pin: pinned host memory (CUDA).
    """

    keeps_clean_rows = True

    def __init__(self, capacity: int, dims: Sequence[int], lower: RowTier, pin: bool) -> None:
        self.capacity = capacity
        self._dims = list(dims)
        self._dmax = max(self._dims)
        self._lower = lower
        self._pin = pin
        self.weights = torch.zeros(capacity, self._dmax, dtype=torch.float32, pin_memory=pin)
        self.state = torch.zeros(capacity, dtype=torch.float32, pin_memory=pin)
        self.slot_tables = np.zeros(capacity, dtype=np.int64)
        self.slot_ids = np.zeros(capacity, dtype=np.int64)
        self.valid = np.zeros(capacity, dtype=np.bool_)
        self.dirty = np.zeros(capacity, dtype=np.bool_)
        self.stamp = np.zeros(capacity, dtype=np.int64)
        self._clock = 0
        self._index = [_SortedIndex() for _ in self._dims]
        self.metrics = TierMetrics()

    @property
    def cached_rows(self) -> int:
        """Rows held now."""
        return int(self.valid.sum())

    def take(self, tables: torch.Tensor, ids: torch.Tensor) -> TierRows:
        """Rows from here where held (removed here), the rest from ``lower``; in the order asked."""
        start = time.perf_counter()
        k = ids.numel()
        slots = np.full(k, -1, dtype=np.int64)
        at = np.zeros(k, dtype=np.int64)
        runs = _table_runs(tables, len(self._dims))
        ids_np = ids.numpy()
        for table, positions in runs:
            pos = positions.numpy()
            slots[pos], at[pos] = self._index[table].find(ids_np[pos])
        found = slots >= 0
        n_found = int(found.sum())
        missing = np.flatnonzero(~found)
        # Read the rest first: a failing store read leaves this tier unchanged.
        below = self._lower.take(tables[missing], ids[missing]) if missing.shape[0] else None
        weights = torch.empty(k, self._dmax, dtype=torch.float32, pin_memory=self._pin)
        state = torch.empty(k, dtype=torch.float32, pin_memory=self._pin)
        dirty = torch.zeros(k, dtype=torch.bool)
        if n_found:
            hit_pos = torch.from_numpy(np.flatnonzero(found))
            hit_slots_np = slots[found]
            hit_slots = torch.from_numpy(hit_slots_np)
            weights[hit_pos] = self.weights.index_select(0, hit_slots)
            state[hit_pos] = self.state.index_select(0, hit_slots)
            dirty[hit_pos] = torch.from_numpy(self.dirty[hit_slots_np])
            self.valid[hit_slots_np] = False
            self.dirty[hit_slots_np] = False
            for table, positions in runs:
                pos = positions.numpy()
                self._index[table].remove(at[pos][found[pos]])
        if below is not None:
            miss_pos = torch.from_numpy(missing)
            weights[miss_pos] = below.weights
            state[miss_pos] = below.state
            dirty[miss_pos] = below.dirty
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
        free = np.flatnonzero(~self.valid)[:k]
        need = k - free.shape[0]
        if need > 0:
            held = np.flatnonzero(self.valid)
            victims = (
                held[np.argpartition(self.stamp[held], need - 1)[:need]] if need < held.shape[0] else held
            )
            self._evict(victims)
            free = np.concatenate([free, victims])
        self._clock += 1
        slots = torch.from_numpy(free)
        self.weights[slots] = rows.weights
        self.state[slots] = rows.state
        tables_np, ids_np = rows.tables.numpy(), rows.ids.numpy()
        self.slot_tables[free] = tables_np
        self.slot_ids[free] = ids_np
        self.valid[free] = True
        self.dirty[free] = rows.dirty.numpy()
        self.stamp[free] = self._clock
        for table, positions in _table_runs(rows.tables, len(self._dims)):
            pos = positions.numpy()
            self._index[table].add(ids_np[pos], free[pos])
        self.metrics.rows_in += k
        self.metrics.bytes_in += k * (self._dmax + 1) * 4
        self.metrics.seconds += time.perf_counter() - start

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
        self._index = [_SortedIndex() for _ in self._dims]
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
        for table, positions in _table_runs(rows.tables, len(self._dims)):
            index = self._index[table]
            index.remove(index.find(rows.ids[positions].numpy())[1])
        self.valid[slots] = False
        self.dirty[slots] = False
