"""One table's row cache: slot storage on the module's device, slot metadata and a sorted id index on the host.

Not thread-safe on its own: the owning :class:`~ssd_tbe_adapter.KeyValueEmbeddingBags` calls every method
under its lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["RowSlab", "TableCache", "copy_rows", "select_rows"]

# Row copies move raw bits: torch's CPU index kernels are several times faster on integer than on
# float or uint8 elements (measured with torch 2.13, one thread).
_BITS = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    bits = _BITS.get(tensor.dtype)
    if bits is not None:
        return tensor.view(bits)
    if (
        tensor.dtype == torch.uint8
        and tensor.dim() == 2
        and tensor.shape[1] % 4 == 0
        and tensor.is_contiguous()
    ):
        return tensor.view(torch.int32)
    return tensor


def select_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``source.index_select(0, index)`` for 2-D ``source``, copying bits (same result, faster)."""
    if source.device.type != "cpu":
        return source.index_select(0, index)
    return _as_bits(source).index_select(0, index).view(source.dtype)


def copy_rows(target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
    """``target.index_copy_(0, index, source)`` for 2-D tensors of one dtype, copying bits."""
    if target.device.type != "cpu" or not source.is_contiguous():
        target.index_copy_(0, index, source)
        return
    target_bits, source_bits = _as_bits(target), _as_bits(source)
    if target_bits.dtype != source_bits.dtype:
        target.index_copy_(0, index, source)
        return
    target_bits.index_copy_(0, index, source_bits)


_TICK_SPAN = 1 << 40
# Slot tensors :meth:`TableCache.vouch` remembers per table: a batch's prefetch, its forward and its backward,
# and a few batches prefetched ahead.
_MAX_VOUCHED = 8
_MAX_USES = (1 << 22) - 1


class RowSlab:
    """The slot storage of several tables' caches of one row width in one buffer each (weights, optimizer state,
    dirty flags, use ticks and counts): table ``t``'s slot ``s`` is row ``bases[t] + s``, so one index op reaches
    every table's rows.

    ``generation`` is bumped whenever a valid slot of any of the tables may stop holding its id (a drop or a
    clear, see :attr:`TableCache.generation`): slab rows found for a batch at one generation still hold that
    batch's rows while it lasts.

    Args:
        capacities: slots per table.
        dim: the tables' common row width ``D``.
        weight_dtype: float32 or float16.
        state_width: optimizer state floats per row ``S``.
        device: where the weights and state live (the dirty flags stay on the host).
    """

    def __init__(
        self,
        capacities: list[int],
        dim: int,
        weight_dtype: torch.dtype,
        state_width: int,
        device: torch.device,
    ) -> None:
        self.bases = np.concatenate([[0], np.cumsum(capacities, dtype=np.int64)])
        rows = int(self.bases[-1])
        self.weights = torch.zeros(rows, dim, dtype=weight_dtype, device=device)
        self.state = torch.zeros(rows, state_width, dtype=torch.float32, device=device)
        self.dirty = torch.zeros(rows, dtype=torch.bool)
        self.last_used = torch.zeros(rows, dtype=torch.int64)
        self.uses = torch.zeros(rows, dtype=torch.int64)
        self.generation = 0

    def rows(self, table: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of table ``table``'s slots: ``(weights [C, D], state [C, S], dirty [C])``."""
        lo, hi = int(self.bases[table]), int(self.bases[table + 1])
        return self.weights[lo:hi], self.state[lo:hi], self.dirty[lo:hi]

    def stamps(self, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of table ``table``'s use stamps: ``(last_used [C], uses [C])`` int64 host."""
        lo, hi = int(self.bases[table]), int(self.bases[table + 1])
        return self.last_used[lo:hi], self.uses[lo:hi]

    def touch(self, rows: np.ndarray[Any, np.dtype[np.int64]], tick: int) -> None:
        """:meth:`TableCache.touch` of every table at once: slab ``rows`` (unique, valid) used at ``tick``."""
        self.last_used.numpy()[rows] = tick
        self.uses.numpy()[rows] += 1  # unique rows: one increment each


class TableCache:
    """Slots for ``capacity`` rows of one table with frequency-then-recency (aged LFU) eviction.

    Each slot counts its uses (halved every ``8 * capacity`` evictions, so old popularity fades); victims are
    the valid slots with the fewest uses, the least recently used first among equals. Under skewed (Zipf)
    ids this keeps the hot rows and lets one-off rows churn among themselves, where plain LRU lets each
    batch's one-off rows push hot rows out (benchmark: unique-row hit rate 0.49 with LRU, 0.56 with this).

    Invariants: ``sorted_ids``/``sorted_slots`` list exactly the valid slots, ids ascending; a slot is dirty
    only if valid; a dirty slot holds a newer row than the store.

    Args:
        capacity: number of slots ``C`` (``>= 0``).
        dim: row width ``D``.
        weight_dtype: float32 or float16.
        state_width: optimizer state floats per row ``S`` (0 for SGD, 1 for row-wise Adagrad).
        device: where the row storage lives.
        storage: ``(weights [C, D], state [C, S], dirty [C])`` to use as the slot storage (zeroed; a
            :meth:`RowSlab.rows`), instead of tensors of its own.
        slab: the :class:`RowSlab` that ``storage`` (given then) comes from, as table ``table``: the use stamps
            live there too, and every drop or clear bumps its ``generation``.
        table: this cache's table number in ``slab``.
    """

    aging_turnovers = 8
    """Use counts are halved after this many cache turnovers (``capacity`` evictions each)."""

    def __init__(
        self,
        capacity: int,
        dim: int,
        weight_dtype: torch.dtype,
        state_width: int,
        device: torch.device,
        *,
        storage: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        slab: RowSlab | None = None,
        table: int = 0,
    ) -> None:
        self.capacity = capacity
        self.device = device
        if storage is None:
            self.weights = torch.zeros(capacity, dim, dtype=weight_dtype, device=device)
            self.state = torch.zeros(capacity, state_width, dtype=torch.float32, device=device)
            self.dirty = torch.zeros(capacity, dtype=torch.bool)
        else:
            self.weights, self.state, self.dirty = storage
        self.slot_ids = torch.zeros(capacity, dtype=torch.int64)
        self.valid = torch.zeros(capacity, dtype=torch.bool)
        self._slab = slab
        if slab is None:
            self.last_used = torch.zeros(capacity, dtype=torch.int64)
            self.uses = torch.zeros(capacity, dtype=torch.int64)
        else:
            self.last_used, self.uses = slab.stamps(table)
        self._evicted_since_aging = 0
        # Slots [_fresh, C) held no row since construction or clear(); _holes invalid slots lie below _fresh.
        # With no hole the free slots are known without a pass over the capacity (a cold cache's inserts).
        self._fresh = 0
        self._holes = 0
        self.fills = 0  # number of :meth:`fill` calls that cached rows
        self.sorted_ids = torch.zeros(0, dtype=torch.int64)
        self.sorted_slots = torch.zeros(0, dtype=torch.int64)
        self._stale = False  # the index still lists slots dropped with ``reindex=False``
        # Bumped whenever a valid slot may stop holding its id (:meth:`drop`, :meth:`clear`); :meth:`fill`
        # only fills invalid slots, so slots that held their ids at one generation still do while it lasts.
        self.generation = 0
        # Slot tensors known to hold their ids (see :meth:`vouch`): ``id(slots)`` -> (slots, ids, their
        # version counters, generation). The tensors are kept alive, so an ``id`` is never reused meanwhile.
        self._vouched: dict[int, tuple[torch.Tensor, torch.Tensor, int, int, int]] = {}

    def index(self) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
        """The id index: ``(sorted_ids, sorted_slots)``, ``[V]`` int64 host each, ids ascending (read-only)."""
        self._compact()
        return self.sorted_ids.numpy(), self.sorted_slots.numpy()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (``[N]`` int64, host), ``-1`` where the id is not cached; ``[N]`` int64 host."""
        self._compact()
        n = self.sorted_ids.numel()
        if n == 0 or ids.numel() == 0:
            return torch.full_like(ids, -1)
        # numpy's searchsorted is much faster than torch's on the (usually ascending) query ids.
        sorted_ids = self.sorted_ids.numpy()
        query = ids.numpy()
        position = np.searchsorted(sorted_ids, query)
        np.minimum(position, n - 1, out=position)
        slots = self.sorted_slots.numpy()[position]
        slots[sorted_ids[position] != query] = -1
        return torch.from_numpy(slots)

    def holds(self, slots: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether each of ``slots`` (``[K]`` int64 host) is valid and holds the id at the same position of
        ``ids`` (``[K]`` int64 host): no work for a pair :meth:`vouch` recorded that no drop or in-place change
        has touched since, else two gathers instead of an index search (and a pair that holds is vouched)."""
        if self._vouched_for(slots, ids):
            return True
        held = (
            slots.numel() == ids.numel()
            and bool(self.valid.numpy()[slots.numpy()].all())
            and bool((self.slot_ids.numpy()[slots.numpy()] == ids.numpy()).all())
        )
        if held:
            self.vouch(slots, ids)
        return held

    def vouch(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """Record that ``slots`` (``[K]`` int64 host, valid) hold ``ids`` (``[K]`` int64 host) now, so that
        :meth:`holds` answers without looking while neither tensor changes in place and no slot is dropped.
        The caller must not write to either tensor through memory torch does not see (a numpy view)."""
        vouched = self._vouched
        if len(vouched) >= _MAX_VOUCHED:
            del vouched[next(iter(vouched))]  # the oldest
        vouched.pop(id(slots), None)
        vouched[id(slots)] = (slots, ids, slots._version, ids._version, self.generation)

    def _vouched_for(self, slots: torch.Tensor, ids: torch.Tensor) -> bool:
        entry = self._vouched.get(id(slots))
        if entry is None:
            return False
        their_slots, their_ids, slots_version, ids_version, generation = entry
        if generation != self.generation:
            self._vouched.clear()  # every entry is older than the drop
            return False
        return (
            their_slots is slots
            and their_ids is ids
            and slots._version == slots_version
            and ids._version == ids_version
        )

    def touch(self, slots: torch.Tensor, tick: int) -> None:
        """Mark ``slots`` (``[K]`` int64 host, all valid, unique) used at ``tick``."""
        index = slots.numpy()
        self.last_used.numpy()[index] = tick
        self.uses.numpy()[index] += 1  # unique slots: one increment each

    def choose_victims(self, count: int, tick: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``count`` slots for new rows: free slots first, then the least used (then least recently
        used) valid slots last touched before ``tick`` (rows of the batch being served, touched at ``tick`` or
        later, stay).

        Returns:
            ``(free, victims)``, ``[K1]`` and ``[K2]`` int64 host, ``K1 + K2 <= count``; victims still hold
            their rows (the caller writes dirty ones back, then calls :meth:`drop`).
        """
        valid = self.valid.numpy()
        if self._holes == 0:  # the lowest invalid slots, as the pass below would find them
            free = torch.arange(self._fresh, min(self.capacity, self._fresh + count), dtype=torch.int64)
        else:
            free = torch.from_numpy(np.flatnonzero(~valid)[:count])
        missing = count - free.numel()
        if missing <= 0:
            return free, torch.zeros(0, dtype=torch.int64)
        last_used = self.last_used.numpy()
        candidates = np.flatnonzero(valid & (last_used < tick))
        k = min(missing, candidates.shape[0])
        if k == 0:
            return free, torch.zeros(0, dtype=torch.int64)
        if k < candidates.shape[0]:
            # One int64 key per slot: uses in the high bits, last use tick in the low 40 bits.
            keys = np.minimum(self.uses.numpy()[candidates], _MAX_USES) * _TICK_SPAN
            keys += np.minimum(last_used[candidates], _TICK_SPAN - 1)
            candidates = candidates[np.argpartition(keys, k - 1)[:k]]
        victims = torch.from_numpy(candidates)
        self._evicted_since_aging += k
        if self._evicted_since_aging >= self.capacity * self.aging_turnovers:
            self.uses.bitwise_right_shift_(1)
            self._evicted_since_aging = 0
        return free, victims

    def drop(self, slots: torch.Tensor, *, reindex: bool = True) -> None:
        """Forget the rows in ``slots`` (host int64, valid, unique); the caller has written dirty ones back already.

        ``reindex=False`` defers the index update to the :meth:`fill` that must follow under the same lock.
        """
        if slots.numel() == 0:
            return
        self.valid.index_fill_(0, slots, False)
        self.dirty.index_fill_(0, slots, False)
        self._holes += slots.numel()  # valid slots all lie below _fresh
        self._bump_generation()
        self._stale = True
        if reindex:
            self._compact()

    def fill(
        self, slots: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, tick: int
    ) -> None:
        """Put clean rows into free ``slots``.

        Args:
            slots: ``[K]`` int64 host, currently invalid.
            ids: ``[K]`` int64 host, unique, not cached.
            weights: ``[K, D]`` in the cache's weight dtype, any device.
            state: ``[K, S]`` float32, any device.
            tick: use time of the new rows.
        """
        self._compact()  # before the slots are valid again
        if slots.numel() == 0:
            return
        self.fills += 1
        # The slots are invalid: those below the old mark were holes, and the new mark's range takes the rest, so
        # the holes change by the slots the mark moved over minus the slots filled.
        fresh = max(self._fresh, int(slots.numpy().max()) + 1)
        self._holes += fresh - self._fresh - slots.numel()
        self._fresh = fresh
        device_slots = slots.to(self.device, non_blocking=True)
        copy_rows(self.weights, device_slots, weights.to(self.device, self.weights.dtype).contiguous())
        if self.state.shape[1]:
            copy_rows(self.state, device_slots, state.to(self.device).contiguous())
        self.slot_ids.index_copy_(0, slots, ids)
        self.valid.index_fill_(0, slots, True)
        self.dirty.index_fill_(0, slots, False)
        self.last_used.index_fill_(0, slots, tick)
        self.uses.index_fill_(0, slots, 1)
        self._merge(ids, slots)

    def clear(self) -> None:
        """Forget every row (the caller has flushed dirty rows)."""
        self.valid.zero_()
        self.dirty.zero_()
        self._fresh = self._holes = 0
        self._bump_generation()
        self._stale = False
        self.sorted_ids = torch.zeros(0, dtype=torch.int64)
        self.sorted_slots = torch.zeros(0, dtype=torch.int64)

    def _bump_generation(self) -> None:
        self.generation += 1
        if self._slab is not None:
            self._slab.generation += 1

    def _compact(self) -> None:
        """Take the slots :meth:`drop` invalidated out of the index (one gather and two compressions)."""
        if not self._stale:
            return
        keep = self.valid.numpy()[self.sorted_slots.numpy()]
        self.sorted_ids = torch.from_numpy(self.sorted_ids.numpy()[keep])
        self.sorted_slots = torch.from_numpy(self.sorted_slots.numpy()[keep])
        self._stale = False

    def _merge(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Merge uncached unique ``ids`` at ``slots`` into the sorted index: ``O(C + K log K)``, no re-sort."""
        new_ids, new_slots = ids.numpy(), slots.numpy()
        if new_ids.shape[0] > 1 and not bool((new_ids[1:] > new_ids[:-1]).all()):
            order = np.argsort(new_ids, kind="stable")
            new_ids, new_slots = new_ids[order], new_slots[order]
        at = np.searchsorted(self.sorted_ids.numpy(), new_ids)
        self.sorted_ids = torch.from_numpy(np.insert(self.sorted_ids.numpy(), at, new_ids))
        self.sorted_slots = torch.from_numpy(np.insert(self.sorted_slots.numpy(), at, new_slots))
