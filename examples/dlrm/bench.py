"""Our DLRM trainer against torchrec's on the same model, tables, optimizer and batches, on one or more ranks.

    python -m examples.dlrm.bench --device cuda --json docs/bench/examples-dlrm-h200.json --plot out.png
    torchrun --standalone --nproc-per-node 2 -m examples.dlrm.bench --device cpu --json out.json

Rows (``--impls``): ``ours-pipelined`` and ``ours-plain`` (every table in a TBE: fbgemm's on CUDA; on one GPU the
whole step is a CUDA graph replay), ``ours-plain-dense-graphs`` (CUDA, not a default row: the plain loop with only
the dense part graphed, ``--no-graph-step``), ``ours-kv``
(pipelined, Criteo's five large tables in key-value tables on RocksDB; on one GPU the whole step a CUDA graph
replay, the key-value rows prefetched one batch ahead), ``ours-kv-no-graph-step`` (CUDA, not a default row: the
same with the eager step), ``ours-kv-plain`` (not a default row: the key-value run in a plain loop, no
pipeline: each forward fetches its own rows, which shows what the pipeline's stages cost where nothing
overlaps, as on CPU), ``torchrec-pipeline``
(``DistributedModelParallel`` + ``TrainPipelineSparseDist``, CUDA only: its pipeline needs streams),
``torchrec-plain`` (``DistributedModelParallel`` in a plain loop) and ``torchrec-plain-cat`` (the same, its
interaction input a ``torch.cat`` of the dense output and the pooled ``KeyedTensor``'s values in the shards'
feature order, as torchrec's own DLRM does, instead of ``KTRegroupAsDict``, whose fbgemm-gpu-cpu
``permute_multi_embedding`` takes 10-25 ms a call on CPU; a default row on CPU only). torchrec gets the same 26
tables (fused row-wise Adagrad in its TBEs), the same bottom MLP / interaction / top MLP modules, the same dense
Adagrad and the same synthetic batches (a pool cycled, as the trainer's ``--batch-pool``). torchrec is a benchmark-only
dependency: when it does not import, its rows are reported as skipped.

Each run trains ``warmup + steps + profile_steps`` steps. Throughput: a device sync after step ``warmup`` and after
step ``warmup + steps`` (counted at the dense optimizer's step), samples of those steps over the wall time between.
GPU busy: a torch.profiler window over the next ``profile_steps`` steps, the union of kernel / memcpy / memset
intervals over the window's wall time (the profiler's host cost stretches those steps, so this fraction is low),
and that GPU time per step over the step time measured without the profiler (``gpu_busy_unprofiled``).
Implementations run interleaved, ``--reps`` times, the order rotated by one each rep (the first run in a process
is the slowest: measured on the 2-rank CPU run, a row run first lost up to a third of its samples/s); medians are
reported.

Under torchrun (``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` set) every rank trains on its own batches (the
trainer's synthetic stream of that rank), torchrec's planner gets a topology of the world size, and the
throughput is the samples of all ranks over the slowest rank's window; rank 0 prints and writes the JSON. Without
torchrun the bench is a world of one (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from examples.dlrm.collector import StepCollector
from examples.dlrm.data import SPARSE_FEATURES, DLRMBatch, SyntheticCriteo
from examples.dlrm.model import MLP, DLRMHead
from examples.dlrm.train import TrainConfig, dense_optimizer, train

__all__ = ["main"]

ALL_IMPLS = (
    "ours-pipelined",
    "ours-plain",
    "ours-kv",
    "torchrec-pipeline",
    "torchrec-plain",
    "torchrec-plain-cat",
    "ours-plain-dense-graphs",
    "ours-kv-no-graph-step",
    "ours-kv-default-priority",
    "ours-kv-plain",
)
CUDA_IMPLS = ALL_IMPLS[:5]  # the default rows on CUDA (torchrec's regroup kernel is fast there)
CPU_IMPLS = tuple(
    i for i in ALL_IMPLS[:6] if i != "torchrec-pipeline"
)  # torchrec's pipeline needs CUDA streams
NUM_DENSE = 13
NO_KV = 10**15  # a key-value row threshold no table reaches: every table in a TBE


@dataclass
class _Window:
    """Step counter fed by the dense optimizer's step: throughput window, then a profiler window."""

    warmup: int
    steps: int
    profile_steps: int
    cuda: bool
    count: int = 0
    t0: float = 0.0
    t1: float = 0.0
    profiler: Any = None
    trace: str = ""

    def on_step(self) -> None:
        self.count += 1
        if self.count == self.warmup:
            self._sync()
            self.t0 = time.perf_counter()
        elif self.count == self.warmup + self.steps:
            self._sync()
            self.t1 = time.perf_counter()
            if self.cuda and self.profile_steps:
                self.profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                self.profiler.start()
        elif self.profiler is not None and self.count == self.warmup + self.steps + self.profile_steps:
            self._sync()
            self.profiler.stop()
            handle, self.trace = tempfile.mkstemp(suffix=".json")
            os.close(handle)
            self.profiler.export_chrome_trace(self.trace)
            self.profiler = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _keep_trace(trace: str, to: Path) -> None:
    """A gzipped copy of the profiler window's trace (for Perfetto or a per-kernel breakdown)."""
    to.parent.mkdir(parents=True, exist_ok=True)
    with open(trace, "rb") as src, gzip.open(to, "wb") as dst:
        shutil.copyfileobj(src, dst)


