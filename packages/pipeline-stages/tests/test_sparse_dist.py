"""SparseDataDistUtil in one process: contexts advance in lockstep with the batches (CPU, inline)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipeline_stages import (
    NoSparseModulesError,
    PipelineStage,
    Prefetchable,
    SparseDataDistUtil,
    SparseDistModule,
    SparseFeaturesError,
    StagedTrainPipeline,
)


@dataclass(frozen=True, slots=True, eq=False)
class Batch:
    index: int
    dense: torch.Tensor
    sparse_features: torch.Tensor  # [L] int64 ids; ids[0] is the batch index

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            index=self.index,
            dense=self.dense.to(device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.dense.record_stream(stream)
        self.sparse_features.record_stream(stream)


@dataclass(frozen=True, slots=True, eq=False)
class Dist:
    batch: int
    ids: torch.Tensor


class FakeSparse(nn.Module):
    """Two-phase input dist without communication; records every call and checks what forward receives."""

    def __init__(self, log: list[tuple[str, int]], tag: str = "") -> None:
        super().__init__()
        self.log = log
        self.tag = tag
        self.queue: deque[Dist] = deque()

    def start_input_dist(self, features: torch.Tensor) -> tuple[int, torch.Tensor]:
        self.log.append((self.tag + "start", int(features[0])))
        return int(features[0]), features * 10

    def wait_input_dist(self, handle: tuple[int, torch.Tensor]) -> Dist:
        self.log.append((self.tag + "wait", handle[0]))
        return Dist(batch=handle[0], ids=handle[1])

    def enqueue_pipelined_input(self, dist_features: Dist) -> None:
        self.queue.append(dist_features)

    def prefetch(self, dist_features: Dist, forward_stream: torch.cuda.Stream | None = None) -> None:
        self.log.append((self.tag + "prefetch", dist_features.batch))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.queue:
            dist = self.queue.popleft()
            self.log.append((self.tag + "forward_pipelined", dist.batch))
        else:
            dist = self.wait_input_dist(self.start_input_dist(features))
            self.log.append((self.tag + "forward_plain", dist.batch))
        assert dist.batch == int(features[0]), (
            f"forward of batch {int(features[0])} got input of batch {dist.batch}"
        )
        total: torch.Tensor = dist.ids.float().sum()
        return total


class Model(nn.Module):
    def __init__(self, log: list[tuple[str, int]]) -> None:
        super().__init__()
        self.sparse = FakeSparse(log)
        self.dense = nn.Linear(2, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        out: torch.Tensor = self.dense(batch.dense).sum() + self.sparse(batch.sparse_features)
        return out


def make_batches(n: int) -> list[Batch]:
    return [Batch(index=i, dense=torch.ones(3, 2), sparse_features=torch.tensor([i, 7, 9])) for i in range(n)]


def stages_for(layout: str, sdd: SparseDataDistUtil) -> list[PipelineStage]:
    copy = PipelineStage("data_copy", lambda b: b.to(torch.device("cpu")))
    start = PipelineStage(
        "start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sparse_data_dist
    )
    prefetch = PipelineStage("prefetch", sdd.prefetch, fill_callback=sdd.load_prefetch)
    postproc = PipelineStage("postproc", lambda b: b)
    return {
        "copy-sdd": [copy, start],
        "copy-sdd-prefetch": [copy, start, prefetch],
        "copy-sdd-postproc-prefetch": [copy, start, postproc, prefetch],
        "sdd-only": [start],
    }[layout]


LAYOUTS = ["copy-sdd", "copy-sdd-prefetch", "copy-sdd-postproc-prefetch", "sdd-only"]


@settings(max_examples=30, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS), total=st.integers(0, 7), flush_at=st.one_of(st.none(), st.integers(0, 6))
)
def test_each_forward_uses_its_own_batch_dist(layout: str, total: int, flush_at: int | None) -> None:
    """Every forward pops the dist features of the batch it runs on; no forward distributes by itself."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages_for(layout, sdd))
    batches = make_batches(total)
    it = iter(batches)
    seen = []
    step = 0
    while (batch := pipeline.progress(it)) is not None:
        model(batch)
        seen.append(batch.index)
        if step == flush_at:
            pipeline.set_flush(True)
        step += 1
    assert seen == list(range(total))
    forwards = [entry for entry in log if entry[0].startswith("forward")]
    assert forwards == [("forward_pipelined", i) for i in range(total)]
    assert [i for kind, i in log if kind == "start"] == list(range(total))
    assert [i for kind, i in log if kind == "wait"] == list(range(total))
    if "prefetch" in layout:
        assert [i for kind, i in log if kind == "prefetch"] == list(range(total))
        for i in range(total):
            assert log.index(("prefetch", i)) < log.index(("forward_pipelined", i))
    for i in range(total):
        assert log.index(("wait", i)) < log.index(("forward_pipelined", i))
    assert sdd.num_in_flight == 0


