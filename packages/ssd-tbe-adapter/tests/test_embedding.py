"""KeyValueEmbeddingBags against an all-in-memory pure-PyTorch reference written here, over several steps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd_tbe_adapter import (
    KeyValueEmbeddingBags,
    MemoryStore,
    RowsNotRestoredWarning,
    SchemaMismatchError,
    TableChunk,
    TableSpec,
)
from ssd_tbe_adapter._init import init_rows, table_salt

# ---------------------------------------------------------------------------- reference


class Reference:
    """Dense in-memory tables over a known id universe: autograd for the gradients, the optimizer by hand."""

    def __init__(
        self,
        tables: Sequence[TableSpec],
        feature_table_map: Sequence[int],
        universe: dict[int, list[int]],
        *,
        optimizer: str,
        learning_rate: float,
        pooling: str,
        fp16: bool = False,
        eps: float = 1e-8,
        seed: int = 0,
        init_range: tuple[float, float] = (-0.01, 0.01),
    ) -> None:
        self.tables = list(tables)
        self.ftm = list(feature_table_map)
        self.optimizer = optimizer
        self.lr = learning_rate
        self.pooling = pooling
        self.fp16 = fp16
        self.eps = eps
        self.row_of: list[dict[int, int]] = []
        self.weights: list[torch.Tensor] = []
        self.state: list[torch.Tensor] = []
        for t, spec in enumerate(tables):
            ids = sorted(set(universe.get(t, [])))
            self.row_of.append({i: r for r, i in enumerate(ids)})
            w = init_rows(
                torch.tensor(ids, dtype=torch.int64), spec.dim, table_salt(seed, spec.name), *init_range
            )
            if fp16:
                w = w.half().float()
            self.weights.append(w)
            self.state.append(torch.zeros(len(ids)))

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        psw: torch.Tensor | None,
        batch_sizes: list[list[int]] | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per feature pooled bags [bags_f, D_f] (autograd leaves: the table weights)."""
        leaves = [w.clone().requires_grad_(True) for w in self.weights]
        num_features = len(self.ftm)
        total_bags = offsets.numel() - 1
        bags = [sum(b) for b in batch_sizes] if batch_sizes else [total_bags // num_features] * num_features
        pooled: list[torch.Tensor] = []
        start = 0
        for f, t in enumerate(self.ftm):
            rows = []
            for b in range(start, start + bags[f]):
                lo, hi = int(offsets[b]), int(offsets[b + 1])
                acc = torch.zeros(self.tables[t].dim)
                for j in range(lo, hi):
                    row = leaves[t][self.row_of[t][int(indices[j])]]
                    acc = acc + (row * psw[j] if psw is not None else row)
                if self.pooling == "mean" and hi > lo:
                    acc = acc / (hi - lo)
                rows.append(acc)
            pooled.append(torch.stack(rows) if rows else torch.zeros(0, self.tables[t].dim))
            start += bags[f]
        return leaves, pooled

    def layout(self, pooled: list[torch.Tensor], batch_sizes: list[list[int]] | None) -> torch.Tensor:
        """fbgemm layout: [B, sum D] without VBE, 1-D rank → feature → sample → dim with VBE."""
        if batch_sizes is None:
            return torch.cat(pooled, dim=1)
        ranks = len(batch_sizes[0])
        parts = []
        for r in range(ranks):
            for f in range(len(self.ftm)):
                first = sum(batch_sizes[f][:r])
                parts.append(pooled[f][first : first + batch_sizes[f][r]].reshape(-1))
        return torch.cat(parts)

    def step(self, leaves: list[torch.Tensor]) -> None:
        for t, leaf in enumerate(leaves):
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            w = self.weights[t]
            if self.optimizer == "sgd":
                w = w - self.lr * g
            else:
                self.state[t] = self.state[t] + g.pow(2).mean(1)
                w = w - (self.lr / (self.state[t].sqrt() + self.eps))[:, None] * g
            self.weights[t] = w.half().float() if self.fp16 else w


def rows_of(module: KeyValueEmbeddingBags) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Every stored row of the module, by table name and id (flushes through checkpoint())."""
    out: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for chunk in module.checkpoint(chunk_rows=7):
        table = out.setdefault(chunk.table, {})
        for i, w, s in zip(chunk.ids.tolist(), chunk.weights, chunk.optimizer_state, strict=True):
            table[i] = (w.float(), s)
    return out


# ---------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    indices: torch.Tensor
    offsets: torch.Tensor
    psw: torch.Tensor | None
    batch_sizes: list[list[int]] | None


def make_batch(
    gen: torch.Generator,
    num_features: int,
    *,
    vbe: bool,
    ranks: int,
    batch: int,
    id_pool: list[int],
    weighted: bool,
    max_len: int = 4,
) -> Batch:
    if vbe:
        batch_sizes = [
            [int(torch.randint(0, batch + 1, (1,), generator=gen)) for _ in range(ranks)]
            for _ in range(num_features)
        ]
        total = sum(map(sum, batch_sizes))
    else:
        batch_sizes = None
        total = batch * num_features
    lengths = torch.randint(0, max_len + 1, (total,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    pool = torch.tensor(id_pool, dtype=torch.int64)
    indices = pool[torch.randint(0, len(id_pool), (int(offsets[-1]),), generator=gen)]
    psw = torch.rand(indices.numel(), generator=gen) + 0.5 if weighted else None
    return Batch(indices, offsets, psw, batch_sizes)


ID_POOL = [0, 1, 2, 3, 7, 11, -5, 2**40 + 3, -(2**62), 99]


def run_case(
    *,
    tables: list[TableSpec],
    ftm: list[int],
    optimizer: str,
    pooling: str,
    cache_rows: int,
    vbe: bool,
    weighted: bool,
    use_vbe_output: bool,
    prefetch: bool,
    fp16: bool,
    steps: int,
    seed: int,
    store: object | None = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    lr = 0.1
    module = KeyValueEmbeddingBags(
        tables,
        ftm,
        store if store is not None else MemoryStore(),  # type: ignore[arg-type]
        cache_rows=cache_rows,
        optimizer=optimizer,  # type: ignore[arg-type]
        learning_rate=lr,
        pooling=pooling,  # type: ignore[arg-type]
        weights_precision="fp16" if fp16 else "fp32",
    )
    batches = [
        make_batch(gen, len(ftm), vbe=vbe, ranks=2, batch=3, id_pool=ID_POOL, weighted=weighted)
        for _ in range(steps)
    ]
    universe = dict.fromkeys(range(len(tables)), ID_POOL)
    ref = Reference(tables, ftm, universe, optimizer=optimizer, learning_rate=lr, pooling=pooling, fp16=fp16)
    tol: dict[str, float] = {"atol": 2e-3, "rtol": 2e-3} if fp16 else {"atol": 1e-5, "rtol": 1e-5}
    if prefetch:
        module.prefetch(batches[0].indices, batches[0].offsets, batches[0].batch_sizes)
    for step, b in enumerate(batches):
        if prefetch and step + 1 < steps:
            # Pipelined: the next batch's rows come in while this batch trains.
            nxt = batches[step + 1]
            module.prefetch(nxt.indices, nxt.offsets, nxt.batch_sizes)
        psw = b.psw.clone().requires_grad_(True) if b.psw is not None else None
        ref_psw = b.psw.clone().requires_grad_(True) if b.psw is not None else None
        leaves, pooled = ref.forward(b.indices, b.offsets, ref_psw, b.batch_sizes)
        expected = ref.layout(pooled, b.batch_sizes)
        probe = torch.randn(expected.shape, generator=gen)
        if use_vbe_output and b.batch_sizes is not None:
            # A larger buffer, blocks at shuffled positions with gaps: the rest must stay untouched.
            sizes = [[b.batch_sizes[f][r] * tables[ftm[f]].dim for f in range(len(ftm))] for r in range(2)]
            order = torch.randperm(2 * len(ftm), generator=gen).tolist()
            starts = [[0] * len(ftm) for _ in range(2)]
            cursor = 5
            for k in order:
                r, f = divmod(k, len(ftm))
                starts[r][f] = cursor
                cursor += sizes[r][f] + 3
            buffer = torch.full((cursor,), 42.0)
            got = module(
                b.indices,
                b.offsets,
                psw,
                b.batch_sizes,
                vbe_output=buffer,
                vbe_output_offsets=torch.tensor(starts, dtype=torch.int64),
            )
            assert got is buffer
            mask = torch.ones(cursor, dtype=torch.bool)
            gathered = []
            for r in range(2):
                for f in range(len(ftm)):
                    mask[starts[r][f] : starts[r][f] + sizes[r][f]] = False
                    gathered.append(got[starts[r][f] : starts[r][f] + sizes[r][f]])
            assert bool((got[mask] == 42.0).all())
            mine = torch.cat(gathered)
        else:
            got = module(b.indices, b.offsets, psw, b.batch_sizes)
            mine = got
        torch.testing.assert_close(mine, expected.detach(), atol=tol["atol"], rtol=tol["rtol"])
        torch.autograd.backward((mine * probe).sum())
        if expected.requires_grad:  # an all-empty VBE batch has nothing to differentiate in the reference
            torch.autograd.backward((expected * probe).sum())
        if psw is not None:
            assert ref_psw is not None
            assert psw.grad is not None
            # The reference leaves no gradient when no lookup reached its output.
            want = ref_psw.grad if ref_psw.grad is not None else torch.zeros_like(ref_psw)
            torch.testing.assert_close(psw.grad, want, atol=tol["atol"], rtol=tol["rtol"])
        ref.step(leaves)
    stored = rows_of(module)
    for t, spec in enumerate(tables):
        for i, r in ref.row_of[t].items():
            if i in stored.get(spec.name, {}):
                w, s = stored[spec.name][i]
                torch.testing.assert_close(w, ref.weights[t][r], atol=tol["atol"], rtol=tol["rtol"])
                if optimizer == "rowwise_adagrad":
                    torch.testing.assert_close(s[0], ref.state[t][r], atol=tol["atol"], rtol=tol["rtol"])
            else:
                # Never written: must still be its initial value in the reference (never touched).
                initial = init_rows(torch.tensor([i]), spec.dim, table_salt(0, spec.name), -0.01, 0.01)[0]
                torch.testing.assert_close(
                    ref.weights[t][r],
                    initial.half().float() if fp16 else initial,
                    atol=tol["atol"],
                    rtol=tol["rtol"],
                )
    module.close()


# ---------------------------------------------------------------------------- tests


@settings(max_examples=30, deadline=None)
@given(
    dims=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    extra_features=st.lists(st.integers(0, 2), max_size=2),
    optimizer=st.sampled_from(["sgd", "rowwise_adagrad"]),
    pooling=st.sampled_from(["sum", "mean"]),
    cache_rows=st.sampled_from([0, 1, 3, 64]),
    vbe=st.booleans(),
    weighted=st.booleans(),
    use_vbe_output=st.booleans(),
    prefetch=st.booleans(),
    fp16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_in_memory_reference(
    dims: list[int],
    extra_features: list[int],
    optimizer: str,
    pooling: str,
    cache_rows: int,
    vbe: bool,
    weighted: bool,
    use_vbe_output: bool,
    prefetch: bool,
    fp16: bool,
    seed: int,
) -> None:
    """Outputs, per-sample-weight gradients, rows and optimizer state equal the dense reference over 3 steps."""
    tables = [TableSpec(f"t{i}", d) for i, d in enumerate(dims)]
    ftm = list(range(len(tables))) + [e % len(tables) for e in extra_features]
    run_case(
        tables=tables,
        ftm=ftm,
        optimizer=optimizer,
        pooling=pooling,
        cache_rows=cache_rows,
        vbe=vbe,
        weighted=weighted,
        use_vbe_output=use_vbe_output,
        prefetch=prefetch,
        fp16=fp16,
        steps=3,
        seed=seed,
    )


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"], ids=["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
def test_vbe_with_cache_smaller_than_batch(optimizer: str, prefetch: bool) -> None:
    """VBE with vbe_output, a 2-row cache and ~10 unique rows per batch stays exact over 5 steps."""
    run_case(
        tables=[TableSpec("a", 4), TableSpec("b", 3)],
        ftm=[0, 1, 0],
        optimizer=optimizer,
        pooling="sum",
        cache_rows=2,
        vbe=True,
        weighted=True,
        use_vbe_output=True,
        prefetch=prefetch,
        fp16=False,
        steps=5,
        seed=7,
    )


def test_rocksdb_store_matches_reference(tmp_path: Path) -> None:
    """The same contract holds with the RocksDB store behind a tiny cache."""
    from ssd_tbe_adapter import RocksDBStore

    run_case(
        tables=[TableSpec("a", 4), TableSpec("b", 2)],
        ftm=[0, 1],
        optimizer="rowwise_adagrad",
        pooling="sum",
        cache_rows=3,
        vbe=True,
        weighted=False,
        use_vbe_output=False,
        prefetch=True,
        fp16=False,
        steps=4,
        seed=3,
        store=RocksDBStore(tmp_path / "db"),
    )


def test_init_is_deterministic_per_id_and_seed() -> None:
    """Same (seed, table, id) → same first-touch row whatever the cache or batch; another seed → another row."""
    ids = torch.tensor([5, 2**50, -3, 5])
    offsets = torch.tensor([0, 1, 2, 3, 4])

    def first_rows(seed: int, cache_rows: int, order: torch.Tensor) -> torch.Tensor:
        module = KeyValueEmbeddingBags(
            [TableSpec("t", 4)], None, MemoryStore(), cache_rows=cache_rows, seed=seed, pooling="sum"
        )
        with torch.no_grad():
            out = module(order, offsets)
        row: torch.Tensor = out[(order == 5).nonzero().flatten()[0]]
        return row

    a = first_rows(0, 8, ids)
    b = first_rows(0, 0, ids.flip(0))
    c = first_rows(1, 8, ids)
    torch.testing.assert_close(a, b)
    assert not torch.equal(a, c)


def test_forward_without_prefetch_is_counted() -> None:
    """A forward without prefetch fetches synchronously and says so in metrics(); with prefetch it hits."""
    module = KeyValueEmbeddingBags([TableSpec("t", 4)], None, MemoryStore(), cache_rows=16)
    indices = torch.tensor([1, 2, 3, 4])
    offsets = torch.tensor([0, 2, 4])
    with torch.no_grad():
        module(indices, offsets)
        m = module.metrics()
        assert m["forwards_without_prefetch"] == 1.0
        assert m["sync_fetched_rows"] == 4.0
        other = torch.tensor([5, 6, 1, 2])
        module.prefetch(other, offsets)
        module(other, offsets)
    m = module.metrics()
    assert m["forwards_without_prefetch"] == 1.0
    assert m["prefetched_rows"] == 2.0
    assert m["forward_hit_rate"] == 4.0 / 8.0
    assert m["cache_hit_rate"] == 2.0 / 8.0
    for key in ("store_rows_read", "store_read_seconds", "store_rows_written", "store_write_seconds"):
        assert key in m


def test_checkpoint_roundtrip_to_fresh_store(tmp_path: Path) -> None:
    """save_checkpoint streams chunks; load_checkpoint into a fresh module reproduces every row and its state."""
    tables = [TableSpec("a", 3), TableSpec("b", 5)]
    src = KeyValueEmbeddingBags(
        tables, None, MemoryStore(), cache_rows=2, optimizer="rowwise_adagrad", learning_rate=0.5
    )
    indices = torch.tensor([1, 2, 3, 9, 8, 7, 6])
    offsets = torch.tensor([0, 1, 3, 5, 7])
    for _ in range(2):
        src(indices, offsets).sum().backward()
    directory = tmp_path / "ckpt"
    written = src.save_checkpoint(directory, chunk_rows=2)
    assert written == 7
    dst = KeyValueEmbeddingBags(
        tables, None, MemoryStore(), cache_rows=5, optimizer="rowwise_adagrad", learning_rate=0.5
    )
    with torch.no_grad():
        dst(
            torch.tensor([100, 101, 1, 9]), torch.tensor([0, 1, 2, 3, 4])
        )  # rows that the restore must drop or replace
    assert dst.load_checkpoint(directory) == 7
    a, b = rows_of(src), rows_of(dst)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys()
        for i in a[name]:
            torch.testing.assert_close(a[name][i][0], b[name][i][0])
            torch.testing.assert_close(a[name][i][1], b[name][i][1])
    with torch.no_grad():
        torch.testing.assert_close(src(indices, offsets), dst(indices, offsets))


def test_checkpoint_rejects_other_configuration(tmp_path: Path) -> None:
    """Loading a checkpoint of a differently configured module is a clear ValueError."""
    src = KeyValueEmbeddingBags([TableSpec("a", 3)], None, MemoryStore(), cache_rows=2)
    with torch.no_grad():
        src(torch.tensor([1]), torch.tensor([0, 1]))
    directory = tmp_path / "ckpt"
    src.save_checkpoint(directory)
    dst = KeyValueEmbeddingBags([TableSpec("a", 4)], None, MemoryStore(), cache_rows=2)
    with pytest.raises(SchemaMismatchError, match=r"written for tables \[a:3\], this module has \[a:4\]"):
        dst.load_checkpoint(directory)
    with pytest.raises(ValueError, match="expected"):
        dst.restore(
            [
                TableChunk(
                    table="a",
                    ids=torch.tensor([1]),
                    weights=torch.zeros(1, 3),
                    optimizer_state=torch.zeros(1, 0),
                )
            ]
        )


def test_state_dict_holds_configuration_only() -> None:
    """state_dict() carries the configuration (checked on load), never the rows."""
    module = KeyValueEmbeddingBags([TableSpec("a", 3)], None, MemoryStore(), cache_rows=2)
    state = module.state_dict()
    assert list(state) == ["_extra_state"]
    with pytest.warns(RowsNotRestoredWarning, match="holds no row"):
        module.load_state_dict(state)
    other = KeyValueEmbeddingBags([TableSpec("a", 3)], None, MemoryStore(), cache_rows=2, seed=3)
    with pytest.raises(SchemaMismatchError, match="`seed` = 0, this module has 3"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"indices": torch.tensor([1.0])}, "`indices` must be"),
        ({"offsets": torch.tensor([0, 1, 3])}, "`offsets` must start at 0"),
        ({"offsets": torch.tensor([0, 1, 1, 2])}, "not a multiple"),
        ({"per_sample_weights": torch.ones(3)}, "`per_sample_weights`"),
        ({"batch_size_per_feature_per_rank": [[1]]}, "one list per feature"),
        ({"batch_size_per_feature_per_rank": [[1], [2]]}, "sums to 3 bags"),
        ({"vbe_output": torch.zeros(4)}, "needs `batch_size_per_feature_per_rank`"),
    ],
    ids=[
        "float-indices",
        "bad-offsets",
        "uneven-batch",
        "psw-length",
        "bsfr-features",
        "bsfr-sum",
        "vbe-output-no-vbe",
    ],
)
def test_bad_input_is_a_clear_value_error(kwargs: dict[str, object], message: str) -> None:
    """Malformed inputs raise ValueError naming the argument, before any lookup."""
    module = KeyValueEmbeddingBags([TableSpec("a", 2), TableSpec("b", 2)], None, MemoryStore(), cache_rows=2)
    args: dict[str, object] = {"indices": torch.tensor([1, 2]), "offsets": torch.tensor([0, 1, 2])}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        module(**args)


def test_bad_construction_is_a_clear_error() -> None:
    """Constructor arguments are validated with messages naming them."""
    with pytest.raises(ValueError, match="`dim`"):
        TableSpec("a", 0)
    with pytest.raises(ValueError, match="unique"):
        KeyValueEmbeddingBags([TableSpec("a", 2), TableSpec("a", 2)], None, MemoryStore(), cache_rows=1)
    with pytest.raises(ValueError, match="`feature_table_map`"):
        KeyValueEmbeddingBags([TableSpec("a", 2)], [1], MemoryStore(), cache_rows=1)
    with pytest.raises(ValueError, match="`cache_rows`"):
        KeyValueEmbeddingBags([TableSpec("a", 2)], None, MemoryStore(), cache_rows=-1)
    with pytest.raises(ValueError, match="`optimizer`"):
        KeyValueEmbeddingBags([TableSpec("a", 2)], None, MemoryStore(), cache_rows=1, optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`store`"):
        KeyValueEmbeddingBags([TableSpec("a", 2)], None, object(), cache_rows=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- mixed with an fbgemm TBE


def _fbgemm_or_skip() -> object:
    from ssd_tbe_adapter import _fbgemm

    fbgemm = _fbgemm.load()
    if fbgemm is None:
        pytest.skip("fbgemm_gpu is not importable (or not ABI-matched to this torch)")
    return fbgemm


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"], ids=["sgd", "rowwise_adagrad"])
def test_mixed_with_fbgemm_tbe_on_one_vbe_output(optimizer: str) -> None:
    """An fbgemm TBE and a KV table write one VBE buffer and chain autograd; both match the reference."""
    fb = _fbgemm_or_skip()
    lr = 0.2
    tbe_rows, tbe_dims = [10, 12], [4, 8]
    tables = [TableSpec("tbe0", 4), TableSpec("tbe1", 8), TableSpec("kv0", 3), TableSpec("kv1", 5)]
    ftm = [0, 1, 2, 3, 2]  # features 0-1 on the TBE, 2-4 on the key-value module
    optim = fb.optim_type.EXACT_SGD if optimizer == "sgd" else fb.optim_type.EXACT_ROWWISE_ADAGRAD  # type: ignore[attr-defined]
    tbe = fb.codegen(  # type: ignore[attr-defined]
        [(r, d, fb.location.HOST, fb.compute_device.CPU) for r, d in zip(tbe_rows, tbe_dims, strict=True)],  # type: ignore[attr-defined]
        optimizer=optim,
        learning_rate=lr,
        eps=1e-8,
    )
    kv = KeyValueEmbeddingBags(
        tables[2:],
        [0, 1, 0],
        MemoryStore(),
        cache_rows=2,
        optimizer=optimizer,  # type: ignore[arg-type]
        learning_rate=lr,
    )
    universe = {0: list(range(10)), 1: list(range(12)), 2: ID_POOL, 3: ID_POOL}
    ref = Reference(tables, ftm, universe, optimizer=optimizer, learning_rate=lr, pooling="sum")
    for t, weights in enumerate(tbe.split_embedding_weights()):
        ref.weights[t] = weights.detach().clone().float()
    gen = torch.Generator().manual_seed(11)
    ranks = 2
    dims = [tables[t].dim for t in ftm]
    for _ in range(3):
        batch_sizes = [[int(torch.randint(0, 4, (1,), generator=gen)) for _ in range(ranks)] for _ in ftm]
        lengths = [torch.randint(0, 4, (sum(b),), generator=gen) for b in batch_sizes]
        ids = []
        for f, ln in enumerate(lengths):
            pool = list(range(tbe_rows[ftm[f]])) if f < 2 else ID_POOL
            ids.append(torch.tensor(pool)[torch.randint(0, len(pool), (int(ln.sum()),), generator=gen)])
        starts = torch.zeros(ranks, len(ftm), dtype=torch.int64)
        cursor = 0
        for r in range(ranks):
            for f in range(len(ftm)):
                starts[r, f] = cursor
                cursor += batch_sizes[f][r] * dims[f]

        def inputs(
            features: range, lengths: list[torch.Tensor] = lengths, ids: list[torch.Tensor] = ids
        ) -> tuple[torch.Tensor, torch.Tensor]:
            ln = torch.cat([lengths[f] for f in features])
            return torch.cat([ids[f] for f in features]), torch.cat(
                [torch.zeros(1, dtype=torch.int64), ln.cumsum(0)]
            )

        tbe_idx, tbe_off = inputs(range(2))
        kv_idx, kv_off = inputs(range(2, 5))
        tbe_out = tbe(tbe_idx, tbe_off, batch_size_per_feature_per_rank=batch_sizes[:2])
        # fbgemm's CPU TBE cannot take `vbe_output`: place its rank → feature blocks into the shared buffer
        # at their offsets ourselves (out of place, so autograd reaches the TBE), then chain the KV module.
        positions = torch.cat(
            [
                torch.arange(int(starts[r, f]), int(starts[r, f]) + batch_sizes[f][r] * dims[f])
                for r in range(ranks)
                for f in range(2)
            ]
        )
        buffer = torch.zeros(cursor).index_copy(0, positions, tbe_out)
        out = kv(
            kv_idx,
            kv_off,
            None,
            batch_sizes[2:],
            vbe_output=buffer,
            vbe_output_offsets=starts[:, 2:].contiguous(),
        )
        leaves, pooled = ref.forward(
            torch.cat(ids),
            torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)]),
            None,
            batch_sizes,
        )
        expected = ref.layout(pooled, batch_sizes)
        torch.testing.assert_close(out, expected.detach(), atol=1e-5, rtol=1e-5)
        probe = torch.randn(cursor, generator=gen)
        torch.autograd.backward((out * probe).sum())
        torch.autograd.backward((expected * probe).sum())
        ref.step(leaves)
    for t, weights in enumerate(tbe.split_embedding_weights()):
        torch.testing.assert_close(weights.float(), ref.weights[t], atol=1e-5, rtol=1e-5)
    stored = rows_of(kv)
    for t in (2, 3):
        for i, r in ref.row_of[t].items():
            if i in stored.get(tables[t].name, {}):
                torch.testing.assert_close(
                    stored[tables[t].name][i][0], ref.weights[t][r], atol=1e-5, rtol=1e-5
                )
