"""tools/bench_report.py renders docs/benchmarks.md from the packages' benchmark JSON files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import bench_report


def _write(path: Path, package: str, **extra: object) -> None:
    data = {
        "package": package,
        "version": "0.1.0",
        "device": "cpu (2 cores)",
        "torch": "2.13.0+cpu",
        "results": [
            {
                "case": "B=512",
                "impl": "torch",
                "median_ms": 1.25,
                "p10_ms": 1.0,
                "p90_ms": 1.5,
                "peak_mem_bytes": 3 * 2**20,
                "speedup": 5.5,
            },
            {
                "case": "B=512",
                "impl": "fbgemm",
                "median_ms": 7.0,
                "p10_ms": 6.0,
                "p90_ms": 8.0,
                "peak_mem_bytes": 0,
            },
        ],
        **extra,
    }
    path.write_text(json.dumps(data), encoding="utf-8")


def test_render_has_one_section_per_file_with_date_device_command_table_and_plot(tmp_path: Path) -> None:
    """Each JSON becomes a section: metadata lines, a row per result (extra keys as columns), its PNG linked."""
    bench = tmp_path / "docs" / "bench"
    bench.mkdir(parents=True)
    _write(
        bench / "kt-regroup-cpu.json", "kt-regroup", date="2026-11-30", command="python -m kt_regroup.bench"
    )
    (bench / "kt-regroup-cpu.png").write_bytes(b"\x89PNG")
    _write(bench / "vbe-lookup-cpu.json", "vbe-lookup")
    text = bench_report.render(bench, tmp_path / "docs")
    assert text.index("## kt-regroup") < text.index("## vbe-lookup")
    assert "- date: 2026-11-30" in text
    assert "- device: cpu (2 cores)" in text
    assert "- command: `python -m kt_regroup.bench`" in text
    assert "python -m vbe_lookup.bench --json" in text  # default command when the JSON has none
    assert "| B=512 | torch | 1.25 | 1–1.5 | 3.0 | 5.5 |" in text
    assert "| B=512 | fbgemm | 7 | 6–8 | – | – |" in text
    assert "![kt-regroup-cpu](bench/kt-regroup-cpu.png)" in text
    assert "vbe-lookup-cpu.png" not in text


def test_main_writes_the_page_and_check_detects_staleness(tmp_path: Path) -> None:
    """`main` writes the output; `--check` passes on it and fails once a JSON changes."""
    bench = tmp_path / "bench"
    bench.mkdir()
    out = tmp_path / "benchmarks.md"
    _write(bench / "ssd-tbe-adapter-cpu.json", "ssd-tbe-adapter")
    assert bench_report.main(["--bench-dir", str(bench), "--out", str(out)]) == 0
    assert "## ssd-tbe-adapter" in out.read_text(encoding="utf-8")
    assert bench_report.main(["--bench-dir", str(bench), "--out", str(out), "--check"]) == 0
    _write(bench / "ssd-tbe-adapter-cpu.json", "ssd-tbe-adapter", device="H200")
    assert bench_report.main(["--bench-dir", str(bench), "--out", str(out), "--check"]) == 1


def test_a_json_without_results_is_an_error_naming_the_file(tmp_path: Path) -> None:
    """A file lacking `results` makes render raise ReportError naming it (main exits 2)."""
    (tmp_path / "broken.json").write_text(json.dumps({"package": "x"}), encoding="utf-8")
    with pytest.raises(bench_report.ReportError, match="broken"):
        bench_report.render(tmp_path, tmp_path)
    assert bench_report.main(["--bench-dir", str(tmp_path), "--out", str(tmp_path / "o.md")]) == 2
