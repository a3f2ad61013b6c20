"""Batch planning: input checks and output layout of one call (:class:`Plan`), and the per-table grouping of its
ids into unique rows with the transpose backward needs (:class:`TableGroup`). All host-side."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ssd_tbe_adapter._checks import describe
from ssd_tbe_adapter.errors import InvalidArgumentError

__all__ = [
    "BatchGroups",
    "Plan",
    "TableGroup",
    "check_offset_values",
    "device_inverse",
    "group_batch",
    "plan_batch",
    "sort_with_order",
]


@dataclass(slots=True)
class TableGroup:
    """The unique ids of one table in one batch and, per feature of the table, its lookups into them.

    Also the transpose of the lookups for backward (all host, built once per batch, on the prefetch
    thread when there is a prefetch): the table's lookups sorted by unique row (``order``), the bag of
    each of them, numbered over the table's features in feature order (``sorted_bags``), and the CSR
    offsets of each unique row's lookups (``row_offsets``), so a row gradient is one ``embedding_bag``.
    """

    unique: torch.Tensor  # [U] int64 host, ascending
    inverse: list[torch.Tensor]  # per feature of the table: [N_f] int64 host, positions in `unique`
    order: torch.Tensor  # [N_t] int64 host: lookups of the table (features concatenated) by unique row
    sorted_bags: torch.Tensor  # [N_t] int64 host: bag (over the table's features) of each sorted lookup
    row_offsets: torch.Tensor  # [U + 1] int64 host: lookups of unique row u are order[ro[u]:ro[u+1]]


class BatchGroups:
    """:class:`TableGroup` of every table of one batch, and the same grouping over all tables at once.

    The batch-wide arrays number the unique rows of every table together, in table order (table ascending, then
    id: table ``t``'s rows are a contiguous run), so one pooled lookup and one transpose serve all tables (the
    fused host-cache step of ``_module``). All host int64. The per-table groups (:attr:`tables`) are built on
    first use only: the fused step needs none of them, only each table's run of unique ids (:meth:`unique_of`).

    Attributes:
        names: the tables present in the batch, ascending.
        unique: ``[U]`` every table's unique ids, table after table (ascending within a table).
        bounds: per table of ``names``, its run ``(lo, hi)`` in ``unique``.
        inverse: ``[N]`` each lookup's row among all tables' unique rows.
        sorted_bags: ``[N]`` the bag (over the whole batch) of each lookup, sorted by unique row.
        row_offsets: ``[U + 1]`` lookups of unique row ``u`` are ``sorted_bags[ro[u]:ro[u+1]]``.
        slots: per table whose rows were all cached after its prefetch: their cache slots (``[U_t]`` int64 host,
            in ``unique_of(table)`` order; forward checks that each slot still holds its id before using them).
        slab_rows: ``[U]`` int64 host, the slab row of every unique row when the prefetch's survey found them
            all cached in the tier's slab (``None`` otherwise), valid while the slab's ``generation`` is still
            :attr:`slab_generation` (no cached row was dropped since).
    """

    __slots__ = (
        "_build",
        "_tables",
        "_unique_of",
        "bounds",
        "inverse",
        "names",
        "row_offsets",
        "slab_generation",
        "slab_rows",
        "slots",
        "sorted_bags",
        "unique",
    )

    def __init__(
        self,
        *,
        names: list[int],
        unique: np.ndarray[Any, np.dtype[np.int64]],
        bounds: list[tuple[int, int]],
        inverse: torch.Tensor,
        sorted_bags: torch.Tensor,
        row_offsets: torch.Tensor,
        build: Callable[[], dict[int, TableGroup]],
    ) -> None:
        self.names = names
        self.unique = unique
        self.bounds = bounds
        self.inverse = inverse
        self.sorted_bags = sorted_bags
        self.row_offsets = row_offsets
        self.slots: dict[int, torch.Tensor] = {}
        self.slab_rows: np.ndarray[Any, np.dtype[np.int64]] | None = None
        self.slab_generation = -1
        self._build: Callable[[], dict[int, TableGroup]] | None = build
        self._tables: dict[int, TableGroup] | None = None
        self._unique_of: list[torch.Tensor | None] = [None] * len(names)

    @property
    def tables(self) -> dict[int, TableGroup]:
        """Per table present in the batch (ascending), its :class:`TableGroup` (built at the first access)."""
        if self._tables is None:
            build = self._build
            assert build is not None  # set until the first build
            self._tables = build()
            self._build = None
            for position, ids in enumerate(self._unique_of):  # one tensor per table's ids, as before
                if ids is not None:
                    self._tables[self.names[position]].unique = ids
        return self._tables

    def unique_of(self, position: int) -> torch.Tensor:
        """The unique ids (``[U_t]`` int64 host, ascending) of table ``names[position]`` (one tensor per table and
        batch, so the slots vouched for it are recognised: :meth:`TableCache.holds`)."""
        ids = self._unique_of[position]
        if ids is None:
            tables = self._tables
            if tables is not None:
                ids = tables[self.names[position]].unique
            else:
                lo, hi = self.bounds[position]
                ids = torch.from_numpy(self.unique[lo:hi])
            self._unique_of[position] = ids
        return ids


@dataclass(slots=True)
class Plan:
    """Host-side description of one forward call (validated inputs, layout, per-table unique ids)."""

    num_bags: list[int]  # per feature
    bag_start: list[int]  # per feature, into offsets
    offsets: torch.Tensor  # [num_bags_total + 1] int64 host (check_offsets=False: the caller's tensor)
    groups: dict[int, TableGroup]
    vbe: bool
    batch_size: int  # non-VBE only
    # VBE blocks per feature: (first bag within the feature, bags, output element offset)
    blocks: list[list[tuple[int, int, int]]] = field(default_factory=list)
    output_numel: int = 0
    # per table whose unique rows were all cached at forward: their slots (backward checks they still are)
    slots: dict[int, torch.Tensor] = field(default_factory=dict)
    batch: BatchGroups | None = None  # the grouping ``groups`` came from (``groups is batch.tables``)
    # The fused host-cache step (``_module``): every unique row's slab slot ([U] int64 host, in
    # ``batch`` order) when the forward pooled all tables at once, and the output row of each bag.
    fused_slots: torch.Tensor | None = None
    bag_rows: torch.Tensor | None = None


def plan_batch(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    batch_sizes: list[list[int]] | None,
    vbe_output: torch.Tensor | None,
    vbe_output_offsets: torch.Tensor | None,
    *,
    feature_table_map: Sequence[int],
    dims: Sequence[int],
    device: torch.device,
    host_indices: bool = True,
    check_offsets: bool = True,
) -> tuple[Plan, torch.Tensor]:
    """Check one forward's (or prefetch's) inputs and lay out its bags and output (no grouping yet).

    ``host_indices=False`` skips copying ``indices`` to the host (the device cache path never needs them
    there). ``check_offsets=False`` skips copying ``offsets`` to the host and checking its values (the device
    cache path checks them on the device, read together with its slot counts: one host sync fewer); the
    plan's ``offsets`` is then the caller's tensor, unchecked, and only its length is used here.

    Returns:
        The plan (``groups`` empty) and ``indices`` as int64 on the host (``indices`` itself when
        ``host_indices`` is false).
    """
    num_features = len(feature_table_map)
    for name, tensor in (("indices", indices), ("offsets", offsets)):
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dim() != 1
            or tensor.dtype not in (torch.int32, torch.int64)
        ):
            raise InvalidArgumentError(f"`{name}` must be a 1-D int32/int64 tensor, got {describe(tensor)}")
        if tensor.device != device:
            raise InvalidArgumentError(f"`{name}` is on {tensor.device}, this module on {device}")
    if offsets.numel() < 1:
        raise InvalidArgumentError("`offsets` must hold at least one element (offsets[0] == 0)")
    indices_cpu = indices.to("cpu", torch.int64) if host_indices else indices
    total_bags = offsets.numel() - 1
    if check_offsets:
        offsets_cpu = offsets.to("cpu", torch.int64)
        values = offsets_cpu.numpy()  # numpy: a fraction of torch's per-op cost on these small arrays
        decreasing = bool(total_bags and (values[1:] < values[:-1]).any())
        check_offset_values(int(values[0]), int(values[-1]), indices_cpu.numel(), decreasing=decreasing)
    else:
        offsets_cpu = offsets
        if total_bags == 0 and indices.numel():  # the device check needs a bag to put each lookup in
            raise InvalidArgumentError(
                f"`offsets` must start at 0 and end at len(indices)={indices.numel()}, got one element"
            )
    if per_sample_weights is not None and (
        per_sample_weights.dim() != 1
        or not per_sample_weights.is_floating_point()
        or per_sample_weights.numel() != indices_cpu.numel()
        or per_sample_weights.device != device
    ):
        raise InvalidArgumentError(
            f"`per_sample_weights` must be a [{indices_cpu.numel()}] float tensor on {device}, "
            f"got {describe(per_sample_weights)}"
        )
    vbe = batch_sizes is not None
    blocks: list[list[tuple[int, int, int]]] = []
    output_numel = 0
    batch_size = 0
    if batch_sizes is not None:
        if len(batch_sizes) != num_features or not batch_sizes:
            raise InvalidArgumentError(
                f"`batch_size_per_feature_per_rank` must have one list per feature ({num_features}), "
                f"got {len(batch_sizes)}"
            )
        ranks = len(batch_sizes[0])
        if (
            ranks < 1
            or any(len(row) != ranks for row in batch_sizes)
            or any((not isinstance(b, int)) or b < 0 for row in batch_sizes for b in row)
        ):
            raise InvalidArgumentError(
                f"`batch_size_per_feature_per_rank` must be [F={num_features}][R] non-negative ints, "
                f"got {batch_sizes!r}"
            )
        num_bags = [sum(row) for row in batch_sizes]
        batch_key = tuple(map(tuple, batch_sizes))
        feature_dims = tuple(dims[table] for table in feature_table_map)
        if sum(num_bags) != total_bags:
            raise InvalidArgumentError(
                f"`batch_size_per_feature_per_rank` sums to {sum(num_bags)} bags, `offsets` has {total_bags}"
            )
        if vbe_output_offsets is not None and vbe_output is None:
            raise InvalidArgumentError("`vbe_output_offsets` was given without `vbe_output`")
        if vbe_output is not None:
            if vbe_output_offsets is None:
                raise InvalidArgumentError("`vbe_output` was given without `vbe_output_offsets`")
            if (
                vbe_output.dim() != 1
                or vbe_output.dtype != torch.float32
                or not vbe_output.is_contiguous()
                or vbe_output.device != device
            ):
                raise InvalidArgumentError(
                    f"`vbe_output` must be a contiguous 1-D float32 tensor on {device}, got {describe(vbe_output)}"
                )
            if tuple(vbe_output_offsets.shape) != (
                ranks,
                num_features,
            ) or vbe_output_offsets.dtype not in (
                torch.int32,
                torch.int64,
            ):
                raise InvalidArgumentError(
                    f"`vbe_output_offsets` must be [R={ranks}, F={num_features}] int64, got {describe(vbe_output_offsets)}"
                )
            starts = _host_starts(vbe_output_offsets)
            layout = _cached_vbe_blocks(batch_key, feature_dims, starts, vbe_output.numel())
        else:
            layout = _cached_vbe_blocks(batch_key, feature_dims, None, 0)
        blocks = [list(feature_blocks) for feature_blocks in layout[0]]
        output_numel = layout[1]
    else:
        if vbe_output is not None or vbe_output_offsets is not None:
            raise InvalidArgumentError("`vbe_output` needs `batch_size_per_feature_per_rank` (VBE)")
        if total_bags % num_features:
            raise InvalidArgumentError(
                f"`offsets` holds {total_bags} bags, not a multiple of the {num_features} features"
            )
        batch_size = total_bags // num_features
        num_bags = [batch_size] * num_features
    bag_start = [0] * num_features
    for feature in range(1, num_features):
        bag_start[feature] = bag_start[feature - 1] + num_bags[feature - 1]
    plan = Plan(
        num_bags=num_bags,
        bag_start=bag_start,
        offsets=offsets_cpu,
        groups={},
        vbe=vbe,
        batch_size=batch_size,
        blocks=blocks,
        output_numel=output_numel,
    )
    return plan, indices_cpu


_Blocks = tuple[tuple[tuple[int, int, int], ...], ...]


def _vbe_blocks(
    batch_sizes: tuple[tuple[int, ...], ...],
    feature_dims: tuple[int, ...],
    starts: tuple[tuple[int, ...], ...] | None,
    output_numel: int,
) -> tuple[_Blocks, int]:
    """The VBE blocks per feature (first bag within the feature, bags, output element offset) and the output's
    size: at ``starts`` (``[R][F]``, in an output of ``output_numel`` elements) when given, else packed rank →
    feature → sample → dim. Raises :class:`InvalidArgumentError` for a block that does not fit."""
    num_features = len(feature_dims)
    ranks = len(batch_sizes[0])
    if starts is None:
        packed = [[0] * num_features for _ in range(ranks)]
        cursor = 0
        for rank in range(ranks):
            for feature in range(num_features):
                packed[rank][feature] = cursor
                cursor += batch_sizes[feature][rank] * feature_dims[feature]
        starts = tuple(map(tuple, packed))
        output_numel = cursor
    blocks = []
    for feature, dim in enumerate(feature_dims):
        feature_blocks = []
        first = 0
        for rank in range(ranks):
            bags = batch_sizes[feature][rank]
            start = starts[rank][feature]
            if bags and (start < 0 or start + bags * dim > output_numel):
                raise InvalidArgumentError(
                    f"`vbe_output_offsets`[{rank}][{feature}] = {start}: block of {bags}x{dim} "
                    f"does not fit in `vbe_output` of {output_numel} elements"
                )
            feature_blocks.append((first, bags, start))
            first += bags
        blocks.append(tuple(feature_blocks))
    return tuple(blocks), output_numel


# The packed layouts of recent batch shapes (a prefetch and its forward plan the same batch; a trainer's
# batches repeat a few shapes): the per-(rank, feature) loops run once per shape.
_cached_vbe_blocks = functools.lru_cache(maxsize=256)(_vbe_blocks)

# Host copies of `vbe_output_offsets` tensors, per tensor: a caller (vbe-lookup) keeps one such tensor per
# batch layout, so reading its values once per tensor (not per call) takes the host sync off the step and
# lets the forward run under CUDA graph capture. Keyed by id() with a weak reference that must still point
# at the very tensor; an in-place change of the tensor (its version counter) reads it again.
_MAX_STARTS = 256
_starts_of: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[tuple[int, ...], ...]]] = {}
_starts_lock = threading.Lock()


def _host_starts(vbe_output_offsets: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The values of ``vbe_output_offsets`` on the host (read once per tensor and version)."""
    key, version = id(vbe_output_offsets), vbe_output_offsets._version
    with _starts_lock:
        cached = _starts_of.get(key)
    if cached is not None and cached[0]() is vbe_output_offsets and cached[1] == version:
        return cached[2]
    rows: list[list[int]] = vbe_output_offsets.to("cpu", torch.int64).tolist()
    starts = tuple(tuple(row) for row in rows)
    with _starts_lock:
        if len(_starts_of) >= _MAX_STARTS:
            _starts_of.clear()
        _starts_of[key] = (weakref.ref(vbe_output_offsets), version, starts)
    return starts


