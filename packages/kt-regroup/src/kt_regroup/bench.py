"""Benchmark: ``python -m kt_regroup.bench [--batch 1024 ...] [--json PATH] [--plot PATH] [--quick]``.

Compares, in one run, interleaved, medians: torchrec's generic fallback (``KeyedTensor.regroup``: split per
key, one cat over every group, split; written here), a leaner split + one cat per group, fbgemm's
``permute_pooled_embs`` path and ``permute_multi_embedding`` (when fbgemm imports), each of our backends
through :func:`kt_regroup.regroup`, a cached :class:`kt_regroup.KTRegroupAsDict` (on CUDA also with its Triton
kernels launched by the JIT instead of directly), and (when torchrec imports;
never a dependency) torchrec's own ``KTRegroupAsDict`` and ``KeyedTensor.regroup``; forward and
forward+backward. Columns: host time, GPU time (CUDA events), peak GPU memory and, on CUDA, the achieved
bandwidth (bytes read + written) as a fraction of a measured device-to-device copy.

Seed shape (torchrec's): B=1024, 20 dense keys of dim 64 + 1000 sparse keys of dim 128, 2 groups.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kt_regroup
from kt_regroup._backend import available_backends
from kt_regroup._fbgemm import fbgemm_available

__all__ = ["main"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Setup:
    kts: list[kt_regroup.KeyedTensor]
    groups: list[list[str]]
    names: list[str]
    bytes_fwd: int
    bytes_bwd: int


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, grad: bool) -> _Setup:
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dense_keys = [f"dense_{i}" for i in range(args.dense_keys)]
    sparse_keys = [f"sparse_{i}" for i in range(args.sparse_keys)]
    kts = []
    for keys, dim in ((dense_keys, args.dense_dim), (sparse_keys, args.sparse_dim)):
        if not keys:
            continue
        values = torch.randn(args.batch, dim * len(keys), generator=gen).to(device=device, dtype=dtype)
        kts.append(kt_regroup.KeyedTensor(keys, [dim] * len(keys), values.requires_grad_(grad)))
    all_keys = dense_keys + sparse_keys
    dims = dict.fromkeys(dense_keys, args.dense_dim) | dict.fromkeys(sparse_keys, args.sparse_dim)
    # torchrec's benchmark allocation: every key to a random group, or (with --skips) to none.
    groups: list[list[str]] = [[] for _ in range(args.groups)]
    for key in all_keys:
        slot = rng.randrange(args.groups + (1 if args.skips else 0))
        if slot < args.groups:
            groups[slot].append(key)
    if args.duplicates:
        for group in groups:
            group.extend(rng.sample(all_keys, max(1, len(all_keys) // (10 * args.groups))))
    itemsize = torch.empty((), dtype=dtype).element_size()
    out_cols = sum(dims[k] for g in groups for k in g)
    in_cols = sum(dims[k] for k in all_keys)
    bytes_fwd = 2 * out_cols * args.batch * itemsize
    bytes_bwd = (out_cols + in_cols) * args.batch * itemsize
    return _Setup(
        kts=kts,
        groups=groups,
        names=[f"group_{i}" for i in range(len(groups))],
        bytes_fwd=bytes_fwd,
        bytes_bwd=bytes_bwd,
    )


def _per_key_views(setup: _Setup) -> dict[str, torch.Tensor]:
    blocks: dict[str, torch.Tensor] = {}
    for kt in setup.kts:
        blocks.update(zip(kt.keys(), torch.split(kt.values(), kt.length_per_key(), dim=1), strict=False))
    return blocks


def _generic_fallback(setup: _Setup) -> Callable[[], list[torch.Tensor]]:
    """torchrec's generic fallback (``KeyedTensor.regroup``): split per key, one cat of every group, split."""
    dims = {k: n for kt in setup.kts for k, n in zip(kt.keys(), kt.length_per_key(), strict=True)}
    split = [sum(dims[k] for k in group) for group in setup.groups]

    def run() -> list[torch.Tensor]:
        blocks = _per_key_views(setup)
        rearranged = torch.cat([blocks[k] for group in setup.groups for k in group], dim=1)
        return list(torch.split(rearranged, split, dim=1))

    return run


def _slice_cat(setup: _Setup) -> Callable[[], list[torch.Tensor]]:
    """A leaner generic path: split every KeyedTensor per key, one cat per group (no second split)."""

    def run() -> list[torch.Tensor]:
        blocks = _per_key_views(setup)
        return [torch.cat([blocks[k] for k in group], dim=1) for group in setup.groups]

    return run


