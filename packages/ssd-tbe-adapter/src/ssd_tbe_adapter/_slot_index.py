"""``(table, id) -> slot`` over a tier's valid slots, on the device: the 64-bit hashes of their keys, sorted.

A lookup is one ``searchsorted`` plus a check of the slot's stored ``(table, id)`` and valid flag, so a hash
collision could only make a row look absent (probability ~``S * N / 2**64`` per batch, ``S`` slots, ``N``
lookups), and a slot freed since the last rebuild is never found. Rebuilt with one sort after the slots change.
"""

from __future__ import annotations

import torch

from ssd_tbe_adapter._init import _mix

__all__ = ["SlotIndex", "hash_keys"]

_MAX_KEY = (1 << 63) - 1


def hash_keys(tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A 64-bit hash of each ``(tables[i], ids[i])`` (int64, same device)."""
    return _mix(_mix(tables) ^ ids)


class SlotIndex:
    """The sorted keys of one tier's slots ``[S + 1]`` (the last one a trash slot that is never valid).

    Args:
        valid, slot_tables, slot_ids: the tier's per-slot metadata (same device), read at each rebuild and
            lookup (the tier may replace these tensors; it passes the current ones).
    """

    sorted_keys: torch.Tensor  # [S + 1] int64: hash of each valid slot's (table, id), invalid ones last
    sorted_slots: torch.Tensor  # [S + 1] int64: the slot of each sorted key

    def __init__(self, valid: torch.Tensor, slot_tables: torch.Tensor, slot_ids: torch.Tensor) -> None:
        self._built = False
        self.rebuild(valid, slot_tables, slot_ids)

    def rebuild(self, valid: torch.Tensor, slot_tables: torch.Tensor, slot_ids: torch.Tensor) -> None:
        """Sort the valid slots' keys again (after slots were filled)."""
        if self._built and valid.device.type == "cuda":
            # The old index may have been made on another stream (prefetch vs. a forward without one): its
            # memory is not reused before this stream's reads of it are done.
            stream = torch.cuda.current_stream(valid.device)
            self.sorted_keys.record_stream(stream)
            self.sorted_slots.record_stream(stream)
        keys = torch.where(valid, hash_keys(slot_tables, slot_ids), _MAX_KEY)
        self.sorted_keys, self.sorted_slots = torch.sort(keys)
        self._built = True

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
