"""The host-cache path's shortcuts: vouched slots, cached batch layouts; each must answer as the long way does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssd_tbe_adapter import _plan
from ssd_tbe_adapter._cache import TableCache
from ssd_tbe_adapter._plan import _GroupLayouts, group_batch, plan_batch


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


def _grouped(
    ids: list[int], lengths: list[int], batch_sizes: list[list[int]], feature_table_map: list[int]
) -> dict[int, list[list[int]]]:
    offsets = torch.tensor([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=torch.int64)
    plan, indices_cpu = plan_batch(
        torch.tensor(ids, dtype=torch.int64),
        offsets,
        None,
        batch_sizes,
        None,
        None,
        feature_table_map=feature_table_map,
        dims=[2] * 3,
        device=torch.device("cpu"),
    )
    groups = group_batch(plan, indices_cpu, feature_table_map).tables
    return {
        table: [
            group.unique.tolist(),
            [u for part in group.inverse for u in part.tolist()],
            group.order.tolist(),
            group.sorted_bags.tolist(),
            group.row_offsets.tolist(),
        ]
        for table, group in groups.items()
    }


def test_group_layout_is_reused_only_for_equal_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two batches of one bag layout but other bag lengths: the second must not reuse the first's layout."""
    feature_table_map = [1, 0, 1]
    batch_sizes = [[1, 1], [2, 0], [0, 2]]
    ids = [5, 6, 7, 5, 8, 9]
    first = _grouped(ids, [1, 2, 1, 1, 1, 0], batch_sizes, feature_table_map)
    assert _grouped(ids, [1, 2, 1, 1, 1, 0], batch_sizes, feature_table_map) == first
    other = _grouped(ids, [0, 1, 1, 1, 1, 2], batch_sizes, feature_table_map)
    # Table 1 holds features 0 (bag 1: id 5) and 2 (bag 4: id 5, bag 5: ids 8, 9), bags numbered 0-1 and 2-3.
    assert other[1][0] == [5, 8, 9]
    assert other[1][3] == [1, 2, 3, 3]
    assert other[1][4] == [0, 2, 3, 4]
    assert other != first
    monkeypatch.setattr(_plan, "_LAYOUTS", _GroupLayouts(budget=1 << 20))  # nothing cached
    assert _grouped(ids, [0, 1, 1, 1, 1, 2], batch_sizes, feature_table_map) == other
    assert _grouped(ids, [1, 2, 1, 1, 1, 0], batch_sizes, feature_table_map) == first


def test_group_layouts_stay_within_budget() -> None:
    layouts = _GroupLayouts(budget=40)
    for bags in range(1, 12):
        plan, _ = plan_batch(
            torch.zeros(bags, dtype=torch.int64),
            torch.arange(bags + 1),
            None,
            None,
            None,
            None,
            feature_table_map=[0],
            dims=[2],
            device=torch.device("cpu"),
        )
        layouts.get(plan, [0])
        assert layouts.held <= 40
        assert layouts.held == sum(layout.size for layout in layouts.layouts.values())
    assert list(layouts.layouts)[-1] == ((0,), (11,))  # the newest is kept


def _vbe_plan(batch_sizes: list[list[int]], **kwargs: torch.Tensor) -> _plan.Plan:
    bags = sum(map(sum, batch_sizes))
    plan, _ = plan_batch(
        torch.zeros(bags, dtype=torch.int64),
        torch.arange(bags + 1),
        None,
        batch_sizes,
        kwargs.get("vbe_output"),
        kwargs.get("vbe_output_offsets"),
        feature_table_map=[0, 1],
        dims=[2, 3],
        device=torch.device("cpu"),
    )
    return plan


def test_vbe_layouts_cached_per_shape_stay_independent() -> None:
    packed = _vbe_plan([[1, 2], [3, 0]])
    # rank 0: feature 0 (1x2) at 0, feature 1 (3x3) at 2; rank 1: feature 0 (2x2) at 11, feature 1 (0) at 15.
    assert packed.blocks == [[(0, 1, 0), (1, 2, 11)], [(0, 3, 2), (3, 0, 15)]]
    assert packed.output_numel == 15
    packed.blocks[0].clear()  # a plan's lists are its own
    assert _vbe_plan([[1, 2], [3, 0]]).blocks == [[(0, 1, 0), (1, 2, 11)], [(0, 3, 2), (3, 0, 15)]]
    assert _vbe_plan([[2, 1], [3, 0]]).blocks == [[(0, 2, 0), (2, 1, 13)], [(0, 3, 4), (3, 0, 15)]]
    given = _vbe_plan(
        [[1, 2], [3, 0]],
        vbe_output=torch.zeros(40),
        vbe_output_offsets=torch.tensor([[20, 0], [30, 9]]),
    )
    assert given.blocks == [[(0, 1, 20), (1, 2, 30)], [(0, 3, 0), (3, 0, 9)]]
    assert given.output_numel == 40


