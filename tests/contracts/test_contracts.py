"""Every real provider fits every consumer Protocol it is used through: typed assignments that mypy --strict
checks, ``isinstance`` against the runtime-checkable Protocols, and a CPU run through the consumer.

Pairs (provider → consumer Protocol):
- kt_regroup.KeyedTensor, vbe_lookup's sharded output (PooledEmbeddings) → kt_regroup KeyedTensorLike
- kt_regroup.KeyedTensor → pipeline_stages KeyedTensorLike (BackwardOverlap cuts it)
- vbe_lookup.VBEFeatures, the example's sparse features → vbe_lookup KeyedJaggedTensorLike
- fbgemm TBE, vbe_lookup.TorchEmbeddingKernel, ssd_tbe_adapter.KeyValueEmbeddingBags → vbe_lookup EmbeddingKernel
- ssd_tbe_adapter.KeyValueEmbeddingBags → vbe_lookup PrefetchableKernel
- vbe_lookup.ShardedEmbeddingBags → pipeline_stages SparseDistModule and Prefetchable
- the example's DLRMBatch, kt_regroup.KeyedTensor → pipeline_stages Pipelineable
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.dlrm._fbgemm import fbgemm_status, new_fbgemm_tbe
from examples.dlrm.data import DLRMBatch, SyntheticConfig, SyntheticCriteo
from examples.dlrm.harness import free_port
from kt_regroup import KeyedTensor, KTRegroupAsDict
from kt_regroup.interfaces import KeyedTensorLike
from pipeline_stages import (
    BackwardOverlap,
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
    record_stream_all,
)
from pipeline_stages.interfaces import KeyedTensorLike as StagesKeyedTensorLike
from pipeline_stages.interfaces import Pipelineable, Prefetchable, SparseDistModule
from ssd_tbe_adapter import KeyValueEmbeddingBags, MemoryStore, RocksDBStore, TableSpec
from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures
from vbe_lookup.interfaces import EmbeddingKernel, KeyedJaggedTensorLike, PrefetchableKernel
from vbe_lookup.sharding import (
    KernelSpec,
    PooledEmbeddings,
    ShardedEmbeddingBags,
    ShardingPlan,
    TableConfig,
    TableWise,
)

DIM = 4
CPU = torch.device("cpu")
# Three features from two source ranks (VBE): feature → rank → sample.
STRIDES = [[2, 1], [1, 3], [2, 2]]


def _vbe_features(keys: list[str], seed: int = 0, rows: int = 50) -> VBEFeatures:
    gen = torch.Generator().manual_seed(seed)
    bags = sum(sum(r) for r in STRIDES)
    lengths = torch.randint(0, 4, (bags,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return VBEFeatures(keys, values, lengths, STRIDES)


def _kv(store: Any = None, cache_rows: int = 8) -> KeyValueEmbeddingBags:
    return KeyValueEmbeddingBags(
        [TableSpec(name="kv", dim=DIM)],
        None,
        MemoryStore() if store is None else store,
        cache_rows=cache_rows,
        optimizer="rowwise_adagrad",
        learning_rate=0.1,
    )


def _torch_kernel() -> TorchEmbeddingKernel:
    return TorchEmbeddingKernel([50], [DIM], optimizer="rowwise_adagrad", learning_rate=0.1)


def _fbgemm() -> Any:
    available, why = fbgemm_status()
    if not available:
        pytest.skip(f"fbgemm TBE unavailable: {why}")
    return new_fbgemm_tbe([50], [DIM], [0], optimizer="rowwise_adagrad", learning_rate=0.1, device=CPU)


# ---------------------------------------------------------------------------------------------- kt-regroup


def test_kt_regroup_keyed_tensor_is_keyed_tensor_like() -> None:
    """kt_regroup.KeyedTensor fits KeyedTensorLike and KTRegroupAsDict groups it like plain slicing."""
    values = torch.randn(3, 2 + 5, requires_grad=True)
    kt: KeyedTensorLike = KeyedTensor(keys=["a", "b"], length_per_key=[2, 5], values=values)
    assert isinstance(kt, KeyedTensorLike)
    out = KTRegroupAsDict(groups=[["b"], ["a", "b"]], keys=["g0", "g1"])([kt])
    torch.testing.assert_close(out["g0"], values[:, 2:])
    torch.testing.assert_close(out["g1"], values)


def test_kt_regroup_keyed_tensor_is_cut_by_backward_overlap() -> None:
    """kt_regroup.KeyedTensor fits pipeline_stages' KeyedTensorLike; BackwardOverlap cuts it at values(),
    keeps its type, and KTRegroupAsDict's gradients reach the embedding module as with plain autograd."""
    emb = nn.EmbeddingBag(20, 3, mode="sum")
    reference = nn.EmbeddingBag(20, 3, mode="sum")
    reference.load_state_dict(emb.state_dict())
    ids = torch.tensor([[1, 2], [3, 3], [0, 19]])

    def ebc(x: torch.Tensor, table: nn.EmbeddingBag) -> KeyedTensor:
        return KeyedTensor(
            keys=["a", "b"], length_per_key=[3, 3], values=torch.cat([table(x), 2 * table(x)], 1)
        )

    regroup = KTRegroupAsDict(groups=[["b", "a"]], keys=["g"])
    regroup([ebc(ids, reference)])["g"].pow(2).sum().backward()
    overlap = BackwardOverlap(cuda=False)
    pooled = overlap.run("ebc", ebc, ids, emb)
    cut: StagesKeyedTensorLike = pooled
    assert isinstance(cut, StagesKeyedTensorLike)
    assert type(pooled) is KeyedTensor
    assert pooled.values().is_leaf
    overlap.backward(regroup([pooled])["g"].pow(2).sum())
    assert emb.weight.grad is not None
    assert reference.weight.grad is not None
    torch.testing.assert_close(emb.weight.grad, reference.weight.grad)


