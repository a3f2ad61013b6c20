"""CUDA streams: each stage on its stream, event + record_stream hand-offs, overlap, sparse dist, backward."""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from pipeline_stages import (
    BackwardOverlap,
    PipelineStage,
    SparseDataDistUtil,
    StagedTrainPipeline,
    StageError,
    record_stream_all,
)

pytestmark = pytest.mark.gpu


def cuda_stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]  # unannotated in torch


@dataclass(frozen=True, eq=False)
class Batch:
    index: int
    x: torch.Tensor
    log: list[tuple[int, torch.cuda.Stream]] = field(default_factory=list)

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(index=self.index, x=self.x.to(device, non_blocking=non_blocking), log=self.log)

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.log.append((self.index, stream))
        if self.x.is_cuda:
            self.x.record_stream(stream)


def gpu_sleep(cycles: int) -> None:
    """Spin the current stream for ``cycles`` GPU clock cycles."""
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # unannotated in torch


def sleep_cycles_per_ms() -> float:
    """Calibrate torch.cuda._sleep on this device."""
    gpu_sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # unannotated
    start.record()
    gpu_sleep(10_000_000)
    end.record()
    end.synchronize()
    elapsed_ms: float = start.elapsed_time(end)
    return 10_000_000 / elapsed_ms


def test_each_stage_runs_on_its_stream_and_results_are_correct() -> None:
    """Stages see their own stream as current; the model sees the batch ready on the compute stream."""
    streams = [cuda_stream() for _ in range(3)]
    seen: dict[str, set[int]] = {"copy": set(), "double": set(), "inc": set()}
    device = torch.device("cuda")

    def copy_stage(batch: Batch) -> Batch:
        seen["copy"].add(torch.cuda.current_stream().cuda_stream)
        return batch.to(device, non_blocking=True)

    def double(batch: Batch) -> Batch:
        seen["double"].add(torch.cuda.current_stream().cuda_stream)
        gpu_sleep(200_000)
        return Batch(index=batch.index, x=batch.x * 2, log=batch.log)

    def inc(batch: Batch) -> Batch:
        seen["inc"].add(torch.cuda.current_stream().cuda_stream)
        return Batch(index=batch.index, x=batch.x + 1, log=batch.log)

    pipeline = StagedTrainPipeline(
        [
            PipelineStage("copy", copy_stage, stream=streams[0]),
            PipelineStage("double", double, stream=streams[1]),
            PipelineStage("inc", inc, stream=streams[2]),
        ]
    )
    assert pipeline.compute_stream == torch.cuda.current_stream()
    data = [Batch(index=i, x=torch.full((1024,), float(i)).pin_memory()) for i in range(8)]
    it = iter(data)
    outs = []
    while (batch := pipeline.progress(it)) is not None:
        outs.append((batch.index, batch.x.sum()))  # runs on the compute stream
    torch.cuda.synchronize()
    assert [i for i, _ in outs] == list(range(8))
    for i, total in outs:
        assert total.item() == pytest.approx(1024 * (2 * i + 1))
    assert seen == {
        "copy": {streams[0].cuda_stream},
        "double": {streams[1].cuda_stream},
        "inc": {streams[2].cuda_stream},
    }


def test_record_stream_on_every_consumer_stream() -> None:
    """Each hand-off calls record_stream with the consumer stream: next stages and then the compute stream."""
    streams = [cuda_stream() for _ in range(3)]
    log: list[tuple[int, torch.cuda.Stream]] = []
    device = torch.device("cuda")
    pipeline = StagedTrainPipeline(
        [
            PipelineStage("copy", lambda b: b.to(device, non_blocking=True), stream=streams[0]),
            PipelineStage("a", lambda b: b, stream=streams[1]),
            PipelineStage("b", lambda b: b, stream=streams[2]),
        ]
    )
    it = iter([Batch(index=i, x=torch.ones(4), log=log) for i in range(3)])
    while pipeline.progress(it) is not None:
        pass
    compute = torch.cuda.current_stream()
    for i in range(3):
        assert [s for j, s in log if j == i] == [streams[1], streams[2], compute]


