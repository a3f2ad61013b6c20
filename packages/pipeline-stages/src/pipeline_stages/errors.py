"""Exceptions raised by ``pipeline_stages``; every one derives from :class:`PipelineError`.

Concrete errors also subclass the matching builtin, so ``except ValueError`` keeps working. A stage that
raises is reported as a :class:`StageError` that is also an instance of every builtin exception class of the
original (a ``ValueError`` or ``UnicodeDecodeError`` from a stage arrives as a ``StageError`` that is a
``ValueError``), chained to the original with ``raise ... from``; see :class:`StageError` for the exact contract.
"""

from __future__ import annotations

import builtins
from typing import Any, cast

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
    """A stage's runnable or callback raised (or returned None); names the stage and the batch.

    The exact ``isinstance`` contract: a stage's exception ``e`` comes out as a ``StageError`` that is also an
    instance of every builtin exception class ``e`` is an instance of (its most derived builtin bases, hence
    all builtins above them), except ``StopIteration`` / ``StopAsyncIteration`` (which would end the caller's
    loop silently). So ``except ValueError`` catches a stage's ``ValueError``, ``UnicodeDecodeError``,
    ``json.JSONDecodeError`` or a user's ``class MyError(KeyError, ValueError)``; the builtin's own fields
    (``errno``, ``encoding``, ``start``, ...) carry over. It is never an instance of a user-defined class
    (``except MyError`` does not catch it): the original is ``__cause__``. Where an original's arguments do
    not fit its builtin base's constructor, the error falls back to that base's own builtin bases (a
    ``UnicodeDecodeError`` subclass built with one argument arrives as a ``UnicodeError``).

    Every ``StageError`` pickles (the generated classes are rebuilt by their builtin bases), so it crosses
    process boundaries (multiprocessing, torch.distributed elastic); ``__cause__`` does not survive pickling,
    the message names the original type.

    Attributes:
        stage_name: the ``PipelineStage.name`` of the stage that raised.
        stage_index: its position in the pipeline (0 = first).
        batch_index: index of the batch in the current epoch (0 = first batch pulled from the iterator),
            or -1 when the stage ran on no batch (a callback after the data was exhausted).
        phase: ``"runnable"``, ``"fill_callback"`` or ``"data_exhausted_callback"``.
        dropped_batches: epoch indices of the in-flight batches the pipeline dropped because of this error
            (set by ``StagedTrainPipeline.progress``; empty until then), oldest first.
    """

    stage_name: str
    stage_index: int
    batch_index: int
    phase: str
    dropped_batches: tuple[int, ...] = ()

    # The builtin classes this (generated) class mixes in; () for StageError itself.
    _builtins: tuple[type[Exception], ...] = ()

    def __str__(self) -> str:
        # Builtins such as KeyError quote their message; ours is always the plain sentence.
        message = self.__dict__.get("_message")
        return message if isinstance(message, str) else super().__str__()

    def __reduce__(self) -> tuple[Any, ...]:
        # Generated classes are not module attributes: rebuild them from their builtin bases.
        state = dict(self.__dict__)
        init_args = state.pop("_init_args", ())
        message = state.pop("_message", str(self))
        return (_restore, (type(self)._builtins, message, init_args), state)

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
        """Build the error for ``original``; it is also an instance of ``original``'s builtin classes."""
        where = f"batch {batch_index}" if batch_index >= 0 else "no batch (data exhausted)"
        what = "" if phase == "runnable" else f" in its {phase}"
        message = (
            f"stage `{stage_name}` (stage {stage_index} of {num_stages}) raised "
            f"{type(original).__name__}{what} on {where}: {original}"
        )
        error = _build(_builtin_bases(type(original)), message, tuple(original.args))
        error._set_location(stage_name, stage_index, batch_index, phase)
        return error

    @classmethod
    def returned_none(
        cls, *, stage_name: str, stage_index: int, num_stages: int, batch_index: int
    ) -> StageError:
        """The error for a runnable that returned None for a real batch (a ``StageError`` and ``TypeError``)."""
        message = (
            f"stage `{stage_name}` (stage {stage_index} of {num_stages}) returned None for batch "
            f"{batch_index}; a stage's `runnable` must return the batch (None reads as 'data exhausted' "
            "and would silently end the epoch)"
        )
        error = _build((TypeError,), message, (message,))
        error._set_location(stage_name, stage_index, batch_index, "runnable")
        return error

    def _set_location(self, stage_name: str, stage_index: int, batch_index: int, phase: str) -> None:
        self.stage_name = stage_name
        self.stage_index = stage_index
        self.batch_index = batch_index
        self.phase = phase
        self.dropped_batches = ()


