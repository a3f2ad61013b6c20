"""The device cache tier: every table's cached rows in one buffer on the module's device, an id -> slot index on
the device, and slot assignment (hit/miss split, unique misses, LRU victims, row moves) as batched torch ops.

Slots: table ``t`` owns slots ``[base_t, base_t + C_t)`` (its ``cache_rows``); after them comes a shared
*scratch* pool that any table uses when its own slots are all protected (rows of batches prefetched or
forwarded but not yet backwarded must stay where they are), and one last *trash* slot that masked scatters
write to. The pool grows (at prefetch, between batches) when a batch needs more slots than are free or
evictable, so any cache size is exact. Per slot: the row's weights (float32, padded to the widest table;
fp16 tables hold fp16-rounded values), its row-wise optimizer state, its ``(table, id)``, valid, dirty and
the tick of its last use (the step stamp: protection of the batches in flight, recency) and a use count.
Victims: aged LFU as the host cache (fewest uses, least recently used among equals; counts halved every 8
turnovers of the slots), which keeps Zipf-hot rows where plain LRU lets each batch's one-off rows push them
out.

Index: the valid slots sorted by a 64-bit hash of ``(table, id)`` (invalid slots sort last); a lookup is one
``searchsorted`` plus a check of the slot's stored ``(table, id)``, so a hash collision could only make a
row look absent (probability ~``S * N / 2**64`` per batch, ``S`` slots, ``N`` lookups). Rebuilt with one
sort after each assignment that moved rows.

Host syncs happen only in :meth:`DeviceCache.assign` (the prefetch, or a forward without one): the miss
count, the missing ids (to read them from the tier below) and the evicted rows (to write them down).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ssd_tbe_adapter._host_tier import RowTier, TierRows
from ssd_tbe_adapter._init import _mix
from ssd_tbe_adapter._optimizer import RowOptimizer

__all__ = ["Assignment", "DeviceCache", "DeviceCacheMetrics"]

_TICK_BITS = 40  # last-use ticks stay far below 2**40
_MAX_USES = (1 << 20) - 1
_NEVER = 1 << 62  # priority of a protected slot (never a victim): above every (uses, tick) key
_MAX_KEY = (1 << 63) - 1


def hash_keys(tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of each ``(tables[i], ids[i])`` (int64, same device)."""
    return _mix(_mix(tables) ^ ids)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Assignment:
    """The slots one batch got (device tensors; they hold its rows until the batch is released)."""

    slots: torch.Tensor  # [N] int64: the slot of each lookup
    unique_slots: torch.Tensor  # [U] int64 ascending: the batch's rows
    inverse: torch.Tensor  # [N] int64: position of each lookup's slot in unique_slots
    inserted: int  # rows moved in from the tier below for this batch


@dataclass(slots=True)
class DeviceCacheMetrics:
    """Counters of the device cache since construction or the last reset."""

    lookups: int = 0  # unique rows of the batches assigned
    hits: int = 0  # of which already cached
    inserted_rows: int = 0  # rows moved in from the tier below
    scratch_rows: int = 0  # of which placed in the scratch pool
    evicted_rows: int = 0  # rows moved down
    written_back_rows: int = 0  # of which dirty
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    assigns: int = 0
    assigns_with_misses: int = 0


