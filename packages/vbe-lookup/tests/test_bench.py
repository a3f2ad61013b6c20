"""``python -m vbe_lookup.bench --sharded`` runs the sharded module's full step and reports it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_harness
import pytest

from vbe_lookup import _fbgemm, bench


def test_sharded_bench_reports_the_full_step(tmp_path: Path) -> None:
    """A tiny ``--sharded`` run on one gloo rank writes both sharded rows with host times."""
    _dist_harness.require_no_process_group()
    out = tmp_path / "bench.json"
    argv = ["--quick", "--sharded", "--only-sharded", "--sharded-world", "1", "--kernel", "torch"]
    argv += ["--features", "4", "--iters", "2", "--warmup", "1", "--threads", "1", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in rows] == ["torch/sharded-tw", "torch/sharded-rw"]
    assert all(r["world_size"] == 1 and r["host_ms"] > 0 for r in rows)
    assert all(r["case"].startswith("sharded fwd+bwd W1 F4") for r in rows)


def test_bench_reports_fused_rows_next_to_preallocated(tmp_path: Path) -> None:
    """With fbgemm, a tiny CPU run reports ``fbgemm/fused-K`` next to ``fbgemm/preallocated-K``."""
    if not _fbgemm.fbgemm_available():
        pytest.skip(f"fbgemm: {_fbgemm.fbgemm_status()}")
    out = tmp_path / "bench.json"
    argv = [
        "--device",
        "cpu",
        "--quick",
        "--kernel",
        "fbgemm",
        "--kernels",
        "2",
        "--iters",
        "2",
        "--warmup",
        "1",
    ]
    assert bench.main([*argv, "--threads", "1", "--json", str(out)]) == 0
    impls = {r["impl"] for r in json.loads(out.read_text())["results"] if r["mode"] == "fwd+bwd"}
    assert {"fbgemm/single", "fbgemm/preallocated-2", "fbgemm/fused-2"} <= impls
