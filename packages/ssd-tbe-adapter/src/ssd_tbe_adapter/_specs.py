"""The public value types: :class:`TableSpec` (a table's name and width) and :class:`TableChunk` (checkpoint rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = ["TableChunk", "TableSpec"]


@dataclass(frozen=True, slots=True)
class TableSpec:
    """One key-value table: its name and row width. Ids are any int64 (no row count).

    Args:
        name: unique table name (also salts the row initialisation).
        dim: embedding dimension ``D >= 1``.
    """

    name: str
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(f"`name` must be a non-empty string, got {self.name!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise InvalidArgumentError(f"`dim` of table `{self.name}` must be an int >= 1, got {self.dim!r}")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TableChunk:
    """A slice of one table's rows, as checkpoints stream them.

    Args:
        table: table name.
        ids: ``[n]`` int64, CPU, ascending within a chunk.
        weights: ``[n, D]`` float32 or float16 (the table's precision), CPU.
        optimizer_state: ``[n, S]`` float32, CPU (``S`` = 0 for SGD, 1 for row-wise Adagrad).
    """

    table: str
    ids: torch.Tensor
    weights: torch.Tensor
    optimizer_state: torch.Tensor

    def __post_init__(self) -> None:
        n = self.ids.shape[0] if self.ids.dim() == 1 else -1
        if n < 0 or self.ids.dtype != torch.int64:
            raise InvalidArgumentError(
                f"`ids` of chunk of `{self.table}` must be 1-D int64, got {self.ids.dtype} {tuple(self.ids.shape)}"
            )
        if self.weights.dim() != 2 or self.weights.shape[0] != n:
            raise InvalidArgumentError(
                f"`weights` of chunk of `{self.table}` must be [{n}, D], got {tuple(self.weights.shape)}"
            )
        if self.optimizer_state.dim() != 2 or self.optimizer_state.shape[0] != n:
            raise InvalidArgumentError(
                f"`optimizer_state` of chunk of `{self.table}` must be [{n}, S], got {tuple(self.optimizer_state.shape)}"
            )
