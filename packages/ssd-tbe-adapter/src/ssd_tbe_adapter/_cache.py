"""One table's row cache: slot storage on the module's device, slot metadata and a sorted id index on the host.

Not thread-safe on its own: the owning :class:`~ssd_tbe_adapter.KeyValueEmbeddingBags` calls every method
under its lock.
"""

from __future__ import annotations

import torch

__all__ = ["TableCache"]

_NEVER = torch.iinfo(torch.int64).max


class TableCache:
    """Slots for ``capacity`` rows of one table with LRU eviction.

    Invariants: ``sorted_ids``/``sorted_slots`` list exactly the valid slots, ids ascending; a slot is dirty
    only if valid; a dirty slot holds a newer row than the store.

    Args:
        capacity: number of slots ``C`` (``>= 0``).
        dim: row width ``D``.
        weight_dtype: float32 or float16.
        state_width: optimizer state floats per row ``S`` (0 for SGD, 1 for row-wise Adagrad).
        device: where the row storage lives.
    """

    def __init__(
        self, capacity: int, dim: int, weight_dtype: torch.dtype, state_width: int, device: torch.device
    ) -> None:
        self.capacity = capacity
        self.device = device
        self.weights = torch.zeros(capacity, dim, dtype=weight_dtype, device=device)
        self.state = torch.zeros(capacity, state_width, dtype=torch.float32, device=device)
        self.slot_ids = torch.zeros(capacity, dtype=torch.int64)
        self.valid = torch.zeros(capacity, dtype=torch.bool)
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.last_used = torch.zeros(capacity, dtype=torch.int64)
        self.sorted_ids = torch.zeros(0, dtype=torch.int64)
        self.sorted_slots = torch.zeros(0, dtype=torch.int64)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids`` (``[N]`` int64, host), ``-1`` where the id is not cached; ``[N]`` int64 host."""
        n = self.sorted_ids.numel()
        if n == 0 or ids.numel() == 0:
            return torch.full_like(ids, -1)
        position = torch.searchsorted(self.sorted_ids, ids).clamp_(max=n - 1)
        hit = self.sorted_ids[position] == ids
        return torch.where(hit, self.sorted_slots[position], -1)

    def touch(self, slots: torch.Tensor, tick: int) -> None:
        """Mark ``slots`` (``[K]`` int64 host, all valid) used at ``tick``."""
        self.last_used[slots] = tick

    def choose_victims(self, count: int, tick: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``count`` slots for new rows: free slots first, then the least recently used valid slots
        last touched before ``tick`` (rows of the batch being served, touched at ``tick`` or later, stay).

        Returns:
            ``(free, victims)``, ``[K1]`` and ``[K2]`` int64 host, ``K1 + K2 <= count``; victims still hold
            their rows (the caller writes dirty ones back, then calls :meth:`drop`).
        """
        free = (~self.valid).nonzero().flatten()[:count]
        missing = count - free.numel()
        if missing <= 0:
            return free, torch.zeros(0, dtype=torch.int64)
        candidates = self.valid & (self.last_used < tick)
        available = int(candidates.sum())
        k = min(missing, available)
        if k == 0:
            return free, torch.zeros(0, dtype=torch.int64)
        scores = torch.where(candidates, self.last_used, _NEVER)
        victims = torch.topk(scores, k, largest=False, sorted=False).indices
        return free, victims

    def drop(self, slots: torch.Tensor, *, reindex: bool = True) -> None:
        """Forget the rows in ``slots`` (host int64); the caller has written dirty ones back already.

        ``reindex=False`` defers the index rebuild to the :meth:`fill` that must follow under the same lock.
        """
        self.valid[slots] = False
        self.dirty[slots] = False
        if reindex:
            self._rebuild()

    def fill(
        self, slots: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, tick: int
    ) -> None:
        """Put clean rows into free ``slots``.

        Args:
            slots: ``[K]`` int64 host, currently invalid.
            ids: ``[K]`` int64 host, not cached.
            weights: ``[K, D]`` in the cache's weight dtype, any device.
            state: ``[K, S]`` float32, any device.
            tick: use time of the new rows.
        """
        if slots.numel() == 0:
            return
        device_slots = slots.to(self.device)
        self.weights[device_slots] = weights.to(self.device, self.weights.dtype)
        self.state[device_slots] = state.to(self.device)
        self.slot_ids[slots] = ids
        self.valid[slots] = True
        self.dirty[slots] = False
        self.last_used[slots] = tick
        self._rebuild()

    def clear(self) -> None:
        """Forget every row (the caller has flushed dirty rows)."""
        self.valid.zero_()
        self.dirty.zero_()
        self._rebuild()

    def _rebuild(self) -> None:
        slots = self.valid.nonzero().flatten()
        ids = self.slot_ids[slots]
        self.sorted_ids, order = torch.sort(ids)
        self.sorted_slots = slots[order]
