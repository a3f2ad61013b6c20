"""Argument checks of :class:`~ssd_tbe_adapter.KeyValueEmbeddingBags` construction (errors name the argument)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ssd_tbe_adapter._specs import TableSpec
from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = ["check_cache_rows", "check_feature_table_map", "check_options", "check_tables", "describe"]


def check_options(
    optimizer: str,
    pooling: str,
    weights_precision: str,
    learning_rate: float,
    init_range: tuple[float, float],
) -> tuple[float, float]:
    """Check the scalar options; returns ``init_range`` as floats."""
    if optimizer not in ("sgd", "rowwise_adagrad"):
        raise InvalidArgumentError(f"`optimizer` must be 'sgd' or 'rowwise_adagrad', got {optimizer!r}")
    if pooling not in ("sum", "mean"):
        raise InvalidArgumentError(f"`pooling` must be 'sum' or 'mean', got {pooling!r}")
    if weights_precision not in ("fp32", "fp16"):
        raise InvalidArgumentError(f"`weights_precision` must be 'fp32' or 'fp16', got {weights_precision!r}")
    if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate >= 0):
        raise InvalidArgumentError(f"`learning_rate` must be a finite float >= 0, got {learning_rate!r}")
    low, high = (float(init_range[0]), float(init_range[1]))
    if not low <= high:
        raise InvalidArgumentError(f"`init_range` must be (low, high) with low <= high, got {init_range!r}")
    return low, high


def describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def check_tables(tables: Sequence[TableSpec]) -> tuple[TableSpec, ...]:
    tables = tuple(tables)
    if not tables or not all(isinstance(t, TableSpec) for t in tables):
        raise InvalidArgumentError(f"`tables` must be a non-empty sequence of TableSpec, got {tables!r}")
    names = [t.name for t in tables]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidArgumentError(f"`tables` names must be unique, repeated: {', '.join(duplicates)}")
    return tables


def check_feature_table_map(feature_table_map: Sequence[int] | None, num_tables: int) -> list[int]:
    if feature_table_map is None:
        return list(range(num_tables))
    mapping = list(feature_table_map)
    if not mapping:
        raise InvalidArgumentError("`feature_table_map` must name at least one feature")
    for feature, table in enumerate(mapping):
        if isinstance(table, bool) or not isinstance(table, int) or not 0 <= table < num_tables:
            raise InvalidArgumentError(
                f"`feature_table_map`[{feature}] = {table!r}, expected a table number in [0, {num_tables})"
            )
    return mapping


def check_cache_rows(cache_rows: int | Sequence[int], num_tables: int) -> list[int]:
    values = [cache_rows] * num_tables if isinstance(cache_rows, int) else list(cache_rows)
    if len(values) != num_tables or any(
        isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values
    ):
        raise InvalidArgumentError(
            f"`cache_rows` must be an int >= 0 or one per table ({num_tables}), got {cache_rows!r}"
        )
    return values