def _is_builtin_exception(kind: type) -> bool:
    return (
        kind.__module__ == "builtins"
        and issubclass(kind, Exception)
        and getattr(builtins, kind.__name__, None) is kind
    )


# Never mixed in: these end `for` loops and `next()` callers silently when they escape.
_LOOP_ENDERS = (StopIteration, StopAsyncIteration)


def _minimal(kinds: list[type[Exception]]) -> tuple[type[Exception], ...]:
    """The most derived of ``kinds`` (no one a base of another), MRO order kept, duplicates dropped."""
    unique = list(dict.fromkeys(kinds))
    return tuple(k for k in unique if not any(o is not k and issubclass(o, k) for o in unique))


def _builtin_bases(kind: type[BaseException]) -> tuple[type[Exception], ...]:
    """The most derived builtin ``Exception`` classes in ``kind``'s MRO (``Exception`` itself excluded)."""
    found = [
        cast("type[Exception]", base)
        for base in kind.__mro__
        if base is not Exception and _is_builtin_exception(base) and not issubclass(base, _LOOP_ENDERS)
    ]
    return _minimal(found)


def _parents(kind: type[Exception]) -> list[type[Exception]]:
    """``kind``'s direct builtin bases, for falling back one level up (``Exception`` excluded)."""
    return [
        cast("type[Exception]", base)
        for base in kind.__bases__
        if base is not Exception and _is_builtin_exception(base) and not issubclass(base, _LOOP_ENDERS)
    ]


_MIXED: dict[tuple[type[Exception], ...], type[StageError]] = {(): StageError}


def _stage_error_type(bases: tuple[type[Exception], ...]) -> type[StageError]:
    """``StageError`` mixed with the builtin ``bases`` (cached); raises TypeError if they cannot mix."""
    cached = _MIXED.get(bases)
    if cached is not None:
        return cached
    name = "Stage" + "".join(base.__name__ for base in bases)
    mixed = cast(
        "type[StageError]",
        type(name, (StageError, *bases), {"__module__": __name__, "__qualname__": name, "_builtins": bases}),
    )
    _MIXED[bases] = mixed
    return mixed


def _build(bases: tuple[type[Exception], ...], message: str, init_args: tuple[Any, ...]) -> StageError:
    """A ``StageError`` instance of ``bases`` (falling back one level up until the bases fit)."""
    while True:
        try:
            kind = _stage_error_type(bases)
            # The builtin's constructor sees the original's arguments, so its fields (errno, encoding,
            # start, ...) carry over; args and str() then say our message.
            error = kind(*init_args) if bases else kind(message)
        except Exception:  # a layout conflict or arguments the builtin's constructor rejects
            if not bases:
                raise
            bases = _minimal([*_parents(bases[0]), *bases[1:]])
            continue
        error._init_args = init_args if bases else (message,)  # type: ignore[attr-defined]  # private state
        error._message = message  # type: ignore[attr-defined]  # private state, read by __str__
        error.args = (message,)
        return error


def _restore(bases: tuple[type[Exception], ...], message: str, init_args: tuple[Any, ...]) -> StageError:
    """Unpickle a ``StageError`` (the state, its attributes, is set afterwards by ``__setstate__``)."""
    return _build(bases, message, init_args)
