"""Triton kernels of :class:`~ssd_tbe_adapter._hash_index.HashSlotIndex` (CUDA only, imported lazily): an
open-addressing table of ``(key, slot)`` entries with linear probing, ``key`` the 64-bit hash of a slot's
``(table, id)``.

- insert: each new entry claims the first empty cell from ``key mod H`` with an atomic compare-and-swap (lanes
  racing for a cell: one wins, the others probe on), then writes its slot there.
- find: probes from ``key mod H`` until an empty cell; an entry whose key matches is a hit only if its slot is
  valid and holds that very ``(table, id)`` (stale entries of refilled or freed slots are skipped), as the
  sorted index's check.

Nothing is ever deleted: the owner rebuilds the table when the entries reach half of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssd_tbe_adapter._hash_kernel import _splitmix
from ssd_tbe_adapter._init import _GOLDEN, _MIX1, _MIX2

__all__ = ["EMPTY", "find_entries", "insert_entries"]

EMPTY = (1 << 63) - 1  # the key of an empty cell (a hash equal to it is stored as EMPTY - 1)
_BLOCK = 256


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _find_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    tables,
    ids,
    keys,
    cells,
    valid,
    slot_tables,
    slot_ids,
    out,
    n,
    cell_mask,
    limit,
    golden,
    mix1,
    mix2,
    empty,
    BLOCK: tl.constexpr,
):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = at < n
    t = tl.load(tables + at, mask=lanes, other=0)
    i = tl.load(ids + at, mask=lanes, other=0)
    key = _splitmix(_splitmix(t, golden, mix1, mix2) ^ i, golden, mix1, mix2)
    key = tl.where(key == empty, empty - 1, key)
    position = key & cell_mask
    found = tl.zeros([BLOCK], dtype=tl.int64) - 1
    active = lanes
    steps = 0
    while (tl.max(active.to(tl.int32), axis=0) > 0) & (steps < limit):
        stored = tl.load(keys + position, mask=active, other=empty)
        match = active & (stored == key)
        slot = tl.load(cells + position, mask=match, other=0)
        held = match & (tl.load(valid + slot, mask=match, other=0) != 0)
        held = held & (tl.load(slot_ids + slot, mask=held, other=0) == i)
        held = held & (tl.load(slot_tables + slot, mask=held, other=0) == t)
        found = tl.where(held, slot, found)
        active = active & ~held & (stored != empty)
        position = (position + 1) & cell_mask
        steps += 1
    tl.store(out + at, found, mask=lanes)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _insert_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    slots,
    slot_keys,
    valid,
    keys,
    cells,
    n,
    cell_mask,
    spare,
    limit,
    empty,
    BLOCK: tl.constexpr,
):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lanes = at < n
    slot = tl.load(slots + at, mask=lanes, other=0)
    active = lanes & (tl.load(valid + slot, mask=lanes, other=0) != 0)
    key = tl.load(slot_keys + slot, mask=active, other=0)
    key = tl.where(key == empty, empty - 1, key)
    position = key & cell_mask
    vacant = tl.zeros([BLOCK], dtype=tl.int64) + empty
    steps = 0
    while (tl.max(active.to(tl.int32), axis=0) > 0) & (steps < limit):
        stored = tl.load(keys + position, mask=active, other=0)
        trying = active & (stored == empty)
        # Lanes that do not try swap into the spare cell past the table (never probed), and lose.
        previous = tl.atomic_cas(keys + tl.where(trying, position, spare), vacant, key)
        won = trying & (previous == empty)
        tl.store(cells + position, slot, mask=won)
        active = active & ~won
        position = tl.where(active, (position + 1) & cell_mask, position)
        steps += 1


def find_entries(
    tables: torch.Tensor,
    ids: torch.Tensor,
    keys: torch.Tensor,
    cells: torch.Tensor,
    valid: torch.Tensor,
    slot_tables: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """The slot of each ``(tables[i], ids[i])`` (``-1`` where no valid slot holds it). No sync."""
    out = torch.empty_like(ids)
    n, size = ids.numel(), cells.numel()
    if n:
        _find_kernel[(triton.cdiv(n, _BLOCK),)](
            tables.contiguous(),
            ids.contiguous(),
            keys,
            cells,
            valid.view(torch.uint8),
            slot_tables,
            slot_ids,
            out,
            n,
            size - 1,
            size,
            _GOLDEN,
            _MIX1,
            _MIX2,
            EMPTY,
            BLOCK=_BLOCK,
        )
    return out


def insert_entries(
    slots: torch.Tensor, slot_keys: torch.Tensor, valid: torch.Tensor, keys: torch.Tensor, cells: torch.Tensor
) -> None:
    """Add an entry ``(slot_keys[s], s)`` for each valid slot ``s`` in ``slots`` (distinct among the valid ones).
    ``keys``: ``[H + 1]`` (the last cell spare), ``cells``: ``[H]``, ``H`` a power of two. No sync."""
    n, size = slots.numel(), cells.numel()
    if n:
        _insert_kernel[(triton.cdiv(n, _BLOCK),)](
            slots.contiguous(),
            slot_keys,
            valid.view(torch.uint8),
            keys,
            cells,
            n,
            size - 1,
            size,
            size,
            EMPTY,
            BLOCK=_BLOCK,
        )
