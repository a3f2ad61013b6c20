"""Rank bodies for the sharding tests (importable by spawned children) and the unsharded reference.

Every rank builds the same global data from one seed: for each step, each rank's local batch (its own
batch size, possibly 0, its own key order). The reference is a plain single-process lookup over the
concatenated global batch (``F.embedding_bag`` on dense tables, dense SGD / row-wise Adagrad), computed
on every rank, so each rank checks its own slice of the output and the full tables after the steps.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from vbe_lookup import _fbgemm
from vbe_lookup._features import VBEFeatures
from vbe_lookup._torch_kernel import TorchEmbeddingKernel
from vbe_lookup.errors import IndexOutOfRangeError, VBELookupError
from vbe_lookup.interfaces import EmbeddingKernel
from vbe_lookup.sharding import (
    CollectiveOrderError,
    CollectiveTimeoutError,
    KernelFactory,
    KernelSpec,
    PeerRankError,
    RowWise,
    ShardedEmbeddingBags,
    ShardedSequenceEmbeddings,
    ShardingPlan,
    ShardingPlanError,
    TableConfig,
    TableWise,
    UnknownFeatureError,
    torch_kernel_factory,
)

LR = 0.05
EPS = 1.0e-8
ATOL = RTOL = 2e-5


def close(actual: Tensor, expected: Tensor, what: str = "") -> None:
    """``assert_close`` with the tolerance of these tests (sums in another order)."""
    torch.testing.assert_close(
        actual, expected, atol=ATOL, rtol=RTOL, msg=(lambda m: f"{what}: {m}") if what else None
    )


def backward(loss: Tensor) -> None:
    """``loss.backward()`` (typed)."""
    torch.autograd.backward(loss)


TABLES = (
    TableConfig(name="t0", num_embeddings=23, embedding_dim=4, feature_names=("f0", "f1")),
    TableConfig(name="t1", num_embeddings=17, embedding_dim=8, feature_names=("f2",), pooling="mean"),
    TableConfig(name="t2", num_embeddings=11, embedding_dim=4, feature_names=("f3",)),
    TableConfig(name="t3", num_embeddings=9, embedding_dim=2, feature_names=("f4",), pooling="mean"),
)
FEATURES = ("f0", "f1", "f2", "f3", "f4")


def feature_table(feature: str) -> TableConfig:
    """The table serving ``feature``."""
    return next(t for t in TABLES if feature in t.feature_names)


def plans(world: int) -> list[ShardingPlan]:
    """Plans mixing table-wise, row-wise, several kernel groups and (for 3 ranks) a rank with no table."""
    if world == 2:
        return [
            ShardingPlan(
                world_size=2,
                placements={
                    "t0": TableWise(rank=0, group="a"),
                    "t1": TableWise(rank=1, group="a"),
                    "t2": RowWise(group="b"),
                    "t3": TableWise(rank=0, group="b"),
                },
            ),
            ShardingPlan(world_size=2, placements={t.name: RowWise() for t in TABLES}),
        ]
    return [
        ShardingPlan(
            world_size=3,
            placements={
                "t0": TableWise(rank=0, group="a"),
                "t1": TableWise(rank=2, group="a"),
                "t2": RowWise(ranks=(0, 2), group="b"),
                "t3": TableWise(rank=0, group="b"),
            },
        ),
        ShardingPlan.table_wise(TABLES, 3),
    ]


@dataclasses.dataclass(frozen=True)
class LocalBatch:
    """A rank's local batch: ``[[B]] * F`` strides, keys in a rank-specific order."""

    keys: list[str]
    values: Tensor
    lengths: Tensor
    weights: Tensor | None
    batch: int

    def features(self, device: torch.device, weights_grad: bool = False) -> VBEFeatures:
        w = None
        if self.weights is not None:
            w = self.weights.to(device).clone().requires_grad_(weights_grad)
        return VBEFeatures(
            self.keys, self.values.to(device), self.lengths.to(device), [[self.batch]] * len(self.keys), w
        )


