"""``(table, id) -> slot`` over a tier's valid slots, on the device: the 64-bit hashes of their keys, sorted.

A lookup is one ``searchsorted`` plus a check of the slot's stored ``(table, id)`` and valid flag, so a hash
collision could only make a row look absent (probability ~``S * N / 2**64`` per batch, ``S`` slots, ``N``
lookups), and a slot freed since the last rebuild is never found. After a batch's row moves the sorted keys are
*merged* (:meth:`SlotIndex.merge`: the few new keys sorted, the kept ones shifted; elementwise work over the slots
and one sort of the batch's keys, no sort of the slots); a full :meth:`SlotIndex.rebuild` sorts them all again.
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

    def merge(self, valid: torch.Tensor, slots: torch.Tensor) -> None:
        """The index after ``slots`` (``[M]``, repeats allowed) got new keys (:meth:`set_keys`) and ``valid``
        changed for them or went false anywhere (a freed slot): the same sorted keys as :meth:`rebuild` (the
        invalid slots' order in the tail aside, which no lookup reads). No sync, fixed shapes: capturable.

        The kept keys (valid, not in ``slots``) stay in order; each one moves up by the new keys below it, each
        new key lands after the kept keys below it: one sort of ``M`` keys and elementwise work over the slots,
        instead of a sort of all of them."""
        size = self.sorted_keys.numel()  # S + 1
        m = slots.numel()
        if m == 0:
            return
        device = slots.device
        position = torch.arange(m, device=device)
        # One entry per distinct slot among `slots` (whichever repeat index_copy_ kept), and only valid ones.
        winner = torch.full((size,), -1, dtype=torch.int64, device=device).index_copy_(0, slots, position)
        first = (winner.index_select(0, slots) == position) & valid.index_select(0, slots)
        new_keys, new_order = torch.sort(torch.where(first, self.slot_keys.index_select(0, slots), _MAX_KEY))
        new_slots = slots.index_select(0, new_order)
        changed = torch.zeros(size, dtype=torch.bool, device=device).index_fill_(0, slots, True)
        old_slots = self.sorted_slots
        kept = (
            (self.sorted_keys != _MAX_KEY)
            & valid.index_select(0, old_slots)
            & ~changed.index_select(0, old_slots)
        )
        kept_before = torch.zeros(size + 1, dtype=torch.int64, device=device)
        kept_before[1:] = torch.cumsum(kept, 0)
        dummy = size  # the scratch entry past the index that dropped entries are written to
        at_kept = kept_before[:-1] + torch.searchsorted(new_keys, self.sorted_keys, right=True)
        at_new = position + kept_before.index_select(0, torch.searchsorted(self.sorted_keys, new_keys))
        keys = torch.full((size + 1,), _MAX_KEY, dtype=torch.int64, device=device)
        order = torch.full((size + 1,), size - 1, dtype=torch.int64, device=device)  # the trash slot
        at_kept = torch.where(kept, at_kept, dummy)
        at_new = torch.where(new_keys != _MAX_KEY, at_new, dummy)
        keys.index_copy_(0, at_kept, self.sorted_keys).index_copy_(0, at_new, new_keys)
        order.index_copy_(0, at_kept, old_slots).index_copy_(0, at_new, new_slots)
        self.sorted_keys.copy_(keys[:size])
        self.sorted_slots.copy_(order[:size])

    def find(
        self,
        tables: torch.Tensor,
        ids: torch.Tensor,
        valid: torch.Tensor,
        slot_tables: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Slots of ``(tables[i], ids[i])`` (``[N]`` int64 on the device), ``-1`` where not held. No sync."""
        if ids.device.type == "cuda" and moves_on_device(ids.device):  # one Triton launch
            from ssd_tbe_adapter._find_kernel import find_pairs

            return find_pairs(
                tables.contiguous(),
                ids.contiguous(),
                self.sorted_keys,
                self.sorted_slots,
                valid,
                slot_tables,
                slot_ids,
            )
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
