"""A group of one rank issues no collective, and gives exactly what the full collective path gives.

The full path is the same code with the communicator told it is not alone (``_alone = False``): real gloo
``all_to_all_single`` calls over a 1-rank group. Both modules start from the same tables and train a few
SGD steps on random layouts (batch sizes, key orders, weights, table-wise and row-wise, pooled and sequence).
"""

from __future__ import annotations

import dataclasses
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
from vbe_lookup.errors import IndexOutOfRangeError
from vbe_lookup.sharding import (
    RowWise,
    ShardedEmbeddingBags,
    ShardedSequenceEmbeddings,
    ShardingPlan,
    TableWise,
    torch_kernel_factory,
)


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A 1-rank gloo group in this process (no spawn)."""
    with _dist_harness.one_rank_gloo():
        yield


class _CountCollectives:
    """Counts the real collective calls made while it is active (the functions still run)."""

    names = ("all_to_all_single", "all_gather", "all_reduce")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        for name in self.names:
            real = getattr(dist, name)
            monkeypatch.setattr(dist, name, self._wrap(real))

    def _wrap(self, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        return counted


def _rotated(seed: int, batch: int, weighted: bool, rotation: int) -> Any:
    """A local batch whose keys are the features rotated by ``rotation`` (``make_batches`` rotates the
    keys of rank ``r`` by ``r``)."""
    return make_batches(seed, [batch] * (rotation + 1), weighted)[rotation]


def _plan(row_wise: bool) -> ShardingPlan:
    placements = {t.name: RowWise(group="g") if row_wise else TableWise(rank=0, group=t.name) for t in TABLES}
    return ShardingPlan(world_size=1, placements=placements)


def _pair(module_type: type, row_wise: bool, seed: int) -> tuple[Any, Any]:
    """Two modules with the same tables: the shortcut and the full collective path."""
    factory = torch_kernel_factory(learning_rate=_dist_workers.LR)
    init = initial_tables(seed)
    fast = module_type(TABLES, _plan(row_wise), kernel_factory=factory)
    full = module_type(TABLES, _plan(row_wise), kernel_factory=factory)
    for module in (fast, full):
        module.load_state_dict(init)
    full._comm._alone = False
    return fast, full


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    batches=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    weighted=st.booleans(),
    row_wise=st.booleans(),
    rotation=st.integers(0, len(FEATURES) - 1),
)
def test_pooled_shortcut_equals_collective_path(
    one_rank: None, seed: int, batches: list[int], weighted: bool, row_wise: bool, rotation: int
) -> None:
    """Pooled outputs and the tables after each SGD step are equal on both paths (keys in slot order or
    rotated, which the shortcut gathers into slot order)."""
    del one_rank
    fast, full = _pair(ShardedEmbeddingBags, row_wise, seed)
    for step, batch in enumerate(batches):
        local = _rotated(seed + step, batch, weighted, rotation)
        outs = [module(local.features(torch.device("cpu"))).values() for module in (fast, full)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        grad = _dist_workers.grad_seed(seed + step, batch)
        for out in outs:
            backward((out * grad).sum())
    for (name, a), (_, b) in zip(fast.state_dict().items(), full.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 6),
    row_wise=st.booleans(),
    rotation=st.integers(0, len(FEATURES) - 1),
)
def test_sequence_shortcut_equals_collective_path(
    one_rank: None, seed: int, batch: int, row_wise: bool, rotation: int
) -> None:
    """Sequence embeddings and lengths are equal on both paths."""
    del one_rank
    fast, full = _pair(ShardedSequenceEmbeddings, row_wise, seed)
    local = _rotated(seed, batch, False, rotation)
    got = [module(local.features(torch.device("cpu"))) for module in (fast, full)]
    for f in FEATURES:
        torch.testing.assert_close(got[0][f], got[1][f], rtol=0, atol=0)
        torch.testing.assert_close(got[0].lengths(f), got[1].lengths(f), rtol=0, atol=0)


def test_one_rank_issues_no_collective(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward of a group of one make no collective call; the full path makes several."""
    del one_rank
    fast, full = _pair(ShardedEmbeddingBags, False, 7)
    local = make_batches(7, [5], True)[0]
    counter = _CountCollectives(monkeypatch)
    backward(fast(local.features(torch.device("cpu"))).values().sum())
    assert counter.calls == 0
    backward(full(local.features(torch.device("cpu"))).values().sum())
    assert counter.calls >= 4  # header, lengths, ids, weights, output (and its backward)


