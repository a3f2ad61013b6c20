"""The device-managed cache (``cache_on_device=True``, the CUDA default) against the host-cache path and a dense
in-memory reference over many steps with tiny caches: both tiers, VBE and ``vbe_output``, prefetch one and two
batches ahead; forced on the CPU and, marked ``gpu``, on CUDA."""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ssd_tbe_adapter
from ssd_tbe_adapter import (
    InvalidArgumentError,
    KeyValueEmbeddingBags,
    KVStore,
    MemoryStore,
    StaleCaptureError,
    StoreIOError,
    TableSpec,
)
from ssd_tbe_adapter._device_cache import DeviceCache, _unique_pairs, _unique_slots
from ssd_tbe_adapter._host_tier import HostTier, TierRows, rows_into
from ssd_tbe_adapter._init import init_rows, table_salt
from ssd_tbe_adapter._optimizer import RowOptimizer

TABLES = [TableSpec("a", 8), TableSpec("b", 5)]
FTM = [0, 1, 0]  # table "a" looked up by two features
LR = 0.1
ID_POOL = torch.tensor(
    [0, 1, 2, 3, 7, 11, -5, 99, 2**40 + 3, -(2**62), 12, 13, 14, 15, 16, 17], dtype=torch.int64
)


@dataclass(frozen=True)
class Batch:
    indices: torch.Tensor
    offsets: torch.Tensor
    psw: torch.Tensor
    sizes: list[list[int]] | None  # VBE batch sizes [F][R], None: fixed batch


def make_batches(steps: int, *, vbe: bool, seed: int = 0, batch: int = 4) -> list[Batch]:
    """``steps`` batches of ~20 lookups over 16 ids per table (VBE: 2 ranks of 0..4 samples per feature)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if vbe:
            sizes: list[list[int]] | None = [
                [int(torch.randint(0, batch + 1, (1,), generator=gen)) for _ in range(2)] for _ in FTM
            ]
            bags = sum(map(sum, sizes or []))
        else:
            sizes, bags = None, batch * len(FTM)
        lengths = torch.randint(0, 4, (bags,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        indices = ID_POOL[torch.randint(0, ID_POOL.numel(), (int(offsets[-1]),), generator=gen)]
        out.append(Batch(indices, offsets, torch.rand(indices.numel(), generator=gen) + 0.5, sizes))
    return out


class Reference:
    """Dense tables over ``ID_POOL``: autograd through ``embedding_bag`` for gradients, the optimizer by hand."""

    def __init__(self, optimizer: str, pooling: str, fp16: bool) -> None:
        self.optimizer, self.pooling, self.fp16 = optimizer, pooling, fp16
        self.row = {int(i): r for r, i in enumerate(ID_POOL.tolist())}
        self.weights = []
        for spec in TABLES:
            w = init_rows(ID_POOL, spec.dim, table_salt(0, spec.name), -0.01, 0.01)
            self.weights.append(w.half().float() if fp16 else w)
        self.state = [torch.zeros(ID_POOL.numel()) for _ in TABLES]

    def step(self, b: Batch, probe_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward (module layout) + backward of ``(out * probe).sum()`` + update; returns (out, psw grad)."""
        leaves = [w.clone().requires_grad_(True) for w in self.weights]
        psw = b.psw.clone().requires_grad_(True)
        rows = torch.tensor([self.row[int(i)] for i in b.indices.tolist()], dtype=torch.int64)
        bags = [sum(s) for s in b.sizes] if b.sizes else [(b.offsets.numel() - 1) // len(FTM)] * len(FTM)
        pooled, start = [], 0
        for f, t in enumerate(FTM):
            o = b.offsets[start : start + bags[f] + 1]
            p = torch.nn.functional.embedding_bag(
                rows[int(o[0]) : int(o[-1])],
                leaves[t],
                o - o[0],
                mode=self.pooling,
                per_sample_weights=psw[int(o[0]) : int(o[-1])] if self.pooling == "sum" else None,
                include_last_offset=True,
            )
            pooled.append(p)
            start += bags[f]
        if b.sizes is None:
            out = torch.cat(pooled, 1)
        else:
            parts = []
            for r in range(2):
                for f in range(len(FTM)):
                    first = sum(b.sizes[f][:r])
                    parts.append(pooled[f][first : first + b.sizes[f][r]].reshape(-1))
            out = torch.cat(parts)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(probe_seed))
        torch.autograd.backward((out * probe).sum())
        for t, leaf in enumerate(leaves):
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            w = self.weights[t]
            if self.optimizer == "sgd":
                w = w - LR * g
            else:
                self.state[t] = self.state[t] + g.pow(2).mean(1)
                w = w - (LR / (self.state[t].sqrt() + 1e-8))[:, None] * g
            self.weights[t] = w.half().float() if self.fp16 else w
        grad = psw.grad if psw.grad is not None else torch.zeros_like(psw)
        return out.detach(), grad


