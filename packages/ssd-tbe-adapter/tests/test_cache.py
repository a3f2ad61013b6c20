"""The cache's eviction policy: fewest uses first, least recently used among equals; the current batch stays."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd_tbe_adapter._cache import TableCache
from ssd_tbe_adapter._plan import sort_with_order


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


@settings(max_examples=30, deadline=None)
@given(
    rounds=st.lists(
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12, unique=True), min_size=1, max_size=6
    ),
    capacity=st.integers(0, 8),
)
def test_incremental_index_matches_the_valid_slots(rounds: list[list[int]], capacity: int) -> None:
    cache = TableCache(capacity, 2, torch.float32, 0, torch.device("cpu"))
    for tick, ids in enumerate(rounds, start=1):
        query = torch.tensor(ids, dtype=torch.int64)
        missing = query[cache.lookup(query) < 0]
        free, victims = cache.choose_victims(missing.numel(), tick=tick)
        cache.drop(victims, reindex=False)
        slots = torch.cat([free, victims])
        count = slots.numel()
        cache.fill(slots, missing[:count], torch.zeros(count, 2), torch.zeros(count, 0), tick=tick)
        valid = cache.valid.nonzero().flatten()
        expected = sorted(zip(cache.slot_ids[valid].tolist(), valid.tolist(), strict=True))
        assert list(zip(cache.sorted_ids.tolist(), cache.sorted_slots.tolist(), strict=True)) == expected
        assert cache.lookup(missing[:count]).tolist() == slots.tolist()


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-5, 50), st.integers(2**40, 2**40 + 9)),
        max_size=40,
    )
)
def test_sort_with_order(ids: list[int]) -> None:
    array = np.array(ids, dtype=np.int64)
    order, sorted_ids = sort_with_order(array)
    assert sorted_ids.tolist() == sorted(ids)
    assert array[order].tolist() == sorted(ids)
    assert sorted(order.tolist()) == list(range(len(ids)))
