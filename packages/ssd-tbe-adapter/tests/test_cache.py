"""The cache's eviction policy: fewest uses first, least recently used among equals; the current batch stays."""

from __future__ import annotations

import torch

from ssd_tbe_adapter._cache import TableCache


def _cache_with(ids: list[int]) -> TableCache:
    cache = TableCache(len(ids), 2, torch.float32, 1, torch.device("cpu"))
    free, victims = cache.choose_victims(len(ids), tick=1)
    assert victims.numel() == 0
    cache.fill(free, torch.tensor(ids), torch.zeros(len(ids), 2), torch.zeros(len(ids), 1), tick=1)
    return cache


def test_evicts_least_used_then_least_recent() -> None:
    cache = _cache_with([10, 20, 30])
    slots = cache.lookup(torch.tensor([10, 20, 30]))
    cache.touch(slots[:1], tick=2)  # 10: 2 uses
    cache.touch(slots[:1], tick=3)  # 10: 3 uses, but touched before 20 and 30 below
    cache.touch(slots[1:], tick=4)  # 20, 30: 2 uses, 30 touched last
    cache.touch(slots[2:], tick=5)  # 30: 3 uses
    free, victims = cache.choose_victims(1, tick=6)
    assert free.numel() == 0
    assert cache.slot_ids[victims].tolist() == [20]
    cache.drop(victims)
    assert cache.lookup(torch.tensor([10, 20, 30])).ge(0).tolist() == [True, False, True]


def test_rows_of_the_current_batch_stay() -> None:
    cache = _cache_with([1, 2])
    cache.touch(cache.lookup(torch.tensor([1, 2])), tick=7)
    free, victims = cache.choose_victims(2, tick=7)
    assert free.numel() == 0
    assert victims.numel() == 0
