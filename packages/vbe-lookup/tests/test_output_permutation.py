"""On CPU a table-wise plan places the pooled output with a permutation (a gather forward and backward); it
gives exactly what the general placement (a zeroed output and a scatter-add) gives.

Both run over real gloo ``all_to_all_single`` calls of a 1-rank group told it is not alone (``_alone =
False``); the general path is the same module with ``_permutation = False``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_harness
import _dist_workers
from _dist_workers import TABLES, backward, initial_tables, make_batches

from vbe_lookup.sharding import RowWise, ShardedEmbeddingBags, ShardingPlan, TableWise, torch_kernel_factory

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A 1-rank gloo group in this process (no spawn)."""
    with _dist_harness.one_rank_gloo():
        yield


def _module(seed: int, *, permutation: bool, row_wise: bool = False) -> Any:
    placements = {t.name: RowWise(group="g") if row_wise else TableWise(rank=0, group=t.name) for t in TABLES}
    plan = ShardingPlan(world_size=1, placements=placements)
    module = ShardedEmbeddingBags(
        TABLES, plan, kernel_factory=torch_kernel_factory(learning_rate=_dist_workers.LR)
    )
    module.load_state_dict(initial_tables(seed))
    module._comm._alone = False
    assert module._output_dist._permutation  # one shard per table on a group of one, row-wise included
    module._output_dist._permutation = permutation
    return module


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    batches=st.lists(st.integers(0, 7), min_size=1, max_size=3),
    weighted=st.booleans(),
    row_wise=st.booleans(),
)
def test_permutation_equals_scatter_add(
    one_rank: None, seed: int, batches: list[int], weighted: bool, row_wise: bool
) -> None:
    """Pooled outputs (mean-pooled tables included), weight gradients and the tables after SGD steps."""
    del one_rank
    modules = [_module(seed, permutation=p, row_wise=row_wise) for p in (True, False)]
    for step, batch in enumerate(batches):
        local = make_batches(seed + step, [batch], weighted)[0]
        grad = _dist_workers.grad_seed(seed + step, batch)
        outs, weight_grads = [], []
        for module in modules:
            features = local.features(CPU, weights_grad=weighted)
            out = module(features).values()
            backward((out * grad).sum())
            outs.append(out.detach())
            weights = features.weights_or_none()
            weight_grads.append(None if weights is None else weights.grad)
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        if weighted:
            assert weight_grads[0] is not None
            assert weight_grads[1] is not None
            torch.testing.assert_close(weight_grads[0], weight_grads[1], rtol=0, atol=0)
    for (name, a), (_, b) in zip(
        modules[0].state_dict().items(), modules[1].state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
