"""Exceptions raised by ``ssd_tbe_adapter``; every one derives from :class:`SSDTBEAdapterError`.

Concrete errors also subclass the matching builtin, so ``except ValueError`` keeps working for callers
that do not know this package.
"""

from __future__ import annotations

__all__ = [
    "SSDTBEAdapterError",
    "StoreClosedError",
    "StoreCorruptError",
    "StoreNotFoundError",
    "StoreOpenError",
    "StoreUnavailableError",
]


class SSDTBEAdapterError(Exception):
    """Base class of every error ``ssd_tbe_adapter`` raises on purpose."""


class StoreNotFoundError(SSDTBEAdapterError, FileNotFoundError):
    """The store `path` does not exist and creating it was not allowed."""


class StoreOpenError(SSDTBEAdapterError, OSError):
    """The store at `path` exists but cannot be opened (not a RocksDB directory, locked, unreadable)."""


class StoreCorruptError(SSDTBEAdapterError, ValueError):
    """The store holds a row whose size or encoding does not match the table it belongs to."""


class StoreClosedError(SSDTBEAdapterError, RuntimeError):
    """An operation was attempted on a store after `close()`."""


class StoreUnavailableError(SSDTBEAdapterError, ImportError):
    """The embedded RocksDB binding (`rocksdict`) cannot be imported."""