def train(
    module: KeyValueEmbeddingBags,
    batches: Sequence[Batch],
    *,
    ahead: int,
    layout: str,
    weighted: bool,
    pipelined: bool = False,
    replay: str = "",
    deferred: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Train over ``batches`` prefetching ``ahead`` batches ahead (0: none); outputs and psw gradients (CPU).

    ``replay``: ``"static"`` runs each forward and backward inside ``replaying`` + ``static_slots`` (the
    code a CUDA graph captures, run eagerly); ``"graph"`` (CUDA) captures each step's forward and backward
    in a CUDA graph over static copies of its inputs and replays it inside ``replaying``.

    ``layout``: ``"plain"`` (no VBE), ``"vbe"`` or ``"vbe_output"`` (blocks written into a larger buffer at
    shuffled offsets; the gaps must stay untouched). ``pipelined``: each step's prefetch is issued after its
    backward was queued, before anything reads a result (a train pipeline's order: on CUDA the prefetch, on
    a side stream, runs while that backward may still update rows it may pick as victims). ``deferred``: each
    prefetch is issued with ``complete=False`` and finished by ``complete_prefetch()`` after the step's
    backward (a forward or a replay of another batch in between finds it unfinished).

    On CUDA the side stream waits for the current one once, when the ids are on the device, and never again:
    the module itself must order its row moves after the forward/backward in flight."""
    device = module.device
    on = [(b.indices.to(device), b.offsets.to(device), b.psw.to(device), b.sizes) for b in batches]
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))  # the ids are ready

    def prefetch(k: int) -> None:
        if k >= len(on):
            return
        indices, offsets, _, sizes = on[k]
        if side is not None:
            with torch.cuda.stream(side):
                module.prefetch(indices, offsets, sizes, complete=not deferred)
        else:
            module.prefetch(indices, offsets, sizes, complete=not deferred)

    for k in range(ahead):
        prefetch(k)
    outputs, grads = [], []
    for step, (indices, offsets, psw_values, sizes) in enumerate(on):
        if ahead and not pipelined:
            prefetch(step + ahead)
        psw = psw_values.clone().requires_grad_(True) if weighted else None
        if layout == "vbe_output":
            assert sizes is not None
            dims = [TABLES[t].dim for t in FTM]
            order = torch.randperm(2 * len(FTM), generator=torch.Generator().manual_seed(step)).tolist()
            starts = torch.zeros(2, len(FTM), dtype=torch.int64)
            cursor = 3
            for j in order:
                r, f = divmod(j, len(FTM))
                starts[r, f] = cursor
                cursor += sizes[f][r] * dims[f] + 2
            buffer = torch.full((cursor,), 42.0, device=device)
            out = module(indices, offsets, psw, sizes, buffer, starts.to(device))
            assert out is buffer
            mask = torch.ones(cursor, dtype=torch.bool)
            parts = []
            for r in range(2):
                for f in range(len(FTM)):
                    lo, n = int(starts[r, f]), sizes[f][r] * dims[f]
                    mask[lo : lo + n] = False
                    parts.append(out[lo : lo + n])
            assert bool((out.detach().cpu()[mask] == 42.0).all())
            mine = torch.cat(parts)
        elif replay:
            mine, psw = replayed_step(module, indices, offsets, psw, sizes, step, replay)
        else:
            mine = module(indices, offsets, psw, sizes)
        if not replay:
            probe = torch.randn(mine.shape, generator=torch.Generator().manual_seed(1000 + step)).to(device)
            torch.autograd.backward((mine * probe).sum())
        if ahead and pipelined:
            prefetch(step + ahead)
        if deferred:
            module.complete_prefetch()
        outputs.append(mine.detach().cpu())
        grads.append(psw.grad.cpu() if psw is not None and psw.grad is not None else torch.zeros(0))
    return outputs, grads


_GRAPHS: list[torch.cuda.CUDAGraph] = []


def replayed_step(
    module: KeyValueEmbeddingBags,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    psw: torch.Tensor | None,
    sizes: list[list[int]] | None,
    step: int,
    replay: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward + backward of ``(out * probe).sum()`` as a graph replay would run it (see :func:`train`);
    returns the output and the leaf holding the psw gradient."""
    device = module.device
    dims = [TABLES[t].dim for t in FTM]
    if sizes is None:  # [B, sum(D)]
        shape: tuple[int, ...] = ((offsets.numel() - 1) // len(FTM), sum(dims))
    else:  # 1-D, rank -> feature -> sample -> dim
        shape = (sum(sum(per_rank) * dim for per_rank, dim in zip(sizes, dims, strict=True)),)
    # Made before any capture: a host-to-device copy cannot be recorded.
    probe = torch.randn(shape, generator=torch.Generator().manual_seed(1000 + step)).to(device)

    def forward_backward(ids: torch.Tensor, offs: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = module(ids, offs, weights, sizes)
        torch.autograd.backward((out * probe).sum())
        return out.detach()

    if replay == "static":
        try:
            with module.replaying(indices, offsets, sizes), module.static_slots():
                return forward_backward(indices, offsets, psw), psw
        except StaleCaptureError:  # staging grew the cache (no prefetch): the batch stays pending, retry
            with module.replaying(indices, offsets, sizes), module.static_slots():
                return forward_backward(indices, offsets, psw), psw
    # A real capture: static inputs, recorded (nothing runs), then one replay; recorded again when staging the
    # batch (without a prefetch) grew the cache the graph holds.
    static_ids, static_offsets = indices.clone(), offsets.clone()
    static_psw = None if psw is None else psw.detach().clone().requires_grad_(True)
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        _GRAPHS.append(graph)  # kept: a graph destroyed (cyclic garbage) during a later capture voids it
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        side.wait_stream(torch.cuda.current_stream(device))
        torch.cuda.synchronize(device)
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(graph, stream=side):
                out = forward_backward(static_ids, static_offsets, static_psw)
        finally:
            gc.enable()
        try:
            with module.replaying(indices, offsets, sizes):
                graph.replay()
        except StaleCaptureError:
            continue
        return out, static_psw
    raise AssertionError("staging grew the cache twice for one batch")


def stored_rows(module: KeyValueEmbeddingBags) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
    """Every stored row after a flush (through checkpoint)."""
    return {
        (c.table, i): (w.float(), s)
        for c in module.checkpoint(chunk_rows=5)
        for i, w, s in zip(c.ids.tolist(), c.weights, c.optimizer_state, strict=True)
    }


def make_module(
    device: str,
    *,
    on_device: bool | None,
    cache_rows: int | list[int],
    host_cache_rows: int = 0,
    optimizer: str = "rowwise_adagrad",
    pooling: str = "sum",
    fp16: bool = False,
    store: KVStore | None = None,
) -> KeyValueEmbeddingBags:
    return KeyValueEmbeddingBags(
        TABLES,
        FTM,
        store if store is not None else MemoryStore(),
        cache_rows=cache_rows,
        optimizer=optimizer,  # type: ignore[arg-type]
        learning_rate=LR,
        pooling=pooling,  # type: ignore[arg-type]
        weights_precision="fp16" if fp16 else "fp32",
        device=device,
        cache_on_device=on_device,
        host_cache_rows=host_cache_rows,
    )


TIERS = [
    ("hbm3", {"cache_rows": 3}),
    ("hbm0", {"cache_rows": 0}),
    ("hbm-per-table", {"cache_rows": [5, 1]}),
    ("hbm2+dram5", {"cache_rows": 2, "host_cache_rows": 5}),
    ("hbm1+dram64", {"cache_rows": 1, "host_cache_rows": 64}),
    ("hbm64", {"cache_rows": 64}),
]
LAYOUTS = ["plain", "vbe", "vbe_output"]


def check_against_both(
    device: str,
    tiers: dict[str, object],
    *,
    ahead: int,
    layout: str,
    optimizer: str = "rowwise_adagrad",
    pooling: str = "sum",
    fp16: bool = False,
    steps: int = 10,
    pipelined: bool = False,
    replay: str = "",
    deferred: bool = False,
) -> KeyValueEmbeddingBags:
    """Train the device-cache module, the host-cache CPU module and the reference on the same batches; every
    output, psw gradient and final row agree. Returns the (closed) device-cache module for metric checks."""
    batches = make_batches(steps, vbe=layout != "plain", seed=ahead * 7 + len(layout))
    weighted = pooling == "sum"
    tol = 2e-3 if fp16 else 1e-5
    module = make_module(device, on_device=True, optimizer=optimizer, pooling=pooling, fp16=fp16, **tiers)  # type: ignore[arg-type]
    host = make_module("cpu", on_device=False, cache_rows=3, optimizer=optimizer, pooling=pooling, fp16=fp16)
    got_out, got_grad = train(
        module,
        batches,
        ahead=ahead,
        layout=layout,
        weighted=weighted,
        pipelined=pipelined,
        replay=replay,
        deferred=deferred,
    )
    host_out, host_grad = train(host, batches, ahead=0, layout=layout, weighted=weighted)
    reference = Reference(optimizer, pooling, fp16)
    for step, b in enumerate(batches):
        want_out, want_grad = reference.step(b, 1000 + step)
        torch.testing.assert_close(got_out[step], want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(got_out[step], host_out[step], atol=tol, rtol=tol)
        if weighted:
            torch.testing.assert_close(got_grad[step], want_grad, atol=tol, rtol=tol)
            torch.testing.assert_close(got_grad[step], host_grad[step], atol=tol, rtol=tol)
    mine, theirs = stored_rows(module), stored_rows(host)
    assert mine.keys() == theirs.keys()
    for (table, i), (w, s) in mine.items():
        t = [spec.name for spec in TABLES].index(table)
        r = reference.row[i]
        torch.testing.assert_close(w, reference.weights[t][r], atol=tol, rtol=tol)
        torch.testing.assert_close(w, theirs[(table, i)][0], atol=tol, rtol=tol)
        if optimizer == "rowwise_adagrad":
            torch.testing.assert_close(s[0], reference.state[t][r], atol=tol, rtol=tol)
    module.close()
    host.close()
    return module


# ---------------------------------------------------------------------------- CPU (forced)


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS)
@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["sync", "ahead1", "ahead2"])
@pytest.mark.parametrize("tiers", [t for _, t in TIERS], ids=[n for n, _ in TIERS])
def test_device_cache_matches_host_path_and_reference(
    tiers: dict[str, object], ahead: int, layout: str
) -> None:
    """Ten steps with tiny caches (~20 rows a batch, 3 features over 2 tables, weighted, row-wise Adagrad)
    give the reference's and the host-cache path's outputs, psw gradients and rows."""
    check_against_both("cpu", tiers, ahead=ahead, layout=layout)


@pytest.mark.parametrize("ahead", [1, 2], ids=["ahead1", "ahead2"])
@pytest.mark.parametrize("tiers", [t for _, t in TIERS], ids=[n for n, _ in TIERS])
def test_device_cache_prefetch_after_backward_matches_reference(tiers: dict[str, object], ahead: int) -> None:
    """Prefetches issued after each backward (its batch released: its slots may be the victims) give the
    reference's and the host-cache path's outputs, psw gradients and rows."""
    check_against_both("cpu", tiers, ahead=ahead, layout="vbe", pipelined=True)


@pytest.mark.parametrize("layout", ["plain", "vbe"], ids=["plain", "vbe"])
@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["sync", "ahead1", "ahead2"])
@pytest.mark.parametrize("tiers", [t for _, t in TIERS], ids=[n for n, _ in TIERS])
def test_static_slots_replay_matches_reference(tiers: dict[str, object], ahead: int, layout: str) -> None:
    """Forwards and backwards that read their slots from the static buffers ``replaying`` stages (the code a
    CUDA graph captures, run eagerly on the CPU) give the reference's outputs, psw gradients and rows, with
    prefetches ahead and without (then staging assigns the slots itself)."""
    check_against_both("cpu", tiers, ahead=ahead, layout=layout, replay="static")


@pytest.mark.parametrize("replay", ["", "static"], ids=["eager", "static"])
@pytest.mark.parametrize("ahead", [1, 2], ids=["ahead1", "ahead2"])
@pytest.mark.parametrize("tiers", [t for _, t in TIERS], ids=[n for n, _ in TIERS])
def test_prefetch_completed_later_matches_reference(
    tiers: dict[str, object], ahead: int, replay: str
) -> None:
    """Prefetches issued with ``complete=False`` (survey only) and finished after the next step (by the
    forward that needs one, or by ``complete_prefetch()``; a staged replay of the batch before leaves it
    unfinished) give the reference's and the host-cache path's outputs, psw gradients and rows."""
    check_against_both("cpu", tiers, ahead=ahead, layout="vbe", replay=replay, deferred=True)


def test_prefetch_completed_later_raises_bad_offsets_at_its_completion() -> None:
    """A prefetch issued with ``complete=False`` checks its ``offsets`` values at its completion: the error is
    raised there, the prefetch is dropped, and the module keeps working."""
    module = make_module("cpu", on_device=True, cache_rows=4, host_cache_rows=8)
    b = make_batches(1, vbe=False, seed=2)[0]
    bad = b.offsets.clone()
    bad[-1] = b.indices.numel() + 5
    module.prefetch(b.indices, bad, complete=False)
    with pytest.raises(InvalidArgumentError, match="offsets"):
        module.complete_prefetch()
    module.complete_prefetch()  # nothing left to finish
    assert module.metrics()["prefetches"] == 0
    module.prefetch(b.indices, b.offsets, complete=False)
    module(b.indices, b.offsets).sum().backward()  # the forward finishes its own prefetch and uses it
    assert module.metrics()["forwards_without_prefetch"] == 0
    module.close()


def test_static_forward_reads_the_staged_slots() -> None:
    """Under ``static_slots`` a forward reads the slots ``replaying`` staged, not its own ids: a forward of
    other ids of the same count gives the staged batch's output (a replay reads its capture's inputs)."""
    module = make_module("cpu", on_device=True, cache_rows=8, host_cache_rows=8)
    staged = make_batches(1, vbe=False, seed=5)[0]
    other_ids = torch.full_like(staged.indices, 12345)  # one id none of the staged bags holds
    with torch.no_grad():
        want = module(staged.indices, staged.offsets)
        with module.replaying(staged.indices, staged.offsets), module.static_slots():
            got = module(other_ids, staged.offsets)
        plain = module(other_ids, staged.offsets)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(plain, want)
    module.close()


def test_staging_that_grows_the_cache_raises_stale_capture_and_keeps_the_batch() -> None:
    """A replay staged without a prefetch whose assignment grows the cache (its scratch pool) raises
    ``StaleCaptureError`` (the graph holds the old tensors) and keeps the batch's slots pending: the retry
    (after a new capture) stages them and trains as the reference."""
    module = make_module("cpu", on_device=True, cache_rows=0)
    b = make_batches(1, vbe=False, seed=11)[0]
    before = module.captured_buffers()
    with pytest.raises(StaleCaptureError, match="record it again"), module.replaying(b.indices, b.offsets):
        pass
    assert any(x is not y for x, y in zip(before, module.captured_buffers(), strict=True))
    fetched = module.metrics()["sync_fetched_rows"]
    with torch.no_grad(), module.replaying(b.indices, b.offsets), module.static_slots():
        got = module(b.indices, b.offsets)
    assert module.metrics()["sync_fetched_rows"] == fetched  # the kept slots, not a second assignment
    with torch.no_grad():
        torch.testing.assert_close(got, module(b.indices, b.offsets))
    module.close()


def test_replaying_needs_the_device_cache() -> None:
    """The host-cache path has no static slots: ``replaying`` and ``static_slots`` say so."""
    module = make_module("cpu", on_device=False, cache_rows=3)
    b = make_batches(1, vbe=False)[0]
    with (
        pytest.raises(InvalidArgumentError, match="device-managed cache"),
        module.replaying(b.indices, b.offsets),
    ):
        pass
    with pytest.raises(InvalidArgumentError, match="device-managed cache"), module.static_slots():
        pass
    module.close()


@pytest.mark.parametrize(
    ("optimizer", "pooling", "fp16"),
    [
        ("sgd", "sum", False),
        ("rowwise_adagrad", "mean", False),
        ("sgd", "mean", True),
        ("rowwise_adagrad", "sum", True),
    ],
    ids=["sgd-sum", "adagrad-mean", "sgd-mean-fp16", "adagrad-sum-fp16"],
)
def test_device_cache_optimizers_pooling_precision(optimizer: str, pooling: str, fp16: bool) -> None:
    """SGD, mean pooling and fp16 rows on the device cache match the reference (both tiers, prefetch ahead)."""
    check_against_both(
        "cpu",
        {"cache_rows": 2, "host_cache_rows": 6},
        ahead=1,
        layout="vbe",
        optimizer=optimizer,
        pooling=pooling,
        fp16=fp16,
    )


def test_steady_moves_from_the_dram_tier_match_the_reference() -> None:
    """With the DRAM tier holding every row, most assignments move their misses in without host work (padded
    to a bucket size, one graph replay on CUDA), and the results stay the reference's."""
    module = check_against_both(
        "cpu", {"cache_rows": 4, "host_cache_rows": 64}, ahead=0, layout="vbe", steps=16
    )
    metrics = module.metrics()
    assert metrics["hbm_steady_assigns"] >= 4, metrics["hbm_steady_assigns"]
    assert (
        metrics["hbm_steady_assigns"] < metrics["hbm_assigns_with_misses"]
    )  # the first touches read the store


def test_dram_tier_keeps_evicted_rows_out_of_the_store() -> None:
    """Rows leaving the device cache go to the DRAM tier while it has room (no store write until flush); a
    DRAM tier too small pushes dirty rows down to the store."""
    batches = make_batches(8, vbe=False)
    roomy = make_module("cpu", on_device=True, cache_rows=2, host_cache_rows=64)
    train(roomy, batches, ahead=1, layout="plain", weighted=True)
    m = roomy.metrics()
    assert m["hbm_evicted_rows"] > 0
    assert m["host_tier_rows_in"] > 0
    assert m["host_tier_hits"] > 0  # evicted rows came back from DRAM, not from the store
    assert m["store_rows_written"] == 0
    roomy.flush()
    assert roomy.metrics()["store_rows_written"] > 0
    roomy.close()
    # Without prefetch the scratch pool holds one batch's overflow, so rows do leave the device cache.
    tight = make_module("cpu", on_device=True, cache_rows=2, host_cache_rows=3)
    train(tight, batches, ahead=0, layout="plain", weighted=True)
    m = tight.metrics()
    assert m["host_tier_evicted_rows"] > 0
    assert m["store_rows_written"] > 0
    tight.close()


def test_scratch_pool_grows_and_batches_stay_protected() -> None:
    """With no cache slots at all, every row of the batches in flight (two prefetched ahead) lives in the
    scratch pool, which grows to hold them; results stay exact (checked by the reference)."""
    module = check_against_both("cpu", {"cache_rows": 0}, ahead=2, layout="vbe")
    m = module.metrics()
    assert m["hbm_scratch_slots"] >= 16  # two or three batches of rows in flight at once
    assert m["forwards_without_prefetch"] == 0
    assert m["forward_hit_rate"] == 1.0


def test_prefetched_forward_reuses_slots_and_counts_hits() -> None:
    """Forwards of prefetched batches find every row cached; a forward given other tensors than its prefetch
    plans again (and stays exact)."""
    batches = make_batches(4, vbe=False)
    module = make_module("cpu", on_device=True, cache_rows=4)
    module.prefetch(batches[0].indices, batches[0].offsets)
    out = module(batches[0].indices.clone(), batches[0].offsets, None)  # not the prefetched tensor
    out.sum().backward()
    assert module.metrics()["forwards_without_prefetch"] == 1
    module.close()


def test_prefetch_is_reused_for_a_view_of_the_same_ids() -> None:
    """A sharded module slices its ids again and rebuilds the offsets for forward: the prefetch still counts
    (same memory, same sizes) and the results stay exact; an in-place change of the ids voids it."""
    batches = make_batches(6, vbe=True)
    module = make_module("cpu", on_device=True, cache_rows=3, host_cache_rows=4)
    reference = Reference("rowwise_adagrad", "sum", False)
    for step, b in enumerate(batches):
        values = torch.cat([b.indices, torch.tensor([123])])  # the "all features" buffer
        module.prefetch(values[: b.indices.numel()], b.offsets.clone(), b.sizes)
        out = module(values[: b.indices.numel()], b.offsets.clone(), b.psw, b.sizes)
        want, _ = reference.step(b, 1000 + step)
        torch.testing.assert_close(out.detach(), want, atol=1e-5, rtol=1e-5)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 + step))
        torch.autograd.backward((out * probe).sum())
    assert module.metrics()["forwards_without_prefetch"] == 0
    ids = batches[0].indices.clone()
    module.prefetch(ids, batches[0].offsets, batches[0].sizes)
    ids.add_(1)
    module(ids, batches[0].offsets, None, batches[0].sizes)
    assert module.metrics()["forwards_without_prefetch"] == 1
    module.close()


