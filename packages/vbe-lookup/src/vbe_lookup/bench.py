"""Benchmark: ``python -m vbe_lookup.bench [--device cuda] [--json PATH] [--plot PATH] [--quick]``.

Compares, in one run, interleaved, medians:

- ``single``: one kernel holding every table (the target: no merge at all);
- ``preallocated-K``: the features split over K kernels (K = 2..4), one pre-allocated 1-D output
  (fbgemm TBEs on CUDA write in place through ``vbe_output``, chained; elsewhere one cached-index copy),
  one op call per TBE (``fuse_kernels=False``);
- with fbgemm, ``fused-K``: the same K TBEs fused into ONE op call (``fuse_kernels=True``, opt-in): the
  host cost a step should keep near ``single``'s (the issue's targets: 1.05x for K = 2, 1.15x for K = 4, fwd+bwd);
- ``legacy-K``: torchrec's path over the same kernels: each through its module, split/permute/cat merge;
- with fbgemm, ``single-module`` and ``preallocated-K-module``: the same lookups calling every TBE through
  its Python module (``fbgemm_call="module"``) instead of its lookup op with per-layout arguments;
- on CUDA with fbgemm, ``fbgemm-chain-2``: fbgemm's own ``vbe_output`` chain without our per-layout
  VBE-metadata cache (fbgemm rebuilds it on the host every call), the issue's 1.73 ms baseline.

With ``--graphed`` (CUDA), also ``graphed-single`` and ``graphed-preallocated-K``: the same lookups with
each of the case's input batches' steps recorded once in a CUDA graph (after the eager rows warmed their
per-layout caches) and replayed: one launch per step whatever the number of kernels, so the rows give the
lookups' GPU cost without their host launch work (what a step captured whole, as examples/dlrm's, pays).

With ``--sharded``, also the sharded module's full training step (``sharded-tw``: table-wise,
``sharded-rw``: row-wise; input dist, lookup, output dist, backward) on a process group of
``--sharded-world`` ranks (gloo on CPU, spawned; NCCL with one rank on CUDA), each rank a local batch of
every feature.

Cases: forward (no grad) and forward + backward (fused row-wise Adagrad). Columns: host time per
step, GPU time (CUDA events over ``--inner`` steps run back to back, as in training, divided by their
number), host syncs per step (CUDA sync debug mode) and peak memory above the model (CUDA). Default shape (the issue's): 32 features, 8 ranks, dim 128, batch per feature and rank
128-1024, ~20 ids per bag; ``--quick`` and the CPU default are smaller.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import platform
import random
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from typing import Any

import torch

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures, __version__, _fbgemm

__all__ = ["main"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Impl:
    name: str
    lookup: GroupedVBELookup
    kernels: int


def _kernel(
    kind: str, rows: list[int], dims: list[int], device: torch.device, args: argparse.Namespace
) -> Any:
    lr = args.lr
    if kind == "fbgemm":
        return _fbgemm.new_tbe(
            rows,
            dims,
            optimizer="rowwise_adagrad",
            learning_rate=lr,
            device=device,
            bounds_check=args.bounds_check,
        )
    return TorchEmbeddingKernel(rows, dims, optimizer="rowwise_adagrad", learning_rate=lr, device=device)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _build_impls(args: argparse.Namespace, device: torch.device, kind: str) -> list[_Impl]:
    keys = [f"f{i}" for i in range(args.features)]
    rows, dims = [args.rows] * args.features, [args.dim] * args.features
    impls: list[_Impl] = []
    single = _kernel(kind, rows, dims, device, args)
    impls.append(_Impl(name="single", lookup=GroupedVBELookup([KernelGroup(single, keys, dims)]), kernels=1))
    fbgemm = kind == "fbgemm"
    if fbgemm:
        lookup = GroupedVBELookup([KernelGroup(single, keys, dims)], fbgemm_call="module")
        impls.append(_Impl(name="single-module", lookup=lookup, kernels=1))
    for k in args.kernels:
        groups = [
            KernelGroup(_kernel(kind, rows[a:b], dims[a:b], device, args), keys[a:b], dims[a:b])
            for a, b in _split(args.features, k)
        ]
        lookup = GroupedVBELookup(groups, fuse_kernels=False)
        impls.append(_Impl(name=f"preallocated-{k}", lookup=lookup, kernels=k))
        if fbgemm:
            # The same TBEs (their rows become views of the fused buffers; the other rows read them as before).
            fused = GroupedVBELookup(groups, fuse_kernels=True)
            impls.append(_Impl(name=f"fused-{k}", lookup=fused, kernels=k))
            lookup = GroupedVBELookup(groups, fbgemm_call="module")
            impls.append(_Impl(name=f"preallocated-{k}-module", lookup=lookup, kernels=k))
        # torchrec's path: every TBE through its module, then its split/permute/cat merge.
        legacy = GroupedVBELookup(groups, merge="legacy", fbgemm_call="module")
        impls.append(_Impl(name=f"legacy-{k}", lookup=legacy, kernels=k))
    if kind == "fbgemm" and device.type == "cuda":
        groups = [
            KernelGroup(_kernel(kind, rows[a:b], dims[a:b], device, args), keys[a:b], dims[a:b])
            for a, b in _split(args.features, 2)
        ]
        lookup = GroupedVBELookup(groups, cache_fbgemm_metadata=False, fbgemm_call="module")
        impls.append(_Impl(name="fbgemm-chain-2", lookup=lookup, kernels=2))
    return impls


def _inputs(args: argparse.Namespace, device: torch.device, count: int) -> list[VBEFeatures]:
    """``count`` batches sharing one batch-size layout (the steady state of a VBE model)."""
    rng = random.Random(args.seed)
    stride = [
        [rng.randint(args.batch_min, args.batch_max) for _ in range(args.ranks)] for _ in range(args.features)
    ]
    gen = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 2 * args.pooling_factor + 1, (sum(map(sum, stride)),), generator=gen)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=gen)
        per_key, start = [], 0
        for row in stride:
            n = sum(row)
            per_key.append(int(lengths[start : start + n].sum()))
            start += n
        out.append(
            VBEFeatures(
                [f"f{i}" for i in range(args.features)],
                values.to(device),
                lengths.to(device),
                stride,
                length_per_key=per_key,
            )
        )
    return out


def _make_step(lookup: GroupedVBELookup, inputs: list[VBEFeatures], mode: str) -> Callable[[int], None]:
    """One training (``fwd+bwd``) or inference (``fwd``) step on batch ``i % len(inputs)``."""

    def step(i: int) -> None:
        features = inputs[i % len(inputs)]
        if mode == "fwd":
            with torch.no_grad():
                lookup(features)
        else:
            out = lookup(features).values()
            torch.autograd.backward(out, torch.ones_like(out))

    return step


def _graphed_step(step: Callable[[int], None], num_inputs: int) -> Callable[[int], None]:
    """``step`` recorded in a CUDA graph once per input batch (``i % num_inputs``), on a side stream without
    cyclic GC (a graph dropped mid-capture voids it), then replayed; the inputs stay the same tensors, so
    the graph reads them where they are."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def replay(i: int) -> None:
        j = i % num_inputs
        graph = graphs.get(j)
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
            side.wait_stream(torch.cuda.current_stream())
            torch.cuda.synchronize()
            gc.collect()
            gc.disable()
            try:
                with torch.cuda.graph(graph, stream=side):
                    step(j)
            finally:
                gc.enable()
            graphs[j] = graph
        graph.replay()

    return replay