class _RecordingTensor(torch.Tensor):
    """Notes record_stream calls instead of running them (CPU has no record_stream kernel)."""

    streams: ClassVar[list[Any]] = []

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.Tensor.record_stream:
            cls.streams.append((args[0].data_ptr(), args[1]))
            return None
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]  # untyped in torch


def test_kt_regroup_keyed_tensor_is_pipelineable_and_record_stream_all_records_it() -> None:
    """kt_regroup.KeyedTensor fits Pipelineable; pipeline_stages.record_stream_all records its values."""
    values = torch.randn(3, 7).as_subclass(_RecordingTensor)
    kt: Pipelineable = KeyedTensor(keys=["a", "b"], length_per_key=[2, 5], values=values)
    assert isinstance(kt, Pipelineable)
    moved = kt.to(CPU, non_blocking=True)
    assert isinstance(moved, KeyedTensor)
    assert moved.keys() == ["a", "b"]
    stream: Any = torch.Stream(device="cpu")  # a CPU stream: the walk's device-type check lets it through
    _RecordingTensor.streams.clear()
    record_stream_all({"pooled": kt, "nested": [kt]}, stream)
    assert (values.data_ptr(), stream) in _RecordingTensor.streams


# ---------------------------------------------------------------------------------------------- vbe-lookup


def test_vbe_features_and_example_batches_are_keyed_jagged_tensor_like() -> None:
    """VBEFeatures (built by hand and by the example's generator) fit KeyedJaggedTensorLike."""
    features: KeyedJaggedTensorLike = _vbe_features(["a", "b", "c"])
    assert isinstance(features, KeyedJaggedTensorLike)
    torch.testing.assert_close(features.offsets()[1:], torch.cumsum(features.lengths(), 0))
    batch = SyntheticCriteo(SyntheticConfig(batch_size=4, num_batches=1)).batch(0)
    sparse: KeyedJaggedTensorLike = batch.sparse_features
    assert isinstance(sparse, KeyedJaggedTensorLike)
    assert sparse.stride_per_key_per_rank() == [[batch.batch_size]] * 26


