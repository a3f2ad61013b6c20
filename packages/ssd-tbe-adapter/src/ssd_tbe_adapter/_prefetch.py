"""Prefetch: a FIFO queue of jobs that bring a future batch's rows into the cache.

A job is a survey (group the batch, look its rows up, protect the cached ones) and, for the misses, a fetch
(store reads, then inserts). When no job is in flight the survey runs on the calling thread, and a batch
whose rows are all cached is done there: no thread is woken (the handoff, and the GIL going back and forth
between the threads, cost more than the survey). Fetches run on one job thread, which also runs, in order,
every job submitted while another is in flight; their store reads run on a small pool of reader threads, one
task per table, so they overlap the job's inserts. The read is the only work done
without the tier's lock, and it may race with a write-back of the same id (an eviction by the training
thread), so each job remembers the store write epoch before reading and, when writes happened meanwhile,
re-reads the ids that were written.

Matching a forward to its prefetch: by content, never by tensor identity alone. A job keeps its own copy of
the batch's host ids and offsets (so changing ``indices`` in place after ``prefetch`` changes neither the job
nor what it is compared with); a forward uses the first pending job whose batch is its batch: the same
tensors with unchanged version counters, or equal ids, offsets and bag counts. Jobs queued before the match
were skipped (their batches never came) and are retired; a forward that matches no job leaves the queue as it
is, so one forward without a prefetch does not shift every later forward onto the wrong job.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ssd_tbe_adapter._plan import BatchGroups, Plan, group_batch
from ssd_tbe_adapter._tier import CacheTier

__all__ = ["Prefetcher"]


# Pending jobs beyond this many (prefetches no forward matched) are retired, oldest first, so that rows they
# protect from eviction do not pile up.
_MAX_PENDING = 16


@dataclass(slots=True)
class _Pending:
    indices: torch.Tensor  # the tensor prefetch was called with
    offsets: torch.Tensor
    versions: tuple[int, int]  # their version counters at prefetch time
    indices_cpu: torch.Tensor  # the job's own copy of the batch (host int64)
    offsets_cpu: torch.Tensor
    num_bags: list[int]
    future: Future[BatchGroups]
    job: int  # sequence number of the prefetch job
    plan: Plan  # the job's plan (no per-sample weights, no ``vbe_output``)
    batch_sizes: list[list[int]] | None  # the VBE batch sizes prefetch was called with

    def matches(
        self, indices: torch.Tensor, offsets: torch.Tensor, plan: Plan, indices_cpu: torch.Tensor
    ) -> bool:
        """Whether a forward of ``plan`` over ``indices``/``offsets`` is this job's batch."""
        if self.num_bags != plan.num_bags:
            return False
        if (
            self.indices is indices
            and self.offsets is offsets
            and self.versions == _versions(indices, offsets)
        ):
            return True
        return torch.equal(self.indices_cpu, indices_cpu) and torch.equal(self.offsets_cpu, plan.offsets)

    def same_batch(
        self, indices: torch.Tensor, offsets: torch.Tensor, batch_sizes: list[list[int]] | None
    ) -> bool:
        """Whether ``indices`` / ``offsets`` (1-D int64 host) and ``batch_sizes`` are this job's batch."""
        return (
            self.batch_sizes == batch_sizes
            and torch.equal(self.offsets_cpu, offsets)
            and torch.equal(self.indices_cpu, indices)
        )


def _versions(indices: torch.Tensor, offsets: torch.Tensor) -> tuple[int, int]:
    return indices._version, offsets._version