def check_offset_values(first: int, last: int, lookups: int, *, decreasing: bool = False) -> None:
    """Raise :class:`InvalidArgumentError` unless ``offsets`` starts at 0, ends at ``lookups`` and (``decreasing``
    false) never decreases."""
    if first != 0 or last != lookups:
        raise InvalidArgumentError(
            f"`offsets` must start at 0 and end at len(indices)={lookups}, got {first} .. {last}"
        )
    if decreasing:
        raise InvalidArgumentError("`offsets` must be non-decreasing")


@dataclass(frozen=True, slots=True)
class _GroupLayout:
    """What :func:`group_batch` derives from a batch's bag layout and offsets alone (not from its ids)."""

    offsets: np.ndarray[Any, np.dtype[np.int64]]  # the batch's offsets (compared on reuse)
    first: int  # first lookup of the first feature
    counts: list[int]  # lookups per feature
    tables: np.ndarray[Any, np.dtype[np.int64]]  # [N] table of each lookup
    local_position: np.ndarray[Any, np.dtype[np.int64]]  # [N] position within its table's lookups
    local_bag: np.ndarray[Any, np.dtype[np.int64]]  # [N] bag within its table's bags
    bag: np.ndarray[Any, np.dtype[np.int64]]  # [N] bag of each lookup within the batch
    num_groups: int  # table numbers are < this
    names: list[int]  # the tables, ascending
    features: dict[int, list[int]]  # per table, its features in order
    lookup_lo: np.ndarray[Any, np.dtype[np.int64]]  # per table of `names`: its lookups in the sorted batch
    lookup_hi: np.ndarray[Any, np.dtype[np.int64]]
    table_lookups: np.ndarray[Any, np.dtype[np.int64]]  # lookup_hi - lookup_lo
    table_starts: np.ndarray[Any, np.dtype[np.int64]]  # lookup_lo of the tables with lookups
    table_bounds: np.ndarray[Any, np.dtype[np.int64]]  # lookup_lo then lookup_hi
    # The (table, position) part of :func:`sort_with_order`'s keys, ``table << (id_bits + position_bits) |
    # position`` ([N]), so a batch adds only its ids (``None`` when fewer than 2 lookups or no id bits are left).
    sort_base: np.ndarray[Any, np.dtype[np.int64]] | None
    id_bits: int
    position_bits: int

    @property
    def size(self) -> int:
        """Lookups and offsets held (what :class:`_GroupLayouts` budgets)."""
        return int(self.tables.shape[0] + self.offsets.shape[0])