def test_two_forwards_before_their_backwards_and_odd_inputs() -> None:
    """Two forwards, then both backwards (gradient accumulation): the first batch's rows keep their slots
    until its backward; int32 ids/offsets and an empty VBE batch work. Checked against the reference."""
    batches = make_batches(4, vbe=True)
    module = make_module("cpu", on_device=True, cache_rows=1)
    reference = Reference("sgd", "sum", False)
    module.optimizer = "sgd"
    a, b = batches[0], batches[1]
    out_a = module(a.indices, a.offsets.int(), a.psw, a.sizes)
    out_b = module(b.indices, b.offsets, b.psw, b.sizes)
    probes = [
        torch.randn(o.shape, generator=torch.Generator().manual_seed(1000 + k))
        for k, o in enumerate((out_a, out_b))
    ]
    # The reference applies both updates after both forwards too: run its forwards on the same weights.
    want_a, _ = reference.step(a, 1000)
    weights_after_a = [w.clone() for w in reference.weights]
    reference.weights = [w.clone() for w in Reference("sgd", "sum", False).weights]
    want_b, _ = reference.step(b, 1001)
    torch.testing.assert_close(out_a.detach(), want_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_b.detach(), want_b, atol=1e-5, rtol=1e-5)
    torch.autograd.backward((out_b * probes[1]).sum())
    torch.autograd.backward((out_a * probes[0]).sum())
    initial = Reference("sgd", "sum", False).weights
    expected = [wa + wb - w0 for wa, wb, w0 in zip(weights_after_a, reference.weights, initial, strict=True)]
    empty = Batch(
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(7, dtype=torch.int64),
        torch.zeros(0),
        [[0, 0], [3, 0], [0, 3]],
    )
    out = module(empty.indices, empty.offsets, None, empty.sizes)
    assert out.shape == (3 * 5 + 3 * 8,)
    assert bool((out == 0).all())
    out.sum().backward()
    for (table, i), (w, _) in stored_rows(module).items():
        t = [spec.name for spec in TABLES].index(table)
        torch.testing.assert_close(w, expected[t][reference.row[i]], atol=1e-5, rtol=1e-5)
    module.close()
    small = a.indices.remainder(1000)  # int32 ids: values that fit
    wide, narrow = (make_module("cpu", on_device=True, cache_rows=2) for _ in range(2))
    torch.testing.assert_close(
        narrow(small.int(), a.offsets, a.psw, a.sizes), wide(small, a.offsets, a.psw, a.sizes)
    )


def test_skipped_prefetch_is_retired_and_an_unprefetched_forward_shifts_nothing() -> None:
    """A prefetched batch that never comes is retired by the next matching forward; a forward nobody
    prefetched leaves the queue alone, so later forwards still find their prefetches (and stay exact)."""
    batches = make_batches(5, vbe=False)
    module = make_module("cpu", on_device=True, cache_rows=2)
    reference = Reference("rowwise_adagrad", "sum", False)
    module.prefetch(batches[0].indices, batches[0].offsets)  # never forwarded
    module.prefetch(batches[1].indices, batches[1].offsets)
    module.prefetch(batches[3].indices, batches[3].offsets)
    for step in (1, 2, 3):
        b = batches[step]
        out = module(b.indices, b.offsets, b.psw)
        want, _ = reference.step(b, 1000 + step)
        torch.testing.assert_close(out.detach(), want, atol=1e-5, rtol=1e-5)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 + step))
        torch.autograd.backward((out * probe).sum())
    m = module.metrics()
    assert m["forwards_without_prefetch"] == 1  # batch 2 only
    assert m["prefetches"] == 3
    for (table, i), (w, _) in stored_rows(module).items():
        t = [spec.name for spec in TABLES].index(table)
        torch.testing.assert_close(w, reference.weights[t][reference.row[i]], atol=1e-5, rtol=1e-5)
    module.close()


class FailingStore(MemoryStore):
    """A memory store whose next ``failures`` reads and next ``put_failures`` writes raise ``StoreIOError``."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0
        self.put_failures = 0

    def get(self, ids: torch.Tensor, out: torch.Tensor, *, table: int = 0) -> torch.Tensor:
        if self.failures:
            self.failures -= 1
            raise StoreIOError("injected read failure")
        return super().get(ids, out, table=table)

    def put(self, ids: torch.Tensor, rows: torch.Tensor, *, table: int = 0) -> None:
        if self.put_failures:
            self.put_failures -= 1
            raise StoreIOError("injected write failure")
        super().put(ids, rows, table=table)


@pytest.mark.parametrize("failing", ["read", "write"], ids=["read", "write"])
def test_failed_prefetch_store_call_surfaces_at_forward_and_loses_no_update(failing: str) -> None:
    """A store read or write-back failing in prefetch raises at the forward that would use it; retrying that
    forward and training on gives the reference's rows (no update lost, no row duplicated)."""
    batches = make_batches(6, vbe=False)
    store = FailingStore()
    module = make_module("cpu", on_device=True, cache_rows=2, host_cache_rows=3, store=store)
    reference = Reference("rowwise_adagrad", "sum", False)
    for step, b in enumerate(batches):
        if step == 3:
            if failing == "read":
                store.failures = 1
            else:
                store.put_failures = 1
            module.prefetch(b.indices, b.offsets)
            with pytest.raises(StoreIOError, match="injected"):
                module.wait_prefetch()
            module.wait_prefetch()  # raised once, then dropped
            if failing == "read":
                store.failures = 1
            else:
                store.put_failures = 1
            module.prefetch(b.indices, b.offsets)
            with pytest.raises(StoreIOError, match="injected"):
                module(b.indices, b.offsets, b.psw)  # the forward of the failed prefetch's batch
        out = module(b.indices, b.offsets, b.psw)
        want, _ = reference.step(b, 1000 + step)
        torch.testing.assert_close(out.detach(), want, atol=1e-5, rtol=1e-5)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1000 + step))
        (out * probe).sum().backward()
    for (table, i), (w, _) in stored_rows(module).items():
        t = [spec.name for spec in TABLES].index(table)
        torch.testing.assert_close(w, reference.weights[t][reference.row[i]], atol=1e-5, rtol=1e-5)
    module.close()


def test_restore_empties_both_tiers(tmp_path: Path) -> None:
    """load_checkpoint on a device-cache module drops the cached rows of both tiers (they would be stale)."""
    batches = make_batches(4, vbe=False)
    module = make_module("cpu", on_device=True, cache_rows=3, host_cache_rows=8)
    train(module, batches[:2], ahead=1, layout="plain", weighted=True)
    module.save_checkpoint(tmp_path / "ckpt")
    saved = stored_rows(module)
    train(module, batches[2:], ahead=1, layout="plain", weighted=True)
    module.load_checkpoint(tmp_path / "ckpt")
    assert module.metrics()["hbm_cached_rows"] == 0
    after = stored_rows(module)
    assert after.keys() == saved.keys()
    for key, (w, _) in saved.items():
        torch.testing.assert_close(after[key][0], w)
    module.close()


def test_bad_host_cache_rows_is_rejected() -> None:
    """`host_cache_rows` must be an int >= 0 and needs the device cache."""
    with pytest.raises(InvalidArgumentError, match="`host_cache_rows`"):
        make_module("cpu", on_device=True, cache_rows=2, host_cache_rows=-1)
    with pytest.raises(InvalidArgumentError, match=r"`host_cache_rows`.*device cache"):
        make_module("cpu", on_device=False, cache_rows=2, host_cache_rows=4)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("chained", [False, True], ids=["own-output", "vbe_output"])
