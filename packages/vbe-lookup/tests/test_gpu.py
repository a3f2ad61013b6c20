"""CUDA paths: TorchEmbeddingKernel on the GPU, zero host syncs per step, fbgemm's real `vbe_output` chain.

Run on a GPU machine: ``REQUIRE_GPU=1 pytest -m gpu packages/vbe-lookup/tests`` (fbgemm-gpu on the path for the
fbgemm tests; they skip when it does not import).
"""

from __future__ import annotations

import datetime
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures, _fbgemm
from vbe_lookup.sharding import RowWise, ShardedEmbeddingBags, ShardingPlan, TableConfig, TableWise

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_harness

from vbe_lookup.testing import ReferenceOptimizer, random_features, reference_pooled

pytestmark = pytest.mark.gpu

KEYS = ["a", "b", "c", "d", "e"]
ROWS = [50, 60, 70, 80, 90]
DIMS = [8, 16, 8, 32, 16]
STRIDE = [[3, 0, 5, 2], [1, 4, 0, 2], [0, 0, 0, 0], [2, 2, 2, 2], [5, 1, 0, 3]]


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Fail on any synchronizing CUDA call inside the block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _features(seed: int, device: str, *, weighted: bool = False) -> VBEFeatures:
    return random_features(
        KEYS,
        ROWS,
        STRIDE,
        weighted=weighted,
        generator=torch.Generator().manual_seed(seed),
        device=device,
        with_length_per_key=True,
    )


def _tables(kernel: Any) -> list[torch.Tensor]:
    tables: list[torch.Tensor] = kernel.split_embedding_weights()
    return tables


def _copy_tables(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"], ids=["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", ["sum", "mean"], ids=["sum", "mean"])
def test_torch_kernel_on_cuda_matches_cpu(optimizer: Any, pooling: Any) -> None:
    """Same forward and same tables after two fused steps on CUDA as on CPU."""
    torch.manual_seed(0)
    cpu = TorchEmbeddingKernel(ROWS, DIMS, pooling=pooling, optimizer=optimizer, learning_rate=0.1)
    gpu = TorchEmbeddingKernel(
        ROWS, DIMS, pooling=pooling, optimizer=optimizer, learning_rate=0.1, device="cuda"
    )
    _copy_tables(gpu.split_embedding_weights(), cpu.split_embedding_weights())
    for step in range(2):
        f_cpu, f_gpu = _features(step, "cpu", weighted=True), _features(step, "cuda", weighted=True)
        kw_cpu = {"per_sample_weights": f_cpu.weights_or_none(), "batch_size_per_feature_per_rank": STRIDE}
        kw_gpu = {"per_sample_weights": f_gpu.weights_or_none(), "batch_size_per_feature_per_rank": STRIDE}
        out_cpu = cpu(f_cpu.values(), f_cpu.offsets(), **kw_cpu)
        out_gpu = gpu(f_gpu.values(), f_gpu.offsets(), **kw_gpu)
        torch.testing.assert_close(out_gpu.cpu(), out_cpu, atol=1e-5, rtol=1e-5)
        grad = torch.randn(out_cpu.shape)
        torch.autograd.backward(out_cpu, grad)
        torch.autograd.backward(out_gpu, grad.cuda())
        for a, b in zip(gpu.split_embedding_weights(), cpu.split_embedding_weights(), strict=True):
            torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5)


def _torch_lookup(device: str, merge: Any = "preallocated") -> GroupedVBELookup:
    torch.manual_seed(0)
    k0 = TorchEmbeddingKernel(ROWS[:2], DIMS[:2], optimizer="rowwise_adagrad", device=device)
    k1 = TorchEmbeddingKernel(ROWS[2:], DIMS[2:], optimizer="rowwise_adagrad", device=device)
    return GroupedVBELookup(
        [KernelGroup(k0, KEYS[:2], DIMS[:2]), KernelGroup(k1, KEYS[2:], DIMS[2:])], merge=merge
    )