def _standalone(kernel: Any, features: VBEFeatures, position: int) -> torch.Tensor:
    """One feature's VBE output from its kernel alone, ``[R][B_r * D]`` split by rank."""
    lengths = torch.split(features.lengths(), [sum(r) for r in STRIDES])[position]
    per_key = features.length_per_key()
    start = sum(per_key[:position])
    indices = features.values()[start : start + per_key[position]]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    with torch.no_grad():
        out = kernel(indices, offsets, batch_size_per_feature_per_rank=[STRIDES[position]])
    assert isinstance(out, torch.Tensor)
    return out


def test_three_kernel_kinds_are_embedding_kernels_of_one_grouped_lookup() -> None:
    """fbgemm TBE, TorchEmbeddingKernel and KeyValueEmbeddingBags fit EmbeddingKernel: a GroupedVBELookup over
    the three (one feature each) gives each feature's block exactly as the kernel alone computes it."""
    tbe = _fbgemm()
    torch_kernel: EmbeddingKernel = _torch_kernel()
    kv: EmbeddingKernel = _kv()
    for kernel in (tbe, torch_kernel, kv):
        assert isinstance(kernel, EmbeddingKernel), type(kernel).__name__
    features = _vbe_features(["a", "b", "c"], seed=1)
    lookup = GroupedVBELookup(
        [
            KernelGroup(tbe, ["a"], [DIM]),
            KernelGroup(torch_kernel, ["b"], [DIM]),
            KernelGroup(kv, ["c"], [DIM]),
        ]
    )
    with torch.no_grad():
        merged = lookup(features).values()
    alone = [_standalone(k, features, i) for i, k in enumerate((tbe, torch_kernel, kv))]
    # Expected layout: rank → kernel group → feature → sample → dim.
    expected = []
    for r in range(2):
        for f, out in enumerate(alone):
            expected.append(torch.split(out, [b * DIM for b in STRIDES[f]])[r])
    torch.testing.assert_close(merged, torch.cat(expected))


def test_key_value_bags_are_a_prefetchable_kernel(tmp_path: Path) -> None:
    """KeyValueEmbeddingBags on RocksDB fits PrefetchableKernel: after prefetch the forward finds every row cached."""
    kv_impl = _kv(RocksDBStore(tmp_path / "store"), cache_rows=64)
    kv: PrefetchableKernel = kv_impl
    assert isinstance(kv, PrefetchableKernel)
    indices = torch.tensor([3, 7, 7, 11, 2**40])
    offsets = torch.tensor([0, 2, 3, 5])
    kv.prefetch(indices, offsets, [[2, 1]])
    out = kv_impl(indices, offsets, batch_size_per_feature_per_rank=[[2, 1]])
    assert out.shape == (3 * DIM,)
    metrics = kv_impl.metrics()
    assert metrics["forward_hits"] == metrics["forward_lookups"] > 0
    kv_impl.close()


