"""Protocols this package consumes: the key-value store behind :class:`KeyValueEmbeddingBags`.

A store keeps fixed-width byte records addressed by ``(table, id)``; it knows nothing about embeddings.
:class:`~ssd_tbe_adapter.RocksDBStore` and :class:`~ssd_tbe_adapter.MemoryStore` fit it; any object with
these methods does too (for example a store over a remote key-value service).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

__all__ = ["KVStore"]


@runtime_checkable
class KVStore(Protocol):
    """Batched key-value storage of fixed-width rows, addressed by ``(table, id)``.

    Rows are raw bytes (``uint8`` tensors); the caller decides what the bytes mean. Every method must be
    safe to call from two threads at once (the embedding module reads on a background thread while the
    training thread writes back evicted rows).
    """

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        """Read the rows of ``ids`` into ``out``.

        Args:
            ids: ``[N]`` int64 on the CPU, any order, may repeat.
            out: ``[N, row_bytes]`` uint8 on the CPU, contiguous, pre-allocated by the caller; row ``i``
                receives the record of ``ids[i]``; rows of absent ids are left untouched.
            table: table number, ``>= 0``.

        Returns:
            ``[N]`` bool on the CPU: ``True`` where the id was present.
        """
        ...

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        """Write ``rows[i]`` as the record of ``ids[i]`` (insert or overwrite), atomically as one batch.

        Args:
            ids: ``[N]`` int64 on the CPU, unique.
            rows: ``[N, row_bytes]`` uint8 on the CPU.
            table: table number, ``>= 0``.
        """
        ...

    def iter_chunks(self, *, table: int, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Stream every record of ``table`` in chunks of at most ``chunk_rows`` rows.

        Yields:
            ``(ids [n] int64, rows [n, row_bytes] uint8)``, both on the CPU, ids ascending.
        """
        ...

    def clear_table(self, *, table: int) -> None:
        """Delete every record of ``table`` (checkpoint restore starts from an empty table)."""
        ...

    def flush(self) -> None:
        """Make every write so far durable (survives the process being killed)."""
        ...

    def close(self) -> None:
        """Flush and release the store; later calls raise."""
        ...