def _fused_run(
    *,
    fused: bool,
    vbe: bool,
    use_vbe_output: bool,
    optimizer: str,
    cache_rows: int,
    monkeypatch: pytest.MonkeyPatch,
    prefetch_after_forward: bool = False,
) -> tuple[
    list[torch.Tensor], list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]], int, list[list[int]]
]:
    """Five prefetched steps over three tables of one width (feature 3 shares table 0); the outputs, every
    stored row afterwards, how many forwards took the fused step, and per table the cached ids with their use
    counts (``[id, uses, ...]`` by id) before the checkpoint. ``prefetch_after_forward``: the next batch's
    prefetch runs between a forward and its backward (as in the trainer), else before the forward."""
    from ssd_tbe_adapter import KeyValueEmbeddingBags, MemoryStore, TableSpec

    module = KeyValueEmbeddingBags(
        [TableSpec("a", 4), TableSpec("b", 4), TableSpec("c", 4)],
        [0, 1, 2, 0],
        MemoryStore(),
        cache_rows=cache_rows,
        optimizer="sgd" if optimizer == "sgd" else "rowwise_adagrad",
        learning_rate=0.1,
    )
    taken = 0
    fused_forward = module._fused_forward

    def counted(
        plan: _plan.Plan, per_sample_weights: torch.Tensor | None, vbe_output: torch.Tensor | None
    ) -> torch.Tensor | None:
        nonlocal taken
        out = fused_forward(plan, per_sample_weights, vbe_output) if fused else None
        taken += out is not None
        return out

    monkeypatch.setattr(module, "_fused_forward", counted)
    gen = torch.Generator().manual_seed(3)
    batch_sizes = [[2, 3], [1, 2], [3, 0], [2, 2]]
    batches = []
    for step in range(5):
        bags = sum(map(sum, batch_sizes)) if vbe else 4 * 3
        lengths = torch.randint(0, 4, (bags,), generator=gen)
        ids = torch.randint(0, 6 if step < 3 else 40, (int(lengths.sum()),), generator=gen)
        batches.append((ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])))
    outputs = []
    sizes = batch_sizes if vbe else None
    # Each prefetch finishes before the next call: a row updated in the cache and one updated through to the
    # store may differ in the last bit (fused multiply-add), so the cache contents must not depend on timing.
    module.prefetch(*batches[0], sizes)
    module.wait_prefetch()
    for step, (ids, offsets) in enumerate(batches):
        if step + 1 < len(batches) and not prefetch_after_forward:
            module.prefetch(*batches[step + 1], sizes)
            module.wait_prefetch()
        vbe_output = vbe_output_offsets = None
        if use_vbe_output:
            # Blocks at row boundaries, rank-major, with a gap a chained kernel would fill.
            vbe_output = torch.full((4 * 40,), 7.0)
            vbe_output_offsets = torch.tensor([[0, 8, 12, 24], [80, 92, 100, 104]])
        out = module(ids, offsets, None, sizes, vbe_output, vbe_output_offsets)
        if step + 1 < len(batches) and prefetch_after_forward:
            module.prefetch(*batches[step + 1], sizes)
            module.wait_prefetch()
        grad = torch.linspace(-1.0, 1.0, out.numel()).view_as(out)
        out.backward(grad)
        outputs.append(out.detach().clone())
    cached = []
    for cache in module._tier.caches:
        valid = cache.valid.nonzero().flatten()
        order = torch.argsort(cache.slot_ids[valid])
        cached.append(
            torch.stack([cache.slot_ids[valid][order], cache.uses[valid][order]], 1).flatten().tolist()
        )
    rows = [(c.table, c.ids, c.weights, c.optimizer_state) for c in module.checkpoint()]
    module.close()
    return outputs, rows, taken, cached


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"], ids=["sgd", "adagrad"])
@pytest.mark.parametrize(
    ("vbe", "use_vbe_output"),
    [(False, False), (True, False), (True, True)],
    ids=["flat", "vbe", "vbe_output"],
)
@pytest.mark.parametrize("cache_rows", [64, 6], ids=["fits", "evicts"])
@pytest.mark.parametrize("prefetch_after_forward", [False, True], ids=["prefetch_first", "prefetch_after"])
def test_fused_step_equals_per_table_step_bit_for_bit(
    optimizer: str,
    vbe: bool,
    use_vbe_output: bool,
    cache_rows: int,
    prefetch_after_forward: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused host-cache step (one pooled lookup and one optimizer step over every table) gives the very
    outputs and rows of the per-table path, and leaves the same rows cached with the same use counts, also when
    evictions make some batches take the per-table path or move rows between a forward and its backward."""
    runs = [
        _fused_run(
            fused=fused,
            vbe=vbe,
            use_vbe_output=use_vbe_output,
            optimizer=optimizer,
            cache_rows=cache_rows,
            monkeypatch=monkeypatch,
            prefetch_after_forward=prefetch_after_forward,
        )
        for fused in (True, False)
    ]
    (fused_out, fused_rows, taken, fused_cached), (plain_out, plain_rows, none, plain_cached) = runs
    assert none == 0
    assert taken == 5 if cache_rows == 64 else 1 <= taken < 5
    assert fused_cached == plain_cached
    for a, b in zip(fused_out, plain_out, strict=True):
        assert torch.equal(a, b)
    assert len(fused_rows) == len(plain_rows) > 0
    for (ta, ia, wa, sa), (tb, ib, wb, sb) in zip(fused_rows, plain_rows, strict=True):
        assert ta == tb
        assert torch.equal(ia, ib)
        assert torch.equal(wa, wb)
        assert torch.equal(sa, sb)


def test_prefetched_slab_rows_are_not_used_after_the_cache_was_cleared() -> None:
    """A batch whose prefetch found every row in the slab, then a restore (which empties the caches) before its
    forward and backward: both read and update the restored rows, as a module that never prefetched does."""
    from ssd_tbe_adapter import KeyValueEmbeddingBags, MemoryStore, TableChunk, TableSpec

    ids = torch.tensor([1, 2, 2, 5, 1, 7])
    offsets = torch.tensor([0, 2, 3, 5, 6])  # 2 features x 2 bags

    def new_module() -> KeyValueEmbeddingBags:
        return KeyValueEmbeddingBags(
            [TableSpec("a", 4), TableSpec("b", 4)],
            None,
            MemoryStore(),
            cache_rows=16,
            optimizer="rowwise_adagrad",
            learning_rate=0.1,
        )

    module = new_module()
    module.prefetch(ids, offsets)
    module(ids, offsets).sum().backward()
    chunks = [
        TableChunk(table=c.table, ids=c.ids, weights=c.weights + 1.0, optimizer_state=c.optimizer_state + 0.5)
        for c in module.checkpoint()
    ]
    module.prefetch(ids, offsets)
    module.wait_prefetch()
    batch = module._prefetcher._pending[0].future.result()
    assert batch.slab_rows is not None  # every row was cached at the prefetch
    module.restore(chunks)
    out = module(ids, offsets)
    out.backward(torch.ones_like(out))

    reference = new_module()
    reference.restore(chunks)
    expected = reference(ids, offsets)
    expected.backward(torch.ones_like(expected))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for a, b in zip(module.checkpoint(), reference.checkpoint(), strict=True):
        assert a.table == b.table
        assert torch.equal(a.ids, b.ids)
        assert torch.equal(a.weights, b.weights)
        assert torch.equal(a.optimizer_state, b.optimizer_state)
    module.close()
    reference.close()


def test_forward_of_a_prefetched_batch_reuses_its_plan_only_for_the_same_content(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forward whose ids, offsets and batch sizes equal a pending prefetch's (other tensors) takes that
    prefetch's plan without planning again; other batch sizes, int32 ids or per-sample weights plan and check
    their inputs as usual, and every forward gives the output of a module that never prefetched."""
    from ssd_tbe_adapter import KeyValueEmbeddingBags, MemoryStore, TableSpec, _module

    planned: list[int] = []
    plan_batch_ = _plan.plan_batch

    def counted(*args: object, **kwargs: object) -> tuple[_plan.Plan, torch.Tensor]:
        planned.append(1)
        return plan_batch_(*args, **kwargs)  # type: ignore[arg-type]  # forwarded as given

    monkeypatch.setattr(_module, "plan_batch", counted)

    def new_module() -> KeyValueEmbeddingBags:
        return KeyValueEmbeddingBags(
            [TableSpec("a", 4), TableSpec("b", 4)], None, MemoryStore(), cache_rows=16, learning_rate=0.1
        )

    module, reference = new_module(), new_module()
    ids = torch.tensor([1, 2, 2, 5, 1, 7])
    offsets = torch.tensor([0, 2, 3, 5, 6])
    sizes = [[1, 1], [2, 0]]
    cases: list[tuple[list[list[int]] | None, torch.Tensor, torch.Tensor | None, int]] = [
        (sizes, ids, None, 0),  # same content: the prefetch's plan
        ([[2, 0], [1, 1]], ids, None, 1),  # other per-rank sizes: planned (own layout), grouping matched
        (sizes, ids.to(torch.int32), None, 1),  # int32 ids: planned, then matched by content
        (sizes, ids, torch.ones(6), 1),  # per-sample weights: planned
    ]
    for batch_sizes, forward_ids, weights, plans in cases:
        module.prefetch(ids.clone(), offsets.clone(), sizes)
        planned.clear()
        out = module(forward_ids, offsets.clone(), weights, batch_sizes)
        assert len(planned) == plans
        expected = reference(forward_ids, offsets.clone(), weights, batch_sizes)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert module.metrics()["forwards_without_prefetch"] == 0
    assert module.metrics()["forwards"] == len(cases)
    module.close()
    reference.close()
