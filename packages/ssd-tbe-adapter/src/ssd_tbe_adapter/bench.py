"""Benchmark: a training step of key-value tables (RocksDB + cache) against an all-in-memory fbgemm TBE.

``python -m ssd_tbe_adapter.bench [--quick] [--device cpu|cuda] [--json PATH] [--plot PATH]``

Setup per case: ``T`` tables of ``N`` rows (ids ``0..N-1``, all pre-written to the store), ``D`` dims,
cache ``N / 10`` rows per table, ``B`` samples per feature with ``L`` Zipf(1.05) ids each (hot ids
scattered over the id space). A step is forward + backward (fused row-wise Adagrad) of the summed output.
Implementations, run interleaved step by step after a warm-up that fills the caches:

- ``fbgemm-tbe``: ``SplitTableBatchedEmbeddingBagsCodegen`` holding all rows in memory (when importable);
- ``kv-sync``: :class:`KeyValueEmbeddingBags` over ``RocksDBStore``, no prefetch (forward fetches misses);
- ``kv-prefetch``: the same with ``prefetch(batch i+1)`` issued before ``forward(batch i)`` (background
  thread), and the step's clock stopped only once that prefetch has finished too (no work leaks out of
  the timed region);
- ``kv-prefetch-io<n>``: ``kv-prefetch`` with the other ``io_threads`` setting: 2 when the store's default
  (half the cores, at most 4) is 1, else 1; shows what splitting large gets over I/O threads gives;
- ``kv-memstore-prefetch``: ``kv-prefetch`` over ``MemoryStore``: the module's own cost without RocksDB.

These four use the host-managed cache (``cache_on_device=False``). With the device-managed cache
(``cache_on_device=True``, the CUDA default: index, victims, pooling and optimizer on the device):

- ``kv-device-prefetch``: ``kv-prefetch`` (RocksDB, no DRAM tier);
- ``kv-device-memstore-prefetch``: the same over ``MemoryStore``;
- ``kv-device-dram-prefetch``: RocksDB behind a host-DRAM tier loaded with every row before the warm-up
  (``host_cache_rows`` = all rows of the tables), so in steady state no store traffic.

With ``--graphed`` (CUDA) two more rows and the TBE's own graphed row, each step recorded once in a CUDA graph
(forward + backward of the summed output, over static copies of the batch's ids and offsets: every batch of a
case has the same shape) and replayed:

- ``fbgemm-tbe-graphed``: the all-in-HBM TBE's step replayed (its host launch work gone: the like-for-like
  comparison for the graphed key-value rows);
- ``kv-device-dram-graphed`` / ``kv-device-memstore-graphed``: ``kv-device-dram-prefetch`` /
  ``kv-device-memstore-prefetch`` with the step replayed inside ``replaying`` and ``prefetch(batch k+1,
  complete=False)`` (its survey, on a prefetch stream) issued right after the replay, ``complete_prefetch()``
  (its sync and row moves) after that (the graphed trainer's order); re-recorded when
  ``captured_buffers()`` change.

With ``--pipelined`` (CUDA) these three issue ``prefetch(batch i+1)`` on a side stream after ``forward(batch i)``
and its backward are queued instead (a train pipeline's order: the prefetch can overlap the backward).

After those, without compute (host only):

- ``store-io-floor``: per step, exactly as many RocksDB rows read and written as ``kv-prefetch`` measured per
  step, and nothing else: per table one ``get`` of batch ``k``'s unique ids outside a fixed hot set (the
  table's ``N / 10`` most popular ids, an ideal static cache), topped up with its other unique ids when
  those are fewer, then one ``put`` writing back the rows read at step ``k - 1``. Its own store, prefilled
  like the others, with ``io_threads = min(4, cores)`` (I/O alone may use every core), ``warmup`` steps
  first. The lower bound of any design over this store at this shape; ``bound_vs_tbe`` =
  ``max(TBE, floor) / TBE`` is the best ``vs_tbe`` one could reach.
- ``store-get-<n>`` / ``store-put-<n>``: a RocksDB multi-get (``io_threads`` 1 against ``min(4, cores)``)
  and a ``WriteBatch`` put of ``n`` random existing ids, interleaved, on the floor's store.

With ``--store-io`` only the store's batched I/O is measured (see :func:`run_store_io`): per step one ``get`` and
one ``put`` of a miss-sized batch (16,384 random existing ids of one table, records of D64 fp32 weights plus
row-wise Adagrad state, 260 bytes), over ``RocksDBStore``, ``K`` RocksDB instances (``rocksdb-x<K>``) or
column families of one instance (``rocksdb-cf<K>``) read and written from ``K`` threads at once, and LMDB
(``lmdb``, ``lmdb-writemap``, ``lmdb-x2``: 2 environments from 2 threads; when the ``lmdb`` package imports),
each alone and again beside a pure-Python thread, whose
progress during the call (``python_progress``: 1.0 = not slowed, 0 = stopped) says whether the call holds
the GIL.

Times are host wall-clock per step (``torch.cuda.synchronize()`` at the end of a step on CUDA).
``peak_mem_bytes``: on CUDA the peak allocated device memory of the implementation's steps; on CPU the
resident embedding bytes (TBE: all rows and state; key-value: the cache).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import operator
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch

from ssd_tbe_adapter import _fbgemm
from ssd_tbe_adapter._module import KeyValueEmbeddingBags, TableSpec
from ssd_tbe_adapter._records import RecordLayout
from ssd_tbe_adapter._store import (
    MemoryStore,
    RocksDBStore,
    default_io_threads,
    encode_keys,
    encode_values,
    write_batch,
)
from ssd_tbe_adapter._version import __version__
from ssd_tbe_adapter.errors import StaleCaptureError, StoreCorruptError

__all__ = ["main"]

FLOOR = "store-io-floor"
MAX_IO_THREADS = max(2, min(4, os.cpu_count() or 2))
ALT_IO_THREADS = 2 if default_io_threads() == 1 else 1
VARIANT = f"kv-prefetch-io{ALT_IO_THREADS}"
DEVICE_ROWS = ("kv-device-prefetch", "kv-device-memstore-prefetch", "kv-device-dram-prefetch")
TBE_GRAPHED = "fbgemm-tbe-graphed"
KV_GRAPHED = {
    "kv-device-dram-graphed": "kv-device-dram-prefetch",
    "kv-device-memstore-graphed": "kv-device-memstore-prefetch",
}
_SEED = 1  # of the batches (and so of each table's hot set)


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One benchmark configuration."""

    tables: int
    rows: int
    dim: int
    batch: int
    pooling_factor: int
    zipf: float = 1.05
    cache_fraction: float = 0.1
    host_fraction: float = 1.0  # rows of the DRAM rows' tier, as a fraction of all rows
    prefill: bool = True  # write every row to the store first (else rows are created at first touch)
    warmup: int = 30
    steps: int = 30

    @property
    def name(self) -> str:
        """Short label."""
        return f"T{self.tables}-N{self.rows // 1000}k-D{self.dim}-B{self.batch}-L{self.pooling_factor}"