def test_one_block_layout_matches_the_host_path(pooling: str, chained: bool) -> None:
    """One rank's VBE layout with one dim (every feature's bags one block of the output: the device path's one
    copy forward and one gradient view backward) gives the host-cache path's outputs, gradients and rows,
    mean pooling and a chained ``vbe_output`` (whose untouched part keeps its gradient) included."""
    tables = [TableSpec("a", 6), TableSpec("b", 6)]
    ftm, batch = [0, 1, 0], 5
    gen = torch.Generator().manual_seed(3)

    def module(on_device: bool) -> KeyValueEmbeddingBags:
        return KeyValueEmbeddingBags(
            tables,
            ftm,
            MemoryStore(),
            cache_rows=4,
            optimizer="rowwise_adagrad",
            learning_rate=LR,
            pooling=pooling,  # type: ignore[arg-type]
            device="cpu",
            cache_on_device=on_device,
        )

    device_path, host_path = module(True), module(False)
    sizes = [[batch]] * len(ftm)
    lead = 7  # elements of the chained buffer before this module's blocks
    for _ in range(6):
        lengths = torch.randint(0, 4, (batch * len(ftm),), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        indices = ID_POOL[torch.randint(0, ID_POOL.numel(), (int(offsets[-1]),), generator=gen)]
        total = batch * len(ftm) * 6
        probe = torch.randn(lead + total, generator=gen)
        outs, grads = [], []
        for m in (device_path, host_path):
            if chained:
                base = torch.zeros(lead + total, requires_grad=True)
                buffer = base * 1.0  # a non-leaf the module writes in place
                offsets_out = torch.tensor([[lead + f * batch * 6 for f in range(len(ftm))]])
                out = m(
                    indices,
                    offsets,
                    batch_size_per_feature_per_rank=sizes,
                    vbe_output=buffer,
                    vbe_output_offsets=offsets_out,
                )
            else:
                base = None
                out = torch.cat(
                    [torch.zeros(lead), m(indices, offsets, batch_size_per_feature_per_rank=sizes)]
                )
            (out * probe).sum().backward()
            outs.append(out.detach())
            grads.append(None if base is None else base.grad)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)
        if chained:
            grad = grads[0]
            assert grad is not None
            torch.testing.assert_close(grad, grads[1])
            torch.testing.assert_close(grad[:lead], probe[:lead])  # the part no block overwrote
            assert bool((grad[lead:] == 0).all())
    mine, theirs = stored_rows(device_path), stored_rows(host_path)
    assert mine
    assert mine.keys() == theirs.keys()
    for key, (w, state) in mine.items():
        torch.testing.assert_close(w, theirs[key][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state, theirs[key][1], atol=1e-6, rtol=1e-6)


def test_device_cache_lookup_and_victims() -> None:
    """DeviceCache alone: misses are moved in once per unique row, hits keep their slot, protected slots are
    never victims and the oldest unprotected slot is."""
    lower = HostTier(16, [4], _NullTier(), pin=False)
    cache = DeviceCache([3], [4], torch.device("cpu"), lower, round_fp16=False)
    tables = torch.zeros(5, dtype=torch.int64)
    first = cache.assign(tables, torch.tensor([5, 6, 5, 7, 6]), tick=1, protect=1).slots
    assert first[0] == first[2]
    assert first[1] == first[4]
    assert len(set(first.tolist())) == 3
    assert cache.metrics.inserted_rows == 3
    assert cache.metrics.lookups == 3
    assert cache.metrics.hits == 0
    again = cache.assign(tables[:2], torch.tensor([7, 5]), tick=2, protect=2).slots
    assert again.tolist() == [first[3].item(), first[0].item()]
    # Row 6 (tick 1) is the only unprotected one: it leaves; 5 and 7 (tick 2) stay.
    third = cache.assign(tables[:1], torch.tensor([8]), tick=3, protect=2).slots
    assert third.tolist() == [first[1].item()]
    assert cache.lookup(tables[:3], torch.tensor([5, 7, 6])).tolist() == [
        first[0].item(),
        first[3].item(),
        -1,
    ]
    assert lower.cached_rows == 1  # row 6 went down to the host tier


@pytest.mark.parametrize("seed", range(4), ids=[f"seed{i}" for i in range(4)])
def test_unique_pairs_padded_match_torch_unique(seed: int) -> None:
    """The padded unique pass equals torch.unique over (table, id): pairs, lookups per pair, inverse, count."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=gen))
    tables = torch.randint(0, 3, (n,), generator=gen)
    ids = ID_POOL[torch.randint(0, ID_POOL.numel(), (n,), generator=gen)]
    u_tables, u_ids, counts, inverse, unique, order, sorted_pairs = _unique_pairs(tables, ids)
    pairs, want_inverse, want_counts = torch.unique(
        torch.stack([tables, ids], 1), dim=0, return_inverse=True, return_counts=True
    )
    u = int(unique)
    assert u == pairs.shape[0]
    assert torch.equal(torch.stack([u_tables[:u], u_ids[:u]], 1), pairs)
    assert torch.equal(counts[:u], want_counts)
    assert int(counts[u:].sum()) == 0
    assert torch.equal(inverse, want_inverse)
    # The lookups sorted by pair, with the pair of each sorted position (ascending).
    assert torch.equal(torch.sort(order).values, torch.arange(n))
    assert torch.equal(inverse.index_select(0, order), sorted_pairs)
    assert bool((sorted_pairs[1:] >= sorted_pairs[:-1]).all())


def test_device_cache_counts_every_lookup_of_a_hit() -> None:
    """A cached row's use count grows by its lookups in each batch (duplicates included); a row moved in starts
    at 1."""
    cache = DeviceCache([4], [4], torch.device("cpu"), _NullTier(), round_fp16=False)
    tables = torch.zeros(6, dtype=torch.int64)
    slots = cache.assign(tables[:2], torch.tensor([5, 6]), tick=1, protect=1).slots
    assert cache.uses[slots].tolist() == [1, 1]
    again = cache.assign(tables, torch.tensor([5, 5, 5, 6, 9, 9]), tick=2, protect=2).slots
    assert cache.uses[again[[0, 3, 4]]].tolist() == [4, 2, 1]
    assert cache.stamp[again].tolist() == [2] * 6


def _check_assignment(cache: DeviceCache, got: Any, tables: torch.Tensor, ids: torch.Tensor) -> None:
    """``got`` (an Assignment of ``(tables, ids)``) names each lookup's row, its fields consistent."""
    n = ids.numel()
    assert torch.equal(cache.slot_tables[got.slots], tables)
    assert torch.equal(cache.slot_ids[got.slots], ids)
    assert bool(cache.valid[got.slots].all())
    assert torch.equal(got.unique_slots[got.inverse], got.slots)
    assert got.unique_slots.unique().numel() == got.unique_slots.numel()
    real = got.order < n
    assert torch.equal(got.pairs[real], got.inverse[got.order[real]])
    assert bool((got.pairs[1:] >= got.pairs[:-1]).all())
    # The packed fields (one copy stages them for a replay): each at k * P, the unique slots padded with the
    # trash slot (a captured backward sums into N rows).
    p = got.packed.numel() // 5
    assert got.packed.numel() == 5 * p
    assert p >= n
    u = got.unique_slots.numel()
    assert bool((got.packed[u:p] == got.trash).all())
    assert torch.equal(got.packed[p : p + n], got.slots)
    assert torch.equal(got.packed[2 * p : 2 * p + n], got.inverse)


def test_hits_only_survey_serves_a_cached_batch_and_surveys_again_on_a_miss() -> None:
    """After an assignment without a miss the next survey looks for hits only: a batch it all hits gets its
    rows' slots, stamped and counted as the full survey does; a batch with a miss is surveyed again in full
    (its row moved in), and the survey after that is a full one."""
    cache = DeviceCache([4, 4], [4, 4], torch.device("cpu"), _NullTier(), round_fp16=False)
    tables, ids = torch.tensor([0, 1, 0, 0, 1]), torch.tensor([5, 5, 7, 5, 9])
    first = cache.assign(tables, ids, tick=1, protect=1)  # misses: a full survey
    second = cache.assign(tables, ids, tick=2, protect=2)  # the last one missed: full again, no miss
    assert (cache.metrics.hit_surveys, cache.metrics.resurveys) == (0, 0)
    third = cache.assign(tables, ids, tick=3, protect=3)  # hits only
    assert (cache.metrics.hit_surveys, cache.metrics.resurveys) == (1, 0)
    for got in (first, second, third):
        _check_assignment(cache, got, tables, ids)
    assert torch.equal(third.slots, first.slots)
    assert third.inserted == 0
    assert cache.uses[third.slots].tolist() == [5, 3, 3, 5, 3]  # 1 at the move in, then 2 batches' lookups
    assert cache.stamp[third.slots].tolist() == [3] * 5
    new_tables, new_ids = torch.tensor([0, 1, 1]), torch.tensor([5, 11, 11])
    fourth = cache.assign(new_tables, new_ids, tick=4, protect=4)  # hits only finds a miss: surveyed again
    assert (cache.metrics.hit_surveys, cache.metrics.resurveys) == (2, 1)
    _check_assignment(cache, fourth, new_tables, new_ids)
    assert fourth.inserted == 1
    assert cache.uses[fourth.slots].tolist() == [6, 1, 1]
    fifth = cache.assign(new_tables, new_ids, tick=5, protect=5)  # the last one missed: a full survey
    assert cache.metrics.hit_surveys == 2
    _check_assignment(cache, fifth, new_tables, new_ids)
    assert cache.metrics.assigns == 5


@pytest.mark.parametrize(
    ("tiers", "ahead"),
    [
        ({"cache_rows": 64}, 2),
        ({"cache_rows": 10, "host_cache_rows": 64}, 1),
        ({"cache_rows": 10, "host_cache_rows": 64}, 2),
    ],
    ids=["hbm64-ahead2", "hbm10+dram64-ahead1", "hbm10+dram64-ahead2"],
)
def test_hits_only_surveys_match_the_reference(tiers: dict[str, object], ahead: int) -> None:
    """Over a cache that soon holds most rows, surveys after an assignment without a miss look for hits only
    and some of them find a miss (surveyed again in full): outputs, gradients and rows stay the reference's
    and the host path's."""
    module = check_against_both("cpu", tiers, ahead=ahead, layout="vbe", steps=24)
    metrics = module.metrics()
    assert metrics["hbm_hit_surveys"] >= metrics["hbm_resurveys"] >= 1, metrics


class _LoggedTier(HostTier):
    """A host tier that logs its takes and gives into a shared list (with the keys asked / handed)."""

    def __init__(self, log: list[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def take(self, tables: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> TierRows:
        self.log.append("take")
        return super().take(tables, ids, out)

    def give(self, rows: TierRows) -> None:
        self.log.append("give")
        super().give(rows)


def test_assignment_reads_below_before_waiting_for_rows_and_writes_after() -> None:
    """The order the CUDA overlap rests on: the missing rows are taken from below before ``before_rows`` (the
    wait for the forward/backward stream), the victims are handed down after it; a batch of hits never waits;
    a growing scratch pool waits before it copies the rows; a host tier full of the rows coming up takes them
    first, so the victims fit without pushing anything to the store, and every row keeps its values."""
    log: list[str] = []
    below = _RecordingTier()
    lower = _LoggedTier(log, 3, [4], below, pin=False)
    cache = DeviceCache([3], [4], torch.device("cpu"), lower, round_fp16=False)

    def wait() -> None:
        log.append("wait")

    tables = torch.zeros(3, dtype=torch.int64)
    # Rows 1, 2, 3 given to the host tier (full), rows 5, 6, 7 in the device cache (from below: -1).
    lower.give(
        TierRows(
            tables=tables,
            ids=torch.tensor([1, 2, 3]),
            weights=torch.arange(12, dtype=torch.float32).reshape(3, 4),
            state=torch.zeros(3),
            dirty=torch.ones(3, dtype=torch.bool),
        )
    )
    first = cache.assign(tables, torch.tensor([5, 6, 7]), tick=1, protect=1, before_rows=wait)
    cache.update(first.unique_slots, torch.ones(3, 4), RowOptimizer("sgd", 1.0, 0.0))  # now dirty: -2
    log.clear()
    cache.assign(tables, torch.tensor([5, 6, 7]), tick=2, protect=2, before_rows=wait)
    assert log == []  # hits only: nothing waits, nothing moves
    got = cache.assign(tables, torch.tensor([3, 1, 2]), tick=3, protect=3, before_rows=wait)
    assert log == ["take", "wait", "give"]
    torch.testing.assert_close(
        cache.weights.index_select(0, got.slots),
        torch.arange(12, dtype=torch.float32).reshape(3, 4)[[2, 0, 1]],
    )
    assert below.given == set()  # the victims fit where the rows coming up were
    assert lower.metrics.evicted_rows == 0
    taken = lower.take(tables, torch.tensor([5, 6, 7]))
    torch.testing.assert_close(taken.weights, torch.full((3, 4), -2.0))
    assert bool(taken.dirty.all())
    # Every own slot protected: the scratch pool grows, after the wait.
    log.clear()
    cache.assign(tables, torch.tensor([8, 9, 10]), tick=4, protect=3, before_rows=wait)
    assert log[0] == "wait"
    assert cache.metrics.scratch_rows == 3


def test_host_tier_take_into_a_buffer_matches_a_plain_take() -> None:
    """take(out=) writes the rows, state and dirty flags into the buffer, the same as a plain take, whether all,
    some or none of the rows are held (the rest from below)."""
    for held in (3, 1, 0):
        tiers = []
        for _ in range(2):
            tier = HostTier(8, [4, 2], _RecordingTier(), pin=False)
            if held:
                tier.give(
                    TierRows(
                        tables=torch.tensor([0, 1, 0])[:held],
                        ids=torch.tensor([4, 5, 6])[:held],
                        weights=torch.arange(12, dtype=torch.float32).reshape(3, 4)[:held],
                        state=torch.tensor([0.5, 1.5, 2.5])[:held],
                        dirty=torch.tensor([True, False, True])[:held],
                    )
                )
            tiers.append(tier)
        asked = (torch.tensor([0, 1, 0]), torch.tensor([4, 5, 6]))
        plain = tiers[0].take(*asked)
        out = torch.full((3, 6), 9.0)
        into = tiers[1].take(*asked, out=out)
        torch.testing.assert_close(out[:, :4], plain.weights)
        torch.testing.assert_close(out[:, 4], plain.state)
        torch.testing.assert_close(out[:, 5], plain.dirty.to(torch.float32))
        torch.testing.assert_close(into.weights, plain.weights)
        assert torch.equal(into.dirty, plain.dirty)
        assert into.weights.data_ptr() == out.data_ptr()


def test_host_tier_matches_a_model_over_takes_gives_and_evictions() -> None:
    """HostTier (hash index with tombstones and rebuilds, free-slot stack, queue of given slots) against a dict:
    takes return the rows given (the rest from below), evictions take the least recently given rows and hand
    exactly the dirty ones down."""
    below = _RecordingTier()
    tier = HostTier(12, [4, 3], below, pin=False)
    gen = torch.Generator().manual_seed(7)
    held: dict[tuple[int, int], tuple[torch.Tensor, bool, int]] = {}  # key -> (row, dirty, give number)
    gives = 0
    for _ in range(120):
        count = int(torch.randint(1, 9, (1,), generator=gen))
        pairs = torch.randint(0, 40, (count, 2), generator=gen)
        keys = sorted({(int(t) % 2, int(i)) for t, i in pairs.tolist()})
        tables = torch.tensor([t for t, _ in keys], dtype=torch.int64)
        ids = torch.tensor([i for _, i in keys], dtype=torch.int64)
        if torch.rand(1, generator=gen) < 0.5:  # take
            rows = tier.take(tables, ids)
            for j, key in enumerate(keys):
                if key in held:
                    row, dirty, _ = held.pop(key)
                    torch.testing.assert_close(rows.weights[j], row)
                    assert bool(rows.dirty[j]) == dirty
                else:
                    torch.testing.assert_close(rows.weights[j], torch.full((4,), -1.0))
        else:  # give rows absent here
            keys = [key for key in keys if key not in held]
            if not keys:
                continue
            gives += 1
            weights = torch.rand(len(keys), 4, generator=gen)
            marked = torch.rand(len(keys), generator=gen) < 0.5
            need = len(keys) - (12 - len(held))
            before = set(held)
            below.given.clear()
            tier.give(
                TierRows(
                    tables=torch.tensor([t for t, _ in keys], dtype=torch.int64),
                    ids=torch.tensor([i for _, i in keys], dtype=torch.int64),
                    weights=weights,
                    state=torch.zeros(len(keys)),
                    dirty=marked,
                )
            )
            held_now = {
                (int(t), int(i))
                for t, i, v in zip(tier.slot_tables, tier.slot_ids, tier.valid, strict=True)
                if v
            }
            evicted = before - held_now
            assert len(evicted) == max(need, 0)
            if evicted and before - evicted:  # the least recently given rows (ties broken any way)
                assert max(held[key][2] for key in evicted) <= min(held[key][2] for key in before - evicted)
            assert below.given == {key for key in evicted if held[key][1]}
            for key in evicted:
                del held[key]
            for j, key in enumerate(keys):
                held[key] = (weights[j], bool(marked[j]), gives)
        assert tier.cached_rows == len(held)
        found, _ = tier._index.find(
            torch.tensor([t for t, _ in held], dtype=torch.int64).numpy(),
            torch.tensor([i for _, i in held], dtype=torch.int64).numpy(),
        )
        assert (found >= 0).all()


class _NullTier:
    """A bottom tier of fresh rows (``fill``, 0 by default) that keeps nothing it is given."""

    keeps_clean_rows = False
    fill = 0.0

    def take(self, tables: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> TierRows:
        k = ids.numel()
        rows = TierRows(
            tables=tables,
            ids=ids,
            weights=torch.full((k, 4), self.fill),
            state=torch.zeros(k),
            dirty=torch.zeros(k, dtype=torch.bool),
        )
        return rows_into(rows, out)

    def give(self, rows: TierRows) -> None:
        del rows

    def persist(self, rows: TierRows) -> None:
        del rows

    def flush(self) -> None:
        return None

    def clear(self) -> None:
        return None

    def summary(self) -> dict[str, float]:
        return {}

    def reset_metrics(self) -> None:
        return None


class _RecordingTier(_NullTier):
    """A bottom tier that returns rows of -1 and records the keys handed down to it."""

    fill = -1.0

    def __init__(self) -> None:
        self.given: set[tuple[int, int]] = set()

    def give(self, rows: TierRows) -> None:
        self.given |= {(int(t), int(i)) for t, i in zip(rows.tables.tolist(), rows.ids.tolist(), strict=True)}


# Files of the device-cache step (their torch calls run on the device on CUDA) and of the host tiers (host
# tensors only: their reads are not syncs).
_DEVICE_FILES = (
    "_device_cache.py",
    "_device_path.py",
    "_dram_tier.py",
    "_slot_index.py",
    "_row_moves.py",
    "_layout.py",
    "_plan.py",
    "_module.py",
    "_init.py",
)
_HOST_FILES = ("_host_tier.py", "_tier.py", "_store.py", "_records.py")
_PACKAGE_DIR = str(Path(ssd_tbe_adapter.__file__).parent)
# aten ops whose output shape depends on the data (CUDA syncs for it) and the host reads of a value.
_DATA_DEPENDENT = {
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "_local_scalar_dense",
}


class _HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]  # untyped in torch's stubs
    """Counts, by kind, the calls made from the device-cache step (not from the host tiers below it) that sync
    on CUDA: host reads (``.tolist()``, ``.item()`` / ``int()`` / ``bool()``, ``.cpu()``, ``.to("cpu")``),
    data-dependent shapes (``nonzero``, boolean masks, ``unique``, ``repeat_interleave`` without
    ``output_size``), element writes ``t[i] = x`` (a blocking host-to-device copy) and tensors built from
    Python data (``torch.tensor(list)``: a host-to-device copy), while the mode is entered. On the CPU only
    the call sites can be counted, not the device: the CUDA-only wait in ``DeviceCache._move_in`` and copies
    to the module's device (no-ops here, skipped by the code on the CPU) are not among them."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        self.counts: dict[str, int] = {}
        self.active = False

    def __enter__(self) -> _HostReads:
        self.active = True
        super().__enter__()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False
        super().__exit__(*exc)  # type: ignore[no-untyped-call]  # untyped in torch's stubs

    @staticmethod
    def _from_device_step() -> bool:
        frame: Any = sys._getframe(1)
        in_step = False
        while frame is not None:
            name = frame.f_code.co_filename
            if _PACKAGE_DIR in name:
                if name.endswith(_HOST_FILES):
                    return False
                in_step = in_step or name.endswith(_DEVICE_FILES)
            frame = frame.f_back
        return in_step

    def note(self, kind: str) -> None:
        if self.active and self._from_device_step():
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        if name in _DATA_DEPENDENT:
            self.note("read" if name == "_local_scalar_dense" else "data-dependent")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            if len(args) == 1 or isinstance(args[1], torch.Tensor):  # not the int-repeats overload
                self.note("data-dependent")
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in args[1]
            if i is not None
        ):
            self.note("data-dependent")
        elif name == "copy_" and args[0].dim() == 0 and args[1].dim() == 0:
            self.note("element-write")
        return func(*args, **kwargs)


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> _HostReads:
    """A :class:`_HostReads` whose ``.tolist()`` / ``.cpu()`` / ``.to(cpu)`` / ``torch.tensor`` patches are live
    for the test (``torch.from_numpy``, host data staying on the host, is not counted)."""
    mode = _HostReads()
    original_tolist, original_cpu, original_to = torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.to
    original_tensor = torch.tensor

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        mode.note("from-python")
        return original_tensor(*args, **kwargs)

    def tolist(self: torch.Tensor) -> Any:
        mode.note("read")
        return original_tolist(self)

    def cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mode.note("read")
        return original_cpu(self, *args, **kwargs)

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str | torch.device) and torch.device(target).type == "cpu":
            mode.note("read")
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch, "tensor", tensor)
    return mode


def test_host_reads_counter_sees_each_kind(host_reads: _HostReads) -> None:
    """The counter behind the sync guard counts a host read, a mask, an element write and torch.tensor(list)
    made from the device step's files, and nothing made elsewhere."""
    from ssd_tbe_adapter import _device_cache

    t = torch.arange(4)
    with host_reads:
        t.tolist()
        t[t > 1]
        t[0] = 3
        torch.tensor([1, 2])
    assert host_reads.counts == {}  # made here, in a test file
    probe = compile(
        "t.tolist(); int(t[0]); t[t > 1]; t[0] = 3; torch.tensor([1, 2]); t.to('cpu')",
        _device_cache.__file__,
        "exec",
    )
    with host_reads:
        exec(probe, {"t": t, "torch": torch})
    assert host_reads.counts == {"read": 3, "data-dependent": 1, "element-write": 1, "from-python": 1}


def test_device_cache_step_makes_one_host_read_per_prefetch(host_reads: _HostReads) -> None:
    """CPU guard of the CUDA sync budget: a prefetch with misses, DRAM-tier hits and evictions (the CUDA sync
    test's scenario, VBE) makes exactly one host read from the device-cache step, the slot counts (bad
    ``offsets`` ride on it: no copy of them), and nothing else that would sync on CUDA; forward and backward
    after it make none. On CUDA the prefetch adds one wait for its victims (not visible here)."""
    gen = torch.Generator().manual_seed(3)
    module = make_module("cpu", on_device=True, cache_rows=3, host_cache_rows=40)
    sizes = [[8, 8], [8, 8], [8, 8]]
    offsets = torch.arange(0, 2 * 48 + 1, 2, dtype=torch.int64)
    batches = [torch.randint(0, 60, (96,), generator=gen) for _ in range(6)]
    module.prefetch(batches[0], offsets, sizes)
    module(batches[0], offsets, None, sizes).sum().backward()
    for indices in batches[1:]:
        before = module.metrics()
        with host_reads:
            module.prefetch(indices, offsets, sizes)
        assert host_reads.counts == {"read": 1}
        host_reads.counts.clear()
        with host_reads:
            out = module(indices, offsets, None, sizes)
            out.sum().backward()
        assert host_reads.counts == {}
        after = module.metrics()
        assert after["hbm_inserted_rows"] > before["hbm_inserted_rows"]
        assert after["hbm_evicted_rows"] > before["hbm_evicted_rows"]
    assert module.metrics()["host_tier_hits"] > 0
    assert module.metrics()["forwards_without_prefetch"] == 0
    module.close()


def test_full_dram_tier_reads_at_most_twice_and_writes_the_store(host_reads: _HostReads) -> None:
    """A DRAM tier that is full (the rows a run touches do not fit): a prefetch reads at most twice from the
    device-cache step (its counts, and the victims when room is made), the least recently kept rows go to the
    store, and forward and backward read nothing."""
    gen = torch.Generator().manual_seed(5)
    module = make_module("cpu", on_device=True, cache_rows=3, host_cache_rows=60)
    offsets = torch.arange(0, 2 * 3 * 8 + 1, 2, dtype=torch.int64)
    batches = [torch.randint(0, 400, (48,), generator=gen) for _ in range(12)]
    module(batches[0], offsets).sum().backward()  # the layout's per-bag tables are built once
    reads = []
    for indices in batches[1:]:
        with host_reads:
            module.prefetch(indices, offsets)
        reads.append(host_reads.counts.get("read", 0))
        assert set(host_reads.counts) <= {"read"}
        host_reads.counts.clear()
        with host_reads:
            module(indices, offsets).sum().backward()
        assert host_reads.counts == {}
    metrics = module.metrics()
    assert max(reads) <= 2, reads
    assert metrics["host_tier_evicted_rows"] > 0
    assert metrics["host_tier_written_rows"] > 0
    assert metrics["host_tier_hits"] > 0
    module.close()


def test_dram_tier_flush_writes_its_dirty_rows_once() -> None:
    """flush() writes the DRAM tier's dirty rows (and the device cache's) to the store; a second flush writes
    nothing: they stay cached, clean."""
    store = MemoryStore()
    module = make_module("cpu", on_device=True, cache_rows=2, host_cache_rows=30, store=store)
    offsets = torch.arange(0, 3 * 4 + 1, dtype=torch.int64) * 2
    for seed in range(4):
        indices = torch.randint(0, 20, (24,), generator=torch.Generator().manual_seed(seed))
        module(indices, offsets).sum().backward()
    module.flush()
    written = module.metrics()["store_tier_written_rows"]
    assert written > 0
    assert module.metrics()["host_tier_cached_rows"] > 0
    module.flush()
    assert module.metrics()["store_tier_written_rows"] == written
    module.close()


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([1, 2, 4], r"must start at 0 and end at len\(indices\)=4, got 1 \.\. 4"),
        ([0, 2, 3], r"must start at 0 and end at len\(indices\)=4, got 0 \.\. 3"),
        ([0, 3, 2, 4], "must be non-decreasing"),
    ],
    ids=["start", "end", "decreasing"],
)
@pytest.mark.parametrize("call", ["prefetch", "forward"], ids=["prefetch", "forward"])
def test_bad_offsets_raise_before_anything_moves(offsets: list[int], message: str, call: str) -> None:
    """Offsets checked on the device (read with the slot counts) raise InvalidArgumentError at the prefetch or
    the unprefetched forward, with nothing queued, cached or counted; the module works on after."""
    module = make_module("cpu", on_device=True, cache_rows=3)
    indices = torch.tensor([1, 2, 3, 2])
    bags = len(offsets) - 1
    sizes = [[1], [1], [bags - 2]]  # VBE: any bag count
    bad = torch.tensor(offsets)
    if call == "prefetch":
        with pytest.raises(InvalidArgumentError, match=message):
            module.prefetch(indices, bad, sizes)
    else:
        with pytest.raises(InvalidArgumentError, match=message):
            module(indices, bad, None, sizes)
    m = module.metrics()
    assert m["hbm_cached_rows"] == 0
    assert m["hbm_lookups"] == 0
    assert m["prefetches"] == 0
    good = torch.tensor([0, 1, 3, 4][: bags + 1] if bags == 3 else [0, 2, 4])
    module.prefetch(indices, good, sizes)
    out = module(indices, good, None, sizes)
    out.sum().backward()
    assert module.metrics()["hbm_lookups"] == 4  # (a, 1), (a, 2), (b, 2), (b, 3)
    module.close()


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUTS)
@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["sync", "ahead1", "ahead2"])
@pytest.mark.parametrize("tiers", [t for _, t in TIERS], ids=[n for n, _ in TIERS])
def test_cuda_device_cache_matches_host_path_and_reference(
    tiers: dict[str, object], ahead: int, layout: str
) -> None:
    """On CUDA (prefetch on a side stream): the CPU host-cache path's and the reference's outputs, psw
    gradients and rows."""
    check_against_both("cuda", tiers, ahead=ahead, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [1, 2], ids=["ahead1", "ahead2"])