def _unique_pairs(tables: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unique ``(table, id)`` pairs sorted by table then id, and the position of each input pair among them.

    Two stable sorts and an adjacent compare (``torch.unique(dim=0)`` is several times slower); one sync (the
    number of unique pairs)."""
    order = torch.argsort(ids, stable=True)
    order = order.index_select(0, torch.argsort(tables.index_select(0, order), stable=True))
    sorted_tables, sorted_ids = tables.index_select(0, order), ids.index_select(0, order)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = (sorted_tables[1:] != sorted_tables[:-1]) | (sorted_ids[1:] != sorted_ids[:-1])
    inverse = torch.empty_like(order).index_copy_(0, order, torch.cumsum(first, 0) - 1)
    starts = first.nonzero().flatten()
    return sorted_tables.index_select(0, starts), sorted_ids.index_select(0, starts), inverse


class DeviceCache:
    """Cached rows of every table on ``device`` over the tier ``lower``.

    Args:
        capacities: per table, its slots ``C_t >= 0``.
        dims: per table, its ``D``.
        device: where the buffer, index and slot metadata live.
        lower: the tier below (host tier or store tier).
        round_fp16: round updated weights to fp16 (fp16 tables).
    """

    # Per slot ``[S + 1]`` (the last one the trash slot), on the device.
    weights: torch.Tensor  # [S + 1, D_max] float32
    state: torch.Tensor  # [S + 1] float32 row-wise optimizer state
    slot_ids: torch.Tensor  # [S + 1] int64
    slot_tables: torch.Tensor  # [S + 1] int64
    valid: torch.Tensor  # [S + 1] bool
    dirty: torch.Tensor  # [S + 1] bool: newer than the store
    stamp: torch.Tensor  # [S + 1] int64: tick of the last use
    uses: torch.Tensor  # [S + 1] int64: lookups since the row came in (halved as it ages)
    sorted_keys: torch.Tensor  # [S + 1] int64: hash of each valid slot's (table, id), invalid ones last
    sorted_slots: torch.Tensor  # [S + 1] int64: the slot of each sorted key

    aging_turnovers = 8
    """Use counts are halved after this many turnovers of the slots (``S`` evictions each)."""

    def __init__(
        self,
        capacities: Sequence[int],
        dims: Sequence[int],
        device: torch.device,
        lower: RowTier,
        *,
        round_fp16: bool,
    ) -> None:
        self.device = device
        self.lower = lower
        self.round_fp16 = round_fp16
        self.dims = list(dims)
        self.dmax = max(self.dims)
        self.capacities = list(capacities)
        self.num_tables = len(self.dims)
        self.region_size = sum(self.capacities)  # C: slots owned by tables; the scratch pool follows
        self.bases = [sum(self.capacities[:t]) for t in range(self.num_tables)]
        self.region_of_slot = torch.repeat_interleave(
            torch.arange(self.num_tables, dtype=torch.int64), torch.tensor(self.capacities, dtype=torch.int64)
        ).to(device)
        self.dims_device = torch.tensor(self.dims, dtype=torch.float32, device=device)
        self.bases_device = torch.tensor(self.bases, dtype=torch.int64, device=device)
        self.metrics = DeviceCacheMetrics()
        self._evicted_since_aging = 0
        self._allocate(self.region_size, keep=False)

    # ------------------------------------------------------------------ state

    @property
    def slots(self) -> int:
        """Slots ``S`` (tables' plus scratch), without the trash slot."""
        return self.weights.shape[0] - 1

    @property
    def trash(self) -> int:
        """The slot masked scatters write to (never valid)."""
        return self.slots

    def _allocate(self, slots: int, *, keep: bool) -> None:
        """(Re)allocate ``slots`` slots plus the trash slot, keeping the first rows of the current buffers."""
        device = self.device
        weights = torch.zeros(slots + 1, self.dmax, dtype=torch.float32, device=device)
        state = torch.zeros(slots + 1, dtype=torch.float32, device=device)
        slot_ids = torch.zeros(slots + 1, dtype=torch.int64, device=device)
        slot_tables = torch.zeros(slots + 1, dtype=torch.int64, device=device)
        valid = torch.zeros(slots + 1, dtype=torch.bool, device=device)
        dirty = torch.zeros(slots + 1, dtype=torch.bool, device=device)
        stamp = torch.zeros(slots + 1, dtype=torch.int64, device=device)
        uses = torch.zeros(slots + 1, dtype=torch.int64, device=device)
        if keep:
            n = self.slots  # the old slots, trash excluded
            for new, current in (
                (weights, self.weights),
                (state, self.state),
                (slot_ids, self.slot_ids),
                (slot_tables, self.slot_tables),
                (valid, self.valid),
                (dirty, self.dirty),
                (stamp, self.stamp),
                (uses, self.uses),
            ):
                new[:n] = current[:n]
                if device.type == "cuda":
                    # The old buffer may still be read by kernels queued on another stream.
                    current.record_stream(torch.cuda.current_stream(device))
        valid[slots] = False
        self.weights, self.state, self.slot_ids, self.slot_tables = weights, state, slot_ids, slot_tables
        self.valid, self.dirty, self.stamp, self.uses = valid, dirty, stamp, uses
        self._rebuild_index()

    def _rebuild_index(self) -> None:
        keys = torch.where(self.valid, hash_keys(self.slot_tables, self.slot_ids), _MAX_KEY)
        self.sorted_keys, self.sorted_slots = torch.sort(keys)

    def cached_rows(self) -> int:
        """Rows held now (host sync: metrics only)."""
        return int(self.valid.sum())

    # ------------------------------------------------------------------ lookups

    def lookup(self, tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``(tables[i], ids[i])`` (``[N]`` int64 on the device), ``-1`` where not cached. No sync."""
        keys = hash_keys(tables, ids)
        position = torch.searchsorted(self.sorted_keys, keys).clamp_(max=self.slots)
        slots = self.sorted_slots.index_select(0, position)
        hit = (
            (self.sorted_keys.index_select(0, position) == keys)
            & self.valid.index_select(0, slots)
            & (self.slot_ids.index_select(0, slots) == ids)
            & (self.slot_tables.index_select(0, slots) == tables)
        )
        return torch.where(hit, slots, -1)

    def assign(self, tables: torch.Tensor, ids: torch.Tensor, tick: int, protect: int) -> Assignment:
        """Slots for every lookup ``(tables[i], ids[i])`` (``[N]`` int64, device): hits are touched at ``tick``,
        unique misses are read from the tier below into free or evicted slots (victims: the least used, then
        least recently used, slots last touched before ``protect``; the table's own slots first, then the
        scratch pool, grown if needed); evicted rows go down. Syncs with the host (miss count, missing ids,
        evicted rows, the number of unique rows).
        """
        self.metrics.assigns += 1
        inserted_before = self.metrics.inserted_rows
        slots = self._slots(tables, ids, tick, protect)
        unique_slots, inverse = torch.unique(slots, return_inverse=True)
        inserted = self.metrics.inserted_rows - inserted_before
        self.metrics.lookups += unique_slots.numel()
        self.metrics.hits += unique_slots.numel() - inserted
        return Assignment(slots=slots, unique_slots=unique_slots, inverse=inverse, inserted=inserted)

    def _slots(self, tables: torch.Tensor, ids: torch.Tensor, tick: int, protect: int) -> torch.Tensor:
        slots = self.lookup(tables, ids)
        hit = slots >= 0
        touched = torch.where(hit, slots, self.trash)
        self.stamp.index_fill_(0, touched, tick)
        self.uses.index_put_((touched,), torch.ones_like(touched), accumulate=True)
        miss_positions = (~hit).nonzero().flatten()  # host sync: the miss count
        if miss_positions.numel() == 0:
            return slots
        self.metrics.assigns_with_misses += 1
        miss_tables, miss_ids, inverse = _unique_pairs(
            tables.index_select(0, miss_positions), ids.index_select(0, miss_positions)
        )
        new_slots = self._place(miss_tables, miss_ids, tick, protect)
        return slots.index_copy(0, miss_positions, new_slots.index_select(0, inverse))

    def _priorities(self, start: int, stop: int, protect: int) -> torch.Tensor:
        """Victim priority of slots ``[start, stop)`` (lowest first): -1 free, else (uses, last-use tick) as one
        int64, ``_NEVER`` if protected (used at or after ``protect``)."""
        stamp = self.stamp[start:stop]
        key = (self.uses[start:stop].clamp(max=_MAX_USES) << _TICK_BITS) + stamp
        return torch.where(
            stamp >= protect, _NEVER, torch.where(self.valid[start:stop], key, torch.full_like(stamp, -1))
        )

    def _place(self, tables: torch.Tensor, ids: torch.Tensor, tick: int, protect: int) -> torch.Tensor:
        """Slots for uncached unique rows ``(tables, ids)`` sorted by table; moves the rows in."""
        count = ids.numel()
        device = self.device
        misses_per_table = torch.bincount(tables, minlength=self.num_tables)
        region = self.region_size
        if region:
            priority = self._priorities(0, region, protect)
            order = torch.argsort(priority, stable=True)  # then region by region, keeping that order
            order = order.index_select(
                0, torch.argsort(self.region_of_slot.index_select(0, order), stable=True)
            )
            choosable = torch.zeros(self.num_tables, dtype=torch.int64, device=device).index_add_(
                0, self.region_of_slot, (priority < _NEVER).to(torch.int64)
            )
            take = torch.minimum(misses_per_table, choosable)
        else:
            order = torch.zeros(1, dtype=torch.int64, device=device)
            take = torch.zeros_like(misses_per_table)
        first = torch.cumsum(misses_per_table, 0) - misses_per_table
        rank = torch.arange(count, device=device) - first.index_select(0, tables)
        in_region = rank < take.index_select(0, tables)
        region_position = (self.bases_device.index_select(0, tables) + rank).clamp_(max=max(region - 1, 0))
        chosen = torch.where(in_region, order.index_select(0, region_position), -1)
        overflow = int(count - take.sum())  # host sync
        if overflow:
            scratch_free = int((self._priorities(region, self.slots, protect) < _NEVER).sum())
            if scratch_free < overflow:
                scratch = self.slots - region
                self._allocate(self.slots + max(overflow - scratch_free, scratch), keep=True)
            scratch_priority = self._priorities(region, self.slots, protect)
            scratch_order = torch.argsort(scratch_priority) + region
            overflow_rank = (torch.cumsum((~in_region).to(torch.int64), 0) - 1).clamp_(min=0)
            chosen = torch.where(in_region, chosen, scratch_order.index_select(0, overflow_rank))
            self.metrics.scratch_rows += overflow
        self._move_in(chosen, tables, ids, tick)
        return chosen

    def _move_in(self, slots: torch.Tensor, tables: torch.Tensor, ids: torch.Tensor, tick: int) -> None:
        """Evict what ``slots`` hold (down to the tier below), then read ``(tables, ids)`` into them.

        Failure-safe order (a store call may raise): the victims are handed down first and only then
        forgotten here, and the missing rows are read before anything is written into their slots. A failing
        write-back leaves this tier unchanged (the victims still hold their rows); a failing read leaves the
        victims' rows below and their slots free. Either way every row lives in exactly one tier.
        """
        occupied = slots[self.valid.index_select(0, slots)]  # host sync (size)
        if occupied.numel():
            handed = (
                occupied if self.lower.keeps_clean_rows else occupied[self.dirty.index_select(0, occupied)]
            )
            if handed.numel():
                evicted = self.rows_to_host(handed)
                self.lower.give(evicted)
                self.metrics.written_back_rows += int(evicted.dirty.sum())
            self.metrics.evicted_rows += int(occupied.numel())
            self._evicted_since_aging += int(occupied.numel())
            if self._evicted_since_aging >= self.aging_turnovers * max(self.slots, 1):
                self.uses.bitwise_right_shift_(1)  # old popularity fades
                self._evicted_since_aging = 0
            # The index may still list them until the rebuild below: lookups check `valid`.
            self.valid.index_put_((occupied,), torch.zeros((), dtype=torch.bool, device=self.device))
            self.dirty.index_put_((occupied,), torch.zeros((), dtype=torch.bool, device=self.device))
        fetched = self.lower.take(tables.cpu(), ids.cpu())
        non_blocking = self.device.type == "cuda"
        self.weights.index_copy_(0, slots, fetched.weights.to(self.device, non_blocking=non_blocking))
        self.state.index_copy_(0, slots, fetched.state.to(self.device, non_blocking=non_blocking))
        self.dirty.index_put_((slots,), fetched.dirty.to(self.device))
        self.slot_ids.index_copy_(0, slots, ids)
        self.slot_tables.index_copy_(0, slots, tables)
        self.valid.index_put_((slots,), torch.ones((), dtype=torch.bool, device=self.device))
        self.stamp.index_fill_(0, slots, tick)
        self.uses.index_fill_(0, slots, 1)
        self._rebuild_index()
        count = ids.numel()
        self.metrics.inserted_rows += count
        self.metrics.bytes_to_device += count * (self.dmax + 2) * 4
        self.metrics.bytes_to_host += count * 16

    def update(self, slots: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer) -> None:
        """Apply ``optimizer`` to the rows in ``slots`` (``[U]`` unique, device) with their summed gradients
        ``grads`` (``[U, D_max]``, zero past each table's ``D``), in place; marks them dirty. No sync.

        Same arithmetic as :meth:`RowOptimizer.step_in_place` (row-wise Adagrad's mean over the row's own
        ``D`` columns); fp16 tables round the updated weights to fp16.
        """
        if optimizer.kind == "sgd":
            self.weights.index_add_(0, slots, grads, alpha=-optimizer.learning_rate)
        else:
            dims = self.dims_device.index_select(0, self.slot_tables.index_select(0, slots))
            self.state.index_add_(0, slots, grads.square().sum(1) / dims)
            scale = (
                self.state.index_select(0, slots)
                .sqrt_()
                .add_(optimizer.eps)
                .reciprocal_()
                .mul_(-optimizer.learning_rate)
            )
            self.weights.index_add_(0, slots, grads * scale[:, None])
        if self.round_fp16:
            rounded = self.weights.index_select(0, slots).half().float()
            self.weights.index_copy_(0, slots, rounded)
        self.dirty.index_put_((slots,), torch.ones((), dtype=torch.bool, device=self.device))

    def rows_to_host(self, slots: torch.Tensor) -> TierRows:
        """The rows in ``slots`` (``[K]`` device int64) copied to the host."""
        rows = TierRows(
            tables=self.slot_tables.index_select(0, slots).cpu(),
            ids=self.slot_ids.index_select(0, slots).cpu(),
            weights=self.weights.index_select(0, slots).cpu(),
            state=self.state.index_select(0, slots).cpu(),
            dirty=self.dirty.index_select(0, slots).cpu(),
        )
        self.metrics.bytes_to_host += slots.numel() * (self.dmax + 4) * 4
        return rows

    # ------------------------------------------------------------------ flush

    def flush(self) -> None:
        """Write every dirty cached row straight to the store (rows stay cached, clean), then the tier below's."""
        dirty = self.dirty.nonzero().flatten()
        if dirty.numel():
            self.lower.persist(self.rows_to_host(dirty))
            self.dirty.index_put_((dirty,), torch.zeros((), dtype=torch.bool, device=self.device))
            self.metrics.written_back_rows += int(dirty.numel())
        self.lower.flush()

    def clear(self) -> None:
        """Forget every row (after :meth:`flush`), here and below."""
        self.valid.zero_()
        self.dirty.zero_()
        self.stamp.zero_()
        self.uses.zero_()
        self._rebuild_index()
        self.lower.clear()

    def summary(self) -> dict[str, float]:
        """``hbm_*`` counters (rows and bytes moved, hit rate), the scratch pool size and the tiers below."""
        m = self.metrics
        out = {f"hbm_{name}": float(getattr(m, name)) for name in m.__slots__}
        out["hbm_hit_rate"] = m.hits / m.lookups if m.lookups else 0.0
        out["hbm_slots"] = float(self.slots)
        out["hbm_scratch_slots"] = float(self.slots - self.region_size)
        out["hbm_cached_rows"] = float(self.cached_rows())
        out.update(self.lower.summary())
        return out

    def reset_metrics(self) -> None:
        """Zero the counters here and below."""
        self.metrics = DeviceCacheMetrics()
        self.lower.reset_metrics()
