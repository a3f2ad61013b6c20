"""Typed wrappers over untyped torch helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = ["eager_only"]

_F = TypeVar("_F", bound=Callable[..., Any])


def eager_only(fn: _F) -> _F:
    """``torch.compiler.disable`` keeping ``fn``'s type: host-side code that graphs must not trace."""
    return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]  # torch leaves it untyped
