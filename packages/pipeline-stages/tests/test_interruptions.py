"""Errors that do not come from a stage: an iterator that raises, KeyboardInterrupt (CPU, inline)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline_stages import PipelineStage, StagedTrainPipeline, StageError


class FlakyIterator:
    """Yields 0..n-1; raises ``error`` once, instead of yielding ``fail_at``, then goes on with ``fail_at``."""

    def __init__(self, n: int, fail_at: int, error: BaseException) -> None:
        self.n = n
        self.fail_at = fail_at
        self.error: BaseException | None = error
        self.next_value = 0

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self.next_value == self.fail_at and self.error is not None:
            error, self.error = self.error, None
            raise error
        if self.next_value >= self.n:
            raise StopIteration
        value = self.next_value
        self.next_value += 1
        return value


def logged_stages(n: int, log: list[tuple[int, int]]) -> list[PipelineStage]:
    def runnable(stage: int) -> Any:
        def run(batch: int) -> int:
            log.append((stage, batch))
            return batch

        return run

    return [PipelineStage(f"s{i}", runnable(i)) for i in range(n)]


def drain(pipeline: StagedTrainPipeline, it: Iterator[int], catch: type[BaseException]) -> list[int]:
    out: list[int] = []
    while True:
        try:
            batch = pipeline.progress(it)
        except catch:
            continue
        if batch is None:
            return out
        out.append(batch)


@pytest.mark.parametrize("stages", [1, 3], ids=["1-stage", "3-stages"])
@pytest.mark.parametrize("fail_at", [1, 2, 6], ids=["pull-1", "pull-2", "pull-6"])
@pytest.mark.parametrize(
    "error", [ValueError("corrupt record"), KeyboardInterrupt()], ids=["value-error", "keyboard-interrupt"]
)
def test_an_iterator_error_loses_no_batch(stages: int, fail_at: int, error: BaseException) -> None:
    """After next() raised (even KeyboardInterrupt), the next progress() repeats the step: every batch comes
    out once, in order, and every stage ran on every batch exactly once, as in an uninterrupted run."""
    log: list[tuple[int, int]] = []
    pipeline = StagedTrainPipeline(logged_stages(stages, log))
    got = drain(pipeline, FlakyIterator(10, fail_at, error), type(error))
    assert got == list(range(10))
    clean_log: list[tuple[int, int]] = []
    clean = StagedTrainPipeline(logged_stages(stages, clean_log))
    assert drain(clean, iter(range(10)), type(error)) == list(range(10))
    assert log == clean_log


def test_an_iterator_error_propagates_unchanged_and_the_batches_in_flight_drain() -> None:
    """The iterator's own exception comes out as is; a generator that died then drains the pulled batches."""

    def generator() -> Iterator[int]:
        yield from range(5)
        raise OSError("disk gone")

    pipeline = StagedTrainPipeline(logged_stages(3, []))
    it = generator()
    got = [pipeline.progress(it) for _ in range(2)]
    with pytest.raises(OSError, match="disk gone") as info:
        pipeline.progress(it)
    assert not isinstance(info.value, StageError)
    while (batch := pipeline.progress(it)) is not None:  # the dead generator reads as exhausted
        got.append(batch)
    assert got == [0, 1, 2, 3, 4]


def test_flush_after_an_iterator_error_drains_without_pulling() -> None:
    """set_flush(True) after an iterator error returns the batches in flight without calling next() again."""
    pulls: list[int] = []

    class Broken:
        def __iter__(self) -> Iterator[int]:
            return self

        def __next__(self) -> int:
            pulls.append(len(pulls))
            if len(pulls) > 4:
                raise RuntimeError("broken for good")
            return len(pulls) - 1

    pipeline = StagedTrainPipeline(logged_stages(3, []))
    it = Broken()
    assert pipeline.progress(it) == 0
    with pytest.raises(RuntimeError, match="broken for good"):
        pipeline.progress(it)
    pipeline.set_flush(True)
    rest = [pipeline.progress(it) for _ in range(3)]
    assert rest == [1, 2, 3]
    assert len(pulls) == 5


def test_keyboard_interrupt_in_a_stage_reports_the_dropped_batches(caplog: pytest.LogCaptureFixture) -> None:
    """A KeyboardInterrupt inside a stage drops the in-flight batches and says exactly which (note, log)."""

    def interrupt_on_3(batch: int) -> int:
        if batch == 3:
            raise KeyboardInterrupt
        return batch

    stages = [
        PipelineStage("copy", lambda b: b),
        PipelineStage("sdd", interrupt_on_3),
        PipelineStage("p", lambda b: b),
    ]
    pipeline = StagedTrainPipeline(stages)
    it = iter(range(10))
    assert pipeline.progress(it) == 0
    with pytest.raises(KeyboardInterrupt) as info:
        pipeline.progress(it)  # `sdd` on batch 3; batches 1 (done with every stage), 2, 3, 4 in flight
    message = "dropped 4 in-flight batch(es) of the epoch (indices 1, 2, 3, 4)"
    assert message in caplog.text
    if sys.version_info >= (3, 11):
        assert any(message in note for note in info.value.__notes__)
    assert pipeline.progress(it) == 5  # refilled from the iterator


def test_stage_error_lists_the_dropped_batches() -> None:
    """StageError.dropped_batches names the epoch indices of every in-flight batch the error dropped."""

    def fail_on_5(batch: int) -> int:
        if batch == 5:
            raise ValueError("bad")
        return batch

    pipeline = StagedTrainPipeline([PipelineStage("a", lambda b: b), PipelineStage("b", fail_on_5)])
    it = iter(range(10))
    assert [pipeline.progress(it) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(StageError) as info:
        pipeline.progress(it)  # `b` on batch 5; batch 4 (through both stages) and 6 are in flight
    assert info.value.dropped_batches == (4, 5, 6)