def test_record_stream_all_walks_nested_structures() -> None:
    """Dicts, lists, tuples, dataclasses and Pipelineable objects inside them are all reached."""
    log: list[tuple[int, torch.cuda.Stream]] = []
    inner = Batch(index=7, x=torch.ones(2, device="cuda"), log=log)

    @dataclass
    class Holder:
        a: torch.Tensor
        b: list[Any]

    stream = cuda_stream()
    obj = {
        "h": Holder(a=torch.ones(3, device="cuda"), b=[(torch.zeros(1, device="cuda"), inner)]),
        "cpu": torch.ones(2),
    }
    record_stream_all(obj, stream)
    assert log == [(7, stream)]


def test_steady_state_step_approaches_max_stage_time() -> None:
    """3 stages + model of equal cost overlap: a step takes about max(stage), not the sum."""
    per_ms = sleep_cycles_per_ms()
    cycles = int(2.0 * per_ms)  # 2 ms per stage and for the model
    streams = [cuda_stream() for _ in range(3)]

    def work(batch: torch.Tensor) -> torch.Tensor:
        gpu_sleep(cycles)
        return batch

    pipeline = StagedTrainPipeline(
        [PipelineStage(f"s{i}", work, stream=streams[i]) for i in range(3)], device_timing=True
    )
    steps = 30
    data = [torch.zeros(1, device="cuda") for _ in range(steps + 10)]
    it = iter(data)
    for _ in range(5):  # fill + warm-up
        pipeline.progress(it)
        gpu_sleep(cycles)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        pipeline.progress(it)
        gpu_sleep(cycles)  # the model
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    # the target: within 5% of max(stage) + model (sum would be 8 ms)
    assert step_ms <= 1.05 * (2.0 + 2.0), (
        f"step {step_ms:.2f} ms: stages did not overlap (sum 8 ms, max 2 ms)"
    )
    stats = pipeline.stats()
    assert stats["s0"].device_ms_mean is not None
    assert stats["s0"].device_ms_mean == pytest.approx(2.0, rel=0.3)


def test_stage_error_on_cuda_resets_and_continues() -> None:
    """A failing stage on CUDA raises StageError; the next calls refill and keep working."""
    stream = cuda_stream()
    failed: list[bool] = []

    def flaky(x: torch.Tensor) -> torch.Tensor:
        if not failed:
            failed.append(True)
            raise ValueError("once")
        return x * 3

    pipeline = StagedTrainPipeline(
        [
            PipelineStage("copy", lambda x: x.cuda(non_blocking=True), stream=cuda_stream()),
            PipelineStage("f", flaky, stream=stream),
        ]
    )
    it = iter([torch.full((4,), float(i)) for i in range(6)])
    with pytest.raises(StageError):
        pipeline.progress(it)
    outs = []
    while (x := pipeline.progress(it)) is not None:
        outs.append(x.sum().item())
    assert outs
    assert all(v % 12 == 0 for v in outs)