@pytest.mark.parametrize("tiers", [t for _, t in TIERS], ids=[n for n, _ in TIERS])
def test_cuda_prefetch_after_backward_matches_reference(tiers: dict[str, object], ahead: int) -> None:
    """On CUDA, each prefetch issued on a side stream right after its step's backward was queued (no wait for
    it by the caller: the prefetch's victims may be rows that backward still updates) gives the reference's
    outputs, psw gradients and rows: the module waits for the backward before it moves rows."""
    check_against_both("cuda", tiers, ahead=ahead, layout="vbe", pipelined=True, steps=16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("optimizer", "pooling", "fp16"),
    [("sgd", "mean", True), ("rowwise_adagrad", "sum", True), ("rowwise_adagrad", "mean", False)],
    ids=["sgd-mean-fp16", "adagrad-sum-fp16", "adagrad-mean"],
)
def test_cuda_device_cache_optimizers_pooling_precision(optimizer: str, pooling: str, fp16: bool) -> None:
    """SGD, mean pooling and fp16 rows on CUDA match the reference (both tiers, prefetch two ahead)."""
    check_against_both(
        "cuda",
        {"cache_rows": 2, "host_cache_rows": 6},
        ahead=2,
        layout="vbe_output",
        optimizer=optimizer,
        pooling=pooling,
        fp16=fp16,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["plain", "vbe"], ids=["plain", "vbe"])
