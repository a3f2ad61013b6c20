"""The benchmark runs (tiny) and writes the JSON the docs tool reads."""

from __future__ import annotations

import json
from pathlib import Path

from kt_regroup import bench


def test_quick_bench_writes_json(tmp_path: Path) -> None:
    """--quick --json writes package/version/device/torch and one row per impl and case."""
    out = tmp_path / "bench.json"
    rows = bench.main(["--quick", "--reps", "1", "--skips", "--duplicates", "--json", str(out)])
    payload = json.loads(out.read_text())
    assert payload["package"] == "kt-regroup"
    assert {"version", "device", "torch", "results"} <= set(payload)
    assert {r["case"] for r in rows} == {"fwd", "fwd+bwd"}
    impls = {r["impl"] for r in rows}
    assert {
        "torchrec generic (cat+split)",
        "slice+cat per group",
        "kt_regroup.regroup[torch]",
        "kt_regroup.KTRegroupAsDict",
    } <= impls
    for row in payload["results"]:
        assert {"case", "impl", "median_ms", "p10_ms", "p90_ms", "peak_mem_bytes"} <= set(row)
