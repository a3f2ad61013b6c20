"""The ``--store-io`` benchmark: its sharded stores return exactly the rows put, and a tiny run reports every store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ssd_tbe_adapter import MemoryStore, RocksDBStore
from ssd_tbe_adapter.bench import StoreIOCase, _ColumnFamilies, _Sharded, main, run_store_io


def _sharded(kind: str, path: Path) -> _Sharded:
    if kind == "instances":
        return _Sharded([RocksDBStore(path / str(k), io_threads=1) for k in range(3)])
    families = _ColumnFamilies(path / "cf", 3)
    return _Sharded([families.shard(k) for k in range(3)], owner=families)


@pytest.mark.parametrize("kind", ["instances", "column-families"], ids=["instances", "column-families"])
def test_sharded_rocksdb_matches_memory_store(kind: str, tmp_path: Path) -> None:
    """Rows put through a 3-way sharded RocksDB read back as from a MemoryStore, in the caller's id order."""
    generator = torch.Generator().manual_seed(0)
    store = _sharded(kind, tmp_path)
    reference = MemoryStore()
    try:
        for _ in range(3):
            ids = torch.randperm(500, generator=generator)[:200]
            rows = torch.randint(0, 256, (200, 12), dtype=torch.uint8, generator=generator)
            store.put(ids, rows)
            reference.put(ids, rows)
        ids = torch.randperm(500, generator=generator)[:300]
        expected = torch.zeros(300, 12, dtype=torch.uint8)
        found = reference.get(ids, expected)
        ids = ids[found]  # the column-family reader expects every id present, as in the benchmark
        got = torch.zeros(ids.numel(), 12, dtype=torch.uint8)
        assert bool(store.get(ids, got).all())
        torch.testing.assert_close(got, expected[found])
    finally:
        store.close()


def test_store_io_reports_every_store(tmp_path: Path) -> None:
    """A tiny ``--store-io`` run has a get and a put row per store, with times and the Python thread's progress."""
    results = run_store_io(StoreIOCase(rows=3000, batch=600, warmup=1, steps=2), tmp_path)
    impls = {r["impl"] for r in results}
    assert {"rocksdb", "rocksdb-x2", "rocksdb-cf2", "rocksdb-x4", "rocksdb-cf4"} <= impls
    assert len(results) == 2 * len(impls)
    for row in results:
        assert row["case"].startswith(("store-io-get-", "store-io-put-"))
        assert 0 < row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["median_ms_beside_python"] > 0
        assert row["python_progress"] >= 0


def test_json_records_the_command_that_ran(tmp_path: Path) -> None:
    """The JSON's ``command`` names the device and the shape flags it ran with (a large-shape JSON once said
    it ran the default shape)."""
    out = tmp_path / "io.json"
    main(
        [
            "--store-io",
            "--quick",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--workdir",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    command = json.loads(out.read_text())["command"]
    assert command.startswith("python -m ssd_tbe_adapter.bench --device cpu --quick")
    assert command.endswith("--steps 1 --store-io")
    assert "--large" not in command
