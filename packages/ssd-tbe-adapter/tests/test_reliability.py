"""Reliability: rows survive SIGKILL after flush(); prefetch racing write-back never loses an update."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ssd_tbe_adapter import KeyValueEmbeddingBags, MemoryStore, RocksDBStore, TableSpec

CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from ssd_tbe_adapter import KeyValueEmbeddingBags, RocksDBStore, TableSpec
    path, expected = sys.argv[1], sys.argv[2]
    module = KeyValueEmbeddingBags(
        [TableSpec("a", 4), TableSpec("b", 3)], [0, 1], RocksDBStore(path), cache_rows=5,
        optimizer="rowwise_adagrad", learning_rate=0.3,
    )
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        indices = torch.randint(0, 40, (32,), generator=gen)
        offsets = torch.arange(0, 33, 4)
        module.prefetch(indices, offsets)
        module(indices, offsets).pow(2).sum().backward()
    module.flush()
    rows = {c.table + ":" + str(i): (w.clone(), s.clone())
            for c in module.checkpoint(chunk_rows=8) for i, w, s in zip(c.ids.tolist(), c.weights, c.optimizer_state)}
    torch.save(rows, expected)
    print("FLUSHED", flush=True)
    # Keep training on other ids (dirty rows, evictions, WAL writes in flight) until killed.
    while True:
        indices = torch.randint(1000, 1100, (32,), generator=gen)
        offsets = torch.arange(0, 33, 4)
        module.prefetch(indices, offsets)
        module(indices, offsets).sum().backward()
    """
)