def _fbgemm_pooled(setup: _Setup) -> Callable[[], list[torch.Tensor]] | None:
    """torchrec's older fast path: cat the KeyedTensors, ``permute_pooled_embs``, split per group."""
    counts: dict[str, int] = {}
    for group in setup.groups:
        for key in group:
            counts[key] = counts.get(key, 0) + 1
    all_keys = [key for kt in setup.kts for key in kt.keys()]  # noqa: SIM118 - KeyedTensor.keys(), not a dict
    if any(c > 1 for c in counts.values()) or len(counts) != len(all_keys):
        return None  # permute_pooled_embs is a permutation: no duplicates, no skips
    lengths = [n for kt in setup.kts for n in kt.length_per_key()]
    index = {k: i for i, k in enumerate(all_keys)}
    permute = [index[k] for group in setup.groups for k in group]
    device = setup.kts[0].values().device
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    inv = [0] * len(permute)
    for i, p in enumerate(permute):
        inv[p] = i
    inv_offsets = [0]
    for p in permute:
        inv_offsets.append(inv_offsets[-1] + lengths[p])
    args = [
        torch.tensor(offsets, device=device, dtype=torch.int64),
        torch.tensor(permute, device=device, dtype=torch.int64),
        torch.tensor(inv_offsets, device=device, dtype=torch.int64),
        torch.tensor(inv, device=device, dtype=torch.int64),
    ]
    widths = [sum(lengths[index[k]] for k in group) for group in setup.groups]

    def run() -> list[torch.Tensor]:
        values = torch.cat([kt.values() for kt in setup.kts], dim=1)
        out = torch.ops.fbgemm.permute_pooled_embs_auto_grad(values, *args)
        return list(torch.split(out, widths, dim=1))

    return run


def _fbgemm_multi(setup: _Setup, cached: bool) -> Callable[[], list[torch.Tensor]]:
    """fbgemm ``permute_multi_embedding``; arguments from ``kt_regroup_arguments`` once or per call."""
    keys = [kt.keys() for kt in setup.kts]
    lengths = [kt.length_per_key() for kt in setup.kts]
    first = setup.kts[0].values()
    fixed = torch.ops.fbgemm.kt_regroup_arguments(first, keys, lengths, setup.groups)

    def run() -> list[torch.Tensor]:
        values = [kt.values() for kt in setup.kts]
        permutes, in_shapes, out_shapes, out_lengths = (
            fixed if cached else torch.ops.fbgemm.kt_regroup_arguments(values[0], keys, lengths, setup.groups)
        )
        result: list[torch.Tensor] = torch.ops.fbgemm.permute_multi_embedding(
            values, permutes, in_shapes, out_shapes, out_lengths
        )
        return result

    return run


def _torchrec_impls(setup: _Setup, device: torch.device) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """torchrec's own ``KTRegroupAsDict`` and ``KeyedTensor.regroup`` when torchrec imports (benchmark only)."""
    try:
        from torchrec.modules.regroup import KTRegroupAsDict as TorchrecRegroup
        from torchrec.sparse.jagged_tensor import KeyedTensor as TorchrecKeyedTensor
    except Exception:  # torchrec missing or broken against this torch/fbgemm: skip the rows
        return {}
    # torchrec's KeyedTensors over the same leaf tensors, so the backward reaches the same gradients.
    kts = [TorchrecKeyedTensor(kt.keys(), kt.length_per_key(), kt.values()) for kt in setup.kts]
    module = TorchrecRegroup(setup.groups, setup.names).to(device)
    return {
        "torchrec KTRegroupAsDict": lambda: list(module(kts).values()),
        "torchrec KeyedTensor.regroup": lambda: list(TorchrecKeyedTensor.regroup(kts, setup.groups)),
    }


