"""Stream helpers shared by the pipeline, the sparse-dist util and the backward-overlap helper.

On CPU there are no streams: every helper here is a no-op for ``None`` streams, so callers run inline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from pipeline_stages.interfaces import Pipelineable

__all__ = ["new_event", "profiler_enabled", "record_stream_all", "stream_context"]

# Leaf types that never hold tensors: skipped without further checks (hot path).
_ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)

# What a dataclass field's annotation may name for a field that can never hold a tensor (``int``,
# ``tuple[tuple[int, ...], ...]``, ``str | None``, ``dict[str, float]``): scalar atoms, and containers only
# with their parameters (a bare ``list`` or ``dict`` may hold anything).
_ATOM_NAMES = frozenset(
    {"int", "float", "bool", "str", "bytes", "complex", "None", "NoneType", "torch.dtype", "torch.device"}
)
_CONTAINER_NAMES = frozenset(
    {
        "tuple", "list", "set", "frozenset", "dict", "Tuple", "List", "Set", "FrozenSet", "Dict", "Optional",
        "Union", "typing.Tuple", "typing.List", "typing.Set", "typing.FrozenSet", "typing.Dict",
        "typing.Optional", "typing.Union",
    }
)  # fmt: skip
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9.]*")


def record_stream_all(obj: Any, stream: torch.cuda.Stream) -> None:
    """Call ``record_stream(stream)`` on every CUDA tensor reachable from ``obj``.

    Walks tensors, objects implementing :class:`~pipeline_stages.interfaces.Pipelineable` (their own
    ``record_stream`` is trusted to cover their tensors), dataclass instances (every field whose annotation
    can hold a tensor: fields annotated only with ``int``, ``float``, ``bool``, ``str``, ``bytes``, ``None``,
    ``torch.dtype``/``torch.device`` and tuples, lists, sets or dicts of them are not walked), mappings
    (values), lists, tuples (named tuples too) and sets. Tensors on another device type are skipped (pinned
    host tensors have no ``record_stream``). Every object, tensor or container, is visited once (shared
    objects and cycles too).

    Args:
        obj: a batch or any nesting of the above.
        stream: the CUDA stream that will use the tensors.
    """
    # Hot path (several calls per step over the in-flight batches and distributed features): one Python
    # frame per call, an explicit stack, and how to walk each type decided once per type (_plan).
    device_type = stream.device.type
    plans = _PLANS
    seen: set[int] = set()
    stack = [obj]
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        item = pop()
        plan = plans.get(type(item))
        if plan is None:
            plan = _plan(type(item), item)
        kind = plan[0]
        if kind == _ATOM:
            continue
        key = id(item)
        if key in seen:
            continue
        seen.add(key)
        if kind == _TENSOR:
            if item.device.type == device_type:
                item.record_stream(stream)
        elif kind == _PIPELINEABLE:
            item.record_stream(stream)
        elif kind == _DATACLASS:
            for name in plan[1]:
                push(getattr(item, name))
        elif kind == _MAPPING:
            extend(item.values())
        elif kind == _SEQUENCE:
            extend(item)


# How record_stream_all treats each type, decided once per type: a runtime Protocol isinstance check costs
# microseconds, and so do dataclasses.fields() and the annotation check of each field.
_ATOM, _TENSOR, _PIPELINEABLE, _DATACLASS, _MAPPING, _SEQUENCE, _OPAQUE = range(7)
_PLANS: dict[type, tuple[int, tuple[str, ...]]] = dict.fromkeys(_ATOMS, (_ATOM, ()))


def _plan(cls: type, obj: Any) -> tuple[int, tuple[str, ...]]:
    fields: tuple[str, ...] = ()
    if isinstance(obj, _ATOMS):
        kind = _ATOM  # a subclass of an atom type (an IntEnum, a str subclass)
    elif isinstance(obj, torch.Tensor):
        kind = _TENSOR
    elif isinstance(obj, Pipelineable):
        kind = _PIPELINEABLE
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        kind = _DATACLASS
        fields = tuple(f.name for f in dataclasses.fields(obj) if not _never_holds_tensors(f.type))
    elif isinstance(obj, Mapping):
        kind = _MAPPING
    elif isinstance(obj, (list, tuple, set, frozenset)):
        kind = _SEQUENCE
    else:
        kind = _OPAQUE
    plan = (kind, fields)
    _PLANS[cls] = plan
    return plan


def _never_holds_tensors(annotation: object) -> bool:
    """Whether a dataclass field annotation (a string one too) names only atoms and containers of atoms."""
    if isinstance(annotation, type):
        return issubclass(annotation, _ATOMS)
    text = annotation if isinstance(annotation, str) else repr(annotation)
    found = False
    for match in _NAME.finditer(text):
        name = match.group()
        if name in _CONTAINER_NAMES:
            if text[match.end() : match.end() + 1] != "[":
                return False  # a bare container: its items may be tensors
        elif name in _ATOM_NAMES:
            found = True
        else:
            return False
    return found


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
