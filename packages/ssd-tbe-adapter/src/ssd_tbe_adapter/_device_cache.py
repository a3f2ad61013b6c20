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
out; sampled: each miss picks the best of a group of up to 16 of its table's slots, the groups disjoint and
walking the table's slots as a ring (:mod:`~ssd_tbe_adapter._victims`), so the choice costs per miss, not
per slot.

Index: on CUDA with Triton a device hash table of the slots' ``(table, id)`` hashes (``_hash_index``: one
launch per refill and per lookup); elsewhere the valid slots sorted by that hash (invalid
slots sort last), a lookup one ``searchsorted``, the moved rows' keys merged in after each assignment that moved
rows. Either way a lookup checks the slot's stored ``(table, id)``, so a hash collision could only make a row
look absent (probability ~``S * N / 2**64`` per batch, ``S`` slots, ``N`` lookups).

Host syncs happen only in :meth:`DeviceCache.assign` (the prefetch, or a forward without one), at most two:
one read of its counts (unique rows, misses, scratch overflow) that also brings the missing keys (copied, padded
to the batch's lookups, into a reused pinned buffer just before), and with misses one wait for a single
device-to-host copy of the victims' keys, flags and rows (the rows read from below go up in one copy nothing
waits for). After an assignment without a miss the next one's survey looks for hits only (no victim choice,
no lookup below: a cache that holds the working set does nothing else); when that finds a miss, the full
survey follows and its read is one more sync, on that batch only. Everything before the counts works on arrays padded to the batch's lookups, so no shape depends on
data until then.

