"""``TorchEmbeddingKernel``: a pure-PyTorch table-batched pooled embedding kernel with TBE's signature.

It is the reference the other kernels are tested against and the fallback where fbgemm is missing
(CUDA included). Like fbgemm's TBE, the optimizer is fused into the backward: when the gradient of the
pooled output reaches the kernel, the touched rows are updated in place and no ``.grad`` is stored.

Storage: the tables are grouped by embedding dim; each dim has one ``[rows, D]`` tensor holding its
tables one after the other, and ``split_embedding_weights()`` hands out row-range views of them. A
forward runs one ``F.embedding_bag`` per distinct dim, then writes the bags into the 1-D VBE output
with one cached-index copy per dim. On CPU the ids are split by dim once (one stable sort), so each
dim pools and updates only its own ids; on CUDA (where the split sizes would be a host sync) each dim
reads every id, other dims' ids with weight 0.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from vbe_lookup._compat import eager_only
from vbe_lookup.errors import BatchLayoutError, ConfigurationError

__all__ = ["Optimizer", "Pooling", "TorchEmbeddingKernel"]

Pooling = Literal["sum", "mean"]
Optimizer = Literal["sgd", "rowwise_adagrad"]

_MAX_CACHED_LAYOUTS = 64
_MAX_EXTERNAL_OFFSETS = 4


@dataclass(frozen=True, slots=True, eq=False)
class _DimGroup:
    """Tables of one embedding dim, stored one after the other in one ``[rows, dim]`` tensor."""

    dim: int
    tables: tuple[int, ...]
    row_offsets: tuple[int, ...]  # first row of each table in the group's tensor
    rows: int


@dataclass(frozen=True, slots=True, eq=False)
class _GroupLayout:
    """Where the bags of one dim group go, for one batch-size layout (all on the kernel's device)."""

    bag_index: torch.Tensor | None  # [n] long: the group's bags among all bags (None: every bag)
    local_of_bag: torch.Tensor | None  # [num_bags] long: index among the group's bags (0 for others)
    block_of_bag: torch.Tensor  # [n] long: flat [R, F] block (rank * F + feature) of each bag
    local_start: torch.Tensor  # [n] long: sample * dim inside the block
    positions: torch.Tensor  # [n * dim / granule] long: rows of the own output viewed [-1, granule]
    granule: int  # elements per index entry: divides dim, every block start and the output size
    dim: int
    # Positions in callers' `vbe_output`s, keyed by the offsets tensor (identity, storage, version).
    external: OrderedDict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, int]] = field(
        default_factory=OrderedDict
    )


@dataclass(frozen=True, slots=True, eq=False)
class _Layout:
    """Per batch-size-layout metadata, computed once on the host and cached on the device."""

    num_bags: int
    bag_feature: torch.Tensor  # [num_bags] long
    bag_ids: torch.Tensor  # [num_bags] long: arange(num_bags), kept on the device
    groups: tuple[_GroupLayout | None, ...]  # per dim group; None when it has no bag
    output_size: int
    output_shape: tuple[int, ...]
    num_ranks: int


