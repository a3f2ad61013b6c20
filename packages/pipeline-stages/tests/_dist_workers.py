"""Worker processes of the 2-process gloo tests (run as a script by test_distributed.py, one per rank).

Usage: python _dist_workers.py RANK WORLD PORT OUT_DIR (runs every scenario, writes OUT_DIR/RANK.json)

The sharded module below is written here on purpose: the package never imports a sibling package. It shards
an embedding table by row (rank r owns the ids with id % world == r) and distributes its input with a real
two-phase ``all_to_all_single``: start sends the per-rank counts asynchronously, wait sends the ids.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline_stages import PipelineStage, SparseDataDistUtil, StagedTrainPipeline

NUM_ROWS = 32
DIM = 4
BATCH = 6


def reference_table() -> torch.Tensor:
    """[NUM_ROWS, DIM] float32: row i is i*DIM .. i*DIM+DIM-1."""
    return torch.arange(NUM_ROWS * DIM, dtype=torch.float32).reshape(NUM_ROWS, DIM)


@dataclass(frozen=True, slots=True, eq=False)
class Batch:
    index: int
    sparse_features: torch.Tensor  # [BATCH] int64 ids of this rank's local batch

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            index=self.index, sparse_features=self.sparse_features.to(device, non_blocking=non_blocking)
        )

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.sparse_features.record_stream(stream)


@dataclass(frozen=True, slots=True, eq=False)
class DistIds:
    ids: torch.Tensor  # ids this rank owns, from every rank (rank-major)
    order: torch.Tensor  # the local batch's permutation that grouped ids by destination rank
    send_counts: list[int]
    recv_counts: list[int]


@dataclass(slots=True)
class _Handle:
    work: Any
    sorted_ids: torch.Tensor
    order: torch.Tensor
    send_counts: torch.Tensor
    recv_counts: torch.Tensor


class RowShardedEmbedding(nn.Module):
    """Row-sharded lookup with a two-phase all-to-all input dist and a pipelined-input FIFO."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.weight = nn.Parameter(reference_table()[rank::world].clone())
        self.queue: deque[DistIds] = deque()
        self.starts = 0
        self.plain_forwards = 0
        self.prefetched: list[list[int]] = []

    def start_input_dist(self, ids: torch.Tensor) -> _Handle:
        self.starts += 1
        dest = ids % self.world
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        work = dist.all_to_all_single(recv_counts, send_counts, async_op=True)
        return _Handle(
            work=work, sorted_ids=ids[order], order=order, send_counts=send_counts, recv_counts=recv_counts
        )

    def wait_input_dist(self, handle: _Handle) -> DistIds:
        handle.work.wait()
        send, recv = handle.send_counts.tolist(), handle.recv_counts.tolist()
        received = torch.empty(sum(recv), dtype=torch.int64)
        dist.all_to_all_single(received, handle.sorted_ids, recv, send)
        return DistIds(ids=received, order=handle.order, send_counts=send, recv_counts=recv)

    def enqueue_pipelined_input(self, dist_features: DistIds) -> None:
        self.queue.append(dist_features)

    def prefetch(self, dist_features: DistIds, forward_stream: torch.cuda.Stream | None = None) -> None:
        assert bool((dist_features.ids % self.world == self.rank).all()), "prefetch got ids of another rank"
        self.prefetched.append(dist_features.ids.tolist())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.queue:
            d = self.queue.popleft()
        else:
            self.plain_forwards += 1
            d = self.wait_input_dist(self.start_input_dist(ids))
        rows = self.weight[d.ids // self.world]  # [sum(recv), DIM]
        out_sorted = torch.empty(ids.numel(), DIM)
        dist.all_to_all_single(out_sorted, rows.detach(), d.send_counts, d.recv_counts)
        out = torch.empty_like(out_sorted)
        out[d.order] = out_sorted
        return out


class Model(nn.Module):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.ebc = RowShardedEmbedding(rank, world)

    def forward(self, batch: Batch) -> torch.Tensor:
        out: torch.Tensor = self.ebc(batch.sparse_features)
        return out


def batches(rank: int, count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [
        Batch(index=i, sparse_features=torch.randint(0, NUM_ROWS, (BATCH,), generator=generator))
        for i in range(count)
    ]


def run(scenario: str, rank: int, world: int) -> dict[str, Any]:
    model = Model(rank, world)
    sdd = SparseDataDistUtil(model)
    stages = [
        PipelineStage("data_copy", lambda b: b.to(torch.device("cpu"))),
        PipelineStage(
            "start_sparse_data_dist", sdd.start_sparse_data_dist, fill_callback=sdd.wait_sparse_data_dist
        ),
        PipelineStage("prefetch", sdd.prefetch, fill_callback=sdd.load_prefetch),
    ]
    if scenario == "sdd":
        data = batches(rank, 7)
        pipeline = StagedTrainPipeline(stages)
    elif scenario == "uneven":
        data = batches(rank, 5 if rank == 0 else 3)
        pipeline = StagedTrainPipeline(stages, exhaustion_group=dist.new_group(backend="gloo"))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    table = reference_table()
    seen: list[int] = []
    correct = True
    it = iter(data)
    while (batch := pipeline.progress(it)) is not None:
        out = model(batch)
        correct = correct and torch.equal(out, table[batch.sparse_features])
        seen.append(batch.index)
    return {
        "seen": seen,
        "correct": correct,
        "starts": model.ebc.starts,
        "plain_forwards": model.ebc.plain_forwards,
        "prefetched_batches": len(model.ebc.prefetched),
        "in_flight": sdd.num_in_flight,
    }


def main() -> None:
    rank, world, port, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        result = {scenario: run(scenario, rank, world) for scenario in ("sdd", "uneven")}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