def make_batches(seed: int, batch_sizes: Sequence[int], weighted: bool) -> list[LocalBatch]:
    """One local batch per rank (keys rotated by rank, so every rank uses a different key order)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r, b in enumerate(batch_sizes):
        keys = list(FEATURES[r % len(FEATURES) :] + FEATURES[: r % len(FEATURES)])
        lengths = torch.randint(0, 4, (len(keys) * b,), generator=gen)
        parts = []
        for i, k in enumerate(keys):
            n = int(lengths[i * b : (i + 1) * b].sum())
            parts.append(torch.randint(0, feature_table(k).num_embeddings, (n,), generator=gen))
        values = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
        out.append(LocalBatch(keys, values, lengths, weights, b))
    return out


def initial_tables(seed: int) -> dict[str, Tensor]:
    """Unsharded ``{f"{table}.weight": [rows, dim]}``."""
    gen = torch.Generator().manual_seed(seed)
    return {f"{t.name}.weight": torch.randn(t.num_embeddings, t.embedding_dim, generator=gen) for t in TABLES}


def per_feature(batch: LocalBatch, feature: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(ids, lengths [B], weights)`` of ``feature`` in ``batch``."""
    i = batch.keys.index(feature)
    b = batch.batch
    lengths = (
        batch.lengths.view(len(batch.keys), b) if b else torch.zeros(len(batch.keys), 0, dtype=torch.int64)
    )
    start = int(lengths[:i].sum())
    n = int(lengths[i].sum())
    w = None if batch.weights is None else batch.weights[start : start + n]
    return batch.values[start : start + n], lengths[i], w


class Reference:
    """Unsharded single-process lookup over the concatenated global batch, with its own optimizer."""

    def __init__(self, tables: dict[str, Tensor], optimizer: str) -> None:
        self.weights = {k: v.clone().requires_grad_(True) for k, v in tables.items()}
        self.momentum = {k: torch.zeros(v.shape[0]) for k, v in tables.items()}
        self.optimizer = optimizer

    def pooled(self, batches: list[LocalBatch], weights: Sequence[Tensor | None] | None = None) -> Tensor:
        """``[sum B, sum dims]`` pooled output, rows rank by rank, keys in ``FEATURES`` order.

        ``weights`` (per rank) default to the batches' own; a rank without weights counts as all ones.
        """
        ranks_weights = [b.weights for b in batches] if weights is None else list(weights)
        weighted = any(w is not None for w in ranks_weights)
        cols = []
        for f in FEATURES:
            table = feature_table(f)
            ids, lengths, ws = [], [], []
            for batch, w in zip(batches, ranks_weights, strict=True):
                i, n, _ = per_feature(batch, f)
                ids.append(i)
                lengths.append(n)
                if weighted:
                    ws.append(w[self._slice(batch, f)] if w is not None else torch.ones(i.numel()))
            ids_t, len_t = torch.cat(ids), torch.cat(lengths)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(len_t, 0)])
            out = F.embedding_bag(
                ids_t,
                self.weights[f"{table.name}.weight"],
                offsets,
                mode="sum",
                per_sample_weights=torch.cat(ws) if weighted else None,
                include_last_offset=True,
            )
            if table.pooling == "mean":
                out = out / len_t.clamp(min=1).to(out.dtype)[:, None]
            cols.append(out)
        return torch.cat(cols, dim=1)

    @staticmethod
    def _slice(batch: LocalBatch, feature: str) -> slice:
        i = batch.keys.index(feature)
        b = batch.batch
        lengths = (
            batch.lengths.view(len(batch.keys), b)
            if b
            else torch.zeros(len(batch.keys), 0, dtype=torch.int64)
        )
        start = int(lengths[:i].sum())
        return slice(start, start + int(lengths[i].sum()))

    def sequence(self, batches: list[LocalBatch]) -> dict[str, list[Tensor]]:
        """Per feature, per rank: ``[n, dim]`` embeddings of its ids."""
        out: dict[str, list[Tensor]] = {}
        for f in FEATURES:
            w = self.weights[f"{feature_table(f).name}.weight"]
            out[f] = [F.embedding(per_feature(b, f)[0], w) for b in batches]
        return out

    def step(self) -> None:
        """Apply the optimizer (dense SGD or row-wise Adagrad, as the fused kernels define them)."""
        with torch.no_grad():
            for k, w in self.weights.items():
                if w.grad is None:
                    continue
                g = w.grad
                if self.optimizer == "sgd":
                    w -= LR * g
                else:
                    self.momentum[k] += g.square().mean(1)
                    w -= LR * g / (self.momentum[k].sqrt() + EPS)[:, None]
                w.grad = None

    def state(self) -> dict[str, Tensor]:
        """Current tables (and momentum for Adagrad)."""
        out = {k: v.detach().clone() for k, v in self.weights.items()}
        if self.optimizer == "rowwise_adagrad":
            for k, m in self.momentum.items():
                out[k.replace(".weight", ".momentum")] = m.clone()
        return out


