"""The schedule: torchrec's fill/progress order, callbacks, exhaustion, flush and epochs (CPU, inline)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline_stages import (
    DuplicateStageNameError,
    InvalidStageError,
    PipelineStage,
    StagedTrainPipeline,
)

Event = tuple[Any, ...]


class Recorder:
    """Records every pull, runnable run and callback, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def iterator(self, n: int, *, start: int = 0) -> Iterator[int]:
        """Yields start..start+n-1, recording each pull (and any pull after exhaustion)."""
        return _RecordingIterator(self.events, start, n)

    def stages(
        self, n: int, *, fill: frozenset[int] = frozenset(), exhausted: frozenset[int] = frozenset()
    ) -> list[PipelineStage]:
        def runnable(stage: int) -> Any:
            def run(batch: int) -> int:
                self.events.append(("run", stage, batch))
                return batch

            return run

        def callback(kind: str, stage: int) -> Any:
            return lambda: self.events.append((kind, stage))

        return [
            PipelineStage(
                name=f"s{stage}",
                runnable=runnable(stage),
                fill_callback=callback("fill", stage) if stage in fill else None,
                data_exhausted_callback=callback("exhausted", stage) if stage in exhausted else None,
            )
            for stage in range(n)
        ]


class _RecordingIterator:
    def __init__(self, events: list[Event], start: int, n: int) -> None:
        self.events, self.next_item, self.stop, self.exhausted = events, start, start + n, False

    def __iter__(self) -> _RecordingIterator:
        return self

    def __next__(self) -> int:
        if self.exhausted:
            self.events.append(("pulled after exhaustion",))
            raise StopIteration
        if self.next_item == self.stop:
            self.exhausted = True
            self.events.append(("next", None))
            raise StopIteration
        item = self.next_item
        self.next_item += 1
        self.events.append(("next", item))
        return item


def reference_events(
    n: int, total: int, calls: int, fill: frozenset[int], exhausted: frozenset[int]
) -> tuple[list[Event], list[int | None]]:
    """torchrec's order in closed form: fill runs batch k through stages 0..n-1-k; call t runs stage s on
    batch t-1+n-s and returns batch t-1. Batch `total` is the pull that signals exhaustion; no pull after."""
    events: list[Event] = []

    def stage_on(stage: int, batch: int) -> None:
        if stage == 0 and batch <= total:
            events.append(("next", batch if batch < total else None))
        if batch < total:
            events.append(("run", stage, batch))
        elif stage in exhausted:
            events.append(("exhausted", stage))

    for batch in range(n):
        for stage in range(n - batch):
            stage_on(stage, batch)
            if stage in fill:
                events.append(("fill", stage))
    returned: list[int | None] = []
    for t in range(1, calls + 1):
        for stage in range(n):
            stage_on(stage, t - 1 + n - stage)
        returned.append(t - 1 if t - 1 < total else None)
    return events, returned


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 4),
    total=st.integers(0, 7),
    extra=st.integers(0, 3),
    fill=st.frozensets(st.integers(0, 3)),
    exhausted=st.frozensets(st.integers(0, 3)),
)
def test_order_matches_torchrec_closed_form(
    n: int, total: int, extra: int, fill: frozenset[int], exhausted: frozenset[int]
) -> None:
    """Fill, progress, callbacks and exhaustion follow torchrec's order for 1-4 stages and short iterators."""
    recorder = Recorder()
    pipeline = StagedTrainPipeline(recorder.stages(n, fill=fill, exhausted=exhausted))
    it = recorder.iterator(total)
    calls = total + extra + 1
    returned = [pipeline.progress(it) for _ in range(calls)]
    expected_events, expected_returned = reference_events(n, total, calls, fill, exhausted)
    assert returned == expected_returned
    assert recorder.events == expected_events


def test_seed_three_stage_order() -> None:
    """The issue's example: fill b0 copy,start,wait(cb),prefetch,load(cb); b1 copy,start,wait(cb); b2 copy."""
    log: list[str] = []

    def step(name: str) -> Any:
        def run(batch: int) -> int:
            log.append(f"b{batch} {name}")
            return batch

        return run

    stages = [
        PipelineStage("copy", step("copy")),
        PipelineStage("start_sdd", step("start_sdd"), fill_callback=lambda: log.append("wait_sdd (cb)")),
        PipelineStage("prefetch", step("prefetch"), fill_callback=lambda: log.append("load_prefetch (cb)")),
    ]
    pipeline = StagedTrainPipeline(stages)
    out = pipeline.progress(iter(range(10)))
    assert out == 0
    assert log == [
        "b0 copy", "b0 start_sdd", "wait_sdd (cb)", "b0 prefetch", "load_prefetch (cb)",
        "b1 copy", "b1 start_sdd", "wait_sdd (cb)",
        "b2 copy",
        "b3 copy", "b2 start_sdd", "b1 prefetch",
    ]  # fmt: skip


def test_empty_iterator_returns_none_and_never_pulls_again() -> None:
    """An empty iterator gives None at once; later calls do not call next() on it again."""
    pulls = 0

    class Empty:
        def __iter__(self) -> Empty:
            return self

        def __next__(self) -> int:
            nonlocal pulls
            pulls += 1
            raise StopIteration

    recorder = Recorder()
    pipeline = StagedTrainPipeline(recorder.stages(3))
    it = Empty()
    assert [pipeline.progress(it) for _ in range(4)] == [None] * 4
    assert pulls == 1
    assert recorder.events == []


