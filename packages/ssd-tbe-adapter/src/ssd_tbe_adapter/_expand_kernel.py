"""Triton kernel of the survey's lookup expansion (CUDA only, imported lazily): a prefetch's ids and offsets, as
copied into buffers of their padded sizes, turned into each lookup's table, id and bag, and the checks of the
offsets, in one launch (and a fill of the checks).

The torch version (``_expand_lookups`` in :mod:`~ssd_tbe_adapter._device_path`, used elsewhere) takes about 20
launches: a ``searchsorted``, gathers, ``where``\\ s and a reduction, each a few microseconds of a GPU that
the training step's graph is using at the same time.

Each program finds the bags of ``BLOCK`` lookups by a binary search over the bags' ends (the last bag for a
lookup past them, so it stays in bounds whatever the offsets hold) and checks ``BLOCK`` bags' offsets for a
decrease (an atomic max into the checks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["expand_lookups"]

_BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _expand_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    ids,
    offsets,
    bag_tables,
    scalars,
    n_at,
    bags_at,
    out_tables,
    out_ids,
    out_bags,
    checks,
    size,
    bag_size,
    BLOCK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    block = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(scalars + n_at)
    bags = tl.load(scalars + bags_at)
    # Lookups: position p's bag is the first whose end is past p (a lookup of the padding repeats lookup 0).
    in_range = block < size
    position = tl.where(block < n, block, 0)
    low = tl.zeros_like(block)
    high = tl.zeros_like(block) + bags
    for _ in range(SEARCH_STEPS):
        middle = (low + high) // 2
        searching = low < high
        end = tl.load(offsets + middle + 1, mask=in_range & searching, other=0)
        past = end <= position
        low = tl.where(searching & past, middle + 1, low)
        high = tl.where(searching & ~past, middle, high)
    bag = tl.minimum(low, tl.maximum(bags - 1, 0))
    tl.store(out_bags + block, bag, mask=in_range)
    tl.store(out_tables + block, tl.load(bag_tables + bag, mask=in_range, other=0), mask=in_range)
    tl.store(out_ids + block, tl.load(ids + position, mask=in_range, other=0), mask=in_range)
    # Bags: whether any of the batch's offsets decreases; the first and the last offset.
    in_batch = block < bags
    start = tl.load(offsets + block, mask=in_batch & (block < bag_size), other=0)
    stop = tl.load(offsets + block + 1, mask=in_batch & (block < bag_size), other=0)
    decreasing = tl.max((in_batch & (block < bag_size) & (stop < start)).to(tl.int64), axis=0)
    tl.atomic_max(checks + 2, decreasing, mask=decreasing > 0)
    if tl.program_id(0) == 0:
        tl.store(checks, tl.load(offsets))
        tl.store(checks + 1, tl.load(offsets + bags))


def expand_lookups(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    bag_tables: torch.Tensor,
    scalars: torch.Tensor,
    n_at: int,
    bags_at: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tables, ids, checks, bags)`` of the ``n = scalars[n_at]`` lookups in ``ids`` (``[P]`` int64) over
    the ``bags = scalars[bags_at]`` bags of ``offsets`` (``[Q + 1]`` int64) and their tables ``bag_tables``
    (``[Q]`` int64): each lookup's table, id and bag (``[P]``; positions ``>= n`` repeat lookup 0's table and
    id), and ``[3]`` checks: the first offset, the last, 1 if any decreases (else 0). No sync; capturable."""
    size, bag_size = ids.numel(), bag_tables.numel()
    device = ids.device
    tables = torch.empty(size, dtype=torch.int64, device=device)
    expanded = torch.empty(size, dtype=torch.int64, device=device)
    bags = torch.empty(size, dtype=torch.int64, device=device)
    checks = torch.zeros(3, dtype=torch.int64, device=device)
    grid = (triton.cdiv(max(size, bag_size), _BLOCK),)
    _expand_kernel[grid](
        ids,
        offsets,
        bag_tables,
        scalars,
        n_at,
        bags_at,
        tables,
        expanded,
        bags,
        checks,
        size,
        bag_size,
        BLOCK=_BLOCK,
        SEARCH_STEPS=max(bag_size, 1).bit_length(),
    )
    return tables, expanded, checks, bags