def grad_seed(seed: int, rows: int) -> Tensor:
    """Deterministic ``[rows, sum dims]`` upstream gradient."""
    total = sum(feature_table(f).embedding_dim for f in FEATURES)
    return torch.randn(rows, total, generator=torch.Generator().manual_seed(seed))


def check_state(module: Any, ref: Reference, what: str) -> None:
    """The gathered state dict equals the reference tables (every rank)."""
    state = module.state_dict()
    expected = ref.state()
    assert set(state) == set(expected), (sorted(state), sorted(expected))
    for k, v in expected.items():
        close(state[k].cpu(), v, f"{what}: {k}")


def train_pooled(
    module: ShardedEmbeddingBags,
    ref: Reference,
    rank: int,
    world: int,
    steps: int,
    seed: int,
    weighted: bool,
    pipelined: bool = False,
) -> None:
    """``steps`` forward/backward/update steps; compare output (and weight grads) with the reference."""
    device = module.device
    for step in range(steps):
        sizes = [(r + step + seed) % 4 for r in range(world)]  # 0 appears for some rank
        batches = make_batches(seed * 100 + step, sizes, weighted)
        want_wgrad = weighted and step == 1
        local = batches[rank].features(device, weights_grad=want_wgrad)
        if pipelined:
            dist_features = module.wait_input_dist(module.start_input_dist(local))
            module.prefetch(dist_features)
            module.enqueue_pipelined_input(dist_features)
            out = module(None)
        else:
            out = module(local)
        ref_w = [
            b.weights.clone().requires_grad_(want_wgrad) if b.weights is not None else None for b in batches
        ]
        expected = ref.pooled(batches, ref_w)
        lo = sum(sizes[:rank])
        assert out.keys() == list(FEATURES)
        assert out.key_dim() == 1
        assert out.values().shape == (sizes[rank], expected.shape[1])
        close(out.values().cpu(), expected[lo : lo + sizes[rank]].detach())
        g = grad_seed(seed * 1000 + step, sum(sizes))
        backward((out.values() * g[lo : lo + sizes[rank]].to(device)).sum())
        backward((expected * g).sum())
        ref.step()
        if want_wgrad:
            lw = local.weights_or_none()
            rw = ref_w[rank]
            assert lw is not None
            assert rw is not None
            assert lw.grad is not None
            assert rw.grad is not None
            close(lw.grad.cpu(), rw.grad)