def test_wait_of_next_batch_runs_after_the_forward() -> None:
    """As torchrec (wait_after_forward=False): the prefetch stage waits and prefetches batch i+1 before
    forward i; the batch after that is waited after the current forward (hidden behind it)."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model, wait_after_forward=False)
    pipeline = StagedTrainPipeline(stages_for("copy-sdd-prefetch", sdd))
    it = iter(make_batches(5))
    batch = pipeline.progress(it)
    assert batch is not None
    assert log == [
        ("start", 0),
        ("wait", 0),
        ("prefetch", 0),
        ("start", 1),
        ("wait", 1),
        ("start", 2),
        ("prefetch", 1),
    ]
    log.clear()
    model(batch)
    assert log == [("forward_pipelined", 0), ("wait", 2)]


def test_detach_restores_plain_forward_and_reattach_continues() -> None:
    """After detach() forwards distribute by themselves; the next start re-attaches, lockstep intact."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages_for("copy-sdd-prefetch", sdd))
    batches = make_batches(6)
    it = iter(batches)
    first = pipeline.progress(it)
    assert first is not None
    model(first)
    assert sdd.detach() is model
    assert not sdd.attached
    log.clear()
    model(make_batches(9)[8])  # an eval forward on another batch: plain
    assert log == [("start", 8), ("wait", 8), ("forward_plain", 8)]
    seen = [first.index]
    while (batch := pipeline.progress(it)) is not None:  # progress re-attaches through the start stage
        model(batch)
        seen.append(batch.index)
    assert seen == list(range(6))
    assert sdd.attached


def test_stale_contexts_are_dropped_after_a_pipeline_error() -> None:
    """A stage error drops in-flight batches; the util drops their contexts at the next matching forward."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    failed = False

    def flaky(batch: Batch) -> Batch:
        nonlocal failed
        if batch.index == 2 and not failed:
            failed = True
            raise RuntimeError("transient")
        return batch

    stages = [*stages_for("copy-sdd-prefetch", sdd)]
    stages.insert(2, PipelineStage("flaky", flaky))
    pipeline = StagedTrainPipeline(stages)
    it = iter(make_batches(10))
    seen = []
    while True:
        try:
            batch = pipeline.progress(it)
        except RuntimeError:
            continue
        if batch is None:
            break
        model(batch)
        seen.append(batch.index)
    assert seen[-1] == 9
    assert seen == sorted(seen)
    assert all(kind != "forward_plain" for kind, _ in log)
    assert sdd.num_in_flight == 0


def test_per_module_features_mapping() -> None:
    """sparse_features may return {module name: features} to feed each module its own input."""
    log: list[tuple[str, int]] = []

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = FakeSparse(log, "a.")
            self.b = FakeSparse(log, "b.")

        def forward(self, batch: Batch) -> torch.Tensor:
            out: torch.Tensor = self.a(batch.sparse_features) + self.b(batch.sparse_features + 100)
            return out

    model = Two()
    sdd = SparseDataDistUtil(
        model, sparse_features=lambda b: {"a": b.sparse_features, "b": b.sparse_features + 100}
    )
    assert sorted(sdd.modules) == ["a", "b"]
    pipeline = StagedTrainPipeline(stages_for("copy-sdd-prefetch", sdd))
    it = iter(make_batches(4))
    while (batch := pipeline.progress(it)) is not None:
        model(batch)
    assert [i for kind, i in log if kind == "a.forward_pipelined"] == [0, 1, 2, 3]
    assert [i for kind, i in log if kind == "b.forward_pipelined"] == [100, 101, 102, 103]


def test_outermost_modules_only_and_protocols() -> None:
    """Nested sparse modules inside a sparse module are not driven twice; the fake fits the Protocols."""
    log: list[tuple[str, int]] = []
    outer = FakeSparse(log)
    outer.inner = FakeSparse(log)
    model = nn.Sequential(outer)
    sdd = SparseDataDistUtil(model)
    assert list(sdd.modules) == ["0"]
    assert isinstance(outer, SparseDistModule)
    assert isinstance(outer, Prefetchable)


def test_errors_for_models_without_sparse_modules_and_batches_without_features() -> None:
    """Clear errors: no sparse module; a batch without `sparse_features`."""
    with pytest.raises(NoSparseModulesError, match="SparseDistModule"):
        SparseDataDistUtil(nn.Linear(2, 2))
    sdd = SparseDataDistUtil(Model([]))
    with pytest.raises(SparseFeaturesError, match="`sparse_features`"):
        sdd.start_sparse_data_dist(object())
    with pytest.raises(AttributeError):
        sdd.start_sparse_data_dist(3)


def test_reset_drops_contexts_after_waiting() -> None:
    """reset() finishes started dists and forgets every context."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    for batch in make_batches(3):
        sdd.start_sparse_data_dist(batch)
    sdd.reset()
    assert [kind for kind, _ in log] == ["start"] * 3 + ["wait"] * 3
    assert sdd.num_in_flight == 0
    log.clear()
    model(make_batches(1)[0])
    assert log == [("start", 0), ("wait", 0), ("forward_plain", 0)]


