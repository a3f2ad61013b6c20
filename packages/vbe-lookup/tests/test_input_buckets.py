"""The input dist's table-wise bucketing (no sort) gives exactly what the general by-shard path gives.

Both paths run over real gloo ``all_to_all_single`` calls of a 1-rank group told it is not alone
(``_alone = False``): the by-shard path is the same module with ``_table_wise = False``. Also: on CPU the
lengths and ids ride with the header in one all-to-all, within a capacity per pair of ranks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_harness
import _dist_workers
from _dist_workers import FEATURES, TABLES, backward, initial_tables, make_batches

from vbe_lookup import VBEFeatures
from vbe_lookup.errors import BatchLayoutError, IndexOutOfRangeError
from vbe_lookup.sharding import (
    ShardedEmbeddingBags,
    ShardedSequenceEmbeddings,
    ShardingPlan,
    TableWise,
    torch_kernel_factory,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A 1-rank gloo group in this process (no spawn)."""
    with _dist_harness.one_rank_gloo():
        yield


def _pair(module_type: type, seed: int) -> tuple[Any, Any]:
    """Two table-wise modules on the full collective path: table-wise bucketing and the by-shard one."""
    plan = ShardingPlan(world_size=1, placements={t.name: TableWise(rank=0, group=t.name) for t in TABLES})
    factory = torch_kernel_factory(learning_rate=_dist_workers.LR)
    init = initial_tables(seed)
    fast = module_type(TABLES, plan, kernel_factory=factory)
    general = module_type(TABLES, plan, kernel_factory=factory)
    for module in (fast, general):
        module.load_state_dict(init)
        module._comm._alone = False
    assert fast._input_dist._table_wise
    general._input_dist._table_wise = False
    return fast, general


def _rotated(seed: int, batch: int, weighted: bool, rotation: int) -> Any:
    return make_batches(seed, [batch] * (rotation + 1), weighted)[rotation]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 6),
    weighted=st.booleans(),
    rotation=st.integers(0, len(FEATURES) - 1),
)
def test_table_wise_buckets_equal_by_shard_buckets(
    one_rank: None, seed: int, batch: int, weighted: bool, rotation: int
) -> None:
    """Distributed features and every tensor of the source context are equal on both paths."""
    del one_rank
    fast, general = _pair(ShardedEmbeddingBags, seed)
    local = _rotated(seed, batch, weighted, rotation)
    got = [m.wait_input_dist(m.start_input_dist(local.features(CPU))) for m in (fast, general)]
    a, b = got
    assert a.keys() == b.keys()
    assert a.stride_per_key_per_rank() == b.stride_per_key_per_rank()
    assert a.ids_per_slot_per_rank == b.ids_per_slot_per_rank
    assert a.batch_size_per_rank == b.batch_size_per_rank
    for name in ("values", "lengths", "offsets"):
        torch.testing.assert_close(getattr(a, name)(), getattr(b, name)(), rtol=0, atol=0, msg=name)
    wa, wb = a.weights_or_none(), b.weights_or_none()
    assert (wa is None) == (wb is None)
    if wa is not None and wb is not None:
        torch.testing.assert_close(wa, wb, rtol=0, atol=0)
    sa, sb = a.source, b.source
    assert (sa.sent, sa.ids_per_feature) == (sb.sent, sb.ids_per_feature)
    for name in ("inverse_perm", "sorted_segment", "sent_counts", "lengths", "key_index"):
        torch.testing.assert_close(getattr(sa, name), getattr(sb, name), rtol=0, atol=0, msg=name)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), batches=st.lists(st.integers(0, 6), min_size=1, max_size=3))