def _own_copy(host: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``host`` (a host int64 view of ``given``), copied when it shares ``given``'s memory."""
    return host.clone() if host.data_ptr() == given.data_ptr() else host


class Prefetcher:
    """The prefetch jobs of one module over its cache tier.

    Args:
        tier: the caches and store the jobs fill from.
        feature_table_map: per feature, its table (to group a batch's ids).
    """

    def __init__(self, tier: CacheTier, feature_table_map: Sequence[int]) -> None:
        self._tier = tier
        self._feature_table_map = list(feature_table_map)
        self._pending: deque[_Pending] = deque()
        self._jobs = 0
        self._executor: ThreadPoolExecutor | None = None
        # Store reads of a prefetch job run here, one task per table, so they overlap the job's inserts (and
        # each other when there are spare cores: the store calls release the GIL).
        self._readers: ThreadPoolExecutor | None = None
        self._running: Future[BatchGroups] | None = None  # the last job handed to the job thread

    def _survey_here(
        self, plan: Plan, indices_cpu: torch.Tensor, stream: Any, job: int
    ) -> Future[BatchGroups]:
        """A job whose survey runs on the calling thread (no job running): a batch whose rows are all cached
        is done here, without waking a thread (a thread handoff and the GIL going back and forth cost more
        than the survey). Its misses go to the job thread (reads on the reader threads, inserts there), which
        overlaps them with the training thread's work and collective waits."""
        executor = self._executor
        assert executor is not None
        future: Future[BatchGroups] = Future()
        try:
            batch, misses = self._survey(plan, indices_cpu, job)
        except Exception as exc:  # raised at the batch's forward, as a job thread's error is
            future.set_exception(exc)
            return future
        if misses is None:
            future.set_result(batch)
            return future
        future = executor.submit(self._fetch, batch, misses, stream)
        self._running = future
        return future

    def submit(
        self,
        plan: Plan,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        indices_cpu: torch.Tensor,
        stream: Any,
        read_threads: int,
        batch_sizes: list[list[int]] | None = None,
    ) -> None:
        """Queue a job for the batch of ``plan`` (``indices``/``offsets``/``batch_sizes``: what prefetch was
        called with).

        The threads start at the first job; ``read_threads`` sizes the reader pool then.
        """
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
            self._readers = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="kv-read")
        indices_cpu = _own_copy(indices_cpu, indices)
        plan.offsets = _own_copy(plan.offsets, offsets)
        job = self._jobs
        self._jobs += 1
        if self._running is None or self._running.done():
            future = self._survey_here(plan, indices_cpu, stream, job)
        else:  # behind a job still reading: the whole job in turn on the job thread (FIFO)
            future = self._executor.submit(self._run, plan, indices_cpu, stream, job)
            self._running = future
        self._pending.append(
            _Pending(
                indices=indices,
                offsets=offsets,
                versions=_versions(indices, offsets),
                indices_cpu=indices_cpu,
                offsets_cpu=plan.offsets,
                num_bags=list(plan.num_bags),
                future=future,
                job=job,
                plan=plan,
                batch_sizes=None if batch_sizes is None else [list(row) for row in batch_sizes],
            )
        )
        while len(self._pending) > _MAX_PENDING:
            self._retire(self._pending.popleft())

    def wait(self, *, raise_failed: bool = True) -> None:
        """Block until every pending job has finished; they stay queued, except failed ones, which are dropped
        (a failed job cached nothing it did not finish, and lost no row). Raises the first failed job's error
        once when ``raise_failed``."""
        failed = [pending for pending in list(self._pending) if pending.future.exception() is not None]
        for pending in failed:
            self._pending.remove(pending)
            self._retire(pending)
        if failed and raise_failed:
            failed[0].future.result()  # raises its error

    def take(
        self, indices: torch.Tensor, offsets: torch.Tensor, plan: Plan, indices_cpu: torch.Tensor
    ) -> BatchGroups | None:
        """The grouping of the pending prefetch of this forward's batch (see the module docstring), waiting
        for it; ``None`` when no pending prefetch is of this batch. Raises what that prefetch raised (once)."""
        tier = self._tier
        match = next(
            (
                position
                for position, pending in enumerate(self._pending)
                if pending.matches(indices, offsets, plan, indices_cpu)
            ),
            None,
        )
        if match is None:
            with tier.lock:
                tier.batch_tick = tier.tick + 1  # this forward's own ticks
            return None
        return self._take_at(match)

    def take_planned(
        self, indices: torch.Tensor, offsets: torch.Tensor, batch_sizes: list[list[int]] | None
    ) -> tuple[Plan, BatchGroups] | None:
        """:meth:`take` for a forward without per-sample weights or ``vbe_output`` whose ``indices`` and
        ``offsets`` are 1-D int64 host tensors: the pending prefetch of the same ids, offsets and batch sizes
        (content; it checked them when it planned the batch) with its plan, so the forward plans nothing.
        ``None``, with nothing changed, when no pending prefetch is of this batch (the forward then plans and
        checks its inputs, and calls :meth:`take`)."""
        match = next(
            (
                position
                for position, pending in enumerate(self._pending)
                if pending.same_batch(indices, offsets, batch_sizes)
            ),
            None,
        )
        if match is None:
            return None
        plan = self._pending[match].plan
        return plan, self._take_at(match)

    def _take_at(self, match: int) -> BatchGroups:
        """Retire the pending jobs before position ``match``, then wait for that one and hand its batch over."""
        tier = self._tier
        for _ in range(match):  # prefetched batches that never came
            self._retire(self._pending.popleft())
        pending = self._pending.popleft()
        try:
            batch = pending.future.result()
        finally:
            with tier.lock:
                job_tick = tier.job_ticks.pop(pending.job, None)
                tier.batch_tick = tier.tick + 1 if job_tick is None else job_tick
        return batch

    def _retire(self, pending: _Pending) -> None:
        """Forget a job no forward will use: wait for it (its error does not matter to anyone), then drop the
        tick that protects its rows from eviction."""
        wait([pending.future])
        with self._tier.lock:
            self._tier.job_ticks.pop(pending.job, None)

    def close(self) -> None:
        """Forget the pending jobs and stop the threads (after the running job)."""
        self._pending.clear()
        self._running = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None

    def _run(self, plan: Plan, indices_cpu: torch.Tensor, stream: Any, job: int) -> BatchGroups:
        """One job: group the batch, count its hits, read its misses and insert them (see the module docstring)."""
        batch, misses = self._survey(plan, indices_cpu, job)
        return batch if misses is None else self._fetch(batch, misses, stream)

    def _survey(self, plan: Plan, indices_cpu: torch.Tensor, job: int) -> tuple[BatchGroups, _Misses | None]:
        """A job's first half: group the batch, count its hits, protect its cached rows; its misses, if any
        (then the tier is marked in flight until :meth:`_fetch` ends).

        With the slab (tables of one width), the batch's rows are looked up and, when all are cached, stamped
        over all tables at once, and their slab rows kept for the forward and backward (``slab_rows``)."""
        tier = self._tier
        batch = group_batch(plan, indices_cpu, self._feature_table_map)
        slab = tier.slab
        misses: dict[int, torch.Tensor] = {}
        with tier.lock:
            tick = tier.next_tick()
            tier.job_ticks[job] = tick
            rows = None
            if slab is not None:
                rows = tier.lookup_batch(batch)
                hit_rows = rows >= 0
                n_hit = int(np.count_nonzero(hit_rows))
                tier.metrics.lookups += rows.shape[0]
                tier.metrics.hits += n_hit
                if n_hit == rows.shape[0]:
                    slab.touch(rows, tick)
                    batch.slab_rows = rows
                    batch.slab_generation = slab.generation
                    return batch, None
            first_slots: dict[int, torch.Tensor] = {}
            fills: dict[int, int] = {}
            for position, table in enumerate(batch.names):
                cache = tier.caches[table]
                unique = batch.unique_of(position)
                if rows is None:
                    slots = cache.lookup(unique)
                    tier.metrics.lookups += unique.numel()
                else:  # the slab rows found above, as this table's slots
                    assert slab is not None
                    lo, hi = batch.bounds[position]
                    slots_np = rows[lo:hi] - slab.bases[table]
                    slots_np[rows[lo:hi] < 0] = -1
                    slots = torch.from_numpy(slots_np)
                hit = slots.numpy() >= 0
                n_hit = int(np.count_nonzero(hit))
                if rows is None:
                    tier.metrics.hits += n_hit
                if n_hit == unique.numel():
                    cache.touch(slots, tick)
                    cache.vouch(slots, unique)
                    batch.slots[table] = slots
                else:
                    cache.touch(torch.from_numpy(slots.numpy()[hit]), tick)
                    misses[table] = torch.from_numpy(unique.numpy()[~hit])
                    first_slots[table] = slots
                    fills[table] = cache.fills
            if not misses:
                return batch, None
            tier.inflight = True
            return batch, _Misses(
                ids=misses, first_slots=first_slots, fills=fills, epoch=tier.epoch, tick=tick
            )

    def _fetch(self, batch: BatchGroups, misses: _Misses, stream: Any) -> BatchGroups:
        """A job's second half: read the misses :meth:`_survey` found and insert them."""
        tier = self._tier
        first_slots, fills, epoch, tick = misses.first_slots, misses.fills, misses.epoch, misses.tick
        readers = self._readers
        assert readers is not None
        fetched: dict[int, Future[tuple[torch.Tensor, torch.Tensor]]] = {}
        try:
            # The slow part, without the lock: the training thread keeps going meanwhile. The reader threads
            # read table after table while this thread inserts the tables already read, so one table's
            # write-backs overlap the next tables' reads.
            for table, ids in misses.ids.items():
                fetched[table] = readers.submit(tier.read_rows, table, ids)
            # One table per lock hold, so the training thread's forward/backward can interleave.
            with _maybe_stream(stream):
                for table, ids in misses.ids.items():
                    weights, state = fetched[table].result()  # not under the lock
                    with tier.lock:
                        if tier.cuda and tier.main_event is not None:
                            stream.wait_event(tier.main_event)
                        cache = tier.caches[table]
                        # Only the training thread's synchronous fetches can have cached some meanwhile.
                        still_missing = cache.lookup(ids) < 0 if cache.fills != fills[table] else None
                        complete = still_missing is None or bool(still_missing.all())
                        if still_missing is not None and not complete:
                            ids, weights, state = (
                                ids[still_missing],
                                weights[still_missing],
                                state[still_missing],
                            )
                        if tier.epoch != epoch and ids.numel():
                            written = [logged for t, logged in tier.write_log if t == table]
                            if written:
                                stale = torch.isin(ids, torch.cat(written))
                                if bool(stale.any()):
                                    # Evicted and written back after our read: the store is newer now.
                                    fresh_weights, fresh_state = tier.read_rows(table, ids[stale])
                                    weights[stale] = fresh_weights
                                    state[stale] = fresh_state
                        inserted_slots = tier.insert(table, ids, weights, state, tick)
                        tier.metrics.prefetched_rows += inserted_slots.numel()
                        if complete and inserted_slots.numel() == ids.numel():
                            slots = first_slots[table]
                            batch.slots[table] = slots.index_copy(
                                0, (slots < 0).nonzero().flatten(), inserted_slots
                            )
                        if tier.cuda:
                            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                            event.record(stream)
                            tier.insert_event = event
        finally:
            wait(fetched.values())  # a failed job leaves no read running behind it
            with tier.lock:
                tier.inflight = False
                tier.write_log.clear()
        return batch


@dataclass(slots=True)
class _Misses:
    """What a job's survey left for its fetch: per table the uncached ids, the slots of the first look (``-1``
    where missing), the cache's fill count then; the store write epoch and the job's tick."""

    ids: dict[int, torch.Tensor]
    first_slots: dict[int, torch.Tensor]
    fills: dict[int, int]
    epoch: int
    tick: int


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def _maybe_stream(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else _NullContext()