@pytest.mark.parametrize("merge", ["preallocated", "legacy"], ids=["preallocated", "legacy"])
def test_grouped_on_cuda_matches_cpu(merge: Any) -> None:
    """The grouped lookup on CUDA equals the CPU one, forward and tables after a step."""
    cpu, gpu = _torch_lookup("cpu", merge), _torch_lookup("cuda", merge)
    for g_cpu, g_gpu in zip(cpu.groups, gpu.groups, strict=True):
        _copy_tables(_tables(g_gpu.kernel), _tables(g_cpu.kernel))
    out_cpu, out_gpu = cpu(_features(0, "cpu")), gpu(_features(0, "cuda"))
    torch.testing.assert_close(out_gpu.values().cpu(), out_cpu.values(), atol=1e-5, rtol=1e-5)
    assert out_gpu.offsets().device.type == "cuda"
    grad = torch.randn(out_cpu.values().shape)
    torch.autograd.backward(out_cpu.values(), grad)
    torch.autograd.backward(out_gpu.values(), grad.cuda())
    for g_cpu, g_gpu in zip(cpu.groups, gpu.groups, strict=True):
        for a, b in zip(_tables(g_gpu.kernel), _tables(g_cpu.kernel), strict=True):
            torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5)


def test_preallocated_step_has_no_host_sync() -> None:
    """After the first step of a layout, forward + fused backward make no synchronizing CUDA call."""
    lookup = _torch_lookup("cuda")
    features = _features(0, "cuda")
    torch.autograd.backward(lookup(features).values().sum())  # builds and caches the layout
    features = _features(1, "cuda")
    with no_host_sync():
        out = lookup(features).values()
        torch.autograd.backward(out, torch.ones_like(out))


needs_fbgemm = pytest.mark.skipif(not _fbgemm.fbgemm_available(), reason=f"fbgemm: {_fbgemm.fbgemm_status()}")


def _fbgemm_lookup(merge: Any = "preallocated") -> tuple[GroupedVBELookup, dict[str, torch.Tensor]]:
    """Two fbgemm TBEs (a,b | c,d) and a TorchEmbeddingKernel (e) on CUDA, plus reference tables."""
    torch.manual_seed(0)
    t0 = _fbgemm.new_tbe(ROWS[:2], DIMS[:2], optimizer="rowwise_adagrad", learning_rate=0.05, device="cuda")
    t1 = _fbgemm.new_tbe(ROWS[2:4], DIMS[2:4], optimizer="rowwise_adagrad", learning_rate=0.05, device="cuda")
    k2 = TorchEmbeddingKernel(
        ROWS[4:], DIMS[4:], optimizer="rowwise_adagrad", learning_rate=0.05, device="cuda"
    )
    tables = {}
    for kernel, names in ((t0, KEYS[:2]), (t1, KEYS[2:4]), (k2, KEYS[4:])):
        for name, w in zip(names, kernel.split_embedding_weights(), strict=True):
            with torch.no_grad():
                w.uniform_(-1, 1)
            tables[name] = w
    lookup = GroupedVBELookup(
        [
            KernelGroup(t0, KEYS[:2], DIMS[:2]),
            KernelGroup(t1, KEYS[2:4], DIMS[2:4]),
            KernelGroup(k2, KEYS[4:], DIMS[4:]),
        ],
        merge=merge,
    )
    return lookup, tables


@needs_fbgemm
@pytest.mark.parametrize("merge", ["preallocated", "legacy"], ids=["preallocated", "legacy"])
def test_fbgemm_vbe_output_chain_matches_reference(merge: Any) -> None:
    """fbgemm TBEs write in place through `vbe_output` (chained) and equal the reference, fwd and two steps."""
    lookup, tables = _fbgemm_lookup(merge)
    assert lookup._writes_in_place(0, torch.device("cuda"))
    ref_tables = {k: v.detach().cpu().clone().requires_grad_(True) for k, v in tables.items()}
    ref_opt = ReferenceOptimizer(list(ref_tables.values()), "rowwise_adagrad", 0.05)
    for step in range(2):
        out = lookup(_features(step, "cuda"))
        ref = reference_pooled(ref_tables, _features(step, "cpu"))
        torch.testing.assert_close(out.values().cpu(), ref.detach(), atol=1e-5, rtol=1e-5)
        grad = torch.randn(ref.shape)
        torch.autograd.backward(out.values(), grad.cuda())
        torch.autograd.backward(ref, grad)
        ref_opt.step()
        for name, w in tables.items():
            torch.testing.assert_close(
                w.detach().cpu(), ref_tables[name].detach(), atol=1e-5, rtol=1e-5, msg=name
            )


