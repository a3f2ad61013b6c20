"""Triton kernels that gather rows from / scatter rows into pinned host memory (CUDA only, imported lazily).

Each program moves ``BLOCK_R`` rows of ``width`` float32 columns, ``BLOCK_D`` columns at a time; row numbers
come from an int64 index on the device. Pinned host memory is addressed directly (unified virtual addressing),
so a move is one launch whatever the rows' order, and nothing waits on the host.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = ["gather", "scatter"]

_BLOCK_R = 16


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _gather_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    source, index, out, n, width, source_stride, out_stride, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n
    picked = tl.load(index + rows, mask=in_range, other=-1)
    wanted = in_range & (picked >= 0)
    columns = tl.arange(0, BLOCK_D)
    for start in range(0, width, BLOCK_D):
        c = start + columns
        mask = wanted[:, None] & (c[None, :] < width)
        values = tl.load(source + picked[:, None] * source_stride + c[None, :], mask=mask)
        tl.store(out + rows.to(tl.int64)[:, None] * out_stride + c[None, :], values, mask=mask)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _scatter_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    rows_in, index, target, n, width, rows_stride, target_stride, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = rows < n
    placed = tl.load(index + rows, mask=in_range, other=0)
    columns = tl.arange(0, BLOCK_D)
    for start in range(0, width, BLOCK_D):
        c = start + columns
        mask = in_range[:, None] & (c[None, :] < width)
        values = tl.load(rows_in + rows.to(tl.int64)[:, None] * rows_stride + c[None, :], mask=mask)
        tl.store(target + placed[:, None] * target_stride + c[None, :], values, mask=mask)


def _launch(
    kernel: Any, first: torch.Tensor, index: torch.Tensor, second: torch.Tensor, n: int, width: int
) -> None:
    """One launch of ``kernel`` over ``n`` rows of ``width`` columns between ``first`` and ``second``."""
    for rows in (first, second):
        if rows.dtype != torch.float32 or rows.dim() != 2 or rows.stride(1) != 1 or rows.shape[1] < width:
            raise InvalidArgumentError(
                f"row moves need float32 rows with unit column stride, >= {width} columns"
            )
    block_d = min(128, int(triton.next_power_of_2(max(width, 16))))
    grid = (triton.cdiv(n, _BLOCK_R),)
    kernel[grid](
        first, index, second, n, width, first.stride(0), second.stride(0), BLOCK_R=_BLOCK_R, BLOCK_D=block_d
    )


def gather(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = source[index[i]]`` where ``index[i] >= 0`` (see :func:`~ssd_tbe_adapter._row_moves.gather_rows`)."""
    n, width = out.shape
    _launch(_gather_kernel, source, index, out, n, width)


def scatter(rows: torch.Tensor, index: torch.Tensor, target: torch.Tensor) -> None:
    """``target[index[i]] = rows[i]`` (see :func:`~ssd_tbe_adapter._row_moves.scatter_rows`)."""
    n, width = rows.shape
    _launch(_scatter_kernel, rows, index, target, n, width)