class RecordingKernel(TorchEmbeddingKernel):
    """A ``TorchEmbeddingKernel`` with a ``prefetch`` that records how many ids it was asked for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefetched: list[tuple[int, int, list[list[int]] | None]] = []

    def prefetch(
        self, indices: Tensor, offsets: Tensor, batch_size_per_feature_per_rank: list[list[int]] | None = None
    ) -> None:
        """Record ``(ids, bags, batch sizes)``."""
        self.prefetched.append((indices.numel(), offsets.numel() - 1, batch_size_per_feature_per_rank))


def recording_factory(spec: KernelSpec) -> RecordingKernel:
    """Kernel factory for :class:`RecordingKernel` (SGD)."""
    return RecordingKernel(
        list(spec.num_embeddings),
        list(spec.embedding_dims),
        feature_table_map=list(spec.feature_table_map),
        optimizer="sgd",
        learning_rate=LR,
        device=spec.device,
    )


def mixed_factory(optimizer: str) -> KernelFactory:
    """Group ``a`` in an fbgemm TBE (when fbgemm loads), every other group in a TorchEmbeddingKernel."""

    def build(spec: KernelSpec) -> EmbeddingKernel:
        if spec.group == "a" and _fbgemm.fbgemm_available():
            tbe = _fbgemm.new_tbe(
                spec.num_embeddings,
                spec.embedding_dims,
                feature_table_map=spec.feature_table_map,
                optimizer=optimizer,
                learning_rate=LR,
                eps=EPS,
                device=spec.device,
            )
            return cast(EmbeddingKernel, tbe)
        return TorchEmbeddingKernel(
            list(spec.num_embeddings),
            list(spec.embedding_dims),
            feature_table_map=list(spec.feature_table_map),
            optimizer="rowwise_adagrad" if optimizer == "rowwise_adagrad" else "sgd",
            learning_rate=LR,
            eps=EPS,
            device=spec.device,
        )

    return build


def _device(backend: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def equivalence(rank: int, world: int, backend: str = "gloo", errors: bool = True) -> dict[str, Any]:
    """Pooled + sequence equivalence over several plans, pipelined input, prefetch, resume, errors."""
    device = _device(backend, rank)
    report: dict[str, Any] = {}
    t0 = time.monotonic()
    init = initial_tables(7)
    plan_a, plan_b = plans(world)

    # 1) SGD, weighted (weights grads too), plan A, direct forward; then resume on plan B.
    ref = Reference(init, "sgd")
    m = ShardedEmbeddingBags(
        TABLES, plan_a, kernel_factory=torch_kernel_factory(learning_rate=LR), device=device
    )
    m.load_state_dict(init)
    check_state(m, ref, "after load")
    train_pooled(m, ref, rank, world, steps=3, seed=1, weighted=True)
    check_state(m, ref, "sgd plan A")
    state = m.state_dict()
    m2 = ShardedEmbeddingBags(
        TABLES, plan_b, kernel_factory=torch_kernel_factory(learning_rate=LR), device=device
    )
    m2.load_state_dict({k: v.cpu() for k, v in state.items()})
    train_pooled(m2, ref, rank, world, steps=2, seed=2, weighted=False, pipelined=True)
    check_state(m2, ref, "sgd plan B after resume")
    report["sgd"] = True

    # 2) Row-wise Adagrad, unweighted, pipelined with prefetch (kernels with `prefetch`).
    ref = Reference(init, "rowwise_adagrad")
    m3 = ShardedEmbeddingBags(
        TABLES,
        plan_a,
        kernel_factory=mixed_factory("rowwise_adagrad"),
        device=device,
    )
    report["fbgemm_kernels"] = sum(_fbgemm.is_fbgemm_tbe(k) for k in m3.kernels())
    m3.load_state_dict(init)  # no momentum in `init`: it stays zero
    train_pooled(m3, ref, rank, world, steps=3, seed=3, weighted=False, pipelined=True)
    check_state(m3, ref, "adagrad")
    report["adagrad"] = True

    # 3) Prefetch reaches every kernel with a `prefetch`, with the ids the forward will look up.
    m4 = ShardedEmbeddingBags(TABLES, plan_a, kernel_factory=recording_factory, device=device)
    batches = make_batches(5, [2 + r for r in range(world)], weighted=False)
    dist_features = m4.wait_input_dist(m4.start_input_dist(batches[rank].features(device)))
    m4.prefetch(dist_features)
    kernels = m4.kernels()
    assert all(isinstance(k, RecordingKernel) and len(k.prefetched) == 1 for k in kernels)
    assert (
        sum(k.prefetched[0][0] for k in kernels if isinstance(k, RecordingKernel))
        == dist_features.values().numel()
    )
    report["prefetch"] = [k.prefetched[0][0] for k in kernels if isinstance(k, RecordingKernel)]

    # 4) Sequence (unpooled) lookup over the same input dist: outputs and SGD updates.
    ref = Reference(init, "sgd")
    seq = ShardedSequenceEmbeddings(
        TABLES, plan_a, kernel_factory=torch_kernel_factory(learning_rate=LR), device=device
    )
    seq.load_state_dict(init)
    for step in range(2):
        sizes = [(r + step) % 3 for r in range(world)]
        batches = make_batches(40 + step, sizes, weighted=False)
        out = seq(batches[rank].features(device))
        expected = ref.sequence(batches)
        loss = torch.zeros((), device=device)
        ref_loss = torch.zeros(())
        for f in FEATURES:
            got = out.embeddings(f)
            close(got.cpu(), expected[f][rank].detach())
            torch.testing.assert_close(out.lengths(f).cpu(), per_feature(batches[rank], f)[1])
            gens = [
                torch.randn(e.shape, generator=torch.Generator().manual_seed(step + r))
                for r, e in enumerate(expected[f])
            ]
            loss = loss + (got * gens[rank].to(device)).sum()
            ref_loss = ref_loss + sum((e * gg).sum() for e, gg in zip(expected[f], gens, strict=True))
        backward(loss)
        backward(ref_loss)
        ref.step()
    check_state(seq, ref, "sequence sgd")
    report["sequence"] = True

    if errors:
        report["errors"] = error_checks(rank, world, device)
    report["seconds"] = time.monotonic() - t0
    return report


def _error_of(call: Callable[[], object]) -> VBELookupError:
    """The VBELookupError ``call`` raises (an AssertionError when it raises none)."""
    try:
        call()
    except VBELookupError as err:
        return err
    raise AssertionError(f"{call} raised no error")


def _expect(err: VBELookupError, kind: type[VBELookupError], *texts: str) -> str:
    """Check ``err``'s type and message; return the type's name."""
    assert isinstance(err, kind), f"{type(err).__name__}: {err}"
    for text in texts:
        assert text in str(err), str(err)
    return type(err).__name__


def error_checks(rank: int, world: int, device: torch.device) -> list[str]:
    """Bad input on one rank raises a clear error on every rank, and the module keeps working."""
    seen: list[str] = []
    plan = plans(world)[0]
    m = ShardedEmbeddingBags(TABLES, plan, device=device)
    good = make_batches(9, [2] * world, weighted=False)

    # Unknown feature on the last rank only: that rank names it, the others name that rank and it.
    bad_rank = world - 1
    batch = good[rank]
    if rank == bad_rank:
        batch = dataclasses.replace(batch, keys=[*batch.keys[:-1], "nope"])
    err = _error_of(lambda: m(batch.features(device)))
    if rank == bad_rank:
        seen.append(_expect(err, UnknownFeatureError, "`nope`"))
    else:
        seen.append(_expect(err, PeerRankError, f"rank(s) {bad_rank}", "`nope`"))

    # Out-of-range id on rank 0 only.
    batch = good[rank]
    if rank == 0:
        values = batch.values.clone()
        values[0] = 1000
        batch = dataclasses.replace(batch, values=values)
    err = _error_of(lambda: m(batch.features(device)))
    seen.append(_expect(err, IndexOutOfRangeError if rank == 0 else PeerRankError, "1000"))

    # Still in step after the errors: a good batch works on every rank.
    out = m(good[rank].features(device))
    assert out.values().shape[0] == 2

    # A pipeline's order: start the next batch (bad on rank 0), run a forward in between (its own
    # collectives), then wait. On CPU the start blocks no rank and the error comes out of the wait on
    # every rank, so the forward in between still pairs up; on CUDA every rank raises at the start.
    batch = good[rank]
    if rank == 0:
        values = batch.values.clone()
        values[-1] = 2000
        batch = dataclasses.replace(batch, values=values)
    started: list[bool] = []

    def pipelined() -> None:
        handle = m.start_input_dist(batch.features(device))
        started.append(True)
        with torch.no_grad():
            m(good[rank].features(device))
        m.wait_input_dist(handle)

    err = _error_of(pipelined)
    assert started or device.type == "cuda", f"on CPU `start_input_dist` must not raise: {err!r}"
    seen.append(_expect(err, IndexOutOfRangeError if rank == 0 else PeerRankError, "2000"))
    out = m(good[rank].features(device))
    assert out.values().shape[0] == 2

    # A plan for another world size: every rank raises, nobody hangs.
    err = _error_of(
        lambda: ShardedEmbeddingBags(TABLES, ShardingPlan.table_wise(TABLES, world + 1), device=device)
    )
    seen.append(_expect(err, ShardingPlanError, f"`world_size`={world + 1}"))

    # Ranks that disagree on the plan.
    other = plans(world)[1] if rank == 0 else plan
    err = _error_of(lambda: ShardedEmbeddingBags(TABLES, other, device=device))
    seen.append(_expect(err, ShardingPlanError, "different"))

    # Unknown table in the plan on rank 0 only: its own error there, PeerRankError elsewhere.
    placements = dict(plan.placements)
    if rank == 0:
        placements["ghost"] = TableWise(rank=0)
    bad_plan = ShardingPlan(world_size=world, placements=placements)
    err = _error_of(lambda: ShardedEmbeddingBags(TABLES, bad_plan, device=device))
    seen.append(_expect(err, ShardingPlanError if rank == 0 else PeerRankError, "`ghost`"))
    return seen


def timeout_check(rank: int, world: int) -> float:
    """A peer that never joins the collective makes ``forward`` raise CollectiveTimeoutError in time."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    m = ShardedEmbeddingBags(TABLES, plans(world)[0], group, timeout=datetime.timedelta(seconds=1))
    batches = make_batches(11, [2] * world, weighted=False)
    if rank != 0:
        time.sleep(3.0)  # stay connected but never join: rank 0 must time out, not hang
        return 0.0
    start = time.monotonic()
    err = _error_of(lambda: m(batches[0].features(torch.device("cpu"))))
    _expect(err, CollectiveTimeoutError, "`timeout`=1s")
    return time.monotonic() - start


