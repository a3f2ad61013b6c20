"""Durability (issue 13): atomic checkpoints, corruption detection, full disks, schema records, the last-flush
state after a crash, prefetch matching, error classes. SIGKILL tests run real subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ssd_tbe_adapter import (
    CheckpointCorruptError,
    KeyValueEmbeddingBags,
    MemoryStore,
    SSDTBEAdapterError,
    TableChunk,
    TableSpec,
)

TABLES = [TableSpec("a", 4), TableSpec("b", 3)]


def rows_of(module: KeyValueEmbeddingBags) -> dict[tuple[str, int], list[float]]:
    """Every stored row of ``module``: (table, id) -> weights then optimizer state."""
    return {
        (chunk.table, i): [*w.tolist(), *s.tolist()]
        for chunk in module.checkpoint(chunk_rows=16)
        for i, w, s in zip(chunk.ids.tolist(), chunk.weights, chunk.optimizer_state, strict=True)
    }


def chunks_with(value: float, count: int) -> list[TableChunk]:
    """Rows ``0..count-1`` of both tables, every weight ``value`` (state ``-value``)."""
    ids = torch.arange(count, dtype=torch.int64)
    return [
        TableChunk(
            table=spec.name,
            ids=ids,
            weights=torch.full((count, spec.dim), value),
            optimizer_state=torch.full((count, 1), -value),
        )
        for spec in TABLES
    ]


def expected_rows(value: float, count: int) -> dict[tuple[str, int], list[float]]:
    """What :func:`rows_of` gives after restoring ``chunks_with(value, count)``."""
    return {(spec.name, i): [value] * spec.dim + [-value] for spec in TABLES for i in range(count)}


def make_module(store: object | None = None) -> KeyValueEmbeddingBags:
    return KeyValueEmbeddingBags(
        TABLES,
        None,
        MemoryStore() if store is None else store,  # type: ignore[arg-type]  # tests pass stores of any kind
        cache_rows=8,
        optimizer="rowwise_adagrad",
    )


# ---------------------------------------------------------------------------- 2: atomic save_checkpoint

SAVE_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    from ssd_tbe_adapter import KeyValueEmbeddingBags, MemoryStore, TableChunk, TableSpec
    directory, kill_at = sys.argv[1], int(sys.argv[2])
    tables = [TableSpec("a", 4), TableSpec("b", 3)]
    module = KeyValueEmbeddingBags(tables, None, MemoryStore(), cache_rows=8, optimizer="rowwise_adagrad")
    ids = torch.arange(150)
    module.restore(
        [TableChunk(table=t.name, ids=ids, weights=torch.full((150, t.dim), 2.0),
                    optimizer_state=torch.full((150, 1), -2.0)) for t in tables]
    )
    calls = 0
    real_fsync = os.fsync
    def fsync(fd):
        global calls
        calls += 1
        if calls == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real_fsync(fd)
    os.fsync = fsync
    module.save_checkpoint(directory, chunk_rows=64)
    """
)


def test_sigkill_during_save_checkpoint_leaves_old_or_new_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed at an fsync of save_checkpoint over an existing checkpoint: loading gives exactly the
    old checkpoint before the manifest rename, exactly the new one after, never a mix or an error."""
    old = make_module()
    old.restore(chunks_with(1.0, 100))
    # 150 rows per table in 64-row chunks: 3 + 3 chunk files (fsyncs 1-6), then the staging directory (7), the
    # checkpoint directory after the generation rename (8), the manifest (9) and the directory after the
    # manifest rename (10, the commit is done).
    calls: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        calls.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    new = make_module()
    new.restore(chunks_with(2.0, 150))
    new.save_checkpoint(tmp_path / "probe", chunk_rows=64)
    monkeypatch.undo()
    assert len(calls) == 10
    kill_points = {7: 1.0, 9: 1.0, 10: 2.0}
    children = {}
    for kill_at in kill_points:
        directory = tmp_path / f"ckpt-{kill_at}"
        old.save_checkpoint(directory, chunk_rows=32)
        children[kill_at] = subprocess.Popen(
            [sys.executable, "-c", SAVE_CHILD, str(directory), str(kill_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    for kill_at, child in children.items():
        _, err = child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL, err
        fresh = make_module()
        fresh.restore(chunks_with(5.0, 3))  # live rows the load must replace
        value = kill_points[kill_at]
        count = 100 if value == 1.0 else 150
        assert fresh.load_checkpoint(tmp_path / f"ckpt-{kill_at}") == 2 * count
        assert rows_of(fresh) == expected_rows(value, count), f"kill at fsync {kill_at}"


# ---------------------------------------------------------------------------- 3: validate before clearing


@pytest.mark.parametrize(
    "damage", ["truncated", "garbled", "missing"], ids=["truncated", "garbled", "missing"]
)
def test_bad_checkpoint_chunk_leaves_live_tables_untouched(tmp_path: Path, damage: str) -> None:
    """load_checkpoint of a checkpoint with one damaged chunk raises CheckpointCorruptError naming the file and
    changes no live row (the whole checkpoint is checked before any table is cleared)."""
    source = make_module()
    source.restore(chunks_with(1.0, 100))
    source.save_checkpoint(tmp_path / "ckpt", chunk_rows=16)
    victim = sorted((tmp_path / "ckpt").glob("g-*/chunk-*.pt"))[9]  # a chunk of the second table
    data = victim.read_bytes()
    if damage == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "garbled":
        victim.write_bytes(data[:-64] + bytes(64))
    else:
        victim.unlink()
    live = make_module()
    live.restore(chunks_with(7.0, 120))
    before = rows_of(live)
    with pytest.raises(CheckpointCorruptError, match=victim.name) as info:
        live.load_checkpoint(tmp_path / "ckpt")
    assert isinstance(info.value, SSDTBEAdapterError)
    assert isinstance(info.value, ValueError)
    assert rows_of(live) == before
