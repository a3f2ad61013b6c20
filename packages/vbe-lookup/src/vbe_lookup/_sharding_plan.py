"""Tables, sharding plans and the layout every rank derives from them (pure Python, no collectives).

Every rank builds the same :class:`ShardingLayout` from the same tables and plan: which rank holds which
rows of which table, the kernel groups of each rank, and each rank's *slots* (the features it serves, in
kernel-group order). The input dist, the lookup and the output dist all read their metadata from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from vbe_lookup._sharding_errors import ShardingPlanError

__all__ = [
    "KernelSpec",
    "RowWise",
    "ShardingLayout",
    "ShardingPlan",
    "Slot",
    "TableConfig",
    "TableShard",
    "TableWise",
]

Pooling = Literal["sum", "mean"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TableConfig:
    """One embedding table and the features that look it up.

    Attributes:
        name: Unique table name; the state dict key is ``f"{name}.weight"``.
        num_embeddings: Rows of the (unsharded) table.
        embedding_dim: Width of each row.
        feature_names: Features served by this table (a feature names exactly one table).
        pooling: ``"sum"`` or ``"mean"`` for :class:`ShardedEmbeddingBags` (mean divides the weighted sum
            by the bag's number of ids; an empty bag gives zeros). Sequence lookups ignore it.
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]
    pooling: Pooling = "sum"

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_names", tuple(self.feature_names))
        if not self.name:
            raise ShardingPlanError("`name` must be a non-empty string")
        if self.num_embeddings < 1:
            raise ShardingPlanError(
                f"table `{self.name}`: `num_embeddings` must be >= 1, got {self.num_embeddings}"
            )
        if self.embedding_dim < 1:
            raise ShardingPlanError(
                f"table `{self.name}`: `embedding_dim` must be >= 1, got {self.embedding_dim}"
            )
        if not self.feature_names:
            raise ShardingPlanError(f"table `{self.name}`: `feature_names` is empty")
        if self.pooling not in ("sum", "mean"):
            raise ShardingPlanError(
                f"table `{self.name}`: `pooling` must be 'sum' or 'mean', got {self.pooling!r}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class TableWise:
    """Place a whole table on one rank, in kernel group ``group`` of that rank."""

    rank: int
    group: str = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class RowWise:
    """Split a table's rows over ``ranks`` (all ranks when ``None``) in contiguous, balanced ranges.

    Rank ``ranks[i]`` holds rows ``[start_i, start_i + n_i)`` with ``n_i = N // k + (i < N % k)``; an id is
    sent to the rank whose range contains it (bucketization).
    """

    ranks: tuple[int, ...] | None = None
    group: str = "default"

    def __post_init__(self) -> None:
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(self.ranks))


Placement = TableWise | RowWise


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingPlan:
    """Where every table lives: ``placements[table_name]`` for a process group of ``world_size`` ranks.

    Build one by hand or with :meth:`table_wise` (greedy balance by table size).
    """

    world_size: int
    placements: Mapping[str, Placement]

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", dict(self.placements))
        if self.world_size < 1:
            raise ShardingPlanError(f"`world_size` must be >= 1, got {self.world_size}")

    @staticmethod
    def table_wise(tables: Sequence[TableConfig], world_size: int, *, group: str = "default") -> ShardingPlan:
        """Table-wise plan placing each table (largest first) on the rank holding the fewest parameters."""
        load = [0] * world_size
        placements: dict[str, Placement] = {}
        for table in sorted(tables, key=lambda t: -t.num_embeddings * t.embedding_dim):
            rank = min(range(world_size), key=lambda r: (load[r], r))
            load[rank] += table.num_embeddings * table.embedding_dim
            placements[table.name] = TableWise(rank=rank, group=group)
        return ShardingPlan(world_size=world_size, placements=placements)


@dataclass(frozen=True, slots=True)
class TableShard:
    """Rows ``[row_start, row_start + num_rows)`` of table ``table`` held by ``rank``."""

    table: int
    rank: int
    row_start: int
    num_rows: int


