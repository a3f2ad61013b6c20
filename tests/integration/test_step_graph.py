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
from examples.dlrm.step_graph import PaddedBatch, StepGraphs, StepPadding
from examples.dlrm.train import TrainConfig, dense_optimizer, new_model
from ssd_tbe_adapter import KeyValueEmbeddingBags
from vbe_lookup import GroupedVBELookup

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


@pytest.mark.parametrize("multi_hot", [1, 3], ids=["one-hot", "multi-hot"])
def test_per_feature_padding_reorders_and_gives_every_feature_one_id_count(multi_hot: int) -> None:
    """``keys`` puts the features in that order (each feature's bags and ids unchanged) and ``per_feature``
    pads each to the same id count, a multiple of ``Bp / 16``, with zero ids in its padding bags."""
    config = _config(Path("unused"))
    keys = tuple(reversed(SPARSE_FEATURES[:5])) + tuple(SPARSE_FEATURES[5:])
    padding = StepPadding((16, 32, 48), keys=keys, per_feature=True)
    for batch in _batches(config, 6, multi_hot):
        padded = padding(batch)
        rows, f = batch.batch_size, len(SPARSE_FEATURES)
        bp, cp = padded.shape_key
        assert padded.batch.sparse_features.keys() == list(keys)
        assert cp % f == 0
        per_feature = cp // f
        assert per_feature % (bp // 16) == 0
        lengths = padded.batch.sparse_features.lengths().view(f, bp)
        assert lengths.sum(1).tolist() == [per_feature] * f
        source = batch.sparse_features
        source_lengths = source.lengths().view(f, rows)
        real = source.values().split_with_sizes(source_lengths.sum(1).tolist())
        values = padded.batch.sparse_features.values().view(f, per_feature)
        for i, key in enumerate(keys):
            j = SPARSE_FEATURES.index(key)
            torch.testing.assert_close(lengths[i, :rows], source_lengths[j])
            k = real[j].numel()
            torch.testing.assert_close(values[i, :k], real[j])
            assert not values[i, k:].any()
            assert per_feature - k < bp // 16 + (bp - rows) * multi_hot * 4
    with pytest.raises(ValueError, match="not the padding's `keys`"):
        StepPadding((16, 32, 48), keys=keys[1:])(_batches(config, 1)[0])


@pytest.mark.parametrize("multi_hot", [1, 3], ids=["one-hot", "multi-hot"])
def test_padding_carries_the_bag_offsets_of_the_runs_it_was_given(multi_hot: int) -> None:
    """``bag_offsets`` runs: the padded batch carries each run's bags' offsets (from 0) one after the other,
    equal to the cumulative sum of the run's padded lengths; without runs it carries none; runs past the
    features or empty are rejected."""
    config = _config(Path("unused"))
    f = len(SPARSE_FEATURES)
    runs = ((2, 3), (0, 1), (f - 4, 4))
    padding = StepPadding((16, 32, 48), per_feature=True, bag_offsets=runs)
    for batch in _batches(config, 4, multi_hot):
        padded = padding(batch)
        bp = padded.batch.batch_size
        lengths = padded.batch.sparse_features.lengths().view(f, bp)
        assert padded.bag_offsets is not None
        expected = [
            torch.nn.functional.pad(torch.cumsum(lengths[first : first + count].reshape(-1), 0), (1, 0))
            for first, count in runs
        ]
        torch.testing.assert_close(padded.bag_offsets, torch.cat(expected).to(torch.int64))
        pinned = padded.pin_memory() if torch.cuda.is_available() else padded
        assert pinned.bag_offsets is not None
        torch.testing.assert_close(pinned.bag_offsets, padded.bag_offsets)
    assert StepPadding((16, 32, 48))(_batches(config, 1)[0]).bag_offsets is None
    with pytest.raises(ValueError, match="reach past the batch's"):
        StepPadding((16, 32, 48), bag_offsets=((f - 1, 2),))(_batches(config, 1)[0])
    with pytest.raises(ValueError, match="`bag_offsets` holds"):
        StepPadding((16, 32, 48), bag_offsets=((0, 0),))


def test_padding_rejects_a_batch_without_a_larger_bucket() -> None:
    """A batch as large as the largest bucket has no padding sample: an error naming the sizes."""
    batch = _batches(_config(Path("unused"), batch_size=16, min_batch_size=16), 1)[0]
    with pytest.raises(ValueError, match="batch of 16 samples needs a padded size above it"):
        StepPadding((8, 16))(batch)
    with pytest.raises(ValueError, match="`buckets`"):
        StepPadding((16, 8))


def _model(
    config: TrainConfig, workdir: Path, device: torch.device | None = None, *, kv_on_device: bool = False
) -> tuple[DLRM, torch.optim.Adagrad]:
    device = torch.device("cpu") if device is None else device
    tables = build_sharded_tables(
        dataclasses.replace(config.embedding_config(1), kv_cache_on_device=kv_on_device or None),
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


def _key_value_kernel(model: DLRM) -> KeyValueEmbeddingBags:
    lookup = model.sparse_arch.lookup
    assert isinstance(lookup, GroupedVBELookup)
    return next(g.kernel for g in lookup.groups if isinstance(g.kernel, KeyValueEmbeddingBags))


@pytest.mark.usefixtures("world_of_one")
def test_padded_whole_step_with_key_value_tables_trains_as_the_unpadded_step(tmp_path: Path) -> None:
    """Two kernels (key-value tables and the in-memory ones): the features in kernel order, each padded to one id
    count, split between the kernels by the counts alone; the step gives the eager step's losses and weights,
    with the key-value rows prefetched by ``StepGraphs.prefetch`` (device-managed cache on the CPU)."""
    config = _config(tmp_path, kv_rows_threshold=250, kv_store="memory", cache_rows=16, host_cache_rows=32)
    batches = _batches(config, 8)
    eager, eager_opt = _model(config, tmp_path / "a")
    whole, whole_opt = _model(config, tmp_path / "b", kv_on_device=True)
    graphs = StepGraphs(whole, whole_opt, capture=False)
    assert graphs.per_feature
    assert graphs.prefetches
    padding = graphs.padding((16, 32, 48))
    # Half the steps prefetched at once, half as the pipeline does it: the next batch's prefetch handed over
    # before this step and issued after its replay (prefetch_after_step).
    ahead: PaddedBatch | None = None
    for k, batch in enumerate(batches):
        eager_opt.zero_grad(set_to_none=True)
        loss = eager.train_loss(batch)
        loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch
        eager_opt.step()
        if k < 4:
            padded = graphs.prefetch(padding(batch))
        else:  # batch 4's prefetch runs at the start of its own step, the later ones after the step before
            padded = ahead if ahead is not None else graphs.prefetch_after_step(padding(batch))
            if k + 1 < len(batches):
                ahead = graphs.prefetch_after_step(padding(batches[k + 1]))
        assert len(padded.kv_inputs) == 1
        torch.testing.assert_close(graphs.step(padded), loss.detach())
    kv_a, kv_b = (_key_value_kernel(m) for m in (eager, whole))
    assert kv_b.metrics()["forwards_without_prefetch"] == 0
    assert kv_b.metrics()["forwards"] == len(batches)
    for (name, a), b in zip(eager.state_dict().items(), whole.state_dict().values(), strict=True):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            assert torch.allclose(b, a, rtol=1.3e-6, atol=1e-5), name
    rows_a = {
        (c.table, i): w for c in kv_a.checkpoint() for i, w in zip(c.ids.tolist(), c.weights, strict=True)
    }
    rows_b = {
        (c.table, i): w for c in kv_b.checkpoint() for i, w in zip(c.ids.tolist(), c.weights, strict=True)
    }
    assert rows_a
    assert rows_a.keys() == rows_b.keys()
    for key, w in rows_a.items():
        torch.testing.assert_close(rows_b[key], w, rtol=1.3e-6, atol=1e-5)


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
@pytest.mark.parametrize("cache_rows", [8, 4096], ids=["tiny-cache", "roomy-cache"])
def test_whole_step_graphs_with_key_value_tables_train_as_the_eager_trainer(
    tmp_path: Path, cache_rows: int
) -> None:
    """On one GPU with key-value tables (device-managed cache over a DRAM tier; a tiny cache evicts every step
    and grows its scratch pool, which makes the graphs record again): the graphed trainer, plain and
    pipelined (prefetch one batch ahead), ends with the eager trainer's dense weights, TBE rows and key-value
    rows, and it replayed graphs."""
    from examples.dlrm.harness import run_world, train_configs

    base = _config(
        tmp_path,
        tbe="fbgemm",
        device="cuda",
        steps=24,
        batch_pool=6,
        pipeline=False,
        kv_rows_threshold=250,
        kv_store="memory",
        cache_rows=cache_rows,
        host_cache_rows=64,
    )
    configs = [
        dataclasses.replace(base, out=tmp_path / "graphed"),
        dataclasses.replace(base, out=tmp_path / "pipelined", pipeline=True),
        dataclasses.replace(base, out=tmp_path / "eager", graph_step=False),
    ]
    graphed, pipelined, eager = run_world(train_configs, 1, (configs,), timeout_s=400)[0]
    for run in (graphed, pipelined):
        assert run.summary["step_graphs"]["replays"] > 0, run.summary["step_graphs"]
        assert any(key.endswith(".kv_ids") for key in run.embedding_state)
        for key in eager.dense_state:
            torch.testing.assert_close(run.dense_state[key], eager.dense_state[key], rtol=1e-4, atol=1e-5)
        assert run.embedding_state.keys() == eager.embedding_state.keys()
        for key in eager.embedding_state:
            torch.testing.assert_close(
                run.embedding_state[key], eager.embedding_state[key], rtol=1e-4, atol=1e-5
            )


@pytest.mark.gpu
@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("key_value", [False, True], ids=["tbe", "tbe+key-value"])
def test_a_replayed_whole_step_makes_no_host_sync(tmp_path: Path, key_value: bool) -> None:
    """After its capture a shape's step is copies and one replay (with key-value tables: after the batch's
    prefetch, which may sync, the staging of its slots): no host sync (sync debug mode 'error')."""
    changes: dict[str, object] = {"tbe": "fbgemm", "device": "cuda"}
    if key_value:
        changes.update(kv_rows_threshold=250, kv_store="memory", cache_rows=4096, host_cache_rows=64)
    config = _config(tmp_path, **changes)
    cuda = torch.device("cuda")
    model, optimizer = _model(config, tmp_path, cuda)
    graphs = StepGraphs(model, optimizer)
    assert graphs.prefetches == key_value
    host = graphs.padding((16, 32, 48))(_batches(config, 1)[0]).pin_memory()
    for _ in range(2):  # the eager step, then the capture and its first replay
        graphs.step(graphs.prefetch(host.to(cuda, non_blocking=True)))
    for _ in range(3):
        batch = graphs.prefetch(host.to(cuda, non_blocking=True))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphs.step(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert graphs.replays == 4
    assert graphs.eager_steps == 1
