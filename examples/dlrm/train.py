"""The DLRM training worker: one process per rank, started by torchrun (or by :mod:`examples.dlrm.launch`).

``torchrun --nproc-per-node 2 -m examples.dlrm.train --out runs/x`` trains on CPU with gloo (NCCL on GPUs):
the batches go through pipeline-stages' ``StagedTrainPipeline`` (data_copy → start_sparse_data_dist → prefetch),
the embedding tables are sharded table-wise by vbe-lookup's ``ShardedEmbeddingBags`` (small tables in fbgemm TBEs,
Criteo's big ones in ssd-tbe-adapter key-value tables on RocksDB in the run folder), ``KTRegroupAsDict`` forms the
interaction group. Every ``--eval-every`` steps and at the end the model is evaluated on held-out data (AUC and
normalized entropy over all ranks). Rank 0 shows a progress bar, appends per-step metrics to ``metrics.jsonl``
(and TensorBoard when installed), and at the end writes ``summary.md``/``summary.json`` and ``loss_qps.png``;
``checkpoint/`` holds the last DCP checkpoint, which ``--resume`` continues from (on any number of ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import itertools
import json
import logging
import math
import os
import platform
import shutil
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from examples.dlrm.checkpoint import load_checkpoint, read_meta, save_checkpoint
from examples.dlrm.collector import StepCollector
from examples.dlrm.data import (
    CRITEO_KAGGLE_CARDINALITIES,
    NUM_DENSE,
    SPARSE_FEATURES,
    CriteoTSVReader,
    DLRMBatch,
    SyntheticConfig,
    SyntheticCriteo,
    empty_batch,
)
from examples.dlrm.dense_graphs import bucket_sizes
from examples.dlrm.dense_step import DenseStep
from examples.dlrm.embeddings import EmbeddingConfig, ShardedTables, build_sharded_tables
from examples.dlrm.errors import ArgumentError, DLRMError
from examples.dlrm.loader import BatchStream, worker_batches
from examples.dlrm.logs import LOGGER_NAME, MetricsWriter, progress_bar, setup_logging
from examples.dlrm.model import DLRM
from examples.dlrm.replicate import replicate_dense
from examples.dlrm.report import format_table, plot_history
from examples.dlrm.step_graph import StepGraphs, StepPadding, step_graph_blocker
from pipeline_stages import PipelineStage, SparseDataDistUtil, StagedTrainPipeline

__all__ = ["TrainConfig", "TrainResult", "main", "parse_args", "train", "validate"]

logger = logging.getLogger(LOGGER_NAME)
_Batch = TypeVar("_Batch")  # a DLRMBatch, or a PaddedBatch under the whole-step graphs


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a run needs; the defaults are the README's main job (2 CPU processes, a few minutes)."""

    out: Path
    steps: int = 300
    batch_size: int = 256
    min_batch_size: int | None = 128
    embedding_dim: int = 16
    bottom_layers: tuple[int, ...] = (64, 32)
    top_layers: tuple[int, ...] = (64, 32)
    max_rows: int = 20_000
    kv_rows_threshold: int = 1_000_000
    kv_max_rows: int = 10_000_000
    cache_rows: int = 4096
    host_cache_rows: int = 0
    kv_device_cache: bool = False
    kv_store: str = "rocksdb"
    tbe: str = "auto"
    dense_lr: float = 0.05
    sparse_lr: float = 0.05
    optimizer: str = "rowwise_adagrad"
    zipf_alpha: float = 1.05
    seed: int = 0
    data: tuple[Path, ...] = ()
    pipeline: bool = True
    resume: bool = False
    checkpoint_every: int = 0
    log_every: int = 25
    gc_every: int = 100
    batch_pool: int = 0
    regroup_backend: str = "auto"
    device: str = "auto"
    graph_dense: bool = True
    graph_step: bool = True
    prefetch_priority: str = "high"
    data_workers: int = 1
    graph_granularity: int = 512
    eval_every: int = 0
    eval_batches: int = 8
    eval_data: tuple[Path, ...] = ()
    eval_fraction: float | None = None
    auc_thresholds: int | None = None
    progress: bool = True
    tensorboard: bool = True
    log_all_ranks: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def model_config(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed: the shapes of every weight and optimizer state."""
        emb = self.embedding_config(1)
        return {
            "embedding_dim": self.embedding_dim,
            "bottom_layers": list(self.bottom_layers),
            "top_layers": list(self.top_layers),
            "table_rows": list(emb.table_rows),
            "kv_features": list(emb.kv_features),
            "optimizer": self.optimizer,
        }

    @property
    def held_out_fraction(self) -> float:
        """Share of the ``--data`` lines held out for evaluation (0 with ``--eval-data`` or synthetic data)."""
        if not self.data or self.eval_data:
            return 0.0
        return 0.1 if self.eval_fraction is None else self.eval_fraction

    @property
    def evaluates(self) -> bool:
        """Whether the run has held-out data to evaluate on."""
        if self.eval_data:
            return True
        if self.data:
            return self.held_out_fraction > 0
        return self.eval_batches > 0

    def embedding_config(self, world_size: int) -> EmbeddingConfig:
        """Table layout and kernels of the sharded embedding module."""
        return EmbeddingConfig(
            embedding_dim=self.embedding_dim,
            table_rows=self.synthetic(0, world_size).table_rows,
            kv_features=tuple(
                f
                for f, c in zip(SPARSE_FEATURES, CRITEO_KAGGLE_CARDINALITIES, strict=True)
                if c >= self.kv_rows_threshold
            ),
            cache_rows=self.cache_rows,
            host_cache_rows=self.host_cache_rows,
            kv_cache_on_device=True if self.kv_device_cache else None,
            kv_store=self.kv_store,
            tbe=self.tbe,
            optimizer=self.optimizer,
            learning_rate=self.sparse_lr,
            seed=self.seed,
        )

    def synthetic(self, rank: int, world_size: int) -> SyntheticConfig:
        """Synthetic data of this rank: small tables capped at ``max_rows``, key-value ones at ``kv_max_rows``."""
        del rank, world_size
        return SyntheticConfig(
            batch_size=self.batch_size,
            min_batch_size=self.min_batch_size,
            num_batches=self.steps,
            max_rows=self.kv_max_rows,
            zipf_alpha=self.zipf_alpha,
            seed=self.seed,
            cardinalities=tuple(
                c if c >= self.kv_rows_threshold else min(c, self.max_rows)
                for c in SyntheticConfig().cardinalities
            ),
        )


@dataclass(frozen=True, kw_only=True)
class TrainResult:
    """What one rank's run produced (returned to tests; rank 0 also writes it to the run folder)."""

    rank: int
    steps: int
    losses: list[float]
    samples: list[int]
    step_seconds: list[float]
    dense_state: dict[str, torch.Tensor]
    embedding_state: dict[str, torch.Tensor]
    summary: dict[str, Any]
    evals: list[dict[str, Any]] = field(default_factory=list)


def _device(config: TrainConfig) -> torch.device:
    if config.device == "cuda":  # no index: this process's local rank
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if config.device != "auto":
        return torch.device(config.device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def dense_optimizer(params: list[torch.nn.Parameter], *, lr: float) -> torch.optim.Adagrad:
    """The dense Adagrad (foreach), the same for our trainer and the bench's torchrec rows.

    Not ``fused=True``: torch 2.11's ``Adagrad`` accepts it on CPU only (its first CUDA step raises "`fused=True`
    requires ... supported devices: ['mps', 'xpu', 'hpu', 'cpu', ...]" on the H200, although the
    ``torch._fused_adagrad_`` op itself runs there)."""
    return torch.optim.Adagrad(params, lr=lr, foreach=True)


def new_model(config: TrainConfig, tables: ShardedTables, device: torch.device) -> DLRM:
    """The DLRM of ``config`` over the rank's sharded ``tables``, on ``device``."""
    return DLRM(
        sparse_arch=tables.module,
        sparse_features=SPARSE_FEATURES,
        embedding_dim=config.embedding_dim,
        num_dense=NUM_DENSE,
        bottom_layers=config.bottom_layers,
        top_layers=config.top_layers,
        regroup_backend=config.regroup_backend,
        seed=config.seed,
    ).to(device)


def _batches(
    config: TrainConfig,
    rank: int,
    world_size: int,
    start: int,
    *,
    pin: bool,
    tsv_lines: tuple[int, int | None] = (0, None),
    padding: StepPadding | None = None,
) -> Iterator[Any]:
    """This rank's batches from step ``start`` on (synthetic, or Criteo TSV with ``--data``); ``pin``: in pinned
    host memory, so that the data_copy stage's non-blocking copies overlap on CUDA.

    A TSV run reads the lines ``tsv_lines`` (the training part; its start is the data position of a resumed
    run: the lines all ranks trained on, which also holds on another world size). With ``padding`` (the
    whole-step CUDA graphs) every batch is a :class:`PaddedBatch`, padded where it is made (in the worker, or
    once per batch of the pool)."""
    if config.data:
        reader = CriteoTSVReader(
            config.data,
            batch_size=config.batch_size,
            table_rows=config.embedding_config(world_size).table_rows,
            rank=rank,
            world_size=world_size,
            lines=tsv_lines,
        )
        # Parsed in a DataLoader worker (one: the reader is sequential), pinned on its pin thread.
        yield from worker_batches(
            BatchStream(reader, start=0, stop=config.steps - start, transform=padding),
            workers=config.data_workers,
            pin=pin,
        )
        return
    source = SyntheticCriteo(config.synthetic(rank, world_size), rank=rank, world_size=world_size)
    if config.batch_pool > 0:
        # Generate a pool once and cycle it: on a GPU the host generator would otherwise be the bottleneck.
        made = (source.batch(i) for i in range(min(config.batch_pool, config.steps)))
        pool: list[Any] = [b if padding is None else padding(b) for b in made]
        pool = [b.pin_memory() for b in pool] if pin else pool
        for index in range(start, config.steps):
            yield pool[index % len(pool)]
        return
    # Generated by `data_workers` DataLoader processes in batch order, pinned on the loader's pin thread.
    yield from worker_batches(
        BatchStream(source, start=start, stop=config.steps, transform=padding),
        workers=config.data_workers,
        pin=pin,
    )


class _Timer:
    """Accumulates wall time per phase of the step (host time; on CUDA it includes waits that sync).

    ``step`` holds the phases of the current step (reset by :meth:`start`).
    """

    def __init__(self) -> None:
        self.total: dict[str, float] = {}
        self.step: dict[str, float] = {}
        self._start = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()
        self.step = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.total[name] = self.total.get(name, 0.0) + now - self._start
        self.step[name] = self.step.get(name, 0.0) + now - self._start
        self._start = now


@dataclass
class _Window:
    """The steps since the last log: their losses stay on the device until then (no host sync per step)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)


def _new_stream(device: torch.device, *, priority: int = 0) -> torch.cuda.Stream:
    """A CUDA stream (``priority``: lower is higher, clamped to the device's range)."""
    return torch.cuda.Stream(device=device, priority=priority)  # type: ignore[no-untyped-call]  # unannotated


def _all_or_none(batch: _Batch | None, device: torch.device) -> _Batch | None:
    """``batch``, or None on every rank as soon as one rank has run out of data (uneven Criteo files)."""
    flag = torch.tensor([0 if batch is None else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return batch if int(flag) == 1 else None


def _has_torchmetrics() -> bool:
    """Whether the evaluation's library is installed (the GPU images may lack it: then no evaluation)."""
    return importlib.util.find_spec("torchmetrics") is not None


def _segment_end(step: int, config: TrainConfig) -> int:
    """The next step after ``step`` at which the pipeline drains: an evaluation, a checkpoint or the end."""
    periods = (config.eval_every if config.evaluates else 0, config.checkpoint_every)
    return min([config.steps, *((step // every + 1) * every for every in periods if every > 0)])


def _tsv_split(config: TrainConfig, rank: int, world_size: int) -> tuple[int | None, CriteoTSVReader | None]:
    """``(end of the training lines, reader of the held-out lines)`` of a TSV run; ``(None, None)`` otherwise."""
    if not config.data:
        if not config.eval_data:
            return None, None
        train_stop = None
        paths, lines = config.eval_data, (0, None)
    elif config.eval_data:
        train_stop, paths, lines = None, config.eval_data, (0, None)
    else:
        fraction = config.held_out_fraction
        if fraction <= 0:
            return None, None
        probe = CriteoTSVReader(config.data, batch_size=1, table_rows=config.embedding_config(1).table_rows)
        total = probe.count_lines()
        held = max(1, math.ceil(total * fraction))
        train_stop = total - held
        paths, lines = config.data, (train_stop, None)
    reader = CriteoTSVReader(
        paths,
        batch_size=config.batch_size,
        table_rows=config.embedding_config(world_size).table_rows,
        rank=rank,
        world_size=world_size,
        lines=lines,
    )
    return train_stop, reader


def _eval_batches(
    config: TrainConfig, rank: int, world_size: int, device: torch.device, reader: CriteoTSVReader | None
) -> Iterator[DLRMBatch]:
    """This rank's held-out batches, the same number on every rank (the forward is collective).

    Synthetic data: ``--eval-batches`` batches of the held-out stream (stream 1: never a training batch).
    TSV: every held-out line once; a rank whose share ran out joins with empty batches until all have.
    """
    if reader is None:
        source = SyntheticCriteo(
            config.synthetic(rank, world_size), rank=rank, world_size=world_size, stream=1
        )
        for index in range(config.eval_batches):
            yield source.batch(index)
        return
    batches = iter(reader)
    while True:
        batch = next(batches, None)
        flag = torch.tensor([0 if batch is None else 1], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) == 0:
            return
        yield empty_batch() if batch is None else batch


def train(config: TrainConfig, *, rank: int, world_size: int, collect_kv_rows: bool = False) -> TrainResult:
    """Train on this rank (the default process group must be initialised, every rank calls this).

    ``collect_kv_rows`` puts every key-value row into the result's ``embedding_state`` (for tests).

    Raises:
        ArgumentError: a bad configuration (see :func:`validate`), on every rank before any collective.
        CheckpointError: ``resume`` without a compatible checkpoint.
    """
    collector = StepCollector(config.gc_every)
    try:
        return _train(
            config, rank=rank, world_size=world_size, collect_kv_rows=collect_kv_rows, collector=collector
        )
    finally:
        collector.stop()  # also when a step raised: the caller's collector works as before


def _train(
    config: TrainConfig, *, rank: int, world_size: int, collect_kv_rows: bool, collector: StepCollector
) -> TrainResult:
    validate(config, check_resume=False)
    device = _device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config.out.mkdir(parents=True, exist_ok=True)
    # The key-value store is the tables' working copy; the checkpoint holds their rows, so each run (fresh or
    # resumed, on any world size) starts from an empty store.
    shutil.rmtree(config.out / "kv" / f"rank{rank}", ignore_errors=True)
    group = dist.group.WORLD
    tables = build_sharded_tables(
        config.embedding_config(world_size),
        rank=rank,
        world_size=world_size,
        process_group=group,
        device=device,
        workdir=config.out / "kv",
    )
    model = new_model(config, tables, device)
    dense_params = model.dense_parameters()
    optimizer = dense_optimizer(dense_params, lr=config.dense_lr)
    # On one GPU with every table in one fbgemm TBE the whole step is one CUDA graph replay per padded shape.
    step_graphs: StepGraphs | None = None
    padding: StepPadding | None = None
    if config.graph_step and config.graph_dense:
        blocker = step_graph_blocker(model, world_size=world_size, device=device)
        if blocker is None:
            step_graphs = StepGraphs(model, optimizer)
            low = config.batch_size if config.min_batch_size is None else config.min_batch_size
            padding = step_graphs.padding(
                bucket_sizes(1 if config.data else low + 1, config.batch_size + 1, config.graph_granularity)
            )
            logger.info("the whole step runs as CUDA graph replays (one per padded batch shape)")
        elif device.type == "cuda":
            logger.info("whole-step CUDA graphs off: %s; the dense part is graphed", blocker)
    # With the dense graphs, the dense Adagrad step is one graph replay too (same ops, same bits).
    # Without DDP a dense gradient may be the dense graphs' own output buffer: DenseStep copies it at capture.
    dense_step = DenseStep(
        optimizer, graph=config.graph_dense and device.type == "cuda", own_gradients=world_size == 1
    )
    if config.graph_dense and device.type == "cuda" and step_graphs is None:
        # The dense part as CUDA graph replays (one per padded batch size): host work under GPU work.
        low = config.batch_size if config.min_batch_size is None else config.min_batch_size
        model.capture_dense(
            min_batch=1 if config.data else low,  # a TSV file's last batch may be short
            max_batch=config.batch_size,
            granularity=config.graph_granularity,
        )

    # Dense gradients are averaged over the ranks by DDP during the backward (overlapped with it).
    train_loss = replicate_dense(model, world_size=world_size)

    start = 0
    history: dict[str, list[float]] = {"loss": [], "samples": [], "seconds": []}
    evals: list[dict[str, Any]] = []
    tsv_start = 0  # TSV data position: lines trained on by all ranks
    if config.resume:
        meta, history = load_checkpoint(
            config.out,
            rank=rank,
            world_size=world_size,
            model=model,
            tables=tables,
            optimizer=optimizer,
            model_config=config.model_config(),
        )
        start, evals, tsv_start = (
            int(meta["step"]),
            list(meta.get("evals", [])),
            int(meta.get("tsv_lines", 0)),
        )
        logger.info(
            "resumed from step %d (checkpoint of %d ranks, now %d)", start, meta["world_size"], world_size
        )
    train_stop, eval_reader = _tsv_split(config, rank, world_size)
    metrics: Any = None
    if config.evaluates and _has_torchmetrics():
        from examples.dlrm.evaluation import EvalMetrics

        metrics = EvalMetrics(device, auc_thresholds=config.auc_thresholds)
    elif config.evaluates:
        logger.warning(
            "torchmetrics is not installed (examples/dlrm/requirements.txt): no held-out evaluation"
        )

    timer = _Timer()
    writer = MetricsWriter(
        config.out / "metrics.jsonl",
        tensorboard_dir=config.out / "tensorboard" if config.tensorboard else None,
        enabled=rank == 0,
    )
    bar = progress_bar(config.steps, start, enabled=rank == 0 and config.progress)
    losses: list[float] = []
    samples: list[int] = []
    seconds: list[float] = []
    batches = _batches(
        config,
        rank,
        world_size,
        start,
        pin=device.type == "cuda",
        tsv_lines=(tsv_start, train_stop),
        padding=padding,
    )

    pipeline: StagedTrainPipeline | None = None
    sdd: SparseDataDistUtil | None = None
    if config.pipeline and step_graphs is not None:
        # The sparse input dist is inside the graph (one rank): the pipeline copies the next batch ahead and,
        # with key-value tables, prefetches its rows (on its own stream) right after the current step replays.
        graphed = step_graphs
        pipeline = StagedTrainPipeline(
            pipeline_stages=[
                PipelineStage(
                    name="data_copy",
                    runnable=lambda b: b.to(device, non_blocking=True),
                    stream=_new_stream(device),
                ),
                *(
                    [
                        PipelineStage(
                            name="prefetch",
                            runnable=graphed.prefetch_after_step,
                            # High priority: the survey's ~150 small kernels run between the step graph's
                            # blocks instead of queueing behind them.
                            stream=_new_stream(
                                device, priority=-1 if config.prefetch_priority == "high" else 0
                            ),
                        )
                    ]
                    if graphed.prefetches
                    else []
                ),
            ],
            exhaustion_group=group if config.data else None,
            device_timing=True,
        )
    elif config.pipeline:
        cuda = device.type == "cuda"
        copy_stream = _new_stream(device) if cuda else None
        # Only key-value tables prefetch; with every table in a TBE the prefetch stage would be a stream
        # hand-off with nothing on it, so it is left out. Decided from the config, the same on every rank
        # (the pipeline depth sets how many batches each rank pulls, and the exhaustion all-reduces match).
        prefetching = bool(config.embedding_config(world_size).kv_features)
        # wait_after_forward: batch i+1's dist wait and prefetch run right after forward i is launched.
        sdd = SparseDataDistUtil(
            model,
            data_dist_stream=_new_stream(device) if cuda else None,
            prefetch_stream=_new_stream(device) if cuda and prefetching else None,
            wait_after_forward=True,
        )
        prefetch_stage = PipelineStage(
            name="prefetch",
            runnable=sdd.prefetch,
            stream=sdd.prefetch_stream,
            fill_callback=sdd.load_prefetch,
        )
        pipeline = StagedTrainPipeline(
            pipeline_stages=[
                PipelineStage(
                    name="data_copy", runnable=lambda b: b.to(device, non_blocking=True), stream=copy_stream
                ),
                PipelineStage(
                    name="start_sparse_data_dist",
                    runnable=sdd.start_sparse_data_dist,
                    stream=sdd.data_dist_stream,
                    fill_callback=sdd.wait_sparse_data_dist,
                ),
                *([prefetch_stage] if prefetching else []),
            ],
            # Criteo files dealt round-robin can leave one rank a batch short: stop all ranks together.
            exhaustion_group=group if config.data else None,
            device_timing=cuda,
        )

    def flush_window(window: _Window, step: int) -> None:
        """Losses of the window to the host, one reduction over the ranks, records to metrics.jsonl."""
        if not window.losses:
            return
        local = torch.stack(window.losses).double().tolist()
        losses.extend(local)
        kv = tables.kv_metrics()
        kv_counts = [kv.get(k, 0.0) for k in ("hits", "lookups", "forward_hits", "forward_lookups")]
        packed = torch.tensor([*local, *map(float, window.samples), *kv_counts], dtype=torch.float64)
        slowest = torch.tensor(window.seconds, dtype=torch.float64)
        if world_size > 1:
            packed = _reduced(packed, device)
            slowest = _reduced(slowest, device, dist.ReduceOp.MAX)
        n = len(local)
        step_loss = (packed[:n] / world_size).tolist()
        step_samples = packed[n : 2 * n].tolist()
        hits, lookups, forward_hits, forward_lookups = packed[2 * n :].tolist()
        for i in range(n):
            writer.write(
                {
                    "kind": "train",
                    "step": step - n + 1 + i,
                    "loss": step_loss[i],
                    "samples": step_samples[i],
                    "step_seconds": float(slowest[i]),
                    "qps": step_samples[i] / max(float(slowest[i]), 1e-9),
                    "phase_ms": {k: 1e3 * v for k, v in window.phases[i].items()},
                    "kv_hit_rate": hits / lookups if lookups else math.nan,
                    "kv_forward_hit_rate": forward_hits / forward_lookups if forward_lookups else math.nan,
                }
            )
        writer.flush()
        elapsed = max(time.perf_counter() - window.start, 1e-9)
        postfix = {"loss": f"{sum(step_loss) / n:.4f}", "qps": f"{sum(step_samples) / elapsed:,.0f}"}
        if evals:
            postfix["auc"] = f"{evals[-1]['auc']:.4f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(step - bar.n)

    def run_eval(step: int) -> None:
        assert metrics is not None
        began = time.perf_counter()
        from examples.dlrm.evaluation import evaluate

        values = evaluate(
            model, _eval_batches(config, rank, world_size, device, eval_reader), device, metrics
        )
        record = {"kind": "eval", "step": step, **values, "seconds": time.perf_counter() - began}
        evals.append(record)
        writer.write(record)
        writer.flush()
        logger.info(
            "eval at step %d: AUC %.4f, NE %.4f, log loss %.4f over %d samples (%.1f s)",
            step,
            values["auc"],
            values["ne"],
            values["loss"],
            values["samples"],
            record["seconds"],
        )

    def checkpoint(step: int) -> None:
        lines = tsv_start + (step - start) * world_size * config.batch_size if config.data else 0
        save_checkpoint(
            config.out,
            rank=rank,
            world_size=world_size,
            step=step,
            model=model,
            tables=tables,
            optimizer=optimizer,
            history=_merged(history, losses, samples, seconds),
            evals=evals,
            model_config=config.model_config(),
            extra={"tsv_lines": lines} if config.data else None,
        )

    step = start
    exhausted = False
    side_seconds = {"eval": 0.0, "checkpoint": 0.0}
    collector.start()  # setup's objects frozen: no full collection lands on a training step
    wall_start = time.perf_counter()
    # Segments end where the pipeline must be empty: before an evaluation (its forwards would take a
    # training batch's pipelined input) and a checkpoint (nothing in flight, the data position exact).
    while step < config.steps and not exhausted:
        end = _segment_end(step, config)
        segment = itertools.islice(batches, end - step)
        window = _Window()
        while True:
            step_start = time.perf_counter()
            timer.start()
            batch: Any
            if pipeline is not None:
                batch = pipeline.progress(segment)
            else:
                batch = next(segment, None)
                if config.data:
                    batch = _all_or_none(batch, device)
                if batch is not None:
                    batch = batch.to(device, non_blocking=True)
            timer.lap("data + pipeline stages")
            if batch is None:
                break
            if step_graphs is not None:
                loss = step_graphs.step(batch)
                timer.lap("whole step (CUDA graph replay; eager per new shape)")
            else:
                dense_step.zero_grad()
                loss = train_loss(batch)
                timer.lap("forward")
                loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch
                timer.lap("backward (incl. fused sparse optimizer, dense all-reduce)")
                dense_step.step()
                timer.lap("dense optimizer")
            step += 1
            collector.after_step(step)  # the same step on every rank
            window.losses.append(loss.detach())
            window.samples.append(batch.batch_size)
            window.seconds.append(time.perf_counter() - step_start)
            window.phases.append(dict(timer.step))
            samples.append(batch.batch_size)
            seconds.append(window.seconds[-1])
            if step % config.log_every == 0:
                flush_window(window, step)
                window = _Window()
                timer.lap("logging")
        flush_window(window, step)
        collector.segment_end()
        exhausted = step < end
        began = time.perf_counter()
        if metrics is not None and config.eval_every > 0 and step % config.eval_every == 0:
            run_eval(step)
        side_seconds["eval"] += time.perf_counter() - began
        began = time.perf_counter()
        if (
            config.checkpoint_every
            and step % config.checkpoint_every == 0
            and step < config.steps
            and not exhausted
        ):
            checkpoint(step)
        side_seconds["checkpoint"] += time.perf_counter() - began
    bar.close()
    began = time.perf_counter()
    if metrics is not None and (not evals or evals[-1]["step"] != step):
        run_eval(step)
    side_seconds["eval"] += time.perf_counter() - began
    if sdd is not None:
        sdd.detach()
    began = time.perf_counter()
    checkpoint(step)
    side_seconds["checkpoint"] += time.perf_counter() - began
    wall = time.perf_counter() - wall_start - side_seconds["eval"] - side_seconds["checkpoint"]
    writer.close()

    history = _merged(history, losses, samples, seconds)
    graphs = (
        None
        if step_graphs is None
        else {
            "replays": step_graphs.replays,
            "eager_steps": step_graphs.eager_steps,
            "shapes": [list(k) for k in step_graphs.captured_shapes],
        }
    )
    summary = _summarize(
        config,
        rank,
        world_size,
        device,
        timer,
        wall,
        history,
        tables,
        pipeline,
        start,
        evals,
        side_seconds,
        graphs,
    )
    dense_state = model.dense_state_dict()
    embedding_state = tables.local_state(include_kv=collect_kv_rows)
    tables.close()
    return TrainResult(
        rank=rank,
        steps=step,
        losses=losses,
        samples=samples,
        step_seconds=seconds,
        dense_state=dense_state,
        embedding_state=embedding_state,
        summary=summary,
        evals=evals,
    )


def _merged(
    history: dict[str, list[float]], losses: list[float], samples: list[int], seconds: list[float]
) -> dict[str, list[float]]:
    return {
        "loss": history["loss"] + losses,
        "samples": history["samples"] + [float(s) for s in samples],
        "seconds": history["seconds"] + seconds,
    }


def _summarize(
    config: TrainConfig,
    rank: int,
    world_size: int,
    device: torch.device,
    timer: _Timer,
    wall: float,
    history: dict[str, list[float]],
    tables: ShardedTables,
    pipeline: StagedTrainPipeline | None,
    start: int,
    evals: list[dict[str, Any]],
    side_seconds: dict[str, float],
    step_graphs: dict[str, Any] | None,
) -> dict[str, Any]:
    """Gather per-step numbers over the ranks; rank 0 writes summary.md, summary.json and the plot.

    ``step_graphs``: the whole-step CUDA graphs' replays, eager steps and captured ``(Bp, Cp)`` shapes."""
    steps = len(history["loss"])
    per_step = torch.tensor([history["samples"], history["loss"], history["seconds"]], dtype=torch.float64)
    phases = sorted(timer.total)
    phase_t = torch.tensor([timer.total[p] for p in phases], dtype=torch.float64)
    kv = tables.kv_metrics()
    kv_keys = ("hits", "lookups", "forward_hits", "forward_lookups")
    kv_t = torch.tensor([kv.get(k, 0.0) for k in kv_keys], dtype=torch.float64)
    wall_t = torch.tensor([wall], dtype=torch.float64)
    if world_size > 1:
        per_step[0] = _reduced(per_step[0], device)  # samples: sum over ranks
        per_step[1] = _reduced(per_step[1], device) / world_size  # loss: mean over ranks
        per_step[2] = _reduced(per_step[2], device, dist.ReduceOp.MAX)  # step time: the slowest rank
        phase_t = _reduced(phase_t, device) / world_size
        kv_t = _reduced(kv_t, device)
        wall_t = _reduced(wall_t, device, dist.ReduceOp.MAX)
    stage_stats = _stage_stats(pipeline)
    if rank != 0:
        return {}
    run_steps = steps - start
    run_samples = float(per_step[0, start:].sum())
    run_wall = float(wall_t)
    qps = [float(s / max(t, 1e-9)) for s, t in zip(per_step[0].tolist(), per_step[2].tolist(), strict=True)]
    losses = per_step[1].tolist()
    head = max(1, min(20, steps // 10))
    hit_rate = float(kv_t[0] / kv_t[1]) if float(kv_t[1]) > 0 else float("nan")
    forward_hit_rate = float(kv_t[2] / kv_t[3]) if float(kv_t[3]) > 0 else float("nan")
    summary: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_name(device),
        "torch": torch.__version__,
        "world_size": world_size,
        "backend": str(dist.get_backend()),
        "steps": steps,
        "steps_this_run": run_steps,
        "wall_seconds": run_wall,
        "eval_seconds": side_seconds["eval"],
        "checkpoint_seconds": side_seconds["checkpoint"],
        "samples_this_run": run_samples,
        "qps": run_samples / max(run_wall, 1e-9),
        "qps_steady": _steady_qps(per_step[0, start:].tolist(), per_step[2, start:].tolist()),
        "loss_first": sum(losses[:head]) / head,
        "loss_last": sum(losses[-head:]) / head,
        "kv_cache_hit_rate": hit_rate,
        "kv_forward_hit_rate": forward_hit_rate,
        "kv_metrics_rank0": kv,
        "eval_auc": evals[-1]["auc"] if evals else math.nan,
        "eval_ne": evals[-1]["ne"] if evals else math.nan,
        "eval_loss": evals[-1]["loss"] if evals else math.nan,
        "evals": evals,
        "phase_ms_per_step": {
            p: 1e3 * float(t) / max(run_steps, 1) for p, t in zip(phases, phase_t, strict=True)
        },
        "pipeline_stage_ms": stage_stats,
        "step_graphs": step_graphs,
        "tables": tables.describe(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()},
    }
    summary["config"]["data"] = [str(p) for p in config.data]
    summary["config"]["eval_data"] = [str(p) for p in config.eval_data]
    rows: list[list[object]] = [
        ["steps (this run)", f"{run_steps} ({steps} total)"],
        ["ranks × device", f"{world_size} × {summary['device']} ({summary['backend']})"],
        ["training wall time (without eval and checkpoints)", f"{run_wall:.1f} s"],
        ["QPS (samples/s, all ranks)", f"{summary['qps']:,.0f}"],
        ["QPS steady state (after warm-up)", f"{summary['qps_steady']:,.0f}"],
        ["loss first → last (mean of 20 steps)", f"{summary['loss_first']:.4f} → {summary['loss_last']:.4f}"],
        ["key-value cache hit rate (first look, all ranks)", _percent(hit_rate)],
        ["key-value hit rate at forward (after prefetch)", _percent(forward_hit_rate)],
    ]
    if step_graphs is not None:
        rows.append(
            [
                "whole-step CUDA graphs (replays / eager steps / shapes)",
                f"{step_graphs['replays']} / {step_graphs['eager_steps']} / {len(step_graphs['shapes'])}",
            ]
        )
    if evals:
        last = evals[-1]
        rows += [
            [
                f"held-out AUC / NE at step {last['step']} ({last['samples']:,.0f} samples)",
                f"{last['auc']:.4f} / {last['ne']:.4f}",
            ],
            ["held-out log loss, label rate", f"{last['loss']:.4f}, {last['ctr']:.3f}"],
            ["eval, checkpoint time", f"{side_seconds['eval']:.1f} s, {side_seconds['checkpoint']:.1f} s"],
        ]
    phase_rows: list[list[object]] = [[p, ms] for p, ms in summary["phase_ms_per_step"].items()]
    stage_rows: list[list[object]] = [[name, ms] for name, ms in stage_stats.items()]
    text = [
        f"# DLRM run {config.out.name}",
        "",
        format_table(rows, ["metric", "value"]),
        "",
        "## Step time per phase (ms per step, mean over ranks)",
        "",
        format_table(phase_rows, ["phase", "ms / step"]),
    ]
    if stage_rows:
        text += [
            "",
            "## Pipeline stages (ms per batch, rank 0)",
            "",
            format_table(stage_rows, ["stage", "ms / batch"]),
        ]
    text += ["", "## Tables", "", format_table(tables.describe(), ["table", "rows", "rank", "kernel"]), ""]
    md = "\n".join(text)
    (config.out / "summary.md").write_text(md, encoding="utf-8")
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    bench = _bench_record(config, summary, per_step[2, start:].tolist(), tables)
    (config.out / "bench.json").write_text(json.dumps(bench, indent=2), encoding="utf-8")
    plotted = plot_history(
        config.out / "loss_qps.png",
        list(range(1, steps + 1)),
        losses,
        qps,
        f"DLRM, {world_size} × {summary['device']}: loss, held-out AUC and QPS",
        eval_steps=[int(e["step"]) for e in evals],
        eval_loss=[float(e["loss"]) for e in evals],
        eval_auc=[float(e["auc"]) for e in evals],
    )
    logger.info("summary\n%s", md)
    logger.info(
        "outputs: %s/summary.md, summary.json, metrics.jsonl%s",
        config.out,
        ", loss_qps.png" if plotted else "",
    )
    return summary


def _reduced(tensor: torch.Tensor, device: torch.device, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce of a host tensor (through ``device``: NCCL only reduces CUDA tensors); returns it on the host."""
    work = tensor.to(device)
    dist.all_reduce(work, op=op)
    return work.cpu()


def _bench_record(
    config: TrainConfig, summary: dict[str, Any], step_seconds: list[float], tables: ShardedTables
) -> dict[str, Any]:
    """The run in the packages' benchmark JSON format (``tools/bench_report.py`` renders it)."""
    skip = min(len(step_seconds) // 5, 20)
    steady = sorted(step_seconds[skip:]) or [0.0]

    def quantile(q: float) -> float:
        return 1e3 * steady[min(len(steady) - 1, int(q * len(steady)))]

    tbe = tables.kernel_kinds.get("tbe", "TBE")
    return {
        "package": "examples-dlrm",
        "version": "main job",
        "device": f"{summary['world_size']} × {summary['device']}",
        "torch": summary["torch"],
        "date": summary["date"][:10],
        "command": "python3 -m nox -s main_job (python -m examples.dlrm.launch; the config is in summary.json)",
        "results": [
            {
                "case": f"{summary['steps_this_run']} steps, B ≤ {config.batch_size}/rank, dim {config.embedding_dim}",
                "impl": ("pipelined" if config.pipeline else "plain loop") + f", {tbe} + key-value",
                "median_ms": quantile(0.5),
                "p10_ms": quantile(0.1),
                "p90_ms": quantile(0.9),
                "peak_mem_bytes": 0,
                "qps": round(summary["qps"]),
                "qps_steady": round(summary["qps_steady"]),
                "wall_s": round(summary["wall_seconds"], 1),
                "loss_first": round(summary["loss_first"], 4),
                "loss_last": round(summary["loss_last"], 4),
                "kv_hit_rate": round(summary["kv_cache_hit_rate"], 3),
            }
        ],
    }


def _percent(rate: float) -> str:
    return "n/a (no key-value tables)" if rate != rate else f"{rate:.1%}"


def _steady_qps(samples: list[float], seconds: list[float]) -> float:
    skip = min(len(samples) // 5, 20)
    total_t = sum(seconds[skip:])
    return sum(samples[skip:]) / total_t if total_t > 0 else 0.0


def _stage_stats(pipeline: StagedTrainPipeline | None) -> dict[str, float]:
    if pipeline is None:
        return {}
    stats = pipeline.stats()
    out: dict[str, float] = {}
    for name, value in stats.items():
        mean = value.device_ms_mean if value.device_ms_mean is not None else value.host_ms_mean
        out[str(name)] = float(mean)
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The command line of the worker (and of the launcher, which forwards it)."""
    defaults = TrainConfig(out=Path("runs/dlrm"))
    p = argparse.ArgumentParser(prog="python -m examples.dlrm.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="run folder (outputs, RocksDB store, checkpoint)")
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size, help="largest local batch per rank")
    p.add_argument("--min-batch-size", type=int, default=defaults.min_batch_size, help="smallest local batch")
    p.add_argument("--embedding-dim", type=int, default=defaults.embedding_dim)
    p.add_argument("--bottom-layers", type=_ints, default=defaults.bottom_layers, help="e.g. 64,32")
    p.add_argument("--top-layers", type=_ints, default=defaults.top_layers, help="e.g. 64,32")
    p.add_argument("--max-rows", type=int, default=defaults.max_rows, help="row cap of the TBE tables")
    p.add_argument(
        "--kv-rows-threshold",
        type=int,
        default=defaults.kv_rows_threshold,
        help="tables with at least this many (Criteo) rows live in key-value tables",
    )
    p.add_argument(
        "--kv-max-rows", type=int, default=defaults.kv_max_rows, help="id space cap of key-value tables"
    )
    p.add_argument(
        "--cache-rows", type=int, default=defaults.cache_rows, help="cache rows per key-value kernel"
    )
    p.add_argument(
        "--host-cache-rows",
        type=int,
        default=defaults.host_cache_rows,
        help="rows of a host-DRAM tier under each key-value kernel's device cache (CUDA; 0: none)",
    )
    p.add_argument(
        "--kv-device-cache",
        action="store_true",
        help="the key-value kernels' device-managed cache on the CPU too (CUDA's default; with its DRAM tier)",
    )
    p.add_argument("--kv-store", choices=["rocksdb", "memory"], default=defaults.kv_store)
    p.add_argument("--tbe", choices=["auto", "fbgemm", "torch"], default=defaults.tbe)
    p.add_argument("--dense-lr", type=float, default=defaults.dense_lr)
    p.add_argument("--sparse-lr", type=float, default=defaults.sparse_lr)
    p.add_argument("--optimizer", choices=["rowwise_adagrad", "sgd"], default=defaults.optimizer)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--data", type=Path, nargs="*", default=[], help="Criteo TSV file(s) instead of synthetic data"
    )
    p.add_argument(
        "--eval-data", type=Path, nargs="*", default=[], help="held-out Criteo TSV file(s) for the evaluation"
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=None,
        help="with --data and no --eval-data: hold out this last share of the lines (default 0.1)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="evaluate every N steps (and always at the end); 0: at the end",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=defaults.eval_batches,
        help="synthetic data: held-out batches per rank (a separate seed stream); 0: no evaluation",
    )
    p.add_argument(
        "--auc-thresholds", type=int, default=None, help="bin the AUC into N thresholds (default: exact AUC)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-tensorboard", action="store_true", help="no TensorBoard files even when installed")
    p.add_argument("--log-all-ranks", action="store_true", help="INFO logs of every rank (default: rank 0)")
    p.add_argument("--no-pipeline", action="store_true", help="plain loop instead of the StagedTrainPipeline")
    p.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --out (any number of ranks)"
    )
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps")
    p.add_argument("--log-every", type=int, default=defaults.log_every)
    p.add_argument(
        "--gc-every",
        type=int,
        default=defaults.gc_every,
        help="collect Python garbage every N steps, setup's objects frozen (0: Python's automatic collection)",
    )
    p.add_argument(
        "--batch-pool",
        type=int,
        default=defaults.batch_pool,
        help="generate N synthetic batches up front and cycle them (GPU throughput runs); 0: a new batch per step",
    )
    p.add_argument("--regroup-backend", default=defaults.regroup_backend)
    p.add_argument("--device", default=defaults.device, help="auto, cpu, cuda")
    p.add_argument(
        "--data-workers",
        type=int,
        default=defaults.data_workers,
        help="DataLoader worker processes making the batches (0: in the training process)",
    )
    p.add_argument(
        "--no-graph-dense",
        action="store_true",
        help="on CUDA, run the dense part eagerly instead of as CUDA graph replays",
    )
    p.add_argument(
        "--no-graph-step",
        action="store_true",
        help="on one GPU, graph only the dense part instead of the whole step",
    )
    p.add_argument(
        "--prefetch-priority",
        choices=["high", "default"],
        default="high",
        help="CUDA stream priority of the key-value prefetch stage next to the whole-step graph",
    )
    p.add_argument(
        "--graph-granularity",
        type=int,
        default=defaults.graph_granularity,
        help="CUDA graphs: batches are padded to a multiple of this many samples",
    )
    a = p.parse_args(argv)
    return TrainConfig(
        out=a.out,
        steps=a.steps,
        batch_size=a.batch_size,
        min_batch_size=a.min_batch_size,
        embedding_dim=a.embedding_dim,
        bottom_layers=a.bottom_layers,
        top_layers=a.top_layers,
        max_rows=a.max_rows,
        kv_rows_threshold=a.kv_rows_threshold,
        kv_max_rows=a.kv_max_rows,
        cache_rows=a.cache_rows,
        host_cache_rows=a.host_cache_rows,
        kv_device_cache=a.kv_device_cache,
        kv_store=a.kv_store,
        tbe=a.tbe,
        dense_lr=a.dense_lr,
        sparse_lr=a.sparse_lr,
        optimizer=a.optimizer,
        seed=a.seed,
        data=tuple(a.data),
        pipeline=not a.no_pipeline,
        resume=a.resume,
        checkpoint_every=a.checkpoint_every,
        log_every=a.log_every,
        gc_every=a.gc_every,
        batch_pool=a.batch_pool,
        regroup_backend=a.regroup_backend,
        graph_dense=not a.no_graph_dense,
        graph_step=not a.no_graph_step,
        prefetch_priority=a.prefetch_priority,
        data_workers=a.data_workers,
        graph_granularity=a.graph_granularity,
        device=a.device,
        eval_every=a.eval_every,
        eval_batches=a.eval_batches,
        eval_data=tuple(a.eval_data),
        eval_fraction=a.eval_fraction,
        auc_thresholds=a.auc_thresholds,
        progress=not a.no_progress,
        tensorboard=not a.no_tensorboard,
        log_all_ranks=a.log_all_ranks,
    )


def validate(config: TrainConfig, *, check_resume: bool = True) -> None:
    """Check the options before any process group or kernel exists (each rank gets the same answer).

    Raises:
        ArgumentError: a data path that is not a file, evaluation asked for without held-out data, a
            non-positive size.
        CheckpointError: ``resume`` (with ``check_resume``) and no checkpoint, or an incompatible one.
    """
    for flag, value in (
        ("--steps", config.steps),
        ("--batch-size", config.batch_size),
        ("--log-every", config.log_every),
    ):
        if value < 1:
            raise ArgumentError(f"`{flag}` is {value}, expected >= 1")
    if config.min_batch_size is not None and not 0 <= config.min_batch_size <= config.batch_size:
        raise ArgumentError(
            f"`--min-batch-size` is {config.min_batch_size}, expected 0..`--batch-size` ({config.batch_size})"
        )
    for flag, paths in (("--data", config.data), ("--eval-data", config.eval_data)):
        for path in paths:
            if not path.is_file():
                raise ArgumentError(f"`{flag}` names {str(path)!r}, which is not a file")
    if config.eval_fraction is not None:
        if not config.data:
            raise ArgumentError(
                "`--eval-fraction` holds out the last lines of the `--data` files, but no `--data` is given "
                "(synthetic runs hold out `--eval-batches` batches of their own)"
            )
        if not 0.0 <= config.eval_fraction < 1.0:
            raise ArgumentError(f"`--eval-fraction` is {config.eval_fraction}, expected 0 <= f < 1")
    if config.prefetch_priority not in ("high", "default"):
        raise ArgumentError(
            f"`--prefetch-priority` is {config.prefetch_priority!r}, expected 'high' or 'default'"
        )
    if config.gc_every < 0:
        raise ArgumentError(
            f"`--gc-every` is {config.gc_every}, expected >= 0 (0: Python's automatic collection)"
        )
    if config.eval_every < 0 or config.eval_batches < 0:
        raise ArgumentError(
            f"`--eval-every` ({config.eval_every}) and `--eval-batches` ({config.eval_batches}) must be >= 0"
        )
    if config.eval_every > 0 and not config.evaluates:
        source = "`--eval-fraction` is 0 and no `--eval-data`" if config.data else "`--eval-batches` is 0"
        raise ArgumentError(
            f"`--eval-every {config.eval_every}` asks for evaluations, but there is no held-out data ({source})"
        )
    if config.eval_every > 0 and not _has_torchmetrics():
        raise ArgumentError(
            f"`--eval-every {config.eval_every}` needs torchmetrics, which is not installed "
            "(pip install -r examples/dlrm/requirements.txt)"
        )
    if config.resume and check_resume:
        read_meta(config.out, config.model_config())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _report(error: DLRMError) -> int:
    """One line on stderr (from the first rank only) instead of a traceback; exit status 2."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=sys.stderr)
    return 2


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one torchrun worker (``@record``: a failing rank's traceback goes to torchrun's error file)."""
    config = parse_args(argv)
    try:
        validate(config)
    except DLRMError as error:
        return _report(error)
    setup_logging(int(os.environ.get("RANK", "0")), all_ranks=config.log_all_ranks)
    backend = "nccl" if _device(config).type == "cuda" else "gloo"
    timeout = dt.timedelta(seconds=120)
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group(backend=backend, timeout=timeout)
    else:  # a plain `python -m examples.dlrm.train`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group(backend=backend, rank=0, world_size=1, timeout=timeout)
    try:
        train(config, rank=dist.get_rank(), world_size=dist.get_world_size())
    except DLRMError as error:
        return _report(error)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
