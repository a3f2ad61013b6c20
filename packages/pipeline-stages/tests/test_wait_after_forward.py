"""SparseDataDistUtil(wait_after_forward=True): batch i+1's wait and prefetch run after forward i is launched.

CPU, inline: the order of the calls is what is checked (on CUDA the same order puts the host waits behind the
queued forward). A small real module with a per-batch row cache stands in for a key-value table: its forward
only finds the rows that a prefetch put there for that very batch.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from pipeline_stages import (
    OutputDistOverlap,
    PipelineStage,
    Prefetchable,
    SparseDataDistUtil,
    StagedTrainPipeline,
)

Log = list[tuple[str, int]]


@dataclass(frozen=True, slots=True, eq=False)
class Batch:
    index: int
    dense: torch.Tensor  # [B, 4]
    ids: torch.Tensor  # [B] int64 row ids of the one sparse feature
    label: torch.Tensor  # [B]

    @property
    def sparse_features(self) -> torch.Tensor:
        return self.ids

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            index=self.index,
            dense=self.dense.to(device, non_blocking=non_blocking),
            ids=self.ids.to(device, non_blocking=non_blocking),
            label=self.label.to(device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for tensor in (self.dense, self.ids, self.label):
            tensor.record_stream(stream)


@dataclass(frozen=True, slots=True, eq=False)
class DistIds:
    token: int  # which start produced it (one per batch)
    ids: torch.Tensor


class CachedBag(nn.Module):
    """A pooled embedding table whose forward reads only rows prefetched for its batch (a KV table's cache).

    ``prefetch`` copies the batch's rows into a per-batch cache slot; ``forward`` takes that slot (an error if
    there is none: the prefetch did not run before it) and pools the cached rows, with the gradient going to
    ``weight`` through them. Without pipelined input the forward distributes and prefetches by itself.
    """

    def __init__(
        self,
        log: Log,
        rows: int = 16,
        dim: int = 4,
        fail_prefetch_of: set[int] | None = None,
        require_prefetch: bool = True,
    ) -> None:
        super().__init__()
        self.require_prefetch = require_prefetch
        self.weight = nn.Parameter(torch.randn(rows, dim, generator=torch.Generator().manual_seed(0)))
        self.log = log
        self.queue: deque[DistIds] = deque()
        self.cache: dict[int, torch.Tensor] = {}
        self.fail_prefetch_of = set() if fail_prefetch_of is None else fail_prefetch_of
        self._tokens = 0

    def start_input_dist(self, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        self._tokens += 1
        self.log.append(("start", self._tokens))
        return self._tokens, ids.clone()

    def wait_input_dist(self, handle: tuple[int, torch.Tensor]) -> DistIds:
        self.log.append(("wait", handle[0]))
        return DistIds(token=handle[0], ids=handle[1])

    def enqueue_pipelined_input(self, dist_features: DistIds) -> None:
        self.queue.append(dist_features)

    def prefetch(self, dist_features: DistIds, forward_stream: torch.cuda.Stream | None = None) -> None:
        if dist_features.token in self.fail_prefetch_of:
            self.fail_prefetch_of.discard(dist_features.token)
            raise ConnectionError(f"store unavailable for batch {dist_features.token}")
        self.log.append(("prefetch", dist_features.token))
        self.cache[dist_features.token] = dist_features.ids.clone()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.queue:
            dist = self.queue.popleft()
        else:
            dist = self.wait_input_dist(self.start_input_dist(ids))
            if self.require_prefetch:
                self.prefetch(dist)
        self.log.append(("forward", dist.token))
        cached = self.cache.pop(dist.token, None) if self.require_prefetch else dist.ids
        if cached is None:
            raise LookupError(f"forward of batch {dist.token} before its prefetch")
        assert torch.equal(cached, ids), "the forward got another batch's rows"
        return self.weight[cached]  # [B, dim]


class OverlappingBag(CachedBag):
    """A ``CachedBag`` whose forward ends in a host-blocking "output collective" and implements
    ``OutputDistOverlap``: the registered callback runs between its launch and its wait (logged)."""

    def __init__(self, log: Log, **table: Any) -> None:
        super().__init__(log, **table)
        self.overlap: Callable[[], None] | None = None

    def set_output_dist_overlap(self, callback: Callable[[], None] | None) -> None:
        self.overlap = callback

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pooled = super().forward(ids)
        token = self.log[-1][1]  # the batch whose forward ran (logged by CachedBag.forward)
        self.log.append(("launch", token))
        try:
            if self.overlap is not None:
                self.overlap()
        finally:
            self.log.append(("waited", token))
        return pooled


class Tiny(nn.Module):
    """Embedding + dense, trained with a BCE loss; ``loss()`` is a method that runs no model hooks."""

    def __init__(self, log: Log, overlapping: bool = False, **table: Any) -> None:
        super().__init__()
        self.table = OverlappingBag(log, **table) if overlapping else CachedBag(log, **table)
        self.dense = nn.Linear(4, 4)
        self.head = nn.Linear(8, 1)
        self.log = log

    def loss(self, batch: Batch) -> torch.Tensor:
        pooled = self.table(batch.ids)
        self.log.append(("head", batch.index))
        logits = self.head(torch.cat([pooled, self.dense(batch.dense)], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.label)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.loss(batch)


def make_batches(n: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(1)
    return [
        Batch(
            index=i,
            dense=torch.randn(3, 4, generator=gen),
            ids=torch.randint(0, 16, (3,), generator=gen),
            label=torch.randint(0, 2, (3,), generator=gen).float(),
        )
        for i in range(n)
    ]


def stages(sdd: SparseDataDistUtil, *, prefetch: bool = True) -> list[PipelineStage]:
    result = [
        PipelineStage("data_copy", lambda b: b.to(torch.device("cpu"))),
        PipelineStage(
            "start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sparse_data_dist
        ),
    ]
    if prefetch:
        result.append(PipelineStage("prefetch", sdd.prefetch, fill_callback=sdd.load_prefetch))
    return result


def forward(model: Tiny, batch: Batch, call: str) -> torch.Tensor:
    return model(batch) if call == "call" else model.loss(batch)


CALLS = ["call", "method"]


def test_the_option_defaults_on_and_is_checked() -> None:
    """wait_after_forward is on by default; a non-bool is a clear error."""
    model = Tiny([])
    assert SparseDataDistUtil(model).wait_after_forward is True
    assert isinstance(model.table, Prefetchable)
    with pytest.raises(TypeError, match="`wait_after_forward` must be a bool, got 1"):
        SparseDataDistUtil(model, wait_after_forward=1)  # type: ignore[arg-type]  # wrong on purpose


@pytest.mark.parametrize("call", CALLS, ids=CALLS)
def test_next_batch_is_waited_and_prefetched_after_the_forward_is_launched(call: str) -> None:
    """progress() returning batch i runs no wait or prefetch of batch i+1: they run after forward i (after
    the whole model forward through __call__, right after the sparse module's forward through a method)."""
    log: Log = []
    model = Tiny(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages(sdd))
    it = iter(make_batches(5))
    batch = pipeline.progress(it)
    # The fill: batch 0 (token 1) is waited and prefetched at once (no forward comes before its own).
    assert log == [("start", 1), ("wait", 1), ("prefetch", 1), ("start", 2), ("wait", 2), ("start", 3)]
    steps = []
    while batch is not None:
        log.clear()
        forward(model, batch, call)
        forward_log = list(log)
        log.clear()
        batch = pipeline.progress(it)
        steps.append((forward_log, list(log)))

    def expected(i: int, prepare: list[tuple[str, int]]) -> list[tuple[str, int]]:
        head = [("head", i)]  # the rest of the model forward (dense part) of batch i, token i + 1
        return [("forward", i + 1), *(head + prepare if call == "call" else prepare + head)]

    assert steps == [
        (expected(0, [("prefetch", 2)]), [("start", 4)]),  # batch 1's dist was waited in the fill
        (expected(1, [("wait", 3), ("prefetch", 3)]), [("start", 5)]),
        (expected(2, [("wait", 4), ("prefetch", 4)]), []),
        (expected(3, [("wait", 5), ("prefetch", 5)]), []),
        (expected(4, []), []),
    ]
    assert sdd.num_in_flight == 0


def test_without_a_prefetch_stage_the_next_dist_is_waited_after_the_forward() -> None:
    """copy → start_sparse_data_dist only: after forward i, batch i+1's dist is waited (right after the
    sparse module's forward when the loop calls a model method, which runs no model hooks)."""
    log: Log = []
    model = Tiny(log, require_prefetch=False)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages(sdd, prefetch=False))
    it = iter(make_batches(4))
    forwards = []
    while (batch := pipeline.progress(it)) is not None:
        log.clear()
        model.loss(batch)
        forwards.append(list(log))
    t = [i + 1 for i in range(4)]
    assert forwards == [
        [("forward", t[0]), ("wait", t[1]), ("head", 0)],
        [("forward", t[1]), ("wait", t[2]), ("head", 1)],
        [("forward", t[2]), ("wait", t[3]), ("head", 2)],
        [("forward", t[3]), ("head", 3)],
    ]
    assert sdd.num_in_flight == 0