class TorchEmbeddingKernel(nn.Module):
    """Pure-PyTorch pooled embedding kernel with fbgemm TBE's forward signature and fused optimizer.

    Args:
        num_embeddings: rows of each table (an int for one table).
        embedding_dims: dim of each table (an int: the same dim for every table).
        feature_table_map: table of each feature (default: feature ``i`` reads table ``i``).
        pooling: ``"sum"`` or ``"mean"`` (mean divides by the bag length; an empty bag gives 0).
        optimizer: ``"sgd"`` or ``"rowwise_adagrad"`` fused into the backward (fbgemm's
            ``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD``), or ``None``: the tables are ordinary
            ``nn.Parameter`` s that receive dense ``.grad`` for an optimizer of your own.
        learning_rate: step size of the fused optimizer.
        eps: Adagrad's epsilon (``w -= lr * g / (sqrt(m) + eps)``).
        weights_dtype: dtype of the tables (float32, float16 or bfloat16).
        output_dtype: dtype of the pooled output (default: ``weights_dtype``).
        device: where the tables live.
        init_range: tables start uniform in ``[-init_range, init_range]``
            (default ``1 / sqrt(rows)`` per table).
    """

    supports_vbe_output = True

    def __init__(
        self,
        num_embeddings: int | Sequence[int],
        embedding_dims: int | Sequence[int],
        *,
        feature_table_map: Sequence[int] | None = None,
        pooling: Pooling = "sum",
        optimizer: Optimizer | None = "sgd",
        learning_rate: float = 0.01,
        eps: float = 1.0e-8,
        weights_dtype: torch.dtype = torch.float32,
        output_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_range: float | None = None,
    ) -> None:
        super().__init__()
        rows, dims = _table_shapes(num_embeddings, embedding_dims)
        if pooling not in ("sum", "mean"):
            raise ConfigurationError(f"`pooling` must be 'sum' or 'mean', got {pooling!r}")
        if optimizer not in ("sgd", "rowwise_adagrad", None):
            raise ConfigurationError(
                f"`optimizer` must be 'sgd', 'rowwise_adagrad' or None, got {optimizer!r}"
            )
        if not (learning_rate >= 0 and math.isfinite(learning_rate)):
            raise ConfigurationError(f"`learning_rate` must be a finite number >= 0, got {learning_rate!r}")
        if weights_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ConfigurationError(
                f"`weights_dtype` must be float32, float16 or bfloat16, got {weights_dtype}"
            )
        ftm = list(range(len(rows))) if feature_table_map is None else [int(t) for t in feature_table_map]
        bad = [t for t in ftm if not 0 <= t < len(rows)]
        if bad or not ftm:
            raise ConfigurationError(
                f"`feature_table_map` must name tables 0..{len(rows) - 1} and be non-empty, got {ftm}"
            )
        self.num_embeddings_per_table: tuple[int, ...] = tuple(rows)
        self.embedding_dims_per_table: tuple[int, ...] = tuple(dims)
        self.feature_table_map: tuple[int, ...] = tuple(ftm)
        self.pooling: Pooling = pooling
        self.optimizer: Optimizer | None = optimizer
        self.learning_rate = float(learning_rate)
        self.eps = float(eps)
        self.weights_dtype = weights_dtype
        self.output_dtype: torch.dtype = weights_dtype if output_dtype is None else output_dtype

        groups: list[_DimGroup] = []
        for dim in sorted(set(dims)):
            tables = tuple(t for t in range(len(rows)) if dims[t] == dim)
            starts = [0]
            for t in tables:
                starts.append(starts[-1] + rows[t])
            groups.append(_DimGroup(dim, tables, tuple(starts[:-1]), starts[-1]))
        self._dim_groups: tuple[_DimGroup, ...] = tuple(groups)
        table_group = {t: (g, g_i) for g_i, g in enumerate(groups) for t in g.tables}
        self._feature_group: tuple[int, ...] = tuple(table_group[t][1] for t in ftm)
        self._feature_row_offset: tuple[int, ...] = tuple(
            table_group[t][0].row_offsets[table_group[t][0].tables.index(t)] for t in ftm
        )

        for g_i, g in enumerate(groups):
            weight = torch.empty(g.rows, g.dim, dtype=weights_dtype, device=device)
            with torch.no_grad():
                for t, start in zip(g.tables, g.row_offsets, strict=True):
                    bound = init_range if init_range is not None else 1.0 / math.sqrt(max(rows[t], 1))
                    weight[start : start + rows[t]].uniform_(-bound, bound)
            if optimizer is None:
                self.register_parameter(f"weights_{g_i}", nn.Parameter(weight))
            else:
                self.register_buffer(f"weights_{g_i}", weight)
            if optimizer == "rowwise_adagrad":
                self.register_buffer(
                    f"momentum_{g_i}", torch.zeros(g.rows, dtype=torch.float32, device=device)
                )
        # Constant per-feature metadata, moved with the module (non-persistent: not model state).
        self.register_buffer(
            "_feature_row_offset_t",
            torch.tensor(self._feature_row_offset, dtype=torch.long, device=device),
            persistent=False,
        )
        self.register_buffer(
            "_feature_group_t",
            torch.tensor(self._feature_group, dtype=torch.long, device=device),
            persistent=False,
        )
        self._layouts: OrderedDict[tuple[Any, ...], _Layout] = OrderedDict()

    _feature_row_offset_t: torch.Tensor
    _feature_group_t: torch.Tensor

    # ------------------------------------------------------------------ description
    @property
    def num_features(self) -> int:
        """Number of features (``len(feature_table_map)``)."""
        return len(self.feature_table_map)

    def feature_dims(self) -> list[int]:
        """Embedding dim of each feature."""
        return [self.embedding_dims_per_table[t] for t in self.feature_table_map]

    def feature_num_embeddings(self) -> list[int]:
        """Rows of the table each feature reads."""
        return [self.num_embeddings_per_table[t] for t in self.feature_table_map]

    def _weights(self, g_i: int) -> torch.Tensor:
        weight = getattr(self, f"weights_{g_i}")
        assert isinstance(weight, torch.Tensor)
        return weight

    def _momentum(self, g_i: int) -> torch.Tensor:
        momentum = getattr(self, f"momentum_{g_i}")
        assert isinstance(momentum, torch.Tensor)
        return momentum

    def split_embedding_weights(self) -> list[torch.Tensor]:
        """One ``[rows_t, dim_t]`` tensor per table: writable views of the storage (no autograd)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.num_embeddings_per_table)
        for g_i, g in enumerate(self._dim_groups):
            weight = self._weights(g_i).detach()
            for t, start in zip(g.tables, g.row_offsets, strict=True):
                out[t] = weight[start : start + self.num_embeddings_per_table[t]]
        return out

    def split_optimizer_states(self) -> list[torch.Tensor]:
        """Row-wise Adagrad: one ``[rows_t]`` float32 momentum view per table; otherwise an empty list."""
        if self.optimizer != "rowwise_adagrad":
            return []
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.num_embeddings_per_table)
        for g_i, g in enumerate(self._dim_groups):
            momentum = self._momentum(g_i)
            for t, start in zip(g.tables, g.row_offsets, strict=True):
                out[t] = momentum[start : start + self.num_embeddings_per_table[t]]
        return out

    # ------------------------------------------------------------------ layout
    @eager_only  # host-side metadata, cached per layout: keep it out of graphs
    def _layout(self, num_bags: int, batch_sizes: list[list[int]] | None, device: torch.device) -> _Layout:
        key: tuple[Any, ...] = (
            num_bags,
            None if batch_sizes is None else tuple(tuple(row) for row in batch_sizes),
            device,
        )
        layout = self._layouts.get(key)
        if layout is not None:
            self._layouts.move_to_end(key)
            return layout
        layout = self._build_layout(num_bags, batch_sizes, device)
        self._layouts[key] = layout
        if len(self._layouts) > _MAX_CACHED_LAYOUTS:
            self._layouts.popitem(last=False)
        return layout

    def _build_layout(
        self, num_bags: int, batch_sizes: list[list[int]] | None, device: torch.device
    ) -> _Layout:
        n_features = self.num_features
        dims = self.feature_dims()
        if batch_sizes is None:
            if num_bags % n_features:
                raise BatchLayoutError(
                    f"`offsets` holds {num_bags} bags, not a multiple of the {n_features} features; "
                    "pass `batch_size_per_feature_per_rank` for variable batch sizes"
                )
            batch = num_bags // n_features
            total_dim = sum(dims)
            dim_offset = [0]
            for d in dims:
                dim_offset.append(dim_offset[-1] + d)
            # Bag (f, b) starts at b * sum(dims) + dim_offset[f]; "block" = feature, rank 0.
            bag_feature = torch.arange(n_features).repeat_interleave(batch)
            sample = torch.arange(batch).repeat(n_features)
            block_start = torch.tensor(dim_offset[:-1], dtype=torch.long)
            block_of_bag = bag_feature.clone()
            local = sample * total_dim
            output_size, num_ranks = batch * total_dim, 1
            output_shape: tuple[int, ...] = (batch, total_dim)
            sample_stride = total_dim  # bags of one feature are `total_dim` apart: the granule divides it
        else:
            num_ranks = len(batch_sizes[0]) if batch_sizes else 0
            # Vectorized over the [F, R] batch sizes: O(F * R) work and no per-(feature, rank) tensors.
            bs = torch.tensor(batch_sizes, dtype=torch.long).reshape(n_features, num_ranks)
            dim_t = torch.tensor(dims, dtype=torch.long)
            per_feature_t = bs.sum(1)
            bag_feature = torch.arange(n_features).repeat_interleave(per_feature_t, output_size=num_bags)
            sizes = (bs * dim_t[:, None]).t().reshape(-1)
            block_start = torch.cumsum(sizes, 0) - sizes  # own [R, F] offsets, rank-major
            rank_of_bag = (
                torch.arange(num_ranks)
                .repeat(n_features)
                .repeat_interleave(bs.reshape(-1), output_size=num_bags)
            )
            bag_start_of_block = (torch.cumsum(bs, 1) - bs).reshape(-1)  # [F * R], feature-major
            feature_start = torch.cumsum(per_feature_t, 0) - per_feature_t
            sample = (
                torch.arange(num_bags)
                - feature_start[bag_feature]
                - bag_start_of_block[bag_feature * num_ranks + rank_of_bag]
            )
            block_of_bag = rank_of_bag * n_features + bag_feature
            local = sample * dim_t[bag_feature]
            output_size = int(sizes.sum())
            output_shape = (output_size,)
            sample_stride = 0  # bags of a block are `dim` apart, which the granule divides
        feature_group = torch.tensor(self._feature_group, dtype=torch.long)
        block_feature = torch.arange(block_start.numel()) % n_features  # blocks are [R, F], rank-major
        groups: list[_GroupLayout | None] = []
        for g_i, g in enumerate(self._dim_groups):
            mine = feature_group[bag_feature] == g_i
            bag_index = torch.nonzero(mine).reshape(-1)
            if bag_index.numel() == 0:
                groups.append(None)
                continue
            blocks, starts = block_of_bag[bag_index], local[bag_index]
            # The group's block starts ([R, F] blocks, not its bags: O(F * R) host values).
            own_starts = block_start[feature_group[block_feature] == g_i].tolist()
            granule = math.gcd(g.dim, output_size, sample_stride, *own_starts)
            positions = _granule_rows(block_start[blocks] + starts, g.dim, granule)
            single = len(self._dim_groups) == 1
            local_of_bag = torch.zeros(num_bags, dtype=torch.long)
            local_of_bag[bag_index] = torch.arange(bag_index.numel())
            groups.append(
                _GroupLayout(
                    bag_index=None if single else bag_index.to(device),
                    local_of_bag=None if single else local_of_bag.to(device),
                    block_of_bag=blocks.to(device),
                    local_start=starts.to(device),
                    positions=positions.to(device),
                    granule=granule,
                    dim=g.dim,
                )
            )
        return _Layout(
            num_bags=num_bags,
            bag_feature=bag_feature.to(device),
            bag_ids=torch.arange(num_bags, device=device),
            groups=tuple(groups),
            output_size=output_size,
            output_shape=output_shape,
            num_ranks=num_ranks,
        )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        vbe_output: torch.Tensor | None = None,
        vbe_output_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled lookup (fbgemm TBE semantics).

        Args:
            indices: ``[N]`` int32/int64 ids, bag after bag (feature → rank → sample).
            offsets: ``[num_bags + 1]`` bag boundaries into ``indices``: start at 0, never decrease,
                end at ``len(indices)``. Checked on CPU (a clear :class:`BatchLayoutError`); on CUDA they
                are trusted, as fbgemm's TBE trusts them (checking would read them back to the host every
                call); :class:`~vbe_lookup.GroupedVBELookup` builds them from the lengths.
            per_sample_weights: ``[N]`` float weights multiplying each id's row, or ``None``.
            batch_size_per_feature_per_rank: ``[F][R]`` batch sizes (VBE) or ``None`` (every feature
                has ``num_bags / F`` samples).
            vbe_output: 1-D tensor of ``output_dtype`` to write the VBE blocks into (VBE only).
            vbe_output_offsets: ``[R, F]`` int64 start of block (rank ``r``, feature ``f``) in
                ``vbe_output``, on its device.

        Returns:
            VBE: 1-D ``rank → feature → sample → dim`` output (``vbe_output`` itself when given, so
            several kernels can chain into one buffer and one backward reaches all of them);
            otherwise ``[B, sum(dims)]``.
        """
        num_bags = offsets.numel() - 1
        if indices.dim() != 1 or offsets.dim() != 1 or num_bags < 0:
            raise BatchLayoutError(
                f"`indices` and `offsets` must be 1-D with len(offsets) >= 1, got {tuple(indices.shape)} "
                f"and {tuple(offsets.shape)}"
            )
        if offsets.device.type == "cpu":
            _check_offsets(offsets, indices.numel())
        batch_sizes = batch_size_per_feature_per_rank
        layout = self._checked_layout(num_bags, batch_sizes, indices.device)
        if (vbe_output is None) != (vbe_output_offsets is None):
            raise BatchLayoutError("`vbe_output` and `vbe_output_offsets` must be given together")
        if vbe_output is not None and vbe_output_offsets is not None:
            if batch_sizes is None:
                raise BatchLayoutError("`vbe_output` needs `batch_size_per_feature_per_rank` (VBE)")
            ranks = len(batch_sizes[0]) if batch_sizes else 0
            if vbe_output.dim() != 1 or vbe_output.dtype != self.output_dtype:
                raise BatchLayoutError(
                    f"`vbe_output` must be a 1-D {self.output_dtype} tensor, got {vbe_output.dtype} "
                    f"{tuple(vbe_output.shape)}"
                )
            if tuple(vbe_output_offsets.shape) != (ranks, self.num_features):
                raise BatchLayoutError(
                    f"`vbe_output_offsets` must be [{ranks}, {self.num_features}] (ranks, features), "
                    f"got {tuple(vbe_output_offsets.shape)}"
                )
        if self.optimizer is None:
            plan = _Plan(self, layout, indices, offsets, per_sample_weights, vbe_output_offsets)
            weights = [self._weights(g_i) for g_i in range(len(self._dim_groups))]
            if vbe_output is None:
                pooled: torch.Tensor = plan.pool(None, weights)
                if not pooled.requires_grad and torch.is_grad_enabled():
                    # No bag at all (an empty batch): still part of the graph, as fbgemm's output is, so that
                    # a backward through it works and gives the tables and the weights zero gradients.
                    for tensor in [*weights, *([] if per_sample_weights is None else [per_sample_weights])]:
                        if tensor.requires_grad:
                            pooled = pooled + tensor.sum().to(pooled.dtype) * 0
                return pooled
            return plan.write_into(vbe_output, weights)
        return _fused_lookup(
            self, layout, indices, offsets, per_sample_weights, vbe_output, vbe_output_offsets
        )

    @eager_only  # host-side metadata, cached per layout: keep it out of graphs
    def _checked_layout(
        self, num_bags: int, batch_sizes: list[list[int]] | None, device: torch.device
    ) -> _Layout:
        """The cached layout of these batch sizes; validated only when first seen (a cached layout was)."""
        if batch_sizes is not None:
            key = (num_bags, tuple(map(tuple, batch_sizes)), device)
            hit = self._layouts.get(key)
            if hit is not None:
                self._layouts.move_to_end(key)
                return hit
            batch_sizes = [[int(b) for b in row] for row in batch_sizes]
            if len(batch_sizes) != self.num_features or sum(sum(row) for row in batch_sizes) != num_bags:
                raise BatchLayoutError(
                    f"`batch_size_per_feature_per_rank` must have {self.num_features} rows summing to the "
                    f"{num_bags} bags of `offsets`, got {batch_sizes}"
                )
        return self._layout(num_bags, batch_sizes, device)

    def extra_repr(self) -> str:
        return (
            f"tables={len(self.num_embeddings_per_table)}, features={self.num_features}, "
            f"dims={sorted(set(self.embedding_dims_per_table))}, pooling={self.pooling}, "
            f"optimizer={self.optimizer}, lr={self.learning_rate}"
        )


