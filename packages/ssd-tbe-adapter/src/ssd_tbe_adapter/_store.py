"""Key-value stores: :class:`RocksDBStore` (embedded RocksDB through ``rocksdict``) and :class:`MemoryStore`.

Keys are 12 bytes: the table number as big-endian ``uint32`` followed by the id as big-endian ``uint64``
with its sign bit flipped, so RocksDB's byte order is (table, id) numeric order and one table is one
contiguous key range (checkpoints stream it with a single iterator).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import itertools
import json
import os
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch

from ssd_tbe_adapter._cache import copy_rows, select_rows
from ssd_tbe_adapter._checkpoint import fsync_directory, io_error
from ssd_tbe_adapter.errors import (
    DiskFullError,
    InvalidArgumentError,
    SSDTBEAdapterError,
    StoreClosedError,
    StoreCorruptError,
    StoreIOError,
    StoreNotFoundError,
    StoreOpenError,
    StoreUnavailableError,
)

__all__ = ["MemoryStore", "RocksDBStore"]

try:
    fcntl: Any = importlib.import_module("fcntl")
except ImportError:  # pragma: no cover - not a POSIX host
    fcntl = None

_KEY_DTYPE = np.dtype([("table", ">u4"), ("id", ">u8")])
_KEY_BYTES = _KEY_DTYPE.itemsize
_SIGN = np.uint64(1 << 63)
# RocksDBStore.get splits a multi-get of at least this many keys over its I/O threads, in contiguous chunks
# of at least half as many keys: below that the hand-off costs more than the parallel reads save.
_SPLIT_MIN_KEYS = 2048


def _check_ids(ids: torch.Tensor) -> np.ndarray[Any, np.dtype[np.int64]]:
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.device.type != "cpu":
        raise InvalidArgumentError(
            f"`ids` must be a 1-D int64 CPU tensor, got {tuple(ids.shape)} {ids.dtype} on {ids.device}"
        )
    array: np.ndarray[Any, np.dtype[np.int64]] = ids.contiguous().numpy()
    return array


def _check_rows(rows: torch.Tensor, n: int, name: str) -> None:
    if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.device.type != "cpu" or rows.shape[0] != n:
        raise InvalidArgumentError(
            f"`{name}` must be a [{n}, row_bytes] uint8 CPU tensor, got {tuple(rows.shape)} {rows.dtype} on {rows.device}"
        )
    if not rows.is_contiguous():
        raise InvalidArgumentError(f"`{name}` must be contiguous")


def _check_table(table: int) -> None:
    if not 0 <= table < 2**32 - 1:
        raise InvalidArgumentError(f"`table` must be in [0, 2**32 - 1), got {table}")


def encode_keys(table: int, ids: np.ndarray[Any, np.dtype[np.int64]]) -> list[bytes]:
    """The 12-byte keys of ``ids`` in ``table`` (see the module docstring)."""
    keys = np.empty(ids.shape[0], dtype=_KEY_DTYPE)
    keys["table"] = table
    keys["id"] = ids.view(np.uint64) ^ _SIGN
    encoded: list[bytes] = keys.view(f"V{_KEY_BYTES}").tolist()
    return encoded


def encode_values(rows: torch.Tensor) -> list[bytes]:
    """The records ``[N, row_bytes]`` uint8 (contiguous, CPU) as ``N`` byte strings (one C-level ``tolist``)."""
    values: list[bytes] = rows.numpy().view(f"V{rows.shape[1]}").ravel().tolist()
    return values


def write_batch(
    rocksdict: Any,
    table: int,
    ids: np.ndarray[Any, np.dtype[np.int64]],
    rows: torch.Tensor,
    *,
    column_family: Any = None,
) -> Any:
    """A ``rocksdict.WriteBatch`` putting ``rows[i]`` under the key of ``ids[i]`` in ``table`` (into
    ``column_family``, a column family handle, when given). ``rocksdict`` takes one key at a time: the loop
    over ``put`` runs on the caller's thread holding the GIL (about 0.4 µs per row)."""
    batch = rocksdict.WriteBatch(raw_mode=True)
    if column_family is not None:
        batch.set_default_column_family(column_family)
    put = batch.put
    for key, value in zip(encode_keys(table, ids), encode_values(rows), strict=True):
        put(key, value)
    return batch


def decode_ids(keys: bytes, n: int) -> torch.Tensor:
    """Ids ``[n]`` int64 of ``n`` concatenated 12-byte keys."""
    array = np.frombuffer(keys, dtype=_KEY_DTYPE, count=n)
    return torch.from_numpy((array["id"] ^ _SIGN).astype(np.uint64).view(np.int64).copy())


