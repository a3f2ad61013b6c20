"""DCP checkpoints of the DLRM example reshard: saved on 2 gloo ranks, resumed on 3, then on 1, every table equal.

The tables are dealt to ranks by a plan that depends on the world size, so on 3 ranks (and on 1) each rank
loads shards that other ranks wrote: the in-memory tables through DCP's ``ShardedTensor`` resharding
(vbe-lookup's ``sharded_state_dict()``), the key-value tables from the chunk files their old owner streamed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.dlrm.checkpoint import read_meta
from examples.dlrm.errors import CheckpointError
from examples.dlrm.harness import run_world, train_configs
from examples.dlrm.train import TrainConfig, TrainResult

STEPS = 6
pytestmark = [pytest.mark.distributed]


def _config(out: Path, **changes: Any) -> TrainConfig:
    base = TrainConfig(
        out=out,
        steps=STEPS,
        batch_size=32,
        min_batch_size=8,
        embedding_dim=8,
        bottom_layers=(16,),
        top_layers=(16,),
        max_rows=300,
        kv_max_rows=20_000,
        cache_rows=32,
        kv_store="rocksdb",
        sparse_lr=0.1,
        log_every=10_000,
        seed=11,
        eval_batches=2,
        progress=False,
        data_workers=0,
    )
    return dataclasses.replace(base, **changes)


def _tables(results: list[TrainResult]) -> dict[str, torch.Tensor]:
    """The union of every rank's tables (each table lives on one rank): the model's whole sparse state."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        for key, value in result.embedding_state.items():
            assert key not in merged, key
            merged[key] = value
    return merged


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[TrainResult]]:
    """The same run folder: 6 steps on 2 ranks, resumed (0 more steps) on 3 ranks, then on 1."""
    out = tmp_path_factory.mktemp("reshard") / "run"
    results = {2: run_world(train_configs, 2, ([_config(out)],), timeout_s=240)}
    for world in (3, 1):
        results[world] = run_world(train_configs, world, ([_config(out, resume=True)],), timeout_s=240)
    return {world: [per_rank[0] for per_rank in ranks] for world, ranks in results.items()}


def test_resume_on_three_and_on_one_rank_restores_every_table(worlds: dict[int, list[TrainResult]]) -> None:
    """In-memory tables with their row-wise Adagrad state and every key-value row equal the 2-rank save."""
    saved = _tables(worlds[2])
    assert any(k.endswith(".kv_ids") for k in saved)
    assert any(k.endswith(".optimizer_state.0") for k in saved)
    for world in (3, 1):
        loaded = _tables(worlds[world])
        assert loaded.keys() == saved.keys(), world
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"{world} ranks: {key} differs from the 2-rank save"


def test_resume_on_another_world_size_moves_tables_between_ranks(
    worlds: dict[int, list[TrainResult]],
) -> None:
    """The 3-rank plan places tables on ranks that did not hold them (the comparison above is a reshard)."""

    def owners(results: list[TrainResult]) -> dict[str, int]:
        return {k.split(".")[0]: r.rank for r in results for k in r.embedding_state}

    two, three = owners(worlds[2]), owners(worlds[3])
    assert any(two[t] != three[t] for t in two)
    assert set(three.values()) == {0, 1, 2}


def test_resumed_dense_weights_and_history_are_the_saved_ones(worlds: dict[int, list[TrainResult]]) -> None:
    """Dense weights (replicated) equal on every rank of every world; the step and the history carry over."""
    reference = worlds[2][0].dense_state
    for world in (3, 1):
        for result in worlds[world]:
            assert result.steps == STEPS
            for key, value in reference.items():
                torch.testing.assert_close(result.dense_state[key], value)
        assert worlds[world][0].summary["steps"] == STEPS


def test_checkpoint_layout_and_incompatible_resume(worlds: dict[int, list[TrainResult]]) -> None:
    """The checkpoint folder is DCP's plus key-value chunk files; another embedding dim is refused in one line."""
    out = Path(worlds[1][0].summary["config"]["out"])
    folder = out / "checkpoint"
    assert (folder / ".metadata").is_file()
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["step"], meta["world_size"]) == (STEPS, 1)
    assert list((folder / "kv").glob("t_cat_*/rank0.json"))
    with pytest.raises(CheckpointError, match=r"embedding_dim=8 in the checkpoint, 16 now"):
        read_meta(out, _config(out, embedding_dim=16).model_config())