@eager_only
def _fused_lookup(
    kernel: TorchEmbeddingKernel,
    layout: _Layout,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    vbe_output: torch.Tensor | None,
    vbe_output_offsets: torch.Tensor | None,
) -> torch.Tensor:
    """The fused-optimizer lookup. Under ``torch.compile`` it runs as one opaque eager region, like
    fbgemm's TBE operator: its backward updates tables in place, which graphs cannot express."""
    plan = _Plan(kernel, layout, indices, offsets, per_sample_weights, vbe_output_offsets)
    # A 0-element input that requires grad, so the fused backward runs even when nothing else does.
    placeholder = torch.zeros(0, device=indices.device, requires_grad=True)
    out = _FusedLookup.apply(plan, placeholder, per_sample_weights, vbe_output)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    assert isinstance(out, torch.Tensor)
    return out


@eager_only  # reads offsets on the host (CPU only): keep it out of graphs
def _check_offsets(offsets: torch.Tensor, nnz: int) -> None:
    """``offsets`` start at 0, never decrease and end at ``nnz`` (CPU tensors: no device sync)."""
    if offsets.is_floating_point() or offsets.dtype == torch.bool:
        raise BatchLayoutError(f"`offsets` must be an integer tensor, got {offsets.dtype}")
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        raise BatchLayoutError(f"`offsets` must start at 0, got offsets[0] = {first}")
    if offsets.numel() > 1:
        decreasing = offsets[1:] < offsets[:-1]
        if bool(decreasing.any()):
            i = int(torch.nonzero(decreasing)[0, 0])
            raise BatchLayoutError(
                f"`offsets` must never decrease, got offsets[{i}] = {int(offsets[i])} > "
                f"offsets[{i + 1}] = {int(offsets[i + 1])}"
            )
    if last != nnz:
        raise BatchLayoutError(f"`offsets` must end at len(`indices`) = {nnz}, got offsets[-1] = {last}")


