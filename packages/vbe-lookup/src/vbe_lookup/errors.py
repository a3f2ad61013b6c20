"""Exceptions raised by ``vbe_lookup``; every one derives from :class:`VBELookupError`.

Each concrete error also subclasses the matching builtin, so ``except ValueError`` keeps working for
callers that do not know this package.
"""

from __future__ import annotations

__all__ = [
    "BatchLayoutError",
    "ConfigurationError",
    "DimensionMismatchError",
    "FeatureCoverageError",
    "IndexOutOfRangeError",
    "InvalidFeaturesError",
    "VBELookupError",
]


class VBELookupError(Exception):
    """Base class of every error ``vbe_lookup`` raises on purpose."""


class ConfigurationError(VBELookupError, ValueError):
    """A constructor argument (pooling, optimizer, table sizes, merge mode, ...) is not valid."""


class InvalidFeaturesError(VBELookupError, ValueError):
    """The sparse features are malformed: shapes, dtypes, devices or duplicate keys."""


class BatchLayoutError(VBELookupError, ValueError):
    """``stride_per_key_per_rank`` disagrees with ``lengths`` (or with the ids in ``values``)."""


class FeatureCoverageError(VBELookupError, KeyError):
    """A feature is covered by no kernel group or by two, or a kernel's feature is missing from the input."""

    def __str__(self) -> str:
        # KeyError quotes its argument; these messages are sentences.
        return str(self.args[0]) if self.args else ""


class DimensionMismatchError(VBELookupError, ValueError):
    """The dims a :class:`~vbe_lookup.KernelGroup` declares disagree with its kernel's tables."""


class IndexOutOfRangeError(VBELookupError, IndexError):
    """An id in ``values`` is negative or not below its table's number of rows."""
