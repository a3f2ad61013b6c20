"""``StagedTrainPipeline``: runs its stages on different batches, oldest batch on the last stage.

Order (identical to torchrec's ``StagedTrainPipeline``, checked by a differential test): with ``n`` stages the
fill runs batch 0 through every stage, batch 1 through all but the last, ..., batch ``n-1`` through stage 0;
every ``progress()`` then returns the oldest batch after running stage 0 on a newly pulled batch, stage 1 on the
next-oldest, ..., stage ``n-1`` on the batch that will be returned by the next call.

Streams: on CUDA each stage runs on its own stream; a batch handed from one stream to another is an event wait
plus ``record_stream`` of every tensor of the batch on the consumer stream (also for the hand-off to the compute
stream). On CPU the same order runs inline.

Errors (see :meth:`StagedTrainPipeline.progress`): an exception raised by the iterator's ``next()`` (also a
``KeyboardInterrupt`` that lands there) undoes the step, so no batch is lost and the next ``progress()``
repeats it; any other error drops the in-flight batches and says how many (``StageError.dropped_batches``, an
exception note and a warning on logger ``pipeline_stages``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from pipeline_stages._sequence import CURRENT_BATCH, next_sequence
from pipeline_stages._sparse_dist import SparseDataDistUtil
from pipeline_stages._stage import PipelineStage
from pipeline_stages._streams import new_event, profiler_enabled, record_stream_all, stream_context
from pipeline_stages.errors import DuplicateStageNameError, InvalidStageError, StageError

__all__ = ["StageStats", "StagedTrainPipeline"]

logger = logging.getLogger("pipeline_stages")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageStats:
    """Per-stage timing since construction or the last ``reset_stats()``.

    Attributes:
        name: the stage's name.
        runs: how many times the runnable ran.
        skipped: how many times the stage was skipped because its input was None (data exhausted, flush).
        host_ms_total: wall time on the host inside the runnable, summed (on CUDA: the time to launch the
            stage's work, not the time the device spent on it).
        host_ms_mean: ``host_ms_total / runs`` (0.0 without runs).
        host_ms_max: the longest single run on the host.
        device_ms_total: device time of the stage's work on its stream, summed over completed runs; None
            unless the pipeline was built with ``device_timing=True`` on CUDA.
        device_ms_mean: ``device_ms_total`` per completed run, or None.
    """

    name: str
    runs: int
    skipped: int
    host_ms_total: float
    host_ms_mean: float
    host_ms_max: float
    device_ms_total: float | None
    device_ms_mean: float | None


@dataclass(slots=True)
class _Slot:
    """One in-flight batch: the last stage output, its index in the epoch, its process-wide sequence number
    (see ``_sequence``), and the stream/event it came from."""

    batch: Any
    index: int
    seq: int
    stream: torch.cuda.Stream | None
    event: torch.cuda.Event | None


_EXHAUSTED = _Slot(batch=None, index=-1, seq=-1, stream=None, event=None)

_TORCHREC_ORDER = "StagedTrainPipeline(pipeline_stages, debug_mode, compute_stream, on_flush_end)"


def _is_stream_or_none(value: object) -> bool:
    return value is None or isinstance(value, torch.cuda.Stream)


def _order_hint(shifted: bool, keyword: str) -> str:
    """The hint for a value that looks like it was meant for the next positional parameter."""
    if not shifted:
        return ""
    return f"; the positional order is torchrec's, {_TORCHREC_ORDER}: pass `{keyword}=` by keyword"


class _StageTimer:
    """Mutable counters behind :class:`StageStats` (one per stage)."""

    __slots__ = ("device_count", "device_ms", "host_max_ns", "host_ns", "name", "pending", "runs", "skipped")

    def __init__(self, name: str) -> None:
        self.name = name
        self.runs = 0
        self.skipped = 0
        self.host_ns = 0
        self.host_max_ns = 0
        self.device_ms = 0.0
        self.device_count = 0
        self.pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def collect(self, *, block: bool) -> None:
        """Fold finished device-timing event pairs into the totals (``block`` waits for all of them)."""
        still: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for start, end in self.pending:
            if block:
                end.synchronize()
            if block or end.query():  # type: ignore[no-untyped-call]  # unannotated in torch
                self.device_ms += start.elapsed_time(end)
                self.device_count += 1
            else:
                still.append((start, end))
        self.pending = still


class StagedTrainPipeline:
    """Pipelined execution of :class:`PipelineStage` s over the batches of a data iterator.

    Example::

        pipeline = StagedTrainPipeline([
            PipelineStage("data_copy", lambda b: b.to(device, non_blocking=True), stream=copy_stream),
            PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist, stream=sdd.data_dist_stream,
                          fill_callback=sdd.wait_sparse_data_dist),
            PipelineStage("prefetch", sdd.prefetch, stream=sdd.prefetch_stream, fill_callback=sdd.load_prefetch),
        ])
        while (batch := pipeline.progress(it)) is not None:
            loss = model(batch); loss.backward(); optimizer.step()

    Args:
        pipeline_stages: the stages, in the order a batch goes through them (at least one, unique names).
        debug_mode: log every stage run, skip and callback at INFO level on logger ``pipeline_stages``.
        compute_stream: the CUDA stream the model runs on; each returned batch is handed to it (event wait +
            ``record_stream``). Defaults to the current stream at construction when any stage has a stream,
            and to None (CPU, inline) otherwise.
        on_flush_end: called when a flush (``set_flush(True)``) has returned the last in-flight batch.
        exhaustion_group: opt-in ``torch.distributed`` process group; every pull of a new batch then
            all-reduces an "exhausted" flag over it, so that all ranks stop at the same step when one rank
            runs out of data (the batches the other ranks pulled at that step are dropped). A gloo group
            (``dist.new_group(backend="gloo")``) avoids a device sync per step; with an NCCL group the flag
            lives on the current CUDA device and is read back with a sync.
        device_timing: on CUDA, also time each stage's work on its stream with CUDA events (``stats()``
            then reports device milliseconds; costs two timing events per stage and step).

    The positional order is torchrec's (``pipeline_stages, debug_mode, compute_stream, on_flush_end``);
    a value of the wrong kind in one of those places (a stream as ``debug_mode``, a callable as
    ``compute_stream``) is rejected with an error that names that order.

    Beyond torchrec: a stage that raises is re-raised as :class:`~pipeline_stages.errors.StageError`
    naming the stage and the batch (chained to the original, and also an instance of the original's builtin
    exception classes); a runnable that returns None for a real batch is a ``StageError`` too. After such an
    error the in-flight batches are dropped (after the compute stream waited for their work), the error says
    which (``dropped_batches``), and the next ``progress()`` refills from the iterator. An error raised by
    the iterator itself loses nothing (see :meth:`progress`). The bound methods of a
    :class:`~pipeline_stages.SparseDataDistUtil` used as stage callables are told which batch each stage
    and each returned batch is (sequence numbers), so its contexts stay matched to their batches. Passing a
    new iterator after the pipeline drained refills at once (a new epoch); torchrec would return None ``n``
    more times first.
    """

    def __init__(
        self,
        pipeline_stages: Sequence[PipelineStage],
        debug_mode: bool = False,
        compute_stream: torch.cuda.Stream | None = None,
        on_flush_end: Callable[[], None] | None = None,
        *,
        exhaustion_group: dist.ProcessGroup | None = None,
        device_timing: bool = False,
    ) -> None:
        if isinstance(pipeline_stages, PipelineStage) or not isinstance(pipeline_stages, Iterable):
            raise InvalidStageError(
                f"`pipeline_stages` must be a sequence of PipelineStage, got {type(pipeline_stages).__name__}"
            )
        stages = list(pipeline_stages)
        if not stages:
            raise InvalidStageError("`pipeline_stages` is empty; expected at least one PipelineStage")
        for position, stage in enumerate(stages):
            if not isinstance(stage, PipelineStage):
                raise InvalidStageError(
                    f"`pipeline_stages[{position}]` must be a PipelineStage, got {type(stage).__name__}"
                )
        names = [stage.name for stage in stages]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise DuplicateStageNameError(
                f"`pipeline_stages` names stage(s) {', '.join(f'`{n}`' for n in duplicates)} more than once; "
                f"stage names must be unique (got {names})"
            )
        if not isinstance(debug_mode, bool):
            raise InvalidStageError(
                f"`debug_mode` must be a bool, got {debug_mode!r}{_order_hint(_is_stream_or_none(debug_mode), 'compute_stream')}"
            )
        if compute_stream is not None and not isinstance(compute_stream, torch.cuda.Stream):
            raise InvalidStageError(
                f"`compute_stream` must be a torch.cuda.Stream or None, got {compute_stream!r}"
                f"{_order_hint(callable(compute_stream), 'on_flush_end')}"
            )
        if on_flush_end is not None and not callable(on_flush_end):
            raise InvalidStageError(f"`on_flush_end` must be callable or None, got {on_flush_end!r}")
        if not isinstance(device_timing, bool):
            raise InvalidStageError(f"`device_timing` must be a bool, got {device_timing!r}")

        self._stages = stages
        self._n = len(stages)
        self._cuda = compute_stream is not None or any(stage.stream is not None for stage in stages)
        if self._cuda and compute_stream is None:
            first = next(stage.stream for stage in stages if stage.stream is not None)
            compute_stream = torch.cuda.current_stream(first.device)
        self._compute_stream = compute_stream
        self.on_flush_end = on_flush_end
        self._debug = debug_mode
        self._group = exhaustion_group
        self._device_timing = device_timing and self._cuda

        # SparseDataDistUtils whose bound methods are stage callables: told the batch sequence numbers.
        self._listeners: list[SparseDataDistUtil] = []
        self._tagged: list[bool] = []
        for stage in stages:
            owners = [
                getattr(fn, "__self__", None)
                for fn in (stage.runnable, stage.fill_callback, stage.data_exhausted_callback)
            ]
            utils = [owner for owner in owners if isinstance(owner, SparseDataDistUtil)]
            for util in utils:
                if all(util is not known for known in self._listeners):
                    self._listeners.append(util)
            self._tagged.append(isinstance(getattr(stage.runnable, "__self__", None), SparseDataDistUtil))
        for util in self._listeners:
            util._link_pipeline()

        self._slots: list[_Slot | None] = [None] * self._n
        self._initialized = False
        self._fill_next = 0  # batch offset the (resumable) fill continues at
        self._step_out: _Slot | None = (
            None  # the slot taken by the step in progress (undone on an iterator error)
        )
        self._stepping = False
        self._pulling = False  # inside the iterator's next(): an error there undoes the step
        self._lost_in_pull = -1  # epoch index of a batch pulled but not yet in a slot when an error hit
        self._num_steps = 0
        self._iter: Iterator[Any] | None = None
        self._exhausted = False
        self._flushing = False
        self._pulled = 0
        self._timers = [_StageTimer(stage.name) for stage in stages]
        self._profiling = False

    # ---------------------------------------------------------------- public API

    @property
    def num_stages(self) -> int:
        """How many stages (= batches in flight once filled)."""
        return self._n

    @property
    def compute_stream(self) -> torch.cuda.Stream | None:
        """The stream returned batches are handed to (None on CPU)."""
        return self._compute_stream

    def set_flush(self, flush: bool) -> None:
        """Stop (True) or resume (False) pulling data; while flushing the in-flight batches drain.

        When the last in-flight batch has been returned, the next ``progress()`` calls ``on_flush_end``,
        refills the pipeline and returns the first new batch.
        """
        self._flushing = flush

    def flush_end(self) -> None:
        """End a flush: resume pulling, refill on the next ``progress()``, call ``on_flush_end``.

        Called by ``progress()`` once a flush drained. Called by hand while batches are still in flight, it
        keeps them (they come out first, then new batches flow in behind them); torchrec would drop them.
        """
        self.set_flush(False)
        if self._drained():
            self._restart()
        if self.on_flush_end is not None:
            self.on_flush_end()

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        """Advance every in-flight batch by one stage and return the oldest one.

        Args:
            dataloader_iter: the data, an iterator (``iter(dataloader)``, as for torchrec). ``next()`` is
                never called again on an iterator that signalled exhaustion (StopIteration or a None item);
                passing another iterator starts a new epoch.

        Returns:
            The output of the last stage for the oldest batch, ready on the compute stream, or None when
            the data is exhausted and every in-flight batch has been returned.

        Raises:
            InvalidStageError: ``dataloader_iter`` is not an iterator (a list, a DataLoader); nothing ran.
            StageError: a stage's runnable or callback raised, or a runnable returned None for a batch. The
                in-flight batches are dropped (``dropped_batches`` lists their epoch indices; also an
                exception note and a warning); the next call refills from the iterator.

        An exception raised by ``dataloader_iter``'s ``next()`` (a corrupt record, a worker crash, a
        ``KeyboardInterrupt`` while waiting for data) propagates unchanged and undoes the step: no stage ran
        in it, no batch is lost, and the next ``progress()`` with the same iterator repeats it (the batches
        in flight come out in order). To drain them without pulling again, ``set_flush(True)`` first. Any
        other ``BaseException`` (a ``KeyboardInterrupt`` inside a stage) drops the in-flight batches like a
        stage error, with the same note and warning.
        """
        if dataloader_iter is not self._iter and not isinstance(dataloader_iter, Iterator):
            raise InvalidStageError(
                f"`dataloader_iter` must be an iterator, got {type(dataloader_iter).__name__}; pass "
                "iter(...) of it (as for torchrec's progress(); each new iterator starts a new epoch)"
            )
        try:
            return self._progress(dataloader_iter)
        except BaseException as error:
            if self._pulling:
                self._undo_step()
            else:
                self._reset_after_error(error)
            raise

    def stats(self) -> dict[str, StageStats]:
        """Per-stage timing, keyed by stage name in stage order (waits for pending device timings)."""
        result: dict[str, StageStats] = {}
        for timer in self._timers:
            if self._device_timing:
                timer.collect(block=True)
            device_total = timer.device_ms if self._device_timing else None
            device_mean = (
                (timer.device_ms / timer.device_count if timer.device_count else 0.0)
                if self._device_timing
                else None
            )
            result[timer.name] = StageStats(
                name=timer.name,
                runs=timer.runs,
                skipped=timer.skipped,
                host_ms_total=timer.host_ns / 1e6,
                host_ms_mean=timer.host_ns / 1e6 / timer.runs if timer.runs else 0.0,
                host_ms_max=timer.host_max_ns / 1e6,
                device_ms_total=device_total,
                device_ms_mean=device_mean,
            )
        return result

    def reset_stats(self) -> None:
        """Zero the counters behind :meth:`stats`."""
        self._timers = [_StageTimer(stage.name) for stage in self._stages]

    # ---------------------------------------------------------------- schedule

    def _progress(self, dataloader_iter: Iterator[Any]) -> Any:
        self._profiling = profiler_enabled()  # once per step: record_function ranges only under a profiler
        if dataloader_iter is not self._iter and self._initialized and self._drained():
            # A new epoch after the previous one drained: refill now instead of returning None n times.
            self._restart()
        while True:
            if not self._initialized:
                self._fill(dataloader_iter)

            out = self._advance()
            if out is None:
                return None
            self._step_out = out
            self._stepping = True
            self._num_steps += 1
            if self._debug:
                logger.info("pipeline step %d", self._num_steps)

            for stage_idx in range(self._n):
                self._run_stage(self._n - 1 - stage_idx, stage_idx, dataloader_iter, fill=False)

            if out.batch is not None and out.event is not None and out.stream != self._compute_stream:
                assert self._compute_stream is not None  # CUDA mode: events exist only there
                self._compute_stream.wait_event(out.event)
                record_stream_all(out.batch, self._compute_stream)
            self._stepping = False

            if out.batch is None:
                if not self._drained():
                    # A bubble (a flush ended by hand, or a new iterator while draining): batches are still
                    # in flight behind it, so step again instead of ending the caller's loop early.
                    continue
                if self._flushing:
                    self.flush_end()
                    continue
                return None
            for listener in self._listeners:
                listener._pipeline_returned(out.seq)
            return out.batch

    def _fill(self, dataloader_iter: Iterator[Any]) -> None:
        # Resumable: an iterator error at batch k leaves batches 0..k-1 filled; the next call goes on at k.
        for batch_offset in range(self._fill_next, self._n):
            for stage_idx in range(self._n - batch_offset):
                self._run_stage(batch_offset, stage_idx, dataloader_iter, fill=True)
            self._fill_next = batch_offset + 1
        self._initialized = True
        if self._debug:
            logger.info("pipeline filled")

    def _restart(self) -> None:
        """Refill on the next ``progress()``."""
        self._initialized = False
        self._fill_next = 0

    def _advance(self) -> _Slot | None:
        out = self._slots[0]
        self._slots[:-1] = self._slots[1:]
        self._slots[-1] = None
        return out

    def _drained(self) -> bool:
        return all(slot is None or slot.batch is None for slot in self._slots)

    def _run_stage(
        self, batch_offset: int, stage_idx: int, dataloader_iter: Iterator[Any], *, fill: bool
    ) -> None:
        stage = self._stages[stage_idx]
        timer = self._timers[stage_idx]
        profiling = self._profiling
        if stage_idx == 0:
            slot = self._next_batch(dataloader_iter)
        else:
            previous = self._slots[batch_offset]
            assert previous is not None  # the schedule always runs stage i-1 on a batch before stage i
            slot = previous

        if slot.batch is None:
            timer.skipped += 1
            if self._debug:
                logger.info("stage %d `%s`: skipped, no batch (data exhausted)", stage_idx, stage.name)
            self._slots[batch_offset] = _EXHAUSTED
            if stage.data_exhausted_callback is not None:
                self._call(stage_idx, "data_exhausted_callback", stage.data_exhausted_callback, -1, profiling)
        else:
            if self._debug:
                logger.info("stage %d `%s`: batch %d", stage_idx, stage.name, slot.index)
            if self._tagged[stage_idx]:
                token = CURRENT_BATCH.set(slot.seq)
                try:
                    new_slot = self._run_runnable(stage_idx, stage, timer, slot, profiling)
                finally:
                    CURRENT_BATCH.reset(token)
            else:
                new_slot = self._run_runnable(stage_idx, stage, timer, slot, profiling)
            self._slots[batch_offset] = new_slot

        if fill and stage.fill_callback is not None:
            index = slot.index if slot.batch is not None else -1
            self._call(stage_idx, "fill_callback", stage.fill_callback, index, profiling)

    def _run_runnable(
        self, stage_idx: int, stage: PipelineStage, timer: _StageTimer, slot: _Slot, profiling: bool
    ) -> _Slot:
        # Hot path (once per stage and step): no helper calls beyond the runnable itself unless profiling.
        if not self._cuda:
            start = perf_counter_ns()
            try:
                if profiling:
                    with record_function(f"## {stage.name} ##"):
                        output = stage.runnable(slot.batch)
                else:
                    output = stage.runnable(slot.batch)
            except Exception as error:
                raise self._wrap(error, stage_idx, slot.index, "runnable") from error
            elapsed = perf_counter_ns() - start
            timer.runs += 1
            timer.host_ns += elapsed
            if elapsed > timer.host_max_ns:
                timer.host_max_ns = elapsed
            if output is None:
                raise self._returned_none(stage_idx, slot.index)
            return _Slot(output, slot.index, slot.seq, None, None)

        stream = stage.stream if stage.stream is not None else torch.cuda.current_stream()
        with stream_context(stage.stream):
            if slot.event is not None and slot.stream != stream:
                stream.wait_event(slot.event)
                record_stream_all(slot.batch, stream)
            begin = new_event(stream, timing=True) if self._device_timing else None
            start = perf_counter_ns()
            output = self._guarded(stage_idx, "runnable", stage.runnable, slot.batch, slot.index, profiling)
            elapsed = perf_counter_ns() - start
            event = new_event(stream, timing=self._device_timing)
        timer.runs += 1
        timer.host_ns += elapsed
        if elapsed > timer.host_max_ns:
            timer.host_max_ns = elapsed
        if begin is not None:
            timer.pending.append((begin, event))
            if len(timer.pending) > 64:
                timer.collect(block=False)
        if output is None:
            raise self._returned_none(stage_idx, slot.index)
        return _Slot(output, slot.index, slot.seq, stream, event)

    def _wrap(self, error: Exception, stage_idx: int, index: int, phase: str) -> StageError:
        return StageError.wrap(
            error,
            stage_name=self._stages[stage_idx].name,
            stage_index=stage_idx,
            num_stages=self._n,
            batch_index=index,
            phase=phase,
        )

    def _returned_none(self, stage_idx: int, index: int) -> StageError:
        return StageError.returned_none(
            stage_name=self._stages[stage_idx].name,
            stage_index=stage_idx,
            num_stages=self._n,
            batch_index=index,
        )

    def _guarded(
        self,
        stage_idx: int,
        phase: str,
        function: Callable[[Any], Any],
        batch: Any,
        index: int,
        profiling: bool,
    ) -> Any:
        stage = self._stages[stage_idx]
        try:
            if profiling:
                with record_function(f"## {stage.name} ##"):
                    return function(batch)
            return function(batch)
        except Exception as error:
            raise self._wrap(error, stage_idx, index, phase) from error

    def _call(
        self, stage_idx: int, phase: str, callback: Callable[[], None], index: int, profiling: bool
    ) -> None:
        stage = self._stages[stage_idx]
        if self._debug:
            logger.info("stage %d `%s`: %s", stage_idx, stage.name, phase)
        try:
            if profiling:
                with record_function(f"## {stage.name} {phase} ##"):
                    callback()
            else:
                callback()
        except Exception as error:
            raise self._wrap(error, stage_idx, index, phase) from error

    # ---------------------------------------------------------------- data

    def _next_batch(self, dataloader_iter: Iterator[Any]) -> _Slot:
        if dataloader_iter is not self._iter:
            self._iter = dataloader_iter
            self._exhausted = False
            self._pulled = 0
        if self._exhausted or self._flushing:
            return _EXHAUSTED
        # An error inside next() undoes the step (see progress()): nothing else has run in it yet.
        self._pulling = True
        if self._profiling:
            with record_function("## next_batch ##"):
                batch = next(dataloader_iter, None)
        else:
            batch = next(dataloader_iter, None)
        self._pulling = False
        if self._group is not None:
            try:
                batch = self._agree(batch)
            except BaseException:
                if batch is not None:
                    self._lost_in_pull = self._pulled
                raise
        if batch is None:
            self._exhausted = True
            if self._debug:
                logger.info("data exhausted after %d batches", self._pulled)
            return _EXHAUSTED
        index = self._pulled
        self._pulled += 1
        return _Slot(batch=batch, index=index, seq=next_sequence(), stream=None, event=None)

    def _agree(self, batch: Any) -> Any:
        """All ranks of the exhaustion group stop together: any rank out of data means all are."""
        assert self._group is not None
        if dist.get_backend(self._group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        flag = torch.tensor([1 if batch is None else 0], dtype=torch.int32, device=device)
        with record_function("## exhaustion_all_reduce ##"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if int(flag.item()) != 0:
            if batch is not None and self._debug:
                logger.info("another rank ran out of data: dropping the batch pulled at this step")
            return None
        return batch

    # ---------------------------------------------------------------- errors

    def _undo_step(self) -> None:
        """The iterator raised inside ``next()``: put the step's batch back so the next call repeats it."""
        self._pulling = False
        if self._stepping:
            # Stage 0 pulls first in a step, so no stage ran yet: only the advance is to be undone.
            self._slots = [self._step_out, *self._slots[:-1]]
            self._num_steps -= 1
            self._stepping = False
        # In a fill, _fill_next already points at the batch offset whose pull failed.
        self._step_out = None

    def _reset_after_error(self, error: BaseException) -> None:
        """Drop every in-flight batch once the compute stream waits for all work the stages launched."""
        in_flight = [slot for slot in self._slots if slot is not None and slot.batch is not None]
        if self._stepping and self._step_out is not None and self._step_out.batch is not None:
            in_flight.insert(0, self._step_out)  # taken by this step, never returned
        dropped = sorted({slot.index for slot in in_flight} | ({self._lost_in_pull} - {-1}))
        seqs = [slot.seq for slot in in_flight]
        if self._compute_stream is not None:
            for stage in self._stages:
                if stage.stream is not None and stage.stream != self._compute_stream:
                    self._compute_stream.wait_stream(stage.stream)
        self._slots = [None] * self._n
        self._restart()
        self._stepping = False
        self._step_out = None
        self._lost_in_pull = -1
        for listener in self._listeners:
            listener._pipeline_dropped(seqs)
        if isinstance(error, StageError):
            error.dropped_batches = tuple(dropped)
        if dropped:
            note = (
                f"pipeline_stages: this error dropped {len(dropped)} in-flight batch(es) of the epoch "
                f"(indices {', '.join(map(str, dropped))}); the next progress() refills from the iterator"
            )
            add_note = getattr(error, "add_note", None)  # Python >= 3.11
            if add_note is not None:
                add_note(note)
            logger.warning("%s (%s)", note, type(error).__name__)
