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


def test_stage_returning_none_for_a_batch_raises_a_stage_error() -> None:
    """A runnable returning None for a real batch is a StageError (and TypeError) naming the stage and batch,
    not a silent end of the epoch: the next stage's data_exhausted_callback never fires."""
    exhausted: list[str] = []
    stages = [
        PipelineStage("copy", lambda b: b),
        PipelineStage("postproc", lambda b: None if b == 3 else b),
        PipelineStage("prefetch", lambda b: b, data_exhausted_callback=lambda: exhausted.append("prefetch")),
    ]
    pipeline = StagedTrainPipeline(stages)
    it = iter(range(20))
    seen = [pipeline.progress(it)]
    with pytest.raises(
        TypeError, match=r"stage `postproc` \(stage 1 of 3\) returned None for batch 3; a stage's `runnable`"
    ) as info:
        pipeline.progress(it)
    assert isinstance(info.value, StageError)
    assert (info.value.stage_name, info.value.batch_index, info.value.phase) == ("postproc", 3, "runnable")
    assert seen == [0]  # the second progress() runs `postproc` on batch 3
    assert info.value.dropped_batches == (1, 2, 3, 4)
    assert exhausted == []


def test_stage_returning_none_always_fails_at_once_not_by_recursion() -> None:
    """A runnable that always returns None fails on batch 0 instead of eating 5000 batches (RecursionError)."""
    pipeline = StagedTrainPipeline([PipelineStage("copy", lambda b: b), PipelineStage("bad", lambda b: None)])
    it = iter(range(5000))
    with pytest.raises(StageError, match=r"stage `bad` .* returned None for batch 0") as info:
        pipeline.progress(it)
    assert info.value.batch_index == 0
    assert next(it) == 1  # the fill stopped at batch 0: nothing else was pulled


class DecodeLike(UnicodeDecodeError):
    """A user subclass of a builtin whose constructor takes five arguments, built with one."""

    def __init__(self, reason: str) -> None:
        super().__init__("utf-8", b"\xff", 0, 1, reason)
        self.args = (reason,)


class KeyAndValue(KeyError, ValueError):
    """A user error under two builtins."""


def raise_in_stage(error: Exception) -> StageError:
    pipeline = StagedTrainPipeline([PipelineStage("decode", failing(0, error))])
    with pytest.raises(StageError) as info:
        pipeline.progress(iter(range(2)))
    assert info.value.__cause__ is error
    return info.value


@pytest.mark.parametrize(
    ("original", "builtins"),
    [
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), (UnicodeDecodeError, ValueError)),
        (KeyAndValue("k"), (KeyError, LookupError, ValueError)),
        (DecodeLike("bad byte"), (UnicodeError, ValueError)),
        (FileNotFoundError(2, "no such file"), (FileNotFoundError, OSError)),
        (Boom("x"), (Exception,)),
    ],
    ids=["unicode-decode", "user-key-and-value", "user-decode-one-arg", "file-not-found", "user-plain"],
)
def test_stage_error_is_an_instance_of_every_builtin_of_the_original(
    original: Exception, builtins: tuple[type[Exception], ...]
) -> None:
    """`except ValueError` catches a stage's UnicodeDecodeError and user subclasses of several builtins."""
    error = raise_in_stage(original)
    for builtin in builtins:
        assert isinstance(error, builtin), builtin
    assert not isinstance(error, type(original)) or type(original).__module__ == "builtins"
    assert str(error).startswith("stage `decode` (stage 0 of 1) raised ")
    assert error.args == (str(error),)


def test_stage_error_keeps_the_builtin_fields() -> None:
    """Builtin fields (UnicodeDecodeError.start/encoding, OSError.errno) carry over; KeyError's is unquoted."""
    decode = raise_in_stage(UnicodeDecodeError("utf-8", b"ab\xff", 2, 3, "invalid start byte"))
    assert isinstance(decode, UnicodeDecodeError)
    assert (decode.encoding, decode.object, decode.start, decode.end) == ("utf-8", b"ab\xff", 2, 3)
    missing = raise_in_stage(FileNotFoundError(2, "no such file"))
    assert isinstance(missing, OSError)
    assert missing.errno == 2
    key = raise_in_stage(KeyError("f9"))
    assert str(key) == "stage `decode` (stage 0 of 1) raised KeyError on batch 0: 'f9'"


@pytest.mark.parametrize(
    "original",
    [
        ValueError("bad ids"),
        KeyError("k"),
        Boom("x"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        KeyAndValue("k"),
        FileNotFoundError(2, "no such file"),
    ],
    ids=["value", "key", "user-plain", "unicode-decode", "user-key-and-value", "file-not-found"],
)
def test_stage_errors_pickle(original: Exception) -> None:
    """Every StageError pickles (multiprocessing error transport) with its class, message and attributes."""
    import pickle

    error = raise_in_stage(original)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert copy.args == error.args
    assert (copy.stage_name, copy.stage_index, copy.batch_index, copy.phase, copy.dropped_batches) == (
        error.stage_name,
        error.stage_index,
        error.batch_index,
        error.phase,
        error.dropped_batches,
    )
    assert getattr(copy, "__notes__", None) == getattr(error, "__notes__", None)


def test_returned_none_error_pickles() -> None:
    """The returned-None StageError pickles too and stays a TypeError."""
    import pickle

    pipeline = StagedTrainPipeline([PipelineStage("bad", lambda b: None)])
    with pytest.raises(StageError) as info:
        pipeline.progress(iter(range(2)))
    copy = pickle.loads(pickle.dumps(info.value))
    assert isinstance(copy, TypeError)
    assert str(copy) == str(info.value)
