"""Sharded embedding bags: plans, layouts, single-rank properties and multi-process equivalence.

The multi-process tests spawn 2 and 3 gloo ranks (one spawn each, many checks per spawn: a spawn costs
seconds of torch import) and compare with an unsharded single-process lookup over the concatenated
global batch; see ``_dist_workers.py``.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _dist_harness
import _dist_workers
from _dist_workers import (
    FEATURES,
    TABLES,
    Reference,
    backward,
    close,
    initial_tables,
    make_batches,
    per_feature,
)

from vbe_lookup._dist_comm import Communicator
from vbe_lookup._dist_input import InputDist
from vbe_lookup._features import VBEFeatures
from vbe_lookup._sharding_plan import ShardingLayout
from vbe_lookup._torch_kernel import TorchEmbeddingKernel
from vbe_lookup.errors import BatchLayoutError, ConfigurationError
from vbe_lookup.interfaces import EmbeddingKernel
from vbe_lookup.sharding import (
    KernelSpec,
    PooledEmbeddings,
    RowWise,
    SequenceEmbeddings,
    ShardedEmbeddingBags,
    ShardedSequenceEmbeddings,
    ShardingPlan,
    ShardingPlanError,
    TableConfig,
    TableWise,
    UnknownFeatureError,
    torch_kernel_factory,
)

# ---------------------------------------------------------------------------------------- plans


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "", "num_embeddings": 3, "embedding_dim": 2, "feature_names": ("f",)}, "`name`"),
        ({"name": "t", "num_embeddings": 0, "embedding_dim": 2, "feature_names": ("f",)}, "`num_embeddings`"),
        ({"name": "t", "num_embeddings": 3, "embedding_dim": 0, "feature_names": ("f",)}, "`embedding_dim`"),
        ({"name": "t", "num_embeddings": 3, "embedding_dim": 2, "feature_names": ()}, "`feature_names`"),
        (
            {"name": "t", "num_embeddings": 3, "embedding_dim": 2, "feature_names": ("f",), "pooling": "max"},
            "`pooling`",
        ),
    ],
    ids=["empty-name", "no-rows", "no-dim", "no-features", "bad-pooling"],
)
def test_table_config_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    """A bad table config raises ShardingPlanError naming the argument."""
    with pytest.raises(ShardingPlanError, match=match):
        TableConfig(**kwargs)  # type: ignore[arg-type]  # deliberately loose kwargs


def _t(name: str, rows: int, *features: str) -> TableConfig:
    return TableConfig(name=name, num_embeddings=rows, embedding_dim=2, feature_names=features)


@pytest.mark.parametrize(
    ("tables", "placements", "world", "match"),
    [
        ([_t("a", 4, "x")], {"a": TableWise(rank=0), "b": TableWise(rank=0)}, 1, "`b`"),
        ([_t("a", 4, "x"), _t("b", 4, "y")], {"a": TableWise(rank=0)}, 1, "table `b` has no placement"),
        ([_t("a", 4, "x")], {"a": TableWise(rank=2)}, 2, "rank 2 is outside"),
        ([_t("a", 2, "x")], {"a": RowWise()}, 3, "needs `num_embeddings` >= 3"),
        (
            [_t("a", 4, "x"), _t("b", 4, "x")],
            {"a": TableWise(rank=0), "b": TableWise(rank=0)},
            1,
            "feature `x`",
        ),
        ([_t("a", 4, "x"), _t("a", 4, "y")], {"a": TableWise(rank=0)}, 1, "duplicate"),
        ([_t("a", 4, "x")], {"a": RowWise(ranks=(0, 0))}, 2, "repeats a rank"),
        ([], {}, 1, "`tables` is empty"),
    ],
    ids=[
        "unknown-table",
        "missing-placement",
        "rank-out-of-range",
        "too-few-rows",
        "shared-feature",
        "dup-table",
        "dup-rank",
        "no-tables",
    ],
)
def test_layout_rejects_bad_plans(
    tables: list[TableConfig], placements: dict[str, TableWise | RowWise], world: int, match: str
) -> None:
    """Plans that cannot be built raise ShardingPlanError with the offending name."""
    with pytest.raises(ShardingPlanError, match=match):
        ShardingLayout.build(tables, ShardingPlan(world_size=world, placements=placements))


def test_row_wise_split_is_balanced_and_contiguous() -> None:
    """Row-wise shards cover the table once, in order, sizes differing by at most one row."""
    layout = ShardingLayout.build([_t("a", 10, "x")], ShardingPlan(world_size=3, placements={"a": RowWise()}))
    shards = layout.shards[0]
    assert [(s.rank, s.row_start, s.num_rows) for s in shards] == [(0, 0, 4), (1, 4, 3), (2, 7, 3)]


def test_layout_orders_slots_by_kernel_group() -> None:
    """A rank's slots follow its kernel groups (plan order), each group's tables and features in order."""
    tables = [_t("a", 4, "x", "y"), _t("b", 4, "z"), _t("c", 4, "w")]
    plan = ShardingPlan(
        world_size=2,
        placements={
            "a": TableWise(rank=0, group="g1"),
            "b": RowWise(group="g2"),
            "c": TableWise(rank=0, group="g1"),
        },
    )
    layout = ShardingLayout.build(tables, plan)
    r0 = layout.ranks[0]
    assert [k.group for k in r0.kernels] == ["g1", "g2"]
    assert [layout.features[s.feature] for s in r0.slots] == ["x", "y", "w", "z"]
    assert r0.kernels[0].feature_table_map == (0, 0, 1)
    assert [layout.features[s.feature] for s in layout.ranks[1].slots] == ["z"]
    assert layout.ranks[1].kernels[0].row_offsets == (2,)


def test_table_wise_helper_balances_parameters() -> None:
    """``ShardingPlan.table_wise`` puts the largest tables on different ranks."""
    tables = [_t("big", 100, "x"), _t("mid", 60, "y"), _t("small", 50, "z")]
    plan = ShardingPlan.table_wise(tables, 2)
    ranks = {name: p.rank for name, p in plan.placements.items() if isinstance(p, TableWise)}
    assert ranks["big"] != ranks["mid"]
    assert ranks["mid"] == ranks["small"]


def test_pooled_embeddings_is_keyed_tensor_like() -> None:
    """PooledEmbeddings exposes the KeyedTensor methods kt-regroup consumes."""
    values = torch.arange(10.0).view(2, 5)
    kt = PooledEmbeddings(["a", "b"], [2, 3], values)
    assert kt.keys() == ["a", "b"]
    assert kt.length_per_key() == [2, 3]
    assert kt.key_dim() == 1
    assert kt.offset_per_key() == [0, 2, 5]
    torch.testing.assert_close(kt["b"], values[:, 2:])
    assert set(kt.to_dict()) == {"a", "b"}


def test_module_needs_initialized_process_group() -> None:
    """Without torch.distributed initialized the module says so instead of failing deep inside."""
    _dist_harness.require_no_process_group()
    with pytest.raises(ShardingPlanError, match="init_process_group"):
        ShardedEmbeddingBags(TABLES, ShardingPlan.table_wise(TABLES, 1))


# --------------------------------------------------------------------- single rank, in process


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A 1-rank gloo group in this process (no spawn) for property tests of the whole path."""
    with _dist_harness.one_rank_gloo():
        yield


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), batch=st.integers(0, 5), weighted=st.booleans(), row_wise=st.booleans())
def test_single_rank_matches_reference(
    one_rank: None, seed: int, batch: int, weighted: bool, row_wise: bool
) -> None:
    """On one rank, pooled and sequence outputs and one SGD step equal the unsharded reference."""
    del one_rank
    plan = ShardingPlan(
        world_size=1,
        placements={
            t.name: RowWise(group="g") if row_wise else TableWise(rank=0, group=t.name) for t in TABLES
        },
    )
    init = initial_tables(seed)
    batches = make_batches(seed, [batch], weighted)
    features = batches[0].features(torch.device("cpu"))

    pooled = ShardedEmbeddingBags(
        TABLES, plan, kernel_factory=torch_kernel_factory(learning_rate=_dist_workers.LR)
    )
    pooled.load_state_dict(init)
    ref = Reference(init, "sgd")
    out = pooled(features)
    expected = ref.pooled(batches)
    close(out.values(), expected.detach())
    g = _dist_workers.grad_seed(seed, batch)
    backward((out.values() * g).sum())
    backward((expected * g).sum())
    ref.step()
    _dist_workers.check_state(pooled, ref, "single rank")

    seq = ShardedSequenceEmbeddings(TABLES, plan)
    seq.load_state_dict(init)
    got = seq(features)
    assert isinstance(got, SequenceEmbeddings)
    assert got.keys() == list(FEATURES)
    want = Reference(init, "sgd").sequence(batches)
    for f in FEATURES:
        close(got[f], want[f][0].detach())
        torch.testing.assert_close(got.lengths(f), per_feature(batches[0], f)[1])