CASES = [Case(tables=4, rows=200_000, dim=64, batch=1024, pooling_factor=16)]
QUICK = [Case(tables=2, rows=20_000, dim=32, batch=256, pooling_factor=8, warmup=10, steps=10)]
# Issue 19's large shape: 4 x 5M rows, HBM cache 1%, DRAM tier 10%; rows created at first touch (a prefill of
# 20M rows would take minutes).
LARGE = [
    Case(
        tables=4,
        rows=5_000_000,
        dim=64,
        batch=1024,
        pooling_factor=16,
        cache_fraction=0.01,
        host_fraction=0.1,
        prefill=False,
        warmup=60,
    )
]


def _permutations(case: Case, rng: np.random.Generator) -> list[np.ndarray[Any, np.dtype[np.int64]]]:
    """Per table, the id of each Zipf rank (rank 0 the most popular): hot ids scattered over the id space,
    as real feature ids are. The first draws of ``rng``."""
    return [rng.permutation(case.rows) for _ in range(case.tables)]


def _zipf_batches(case: Case, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of (indices, offsets): feature-major, fixed pooling factor, Zipf-ranked ids."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, case.rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks**-case.zipf)
    cdf /= cdf[-1]
    permutations = _permutations(case, rng)
    n = case.batch * case.pooling_factor
    offsets = torch.arange(0, case.tables * n + 1, case.pooling_factor, dtype=torch.int64)
    batches = []
    for _ in range(count):
        parts = [perm[np.searchsorted(cdf, rng.random(n))] for perm in permutations]
        batches.append((torch.from_numpy(np.concatenate(parts)).to(torch.int64), offsets))
    return batches


def _prefill(store: RocksDBStore | MemoryStore, module: KeyValueEmbeddingBags, case: Case) -> None:
    """Write every row (its deterministic initial value, zero state) so reads really go to RocksDB."""
    chunk = 50_000
    for table in range(case.tables):
        for start in range(0, case.rows, chunk):
            ids = torch.arange(start, min(start + chunk, case.rows), dtype=torch.int64)
            weights, state = module._tier.read_rows(table, ids)
            store.put(ids, module._tier.layout.encode(table, weights, state), table=table)
    store.flush()
    module.reset_metrics()


def _fill_dram(module: KeyValueEmbeddingBags, case: Case) -> None:
    """Load every row into the module's host-DRAM tier (it holds all rows the device cache does not)."""
    path = module._device_path
    assert path is not None
    chunk = 50_000
    for table in range(case.tables):
        for start in range(0, case.rows, chunk):
            path.load_host_tier(table, torch.arange(start, min(start + chunk, case.rows), dtype=torch.int64))
    module.reset_metrics()


def _timed(device: torch.device, step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


class _GraphedStep:
    """One implementation's step recorded once in a CUDA graph and replayed (``--graphed``).

    ``body(ids, offsets)`` (forward + backward) is recorded over static copies of the first batch's ids and
    offsets on a side stream, without cyclic GC (a graph dropped mid-capture would void it); each step copies
    its batch into them and replays. With a key-value ``module`` the replay runs inside ``replaying`` (which
    hands the batch's prefetched slots to the graph) and is recorded again when the module's
    ``captured_buffers()`` are other tensors than at the capture (its scratch pool grew).
    """

    def __init__(
        self,
        device: torch.device,
        body: Callable[[torch.Tensor, torch.Tensor], None],
        module: KeyValueEmbeddingBags | None = None,
    ) -> None:
        self._device = device
        self._body = body
        self._module = module
        self._graph: Any = None
        self._static: tuple[torch.Tensor, torch.Tensor] | None = None
        self._buffers: list[int] = []
        self._old: list[Any] = []  # replaced graphs stay alive (see above)
        self.captures = 0

    def _capture(self, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        if self._graph is not None:
            self._old.append(self._graph)
        self._static = (indices.clone(), offsets.clone())
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        side.wait_stream(torch.cuda.current_stream(self._device))
        torch.cuda.synchronize(self._device)
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(graph, stream=side):
                self._body(*self._static)
        finally:
            gc.enable()
        self._graph = graph
        self._buffers = self._addresses()
        self.captures += 1

    def _addresses(self) -> list[int]:
        return [] if self._module is None else [t.data_ptr() for t in self._module.captured_buffers()]

    def __call__(
        self, indices: torch.Tensor, offsets: torch.Tensor, then: Callable[[], None] | None = None
    ) -> None:
        """Replay the step of ``(indices, offsets)``; ``then()`` runs right after the replay was issued (inside
        ``replaying``: the batch's rows still held)."""
        for _ in range(2):
            if self._graph is None or self._buffers != self._addresses():
                self._capture(indices, offsets)
            assert self._static is not None
            self._static[0].copy_(indices)
            self._static[1].copy_(offsets)
            if self._module is None:
                self._graph.replay()
                if then is not None:
                    then()
                return
            try:
                with self._module.replaying(indices, offsets):
                    self._graph.replay()
                    if then is not None:
                        then()
                return
            except StaleCaptureError:  # staging grew the cache: the batch stays pending, record again
                self._buffers = []  # the next pass records again
        raise StaleCaptureError(
            "the key-value module's cache grew twice for one batch: `--graphed` cannot record it"
        )


def run_case(
    case: Case,
    device: torch.device,
    workdir: Path,
    only: set[str] | None = None,
    *,
    pipelined: bool = False,
    graphed: bool = False,
) -> list[dict[str, Any]]:
    """Every implementation of one case (or those named in ``only``), interleaved; one result row each.

    ``graphed`` (CUDA): also the rows of :class:`_GraphedStep` (the TBE's and two key-value rows).

    ``pipelined`` (CUDA): the device-cache rows issue ``prefetch(batch k+1)`` on a side stream *after*
    ``forward(batch k)`` and its backward are queued on the current stream, as a train pipeline's prefetch
    stage does, so that the prefetch's host work can overlap the backward on the GPU (same work per step)."""
    torch.manual_seed(0)
    batches = _zipf_batches(case, case.warmup + case.steps + 1, seed=_SEED)
    batches = [(i.to(device), o.to(device)) for i, o in batches]
    specs = [TableSpec(f"t{t}", case.dim) for t in range(case.tables)]
    cache_rows = int(case.rows * case.cache_fraction)
    impls: dict[str, Callable[[int], None]] = {}
    resident: dict[str, int] = {}
    modules: dict[str, KeyValueEmbeddingBags] = {}

    fbgemm = _fbgemm.load()
    if fbgemm is not None:
        location = fbgemm.location.DEVICE if device.type == "cuda" else fbgemm.location.HOST
        compute = fbgemm.compute_device.CUDA if device.type == "cuda" else fbgemm.compute_device.CPU
        tbe = fbgemm.codegen(
            [(case.rows, case.dim, location, compute)] * case.tables,
            optimizer=fbgemm.optim_type.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.01,
            eps=1e-8,
            device=device,
        )

        def tbe_step(k: int) -> None:
            indices, offsets = batches[k]
            tbe(indices, offsets).sum().backward()

        impls["fbgemm-tbe"] = tbe_step
        resident["fbgemm-tbe"] = case.tables * case.rows * (case.dim + 1) * 4
        if graphed:
            graphed_tbe = fbgemm.codegen(
                [(case.rows, case.dim, location, compute)] * case.tables,
                optimizer=fbgemm.optim_type.EXACT_ROWWISE_ADAGRAD,
                learning_rate=0.01,
                eps=1e-8,
                device=device,
            )
            replay_tbe = _GraphedStep(device, lambda ids, offs: graphed_tbe(ids, offs).sum().backward())

            def tbe_graphed_step(k: int) -> None:
                if k < 3:  # eager first: the TBE allocates its workspaces lazily
                    graphed_tbe(*batches[k]).sum().backward()
                else:
                    replay_tbe(*batches[k])

            impls[TBE_GRAPHED] = tbe_graphed_step
            resident[TBE_GRAPHED] = resident["fbgemm-tbe"]

    io_threads = {VARIANT: ALT_IO_THREADS, FLOOR: MAX_IO_THREADS}
    names: tuple[str, ...] = (
        "kv-sync",
        "kv-prefetch",
        VARIANT,
        "kv-memstore-prefetch",
        *DEVICE_ROWS,
        *(KV_GRAPHED if graphed else ()),
        FLOOR,
    )
    if only is not None:  # the floor replays kv-prefetch's store traffic: it needs that row
        names = tuple(n for n in names if n in only and (n != FLOOR or "kv-prefetch" in only))
    for name in names:
        store: RocksDBStore | MemoryStore = (
            MemoryStore()
            if "memstore" in name
            else RocksDBStore(workdir / name, io_threads=io_threads.get(name))
        )
        module = KeyValueEmbeddingBags(
            specs,
            None,
            store,
            cache_rows=cache_rows,
            optimizer="rowwise_adagrad",
            learning_rate=0.01,
            device=device,
            cache_on_device=name in DEVICE_ROWS or name in KV_GRAPHED,
            host_cache_rows=int(case.tables * case.rows * case.host_fraction) if "dram" in name else 0,
        )
        if case.prefill:
            _prefill(store, module, case)
        if "dram" in name and case.host_fraction >= 1:
            _fill_dram(module, case)
        modules[name] = module
        resident[name] = case.tables * cache_rows * (case.dim + 1) * 4

    def sync_step(k: int) -> None:
        indices, offsets = batches[k]
        modules["kv-sync"](indices, offsets).sum().backward()

    side = torch.cuda.Stream(device) if pipelined and device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def prefetch_step(name: str, k: int) -> None:
        module = modules[name]
        indices, offsets = batches[k]
        if side is not None and name in DEVICE_ROWS:
            module(indices, offsets).sum().backward()
            with torch.cuda.stream(side):
                module.prefetch(*batches[k + 1])
            module.wait_prefetch()
            return
        module.prefetch(*batches[k + 1])
        module(indices, offsets).sum().backward()
        module.wait_prefetch()

    replays: dict[str, _GraphedStep] = {}
    prefetch_stream = None
    if graphed and device.type == "cuda":
        prefetch_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        prefetch_stream.wait_stream(torch.cuda.current_stream(device))  # the batches are on the device

    def graphed_step(name: str, k: int) -> None:
        # The trainer's order: batch k's replay, then batch k+1's survey on its own stream (beside the replay
        # on the GPU), then the prefetch's sync and row moves (which wait for the replay on the device only).
        module = modules[name]
        if name not in replays:
            replays[name] = _GraphedStep(device, lambda ids, offs: module(ids, offs).sum().backward(), module)

        def survey_next() -> None:
            with torch.cuda.stream(prefetch_stream):
                module.prefetch(*batches[k + 1], complete=False)

        replays[name](*batches[k], then=survey_next)
        module.complete_prefetch()
        module.wait_prefetch()

    if "kv-sync" in modules:
        impls["kv-sync"] = sync_step
    for name in ("kv-prefetch", VARIANT, "kv-memstore-prefetch", *DEVICE_ROWS):
        if name not in modules:
            continue
        impls[name] = lambda k, name=name: prefetch_step(name, k)  # type: ignore[misc]
        modules[name].prefetch(*batches[0])
    for name in KV_GRAPHED:
        if name not in modules:
            continue
        impls[name] = lambda k, name=name: graphed_step(name, k)  # type: ignore[misc]
        modules[name].prefetch(*batches[0])

    times: dict[str, list[float]] = {name: [] for name in impls}
    peaks: dict[str, int] = dict.fromkeys(impls, 0)
    for k in range(case.warmup + case.steps):
        if k == case.warmup:
            for module in modules.values():
                module.reset_metrics()
        for name, step in impls.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            elapsed = _timed(device, lambda step=step, k=k: step(k))  # type: ignore[misc]
            if k >= case.warmup:
                times[name].append(elapsed)
                if device.type == "cuda":
                    peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device))
    extra: dict[str, dict[str, Any]] = {}
    micro: list[dict[str, Any]] = []
    if FLOOR in modules:
        floor = modules.pop(FLOOR)
        floor_store = cast(RocksDBStore, floor.store)
        metrics = modules["kv-prefetch"].metrics()
        reads, writes = (
            round(metrics["store_rows_read"] / case.steps),
            round(metrics["store_rows_written"] / case.steps),
        )
        times[FLOOR] = _store_io_floor(
            case, batches, floor_store, reads, writes, floor._layout.record_bytes[0]
        )
        resident[FLOOR] = 0
        extra[FLOOR] = {"store_rows_read_per_step": reads, "store_rows_written_per_step": writes}
        micro = _store_micro(case, floor_store, floor._layout.record_bytes[0])
        floor.close()
    results = []
    tbe_median = statistics.median(times["fbgemm-tbe"]) if "fbgemm-tbe" in times else None
    for name, samples in times.items():
        quantiles = np.percentile(samples, [10, 50, 90])
        row: dict[str, Any] = {
            "case": case.name,
            "impl": name,
            "median_ms": float(quantiles[1]),
            "p10_ms": float(quantiles[0]),
            "p90_ms": float(quantiles[2]),
            "peak_mem_bytes": peaks.get(name, 0) if device.type == "cuda" else resident[name],
            **extra.get(name, {}),
        }
        if tbe_median:
            row["vs_tbe"] = float(quantiles[1]) / tbe_median
            if name == FLOOR:
                row["bound_vs_tbe"] = max(tbe_median, float(quantiles[1])) / tbe_median
        if name in replays:
            row["captures"] = replays[name].captures
        if name in modules:
            m = modules[name].metrics()
            row["cache_hit_rate"] = m["cache_hit_rate"]
            row["forward_hit_rate"] = m["forward_hit_rate"]
            row["store_rows_written_per_step"] = m["store_rows_written"] / case.steps
            row["store_read_rows_per_s"] = m["store_read_rows_per_s"]
            row["store_write_rows_per_s"] = m["store_write_rows_per_s"]
            row["store_rows_read_per_step"] = m["store_rows_read"] / case.steps
            for key in ("hbm_hit_rate", "hbm_scratch_slots", "host_tier_hit_rate"):
                if key in m:
                    row[key] = m[key]
        results.append(row)
    for module in modules.values():
        module.close()
    return results + micro


def _store_io_floor(
    case: Case,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    store: RocksDBStore,
    reads: int,
    writes: int,
    record_bytes: int,
) -> list[float]:
    """Per-step times (ms) of ``reads`` rows read and ``writes`` written, split evenly over the tables, with
    the ids described in the module docstring (chosen before the clock starts); measured steps only."""
    hot = _hot_sets(case)
    n = case.batch * case.pooling_factor
    per_table_reads = [reads // case.tables + (t < reads % case.tables) for t in range(case.tables)]
    per_table_writes = [writes // case.tables + (t < writes % case.tables) for t in range(case.tables)]
    plan: list[list[torch.Tensor]] = []
    for indices, _ in batches[: case.warmup + case.steps]:
        ids = indices.cpu().numpy()
        step = []
        for t in range(case.tables):
            unique = np.unique(ids[t * n : (t + 1) * n])
            cold = unique[~np.isin(unique, hot[t])]
            if cold.shape[0] < per_table_reads[t]:  # top up with the batch's other ids
                cold = np.concatenate([cold, unique[np.isin(unique, hot[t])]])
            step.append(torch.from_numpy(np.sort(cold[: per_table_reads[t]])))
        plan.append(step)
    previous = [torch.zeros(0, dtype=torch.int64) for _ in range(case.tables)]
    previous_rows = [torch.empty(0, record_bytes, dtype=torch.uint8) for _ in range(case.tables)]
    times = []
    for k, step in enumerate(plan):
        start = time.perf_counter()
        for t, read_ids in enumerate(step):
            out = torch.empty(read_ids.numel(), record_bytes, dtype=torch.uint8)
            store.get(read_ids, out, table=t)
            count = min(per_table_writes[t], previous[t].numel())
            store.put(previous[t][:count], previous_rows[t][:count], table=t)
            previous[t], previous_rows[t] = read_ids, out
        elapsed = (time.perf_counter() - start) * 1e3
        if k >= case.warmup:
            times.append(elapsed)
    return times


def _hot_sets(case: Case) -> list[np.ndarray[Any, np.dtype[np.int64]]]:
    """Per table, the ids of its ``cache_rows`` lowest Zipf ranks (the permutations of :func:`_zipf_batches`)."""
    cache_rows = int(case.rows * case.cache_fraction)
    return [np.sort(perm[:cache_rows]) for perm in _permutations(case, np.random.default_rng(_SEED))]


def _store_micro(case: Case, store: RocksDBStore, record_bytes: int) -> list[dict[str, Any]]:
    """Multi-gets of ``n`` ids with one I/O thread and with the store's ``io_threads``, and puts, interleaved."""
    rng = np.random.default_rng(3)
    default_threads = store.io_threads
    results = []
    for n in (2560, 10240):
        samples: dict[str, list[float]] = {}
        for _ in range(5 + case.steps):
            ids = torch.from_numpy(np.sort(rng.choice(case.rows, n, replace=False)))
            out = torch.empty(n, record_bytes, dtype=torch.uint8)
            for threads in dict.fromkeys((1, default_threads)):
                store.io_threads = threads
                start = time.perf_counter()
                store.get(ids, out, table=0)
                samples.setdefault(f"get io_threads={threads}", []).append(
                    (time.perf_counter() - start) * 1e3
                )
            start = time.perf_counter()
            store.put(ids, out, table=0)
            samples.setdefault("put", []).append((time.perf_counter() - start) * 1e3)
        store.io_threads = default_threads
        for impl, values in samples.items():
            quantiles = np.percentile(values[5:], [10, 50, 90])
            results.append(
                {
                    "case": f"store-{impl.split()[0]}-{n}",
                    "impl": f"rocksdb {impl.split()[1]}" if " " in impl else "rocksdb",
                    "median_ms": float(quantiles[1]),
                    "p10_ms": float(quantiles[0]),
                    "p90_ms": float(quantiles[2]),
                    "peak_mem_bytes": 0,
                    "us_per_key": float(quantiles[1]) * 1e3 / n,
                }
            )
    return results


# --- store I/O alone (--store-io) ------------------------------------------------------------------------------

STORE_IO_SHARDS = (2, 4)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreIOCase:
    """One ``--store-io`` configuration: a table of ``rows`` records, batches of ``batch`` unique ids."""

    rows: int
    batch: int
    dim: int = 64
    warmup: int = 3
    steps: int = 15

    @property
    def record_bytes(self) -> int:
        """Bytes of one record: ``dim`` fp32 weights and one fp32 row-wise Adagrad state."""
        return RecordLayout([self.dim], torch.float32, 1).record_bytes[0]

    @property
    def name(self) -> str:
        """Short label."""
        return f"N{self.rows // 1000}k-B{self.batch}-R{self.record_bytes}"


# 4 tables x 200k rows of the step benchmark in one table; 16k ids: about what one kv-prefetch step misses.
STORE_IO_CASE = StoreIOCase(rows=800_000, batch=16_384)
STORE_IO_QUICK = StoreIOCase(rows=40_000, batch=4_096, warmup=2, steps=5)


class _BatchIO(Protocol):
    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor: ...

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None: ...

    def close(self) -> None: ...


class _Sharded:
    """``len(shards)`` stores holding the ids ``id % K == k``: a batch is split by shard (tensor ops) and each
    part read or written on its own thread (the caller takes shard 0). Not atomic across shards."""

    def __init__(self, shards: list[_BatchIO], *, owner: _ColumnFamilies | None = None) -> None:
        self._shards = shards
        self._owner = owner  # closed after the shards (the database of column families)
        self._pool = ThreadPoolExecutor(len(shards) - 1, thread_name_prefix="bench-shard")

    def _parts(self, ids: torch.Tensor) -> list[torch.Tensor]:
        shard = ids.remainder(len(self._shards))
        return [(shard == k).nonzero().flatten() for k in range(len(self._shards))]

    def _run(self, calls: list[Callable[[], object]]) -> list[object]:
        futures = [self._pool.submit(call) for call in calls[1:]]
        try:
            first = calls[0]()
        finally:
            wait(futures)
        return [first, *(future.result() for future in futures)]

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        parts = self._parts(ids)
        outs = [torch.empty(part.numel(), out.shape[1], dtype=torch.uint8) for part in parts]
        founds = self._run(
            [
                lambda s=store, p=part, o=o: s.get(ids[p], o, table=table)  # type: ignore[misc]
                for store, part, o in zip(self._shards, parts, outs, strict=True)
            ]
        )
        found = torch.empty(ids.numel(), dtype=torch.bool)
        for part, o, f in zip(parts, outs, founds, strict=True):
            out.index_copy_(0, part, o)
            found[part] = cast(torch.Tensor, f)
        return found

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        parts = self._parts(ids)
        self._run(
            [
                lambda s=store, p=part: s.put(ids[p], rows.index_select(0, p), table=table)  # type: ignore[misc]
                for store, part in zip(self._shards, parts, strict=True)
            ]
        )

    def close(self) -> None:
        self._pool.shutdown()
        for store in self._shards:
            store.close()
        if self._owner is not None:
            self._owner.close()


def _store_options(rocksdict: Any) -> Any:
    """``rocksdict.Options`` as :class:`RocksDBStore` sets them (raw keys, point lookups, no compression,
    mmap reads), for the bench's other RocksDB layouts."""
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    options.optimize_for_point_lookup(64)
    options.set_compression_type(rocksdict.DBCompressionType.none())
    options.set_allow_mmap_reads(True)
    return options


def _multi_get(db: Any, ids: torch.Tensor, out: torch.Tensor, table: int) -> torch.Tensor:
    """One multi-get of prefilled ``ids`` from ``db`` (an ``Rdict`` or a column family) into ``out``."""
    values: list[bytes | None] = db.get(encode_keys(table, ids.numpy()))
    out.numpy()[...] = np.frombuffer(b"".join(cast("list[bytes]", values)), np.uint8).reshape(out.shape)
    return torch.ones(ids.numel(), dtype=torch.bool)


class _ColumnFamilies:
    """One RocksDB instance (``rocksdict``, the options of :class:`RocksDBStore`) with ``K`` column families;
    the shard ``k`` of an id (``id % K``) lives in family ``k`` (one ``WriteBatch`` per family)."""

    def __init__(self, path: Path, families: int) -> None:
        import rocksdict

        self._rocksdict = rocksdict
        options = _store_options(rocksdict)
        self._db: Any = rocksdict.Rdict(str(path), options)
        self._families: list[Any] = [
            self._db.create_column_family(f"shard{k}", options) for k in range(families)
        ]
        self._handles: list[Any] = [self._db.get_column_family_handle(f"shard{k}") for k in range(families)]

    def shard(self, k: int) -> _BatchIO:
        """Column family ``k`` with the store methods."""
        return _Family(self._rocksdict, self._families[k], self._handles[k])

    def close(self) -> None:
        for family in self._families:
            family.close()
        self._db.close()


class _Family:
    """One column family of :class:`_ColumnFamilies` (``family``: its ``Rdict``, ``handle``: its handle)."""

    def __init__(self, rocksdict: Any, family: Any, handle: Any) -> None:
        self._rocksdict, self._family, self._handle = rocksdict, family, handle

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        return _multi_get(self._family, ids, out, table)

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        self._family.write(write_batch(self._rocksdict, table, ids.numpy(), rows, column_family=self._handle))

    def close(self) -> None:
        """The owner closes the database."""


class _SstIngest:
    """RocksDB (``rocksdict``, the options of :class:`RocksDBStore`) whose ``put`` writes the batch, sorted by
    key, into one SST file (``SstFileWriter``) and ingests it (``ingest_external_file``, files moved): no
    memtable insert and no write-ahead log per row; every put adds one level-0 file that background
    compactions merge. Gets are the plain multi-get."""

    def __init__(self, path: Path) -> None:
        import rocksdict

        self._rocksdict = rocksdict
        self._options = _store_options(rocksdict)
        self._db: Any = rocksdict.Rdict(str(path / "db"), self._options)
        self._ingest = rocksdict.IngestExternalFileOptions()
        self._ingest.set_move_files(True)
        self._files = path / "sst"
        self._files.mkdir(parents=True, exist_ok=True)
        self._written = 0

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        return _multi_get(self._db, ids, out, table)

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        order = np.argsort(ids.numpy(), kind="stable")  # one table: key order is id order (unique ids here)
        keys = encode_keys(table, ids.numpy()[order])
        values = encode_values(rows.index_select(0, torch.from_numpy(order)).contiguous())
        path = str(self._files / f"{self._written}.sst")
        self._written += 1
        writer = self._rocksdict.SstFileWriter(options=self._options)
        writer.open(path)
        for key, value in zip(keys, values, strict=True):
            writer[key] = value
        writer.finish()
        self._db.ingest_external_file([path], self._ingest)

    def close(self) -> None:
        self._db.close()


class _Lmdb:
    """LMDB (``lmdb`` package) with the store's key encoding: ``getmulti`` / ``putmulti`` over one cursor, one
    transaction per call, ``sync=False`` (a killed process loses no committed write; ``flush`` would fsync);
    ``writemap``: dirty pages written in place in the memory map instead of copied out at commit."""

    def __init__(self, path: Path, map_bytes: int, *, writemap: bool = False) -> None:
        import lmdb  # type: ignore[import-not-found,unused-ignore]

        self._env = lmdb.open(
            str(path), map_size=map_bytes, sync=False, readahead=False, max_readers=64, writemap=writemap
        )

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        with self._env.begin(buffers=False) as txn:
            pairs = txn.cursor().getmulti(encode_keys(table, ids.numpy()))
        if len(pairs) != ids.numel():
            raise StoreCorruptError(f"lmdb found {len(pairs)} of {ids.numel()} prefilled ids")
        blob = b"".join(map(operator.itemgetter(1), pairs))
        out.numpy()[...] = np.frombuffer(blob, np.uint8).reshape(out.shape)
        return torch.ones(ids.numel(), dtype=torch.bool)

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        keys = encode_keys(table, ids.numpy())
        values = encode_values(rows)
        with self._env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(keys, values, strict=True))

    def close(self) -> None:
        self._env.sync(True)
        self._env.close()


class _Probe:
    """A pure-Python thread counting loop iterations while :meth:`running`: how much Python work a concurrent
    thread gets done (it can only run while no other thread holds the GIL)."""

    def __init__(self) -> None:
        self.count = 0
        self._go = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        count = 0
        while not self._stop:
            self._go.wait()
            for _ in range(100):
                count += 1
            self.count = count

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        self._go.set()
        try:
            yield
        finally:
            self._go.clear()

    def close(self) -> None:
        self._stop = True
        self._go.set()
        self._thread.join()


def _store_io_impls(case: StoreIOCase, workdir: Path) -> dict[str, _BatchIO]:
    """The stores compared, each on its own directory under ``workdir``."""
    impls: dict[str, _BatchIO] = {"rocksdb": RocksDBStore(workdir / "rocksdb")}
    for k in STORE_IO_SHARDS:
        impls[f"rocksdb-x{k}"] = _Sharded(
            [RocksDBStore(workdir / f"rocksdb-x{k}" / str(i), io_threads=1) for i in range(k)]
        )
        families = _ColumnFamilies(workdir / f"rocksdb-cf{k}", k)
        impls[f"rocksdb-cf{k}"] = _Sharded([families.shard(i) for i in range(k)], owner=families)
    impls["rocksdb-sst"] = _SstIngest(workdir / "rocksdb-sst")
    try:
        importlib.import_module("lmdb")
    except ImportError:
        print("lmdb is not importable: its rows are left out")
    else:
        map_bytes = 4 * case.rows * (case.record_bytes + 64) + 2**26
        impls["lmdb"] = _Lmdb(workdir / "lmdb", map_bytes)
        impls["lmdb-writemap"] = _Lmdb(workdir / "lmdb-writemap", map_bytes, writemap=True)
        impls["lmdb-x2"] = _Sharded([_Lmdb(workdir / f"lmdb-x2-{i}", map_bytes) for i in range(2)])
    return impls


def run_store_io(case: StoreIOCase, workdir: Path) -> list[dict[str, Any]]:
    """Batched ``get`` and ``put`` of ``case.batch`` random existing ids over every store, interleaved per step
    (the order rotating), each alone and beside a :class:`_Probe` thread; medians over ``case.steps``."""
    impls = _store_io_impls(case, workdir)
    rng = np.random.default_rng(7)
    width = case.record_bytes
    chunk = 50_000
    for store in impls.values():  # every row exists: gets read the disk/page cache, puts overwrite
        for start in range(0, case.rows, chunk):
            ids = torch.arange(start, min(start + chunk, case.rows), dtype=torch.int64)
            store.put(ids, torch.from_numpy(rng.integers(0, 256, (ids.numel(), width), dtype=np.uint8)))
    for store in impls.values():
        flush = getattr(store, "flush", None)
        if flush is not None:
            flush()
    probe = _Probe()
    samples: dict[tuple[str, str], list[float]] = {}
    names = list(impls)
    try:
        for step in range(case.warmup + case.steps):
            batches = [
                torch.from_numpy(np.sort(rng.choice(case.rows, case.batch, replace=False))) for _ in range(2)
            ]
            rows = torch.from_numpy(rng.integers(0, 256, (case.batch, width), dtype=np.uint8))
            out = torch.empty(case.batch, width, dtype=torch.uint8)
            # The probe's pace alone (the main thread asleep), as the reference for this step.
            with probe.running():
                before, began = probe.count, time.perf_counter()
                time.sleep(0.02)
                alone = (probe.count - before) / (time.perf_counter() - began)
            for name in names[step % len(names) :] + names[: step % len(names)]:
                store = impls[name]
                for op in ("get", "put"):
                    for beside, ids in ((False, batches[0]), (True, batches[1])):
                        with probe.running() if beside else contextlib.nullcontext():
                            before, began = probe.count, time.perf_counter()
                            if op == "get":
                                store.get(ids, out)
                            else:
                                store.put(ids, rows)
                            elapsed = time.perf_counter() - began
                            progress = (probe.count - before) / elapsed / alone
                        if step >= case.warmup:
                            key = (name, f"{op}-beside-python" if beside else op)
                            samples.setdefault(key, []).append(elapsed * 1e3)
                            if beside:
                                samples.setdefault((name, f"{op}-progress"), []).append(progress)
            if step == case.warmup - 1:
                print(f"store-io: warm-up done ({len(names)} stores)")
    finally:
        probe.close()
        for store in impls.values():
            store.close()
    results = []
    for name in names:
        for op in ("get", "put"):
            quantiles = np.percentile(samples[(name, op)], [10, 50, 90])
            beside_ms = statistics.median(samples[(name, f"{op}-beside-python")])
            results.append(
                {
                    "case": f"store-io-{op}-{case.name}",
                    "impl": name,
                    "median_ms": float(quantiles[1]),
                    "p10_ms": float(quantiles[0]),
                    "p90_ms": float(quantiles[2]),
                    "peak_mem_bytes": 0,
                    "us_per_row": float(quantiles[1]) * 1e3 / case.batch,
                    "median_ms_beside_python": beside_ms,
                    # Pure-Python work another thread got done during the call, against alone (1.0: not slowed).
                    "python_progress": statistics.median(samples[(name, f"{op}-progress")]),
                }
            )
    return results


def _print_store_io(results: list[dict[str, Any]]) -> None:
    header = f"{'case':<34} {'impl':<12} {'median ms':>10} {'p10':>8} {'p90':>8} {'us/row':>7} {'ms beside py':>13} {'py progress':>12}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['case']:<34} {r['impl']:<12} {r['median_ms']:>10.2f} {r['p10_ms']:>8.2f} {r['p90_ms']:>8.2f} "
            f"{r['us_per_row']:>7.2f} {r['median_ms_beside_python']:>13.2f} {r['python_progress']:>12.2f}"
        )


def _print_table(results: list[dict[str, Any]], device: torch.device) -> None:
    header = f"{'case':<28} {'impl':<20} {'median ms':>10} {'p10':>8} {'p90':>8} {'vs TBE':>7} {'hit rate':>9} {'store rows/s':>13} {'mem MiB':>8}"
    print(f"device: {device}, torch {torch.__version__}")
    print(header)
    print("-" * len(header))
    for r in results:
        vs = f"{r['vs_tbe']:.2f}x" if "vs_tbe" in r else "-"
        hit = f"{r['cache_hit_rate']:.3f}" if "cache_hit_rate" in r else "-"
        rate = f"{r['store_read_rows_per_s']:.0f}" if "store_read_rows_per_s" in r else "-"
        print(
            f"{r['case']:<28} {r['impl']:<20} {r['median_ms']:>10.2f} {r['p10_ms']:>8.2f} {r['p90_ms']:>8.2f} "
            f"{vs:>7} {hit:>9} {rate:>13} {r['peak_mem_bytes'] / 2**20:>8.1f}"
        )
    for r in results:
        if "bound_vs_tbe" in r:
            print(
                f"{r['case']}: {r['impl']} reads {r['store_rows_read_per_step']} and writes "
                f"{r['store_rows_written_per_step']} rows per step: bound_vs_tbe {r['bound_vs_tbe']:.2f}x"
            )
        if "us_per_key" in r:
            print(f"{r['case']} {r['impl']}: {r['us_per_key']:.2f} us per key")


def _plot(results: list[dict[str, Any]], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in results if not r["case"].startswith("store-")]  # the step benchmark only
    cases = sorted({r["case"] for r in results})
    impls = list(dict.fromkeys(r["impl"] for r in results))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        values = [
            next((r["median_ms"] for r in results if r["case"] == c and r["impl"] == impl), 0.0)
            for c in cases
        ]
        errors = [
            [
                next(
                    (r["median_ms"] - r["p10_ms"] for r in results if r["case"] == c and r["impl"] == impl),
                    0.0,
                )
                for c in cases
            ],
            [
                next(
                    (r["p90_ms"] - r["median_ms"] for r in results if r["case"] == c and r["impl"] == impl),
                    0.0,
                )
                for c in cases
            ],
        ]
        ax.bar([i + j * width for i in range(len(cases))], values, width, yerr=errors, label=impl, capsize=3)
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(cases))], cases)
    ax.set_ylabel("training step, ms (median, p10-p90)")
    ax.set_title(f"ssd-tbe-adapter {__version__} on {device}: RocksDB + cache vs in-memory TBE")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on every platform
        return None


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small tables, few steps")
    parser.add_argument(
        "--large", action="store_true", help="4 x 5M rows, HBM cache 1%%, DRAM tier 10%% (no prefill)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write results as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    parser.add_argument("--workdir", type=Path, help="where the RocksDB stores go (default: a temp dir)")
    parser.add_argument("--steps", type=int, help="measured steps per implementation")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument(
        "--only",
        help="comma-separated implementations to run (default: all; fbgemm-tbe runs whenever importable; "
        f"{FLOOR} needs kv-prefetch)",
    )
    parser.add_argument(
        "--store-io",
        action="store_true",
        help="measure only the stores' batched get/put (RocksDB, K RocksDB instances or column families from "
        "K threads, LMDB when importable) and how much each slows a concurrent Python thread",
    )
    parser.add_argument(
        "--graphed",
        action="store_true",
        help="CUDA: also the TBE's and two device-cache key-value rows with each step recorded once in a "
        "CUDA graph and replayed (the key-value prefetch of batch k+1 around the replay: its survey before, "
        "its sync and row moves after)",
    )
    parser.add_argument(
        "--pipelined",
        action="store_true",
        help="CUDA: the kv-device-* rows prefetch batch k+1 on a side stream after batch k's backward is "
        "queued (a train pipeline's order; lets the prefetch overlap the backward)",
    )
    args = parser.parse_args(argv)
    if args.graphed and args.device == "cpu":
        parser.error("--graphed needs CUDA (it records CUDA graphs)")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cases = QUICK if args.quick else LARGE if args.large else CASES
    if args.steps:
        cases = [
            Case(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, "steps": args.steps}) for c in cases
        ]
    workdir = Path(tempfile.mkdtemp(prefix="kv-bench-", dir=args.workdir))
    load_before = _load_average()
    try:
        if args.store_io:
            io_case = STORE_IO_QUICK if args.quick else STORE_IO_CASE
            if args.steps:
                io_case = StoreIOCase(
                    rows=io_case.rows, batch=io_case.batch, warmup=io_case.warmup, steps=args.steps
                )
            results = run_store_io(io_case, workdir)
        else:
            only = set(args.only.split(",")) if args.only else None
            results = [
                row
                for case in cases
                for row in run_case(
                    case, device, workdir / case.name, only, pipelined=args.pipelined, graphed=args.graphed
                )
            ]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.store_io:
        _print_store_io(results)
    else:
        _print_table(results, device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "package": "ssd-tbe-adapter",
            "version": __version__,
            "device": device_name,
            "torch": torch.__version__,
            "command": "python -m ssd_tbe_adapter.bench"
            + f" --device {args.device}"
            + (" --quick" if args.quick else "")
            + (" --large" if args.large else "")
            + (f" --threads {args.threads}" if args.threads else "")
            + (f" --steps {args.steps}" if args.steps else "")
            + (f" --only {args.only}" if args.only else "")
            + (" --pipelined" if args.pipelined else "")
            + (" --graphed" if args.graphed else "")
            + (" --store-io" if args.store_io else ""),
            "threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            # 1-minute load average of the host before and after the run (shared CI boxes are noisy).
            "load_average": [load_before, _load_average()],
            "cpu_count": os.cpu_count(),
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if args.plot and not args.store_io:
        _plot(results, args.plot, device_name)


if __name__ == "__main__":
    main()