def _group_layout(
    offsets: np.ndarray[Any, np.dtype[np.int64]],
    num_bags: Sequence[int],
    bag_start: Sequence[int],
    feature_table_map: Sequence[int],
) -> _GroupLayout:
    num_features = len(feature_table_map)
    total_bags = bag_start[-1] + num_bags[-1] if num_features else 0
    # Lookups of feature f: [bounds[f], bounds[f + 1]) (features are contiguous, in order).
    bounds = offsets[np.array([*bag_start, total_bags], dtype=np.int64)]
    counts = np.diff(bounds)
    tables = np.asarray(feature_table_map, dtype=np.int64)
    # Where each feature starts within its table's concatenation of features (lookups and bags), as a shift
    # from its position in the batch.
    lookup_shift = np.empty(num_features, dtype=np.int64)
    bag_shift = np.empty(num_features, dtype=np.int64)
    table_lookups: dict[int, int] = {}
    table_bags: dict[int, int] = {}
    features: dict[int, list[int]] = {}
    for feature, table in enumerate(feature_table_map):
        lookup_shift[feature] = bounds[feature] - bounds[0] - table_lookups.get(table, 0)
        bag_shift[feature] = bag_start[feature] - table_bags.get(table, 0)
        table_lookups[table] = table_lookups.get(table, 0) + int(counts[feature])
        table_bags[table] = table_bags.get(table, 0) + num_bags[feature]
        features.setdefault(table, []).append(feature)
    n = int(bounds[-1] - bounds[0])
    lengths = np.diff(offsets[: total_bags + 1])
    names = sorted(features)
    # Sorted by (table, id), the lookups of table names[i] come after those of every smaller table.
    sizes = np.array([table_lookups[table] for table in names], dtype=np.int64)
    lookup_hi = np.cumsum(sizes)
    bag = np.repeat(np.arange(total_bags, dtype=np.int64), lengths)[:n]
    lookup_tables = np.repeat(tables, counts)
    num_groups = int(tables.max()) + 1 if num_features else 1
    lookup_lo = lookup_hi - sizes
    # sort_with_order's key layout for this batch size and table count.
    position_bits = (n - 1).bit_length() if n else 0
    id_bits = 63 - position_bits - (num_groups - 1).bit_length()
    sort_base = None
    if n >= 2 and id_bits > 0:
        sort_base = lookup_tables << (id_bits + position_bits)
        sort_base |= np.arange(n, dtype=np.int64)
    return _GroupLayout(
        offsets=offsets.copy(),
        first=int(bounds[0]),
        counts=counts.tolist(),
        tables=lookup_tables,
        local_position=np.arange(n, dtype=np.int64) - np.repeat(lookup_shift, counts),
        local_bag=bag - np.repeat(bag_shift, counts),
        bag=bag,
        num_groups=num_groups,
        names=names,
        features=features,
        lookup_lo=lookup_lo,
        lookup_hi=lookup_hi,
        table_lookups=sizes,
        table_starts=lookup_lo[sizes > 0],
        table_bounds=np.concatenate([lookup_lo, lookup_hi]),
        sort_base=sort_base,
        id_bits=id_bits,
        position_bits=position_bits,
    )


