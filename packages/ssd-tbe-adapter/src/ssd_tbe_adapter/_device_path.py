"""The device-cache path of :class:`~ssd_tbe_adapter.KeyValueEmbeddingBags`: one direction of flow per batch.

1. **Plan** (host, no sync): :func:`~ssd_tbe_adapter._plan.plan_batch` checks the inputs' types, shapes and
   batch sizes and lays out the output; the values of ``offsets`` are checked on the device (step 2); the
   table of each lookup is derived on the device from ``offsets``.
2. **Ask the tiers for slots** (prefetch, or forward without one): :meth:`DeviceCache.assign` maps every
   lookup to a cache slot, moving missing rows up from the host tier / store and evicted rows down. This is
   the only step that syncs with the host (the ``offsets`` checks ride on its one read of counts, and bad
   ``offsets`` raise before anything moved), and the only device <-> host traffic (missing ids, rows).
3. **Pool and update over the slots** (forward / backward, no host sync): one ``embedding_bag`` over the
   cache buffer as a table (all tables side by side, padded to the widest), written out with the module's
   output layout (:mod:`~ssd_tbe_adapter._layout`: VBE and ``vbe_output`` as before); backward sums each
   row's gradient with one ``index_add_`` and applies the row optimizer to the slots in place.

Protection: every prefetched or forwarded batch holds a tick until its backward ran (or its graph died, or
at once for a forward without autograd); slots touched at or after the oldest held tick are never victims,
so the slots a batch was given stay its rows' home until its update is applied. Streams (CUDA): prefetch
runs on the stream current at its call (the pipeline's prefetch stream). It waits for the last assignment's
work (the slot metadata it wrote, whatever stream it ran on) at once, but for the last forward/backward's work
only before it reads victims' rows or writes into slots (:meth:`DeviceCache.assign`'s ``before_rows``): a
backward writes rows, optimizer state and dirty flags, never the slot metadata, and a batch's slots are
released when its backward is *issued*, so a victim may be a slot that backward is still updating. The id
lookup, victim choice, the counts and missing-keys read and the tiers' host work below thus overlap a
backward in flight on the main stream. Forward and backward wait for the last prefetch's work. The ids and
offsets handed to prefetch must be ready on its stream (the pipeline's handoff).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import torch

from ssd_tbe_adapter._device_cache import (
    DeviceCache,
    LookupSource,
    StartedAssign,
    lookup_bucket,
    packed_views,
    positions,
)
from ssd_tbe_adapter._dram_tier import DramTier
from ssd_tbe_adapter._host_tier import HostTier, RowTier, StoreTier
from ssd_tbe_adapter._layout import (
    allocate_output,
    bag_grads,
    chained_input_grad,
    one_block_start,
    place_pooled,
)
from ssd_tbe_adapter._optimizer import RowOptimizer
from ssd_tbe_adapter._plan import Plan, check_offset_values, plan_batch
from ssd_tbe_adapter._row_moves import moves_on_device
from ssd_tbe_adapter._tier import CacheTier
from ssd_tbe_adapter.errors import InvalidArgumentError, StaleCaptureError

__all__ = ["DevicePath"]

# Pending prefetches beyond this many (batches no forward came for) are retired, oldest first, so that the
# rows they protect do not pile up.
_MAX_PENDING = 16


@dataclass(eq=False)  # no slots: weakref.finalize needs a __weakref__ (weakref_slot is Python 3.11+)
class _Batch:
    """One batch's lookups mapped to cache slots (device tensors) and its protection tick."""

    indices: torch.Tensor  # the caller's tensor (see _same_batch for which forward reuses the prefetch)
    offsets: torch.Tensor
    slots: torch.Tensor  # [N] int64: cache slot of each lookup
    unique_slots: torch.Tensor  # [U] int64 distinct: the batch's rows
    inverse: torch.Tensor  # [N] int64: position of each lookup's slot in unique_slots
    order: torch.Tensor  # [P] int64: the lookups by unique slot (P >= N; entries >= N are padding)
    pairs: torch.Tensor  # [P] int64: the unique slot (position in unique_slots) of each of those, ascending
    bag_of_lookup: torch.Tensor  # [N] int64
    # [5P] int64 whose views the slot fields are (see Assignment.packed): one copy stages them
    packed: torch.Tensor
    trash: int  # the trash slot its padding holds
    tick: int
    version: int  # indices._version at prefetch: an in-place change of the ids voids the prefetch
    num_bags: list[int]  # per feature


@dataclass(eq=False)
class _Failed:
    """A prefetch whose store call raised: its batch (to match the forward that raises it) and the error."""

    indices: torch.Tensor
    offsets: torch.Tensor
    num_bags: list[int]
    version: int
    error: Exception