@pytest.mark.parametrize("ahead", [0, 1, 2], ids=["sync", "ahead1", "ahead2"])
@pytest.mark.parametrize("tiers", [t for _, t in TIERS], ids=[n for n, _ in TIERS])
def test_cuda_graph_replays_match_reference(tiers: dict[str, object], ahead: int, layout: str) -> None:
    """Each step's forward and backward captured in a CUDA graph (nothing runs at capture) and replayed
    inside ``replaying`` (prefetches on a side stream) give the reference's outputs, psw gradients and rows."""
    check_against_both("cuda", tiers, ahead=ahead, layout=layout, replay="graph")


@pytest.mark.gpu
@pytest.mark.parametrize("replay", ["", "graph"], ids=["eager", "graph"])
@pytest.mark.parametrize("ahead", [1, 2], ids=["ahead1", "ahead2"])
@pytest.mark.parametrize("tiers", [t for _, t in TIERS], ids=[n for n, _ in TIERS])
def test_cuda_prefetch_completed_later_matches_reference(
    tiers: dict[str, object], ahead: int, replay: str
) -> None:
    """On CUDA, prefetches issued on a side stream with ``complete=False`` (survey only, then the graph
    replay of the current batch issued, then ``complete_prefetch()``: the trainer's order) give the
    reference's outputs, psw gradients and rows."""
    check_against_both("cuda", tiers, ahead=ahead, layout="vbe", replay=replay, deferred=True)


@pytest.mark.gpu
def test_cuda_chained_forward_reads_its_offsets_once() -> None:
    """A forward into ``vbe_output`` reads the host copy of ``vbe_output_offsets`` once per tensor: later
    forwards of the same layout, after a prefetch, run without a host sync."""
    module = make_module("cuda", on_device=True, cache_rows=4, host_cache_rows=8)
    sizes = [[2, 2] for _ in FTM]
    dims = [TABLES[t].dim for t in FTM]
    starts = torch.tensor([[0, 16, 26], [42, 58, 68]], dtype=torch.int64).cuda()
    bags = sum(map(sum, sizes))
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        lengths = torch.randint(0, 3, (bags,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
        indices = ID_POOL[torch.randint(0, ID_POOL.numel(), (int(lengths.sum()),), generator=gen)].cuda()
        module.prefetch(indices, offsets, sizes)
        buffer = torch.zeros(84, device="cuda")
        torch.cuda.synchronize()
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = module(indices, offsets, None, sizes, buffer, starts)
            out.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert sum(d * 4 for d in dims) == 84
    module.close()


@pytest.mark.gpu
def test_cuda_prefetched_step_has_no_host_sync() -> None:
    """After a prefetch, forward and backward on CUDA run without one device -> host sync (torch's sync debug
    mode raises on any)."""
    batches = make_batches(3, vbe=True)
    module = make_module("cuda", on_device=True, cache_rows=4, host_cache_rows=8)
    assert module.metrics()["hbm_slots"] >= 0
    on = [(b.indices.cuda(), b.offsets.cuda(), b.psw.cuda(), b.sizes) for b in batches]
    for indices, offsets, psw, sizes in on:
        module.prefetch(indices, offsets, sizes)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = module(indices, offsets, psw, sizes)
            out.sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert module.metrics()["forwards_without_prefetch"] == 0
    module.close()


def _cuda_prefetch_syncs(
    module: KeyValueEmbeddingBags, seed: int
) -> list[tuple[int, dict[str, float], dict[str, float]]]:
    """Seven prefetch + forward + backward steps on CUDA (after two that make the survey's graph for this batch
    size), ids from a range of 60 per table: per prefetch, its host syncs (sync debug mode) and the metrics
    before and after its step."""
    gen = torch.Generator().manual_seed(seed)
    bags = 16 * len(FTM)
    offsets = torch.arange(0, 2 * bags + 1, 2, dtype=torch.int64).cuda()
    batches = [torch.randint(0, 60, (2 * bags,), generator=gen).cuda() for _ in range(9)]
    for indices in batches[:2]:  # the survey of this batch size runs eagerly once, then is captured
        module.prefetch(indices, offsets)
        module(indices, offsets).sum().backward()
    steps = []
    for indices in batches[2:]:
        torch.cuda.synchronize()
        before = module.metrics()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module.prefetch(indices, offsets)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        module(indices, offsets).sum().backward()
        syncs = sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
        steps.append((syncs, before, module.metrics()))
    return steps


@pytest.mark.gpu
def test_cuda_prefetch_with_misses_syncs_at_most_twice() -> None:
    """A prefetch that moves rows both ways (misses read from the DRAM tier and the store, victims handed down)
    syncs with the host at most twice: the assignment's counts (the `offsets` checks and the missing keys ride on
    them) and, when the DRAM tier must make room, the wait for its victims (before: ~16, then 4-5 from element
    writes and the plan's `offsets` copy)."""
    module = make_module("cuda", on_device=True, cache_rows=3, host_cache_rows=40)
    steps = _cuda_prefetch_syncs(module, seed=3)
    for _, before, after in steps:
        assert after["hbm_inserted_rows"] > before["hbm_inserted_rows"]
        assert after["hbm_evicted_rows"] > before["hbm_evicted_rows"]
    assert module.metrics()["host_tier_hits"] > 0
    assert max(syncs for syncs, _, _ in steps) <= 2, steps
    module.close()


@pytest.mark.gpu
def test_cuda_hash_kernel_is_bit_equal_to_the_torch_hash() -> None:
    """The Triton hash of (table, id) pairs gives the torch splitmix64 hash's bits (negative and huge ids too)."""
    from ssd_tbe_adapter._hash_kernel import hash_pairs
    from ssd_tbe_adapter._init import _mix

    gen = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(-(1 << 62), 1 << 62, (5000,), generator=gen), torch.arange(-3, 3)])
    tables = torch.randint(0, 30, ids.shape, generator=gen)
    want = _mix(_mix(tables) ^ ids)
    assert torch.equal(hash_pairs(tables.cuda(), ids.cuda()).cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [1, 7, 1025, 40000])