Streams (CUDA): the slot metadata (index, ``(table, id)``, valid, stamps, use counts) is written only by
:meth:`DeviceCache.assign` (and ``clear``); a forward reads only ``weights`` and a backward
(:meth:`DeviceCache.update`) writes only ``weights``, ``state`` and ``dirty`` (and reads its own slots'
tables). So the lookup, hit/miss split, victim choice, the counts and missing-keys read and the reads from
the tiers below (host work) need not wait for a forward/backward in flight on another stream; ``assign``
calls its ``before_rows`` (the caller's wait for that stream) only before it reads victims' rows / flags or
writes into slots (a victim may be a slot whose batch's backward was issued but still runs: released at issue),
and before the scratch pool grows (the copy reads every row).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ssd_tbe_adapter._dram_tier import DramTier
from ssd_tbe_adapter._graphed import GraphedCalls
from ssd_tbe_adapter._hash_index import HashSlotIndex, new_slot_index
from ssd_tbe_adapter._host_tier import RowTier, TierRows
from ssd_tbe_adapter._optimizer import RowOptimizer
from ssd_tbe_adapter._row_moves import StagingBuffers, moves_on_device
from ssd_tbe_adapter._victims import MAX_USES, NEVER, TICK_BITS, VictimTables, choose_victims
from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = [
    "Assignment",
    "DeviceCache",
    "DeviceCacheMetrics",
    "LookupSource",
    "StartedAssign",
    "lookup_bucket",
    "packed_views",
    "positions",
]

_MAX_TABLES = 1 << 15  # table numbers sort as int16 keys


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Assignment:
    """The slots one batch got (device tensors; they hold its rows until the batch is released)."""

    slots: torch.Tensor  # [N] int64: the slot of each lookup
    unique_slots: torch.Tensor  # [U] int64 distinct: the batch's rows, in (table, id) order
    inverse: torch.Tensor  # [N] int64: position of each lookup's slot in unique_slots
    order: torch.Tensor  # [P] int64: the lookups (padded to P >= N; entries >= N are padding) by unique slot
    pairs: torch.Tensor  # [P] int64: the unique slot (position in unique_slots) of each of those, ascending
    inserted: int  # rows moved in from the tier below for this batch
    # [5P] int64, of which the fields above are views, each field at k * P (see packed_views): the unique
    # slots padded with the trash slot, slots, inverse (past N: the padding's), order, pairs (one copy stages
    # them all for a replay)
    packed: torch.Tensor
    # The trash slot the padding holds (the pool may grow, and the trash slot move, before the batch is staged).
    trash: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class HitSurvey:
    """What a survey found over the ``N`` padded lookups, all an assignment without misses needs (device
    tensors, ``[N]``): the batch's distinct rows ("pairs") and where each lookup's row is."""

    counts: torch.Tensor  # lookups per pair (the padding's repeats not counted), 0 past the pairs
    inverse: torch.Tensor  # position of each lookup's pair
    order: torch.Tensor  # the lookups sorted by pair (the padding's among its first lookup's)
    pairs: torch.Tensor  # the pair of each sorted lookup (ascending)
    slots: torch.Tensor  # each pair's slot here, -1 if not cached; positions past the pairs repeat the last
    touched: torch.Tensor  # each hit's slot, the trash slot elsewhere
    # A hits-only survey's [5N] (N padded lookups) assignment fields (see Assignment.packed), its hits already stamped and
    # counted when it found no miss (the graph's tensor: copied before its next replay); None for a full one.
    packed: torch.Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Survey(HitSurvey):
    """A full survey (:meth:`DeviceCache._survey`): its pairs sorted by (table, id), with the misses' victims."""

    tables: (
        torch.Tensor
    )  # unique pairs' tables, sorted by (table, id); positions past the pairs repeat the last
    ids: torch.Tensor  # unique pairs' ids
    chosen: torch.Tensor  # the region slot each miss takes (-1: none, see _victims)
    overflowing: torch.Tensor  # the misses left for the scratch pool
    at: torch.Tensor  # [N + 1]: positions of the misses among the pairs, ascending, zeros after them
    below: torch.Tensor | None  # each miss's slot in the DRAM tier (-1: absent), None without one


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class StartedAssign:
    """An assignment between :meth:`DeviceCache.start_assign` (its survey issued) and
    :meth:`DeviceCache.finish_assign`; the buffers are ``None`` for an empty batch."""

    n: int  # lookups
    key: tuple[Hashable, ...] | None  # the survey's graph key (the steady move's graph extends it)
    survey: HitSurvey | None  # a Survey, or a hits-only one (see DeviceCache._hit_survey)
    host_missing: torch.Tensor | None  # pinned: the missing keys, written by the survey
    host_read: torch.Tensor | None  # pinned: the counts (and checks), written by the survey
    tick: int
    protect: int
    verify: Callable[[list[int]], None] | None
    before_rows: Callable[[], None] | None
    checks: torch.Tensor | None
    done: Any  # CUDA event after the survey (a deferred finish waits for it), else None
    fixed: bool = (
        False  # the survey's tensors are the same at every call of its key (see DeviceCache._graphed)
    )
    extra: torch.Tensor | None = None  # a LookupSource's extra output, its first n entries (a copy)
    # A hits-only survey's full survey, issued by finish_assign if it found a miss; None after a full one.
    again: Callable[[], StartedAssign] | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class LookupSource:
    """A batch's ``n`` lookups as buffers the survey expands on the device, inside its graph: for a caller that
    derives each lookup's table (and checks of its input) from its own layout, so that this work is replayed
    with the survey instead of launched op by op (see :meth:`DeviceCache.start_assign_from`).

    ``expand(scalars)`` (capturable: no sync, fixed shapes) returns ``(tables, ids, checks, extra)``: the
    tables and ids of the lookups padded to ``lookup_bucket(n)`` (the padding repeats the first lookup), the
    ``[checks]`` int64 checks read with the counts (see :meth:`DeviceCache.assign`), and a tensor the caller
    gets back (its first ``n`` entries, copied). ``scalars``: ``[1, 3 + len(values)]`` int64 on the device:
    protect, minus the padding's lookups, then ``values``, then the batch's tick. ``key``: the sizes of the buffers ``expand``
    reads; the same key must mean the same buffers (their addresses are captured).
    """

    n: int
    key: Hashable
    values: tuple[int, ...]
    checks: int
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


# The survey's counts read by the host: unique pairs, misses, scratch overflow, free scratch slots, misses the
# DRAM tier holds, its free slots, the entries of the index here and of the DRAM tier's (then the checks).
_COUNTS = 8

_Issued = tuple[HitSurvey, torch.Tensor | None]  # a survey issued, with its LookupSource's extra output


# positions(): aranges kept per (size, device), never freed (a captured graph reads them by address).
_POSITIONS: dict[tuple[int, torch.device], torch.Tensor] = {}
_MAX_POSITIONS = 256  # sizes kept; past them each call makes its own (inside a capture: the graph's memory)


def positions(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` int64 on ``device``, made once per size (read only: a survey replayed from a graph then
    launches no kernel for it)."""
    key = (n, device)
    cached = _POSITIONS.get(key)
    if cached is None:
        cached = torch.arange(n, dtype=torch.int64, device=device)
        if len(_POSITIONS) < _MAX_POSITIONS:
            _POSITIONS[key] = cached
    return cached


def lookup_bucket(n: int) -> int:
    """The padded size of ``n`` lookups in a survey (see :class:`LookupSource`)."""
    return _bucket(n)


def packed_views(packed: torch.Tensor, n: int, unique: int) -> dict[str, torch.Tensor]:
    """The assignment fields of ``n`` lookups with ``unique`` distinct rows in ``packed`` (``[5P]``, ``P =
    lookup_bucket(n)``; see :attr:`Assignment.packed`), by :class:`Assignment`'s field names."""
    p = packed.numel() // 5
    return {
        "unique_slots": packed[:unique],
        "slots": packed[p : p + n],
        "inverse": packed[2 * p : 2 * p + n],
        "order": packed[3 * p : 4 * p],
        "pairs": packed[4 * p :],
    }


def _bucket(n: int) -> int:
    """``n`` rounded up to a multiple of 1/16 of its power of two (at least 1024): at most ~6% padding and
    16 sizes per octave, so the survey's graphs are reused."""
    step = max(1024, 1 << max(n.bit_length() - 5, 0))
    return -(-n // step) * step


def _pad(values: torch.Tensor, size: int) -> torch.Tensor:
    """``values`` (``[n] >= 1``) followed by repeats of its first element up to ``size``."""
    return torch.cat([values, values[:1].expand(size - values.numel())])


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
    steady_assigns: int = 0  # of which every miss came from the DRAM tier with no host work (see _steady)
    hit_surveys: int = 0  # assignments surveyed for hits only first (the last assignment had no miss)
    resurveys: int = 0  # of which the hits-only survey found a miss: surveyed again in full (one more sync)


def _runs(
    order: torch.Tensor, first: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The runs of equal keys in ``N > 0`` lookups sorted by key (``order``: the lookups in that order;
    ``first``: whether each sorted position starts a run). No sync.

    Returns:
        ``(counts, inverse, unique, pairs, head)``: ``[N]`` lookups per run (0 past the runs), ``[N]`` run of
        each lookup, the number of runs as a 0-dim device tensor, ``[N]`` run of each sorted position
        (ascending: ``pairs[p] == inverse[order[p]]``) and ``[N]`` sorted position of each run's first lookup
        (positions past the runs repeat the last run's).
    """
    n = order.numel()
    rank = torch.cumsum(first, 0) - 1
    inverse = torch.empty_like(order).index_copy_(0, order, rank)
    # starts[k]: sorted position of run k's first lookup, n past the last run; non-first lookups write to
    # the dummy entry n + 1 (never read). No element assignment: `t[i] = x` on CUDA is a synchronous
    # host-to-device copy.
    starts = torch.full((n + 2,), n, dtype=torch.int64, device=order.device)
    starts.index_copy_(0, torch.where(first, rank, n + 1), positions(n, order.device))
    counts = starts[1 : n + 1] - starts[:n]
    return counts, inverse, rank[-1] + 1, rank, starts[:n].clamp(max=n - 1)


def _unique_pairs(
    tables: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unique ``(table, id)`` pairs of ``N > 0`` lookups, sorted by table then id, *padded to N* (no sync).

    Two stable sorts (the second on int16 table numbers: fewer than 2**15 tables) and an adjacent compare
    (``torch.unique(dim=0)`` is several times slower).

    Returns:
        ``(tables, ids, counts, inverse, unique, order, pairs)``: ``[N]`` pairs (positions ``>= unique``
        repeat the last pair), then as :func:`_runs`, with ``order`` the lookups sorted by pair.
    """
    order = torch.argsort(ids, stable=True)
    # The tables as int16 keys (a radix sort's passes follow the key's width: 2 instead of 8 for int64).
    narrow = tables.index_select(0, order).to(torch.int16)
    order = order.index_select(0, torch.argsort(narrow, stable=True))
    sorted_tables, sorted_ids = tables.index_select(0, order), ids.index_select(0, order)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = (sorted_tables[1:] != sorted_tables[:-1]) | (sorted_ids[1:] != sorted_ids[:-1])
    counts, inverse, unique, pairs, head = _runs(order, first)
    return (
        sorted_tables.index_select(0, head),
        sorted_ids.index_select(0, head),
        counts,
        inverse,
        unique,
        order,
        pairs,
    )


def _unique_slots(
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct slots of ``N > 0`` lookups (``[N]``, ``0 <= slot < 2**31``), ascending, *padded to N* (no
    sync): one stable sort on int32 keys (4 radix passes, against the 10 of :func:`_unique_pairs`).

    Returns:
        ``(slots, counts, inverse, unique, order, pairs)``: ``[N]`` distinct slots (positions ``>= unique``
        repeat the last), then as :func:`_runs`, with ``order`` the lookups sorted by slot.
    """
    # The sorted keys come with the order (no gather of the slots by it).
    sorted_slots, order = torch.sort(slots.to(torch.int32), stable=True)
    first = torch.ones_like(sorted_slots, dtype=torch.bool)
    torch.ne(sorted_slots[1:], sorted_slots[:-1], out=first[1:])
    counts, inverse, unique, pairs, head = _runs(order, first)
    return sorted_slots.index_select(0, head).to(torch.int64), counts, inverse, unique, order, pairs


class DeviceCache:
    """Cached rows of every table on ``device`` over the tier ``lower``.

    Args:
        capacities: per table, its slots ``C_t >= 0``.
        dims: per table, its ``D``.
        device: where the buffer, index and slot metadata live.
        lower: the tier below: the host-DRAM tier indexed on the device (:class:`DramTier`: rows move by
            kernels, no host work in steady state), or a host-side tier (:class:`RowTier`: the host-indexed
            DRAM tier or the store tier; rows go through the host).
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

    aging_turnovers = 8
    """Use counts are halved after this many turnovers of the slots (``S`` evictions each)."""

    def __init__(
        self,
        capacities: Sequence[int],
        dims: Sequence[int],
        device: torch.device,
        lower: RowTier | DramTier,
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
        if self.num_tables >= _MAX_TABLES:
            raise InvalidArgumentError(
                f"`dims` lists {self.num_tables} tables; the device cache takes fewer than {_MAX_TABLES}"
            )
        self.region_size = sum(self.capacities)  # C: slots owned by tables; the scratch pool follows
        self._rings = VictimTables(self.capacities, device)
        self.dims_device = torch.tensor(self.dims, dtype=torch.float32, device=device)
        self.metrics = DeviceCacheMetrics()
        self._evicted_since_aging = 0
        # With a DramTier below, victims are counted on the device (no sync): evicted, written back, and the
        # evictions since use counts were last halved; folded into `metrics` by `summary`.
        self._moved_down = torch.zeros(3, dtype=torch.int64, device=device)
        self._staging = StagingBuffers(device)
        self._generation = 0  # bumped when the slot buffers are reallocated (the survey graphs read them)
        self._surveys: GraphedCalls[Survey] = GraphedCalls(device, self._survey)
        self._hit_surveys: GraphedCalls[HitSurvey] = GraphedCalls(device, self._hit_survey)
        # Of a LookupSource, full or hits-only (the survey is one of the graphed call's fixed arguments).
        self._sourced: GraphedCalls[tuple[HitSurvey, torch.Tensor]] = GraphedCalls(
            device, self._sourced_survey
        )
        # The last assignment had no miss: the next one's survey looks for hits only (see _hit_survey).
        self._expect_hits = False
        self._moves: GraphedCalls[torch.Tensor] = GraphedCalls(device, self._move_steady)
        self._trash: torch.Tensor | None = None  # the trash slot's number on the device (see _trash_slot)
        self._trash_value = -1
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
        # The trash slot (index `slots`) stays invalid: `valid` starts zeroed and only `[:n]` is copied (no
        # `valid[slots] = False`: an element assignment is a synchronous host-to-device copy on CUDA).
        self.weights, self.state, self.slot_ids, self.slot_tables = weights, state, slot_ids, slot_tables
        self.valid, self.dirty, self.stamp, self.uses = valid, dirty, stamp, uses
        self._index = new_slot_index(self.valid, self.slot_tables, self.slot_ids)
        self._generation += 1
        self._surveys.clear()
        self._hit_surveys.clear()
        self._sourced.clear()
        self._moves.clear()

    def cached_rows(self) -> int:
        """Rows held now (host sync: metrics only)."""
        return int(self.valid.sum())

    # ------------------------------------------------------------------ lookups

    def lookup(self, tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``(tables[i], ids[i])`` (``[N]`` int64 on the device), ``-1`` where not cached. No sync."""
        return self._index.find(tables, ids, self.valid, self.slot_tables, self.slot_ids)

    def assign(
        self,
        tables: torch.Tensor,
        ids: torch.Tensor,
        tick: int,
        protect: int,
        *,
        checks: torch.Tensor | None = None,
        verify: Callable[[list[int]], None] | None = None,
        before_rows: Callable[[], None] | None = None,
    ) -> Assignment:
        """Slots for every lookup ``(tables[i], ids[i])`` (``[N]`` int64, device): hits are touched at ``tick``,
        unique misses are read from the tier below into free or evicted slots (victims: the least used, then
        least recently used, of slots last touched before ``protect``, among a sampled group of the table's own
        slots per miss, see :mod:`~ssd_tbe_adapter._victims`; else the scratch pool, grown if needed); evicted
        rows go down.

        ``checks`` (``[K]`` int64 on the device, e.g. the caller's input checks) is read in the same copy as the
        counts and handed to ``verify`` before anything changes here: ``verify`` may raise (bad input), and then
        no slot, row, stamp or use count moved.

        ``before_rows`` (e.g. the current stream waiting for the forward/backward stream) is called before the
        first read of a row, optimizer state or dirty flag in the cache and before the first write into a
        slot; everything before it touches only the slot metadata, which no forward/backward writes.

        Host syncs: one read of four counts (unique rows, misses, scratch overflow, free scratch slots) plus
        ``checks``, with the missing keys in a copy queued before it; with misses, one wait for the victims'
        keys and rows (one device-to-host copy into reused pinned buffers). The rows read from below go up in
        one host-to-device copy that nothing waits for.

        The same as :meth:`finish_assign` of :meth:`start_assign` (which splits it at its first sync).
        """
        return self.finish_assign(
            self.start_assign(
                tables, ids, tick, protect, checks=checks, verify=verify, before_rows=before_rows
            )
        )

    def start_assign(
        self,
        tables: torch.Tensor,
        ids: torch.Tensor,
        tick: int,
        protect: int,
        *,
        checks: torch.Tensor | None = None,
        verify: Callable[[list[int]], None] | None = None,
        before_rows: Callable[[], None] | None = None,
        deferred: bool = False,
    ) -> StartedAssign:
        """:meth:`assign` up to its first host sync: the survey (device work on the current stream, nothing
        changed here). :meth:`finish_assign` does the rest; until then nothing else may assign.

        ``deferred``: the finish may come after other work was queued on this stream (say a graph replay), so
        it waits for an event recorded after the survey instead of for the whole stream.

        When the last assignment had no miss the survey looks for hits only (:meth:`_hit_survey`, about a
        quarter of the full one's kernels); if it finds a miss, :meth:`finish_assign` issues the full survey
        and waits for it too (one more sync, on that batch only)."""
        n = ids.numel()
        padded = _bucket(n)

        def start(hits_only: bool) -> StartedAssign:
            def run(
                scalars: torch.Tensor, key: tuple[Hashable, ...], fixed: tuple[torch.Tensor, ...]
            ) -> _Issued:
                inputs = [_pad(tables, padded), _pad(ids, padded), scalars]
                if checks is not None:
                    inputs.append(checks)
                calls: GraphedCalls[Survey] | GraphedCalls[HitSurvey]
                calls = self._hit_surveys if hits_only else self._surveys
                return calls(key, inputs, fixed=fixed), None

            started = self._start(
                n,
                (),
                0 if checks is None else checks.numel(),
                tick,
                protect,
                verify,
                before_rows,
                deferred,
                run,
                hits_only=hits_only,
            )
            return replace(started, checks=checks, fixed=self._graphed(self._surveys, started.key))

        return self._begin(start)

    def start_assign_from(
        self,
        source: LookupSource,
        tick: int,
        protect: int,
        *,
        verify: Callable[[list[int]], None] | None = None,
        before_rows: Callable[[], None] | None = None,
        deferred: bool = False,
    ) -> StartedAssign:
        """:meth:`start_assign` of the lookups ``source`` expands inside the survey's graph (its checks read
        with the counts and handed to ``verify``); the result's ``extra`` is ``source``'s extra output."""

        def start(hits_only: bool) -> StartedAssign:
            survey = self._hit_survey if hits_only else self._survey

            def run(
                scalars: torch.Tensor, key: tuple[Hashable, ...], fixed: tuple[torch.Tensor, ...]
            ) -> _Issued:
                found, out = self._sourced(
                    ("from", source.key, *key), [scalars], fixed=(survey, source.expand, *fixed)
                )
                return found, out[: source.n].clone()  # the graph's tensor: rewritten by its next replay

            started = self._start(
                source.n,
                source.values,
                source.checks,
                tick,
                protect,
                verify,
                before_rows,
                deferred,
                run,
                hits_only=hits_only,
            )
            key = None if started.key is None else ("from", source.key, *started.key)
            return replace(started, key=key, fixed=self._graphed(self._sourced, key))

        return self._begin(start)

    def _begin(self, start: Callable[[bool], StartedAssign]) -> StartedAssign:
        """``start(hits_only)``: hits-only when the last assignment had no miss, with the full survey kept for
        :meth:`finish_assign` to issue if it finds one."""
        self.metrics.assigns += 1
        if not self._expect_hits:
            return start(False)
        started = start(True)
        if started.survey is None:  # an empty batch: nothing surveyed
            return started
        self.metrics.hit_surveys += 1
        return replace(started, again=functools.partial(start, False))

    def _graphed(self, calls: GraphedCalls[Any], key: Hashable | None) -> bool:
        """Whether a survey's tensors are the same at every call of its key: a graph's (elsewhere than on CUDA
        the survey runs eagerly, and so does the steady move that reads it)."""
        return key is not None and (self.device.type != "cuda" or calls.captured(key))

    def _start(
        self,
        n: int,
        values: tuple[int, ...],
        checks: int,
        tick: int,
        protect: int,
        verify: Callable[[list[int]], None] | None,
        before_rows: Callable[[], None] | None,
        deferred: bool,
        run: Callable[[torch.Tensor, tuple[Hashable, ...], tuple[torch.Tensor, ...]], _Issued],
        *,
        hits_only: bool,
    ) -> StartedAssign:
        """The survey of ``n`` lookups, issued by ``run(scalars, key, fixed)``, which returns it and its source's
        extra output, if any (see :meth:`start_assign`)."""
        if n == 0:
            return StartedAssign(
                n=0,
                key=None,
                survey=None,
                host_missing=None,
                host_read=None,
                tick=tick,
                protect=protect,
                verify=verify,
                before_rows=before_rows,
                checks=None,
                done=None,
            )
        # The survey (everything up to the read of its counts) runs over the lookups padded to a bucket size,
        # as one CUDA graph replay per bucket on CUDA (same padded code eagerly elsewhere).
        padded = _bucket(n)
        dram = self.lower if isinstance(self.lower, DramTier) else None
        columns = 3 if dram is not None else 2
        host_missing = self._staging.get(f"missing{padded}", padded, columns, torch.int64)
        host_read = self._staging.get(f"read{padded}", 1, _COUNTS + checks, torch.int64)
        scalars = self._staging.get(f"scalars{len(values)}", 1, 3 + len(values), torch.int64)
        # The victim choice's bound, the padding's negative count, the source's values, the batch's tick.
        scalars.numpy()[0] = (protect, n - padded, *values, tick)
        key = (padded, columns, host_read.shape[1], self._generation, hits_only)
        moved = self._staging.copy_up(f"scalars{len(values)}", scalars, self.device)
        survey, extra = run(moved, key, (host_missing, host_read))
        done = None
        if deferred and self.device.type == "cuda":
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            done.record(torch.cuda.current_stream(self.device))
        return StartedAssign(
            n=n,
            key=key,
            survey=survey,
            host_missing=host_missing,
            host_read=host_read,
            tick=tick,
            protect=protect,
            verify=verify,
            before_rows=before_rows,
            checks=None,
            done=done,
            extra=extra,
        )

    def finish_assign(self, started: StartedAssign) -> Assignment:
        """The rest of :meth:`assign` after :meth:`start_assign` (on the stream the survey ran on): the read of
        its counts (the host sync), ``verify``, the stamps and the row moves."""
        n, verify, before_rows, tick = started.n, started.verify, started.before_rows, started.tick
        protect = started.protect
        if n == 0:
            if started.checks is not None and verify is not None:
                # host sync: only for an empty batch with checks
                verify([int(c) for c in started.checks.tolist()])
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return Assignment(
                slots=empty,
                unique_slots=empty,
                inverse=empty,
                order=empty,
                pairs=empty,
                inserted=0,
                packed=empty,
                trash=self.trash,
            )
        survey, key = started.survey, started.key
        host_missing, host_read = started.host_missing, started.host_read
        assert survey is not None
        assert key is not None
        assert host_missing is not None
        assert host_read is not None
        dram = self.lower if isinstance(self.lower, DramTier) else None
        if started.done is not None:
            started.done.synchronize()  # host sync: the survey's counts (not the work queued after it)
        elif self.device.type == "cuda":
            # host sync: the only one before the rows move
            torch.cuda.current_stream(self.device).synchronize()
        values = [int(c) for c in host_read[0].tolist()]
        counts, slots, touched = survey.counts, survey.slots, survey.touched
        u, m, overflow, free = values[:4]
        if verify is not None:
            verify(values[_COUNTS:])
        if m and started.again is not None:
            # The hits-only survey found a miss: the full survey, and the rest as after it alone.
            self._expect_hits = False
            self.metrics.resurveys += 1
            return self.finish_assign(started.again())
        self._expect_hits = not m
        # The indexes' entries as the survey saw them (rebuilt here, between batches, when crowded).
        if isinstance(self._index, HashSlotIndex):
            self._index.rebuild_if_crowded(values[6], self.valid)
        if dram is not None:
            dram.rebuild_index_if_crowded(values[7])
        if survey.packed is not None:  # a hits-only survey without a miss: its graph did the rest
            self.metrics.lookups += u
            self.metrics.hits += u
            packed = survey.packed.clone()  # the graph's tensor: rewritten by its next replay
            return Assignment(**packed_views(packed, n, u), inserted=0, packed=packed, trash=self.trash)
        # Hits: stamped and counted (unique slots: a plain copy, the trash slot takes the rest).
        self.stamp.index_fill_(0, touched, tick)
        self.uses.index_copy_(0, touched, self.uses.index_select(0, touched) + counts)
        if m:
            assert isinstance(survey, Survey)  # a hits-only survey that found misses was surveyed again
            u_tables, u_ids = survey.tables, survey.ids
            self.metrics.assigns_with_misses += 1
            found, dram_free = values[4], values[5]
            if dram is not None and self._steady(started.fixed, dram, m, overflow, found, dram_free):
                if before_rows is not None:
                    before_rows()  # victims' rows and dirty flags below; writes into the slots after
                slots = self._steady_moves(key, survey, m, tick)
                self.metrics.steady_assigns += 1
            else:
                chosen = survey.chosen
                if overflow:
                    chosen = self._overflow(chosen, survey.overflowing, overflow, free, protect, before_rows)
                at = survey.at[:m]
                new_slots = chosen.index_select(0, at)
                if dram is not None:
                    assert survey.below is not None
                    self._move_in_from_dram(
                        dram,
                        new_slots,
                        u_tables.index_select(0, at),
                        u_ids.index_select(0, at),
                        survey.below.index_select(0, at),
                        host_missing[:m],
                        found=found,
                        dram_free=dram_free,
                        tick=tick,
                        before_rows=before_rows,
                    )
                else:
                    self._move_in(
                        new_slots,
                        u_tables.index_select(0, at),
                        u_ids.index_select(0, at),
                        host_missing[:m],
                        tick,
                        before_rows,
                    )
                slots = slots.index_copy(0, at, new_slots)
            if dram is not None:
                dram.count_taken(asked=m, found=found)
            self.metrics.inserted_rows += m
            self.metrics.bytes_to_device += m * (self.dmax + 2) * 4
        self.metrics.lookups += u
        self.metrics.hits += u - m
        # One new tensor holds it all (the survey's tensors are the graph's: rewritten by its next replay).
        p = survey.order.numel()
        packed = torch.cat(
            [
                slots[:u],
                self._trash_slot().expand(p - u),
                slots.index_select(0, survey.inverse),
                survey.inverse,
                survey.order,
                survey.pairs,
            ]
        )
        return Assignment(**packed_views(packed, n, u), inserted=m, packed=packed, trash=self.trash)

    def _trash_slot(self) -> torch.Tensor:
        """``[1]`` int64 on the device: the trash slot (made again when the pool grew)."""
        if self._trash is None or self._trash_value != self.trash:
            self._trash = torch.full((1,), self.trash, dtype=torch.int64, device=self.device)
            self._trash_value = self.trash
        return self._trash

    def _sourced_survey(
        self,
        scalars: torch.Tensor,
        survey: Callable[..., HitSurvey],
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
        host_missing: torch.Tensor,
        host_read: torch.Tensor,
    ) -> tuple[HitSurvey, torch.Tensor]:
        """``survey`` (:meth:`_survey` or :meth:`_hit_survey`) of the lookups a :class:`LookupSource`'s
        ``expand`` builds (capturable)."""
        tables, ids, checks, extra = expand(scalars)
        return survey(tables, ids, scalars, checks, host_missing, host_read), extra

    def _survey(
        self,
        tables: torch.Tensor,
        ids: torch.Tensor,
        scalars: torch.Tensor,
        *rest: torch.Tensor,
    ) -> Survey:
        """The survey of ``N`` padded lookups (the padding repeats the first lookup): unique pairs, hits,
        victims for the misses, which misses the DRAM tier holds; the missing keys and the counts (plus the
        optional checks) copied into the host buffers that end ``rest``. Device work only, no sync, nothing
        changed here: capturable as a CUDA graph per ``N``.

        ``scalars``: ``[1, 3 + K]`` int64 on the device: ``protect``, minus the padding's lookups, ``K`` values
        of a :class:`LookupSource`, the batch's tick.
        """
        *checks, host_missing, host_read = rest
        n = ids.numel()
        device = self.device
        u_tables, u_ids, counts, inverse, unique, order, pairs = _unique_pairs(tables, ids)
        counts.index_add_(0, inverse[:1], scalars[0, 1:2])  # the padding's repeats of the first lookup
        protect = scalars[0, 0]
        real = positions(n, device) < unique  # padding past the unique pairs
        slots = self.lookup(u_tables, u_ids)
        hit = slots >= 0
        miss = ~hit & real
        # Up to the read of the counts nothing changes here (``verify`` may still refuse the batch): the hits
        # are protected from the victim choice by a mask, and stamped and counted only after the read.
        touched = torch.where(hit & real, slots, self.trash)  # unique slots; the trash slot takes the rest
        held = torch.zeros_like(self.valid).index_fill_(0, touched, True)
        chosen = choose_victims(
            self._rings, u_tables, miss, protect, self.stamp, self.uses, self.valid, held, self.trash
        )
        overflowing = miss & (chosen < 0)
        scratch_free = self._scratch_choosable(protect, held)
        # Positions of the misses among the pairs (ascending) at the front of `at` (zeros after them), and
        # their keys copied to the host ahead of the counts' read (which waits for it: same stream), so the
        # tiers below can be asked before anything waits for the forward/backward stream.
        rank = torch.cumsum(miss, 0) - 1
        at = torch.zeros(n + 1, dtype=torch.int64, device=device).index_copy_(
            0, torch.where(miss, rank, n), positions(n, device)
        )
        columns = [u_tables, u_ids]
        counted = [unique, miss.sum(), overflowing.sum(), scratch_free]
        below = None
        if isinstance(self.lower, DramTier):  # which misses it holds (their slots ride up with the keys)
            below, dram_free = self.lower.locate(u_tables, u_ids, miss)
            columns.append(below)
            counted += [(below >= 0).sum(), dram_free]
        else:
            counted += [unique * 0, unique * 0]
        host_missing.copy_(
            torch.stack(columns, 1).index_select(0, at[:n]), non_blocking=device.type == "cuda"
        )
        self._copy_counts(counted, checks, host_read)
        return Survey(
            tables=u_tables,
            ids=u_ids,
            counts=counts,
            inverse=inverse,
            order=order,
            pairs=pairs,
            slots=slots,
            touched=touched,
            chosen=chosen,
            overflowing=overflowing,
            at=at,
            below=below,
        )

    def _hit_survey(
        self,
        tables: torch.Tensor,
        ids: torch.Tensor,
        scalars: torch.Tensor,
        *rest: torch.Tensor,
    ) -> HitSurvey:
        """:meth:`_survey` for a batch expected to hit everywhere (the last one did): each lookup's slot from the
        index, the batch's distinct slots by one int32 sort of them (so its pairs come in slot order), and the
        counts (whether anything missed, as its miss count, 0 or 1; nothing chosen for the misses; the missing
        keys' buffer left as it is).
        Capturable, as :meth:`_survey`; its result serves an assignment only when it counted no miss.

        When it counts no miss it also does the assignment's device work here, in its graph: its rows are
        stamped with the batch's tick (the last entry of ``scalars``) and their uses counted, and the
        assignment's fields are packed (:attr:`HitSurvey.packed`); so the assignment's finish is a read and a
        copy. With a miss nothing changes (the full survey does it all)."""
        *checks, _, host_read = rest
        n = ids.numel()
        found = self.lookup(tables, ids)
        if self.fuses_updates:  # the same in four launches around the sort (see _survey_kernel)
            from ssd_tbe_adapter._survey_kernel import hit_runs

            runs = hit_runs(
                found, self.trash, scalars.view(-1), 1, scalars.numel() - 1, self.stamp, self.uses
            )
            zero = runs.unique * 0
            self._copy_counts([runs.unique, runs.misses, zero, zero, zero, zero], checks, host_read)
            return HitSurvey(
                counts=runs.counts,
                inverse=runs.inverse,
                order=runs.order,
                pairs=runs.pairs,
                slots=runs.unique_slots,
                touched=runs.touched,
                packed=runs.packed,
            )
        # A miss's lookup takes the trash slot here (its survey is discarded: finish_assign surveys again).
        slots, counts, inverse, unique, order, pairs = _unique_slots(
            torch.where(found >= 0, found, self.trash)
        )
        counts.index_add_(0, inverse[:1], scalars[0, 1:2])  # the padding's repeats of the first lookup
        touched = torch.where(positions(n, self.device) < unique, slots, self.trash)
        # Whether any lookup missed (1) or none (0): the trash slot, above every other, is then the last
        # distinct slot (positions past the pairs repeat it). No count: a miss means a full survey anyway.
        misses = (slots[-1:] == self.trash).to(torch.int64)[0]
        # No miss: the hits stamped and counted (unique slots: plain copies, the trash slot takes the rest).
        hits_all = misses == 0
        tick = scalars[0, -1]
        # (with a miss every stamp goes to the trash slot instead: no read of the stamps)
        self.stamp.index_copy_(0, torch.where(hits_all, touched, self.trash), tick.expand(n))
        self.uses.index_copy_(0, touched, self.uses.index_select(0, touched) + counts * hits_all)
        packed = torch.cat([touched, slots.index_select(0, inverse), inverse, order, pairs])
        zero = unique * 0
        self._copy_counts([unique, misses, zero, zero, zero, zero], checks, host_read)
        return HitSurvey(
            counts=counts,
            inverse=inverse,
            order=order,
            pairs=pairs,
            slots=slots,
            touched=touched,
            packed=packed,
        )

    def _copy_counts(
        self, counted: list[torch.Tensor], checks: list[torch.Tensor], host_read: torch.Tensor
    ) -> None:
        """The survey's first six counts (0-dim), the entries of the indexes here and of the DRAM tier's, then
        the checks (``[K]``, if any), copied into ``host_read`` (``[1, _COUNTS + K]``, pinned) in one copy."""
        zero = counted[0] * 0
        index_entries = self._index.entries if isinstance(self._index, HashSlotIndex) else zero
        dram_entries = self.lower.index_entries() if isinstance(self.lower, DramTier) else None
        read = torch.stack([*counted, index_entries, zero if dram_entries is None else dram_entries])
        if checks:
            read = torch.cat([read, checks[0]])
        host_read.copy_(read[None], non_blocking=self.device.type == "cuda")

    def _priorities(self, start: int, stop: int, protect: int | torch.Tensor) -> torch.Tensor:
        """Victim priority of slots ``[start, stop)`` (lowest first): -1 free, else (uses, last-use tick) as one
        int64, ``NEVER`` if protected (used at or after ``protect``)."""
        stamp = self.stamp[start:stop]
        key = (self.uses[start:stop].clamp(max=MAX_USES) << TICK_BITS) + stamp
        protected = stamp >= protect
        return torch.where(
            protected, NEVER, torch.where(self.valid[start:stop], key, torch.full_like(stamp, -1))
        )

    def _scratch_choosable(self, protect: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        """Scratch slots that are not protected (free, or a victim candidate; ``held``: the batch's hits),
        0-dim. No sync."""
        region, slots = self.region_size, self.slots
        return ((self.stamp[region:slots] < protect) & ~held[region:slots]).sum()

    def _steady(self, fixed: bool, dram: DramTier, m: int, overflow: int, found: int, free: int) -> bool:
        """Whether an assignment's ``m`` misses need nothing of the host: every one in the DRAM tier, room there
        for the victims, no scratch growth, and (on CUDA) its survey replayed from a graph: the move's graph
        reads the survey's tensors, which must be the same at every call (elsewhere both run eagerly)."""
        room = min(m, dram.capacity) - free - found <= 0
        return not overflow and found == m and m <= dram.capacity and room and fixed

    def _steady_moves(self, key: tuple[Hashable, ...], survey: Survey, m: int, tick: int) -> torch.Tensor:
        """The ``m`` misses of a steady assignment (see :meth:`_steady`) moved in from the DRAM tier as one
        CUDA graph replay per (survey, padded ``m``) (the first call eager): the survey's slots with them."""
        padded = _bucket(m)
        scalars = self._staging.get("move_scalars", 1, 2, torch.int64)
        scalars.numpy()[0] = (m, tick)
        fixed = (
            survey.tables,
            survey.ids,
            survey.at,
            survey.below,
            survey.chosen,
            survey.slots,
        )
        moving = self._staging.copy_up("move_scalars", scalars, self.device)
        return self._moves((*key, padded), [moving], fixed=(padded, *fixed))

    def _move_steady(
        self,
        scalars: torch.Tensor,
        padded: int,
        tables: torch.Tensor,
        ids: torch.Tensor,
        at: torch.Tensor,
        below: torch.Tensor | None,
        chosen: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`_steady_moves`'s work over the misses padded to ``padded`` (the padding moves nothing: its
        slot is the trash slot, its DRAM slot -1) into the slots the survey chose. ``scalars``: ``[1, 2]`` int64,
        the misses and the tick. Device work only: capturable."""
        dram = self.lower
        assert isinstance(dram, DramTier)
        assert below is not None
        n = slots.numel()
        count, tick = scalars[0, 0], scalars[0, 1]
        at = at[:padded]
        live = torch.arange(padded, device=self.device) < count
        new_slots = torch.where(live, chosen.index_select(0, at), self.trash)
        new_tables = torch.where(live, tables.index_select(0, at), 0)
        new_ids = torch.where(live, ids.index_select(0, at), 0)
        moved = self._hand_down(dram, new_slots, torch.where(live, below.index_select(0, at), -1), None, 0)
        self._fill_slots(new_slots, new_tables, new_ids, moved, tick)
        out = torch.cat([slots, slots[:1]]).index_copy_(0, torch.where(live, at, n), new_slots)
        return out[:n]

    def _overflow(
        self,
        chosen: torch.Tensor,
        overflowing: torch.Tensor,
        overflow: int,
        free: int,
        protect: int,
        before_rows: Callable[[], None] | None,
    ) -> torch.Tensor:
        """``chosen`` with scratch slots for the ``overflow`` misses marked in ``overflowing`` (the pool grown
        first when fewer than that are ``free``: after ``before_rows``, the copy reads every row)."""
        region = self.region_size
        if free < overflow:
            if before_rows is not None:
                before_rows()
            scratch = self.slots - region
            self._allocate(self.slots + max(overflow - free, scratch), keep=True)
        scratch_order = torch.argsort(self._priorities(region, self.slots, protect)) + region
        overflow_rank = (torch.cumsum(overflowing, 0) - 1).clamp_(0, scratch_order.numel() - 1)
        self.metrics.scratch_rows += overflow
        return torch.where(overflowing, scratch_order.index_select(0, overflow_rank), chosen)

    def _move_in(
        self,
        slots: torch.Tensor,
        tables: torch.Tensor,
        ids: torch.Tensor,
        host_keys: torch.Tensor,
        tick: int,
        before_rows: Callable[[], None] | None,
    ) -> None:
        """Read ``(tables, ids)`` (``[M]`` device; ``host_keys`` ``[M, 2]`` the same on the host) from the tier
        below into ``slots`` (``[M]``, distinct), evicting what they hold (down to the tier below).

        Order: the missing rows are read from below first (host work, written straight into the pinned
        staging buffer, and sent up) without waiting for anything on the device; then ``before_rows``; then
        one device-to-host copy carries every victim slot's key, flags and row (one wait), the victims are
        picked out on the host and handed down, and only then are the slots written.

        Failure-safe (a store call may raise): a failing read changes no tier; a failing write-back hands the
        rows just taken back down (the dirty ones: they fit in the slots the take freed, so that can't call the
        store; clean ones are in the store already) and leaves this tier unchanged (the victims still hold
        their rows). Either way every row lives in exactly one tier.
        """
        m, dmax, device = ids.numel(), self.dmax, self.device
        lower = self.lower
        assert not isinstance(lower, DramTier)
        up = self._staging.get("up", m, dmax + 2, torch.float32)
        fetched = lower.take(host_keys[:, 0].clone(), host_keys[:, 1].clone(), out=up)
        # The copy up touches no cache state: it may run while a backward still updates the victims.
        moved = self._staging.copy_up("up", up, device)
        if before_rows is not None:
            before_rows()  # victims' rows and dirty flags below; writes into the slots after
        flags = self.valid.index_select(0, slots).to(torch.int64) | (
            self.dirty.index_select(0, slots).to(torch.int64) << 1
        )
        keys_np, rows_np = self._slots_to_host(slots, [flags], "down")
        self.metrics.bytes_to_host += m * (3 * 8 + (dmax + 1) * 4)
        host_flags = keys_np[:, 2]
        occupied = (host_flags & 1).astype(np.bool_)
        handed = occupied if lower.keeps_clean_rows else (host_flags == 3)
        evicted = int(occupied.sum())
        if evicted:
            picked = np.flatnonzero(handed)
            if picked.shape[0]:
                # Every slot handed down (a host tier's steady state): views of the staging buffers, no copy
                # before the tier's own.
                every = picked.shape[0] == m
                victims = TierRows(
                    tables=torch.from_numpy(keys_np[:, 0] if every else keys_np[picked, 0]),
                    ids=torch.from_numpy(keys_np[:, 1] if every else keys_np[picked, 1]),
                    weights=torch.from_numpy(rows_np[:, :dmax] if every else rows_np[picked, :dmax]),
                    state=torch.from_numpy(rows_np[:, dmax] if every else rows_np[picked, dmax]),
                    dirty=torch.from_numpy((host_flags[picked] & 2).astype(np.bool_)),
                )
                try:
                    lower.give(victims)
                except BaseException:
                    if bool(fetched.dirty.any()):
                        lower.give(fetched.select(fetched.dirty))
                    raise
                self.metrics.written_back_rows += int(np.count_nonzero(host_flags[picked] == 3))
            self.metrics.evicted_rows += evicted
            self._evicted_since_aging += evicted
            if self._evicted_since_aging >= self.aging_turnovers * max(self.slots, 1):
                self.uses.bitwise_right_shift_(1)  # old popularity fades
                self._evicted_since_aging = 0
        self._fill_slots(slots, tables, ids, moved, tick)

    def _move_in_from_dram(
        self,
        dram: DramTier,
        slots: torch.Tensor,
        tables: torch.Tensor,
        ids: torch.Tensor,
        below: torch.Tensor,
        host_keys: torch.Tensor,
        *,
        found: int,
        dram_free: int,
        tick: int,
        before_rows: Callable[[], None] | None,
    ) -> None:
        """Move ``(tables, ids)`` (``[M]`` device) into ``slots`` (``[M]``, distinct) from the DRAM tier below
        (``below``: their slots there, ``-1`` where absent; ``found`` of them held there, ``dram_free`` free
        slots there; ``host_keys`` ``[M, 3]`` the same on the host), evicting what the slots hold into it.

        In steady state (every row in the tier, room for the victims) this is device work only: one kernel
        gathers the rows up from pinned host memory, one scatters the victims down, nothing is read back. The
        host steps in only for rows the tier lacks (a store read) and for room when it is full (one wait, store
        writes), both before anything changes, so a failing store call changes no tier.
        """
        m = ids.numel()
        read = dram.read_below(host_keys, m - found)  # store reads (host): may raise, nothing changed
        dram.make_room(min(m, dram.capacity) - dram_free - found, below)  # when full: store writes, may raise
        if before_rows is not None:
            before_rows()  # victims' rows and dirty flags below; writes into the slots after
        moved = self._hand_down(dram, slots, below, read, max(m - dram.capacity, 0))
        self._fill_slots(slots, tables, ids, moved, tick)

    def _hand_down(
        self,
        dram: DramTier,
        slots: torch.Tensor,
        below: torch.Tensor,
        read: tuple[torch.Tensor, torch.Tensor] | None,
        spill: int,
    ) -> torch.Tensor:
        """The rows for ``slots`` (``[M]``) from the DRAM tier (``below``: their slots there) and ``read`` (the
        store's), as ``[M, D_max + 2]``; the slots' victims kept there (the first ``spill`` ones to the store:
        more victims than the tier holds). Counted on the device; no sync unless ``spill``."""
        occupied = self.valid.index_select(0, slots)
        dirty = self.dirty.index_select(0, slots)
        evicted = occupied.sum()
        written = (occupied & dirty).sum()
        victim_tables = self.slot_tables.index_select(0, slots)
        victim_ids = self.slot_ids.index_select(0, slots)
        if spill > 0:
            occupied = self._spill(dram, slots, occupied, dirty, spill)
        victims = torch.cat(
            [self.weights.index_select(0, slots), self.state.index_select(0, slots)[:, None]], 1
        )
        moved = torch.empty(slots.numel(), self.dmax + 2, dtype=torch.float32, device=self.device)
        dram.take_up(below, read, moved)
        dram.keep(victim_tables, victim_ids, victims, dirty, occupied)
        # Counted on the device (no sync): evicted, written back, evicted since the use counts were halved.
        self._moved_down += torch.stack([evicted, written, evicted])
        aged = self._moved_down[2] >= self.aging_turnovers * max(self.slots, 1)
        self.uses.bitwise_right_shift_(aged.to(torch.int64))  # old popularity fades
        self._moved_down[2:].mul_((~aged).to(torch.int64))
        return moved

    def _spill(
        self, dram: DramTier, slots: torch.Tensor, occupied: torch.Tensor, dirty: torch.Tensor, count: int
    ) -> torch.Tensor:
        """``occupied`` without the first ``count`` occupied victims in ``slots``, whose dirty rows go straight to
        the store (clean ones are there): victims that the DRAM tier cannot hold (a batch missing more rows than
        the tier holds). One device-to-host copy of every victim's key, flags and row, one wait."""
        dmax = self.dmax
        keys_np, rows_np = self._slots_to_host(slots, [occupied.long(), dirty.long()], "spill")
        out = np.flatnonzero(keys_np[:, 2])[:count]
        if out.shape[0] == 0:
            return occupied
        at = out[keys_np[out, 3] != 0]
        if at.shape[0]:
            dram.persist(
                TierRows(
                    tables=torch.from_numpy(keys_np[at, 0]),
                    ids=torch.from_numpy(keys_np[at, 1]),
                    weights=torch.from_numpy(rows_np[at, :dmax]),
                    state=torch.from_numpy(rows_np[at, dmax]),
                    dirty=torch.ones(at.shape[0], dtype=torch.bool),
                )
            )
        return occupied.index_fill(0, torch.from_numpy(out).to(self.device), False)

    def _slots_to_host(
        self, slots: torch.Tensor, flags: list[torch.Tensor], name: str
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.float32]]]:
        """Each slot's ``(table, id, *flags)`` (``flags``: ``[M]`` int64 columns) and row (weights, state) on the
        host, as numpy views (faster row picks there) of reused pinned buffers: one copy each, one wait."""
        m, cuda = slots.numel(), self.device.type == "cuda"
        keys = torch.stack(
            [self.slot_tables.index_select(0, slots), self.slot_ids.index_select(0, slots), *flags], 1
        )
        rows = torch.cat([self.weights.index_select(0, slots), self.state.index_select(0, slots)[:, None]], 1)
        host_keys = self._staging.get(f"{name}_keys", m, keys.shape[1], torch.int64)
        host_rows = self._staging.get(f"{name}_rows", m, self.dmax + 1, torch.float32)
        host_keys.copy_(keys, non_blocking=cuda)
        host_rows.copy_(rows, non_blocking=cuda)
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()  # host sync: the slots' rows
        return host_keys.numpy(), host_rows.numpy()

    def _fill_slots(
        self,
        slots: torch.Tensor,
        tables: torch.Tensor,
        ids: torch.Tensor,
        moved: torch.Tensor,
        tick: int | torch.Tensor,
    ) -> None:
        """Write the rows ``moved`` (``[M, D_max + 2]``: weights, state, dirty) of ``(tables, ids)`` into ``slots``,
        stamped at ``tick``, and merge them into the index. ``slots`` may repeat the trash slot (padding): it stays
        invalid and clean (so neither the index nor a flush ever sees it)."""
        dmax = self.dmax
        self.weights.index_copy_(0, slots, moved[:, :dmax])
        self.state.index_copy_(0, slots, moved[:, dmax])
        self.dirty.index_copy_(0, slots, moved[:, dmax + 1] != 0)
        self.slot_ids.index_copy_(0, slots, ids)
        self.slot_tables.index_copy_(0, slots, tables)
        self.valid.index_fill_(0, slots, True)
        if isinstance(
            tick, torch.Tensor
        ):  # index_fill_ would read a tensor value on the host (not capturable)
            self.stamp.index_copy_(0, slots, tick.expand(slots.numel()))
        else:
            self.stamp.index_fill_(0, slots, tick)
        self.uses.index_fill_(0, slots, 1)
        self.valid[self.trash :].zero_()  # slice fills: no host copy
        self.dirty[self.trash :].zero_()
        self._index.set_keys(slots, tables, ids)
        self._index.merge(self.valid, slots)

    def update(self, slots: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer) -> None:
        """Apply ``optimizer`` to the rows in ``slots`` (``[U]`` unique, device) with their summed gradients
        ``grads`` (``[U, D_max]``, zero past each table's ``D``), in place; marks them dirty. No sync.
        ``slots`` may repeat the trash slot with zero gradients (a padded batch): it is left as it was.

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
        self.dirty[self.trash :].zero_()  # `slots` may be padded with the trash slot: it stays clean

    @property
    def fuses_updates(self) -> bool:
        """Whether :meth:`update_from_bags` runs here (CUDA with Triton; :meth:`pool` then runs one launch)."""
        return self.device.type == "cuda" and moves_on_device(self.device)

    def pool(
        self,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """Each bag's rows summed into ``out`` (``[bags, W]`` float32, ``W <= D_max``; any row stride): bags of
        ``slots`` by ``offsets`` (``[bags + 1]`` int64), times ``per_sample_weights`` if given. On CUDA with
        Triton one launch straight into ``out`` (:mod:`~ssd_tbe_adapter._pool_kernel`), elsewhere
        ``embedding_bag`` and a copy. No sync."""
        if self.fuses_updates and (per_sample_weights is None or per_sample_weights.dtype == torch.float32):
            from ssd_tbe_adapter._pool_kernel import pool_sum

            pool_sum(self.weights, slots, offsets, per_sample_weights, out)
            return
        pooled = F.embedding_bag(
            slots,
            self.weights,
            offsets,
            mode="sum",
            per_sample_weights=per_sample_weights,
            include_last_offset=True,
        )
        out.copy_(pooled[:, : out.shape[1]])

    def update_from_bags(
        self,
        slots: torch.Tensor,
        order: torch.Tensor,
        pairs: torch.Tensor,
        grad_bags: torch.Tensor,
        bag_of_lookup: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        optimizer: RowOptimizer,
    ) -> None:
        """:meth:`update` with each row's gradient summed from its lookups' bag gradients in the same kernel
        (two launches; see :mod:`~ssd_tbe_adapter._update_kernel`): ``slots`` (``[U]``, the trash slot skipped)
        as an :class:`Assignment`'s ``unique_slots`` with its ``order`` and ``pairs``; ``grad_bags``
        ``[bags, D_max]``; ``bag_of_lookup`` and ``per_sample_weights`` per lookup. Only where
        :attr:`fuses_updates`. No sync."""
        from ssd_tbe_adapter._update_kernel import fused_update

        fused_update(
            grad_bags.contiguous(),
            bag_of_lookup,
            per_sample_weights,
            order,
            pairs,
            slots,
            self.slot_tables,
            self.dims_device,
            self.weights,
            self.state,
            self.dirty,
            lookups=bag_of_lookup.numel(),
            trash=self.trash,
            learning_rate=optimizer.learning_rate,
            eps=optimizer.eps,
            adagrad=optimizer.kind != "sgd",
            round_fp16=self.round_fp16,
        )

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
        self._index.rebuild(self.valid)
        self.lower.clear()

    def summary(self) -> dict[str, float]:
        """``hbm_*`` counters (rows and bytes moved, hit rate), the scratch pool size and the tiers below."""
        m = self.metrics
        if isinstance(self.lower, DramTier):  # the victims counted on the device (a host sync: metrics)
            evicted, written = (int(v) for v in self._moved_down[:2].tolist())
            self._moved_down[:2].zero_()
            m.evicted_rows += evicted
            m.written_back_rows += written
            m.bytes_to_host += evicted * (self.dmax + 1) * 4
        out = {f"hbm_{name}": float(getattr(m, name)) for name in m.__slots__}
        out["hbm_hit_rate"] = m.hits / m.lookups if m.lookups else 0.0
        out["hbm_slots"] = float(self.slots)
        out["hbm_scratch_slots"] = float(self.slots - self.region_size)
        # Every kind of survey graph: full or hits-only, of tables and ids (start_assign) or of a LookupSource.
        surveys = (self._surveys, self._hit_surveys, self._sourced)
        out["hbm_survey_graph_replays"] = float(sum(calls.replays for calls in surveys))
        out["hbm_survey_graph_captures"] = float(sum(calls.captures for calls in surveys))
        out["hbm_move_graph_replays"] = float(self._moves.replays)
        out["hbm_cached_rows"] = float(self.cached_rows())
        out.update(self.lower.summary())
        return out

    def reset_metrics(self) -> None:
        """Zero the counters here and below."""
        self.metrics = DeviceCacheMetrics()
        self._moved_down[:2].zero_()
        self.lower.reset_metrics()