@dataclass(frozen=True, slots=True)
class _Started:
    """A batch's assignment with its survey issued (:meth:`DevicePath._start`), not yet finished."""

    plan: Plan
    indices: torch.Tensor
    offsets: torch.Tensor
    bag_of_lookup: torch.Tensor
    version: int  # indices._version at the prefetch call
    cache: StartedAssign
    stream: Any  # the CUDA stream it was issued on (its finish runs there), None on the CPU


def _failed(
    plan: Plan, indices: torch.Tensor, offsets: torch.Tensor, version: int, error: Exception
) -> _Failed:
    return _Failed(indices=indices, offsets=offsets, num_bags=plan.num_bags, version=version, error=error)


class DevicePath:
    """The device-managed cache of one module, its tiers and its pooled lookup / fused update.

    Args:
        tier: the module's cache tier (store access, record layout, initialisation, store counters).
        capacities: per table, its device cache slots.
        dims: per table, its ``D``.
        feature_table_map: per feature, its table.
        device: where the cache lives (CPU or one CUDA device).
        host_cache_rows: rows of the host-DRAM tier (0: none, the store is the next tier). Indexed on the
            device, its rows moved by kernels (:class:`DramTier`) where the device can (the CPU, CUDA with
            Triton); else indexed on the host (:class:`HostTier`).
        round_fp16: fp16 tables (updated weights are rounded to fp16).
    """

    def __init__(
        self,
        tier: CacheTier,
        capacities: Sequence[int],
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        device: torch.device,
        *,
        host_cache_rows: int,
        round_fp16: bool,
    ) -> None:
        self._dims = list(dims)
        self._ftm = list(feature_table_map)
        self._feature_dims = [self._dims[t] for t in self._ftm]
        self._device = device
        self._cuda = device.type == "cuda"
        store: RowTier = StoreTier(tier, dims, pin=self._cuda)
        lower: RowTier | DramTier = store
        if host_cache_rows and moves_on_device(device):
            lower = DramTier(host_cache_rows, dims, store, device)
        elif host_cache_rows:
            lower = HostTier(host_cache_rows, dims, store, pin=self._cuda)
        self.cache = DeviceCache(capacities, dims, device, lower, round_fp16=round_fp16)
        self._tick = 0
        self._open: set[int] = set()  # ticks of batches whose rows must not move
        self._pending: deque[_Batch | _Failed] = deque()
        self._tables_of_bags: dict[tuple[int, ...], torch.Tensor] = {}
        # A prefetch's ids, offsets and bags' tables, per (padded lookups, padded bags): the survey's graph
        # reads them by address (its key names the generation: bumped when the dict is cleared).
        self._lookup_buffers: dict[tuple[int, int], _LookupBuffers] = {}
        self._buffers_generation = 0
        self._main_event: Any = None
        self._insert_event: Any = None
        # Captured forwards (CUDA graphs) read a batch's slots from these, per lookup count N.
        self._static: dict[int, _Batch] = {}
        self._staged: list[_Batch] = []  # batches staged for a replay, released when it was issued
        self._started: _Started | None = None  # a prefetch issued with complete=False, not finished yet
        self.static_mode = False  # forwards read the static buffers as under a capture (see in_capture)
        self.counters = dict.fromkeys(
            ("forwards", "forwards_without_prefetch", "prefetches", "forward_lookups", "forward_hits"), 0
        )
        self.counters.update(sync_fetched_rows=0, prefetched_rows=0)

    # ------------------------------------------------------------------ public (called by the module)

    def prefetch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        batch_sizes: list[list[int]] | None,
        *,
        complete: bool = True,
    ) -> None:
        """Map a future batch to slots now (rows move in on the current stream); bad input raises here, a store
        error is kept and raised by the forward of that batch or by :meth:`wait`, once.

        ``complete=False``: only the assignment's survey is issued now (device work, no host sync); the rest
        (its one sync, the row moves, on this same stream) runs at :meth:`complete`, or at the next call that
        needs it (prefetch, wait, forward, flush, clear, close, a stage of another batch). Bad ``offsets``
        values then raise there."""
        self.complete()
        plan, _ = self._plan(indices, offsets, None, batch_sizes, None, None)
        try:
            started = self._start(plan, indices, offsets, deferred=not complete)
        except InvalidArgumentError:  # bad input: nothing changed, nothing queued
            raise
        except Exception as error:  # no tier changed (see DeviceCache._move_in): nothing to undo
            self._queue(_failed(plan, indices, offsets, indices._version, error))
            return
        if complete:
            self._finish_prefetch(started)
        else:
            self._started = started

    def complete(self) -> None:
        """Finish the prefetch issued with ``complete=False`` (if any): its sync and row moves, on the stream
        it was issued on. Bad ``offsets`` raise here (the prefetch is dropped); a store error is kept for its
        batch's forward."""
        started, self._started = self._started, None
        if started is not None:
            with (
                torch.cuda.stream(started.stream) if started.stream is not None else contextlib.nullcontext()
            ):
                self._finish_prefetch(started)

    def _finish_prefetch(self, started: _Started) -> None:
        item: _Batch | _Failed
        try:
            item = self._finish(started, "prefetched_rows")
        except InvalidArgumentError:  # bad `offsets` (checked on the device): nothing changed, nothing queued
            raise
        except Exception as error:  # no tier changed (see DeviceCache._move_in): nothing to undo
            item = _failed(started.plan, started.indices, started.offsets, started.version, error)
        self._queue(item)

    def _queue(self, item: _Batch | _Failed) -> None:
        self.counters["prefetches"] += 1
        self._pending.append(item)
        while len(self._pending) > _MAX_PENDING:  # prefetches no forward came for
            self._retire(self._pending.popleft())

    def wait(self, *, raise_failed: bool = True) -> None:
        """Prefetches run at their call: drop the failed ones; raise the first one's error when ``raise_failed``
        (once: it is dropped)."""
        self.complete()
        failed = [item for item in self._pending if isinstance(item, _Failed)]
        for item in failed:
            self._pending.remove(item)
        if failed and raise_failed:
            raise failed[0].error

    def _retire(self, item: _Batch | _Failed) -> None:
        if isinstance(item, _Batch):
            self._open.discard(item.tick)

    def _find(
        self, indices: torch.Tensor, offsets: torch.Tensor, batch_sizes: list[list[int]] | None
    ) -> int | None:
        """Position of the first pending prefetch of this forward's batch, ``None`` when none is."""
        try:
            if batch_sizes is not None:
                num_bags = [sum(sizes) for sizes in batch_sizes]
            else:
                num_bags = [(offsets.numel() - 1) // len(self._ftm)] * len(self._ftm)
        except TypeError:  # malformed sizes: plan_batch says what is wrong
            return None
        return next(
            (k for k, item in enumerate(self._pending) if _same_batch(item, indices, offsets, num_bags)), None
        )

    def forward(
        self,
        anchor: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        batch_sizes: list[list[int]] | None,
        vbe_output: torch.Tensor | None,
        vbe_output_offsets: torch.Tensor | None,
        optimizer: RowOptimizer,
        pooling: Literal["sum", "mean"],
    ) -> torch.Tensor:
        """The pooled lookup (see :meth:`KeyValueEmbeddingBags.forward`).

        Uses the first pending prefetch of this batch (earlier ones are retired: their batches never came);
        without one the queue stays as it is and the batch gets its slots here (host syncs)."""
        # The plan before the queue changes (bad input raises first). The values of `offsets` were checked by
        # the prefetch, or are checked by the assignment below.
        plan, _ = self._plan(
            indices, offsets, per_sample_weights, batch_sizes, vbe_output, vbe_output_offsets
        )
        psw = None if per_sample_weights is None else per_sample_weights.to(torch.float32)
        if self.in_capture():
            return self._captured_forward(anchor, plan, indices, offsets, psw, vbe_output, optimizer, pooling)
        self.complete()
        batch = self._take(plan, indices, offsets, self._find(indices, offsets, batch_sizes))
        if batch.offsets is not offsets:  # same ids, offsets rebuilt by the caller: bag each lookup anew
            batch = replace(batch, offsets=offsets, bag_of_lookup=_bag_of_lookup(offsets, indices.numel()))
        self._wait_insert()
        if torch.is_grad_enabled():
            # Held until backward ran or the graph is gone, whichever comes first.
            weakref.finalize(batch, self._open.discard, batch.tick)
            # autograd.Function.apply is untyped in torch's stubs.
            result = _SlotBagFunction.apply(  # type: ignore[no-untyped-call]
                anchor, psw, vbe_output, self, plan, batch, optimizer, pooling
            )
            output = cast(torch.Tensor, result)
        else:
            output, _ = self.pool(plan, batch, psw, vbe_output, pooling, False)
            self._open.discard(batch.tick)
        self._record_main()
        return output

    def _take(
        self, plan: Plan | None, indices: torch.Tensor, offsets: torch.Tensor, match: int | None
    ) -> _Batch:
        """A forward's (or a replay's) slots: the pending prefetch at ``match`` (the ones before it retired: their
        batches never came; a failed one raises its store error), else assigned now (host syncs; ``plan`` is
        needed then only). Counted."""
        pending: _Batch | _Failed | None = None
        if match is not None:
            for _ in range(match):
                self._retire(self._pending.popleft())
            pending = self._pending.popleft()
        if isinstance(pending, _Failed):
            raise pending.error
        self.counters["forwards"] += 1
        if pending is None:
            assert plan is not None  # the callers plan whenever no prefetch matched
            self.counters["forwards_without_prefetch"] += 1
            return self._assign(plan, indices, offsets, "sync_fetched_rows")
        self.counters["forward_lookups"] += pending.unique_slots.numel()
        self.counters["forward_hits"] += pending.unique_slots.numel()
        return pending

    def in_capture(self) -> bool:
        """Whether a forward now is recorded for replays: the current CUDA stream captures a graph, or
        :attr:`static_mode` is on (the same code run eagerly, e.g. on the CPU)."""
        return self.static_mode or _capturing(self._device)

    def _captured_forward(
        self,
        anchor: torch.Tensor,
        plan: Plan,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        vbe_output: torch.Tensor | None,
        optimizer: RowOptimizer,
        pooling: Literal["sum", "mean"],
    ) -> torch.Tensor:
        """:meth:`forward` while a CUDA graph captures: the lookups' slots come from the static buffers of
        ``N = indices.numel()`` lookups, which :meth:`stage` fills before each replay (the unique slots padded
        to ``N`` with the trash slot, which a zero gradient leaves as it was). Nothing here reads the host
        queue or the events: staging and :meth:`replayed` do that around each replay."""
        static = self._static_batch(indices.numel())
        batch = replace(
            static, indices=indices, offsets=offsets, bag_of_lookup=_bag_of_lookup(offsets, indices.numel())
        )
        if torch.is_grad_enabled():
            result = _SlotBagFunction.apply(  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                anchor, psw, vbe_output, self, plan, batch, optimizer, pooling
            )
            return cast(torch.Tensor, result)
        output, _ = self.pool(plan, batch, psw, vbe_output, pooling, False)
        return output

    def _static_batch(self, lookups: int) -> _Batch:
        static = self._static.get(lookups)
        if static is None:
            # `empty`, not `zeros`: under a capture a fill would be recorded, and every replay would wipe the
            # slots staged for it. Staging writes them before any replay (or static-mode forward) reads them.
            # Only the slot tensors are buffers: the ids, offsets and bags are the captured forward's own.
            packed = torch.empty(5 * lookup_bucket(lookups), dtype=torch.int64, device=self._device)
            unused = torch.empty(0, dtype=torch.int64, device=self._device)
            # The unique slots padded to N with the trash slot (past the batch's rows the packed tensor
            # staged holds it): the captured backward sums into N rows.
            views = packed_views(packed, lookups, lookups)
            static = _Batch(
                indices=unused,
                offsets=unused,
                **views,
                bag_of_lookup=unused,
                packed=packed,
                trash=-1,
                tick=0,
                version=0,
                num_bags=[],
            )
            self._static[lookups] = static
        return static

    def stage(
        self, indices: torch.Tensor, offsets: torch.Tensor, batch_sizes: list[list[int]] | None
    ) -> None:
        """Before a replay of a captured forward of this batch: its slots (from its pending prefetch, else
        assigned now, with host syncs) copied into the static buffers of its size, on the current stream
        (made here if no forward of that size was captured yet, so a replay of no such capture trains
        nothing)."""
        static = self._static_batch(indices.numel())
        match = self._find(indices, offsets, batch_sizes)
        if match is None and self._started is not None:  # maybe the prefetch still being finished
            self.complete()
            match = self._find(indices, offsets, batch_sizes)
        # A matched prefetch was planned (and its input checked) at its call: plan only to assign here.
        plan = None if match is not None else self._plan(indices, offsets, None, batch_sizes, None, None)[0]
        captured = self.captured_buffers()
        batch = self._take(plan, indices, offsets, match)
        if any(a is not b for a, b in zip(captured, self.captured_buffers(), strict=True)):
            self._pending.appendleft(batch)  # still this batch's slots, for the retried replay or forward
            raise StaleCaptureError(
                "staging a batch without a prefetch grew the key-value cache: the graph to replay holds its "
                "old tensors; record it again (captured_buffers() changed) and replay, or prefetch the batch "
                "before checking captured_buffers()"
            )
        self._wait_insert()
        # The unique slots padded with the trash slot, the slots, inverse, order and pairs: one copy.
        static.packed.copy_(batch.packed)
        if batch.trash != self.cache.trash:  # the pool grew since the assignment: pad with today's trash slot
            static.unique_slots[batch.unique_slots.numel() :].fill_(self.cache.trash)
        if self._cuda:
            batch.packed.record_stream(torch.cuda.current_stream(self._device))
        self._staged.append(batch)

    def replayed(self) -> None:
        """After the replay of the staged batches was issued (on the current stream): their rows may move
        again once that work is done (the next assignment waits for it before it reads or writes rows)."""
        for batch in self._staged:
            self.release(batch)
        self._staged.clear()
        self._record_main()

    def captured_buffers(self) -> list[torch.Tensor]:
        """The cache's tensors a captured forward and backward use by address (rows, state and flags; the
        static slot buffers never change): a capture is stale once any of them is another tensor (the
        cache grew its scratch pool)."""
        cache = self.cache
        return [cache.weights, cache.state, cache.dirty, cache.slot_tables, cache.dims_device]

    def flush(self) -> None:
        """Write every dirty row (device cache and host tier) to the store."""
        self.complete()
        self._wait_insert()
        self.cache.flush()
        self._record_main()

    def clear(self) -> None:
        """Forget every cached row and pending prefetch (checkpoint restore, after :meth:`flush`)."""
        self.complete()
        self._pending.clear()
        self._open.clear()
        self._staged.clear()
        self.cache.clear()
        self._record_insert()  # the metadata cleared here: the next assignment waits for it

    def load_host_tier(self, table: int, ids: torch.Tensor) -> None:
        """Read the rows of ``ids`` (``[K]`` int64 host, unique, not cached yet) from the store into the host
        tier (warm start: benchmarks); nothing without a host tier."""
        self.complete()
        lower = self.cache.lower
        if isinstance(lower, HostTier | DramTier):
            lower.load(torch.full_like(ids, table), ids)

    def close(self) -> None:
        """Forget the pending prefetches (one still being finished is finished first: it holds a tick)."""
        try:
            self.complete()
        finally:
            self._pending.clear()

    def summary(self) -> dict[str, float]:
        """The device path's counters, under the module's metric names plus ``hbm_*`` / ``host_tier_*`` /
        ``store_tier_*`` per tier."""
        out = self.cache.summary()
        m = self.cache.metrics
        forward_lookups = self.counters["forward_lookups"]
        out.update({name: float(value) for name, value in self.counters.items()})
        out.update(
            lookups=float(m.lookups),
            hits=float(m.hits),
            cache_hit_rate=out["hbm_hit_rate"],
            forward_hit_rate=self.counters["forward_hits"] / forward_lookups if forward_lookups else 0.0,
            scratch_rows=float(m.scratch_rows),
            evicted_rows=float(m.evicted_rows),
            written_back_rows=float(m.written_back_rows),
            cached_rows=out["hbm_cached_rows"],
        )
        return out

    def reset_metrics(self) -> None:
        """Zero every counter."""
        self.cache.reset_metrics()
        self.counters = dict.fromkeys(self.counters, 0)

    # ------------------------------------------------------------------ plan and slots

    def _plan(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        batch_sizes: list[list[int]] | None,
        vbe_output: torch.Tensor | None,
        vbe_output_offsets: torch.Tensor | None,
    ) -> tuple[Plan, torch.Tensor]:
        return plan_batch(
            indices,
            offsets,
            per_sample_weights,
            batch_sizes,
            vbe_output,
            vbe_output_offsets,
            feature_table_map=self._ftm,
            dims=self._dims,
            device=self._device,
            host_indices=False,
            check_offsets=False,
        )

    def _table_of_bags(self, plan: Plan) -> torch.Tensor:
        """``[bags]`` int64 on the device: each bag's table (cached per layout; VBE layouts change per batch).

        Built on the host and copied up without a sync: a pageable or blocking host-to-device copy syncs, so
        on CUDA it goes through pinned memory (the caching host allocator keeps the block until the copy
        is done) with ``non_blocking``."""
        key = tuple(plan.num_bags)
        cached = self._tables_of_bags.get(key)
        if cached is None:
            if len(self._tables_of_bags) >= 64:
                self._tables_of_bags.clear()
            host = torch.repeat_interleave(
                torch.tensor(self._ftm, dtype=torch.int64),
                torch.tensor(plan.num_bags, dtype=torch.int64),
                output_size=sum(plan.num_bags),
            )
            cached = host.pin_memory().to(self._device, non_blocking=True) if self._cuda else host
            self._tables_of_bags[key] = cached
        return cached

    def _assign(self, plan: Plan, indices: torch.Tensor, offsets: torch.Tensor, moved: str) -> _Batch:
        """Step 2: slots for every lookup of the batch (rows moved in on the current stream).

        The values of ``offsets`` are checked on the device and read with the assignment's counts; bad ones
        raise :class:`InvalidArgumentError` before anything moved. Until then every kernel is safe whatever
        ``offsets`` holds (bags by ``searchsorted``, clamped)."""
        return self._finish(self._start(plan, indices, offsets, deferred=False), moved)

    def _start(self, plan: Plan, indices: torch.Tensor, offsets: torch.Tensor, *, deferred: bool) -> _Started:
        """:meth:`_assign` up to its survey (device work, no sync): the batch's tick is held from here.

        The lookups' tables (from the bags' tables by ``offsets``), their padding and the checks of
        ``offsets`` (read with the survey's counts) are worked out inside the survey (see
        :func:`_expand_lookups`): the host copies the ids, offsets and bags' tables into the buffers of their
        size and issues one replay."""
        self._wait_insert()  # the slot metadata the last assignment wrote (on another stream, maybe)
        lookups = indices.numel()

        def verify(values: list[int]) -> None:
            check_offset_values(values[0], values[1], lookups, decreasing=bool(values[2]))

        self._tick += 1
        tick = self._tick
        self._open.add(tick)
        try:
            if lookups:
                source = self._lookup_source(plan, indices, offsets)
                started = self.cache.start_assign_from(
                    source,
                    tick,
                    min(self._open),
                    verify=verify,
                    before_rows=self._wait_main,
                    deferred=deferred,
                )
                assert started.extra is not None  # a survey ran
                bag_of_lookup = started.extra
            else:
                bag_of_lookup = torch.zeros(0, dtype=torch.int64, device=self._device)
                wide = offsets.to(torch.int64)
                checks = torch.stack([wide[0], wide[-1], (wide[1:] < wide[:-1]).any().to(torch.int64)])
                started = self.cache.start_assign(
                    bag_of_lookup,
                    bag_of_lookup,
                    tick,
                    min(self._open),
                    checks=checks,
                    verify=verify,
                    before_rows=self._wait_main,
                    deferred=deferred,
                )
        except BaseException:
            self._open.discard(tick)
            raise
        stream = torch.cuda.current_stream(self._device) if self._cuda else None
        return _Started(plan, indices, offsets, bag_of_lookup, indices._version, started, stream)

    def _lookup_source(self, plan: Plan, indices: torch.Tensor, offsets: torch.Tensor) -> LookupSource:
        """The batch's ids, offsets and bags' tables copied into the buffers of their padded sizes (no sync),
        for the survey to expand (:func:`_expand_lookups`)."""
        lookups, bags = indices.numel(), offsets.numel() - 1
        size = (lookup_bucket(lookups), lookup_bucket(max(bags, 1)))
        buffers = self._lookup_buffers.get(size)
        if buffers is None:
            if len(self._lookup_buffers) >= 64:
                self._lookup_buffers.clear()
                self._buffers_generation += 1
            buffers = _LookupBuffers(
                ids=torch.zeros(size[0], dtype=torch.int64, device=self._device),
                offsets=torch.zeros(size[1] + 1, dtype=torch.int64, device=self._device),
                tables=torch.zeros(size[1], dtype=torch.int64, device=self._device),
            )
            self._lookup_buffers[size] = buffers
        buffers.ids[:lookups].copy_(indices)
        buffers.offsets[: bags + 1].copy_(offsets)
        layout = tuple(plan.num_bags)
        if buffers.layout != layout:  # the bags' tables change with the layout only
            buffers.tables[:bags].copy_(self._table_of_bags(plan))
            buffers.layout = layout
        return LookupSource(
            n=lookups,
            key=(*size, self._buffers_generation),
            values=(lookups, bags),
            checks=3,
            expand=functools.partial(_expand_lookups, buffers),
        )

    def _finish(self, started: _Started, moved: str) -> _Batch:
        """The rest of :meth:`_assign` (on the stream of its start)."""
        tick = started.cache.tick
        try:
            assignment = self.cache.finish_assign(started.cache)
        except BaseException:
            self._open.discard(tick)
            raise
        self.counters[moved] += assignment.inserted
        self._record_insert()
        return _Batch(
            indices=started.indices,
            offsets=started.offsets,
            slots=assignment.slots,
            unique_slots=assignment.unique_slots,
            inverse=assignment.inverse,
            order=assignment.order,
            pairs=assignment.pairs,
            bag_of_lookup=started.bag_of_lookup,
            packed=assignment.packed,
            trash=assignment.trash,
            tick=tick,
            version=started.version,
            num_bags=list(started.plan.num_bags),
        )

    def release(self, batch: _Batch) -> None:
        """The batch's rows may move again (its update was applied)."""
        self._open.discard(batch.tick)

    # ------------------------------------------------------------------ pool and update

    def pool(
        self,
        plan: Plan,
        batch: _Batch,
        per_sample_weights: torch.Tensor | None,
        vbe_output: torch.Tensor | None,
        pooling: Literal["sum", "mean"],
        keep_rows: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step 3, forward: the output (module layout) and, if ``keep_rows``, the looked-up rows ``[N, D_max]``."""
        if self._cuda and not self.in_capture():
            stream = torch.cuda.current_stream(self._device)
            batch.packed.record_stream(stream)  # the slot fields' storage
            batch.bag_of_lookup.record_stream(stream)
        weights = self.cache.weights
        offsets = batch.offsets.to(torch.int64)
        psw = None if per_sample_weights is None else per_sample_weights.detach()
        output = allocate_output(plan, self._feature_dims, self._device, vbe_output)
        block = one_block_start(plan, self._feature_dims)
        bags = offsets.numel() - 1
        if block is not None:  # every feature's bags in one block: pooled straight into it
            dim = self._feature_dims[0]
            pooled = output[block : block + bags * dim].view(bags, dim)
        else:  # pooled at full width, then placed feature by feature
            pooled = weights.new_empty(bags, self.cache.dmax)
        self.cache.pool(batch.slots, offsets, psw, pooled)
        if pooling == "mean":
            pooled.div_((offsets[1:] - offsets[:-1]).clamp(min=1).to(torch.float32)[:, None])
        if block is None:
            column = 0
            for feature, dim in enumerate(self._feature_dims):
                start, count = plan.bag_start[feature], plan.num_bags[feature]
                if count:
                    place_pooled(plan, output, feature, column, pooled[start : start + count, :dim])
                column += dim
        rows = weights.index_select(0, batch.slots) if keep_rows else None
        return output, rows

    def update(
        self,
        plan: Plan,
        batch: _Batch,
        per_sample_weights: torch.Tensor | None,
        rows: torch.Tensor | None,
        grad_output: torch.Tensor,
        optimizer: RowOptimizer,
        pooling: Literal["sum", "mean"],
    ) -> torch.Tensor | None:
        """Step 3, backward: apply the optimizer to the batch's slots; returns the per-sample-weight gradient."""
        capturing = self.in_capture()
        if not capturing:  # a replay's stage waited for the insert, and replayed() records the stream
            self._wait_insert()
        offsets = batch.offsets.to(torch.int64)
        bags, dmax = offsets.numel() - 1, self.cache.dmax
        block = one_block_start(plan, self._feature_dims)
        if block is not None and self._feature_dims[0] == dmax:  # one view of the output's gradient
            grad_bags = grad_output.view(-1)[block : block + bags * dmax].view(bags, dmax)
        else:
            grad_bags = grad_output.new_zeros(bags, dmax)
            column = 0
            for feature, dim in enumerate(self._feature_dims):
                start, count = plan.bag_start[feature], plan.num_bags[feature]
                if count:
                    grad_bags[start : start + count, :dim] = bag_grads(
                        plan, grad_output, feature, column, dim
                    )
                column += dim
        if pooling == "mean":  # not in place: grad_bags may be a view of grad_output
            grad_bags = grad_bags / (offsets[1:] - offsets[:-1]).clamp(min=1).to(torch.float32)[:, None]
        if rows is None and self.cache.fuses_updates:  # one kernel: no per-lookup gradients, no atomics
            psw = None if per_sample_weights is None else per_sample_weights.detach().to(torch.float32)
            self.cache.update_from_bags(
                batch.unique_slots, batch.order, batch.pairs, grad_bags, batch.bag_of_lookup, psw, optimizer
            )
            if not capturing:
                self.release(batch)
                self._record_main()
            return None
        grad_lookups = grad_bags.index_select(0, batch.bag_of_lookup)
        grad_psw = None
        if rows is not None:
            grad_psw = (grad_lookups * rows).sum(1)
        if per_sample_weights is not None:
            grad_lookups = grad_lookups * per_sample_weights.detach()[:, None]
        grad_rows = grad_lookups.new_zeros(batch.unique_slots.numel(), self.cache.dmax).index_add_(
            0, batch.inverse, grad_lookups
        )
        self.cache.update(batch.unique_slots, grad_rows, optimizer)
        if not capturing:
            self.release(batch)
            self._record_main()
        return grad_psw

    # ------------------------------------------------------------------ streams

    def _wait_main(self) -> None:
        if self._cuda and self._main_event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._main_event)

    def _wait_insert(self) -> None:
        if self._cuda and self._insert_event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._insert_event)

    def _record_main(self) -> None:
        if self._cuda:
            self._main_event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            self._main_event.record(torch.cuda.current_stream(self._device))

    def _record_insert(self) -> None:
        if self._cuda:
            self._insert_event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            self._insert_event.record(torch.cuda.current_stream(self._device))

    def feature_dims(self) -> list[int]:
        """Per feature, its ``D``."""
        return self._feature_dims


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream of ``device`` is capturing a graph (never on the CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@dataclass(slots=True, eq=False)
class _LookupBuffers:
    """One padded size's prefetch inputs on the device (int64): ``ids`` ``[P]``, ``offsets`` ``[Q + 1]`` and the
    table of each bag ``[Q]``; a batch fills their first ``n``, ``bags + 1`` and ``bags`` entries (``tables``
    only when its layout, the bags per feature, is not the one they hold)."""

    ids: torch.Tensor
    offsets: torch.Tensor
    tables: torch.Tensor
    layout: tuple[int, ...] | None = None


_NO_END = (1 << 63) - 1  # the end of a padding bag: past every lookup


def _expand_lookups(
    buffers: _LookupBuffers, scalars: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefetch's lookups from its buffers, inside the survey (no sync, fixed shapes): the table and id of each
    lookup padded to ``P`` (repeats of the first lookup), the checks of ``offsets`` (first, last, whether any
    decreases) and the bag of each lookup (as :func:`_bag_of_lookup`: clamped, in bounds whatever ``offsets``
    holds). ``scalars``: ``[1, 5]`` int64, the survey's two, the lookups ``n`` and the bags, the tick."""
    device = buffers.ids.device
    if device.type == "cuda" and moves_on_device(device):  # one launch (see _expand_kernel)
        from ssd_tbe_adapter._expand_kernel import expand_lookups

        return expand_lookups(buffers.ids, buffers.offsets, buffers.tables, scalars.view(-1), 2, 3)
    n, bags = scalars[0, 2], scalars[0, 3]
    position = positions(buffers.ids.numel(), device)
    real = position < n
    bag_positions = positions(buffers.tables.numel(), device)
    in_batch = bag_positions < bags
    ends = torch.where(in_batch, buffers.offsets[1:], _NO_END)
    bag = torch.minimum(torch.searchsorted(ends, position, right=True), (bags - 1).clamp(min=0))
    tables = buffers.tables.index_select(0, bag)
    tables = torch.where(real, tables, tables[0])
    ids = torch.where(real, buffers.ids, buffers.ids[0])
    wide = buffers.offsets
    decreasing = ((wide[1:] < wide[:-1]) & in_batch).any()
    checks = torch.stack([wide[0], wide.index_select(0, bags.view(1))[0], decreasing.to(torch.int64)])
    return tables, ids, checks, bag


def _bag_of_lookup(offsets: torch.Tensor, lookups: int) -> torch.Tensor:
    """``[lookups]`` int64 on the device of ``offsets``: the bag of each lookup (no sync; ``offsets`` has at
    least one bag when ``lookups > 0``).

    A ``searchsorted`` over the bags' ends rather than ``repeat_interleave(output_size=...)``: it stays in
    bounds (clamped) whatever ``offsets`` holds, so it may run before the values are checked, where a
    ``repeat_interleave`` whose lengths do not sum to ``lookups`` trips a device-side assert on CUDA."""
    ends = offsets[1:].to(torch.int64)
    positions = torch.arange(lookups, dtype=torch.int64, device=offsets.device)
    return torch.searchsorted(ends, positions, right=True).clamp_(max=max(ends.numel() - 1, 0))


def _same_batch(
    batch: _Batch | _Failed, indices: torch.Tensor, offsets: torch.Tensor, num_bags: list[int] | None
) -> bool:
    """Whether ``forward(indices, offsets)`` is the batch ``batch`` was prefetched for, without a sync: the
    same tensors, or ``indices`` over the very same memory (the prefetch holds it alive, so no other batch
    can be there; the version counter rules out in-place changes) and ``offsets`` of the same length (a
    sharded module slices its ids again and rebuilds the offsets for each call); ``num_bags`` (per feature,
    when known) must agree too."""
    mine = batch.indices
    if indices._version != batch.version or (num_bags is not None and num_bags != batch.num_bags):
        return False
    if mine is indices and batch.offsets is offsets:
        return True
    return (
        mine.numel() == indices.numel()
        and mine.dtype == indices.dtype
        and mine.device == indices.device
        and mine.data_ptr() == indices.data_ptr()
        and mine.stride() == indices.stride()
        and batch.offsets.numel() == offsets.numel()
    )


class _SlotBagFunction(torch.autograd.Function):
    """Autograd node of one device-path forward: backward updates the batch's cache slots."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        vbe_output: torch.Tensor | None,
        path: DevicePath,
        plan: Plan,
        batch: _Batch,
        optimizer: RowOptimizer,
        pooling: Literal["sum", "mean"],
    ) -> torch.Tensor:
        del anchor
        keep_rows = per_sample_weights is not None and per_sample_weights.requires_grad
        output, rows = path.pool(plan, batch, per_sample_weights, vbe_output, pooling, keep_rows)
        if vbe_output is not None:
            ctx.mark_dirty(vbe_output)
        ctx.state = (path, plan, batch, per_sample_weights, rows, optimizer, pooling, vbe_output is not None)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        path, plan, batch, psw, rows, optimizer, pooling, chained = ctx.state
        ctx.state = None
        grad_output = grad_output.contiguous()
        grad_psw = path.update(plan, batch, psw, rows, grad_output, optimizer, pooling)
        # The chained buffer's gradient only where it needs one (the chain's first kernel writes a fresh buffer).
        chained = chained and ctx.needs_input_grad[2]
        grad_vbe = chained_input_grad(plan, grad_output, path.feature_dims()) if chained else None
        return None, grad_psw, grad_vbe, None, None, None, None, None