def test_sigkill_after_flush_keeps_every_flushed_row(tmp_path: Path) -> None:
    """A training process killed with SIGKILL after flush(): reopening the store shows every flushed row."""
    path = tmp_path / "db"
    expected_path = tmp_path / "expected.pt"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(expected_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip() == "FLUSHED", child.stderr.read() if child.stderr else line
        time.sleep(0.5)  # let it train (and write back) after the flush
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    expected: dict[str, tuple[torch.Tensor, torch.Tensor]] = torch.load(expected_path)
    assert len(expected) > 20
    module = KeyValueEmbeddingBags(
        [TableSpec("a", 4), TableSpec("b", 3)],
        [0, 1],
        RocksDBStore(path, create_if_missing=False),
        cache_rows=5,
        optimizer="rowwise_adagrad",
        learning_rate=0.3,
    )
    got = {
        f"{c.table}:{i}": (w, s)
        for c in module.checkpoint(chunk_rows=16)
        for i, w, s in zip(c.ids.tolist(), c.weights, c.optimizer_state, strict=True)
    }
    for key, (weights, state) in expected.items():
        assert key in got, key
        torch.testing.assert_close(got[key][0], weights, rtol=0, atol=0)
        torch.testing.assert_close(got[key][1], state, rtol=0, atol=0)
    module.close()


class SlowStore(MemoryStore):
    """A MemoryStore whose reads and writes sleep a little at random, to widen every race window."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._random = random.Random(seed)
        self._random_lock = threading.Lock()

    def _nap(self) -> None:
        with self._random_lock:
            delay = self._random.random() * 0.002
        time.sleep(delay)

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        self._nap()
        found = super().get(ids, out, table=table)
        self._nap()
        return found

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        self._nap()
        super().put(ids, rows, table=table)

    def iter_chunks(self, *, table: int, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return super().iter_chunks(table=table, chunk_rows=chunk_rows)


@pytest.mark.parametrize("store_kind", ["slow-memory", "rocksdb"], ids=["slow-memory", "rocksdb"])
@pytest.mark.parametrize("cache_rows", [1, 3], ids=["cache1", "cache3"])
def test_prefetch_and_write_back_never_lose_an_update(
    store_kind: str, cache_rows: int, tmp_path: Path
) -> None:
    """Tiny cache, heavily repeated ids, prefetch two batches ahead: every SGD update lands exactly once."""
    store = SlowStore(cache_rows) if store_kind == "slow-memory" else RocksDBStore(tmp_path / "db")
    lr = 0.25
    module = KeyValueEmbeddingBags(
        [TableSpec("t", 2)],
        None,
        store,
        cache_rows=cache_rows,
        optimizer="sgd",
        learning_rate=lr,
        init_range=(0.0, 0.0),
    )
    gen = torch.Generator().manual_seed(cache_rows)
    steps = 120
    batches = [
        torch.randint(0, 6, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        for _ in range(steps)
    ]
    expected = torch.zeros(6)
    for step in range(min(2, steps)):
        module.prefetch(batches[step], torch.tensor([0, batches[step].numel()]))
    for step, indices in enumerate(batches):
        if step + 2 < steps:
            ahead = batches[step + 2]
            module.prefetch(ahead, torch.tensor([0, ahead.numel()]))
        out = module(indices, torch.tensor([0, indices.numel()]))
        out.sum().backward()  # gradient 1 per lookup: each lookup moves its row by -lr
        expected -= lr * torch.bincount(indices, minlength=6).float()
        if step % 7 == 3:
            module.flush()
    rows = {i: w for c in module.checkpoint() for i, w in zip(c.ids.tolist(), c.weights, strict=True)}
    for i in range(6):
        got = rows[i] if i in rows else torch.zeros(2)
        torch.testing.assert_close(got, torch.full((2,), float(expected[i])), msg=f"id {i}")
    m = module.metrics()
    assert m["evicted_rows"] > 0
    module.close()


@pytest.mark.parametrize("read_threads", [1, 2], ids=["1-reader", "2-readers"])
def test_two_tables_prefetch_reads_overlap_inserts_without_losing_updates(read_threads: int) -> None:
    """Two tables, tiny caches, slow store, prefetch two batches ahead: one table's store read runs while the
    other's insert and write-backs happen (both reads at once with two reader threads); every SGD update lands
    exactly once."""
    store = SlowStore(7)
    lr = 0.5
    module = KeyValueEmbeddingBags(
        [TableSpec("t", 2), TableSpec("u", 3)],
        None,
        store,
        cache_rows=[3, 3],
        optimizer="sgd",
        learning_rate=lr,
        init_range=(0.0, 0.0),
    )
    module.read_threads = read_threads
    gen = torch.Generator().manual_seed(read_threads)
    steps = 150
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, 6, (2, 4), generator=gen)
        batches.append((ids.flatten(), torch.tensor([0, 2, 4, 6, 8])))  # 2 features x 2 bags x 2 ids
    expected = [torch.zeros(6), torch.zeros(6)]
    module.prefetch(*batches[0])
    module.prefetch(*batches[1])
    for step, (indices, offsets) in enumerate(batches):
        if step + 2 < steps:
            module.prefetch(*batches[step + 2])  # two ahead: prefetched rows get evicted before use
        module(indices, offsets).sum().backward()
        for table in range(2):
            expected[table] -= lr * torch.bincount(indices[4 * table : 4 * table + 4], minlength=6).float()
        if step % 11 == 5:
            module.flush()
    rows = {
        (c.table, i): w for c in module.checkpoint() for i, w in zip(c.ids.tolist(), c.weights, strict=True)
    }
    for table, (name, dim) in enumerate((("t", 2), ("u", 3))):
        for i in range(6):
            got = rows.get((name, i), torch.zeros(dim))
            torch.testing.assert_close(got, torch.full((dim,), float(expected[table][i])), msg=f"{name} {i}")
    assert module.metrics()["evicted_rows"] > 0
    module.close()


def test_concurrent_flushes_and_training_stay_consistent() -> None:
    """A flush() from another thread while training neither deadlocks nor loses updates."""
    lr = 0.5
    module = KeyValueEmbeddingBags(
        [TableSpec("t", 1)],
        None,
        SlowStore(1),
        cache_rows=2,
        optimizer="sgd",
        learning_rate=lr,
        init_range=(0.0, 0.0),
    )
    stop = threading.Event()

    def flusher() -> None:
        while not stop.is_set():
            module.flush()

    thread = threading.Thread(target=flusher)
    thread.start()
    expected = torch.zeros(4)
    try:
        gen = torch.Generator().manual_seed(5)
        for _ in range(30):
            indices = torch.randint(0, 4, (3,), generator=gen)
            module.prefetch(indices, torch.tensor([0, 3]))
            module(indices, torch.tensor([0, 3])).sum().backward()
            expected -= lr * torch.bincount(indices, minlength=4).float()
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    rows = {
        i: float(w[0]) for c in module.checkpoint() for i, w in zip(c.ids.tolist(), c.weights, strict=True)
    }
    assert [rows.get(i, 0.0) for i in range(4)] == pytest.approx(expected.tolist())
