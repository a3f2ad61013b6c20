"""Deterministic per-id row initialisation: a counter-based hash (splitmix64) of (seed, table, id, column).

The same (seed, table name, id) gives the same row on every device, every process and every cache
state, so a row created on first touch never depends on which batch touched it first.
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["init_rows", "table_salt"]


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> is arithmetic on int64; mask the sign extension to get a logical shift.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64 on every torch backend, which is what splitmix64 needs.
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def table_salt(seed: int, name: str) -> int:
    """A 64-bit salt of ``(seed, table name)``: renaming or reordering other tables changes nothing."""
    return _signed(((seed & 0xFFFFFFFF) << 32) | zlib.crc32(name.encode()))


def init_rows(ids: torch.Tensor, dim: int, salt: int, low: float, high: float) -> torch.Tensor:
    """Initial rows of ``ids``: uniform in ``[low, high)``, a pure function of (salt, id, column).

    Args:
        ids: ``[N]`` int64 on any device.
        dim: row width ``D``.
        salt: :func:`table_salt` of the table.
        low: lower bound.
        high: upper bound.

    Returns:
        ``[N, D]`` float32 on the device of ``ids``.
    """
    row = _mix(_mix(torch.full_like(ids, salt)) ^ ids)
    columns = torch.arange(dim, dtype=torch.int64, device=ids.device) * _GOLDEN
    bits = _mix(row[:, None] + columns[None, :])
    uniform = _shift_right(bits, 40).to(torch.float32) * (1.0 / (1 << 24))
    return uniform * (high - low) + low