def test_single_rank_rejects_unknown_feature(one_rank: None) -> None:
    """An input key no table serves raises UnknownFeatureError naming it and the known features."""
    del one_rank
    m = ShardedEmbeddingBags(TABLES, ShardingPlan.table_wise(TABLES, 1))
    batch = make_batches(0, [2], False)[0]
    batch = _dist_workers.LocalBatch(["zz", *batch.keys[1:]], batch.values, batch.lengths, None, 2)
    with pytest.raises(UnknownFeatureError, match=r"`zz`.*known features: f0"):
        m(batch.features(torch.device("cpu")))


def test_single_rank_rejects_lengths_that_do_not_cover_values(one_rank: None) -> None:
    """Lengths summing to more ids than `values` holds raise BatchLayoutError, and the module recovers."""
    del one_rank
    m = ShardedEmbeddingBags(TABLES, ShardingPlan.table_wise(TABLES, 1))
    batch = make_batches(0, [2], False)[0]
    cpu = torch.device("cpu")
    broken = _dist_workers.LocalBatch(batch.keys, batch.values[:-1], batch.lengths, None, 2)
    with pytest.raises(BatchLayoutError, match="`lengths`"):
        m(broken.features(cpu))
    assert m(batch.features(cpu)).values().shape[0] == 2