def _sort_batch(
    layout: _GroupLayout, ids: np.ndarray[Any, np.dtype[np.int64]]
) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
    """``sort_with_order(ids, layout.tables, layout.num_groups)``, the same keys, with the layout's part of them
    computed once per layout."""
    base = layout.sort_base
    if base is None:
        return sort_with_order(ids, layout.tables, layout.num_groups)
    low, high = int(ids.min()), int(ids.max())
    if (high - low) >> layout.id_bits:
        return sort_with_order(ids, layout.tables, layout.num_groups)
    keys = ids - low
    keys <<= layout.position_bits
    keys |= base
    keys.sort()
    order = keys & ((1 << layout.position_bits) - 1)
    return order, ids[order]


class _GroupLayouts:
    """Recent :class:`_GroupLayout`s by bag layout, their offsets compared on reuse (a trainer's batches repeat a
    few shapes; fixed-size batches of fixed-length bags one). Holds at most ``budget`` lookups and offsets in all."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self.layouts: dict[tuple[tuple[int, ...], tuple[int, ...]], _GroupLayout] = {}
        self.lock = threading.Lock()  # prefetch jobs and forwards without one group on different threads

    def get(self, plan: Plan, feature_table_map: Sequence[int]) -> _GroupLayout:
        offsets = plan.offsets.numpy()
        key = (tuple(feature_table_map), tuple(plan.num_bags))
        with self.lock:
            layout = self.layouts.pop(key, None)
            if layout is not None:
                self.held -= layout.size
                if not np.array_equal(layout.offsets, offsets):
                    layout = None
        if layout is None:
            layout = _group_layout(offsets, plan.num_bags, plan.bag_start, feature_table_map)
        size = layout.size
        if size <= self.budget:
            with self.lock:
                while self.layouts and self.held + size > self.budget:
                    oldest = next(iter(self.layouts))
                    self.held -= self.layouts.pop(oldest).size
                self.layouts[key] = layout  # the newest last
                self.held += size
        return layout


# About 70 MB of layouts at most (eight int64 arrays per lookup, with the sort keys' layout part).
_LAYOUTS = _GroupLayouts(1 << 20)


def group_batch(plan: Plan, indices_cpu: torch.Tensor, feature_table_map: Sequence[int]) -> BatchGroups:
    """Per table: unique ids of the batch, each feature's lookups into them, and their transpose (host); and
    the same over all tables at once (see :class:`BatchGroups`).

    One sort of every lookup of the batch by ``(table, id)`` gives all tables' unique ids, inverses and
    transposes together (numpy over the whole batch). Here only the batch-wide arrays are made; the per-table
    groups are slices and shifts of the same results, taken when :attr:`BatchGroups.tables` is first read, so
    the host work per batch does not grow with the number of tables (no per-row or per-table array pass). What
    depends on the bag layout and offsets alone is computed once per layout (:class:`_GroupLayouts`).
    """
    layout = _LAYOUTS.get(plan, feature_table_map)
    n = layout.tables.shape[0]
    ids = indices_cpu.numpy()[layout.first : layout.first + n]
    # The order within one (table, id) does not matter (it only orders the terms of that row's gradient sum).
    order, sorted_ids = _sort_batch(layout, ids)
    is_first = np.empty(n + 1, dtype=np.bool_)
    if n:
        is_first[0] = True
        np.not_equal(sorted_ids[1:], sorted_ids[:-1], out=is_first[1:n])
        is_first[layout.table_starts] = True  # a table's first lookup
    is_first[n] = True  # past the end: `starts` ends with n
    starts = np.flatnonzero(is_first)
    unique_ids = sorted_ids[starts[:-1]]
    # firsts[p]: unique rows among the sorted lookups before p.
    firsts = np.cumsum(is_first, dtype=np.int64)
    firsts -= is_first
    unique_bounds = firsts[layout.table_bounds].tolist()
    unique_lo, unique_hi = unique_bounds[: len(layout.names)], unique_bounds[len(layout.names) :]
    # Position of each sorted lookup's row among all unique rows.
    rank = firsts[1 : n + 1] - 1
    batch_inverse = np.empty(n, dtype=np.int64)
    batch_inverse[order] = rank

    def build() -> dict[int, TableGroup]:
        # Then among its table's unique rows.
        local = rank - np.repeat(np.asarray(unique_lo, dtype=np.int64), layout.table_lookups)
        inverse_np = np.empty(n, dtype=np.int64)
        inverse_np[order] = local
        inverse = torch.from_numpy(inverse_np).split_with_sizes(layout.counts)
        sorted_local = layout.local_position[order]
        sorted_bags = layout.local_bag[order]
        groups: dict[int, TableGroup] = {}
        for i, table in enumerate(layout.names):
            lo, hi, u_lo, u_hi = (
                int(layout.lookup_lo[i]),
                int(layout.lookup_hi[i]),
                unique_lo[i],
                unique_hi[i],
            )
            groups[table] = TableGroup(
                unique=torch.from_numpy(unique_ids[u_lo:u_hi]),
                inverse=[inverse[feature] for feature in layout.features[table]],
                order=torch.from_numpy(sorted_local[lo:hi]),
                sorted_bags=torch.from_numpy(sorted_bags[lo:hi]),
                # starts[u_hi] is the next table's first lookup (hi), or n after the last table.
                row_offsets=torch.from_numpy(starts[u_lo : u_hi + 1] - lo),
            )
        return groups

    return BatchGroups(
        names=layout.names,
        unique=unique_ids,
        bounds=list(zip(unique_lo, unique_hi, strict=True)),
        inverse=torch.from_numpy(batch_inverse),
        sorted_bags=torch.from_numpy(layout.bag[order]),
        row_offsets=torch.from_numpy(starts),
        build=build,
    )


def device_inverse(plan: Plan, feature_table_map: Sequence[int], device: torch.device) -> list[torch.Tensor]:
    """Per feature: its lookups into its table's unique rows, on the device."""
    cursor: dict[int, int] = {}
    out: list[torch.Tensor] = []
    for table in feature_table_map:
        position = cursor.get(table, 0)
        cursor[table] = position + 1
        out.append(plan.groups[table].inverse[position].to(device, non_blocking=True))
    return out


