"""Exceptions raised by ``pipeline_stages``; every one derives from :class:`PipelineError`.

Concrete errors also subclass the matching builtin, so ``except ValueError`` keeps working. A stage that
raises is reported as a :class:`StageError` that also subclasses the nearest builtin base of the original
exception (a ``ValueError`` from a stage arrives as a ``StageError`` that is a ``ValueError``), chained to the
original with ``raise ... from``.
"""

from __future__ import annotations

import builtins
from typing import cast

__all__ = [
    "DuplicateStageNameError",
    "InvalidStageError",
    "NoSparseModulesError",
    "PipelineError",
    "SparseFeaturesError",
    "StageError",
]


class PipelineError(Exception):
    """Base class of every error ``pipeline_stages`` raises on purpose."""


class InvalidStageError(PipelineError, TypeError):
    """A ``PipelineStage`` or ``StagedTrainPipeline`` argument has the wrong type or value."""


class DuplicateStageNameError(PipelineError, ValueError):
    """Two stages of one pipeline share a name (stats and profiler ranges are keyed by it)."""


class NoSparseModulesError(PipelineError, ValueError):
    """``SparseDataDistUtil`` found no submodule implementing the ``SparseDistModule`` Protocol."""


class SparseFeaturesError(PipelineError, AttributeError):
    """The sparse features of a batch could not be taken (no ``sparse_features`` attribute)."""


class StageError(PipelineError):
    """A stage's runnable or callback raised; names the stage and the batch, chains the original.

    Attributes:
        stage_name: the ``PipelineStage.name`` of the stage that raised.
        stage_index: its position in the pipeline (0 = first).
        batch_index: index of the batch in the current epoch (0 = first batch pulled from the iterator),
            or -1 when the stage ran on no batch (a callback after the data was exhausted).
        phase: ``"runnable"``, ``"fill_callback"`` or ``"data_exhausted_callback"``.
    """

    stage_name: str
    stage_index: int
    batch_index: int
    phase: str

    @classmethod
    def wrap(
        cls,
        original: Exception,
        *,
        stage_name: str,
        stage_index: int,
        num_stages: int,
        batch_index: int,
        phase: str,
    ) -> StageError:
        """Build the error for ``original``; its class also subclasses the nearest builtin base of it."""
        where = f"batch {batch_index}" if batch_index >= 0 else "no batch (data exhausted)"
        what = "" if phase == "runnable" else f" in its {phase}"
        message = (
            f"stage `{stage_name}` (stage {stage_index} of {num_stages}) raised "
            f"{type(original).__name__}{what} on {where}: {original}"
        )
        error = _stage_error_type(_nearest_builtin(type(original)))(message)
        error.stage_name = stage_name
        error.stage_index = stage_index
        error.batch_index = batch_index
        error.phase = phase
        return error


def _nearest_builtin(kind: type[BaseException]) -> type[Exception]:
    """The first class in ``kind``'s MRO that is a builtin ``Exception`` subclass (at least ``Exception``)."""
    for base in kind.__mro__:
        if (
            base.__module__ == "builtins"
            and issubclass(base, Exception)
            and getattr(builtins, base.__name__, None) is base
        ):
            return cast("type[Exception]", base)
    return Exception


_MIXED: dict[type[Exception], type[StageError]] = {}


def _stage_error_type(builtin: type[Exception]) -> type[StageError]:
    """``StageError`` mixed with ``builtin`` (cached per builtin); plain ``StageError`` if they cannot mix."""
    cached = _MIXED.get(builtin)
    if cached is not None:
        return cached
    mixed: type[StageError] = StageError
    # StopIteration-like types end loops silently when they escape: never let a stage failure look like one.
    if builtin is not Exception and not issubclass(builtin, (StopIteration, StopAsyncIteration)):
        try:
            candidate = cast(
                "type[StageError]",
                type(f"Stage{builtin.__name__}", (StageError, builtin), {"__module__": __name__}),
            )
            candidate("probe")  # some builtins (e.g. UnicodeDecodeError) need more constructor arguments
            mixed = candidate
        except TypeError:
            mixed = StageError
    _MIXED[builtin] = mixed
    return mixed