# ---------------------------------------------------------------------------------------------- sharded module


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    """A one-process gloo default group (the sharded module needs torch.distributed)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=dt.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def _sharded(tmp_path: Path) -> ShardedEmbeddingBags:
    tables = [
        TableConfig(name="t_a", num_embeddings=50, embedding_dim=DIM, feature_names=("a",)),
        TableConfig(name="t_b", num_embeddings=50, embedding_dim=DIM, feature_names=("b",)),
    ]
    plan = ShardingPlan(
        world_size=1, placements={"t_a": TableWise(rank=0, group="tbe"), "t_b": TableWise(rank=0, group="kv")}
    )

    def factory(spec: KernelSpec) -> EmbeddingKernel:
        if spec.group == "kv":
            return _kv(RocksDBStore(tmp_path / "kv"), cache_rows=16)
        return TorchEmbeddingKernel(
            list(spec.num_embeddings),
            list(spec.embedding_dims),
            optimizer="rowwise_adagrad",
            learning_rate=0.1,
        )

    return ShardedEmbeddingBags(tables, plan, None, kernel_factory=factory)


class _Model(nn.Module):
    def __init__(self, sparse: ShardedEmbeddingBags) -> None:
        super().__init__()
        self.sparse = sparse

    def forward(self, batch: DLRMBatch) -> torch.Tensor:
        pooled: PooledEmbeddings = self.sparse(batch.sparse_features)
        return pooled.values()


def _local_batch(seed: int) -> DLRMBatch:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (2 * 3,), generator=gen)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    return DLRMBatch(
        dense_features=torch.zeros(3, 13),
        sparse_features=VBEFeatures(["a", "b"], values, lengths, [[3], [3]]),
        labels=torch.zeros(3),
    )


@pytest.mark.usefixtures("world_of_one")
def test_sharded_module_output_is_keyed_tensor_like(tmp_path: Path) -> None:
    """ShardedEmbeddingBags' PooledEmbeddings fit KeyedTensorLike; KTRegroupAsDict regroups them with a dense KT."""
    module = _sharded(tmp_path)
    batch = _local_batch(0)
    pooled: PooledEmbeddings = module(batch.sparse_features)
    kt: KeyedTensorLike = pooled
    assert isinstance(kt, KeyedTensorLike)
    assert kt.keys() == ["a", "b"]
    assert kt.length_per_key() == [DIM, DIM]
    dense = KeyedTensor(keys=["dense"], length_per_key=[2], values=torch.ones(3, 2))
    out = KTRegroupAsDict(groups=[["b", "dense", "a"]], keys=["g"])([dense, kt])["g"]
    torch.testing.assert_close(
        out, torch.cat([pooled.values()[:, DIM:], torch.ones(3, 2), pooled.values()[:, :DIM]], 1)
    )


@pytest.mark.usefixtures("world_of_one")
def test_sharded_module_is_a_sparse_dist_module_driven_by_the_pipeline(tmp_path: Path) -> None:
    """ShardedEmbeddingBags fits SparseDistModule and Prefetchable; DLRMBatch fits Pipelineable; a
    StagedTrainPipeline with data_copy → start_sparse_data_dist → prefetch yields the plain forward's outputs."""
    module = _sharded(tmp_path)
    sparse_dist: SparseDistModule = module
    prefetchable: Prefetchable = module
    assert isinstance(sparse_dist, SparseDistModule)
    assert isinstance(prefetchable, Prefetchable)
    batches = [_local_batch(seed) for seed in range(5)]
    for batch in batches:
        pipelineable: Pipelineable = batch
        assert isinstance(pipelineable, Pipelineable)

    model = _Model(module)
    with torch.no_grad():
        expected = [model(b) for b in batches]
    sdd = SparseDataDistUtil(model)
    assert list(sdd.modules) == ["sparse"]
    pipeline = StagedTrainPipeline(
        [
            PipelineStage("data_copy", lambda b: b.to(CPU, non_blocking=True)),
            PipelineStage(
                "start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sparse_data_dist
            ),
            PipelineStage("prefetch", sdd.prefetch, fill_callback=sdd.load_prefetch),
        ]
    )
    outputs = []
    iterator = iter(batches)
    with torch.no_grad():
        while (batch := pipeline.progress(iterator)) is not None:
            assert isinstance(batch, DLRMBatch)
            outputs.append(model(batch))
    sdd.detach()
    assert len(outputs) == len(batches)
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want)
    kv = next(k for k in module.kernels() if isinstance(k, KeyValueEmbeddingBags))
    assert kv.metrics()["prefetches"] == len(batches)
    kv.close()