def _event() -> torch.cuda.Event:
    event: torch.cuda.Event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
    return event


def _time_interleaved(
    steps: dict[str, Callable[[int], None]], num_inputs: int, args: argparse.Namespace, cuda: bool
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm every step up (each input layout seen once), then time them interleaved, ``args.iters`` times:
    host ms and (CUDA) event ms per step, ``args.inner`` steps back to back per sample, as in training (the
    host runs ahead of the device)."""
    for step in steps.values():  # warm-up: layouts, caches, allocator
        for i in range(max(args.warmup, num_inputs)):
            step(i)
    host: dict[str, list[float]] = {n: [] for n in steps}
    gpu: dict[str, list[float]] = {n: [] for n in steps}
    inner = args.inner
    for i in range(args.iters):
        for name, step in steps.items():
            if cuda:
                torch.cuda.synchronize()
                begin, end = _event(), _event()
                begin.record()
            t0 = time.perf_counter()
            for j in range(inner):
                step(i * inner + j)
            host[name].append((time.perf_counter() - t0) * 1e3 / inner)
            if cuda:
                end.record()
                end.synchronize()
                gpu[name].append(begin.elapsed_time(end) / inner)
    return host, gpu


def _count_syncs(fn: Callable[[], None]) -> int:
    """Host waits for the device made by ``fn``: synchronizing CUDA calls (CUDA sync debug mode, warn level)
    plus ``torch.cuda.Event.synchronize`` calls, which that prototype mode does not report (a one-rank
    sharded module's host read is one)."""
    torch.cuda.synchronize()
    waits = [0]
    event_synchronize = torch.cuda.Event.synchronize

    def counted(event: torch.cuda.Event) -> None:
        waits[0] += 1
        with warnings.catch_warnings(record=True):  # its own report, if the mode makes one, is this wait
            warnings.simplefilter("always")
            event_synchronize(event)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted  # type: ignore[method-assign,assignment]  # a counting wrapper
        try:
            fn()
        finally:
            torch.cuda.Event.synchronize = event_synchronize  # type: ignore[method-assign]
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # Not "synchronizing" alone: the mode's one-time notice ("... does not yet detect all synchronizing
    # operations") would count as a sync of the first step measured in the process.
    return waits[0] + sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def _host_work_ms(step: Callable[[int], None], count: int) -> float:
    """Host ms per step spent outside ``torch.cuda.Event.synchronize`` (a one-rank sharded module's host read
    waits there for the device): the host's own work, over ``count`` steps back to back. A wait the wrapper does
    not see (another kind of sync) stays in, so this never understates the host work."""
    torch.cuda.synchronize()
    waited = [0.0]
    event_synchronize = torch.cuda.Event.synchronize

    def timed(event: torch.cuda.Event) -> None:
        t0 = time.perf_counter()
        event_synchronize(event)
        waited[0] += time.perf_counter() - t0

    torch.cuda.Event.synchronize = timed  # type: ignore[method-assign,assignment]  # a timing wrapper
    try:
        t0 = time.perf_counter()
        for i in range(count):
            step(i)
        total = time.perf_counter() - t0
    finally:
        torch.cuda.Event.synchronize = event_synchronize  # type: ignore[method-assign]
    torch.cuda.synchronize()
    return (total - waited[0]) * 1e3 / max(count, 1)


def _profile(label: str, step: Callable[[int], None], cuda: bool) -> None:
    """Print the ops of three steps by host time, and by device time on CUDA."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(3):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    print(f"\n=== profile {label} (3 steps) ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if cuda:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))


def _percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _run(args: argparse.Namespace, device: torch.device, kind: str) -> list[dict[str, Any]]:
    impls = _build_impls(args, device, kind)
    inputs = _inputs(args, device, 4)
    cuda = device.type == "cuda"
    results: list[dict[str, Any]] = []
    for mode in ("fwd", "fwd+bwd"):
        steps = {impl.name: _make_step(impl.lookup, inputs, mode) for impl in impls}
        kernels = {impl.name: impl.kernels for impl in impls}
        if args.graphed:  # after the eager rows (insertion order): their warm-up fills the layout caches
            for impl in impls:
                plain = impl.name.removeprefix("preallocated-").removeprefix("fused-")
                if impl.name == "single" or plain.isdigit():
                    steps[f"graphed-{impl.name}"] = _graphed_step(steps[impl.name], len(inputs))
                    kernels[f"graphed-{impl.name}"] = impl.kernels
        host, gpu = _time_interleaved(steps, len(inputs), args, cuda)
        for name in steps:
            syncs = peak = None
            if cuda:
                syncs = _count_syncs(functools.partial(steps[name], 0))
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                steps[name](0)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
            times = gpu[name] if cuda else host[name]
            if mode == "fwd+bwd" and args.profile is not None:
                wanted = args.profile or ["single", "preallocated-2", "legacy-2", "fbgemm-chain-2"]
                if name in wanted:
                    _profile(f"{kind}/{name}", steps[name], cuda)
            results.append(
                {
                    "case": f"{mode} F{args.features} R{args.ranks} D{args.dim} B{args.batch_min}-{args.batch_max} L~{args.pooling_factor}",
                    "impl": f"{kind}/{name}",
                    "median_ms": statistics.median(times),
                    "p10_ms": _percentile(times, 0.1),
                    "p90_ms": _percentile(times, 0.9),
                    "peak_mem_bytes": peak,
                    "host_ms": statistics.median(host[name]),
                    "gpu_ms": statistics.median(gpu[name]) if cuda else None,
                    "syncs_per_step": syncs,
                    "kernels": kernels[name],
                    "mode": mode,
                    "kernel": kind,
                }
            )
    return results


# ------------------------------------------------------------------ sharded module (--sharded)


def _sharded_factory(kind: str, args: argparse.Namespace) -> Any:
    from vbe_lookup.sharding import KernelSpec, torch_kernel_factory

    if kind != "fbgemm":
        return torch_kernel_factory(optimizer="rowwise_adagrad", learning_rate=args.lr)

    def build(spec: KernelSpec) -> Any:
        return _fbgemm.new_tbe(
            list(spec.num_embeddings),
            list(spec.embedding_dims),
            feature_table_map=list(spec.feature_table_map),
            optimizer="rowwise_adagrad",
            learning_rate=args.lr,
            device=spec.device if spec.device is not None else "cpu",
            bounds_check=args.bounds_check,
        )

    return build


def _sharded_inputs(
    args: argparse.Namespace, rank: int, device: torch.device, count: int
) -> list[VBEFeatures]:
    """``count`` local batches of rank ``rank``: every feature, one batch size per rank (a fixed layout)."""
    batch = random.Random(args.seed * 1000 + rank).randint(args.batch_min, args.batch_max)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    keys = [f"f{i}" for i in range(args.features)]
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 2 * args.pooling_factor + 1, (args.features * batch,), generator=gen)
        values = torch.randint(0, args.rows, (int(lengths.sum()),), generator=gen)
        out.append(VBEFeatures(keys, values, lengths, [[batch]] * args.features).to(device))
    return out


def _sharded_rank(rank: int, world: int, args: argparse.Namespace, kind: str) -> list[dict[str, Any]]:
    """Time the sharded training step on this rank (every rank runs the same steps in lockstep)."""
    from vbe_lookup.sharding import RowWise, ShardedEmbeddingBags, ShardingPlan, TableConfig

    cuda = torch.cuda.is_available() and str(torch.distributed.get_backend()) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tables = [
        TableConfig(name=f"t{i}", num_embeddings=args.rows, embedding_dim=args.dim, feature_names=(f"f{i}",))
        for i in range(args.features)
    ]
    plans = {
        "sharded-tw": ShardingPlan.table_wise(tables, world),
        "sharded-rw": ShardingPlan(world_size=world, placements={t.name: RowWise() for t in tables}),
    }
    inputs = _sharded_inputs(args, rank, device, 4)
    modules = {
        name: ShardedEmbeddingBags(tables, plan, kernel_factory=_sharded_factory(kind, args), device=device)
        for name, plan in plans.items()
    }

    def make(module: ShardedEmbeddingBags) -> Callable[[int], None]:
        def step(i: int) -> None:
            out = module(inputs[i % len(inputs)]).values()
            torch.autograd.backward(out, torch.ones_like(out))

        return step

    steps = {name: make(m) for name, m in modules.items()}
    host, gpu = _time_interleaved(steps, len(inputs), args, cuda)
    results = []
    for name, step in steps.items():
        syncs = _count_syncs(functools.partial(step, 0)) if cuda else None
        if args.profile is not None and name in (args.profile or list(steps)) and rank == 0:
            _profile(f"{kind}/{name} world {world}", step, cuda)
        times = gpu[name] if cuda else host[name]
        results.append(
            {
                "case": f"sharded fwd+bwd W{world} F{args.features} D{args.dim} B{args.batch_min}-{args.batch_max} L~{args.pooling_factor}",
                "impl": f"{kind}/{name}",
                "median_ms": statistics.median(times),
                "p10_ms": _percentile(times, 0.1),
                "p90_ms": _percentile(times, 0.9),
                "peak_mem_bytes": None,
                "host_ms": statistics.median(host[name]),
                # CUDA: the host's work without its wait for the device at the step's one host read.
                "host_work_ms": (
                    statistics.median(_host_work_ms(step, args.inner) for _ in range(5)) if cuda else None
                ),
                "gpu_ms": statistics.median(gpu[name]) if cuda else None,
                "syncs_per_step": syncs,
                "kernels": len(modules[name].kernels()),
                "mode": "fwd+bwd",
                "kernel": kind,
                "world_size": world,
            }
        )
    return results


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _sharded_entry(
    rank: int, world: int, port: int, backend: str, args: argparse.Namespace, kind: str, queue: Any
) -> None:
    """Spawned rank: join the group, time, hand rank 0's rows back through ``queue``."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, torch.get_num_threads() // world))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = _sharded_rank(rank, world, args, kind)
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def _run_sharded(
    args: argparse.Namespace, device: torch.device, kind: str, world: int
) -> list[dict[str, Any]]:
    """The sharded step on ``world`` ranks: in this process for one rank, spawned ranks otherwise."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    backend = "nccl" if device.type == "cuda" else "gloo"
    port = _free_port()
    if world == 1:
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            return _sharded_rank(0, 1, args, kind)
        finally:
            dist.destroy_process_group()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]  # untyped, not re-exported
        _sharded_entry, args=(world, port, backend, args, kind, queue), nprocs=world, start_method="spawn"
    )
    results: list[dict[str, Any]] = queue.get()
    return results


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        f"{'case':<40} {'impl':<28} {'host ms':>9} {'GPU ms':>9} {'vs single':>9} {'syncs':>6} {'peak MiB':>9}"
    ]
    singles = {(r["case"], r["kernel"]): r["median_ms"] for r in results if r["impl"].endswith("/single")}
    for r in results:
        single = singles.get((r["case"], r["kernel"]))
        ratio = "-" if single is None else f"{r['median_ms'] / single:.2f}x"
        gpu = "-" if r["gpu_ms"] is None else f"{r['gpu_ms']:.3f}"
        syncs = "-" if r["syncs_per_step"] is None else str(r["syncs_per_step"])
        peak = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**20:.1f}"
        lines.append(
            f"{r['case']:<40} {r['impl']:<28} {r['host_ms']:>9.3f} {gpu:>9} {ratio:>9} {syncs:>6} {peak:>9}"
        )
        if r.get("host_work_ms") is not None:
            lines.append(f"{'':<40} {'  host work (no sync wait)':<28} {r['host_work_ms']:>9.3f}")
    return "\n".join(lines)


def _plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in results))
    fig, axes = plt.subplots(1, len(cases), figsize=(7 * len(cases), 5), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        rows = [r for r in results if r["case"] == case]
        ax.barh([r["impl"] for r in rows], [r["median_ms"] for r in rows], color="tab:blue")
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("median ms per step")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vbe_lookup.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--kernel",
        choices=["auto", "fbgemm", "torch", "both"],
        default="auto",
        help="kernel kind: fbgemm TBEs (auto when fbgemm imports), TorchEmbeddingKernel, or both",
    )
    parser.add_argument("--features", type=int, default=None)
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--batch-min", type=int, default=None)
    parser.add_argument("--batch-max", type=int, default=None)
    parser.add_argument("--pooling-factor", type=int, default=None, help="mean ids per bag")
    parser.add_argument("--kernels", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--inner",
        type=int,
        default=None,
        help="steps run back to back per sample (the training steady state; default 10 on CUDA, 1 on CPU); "
        "1 syncs before every step and so also charges the step's host launch time",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--bounds-check",
        choices=["warning", "fatal", "none"],
        default="warning",
        help="fbgemm TBEs' BoundsCheckMode, the same for every implementation (default: fbgemm's, warning)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    parser.add_argument("--quick", action="store_true", help="a small, fast run")
    parser.add_argument(
        "--profile",
        nargs="*",
        default=None,
        metavar="IMPL",
        help="after timing, print a torch.profiler table (host and device time per op) of a few fwd+bwd steps "
        "of these implementations (default: single, preallocated-2, legacy-2, fbgemm-chain-2)",
    )
    parser.add_argument(
        "--graphed",
        action="store_true",
        help="CUDA: also graphed-single and graphed-preallocated-K (each input's step recorded once in a CUDA "
        "graph and replayed: the lookups' GPU cost without host launch work)",
    )
    parser.add_argument(
        "--sharded",
        action="store_true",
        help="also time the sharded module's full training step (input dist, lookup, output dist, backward)",
    )
    parser.add_argument(
        "--sharded-world",
        type=int,
        nargs="+",
        default=None,
        help="process group sizes for --sharded (default: 1 and 2 gloo ranks on CPU, 1 NCCL rank on CUDA)",
    )
    parser.add_argument(
        "--only-sharded", action="store_true", help="with --sharded: skip the grouped-lookup cases"
    )
    parser.add_argument("--json", default=None, help="write results as JSON here")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
    return parser


def _defaults(args: argparse.Namespace, device: torch.device) -> None:
    if args.quick:
        shape = {
            "features": 8,
            "ranks": 2,
            "dim": 32,
            "rows": 1000,
            "batch_min": 8,
            "batch_max": 32,
            "pooling_factor": 4,
            "iters": 10,
        }
    elif device.type == "cuda":  # the production-like shape
        shape = {
            "features": 32,
            "ranks": 8,
            "dim": 128,
            "rows": 100_000,
            "batch_min": 128,
            "batch_max": 1024,
            "pooling_factor": 20,
            "iters": 50,
        }
    else:
        shape = {
            "features": 32,
            "ranks": 4,
            "dim": 64,
            "rows": 10_000,
            "batch_min": 16,
            "batch_max": 64,
            "pooling_factor": 10,
            "iters": 25,
        }
    shape["inner"] = 10 if device.type == "cuda" and not args.quick else 1
    for key, value in shape.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.kernels = [k for k in args.kernels if 2 <= k <= args.features]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table; optionally write JSON and a plot."""
    parser = _parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.graphed and device.type != "cuda":
        parser.error("--graphed needs CUDA (it records CUDA graphs)")
    if args.threads:
        torch.set_num_threads(args.threads)
    _defaults(args, device)
    has_fbgemm = _fbgemm.fbgemm_available()
    if args.kernel == "auto":
        kinds = ["fbgemm" if has_fbgemm else "torch"]
    elif args.kernel == "both":
        kinds = ["fbgemm", "torch"] if has_fbgemm else ["torch"]
    else:
        kinds = [args.kernel]
    results = (
        [] if args.sharded and args.only_sharded else [r for kind in kinds for r in _run(args, device, kind)]
    )
    if args.sharded:
        worlds = args.sharded_world or ([1] if device.type == "cuda" else [1, 2])
        results += [r for kind in kinds for world in worlds for r in _run_sharded(args, device, kind, world)]
    print(
        f"vbe_lookup {__version__} | torch {torch.__version__} | {_fbgemm.fbgemm_status()} | device {device}"
    )
    print(_table(results))
    if args.json:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu: {platform.machine()}"
        payload = {
            "package": "vbe-lookup",
            "version": __version__,
            "device": name,
            "torch": torch.__version__,
            "fbgemm": _fbgemm.fbgemm_status(),
            "date": date.today().isoformat(),
            "command": "python -m vbe_lookup.bench "
            + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
            "threads": torch.get_num_threads(),
            "results": results,
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
