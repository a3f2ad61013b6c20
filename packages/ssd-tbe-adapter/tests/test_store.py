"""KVStore implementations: round trips, chunked iteration, clear errors for bad paths and records."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd_tbe_adapter import (
    KVStore,
    MemoryStore,
    RocksDBStore,
    StoreClosedError,
    StoreCorruptError,
    StoreNotFoundError,
    StoreOpenError,
)
from ssd_tbe_adapter._store import default_io_threads

STORES: list[tuple[str, Callable[[Path], KVStore]]] = [
    ("memory", lambda _: MemoryStore()),
    ("rocksdb", lambda path: RocksDBStore(path / "db")),
]


@pytest.mark.parametrize("make", [m for _, m in STORES], ids=[n for n, _ in STORES])
def test_stores_fit_the_protocol(make: Callable[[Path], KVStore], tmp_path: Path) -> None:
    """Both stores are KVStore instances (runtime-checkable Protocol)."""
    store = make(tmp_path)
    assert isinstance(store, KVStore)
    store.close()


@pytest.mark.parametrize("make", [m for _, m in STORES], ids=[n for n, _ in STORES])
@settings(max_examples=20, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=30, unique=True),
    width=st.integers(1, 17),
    table=st.integers(0, 3),
)
def test_put_get_iterate_roundtrip(
    make: Callable[[Path], KVStore],
    tmp_path_factory: pytest.TempPathFactory,
    ids: list[int],
    width: int,
    table: int,
) -> None:
    """put then get returns the bytes; absent ids report False and leave `out` alone; iteration is id-ordered."""
    store = make(tmp_path_factory.mktemp("s"))
    keys = torch.tensor(ids, dtype=torch.int64)
    rows = torch.randint(0, 256, (len(ids), width), dtype=torch.uint8)
    store.put(keys, rows, table=table)
    store.put(
        torch.tensor([5], dtype=torch.int64), torch.zeros(1, width + 1, dtype=torch.uint8), table=table + 1
    )
    query = torch.cat([keys, torch.tensor([123456789], dtype=torch.int64)]) if 123456789 not in ids else keys
    out = torch.full((query.numel(), width), 7, dtype=torch.uint8)
    found = store.get(query, out, table=table)
    assert found[: len(ids)].all()
    assert torch.equal(out[: len(ids)], rows)
    if query.numel() > len(ids):
        assert not bool(found[-1])
        assert bool((out[-1] == 7).all())
    chunks = list(store.iter_chunks(table=table, chunk_rows=4))
    got_ids = torch.cat([c[0] for c in chunks]) if chunks else torch.zeros(0, dtype=torch.int64)
    order = torch.argsort(keys)
    assert torch.equal(got_ids, keys[order])
    if chunks:
        assert torch.equal(torch.cat([c[1] for c in chunks]), rows[order])
        assert all(c[0].numel() <= 4 for c in chunks)
    store.clear_table(table=table)
    assert list(store.iter_chunks(table=table, chunk_rows=4)) == []
    assert len(list(store.iter_chunks(table=table + 1, chunk_rows=4))) == 1
    store.close()


def test_rocksdb_reopen_keeps_rows(tmp_path: Path) -> None:
    """Rows put before close() are there after reopening."""
    store = RocksDBStore(tmp_path / "db")
    store.put(torch.tensor([1, -2]), torch.tensor([[1, 2], [3, 4]], dtype=torch.uint8), table=2)
    store.close()
    store = RocksDBStore(tmp_path / "db", create_if_missing=False)
    out = torch.zeros(2, 2, dtype=torch.uint8)
    assert bool(store.get(torch.tensor([-2, 1]), out, table=2).all())
    assert out.tolist() == [[3, 4], [1, 2]]
    store.close()


def test_missing_path_without_create_is_clear(tmp_path: Path) -> None:
    """A missing store path with create_if_missing=False raises StoreNotFoundError (a FileNotFoundError)."""
    with pytest.raises(StoreNotFoundError, match="`path`") as info:
        RocksDBStore(tmp_path / "nope", create_if_missing=False)
    assert isinstance(info.value, FileNotFoundError)


def test_path_that_is_a_file_is_clear(tmp_path: Path) -> None:
    """A store path that is a regular file raises StoreOpenError."""
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(StoreOpenError, match="is a file"):
        RocksDBStore(path)


def test_non_rocksdb_directory_is_clear(tmp_path: Path) -> None:
    """A non-empty directory that is not a RocksDB database raises StoreOpenError."""
    (tmp_path / "other.txt").write_text("not a database")
    with pytest.raises(StoreOpenError, match="CURRENT"):
        RocksDBStore(tmp_path)


def test_corrupt_database_is_clear(tmp_path: Path) -> None:
    """A database whose CURRENT names a missing MANIFEST raises StoreCorruptError naming it, not a crash."""
    store = RocksDBStore(tmp_path / "db")
    store.put(torch.tensor([1]), torch.zeros(1, 4, dtype=torch.uint8))
    store.close()
    (tmp_path / "db" / "CURRENT").write_text("MANIFEST-999999\n")
    with pytest.raises(StoreCorruptError, match="MANIFEST-999999"):
        RocksDBStore(tmp_path / "db")


def test_locked_database_is_clear(tmp_path: Path) -> None:
    """Opening a database that is already open raises StoreOpenError."""
    store = RocksDBStore(tmp_path / "db")
    with pytest.raises(StoreOpenError, match="locked"):
        RocksDBStore(tmp_path / "db")
    store.close()


def test_wrong_record_width_is_corrupt(tmp_path: Path) -> None:
    """Reading records with a different width than stored raises StoreCorruptError naming the id."""
    store = RocksDBStore(tmp_path / "db")
    store.put(torch.tensor([9]), torch.zeros(1, 4, dtype=torch.uint8))
    with pytest.raises(StoreCorruptError, match="id 9"):
        store.get(torch.tensor([9]), torch.zeros(1, 8, dtype=torch.uint8))
    store.close()


@pytest.mark.parametrize("make", [m for _, m in STORES], ids=[n for n, _ in STORES])
def test_closed_store_raises(make: Callable[[Path], KVStore], tmp_path: Path) -> None:
    """Any call after close() raises StoreClosedError."""
    store = make(tmp_path)
    store.close()
    with pytest.raises(StoreClosedError):
        store.get(torch.tensor([1]), torch.zeros(1, 1, dtype=torch.uint8))


@pytest.mark.parametrize("make", [m for _, m in STORES], ids=[n for n, _ in STORES])
def test_bad_arguments_name_the_argument(make: Callable[[Path], KVStore], tmp_path: Path) -> None:
    """Wrong dtypes or shapes raise ValueError naming `ids`, `out` or `rows`."""
    store = make(tmp_path)
    with pytest.raises(ValueError, match="`ids`"):
        store.get(torch.tensor([1.0]), torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="`out`"):
        store.get(torch.tensor([1]), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="`rows`"):
        store.put(torch.tensor([1]), torch.zeros(1, 1))
    store.close()


@settings(max_examples=30, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.one_of(st.integers(0, 300), st.integers(-3, 10**6)), max_size=20, unique=True),
        min_size=1,
        max_size=5,
    )
)
def test_memory_store_matches_a_dict_over_puts(batches: list[list[int]]) -> None:
    """Overwrites, new ids, dense and sparse id ranges: every get sees the last put of each id."""
    store = MemoryStore()
    reference: dict[int, int] = {}
    for step, ids in enumerate(batches):
        values = [(step * 31 + i) % 256 for i in range(len(ids))]
        store.put(
            torch.tensor(ids, dtype=torch.int64),
            torch.tensor(values, dtype=torch.uint8)[:, None].repeat(1, 4),
        )
        reference.update(zip(ids, values, strict=True))
        query = [*sorted(reference), 10**7]
        out = torch.zeros(len(query), 4, dtype=torch.uint8)
        found = store.get(torch.tensor(query, dtype=torch.int64), out)
        assert found.tolist() == [True] * len(reference) + [False]
        assert out[:-1, 0].tolist() == [reference[i] for i in sorted(reference)]
    chunks = list(store.iter_chunks(table=0, chunk_rows=7))
    assert [i for c in chunks for i in c[0].tolist()] == sorted(reference)


@pytest.mark.parametrize("io_threads", [0, -1, True, 1.5], ids=["zero", "negative", "bool", "float"])
def test_rocksdb_io_threads_is_checked(io_threads: object, tmp_path: Path) -> None:
    """A bad `io_threads` is a ValueError naming the argument, before anything is created."""
    with pytest.raises(ValueError, match="`io_threads`"):
        RocksDBStore(tmp_path / "db", io_threads=io_threads)  # type: ignore[arg-type]  # the bad value is the test
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize("io_threads", [1, 2, 3], ids=["1-thread", "2-threads", "3-threads"])
@settings(max_examples=10, deadline=None)
@given(
    stored=st.integers(0, 6000),
    queried=st.integers(0, 7000),
    seed=st.integers(0, 2**31 - 1),
)
def test_rocksdb_split_get_matches_memory_store(
    io_threads: int, tmp_path_factory: pytest.TempPathFactory, stored: int, queried: int, seed: int
) -> None:
    """A get split over I/O threads returns what MemoryStore returns: same rows, same found mask, absent
    rows untouched, for ids in any order with repeats and absent ids."""
    gen = torch.Generator().manual_seed(seed)
    store = RocksDBStore(tmp_path_factory.mktemp("s") / "db", io_threads=io_threads)
    reference = MemoryStore()
    ids = torch.randperm(8000, generator=gen)[:stored].to(torch.int64)
    rows = torch.randint(0, 256, (stored, 12), dtype=torch.uint8, generator=gen)
    for target in (store, reference):
        target.put(ids, rows, table=1)
    query = torch.randint(0, 8000, (queried,), generator=gen, dtype=torch.int64)
    out = torch.full((queried, 12), 7, dtype=torch.uint8)
    expected_out = out.clone()
    found = store.get(query, out, table=1)
    expected_found = reference.get(query, expected_out, table=1)
    assert torch.equal(found, expected_found)
    assert torch.equal(out, expected_out)
    store.close()


def test_rocksdb_split_get_reports_a_corrupt_record_in_any_chunk(tmp_path: Path) -> None:
    """A wrong-width record read by an I/O thread (not the caller) still raises StoreCorruptError."""
    store = RocksDBStore(tmp_path / "db", io_threads=2)
    ids = torch.arange(4096, dtype=torch.int64)
    store.put(ids, torch.zeros(4096, 8, dtype=torch.uint8))
    store.put(torch.tensor([4000]), torch.zeros(1, 9, dtype=torch.uint8))
    with pytest.raises(StoreCorruptError, match="id 4000"):
        store.get(ids, torch.empty(4096, 8, dtype=torch.uint8))
    store.close()


def test_rocksdb_close_waits_for_gets_in_flight(tmp_path: Path) -> None:
    """close() during split gets on other threads neither crashes nor loses a flushed row: each get either
    completes with the stored rows or raises StoreClosedError, and the reopened store holds every row."""
    store = RocksDBStore(tmp_path / "db", io_threads=3)
    ids = torch.arange(20_000, dtype=torch.int64)
    rows = torch.randint(0, 256, (20_000, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    store.put(ids, rows)
    outcomes: list[str] = []
    started = threading.Barrier(3)

    def reader() -> None:
        started.wait()
        while True:
            out = torch.empty(20_000, 16, dtype=torch.uint8)
            try:
                found = store.get(ids, out)
            except StoreClosedError:
                outcomes.append("closed")
                return
            if not (bool(found.all()) and torch.equal(out, rows)):
                outcomes.append("wrong")
                return

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(0.05)
    store.close()
    for thread in threads:
        thread.join(timeout=30)
    assert outcomes == ["closed", "closed"]
    reopened = RocksDBStore(tmp_path / "db", create_if_missing=False, io_threads=1)
    out = torch.empty(20_000, 16, dtype=torch.uint8)
    assert bool(reopened.get(ids, out).all())
    assert torch.equal(out, rows)
    reopened.close()


def test_rocksdb_io_threads_defaults_to_half_the_cores(tmp_path: Path) -> None:
    """Without `io_threads` the store splits gets over half the cores, 1 to 4."""
    store = RocksDBStore(tmp_path / "db")
    assert store.io_threads == default_io_threads() == max(1, min(4, (os.cpu_count() or 2) // 2))
    store.close()
