"""Key-value (SSD) embedding tables on an embedded RocksDB store behind a cache with prefetch, usable wherever an fbgemm TBE is."""

from __future__ import annotations

from ssd_tbe_adapter._version import __version__
from ssd_tbe_adapter.errors import SSDTBEAdapterError

__all__ = ["SSDTBEAdapterError", "__version__"]
