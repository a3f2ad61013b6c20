"""The cache's eviction policy: fewest uses first, least recently used among equals; the current batch stays."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd_tbe_adapter._cache import TableCache
from ssd_tbe_adapter._plan import group_batch, plan_batch, sort_with_order


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


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "fill", "drop", "clear"]), st.lists(st.integers(0, 9), max_size=6)
        ),
        max_size=12,
    ),
    want=st.integers(0, 12),
)
def test_free_slots_without_a_pass_match_the_lowest_invalid_slots(
    ops: list[tuple[str, list[int]]], want: int
) -> None:
    """Whatever inserts (into the free slots it hands out), fills of any invalid slots, drops and clears came
    before, the free slots a cache hands out are its lowest invalid slots, as a pass over the capacity finds them."""
    cache = TableCache(10, 2, torch.float32, 0, torch.device("cpu"))
    next_id = 0
    for op, picks in ops:
        valid = cache.valid.numpy()
        if op in ("insert", "fill"):
            if op == "insert":
                slots = cache.choose_victims(len(picks), tick=0)[0].tolist()
            else:
                slots = sorted({p for p in picks if not valid[p]})
            ids = torch.arange(next_id, next_id + len(slots), dtype=torch.int64)
            next_id += len(slots)
            cache.fill(
                torch.tensor(slots, dtype=torch.int64),
                ids,
                torch.zeros(len(slots), 2),
                torch.zeros(len(slots), 0),
                1,
            )
        elif op == "drop":
            cache.drop(torch.tensor(sorted({p for p in picks if valid[p]}), dtype=torch.int64))
        else:
            cache.clear()
        free, victims = cache.choose_victims(want, tick=0)  # tick 0: no row is old enough to be a victim
        assert victims.numel() == 0
        assert free.tolist() == np.flatnonzero(~cache.valid.numpy())[:want].tolist()


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


_IDS = st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(-5, 50), st.integers(2**40, 2**40 + 9))


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 4), _IDS), max_size=40))
def test_sort_with_order_by_group(pairs: list[tuple[int, int]]) -> None:
    """With groups, the order sorts by (group, id), over the packed-key path and the lexsort fallback."""
    groups = np.array([g for g, _ in pairs], dtype=np.int64)
    ids = np.array([i for _, i in pairs], dtype=np.int64)
    order, sorted_ids = sort_with_order(ids, groups, 5)
    assert sorted(order.tolist()) == list(range(len(pairs)))
    assert list(zip(groups[order].tolist(), sorted_ids.tolist(), strict=True)) == sorted(pairs)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    feature_table_map=st.lists(st.integers(0, 3), min_size=1, max_size=5),
    ranks=st.integers(1, 3),
)
def test_group_batch_matches_per_table_reference(
    data: st.DataObject, feature_table_map: list[int], ranks: int
) -> None:
    """One sort over all tables gives each table's unique ids, inverses and transpose as a per-table pass would."""
    batch_sizes = [
        data.draw(st.lists(st.integers(0, 3), min_size=ranks, max_size=ranks)) for _ in feature_table_map
    ]
    bags = sum(map(sum, batch_sizes))
    lengths = data.draw(st.lists(st.integers(0, 3), min_size=bags, max_size=bags))
    ids = data.draw(
        st.lists(st.one_of(st.integers(0, 6), _IDS), min_size=sum(lengths), max_size=sum(lengths))
    )
    offsets = torch.tensor([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=torch.int64)
    indices = torch.tensor(ids, dtype=torch.int64)
    plan, indices_cpu = plan_batch(
        indices,
        offsets,
        None,
        batch_sizes,
        None,
        None,
        feature_table_map=feature_table_map,
        dims=[2] * 4,
        device=torch.device("cpu"),
    )
    batch = group_batch(plan, indices_cpu, feature_table_map)
    groups = batch.tables
    assert sorted(groups) == sorted(set(feature_table_map))
    for table, group in groups.items():
        features = [f for f, t in enumerate(feature_table_map) if t == table]
        lookups: list[int] = []  # the table's lookups, features concatenated
        lookup_bags: list[int] = []  # the bag of each, numbered over the table's features
        base = 0
        for feature in features:
            first = plan.bag_start[feature]
            for bag in range(plan.num_bags[feature]):
                lo, hi = int(offsets[first + bag]), int(offsets[first + bag + 1])
                lookups += ids[lo:hi]
                lookup_bags += [base + bag] * (hi - lo)
            base += plan.num_bags[feature]
        unique = sorted(set(lookups))
        assert group.unique.tolist() == unique
        assert [u for part in group.inverse for u in part.tolist()] == [unique.index(i) for i in lookups]
        assert [part.numel() for part in group.inverse] == [
            int(offsets[plan.bag_start[f] + plan.num_bags[f]] - offsets[plan.bag_start[f]]) for f in features
        ]
        row_offsets = group.row_offsets.tolist()
        assert row_offsets[0] == 0
        assert row_offsets[-1] == len(lookups)
        assert len(row_offsets) == len(unique) + 1
        for row, value in enumerate(unique):
            span = group.order[row_offsets[row] : row_offsets[row + 1]].tolist()
            assert sorted(span) == [p for p, i in enumerate(lookups) if i == value]
            assert group.sorted_bags[row_offsets[row] : row_offsets[row + 1]].tolist() == [
                lookup_bags[p] for p in span
            ]
    # The batch-wide grouping: every table's unique rows in table order, each lookup's row among them, and
    # the bags (numbered over the whole batch) of each row's lookups, in the per-table order.
    keys = [(table, int(u)) for table, group in groups.items() for u in group.unique.tolist()]
    bag_of_lookup = np.repeat(np.arange(len(lengths)), lengths).tolist()
    table_of_lookup = np.repeat(
        [feature_table_map[f] for f in range(len(feature_table_map)) for _ in range(plan.num_bags[f])],
        lengths,
    ).tolist()
    assert [keys[u] for u in batch.inverse.tolist()] == list(zip(table_of_lookup, ids, strict=True))
    batch_offsets = batch.row_offsets.tolist()
    assert batch_offsets[0] == 0
    assert batch_offsets[-1] == len(ids)
    assert len(batch_offsets) == len(keys) + 1
    for row, key in enumerate(keys):
        row_bags = batch.sorted_bags[batch_offsets[row] : batch_offsets[row + 1]].tolist()
        table = key[0]
        group = groups[table]
        local = group.unique.tolist().index(key[1])
        ro = group.row_offsets.tolist()
        # Same bags in the same order as the table's own transpose (bag numbers shifted to the batch's).
        local_bags = group.sorted_bags[ro[local] : ro[local + 1]].tolist()
        features = [f for f, t in enumerate(feature_table_map) if t == table]
        starts = np.cumsum([0] + [plan.num_bags[f] for f in features])
        expected = []
        for bag in local_bags:
            k = int(np.searchsorted(starts, bag, side="right")) - 1
            expected.append(plan.bag_start[features[k]] + bag - int(starts[k]))
        assert row_bags == expected
        assert sorted(row_bags) == [
            bag_of_lookup[p] for p in range(len(ids)) if (table_of_lookup[p], ids[p]) == key
        ]
