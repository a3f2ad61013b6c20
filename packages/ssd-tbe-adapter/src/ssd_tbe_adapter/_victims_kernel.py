"""A Triton kernel for :func:`~ssd_tbe_adapter._victims.choose_victims` (CUDA only, imported lazily): each
miss's group of slots read and its best slot picked in one launch (the torch version is ~15 kernels over
``[N, GROUP]`` arrays); the same slots."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ssd_tbe_adapter._victims import GROUP, MAX_USES, NEVER, TICK_BITS

if TYPE_CHECKING:
    from ssd_tbe_adapter._victims import VictimTables

__all__ = ["pick"]

_BLOCK = 256


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _pick_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    first,
    width,
    grouped,
    tables,
    bases,
    capacities,
    stamp,
    uses,
    valid,
    held,
    protect,
    out,
    n,
    never,
    max_uses,
    TICK_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < n
    start = tl.load(first + at, mask=mask, other=0)
    size = tl.load(width + at, mask=mask, other=0)
    live_miss = mask & (tl.load(grouped + at, mask=mask, other=0) != 0)
    table = tl.load(tables + at, mask=mask, other=0)
    base = tl.load(bases + table, mask=mask, other=0)
    ring = tl.maximum(tl.load(capacities + table, mask=mask, other=1), 1)
    bound = tl.load(protect)
    best_key = tl.zeros([BLOCK], dtype=tl.int64) + never
    best_slot = tl.zeros([BLOCK], dtype=tl.int64) - 1
    for j in range(GROUP):  # a constexpr: unrolled
        live = live_miss & (j < size)
        slot = base + (start + j) % ring
        last = tl.load(stamp + slot, mask=live, other=0)
        count = tl.minimum(tl.load(uses + slot, mask=live, other=0), max_uses)
        occupied = tl.load(valid + slot, mask=live, other=0) != 0
        taken = tl.load(held + slot, mask=live, other=1) != 0
        key = tl.where(occupied, (count << TICK_BITS) + last, -1)
        key = tl.where(live & (last < bound) & ~taken, key, never)
        better = key < best_key
        best_slot = tl.where(better, slot, best_slot)
        best_key = tl.where(better, key, best_key)
    tl.store(out + at, tl.where(best_key < never, best_slot, -1), mask=mask)


def pick(
    first: torch.Tensor,
    width: torch.Tensor,
    grouped: torch.Tensor,
    tables: torch.Tensor,
    rings: VictimTables,
    stamp: torch.Tensor,
    uses: torch.Tensor,
    valid: torch.Tensor,
    held: torch.Tensor,
    protect: torch.Tensor,
) -> torch.Tensor:
    """The chosen slot of each pair (``-1``: none); see ``_victims._pick`` (no masked-off slot is read, so no
    trash slot is needed here). No sync."""
    n = first.numel()
    out = torch.empty(n, dtype=torch.int64, device=first.device)
    if n:
        _pick_kernel[(triton.cdiv(n, _BLOCK),)](
            first.contiguous(),
            width.contiguous(),
            grouped.contiguous().view(torch.uint8),
            tables.contiguous(),
            rings.bases,
            rings.capacities,
            stamp,
            uses,
            valid.view(torch.uint8),
            held.view(torch.uint8),
            protect.reshape(1).contiguous(),
            out,
            n,
            NEVER,
            MAX_USES,
            TICK_BITS=TICK_BITS,
            GROUP=GROUP,
            BLOCK=_BLOCK,
        )
    return out