def skipped_backward_check(rank: int, world: int) -> list[str]:
    """A rank that drops a training output without backward: the peers' tables stay right, every rank
    raises a clear error at the next step, and the ranks are in step again afterwards."""
    device = torch.device("cpu")
    init = initial_tables(21)
    m = ShardedEmbeddingBags(
        TABLES, plans(world)[0], kernel_factory=torch_kernel_factory(learning_rate=LR), device=device
    )
    m.load_state_dict(init)
    sizes = [3] * world
    batches = make_batches(22, sizes, weighted=True)
    out = m(batches[rank].features(device, weights_grad=True))
    g = grad_seed(23, sum(sizes))
    lo = sum(sizes[:rank])
    if rank == world - 1:
        del out  # the skipped backward: the graph is freed, its backward all-to-alls never run
    else:
        backward((out.values() * g[lo : lo + sizes[rank]]).sum())
    seen: list[str] = []
    err = _error_of(lambda: m(batches[rank].features(device)))
    if rank == world - 1:
        seen.append(_expect(err, CollectiveOrderError, "rank(s) 1 dropped", "without running `backward`"))
    else:
        seen.append(_expect(err, PeerRankError, f"rank(s) {world - 1}", "without running `backward`"))
    # Rank 0's rows got its own gradient and none from the skipping rank (zeros), not a header or ids.
    ref = Reference(init, "sgd")
    g_kept = g.clone()
    g_kept[sum(sizes[: world - 1]) :] = 0
    backward((ref.pooled(batches) * g_kept).sum())
    ref.step()
    if rank == 0:
        for shard, weight, _ in m._local_shards():
            name = TABLES[shard.table].name
            rows = slice(shard.row_start, shard.row_start + shard.num_rows)
            close(weight, ref.weights[f"{name}.weight"][rows].detach(), f"rank 0 shard of {name}")
    # Back in step: a no-grad forward works on every rank.
    with torch.no_grad():
        assert m(batches[rank].features(device)).values().shape[0] == 3
    # Every rank dropping a grad-mode output (an evaluation without no_grad) is consistent: no error.
    before = [w.clone() for _, w, _ in m._local_shards()]
    m(batches[rank].features(device))
    assert m(batches[rank].features(device)).values().shape[0] == 3
    for (_, w, _), b in zip(m._local_shards(), before, strict=True):
        close(w, b, "tables after outputs dropped on every rank")

    # A rank whose step count differs (as if it had rebuilt its module): every rank raises.
    if rank == world - 1:
        m._input_dist._step += 1
    with torch.no_grad():
        err = _error_of(lambda: m(batches[rank].features(device)))
    seen.append(_expect(err, CollectiveOrderError, "different steps"))
    return seen