def _gpu_busy(trace: str) -> tuple[float, float]:
    """The union of GPU kernel / memcpy / memset intervals: as a fraction of the span of the trace's GPU and
    CPU-op events, and in milliseconds (summed over the window's steps)."""
    if not trace:
        return float("nan"), float("nan")
    opener = gzip.open if trace.endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    os.unlink(trace)
    gpu = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    cpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "cpu_op"]
    if not gpu or not cpu:
        return float("nan"), float("nan")
    start = min(a for a, _ in cpu)
    end = max(max(b for _, b in cpu), gpu[-1][1])
    busy, cur_a, cur_b = 0.0, gpu[0][0], gpu[0][1]
    for a, b in gpu[1:]:
        if a > cur_b:
            busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    return float(busy / max(end - start, 1e-9)), busy / 1000.0


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Model and batch shape shared by every implementation."""

    device: str
    batch_size: int
    min_batch_size: int
    embedding_dim: int
    batch_pool: int
    max_rows: int
    kv_max_rows: int
    cache_rows: int
    host_cache_rows: int
    kv_device_cache: bool
    warmup: int
    steps: int
    profile_steps: int
    out: Path
    rank: int = 0
    world_size: int = 1
    tbe: str = "auto"
    trace_dir: Path | None = None

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps + self.profile_steps + 4  # pipelines look ahead a few batches

    def train_config(self, *, pipeline: bool, kv: bool, graph_step: bool = True) -> TrainConfig:
        return TrainConfig(
            out=self.out,
            steps=self.total_steps,
            batch_size=self.batch_size,
            min_batch_size=self.min_batch_size,
            embedding_dim=self.embedding_dim,
            max_rows=self.max_rows,
            kv_max_rows=self.kv_max_rows,
            kv_rows_threshold=TrainConfig(out=self.out).kv_rows_threshold if kv else NO_KV,
            cache_rows=self.cache_rows,
            host_cache_rows=self.host_cache_rows,
            kv_device_cache=self.kv_device_cache,
            tbe=self.tbe,
            kv_store="rocksdb",
            batch_pool=self.batch_pool,
            pipeline=pipeline,
            graph_step=graph_step,
            log_every=10**9,
            eval_batches=0,  # throughput only: no held-out evaluation at the end
            device=self.device,
        )


def _run_window(bench: BenchConfig, body: Callable[[], list[int]]) -> dict[str, float]:
    """Run ``body`` (it trains and returns the batch size of every step) under a fresh step window."""
    window = _Window(bench.warmup, bench.steps, bench.profile_steps, cuda=bench.device.startswith("cuda"))

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if type(opt) is torch.optim.Adagrad:  # the dense optimizer: one step per training step
            window.on_step()

    handle = register_optimizer_step_post_hook(hook)
    try:
        sizes = body()
    finally:
        handle.remove()
    samples = float(sum(sizes[bench.warmup : bench.warmup + bench.steps]))
    seconds = window.t1 - window.t0
    if bench.world_size > 1:  # samples of all ranks over the slowest rank's window
        on = torch.device("cuda", torch.cuda.current_device()) if window.cuda else torch.device("cpu")
        total = torch.tensor([samples], dtype=torch.float64, device=on)
        slowest = torch.tensor([seconds], dtype=torch.float64, device=on)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        samples, seconds = float(total.item()), float(slowest.item())  # after the window: off the timed steps
    if bench.trace_dir is not None and window.trace and bench.rank == 0:
        _keep_trace(window.trace, bench.trace_dir / f"{bench.out.name}-trace.json.gz")
    busy, busy_ms = _gpu_busy(window.trace)
    ms_per_step = 1000.0 * seconds / bench.steps
    gpu_ms = busy_ms / bench.profile_steps if bench.profile_steps else float("nan")
    return {
        "qps": samples / seconds if seconds > 0 else float("nan"),
        "ms_per_step": ms_per_step,
        # Busy fraction of the profiled steps (the profiler's own host cost stretches them) ...
        "gpu_busy": busy,
        # ... and the GPU time per step over the step time measured without the profiler.
        "gpu_ms_per_step": gpu_ms,
        "gpu_busy_unprofiled": gpu_ms / ms_per_step if ms_per_step > 0 else float("nan"),
    }


def _ours(
    bench: BenchConfig, *, pipeline: bool, kv: bool, graph_step: bool = True, priority: str = "high"
) -> list[int]:
    config = replace(
        bench.train_config(pipeline=pipeline, kv=kv, graph_step=graph_step), prefetch_priority=priority
    )
    result = train(config, rank=bench.rank, world_size=bench.world_size)
    return list(result.samples)


def _pool(bench: BenchConfig) -> list[DLRMBatch]:
    config = bench.train_config(pipeline=False, kv=False)
    rank, world = bench.rank, bench.world_size
    source = SyntheticCriteo(config.synthetic(rank, world), rank=rank, world_size=world)
    return [source.batch(i) for i in range(min(bench.batch_pool, bench.total_steps))]


def _torchrec(bench: BenchConfig, *, pipeline: bool, cat: bool = False) -> list[int]:
    """torchrec's DistributedModelParallel over the same tables, modules, optimizers and batches.

    ``cat``: the interaction input is ``torch.cat`` of the dense output and the pooled values instead of
    ``KTRegroupAsDict``, as torchrec's own DLRM reads its ``SparseArch``: the same work and model shape, the
    features in the order of the shards (rank 0's tables first) rather than in Criteo's order.
    """
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.modules.regroup import KTRegroupAsDict
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    device = torch.device(bench.device)
    if device.type == "cuda" and bench.world_size > 1:
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU (set from LOCAL_RANK)
    config = bench.train_config(pipeline=False, kv=False)
    rows = config.embedding_config(1).table_rows
    dim = bench.embedding_dim
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=r, feature_names=[f])
            for f, r in zip(SPARSE_FEATURES, rows, strict=True)
        ],
        device=torch.device("meta"),
    )

    class TorchrecDLRM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse_arch = ebc
            self.bottom = MLP(NUM_DENSE, [*config.bottom_layers, dim], final_relu=True, seed=config.seed)
            self.head = DLRMHead(
                num_embeddings=len(SPARSE_FEATURES) + 1,
                embedding_dim=dim,
                top_layers=config.top_layers,
                seed=config.seed + 1,
            )
            self.regroup = KTRegroupAsDict(groups=[["dense", *SPARSE_FEATURES]], keys=["interaction"])
            self.keys_checked = False

        def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
            dense = self.bottom(batch.dense_features)
            pooled = self.sparse_arch(batch.sparse_features)
            if cat:
                if not self.keys_checked:  # once: every feature, each `dim` wide (in the shards' order)
                    widths = set(pooled.length_per_key())
                    if sorted(pooled.keys()) != sorted(SPARSE_FEATURES) or widths != {dim}:
                        raise RuntimeError(
                            f"torchrec's pooled keys {pooled.keys()} (widths {widths}) do not fit"
                        )
                    self.keys_checked = True
                grouped = torch.cat([dense, pooled.values()], dim=1)  # [B, (1 + 26) * dim]
            else:
                dense_kt = KeyedTensor(keys=["dense"], length_per_key=[dim], values=dense)
                grouped = self.regroup([dense_kt, pooled])["interaction"]
            logits = self.head.logits(grouped)
            return F.binary_cross_entropy_with_logits(logits, batch.labels), logits.detach()

    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": config.sparse_lr})
    # Every table table-wise in a fused TBE (as ours): the planner alone picks data-parallel on one rank. On more
    # ranks the planner spreads the tables over them and DMP wraps the dense part in DDP, as ours does.
    unsharded = TorchrecDLRM()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=bench.world_size, compute_device=device.type),
        constraints={
            f"t_{f}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
            for f in SPARSE_FEATURES
        },
    )
    plan = planner.collective_plan(unsharded, [EmbeddingBagCollectionSharder()], dist.group.WORLD)
    model = DistributedModelParallel(unsharded, device=device, plan=plan)
    dense_params = [p for n, p in model.named_parameters() if "sparse_arch" not in n]
    optimizer = dense_optimizer(dense_params, lr=config.dense_lr)  # the same as ours

    def to_torchrec(b: DLRMBatch) -> Any:
        features = b.sparse_features
        kjt = KeyedJaggedTensor(
            keys=list(features.keys()),
            values=features.values(),
            lengths=features.lengths(),
            stride=b.batch_size,
        )
        out = Batch(dense_features=b.dense_features, sparse_features=kjt, labels=b.labels)
        return out.pin_memory() if device.type == "cuda" else out

    pool = [to_torchrec(b) for b in _pool(bench)]
    sizes = [int(pool[i % len(pool)].labels.shape[0]) for i in range(bench.total_steps)]

    def batches() -> Iterator[Any]:
        for i in range(bench.total_steps):
            yield pool[i % len(pool)]

    # The garbage collector on the same schedule as our trainer's (frozen setup, young generations every
    # `gc_every` steps), so that neither side's timed steps take a full collection the other is spared.
    collector = StepCollector(config.gc_every)
    collector.start()
    try:
        if pipeline:
            from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

            pipe = TrainPipelineSparseDist(model, optimizer, device)
            it = batches()
            step = 0
            try:
                while True:
                    pipe.progress(it)
                    step += 1
                    collector.after_step(step)
            except StopIteration:
                pass
        else:
            model.train()
            for step, b in enumerate(batches(), start=1):
                b = b.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss, _ = model(b)
                loss.backward()
                optimizer.step()
                collector.after_step(step)
    finally:
        collector.stop()
    return sizes


def _run(bench: BenchConfig, impl: str) -> list[int]:
    if impl == "ours-pipelined":
        return _ours(bench, pipeline=True, kv=False)
    if impl == "ours-plain":
        return _ours(bench, pipeline=False, kv=False)
    if impl == "ours-kv":
        return _ours(bench, pipeline=True, kv=True)
    if impl == "ours-plain-dense-graphs":
        return _ours(bench, pipeline=False, kv=False, graph_step=False)
    if impl == "ours-kv-no-graph-step":
        return _ours(bench, pipeline=True, kv=True, graph_step=False)
    if impl == "ours-kv-plain":
        return _ours(bench, pipeline=False, kv=True)
    if impl == "ours-kv-default-priority":
        return _ours(bench, pipeline=True, kv=True, priority="default")
    if impl == "torchrec-pipeline":
        return _torchrec(bench, pipeline=True)
    if impl == "torchrec-plain":
        return _torchrec(bench, pipeline=False)
    if impl == "torchrec-plain-cat":
        return _torchrec(bench, pipeline=False, cat=True)
    raise ValueError(f"`impl` is {impl!r}, expected one of {', '.join(ALL_IMPLS)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m examples.dlrm.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--impls",
        default="",
        help=f"comma-separated subset of {','.join(ALL_IMPLS)} "
        f"(default on CUDA: {','.join(CUDA_IMPLS)}; on CPU: {','.join(CPU_IMPLS)})",
    )
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--min-batch-size", type=int, default=4096)
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--batch-pool", type=int, default=32)
    p.add_argument("--max-rows", type=int, default=20_000)
    p.add_argument("--kv-max-rows", type=int, default=10_000_000)
    p.add_argument("--cache-rows", type=int, default=65536)
    p.add_argument("--host-cache-rows", type=int, default=0)
    p.add_argument(
        "--kv-device-cache",
        action="store_true",
        help="key-value tables on the device-managed cache on CPU too",
    )
    p.add_argument(
        "--tbe", choices=["auto", "fbgemm", "torch"], default="auto", help="our in-memory tables' kernel"
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--trace-dir", type=Path, help="keep each run's profiler trace here (gzipped, rank 0)")
    p.add_argument("--notes", default="", help="free text for the JSON's `notes` (machine load, versions)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    impls = [i for i in args.impls.split(",") if i] or list(CUDA_IMPLS if cuda else CPU_IMPLS)
    unknown = [i for i in impls if i not in ALL_IMPLS]
    if unknown:
        print(f"error: `--impls` names {', '.join(unknown)}; expected some of {', '.join(ALL_IMPLS)}")
        return 2
    if args.device == "cpu" and "torchrec-pipeline" in impls:
        impls.remove("torchrec-pipeline")  # torchrec's pipeline needs CUDA streams
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun: env:// rendezvous
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        else:  # a plain `python -m examples.dlrm.bench`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29561")
            dist.init_process_group(backend, rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    lead = rank == 0  # only rank 0 prints and writes
    try:
        import torchrec  # noqa: F401
    except Exception as exc:  # any import failure (missing, ABI mismatch): its rows are skipped
        if lead:
            print(f"torchrec does not import here ({type(exc).__name__}: {exc}); its rows are skipped")
        impls = [i for i in impls if not i.startswith("torchrec")]
    results: dict[str, list[dict[str, float]]] = {i: [] for i in impls}
    # One run folder for all ranks (the trainer's checkpoint and key-value folders are per run, not per rank).
    shared = [tempfile.mkdtemp(prefix="dlrm-bench-") if lead else ""]
    if world > 1:
        dist.broadcast_object_list(shared, src=0)
    tmp = shared[0]
    try:
        for rep in range(args.reps):
            shift = rep % len(impls)
            for impl in impls[shift:] + impls[:shift]:
                bench = BenchConfig(
                    device=args.device,
                    batch_size=args.batch_size,
                    min_batch_size=args.min_batch_size,
                    embedding_dim=args.embedding_dim,
                    batch_pool=args.batch_pool,
                    max_rows=args.max_rows,
                    kv_max_rows=args.kv_max_rows,
                    cache_rows=args.cache_rows,
                    host_cache_rows=args.host_cache_rows,
                    kv_device_cache=args.kv_device_cache,
                    tbe=args.tbe,
                    warmup=args.warmup,
                    steps=args.steps,
                    profile_steps=args.profile_steps,
                    out=Path(tmp) / f"{impl}-{rep}",
                    rank=rank,
                    world_size=world,
                    trace_dir=args.trace_dir,
                )
                row = _run_window(bench, functools.partial(_run, bench, impl))
                row["load_avg"] = os.getloadavg()[0]  # 1-minute load at the end of the run (shared machines)
                results[impl].append(row)
                if lead:
                    busy = (
                        f"gpu busy {row['gpu_busy']:.1%} (gpu {row['gpu_ms_per_step']:.2f} ms/step = "
                        f"{row['gpu_busy_unprofiled']:.1%} of the unprofiled step) "
                        if cuda
                        else ""
                    )
                    print(
                        f"rep {rep} {impl:18s} {row['qps']:>12,.0f} samples/s {row['ms_per_step']:8.2f} ms/step "
                        f"{busy}load {row['load_avg']:.1f}",
                        flush=True,
                    )
    finally:
        if world > 1:
            dist.barrier()
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
    if not lead:
        dist.destroy_process_group()
        return 0
    summary = [
        {
            "case": f"dlrm B{args.min_batch_size}-{args.batch_size} D{args.embedding_dim}"
            + (f" × {world} ranks" if world > 1 else ""),
            "impl": impl,
            "median_ms": statistics.median(r["ms_per_step"] for r in rows),
            "p10_ms": min(r["ms_per_step"] for r in rows),  # min / max of the reps (few reps: no quantiles)
            "p90_ms": max(r["ms_per_step"] for r in rows),
            "qps_median": round(statistics.median(r["qps"] for r in rows)),
            "gpu_busy_median": round(statistics.median(r["gpu_busy"] for r in rows), 3) if cuda else None,
            "gpu_ms_per_step_median": round(statistics.median(r["gpu_ms_per_step"] for r in rows), 3)
            if cuda
            else None,
            "gpu_busy_unprofiled_median": round(statistics.median(r["gpu_busy_unprofiled"] for r in rows), 3)
            if cuda
            else None,
            "load_avg_median": round(statistics.median(r["load_avg"] for r in rows), 1),
            "reps": len(rows),
        }
        for impl, rows in results.items()
    ]
    print(
        f"\n{'impl':18s} {'samples/s':>12s} {'ms/step':>8s} {'GPU busy':>8s} {'GPU ms':>7s} {'of step':>8s}"
    )
    for s in summary:
        if cuda:
            busy = f"{s['gpu_busy_median']:8.1%} {s['gpu_ms_per_step_median']:7.2f} {s['gpu_busy_unprofiled_median']:8.1%}"
        else:
            busy = f"{'-':>8s} {'-':>7s} {'-':>8s}"
        print(f"{s['impl']:18s} {s['qps_median']:>12,.0f} {s['median_ms']:8.2f} {busy}")
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    if world > 1:
        device_name = f"{world} ranks × {device_name} ({dist.get_backend()})"
    launcher = "python -m"
    if world > 1:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        nodes = "--standalone" if local == world else f"--nnodes {world // local}"
        launcher = f"torchrun {nodes} --nproc-per-node {local} -m"
    shown = list(sys.argv[1:] if argv is None else argv)
    if "--notes" in shown:  # the notes go to their own key
        del shown[shown.index("--notes") : shown.index("--notes") + 2]
    shown = [a for a in shown if not a.startswith("--notes=")]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "package": "examples-dlrm",
            "version": "examples",
            "date": time.strftime("%Y-%m-%d"),
            "command": f"{launcher} examples.dlrm.bench {shlex.join(shown)}",
            "device": device_name,
            "torch": torch.__version__,
            "results": summary,
        }
        if args.notes:
            payload["notes"] = args.notes
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.barh([str(s["impl"]) for s in summary], [float(str(s["qps_median"])) for s in summary])
        ax.set_xlabel("samples/s (median)")
        ax.set_title(f"DLRM training step, {device_name}")
        fig.tight_layout()
        fig.savefig(args.plot)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
