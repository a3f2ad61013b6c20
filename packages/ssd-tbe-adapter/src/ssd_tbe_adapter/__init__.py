"""Key-value (SSD) embedding tables on an embedded RocksDB store behind a cache with prefetch, usable wherever an fbgemm TBE is.

- :class:`KeyValueEmbeddingBags`: pooled lookups with the fbgemm TBE forward signature (VBE, ``vbe_output``),
  ``prefetch``, fused SGD / row-wise Adagrad in backward, ``flush``, chunked checkpoints, ``metrics``.
- :class:`RocksDBStore` / :class:`MemoryStore`: :class:`~ssd_tbe_adapter.interfaces.KVStore` implementations.
"""

from __future__ import annotations

from ssd_tbe_adapter._module import KeyValueEmbeddingBags, TableChunk, TableSpec
from ssd_tbe_adapter._store import MemoryStore, RocksDBStore
from ssd_tbe_adapter._version import __version__
from ssd_tbe_adapter.errors import (
    ArgumentTypeError,
    CheckpointCorruptError,
    CheckpointNotFoundError,
    DiskFullError,
    InvalidArgumentError,
    ModuleClosedError,
    RowsNotRestoredWarning,
    SchemaMismatchError,
    SSDTBEAdapterError,
    StaleCaptureError,
    StoreClosedError,
    StoreCorruptError,
    StoreIOError,
    StoreNotFoundError,
    StoreOpenError,
    StoreUnavailableError,
)
from ssd_tbe_adapter.interfaces import KVStore

__all__ = [
    "ArgumentTypeError",
    "CheckpointCorruptError",
    "CheckpointNotFoundError",
    "DiskFullError",
    "InvalidArgumentError",
    "KVStore",
    "KeyValueEmbeddingBags",
    "MemoryStore",
    "ModuleClosedError",
    "RocksDBStore",
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
    "TableChunk",
    "TableSpec",
    "__version__",
]