def test_flush_drains_calls_on_flush_end_and_refills() -> None:
    """set_flush(True) stops pulling, drains in-flight batches, calls on_flush_end, then refills."""
    recorder = Recorder()
    flushes: list[int] = []
    pipeline = StagedTrainPipeline(
        recorder.stages(2), on_flush_end=lambda: flushes.append(len(recorder.events))
    )
    it = recorder.iterator(10)
    out = [pipeline.progress(it) for _ in range(3)]
    assert out == [0, 1, 2]
    pipeline.set_flush(True)
    mark = len(recorder.events)
    assert pipeline.progress(it) == 3
    assert pipeline.progress(it) == 4
    assert ("next", 5) not in recorder.events  # nothing pulled while flushing
    assert recorder.events[mark:] == [("run", 1, 4)]
    assert flushes == []
    assert pipeline.progress(it) == 5  # on_flush_end, refill, first new batch
    assert flushes == [mark + 1]
    assert recorder.events[mark + 1 :] == [
        ("next", 5), ("run", 0, 5), ("run", 1, 5), ("next", 6), ("run", 0, 6),
        ("next", 7), ("run", 0, 7), ("run", 1, 6),
    ]  # fmt: skip
    rest = []
    while (batch := pipeline.progress(it)) is not None:
        rest.append(batch)
    assert rest == [6, 7, 8, 9]


def test_flush_end_manual_refills() -> None:
    """flush_end() by hand also resumes pulling and refills on the next call."""
    recorder = Recorder()
    ended: list[bool] = []
    pipeline = StagedTrainPipeline(recorder.stages(2), on_flush_end=lambda: ended.append(True))
    it = recorder.iterator(6)
    assert pipeline.progress(it) == 0
    pipeline.set_flush(True)
    assert pipeline.progress(it) == 1
    pipeline.flush_end()
    assert ended == [True]
    # batch 2 was never pulled (flushing): the refill starts at 2
    assert [pipeline.progress(it) for _ in range(5)] == [2, 3, 4, 5, None]


def test_new_iterator_starts_a_new_epoch() -> None:
    """After a drained epoch, a new iterator refills at once and its batches come out in order."""
    recorder = Recorder()
    pipeline = StagedTrainPipeline(recorder.stages(3))
    first = recorder.iterator(2)
    assert [pipeline.progress(first) for _ in range(3)] == [0, 1, None]
    second = recorder.iterator(4, start=100)
    epoch2 = []
    while (batch := pipeline.progress(second)) is not None:
        epoch2.append(batch)
    assert epoch2 == [100, 101, 102, 103]
    assert ("pulled after exhaustion",) not in recorder.events


def test_new_iterator_mid_epoch_continues_in_flight_batches() -> None:
    """Switching iterators with batches in flight returns those first (torchrec), then the new ones."""
    recorder = Recorder()
    pipeline = StagedTrainPipeline(recorder.stages(2))
    first = recorder.iterator(10)
    assert pipeline.progress(first) == 0
    second = recorder.iterator(3, start=50)
    out = []
    while (batch := pipeline.progress(second)) is not None:
        out.append(batch)
    assert out == [1, 2, 50, 51, 52]


def test_runnable_output_flows_to_next_stage() -> None:
    """Each stage receives the previous stage's output, the pipeline returns the last one."""
    stages = [
        PipelineStage("add", lambda b: b + 1),
        PipelineStage("mul", lambda b: b * 10),
        PipelineStage("neg", lambda b: -b),
    ]
    pipeline = StagedTrainPipeline(stages)
    it = iter(range(5))
    out = []
    while (batch := pipeline.progress(it)) is not None:
        out.append(batch)
    assert out == [-(b + 1) * 10 for b in range(5)]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"name": "", "runnable": lambda b: b}, InvalidStageError),
        ({"name": "x", "runnable": 3}, InvalidStageError),
        ({"name": "x", "runnable": lambda b: b, "stream": "cuda"}, InvalidStageError),
        ({"name": "x", "runnable": lambda b: b, "fill_callback": 1}, InvalidStageError),
    ],
    ids=["empty-name", "runnable-not-callable", "stream-not-a-stream", "callback-not-callable"],
)
def test_pipeline_stage_validates(kwargs: dict[str, Any], error: type[Exception]) -> None:
    """Bad PipelineStage arguments raise a clear error naming the argument."""
    with pytest.raises(error, match="`"):
        PipelineStage(**kwargs)


def test_pipeline_validates_arguments() -> None:
    """Empty stage lists, duplicate names and a non-stream compute_stream are rejected."""
    with pytest.raises(InvalidStageError, match="`pipeline_stages` is empty"):
        StagedTrainPipeline([])
    with pytest.raises(DuplicateStageNameError, match="`a`"):
        StagedTrainPipeline([PipelineStage("a", lambda b: b), PipelineStage("a", lambda b: b)])
    with pytest.raises(InvalidStageError, match="`compute_stream`"):
        StagedTrainPipeline([PipelineStage("a", lambda b: b)], compute_stream="cuda:0")  # type: ignore[arg-type]  # not a stream
    with pytest.raises(InvalidStageError, match=r"`pipeline_stages\[0\]`"):
        StagedTrainPipeline(["a"])  # type: ignore[list-item]  # wrong element type on purpose
    with pytest.raises(TypeError):
        StagedTrainPipeline([PipelineStage("a", lambda b: b)], debug_mode=1)  # type: ignore[arg-type]  # not a bool