@needs_fbgemm
def test_fbgemm_preallocated_forward_has_no_host_sync() -> None:
    """The pre-allocated fbgemm chain (with cached VBE metadata) makes no synchronizing call in the forward.

    The backward through fbgemm TBEs is fbgemm's own code; the benchmark reports its syncs per step.
    """
    lookup, _ = _fbgemm_lookup()
    torch.autograd.backward(lookup(_features(0, "cuda")).values().sum())
    features = _features(1, "cuda")
    with no_host_sync():
        out = lookup(features).values()
    torch.autograd.backward(out, torch.ones_like(out))


def test_always_checked_ids_on_cuda_raise_before_kernels() -> None:
    """`check_indices="always"` reports a bad id on CUDA as an IndexOutOfRangeError (not a device assert)."""
    from vbe_lookup.errors import IndexOutOfRangeError

    kernel = TorchEmbeddingKernel([10, 20], [4, 8], device="cuda")
    lookup = GroupedVBELookup([KernelGroup(kernel, ["a", "b"], [4, 8])], check_indices="always")
    features = VBEFeatures(
        ["a", "b"], torch.tensor([1, 25], device="cuda"), torch.tensor([1, 1], device="cuda"), [[1], [1]]
    )
    with pytest.raises(IndexOutOfRangeError, match="= 25 is out of range for feature `b`"):
        lookup(features)


