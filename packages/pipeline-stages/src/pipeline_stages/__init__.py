"""Staged train pipeline (H2D copy, sparse data dist, prefetch) on CPU and CUDA streams, with torchrec's order.

* :class:`PipelineStage` and :class:`StagedTrainPipeline`: torchrec's API and schedule; on CUDA every stage on
  its own stream (event wait + ``record_stream`` hand-offs), on CPU inline; plus an opt-in ``exhaustion_group``
  (all ranks stop together), stage errors that name the stage and batch, ``stats()`` and profiler ranges.
* :class:`SparseDataDistUtil`: the sparse-data-dist and prefetch stages for the modules of a model that
  implement :class:`~pipeline_stages.interfaces.SparseDistModule` (no FX rewrite).
* :class:`BackwardOverlap`: each embedding module's backward on its own stream after the dense backward.
"""

from __future__ import annotations

from pipeline_stages._backward import BackwardOverlap
from pipeline_stages._pipeline import StagedTrainPipeline, StageStats
from pipeline_stages._sparse_dist import SparseDataDistUtil
from pipeline_stages._stage import PipelineStage, Runnable
from pipeline_stages._streams import record_stream_all
from pipeline_stages._version import __version__
from pipeline_stages.errors import (
    DuplicateStageNameError,
    InvalidStageError,
    NoSparseModulesError,
    PipelineError,
    SparseFeaturesError,
    StageError,
)
from pipeline_stages.interfaces import (
    KeyedTensorLike,
    OutputDistOverlap,
    Pipelineable,
    Prefetchable,
    SparseDistModule,
)

__all__ = [
    "BackwardOverlap",
    "DuplicateStageNameError",
    "InvalidStageError",
    "KeyedTensorLike",
    "NoSparseModulesError",
    "OutputDistOverlap",
    "PipelineError",
    "PipelineStage",
    "Pipelineable",
    "Prefetchable",
    "Runnable",
    "SparseDataDistUtil",
    "SparseDistModule",
    "SparseFeaturesError",
    "StageError",
    "StageStats",
    "StagedTrainPipeline",
    "__version__",
    "record_stream_all",
]