def _table_shapes(
    num_embeddings: int | Sequence[int], embedding_dims: int | Sequence[int]
) -> tuple[list[int], list[int]]:
    rows = [int(num_embeddings)] if isinstance(num_embeddings, int) else [int(n) for n in num_embeddings]
    if isinstance(embedding_dims, int):
        dims = [int(embedding_dims)] * len(rows)
    else:
        dims = [int(d) for d in embedding_dims]
        if isinstance(num_embeddings, int):
            rows = rows * len(dims)
    if len(rows) != len(dims) or not rows:
        raise ConfigurationError(
            f"`num_embeddings` ({len(rows)} tables) and `embedding_dims` ({len(dims)} tables) must describe "
            "the same non-zero number of tables"
        )
    if any(n <= 0 for n in rows) or any(d <= 0 for d in dims):
        raise ConfigurationError(
            f"every table needs rows > 0 and dim > 0, got `num_embeddings`={rows}, `embedding_dims`={dims}"
        )
    return rows, dims


GRANULE_ATTRIBUTE = "_vbe_lookup_granule"


def _granule_rows(bag_starts: torch.Tensor, dim: int, granule: int) -> torch.Tensor:
    """``[n * dim / granule]`` rows of a 1-D output viewed ``[-1, granule]`` covering bags of ``dim``
    elements starting at ``bag_starts`` (all multiples of ``granule``)."""
    per_bag = dim // granule
    return (
        torch.div(bag_starts, granule, rounding_mode="floor")[:, None]
        + torch.arange(per_bag, device=bag_starts.device)
    ).reshape(-1)


