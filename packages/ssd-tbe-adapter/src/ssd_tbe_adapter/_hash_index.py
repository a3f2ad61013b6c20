"""``(table, id) -> slot`` over a tier's valid slots as a hash table on the device (CUDA with Triton): the
batch's work proportional to the batch, not to the slots.

The sorted index (:class:`~ssd_tbe_adapter._slot_index.SlotIndex`) merges each batch's new keys into every
slot's sorted key (a sort of the batch's keys and ~15 passes over the slots: on one H200 about half the
device work of a key-value step whose cache misses every step). Here a refill adds one entry per new row
(one launch over the batch's slots) and a lookup probes ~1.5 cells (one launch), whatever the slots.
Entries are never deleted: a refilled or freed slot's old entry stays, stale, and lookups skip it (they check
the slot's valid flag and stored ``(table, id)``); :meth:`HashSlotIndex.rebuild_if_crowded` rebuilds the
table once the entries pass half of it (``4 (S + 1)`` cells rounded up to a power of two, so rebuilds come
every ``S`` inserts or so). The entry count lives on the device (graph replays add to it) and reaches the
host with the survey's counts.
"""

from __future__ import annotations

import torch

from ssd_tbe_adapter._row_moves import moves_on_device
from ssd_tbe_adapter._slot_index import SlotIndex, hash_keys

__all__ = ["HashSlotIndex", "new_slot_index"]


class HashSlotIndex:
    """The keys of one tier's slots ``[S + 1]`` (the last one a trash slot that is never valid) in a hash table.

    The same calls as :class:`~ssd_tbe_adapter._slot_index.SlotIndex` (``set_keys``, ``merge``, ``rebuild``,
    ``find``), plus :attr:`entries` and :meth:`rebuild_if_crowded`. The table's tensors keep their addresses
    (a CUDA graph may read them).
    """

    slot_keys: torch.Tensor  # [S + 1] int64: hash of each slot's (table, id), whatever its valid flag
    keys: torch.Tensor  # [H + 1] int64: each cell's key (EMPTY: none); the last cell is a spare, never probed
    cells: torch.Tensor  # [H] int64: each cell's slot
    entries: torch.Tensor  # 0-dim int64: entries since the last rebuild (stale ones included)

    def __init__(self, valid: torch.Tensor, slot_tables: torch.Tensor, slot_ids: torch.Tensor) -> None:
        device = valid.device
        size = 1024
        while size < 4 * valid.numel():
            size *= 2
        self.slot_keys = hash_keys(slot_tables, slot_ids)
        self.keys = torch.zeros(size + 1, dtype=torch.int64, device=device)  # emptied by rebuild
        self.cells = torch.zeros(size, dtype=torch.int64, device=device)
        self.entries = torch.zeros((), dtype=torch.int64, device=device)
        self._every_slot = torch.arange(valid.numel(), dtype=torch.int64, device=device)
        self.rebuild(valid)

    def set_keys(self, slots: torch.Tensor, tables: torch.Tensor, ids: torch.Tensor) -> None:
        """Slots ``slots`` (``[M]``) now hold ``(tables, ids)`` (call :meth:`merge` after)."""
        self.slot_keys.index_copy_(0, slots, hash_keys(tables, ids))

    def merge(self, valid: torch.Tensor, slots: torch.Tensor) -> None:
        """Entries for the valid ones of ``slots`` (``[M]``: distinct, but for invalid repeats such as the trash
        slot), after :meth:`set_keys`. No sync, fixed shapes: capturable."""
        if slots.numel() == 0:
            return
        from ssd_tbe_adapter._hash_table_kernel import insert_entries

        insert_entries(slots, self.slot_keys, valid, self.keys, self.cells)
        self.entries += valid.index_select(0, slots).sum()

    def rebuild(self, valid: torch.Tensor) -> None:
        """The table again from the valid slots alone (drops the stale entries)."""
        from ssd_tbe_adapter._hash_table_kernel import EMPTY, insert_entries

        self.keys.fill_(EMPTY)
        insert_entries(self._every_slot, self.slot_keys, valid, self.keys, self.cells)
        self.entries.copy_(valid.sum())

    def rebuild_if_crowded(self, entries: int, valid: torch.Tensor) -> None:
        """:meth:`rebuild` when ``entries`` (:attr:`entries` as the host last read it) passed half the table: a
        batch adds at most ``S + 1`` more, so the table stays under three quarters full."""
        if entries > self.cells.numel() // 2:
            self.rebuild(valid)

    def find(
        self,
        tables: torch.Tensor,
        ids: torch.Tensor,
        valid: torch.Tensor,
        slot_tables: torch.Tensor,
        slot_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Slots of ``(tables[i], ids[i])`` (``[N]`` int64 on the device), ``-1`` where not held. No sync."""
        from ssd_tbe_adapter._hash_table_kernel import find_entries

        return find_entries(tables, ids, self.keys, self.cells, valid, slot_tables, slot_ids)


def new_slot_index(
    valid: torch.Tensor, slot_tables: torch.Tensor, slot_ids: torch.Tensor
) -> SlotIndex | HashSlotIndex:
    """The index of a tier's slots on their device: the hash table on CUDA with Triton, else the sorted one."""
    if valid.device.type == "cuda" and moves_on_device(valid.device):
        return HashSlotIndex(valid, slot_tables, slot_ids)
    return SlotIndex(valid, slot_tables, slot_ids)
