"""Stage errors, stats(), profiler ranges and debug logging (CPU)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

from pipeline_stages import PipelineError, PipelineStage, StagedTrainPipeline, StageError


class Boom(Exception):
    """A user-defined error type (not a builtin)."""


def failing(at: int, error: Exception) -> Any:
    def run(batch: int) -> int:
        if batch == at:
            raise error
        return batch

    return run


def test_stage_error_names_stage_and_batch_and_keeps_builtin_type() -> None:
    """A ValueError in a stage arrives as a StageError that is a ValueError, chained to the original."""
    original = ValueError("bad ids")
    stages = [PipelineStage("copy", lambda b: b), PipelineStage("prefetch", failing(4, original))]
    pipeline = StagedTrainPipeline(stages)
    it = iter(range(10))
    seen = [pipeline.progress(it) for _ in range(3)]
    assert seen == [0, 1, 2]
    with pytest.raises(
        ValueError, match=r"stage `prefetch` \(stage 1 of 2\) raised ValueError on batch 4: bad ids"
    ) as info:
        pipeline.progress(it)
    error = info.value
    assert isinstance(error, StageError)
    assert isinstance(error, PipelineError)
    assert error.__cause__ is original
    assert (error.stage_name, error.stage_index, error.batch_index, error.phase) == (
        "prefetch",
        1,
        4,
        "runnable",
    )


def test_stage_error_for_user_exception_and_torch_error() -> None:
    """Non-builtin errors map to their nearest builtin base (Exception for plain user errors)."""
    for original, builtin in ((Boom("x"), Exception), (torch.OutOfMemoryError("oom"), RuntimeError)):
        pipeline = StagedTrainPipeline([PipelineStage("s", failing(0, original))])
        with pytest.raises(StageError) as info:
            pipeline.progress(iter(range(3)))
        assert isinstance(info.value, builtin)
        assert info.value.__cause__ is original


def test_after_an_error_the_pipeline_refills_and_continues() -> None:
    """In-flight batches are dropped on error; the next call refills from where the iterator is."""
    calls: list[int] = []

    def once(batch: int) -> int:
        calls.append(batch)
        if batch == 3 and calls.count(3) == 1:
            raise KeyError("k")
        return batch

    pipeline = StagedTrainPipeline([PipelineStage("a", lambda b: b), PipelineStage("b", once)])
    it = iter(range(8))
    assert pipeline.progress(it) == 0
    assert pipeline.progress(it) == 1
    with pytest.raises(KeyError) as info:
        pipeline.progress(it)  # stage b raises on batch 3; batches 2 and 4 (in flight) are dropped
    assert isinstance(info.value, StageError)
    rest = []
    while (batch := pipeline.progress(it)) is not None:
        rest.append(batch)
    assert rest == [5, 6, 7]


def test_error_in_fill_callback_is_wrapped() -> None:
    """A fill callback that raises names the stage and the phase."""

    def bad() -> None:
        raise RuntimeError("wait failed")

    pipeline = StagedTrainPipeline([PipelineStage("sdd", lambda b: b, fill_callback=bad)])
    with pytest.raises(
        RuntimeError, match=r"stage `sdd` .* in its fill_callback on batch 0: wait failed"
    ) as info:
        pipeline.progress(iter(range(2)))
    assert isinstance(info.value, StageError)
    assert info.value.phase == "fill_callback"


def test_stats_count_runs_skips_and_time() -> None:
    """stats() reports runs, skips and host time per stage, in stage order."""

    def slow(batch: int) -> int:
        time.sleep(0.002)
        return batch

    pipeline = StagedTrainPipeline([PipelineStage("fast", lambda b: b), PipelineStage("slow", slow)])
    it = iter(range(5))
    while pipeline.progress(it) is not None:
        pass
    stats = pipeline.stats()
    assert list(stats) == ["fast", "slow"]
    assert stats["fast"].runs == 5
    assert stats["slow"].runs == 5
    assert stats["fast"].skipped >= 1
    assert stats["slow"].skipped >= 1
    assert stats["slow"].host_ms_total >= 5 * 2.0
    assert stats["slow"].host_ms_mean >= 2.0
    assert stats["slow"].host_ms_max >= stats["slow"].host_ms_mean
    assert stats["slow"].device_ms_total is None
    pipeline.reset_stats()
    assert pipeline.stats()["slow"].runs == 0


def test_profiler_ranges_are_named_after_stages() -> None:
    """Under torch.profiler every stage run is a range named after the stage."""
    pipeline = StagedTrainPipeline(
        [PipelineStage("data_copy", lambda b: b), PipelineStage("prefetch", lambda b: b)]
    )
    it = iter(range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        while pipeline.progress(it) is not None:
            pass
    names = {event.name for event in prof.events()}
    assert "## data_copy ##" in names
    assert "## prefetch ##" in names
    assert "## next_batch ##" in names


def test_debug_mode_logs_each_stage(caplog: pytest.LogCaptureFixture) -> None:
    """debug_mode=True logs stage runs, skips and callbacks on logger `pipeline_stages`."""
    pipeline = StagedTrainPipeline(
        [PipelineStage("copy", lambda b: b, fill_callback=lambda: None)], debug_mode=True
    )
    with caplog.at_level(logging.INFO, logger="pipeline_stages"):
        it = iter(range(1))
        while pipeline.progress(it) is not None:
            pass
    text = caplog.text
    assert "stage 0 `copy`: batch 0" in text
    assert "fill_callback" in text
    assert "skipped" in text


def test_stop_iteration_from_a_stage_does_not_look_like_exhaustion() -> None:
    """A StopIteration raised by a stage is a StageError but not a StopIteration (it would end loops)."""
    original = StopIteration("oops")
    pipeline = StagedTrainPipeline([PipelineStage("s", failing(0, original))])
    with pytest.raises(StageError) as info:
        pipeline.progress(iter(range(2)))
    assert not isinstance(info.value, StopIteration)
    assert info.value.__cause__ is original
