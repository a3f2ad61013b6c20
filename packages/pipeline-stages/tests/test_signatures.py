"""Signature freeze: the positional order of torchrec's constructors, and clear errors for shifted calls."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from pipeline_stages import InvalidStageError, PipelineStage, SparseDataDistUtil, StagedTrainPipeline

# torchrec 1.x (torchrec/distributed/train_pipeline/train_pipelines.py and pipeline_stage.py).
TORCHREC_PIPELINE = ["pipeline_stages", "debug_mode", "compute_stream", "on_flush_end"]
TORCHREC_SDD = ["model", "data_dist_stream", "apply_jit", "prefetch_stream"]


class Sparse(nn.Module):
    def start_input_dist(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def wait_input_dist(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def enqueue_pipelined_input(self, dist_features: torch.Tensor) -> None:
        pass

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


def positional(function: object) -> list[str]:
    parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]  # any callable
    return [
        p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name != "self"
    ]


def test_positional_parameters_are_torchrecs() -> None:
    """StagedTrainPipeline and SparseDataDistUtil take torchrec's positional parameters, in its order."""
    assert positional(StagedTrainPipeline.__init__) == TORCHREC_PIPELINE
    assert positional(SparseDataDistUtil.__init__) == TORCHREC_SDD


def test_torchrec_positional_call_binds_the_same_way() -> None:
    """StagedTrainPipeline(stages, True, None, on_flush_end) means what it means in torchrec."""
    ended: list[bool] = []
    pipeline = StagedTrainPipeline([PipelineStage("a", lambda b: b)], True, None, lambda: ended.append(True))
    assert pipeline._debug is True
    assert pipeline.compute_stream is None
    it = iter(range(2))
    assert pipeline.progress(it) == 0
    pipeline.set_flush(True)
    assert pipeline.progress(it) == 1
    assert ended == []
    assert pipeline.progress(it) is None  # the flush drained: on_flush_end, refill (nothing left)
    assert ended == [True]
    sdd = SparseDataDistUtil(Sparse(), None, False, None)
    assert (sdd.data_dist_stream, sdd.prefetch_stream) == (None, None)


def test_shifted_positional_calls_name_torchrecs_order() -> None:
    """The old order (on_flush_end in compute_stream's place) is rejected with torchrec's order named."""
    stages = [PipelineStage("a", lambda b: b)]
    with pytest.raises(InvalidStageError, match=r"`compute_stream` .*torchrec's, StagedTrainPipeline\("):
        StagedTrainPipeline(stages, False, lambda: None)  # type: ignore[arg-type]  # shifted on purpose
    with pytest.raises(
        InvalidStageError, match=r"`debug_mode` must be a bool, got None; .*`compute_stream=`"
    ):
        StagedTrainPipeline(stages, None)  # type: ignore[arg-type]  # shifted on purpose
    with pytest.raises(
        InvalidStageError, match=r"`apply_jit` must be a bool, got None; .*`prefetch_stream=`"
    ):
        SparseDataDistUtil(Sparse(), None, None)  # type: ignore[arg-type]  # shifted on purpose
    with pytest.raises(InvalidStageError, match=r"`apply_jit=True` is not supported"):
        SparseDataDistUtil(Sparse(), apply_jit=True)
    with pytest.raises(InvalidStageError, match=r"`pipeline_stages` must be a sequence"):
        StagedTrainPipeline(stages[0])  # type: ignore[arg-type]  # a single stage


def test_progress_rejects_an_iterable_that_is_not_an_iterator() -> None:
    """progress(list) names `dataloader_iter` and iter(); the pipeline is untouched and works afterwards."""
    log: list[int] = []

    def record(batch: int) -> int:
        log.append(batch)
        return batch

    pipeline = StagedTrainPipeline([PipelineStage("a", record)])
    data = [1, 2, 3]
    with pytest.raises(
        InvalidStageError, match=r"`dataloader_iter` must be an iterator, got list; pass iter"
    ):
        pipeline.progress(data)  # type: ignore[arg-type]  # an iterable, not an iterator
    with pytest.raises(TypeError):  # InvalidStageError is a TypeError
        pipeline.progress(data)  # type: ignore[arg-type]  # an iterable, not an iterator
    assert log == []
    it = iter(data)
    assert [pipeline.progress(it) for _ in range(4)] == [1, 2, 3, None]
