"""The host-cache path's shortcuts: vouched slots, cached batch layouts; each must answer as the long way does."""

from __future__ import annotations

import torch

from ssd_tbe_adapter._cache import TableCache


def _cache_with(ids: list[int], capacity: int | None = None) -> TableCache:
    cache = TableCache(capacity or len(ids), 2, torch.float32, 1, torch.device("cpu"))
    free, _ = cache.choose_victims(len(ids), tick=1)
    cache.fill(free, torch.tensor(ids), torch.zeros(len(ids), 2), torch.zeros(len(ids), 1), tick=1)
    return cache


def test_vouched_slots_hold_until_a_drop() -> None:
    cache = _cache_with([10, 20, 30])
    ids = torch.tensor([10, 30])
    slots = cache.lookup(ids)
    cache.vouch(slots, ids)
    assert cache.holds(slots, ids)
    # Slot of 30 dropped and refilled with 40: the vouched pair must not be trusted any more.
    cache.drop(slots[1:])
    cache.fill(slots[1:].clone(), torch.tensor([40]), torch.zeros(1, 2), torch.zeros(1, 1), tick=2)
    assert not cache.holds(slots, ids)
    assert cache.holds(slots, torch.tensor([10, 40]))


def test_vouched_slots_changed_in_place_are_checked() -> None:
    cache = _cache_with([10, 20, 30])
    ids = torch.tensor([10, 20])
    slots = cache.lookup(ids)
    cache.vouch(slots, ids)
    ids[1] = 30  # same tensor, new content
    assert not cache.holds(slots, ids)
    ids[1] = 20
    slots[0] = 2  # slot of 30
    assert not cache.holds(slots, ids)


def test_vouch_is_per_tensor_pair() -> None:
    cache = _cache_with([10, 20, 30])
    ids = torch.tensor([10, 20])
    slots = cache.lookup(ids)
    cache.vouch(slots, ids)
    other = torch.tensor([20, 10])
    assert not cache.holds(slots, other)  # same slots, other ids tensor: looked at, and they differ
    assert cache.holds(slots, ids.clone())


def test_clear_forgets_vouched_slots() -> None:
    cache = _cache_with([10, 20])
    ids = torch.tensor([10, 20])
    slots = cache.lookup(ids)
    cache.vouch(slots, ids)
    cache.clear()
    assert not cache.holds(slots, ids)


def test_vouched_entries_are_bounded() -> None:
    cache = _cache_with([10, 20, 30])
    ids = torch.tensor([10])
    pairs = [(cache.lookup(ids), ids) for _ in range(20)]
    for slots, pair_ids in pairs:
        cache.vouch(slots, pair_ids)
    assert len(cache._vouched) <= 8
    assert all(cache.holds(slots, pair_ids) for slots, pair_ids in pairs)


def test_touch_counts_once_per_slot() -> None:
    cache = _cache_with([10, 20, 30])
    slots = cache.lookup(torch.tensor([30, 10]))
    cache.touch(slots, tick=9)
    assert cache.last_used.tolist() == [9, 1, 9]
    assert cache.uses.tolist() == [2, 1, 2]