def test_torchrec_stage_layout_names_work() -> None:
    """torchrec's callback names (wait_sdd_fill_callback, data_exhausted_callback) drive the same lockstep."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(
        [
            PipelineStage("data_copy", lambda b: b),
            PipelineStage(
                "start_sparse_data_dist",
                sdd.start_sparse_data_dist,
                fill_callback=sdd.wait_sdd_fill_callback,
                data_exhausted_callback=sdd.data_exhausted_callback,
            ),
            PipelineStage("prefetch", sdd.prefetch, fill_callback=sdd.load_prefetch),
        ]
    )
    it = iter(make_batches(5))
    while (batch := pipeline.progress(it)) is not None:
        model(batch)
    assert [i for kind, i in log if kind == "forward_pipelined"] == [0, 1, 2, 3, 4]


def renew(batch: Batch) -> Batch:
    """A stage that returns a new batch object with new tensors (identity matching cannot find it)."""
    return Batch(index=batch.index, dense=batch.dense.clone(), sparse_features=batch.sparse_features.clone())


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_contexts_stay_matched_after_an_error_when_a_stage_returns_a_new_object(prefetch: bool) -> None:
    """After a stage error and the documented recovery (catch, call progress() again), every forward still
    gets its own batch's dist features although a stage after the dist returns a new object."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    failures = {4, 11}

    def flaky(batch: Batch) -> Batch:
        if batch.index in failures:
            failures.discard(batch.index)
            raise RuntimeError("transient")
        return batch

    stages = [
        PipelineStage("data_copy", lambda b: b.to(torch.device("cpu"))),
        PipelineStage(
            "start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sparse_data_dist
        ),
        PipelineStage("renew", renew),
        PipelineStage("flaky", flaky),
    ]
    if prefetch:
        stages.append(PipelineStage("prefetch", sdd.prefetch, fill_callback=sdd.load_prefetch))
    pipeline = StagedTrainPipeline(stages)
    it = iter(make_batches(16))
    seen = []
    in_flight_after_errors = []
    while True:
        try:
            batch = pipeline.progress(it)
        except RuntimeError:
            in_flight_after_errors.append(sdd.num_in_flight)
            continue
        if batch is None:
            break
        model(batch)  # FakeSparse asserts that the dist features are this batch's
        seen.append(batch.index)
    assert seen[-1] == 15
    assert seen == sorted(seen)
    assert [i for kind, i in log if kind.startswith("forward")] == seen
    assert all(kind != "forward_plain" for kind, _ in log)
    if prefetch:
        prefetched = [i for kind, i in log if kind == "prefetch"]
        for i in seen:
            assert i in prefetched
            assert log.index(("prefetch", i)) < log.index(("forward_pipelined", i))
    assert in_flight_after_errors == [0, 0]  # the dropped batches' contexts went with them
    assert sdd.num_in_flight == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS)
def test_an_eval_forward_mid_epoch_runs_plain_and_keeps_the_pipeline_aligned(layout: str) -> None:
    """A model forward on another batch between pipelined forwards distributes by itself and consumes no
    pipelined context: every training forward still gets its own batch's features."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages_for(layout, sdd))
    it = iter(make_batches(8))
    eval_batch = Batch(index=99, dense=torch.ones(3, 2), sparse_features=torch.tensor([99, 7, 9]))
    seen = []
    while (batch := pipeline.progress(it)) is not None:
        model(batch)
        seen.append(batch.index)
        if batch.index in (2, 5):
            with torch.no_grad():
                model(eval_batch)
    assert seen == list(range(8))
    forwards = [entry for entry in log if entry[0].startswith("forward")]
    expected = [("forward_pipelined", i) for i in range(8)]
    expected.insert(6, ("forward_plain", 99))
    expected.insert(3, ("forward_plain", 99))
    assert forwards == expected
    assert sdd.num_in_flight == 0


def test_a_second_forward_of_the_same_batch_runs_plain() -> None:
    """Forwarding a returned batch twice (e.g. a metrics pass) runs the second one plain, still aligned."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages_for("copy-sdd-prefetch", sdd))
    it = iter(make_batches(5))
    while (batch := pipeline.progress(it)) is not None:
        model(batch)
        model(batch)
    forwards = [entry for entry in log if entry[0].startswith("forward")]
    assert forwards == [entry for i in range(5) for entry in (("forward_pipelined", i), ("forward_plain", i))]


def test_a_skipped_forward_drops_its_context_at_the_next_forward() -> None:
    """A returned batch that is never forwarded does not shift later forwards onto its features."""
    log: list[tuple[str, int]] = []
    model = Model(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages_for("copy-sdd-postproc-prefetch", sdd))
    it = iter(make_batches(6))
    seen = []
    while (batch := pipeline.progress(it)) is not None:
        if batch.index == 2:
            continue  # e.g. a bad batch the training loop skips
        model(renew(batch))
        seen.append(batch.index)
    assert seen == [0, 1, 3, 4, 5]
    assert [i for kind, i in log if kind == "forward_pipelined"] == seen
    assert sdd.num_in_flight == 0