def test_table_wise_training_equals_by_shard_training(one_rank: None, seed: int, batches: list[int]) -> None:
    """Pooled outputs and tables after weighted SGD steps, and sequence outputs, are equal on both paths."""
    del one_rank
    fast, general = _pair(ShardedEmbeddingBags, seed)
    for step, batch in enumerate(batches):
        local = _rotated(seed + step, batch, True, step % len(FEATURES))
        outs = [m(local.features(CPU)).values() for m in (fast, general)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        grad = _dist_workers.grad_seed(seed + step, batch)
        for out in outs:
            backward((out * grad).sum())
    for (name, x), (_, y) in zip(fast.state_dict().items(), general.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)
    fast_seq, general_seq = _pair(ShardedSequenceEmbeddings, seed)
    local = _rotated(seed, batches[0], False, 2)
    seq = [m(local.features(CPU)) for m in (fast_seq, general_seq)]
    for f in FEATURES:
        torch.testing.assert_close(seq[0][f], seq[1][f], rtol=0, atol=0)


@pytest.mark.parametrize("table_wise", [True, False])
def test_bad_input_raises_on_both_paths(one_rank: None, table_wise: bool) -> None:
    """Ids past their table and lengths that do not cover the ids raise the same errors on both paths."""
    del one_rank
    module = _pair(ShardedEmbeddingBags, 11)[0 if table_wise else 1]
    good = make_batches(11, [4], False)[0].features(CPU)
    values = good.values().clone()
    values[-1] = 10_000
    bad_ids = VBEFeatures(good.keys(), values, good.lengths(), good.stride_per_key_per_rank())
    with pytest.raises(IndexOutOfRangeError, match="10000"):
        module(bad_ids)
    lengths = good.lengths().clone()
    lengths[0] += 3
    bad_lengths = VBEFeatures(good.keys(), good.values(), lengths, good.stride_per_key_per_rank())
    with pytest.raises(BatchLayoutError, match="sum to"):
        module(bad_lengths)
    backward(module(good).values().sum())  # the module goes on


def _count_all_to_alls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = dist.all_to_all_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "all_to_all_single", counted)
    return calls


def test_ids_ride_with_the_header_within_capacity(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU an unweighted input dist is one all-to-all (header, lengths and ids) once the pair's capacity
    holds the payload; a payload past it takes a second all-to-all and grows the capacity."""
    del one_rank
    fast, _ = _pair(ShardedEmbeddingBags, 5)
    calls = _count_all_to_alls(monkeypatch)
    made = []
    for batch in (4, 4, 3, 40, 40):
        features = make_batches(5, [batch], False)[0].features(CPU)
        calls.clear()
        dist_features = fast.wait_input_dist(fast.start_input_dist(features))
        made.append(len(calls))
        assert dist_features.values().numel() == features.values().numel()
    assert made == [2, 1, 1, 2, 1]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), batches=st.lists(st.integers(0, 40), min_size=2, max_size=5))
def test_payload_within_capacity_equals_overflow_path(one_rank: None, seed: int, batches: list[int]) -> None:
    """Distributed features are the same whether the payload rode with the header (a module that has seen
    larger batches) or came in the second all-to-all (a fresh module: capacity 0)."""
    del one_rank
    seasoned, _ = _pair(ShardedEmbeddingBags, seed)
    seasoned.wait_input_dist(seasoned.start_input_dist(make_batches(seed, [40], True)[0].features(CPU)))
    for step, batch in enumerate(batches):
        local = _rotated(seed + step, batch, step % 2 == 0, step % len(FEATURES))
        fresh, _ = _pair(ShardedEmbeddingBags, seed)
        a, b = (m.wait_input_dist(m.start_input_dist(local.features(CPU))) for m in (seasoned, fresh))
        for name in ("values", "lengths"):
            torch.testing.assert_close(getattr(a, name)(), getattr(b, name)(), rtol=0, atol=0, msg=name)
        assert a.stride_per_key_per_rank() == b.stride_per_key_per_rank()
        wa, wb = a.weights_or_none(), b.weights_or_none()
        assert (wa is None) == (wb is None)
        if wa is not None and wb is not None:
            torch.testing.assert_close(wa, wb, rtol=0, atol=0)