def test_single_rank_pipelined_input_is_fifo(one_rank: None) -> None:
    """Queued distributed features are consumed first in, first out by the next forwards."""
    del one_rank
    m = ShardedEmbeddingBags(TABLES, ShardingPlan.table_wise(TABLES, 1))
    b1, b2 = (make_batches(s, [n], False)[0] for s, n in ((1, 2), (2, 3)))
    cpu = torch.device("cpu")
    with torch.no_grad():
        direct = [m(b.features(cpu)).values() for b in (b1, b2)]
        for b in (b1, b2):
            m.enqueue_pipelined_input(m.wait_input_dist(m.start_input_dist(b.features(cpu))))
        queued = [m(None).values(), m(None).values()]
    for a, b in zip(direct, queued, strict=True):
        torch.testing.assert_close(a, b)


def test_single_rank_never_runs_the_output_dist_overlap(one_rank: None) -> None:
    """A group of one issues no output all-to-all, so the overlap callback never runs; a non-callable is a
    clear error."""
    del one_rank
    m = ShardedEmbeddingBags(TABLES, ShardingPlan.table_wise(TABLES, 1))
    calls: list[int] = []
    m.set_output_dist_overlap(lambda: calls.append(1))
    m(make_batches(3, [2], False)[0].features(torch.device("cpu")))
    assert calls == []
    with pytest.raises(ConfigurationError, match="`callback` must be callable or None"):
        m.set_output_dist_overlap(3)  # type: ignore[arg-type]  # wrong on purpose


