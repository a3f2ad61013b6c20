"""A Triton kernel for :meth:`~ssd_tbe_adapter._slot_index.SlotIndex.find` (CUDA only, imported lazily): hash,
binary search of the sorted keys and the check of the slot found, in one launch instead of ~13 torch kernels
(the hash, a ``searchsorted``, four gathers and the compares); the same slots as the torch version."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssd_tbe_adapter._hash_kernel import _splitmix
from ssd_tbe_adapter._init import _GOLDEN, _MIX1, _MIX2

__all__ = ["find_pairs"]

_BLOCK = 512


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _find_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    tables,
    ids,
    sorted_keys,
    sorted_slots,
    valid,
    slot_tables,
    slot_ids,
    out,
    n,
    size,
    golden,
    mix1,
    mix2,
    BLOCK: tl.constexpr,
    STEPS: tl.constexpr,
):
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < n
    t = tl.load(tables + at, mask=mask, other=0)
    i = tl.load(ids + at, mask=mask, other=0)
    key = _splitmix(_splitmix(t, golden, mix1, mix2) ^ i, golden, mix1, mix2)
    # The first position whose key is not below `key` (searchsorted, left), clamped to the last one.
    low = tl.zeros([BLOCK], dtype=tl.int64)
    high = tl.zeros([BLOCK], dtype=tl.int64) + size
    for _ in range(STEPS):  # a constexpr: one compile per bit length of the index size
        open_ = low < high
        middle = (low + high) >> 1
        probe = tl.load(sorted_keys + middle, mask=mask & open_, other=0)
        right = probe < key
        low = tl.where(open_ & right, middle + 1, low)
        high = tl.where(open_ & ~right, middle, high)
    position = tl.minimum(low, size - 1)
    found = tl.load(sorted_keys + position, mask=mask, other=0)
    slot = tl.load(sorted_slots + position, mask=mask, other=0)
    held = tl.load(valid + slot, mask=mask, other=0) != 0
    same = (tl.load(slot_ids + slot, mask=mask, other=-1) == i) & (
        tl.load(slot_tables + slot, mask=mask, other=-1) == t
    )
    hit = (found == key) & held & same
    tl.store(out + at, tl.where(hit, slot, -1), mask=mask)


def find_pairs(
    tables: torch.Tensor,
    ids: torch.Tensor,
    sorted_keys: torch.Tensor,
    sorted_slots: torch.Tensor,
    valid: torch.Tensor,
    slot_tables: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """The slot of each ``(tables[i], ids[i])`` among the sorted keys (``-1`` where not held), for contiguous
    int64 CUDA tensors (``valid`` bool); the lookup of :meth:`SlotIndex.find`. No sync."""
    out = torch.empty_like(ids)
    n, size = ids.numel(), sorted_keys.numel()
    if n:
        grid = (triton.cdiv(n, _BLOCK),)
        _find_kernel[grid](
            tables,
            ids,
            sorted_keys,
            sorted_slots,
            valid.view(torch.uint8),
            slot_tables,
            slot_ids,
            out,
            n,
            size,
            _GOLDEN,
            _MIX1,
            _MIX2,
            BLOCK=_BLOCK,
            STEPS=max(size, 1).bit_length(),
        )
    return out