def _train(
    mode: str, call: str, steps: int = 9, overlapping: bool = False
) -> tuple[dict[str, torch.Tensor], list[float], Log]:
    log: Log = []
    torch.manual_seed(0)
    model = Tiny(log, overlapping=overlapping)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = iter(make_batches(steps))
    losses = []
    pipeline = None
    if mode != "plain":
        sdd = SparseDataDistUtil(model, wait_after_forward=mode == "pipelined-after-forward")
        pipeline = StagedTrainPipeline(stages(sdd))
    while (batch := next(batches, None) if pipeline is None else pipeline.progress(batches)) is not None:
        optimizer.zero_grad()
        loss = forward(model, batch, call)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        optimizer.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, log


MODES = ["pipelined-after-forward", "pipelined-in-progress"]


@pytest.mark.parametrize("call", CALLS, ids=CALLS)
@pytest.mark.parametrize("mode", MODES, ids=MODES)
def test_pipelined_training_gives_the_plain_loops_weights(mode: str, call: str) -> None:
    """Every forward finds its own batch's prefetched rows, and the weights and losses equal the plain loop's."""
    state, losses, log = _train(mode, call)
    plain_state, plain_losses, _ = _train("plain", call)
    assert losses == plain_losses
    assert state.keys() == plain_state.keys()
    for key in state:
        assert torch.equal(state[key], plain_state[key]), key
    tokens = [t for kind, t in log if kind == "forward"]
    assert tokens == list(range(1, 10))
    for t in tokens:
        assert log.count(("prefetch", t)) == 1
        assert log.index(("prefetch", t)) < log.index(("forward", t))
        assert log.index(("wait", t)) < log.index(("prefetch", t))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python >= 3.11")
