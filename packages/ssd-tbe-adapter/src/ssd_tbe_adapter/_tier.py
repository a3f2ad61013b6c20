"""The cache tier: per-table row caches in front of the key-value store, and every move of rows between them.

:class:`CacheTier` owns the caches, the store, the lock and the bookkeeping that keeps them consistent
(use ticks, the store write epoch and write log that prefetch jobs check, CUDA events between the prefetch
stream and the training stream, the counters). Every cache or store metadata change happens under
``lock``; the only work done without it is a prefetch job's store read (see ``_prefetch.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ssd_tbe_adapter._cache import RowSlab, TableCache, copy_rows, select_rows
from ssd_tbe_adapter._init import init_rows
from ssd_tbe_adapter._metrics import Metrics, summarize
from ssd_tbe_adapter._optimizer import RowOptimizer
from ssd_tbe_adapter._plan import BatchGroups, TableGroup
from ssd_tbe_adapter._records import RecordLayout
from ssd_tbe_adapter.interfaces import KVStore

__all__ = ["NO_TICK", "CacheTier"]

NO_TICK = 1 << 62


class CacheTier:
    """Row caches of every table over one store.

    Args:
        store: the key-value store.
        capacities: cache slots per table.
        layout: the record layout (row widths, weight dtype, state width).
        salts: per table, the salt of its first-touch initialisation.
        init_range: ``(low, high)`` of the uniform first-touch initialisation.
        device: where the caches live.
    """

    def __init__(
        self,
        store: KVStore,
        capacities: Sequence[int],
        layout: RecordLayout,
        salts: Sequence[int],
        init_range: tuple[float, float],
        device: torch.device,
    ) -> None:
        self.store = store
        self.layout = layout
        self.device = device
        self.cuda = device.type == "cuda"
        self.salts = list(salts)
        self.init_range = init_range
        # Tables of one row width keep their slots in one slab, so a batch's lookups and updates of every
        # table are one op each (the fused host-cache step, see ``gather_batch``).
        self.slab = (
            RowSlab(list(capacities), layout.dims[0], layout.weight_dtype, layout.state_width, device)
            if len(set(layout.dims)) == 1
            else None
        )
        self.caches = [
            TableCache(
                capacity,
                dim,
                layout.weight_dtype,
                layout.state_width,
                device,
                storage=None if self.slab is None else self.slab.rows(table),
                slab=self.slab,
                table=table,
            )
            for table, (capacity, dim) in enumerate(zip(capacities, layout.dims, strict=True))
        ]
        self.lock = threading.RLock()
        self.tick = 0
        # Eviction never takes a row touched at or after the tick of the batch being served (``batch_tick``)
        # or of a prefetched batch not yet served (``job_ticks``, job number -> tick): prefetching batch k+1
        # must not push out the rows of batch k, whatever the eviction order says.
        self.batch_tick = NO_TICK
        self.job_ticks: dict[int, int] = {}
        self.epoch = 0
        self.inflight = False
        self.write_log: list[tuple[int, torch.Tensor]] = []
        self.metrics = Metrics()
        self.read_metrics_lock = threading.Lock()
        self.insert_event: Any = None
        self.main_event: Any = None

    def summary(self) -> dict[str, float]:
        """The counters and derived rates (see :meth:`KeyValueEmbeddingBags.metrics`)."""
        with self.lock:
            return summarize(self.metrics, sum(int(cache.valid.sum()) for cache in self.caches))

    def reset_metrics(self) -> None:
        """Zero every counter."""
        with self.lock:
            self.metrics = Metrics()

    def write_back_dirty(self) -> None:
        """Write every dirty cached row to the store (they stay cached, clean); lock held."""
        for table, cache in enumerate(self.caches):
            dirty = cache.dirty.nonzero().flatten()
            if dirty.numel():
                ids = cache.slot_ids[dirty]
                device_slots = dirty.to(self.device)
                records = self.layout.encode(table, cache.weights[device_slots], cache.state[device_slots])
                self.store_put(table, ids, records)
                cache.dirty[dirty] = False
                self.metrics.written_back_rows += int(dirty.numel())

    def count_first_look(self, groups: dict[int, TableGroup]) -> None:
        """Count a batch's first look at the cache (forward without a prefetch)."""
        with self.lock:
            for table, group in groups.items():
                slots = self.caches[table].lookup(group.unique)
                self.metrics.lookups += group.unique.numel()
                self.metrics.hits += int((slots >= 0).sum())

    def next_tick(self) -> int:
        self.tick += 1
        return self.tick

    def gather(
        self,
        table: int,
        ids: torch.Tensor,
        hints: dict[int, torch.Tensor],
        need_rows: bool = True,
        prior: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Rows ``[U, D]`` float32 on the device for unique ``ids``; misses are fetched (and cached if they fit).

        When every row was cached, records their slots in ``hints[table]`` (for forward and backward) and,
        unless ``need_rows`` or the weights are fp16, returns ``None`` instead of copying the rows.
        ``prior``: slots the prefetch left the rows in, used instead of an index search if still valid.
        """
        cache = self.caches[table]
        with self.lock:
            self.wait_insert_event()
            tick = self.next_tick()
            # Slots that still hold their ids are all hits: no second pass over them.
            held = prior is not None and cache.holds(prior, ids)
            slots = prior if held and prior is not None else cache.lookup(ids)
            if held or _all_found(slots):
                hit_positions = None
                hit_slots = slots
                hints[table] = slots
                if not held:
                    cache.vouch(slots, ids)
            else:
                hit_positions = (slots >= 0).nonzero().flatten()
                hit_slots = slots.index_select(0, hit_positions)
            cache.touch(hit_slots, tick)
            n_hit = hit_slots.numel()
            self.metrics.forward_lookups += ids.numel()
            self.metrics.forward_hits += n_hit
            if hit_positions is None and not need_rows and self.layout.weight_dtype == torch.float32:
                self.record_main_event()
                return None
            if hit_positions is None:
                rows = select_rows(cache.weights, hit_slots.to(self.device, non_blocking=True))
                rows = rows.to(torch.float32)
            else:
                rows = torch.empty(
                    ids.numel(), self.layout.dims[table], dtype=torch.float32, device=self.device
                )
                if n_hit:
                    assert hit_positions is not None
                    copy_rows(
                        rows,
                        hit_positions.to(self.device, non_blocking=True),
                        select_rows(cache.weights, hit_slots.to(self.device, non_blocking=True)).to(
                            torch.float32
                        ),
                    )
                miss_positions = (slots < 0).nonzero().flatten()
                miss_ids = ids.index_select(0, miss_positions)
                weights, state = self.read_rows(table, miss_ids)
                self.metrics.sync_fetched_rows += miss_ids.numel()
                inserted_slots = self.insert(table, miss_ids, weights, state, tick)
                inserted = inserted_slots.numel()
                self.metrics.scratch_rows += miss_ids.numel() - inserted
                if inserted == miss_ids.numel():
                    # Every row is cached now: backward can use the slots.
                    hints[table] = slots.index_copy(0, miss_positions, inserted_slots)
                copy_rows(
                    rows,
                    miss_positions.to(self.device),
                    weights.to(self.device, torch.float32).contiguous(),
                )
            self.record_main_event()
        return rows

    def lookup_batch(self, batch: BatchGroups) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The slab row of every unique row of ``batch`` (``[U]`` int64 host, in ``batch`` order), ``-1`` where
        the row is not cached: one index search per table, the rest batch-wide. Slab only; lock held."""
        slab = self.slab
        assert slab is not None
        unique = batch.unique
        rows = np.empty(unique.shape[0], dtype=np.int64)
        found = np.empty(unique.shape[0], dtype=np.int64)  # the id at each row's index position
        for table, (lo, hi) in zip(batch.names, batch.bounds, strict=True):
            if lo == hi:
                continue
            sorted_ids, sorted_slots = self.caches[table].index()
            n = sorted_ids.shape[0]
            if n == 0:
                rows[lo:hi] = -1
                np.bitwise_xor(unique[lo:hi], 1, out=found[lo:hi])  # differs from every id
                continue
            # numpy's searchsorted is much faster than torch's on the (ascending) query ids; fancy indexing
            # than np.take(out=...), which buffers.
            position = np.searchsorted(sorted_ids, unique[lo:hi])
            np.minimum(position, n - 1, out=position)
            found[lo:hi] = sorted_ids[position]
            rows[lo:hi] = sorted_slots[position] + int(slab.bases[table])
        rows[found != unique] = -1
        return rows

    def table_slots(self, batch: BatchGroups, position: int) -> torch.Tensor | None:
        """The slots (``[U_t]`` int64 host) the prefetch left the rows of table ``batch.names[position]`` in, if it
        left them all cached: the table's own (``batch.slots``), else its part of ``batch.slab_rows`` (then kept
        in ``batch.slots``). Not checked: :meth:`TableCache.holds` tells whether they still hold the rows."""
        table = batch.names[position]
        slots = batch.slots.get(table)
        if slots is None and batch.slab_rows is not None and self.slab is not None:
            lo, hi = batch.bounds[position]
            slots = torch.from_numpy(batch.slab_rows[lo:hi] - int(self.slab.bases[table]))
            batch.slots[table] = slots
        return slots

    def gather_batch(self, batch: BatchGroups, hints: dict[int, torch.Tensor]) -> torch.Tensor | None:
        """The slab slot (``[U]`` int64 host, in ``batch`` order) of every unique row of the batch when each
        table's rows are still in the slots its prefetch left them in, with the use ticks and counters that
        :meth:`gather` per table would leave; else ``None`` and nothing changed (the caller gathers per table).

        When the prefetch's survey found every row in the slab (``batch.slab_rows``) and no cached row was
        dropped since (the slab's generation), those rows are used as they are: one stamp pass over the slab.
        Otherwise each table's slots (:meth:`table_slots`) are checked (:meth:`TableCache.holds`) and recorded in
        ``hints`` for backward.

        One call for every table: the forward pools all tables straight from the slab (float32 rows only).
        """
        slab = self.slab
        if slab is None or self.layout.weight_dtype != torch.float32:
            return None
        with self.lock:
            self.wait_insert_event()
            rows = batch.slab_rows
            if rows is not None and batch.slab_generation == slab.generation:
                # One tick for every table: ticks are compared only within a table, and every other event's
                # tick falls before or after all of this forward's either way.
                slab.touch(rows, self.next_tick())
                self.metrics.forward_lookups += rows.shape[0]
                self.metrics.forward_hits += rows.shape[0]
                self.record_main_event()
                return torch.from_numpy(rows)
            for position, table in enumerate(batch.names):
                slots = self.table_slots(batch, position)
                if slots is None or not self.caches[table].holds(slots, batch.unique_of(position)):
                    return None
            parts: list[np.ndarray[Any, np.dtype[np.int64]]] = []
            count = 0
            for table in batch.names:
                slots = batch.slots[table]
                self.caches[table].touch(slots, self.next_tick())
                hints[table] = slots
                parts.append(slots.numpy() + slab.bases[table])
                count += slots.numel()
            self.metrics.forward_lookups += count
            self.metrics.forward_hits += count
            self.record_main_event()
        return torch.from_numpy(np.concatenate(parts) if len(parts) != 1 else parts[0])

    def apply_update_batch(
        self, batch: BatchGroups, slots: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer
    ) -> None:
        """:meth:`apply_update` of every table of a batch whose forward took :meth:`gather_batch`'s ``slots``:
        one optimizer step over the slab when every table's rows are still there (the usual case: rows of the
        batch being served are not evicted), else table by table.

        Args:
            batch: the batch's grouping.
            slots: ``[U]`` int64 host, from :meth:`gather_batch`.
            grads: ``[U, D]`` float32 row gradients on the device, in ``batch`` order.
            optimizer: the step.
        """
        slab = self.slab
        assert slab is not None  # gather_batch gave the slots
        with self.lock:
            self.wait_insert_event()
            slots_np = slots.numpy()
            # Rows found at the survey and no row dropped since: they are the forward's slots, still there.
            # Else the forward's slots, table by table (:meth:`table_slots`: those it took them from).
            if (batch.slab_rows is not None and batch.slab_generation == slab.generation) or all(
                (table_slots := self.table_slots(batch, position)) is not None
                and self.caches[table].holds(table_slots, batch.unique_of(position))
                for position, table in enumerate(batch.names)
            ):
                if slots.numel():
                    optimizer.step_in_place(slab, slots.to(self.device, non_blocking=True), grads)
                    slab.dirty.numpy()[slots_np] = True
                self.record_main_event()
                return
            # Some row moved since forward: each table's rows wherever they are now (the forward's slots as
            # hints, each checked before use).
            for position, table in enumerate(batch.names):
                lo, hi = batch.bounds[position]
                hint = self.table_slots(batch, position)
                self.apply_update(table, batch.unique_of(position), grads[lo:hi], optimizer, hint)

    def apply_update(
        self,
        table: int,
        ids: torch.Tensor,
        grads: torch.Tensor,
        optimizer: RowOptimizer,
        hint: torch.Tensor | None = None,
    ) -> None:
        """Apply ``optimizer`` to the current value of each row of ``ids``, wherever it lives now.

        ``hint``: the slots forward found for ``ids``; used only if each still holds its id (one gather and
        compare instead of an index search).
        """
        cache = self.caches[table]
        with self.lock:
            self.wait_insert_event()
            held = hint is not None and cache.holds(hint, ids)
            slots = hint if held and hint is not None else cache.lookup(ids)
            if ids.numel() and (held or _all_found(slots)):
                hit_positions = None
                hit_slots = slots
            else:
                hit_positions = (slots >= 0).nonzero().flatten()
                hit_slots = slots.index_select(0, hit_positions)
            if hit_slots.numel():
                device_slots = hit_slots.to(self.device, non_blocking=True)
                hit_grads = (
                    grads
                    if hit_positions is None
                    else select_rows(grads, hit_positions.to(self.device, non_blocking=True))
                )
                if self.layout.weight_dtype == torch.float32:
                    optimizer.step_in_place(cache, device_slots, hit_grads)
                else:
                    weights, state = optimizer.step(
                        select_rows(cache.weights, device_slots).to(torch.float32),
                        select_rows(cache.state, device_slots),
                        hit_grads,
                    )
                    copy_rows(cache.weights, device_slots, weights.to(self.layout.weight_dtype).contiguous())
                    if self.layout.state_width:
                        copy_rows(cache.state, device_slots, state.contiguous())
                cache.dirty.numpy()[hit_slots.numpy()] = True
            if hit_slots.numel() < ids.numel():
                miss_positions = (slots < 0).nonzero().flatten()
                miss_ids = ids.index_select(0, miss_positions)
                weights, state = self.read_rows(table, miss_ids)
                new_weights, new_state = optimizer.step(
                    weights.to(torch.float32),
                    state,
                    grads.index_select(0, miss_positions.to(self.device)).to("cpu"),
                )
                self.store_put(
                    table,
                    miss_ids,
                    self.layout.encode(table, new_weights.to(self.layout.weight_dtype), new_state),
                )
                self.metrics.write_through_rows += miss_ids.numel()
            self.record_main_event()

    def read_rows(self, table: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``ids`` from the store, initialised where absent: (``[K, D]`` weight dtype, ``[K, S]``) host."""
        records = torch.empty(ids.numel(), self.layout.record_bytes[table], dtype=torch.uint8)
        start = time.perf_counter()
        found = self.store.get(ids, records, table=table)
        elapsed = time.perf_counter() - start
        # Not the module lock: a reader thread must not wait for the prefetch job's insert of another table.
        with self.read_metrics_lock:
            self.metrics.store_read_seconds += elapsed
            self.metrics.store_rows_read += ids.numel()
        weights, state = self.layout.decode(table, records)
        absent = ~found
        if bool(absent.any()):
            low, high = self.init_range
            weights[absent] = init_rows(
                ids[absent], self.layout.dims[table], self.salts[table], low, high
            ).to(self.layout.weight_dtype)
            state[absent] = 0.0
        return weights, state

    def insert(
        self, table: int, ids: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, tick: int
    ) -> torch.Tensor:
        """Cache as many of the (uncached) rows as fit; lock held. Victims: the least used rows last touched
        before ``tick``, the batch being served and every prefetched batch not yet served.

        Returns:
            The slots ``[K]`` (int64 host) of the rows cached: ``ids[:K]``.
        """
        cache = self.caches[table]
        protect = min(tick, self.batch_tick, *self.job_ticks.values())
        free, victims = cache.choose_victims(ids.numel(), protect)
        if victims.numel():
            dirty = victims[cache.dirty.index_select(0, victims)]
            if dirty.numel():
                device_slots = dirty.to(self.device)
                records = self.layout.encode(
                    table, select_rows(cache.weights, device_slots), select_rows(cache.state, device_slots)
                )
                self.store_put(table, cache.slot_ids.index_select(0, dirty), records)
                self.metrics.written_back_rows += dirty.numel()
            self.metrics.evicted_rows += victims.numel()
            cache.drop(victims, reindex=False)
        slots = torch.cat([free, victims])
        count = slots.numel()
        # Victims are non-empty only when count > 0, so fill() rebuilds the index drop() deferred.
        cache.fill(slots, ids[:count], weights[:count], state[:count], tick)
        return slots

    def store_put(self, table: int, ids: torch.Tensor, records: torch.Tensor) -> None:
        """Write records; lock held. Logged while a prefetch job is between its read and its insert."""
        start = time.perf_counter()
        self.store.put(ids, records, table=table)
        self.metrics.store_write_seconds += time.perf_counter() - start
        self.metrics.store_rows_written += ids.numel()
        self.epoch += 1
        if self.inflight:
            self.write_log.append((table, ids.clone()))

    def wait_insert_event(self) -> None:
        if self.cuda and self.insert_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.insert_event)

    def record_main_event(self) -> None:
        if self.cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            event.record(torch.cuda.current_stream(self.device))
            self.main_event = event


def _all_found(slots: torch.Tensor) -> bool:
    """Whether no entry of a lookup's slots (``[K]`` int64 host) is ``-1`` (numpy: a fraction of torch's cost)."""
    return bool((slots.numpy() >= 0).all())