def test_single_rank_state_dict_nested_in_a_model(one_rank: None) -> None:
    """Inside a larger model the state dict holds unsharded tables under the module's prefix, loads
    back strictly, and a missing table is reported as a missing key."""
    del one_rank
    plan = ShardingPlan(world_size=1, placements={t.name: RowWise() for t in TABLES})
    model = torch.nn.ModuleDict({"ebc": ShardedEmbeddingBags(TABLES, plan), "dense": torch.nn.Linear(2, 2)})
    state = model.state_dict()
    assert {k for k in state if k.startswith("ebc.")} == {f"ebc.{t.name}.weight" for t in TABLES}
    init = initial_tables(3)
    state.update({f"ebc.{k}": v for k, v in init.items()})
    model.load_state_dict(state)
    for k, v in init.items():
        close(model.state_dict()[f"ebc.{k}"], v)
    del state["ebc.t1.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*ebc\.t1\.weight"):
        model.load_state_dict(state)


class OpaqueKernel(torch.nn.Module):
    """A kernel without ``split_embedding_weights()`` (like a key-value table): it keeps its own state."""

    def __init__(self, spec: KernelSpec) -> None:
        super().__init__()
        self.inner = TorchEmbeddingKernel(
            list(spec.num_embeddings),
            list(spec.embedding_dims),
            feature_table_map=list(spec.feature_table_map),
        )

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        vbe_output: torch.Tensor | None = None,
        vbe_output_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Delegate (no in-place ``vbe_output``)."""
        del vbe_output, vbe_output_offsets
        out: torch.Tensor = self.inner(
            indices,
            offsets,
            per_sample_weights=per_sample_weights,
            batch_size_per_feature_per_rank=batch_size_per_feature_per_rank,
        )
        return out

    def feature_dims(self) -> list[int]:
        """Embedding dim of each feature."""
        return self.inner.feature_dims()


def test_single_rank_state_dict_keeps_opaque_kernels_own_state(one_rank: None) -> None:
    """Tables of kernels without ``split_embedding_weights()`` stay in the kernel's own entries; the
    others are unsharded; both load back."""
    del one_rank
    plan = ShardingPlan(
        world_size=1,
        placements={
            "t0": TableWise(rank=0, group="a"),
            "t1": TableWise(rank=0, group="a"),
            "t2": RowWise(group="kv"),
            "t3": TableWise(rank=0, group="kv"),
        },
    )

    def factory(spec: KernelSpec) -> EmbeddingKernel:
        if spec.group == "kv":
            return OpaqueKernel(spec)
        return TorchEmbeddingKernel(
            list(spec.num_embeddings),
            list(spec.embedding_dims),
            feature_table_map=list(spec.feature_table_map),
        )

    m = ShardedEmbeddingBags(TABLES, plan, kernel_factory=factory)
    state = m.state_dict()
    opaque = sorted(k for k in state if k.startswith("lookup."))
    assert {k for k in state if not k.startswith("lookup.")} == {"t0.weight", "t1.weight"}
    assert opaque
    assert all(".inner." in k for k in opaque)
    init = initial_tables(4)
    state["t0.weight"] = init["t0.weight"]
    state[opaque[0]] = torch.full_like(state[opaque[0]], 0.5)
    m.load_state_dict(state)
    after = m.state_dict()
    close(after["t0.weight"], init["t0.weight"])
    close(after[opaque[0]], torch.full_like(after[opaque[0]], 0.5))


# ------------------------------------------------------- input dist pieces (host-light step path)


def _input_dist(layout: ShardingLayout) -> InputDist:
    comm = Communicator(None, datetime.timedelta(seconds=30), torch.device("cpu"))
    return InputDist(layout, comm)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    world=st.integers(1, 6),
    num_tables=st.integers(1, 4),
    n=st.integers(0, 200),
)
def test_bucketize_matches_per_shard_scan(
    one_rank: None, seed: int, world: int, num_tables: int, n: int
) -> None:
    """One binary search over all shards' first rows gives the rank, slot and local id of a scan of the
    shards (the old O(N*K) comparison), for random row-wise/table-wise mixes and ids."""
    del one_rank
    gen = torch.Generator().manual_seed(seed)
    rows = [int(r) for r in torch.randint(world, 40, (num_tables,), generator=gen)]
    tables = [_t(f"t{i}", rows[i], f"f{i}", f"g{i}") for i in range(num_tables)]
    placements: dict[str, TableWise | RowWise] = {}
    for i in range(num_tables):
        if int(torch.randint(0, 2, (1,), generator=gen)):
            k = int(torch.randint(1, world + 1, (1,), generator=gen))
            ranks = tuple(int(r) for r in torch.randperm(world, generator=gen)[:k])
            placements[f"t{i}"] = RowWise(ranks=ranks)
        else:
            placements[f"t{i}"] = TableWise(rank=int(torch.randint(0, world, (1,), generator=gen)))
    layout = ShardingLayout.build(tables, ShardingPlan(world_size=world, placements=placements))
    dist_in = _input_dist(layout)
    num_features = len(layout.features)
    g = torch.randint(0, num_features, (n,), generator=gen)
    feature_rows = torch.tensor([rows[layout.feature_table[f]] for f in range(num_features)])
    values = (torch.rand(n, generator=gen) * feature_rows[g]).to(torch.int64)
    shard = dist_in._bucketize(g, values)
    got = (
        dist_in._shard_rank[shard].tolist(),
        dist_in._shard_slot[shard].tolist(),
        (values - dist_in._shard_row0[shard]).tolist(),
    )
    slot_of = {(s.feature, r): j for r, rl in enumerate(layout.ranks) for j, s in enumerate(rl.slots)}
    want: tuple[list[int], list[int], list[int]] = ([], [], [])
    for f, v in zip(g.tolist(), values.tolist(), strict=True):
        owner = [s for s in layout.shards[layout.feature_table[f]] if s.row_start <= v][-1]
        assert v < owner.row_start + owner.num_rows
        want[0].append(owner.rank)
        want[1].append(slot_of[(f, owner.rank)])
        want[2].append(v - owner.row_start)
    assert got == want


def test_input_dist_layout_metadata_is_cached(one_rank: None) -> None:
    """The receive-side reorder index and VBE strides are built once per batch-size layout, and the
    reorder index equals the source → slot → sample to slot → source → sample permutation."""
    del one_rank
    plan = ShardingPlan(world_size=3, placements={t.name: RowWise() for t in TABLES})
    dist_in = _input_dist(ShardingLayout.build(TABLES, plan))
    batches = (2, 0, 3)
    index = dist_in._recv_len_index(batches, torch.tensor(batches))
    assert dist_in._recv_len_index(batches, torch.tensor(batches)) is index
    assert dist_in._stride(batches, 4) is dist_in._stride(batches, 4)
    slots = dist_in.slot_counts[0]
    base = [0, slots * 2, slots * 2]  # source s starts after the slots x batch sizes of the ones before
    want = [base[s] + j * batches[s] + i for j in range(slots) for s in range(3) for i in range(batches[s])]
    assert index.tolist() == want
    other = dist_in._recv_len_index((1, 1, 1), torch.tensor((1, 1, 1)))
    assert other is not index
    assert other.numel() == slots * 3


class _UniformKJT:
    """What a torchrec KeyedJaggedTensor answers when it is not variable-stride (its strides are lists
    rebuilt on every ``stride_per_key_per_rank()`` call, which the input dist must not make)."""

    def __init__(self, features: VBEFeatures, batch: int) -> None:
        self._f = features
        self._batch = batch

    def keys(self) -> list[str]:
        return self._f.keys()

    def values(self) -> torch.Tensor:
        return self._f.values()

    def lengths(self) -> torch.Tensor:
        return self._f.lengths()

    def weights_or_none(self) -> torch.Tensor | None:
        return self._f.weights_or_none()

    def variable_stride_per_key(self) -> bool:
        return False

    def stride(self) -> int:
        return self._batch

    def stride_per_key_per_rank(self) -> list[list[int]]:
        raise AssertionError("stride_per_key_per_rank() called for a uniform-stride KJT")


def test_uniform_kjt_strides_are_not_rebuilt(one_rank: None) -> None:
    """A non-variable-stride KJT is read through ``stride()`` (not its per-key lists); same output."""
    del one_rank
    m = ShardedEmbeddingBags(TABLES, ShardingPlan.table_wise(TABLES, 1))
    batch = make_batches(3, [4], weighted=True)[0]
    features = batch.features(torch.device("cpu"))
    with torch.no_grad():
        want = m(features).values()
        got = m(_UniformKJT(features, 4)).values()
    close(got, want)


def test_missing_feature_named_among_thousands(one_rank: None) -> None:
    """3000 features (set-based O(F) check): the one missing is named; a complete key order passes."""
    del one_rank
    many = [_t(f"t{i}", 3, f"f{i}") for i in range(3000)]
    layout = ShardingLayout.build(many, ShardingPlan.table_wise(many, 1))
    dist_in = _input_dist(layout)
    keys = tuple(layout.features[1:])
    with pytest.raises(UnknownFeatureError, match=r"lacks feature.*`f0`"):
        dist_in._check_keys(keys)
    dist_in._check_keys(tuple(layout.features))


# ------------------------------------------------------------------------------ multi-process


@pytest.mark.distributed
def test_two_ranks_gloo_equal_unsharded_reference() -> None:
    """2 gloo ranks: outputs, weight grads and tables after k steps equal the unsharded reference;
    bad input and bad plans raise on every rank (on CPU a pipelined start's bad input raises at its wait,
    on every rank, after a forward in between; input dists started several batches ahead give what one at a
    time gives; a callback run while the output all-to-all is in flight waits for the next batch's dist and
    changes no result, and its error leaves the ranks in step); a missing peer times out instead of hanging; a rank
    that skips backward or is at another step makes every rank raise, the peers' tables intact."""
    reports = _dist_harness.run_ranks(_dist_workers.two_ranks, 2, timeout_s=240)
    for r in reports:
        assert (r["sgd"], r["adagrad"], r["sequence"]) == (True, True, True)
    assert reports[0]["errors"] == [
        "PeerRankError",
        "IndexOutOfRangeError",
        "IndexOutOfRangeError",
        *["ShardingPlanError"] * 3,
    ]
    assert reports[1]["errors"] == [
        "UnknownFeatureError",
        "PeerRankError",
        "PeerRankError",
        "ShardingPlanError",
        "ShardingPlanError",
        "PeerRankError",
    ]
    assert [r["in_flight"] for r in reports] == [8, 8]
    assert reports[0]["overlap"] == ["ValueError", "CollectiveOrderError"]
    assert reports[1]["overlap"] == ["ok", "PeerRankError"]
    assert 0.9 <= reports[0]["timeout_s"] < 10
    assert reports[0]["skipped_backward"] == ["PeerRankError", "CollectiveOrderError"]
    assert reports[1]["skipped_backward"] == ["CollectiveOrderError", "CollectiveOrderError"]


