"""Typed wrappers over untyped torch helpers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["eager_only"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager_only(fn: _F) -> _F:
    """``torch.compiler.disable`` keeping ``fn``'s type: host-side code that graphs must not trace.

    Eager calls go straight to ``fn``: the disabled wrapper (a dynamo frame hook, microseconds per call)
    is only entered while dynamo traces the caller, where ``is_compiling()`` is True and the call becomes
    a graph break.
    """
    disabled = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]  # torch leaves it untyped
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return cast(_F, wrapper)