class _Plan:
    """One call's inputs and derived per-id tensors, shared by forward and the fused backward."""

    def __init__(
        self,
        kernel: TorchEmbeddingKernel,
        layout: _Layout,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        vbe_output_offsets: torch.Tensor | None,
    ) -> None:
        self.kernel = kernel
        self.layout = layout
        nnz = indices.numel()
        self.offsets = offsets.to(torch.long)
        self.bag_lengths = self.offsets[1:] - self.offsets[:-1]
        # Bag and feature of every id, without a host sync (output_size is known from the shape).
        self.bag_of_id = torch.repeat_interleave(layout.bag_ids, self.bag_lengths, output_size=nnz)
        feature_of_id = layout.bag_feature.index_select(0, self.bag_of_id)
        self.rows = indices.to(torch.long) + kernel._feature_row_offset_t.index_select(0, feature_of_id)
        self.multi_group = len(kernel._dim_groups) > 1
        self.group_of_id = (
            kernel._feature_group_t.index_select(0, feature_of_id) if self.multi_group else None
        )
        self.per_sample_weights = per_sample_weights
        self.vbe_output_offsets = vbe_output_offsets
        self.nnz = nnz
        # Several dims on CPU: split the ids by dim group once (a stable sort keeps each bag's ids in
        # order), so every group pools and updates only its own ids: one pass over the ids in all,
        # whatever the number of dims. The split sizes are a host read, free on CPU; on CUDA that read
        # would be a sync per call, so there each group masks the others' ids instead (weight 0).
        self.group_ids: list[torch.Tensor] | None = None
        if self.group_of_id is not None and indices.device.type == "cpu":
            order = torch.sort(self.group_of_id, stable=True).indices
            sizes = torch.bincount(self.group_of_id, minlength=len(kernel._dim_groups)).tolist()
            self.group_ids = list(torch.split(order, sizes))

    def group_rows_and_weights(
        self, g_i: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of group ``g_i`` and their per-id weights.

        With ``group_ids`` (CPU): only the group's own ids. Otherwise every id, other groups' ids reading
        row 0 with weight 0.
        """
        psw = self.per_sample_weights
        if not self.multi_group:
            return self.rows, None if psw is None else psw.to(dtype)
        if self.group_ids is not None:
            ids = self.group_ids[g_i]
            return self.rows.index_select(0, ids), None if psw is None else psw.index_select(0, ids).to(dtype)
        assert self.group_of_id is not None
        mine = self.group_of_id == g_i
        rows = torch.where(mine, self.rows, torch.zeros_like(self.rows))
        weight = mine.to(dtype) if psw is None else psw.to(dtype) * mine.to(dtype)
        return rows, weight

    def positions(self, group: _GroupLayout) -> tuple[torch.Tensor, int]:
        """Rows of the output viewed ``[-1, granule]`` holding the group's bags, and the granule."""
        offsets = self.vbe_output_offsets
        if offsets is None:
            return group.positions, group.granule
        # A grouped lookup passes the same cached offsets tensor every step of a layout: build once.
        key = (id(offsets), offsets.data_ptr(), offsets._version)
        hit = group.external.get(key)
        if hit is not None:
            return hit[1], hit[2]
        # The grouped lookup tags its offsets with a granule dividing every offset and the total.
        granule = math.gcd(group.dim, int(getattr(offsets, GRANULE_ATTRIBUTE, 1)))
        flat = offsets.reshape(-1).to(torch.long)
        starts = flat.index_select(0, group.block_of_bag) + group.local_start
        positions = _granule_rows(starts, group.dim, granule)
        # Keep `offsets` alive with the entry so its id cannot be reused by another tensor.
        group.external[key] = (offsets, positions, granule)
        if len(group.external) > _MAX_EXTERNAL_OFFSETS:
            group.external.popitem(last=False)
        return positions, granule

    def bag_lengths_of(self, group: _GroupLayout) -> torch.Tensor:
        """``[n_bags_g]`` lengths of the group's bags."""
        if group.bag_index is None:
            return self.bag_lengths
        return self.bag_lengths.index_select(0, group.bag_index)

    def pooled(self, g_i: int, weight: torch.Tensor) -> torch.Tensor:
        """``[n_bags_g, dim]`` pooled bags of dim group ``g_i`` in the weights' dtype."""
        group = self.layout.groups[g_i]
        assert group is not None
        rows, psw = self.group_rows_and_weights(g_i, weight.dtype)
        if self.group_ids is not None:
            # The group's ids only, bag after bag of its own bags: offsets from their lengths.
            offsets = torch.zeros(group.block_of_bag.numel() + 1, dtype=torch.long)
            torch.cumsum(self.bag_lengths_of(group), 0, out=offsets[1:])
            pooled = F.embedding_bag(
                rows, weight, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
            )
        else:
            pooled = F.embedding_bag(
                rows, weight, self.offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
            )
            if group.bag_index is not None:
                pooled = pooled.index_select(0, group.bag_index)
        if self.kernel.pooling == "mean":
            pooled = pooled / self.bag_lengths_of(group).clamp(min=1).to(pooled.dtype)[:, None]
        return pooled

    def pool(self, vbe_output: torch.Tensor | None, weights: list[torch.Tensor]) -> torch.Tensor:
        """Forward: every dim group's bags written into ``vbe_output`` (or a new output)."""
        if vbe_output is None:
            # Every element is written exactly once (every bag belongs to one dim group).
            out = torch.empty(
                self.layout.output_size, dtype=self.kernel.output_dtype, device=self.rows.device
            )
        else:
            out = vbe_output
        for g_i, group in enumerate(self.layout.groups):
            if group is None:
                continue
            pooled = self.pooled(g_i, weights[g_i])
            rows, granule = self.positions(group)
            out.view(-1, granule).index_copy_(0, rows, pooled.to(out.dtype).reshape(-1, granule))
        if vbe_output is None:
            return out.view(self.layout.output_shape)
        return out

    def write_into(self, vbe_output: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """Differentiable write of every dim group's bags into ``vbe_output`` (plain-autograd kernels).

        ``vbe_output`` may be the tensor a custom autograd function (fbgemm's TBE) returned as-is, on which
        autograd forbids in-place ops; :class:`_WriteInto` writes inside its own forward and returns it as
        fbgemm does.
        """
        out = vbe_output
        for g_i, group in enumerate(self.layout.groups):
            if group is None:
                continue
            pooled = self.pooled(g_i, weights[g_i])
            rows, granule = self.positions(group)
            out = _WriteInto.apply(out, rows, granule, pooled)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        return out


class _WriteInto(torch.autograd.Function):
    """``out.view(-1, granule)[rows] = pooled`` inside a custom function, returning ``out`` as-is.

    The gradient passes through to ``out`` (the earlier kernels of a chain read only their own blocks)
    and is gathered for ``pooled``.
    """

    @staticmethod
    def forward(
        ctx: Any, out: torch.Tensor, rows: torch.Tensor, granule: int, pooled: torch.Tensor
    ) -> torch.Tensor:
        out.view(-1, granule).index_copy_(0, rows, pooled.to(out.dtype).reshape(-1, granule))
        ctx.save_for_backward(rows)
        ctx.granule = granule
        ctx.pooled_shape = pooled.shape
        ctx.pooled_dtype = pooled.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, torch.Tensor]:
        (rows,) = ctx.saved_tensors
        grad_pooled = grad.reshape(-1, ctx.granule).index_select(0, rows)
        return grad, None, None, grad_pooled.reshape(ctx.pooled_shape).to(ctx.pooled_dtype)


class _FusedLookup(torch.autograd.Function):
    """Forward pooling; backward applies the kernel's optimizer to the touched rows in place."""

    @staticmethod
    def forward(
        ctx: Any,
        plan: _Plan,
        placeholder: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        vbe_output: torch.Tensor | None,
    ) -> torch.Tensor:
        kernel = plan.kernel
        weights = [kernel._weights(g_i) for g_i in range(len(kernel._dim_groups))]
        out = plan.pool(vbe_output, weights)
        ctx.plan = plan
        ctx.chained = vbe_output is not None
        # `vbe_output` is returned as-is, NOT marked dirty: fbgemm's TBE does the same, and the tensor it
        # returns is a view "created inside a custom Function" that `mark_dirty` (an in-place op for
        # autograd) refuses. Our backward passes the gradient through to `vbe_output`.
        return out

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[None, None, torch.Tensor | None, torch.Tensor | None]:
        plan: _Plan = ctx.plan
        kernel = plan.kernel
        grad_flat = grad_output.reshape(-1).contiguous()
        psw_grad: torch.Tensor | None = None
        if ctx.needs_input_grad[2]:
            psw_grad = torch.zeros(plan.nnz, dtype=torch.float32, device=grad_flat.device)
        with torch.no_grad():
            for g_i, group in enumerate(plan.layout.groups):
                if group is None:
                    continue
                weight = kernel._weights(g_i)
                rows_of_out, granule = plan.positions(group)
                grad_bags = (
                    grad_flat.view(-1, granule)
                    .index_select(0, rows_of_out)
                    .view(-1, group.dim)
                    .to(torch.float32)
                )
                if kernel.pooling == "mean":
                    grad_bags = grad_bags / plan.bag_lengths_of(group).clamp(min=1).to(torch.float32)[:, None]
                rows, id_weight = plan.group_rows_and_weights(g_i, torch.float32)
                ids = None if plan.group_ids is None else plan.group_ids[g_i]
                # Group-local bag of every id read (masked path: other groups' ids, bag 0 with weight 0).
                bag_of_id = plan.bag_of_id if ids is None else plan.bag_of_id.index_select(0, ids)
                local_bag = (
                    bag_of_id if group.local_of_bag is None else group.local_of_bag.index_select(0, bag_of_id)
                )
                if psw_grad is not None:
                    grad_of_id = grad_bags.index_select(0, local_bag)
                    contribution = (grad_of_id * weight.index_select(0, rows).to(torch.float32)).sum(1)
                    if ids is not None:
                        psw_grad.index_add_(0, ids, contribution)
                    else:
                        if plan.group_of_id is not None:
                            contribution = contribution * (plan.group_of_id == g_i).to(torch.float32)
                        psw_grad += contribution
                seg_row, seg_grad = _row_gradients(rows, local_bag, grad_bags, id_weight)
                _apply_update(kernel, g_i, weight, seg_row, seg_grad)
        weights_grad = None
        if psw_grad is not None and plan.per_sample_weights is not None:
            weights_grad = psw_grad.to(plan.per_sample_weights.dtype)
        return None, None, weights_grad, grad_output if ctx.chained else None


def _row_gradients(
    rows: torch.Tensor,
    local_bag: torch.Tensor,
    grad_bags: torch.Tensor,
    id_weight: torch.Tensor | None,
    *,
    compact: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient summed per distinct row: ``(rows [K], grads [K, dim])``.

    ``grad(row) = sum over ids i reading row of id_weight[i] * grad_bags[local_bag[i]]``, computed as
    one ``F.embedding_bag`` over the ids sorted by row (a fused gather-reduce). On CUDA the number of
    distinct rows is not asked from the host: ``K = len(rows)`` and the slots past the last distinct row
    hold row 0 with a zero gradient, which leaves row 0 unchanged. On CPU (where a sync is free) the
    result is compact (``compact`` overrides the choice).
    """
    n = rows.numel()
    sorted_rows, order = torch.sort(rows)
    if compact if compact is not None else rows.device.type == "cpu":
        seg_row, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
        seg_offsets = torch.zeros(seg_row.numel() + 1, dtype=torch.long)
        torch.cumsum(counts, 0, out=seg_offsets[1:])
    else:
        is_start = torch.ones(n, dtype=torch.bool, device=rows.device)
        is_start[1:] = sorted_rows[1:] != sorted_rows[:-1]
        segment = torch.cumsum(is_start, 0) - 1
        positions = torch.arange(n, device=rows.device)
        seg_offsets = torch.full((n + 1,), n, dtype=torch.long, device=rows.device)
        seg_offsets.scatter_reduce_(0, segment, positions, reduce="amin")
        seg_row = torch.zeros_like(rows).scatter_(0, segment, sorted_rows)
    seg_grad = F.embedding_bag(
        local_bag.index_select(0, order),
        grad_bags,
        seg_offsets,
        mode="sum",
        per_sample_weights=None if id_weight is None else id_weight.index_select(0, order),
        include_last_offset=True,
    )
    return seg_row, seg_grad


def _apply_update(
    kernel: TorchEmbeddingKernel,
    g_i: int,
    weight: torch.Tensor,
    seg_row: torch.Tensor,
    seg_grad: torch.Tensor,
) -> None:
    """In-place ``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD`` step from per-row gradients (no host sync)."""
    if seg_row.numel() == 0:
        return
    lr = kernel.learning_rate
    if kernel.optimizer == "sgd":
        weight.index_add_(0, seg_row, (seg_grad * -lr).to(weight.dtype))
        return
    momentum = kernel._momentum(g_i)
    momentum.index_add_(0, seg_row, seg_grad.square().mean(1))
    step = seg_grad * (-lr / (momentum.index_select(0, seg_row).sqrt() + kernel.eps))[:, None]
    weight.index_add_(0, seg_row, step.to(weight.dtype))