@pytest.mark.parametrize("call", CALLS, ids=CALLS)
def test_a_deferred_prefetch_error_surfaces_and_the_batch_retries_it(call: str) -> None:
    """A prefetch that fails after forward i comes out of that forward with a note naming the batch; the
    loop goes on, and batch i+1's own forward retries the prefetch before it runs."""
    log: Log = []
    model = Tiny(log, fail_prefetch_of={3})  # token 3 is batch 2, prefetched after batch 1's forward
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages(sdd))
    it = iter(make_batches(6))
    errors = []
    seen = []
    while (batch := pipeline.progress(it)) is not None:
        try:
            forward(model, batch, call)
        except ConnectionError as caught:
            errors.append((batch.index, caught))
        seen.append(batch.index)
    assert seen == list(range(6))
    [(index, error)] = errors
    assert index == 1
    assert "store unavailable for batch 3" in str(error)
    assert any("wait/prefetch of batch 2" in note for note in getattr(error, "__notes__", []))
    assert [t for kind, t in log if kind == "forward"] == [1, 2, 3, 4, 5, 6]
    assert log.index(("prefetch", 3)) < log.index(("forward", 3))
    assert sdd.num_in_flight == 0


@pytest.mark.parametrize("call", CALLS, ids=CALLS)
def test_a_skipped_batch_does_not_block_the_next_prefetch(call: str) -> None:
    """A returned batch the loop never forwards: the next batch's deferred prefetch runs in its own forward's
    pre-hook, and the skipped batch's context is dropped (also without model hooks)."""
    log: Log = []
    model = Tiny(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages(sdd))
    it = iter(make_batches(6))
    seen = []
    while (batch := pipeline.progress(it)) is not None:
        if batch.index == 2:
            continue
        forward(model, batch, call)
        seen.append(batch.index)
    assert seen == [0, 1, 3, 4, 5]
    assert [t for kind, t in log if kind == "forward"] == [1, 2, 4, 5, 6]
    assert log.index(("prefetch", 4)) < log.index(("forward", 4))
    assert sdd.num_in_flight == 0


