"""A group of one checks its local batch with a few reductions read with the ids per key (no per-id key when
every table has as many rows): the same results and the same errors as the full collective path.

Tables with as many rows each take the largest-id check; the shared ``TABLES`` (rows differ) take the per-key
excess check. Both are compared with the full path (the same module told it is not alone) on random batches,
key orders, weights and plans, and both raise for ids just past their table, negative ids, negative lengths and
lengths that do not cover the ids.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_harness
import _dist_workers
from _dist_workers import TABLES, backward

from vbe_lookup import VBEFeatures
from vbe_lookup.errors import BatchLayoutError, IndexOutOfRangeError
from vbe_lookup.sharding import (
    RowWise,
    ShardedEmbeddingBags,
    ShardedSequenceEmbeddings,
    ShardingPlan,
    TableConfig,
    TableWise,
    torch_kernel_factory,
)

CPU = torch.device("cpu")
SAME_ROWS = 13
SAME_TABLES = (
    TableConfig(name="s0", num_embeddings=SAME_ROWS, embedding_dim=4, feature_names=("g0", "g1")),
    TableConfig(name="s1", num_embeddings=SAME_ROWS, embedding_dim=8, feature_names=("g2",), pooling="mean"),
    TableConfig(name="s2", num_embeddings=SAME_ROWS, embedding_dim=4, feature_names=("g3",)),
)
SAME_FEATURES = ("g0", "g1", "g2", "g3")


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A 1-rank gloo group in this process (no spawn)."""
    with _dist_harness.one_rank_gloo():
        yield


def _rows(tables: Sequence[TableConfig], feature: str) -> int:
    return next(t.num_embeddings for t in tables if feature in t.feature_names)


def _features(
    tables: Sequence[TableConfig], seed: int, batch: int, rotation: int, weighted: bool
) -> VBEFeatures:
    """A local batch of every feature, keys rotated by ``rotation``, ids anywhere in their table (both ends)."""
    names = [f for t in tables for f in t.feature_names]
    keys = names[rotation:] + names[:rotation]
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=gen)
    parts = []
    for i, key in enumerate(keys):
        n = int(lengths[i * batch : (i + 1) * batch].sum())
        ids = torch.randint(0, _rows(tables, key), (n,), generator=gen)
        if n:
            ids[0] = _rows(tables, key) - 1  # the last row is in range
        parts.append(ids)
    values = torch.cat(parts)
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return VBEFeatures(keys, values, lengths, [[batch]] * len(keys), weights)


def _pair(module_type: type, tables: Sequence[TableConfig], row_wise: bool, seed: int) -> tuple[Any, Any]:
    """The shortcut and the full collective path over ``tables``, from the same random tables."""
    placements = {t.name: RowWise(group="g") if row_wise else TableWise(rank=0, group=t.name) for t in tables}
    factory = torch_kernel_factory(learning_rate=_dist_workers.LR)
    gen = torch.Generator().manual_seed(seed)
    init = {f"{t.name}.weight": torch.randn(t.num_embeddings, t.embedding_dim, generator=gen) for t in tables}
    fast = module_type(tables, ShardingPlan(world_size=1, placements=placements), kernel_factory=factory)
    full = module_type(tables, ShardingPlan(world_size=1, placements=placements), kernel_factory=factory)
    for module in (fast, full):
        module.load_state_dict(init)
    full._comm._alone = False
    return fast, full


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    batches=st.lists(st.integers(0, 5), min_size=1, max_size=3),
    weighted=st.booleans(),
    row_wise=st.booleans(),
    rotation=st.integers(0, len(SAME_FEATURES) - 1),
)
def test_same_rows_shortcut_equals_collective_path(
    one_rank: None, seed: int, batches: list[int], weighted: bool, row_wise: bool, rotation: int
) -> None:
    """Tables with as many rows take the largest-id check; outputs and tables after SGD steps equal the full
    path's, for keys in slot order and rotated."""
    del one_rank
    fast, full = _pair(ShardedEmbeddingBags, SAME_TABLES, row_wise, seed)
    for step, batch in enumerate(batches):
        local = _features(SAME_TABLES, seed + step, batch, rotation, weighted)
        assert fast._input_dist._alone_layout(tuple(local.keys())).same_rows == SAME_ROWS
        outs = [module(local).values() for module in (fast, full)]
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        grad = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(seed + step))
        for out in outs:
            backward((out * grad).sum())
    for (name, a), (_, b) in zip(fast.state_dict().items(), full.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(0, 5),
    row_wise=st.booleans(),
    rotation=st.integers(0, len(SAME_FEATURES) - 1),
)
def test_same_rows_sequence_shortcut_equals_collective_path(
    one_rank: None, seed: int, batch: int, row_wise: bool, rotation: int
) -> None:
    """A sequence module (which keeps the ids' order) over tables with as many rows equals the full path."""
    del one_rank
    fast, full = _pair(ShardedSequenceEmbeddings, SAME_TABLES, row_wise, seed)
    local = _features(SAME_TABLES, seed, batch, rotation, False)
    got = [module(local) for module in (fast, full)]
    for f in SAME_FEATURES:
        torch.testing.assert_close(got[0][f], got[1][f], rtol=0, atol=0)
        torch.testing.assert_close(got[0].lengths(f), got[1].lengths(f), rtol=0, atol=0)


