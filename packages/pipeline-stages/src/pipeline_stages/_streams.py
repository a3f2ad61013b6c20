"""Stream helpers shared by the pipeline, the sparse-dist util and the backward-overlap helper.

On CPU there are no streams: every helper here is a no-op for ``None`` streams, so callers run inline.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from pipeline_stages.interfaces import Pipelineable

__all__ = ["new_event", "profiler_enabled", "record_stream_all", "stream_context"]

# Leaf types that never hold tensors: skipped without further checks (hot path).
_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


def record_stream_all(obj: Any, stream: torch.cuda.Stream) -> None:
    """Call ``record_stream(stream)`` on every CUDA tensor reachable from ``obj``.

    Walks tensors, objects implementing :class:`~pipeline_stages.interfaces.Pipelineable` (their own
    ``record_stream`` is trusted to cover their tensors), dataclass instances (every field), mappings
    (values), lists, tuples (named tuples too) and sets. Tensors on another device type are skipped
    (pinned host tensors have no ``record_stream``). Cycles are visited once.

    Args:
        obj: a batch or any nesting of the above.
        stream: the CUDA stream that will use the tensors.
    """
    _walk(obj, stream, set())


# How _walk treats each type, decided once per type: a runtime Protocol isinstance check costs microseconds
# and the pipeline walks every in-flight batch several times per step.
_PIPELINEABLE, _DATACLASS, _MAPPING, _SEQUENCE, _OPAQUE = range(5)
_KIND: dict[type, int] = {}


def _kind(cls: type, obj: Any) -> int:
    kind = _KIND.get(cls)
    if kind is None:
        if isinstance(obj, Pipelineable):
            kind = _PIPELINEABLE
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            kind = _DATACLASS
        elif isinstance(obj, Mapping):
            kind = _MAPPING
        elif isinstance(obj, (list, tuple, set, frozenset)):
            kind = _SEQUENCE
        else:
            kind = _OPAQUE
        _KIND[cls] = kind
    return kind


def _walk(obj: Any, stream: torch.cuda.Stream, seen: set[int]) -> None:
    if isinstance(obj, _ATOMS):
        return
    if isinstance(obj, torch.Tensor):
        if obj.device.type == stream.device.type:
            obj.record_stream(stream)
        return
    key = id(obj)
    if key in seen:
        return
    seen.add(key)
    kind = _kind(type(obj), obj)
    if kind == _PIPELINEABLE:
        obj.record_stream(stream)
    elif kind == _DATACLASS:
        for field in dataclasses.fields(obj):
            _walk(getattr(obj, field.name), stream, seen)
    elif kind == _MAPPING:
        for value in obj.values():
            _walk(value, stream, seen)
    elif kind == _SEQUENCE:
        for item in obj:
            _walk(item, stream, seen)


def stream_context(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.stream(stream)``, or a null context for ``None`` (CPU, or "stay on the current stream")."""
    if stream is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def profiler_enabled() -> bool:
    """Whether a torch (autograd / kineto) profiler is recording: record_function ranges only then."""
    return bool(torch.autograd._profiler_enabled())  # type: ignore[attr-defined]  # private, not re-exported


def new_event(stream: torch.cuda.Stream, *, timing: bool = False) -> torch.cuda.Event:
    """A fresh CUDA event recorded on ``stream``."""
    event = torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]  # unannotated in torch
    event.record(stream)
    return event