def _sharded_features(seed: int, batch: int, tables: list[TableConfig]) -> VBEFeatures:
    """A local batch of every table's features (``[[B]] * F`` strides), built on the CPU, on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    keys = [f for t in tables for f in t.feature_names]
    rows = [t.num_embeddings for t in tables for _ in t.feature_names]
    lengths = torch.randint(0, 5, (len(keys) * batch,), generator=gen)
    per_key = lengths.view(len(keys), batch).sum(1).tolist()
    values = torch.cat([torch.randint(0, r, (n,), generator=gen) for r, n in zip(rows, per_key, strict=True)])
    weights = torch.rand(values.numel(), generator=gen)
    return VBEFeatures(keys, values, lengths, [[batch]] * len(keys), weights).to("cuda")


def _sharded_reference(
    state: dict[str, torch.Tensor], tables: list[TableConfig], features: VBEFeatures
) -> torch.Tensor:
    """``[B, sum(dims)]`` pooled output from the unsharded tables (``F.embedding_bag`` per feature)."""
    batch = features.stride_per_key_per_rank()[0][0]
    lengths = features.lengths().view(-1, batch)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths.reshape(-1), 0)])
    weights = features.weights_or_none()
    cols = []
    i = 0
    for t in tables:
        for _ in t.feature_names:
            lo, hi = int(offsets[i * batch]), int(offsets[(i + 1) * batch])
            bag_offsets = offsets[i * batch : (i + 1) * batch + 1] - lo
            out = torch.nn.functional.embedding_bag(
                features.values()[lo:hi],
                state[f"{t.name}.weight"],
                bag_offsets,
                mode="sum",
                per_sample_weights=None if weights is None else weights[lo:hi],
                include_last_offset=True,
            )
            if t.pooling == "mean":
                out = out / lengths[i].clamp(min=1).to(out.dtype)[:, None]
            cols.append(out)
            i += 1
    return torch.cat(cols, dim=1)


def test_sharded_step_has_one_host_sync() -> None:
    """A steady-state sharded step on one GPU (NCCL, world size 1: input dist, lookup, output dist,
    backward) makes exactly one synchronizing CUDA call, the input dist's splits header, and its output
    equals a plain pooled lookup of the unsharded tables."""
    _dist_harness.require_no_process_group()
    port = _dist_harness.free_port()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        tables = [
            TableConfig(name="a", num_embeddings=100, embedding_dim=16, feature_names=("a0", "a1")),
            TableConfig(name="b", num_embeddings=80, embedding_dim=32, feature_names=("b0",), pooling="mean"),
            TableConfig(name="c", num_embeddings=60, embedding_dim=16, feature_names=("c0",)),
        ]
        plan = ShardingPlan(
            world_size=1,
            placements={"a": TableWise(rank=0, group="x"), "b": RowWise(group="y"), "c": RowWise(group="y")},
        )
        module = ShardedEmbeddingBags(tables, plan, device="cuda")
        steps = [_sharded_features(seed, 8, tables) for seed in range(4)]
        for features in steps[:2]:  # warm-up: layouts and key orders are cached
            torch.autograd.backward(module(features).values().sum())
        torch.cuda.synchronize()
        waits = [0]
        event_synchronize = torch.cuda.Event.synchronize

        def counted(event: torch.cuda.Event) -> None:
            waits[0] += 1
            with warnings.catch_warnings(record=True):  # its own report (if the mode makes one) is this wait
                warnings.simplefilter("always")
                event_synchronize(event)

        for features in steps[2:]:
            expected = _sharded_reference(module.state_dict(), tables, features)
            torch.cuda.synchronize()
            waits[0] = 0
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                torch.cuda.Event.synchronize = counted  # type: ignore[method-assign,assignment]  # counting wrapper
                try:
                    out = module(features).values()
                    torch.autograd.backward(out, torch.ones_like(out))
                finally:
                    torch.cuda.Event.synchronize = event_synchronize  # type: ignore[method-assign]
                    torch.cuda.set_sync_debug_mode("default")
            # The sync reports only: not the mode's one-time "prototype feature" notice. On one rank the
            # step's host read is an event wait (issued in start, made in wait), which the prototype mode
            # does not report: both kinds together are the step's one sync.
            syncs = [
                str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)
            ]
            assert len(syncs) + waits[0] == 1, (syncs, waits[0])
            torch.testing.assert_close(out.detach(), expected, atol=1e-5, rtol=1e-5)
    finally:
        dist.destroy_process_group()


@needs_fbgemm
def test_sharded_fbgemm_batch_major_equals_collective_path() -> None:
    """One NCCL rank with fbgemm TBEs (direct op): the lookup called without VBE (each kernel's ``[B, sum(dims)]``
    block, slots not in feature order) equals the full collective path (VBE lookup, NCCL all-to-alls on the
    same 1-rank group), outputs and tables after row-wise Adagrad steps with per-id weights."""
    _dist_harness.require_no_process_group()
    port = _dist_harness.free_port()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        tables = [
            TableConfig(name="a", num_embeddings=100, embedding_dim=16, feature_names=("a0", "a1")),
            TableConfig(name="b", num_embeddings=80, embedding_dim=32, feature_names=("b0",), pooling="mean"),
            TableConfig(name="c", num_embeddings=60, embedding_dim=16, feature_names=("c0",)),
        ]
        # Groups "y" (a, c) then "x" (b): the slots are a0 a1 c0 b0, not the feature order a0 a1 b0 c0.
        plan = ShardingPlan(
            world_size=1,
            placements={
                "a": TableWise(rank=0, group="y"),
                "b": RowWise(group="x"),
                "c": TableWise(rank=0, group="y"),
            },
        )

        def factory(spec: Any) -> Any:
            return _fbgemm.new_tbe(
                list(spec.num_embeddings),
                list(spec.embedding_dims),
                feature_table_map=list(spec.feature_table_map),
                optimizer="rowwise_adagrad",
                learning_rate=0.05,
                device=spec.device,
            )

        fast, full = (
            ShardedEmbeddingBags(tables, plan, kernel_factory=factory, device="cuda") for _ in range(2)
        )
        full.load_state_dict(fast.state_dict())
        full._comm._alone = False
        assert fast.lookup is not None
        assert fast.lookup._plain_calls
        assert fast._output_dist._alone_columns is not None
        for seed in range(3):
            features = _sharded_features(seed, 8, tables)
            outs = [module(features).values() for module in (fast, full)]
            torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
            grad = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(seed)).cuda()
            for out in outs:
                torch.autograd.backward(out, grad)
        for (name, a), (_, b) in zip(fast.state_dict().items(), full.state_dict().items(), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()