def test_an_eval_forward_between_steps_runs_plain_and_changes_nothing() -> None:
    """An eval forward (no batch handed out for it) distributes and prefetches by itself; training forwards
    still get their own batch's prefetched rows, and the deferred work is not run twice."""
    log: Log = []
    model = Tiny(log)
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages(sdd))
    it = iter(make_batches(5))
    eval_batch = make_batches(7)[6]
    while (batch := pipeline.progress(it)) is not None:
        model(batch)
        with torch.no_grad():
            model(eval_batch)
    pipelined = {t for kind, t in log if kind == "forward"}
    assert len(pipelined) == 10
    assert all(log.count(("prefetch", t)) == 1 for t in pipelined)
    assert sdd.num_in_flight == 0


# ---------------------------------------------------------------- OutputDistOverlap modules


@pytest.mark.parametrize("call", CALLS, ids=CALLS)
def test_the_next_batch_is_prepared_while_the_output_collective_is_in_flight(call: str) -> None:
    """A module implementing OutputDistOverlap: batch i+1's wait and prefetch run inside forward i's output
    collective window (between its launch and its wait), not after the forward; weights equal the plain loop's.
    """
    log: Log = []
    model = Tiny(log, overlapping=True)
    assert isinstance(model.table, OutputDistOverlap)
    sdd = SparseDataDistUtil(model)
    assert model.table.overlap is not None
    pipeline = StagedTrainPipeline(stages(sdd))
    it = iter(make_batches(5))
    steps = []
    while (batch := pipeline.progress(it)) is not None:
        log.clear()
        forward(model, batch, call)
        steps.append(list(log))

    def window(i: int, prepare: list[tuple[str, int]]) -> list[tuple[str, int]]:
        t = i + 1
        return [("forward", t), ("launch", t), *prepare, ("waited", t), ("head", i)]

    assert steps == [
        window(0, [("prefetch", 2)]),
        window(1, [("wait", 3), ("prefetch", 3)]),
        window(2, [("wait", 4), ("prefetch", 4)]),
        window(3, [("wait", 5), ("prefetch", 5)]),
        window(4, []),
    ]
    assert sdd.num_in_flight == 0

    state, losses, _ = _train("pipelined-after-forward", call, overlapping=True)
    plain_state, plain_losses, _ = _train("plain", call, overlapping=True)
    assert losses == plain_losses
    for key in state:
        assert torch.equal(state[key], plain_state[key]), key


@pytest.mark.parametrize("call", CALLS, ids=CALLS)
def test_an_error_of_the_overlapped_prefetch_surfaces_after_the_collective(call: str) -> None:
    """The callback never raises into the module's collective: the prefetch error comes out of the forward
    once the collective was waited for, with the note naming the batch; the batch's own forward retries it."""
    log: Log = []
    model = Tiny(log, overlapping=True, fail_prefetch_of={3})
    sdd = SparseDataDistUtil(model)
    pipeline = StagedTrainPipeline(stages(sdd))
    it = iter(make_batches(6))
    errors = []

    def step(batch: Batch) -> None:
        try:
            forward(model, batch, call)
        except ConnectionError as caught:
            errors.append((batch.index, caught, list(log)))

    while (batch := pipeline.progress(it)) is not None:
        step(batch)
    [(index, error, log_then)] = errors
    assert index == 1
    assert log_then[-1] == ("waited", 2)  # the collective of batch 1 (token 2) completed first
    if sys.version_info >= (3, 11):  # exception notes (the rest holds on 3.10 too)
        assert any("wait/prefetch of batch 2" in note for note in getattr(error, "__notes__", []))
    assert [t for kind, t in log if kind == "forward"] == [1, 2, 3, 4, 5, 6]
    assert log.count(("prefetch", 3)) == 1
    assert log.index(("prefetch", 3)) < log.index(("forward", 3))
    assert sdd.num_in_flight == 0


def test_the_callback_is_registered_only_with_wait_after_forward_and_removed_by_detach() -> None:
    """wait_after_forward=False keeps torchrec's placement (no callback); detach() removes it, attach() puts
    it back; an eval forward (no batch handed out) runs the callback as a no-op."""
    model = Tiny([], overlapping=True)
    table = model.table
    assert isinstance(table, OverlappingBag)

    def registered() -> bool:
        return table.overlap is not None

    SparseDataDistUtil(model, wait_after_forward=False).detach()
    assert not registered()
    sdd = SparseDataDistUtil(model)
    assert registered()
    sdd.detach()
    assert not registered()
    sdd.attach()
    assert registered()
    with torch.no_grad():
        model(make_batches(1)[0])
    assert sdd.num_in_flight == 0