@dataclass(frozen=True, slots=True, eq=False)
class SparseBatch:
    index: int
    sparse_features: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> SparseBatch:
        return SparseBatch(
            index=self.index, sparse_features=self.sparse_features.to(device, non_blocking=non_blocking)
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.sparse_features.record_stream(stream)


@dataclass(frozen=True, slots=True, eq=False)
class Dist:
    ids: torch.Tensor


class StreamRecordingSparse(nn.Module):
    """Fake two-phase dist on CUDA: ids*10 produced on the data dist stream after a sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: deque[Dist] = deque()
        self.streams: dict[str, set[int]] = {
            "start": set(),
            "wait": set(),
            "prefetch": set(),
            "forward": set(),
        }
        self.plain = 0

    def start_input_dist(self, features: torch.Tensor) -> torch.Tensor:
        self.streams["start"].add(torch.cuda.current_stream().cuda_stream)
        gpu_sleep(100_000)
        return features * 10

    def wait_input_dist(self, handle: torch.Tensor) -> Dist:
        self.streams["wait"].add(torch.cuda.current_stream().cuda_stream)
        return Dist(ids=handle + 0)

    def enqueue_pipelined_input(self, dist_features: Dist) -> None:
        self.queue.append(dist_features)

    def prefetch(self, dist_features: Dist, forward_stream: torch.cuda.Stream | None = None) -> None:
        self.streams["prefetch"].add(torch.cuda.current_stream().cuda_stream)
        assert forward_stream == torch.cuda.default_stream()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        self.streams["forward"].add(torch.cuda.current_stream().cuda_stream)
        if self.queue:
            dist = self.queue.popleft()
        else:
            self.plain += 1
            dist = self.wait_input_dist(self.start_input_dist(features))
        return dist.ids


def _run_three_stages(
    model: torch.nn.Module, sdd: SparseDataDistUtil, copy_stream: torch.cuda.Stream
) -> list[tuple[int, torch.Tensor]]:
    """data_copy -> start_sparse_data_dist -> prefetch over 6 pinned batches of 64 ids; each batch's index
    and the model's output, after a device sync."""
    device = torch.device("cuda")
    pipeline = StagedTrainPipeline(
        [
            PipelineStage("data_copy", lambda b: b.to(device, non_blocking=True), stream=copy_stream),
            PipelineStage(
                "start_sparse_data_dist", sdd.start_sparse_data_dist, stream=sdd.data_dist_stream,
                fill_callback=sdd.wait_sparse_data_dist,
            ),
            PipelineStage("prefetch", sdd.prefetch, stream=sdd.prefetch_stream, fill_callback=sdd.load_prefetch),
        ]
    )  # fmt: skip
    it = iter([SparseBatch(index=i, sparse_features=torch.arange(i, i + 64).pin_memory()) for i in range(6)])
    outs = []
    while (batch := pipeline.progress(it)) is not None:
        outs.append((batch.index, model(batch.sparse_features)))
    torch.cuda.synchronize()
    return outs


def test_sparse_data_dist_util_on_streams() -> None:
    """start/wait on the data dist stream, prefetch on the prefetch stream, forward gets the right ids."""
    model = StreamRecordingSparse()
    dist_stream, prefetch_stream, copy_stream = cuda_stream(), cuda_stream(), cuda_stream()
    sdd = SparseDataDistUtil(model, data_dist_stream=dist_stream, prefetch_stream=prefetch_stream)
    outs = _run_three_stages(model, sdd, copy_stream)
    for i, ids in outs:
        torch.testing.assert_close(ids.cpu(), torch.arange(i, i + 64) * 10)
    assert model.plain == 0
    assert model.streams["start"] == {dist_stream.cuda_stream}
    assert model.streams["wait"] == {dist_stream.cuda_stream}
    assert model.streams["prefetch"] == {prefetch_stream.cuda_stream}
    assert model.streams["forward"] == {torch.cuda.default_stream().cuda_stream}


class SlowPrefetchSparse(nn.Module):
    """Fake dist + a slow prefetch on its stream that writes the rows the forward reads (a KV cache)."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.queue: deque[Dist] = deque()
        self.cache: dict[int, torch.Tensor] = {}
        self.log = log

    def start_input_dist(self, features: torch.Tensor) -> torch.Tensor:
        gpu_sleep(100_000)
        return features * 10

    def wait_input_dist(self, handle: torch.Tensor) -> Dist:
        return Dist(ids=handle + 0)

    def enqueue_pipelined_input(self, dist_features: Dist) -> None:
        self.queue.append(dist_features)

    def prefetch(self, dist_features: Dist, forward_stream: torch.cuda.Stream | None = None) -> None:
        self.log.append(("prefetch", id(dist_features)))
        gpu_sleep(2_000_000)  # the forward must wait for this (prefetch stream event)
        self.cache[id(dist_features)] = dist_features.ids + 1

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        dist = self.queue.popleft()
        self.log.append(("forward", id(dist)))
        cached = self.cache.pop(id(dist))
        cached.record_stream(torch.cuda.current_stream())
        return cached * 2


@pytest.mark.parametrize("after", [True, False], ids=["wait-after-forward", "in-progress"])
def test_deferred_prefetch_is_stream_ordered_before_its_forward(after: bool) -> None:
    """With the wait and prefetch of batch i+1 run after forward i, forward i+1 still reads the rows the
    (slow) prefetch wrote on its stream; with the option the prefetch of i+1 is called after forward i."""
    log: list[tuple[str, int]] = []
    model = SlowPrefetchSparse(log)
    dist_stream, prefetch_stream, copy_stream = cuda_stream(), cuda_stream(), cuda_stream()
    sdd = SparseDataDistUtil(
        model, data_dist_stream=dist_stream, prefetch_stream=prefetch_stream, wait_after_forward=after
    )
    outs = _run_three_stages(model, sdd, copy_stream)
    for i, out in outs:
        torch.testing.assert_close(out.cpu(), (torch.arange(i, i + 64) * 10 + 1) * 2)
    kinds = [kind for kind, _ in log]
    if after:  # fill: prefetch 0; then each forward i is followed by the prefetch of i+1
        assert kinds == ["prefetch", *["forward", "prefetch"] * 5, "forward"]
    else:  # torchrec's placement: prefetch of i+1 inside progress(), before forward i
        assert kinds == ["prefetch", "prefetch", *["forward", "prefetch"] * 4, "forward", "forward"]


def test_backward_overlap_runs_embedding_backward_on_module_stream() -> None:
    """The embedding backward runs on the module's own stream; gradients equal plain autograd."""
    backward_streams: list[int] = []

    class Tap(torch.autograd.Function):
        @staticmethod
        def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
            backward_streams.append(torch.cuda.current_stream().cuda_stream)
            return grad

    torch.manual_seed(0)
    emb = nn.EmbeddingBag(50, 8, mode="sum").cuda()
    dense = nn.Linear(8, 1).cuda()
    emb_ref, dense_ref = copy.deepcopy(emb), copy.deepcopy(dense)
    ids = torch.randint(0, 50, (16, 3), device="cuda")

    tap = Tap.apply
    loss_ref = dense_ref(emb_ref(ids)).pow(2).sum()
    loss_ref.backward()

    overlap = BackwardOverlap()
    pooled = overlap.run("emb", lambda x: tap(emb(x)), ids)  # type: ignore[no-untyped-call]  # Function.apply
    overlap.backward(dense(pooled).pow(2).sum())
    overlap.wait()
    torch.cuda.synchronize()
    assert backward_streams == [overlap.streams["emb"].cuda_stream]
    assert emb.weight.grad is not None
    assert emb_ref.weight.grad is not None
    torch.testing.assert_close(emb.weight.grad, emb_ref.weight.grad)
    assert dense.weight.grad is not None
    assert dense_ref.weight.grad is not None
    torch.testing.assert_close(dense.weight.grad, dense_ref.weight.grad)


def test_none_from_a_stage_and_iterator_errors_on_streams() -> None:
    """On CUDA streams too: None from a runnable is a StageError naming the stage; an iterator error undoes
    the step (every batch comes out once, in order, with its values)."""
    device = torch.device("cuda")
    copy_stream, work_stream = cuda_stream(), cuda_stream()
    bad = StagedTrainPipeline(
        [
            PipelineStage("data_copy", lambda b: b.to(device, non_blocking=True), stream=copy_stream),
            PipelineStage("postproc", lambda b: None, stream=work_stream),
        ]
    )
    with pytest.raises(StageError, match=r"stage `postproc` \(stage 1 of 2\) returned None for batch 0"):
        bad.progress(iter([Batch(index=0, x=torch.ones(4).pin_memory())]))

    failed = False

    def data() -> Any:
        nonlocal failed
        for i in range(6):
            if i == 3 and not failed:
                failed = True
                raise ValueError("corrupt record")
            yield Batch(index=i, x=torch.full((4,), float(i)).pin_memory())

    pipeline = StagedTrainPipeline(
        [
            PipelineStage("data_copy", lambda b: b.to(device, non_blocking=True), stream=copy_stream),
            PipelineStage("double", lambda b: Batch(index=b.index, x=b.x * 2, log=b.log), stream=work_stream),
        ]
    )
    it = data()
    first = pipeline.progress(it)  # the fill pulled batches 0 and 1, this call batch 2
    got = [(first.index, first.x)]
    with pytest.raises(ValueError, match="corrupt record"):
        pipeline.progress(it)  # pulling batch 3 raises
    while (batch := pipeline.progress(it)) is not None:  # the generator died: the pulled batches drain
        got.append((batch.index, batch.x))
    torch.cuda.synchronize()
    assert [i for i, _ in got] == [0, 1, 2]
    for i, x in got:
        torch.testing.assert_close(x.cpu(), torch.full((4,), 2.0 * i))
