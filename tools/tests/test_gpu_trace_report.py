"""tools/gpu_trace_report.py: interval unions, per-stream overlap and launch attribution on a small trace."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[1]


def _report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_trace_report", TOOLS / "gpu_trace_report.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace() -> list[dict[str, object]]:
    """Two steps: stream 7 runs kernel `a` (10 us) then `b` (5 us), stream 14 `c` (8 us, 4 of them beside `a`);
    `a` and `c` were launched inside op `outer > inner`, `b` by a graph replay (no launching op)."""
    events: list[dict[str, object]] = []
    for step in range(2):
        t = 100.0 * step
        events += [
            {"ph": "X", "cat": "cpu_op", "name": "outer", "tid": 1, "ts": t, "dur": 20.0},
            {"ph": "X", "cat": "cpu_op", "name": "inner", "tid": 1, "ts": t + 1, "dur": 10.0},
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "tid": 1,
                "ts": t + 2,
                "dur": 1.0,
                "args": {"correlation": 10 * step + 1},
            },
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "tid": 1,
                "ts": t + 4,
                "dur": 1.0,
                "args": {"correlation": 10 * step + 3},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "a(int)",
                "tid": 7,
                "ts": t + 30,
                "dur": 10.0,
                "args": {"stream": 7, "correlation": 10 * step + 1},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "b",
                "tid": 7,
                "ts": t + 40,
                "dur": 5.0,
                "args": {"stream": 7, "correlation": 10 * step + 2},
            },
            {
                "ph": "X",
                "cat": "kernel",
                "name": "c",
                "tid": 14,
                "ts": t + 36,
                "dur": 8.0,
                "args": {"stream": 14, "correlation": 10 * step + 3},
            },
        ]
    return events


def test_union_counts_overlapping_time_once() -> None:
    report = _report()
    assert report.union([]) == 0.0
    assert report.union([(0.0, 10.0), (5.0, 12.0), (20.0, 21.0)]) == pytest.approx(13.0)


def test_streams_report_gives_per_step_busy_time_and_overlap(tmp_path: Path) -> None:
    report = _report()
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    lines = report.streams_report(report.load(path), steps=2)
    assert lines[0].startswith("GPU union 15.0 us/step")  # 30..45 on both streams
    assert "stream 7: 2 events/step, sum 15.0 us/step, union 15.0" in lines
    assert lines[-1] == "overlap of streams 7 and 14: 8.0 us/step"


def test_attribute_report_names_the_launching_ops(tmp_path: Path) -> None:
    report = _report()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": _trace()}))
    lines = report.attribute_report(report.load(path), steps=2, min_us=1.0)
    assert lines[0].endswith(" a")
    assert lines[1].strip() == "<- inner < outer"
    assert "<- (no launch)" in [line.strip() for line in lines]
