"""Store records: one row's weights then its optimizer state, as bytes (:class:`RecordLayout`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ssd_tbe_adapter._specs import TableChunk
from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = ["RecordLayout"]


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


class RecordLayout:
    """The byte layout of every table's records: weights (``D`` of the weight dtype, padded to 4 bytes), then
    ``S`` float32 optimizer state.

    Args:
        dims: per table, its row width ``D``.
        weight_dtype: float32 or float16.
        state_width: optimizer state floats per row ``S`` (0 for SGD, 1 for row-wise Adagrad).
    """

    __slots__ = ("dims", "record_bytes", "state_width", "weight_bytes", "weight_dtype")

    def __init__(self, dims: Sequence[int], weight_dtype: torch.dtype, state_width: int) -> None:
        self.dims = tuple(dims)
        self.weight_dtype = weight_dtype
        self.state_width = state_width
        self.weight_bytes = [_round4(dim * weight_dtype.itemsize) for dim in self.dims]
        self.record_bytes = [wb + 4 * state_width for wb in self.weight_bytes]

    def encode(self, table: int, weights: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Records ``[K, record_bytes]`` uint8 (host) of rows ``[K, D]`` and state ``[K, S]``.

        Copies go through ``int16`` views (every field starts at an even byte): torch's CPU copies are several
        times faster on them than on strided ``uint8``.
        """
        weights = weights.to("cpu", self.weight_dtype).contiguous()
        state = state.to("cpu", torch.float32).contiguous()
        n = weights.shape[0]
        raw = self.dims[table] * self.weight_dtype.itemsize
        padded = self.weight_bytes[table]
        records = torch.empty(n, self.record_bytes[table], dtype=torch.uint8)
        halves = records.view(torch.int16)
        halves[:, : raw // 2] = weights.view(torch.int16)
        if padded > raw:
            halves[:, raw // 2 : padded // 2] = 0
        if self.state_width:
            halves[:, padded // 2 :] = state.view(torch.int16)
        return records

    def decode(self, table: int, records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode`: (``[K, D]`` weight dtype, ``[K, S]`` float32), host."""
        n = records.shape[0]
        raw = self.dims[table] * self.weight_dtype.itemsize
        halves = records.contiguous().view(torch.int16)
        weights = halves[:, : raw // 2].contiguous().view(self.weight_dtype).view(n, self.dims[table])
        if self.state_width:
            state = (
                halves[:, self.weight_bytes[table] // 2 :]
                .contiguous()
                .view(torch.float32)
                .view(n, self.state_width)
            )
        else:
            state = torch.zeros(n, 0, dtype=torch.float32)
        return weights, state

    def check_chunk(self, table: int, chunk: TableChunk, optimizer: str) -> None:
        """Raise :class:`InvalidArgumentError` unless ``chunk`` fits ``table``'s records (``optimizer`` names the state)."""
        dim = self.dims[table]
        if chunk.weights.shape[1] != dim or chunk.weights.dtype != self.weight_dtype:
            raise InvalidArgumentError(
                f"chunk of `{chunk.table}` has weights {chunk.weights.dtype} [.., {chunk.weights.shape[1]}], "
                f"expected {self.weight_dtype} [.., {dim}]"
            )
        if chunk.optimizer_state.shape[1] != self.state_width:
            raise InvalidArgumentError(
                f"chunk of `{chunk.table}` has {chunk.optimizer_state.shape[1]} optimizer state columns, "
                f"expected {self.state_width} ({optimizer})"
            )