@dataclass(frozen=True, slots=True)
class Slot:
    """One feature a rank serves: feature ``feature`` (global index) looked up in shard ``shard``."""

    feature: int
    shard: TableShard


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelSpec:
    """What a ``kernel_factory`` must build: one kernel for one kernel group of one rank.

    The kernel is an ``EmbeddingKernel`` (fbgemm TBE forward signature) holding ``len(num_embeddings)``
    tables (local shards), with features mapped to tables by ``feature_table_map``, **sum** pooling (the
    sharded module applies mean pooling itself, after the partial sums of row-wise shards are added), and
    its optimizer fused into the backward if it should train.

    Attributes:
        rank: The rank the kernel lives on.
        group: The plan's kernel group name.
        table_names: Table of each local shard.
        num_embeddings: Rows of each local shard.
        embedding_dims: Width of each local shard.
        row_offsets: First global row of each local shard (``0`` for table-wise).
        feature_names: Features served by the kernel, in its order.
        feature_table_map: For each feature, the index of its shard in ``table_names``.
        device: Where the kernel must live (the sharded module's device).
    """

    rank: int
    group: str
    table_names: tuple[str, ...]
    num_embeddings: tuple[int, ...]
    embedding_dims: tuple[int, ...]
    row_offsets: tuple[int, ...]
    feature_names: tuple[str, ...]
    feature_table_map: tuple[int, ...]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLayout:
    """What one rank holds: its kernel groups (in order) and its slots (group → feature within group)."""

    kernels: tuple[KernelSpec, ...]
    slots: tuple[Slot, ...]
    slot_dims: tuple[int, ...] = field(default=())


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingLayout:
    """The layout every rank derives from ``(tables, plan)``; identical on all ranks.

    Attributes:
        tables: The tables, in the given order.
        features: Every feature name in global order (table order, then feature order within a table);
            the pooled output's keys follow it.
        feature_table: Table index of each feature.
        shards: For each table, its shards (one for table-wise, one per rank for row-wise).
        ranks: For each rank, its :class:`RankLayout`.
        fingerprint: A 63-bit hash of tables and plan, compared across ranks at construction.
    """

    tables: tuple[TableConfig, ...]
    features: tuple[str, ...]
    feature_table: tuple[int, ...]
    shards: tuple[tuple[TableShard, ...], ...]
    ranks: tuple[RankLayout, ...]
    fingerprint: int

    @property
    def world_size(self) -> int:
        """Number of ranks of the plan."""
        return len(self.ranks)

    @staticmethod
    def build(tables: Sequence[TableConfig], plan: ShardingPlan) -> ShardingLayout:
        """Validate ``tables`` against ``plan`` and derive the layout.

        Raises:
            ShardingPlanError: duplicate table or feature names, a table without placement or a
                placement without table, a rank outside ``[0, world_size)``, or a row-wise table with
                fewer rows than ranks.
        """
        tables = tuple(tables)
        world = plan.world_size
        if not tables:
            raise ShardingPlanError("`tables` is empty: a sharded module needs at least one table")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ShardingPlanError(f"`tables` has duplicate names: {', '.join(dup)}")
        unknown = sorted(set(plan.placements) - set(names))
        if unknown:
            raise ShardingPlanError(
                f"`plan` places table(s) {', '.join(f'`{n}`' for n in unknown)}, which are not in `tables` "
                f"(tables: {', '.join(names)})"
            )
        features: list[str] = []
        feature_table: list[int] = []
        for ti, table in enumerate(tables):
            for f in table.feature_names:
                if f in features:
                    other = tables[feature_table[features.index(f)]].name
                    raise ShardingPlanError(
                        f"feature `{f}` is served by two tables, `{other}` and `{table.name}`; "
                        "a feature must name exactly one table"
                    )
                features.append(f)
                feature_table.append(ti)

        shards: list[tuple[TableShard, ...]] = []
        groups: list[str] = []
        table_group: list[str] = []
        for ti, table in enumerate(tables):
            placement = plan.placements.get(table.name)
            if placement is None:
                raise ShardingPlanError(
                    f"table `{table.name}` has no placement in `plan` (placed: {', '.join(plan.placements)})"
                )
            if isinstance(placement, TableWise):
                _check_rank(placement.rank, world, table.name)
                shards.append((TableShard(ti, placement.rank, 0, table.num_embeddings),))
            elif isinstance(placement, RowWise):
                ranks = placement.ranks if placement.ranks is not None else tuple(range(world))
                if not ranks:
                    raise ShardingPlanError(f"table `{table.name}`: row-wise `ranks` is empty")
                if len(set(ranks)) != len(ranks):
                    raise ShardingPlanError(f"table `{table.name}`: row-wise `ranks` repeats a rank: {ranks}")
                for r in ranks:
                    _check_rank(r, world, table.name)
                if table.num_embeddings < len(ranks):
                    raise ShardingPlanError(
                        f"table `{table.name}`: row-wise over {len(ranks)} ranks needs `num_embeddings` >= "
                        f"{len(ranks)}, got {table.num_embeddings}"
                    )
                base, extra = divmod(table.num_embeddings, len(ranks))
                start = 0
                row_shards = []
                for i, r in enumerate(ranks):
                    n = base + (1 if i < extra else 0)
                    row_shards.append(TableShard(ti, r, start, n))
                    start += n
                shards.append(tuple(row_shards))
            else:
                raise ShardingPlanError(
                    f"table `{table.name}`: placement must be TableWise or RowWise, got {placement!r}"
                )
            if placement.group not in groups:
                groups.append(placement.group)
            table_group.append(placement.group)

        rank_layouts: list[RankLayout] = []
        for rank in range(world):
            kernels: list[KernelSpec] = []
            slots: list[Slot] = []
            dims: list[int] = []
            for group in groups:
                local = [
                    s
                    for ti, ts in enumerate(shards)
                    for s in ts
                    if s.rank == rank and table_group[ti] == group
                ]
                if not local:
                    continue
                feat_names: list[str] = []
                ftm: list[int] = []
                for li, shard in enumerate(local):
                    table = tables[shard.table]
                    for f in table.feature_names:
                        feat_names.append(f)
                        ftm.append(li)
                        slots.append(Slot(features.index(f), shard))
                        dims.append(table.embedding_dim)
                kernels.append(
                    KernelSpec(
                        rank=rank,
                        group=group,
                        table_names=tuple(tables[s.table].name for s in local),
                        num_embeddings=tuple(s.num_rows for s in local),
                        embedding_dims=tuple(tables[s.table].embedding_dim for s in local),
                        row_offsets=tuple(s.row_start for s in local),
                        feature_names=tuple(feat_names),
                        feature_table_map=tuple(ftm),
                    )
                )
            rank_layouts.append(RankLayout(kernels=tuple(kernels), slots=tuple(slots), slot_dims=tuple(dims)))

        digest = hashlib.sha256(repr((tables, sorted(plan.placements.items()), world)).encode()).digest()
        fingerprint = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
        return ShardingLayout(
            tables=tables,
            features=tuple(features),
            feature_table=tuple(feature_table),
            shards=tuple(shards),
            ranks=tuple(rank_layouts),
            fingerprint=fingerprint,
        )


def _check_rank(rank: int, world: int, table: str) -> None:
    if not 0 <= rank < world:
        raise ShardingPlanError(f"table `{table}`: rank {rank} is outside the plan's `world_size` of {world}")