def in_flight_check(rank: int, world: int) -> int:
    """Input dists started two and three ahead of their waits (a deep pipeline), with payloads that outgrow
    the CPU exchange's capacities between a start and its wait, give what one at a time gives."""
    device = torch.device("cpu")
    batches = [make_batches(31 + k, [2 + 3 * k] * world, weighted=k % 2 == 1)[rank] for k in range(4)]
    plan = plans(world)[0]
    one_at_a_time = ShardedEmbeddingBags(TABLES, plan, device=device)
    expected = [
        one_at_a_time.wait_input_dist(one_at_a_time.start_input_dist(b.features(device))) for b in batches
    ]
    ahead = ShardedEmbeddingBags(TABLES, plan, device=device)
    handles = [ahead.start_input_dist(b.features(device)) for b in batches[:3]]
    got = [ahead.wait_input_dist(handles[0])]
    handles.append(ahead.start_input_dist(batches[3].features(device)))
    got += [ahead.wait_input_dist(h) for h in handles[1:]]
    # CUDA's protocol on gloo (the header read by the start, then one lengths-and-ids all-to-all): the same.
    header_first = ShardedEmbeddingBags(TABLES, plan, device=device)
    header_first._input_dist._payload_caps = None
    for b in batches:
        got.append(header_first.wait_input_dist(header_first.start_input_dist(b.features(device))))
    bad = batches[0]
    if rank == 0:
        bad = dataclasses.replace(bad, values=bad.values.clone().fill_(3000))
    err = _error_of(lambda: header_first.start_input_dist(bad.features(device)))
    _expect(err, IndexOutOfRangeError if rank == 0 else PeerRankError, "3000")
    bad = batches[1]
    if rank == 1:
        bad = dataclasses.replace(bad, keys=[*bad.keys[:-1], "nope"])
    err = _error_of(lambda: header_first.start_input_dist(bad.features(device)))
    _expect(err, UnknownFeatureError if rank == 1 else PeerRankError, "`nope`")
    for e, g in zip(expected * 2, got, strict=True):
        assert e.keys() == g.keys()
        assert e.stride_per_key_per_rank() == g.stride_per_key_per_rank()
        torch.testing.assert_close(g.values(), e.values())
        torch.testing.assert_close(g.lengths(), e.lengths())
        ew, gw = e.weights_or_none(), g.weights_or_none()
        assert (ew is None) == (gw is None)
        if ew is not None and gw is not None:
            torch.testing.assert_close(gw, ew)
    return len(got)


