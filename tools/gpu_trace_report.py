"""Where a torch.profiler trace's GPU time goes: per stream, per kernel, and which CPU ops launched it.

    python tools/gpu_trace_report.py TRACE.json[.gz] --steps 10                # streams and top kernels
    python tools/gpu_trace_report.py TRACE.json[.gz] --steps 10 --attribute    # kernels by launching CPU ops

``TRACE`` is a chrome trace as ``torch.profiler`` exports it (``python -m examples.dlrm.bench --trace-dir DIR``
keeps one per run). Times are per step (``--steps``: the profiled steps in the trace). The union of a set of
intervals counts overlapping time once, so ``union`` is the stream's busy time and the overlap of two streams is
``union(a) + union(b) - union(a + b)``. Kernels launched by a CUDA graph replay name no CPU op (the graph's
launch is the only one): attribute an eager run's trace.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
Event = dict[str, Any]


def load(path: Path) -> list[Event]:
    """The trace's complete events (``ph == "X"`` with a duration)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events: list[Event] = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union(spans: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, start, end = 0.0, None, 0.0
    for a, b in sorted(spans):
        if start is None or a > end:
            total += end - start if start is not None else 0.0
            start, end = a, b
        else:
            end = max(end, b)
    return total + (end - start if start is not None else 0.0)


def _spans(events: Iterable[Event]) -> list[tuple[float, float]]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events]


def _short(name: str, width: int = 160) -> str:
    return re.sub(r"\s+", " ", name)[:width]


def streams_report(events: Sequence[Event], steps: int, top: int = 12) -> list[str]:
    """Per stream (busiest first): launches, summed and union time, the top kernels; then the overlap of the
    two busiest streams. All per step."""
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    by_stream: dict[Any, list[Event]] = collections.defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    lines = [f"GPU union {union(_spans(gpu)) / steps:.1f} us/step, {len(gpu) / steps:.0f} events/step"]
    order = sorted(by_stream, key=lambda s: -sum(e["dur"] for e in by_stream[s]))
    for stream in order:
        es = by_stream[stream]
        lines.append(
            f"stream {stream}: {len(es) / steps:.0f} events/step, sum {sum(e['dur'] for e in es) / steps:.1f} "
            f"us/step, union {union(_spans(es)) / steps:.1f}"
        )
        time: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        for e in es:
            time[_short(e["name"])] += e["dur"]
            count[_short(e["name"])] += 1
        for name, dur in time.most_common(top):
            lines.append(f"   {dur / steps:8.1f} us/step  x{count[name] / steps:5.1f}  {name}")
    if len(order) >= 2:
        a, b = _spans(by_stream[order[0]]), _spans(by_stream[order[1]])
        overlap = union(a) + union(b) - union(a + b)
        lines.append(f"overlap of streams {order[0]} and {order[1]}: {overlap / steps:.1f} us/step")
    return lines


def attribute_report(events: Sequence[Event], steps: int, min_us: float = 5.0) -> list[str]:
    """Each kernel name's time per step by the chain of CPU ops around its launch (innermost first), largest
    first, down to ``min_us`` a step."""
    launches = {
        e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
    }
    ops: dict[Any, list[Event]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops[e["tid"]].append(e)
    for thread in ops.values():
        thread.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in thread] for tid, thread in ops.items()}

    def chain(launch: Event) -> str:
        thread, at = ops.get(launch["tid"], []), starts.get(launch["tid"], [])
        i = bisect.bisect_right(at, launch["ts"])
        around = [
            _short(e["name"], 60)
            for e in reversed(thread[max(0, i - 400) : i])
            if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]
        ]
        return " < ".join(around[:6])

    time: collections.Counter[tuple[str, str]] = collections.Counter()
    count: collections.Counter[tuple[str, str]] = collections.Counter()
    for kernel in (e for e in events if e.get("cat") in GPU_CATEGORIES):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        key = (_short(re.sub(r"\(.*", "", kernel["name"]), 70), chain(launch) if launch else "(no launch)")
        time[key] += kernel["dur"]
        count[key] += 1
    lines = []
    for (name, where), dur in time.most_common():
        if dur / steps < min_us:
            break
        lines.append(f"{dur / steps:8.1f} us/step x{count[(name, where)] / steps:4.1f} {name}")
        lines.append(f"            <- {where}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("trace", type=Path)
    parser.add_argument(
        "--steps", type=int, default=1, help="profiled steps in the trace (times are per step)"
    )
    parser.add_argument("--attribute", action="store_true", help="kernels by the CPU ops that launched them")
    parser.add_argument("--min-us", type=float, default=5.0, help="--attribute: smallest time a step shown")
    parser.add_argument("--top", type=int, default=12, help="kernels shown per stream (without --attribute)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps is {args.steps}, expected >= 1")
    events = load(args.trace)
    lines = (
        attribute_report(events, args.steps, args.min_us)
        if args.attribute
        else streams_report(events, args.steps)
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
