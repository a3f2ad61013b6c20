"""Durability (issue 13): atomic checkpoints, corruption detection, full disks, schema records, the last-flush
state after a crash, prefetch matching, error classes. SIGKILL tests run real subprocesses."""

from __future__ import annotations

import ast
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ssd_tbe_adapter
import ssd_tbe_adapter.errors
from ssd_tbe_adapter import (
    CheckpointCorruptError,
    DiskFullError,
    KeyValueEmbeddingBags,
    KVStore,
    MemoryStore,
    RocksDBStore,
    RowsNotRestoredWarning,
    SchemaMismatchError,
    SSDTBEAdapterError,
    StoreClosedError,
    StoreCorruptError,
    StoreIOError,
    StoreOpenError,
    TableChunk,
    TableSpec,
)

TABLES = [TableSpec("a", 4), TableSpec("b", 3)]
# Both cache paths: the host cache and the device-managed cache (run on the CPU here).
CACHE_PATHS = pytest.mark.parametrize("cache_on_device", [False, True], ids=["host-cache", "device-cache"])


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


# ---------------------------------------------------------------------------- 1, 5: corrupt store files


def rocksdb_module(
    path: Path, *, keep_last_flush: bool = True, at_last_flush: bool = False
) -> KeyValueEmbeddingBags:
    return make_module(RocksDBStore(path, keep_last_flush=keep_last_flush, at_last_flush=at_last_flush))


def test_garbled_sst_raises_on_every_read_path(tmp_path: Path) -> None:
    """A garbled SST block: checkpoint() (iter_chunks checks the iterator status), get and forward raise
    StoreCorruptError naming the SST file instead of returning fewer rows."""
    module = rocksdb_module(tmp_path / "db")
    module.restore(chunks_with(1.0, 3000))
    module.close()
    (sst,) = [p for p in (tmp_path / "db").glob("*.sst") if p.stat().st_size > 100_000]
    with open(sst, "r+b") as handle:
        handle.seek(sst.stat().st_size // 3)
        handle.write(bytes(range(256)) * 16)
    module = rocksdb_module(tmp_path / "db")
    with pytest.raises(StoreCorruptError, match=sst.name):
        list(module.checkpoint())
    with pytest.raises(StoreCorruptError, match=sst.name):
        module.store.get(torch.arange(3000), torch.empty(3000, 20, dtype=torch.uint8), table=0)
    with pytest.raises(StoreCorruptError, match=sst.name), torch.no_grad():
        module(torch.arange(3000).repeat(2), torch.tensor([0, 3000, 6000]))


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.9], ids=["quarter", "half", "most"])
def test_truncated_manifest_refuses_to_open_and_last_flush_recovers(tmp_path: Path, keep: float) -> None:
    """A truncated MANIFEST no longer opens as a store with rows missing: StoreCorruptError says flushed rows
    were lost, and at_last_flush=True brings every flushed row back (its checkpoint holds the SST files)."""
    path = tmp_path / "db"
    module = rocksdb_module(path)
    for value in (1.0, 2.0, 3.0):
        module.restore(chunks_with(value, 400 * int(value)))  # restore() flushes: one SST per restore
    module.close()
    (manifest,) = path.glob("MANIFEST-*")
    os.truncate(manifest, int(manifest.stat().st_size * keep))
    with pytest.raises(StoreCorruptError, match="at_last_flush=True"):
        RocksDBStore(path)
    module = rocksdb_module(path, at_last_flush=True)
    assert rows_of(module) == expected_rows(3.0, 1200)
    module.close()


