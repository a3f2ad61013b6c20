"""Triton kernel of the device cache's pooled forward (CUDA only, imported lazily): each bag's rows summed
(times the per-sample weights) straight into the module's output, in one launch.

The torch version is ``embedding_bag`` over the cache's rows and then a copy of its result into the output:
two launches, and in the DLRM trainer the first alone took about twice a plain gather of the rows.

Each program sums ``BLOCK_B`` bags over ``BLOCK_D`` columns at a time, walking the lookups of its longest bag
(the other bags' lanes masked off when they end): the sum of a bag is taken in its lookups' order, as
``embedding_bag`` does on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = ["pool_sum"]

_BLOCK_B = 16


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _pool_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    weights,
    weights_stride,
    slots,
    offsets,
    psw,
    out,
    out_stride,
    bags,
    width,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_PSW: tl.constexpr,
):
    bag = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    in_range = bag < bags
    start = tl.load(offsets + bag, mask=in_range, other=0)
    length = tl.load(offsets + bag + 1, mask=in_range, other=0) - start
    length = tl.where(in_range, length, 0)
    longest = tl.max(length, axis=0)
    columns = tl.arange(0, BLOCK_D)
    for first_column in range(0, width, BLOCK_D):
        c = first_column + columns
        in_row = c < width
        total = tl.zeros((BLOCK_B, BLOCK_D), dtype=tl.float32)
        for j in range(0, longest):
            live = j < length
            lookup = start + j
            slot = tl.load(slots + lookup, mask=live, other=0)
            row = tl.load(
                weights + slot[:, None] * weights_stride + c[None, :],
                mask=live[:, None] & in_row[None, :],
                other=0.0,
            )
            if HAS_PSW:
                row = row * tl.load(psw + lookup, mask=live, other=0.0)[:, None]
            total += row
        tl.store(
            out + bag[:, None] * out_stride + c[None, :], total, mask=in_range[:, None] & in_row[None, :]
        )


def pool_sum(
    weights: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """``out[b] = sum(weights[slots[i], :W] * psw[i] for i in bag b)`` with ``W = out.shape[1]``: bags by
    ``offsets`` (``[bags + 1]`` int64, from 0), ``weights`` float32 ``[S, >= W]``, ``out`` float32
    ``[bags, W]`` (any row stride, unit column stride). One launch, no sync."""
    bags, width = out.shape
    if (
        weights.dtype != torch.float32
        or out.dtype != torch.float32
        or weights.stride(1) != 1
        or out.stride(1) != 1
        or weights.shape[1] < width
    ):
        raise InvalidArgumentError(
            f"pooling needs float32 rows of >= {width} columns and a float32 output, unit column strides"
        )
    if offsets.dtype != torch.int64 or slots.dtype != torch.int64 or offsets.numel() != bags + 1:
        raise InvalidArgumentError(f"pooling needs int64 slots and [{bags + 1}] int64 offsets")
    if bags == 0:
        return
    block_d = min(128, int(triton.next_power_of_2(max(width, 16))))
    psw = per_sample_weights if per_sample_weights is not None else weights  # unread without weights
    _pool_kernel[(triton.cdiv(bags, _BLOCK_B),)](
        weights,
        weights.stride(0),
        slots,
        offsets,
        psw,
        out,
        out.stride(0),
        bags,
        width,
        BLOCK_B=_BLOCK_B,
        BLOCK_D=block_d,
        HAS_PSW=per_sample_weights is not None,
    )
