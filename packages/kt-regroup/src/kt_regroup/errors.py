"""Exceptions raised by ``kt_regroup``; every one derives from :class:`KTRegroupError`.

Concrete errors also subclass the matching builtin, so ``except KeyError`` / ``except ValueError`` keep
working for callers that do not know this package.
"""

from __future__ import annotations

__all__ = [
    "AmbiguousKeyError",
    "ArgumentTypeError",
    "BackendUnavailableError",
    "InvalidGroupsError",
    "KTRegroupError",
    "LayoutMismatchError",
    "LengthMismatchError",
    "UnknownBackendError",
    "UnknownKeyError",
]


class KTRegroupError(Exception):
    """Base class of every error ``kt_regroup`` raises on purpose."""


class UnknownKeyError(KTRegroupError, KeyError):
    """A group (or ``KeyedTensor.__getitem__``) names a key that no input KeyedTensor holds."""

    def __str__(self) -> str:
        # KeyError's str() wraps the message in quotes; show it as written.
        return str(self.args[0]) if self.args else ""


class ArgumentTypeError(KTRegroupError, TypeError):
    """An argument has the wrong type: a plain tensor or ``None`` where a KeyedTensor-like is expected, a single
    KeyedTensor where a list of them is, ``None`` for ``groups`` or ``keys``, a ``str`` for ``keys``, or a
    length that is not an int."""


class AmbiguousKeyError(KTRegroupError, ValueError):
    """A key appears more than once among the input KeyedTensors (in two of them, or twice in one)."""


class LayoutMismatchError(KTRegroupError, ValueError):
    """The input KeyedTensors disagree on batch size, device, dtype or ``key_dim``, or are not 2-D."""


class LengthMismatchError(KTRegroupError, ValueError):
    """``length_per_key`` does not match the keys or the width of ``values`` along ``key_dim``."""


class InvalidGroupsError(KTRegroupError, ValueError):
    """``groups`` / ``keys`` arguments are malformed (not lists of str, count mismatch, duplicate names)."""


class UnknownBackendError(KTRegroupError, ValueError):
    """``backend`` (or the ``KT_REGROUP_BACKEND`` environment variable) names no known backend."""


class BackendUnavailableError(KTRegroupError, RuntimeError):
    """The requested backend cannot run here (fbgemm not importable, Triton without CUDA, ...)."""