def test_cuda_find_kernel_gives_the_torch_lookup(slots: int) -> None:
    """The Triton find (hash, binary search, slot check in one launch) gives the torch SlotIndex lookup's slots:
    valid and freed slots, absent keys, huge and negative ids, every index size's search depth."""
    from ssd_tbe_adapter._find_kernel import find_pairs
    from ssd_tbe_adapter._slot_index import SlotIndex

    gen = torch.Generator().manual_seed(slots)
    valid = torch.rand(slots + 1, generator=gen) < 0.7
    valid[slots - 1] = True
    valid[-1] = False
    tables = torch.randint(0, 4, (slots + 1,), generator=gen)
    ids = torch.randperm(10 * slots + 10, generator=gen)[: slots + 1] - 3 * slots
    ids[: min(3, slots)] += 1 << 61
    index = SlotIndex(valid, tables, ids)
    valid[: slots // 3] = False  # freed since the index was built: never found
    probe_tables = torch.cat([tables, torch.randint(0, 4, (333,), generator=gen)])
    probe_ids = torch.cat([ids, torch.randint(-3 * slots, 7 * slots + 10, (333,), generator=gen)])
    want = index.find(probe_tables, probe_ids, valid, tables, ids)
    assert int((want >= 0).sum()) > 0
    got = find_pairs(
        probe_tables.cuda(),
        probe_ids.cuda(),
        index.sorted_keys.cuda(),
        index.sorted_slots.cuda(),
        valid.cuda(),
        tables.cuda(),
        ids.cuda(),
    )
    assert torch.equal(got.cpu(), want)


def fused_update_case(device: str, optimizer: str, psw: bool, fp16: bool, seed: int) -> None:
    """The fused backward kernel on ``device`` against the torch backward (gather of the bag gradients,
    ``index_add_`` into the unique rows, :meth:`DeviceCache.update`) on the CPU: a padded batch with repeats
    and hot rows, rows of several dims, the trash slot among the unique slots."""
    from ssd_tbe_adapter._update_kernel import fused_update

    gen = torch.Generator().manual_seed(seed)
    dims, dmax, slots = [8, 5, 8], 8, 64
    n = int(torch.randint(1, 300, (1,), generator=gen))
    padded = n + int(torch.randint(0, 40, (1,), generator=gen))
    tables = torch.randint(0, 3, (n,), generator=gen)
    ids = torch.where(torch.rand(n, generator=gen) < 0.5, 7, torch.randint(0, 20, (n,), generator=gen))
    pad_tables = torch.cat([tables, tables[:1].expand(padded - n)])
    pad_ids = torch.cat([ids, ids[:1].expand(padded - n)])
    _, _, _, inverse, unique, order, pairs = _unique_pairs(pad_tables, pad_ids)
    u = int(unique)
    unique_slots = torch.randperm(slots, generator=gen)[:u]
    unique_slots[u // 2] = slots if u > 1 else unique_slots[u // 2]  # the trash slot: skipped
    pair_tables = torch.zeros(u, dtype=torch.int64).index_copy_(0, inverse[:n], tables)
    slot_tables = torch.zeros(slots + 1, dtype=torch.int64).index_copy_(0, unique_slots, pair_tables)
    bags = max(n // 3, 1)
    bag_of_lookup = torch.sort(torch.randint(0, bags, (n,), generator=gen)).values
    grad_bags = torch.randn(bags, dmax, generator=gen)
    weights = torch.randn(slots + 1, dmax, generator=gen)
    if fp16:
        weights = weights.half().float()
    state = torch.rand(slots + 1, generator=gen)
    weights_psw = torch.rand(n, generator=gen) if psw else None
    opt = RowOptimizer(kind=optimizer, learning_rate=0.05, eps=1e-8)  # type: ignore[arg-type]
    dims_t = torch.tensor(dims, dtype=torch.float32)
    # The torch backward on the CPU.
    lower = HostTier(16, dims, _NullTier(), pin=False)
    ref = DeviceCache([32, 16, 16], dims, torch.device("cpu"), lower, round_fp16=fp16)
    ref.weights.copy_(weights)
    ref.state.copy_(state)
    ref.slot_tables.copy_(slot_tables)
    grad_lookups = grad_bags.index_select(0, bag_of_lookup)
    if weights_psw is not None:
        grad_lookups = grad_lookups * weights_psw[:, None]
    grad_rows = torch.zeros(u, dmax).index_add_(0, inverse[:n], grad_lookups)
    grad_rows[unique_slots == slots] = 0.0  # the trash row is left as it was
    ref.update(unique_slots, grad_rows, opt)
    # The fused kernel.
    on = torch.device(device)
    got_w, got_s = weights.to(on), state.to(on)
    got_d = torch.zeros(slots + 1, dtype=torch.bool, device=on)
    fused_update(
        grad_bags.to(on),
        bag_of_lookup.to(on),
        None if weights_psw is None else weights_psw.to(on),
        order.to(on),
        pairs.to(on),
        unique_slots.to(on),
        slot_tables.to(on),
        dims_t.to(on),
        got_w,
        got_s,
        got_d,
        lookups=n,
        trash=slots,
        learning_rate=opt.learning_rate,
        eps=opt.eps,
        adagrad=optimizer != "sgd",
        round_fp16=fp16,
    )
    torch.testing.assert_close(got_w.cpu(), ref.weights, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_s.cpu(), ref.state, atol=1e-5, rtol=1e-5)
    want_dirty = torch.zeros(slots + 1, dtype=torch.bool).index_fill_(0, unique_slots, True)
    want_dirty[slots] = False
    assert torch.equal(got_d.cpu(), want_dirty)


def hash_index_case(device: str, seed: int) -> None:
    """HashSlotIndex on ``device`` against the sorted SlotIndex rebuilt from scratch on the CPU, over rounds of
    refills (repeats of the trash slot, keys that come back in other slots, huge and negative ids), frees and
    crowded rebuilds: the same slot for every lookup, present or absent."""
    from ssd_tbe_adapter._hash_index import HashSlotIndex
    from ssd_tbe_adapter._slot_index import SlotIndex

    gen = torch.Generator().manual_seed(seed)
    slots = 200
    trash = slots
    on = torch.device(device)
    valid = torch.zeros(slots + 1, dtype=torch.bool)
    tables = torch.zeros(slots + 1, dtype=torch.int64)
    ids = torch.zeros(slots + 1, dtype=torch.int64)
    index = HashSlotIndex(valid.to(on), tables.to(on), ids.to(on))
    universe = torch.cat([torch.arange(-40, 260), torch.tensor([1 << 62, -(1 << 62), (1 << 63) - 1])])
    for step in range(30):
        m = int(torch.randint(0, 50, (1,), generator=gen))
        picked = torch.randperm(slots, generator=gen)[:m]  # distinct, as the tiers' refills
        # Keys not held by another valid slot (a row lives in one slot), some of them back from earlier.
        held = set(zip(tables[valid].tolist(), ids[valid].tolist(), strict=True))
        fresh = [
            (t, i)
            for t, i in zip(
                torch.randint(0, 3, (4 * m + 4,), generator=gen).tolist(),
                universe[torch.randint(0, universe.numel(), (4 * m + 4,), generator=gen)].tolist(),
                strict=True,
            )
            if (t, i) not in held
        ]
        fresh = list(dict.fromkeys(fresh))[:m]
        picked = picked[: len(fresh)]
        new_tables = torch.tensor([t for t, _ in fresh], dtype=torch.int64)
        new_ids = torch.tensor([i for _, i in fresh], dtype=torch.int64)
        tables.index_copy_(0, picked, new_tables)
        ids.index_copy_(0, picked, new_ids)
        valid.index_fill_(0, picked, True)
        padded = torch.cat([picked, torch.full((3,), trash)])
        index.set_keys(
            padded.to(on), tables.index_select(0, padded).to(on), ids.index_select(0, padded).to(on)
        )
        index.merge(valid.to(on), padded.to(on))
        freed = torch.randint(0, slots, (int(torch.randint(0, 15, (1,), generator=gen)),), generator=gen)
        valid.index_fill_(0, freed, False)
        if step % 7 == 6:
            index.rebuild_if_crowded(int(index.entries), valid.to(on))
        full = SlotIndex(valid, tables, ids)
        probe_tables = torch.cat([tables, torch.randint(0, 3, (60,), generator=gen)])
        probe_ids = torch.cat([ids, universe[torch.randint(0, universe.numel(), (60,), generator=gen)]])
        got = index.find(probe_tables.to(on), probe_ids.to(on), valid.to(on), tables.to(on), ids.to(on))
        assert torch.equal(got.cpu(), full.find(probe_tables, probe_ids, valid, tables, ids))
    assert int(index.entries) <= index.cells.numel() * 3 // 4


@pytest.mark.gpu
def test_cuda_hash_index_gives_the_sorted_index_lookups() -> None:
    """The device hash table (CUDA's index) finds what the sorted index finds, over refills, frees, rebuilds."""
    for seed in range(6):
        hash_index_case("cuda", seed)


def victims_case(device: str, seed: int) -> None:
    """``choose_victims`` on ``device`` against its torch version on the CPU over random slot states (free,
    protected, held, every table size including 0 and 1, more misses than slots), both advancing the hands
    alike; and what any choice must be: distinct slots of the miss's own table, never protected or held."""
    from ssd_tbe_adapter._victims import VictimTables, choose_victims

    gen = torch.Generator().manual_seed(seed)
    capacities = [int(c) for c in torch.randint(0, 40, (5,), generator=gen)] + [1, 0]
    slots = sum(capacities) + 3  # a small scratch pool after the regions
    n = int(torch.randint(1, 120, (1,), generator=gen))
    tables = torch.sort(torch.randint(0, len(capacities), (n,), generator=gen)).values
    miss = torch.rand(n, generator=gen) < 0.6
    stamp = torch.randint(0, 10, (slots + 1,), generator=gen)
    uses = torch.randint(0, 4, (slots + 1,), generator=gen)
    valid = torch.rand(slots + 1, generator=gen) < 0.8
    valid[slots] = False
    held = torch.rand(slots + 1, generator=gen) < 0.1
    protect = torch.tensor(7)
    on = torch.device(device)
    mine, theirs = VictimTables(capacities, on), VictimTables(capacities, torch.device("cpu"))
    for _ in range(3):
        got = choose_victims(
            mine,
            tables.to(on),
            miss.to(on),
            protect.to(on),
            stamp.to(on),
            uses.to(on),
            valid.to(on),
            held.to(on),
            slots,
        ).cpu()
        want = choose_victims(theirs, tables, miss, protect, stamp, uses, valid, held, slots)
        assert torch.equal(got, want)
        assert torch.equal(mine.hands.cpu(), theirs.hands)
        picked = want[want >= 0]
        assert torch.unique(picked).numel() == picked.numel()
        assert bool((miss | (want < 0)).all())
        bases = theirs.bases.index_select(0, tables)
        ends = bases + theirs.capacities.index_select(0, tables)
        assert bool(((want < 0) | ((want >= bases) & (want < ends))).all())
        assert bool((stamp[picked] < protect).all())
        assert not bool(held[picked].any())
        # Exact by count: each table's misses get min(misses, choosable slots) of its region's slots.
        choosable = (stamp < protect) & ~held
        for t, (base, size) in enumerate(zip(theirs.bases.tolist(), capacities, strict=True)):
            mine_t = miss & (tables == t)
            free_t = int(choosable[base : base + size].sum())
            assert int((want[mine_t] >= 0).sum()) == min(int(mine_t.sum()), free_t)
        stamp = torch.where(torch.rand(slots + 1, generator=gen) < 0.3, 9, stamp)  # more protected next call


@pytest.mark.parametrize("seed", range(6), ids=[f"seed{i}" for i in range(6)])
def test_victim_choice_takes_the_best_unprotected_slot_of_each_group(seed: int) -> None:
    """The sampled victim choice (torch version): distinct slots in the miss's own region, never protected or
    held, the hands moved alike on every call."""
    victims_case("cpu", seed)


@pytest.mark.gpu
def test_cuda_victim_kernel_gives_the_torch_choice() -> None:
    """The one-launch Triton victim choice gives the torch version's slots and hands."""
    for seed in range(8):
        victims_case("cuda", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("psw", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_cuda_fused_update_matches_the_torch_backward(optimizer: str, psw: bool, fp16: bool) -> None:
    """The two-launch backward (segmented sums over the sorted lookups, then the optimizer) gives the torch one."""
    for seed in range(6):
        fused_update_case("cuda", optimizer, psw, fp16, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("psw", [False, True], ids=["plain", "weighted"])
def test_cuda_pooled_forward_kernel_matches_embedding_bag(psw: bool) -> None:
    """The one-launch Triton pooling gives ``embedding_bag``'s sums: empty, one-lookup and long bags, repeated
    and hot slots, an output narrower than the rows and with a row stride of its own (a view of a wider
    buffer), per-sample weights; nothing outside the output view is written."""
    from ssd_tbe_adapter._pool_kernel import pool_sum

    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        slots, dmax, width = 97, 8 + 4 * (seed % 3), 5 + seed
        width = min(width, dmax)
        bags = int(torch.randint(1, 400, (1,), generator=gen))
        lengths = torch.randint(0, 7, (bags,), generator=gen) * (torch.rand(bags, generator=gen) < 0.8)
        offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
        n = int(offsets[-1])
        picked = torch.where(
            torch.rand(n, generator=gen) < 0.3, 3, torch.randint(0, slots, (n,), generator=gen)
        )
        weights = torch.randn(slots, dmax, generator=gen)
        per_sample = torch.rand(n, generator=gen) if psw else None
        want = torch.nn.functional.embedding_bag(
            picked, weights, offsets, mode="sum", per_sample_weights=per_sample, include_last_offset=True
        )[:, :width]
        wide = torch.full((bags, width + 3), 7.0, device="cuda")
        out = wide[:, 1 : 1 + width]
        pool_sum(
            weights.cuda(),
            picked.cuda(),
            offsets.cuda(),
            None if per_sample is None else per_sample.cuda(),
            out,
        )
        torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
        assert (wide[:, 0] == 7.0).all()
        assert (wide[:, 1 + width :] == 7.0).all()


def hit_runs_case(device: str, seed: int) -> None:
    """:func:`hit_runs` against the torch survey's ``_unique_slots`` on ``device``: every packed field, the
    counts (the padding's repeats taken off), the runs, the miss flag, and the stamps and uses (changed only
    when nothing missed, and then only at the batch's slots)."""
    from ssd_tbe_adapter._survey_kernel import hit_runs

    gen = torch.Generator().manual_seed(seed)
    trash = 50 + 37 * seed
    n = int(torch.randint(1, 3000, (1,), generator=gen))
    hot = torch.randint(0, trash, (n,), generator=gen) % 7  # hot slots: long runs
    found = torch.where(torch.rand(n, generator=gen) < 0.5, hot, torch.randint(0, trash, (n,), generator=gen))
    if seed % 2:
        found[torch.rand(n, generator=gen) < 0.05] = -1  # misses: the trash slot
    padding = int(torch.randint(0, n, (1,), generator=gen))
    found[n - padding :] = found[0]  # the padding repeats the first lookup
    tick = 1000 + seed
    scalars = torch.tensor([5, -padding, 3, 9, tick])
    stamp = torch.randint(0, 999, (trash + 1,), generator=gen)
    uses = torch.randint(0, 50, (trash + 1,), generator=gen)

    slots, counts, inverse, unique, order, pairs = _unique_slots(torch.where(found >= 0, found, trash))
    counts.index_add_(0, inverse[:1], scalars[1:2])
    touched = torch.where(torch.arange(n) < unique, slots, trash)
    missed = bool(slots[-1] == trash)
    want_stamp, want_uses = stamp.clone(), uses.clone()
    if not missed:
        u = int(unique)
        want_stamp[touched[:u]] = tick
        want_uses[touched[:u]] += counts[:u]
    want_packed = torch.cat([touched, slots.index_select(0, inverse), inverse, order, pairs])

    stamp_here, uses_here = stamp.to(device), uses.to(device)
    runs = hit_runs(found.to(device), trash, scalars.to(device), 1, 4, stamp_here, uses_here)
    assert torch.equal(runs.packed.cpu(), want_packed)
    assert torch.equal(runs.counts.cpu(), counts)
    assert torch.equal(runs.unique_slots.cpu(), slots)
    assert torch.equal(runs.touched.cpu(), touched)
    assert int(runs.unique) == int(unique)
    assert int(runs.misses) == int(missed)
    assert torch.equal(stamp_here.cpu(), want_stamp)
    assert torch.equal(uses_here.cpu(), want_uses)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_cuda_hit_survey_kernels_match_the_torch_survey(seed: int) -> None:
    """The hits-only survey's Triton kernels give the torch version's fields, counts, stamps and uses."""
    hit_runs_case("cuda", seed)


def expand_case(device: str, seed: int) -> None:
    """:func:`expand_lookups` against the torch expansion (``_expand_lookups`` on the CPU) on ``device``: the
    tables, ids and checks of every lookup, the bags of the batch's lookups; empty bags, a batch filling only
    part of its buffers, offsets that decrease (a check, and every bag still in bounds)."""
    from ssd_tbe_adapter._device_path import _expand_lookups, _LookupBuffers
    from ssd_tbe_adapter._expand_kernel import expand_lookups

    gen = torch.Generator().manual_seed(seed)
    bags = int(torch.randint(1, 600, (1,), generator=gen))
    lengths = torch.randint(0, 5, (bags,), generator=gen) * (torch.rand(bags, generator=gen) < 0.8)
    lengths[0] = max(int(lengths[0]), 1)
    offsets = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))
    n = int(offsets[-1])
    if seed % 3 == 2:  # offsets that decrease somewhere
        at = int(torch.randint(1, bags + 1, (1,), generator=gen))
        offsets[at] = offsets[at - 1] - 1
    size, bag_size = n + int(torch.randint(0, 300, (1,), generator=gen)), bags + 7
    buffers = _LookupBuffers(
        ids=torch.randint(0, 10**6, (size,), generator=gen),
        offsets=torch.cat([offsets, torch.randint(0, n + 1, (bag_size - bags,), generator=gen)]),
        tables=torch.randint(0, 9, (bag_size,), generator=gen),
    )
    scalars = torch.tensor([[3, -1, n, bags, 77]])
    want_tables, want_ids, want_checks, want_bags = _expand_lookups(buffers, scalars)
    tables, ids, checks, bags_out = expand_lookups(
        buffers.ids.to(device),
        buffers.offsets.to(device),
        buffers.tables.to(device),
        scalars.view(-1).to(device),
        2,
        3,
    )
    assert torch.equal(checks.cpu(), want_checks)
    assert int(bags_out.min()) >= 0
    assert int(bags_out.max()) < bags
    if not int(want_checks[2]):  # offsets that never decrease: the same bags, tables and ids
        assert torch.equal(bags_out[:n].cpu(), want_bags[:n])
        assert torch.equal(tables.cpu(), want_tables)
        assert torch.equal(ids.cpu(), want_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
def test_cuda_survey_expansion_kernel_matches_the_torch_expansion(seed: int) -> None:
    """The survey's one-launch lookup expansion gives the torch version's tables, ids, bags and checks."""
    expand_case("cuda", seed)


@pytest.mark.gpu
def test_cuda_row_moves_match_torch_on_pinned_rows() -> None:
    """The Triton kernels that move rows between the device and pinned host memory give torch's index ops:
    a gather into a strided view that skips ``-1`` rows, a scatter where several rows hit the trash row."""
    from ssd_tbe_adapter._row_moves import gather_rows, scatter_rows

    gen = torch.Generator().manual_seed(0)
    host = torch.randn(50, 7, generator=gen).pin_memory()
    index = torch.tensor([3, -1, 49, 0, 3, -1, 17])
    out = torch.full((7, 9), 5.0, device="cuda")
    gather_rows(host, index.cuda(), out[:, :7])
    want = torch.full((7, 9), 5.0)
    want[:, :7] = torch.where((index >= 0)[:, None], host.index_select(0, index.clamp(min=0)), want[:, :7])
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
    rows = torch.randn(5, 9, generator=gen)
    target = torch.zeros(51, 9).pin_memory()
    at = torch.tensor([4, 50, 10, 50, 0])
    scatter_rows(rows.cuda(), at.cuda(), target)
    torch.cuda.synchronize()
    for i in (0, 2, 4):
        assert torch.equal(target[at[i]], rows[i])
    assert int((target[:50].abs().sum(1) > 0).sum()) == 3


@pytest.mark.gpu
def test_cuda_prefetch_over_a_dram_tier_with_room_syncs_once() -> None:
    """While the DRAM tier has room, a prefetch that moves rows both ways (misses found there or read from
    the store, victims kept there) syncs with the host once: its counts."""
    module = make_module("cuda", on_device=True, cache_rows=3, host_cache_rows=400)
    steps = _cuda_prefetch_syncs(module, seed=4)
    metrics = module.metrics()
    assert metrics["host_tier_hits"] > 0
    assert metrics["hbm_evicted_rows"] > 0
    assert metrics["hbm_survey_graph_replays"] >= len(steps)
    assert max(syncs for syncs, _, _ in steps) == 1, steps
    module.close()


@pytest.mark.gpu
def test_cuda_steady_moves_replay_and_match_the_reference() -> None:
    """On CUDA, assignments whose misses all come from the DRAM tier run as graph replays (survey and move) and
    the results stay the reference's and the host path's."""
    module = check_against_both(
        "cuda", {"cache_rows": 2, "host_cache_rows": 64}, ahead=0, layout="vbe", steps=24
    )
    metrics = module.metrics()
    assert metrics["hbm_steady_assigns"] >= 2, metrics["hbm_steady_assigns"]
    assert metrics["hbm_survey_graph_replays"] > 0
    assert metrics["hbm_move_graph_replays"] + metrics["hbm_steady_assigns"] >= 3


@pytest.mark.gpu
@pytest.mark.parametrize("replay", ["", "graph"], ids=["eager", "graph"])
@pytest.mark.parametrize(
    ("tiers", "ahead"),
    [
        ({"cache_rows": 64}, 2),
        ({"cache_rows": 10, "host_cache_rows": 64}, 1),
        ({"cache_rows": 10, "host_cache_rows": 64}, 2),
    ],
    ids=["hbm64-ahead2", "hbm10+dram64-ahead1", "hbm10+dram64-ahead2"],
)
def test_cuda_hits_only_surveys_match_the_reference(
    tiers: dict[str, object], ahead: int, replay: str
) -> None:
    """On CUDA, in the trainer's order (survey issued, the current batch replayed, then completed), hits-only
    surveys (graphed) and the full surveys after those that found a miss give the reference's results."""
    module = check_against_both(
        "cuda", tiers, ahead=ahead, layout="vbe", steps=24, replay=replay, deferred=True
    )
    metrics = module.metrics()
    assert metrics["hbm_hit_surveys"] >= metrics["hbm_resurveys"] >= 1, metrics
    assert metrics["hbm_survey_graph_replays"] > 0


@pytest.mark.gpu
def test_cuda_is_the_default_device_cache() -> None:
    """A module on CUDA manages its cache on the device unless told otherwise."""
    module = make_module("cuda", on_device=None, cache_rows=4)
    assert "hbm_hit_rate" in module.metrics()
    module.close()


@pytest.mark.parametrize("seed", range(6))
def test_slot_index_merge_matches_a_full_rebuild(seed: int) -> None:
    """SlotIndex.merge (new keys merged into the sorted ones) gives the same valid keys in the same order as a
    full sort, and the same lookups, over many rounds of refills (repeats, trash padding) and frees."""
    from ssd_tbe_adapter._slot_index import SlotIndex

    gen = torch.Generator().manual_seed(seed)
    slots = 300
    trash = slots
    valid = torch.zeros(slots + 1, dtype=torch.bool)
    tables = torch.zeros(slots + 1, dtype=torch.int64)
    ids = torch.zeros(slots + 1, dtype=torch.int64)
    merged = SlotIndex(valid, tables, ids)
    fresh = 0
    for _ in range(40):
        m = int(torch.randint(0, 60, (1,), generator=gen))
        picked = torch.randint(0, slots, (m,), generator=gen)
        picked = torch.cat([picked, torch.full((3,), trash)])  # padding repeats the trash slot
        new_tables = torch.randint(0, 3, (picked.numel(),), generator=gen)
        new_ids = torch.arange(picked.numel()) + fresh  # a key lives in one slot at most, as in the tiers
        fresh += picked.numel()
        # A repeated slot keeps whichever write index_copy_ kept; the index must agree with the metadata.
        tables.index_copy_(0, picked, new_tables)
        ids.index_copy_(0, picked, new_ids)
        fill = torch.rand(picked.numel(), generator=gen) < 0.8
        valid.index_copy_(0, picked, fill)
        freed = torch.randint(0, slots, (int(torch.randint(0, 20, (1,), generator=gen)),), generator=gen)
        valid.index_fill_(0, freed, False)
        valid[trash] = False
        merged.set_keys(picked, tables.index_select(0, picked), ids.index_select(0, picked))
        merged.merge(valid, picked)
        full = SlotIndex(valid, tables, ids)
        count = int(valid.sum())
        assert torch.equal(merged.sorted_keys[:count], full.sorted_keys[:count])
        assert torch.equal(merged.sorted_slots[:count], full.sorted_slots[:count])
        assert bool((merged.sorted_keys[count:] == (1 << 63) - 1).all())
        probe_tables = torch.cat([tables, torch.randint(0, 3, (50,), generator=gen)])
        probe_ids = torch.cat([ids, torch.randint(0, fresh + 1, (50,), generator=gen)])
        assert torch.equal(
            merged.find(probe_tables, probe_ids, valid, tables, ids),
            full.find(probe_tables, probe_ids, valid, tables, ids),
        )