@pytest.mark.distributed
def test_three_ranks_gloo_equal_unsharded_reference_and_resume_2_on_3() -> None:
    """3 gloo ranks (one holding no table): equivalence as for 2 ranks, and a model trained on a
    2-rank group resumes on 3 ranks with another plan (row-wise Adagrad state included)."""
    reports = _dist_harness.run_ranks(_dist_workers.three_ranks, 3, timeout_s=300)
    for r in reports:
        assert (r["sgd"], r["adagrad"], r["sequence"], r["resumed"]) == (True, True, True, True)
    assert reports[1]["prefetch"] == []  # rank 1 holds no table, so no kernel
    assert reports[2]["errors"][0] == "UnknownFeatureError"
    assert reports[0]["errors"][1] == "IndexOutOfRangeError"


@pytest.mark.gpu
@pytest.mark.distributed
def test_two_gpus_nccl_equal_unsharded_reference() -> None:
    """2 GPUs over NCCL: the 2-rank equivalence and error checks (run with NCCL_NVLS_ENABLE=0)."""
    if torch.cuda.device_count() < 2:
        if os.environ.get("REQUIRE_GPU") == "1":
            pytest.fail(f"needs 2 CUDA devices, found {torch.cuda.device_count()} (REQUIRE_GPU=1)")
        pytest.skip("needs 2 CUDA devices")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    reports = _dist_harness.run_ranks(_dist_workers.nccl_two_ranks, 2, backend="nccl", timeout_s=300)
    for r in reports:
        assert (r["sgd"], r["adagrad"], r["sequence"]) == (True, True, True)