def _impls(
    setup: _Setup, device: torch.device, only: Sequence[str]
) -> dict[str, Callable[[], list[torch.Tensor]]]:
    impls: dict[str, Callable[[], list[torch.Tensor]]] = {
        "torchrec generic (cat+split)": _generic_fallback(setup),
        "slice+cat per group": _slice_cat(setup),
    }
    if fbgemm_available():
        pooled = _fbgemm_pooled(setup)
        if pooled is not None:
            impls["fbgemm permute_pooled_embs"] = pooled
        impls["fbgemm permute_multi_embedding"] = _fbgemm_multi(setup, cached=True)
        impls["fbgemm kt_regroup_arguments+permute"] = _fbgemm_multi(setup, cached=False)
    for backend in available_backends(device):
        impls[f"kt_regroup.regroup[{backend}]"] = (
            lambda b=backend: kt_regroup.regroup(setup.kts, setup.groups, backend=b)  # type: ignore[misc]
        )
    module = kt_regroup.KTRegroupAsDict(setup.groups, setup.names).to(device)
    impls["kt_regroup.KTRegroupAsDict"] = lambda: list(module(setup.kts).values())
    if "triton" in available_backends(device):
        # The same module with every Triton launch through the JIT (see _JIT_LAUNCH).
        impls[_JIT_LAUNCH] = lambda: list(module(setup.kts).values())
    impls.update(_torchrec_impls(setup, device))
    if only:
        impls = {k: v for k, v in impls.items() if any(o in k for o in only)}
    return impls


