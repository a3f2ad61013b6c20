"""``PipelineStage``: one gradient-less transform of a batch, on its own stream (torchrec's dataclass)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline_stages.errors import InvalidStageError

__all__ = ["PipelineStage", "Runnable"]

Runnable = Callable[[Any], Any]
"""``runnable(batch) -> batch``: the stage's transform (a data copy, a sparse data dist start, a prefetch)."""


@dataclass(frozen=True, slots=True, eq=False)
class PipelineStage:
    """One stage of a :class:`~pipeline_stages.StagedTrainPipeline`.

    Args:
        name: the stage's name; it names the stage in errors, ``stats()``, debug logs and profiler ranges,
            and must be unique within a pipeline.
        runnable: ``runnable(batch) -> batch``, a transform that does not take part in the model's
            backward (host-to-device copy, sparse data dist start, prefetch, GPU postprocessing). It may
            return a new object but never None (the pipeline raises a ``StageError`` naming the stage:
            None would read as "data exhausted").
        stream: the CUDA stream the runnable runs on, or None to run on the stream that is current when
            ``progress()`` is called (on CPU streams do not exist: always None there).
        fill_callback: called right after this stage ran, only while the pipeline fills (torchrec: the
            sparse data dist's wait, the prefetch's load).
        data_exhausted_callback: called instead of the runnable whenever this stage's input is None
            because the data is exhausted (or the pipeline flushes).
    """

    name: str
    runnable: Runnable
    stream: torch.cuda.Stream | None = None
    fill_callback: Callable[[], None] | None = None
    data_exhausted_callback: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidStageError(f"`name` must be a non-empty str, got {self.name!r}")
        if not callable(self.runnable):
            raise InvalidStageError(
                f"`runnable` of stage `{self.name}` must be callable (batch -> batch), got {self.runnable!r}"
            )
        if self.stream is not None and not isinstance(self.stream, torch.cuda.Stream):
            raise InvalidStageError(
                f"`stream` of stage `{self.name}` must be a torch.cuda.Stream or None, got {self.stream!r}"
            )
        for field in ("fill_callback", "data_exhausted_callback"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise InvalidStageError(
                    f"`{field}` of stage `{self.name}` must be callable or None, got {value!r}"
                )