def overlap_check(rank: int, world: int) -> list[str]:
    """``set_output_dist_overlap``: a pipeline's callback, run while the output all-to-all is in flight, waits
    for the next batch's input dist there; pooled and sequence outputs, gradients and tables equal plain
    forwards'. A callback that raises (on rank 0 only) comes out of that rank's forward once the all-to-all
    completed, and the ranks stay in step: the next step raises on every rank as for a dropped output."""
    device = torch.device("cpu")
    init = initial_tables(41)
    plan = plans(world)[0]
    batches = [make_batches(42 + k, [3 + k] * world, weighted=k == 1)[rank] for k in range(3)]
    factory = torch_kernel_factory(learning_rate=LR)
    plain = ShardedEmbeddingBags(TABLES, plan, kernel_factory=factory, device=device)
    piped = ShardedEmbeddingBags(TABLES, plan, kernel_factory=factory, device=device)
    for m in (plain, piped):
        m.load_state_dict(init)
    next_dist: list[Any] = []
    pending: list[Any] = []
    calls: list[int] = []

    def prepare_next() -> None:  # what SparseDataDistUtil does there: wait for the next batch's dist
        calls.append(len(pending))
        if pending:
            next_dist.append(piped.wait_input_dist(pending.pop()))

    piped.set_output_dist_overlap(prepare_next)
    next_dist.append(piped.wait_input_dist(piped.start_input_dist(batches[0].features(device))))
    for k, batch in enumerate(batches):
        if k + 1 < len(batches):
            pending.append(piped.start_input_dist(batches[k + 1].features(device)))
        piped.enqueue_pipelined_input(next_dist.pop())
        got = piped(None)
        expected = plain(batch.features(device))
        close(got.values(), expected.values(), f"pooled output of step {k}")
        g = grad_seed(43 + k, expected.values().shape[0])
        for out in (got, expected):
            backward((out.values() * g).sum())
    assert calls == [1, 1, 0]
    for (_, a, _), (_, b, _) in zip(piped._local_shards(), plain._local_shards(), strict=True):
        close(a, b, "tables after pipelined steps")
    sequence = ShardedSequenceEmbeddings(TABLES, plan, device=device)
    seq_calls: list[int] = []
    sequence.set_output_dist_overlap(lambda: seq_calls.append(1))
    with torch.no_grad():
        sequence(batches[0].features(device))
    assert seq_calls == [1]

    seen: list[str] = []

    def fail_on_rank_0() -> None:
        if rank == 0:
            raise ValueError("store unavailable")

    piped.set_output_dist_overlap(fail_on_rank_0)
    try:
        out = piped(batches[0].features(device))
    except ValueError:
        seen.append("ValueError")
    else:
        seen.append("ok")
        backward(out.values().sum())
    piped.set_output_dist_overlap(None)
    err = _error_of(lambda: piped(batches[1].features(device)))
    seen.append(type(err).__name__)
    with torch.no_grad():  # in step again
        assert piped(batches[1].features(device)).values().shape[0] == 4
    return seen