def _broken(local: VBEFeatures, tables: Sequence[TableConfig], what: str) -> tuple[VBEFeatures, type, str]:
    """``local`` with one defect, the error it must raise and a piece of its message."""
    keys = local.keys()
    values, lengths = local.values().clone(), local.lengths().clone()
    ends = local.lengths().view(len(keys), -1).sum(1).cumsum(0).tolist()
    most = max(t.num_embeddings for t in tables)
    # The last id of a key that has ids (of a key whose table is smaller than the largest, if asked).
    smaller = what == "id past a smaller table"
    at, key = next(
        (ends[i] - 1, k)
        for i, k in reversed(list(enumerate(keys)))
        if ends[i] > (ends[i - 1] if i else 0) and (not smaller or _rows(tables, k) < most)
    )
    if what == "id past its table":
        values[at] = _rows(tables, key)
        return _with(local, values, lengths), IndexOutOfRangeError, f"`{key}` has id {_rows(tables, key)}"
    if what == "negative id":
        values[at] = -1
        return _with(local, values, lengths), IndexOutOfRangeError, f"`{key}` has id -1"
    if smaller:  # in range of the largest table, not of its own
        values[at] = most - 1
        return _with(local, values, lengths), IndexOutOfRangeError, f"`{key}` has id {most - 1}"
    if what == "negative length":  # the lengths still sum to the number of ids
        lengths[1] += lengths[0] + 1
        lengths[0] = -1
        return _with(local, values, lengths), BatchLayoutError, "min -1"
    assert what == "lengths past the ids"
    lengths[0] += 3
    return _with(local, values, lengths), BatchLayoutError, "sum to"


def _with(local: VBEFeatures, values: torch.Tensor, lengths: torch.Tensor) -> VBEFeatures:
    return VBEFeatures(local.keys(), values, lengths, local.stride_per_key_per_rank())


_DEFECTS = ["id past its table", "negative id", "negative length", "lengths past the ids"]


@pytest.mark.parametrize(
    ("same_rows", "what"),
    [(True, what) for what in _DEFECTS] + [(False, what) for what in [*_DEFECTS, "id past a smaller table"]],
    ids=lambda v: ("same-rows" if v else "rows-differ") if isinstance(v, bool) else v.replace(" ", "-"),
)
@pytest.mark.parametrize("rotation", [0, 2], ids=["slot-order", "rotated"])
def test_bad_input_raises_at_wait(one_rank: None, same_rows: bool, what: str, rotation: int) -> None:
    """Each defect raises its error in ``wait_input_dist`` (again on a second try), on both checks; the module
    then goes on with a good batch."""
    del one_rank
    tables = SAME_TABLES if same_rows else TABLES
    fast, _ = _pair(ShardedEmbeddingBags, tables, False, 9)
    good = _features(tables, 9, 4, rotation, False)
    bad, error, message = _broken(good, tables, what)
    assert (fast._input_dist._alone_layout(tuple(good.keys())).same_rows is not None) == same_rows
    handle = fast.start_input_dist(bad)  # no host read yet: nothing raised
    for _ in range(2):
        with pytest.raises(error, match=message):
            fast.wait_input_dist(handle)
    backward(fast(good).values().sum())
