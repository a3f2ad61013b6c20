"""The whole-step CUDA graphs' padding and step: a padded step trains exactly as the unpadded one.

On the CPU the step runs eagerly (the same ops the graph records); on CUDA (``gpu``) the trainer with the
whole-step graphs ends with the weights of the trainer without them, and a replayed step makes no host sync.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from examples.dlrm.data import SPARSE_FEATURES, DLRMBatch, SyntheticCriteo
from examples.dlrm.embeddings import build_sharded_tables
from examples.dlrm.model import DLRM
from examples.dlrm.step_graph import StepGraphs, StepPadding
from examples.dlrm.train import TrainConfig, dense_optimizer, new_model

NO_KV = 10**15


def _config(out: Path, **changes: object) -> TrainConfig:
    base = TrainConfig(
        out=out,
        steps=12,
        batch_size=40,
        min_batch_size=8,
        embedding_dim=8,
        bottom_layers=(16,),
        top_layers=(16,),
        max_rows=300,
        kv_rows_threshold=NO_KV,
        tbe="torch",
        dense_lr=0.05,
        sparse_lr=0.1,
        seed=5,
        log_every=10_000,
        progress=False,
        tensorboard=False,
        data_workers=0,
        graph_granularity=16,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]  # the changes are TrainConfig fields


def _batches(config: TrainConfig, count: int, multi_hot: int = 1) -> list[DLRMBatch]:
    synthetic = dataclasses.replace(config.synthetic(0, 1), multi_hot=multi_hot)
    source = SyntheticCriteo(synthetic)
    return [source.batch(i) for i in range(count)]


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A gloo process group of this process alone."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]  # HashStore is not re-exported in torch's stubs
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("multi_hot", [1, 3], ids=["one-hot", "multi-hot"])
def test_padding_keeps_every_real_bag_and_pads_with_zero_weight(multi_hot: int) -> None:
    """Real bags keep their ids in place; padding samples get weight 0 and every padding id; shapes bucketed."""
    config = _config(Path("unused"))
    padding = StepPadding((16, 32, 48))
    for batch in _batches(config, 6, multi_hot):
        padded = padding(batch)
        rows, f = batch.batch_size, len(SPARSE_FEATURES)
        bp, cp = padded.shape_key
        assert padded.rows == padded.batch_size == rows
        assert bp == min(b for b in (16, 32, 48) if b > rows)
        n = batch.sparse_features.values().numel()
        quantum = bp * f // 16
        assert cp >= n
        assert cp % quantum == 0
        assert cp - n < quantum + f * (bp - rows)
        lengths = padded.batch.sparse_features.lengths().view(f, bp)
        torch.testing.assert_close(lengths[:, :rows], batch.sparse_features.lengths().view(f, rows))
        assert int(lengths.sum()) == cp
        # Per feature: the real ids first, in order, then the padding ids (all 0).
        values = padded.batch.sparse_features.values()
        starts = torch.cumsum(lengths.sum(1), 0) - lengths.sum(1)
        real = batch.sparse_features.values().split_with_sizes(
            batch.sparse_features.lengths().view(f, rows).sum(1).tolist()
        )
        for i in range(f):
            a, k = int(starts[i]), real[i].numel()
            torch.testing.assert_close(values[a : a + k], real[i])
            assert not values[a + k : a + int(lengths[i].sum())].any()
        torch.testing.assert_close(padded.batch.dense_features[:rows], batch.dense_features)
        assert not padded.batch.dense_features[rows:].any()
        assert not padded.batch.labels[rows:].any()
        torch.testing.assert_close(padded.weight.sum(), torch.tensor(1.0))
        assert not padded.weight[rows:].any()


def test_padding_rejects_a_batch_without_a_larger_bucket() -> None:
    """A batch as large as the largest bucket has no padding sample: an error naming the sizes."""
    batch = _batches(_config(Path("unused"), batch_size=16, min_batch_size=16), 1)[0]
    with pytest.raises(ValueError, match="batch of 16 samples needs a padded size above it"):
        StepPadding((8, 16))(batch)
    with pytest.raises(ValueError, match="`buckets`"):
        StepPadding((16, 8))


def _model(
    config: TrainConfig, workdir: Path, device: torch.device | None = None
) -> tuple[DLRM, torch.optim.Adagrad]:
    device = torch.device("cpu") if device is None else device
    tables = build_sharded_tables(
        config.embedding_config(1),
        rank=0,
        world_size=1,
        process_group=dist.group.WORLD,
        device=device,
        workdir=workdir,
    )
    model = new_model(config, tables, device)
    return model, dense_optimizer(model.dense_parameters(), lr=config.dense_lr)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("multi_hot", [1, 3], ids=["one-hot", "multi-hot"])
def test_padded_whole_step_trains_as_the_unpadded_step(tmp_path: Path, multi_hot: int) -> None:
    """The whole step's ops on padded batches give the weights and losses of the trainer's eager step."""
    config = _config(tmp_path)
    batches = _batches(config, 8, multi_hot)
    padding = StepPadding((16, 32, 48))
    eager, eager_opt = _model(config, tmp_path / "a")
    whole, whole_opt = _model(config, tmp_path / "b")
    graphs = StepGraphs(whole, whole_opt, capture=False)
    for batch in batches:
        eager_opt.zero_grad(set_to_none=True)
        loss = eager.train_loss(batch)
        loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch
        eager_opt.step()
        torch.testing.assert_close(graphs.step(padding(batch)), loss.detach())
    assert graphs.eager_steps == len(batches)
    assert graphs.replays == 0
    for (name, a), b in zip(eager.state_dict().items(), whole.state_dict().values(), strict=True):
        assert torch.allclose(b, a, rtol=1.3e-6, atol=1e-5), name
    for p_a, p_b in zip(eager.dense_parameters(), whole.dense_parameters(), strict=True):
        assert eager_opt.state[p_a]["step"] == whole_opt.state[p_b]["step"] == len(batches)


@pytest.mark.gpu
def test_whole_step_graphs_train_as_the_eager_trainer(tmp_path: Path) -> None:
    """On one GPU (fbgemm TBE, direct path): the graphed trainer ends with the eager trainer's weights, and it
    replayed graphs."""
    from examples.dlrm.harness import run_world, train_configs

    base = _config(tmp_path, tbe="fbgemm", device="cuda", steps=24, batch_pool=6, pipeline=False)
    configs = [
        dataclasses.replace(base, out=tmp_path / "graphed"),
        dataclasses.replace(base, out=tmp_path / "pipelined", pipeline=True),
        dataclasses.replace(base, out=tmp_path / "eager", graph_step=False),
    ]
    graphed, pipelined, eager = run_world(train_configs, 1, (configs,), timeout_s=400)[0]
    assert graphed.summary["step_graphs"]["replays"] > 0, graphed.summary["step_graphs"]
    assert eager.summary["step_graphs"] is None
    for run in (graphed, pipelined):
        for key in eager.dense_state:
            torch.testing.assert_close(run.dense_state[key], eager.dense_state[key], rtol=1e-4, atol=1e-5)
        for key in eager.embedding_state:
            torch.testing.assert_close(
                run.embedding_state[key], eager.embedding_state[key], rtol=1e-4, atol=1e-5
            )


@pytest.mark.gpu
@pytest.mark.usefixtures("world_of_one")
def test_a_replayed_whole_step_makes_no_host_sync(tmp_path: Path) -> None:
    """After its capture a shape's step is copies and one replay: no host sync (sync debug mode 'error')."""
    config = _config(tmp_path, tbe="fbgemm", device="cuda")
    cuda = torch.device("cuda")
    model, optimizer = _model(config, tmp_path, cuda)
    graphs = StepGraphs(model, optimizer)
    batch = StepPadding((16, 32, 48))(_batches(config, 1)[0]).pin_memory().to(cuda, non_blocking=True)
    for _ in range(2):  # the eager step, then the capture and its first replay
        graphs.step(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            graphs.step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert graphs.replays == 4
    assert graphs.eager_steps == 1
