"""``(table, id) -> slot`` over a tier's valid slots, on the device: the 64-bit hashes of their keys, sorted.

A lookup is one ``searchsorted`` plus a check of the slot's stored ``(table, id)`` and valid flag, so a hash
collision could only make a row look absent (probability ~``S * N / 2**64`` per batch, ``S`` slots, ``N``
lookups), and a slot freed since the last rebuild is never found. Rebuilt with one sort after the slots change.
"""

from __future__ import annotations

import torch

from ssd_tbe_adapter._init import _mix
from ssd_tbe_adapter._row_moves import moves_on_device

__all__ = ["SlotIndex", "hash_keys"]

_MAX_KEY = (1 << 63) - 1


def hash_keys(tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of each ``(tables[i], ids[i])`` (int64, same device; one Triton launch on CUDA)."""
    if ids.device.type == "cuda" and moves_on_device(ids.device):
        from ssd_tbe_adapter._hash_kernel import hash_pairs

        return hash_pairs(tables.contiguous(), ids.contiguous())
    return _mix(_mix(tables) ^ ids)


class SlotIndex:
    """The keys of one tier's slots ``[S + 1]`` (the last one a trash slot that is never valid), sorted.

    Each slot's hash is kept (:meth:`set_keys` when slots are filled), so a rebuild is one masked sort into
    the same buffers (their addresses never change: a CUDA graph may read them), not a rehash of every slot.

    Args:
        valid, slot_tables, slot_ids: the tier's per-slot metadata (same device), hashed once here.
    """

    slot_keys: torch.Tensor  # [S + 1] int64: hash of each slot's (table, id), whatever its valid flag
    sorted_keys: torch.Tensor  # [S + 1] int64: hash of each valid slot's (table, id), invalid ones last
    sorted_slots: torch.Tensor  # [S + 1] int64: the slot of each sorted key

    def __init__(self, valid: torch.Tensor, slot_tables: torch.Tensor, slot_ids: torch.Tensor) -> None:
        self.slot_keys = hash_keys(slot_tables, slot_ids)
        self.sorted_keys = torch.empty_like(self.slot_keys)
        self.sorted_slots = torch.empty_like(self.slot_keys)
        self.rebuild(valid)

    def set_keys(self, slots: torch.Tensor, tables: torch.Tensor, ids: torch.Tensor) -> None:
        """Slots ``slots`` (``[M]``) now hold ``(tables, ids)`` (call :meth:`rebuild` after)."""
        self.slot_keys.index_copy_(0, slots, hash_keys(tables, ids))

    def rebuild(self, valid: torch.Tensor) -> None:
        """Sort the valid slots' keys again (after slots were filled or freed)."""
        keys = torch.where(valid, self.slot_keys, _MAX_KEY)
        torch.sort(keys, out=(self.sorted_keys, self.sorted_slots))

    def find(
        self,
        tables: torch.Tensor,
        ids: torch.Tensor,
        valid: torch.Tensor,
        slot_tables: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Slots of ``(tables[i], ids[i])`` (``[N]`` int64 on the device), ``-1`` where not held. No sync."""
        keys = hash_keys(tables, ids)
        last = self.sorted_keys.numel() - 1
        position = torch.searchsorted(self.sorted_keys, keys).clamp_(max=last)
        slots = self.sorted_slots.index_select(0, position)
        hit = (
            (self.sorted_keys.index_select(0, position) == keys)
            & valid.index_select(0, slots)
            & (slot_ids.index_select(0, slots) == ids)
            & (slot_tables.index_select(0, slots) == tables)
        )
        return torch.where(hit, slots, -1)