def test_one_rank_output_of_an_empty_batch_takes_part_in_the_graph(one_rank: None) -> None:
    """An empty local batch still gives an output that requires grad (its backward runs, as on any rank)."""
    del one_rank
    fast, _ = _pair(ShardedEmbeddingBags, True, 3)
    out = fast(make_batches(3, [0], False)[0].features(torch.device("cpu"))).values()
    assert out.requires_grad
    backward(out.sum())


def test_one_rank_reports_bad_input_at_wait(one_rank: None) -> None:
    """On a group of one the checks' host read happens in ``wait_input_dist`` (a pipeline's start never
    blocks): bad ids raise there, again on a second try with the same handle, and the module goes on."""
    del one_rank
    fast, _ = _pair(ShardedEmbeddingBags, False, 5)
    local = make_batches(5, [4], False)[0]
    good = local.features(torch.device("cpu"))
    values = good.values().clone()
    values[0] = 10_000  # past every table
    bad = VBEFeatures(good.keys(), values, good.lengths(), good.stride_per_key_per_rank())
    handle = fast.start_input_dist(bad)  # no host read yet: nothing raised
    for _ in range(2):
        with pytest.raises(IndexOutOfRangeError, match="10000"):
            fast.wait_input_dist(handle)
    out = fast(good).values()
    backward(out.sum())


def _fbgemm_factory() -> Any:
    from vbe_lookup import _fbgemm
    from vbe_lookup.sharding import KernelSpec

    def build(spec: KernelSpec) -> Any:
        return _fbgemm.new_tbe(
            list(spec.num_embeddings),
            list(spec.embedding_dims),
            feature_table_map=list(spec.feature_table_map),
            optimizer="sgd",
            learning_rate=_dist_workers.LR,
            device="cpu",
        )

    return build


def _kernel_factories() -> list[Any]:
    from vbe_lookup import _fbgemm

    fbgemm = pytest.param(
        "fbgemm",
        marks=pytest.mark.skipif(not _fbgemm.fbgemm_available(), reason="fbgemm-gpu is not installed"),
        id="fbgemm",
    )
    return [pytest.param("torch", id="torch"), fbgemm]


@pytest.mark.parametrize("kernel", _kernel_factories())
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    batches=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    weighted=st.booleans(),
    rotation=st.integers(0, len(FEATURES) - 1),
)
def test_batch_major_block_in_another_slot_order_equals_collective_path(
    one_rank: None, kernel: str, seed: int, batches: list[int], weighted: bool, rotation: int
) -> None:
    """Kernel groups whose slots are not in the module's feature order: the lookup's ``[B, sum(dims)]``
    block, its columns put in feature order, gives the full path's outputs and tables after SGD steps."""
    del one_rank
    placements: dict[str, TableWise | RowWise] = {
        "t0": TableWise(rank=0, group="b"),
        "t1": TableWise(rank=0, group="a"),
        "t2": RowWise(group="b"),
        "t3": TableWise(rank=0, group="a"),
    }
    factory = (
        _fbgemm_factory() if kernel == "fbgemm" else torch_kernel_factory(learning_rate=_dist_workers.LR)
    )
    # fbgemm's TBEs take dims that are multiples of 4: t3 gets 4 (its rows, ids and features are TABLES').
    tables = [dataclasses.replace(t, embedding_dim=4) if t.name == "t3" else t for t in TABLES]
    gen = torch.Generator().manual_seed(seed)
    init = {f"{t.name}.weight": torch.randn(t.num_embeddings, t.embedding_dim, generator=gen) for t in tables}
    fast, full = (
        ShardedEmbeddingBags(
            tables, ShardingPlan(world_size=1, placements=placements), kernel_factory=factory
        )
        for _ in range(2)
    )
    for module in (fast, full):
        module.load_state_dict(init)
    full._comm._alone = False
    assert fast._output_dist._alone_columns is not None  # the slots are f0 f1 f3 f2 f4
    assert fast.lookup is not None
    assert fast.lookup._plain_calls  # every kernel is called without VBE for a batch of B > 0
    for step, batch in enumerate(batches):
        local = _rotated(seed + step, batch, weighted, rotation)
        outs = [module(local.features(torch.device("cpu"))).values() for module in (fast, full)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        grad = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(seed + step))
        for out in outs:
            backward((out * grad).sum())
    for (name, a), (_, b) in zip(fast.state_dict().items(), full.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
