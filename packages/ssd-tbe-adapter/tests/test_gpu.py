"""CUDA: the module on the GPU (cache on device, prefetch on a side stream) equals the same module on the CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ssd_tbe_adapter import KeyValueEmbeddingBags, KVStore, MemoryStore, TableSpec


def _rocksdb(path: Path) -> KVStore:
    pytest.importorskip("rocksdict")
    from ssd_tbe_adapter import RocksDBStore

    return RocksDBStore(path)


STORES: list[tuple[str, Callable[[Path], KVStore]]] = [
    ("memory", lambda _: MemoryStore()),
    ("rocksdb", _rocksdb),
]


def _train(
    device: str, store: KVStore, optimizer: str, fp16: bool, prefetch: bool, vbe_output: bool
) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    tables = [TableSpec("a", 8), TableSpec("b", 5)]
    module = KeyValueEmbeddingBags(
        tables,
        [0, 1, 0],
        store,
        cache_rows=6,
        optimizer=optimizer,  # type: ignore[arg-type]
        learning_rate=0.1,
        weights_precision="fp16" if fp16 else "fp32",
        device=device,
    )
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(6):
        sizes = [[int(torch.randint(0, 5, (1,), generator=gen)) for _ in range(2)] for _ in range(3)]
        lengths = torch.randint(0, 5, (sum(map(sum, sizes)),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        indices = torch.randint(-20, 20, (int(offsets[-1]),), generator=gen) * 7919
        psw = torch.rand(indices.numel(), generator=gen)
        batches.append((indices.to(device), offsets.to(device), psw.to(device), sizes))
    # torch.cuda.Stream is untyped in torch's stubs.
    side = torch.cuda.Stream() if device == "cuda" else None  # type: ignore[no-untyped-call]
    outputs = []
    for step, (indices, offsets, psw, sizes) in enumerate(batches):
        if prefetch and step + 1 < len(batches):
            nxt = batches[step + 1]
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    module.prefetch(nxt[0], nxt[1], nxt[3])
            else:
                module.prefetch(nxt[0], nxt[1], nxt[3])
        if vbe_output:
            dims = [8, 5, 8]
            starts = torch.zeros(2, 3, dtype=torch.int64)
            cursor = 0
            for r in range(2):
                for f in range(3):
                    starts[r, f] = cursor
                    cursor += sizes[f][r] * dims[f]
            out = module(indices, offsets, psw, sizes, torch.zeros(cursor, device=device), starts.to(device))
        else:
            out = module(indices, offsets, psw, sizes)
        (out * torch.arange(out.numel(), device=device).float().sin()).sum().backward()
        outputs.append(out.detach().cpu())
    rows = {
        i: w.float()
        for c in module.checkpoint()
        for i, w in zip(c.ids.tolist(), c.weights, strict=True)
        if c.table == "a"
    }
    module.close()
    return outputs, rows


@pytest.mark.gpu
@pytest.mark.parametrize("make", [m for _, m in STORES], ids=[n for n, _ in STORES])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"], ids=["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
@pytest.mark.parametrize("vbe_output", [False, True], ids=["alloc", "vbe_output"])
def test_cuda_matches_cpu(
    make: Callable[[Path], KVStore],
    optimizer: str,
    fp16: bool,
    prefetch: bool,
    vbe_output: bool,
    tmp_path: Path,
) -> None:
    """Six VBE steps on CUDA (cache 6 rows, ~20 unique rows a batch) give the CPU module's outputs and rows."""
    cuda_out, cuda_rows = _train("cuda", make(tmp_path / "gpu"), optimizer, fp16, prefetch, vbe_output)
    cpu_out, cpu_rows = _train("cpu", MemoryStore(), optimizer, fp16, False, vbe_output)
    tol: dict[str, float] = {"atol": 2e-3, "rtol": 2e-3} if fp16 else {"atol": 1e-5, "rtol": 1e-5}
    for got, want in zip(cuda_out, cpu_out, strict=True):
        torch.testing.assert_close(got, want, atol=tol["atol"], rtol=tol["rtol"])
    assert cuda_rows.keys() == cpu_rows.keys()
    for i in cpu_rows:
        torch.testing.assert_close(cuda_rows[i], cpu_rows[i], atol=tol["atol"], rtol=tol["rtol"])


@pytest.mark.gpu
def test_graphed_bench_rows_replay_the_prefetched_step(tmp_path: Path) -> None:
    """``bench --graphed`` on CUDA: the graphed key-value rows replay every measured step from their
    prefetched slots (recorded at most a few times, every forward hit), beside the TBE's graphed row."""
    from ssd_tbe_adapter.bench import QUICK, run_case

    results = run_case(
        QUICK[0],
        torch.device("cuda"),
        tmp_path,
        {"kv-device-dram-graphed", "kv-device-memstore-graphed", "kv-device-dram-prefetch"},
        graphed=True,
    )
    rows = {r["impl"]: r for r in results}
    for name in ("kv-device-dram-graphed", "kv-device-memstore-graphed"):
        assert 1 <= rows[name]["captures"] <= 3
        assert rows[name]["forward_hit_rate"] == 1.0
        assert 0 < rows[name]["p10_ms"] <= rows[name]["median_ms"] <= rows[name]["p90_ms"]
    if "fbgemm-tbe" in rows:
        assert rows["fbgemm-tbe-graphed"]["median_ms"] > 0