class MemoryStore:
    """A :class:`~ssd_tbe_adapter.interfaces.KVStore` in host memory (tests, benchmarks, small tables).

    Per table a sorted ``int64`` id array with each id's row number (``np.searchsorted`` lookups, no
    per-id Python work) over a growing ``uint8`` row matrix. Nothing survives the process.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[int, _MemoryTable] = {}
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("this MemoryStore was closed")

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        """Read the rows of ``ids`` into ``out`` (see :meth:`KVStore.get`)."""
        _check_table(table)
        array = _check_ids(ids)
        _check_rows(out, array.shape[0], "out")
        with self._lock:
            self._check_open()
            data = self._tables.get(table)
            if data is None or array.shape[0] == 0 or data.size == 0:
                return torch.zeros(array.shape[0], dtype=torch.bool)
            if data.rows.shape[1] != out.shape[1]:
                raise StoreCorruptError(
                    f"table {table} holds {data.rows.shape[1]}-byte rows, `out` has {out.shape[1]}-byte rows"
                )
            positions_np, found_np = data.find(array)
            found = torch.from_numpy(found_np)
            positions = torch.from_numpy(positions_np)
            if bool(found_np.all()):
                torch.index_select(_bits(data.rows), 0, positions, out=_bits(out))
            else:
                hit = found.nonzero().flatten()
                copy_rows(out, hit, select_rows(data.rows, positions.index_select(0, hit)))
            return found

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        """Write ``rows`` as the records of ``ids`` (see :meth:`KVStore.put`); a repeated id keeps its last row."""
        _check_table(table)
        array = _check_ids(ids)
        _check_rows(rows, array.shape[0], "rows")
        if array.shape[0] == 0:
            return
        # A repeated id keeps its last row (the Protocol asks for unique ids; be exact anyway).
        order = np.argsort(array, kind="stable")
        ordered = array[order]
        last = np.ones(array.shape[0], dtype=np.bool_)
        last[:-1] = ordered[1:] != ordered[:-1]
        if not bool(last.all()):
            order = order[last]
            array = ordered[last]
            rows = select_rows(rows, torch.from_numpy(order))
        with self._lock:
            self._check_open()
            data = self._tables.get(table)
            if data is None:
                data = self._tables[table] = _MemoryTable(rows.shape[1], array.shape[0])
            if data.rows.shape[1] != rows.shape[1]:
                raise StoreCorruptError(
                    f"table {table} holds {data.rows.shape[1]}-byte rows, `rows` has {rows.shape[1]}-byte rows"
                )
            data.put(array, rows)

    def iter_chunks(self, *, table: int, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Stream the records of ``table`` in id order (see :meth:`KVStore.iter_chunks`)."""
        _check_table(table)
        if chunk_rows < 1:
            raise InvalidArgumentError(f"`chunk_rows` must be >= 1, got {chunk_rows}")
        with self._lock:
            self._check_open()
            data = self._tables.get(table)
            if data is None:
                return
            keys = data.keys[: data.size].copy()
            positions = data.positions[: data.size].copy()
        for start in range(0, keys.shape[0], chunk_rows):
            part = torch.from_numpy(positions[start : start + chunk_rows])
            with self._lock:
                self._check_open()
                chunk = select_rows(self._tables[table].rows, part)
            yield torch.from_numpy(keys[start : start + chunk_rows].copy()), chunk

    def clear_table(self, *, table: int) -> None:
        """Delete every record of ``table``."""
        _check_table(table)
        with self._lock:
            self._check_open()
            self._tables.pop(table, None)

    def flush(self) -> None:
        """Nothing to do: memory is as durable as this store gets."""
        self._check_open()

    def close(self) -> None:
        """Drop every row."""
        with self._lock:
            self._closed = True
            self._tables.clear()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _bits(rows: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[N, W]`` uint8 tensor as ``[N, W / 4]`` int32 when ``W % 4 == 0`` (faster row copies)."""
    return rows.view(torch.int32) if rows.shape[1] % 4 == 0 else rows


class _MemoryTable:
    """One table of a :class:`MemoryStore`: ``keys[:size]`` ascending, ``positions[i]`` the row of ``keys[i]``.

    Rows are never moved or freed (ids are never deleted one by one), so a new id appends a row. While the
    ids are non-negative and not much sparser than ``[0, 4 * size + 2**16)``, ``dense[id]`` (-1 if absent)
    answers lookups with one gather instead of a binary search; a sparser id puts the table on the sorted
    index alone for good.
    """

    def __init__(self, width: int, capacity: int) -> None:
        self.size = 0
        self.keys: np.ndarray[Any, np.dtype[np.int64]] = np.zeros(0, dtype=np.int64)
        self.positions: np.ndarray[Any, np.dtype[np.int64]] = np.zeros(0, dtype=np.int64)
        self.dense: np.ndarray[Any, np.dtype[np.int64]] | None = np.full(0, -1, dtype=np.int64)
        self.rows = torch.empty(max(1024, capacity), width, dtype=torch.uint8)

    def find(
        self, ids: np.ndarray[Any, np.dtype[np.int64]]
    ) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.bool_]]]:
        """``(positions, found)`` of ``ids`` (any order); positions of absent ids are arbitrary valid rows."""
        dense = self.dense
        if dense is not None and ids.shape[0] and int(ids.min()) >= 0 and int(ids.max()) < dense.shape[0]:
            positions = dense[ids]
            found = positions >= 0
            if not bool(found.all()):
                positions = np.where(found, positions, 0)
            return positions, found
        if self.size == 0:
            return np.zeros(ids.shape[0], dtype=np.int64), np.zeros(ids.shape[0], dtype=np.bool_)
        where = np.searchsorted(self.keys, ids)
        np.minimum(where, self.size - 1, out=where)
        return self.positions[where], self.keys[where] == ids

    def _index_dense(
        self, ids: np.ndarray[Any, np.dtype[np.int64]], positions: np.ndarray[Any, np.dtype[np.int64]]
    ) -> None:
        """Add new ascending ``ids`` to the dense index, growing it, or drop it when ids are too sparse."""
        if self.dense is None:
            return
        low, high = int(ids[0]), int(ids[-1])
        if low < 0 or high >= 4 * self.size + 2**16:
            self.dense = None
            return
        if high >= self.dense.shape[0]:
            grown = np.full(max(high + 1, 2 * self.dense.shape[0]), -1, dtype=np.int64)
            grown[: self.dense.shape[0]] = self.dense
            self.dense = grown
        self.dense[ids] = positions

    def put(self, ids: np.ndarray[Any, np.dtype[np.int64]], rows: torch.Tensor) -> None:
        """Insert or overwrite rows of unique ``ids`` (any order)."""
        positions, found = self.find(ids)
        fresh = ~found
        count = int(fresh.sum())
        if count:
            positions = positions.copy()
            positions[fresh] = np.arange(self.size, self.size + count, dtype=np.int64)
            new_ids, new_positions = ids[fresh], positions[fresh]
            order = np.argsort(new_ids)
            new_ids, new_positions = new_ids[order], new_positions[order]
            at = np.searchsorted(self.keys, new_ids)
            self.keys = np.insert(self.keys, at, new_ids)
            self.positions = np.insert(self.positions, at, new_positions)
            self.size += count
            self._index_dense(new_ids, new_positions)
            if self.size > self.rows.shape[0]:
                grown = torch.empty(
                    max(self.size, 2 * self.rows.shape[0]), self.rows.shape[1], dtype=torch.uint8
                )
                grown[: self.size - count] = self.rows[: self.size - count]
                self.rows = grown
        copy_rows(self.rows, torch.from_numpy(positions), rows)


def _import_rocksdict() -> Any:
    try:
        import rocksdict
    except ImportError as error:  # pragma: no cover - rocksdict is a runtime dependency
        raise StoreUnavailableError(
            "RocksDBStore needs `rocksdict` (pip install rocksdict); use MemoryStore() without it"
        ) from error
    return rocksdict


def default_io_threads() -> int:
    """``RocksDBStore``'s default ``io_threads``: half the cores (``os.cpu_count() // 2``), 1 to 4."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


# The store's own records live under table number 2**32 - 1, which put() refuses: iterations and range
# deletes of tables never see them.
_META = b"\xff\xff\xff\xff"
_FLUSH_KEY = _META + b"flush"
_FLUSH_FILE = "SSD_TBE_FLUSH"  # JSON {"flush": n, "checkpoint": dir or null}: the last completed flush()
_ROLLBACK_FILE = "SSD_TBE_ROLLBACK"  # present while a rollback to the last flush is in progress
_LAST_FLUSH_DIR = ".last-flush"  # RocksDB checkpoints (hard links) of completed flushes
# RocksDB cannot tell a damaged WAL record header from a write cut short at the end of the log: only absolute
# consistency refuses both, every other mode opens without the rest of the log.
_WAL_MODES = {"strict": "absolute_consistency", "tolerate_tail": "tolerate_corrupted_tail_records"}
_KEEP_ON_ROLLBACK = frozenset({_FLUSH_FILE, _ROLLBACK_FILE, "LOCK", "rocksdict-config.json"})


def _classify(error: Exception, path: Path, action: str) -> SSDTBEAdapterError:
    """The package error for a RocksDB status (``rocksdict`` raises a plain ``Exception`` for every one)."""
    text = str(error)
    where = f"store {str(path)!r}"
    if "No space left" in text:
        return DiskFullError(
            f"no space left on the device of {where} while {action}: free space and retry "
            f"(acknowledged writes and dirty cached rows are kept) [{text}]"
        )
    if "Corruption" in text or "checksum mismatch" in text:
        return StoreCorruptError(f"{where} is corrupt ({action}): {text}")
    if action == "opening" and "No such file" in text:
        return StoreCorruptError(f"{where} is missing a file its MANIFEST or CURRENT names: {text}")
    if "Permission denied" in text or "Read-only file system" in text:
        return StoreOpenError(f"no permission to use {where} ({action}; read-only directory?): {text}")
    if action == "opening" and "lock" in text.lower():
        return StoreOpenError(f"{where} is locked by another process or already open in this one: {text}")
    return StoreIOError(f"I/O error on {where} while {action}: {text}")


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except ValueError as error:
        raise StoreCorruptError(f"store file {str(path)!r} is unreadable: {error}") from error
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace ``path`` atomically and durably (temporary file, fsync, rename, fsync of the directory)."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(json.dumps(data))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold RocksDB's ``LOCK`` file of ``path`` (the ``fcntl`` lock RocksDB takes), so that no other process has
    the database open while its files are replaced."""
    if fcntl is None:  # pragma: no cover - not a POSIX host
        yield
        return
    descriptor = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            raise StoreOpenError(
                f"store `path` {str(path)!r} is open in another process: cannot roll it back to its last flush"
            ) from error
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _rollback_to_last_flush(path: Path) -> None:
    """Replace the database files of ``path`` by the checkpoint of its last completed flush (idempotent: a
    rollback interrupted by a crash is redone from the untouched checkpoint by the next open)."""
    if not (path / _FLUSH_FILE).is_file() and not (path / _ROLLBACK_FILE).is_file():
        raise StoreOpenError(f"store `path` {str(path)!r} has no completed flush to go back to")
    with _exclusive(path):
        _replace_by_last_flush(path)


def _replace_by_last_flush(path: Path) -> None:
    state = _read_json(path / _ROLLBACK_FILE) or _read_json(path / _FLUSH_FILE)
    if state is None or not state.get("checkpoint"):
        raise StoreOpenError(
            f"store `path` {str(path)!r} has no last-flush checkpoint to go back to (never flushed, or "
            "opened with keep_last_flush=False)"
        )
    source = path / str(state["checkpoint"])
    if not (source / "CURRENT").is_file():
        raise StoreCorruptError(
            f"the last-flush checkpoint {str(source)!r} of store {str(path)!r} is missing"
        )
    _write_json(path / _ROLLBACK_FILE, state)
    staging = path / ".rollback"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for file in source.iterdir():
        # SST files are immutable: share them. MANIFEST, CURRENT, OPTIONS and logs may be appended to or
        # replaced by the reopened database, so they are copied (the checkpoint stays as it was).
        if file.suffix == ".sst":
            os.link(file, staging / file.name)
        else:
            shutil.copy2(file, staging / file.name)
    fsync_directory(staging)
    for entry in path.iterdir():
        if entry.is_file() and entry.name not in _KEEP_ON_ROLLBACK:
            entry.unlink()
    for file in staging.iterdir():
        os.rename(file, path / file.name)
    fsync_directory(path)
    staging.rmdir()
    (path / _ROLLBACK_FILE).unlink()
    fsync_directory(path)


class _Cursor:
    """One ``iter_chunks`` iteration's RocksDB iterator; ``close()`` and a reopen drop it (``iterator = None``)."""

    __slots__ = ("iterator", "reason")

    def __init__(self, iterator: Any) -> None:
        self.iterator: Any = iterator
        self.reason = ""


class RocksDBStore:
    """A :class:`~ssd_tbe_adapter.interfaces.KVStore` on an embedded RocksDB database (``rocksdict``, raw mode).

    Options (RocksDB defaults unless listed):

    - write-ahead log on: every ``put`` batch goes to the WAL before it is acknowledged, so a killed process
      loses nothing that was put; ``flush()`` also flushes the memtable to SST files and fsyncs the WAL
      (survives a power loss).
    - ``paranoid_checks`` and WAL recovery mode ``absolute_consistency`` (``wal_recovery="strict"``): a
      missing or damaged SST file, a damaged MANIFEST or any damaged or cut-short WAL record refuses to open
      (:class:`StoreCorruptError`, whose message says how to open anyway) instead of opening with rows
      missing.
    - ``optimize_for_point_lookup(block_cache_mb)``: bloom filters and a block cache sized for point gets,
      which is all an embedding cache does.
    - ``allow_mmap_reads``: SST files are read through ``mmap`` instead of ``pread`` (no system call and no
      buffer copy per block read; point gets of rows not in the block cache cost about 3 µs instead of 8 µs
      in the CPU benchmark). Turn it off (``mmap_reads=False``) on 32-bit hosts or filesystems without mmap.
    - no compression: embedding rows are noise to a compressor.
    - ``write_buffer_mb`` memtable size, ``max_background_jobs`` flush/compaction threads.

    Durability (see docs/ssd-tbe-adapter.md, "Durability contract"): every completed :meth:`flush` is
    numbered; the number is written into the database with the flushed rows and into the file
    ``SSD_TBE_FLUSH`` beside it, and (``keep_last_flush``) a RocksDB checkpoint of that state is kept under
    ``.last-flush/`` (hard links of the SST files: little extra space until compactions replace them). Opening
    a database that holds an older flush than ``SSD_TBE_FLUSH`` records (flushed rows lost: truncated MANIFEST,
    deleted SST files) raises :class:`StoreCorruptError`; ``at_last_flush=True`` reopens the store at its last
    completed flush, discarding every write since (after a crash: the rows evicted or written through since
    that flush, so the tables are as one consistent step left them).

    Errors: every RocksDB status becomes a package error naming the path: :class:`StoreCorruptError` (bad
    checksum on any read path, ``iter_chunks`` included), :class:`DiskFullError` (ENOSPC; recoverable: the next
    call reopens the database, and nothing acknowledged is lost), :class:`StoreIOError` (other I/O errors),
    :class:`StoreOpenError` (locked, no permission).

    Threads: RocksDB is thread-safe and ``rocksdict`` releases the GIL inside a multi-get, so calls from
    several threads run at once (the store only counts calls in flight, so that :meth:`close` waits for
    them). A ``get`` of at least 2048 ids is split into up to ``io_threads`` contiguous chunks read at once
    (the calling thread reads one; a small pool owned by the store the others): 1.3-1.9x per multi-get of
    2,560-10,240 keys with 2 threads on a 2-core host. The default leaves half the cores to compute: on that
    2-core host a prefetching training step was *slower* with 2 I/O threads (108 against 96 ms per step),
    the second thread taking the core the training thread computes on. A ``put`` stays one ``WriteBatch``
    written by the calling thread: RocksDB applies a batch on one thread, and splitting it over threads
    (measured: 2 batches from 2 threads were slower than 1) would only give up its atomicity.

    Usable as a context manager (``with RocksDBStore(path) as store: ...`` closes it).

    Args:
        path: database directory; created when missing if ``create_if_missing``.
        create_if_missing: create a new database at a missing ``path`` (else :class:`StoreNotFoundError`).
        block_cache_mb: block cache for point lookups, MiB.
        write_buffer_mb: memtable size, MiB.
        max_background_jobs: RocksDB background threads.
        sync_writes: fsync the WAL on every ``put`` (slow; only needed against power loss between flushes).
        mmap_reads: read SST files through ``mmap`` (see above).
        io_threads: threads one large ``get`` is split over, ``>= 1``; 1 reads every batch on the calling
            thread. Default: half the cores, at most 4 (:func:`default_io_threads`).
        keep_last_flush: keep a checkpoint of the last completed flush (for ``at_last_flush``).
        at_last_flush: before opening, roll the database back to its last completed flush.
        wal_recovery: ``"strict"`` refuses to open a store whose write-ahead log has a damaged or cut-short
            record (RocksDB cannot tell them apart); ``"tolerate_tail"`` opens it without the log from that
            record on (a write torn by a crash, or a damaged header, drops the rest of the log).

    Raises:
        StoreNotFoundError: ``path`` is missing and ``create_if_missing`` is false.
        StoreOpenError: ``path`` is a file or not a RocksDB database, is locked by another process, cannot
            be written, or (``at_last_flush``) has no last-flush checkpoint.
        StoreCorruptError: the database is damaged or lost flushed rows.
        StoreUnavailableError: ``rocksdict`` is not installed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        create_if_missing: bool = True,
        block_cache_mb: int = 64,
        write_buffer_mb: int = 64,
        max_background_jobs: int = 2,
        sync_writes: bool = False,
        mmap_reads: bool = True,
        io_threads: int | None = None,
        keep_last_flush: bool = True,
        at_last_flush: bool = False,
        wal_recovery: Literal["strict", "tolerate_tail"] = "strict",
    ) -> None:
        if wal_recovery not in _WAL_MODES:
            raise InvalidArgumentError(
                f"`wal_recovery` must be 'strict' or 'tolerate_tail', got {wal_recovery!r}"
            )
        if io_threads is None:
            io_threads = default_io_threads()
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise InvalidArgumentError(f"`io_threads` must be an int >= 1 or None, got {io_threads!r}")
        self.io_threads = io_threads
        self.keep_last_flush = bool(keep_last_flush)
        rocksdict = _import_rocksdict()
        self._path = Path(path)
        if self._path.exists() and not self._path.is_dir():
            raise StoreOpenError(f"store `path` {str(self._path)!r} is a file, expected a RocksDB directory")
        fresh = not self._path.exists() or not any(self._path.iterdir())
        if fresh and not create_if_missing:
            raise StoreNotFoundError(
                f"store `path` {str(self._path)!r} holds no RocksDB database and `create_if_missing` is False"
            )
        if at_last_flush or (self._path / _ROLLBACK_FILE).is_file():
            try:
                _rollback_to_last_flush(self._path)
            except SSDTBEAdapterError:
                raise
            except OSError as error:
                raise io_error(
                    error, f"rolling store `path` {str(self._path)!r} back to its last flush"
                ) from error
        elif not fresh and not (self._path / "CURRENT").is_file():
            if any(entry.name.startswith("MANIFEST-") for entry in self._path.iterdir()):
                raise StoreCorruptError(
                    f"store `path` {str(self._path)!r} has MANIFEST files but no `CURRENT` file (damaged); "
                    "RocksDBStore(path, at_last_flush=True) reopens it at its last flush"
                )
            raise StoreOpenError(
                f"store `path` {str(self._path)!r} is a non-empty directory without a RocksDB `CURRENT` file"
            )
        try:
            self._path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StoreOpenError(
                    f"no permission to create store `path` {str(self._path)!r} (read-only directory?): {error}"
                ) from error
            raise io_error(error, f"creating store `path` {str(self._path)!r}") from error
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(create_if_missing)
        options.set_paranoid_checks(True)
        options.set_wal_recovery_mode(getattr(rocksdict.DBRecoveryMode, _WAL_MODES[wal_recovery])())
        options.optimize_for_point_lookup(block_cache_mb)
        options.set_compression_type(rocksdict.DBCompressionType.none())
        options.set_write_buffer_size(write_buffer_mb * 2**20)
        options.set_max_background_jobs(max_background_jobs)
        options.set_allow_mmap_reads(mmap_reads)
        self._options = options
        self._sync_writes = sync_writes
        self._rocksdict = rocksdict
        self._closed = False
        # RocksDB is thread-safe: calls run at once. The condition only guards ``_closed``, ``_active`` (calls
        # in flight, so that close() and a reopen wait for them), ``_broken`` and ``_cursors``.
        self._state = threading.Condition()
        self._active = 0
        # The error that put the database into RocksDB's read-only error state (ENOSPC, I/O): the next call
        # closes and reopens it, which clears that state once the cause is gone.
        self._broken: SSDTBEAdapterError | None = None
        self._cursors: set[_Cursor] = set()
        self._flush_lock = threading.Lock()  # one flush (and its checkpoint) at a time
        # The I/O threads of split gets (io_threads - 1 of them: the caller reads a chunk too), started at the
        # first split get.
        self._pool: ThreadPoolExecutor | None = None
        self._flushes = 0
        self._db: Any = self._open_db()

    @property
    def path(self) -> Path:
        """The database directory."""
        return self._path

    def __enter__(self) -> RocksDBStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open_db(self) -> Any:
        """Open the database and check that it holds the last completed flush."""
        try:
            db = self._rocksdict.Rdict(str(self._path), self._options)
        except Exception as error:  # rocksdict raises plain Exception for every RocksDB status
            mapped = _classify(error, self._path, "opening")
            if isinstance(mapped, StoreCorruptError):
                mapped = StoreCorruptError(f"{mapped}{self._recovery_hint()}")
            raise mapped from error
        write_options = self._rocksdict.WriteOptions()
        write_options.sync = self._sync_writes
        write_options.disable_wal = False
        db.set_write_options(write_options)
        try:
            raw = db.get(_FLUSH_KEY)
            held = int.from_bytes(raw, "big") if raw is not None else 0
            state = _read_json(self._path / _FLUSH_FILE)
        except Exception as error:
            with contextlib.suppress(Exception):
                db.close()
            raise (
                error if isinstance(error, SSDTBEAdapterError) else _classify(error, self._path, "opening")
            ) from error
        done = int(state["flush"]) if state is not None else 0
        if held < done:
            with contextlib.suppress(Exception):
                db.close()
            raise StoreCorruptError(
                f"store {str(self._path)!r} lost flushed rows: its database holds flush #{held}, but flush "
                f"#{done} had completed (truncated or replaced MANIFEST, deleted SST files)"
                f"{self._recovery_hint()}"
            )
        self._flushes = max(held, done)
        return db

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError(f"the RocksDBStore at {str(self._path)!r} was closed")

    def _recovery_hint(self) -> str:
        """How to open a store that refused to open as corrupt (for its error message)."""
        with contextlib.suppress(SSDTBEAdapterError):
            state = _read_json(self._path / _FLUSH_FILE)
            if state is not None and state.get("checkpoint"):
                return (
                    f" (RocksDBStore(path, at_last_flush=True) reopens it at its last completed flush, "
                    f"#{state['flush']}; a damaged write-ahead log tail can also be dropped with "
                    "wal_recovery='tolerate_tail')"
                )
        return " (a damaged write-ahead log tail can be dropped with wal_recovery='tolerate_tail')"

    def _drop_cursors(self, reason: str) -> None:
        """Invalidate every open ``iter_chunks`` iterator (state lock held, no call in flight)."""
        for cursor in self._cursors:
            cursor.iterator = None
            cursor.reason = reason
        self._cursors.clear()

    @contextlib.contextmanager
    def _open_call(self, action: str) -> Iterator[Any]:
        """The database, for one call doing ``action``: raises :class:`StoreClosedError` once closed (close()
        waits for the call), reopens a database left in an error state first, and turns RocksDB errors into
        package errors (a write error marks the database for that reopen)."""
        with self._state:
            self._check_open()
            if self._broken is not None:
                while self._active:
                    self._state.wait()
                self._check_open()
                if self._broken is not None:
                    self._drop_cursors(f"the store was reopened after: {self._broken}")
                    with contextlib.suppress(Exception):
                        self._db.close()
                    self._db = self._open_db()  # raises (and stays broken) while the cause lasts
                    self._broken = None
            self._active += 1
        try:
            yield self._db
        except SSDTBEAdapterError:
            raise
        except Exception as error:
            # rocksdict raises plain Exception for every RocksDB status; anything else is a bug, not the store's.
            if type(error) is not Exception and not isinstance(
                error, (OSError, self._rocksdict.DbClosedError)
            ):
                raise
            mapped = _classify(error, self._path, action)
            if isinstance(mapped, (DiskFullError, StoreIOError)):
                with self._state:
                    self._broken = mapped
            raise mapped from error
        finally:
            with self._state:
                self._active -= 1
                if not self._active:
                    self._state.notify_all()

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        """Read the rows of ``ids`` into ``out`` with multi-gets (see :meth:`KVStore.get`).

        At least 2048 ids are split into up to ``io_threads`` contiguous chunks read at once; each row is
        read atomically, but a get split into chunks is not one snapshot (a concurrent ``put`` may land
        between two chunks).

        Raises:
            StoreCorruptError: a block read fails its checksum, or a record has the wrong width.
        """
        _check_table(table)
        array = _check_ids(ids)
        _check_rows(out, array.shape[0], "out")
        n = array.shape[0]
        if n == 0:
            return torch.zeros(0, dtype=torch.bool)
        chunks = min(self.io_threads, n // (_SPLIT_MIN_KEYS // 2))
        with self._open_call(f"reading table {table}") as db:
            if chunks < 2:
                return self._get_chunk(db, table, array, out)
            if self._pool is None:
                with self._state:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(self.io_threads - 1, thread_name_prefix="rocksdb-io")
            bounds = [n * part // chunks for part in range(chunks + 1)]
            futures = [
                self._pool.submit(self._get_chunk, db, table, array[lo:hi], out[lo:hi])
                for lo, hi in itertools.pairwise(bounds[1:])
            ]
            try:
                first = self._get_chunk(db, table, array[: bounds[1]], out[: bounds[1]])
            finally:
                wait(futures)  # no chunk may write into `out` after this call returns
            return torch.cat([first, *(future.result() for future in futures)])

    def _get_chunk(
        self, db: Any, table: int, array: np.ndarray[Any, np.dtype[np.int64]], out: torch.Tensor
    ) -> torch.Tensor:
        """One multi-get of ``array`` into ``out`` (rows of the caller's ``out``); the ``found`` mask."""
        n = array.shape[0]
        keys = encode_keys(table, array)
        values: list[bytes | None] = db.get(keys)
        width = out.shape[1]
        if None not in values:  # the common case: every row was stored before
            present = cast("list[bytes]", values)
            found = torch.ones(n, dtype=torch.bool)
        else:
            found = torch.from_numpy(np.fromiter((value is not None for value in values), np.bool_, n))
            present = [value for value in values if value is not None]
        if present:
            blob = b"".join(present)
            if len(blob) != width * len(present) or set(map(len, present)) != {width}:
                bad = next(i for i, value in enumerate(values) if value is not None and len(value) != width)
                length = len(values[bad] or b"")
                raise StoreCorruptError(
                    f"table {table} id {int(array[bad])} has a {length}-byte record, expected {width} bytes "
                    f"(store {str(self._path)!r} written with another table layout?)"
                )
            rows = np.frombuffer(blob, dtype=np.uint8).reshape(len(present), width)
            if len(present) == n:
                out.numpy()[...] = rows
            else:
                out[found] = torch.from_numpy(rows.copy())
        return found

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        """Write ``rows`` as the records of ``ids`` in one atomic ``WriteBatch`` (see :meth:`KVStore.put`).

        Raises:
            DiskFullError: no space left; nothing of the batch was written (retry once space is freed).
        """
        _check_table(table)
        array = _check_ids(ids)
        _check_rows(rows, array.shape[0], "rows")
        if array.shape[0] == 0:
            return
        batch = write_batch(self._rocksdict, table, array, rows)
        with self._open_call(f"writing table {table}") as db:
            db.write(batch)

    def iter_chunks(self, *, table: int, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Stream the records of ``table`` in id order with one RocksDB iterator (see :meth:`KVStore.iter_chunks`).

        Each chunk is read as one store call (close() waits for it); between chunks the iteration holds
        nothing, and after close() its next chunk raises :class:`StoreClosedError`. The iterator's status is
        checked at the end, so a damaged block raises instead of ending the table early.

        Raises:
            StoreCorruptError: a block fails its checksum, or the table mixes record widths.
        """
        _check_table(table)
        if chunk_rows < 1:
            raise InvalidArgumentError(f"`chunk_rows` must be >= 1, got {chunk_rows}")
        prefix = np.array([table], dtype=">u4").tobytes()
        action = f"iterating table {table}"
        with self._open_call(action) as db:
            cursor = _Cursor(db.iter())
            cursor.iterator.seek(prefix)
            with self._state:
                self._cursors.add(cursor)
        width: int | None = None
        try:
            done = False
            while not done:
                keys: list[bytes] = []
                values: list[bytes] = []
                with self._open_call(action):
                    iterator = cursor.iterator
                    if iterator is None:
                        raise StoreClosedError(
                            f"iteration of table {table} of {str(self._path)!r} ended: {cursor.reason}"
                        )
                    while len(keys) < chunk_rows:
                        if not iterator.valid():
                            iterator.status()  # raises what ended the iteration early (corruption, I/O)
                            done = True
                            break
                        key = iterator.key()
                        if len(key) != _KEY_BYTES or key[:4] != prefix:
                            done = True
                            break
                        value = iterator.value()
                        if width is None:
                            width = len(value)
                        elif len(value) != width:
                            raise StoreCorruptError(
                                f"table {table} mixes {width}-byte and {len(value)}-byte records in {str(self._path)!r}"
                            )
                        keys.append(key)
                        values.append(value)
                        iterator.next()
                    del iterator
                if keys:
                    assert width is not None
                    rows = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), width)
                    yield decode_ids(b"".join(keys), len(keys)), torch.from_numpy(rows.copy())
        finally:
            with self._state:
                self._cursors.discard(cursor)
            cursor.iterator = None

    def clear_table(self, *, table: int) -> None:
        """Delete every record of ``table`` with one range delete."""
        _check_table(table)
        start = np.array([table], dtype=">u4").tobytes()
        end = np.array([table + 1], dtype=">u4").tobytes()
        with self._open_call(f"clearing table {table}") as db:
            db.delete_range(start, end)

    def flush(self) -> None:
        """Make every write so far durable and record it as the last completed flush.

        Writes the next flush number, flushes the memtable to SST files, fsyncs the write-ahead log, then
        (``keep_last_flush``) takes a RocksDB checkpoint of that state and records the flush in
        ``SSD_TBE_FLUSH``; the previous checkpoint is removed only after that.

        Raises:
            DiskFullError: no space left (the previous last flush stays the one to go back to; retry once
                space is freed).
        """
        with self._flush_lock:
            number = self._flushes + 1
            with self._open_call("flushing") as db:
                db.put(_FLUSH_KEY, number.to_bytes(8, "big"))
                db.flush(True)
                db.flush_wal(True)
                checkpoint = None
                if self.keep_last_flush:
                    checkpoint = f"{_LAST_FLUSH_DIR}/{number:012d}"
                    target = self._path / checkpoint
                    shutil.rmtree(target, ignore_errors=True)  # left by a flush that crashed here
                    target.parent.mkdir(exist_ok=True)
                    self._rocksdict.Checkpoint(db).create_checkpoint(str(target))
            try:
                _write_json(self._path / _FLUSH_FILE, {"flush": number, "checkpoint": checkpoint})
            except OSError as error:
                raise io_error(error, f"recording the flush of store {str(self._path)!r}") from error
            self._flushes = number
            last = self._path / _LAST_FLUSH_DIR
            if last.is_dir():
                for entry in last.iterdir():
                    if checkpoint is None or entry.name != Path(checkpoint).name:
                        shutil.rmtree(entry, ignore_errors=True)

    def close(self) -> None:
        """Flush (see :meth:`flush`), wait for the calls in flight, end open iterations and close the database;
        idempotent. Later calls raise :class:`~ssd_tbe_adapter.errors.StoreClosedError`.

        Raises:
            DiskFullError: the final flush found no space; the store stays open (close again once freed).
        """
        with self._state:
            if self._closed:
                return
        self.flush()
        if self._mark_closed():
            return  # another thread closed it during the flush
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        try:
            self._db.close()
        except Exception as error:
            raise _classify(error, self._path, "closing") from error

    def _mark_closed(self) -> bool:
        """Refuse new calls, wait for those in flight and end open iterations; whether it was closed already."""
        with self._state:
            closed = self._closed
            self._closed = True
            while self._active:
                self._state.wait()
            self._drop_cursors("the store was closed")
        return closed

    def __del__(self) -> None:
        # Interpreter shutdown may have torn rocksdict down already; the WAL holds every put anyway.
        if "_db" in self.__dict__:
            with contextlib.suppress(Exception):
                self.close()