def test_manifest_losing_its_last_flushes_is_detected(tmp_path: Path) -> None:
    """A MANIFEST cut after its first flush opens in RocksDB as a smaller database (the later SST files are
    deleted as orphans); the flush number recorded beside it turns that into StoreCorruptError, and the
    last-flush checkpoint still has every row."""
    path = tmp_path / "db"
    store = RocksDBStore(path)
    for part in range(2):
        store.put(torch.arange(1000) + 1000 * part, torch.full((1000, 40), part, dtype=torch.uint8))
        store.flush()
    store.close()
    (manifest,) = path.glob("MANIFEST-*")
    os.truncate(manifest, manifest.stat().st_size // 3)
    with pytest.raises(
        StoreCorruptError, match=r"lost flushed rows: its database holds flush #\d, but flush #3"
    ):
        RocksDBStore(path)
    with RocksDBStore(path, at_last_flush=True) as store:
        assert sum(ids.numel() for ids, _ in store.iter_chunks(table=0, chunk_rows=4096)) == 2000


def test_missing_sst_file_refuses_to_open(tmp_path: Path) -> None:
    """A store with an SST file deleted refuses to open (paranoid checks) with StoreCorruptError naming it."""
    path = tmp_path / "db"
    module = rocksdb_module(path, keep_last_flush=False)
    module.restore(chunks_with(1.0, 100))
    module.close()
    sst = sorted(path.glob("*.sst"))[0]
    sst.unlink()
    with pytest.raises(StoreCorruptError, match=sst.name):
        RocksDBStore(path)


def test_garbled_wal_record_refuses_to_open(tmp_path: Path) -> None:
    """A damaged WAL record before the last one (a crashed store's unflushed batches) raises StoreCorruptError
    instead of silently dropping the batch and every later one."""
    path = tmp_path / "db"
    store = RocksDBStore(path)
    for batch in range(4):
        store.put(torch.arange(100) + 100 * batch, torch.full((100, 40), batch, dtype=torch.uint8))
    crashed = tmp_path / "crashed"  # the files as a crash right now would leave them
    shutil.copytree(path, crashed, ignore=shutil.ignore_patterns("LOCK"))
    store.close()
    (wal,) = crashed.glob("*.log")
    with open(wal, "r+b") as handle:
        handle.seek(wal.stat().st_size // 4)
        handle.write(b"\xff" * 16)
    with pytest.raises(StoreCorruptError, match=str(crashed)):
        RocksDBStore(crashed)
    store = RocksDBStore(crashed, wal_recovery="tolerate_tail")  # the documented way to open it anyway
    assert sum(ids.numel() for ids, _ in store.iter_chunks(table=0, chunk_rows=1000)) < 400
    store.close()


# ---------------------------------------------------------------------------- 11: back to the last flush

CRASH_CHILD = textwrap.dedent(
    """
    import os, signal, sys, torch
    import ssd_tbe_adapter._store as store_module
    from ssd_tbe_adapter import KeyValueEmbeddingBags, MemoryStore, RocksDBStore, TableSpec
    path, out, kill_at = sys.argv[1], sys.argv[2], sys.argv[3]
    tables = [TableSpec("a", 4), TableSpec("b", 3)]
    def make(store):
        return KeyValueEmbeddingBags(tables, None, store, cache_rows=8, optimizer="rowwise_adagrad",
                                     learning_rate=0.3)
    module, twin = make(RocksDBStore(path)), make(MemoryStore())  # twin: the same steps, never crashed
    gen = torch.Generator().manual_seed(0)
    def step(high):
        indices = torch.randint(0, high, (24,), generator=gen)
        offsets = torch.arange(0, 25, 4)
        for m in (module, twin):
            m(indices, offsets).pow(2).sum().backward()  # tiny caches: evictions write rows back
    def rows():
        return {(c.table, i): [*w.tolist(), *s.tolist()] for c in twin.checkpoint()
                for i, w, s in zip(c.ids.tolist(), c.weights, c.optimizer_state)}
    for _ in range(5):
        step(60)
    module.flush()
    torch.save(rows(), out + ".flushed")
    for _ in range(5):
        step(90)
    torch.save(rows(), out + ".next")
    def kill(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    if kill_at == "before-record":  # the flush's data and checkpoint are written, SSD_TBE_FLUSH not yet
        store_module._write_json = kill
    elif kill_at == "after-record":  # SSD_TBE_FLUSH replaced, its directory not fsynced yet
        store_module.fsync_directory = kill
    if kill_at != "training":
        module.flush()
    print("TRAINING", flush=True)
    while True:
        step(90)
    """
)


def test_sigkill_at_several_points_reopens_at_last_flush(tmp_path: Path) -> None:
    """A training process killed while training after a flush, or inside the next flush before or after it is
    recorded: RocksDBStore(path, at_last_flush=True) gives exactly the rows of the last completed flush (not a
    mix of the steps since), checked against a twin module that never crashed."""
    expected = {"training": ".flushed", "before-record": ".flushed", "after-record": ".next"}
    children = {
        kill_at: subprocess.Popen(
            [
                sys.executable,
                "-c",
                CRASH_CHILD,
                str(tmp_path / kill_at),
                str(tmp_path / f"{kill_at}-rows"),
                kill_at,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for kill_at in expected
    }
    for kill_at, child in children.items():
        assert child.stdout is not None
        if kill_at == "training":
            line = child.stdout.readline()
            assert line.strip() == "TRAINING", child.stderr.read() if child.stderr else line
            time.sleep(0.5)  # steps since the flush write evicted rows into the store
            child.send_signal(signal.SIGKILL)
        _, err = child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL, err
        want = torch.load(tmp_path / f"{kill_at}-rows{expected[kill_at]}")
        if kill_at == "training":  # the live store holds a mix of the steps since the flush (on a copy:
            # opening and closing a store records its state as a new flush)
            shutil.copytree(tmp_path / kill_at, tmp_path / "copy", ignore=shutil.ignore_patterns("LOCK"))
            with RocksDBStore(tmp_path / "copy") as live:
                assert rows_of(make_module(live)) != want
        module = KeyValueEmbeddingBags(
            TABLES,
            None,
            RocksDBStore(tmp_path / kill_at, at_last_flush=True),
            cache_rows=8,
            optimizer="rowwise_adagrad",
        )
        assert rows_of(module) == want, kill_at
        module.close()


# ---------------------------------------------------------------------------- 4: full disk


class FullDiskStore:
    """A KVStore over a real store whose writes fail with ENOSPC while ``full`` is set (an injected full disk)."""

    def __init__(self, inner: KVStore) -> None:
        self.inner = inner
        self.full = False
        self.refused = 0

    def _check_space(self) -> None:
        if self.full:
            self.refused += 1
            raise DiskFullError("no space left on device (injected)")

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        return self.inner.get(ids, out, table=table)

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        self._check_space()
        self.inner.put(ids, rows, table=table)

    def iter_chunks(self, *, table: int, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.inner.iter_chunks(table=table, chunk_rows=chunk_rows)

    def clear_table(self, *, table: int) -> None:
        self._check_space()
        self.inner.clear_table(table=table)

    def flush(self) -> None:
        self._check_space()
        self.inner.flush()

    def close(self) -> None:
        self._check_space()
        self.inner.close()


@CACHE_PATHS
def test_full_disk_is_recoverable_and_drops_no_dirty_row(tmp_path: Path, cache_on_device: bool) -> None:
    """While the disk is full, flush/checkpoint/save_checkpoint/close and an evicting forward raise
    DiskFullError (an OSError with errno ENOSPC and a package error) and lose nothing: once space is back they
    all work and every row equals a twin that never saw a full disk (the dirty cached rows included)."""
    store = FullDiskStore(RocksDBStore(tmp_path / "db"))
    module = KeyValueEmbeddingBags(
        TABLES, None, store, cache_rows=2000, optimizer="rowwise_adagrad", cache_on_device=cache_on_device
    )
    twin = KeyValueEmbeddingBags(TABLES, None, MemoryStore(), cache_rows=2000, optimizer="rowwise_adagrad")
    gen = torch.Generator().manual_seed(0)

    def step(high: int) -> None:
        indices = torch.randint(0, high, (400,), generator=gen)
        offsets = torch.arange(0, 401, 4)
        for m in (module, twin):
            m(indices, offsets).pow(2).sum().backward()

    for _ in range(20):
        step(2000)  # about 2 x 1,700 rows cached, every one dirty
    store.full = True
    for call in (
        module.flush,
        lambda: list(module.checkpoint()),
        lambda: module.save_checkpoint(tmp_path / "ckpt"),
        module.close,
    ):
        with pytest.raises(DiskFullError) as info:
            call()
        assert isinstance(info.value, SSDTBEAdapterError)
        assert info.value.errno == errno.ENOSPC
    assert module.metrics()["cached_rows"] > 3000
    indices = torch.arange(5000, 9000)  # 4,000 new ids: evicts dirty rows, whose write-back fails
    with pytest.raises(DiskFullError), torch.no_grad():
        module(indices, torch.tensor([0, 2000, 4000]))
    assert not (tmp_path / "ckpt").exists() or not (tmp_path / "ckpt" / "manifest.json").exists()
    store.full = False
    step(2000)  # training goes on
    module.flush()
    assert module.save_checkpoint(tmp_path / "ckpt") == len(rows_of(twin))
    assert rows_of(module) == rows_of(twin)
    module.close()
    reopened = make_module(RocksDBStore(tmp_path / "db"))
    assert rows_of(reopened) == rows_of(twin)
    loaded = make_module()
    loaded.load_checkpoint(tmp_path / "ckpt")
    assert rows_of(loaded) == rows_of(twin)


TMPFS_CHILD = textwrap.dedent(
    """
    import errno, os, sys, torch
    from ssd_tbe_adapter import DiskFullError, KeyValueEmbeddingBags, MemoryStore, RocksDBStore, TableSpec
    mnt = sys.argv[1]
    tables = [TableSpec("a", 16), TableSpec("b", 16)]
    def make(store):
        return KeyValueEmbeddingBags(tables, None, store, cache_rows=4000, optimizer="rowwise_adagrad")
    module = make(RocksDBStore(mnt + "/db", write_buffer_mb=1, block_cache_mb=1))
    twin = make(MemoryStore())
    gen = torch.Generator().manual_seed(0)
    def step():
        indices = torch.randint(0, 3500, (800,), generator=gen)
        for m in (module, twin):
            m(indices, torch.arange(0, 801, 8)).pow(2).sum().backward()
    def rows(m):
        return {(c.table, i): [*w.tolist(), *s.tolist()] for c in m.checkpoint()
                for i, w, s in zip(c.ids.tolist(), c.weights, c.optimizer_state)}
    for _ in range(4):
        step()
    module.flush()
    for _ in range(4):
        step()  # thousands of dirty cached rows again
    free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
    with open(mnt + "/filler", "wb") as handle:
        handle.write(bytes(free - 64 * 1024))
    for call in (module.flush, lambda: rows(module), lambda: module.save_checkpoint(mnt + "/ckpt"), module.close):
        try:
            call()
        except DiskFullError as error:
            assert error.errno == errno.ENOSPC, error
        else:
            raise AssertionError("no DiskFullError on a full disk")
    os.remove(mnt + "/filler")
    step()
    module.flush()
    assert module.save_checkpoint(mnt + "/ckpt") > 0
    assert rows(module) == rows(twin)
    module.close()
    assert rows(make(RocksDBStore(mnt + "/db"))) == rows(twin)
    print("RECOVERED", flush=True)
    """
)


def _can_mount_tmpfs(directory: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {directory}"], capture_output=True
    )
    return probe.returncode == 0


def test_full_tmpfs_real_rocksdb_recovers_once_space_is_freed(tmp_path: Path) -> None:
    """A real RocksDB store on a 4 MiB tmpfs filled up: flush, checkpoint, save_checkpoint and close raise
    DiskFullError (ENOSPC); after the filler is removed they work (the store reopens itself out of RocksDB's
    error state) and every row, the dirty cached ones included, equals a twin that never saw a full disk."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (no unshare or no user namespaces)")
    script = f'mount -t tmpfs -o size=4m tmpfs {mount} && exec "$0" -c "$1" {mount}'
    child = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, TMPFS_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["RECOVERED"], child.stderr


# ---------------------------------------------------------------------------- 6: schema record


@pytest.mark.parametrize(
    ("tables", "options", "message"),
    [
        ([TableSpec("b", 3), TableSpec("a", 4)], {}, r"table 0 is `a` \(dim 4\) there, `b` \(dim 3\) here"),
        ([TableSpec("a", 8), TableSpec("b", 3)], {}, r"table 0 is `a` \(dim 4\) there, `a` \(dim 8\) here"),
        ([TableSpec("a", 4)], {}, "2 tables there, 1 here"),
        (TABLES, {"weights_precision": "fp16"}, "`weights_precision` = 'fp32', this module has 'fp16'"),
        (TABLES, {"optimizer": "sgd"}, "`optimizer` = 'rowwise_adagrad', this module has 'sgd'"),
        (TABLES, {"seed": 7}, "`seed` = 0, this module has 7"),
    ],
    ids=["reordered", "dim", "fewer-tables", "precision", "optimizer", "seed"],
)
def test_store_schema_record_refuses_another_configuration(
    tmp_path: Path, tables: list[TableSpec], options: dict[str, Any], message: str
) -> None:
    """A store reopened by a differently configured module (tables reordered, another dim, precision,
    optimizer or seed) raises SchemaMismatchError naming the difference instead of reading rows as garbage."""
    module = rocksdb_module(tmp_path / "db")
    module.restore(chunks_with(1.0, 10))
    module.close()
    with RocksDBStore(tmp_path / "db") as store:
        with pytest.raises(SchemaMismatchError, match=message) as info:
            KeyValueEmbeddingBags(
                tables, None, store, cache_rows=4, **{"optimizer": "rowwise_adagrad", **options}
            )
        assert str(tmp_path / "db") in str(info.value)
        assert isinstance(info.value, ValueError)
        reopened = make_module(store)  # the same configuration opens and reads the rows
        assert rows_of(reopened) == expected_rows(1.0, 10)


def test_schema_mismatch_fp32_d8_as_fp16_d16(tmp_path: Path) -> None:
    """The issue's case: an fp32 D=8 store (32-byte records) opened as fp16 D=16 (also 32 bytes) is refused."""
    store = MemoryStore()
    KeyValueEmbeddingBags([TableSpec("t", 8)], None, store, cache_rows=2).restore(
        [
            TableChunk(
                table="t", ids=torch.arange(3), weights=torch.ones(3, 8), optimizer_state=torch.zeros(3, 0)
            )
        ]
    )
    with pytest.raises(SchemaMismatchError, match="table 0 is `t` \\(dim 8\\) there, `t` \\(dim 16\\) here"):
        KeyValueEmbeddingBags([TableSpec("t", 16)], None, store, cache_rows=2, weights_precision="fp16")


# ---------------------------------------------------------------------------- 11: load_state_dict


def test_load_state_dict_onto_another_store_warns_that_no_row_moved(tmp_path: Path) -> None:
    """load_state_dict onto a module over a fresh store warns (RowsNotRestoredWarning) that the rows were not
    restored and names load_checkpoint; onto the same store it is silent."""
    source = rocksdb_module(tmp_path / "db")
    source.restore(chunks_with(1.0, 10))
    state = source.state_dict()
    fresh = make_module()
    with pytest.warns(RowsNotRestoredWarning, match="holds no row.*load_checkpoint"):
        fresh.load_state_dict(state)
    other = make_module()
    other.restore(chunks_with(2.0, 3))
    with pytest.warns(RowsNotRestoredWarning, match="not the store the state dict came from"):
        other.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source.load_state_dict(state)
    source.close()


# ---------------------------------------------------------------------------- 7, 8, 9: prefetch


def sgd_module(
    store: KVStore | None = None, cache_rows: int = 64, cache_on_device: bool = False
) -> KeyValueEmbeddingBags:
    return KeyValueEmbeddingBags(
        [TableSpec("t", 2)],
        None,
        MemoryStore() if store is None else store,
        cache_rows=cache_rows,
        optimizer="sgd",
        learning_rate=1.0,
        init_range=(0.0, 0.0),
        cache_on_device=cache_on_device,
    )


def test_prefetch_then_indices_changed_in_place_updates_the_ids_forward_used() -> None:
    """prefetch(idx), then idx changed in place, then forward(idx): the update lands on the ids forward looked
    up (the prefetch is matched by content and version, not by tensor identity)."""
    module = sgd_module()
    indices = torch.tensor([1, 2, 3, 4])
    offsets = torch.tensor([0, 4])
    module.prefetch(indices, offsets)
    indices.copy_(torch.tensor([10, 11, 12, 13]))
    module(indices, offsets).sum().backward()
    rows = {
        i: w.tolist() for c in module.checkpoint() for i, w in zip(c.ids.tolist(), c.weights, strict=True)
    }
    assert {i for i, w in rows.items() if w != [0.0, 0.0]} == {10, 11, 12, 13}
    assert module.metrics()["forwards_without_prefetch"] == 1
    same = torch.tensor([5, 6])
    module.prefetch(same, torch.tensor([0, 2]))
    module(same.clone(), torch.tensor([0, 2])).sum().backward()  # equal content, other tensors: matched
    assert module.metrics()["forwards_without_prefetch"] == 1


@CACHE_PATHS
def test_skipped_prefetch_does_not_desync_the_queue(cache_on_device: bool) -> None:
    """Prefetching one batch ahead with one prefetch skipped and one stale prefetch never consumed: every other
    forward still uses its own prefetch (the queue re-aligns), and every update lands exactly once."""
    module = sgd_module(cache_rows=32, cache_on_device=cache_on_device)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 40, (8,), generator=gen) for _ in range(30)]
    offsets = torch.tensor([0, 8])
    expected = torch.zeros(40)
    module.prefetch(batches[0], offsets)
    for step, indices in enumerate(batches):
        if step + 1 < len(batches) and step != 5:  # batch 6 is never prefetched
            module.prefetch(batches[step + 1], offsets)
        if step == 12:
            module.prefetch(torch.tensor([99, 98]), torch.tensor([0, 2]))  # a batch that never comes
        module(indices, offsets).sum().backward()
        expected -= torch.bincount(indices, minlength=40).float()
    metrics = module.metrics()
    assert metrics["forwards_without_prefetch"] == 1
    assert metrics["forward_hit_rate"] > 0.95
    rows = {
        i: float(w[0]) for c in module.checkpoint() for i, w in zip(c.ids.tolist(), c.weights, strict=True)
    }
    assert [rows.get(i, 0.0) for i in range(40)] == expected.tolist()


class FlakyStore(MemoryStore):
    """A MemoryStore whose reads fail while ``broken`` is set."""

    broken = False

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        if self.broken:
            raise StoreIOError("read failed (injected)")
        return super().get(ids, out, table=table)


@CACHE_PATHS
def test_flush_and_close_work_after_a_failed_prefetch(cache_on_device: bool) -> None:
    """A prefetch whose store read failed: wait_prefetch raises its error once, the forward of that batch
    reads its rows itself once the store works, and flush and close work (no row lost)."""
    store = FlakyStore()
    module = sgd_module(store, cache_rows=4, cache_on_device=cache_on_device)
    module(torch.arange(8), torch.tensor([0, 8])).sum().backward()  # dirty rows, some written back
    store.broken = True
    module.prefetch(torch.arange(20, 28), torch.tensor([0, 8]))
    with pytest.raises(StoreIOError, match="injected"):
        module.wait_prefetch()
    module.wait_prefetch()  # raised once
    module.prefetch(torch.arange(30, 38), torch.tensor([0, 8]))
    store.broken = False
    module.flush()  # drops the failed prefetch, flushes every dirty row
    module(torch.arange(30, 38), torch.tensor([0, 8])).sum().backward()
    rows = {
        i: float(w[0]) for c in module.checkpoint() for i, w in zip(c.ids.tolist(), c.weights, strict=True)
    }
    assert rows == dict.fromkeys([*range(8), *range(30, 38)], -1.0)
    module.close()


# ---------------------------------------------------------------------------- 10: error classes


def bad(value: object) -> Any:
    """``value`` typed as anything: an argument of the wrong kind on purpose."""
    return value


def closed_then(thing: MemoryStore | KeyValueEmbeddingBags) -> None:
    """Close ``thing``, then use it."""
    thing.close()
    thing.flush()


def _bad_calls(tmp_path: Path) -> list[tuple[str, Callable[[], object], type[BaseException]]]:
    module = make_module()
    store = MemoryStore()
    (tmp_path / "file").write_text("x")
    return [
        (
            "optimizer",
            lambda: KeyValueEmbeddingBags(TABLES, None, store, cache_rows=2, optimizer=bad("adam")),
            ValueError,
        ),
        (
            "pooling",
            lambda: KeyValueEmbeddingBags(TABLES, None, store, cache_rows=2, pooling=bad("max")),
            ValueError,
        ),
        (
            "learning_rate",
            lambda: KeyValueEmbeddingBags(TABLES, None, store, cache_rows=2, learning_rate=-1.0),
            ValueError,
        ),
        (
            "init_range",
            lambda: KeyValueEmbeddingBags(TABLES, None, store, cache_rows=2, init_range=(1.0, 0.0)),
            ValueError,
        ),
        ("tables", lambda: KeyValueEmbeddingBags([], None, store, cache_rows=2), ValueError),
        ("feature_table_map", lambda: KeyValueEmbeddingBags(TABLES, [5], store, cache_rows=2), ValueError),
        ("cache_rows", lambda: KeyValueEmbeddingBags(TABLES, None, store, cache_rows=-1), ValueError),
        ("store", lambda: KeyValueEmbeddingBags(TABLES, None, bad(object()), cache_rows=2), TypeError),
        ("dim", lambda: TableSpec("a", 0), ValueError),
        (
            "ids",
            lambda: TableChunk(
                table="a", ids=torch.zeros(2), weights=torch.zeros(2, 4), optimizer_state=torch.zeros(2, 1)
            ),
            ValueError,
        ),
        ("indices", lambda: module(torch.zeros(3), torch.tensor([0, 3])), ValueError),
        ("offsets", lambda: module(torch.arange(3), torch.tensor([0, 4, 3])), ValueError),
        (
            "per_sample_weights",
            lambda: module(torch.arange(4), torch.tensor([0, 2, 4]), torch.ones(3)),
            ValueError,
        ),
        (
            "batch_size_per_feature_per_rank",
            lambda: module(torch.arange(4), torch.tensor([0, 2, 4]), None, [[1]]),
            ValueError,
        ),
        ("chunk_rows", lambda: list(module.checkpoint(chunk_rows=0)), ValueError),
        ("io_threads", lambda: RocksDBStore(tmp_path / "db", io_threads=0), ValueError),
        ("wal_recovery", lambda: RocksDBStore(tmp_path / "db", wal_recovery=bad("lax")), ValueError),
        ("store `ids`", lambda: store.get(torch.zeros(2), torch.zeros(2, 4, dtype=torch.uint8)), ValueError),
        (
            "store `rows`",
            lambda: store.put(torch.arange(2), torch.zeros(3, 4, dtype=torch.uint8)),
            ValueError,
        ),
        (
            "store table",
            lambda: store.put(torch.arange(1), torch.zeros(1, 4, dtype=torch.uint8), table=2**32 - 1),
            ValueError,
        ),
        ("missing checkpoint", lambda: module.load_checkpoint(tmp_path / "nowhere"), FileNotFoundError),
        ("store under a file", lambda: RocksDBStore(tmp_path / "file" / "db"), OSError),
        ("checkpoint under a file", lambda: module.save_checkpoint(tmp_path / "file" / "ckpt"), OSError),
        (
            "missing store",
            lambda: RocksDBStore(tmp_path / "absent", create_if_missing=False),
            FileNotFoundError,
        ),
        ("closed store", lambda: closed_then(store), RuntimeError),
        ("closed module", lambda: closed_then(module), RuntimeError),
    ]


BAD_CALLS = [
    "optimizer", "pooling", "learning_rate", "init_range", "tables", "feature_table_map", "cache_rows", "store",
    "dim", "ids", "indices", "offsets", "per_sample_weights", "batch_size_per_feature_per_rank", "chunk_rows",
    "io_threads", "wal_recovery", "store `ids`", "store `rows`", "store table", "missing checkpoint",
    "store under a file", "checkpoint under a file", "missing store", "closed store", "closed module",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_CALLS, ids=BAD_CALLS)
def test_every_deliberate_error_is_a_package_error_and_the_matching_builtin(
    tmp_path: Path, case: str
) -> None:
    """Bad arguments, missing paths, mkdir failures and closed objects raise errors that are instances of
    SSDTBEAdapterError and of the matching builtin (`except SSDTBEAdapterError` catches every one)."""
    calls = {name: (call, builtin) for name, call, builtin in _bad_calls(tmp_path)}
    assert sorted(calls) == sorted(BAD_CALLS)
    call, builtin = calls[case]
    with pytest.raises(SSDTBEAdapterError) as info:
        call()
    assert isinstance(info.value, builtin)
    assert type(info.value).__module__ == "ssd_tbe_adapter.errors"


def test_source_raises_only_package_errors() -> None:
    """Every `raise X(...)` in the package's source names a class of ssd_tbe_adapter.errors (no bare builtin)."""
    source = Path(ssd_tbe_adapter.__file__).parent
    allowed = {*ssd_tbe_adapter.errors.__all__, "io_error", "_classify"}  # those two return package errors
    offenders = [
        f"{file.name}:{node.lineno} raises {node.exc.func.id}"
        for file in sorted(source.glob("*.py"))
        for node in ast.walk(ast.parse(file.read_text()))
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and node.exc.func.id not in allowed
    ]
    assert offenders == []


# ---------------------------------------------------------------------------- context manager, close


def test_rocksdb_store_is_a_context_manager(tmp_path: Path) -> None:
    """`with RocksDBStore(path) as store` (and `with KeyValueEmbeddingBags(...)`) closes and flushes at the end of
    the block."""
    with RocksDBStore(tmp_path / "db") as store:
        store.put(torch.tensor([3]), torch.full((1, 4), 9, dtype=torch.uint8))
    with pytest.raises(StoreClosedError):
        store.put(torch.tensor([4]), torch.zeros(1, 4, dtype=torch.uint8))
    with RocksDBStore(tmp_path / "db", create_if_missing=False) as store:
        out = torch.zeros(1, 4, dtype=torch.uint8)
        assert bool(store.get(torch.tensor([3]), out).all())
        assert out.tolist() == [[9] * 4]
    with MemoryStore() as memory:
        memory.put(torch.tensor([1]), torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(StoreClosedError):
        memory.flush()
    with make_module(RocksDBStore(tmp_path / "kv")) as module:
        module.restore(chunks_with(1.0, 5))
    with pytest.raises(StoreClosedError):
        module.store.flush()


def test_close_waits_for_chunk_iterators_and_ends_them(tmp_path: Path) -> None:
    """close() while iterations are open: a thread iterating a large table either finishes or gets
    StoreClosedError at its next chunk (never a crash or a read of a closed database); a paused iteration
    raises StoreClosedError on its next chunk."""
    store = RocksDBStore(tmp_path / "db")
    store.put(torch.arange(20000), torch.full((20000, 16), 1, dtype=torch.uint8))
    paused = store.iter_chunks(table=0, chunk_rows=100)
    first_ids, _ = next(paused)
    assert first_ids.tolist() == list(range(100))
    outcome: list[str] = []
    started = threading.Event()

    def iterate() -> None:
        rows = 0
        try:
            for ids, _ in store.iter_chunks(table=0, chunk_rows=50):
                rows += ids.numel()
                started.set()
            outcome.append(f"finished {rows}")
        except StoreClosedError:
            outcome.append("closed")

    thread = threading.Thread(target=iterate)
    thread.start()
    started.wait(timeout=30)
    store.close()
    thread.join(timeout=30)
    assert outcome in (["closed"], ["finished 20000"])
    with pytest.raises(StoreClosedError, match="closed"):
        next(paused)


def test_at_last_flush_refuses_a_store_open_in_another_process(tmp_path: Path) -> None:
    """Rolling back a store that another process has open raises StoreOpenError and touches no file."""
    path = tmp_path / "db"
    with RocksDBStore(path) as store:
        store.put(torch.arange(3), torch.ones(3, 4, dtype=torch.uint8))
        store.flush()
        store.put(torch.arange(3, 6), torch.ones(3, 4, dtype=torch.uint8))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import rocksdict, sys, time; db = rocksdict.Rdict(sys.argv[1]); print('OPEN', flush=True); time.sleep(60)",
            str(path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "OPEN"
        with pytest.raises(StoreOpenError, match="open in another process"):
            RocksDBStore(path, at_last_flush=True)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with RocksDBStore(path) as store:  # closing flushed all six rows
        assert sum(ids.numel() for ids, _ in store.iter_chunks(table=0, chunk_rows=10)) == 6
    with pytest.raises(StoreOpenError, match="no completed flush"):
        RocksDBStore(tmp_path / "fresh", at_last_flush=True)


READ_ONLY_CHILD = textwrap.dedent(
    """
    import subprocess, sys, torch
    from ssd_tbe_adapter import StoreIOError, StoreOpenError, RocksDBStore
    mnt = sys.argv[1]
    with RocksDBStore(mnt + "/db") as store:
        store.put(torch.arange(2), torch.ones(2, 4, dtype=torch.uint8))
    subprocess.run(["mount", "-o", "remount,ro", mnt], check=True)
    for path in (mnt + "/db", mnt + "/new"):
        try:
            RocksDBStore(path)
        except StoreOpenError as error:
            assert "read-only" in str(error).lower(), error
            assert "corrupt" not in str(error), error
        else:
            raise AssertionError("opened a store on a read-only filesystem")
    print("REFUSED", flush=True)
    """
)


def test_read_only_directory_is_a_clear_open_error(tmp_path: Path) -> None:
    """A store on a read-only filesystem (existing or to be created) raises StoreOpenError saying so, not
    "corrupt, locked, or not a RocksDB database" or a raw OSError."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    if not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (no unshare or no user namespaces)")
    script = f'mount -t tmpfs -o size=4m tmpfs {mount} && exec "$0" -c "$1" {mount}'
    child = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, READ_ONLY_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["REFUSED"], child.stderr


def test_format_1_checkpoint_still_loads_and_a_truncated_one_names_its_file(tmp_path: Path) -> None:
    """A checkpoint written before checksums (format 1: chunk files beside the manifest) loads; a truncated
    chunk of one raises CheckpointCorruptError naming the file (was `EOFError('')`), live rows untouched."""
    module = make_module()
    directory = tmp_path / "old"
    directory.mkdir()
    files = []
    for number, chunk in enumerate(chunks_with(3.0, 20)):
        name = f"chunk-{number:06d}.pt"
        torch.save(
            {
                "table": chunk.table,
                "ids": chunk.ids,
                "weights": chunk.weights,
                "state": chunk.optimizer_state,
            },
            directory / name,
        )
        files.append(name)
    config = {key: value for key, value in module.get_extra_state().items() if key != "store_id"}
    manifest = {"format": 1, **config, "files": files, "rows": 40}
    (directory / "manifest.json").write_text(json.dumps(manifest))
    assert module.load_checkpoint(directory) == 40
    assert rows_of(module) == expected_rows(3.0, 20)
    data = (directory / files[1]).read_bytes()
    (directory / files[1]).write_bytes(data[:100])
    live = make_module()
    live.restore(chunks_with(4.0, 5))
    with pytest.raises(CheckpointCorruptError, match=files[1]):
        live.load_checkpoint(directory)
    assert rows_of(live) == expected_rows(4.0, 5)