def two_ranks(rank: int, world: int) -> dict[str, Any]:
    """Everything the 2-rank CPU test checks, in one spawn."""
    report = equivalence(rank, world)
    report["in_flight"] = in_flight_check(rank, world)
    report["overlap"] = overlap_check(rank, world)
    report["timeout_s"] = timeout_check(rank, world)
    report["skipped_backward"] = skipped_backward_check(rank, world)
    return report


def resume_n_on_m(rank: int, world: int, backend: str = "gloo") -> dict[str, Any]:
    """Train on a 2-rank subgroup, gather, resume on all ``world`` ranks with another plan."""
    device = _device(backend, rank)
    init = initial_tables(13)
    ref = Reference(init, "rowwise_adagrad")
    sub = dist.new_group(ranks=[0, 1])
    factory = torch_kernel_factory(optimizer="rowwise_adagrad", learning_rate=LR, eps=EPS)
    state: dict[str, Tensor] = {}
    small = None
    if rank < 2:
        small = ShardedEmbeddingBags(TABLES, plans(2)[0], sub, kernel_factory=factory, device=device)
        small.load_state_dict(init)
    for step in range(2):
        sizes = [(step + r) % 3 + 1 for r in range(2)]
        batches = make_batches(60 + step, sizes, weighted=True)
        expected = ref.pooled(batches)
        g = grad_seed(600 + step, sum(sizes))
        backward((expected * g).sum())
        ref.step()
        if small is not None:
            out = small(batches[rank].features(device))
            lo = sum(sizes[:rank])
            close(out.values().cpu(), expected[lo : lo + sizes[rank]].detach())
            backward((out.values() * g[lo : lo + sizes[rank]].to(device)).sum())
    if small is not None:
        state = {k: v.cpu() for k, v in small.state_dict().items()}
    # Hand rank 0's checkpoint to every rank (as a file would).
    keys = sorted(ref.state())
    for k in keys:
        t = state[k].to(device) if rank == 0 else torch.zeros_like(ref.state()[k], device=device)
        dist.broadcast(t, src=0)
        state[k] = t.cpu()
    big = ShardedEmbeddingBags(TABLES, plans(world)[1], kernel_factory=factory, device=device)
    big.load_state_dict(state)
    check_state(big, ref, "after resume on M ranks")
    train_pooled(big, ref, rank, world, steps=2, seed=5, weighted=False)
    check_state(big, ref, "resumed training")
    return {"resumed": True}


def three_ranks(rank: int, world: int) -> dict[str, Any]:
    """Everything the 3-rank CPU test checks, in one spawn."""
    report = equivalence(rank, world)
    report.update(resume_n_on_m(rank, world))
    return report


def nccl_two_ranks(rank: int, world: int) -> dict[str, Any]:
    """The 2-GPU NCCL variant: equivalence (no timeout check: it breaks an NCCL communicator)."""
    return equivalence(rank, world, backend="nccl", errors=True)