def _measure(
    fn: Callable[[], None], device: torch.device, inner: int = 1
) -> tuple[float, float | None, int | None]:
    """Host ms, GPU ms (CUDA events) and peak GPU bytes per call, over ``inner`` back-to-back calls.

    With ``inner > 1`` the host enqueues the next call while the device runs the last one, so the GPU
    time is the device's time per call whenever the host keeps up (as in a training loop).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # untyped in torch
        t0 = time.perf_counter()
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        host = (time.perf_counter() - t0) * 1e3 / inner
        torch.cuda.synchronize(device)
        return host, start.elapsed_time(end) / inner, torch.cuda.max_memory_allocated(device) - base
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) * 1e3 / inner, None, None


def _with_backward(
    impl: Callable[[], list[torch.Tensor]], grads: list[torch.Tensor], kts: list[kt_regroup.KeyedTensor]
) -> Callable[[], None]:
    def call() -> None:
        outs = impl()
        pairs = [(o, g) for o, g in zip(outs, grads, strict=False) if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for kt in kts:
            kt.values().grad = None

    return call


# A row of the cached module whose Triton kernels are launched by the JIT, forward and backward, instead of
# directly (kt_regroup._triton_impl.FAST_LAUNCH off for the call): what the direct launch saves.
_JIT_LAUNCH = "kt_regroup.KTRegroupAsDict[JIT launch]"


def _through_jit(call: Callable[[], None]) -> Callable[[], None]:
    from kt_regroup import _triton_impl

    def run() -> None:
        previous = _triton_impl.FAST_LAUNCH
        _triton_impl.FAST_LAUNCH = False
        try:
            call()
        finally:
            _triton_impl.FAST_LAUNCH = previous

    return run


def _no_grad(impl: Callable[[], list[torch.Tensor]]) -> Callable[[], None]:
    def call() -> None:
        with torch.no_grad():
            impl()

    return call


def _copy_bandwidth(nbytes: int, device: torch.device, reps: int, inner: int) -> float:
    """Bytes per ms (read + written) of a device copy of ``nbytes / 2`` bytes."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    times = []
    for _ in range(reps + 2):
        host, gpu, _ = _measure(copy, device, inner)
        times.append(gpu if gpu is not None else host)
    return 2 * src.numel() / statistics.median(times[2:])


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark, print the table, optionally write ``--json`` and ``--plot``; return the rows."""
    parser = argparse.ArgumentParser(prog="python -m kt_regroup.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--dense-keys", type=int, default=20)
    parser.add_argument("--dense-dim", type=int, default=64)
    parser.add_argument("--sparse-keys", type=int, default=1000)
    parser.add_argument("--sparse-dim", type=int, default=128)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--duplicates", action="store_true", help="add ~10%% repeated keys to the groups")
    parser.add_argument("--skips", action="store_true", help="leave some keys out of every group")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--inner",
        type=int,
        default=None,
        help="back-to-back calls per timed sample (default 10 on CUDA, 1 on CPU); times are per call",
    )
    parser.add_argument("--only", nargs="*", default=[], help="substrings of the implementations to run")
    parser.add_argument("--cases", nargs="*", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for CPU runs")
    parser.add_argument("--quick", action="store_true", help="small shape, few repetitions")
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    parser.add_argument("--plot", type=str, default=None, help="write a PNG bar chart here")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.dense_keys, args.sparse_keys = min(args.batch, 64), 4, 40
        args.dense_dim, args.sparse_dim = min(args.dense_dim, 16), min(args.sparse_dim, 32)
        args.reps, args.warmup = min(args.reps, 3), 1
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.inner is None:
        args.inner = 10 if device.type == "cuda" else 1

    rows: list[dict[str, Any]] = []
    copy_bw = None
    for case in args.cases:
        grad = case == "fwd+bwd"
        setup = _build(args, device, dtype, grad)
        impls = _impls(setup, device, args.only)
        nbytes = setup.bytes_fwd if not grad else setup.bytes_fwd + setup.bytes_bwd
        if device.type == "cuda" and copy_bw is None:
            copy_bw = _copy_bandwidth(setup.bytes_fwd, device, args.reps, args.inner)
        samples: dict[str, list[tuple[float, float | None, int | None]]] = {name: [] for name in impls}
        grads_out: list[torch.Tensor] | None = None
        calls: dict[str, Callable[[], None]] = {}
        for name, impl in impls.items():
            if grad and grads_out is None:
                grads_out = [torch.randn_like(t) for t in impl()]
            calls[name] = _with_backward(impl, grads_out or [], setup.kts) if grad else _no_grad(impl)
            if name == _JIT_LAUNCH:
                calls[name] = _through_jit(calls[name])
        for _ in range(args.warmup):
            for call in calls.values():
                call()
        for _ in range(args.reps):  # interleaved: one call of every implementation per repetition
            for name, call in calls.items():
                samples[name].append(_measure(call, device, args.inner))
        for name, got in samples.items():
            host = [h for h, _, _ in got]
            gpu = [g for _, g, _ in got if g is not None]
            main_times = gpu if gpu else host
            row: dict[str, Any] = {
                "case": case,
                "impl": name,
                "median_ms": statistics.median(main_times),
                "p10_ms": _percentile(main_times, 0.1),
                "p90_ms": _percentile(main_times, 0.9),
                "host_median_ms": statistics.median(host),
                "gpu_median_ms": statistics.median(gpu) if gpu else None,
                "peak_mem_bytes": max((m for _, _, m in got if m is not None), default=None),
                "bytes": nbytes,
            }
            if copy_bw is not None:
                row["bandwidth_fraction"] = nbytes / row["median_ms"] / copy_bw
            rows.append(row)
    _print(rows, args, device)
    if args.json:
        payload = {
            "package": "kt-regroup",
            "version": kt_regroup.__version__,
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
            "torch": torch.__version__,
            "command": "python -m kt_regroup.bench "
            + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
            "shape": {
                "batch": args.batch,
                "dense_keys": args.dense_keys,
                "dense_dim": args.dense_dim,
                "sparse_keys": args.sparse_keys,
                "sparse_dim": args.sparse_dim,
                "groups": args.groups,
                "duplicates": args.duplicates,
                "skips": args.skips,
                "dtype": args.dtype,
            },
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "results": rows,
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
    if args.plot:
        _plot(rows, args.plot, device)
    return rows


def _print(rows: list[dict[str, Any]], args: argparse.Namespace, device: torch.device) -> None:
    print(
        f"kt_regroup.bench  B={args.batch}  {args.dense_keys}x{args.dense_dim} dense + "
        f"{args.sparse_keys}x{args.sparse_dim} sparse keys, {args.groups} groups, dup={args.duplicates}, "
        f"skips={args.skips}, {args.dtype} on {device}, {args.reps} reps x {args.inner} calls"
    )
    header = f"{'case':8} {'impl':42} {'host ms':>10} {'GPU ms':>9} {'peak MB':>9} {'BW frac':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        gpu = f"{row['gpu_median_ms']:.3f}" if row["gpu_median_ms"] is not None else "-"
        mem = f"{row['peak_mem_bytes'] / 2**20:.1f}" if row["peak_mem_bytes"] is not None else "-"
        frac = f"{row['bandwidth_fraction']:.2f}" if "bandwidth_fraction" in row else "-"
        print(f"{row['case']:8} {row['impl']:42} {row['host_median_ms']:10.3f} {gpu:>9} {mem:>9} {frac:>8}")


def _plot(rows: list[dict[str, Any]], path: str, device: torch.device) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows}, key=lambda c: (len(c), c))
    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=False):
        sub = [r for r in rows if r["case"] == case]
        names = [r["impl"] for r in sub]
        medians = [r["median_ms"] for r in sub]
        errors = [
            [m - r["p10_ms"] for m, r in zip(medians, sub, strict=False)],
            [r["p90_ms"] - m for m, r in zip(medians, sub, strict=False)],
        ]
        ax.barh(names, medians, xerr=errors, color="tab:blue")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("median ms (log scale)")
        ax.set_title(f"{case} on {device.type}")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