def sort_with_order(
    ids: np.ndarray[Any, np.dtype[np.int64]],
    groups: np.ndarray[Any, np.dtype[np.int64]] | None = None,
    num_groups: int = 1,
) -> tuple[np.ndarray[Any, np.dtype[np.int64]], np.ndarray[Any, np.dtype[np.int64]]]:
    """``(order, ids[order])`` with ``ids[order]`` ascending (order among equal ids unspecified); with
    ``groups`` (``[N]`` in ``[0, num_groups)``), ordered by ``(groups, ids)``.

    When the group, the id range and the positions fit together in 63 bits (ids of a few billion rows), sorts
    ``group << a | (id - min) << b | position`` keys with one ``np.sort``, about 3x faster than ``np.argsort``;
    otherwise falls back to ``np.argsort`` (``np.lexsort`` with groups).
    """
    n = ids.shape[0]
    if n < 2:
        return np.arange(n, dtype=np.int64), ids.copy()
    low, high = int(ids.min()), int(ids.max())
    bits = (n - 1).bit_length()
    group_bits = (num_groups - 1).bit_length() if groups is not None else 0
    id_bits = 63 - bits - group_bits
    if id_bits <= 0 or (high - low) >> id_bits:
        order = np.argsort(ids) if groups is None else np.lexsort((ids, groups))
        return order, ids[order]
    keys = ids - low if low else ids.copy()
    if groups is not None and group_bits:
        keys |= groups << id_bits
    keys <<= bits
    keys |= np.arange(n, dtype=np.int64)
    keys.sort()
    order = keys & ((1 << bits) - 1)
    return order, ids[order]
