"""Exceptions and warnings raised by ``ssd_tbe_adapter``; every exception derives from :class:`SSDTBEAdapterError`.

Concrete errors also subclass the matching builtin, so ``except ValueError`` (or ``OSError``,
``FileNotFoundError``, ...) keeps working for callers that do not know this package, and
``except SSDTBEAdapterError`` catches every error this package raises on purpose.
"""

from __future__ import annotations

import errno

__all__ = [
    "ArgumentTypeError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "DiskFullError",
    "InvalidArgumentError",
    "ModuleClosedError",
    "RowsNotRestoredWarning",
    "SSDTBEAdapterError",
    "SchemaMismatchError",
    "StaleCaptureError",
    "StoreClosedError",
    "StoreCorruptError",
    "StoreIOError",
    "StoreNotFoundError",
    "StoreOpenError",
    "StoreUnavailableError",
]


class SSDTBEAdapterError(Exception):
    """Base class of every error ``ssd_tbe_adapter`` raises on purpose."""


class InvalidArgumentError(SSDTBEAdapterError, ValueError):
    """An argument has a bad value (the message names it in backticks, shows it and says what was expected)."""


class ArgumentTypeError(SSDTBEAdapterError, TypeError):
    """An argument has the wrong type (for example a `store` that does not implement ``KVStore``)."""


class StoreNotFoundError(SSDTBEAdapterError, FileNotFoundError):
    """The store `path` does not exist and creating it was not allowed."""


class StoreOpenError(SSDTBEAdapterError, OSError):
    """The store at `path` exists but cannot be opened (not a RocksDB directory, locked, no permission)."""


class StoreCorruptError(SSDTBEAdapterError, ValueError):
    """The store's files are damaged (bad checksum, truncated or missing MANIFEST/SST/WAL data, lost flushed
    rows) or hold a record whose size does not match its table. The message names the store path."""


class StoreIOError(SSDTBEAdapterError, OSError):
    """An I/O error other than a full disk while reading or writing the store or a checkpoint."""


class DiskFullError(SSDTBEAdapterError, OSError):
    """No space left on the device of the store or of a checkpoint (``errno`` is ``ENOSPC``).

    Recoverable: nothing acknowledged is lost, dirty cached rows stay cached, and ``flush()``,
    ``checkpoint()``, ``save_checkpoint()`` and ``close()`` work again once space is freed.
    """

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)


class StoreClosedError(SSDTBEAdapterError, RuntimeError):
    """An operation was attempted on a store after `close()`."""


class ModuleClosedError(SSDTBEAdapterError, RuntimeError):
    """An operation was attempted on a ``KeyValueEmbeddingBags`` after `close()`."""


class StaleCaptureError(SSDTBEAdapterError, RuntimeError):
    """A replay's staging had to assign a batch's slots itself (no prefetch) and that grew the cache: the CUDA
    graph about to replay holds the old cache tensors. The batch stays pending; record the graph again (after
    :meth:`~ssd_tbe_adapter.KeyValueEmbeddingBags.captured_buffers` changed) and replay, or prefetch first."""


class StoreUnavailableError(SSDTBEAdapterError, ImportError):
    """The embedded RocksDB binding (`rocksdict`) cannot be imported."""


class SchemaMismatchError(SSDTBEAdapterError, ValueError):
    """The store (or a checkpoint) was written by a differently configured module: tables, dims, precision,
    optimizer, record layout or seed differ. The message names the first difference."""


class CheckpointNotFoundError(SSDTBEAdapterError, FileNotFoundError):
    """The checkpoint `directory` has no ``manifest.json``."""


class CheckpointCorruptError(SSDTBEAdapterError, ValueError):
    """A checkpoint file is missing, truncated, fails its checksum or holds rows that do not fit the manifest.
    The message names the file; nothing in the live tables was changed."""


class RowsNotRestoredWarning(UserWarning):
    """``load_state_dict`` restored the configuration only: the rows live in the store, not in the state dict
    (use ``load_checkpoint`` or ``restore``)."""
