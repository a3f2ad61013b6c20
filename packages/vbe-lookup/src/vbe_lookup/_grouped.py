"""``GroupedVBELookup``: one VBE pooled lookup over several kernels into one pre-allocated 1-D output.

Output order (fbgemm's merged-VBE order): rank → kernel group → feature within the group → sample →
dim. The ``[R, F]`` start offsets of every (rank, feature) block are computed once per distinct
batch-size layout and cached on the device, so a step does no host sync and no ``.item()``.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from vbe_lookup import _fbgemm
from vbe_lookup._compat import eager_only
from vbe_lookup._fbgemm_direct import PLAIN_LAYOUT, DirectTBE, LayoutArgs, direct_tbe
from vbe_lookup._fbgemm_fused import FusedTBE, Fusion
from vbe_lookup._features import (
    VBEFeatures,
    check_length_per_key,
    check_offsets,
    check_tensors,
    complete_cumsum,
)
from vbe_lookup._torch_kernel import GRANULE_ATTRIBUTE, TorchEmbeddingKernel
from vbe_lookup.errors import (
    BatchLayoutError,
    ConfigurationError,
    DimensionMismatchError,
    FeatureCoverageError,
    IndexOutOfRangeError,
    InvalidFeaturesError,
)
from vbe_lookup.interfaces import EmbeddingKernel, KeyedJaggedTensorLike

__all__ = [
    "CheckIndices",
    "FBGEMMCall",
    "GroupedVBELookup",
    "KernelGroup",
    "KernelPooling",
    "Merge",
    "VBEOutput",
]

Merge = Literal["preallocated", "legacy"]
FBGEMMCall = Literal["direct", "module"]
CheckIndices = Literal["auto", "always", "deferred", "never"]
KernelPooling = Literal["any", "sum"]

_MAX_CACHED_LAYOUTS = 64
_UNBOUNDED_ROWS = 2**62


@dataclass(frozen=True, slots=True, eq=False)
class KernelGroup:
    """One kernel and the features it serves, in the kernel's feature order.

    Args:
        kernel: an :class:`~vbe_lookup.interfaces.EmbeddingKernel` (fbgemm TBE,
            :class:`~vbe_lookup.TorchEmbeddingKernel`, a key-value table adapter, ...).
        features: the kernel's feature names; feature ``i`` of the kernel is ``features[i]``.
        dims: embedding dim of each feature (checked against the kernel when it describes its tables).
        num_embeddings: optional rows of each feature's table, for id range checks; taken from the
            kernel when it describes its tables (fbgemm TBE, ``TorchEmbeddingKernel``).
    """

    kernel: EmbeddingKernel
    features: Sequence[str]
    dims: Sequence[int]
    num_embeddings: Sequence[int] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        object.__setattr__(self, "dims", tuple(int(d) for d in self.dims))
        if not self.features:
            raise ConfigurationError("a KernelGroup needs at least one feature in `features`")
        if len(set(self.features)) != len(self.features):
            raise ConfigurationError(f"`features` repeats a name: {list(self.features)}")
        if len(self.dims) != len(self.features):
            raise DimensionMismatchError(
                f"`dims` has {len(self.dims)} entries for {len(self.features)} `features` {list(self.features)}"
            )
        if any(d <= 0 for d in self.dims):
            raise DimensionMismatchError(f"`dims` must be positive, got {list(self.dims)}")
        kernel_dims = _kernel_feature_dims(self.kernel)
        if kernel_dims is not None and list(kernel_dims) != list(self.dims):
            raise DimensionMismatchError(
                f"`dims` {list(self.dims)} for features {list(self.features)} disagree with the kernel's "
                f"feature dims {kernel_dims}"
            )
        rows = self.num_embeddings
        if rows is None:
            rows = _kernel_feature_rows(self.kernel)
        if rows is not None:
            rows = tuple(int(n) for n in rows)
            if len(rows) != len(self.features):
                raise ConfigurationError(
                    f"`num_embeddings` has {len(rows)} entries for {len(self.features)} `features`"
                )
        object.__setattr__(self, "num_embeddings", rows)


def _kernel_feature_dims(kernel: object) -> list[int] | None:
    if isinstance(kernel, TorchEmbeddingKernel):
        return kernel.feature_dims()
    if _fbgemm.is_fbgemm_tbe(kernel):
        return _fbgemm.tbe_feature_dims(kernel)
    dims = getattr(kernel, "feature_dims", None)
    if callable(dims):
        value = dims()
        if isinstance(value, Sequence):
            return [int(d) for d in value]
    return None


def _kernel_feature_rows(kernel: object) -> list[int] | None:
    if isinstance(kernel, TorchEmbeddingKernel):
        return kernel.feature_num_embeddings()
    if _fbgemm.is_fbgemm_tbe(kernel):
        return _fbgemm.tbe_feature_num_embeddings(kernel)
    return None


def _kernel_output_dtype(kernel: object) -> torch.dtype | None:
    if isinstance(kernel, TorchEmbeddingKernel):
        return kernel.output_dtype
    if _fbgemm.is_fbgemm_tbe(kernel):
        return _fbgemm.tbe_output_dtype(kernel)
    dtype = getattr(kernel, "output_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _kernel_pooling(kernel: object) -> str | None:
    """``"sum"``, ``"mean"``, ``"none"`` (unpooled) or ``None`` when the kernel does not say.

    ``TorchEmbeddingKernel`` and key-value tables name it in ``pooling``; fbgemm's TBE holds a
    ``PoolingMode`` enum (``SUM``, ``MEAN``, ``NONE``) in ``pooling_mode``.
    """
    pooling = getattr(kernel, "pooling", None)
    if isinstance(pooling, str):
        return pooling.lower()
    name = getattr(getattr(kernel, "pooling_mode", None), "name", None)
    return name.lower() if isinstance(name, str) else None


def _fbgemm_weights_dtype(kernel: object) -> torch.dtype | None:
    """The torch dtype of an fbgemm TBE's rows (its ``weights_precision`` ``SparseType``), if it says."""
    as_dtype = getattr(getattr(kernel, "weights_precision", None), "as_dtype", None)
    if not callable(as_dtype):
        return None
    try:
        dtype = as_dtype()
    except (ValueError, KeyError, AttributeError):
        return None
    return dtype if isinstance(dtype, torch.dtype) else None


def _kernel_kind(kernel: object) -> str:
    """``fbgemm-cuda`` (writes in place on CUDA), ``fbgemm-cpu``, ``in-place`` (always) or ``other``."""
    if _fbgemm.is_fbgemm_tbe(kernel):
        return "fbgemm-cpu" if _fbgemm.tbe_uses_cpu(kernel) else "fbgemm-cuda"
    if getattr(kernel, "supports_vbe_output", False) is True:
        return "in-place"
    return "other"


class VBEOutput:
    """Pooled VBE output of a :class:`GroupedVBELookup`: one 1-D tensor, rank → feature → sample → dim.

    The feature order (``keys()``) is kernel group by kernel group, each group's features in its order;
    it is the same for every rank. Block (rank ``r``, feature ``f``) holds
    ``batch_size_per_feature_per_rank()[f][r] * dims()[f]`` elements starting at ``offsets()[r, f]``.
    """

    __slots__ = ("_batch_sizes", "_dims", "_keys", "_offsets", "_offsets_host", "_size_per_rank", "_values")

    def __init__(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        keys: tuple[str, ...],
        dims: tuple[int, ...],
        batch_sizes: tuple[tuple[int, ...], ...],
        offsets_host: tuple[tuple[int, ...], ...],
        size_per_rank: tuple[int, ...],
    ) -> None:
        self._values = values
        self._offsets = offsets
        self._keys = keys
        self._dims = dims
        self._batch_sizes = batch_sizes
        self._offsets_host = offsets_host
        self._size_per_rank = size_per_rank

    def __repr__(self) -> str:
        return (
            f"VBEOutput(values={tuple(self._values.shape)} {self._values.dtype}, keys={list(self._keys)}, "
            f"dims={list(self._dims)}, ranks={len(self._size_per_rank)})"
        )

    def values(self) -> torch.Tensor:
        """``[sum over r, f of B[f][r] * dims[f]]`` pooled embeddings (autograd reaches every kernel)."""
        return self._values

    def offsets(self) -> torch.Tensor:
        """``[R, F]`` int64 start of each (rank, feature) block, on the output's device (cached)."""
        return self._offsets

    def offsets_list(self) -> list[list[int]]:
        """``offsets()`` on the host (no sync: it was computed there)."""
        return [list(row) for row in self._offsets_host]

    def keys(self) -> list[str]:
        """Feature order of the output: kernel group → feature within the group."""
        return list(self._keys)

    def dims(self) -> list[int]:
        """Embedding dim per feature, in ``keys()`` order."""
        return list(self._dims)

    def batch_size_per_feature_per_rank(self) -> list[list[int]]:
        """``[F][R]`` batch sizes, in ``keys()`` order."""
        return [list(row) for row in self._batch_sizes]

    def size_per_rank(self) -> list[int]:
        """Number of output elements destined to each rank (the output all-to-all's split sizes)."""
        return list(self._size_per_rank)

    def values_per_rank(self) -> list[torch.Tensor]:
        """``values()`` split into each rank's contiguous block (views)."""
        return list(torch.split(self._values, list(self._size_per_rank)))


@dataclass(frozen=True, slots=True, eq=False)
class _GroupPlan:
    """Where one call unit's input comes from and where its output goes, for one layout.

    A unit is one kernel group, or several groups whose fbgemm TBEs share one op call (their features in a row,
    group by group); every field is over the unit's features in that order.
    """

    bag_runs: tuple[tuple[int, int], ...]  # [start, end) ranges of input bags, in the group's order
    feature_runs: tuple[tuple[int, int], ...]  # matching [start, end) ranges of input features
    whole_input: bool  # the group reads every input bag, in input order
    batch_sizes: list[list[int]]  # [F_g][R]
    num_bags: int
    vbe_output_offsets: torch.Tensor  # [R, F_g] int64 on the device (contiguous)
    block_starts: tuple[int, ...]  # per rank, per group of the unit: where that block starts in the output
    block_sizes: tuple[int, ...]  # its size
    placement: list[tuple[torch.Tensor, int]]  # lazily: rows of the output viewed [-1, granule], granule
    direct_args: list[
        LayoutArgs
    ]  # lazily: the layout's arguments of a kernel (or fused kernels) called through the op


@dataclass(frozen=True, slots=True, eq=False)
class _Layout:
    """Per (keys, batch sizes, device) metadata, built on the host once and kept on the device."""

    groups: tuple[_GroupPlan, ...]  # per call unit (`GroupedVBELookup._units`)
    offsets: torch.Tensor  # [R, F] int64
    offsets_host: tuple[tuple[int, ...], ...]
    keys: tuple[str, ...]
    dims: tuple[int, ...]
    batch_sizes: tuple[tuple[int, ...], ...]
    size_per_rank: tuple[int, ...]
    total: int
    feature_bag_bounds: torch.Tensor  # [F_in + 1] long: first bag of each input feature
    rows_of_feature: torch.Tensor  # [F_in] long: table rows of each input feature (2**62: unknown)
    feature_of_bag: torch.Tensor  # [num_bags] long, input feature of every bag
    num_bags: int
    # Input split, decided once per layout: whether ids per feature are needed on the host, and, when the
    # groups with bags read consecutive runs of input features in input order, each one's run (one
    # `torch.split` of the ids then serves every group).
    need_counts: bool
    tiled_runs: tuple[tuple[int, int], ...] | None


class GroupedVBELookup(nn.Module):
    """Variable-batch pooled lookup over several kernels into one pre-allocated 1-D output.

    Args:
        groups: the kernel groups; every input feature must be in exactly one.
        output_dtype: dtype of the output (default: the kernels' common output dtype, so bf16 kernels
            give a bf16 output; fbgemm-gpu-cpu TBEs have no bf16 forward and are rejected with bf16
            weights or output, see docs/vbe-lookup.md).
        merge: ``"preallocated"`` (default) writes every kernel's blocks into one buffer: fbgemm TBEs on
            CUDA and kernels that can (``TorchEmbeddingKernel``, kernels with
            ``supports_vbe_output = True``) write in place, chained through ``vbe_output``; any other
            kernel's output is placed with one cached-index copy. ``"legacy"`` reproduces torchrec's
            split/permute/cat merge for comparison. A single kernel never merges.
        check_indices: what is checked of the input's contents before any kernel runs: ids within
            their table's rows, ``sum(lengths) == len(values)`` and no negative length, each entry of a
            host-side ``length_per_key`` against ``lengths``, and a non-``VBEFeatures`` input's
            ``offsets`` against its ``lengths``. ``"auto"`` checks when the ids are on the CPU (free)
            and not on CUDA (the check needs one host sync); ``"always"`` checks everywhere (one sync
            per step on CUDA); ``"deferred"`` computes the same check on the device without a sync
            and records it: :meth:`check_deferred` raises for every forward since its last call (call
            it where the step syncs anyway); ``"never"`` skips it. Unchecked, an out-of-range id of a
            ``TorchEmbeddingKernel`` reads (and trains) a row of another table of the same dim.
            Layout, dtype and shape checks (coverage, dims, batch sizes vs lengths) always run; they
            need no sync.
        kernel_pooling: ``"sum"`` rejects, at construction, a kernel whose pooling mode is known and is
            not sum (an owner that applies mean pooling itself, like the sharded modules, would
            otherwise divide twice); ``"any"`` (default) accepts every kernel.
        cache_fbgemm_metadata: memoise fbgemm TBEs' host-side VBE metadata per layout (module path).
        fbgemm_call: ``"direct"`` (default) calls an fbgemm TBE's lookup op below its Python module, with
            the layout's arguments prepared once per layout (same op, same arguments, same results; see
            docs/vbe-lookup.md), for TBEs in the plain training configuration; any other TBE keeps the
            module path, and :attr:`fbgemm_paths` says which path each group takes and why.
            ``"module"`` calls every TBE's ``forward``.
        fuse_kernels: on the direct path with ``merge="preallocated"``, call fbgemm's op ONCE for all TBEs that
            are compatible (same optimizer and equal learning rate and optimizer arguments, rows in the same
            memory with the same dtype and device, same output dtype, pooling and bounds-check modes): their
            rows are moved into one buffer per state tensor (the modules' ``weights_*``/``momentum1_*`` become
            views of it, so each module still holds, trains and checkpoints its own rows) and their features
            are looked up together, with the results of separate calls. The host cost of a step then stays
            that of one TBE instead of growing by fbgemm's per-call backward work with every TBE. Checked every
            forward: a kernel whose learning rate or optimizer arguments no longer match, or whose rows were
            moved or replaced (``.to()``, ``load_state_dict(assign=True)``), is planned again (fused anew or
            called on its own). Default ``False`` (opt-in): fusing re-binds the TBEs' storage and copies
            their rows once (held twice while it runs: HBM may have no room for that);
            ``False`` keeps one op call per TBE and the TBEs' own storage.
            :attr:`fbgemm_fusion` says per group whether and with which groups it is fused.
    """

    def __init__(
        self,
        groups: Sequence[KernelGroup],
        *,
        output_dtype: torch.dtype | None = None,
        merge: Merge = "preallocated",
        check_indices: CheckIndices = "auto",
        kernel_pooling: KernelPooling = "any",
        cache_fbgemm_metadata: bool = True,
        fbgemm_call: FBGEMMCall = "direct",
        fuse_kernels: bool = False,
    ) -> None:
        super().__init__()
        groups = tuple(groups)
        if not groups:
            raise ConfigurationError("`groups` must hold at least one KernelGroup")
        if merge not in ("preallocated", "legacy"):
            raise ConfigurationError(f"`merge` must be 'preallocated' or 'legacy', got {merge!r}")
        if check_indices not in ("auto", "always", "deferred", "never"):
            raise ConfigurationError(
                f"`check_indices` must be 'auto', 'always', 'deferred' or 'never', got {check_indices!r}"
            )
        if kernel_pooling not in ("any", "sum"):
            raise ConfigurationError(f"`kernel_pooling` must be 'any' or 'sum', got {kernel_pooling!r}")
        if fbgemm_call not in ("direct", "module"):
            raise ConfigurationError(f"`fbgemm_call` must be 'direct' or 'module', got {fbgemm_call!r}")
        owner: dict[str, int] = {}
        for g_i, group in enumerate(groups):
            if not isinstance(group, KernelGroup):
                raise ConfigurationError(f"`groups[{g_i}]` must be a KernelGroup, got {type(group).__name__}")
            for name in group.features:
                if name in owner:
                    raise FeatureCoverageError(
                        f"feature `{name}` is covered by two kernel groups ({owner[name]} and {g_i}); "
                        "each feature must be served by exactly one kernel"
                    )
                owner[name] = g_i
        self.groups = groups
        self.merge: Merge = merge
        self.check_indices: CheckIndices = check_indices
        self._owner = owner
        # Register module kernels so .to(), state_dict() and parameters() see them.
        self.kernels = nn.ModuleList([g.kernel for g in groups if isinstance(g.kernel, nn.Module)])
        if output_dtype is None:
            known = [d for d in (_kernel_output_dtype(g.kernel) for g in groups) if d is not None]
            output_dtype = known[0] if known else torch.float32
            for dtype in known[1:]:
                output_dtype = torch.promote_types(output_dtype, dtype)
        self.output_dtype: torch.dtype = output_dtype
        # Kernel kinds are fixed at construction so the forward asks no questions of fbgemm.
        self._in_place_cache: dict[str, tuple[bool, ...]] = {}
        self._kinds: list[tuple[str, torch.dtype | None]] = [
            (_kernel_kind(g.kernel), _kernel_output_dtype(g.kernel)) for g in groups
        ]
        self._fp16_weighted_mean = _check_kernel_modes(groups, self._kinds, kernel_pooling)
        self._deferred_flags: torch.Tensor | None = None
        self._deferred_forwards = 0
        direct: list[DirectTBE | None] = []
        paths: list[str | None] = []
        for group, (kind, _) in zip(groups, self._kinds, strict=True):
            call, why = (None, None) if not kind.startswith("fbgemm") else direct_tbe(group.kernel)
            if call is None and why is not None:
                why = f"module: {why}"
            if call is not None and fbgemm_call == "module":
                call, why = None, "module: fbgemm_call='module'"
            direct.append(call)
            paths.append(why)
        self._direct: tuple[DirectTBE | None, ...] = tuple(direct)
        if cache_fbgemm_metadata:  # the module path's per-call metadata; the direct path prepares its own
            for group, call in zip(groups, direct, strict=True):
                if call is None and _fbgemm.is_fbgemm_tbe(group.kernel):
                    _fbgemm.install_vbe_metadata_cache(group.kernel)
        self.fbgemm_paths: tuple[str | None, ...] = tuple(paths)
        # Kernels whose call without VBE is known to give ``[B, sum(dims)]`` (fbgemm's op, called directly, and
        # TorchEmbeddingKernel): then `_batch_major` serves batches of one rank and one batch size.
        self._plain_calls = merge == "preallocated" and all(
            call is not None or type(group.kernel) is TorchEmbeddingKernel
            for group, call in zip(groups, direct, strict=True)
        )
        """Per group: ``"direct"``, ``"module: <why>"`` for an fbgemm TBE, ``None`` for other kernels."""
        self._layouts: OrderedDict[tuple[Any, ...], _Layout] = OrderedDict()
        # The last layout with the very key and stride tuples it was asked for: a producer that keeps its
        # tuples per layout (the sharded input dist, ``VBEFeatures.to``) finds it without hashing them.
        self._last: tuple[tuple[str, ...], tuple[tuple[int, ...], ...], torch.device, _Layout] | None = None
        self.fuse_kernels = bool(fuse_kernels)
        self._fusion: Fusion | None = None
        if fuse_kernels and merge == "preallocated" and sum(call is not None for call in direct) > 1:
            self._fusion = Fusion(direct)
        self._set_units()
        # Inputs whose ids, lengths and offsets the caller has checked (a sharded module's input dist): an
        # fbgemm TBE may then get the features' own offsets (its bounds check has nothing to repair).
        self._trusted_inputs = False

    # ------------------------------------------------------------------ call units
    def _set_units(self) -> None:
        """The call units (one op call or module call each) from the fusion plan, and what depends on them.

        Drops the cached layouts: their plans are per unit.
        """
        fusion = self._fusion
        n = len(self.groups)
        units = fusion.units if fusion is not None else tuple((g_i,) for g_i in range(n))
        self._units: tuple[tuple[int, ...], ...] = units
        calls: list[DirectTBE | FusedTBE | None] = []
        for unit in units:
            fused = None if fusion is None else fusion.calls.get(unit)
            calls.append(fused if fused is not None else self._direct[unit[0]])
        self._unit_calls: tuple[DirectTBE | FusedTBE | None, ...] = tuple(calls)
        # Per unit, the row-wise Adagrad TBEs called through the op, whose `iter` a call advances.
        self._unit_iters: tuple[tuple[DirectTBE, ...], ...] = tuple(
            tuple(d for d in (self._direct[g_i] for g_i in unit) if d is not None and d.rowwise)
            for unit in units
        )
        # Offsets handed to fbgemm TBEs must not alias the features' own when the input went unchecked:
        # fbgemm's bounds check repairs bad offsets in place.
        self._unit_fbgemm = tuple(self._kinds[unit[0]][0].startswith("fbgemm") for unit in units)
        order = [g_i for unit in units for g_i in unit]
        # Batch-major outputs come unit by unit: the columns that put them back in group order (None: already).
        self._unit_columns: list[int] | None = None
        if order != sorted(order):
            widths = {g_i: sum(self.groups[g_i].dims) for g_i in order}
            start: dict[int, int] = {}
            cursor = 0
            for g_i in order:
                start[g_i] = cursor
                cursor += widths[g_i]
            self._unit_columns = [start[g_i] + c for g_i in range(n) for c in range(widths[g_i])]
        self._unit_columns_on: dict[torch.device, torch.Tensor] = {}
        self._in_place_cache.clear()
        self._layouts.clear()
        self._last = None
        if fusion is not None:
            report = fusion.report
        else:
            if not self.fuse_kernels:
                why = "fuse_kernels=False"
            elif self.merge != "preallocated":
                why = f"merge={self.merge!r}"
            else:
                why = "the only TBE on the direct path"
            report = tuple(None if d is None else f"unfused: {why}" for d in self._direct)
        self.fbgemm_fusion: tuple[str | None, ...] = report
        """Per group: ``"fused: groups 0, 2 in one op call"``, ``"unfused: <why>"`` for a TBE on the direct
        path, ``None`` for other groups."""

    @eager_only  # host-side checks of module state; never part of a graph
    def _refresh_fusion(self) -> None:
        """Plan the fusion again when a fused kernel's rows or any direct kernel's learning rate or optimizer
        arguments changed so that it no longer holds (a few attribute reads per kernel)."""
        fusion = self._fusion
        if fusion is not None and fusion.stale():
            fusion.plan()
            self._set_units()

    # ------------------------------------------------------------------ layout
    @eager_only  # host-side metadata, cached per layout
    def keep_layout(self, features: KeyedJaggedTensorLike) -> object:
        """The state this lookup caches for the batch-size layout of ``features`` (built if missing), as an
        opaque object: holding it keeps that state alive after the cache (64 layouts) drops it.

        A CUDA graph that recorded a :meth:`forward` reads that state (offsets, fbgemm's VBE metadata) by
        address: keep the handle as long as the graph.
        """
        if isinstance(features, VBEFeatures):
            keys, stride = features._keys, features._stride
        else:
            keys = tuple(features.keys())
            stride = tuple(tuple(int(b) for b in row) for row in features.stride_per_key_per_rank())
        if self._fusion is not None:
            self._refresh_fusion()
        return self._layout(keys, stride, features.values().device)

    @eager_only  # host-side metadata, cached per layout: keep it out of graphs
    def _layout(
        self, keys: tuple[str, ...], stride: tuple[tuple[int, ...], ...], device: torch.device
    ) -> _Layout:
        last = self._last
        if last is not None and last[0] is keys and last[1] is stride and last[2] == device:
            return last[3]
        key = (keys, stride, device)
        layout = self._layouts.get(key)
        if layout is not None:
            self._layouts.move_to_end(key)
        else:
            layout = self._build_layout(keys, stride, device)
            self._layouts[key] = layout
            if len(self._layouts) > _MAX_CACHED_LAYOUTS:
                self._layouts.popitem(last=False)
        self._last = (keys, stride, device, layout)
        return layout

    def _build_layout(
        self, keys: tuple[str, ...], stride: tuple[tuple[int, ...], ...], device: torch.device
    ) -> _Layout:
        position = {name: i for i, name in enumerate(keys)}
        if len(position) != len(keys):
            raise InvalidFeaturesError(f"`keys` must be unique, got {keys}")
        for name in keys:
            if name not in self._owner:
                raise FeatureCoverageError(
                    f"feature `{name}` is covered by no kernel group (groups cover: {', '.join(self._owner)})"
                )
        for g_i, group in enumerate(self.groups):
            missing = [n for n in group.features if n not in position]
            if missing:
                raise FeatureCoverageError(
                    f"kernel group {g_i} needs feature(s) {', '.join(f'`{n}`' for n in missing)}, which the "
                    f"input lacks (input keys: {', '.join(keys)})"
                )
        if len(stride) != len(keys):
            raise BatchLayoutError(f"`stride_per_key_per_rank` has {len(stride)} rows for {len(keys)} keys")
        ranks = {len(row) for row in stride}
        if len(ranks) > 1:
            raise BatchLayoutError(
                f"`stride_per_key_per_rank` rows list different numbers of ranks: {stride}"
            )
        num_ranks = ranks.pop() if ranks else 0
        bag_start = [0]
        for row in stride:
            bag_start.append(bag_start[-1] + sum(row))

        out_keys: list[str] = []
        out_dims: list[int] = []
        out_bs: list[tuple[int, ...]] = []
        for group in self.groups:
            for name, dim in zip(group.features, group.dims, strict=True):
                out_keys.append(name)
                out_dims.append(dim)
                out_bs.append(tuple(stride[position[name]]))
        # Rank-major offsets: rank → group → feature → sample → dim.
        offsets_host: list[list[int]] = []
        size_per_rank: list[int] = []
        cursor = 0
        group_block_starts: list[list[int]] = [[] for _ in self.groups]
        group_block_sizes: list[list[int]] = [[] for _ in self.groups]
        for r in range(num_ranks):
            rank_row: list[int] = []
            rank_start = cursor
            f = 0
            for g_i, group in enumerate(self.groups):
                group_block_starts[g_i].append(cursor)
                for _ in group.features:
                    rank_row.append(cursor)
                    cursor += out_bs[f][r] * out_dims[f]
                    f += 1
                group_block_sizes[g_i].append(cursor - group_block_starts[g_i][-1])
            offsets_host.append(rank_row)
            size_per_rank.append(cursor - rank_start)
        offsets = torch.tensor(offsets_host, dtype=torch.long).reshape(num_ranks, len(out_keys))
        offsets_dev = _to_device(offsets, device)

        # Every offset, size and the total are multiples of `granule`: kernels writing in place and the
        # placement copy move rows of `granule` elements with one index entry per row.
        granule = math.gcd(cursor, *out_dims, *(o for row in offsets_host for o in row))
        plans: list[_GroupPlan] = []
        first_column = list(itertools.accumulate((len(g.features) for g in self.groups), initial=0))
        for unit in self._units:
            idx = [position[n] for g_i in unit for n in self.groups[g_i].features]
            runs: list[tuple[int, int]] = []
            for i in idx:
                if runs and runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], i + 1)
                else:
                    runs.append((i, i + 1))
            bag_runs = tuple((bag_start[a], bag_start[b]) for a, b in runs)
            batch_sizes = [list(stride[i]) for i in idx]
            columns = [c for g_i in unit for c in range(first_column[g_i], first_column[g_i + 1])]
            if columns == list(range(columns[0], columns[-1] + 1)):
                unit_offsets = offsets_dev[:, columns[0] : columns[-1] + 1].contiguous()
            else:  # groups fused across others: their columns of the output offsets
                unit_offsets = offsets_dev[:, columns].contiguous()
            setattr(unit_offsets, GRANULE_ATTRIBUTE, granule)
            plans.append(
                _GroupPlan(
                    bag_runs=bag_runs,
                    feature_runs=tuple(runs),
                    whole_input=runs == [(0, len(keys))],
                    batch_sizes=batch_sizes,
                    num_bags=sum(sum(row) for row in batch_sizes),
                    vbe_output_offsets=unit_offsets,
                    block_starts=tuple(group_block_starts[g_i][r] for r in range(num_ranks) for g_i in unit),
                    block_sizes=tuple(group_block_sizes[g_i][r] for r in range(num_ranks) for g_i in unit),
                    placement=[],
                    direct_args=[],
                )
            )
        rows = [_UNBOUNDED_ROWS] * len(keys)
        for group in self.groups:
            if group.num_embeddings is not None:
                for name, n_rows in zip(group.features, group.num_embeddings, strict=True):
                    rows[position[name]] = n_rows
        per_feature_bags = torch.tensor(
            [bag_start[i + 1] - bag_start[i] for i in range(len(keys))], dtype=torch.long
        )
        active = [p for p in plans if p.num_bags > 0]
        tiled: tuple[tuple[int, int], ...] | None = None
        if active and all(len(p.feature_runs) == 1 for p in active):
            runs = [p.feature_runs[0] for p in active]
            if runs[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(runs)):
                tiled = tuple(runs)
        return _Layout(
            need_counts=any(not p.whole_input and p.num_bags > 0 for p in plans),
            tiled_runs=tiled,
            groups=tuple(plans),
            offsets=offsets_dev,
            offsets_host=tuple(tuple(r) for r in offsets_host),
            keys=tuple(out_keys),
            dims=tuple(out_dims),
            batch_sizes=tuple(out_bs),
            size_per_rank=tuple(size_per_rank),
            total=cursor,
            feature_bag_bounds=_to_device(torch.tensor(bag_start, dtype=torch.long), device),
            rows_of_feature=_to_device(torch.tensor(rows, dtype=torch.long), device),
            feature_of_bag=_to_device(torch.arange(len(keys)).repeat_interleave(per_feature_bags), device),
            num_bags=bag_start[-1],
        )

    # ------------------------------------------------------------------ forward
    def forward(self, features: KeyedJaggedTensorLike) -> VBEOutput:
        """Look up every kernel group's features and merge into one 1-D output.

        Args:
            features: variable-batch sparse features (``VBEFeatures`` or a torchrec KJT with
                ``stride_per_key_per_rank``), ids on the kernels' device. A non-``VBEFeatures`` input
                gets the same dtype, shape and device checks as ``VBEFeatures`` (O(1), no sync), and
                its ``offsets()`` are checked against its ``lengths()`` with the ids.

        Returns:
            :class:`VBEOutput` whose ``values()`` is 1-D, rank → group → feature → sample → dim, of
            ``output_dtype``.

        Raises:
            InvalidFeaturesError: bad dtypes, shapes or devices.
            BatchLayoutError: batch sizes, lengths, offsets or ``length_per_key`` that disagree.
            IndexOutOfRangeError: an id outside its table (when ``check_indices`` checks now).
            ConfigurationError: per-id weights for an fbgemm-gpu-cpu TBE whose weighted mean is wrong.
        """
        layout, inputs, device = self._accept(features)
        out_values = self._run_kernels(layout, inputs, device)
        return VBEOutput(
            out_values,
            layout.offsets,
            layout.keys,
            layout.dims,
            layout.batch_sizes,
            layout.offsets_host,
            layout.size_per_rank,
        )

    def _batch_major(self, features: VBEFeatures) -> torch.Tensor | None:
        """``[B, sum(dims)]`` pooled embeddings, columns in :meth:`forward`'s key order, of features from one
        rank with the same batch size ``B > 0`` for every key (a sharded module's own batch on a group of one),
        or ``None`` when that does not apply (``forward`` then serves). Every kernel is called without VBE:
        its ``[B, sum(its dims)]`` output is a block of columns, so no rank → feature → sample output is built
        only for its owner to put it back in sample order. The same checks as ``forward``."""
        stride = features._stride
        if (
            not self._plain_calls
            or not stride
            or len(stride[0]) != 1
            or stride[0][0] == 0
            or stride.count(stride[0]) != len(stride)  # rows compared in C: no loop per feature
        ):
            return None
        _, inputs, _ = self._accept(features)
        outs: list[torch.Tensor] = []
        for u_i, item in enumerate(inputs):
            assert item is not None  # every unit has B > 0 bags of each of its features
            indices, offsets, weights = item
            call = self._unit_calls[u_i]
            if call is not None:
                y = call(PLAIN_LAYOUT, indices, offsets, weights)
            else:
                y = self.groups[self._units[u_i][0]].kernel(indices, offsets, per_sample_weights=weights)
            outs.append(y if y.dtype == self.output_dtype else y.to(self.output_dtype))
        self._count_iterations(inputs)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self._unit_columns is not None:  # units fused across other groups: back to group order
            columns = self._unit_columns_on.get(out.device)
            if columns is None:
                columns = _to_device(torch.tensor(self._unit_columns, dtype=torch.long), out.device)
                self._unit_columns_on[out.device] = columns
            out = out.index_select(1, columns)
        return out

    def _accept(
        self, features: KeyedJaggedTensorLike
    ) -> tuple[_Layout, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None], torch.device]:
        """The checks of :meth:`forward`, its layout, and each call unit's ``(indices, offsets, weights)``."""
        if self._fusion is not None:
            self._refresh_fusion()
        counts: Sequence[int] | None
        if isinstance(features, VBEFeatures):
            # Immutable and checked at construction: no per-step copies or checks.
            keys, stride = features._keys, features._stride
            values, lengths, weights = features._values, features._lengths, features._weights
            offsets = features.offsets()
            counts = features._length_per_key
            offsets_from_lengths = True
        else:
            keys = tuple(features.keys())
            stride = tuple(tuple(int(b) for b in row) for row in features.stride_per_key_per_rank())
            values, lengths, weights = features.values(), features.lengths(), features.weights_or_none()
            check_tensors(values, lengths, weights)
            offsets = features.offsets()
            check_offsets(offsets, lengths)
            counts = _given_length_per_key(features)
            if counts is not None:
                check_length_per_key(counts, len(keys), values.numel())
            offsets_from_lengths = False
        device = values.device
        layout = self._layout(keys, stride, device)
        num_bags = layout.num_bags
        if lengths.numel() != num_bags:
            raise BatchLayoutError(
                f"`lengths` has {lengths.numel()} entries but `stride_per_key_per_rank` sums to {num_bags} bags"
            )
        if weights is not None and self._fp16_weighted_mean:
            g_i = self._fp16_weighted_mean[0]
            raise ConfigurationError(
                f"`weights` given, but kernel group {g_i} is an fbgemm-gpu-cpu TBE with mean pooling and "
                "float16 output, whose weighted mean fbgemm 1.8 computes wrongly on CPU (no division by the "
                "bag length); give that TBE float32 output or sum pooling"
            )
        mode = self.check_indices
        checked = mode == "always" or (mode == "auto" and device.type == "cpu")
        if checked or mode == "deferred":
            self._check_contents(
                layout, keys, values, lengths, offsets, counts, offsets_from_lengths, deferred=not checked
            )

        trusted = checked or (self._trusted_inputs and offsets_from_lengths)
        inputs = self._split_inputs(layout, values, lengths, offsets, weights, counts, trusted=trusted)
        return layout, inputs, device

    @eager_only  # one host sync (or module state, when deferred) by design; never part of a graph
    def _check_contents(
        self,
        layout: _Layout,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        counts: Sequence[int] | None,
        offsets_from_lengths: bool,
        *,
        deferred: bool,
    ) -> None:
        """Offsets, lengths, ``length_per_key`` and id ranges, fused into one ``[4]`` flag tensor.

        Read at once (one host sync on CUDA), or, when ``deferred``, OR-ed into the module's pending
        flags on the device (no sync) for :meth:`check_deferred`.
        """
        flags = _content_flags(layout, values, lengths, offsets, counts, offsets_from_lengths)
        if deferred:
            pending = self._deferred_flags
            if pending is None:
                self._deferred_flags = flags
            elif pending.device == flags.device:
                pending.logical_or_(flags)
            else:
                self._deferred_flags = pending.to(flags.device) | flags
            self._deferred_forwards += 1
            return
        bad = flags.tolist()
        if any(bad):
            _raise_content_error(bad, layout, keys, values, lengths, offsets, counts)

    @eager_only  # one host sync by design; never part of a graph
    def check_deferred(self) -> None:
        """Raise if any forward since the last call had bad contents (``check_indices="deferred"``).

        Reads the flags the forwards accumulated on the device: one host sync, so call it where the
        step syncs anyway (reading the loss, a splits header). Clears them. A no-op under the other
        ``check_indices`` modes.

        Raises:
            BatchLayoutError: offsets, lengths or ``length_per_key`` that disagreed.
            IndexOutOfRangeError: an id outside its table's rows. Those forwards already ran: they read
                other rows (for ``TorchEmbeddingKernel``, rows of a neighbouring table) and a backward
                updated them.
        """
        pending, forwards = self._deferred_flags, self._deferred_forwards
        self._deferred_flags, self._deferred_forwards = None, 0
        if pending is None:
            return
        bad = pending.tolist()
        where = f"`check_indices='deferred'`: at least one of the {forwards} forward(s) since the last check"
        hint = "; run with `check_indices='always'` to find it"
        if bad[0]:
            raise BatchLayoutError(f"{where} had `offsets` that disagree with its `lengths`{hint}")
        if bad[1]:
            raise BatchLayoutError(
                f"{where} had `lengths` that do not sum to the number of ids in `values` (or a negative "
                f"length){hint}"
            )
        if bad[2]:
            raise BatchLayoutError(
                f"{where} had a `length_per_key` entry that disagrees with its feature's `lengths`{hint}"
            )
        if bad[3]:
            raise IndexOutOfRangeError(
                f"{where} had an id in `values` out of range for its feature's table; those forwards read "
                f"(and a backward updated) rows of other tables{hint}"
            )

    def _split_inputs(
        self,
        layout: _Layout,
        values: torch.Tensor,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        counts: Sequence[int] | None,
        *,
        trusted: bool,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None]:
        """Each call unit's (indices, offsets, weights); ``None`` for a unit with no bag.

        Unless the contents were checked (``trusted``), an fbgemm TBE never gets a view of the
        features' offsets: its bounds check repairs bad offsets in place.
        """
        if not layout.need_counts:  # one group reads everything (others have no bag)
            whole_offsets = offsets if offsets.dtype == values.dtype else offsets.to(values.dtype)
            out_whole: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None] = []
            for plan, fbgemm in zip(layout.groups, self._unit_fbgemm, strict=True):
                if plan.num_bags == 0:
                    out_whole.append(None)
                elif fbgemm and not trusted and whole_offsets is offsets:
                    out_whole.append((values, offsets.clone(), weights))
                else:
                    out_whole.append((values, whole_offsets, weights))
            return out_whole
        if counts is None:
            counts = _length_per_key(layout, offsets)
        value_start = [0, *itertools.accumulate(counts)]
        if layout.tiled_runs is not None:
            # Groups with bags read consecutive feature runs in input order: one split of the ids.
            sizes = [value_start[b] - value_start[a] for a, b in layout.tiled_runs]
            sizes[-1] = values.numel() - sum(sizes[:-1])  # any ids past the last run (none when valid)
            v_split = values.split_with_sizes(sizes)
            w_split = None if weights is None else weights.split_with_sizes(sizes)
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None] = []
        active = 0
        for plan, fbgemm in zip(layout.groups, self._unit_fbgemm, strict=True):
            if plan.num_bags == 0:
                out.append(None)
                continue
            if layout.tiled_runs is not None:
                g_values = v_split[active]
                g_weights = None if w_split is None else w_split[active]
                active += 1
            else:
                v_parts = [values[value_start[a] : value_start[b]] for a, b in plan.feature_runs]
                g_values = v_parts[0] if len(v_parts) == 1 else torch.cat(v_parts)
                g_weights = None
                if weights is not None:
                    w_parts = [weights[value_start[a] : value_start[b]] for a, b in plan.feature_runs]
                    g_weights = w_parts[0] if len(w_parts) == 1 else torch.cat(w_parts)
            if len(plan.bag_runs) == 1:
                # One contiguous run: rebase the global offsets (no kernel when it starts at id 0).
                (bag_a, bag_b), (feature_a, _) = plan.bag_runs[0], plan.feature_runs[0]
                g_offsets = offsets[bag_a : bag_b + 1]
                shift = value_start[feature_a]
                if shift:
                    g_offsets = g_offsets - shift
                if g_offsets.dtype != values.dtype:
                    g_offsets = g_offsets.to(values.dtype)
                elif fbgemm and not trusted and not shift:
                    g_offsets = g_offsets.clone()  # a view of the features' offsets otherwise
            else:
                g_lengths = torch.cat([lengths[a:b] for a, b in plan.bag_runs])
                g_offsets = complete_cumsum(g_lengths.to(values.dtype))
            out.append((g_values, g_offsets, g_weights))
        return out

    def _writes_in_place(self, g_i: int, device: torch.device) -> bool:
        """Whether kernel ``g_i`` can write its blocks straight into the shared output on ``device``."""
        kind, dtype = self._kinds[g_i]
        if dtype not in (None, self.output_dtype):
            return False
        if kind == "fbgemm-cuda":
            return device.type == "cuda"
        return kind == "in-place"

    def _run_kernels(
        self,
        layout: _Layout,
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None],
        device: torch.device,
    ) -> torch.Tensor:
        dtype = self.output_dtype
        if len(self._units) == 1:
            # A single call never merges: its own VBE output (all groups, in order) is already the final order.
            item = inputs[0]
            if item is None:
                return torch.zeros(layout.total, dtype=dtype, device=device)
            y = self._call(0, layout.groups[0], item)
            self._count_iterations(inputs)
            return (y if y.dim() == 1 else y.reshape(-1)).to(dtype)  # no view node for a 1-D output
        if self.merge == "legacy":
            return self._legacy_merge(layout, inputs, device)
        out = torch.empty(layout.total, dtype=dtype, device=device)
        in_place = self._in_place_on(device)
        # Placement copies first, into the plain buffer: a tensor an in-place kernel returned may be a view
        # created inside its custom autograd function (fbgemm returns `vbe_output` as-is), on which an
        # in-place autograd op is forbidden. Then the chain: each in-place kernel gets the tensor the
        # previous one returned, used as it is (no reshape, no copy).
        for u_i, (plan, item) in enumerate(zip(layout.groups, inputs, strict=True)):
            if item is None or in_place[u_i]:
                continue  # no bag on any rank (its blocks are empty), or written in the chain below
            y = self._call(u_i, plan, item).reshape(-1).to(dtype)
            rows, granule = _placement(plan, layout.total, device)
            out.view(-1, granule).index_copy_(0, rows, y.view(-1, granule))
        for u_i, (plan, item) in enumerate(zip(layout.groups, inputs, strict=True)):
            if item is not None and in_place[u_i]:
                out = self._call(u_i, plan, item, out)
                if out.dim() != 1:
                    out = out.reshape(-1)
        self._count_iterations(inputs)
        return out

    def _call(
        self,
        u_i: int,
        plan: _GroupPlan,
        item: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        vbe_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Call unit ``u_i`` over its part of the batch; into ``vbe_output`` at its offsets when given."""
        indices, offsets, weights = item
        call = self._unit_calls[u_i]
        if call is not None:
            if not plan.direct_args:
                out_offsets = None if vbe_output is None else plan.vbe_output_offsets
                plan.direct_args.append(call.prepare(offsets, plan.batch_sizes, out_offsets))
            return call(plan.direct_args[0], indices, offsets, weights, vbe_output)
        kernel = self.groups[self._units[u_i][0]].kernel
        if vbe_output is None:
            return kernel(
                indices, offsets, per_sample_weights=weights, batch_size_per_feature_per_rank=plan.batch_sizes
            )
        return kernel(
            indices,
            offsets,
            per_sample_weights=weights,
            batch_size_per_feature_per_rank=plan.batch_sizes,
            vbe_output=vbe_output,
            vbe_output_offsets=plan.vbe_output_offsets,
        )

    def _count_iterations(self, inputs: Sequence[object | None]) -> None:
        """Add 1 to the ``iter`` of every row-wise Adagrad TBE called through the op, fused or not, whose unit
        was called (fbgemm's module does it per call; here one ``_foreach_add_`` for all)."""
        iters = [
            direct.kernel.iter
            for directs, item in zip(self._unit_iters, inputs, strict=True)
            if item is not None
            for direct in directs
        ]
        if iters:
            torch._foreach_add_(iters, 1)

    def _in_place_on(self, device: torch.device) -> tuple[bool, ...]:
        """Per call unit: writes in place on ``device`` (cached per device type)."""
        hit = self._in_place_cache.get(device.type)
        if hit is None:
            hit = tuple(all(self._writes_in_place(g_i, device) for g_i in unit) for unit in self._units)
            self._in_place_cache[device.type] = hit
        return hit

    def _legacy_merge(
        self,
        layout: _Layout,
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None],
        device: torch.device,
    ) -> torch.Tensor:
        """torchrec's ``_merge_variable_batch_embeddings``, as torchrec runs it (the baseline to beat).

        Every step, on the host: each kernel's split sizes per (rank, feature) from the batch sizes and
        dims (torchrec's ``_vbe_splits``), one ``torch.split`` per kernel output into ``R * F_g`` pieces,
        and one ``torch.cat`` of all pieces in rank-major order. Nothing is cached across steps.
        """
        dtype = self.output_dtype
        split_outputs: list[tuple[tuple[torch.Tensor, ...], int]] = []
        for g_i, (group, plan, item) in enumerate(zip(self.groups, layout.groups, inputs, strict=True)):
            sizes = [
                stride * dim
                for stride_per_feature in zip(*plan.batch_sizes, strict=True)
                for stride, dim in zip(stride_per_feature, group.dims, strict=True)
            ]
            if item is None:  # no bag on any rank: its blocks are empty
                y = torch.zeros(sum(sizes), dtype=dtype, device=device)
            else:
                y = self._call(g_i, plan, item).reshape(-1).to(dtype)
            split_outputs.append((torch.split(y, sizes), len(group.features)))
        num_ranks = len(layout.size_per_rank)
        pieces = [
            piece
            for rank in range(num_ranks)
            for pieces_g, n in split_outputs
            for piece in pieces_g[n * rank : n * rank + n]
        ]
        self._count_iterations(inputs)
        if not pieces:
            return torch.zeros(0, dtype=dtype, device=device)
        return torch.cat(pieces)


def _check_kernel_modes(
    groups: tuple[KernelGroup, ...],
    kinds: list[tuple[str, torch.dtype | None]],
    kernel_pooling: KernelPooling,
) -> tuple[int, ...]:
    """Reject kernels the lookup cannot use as configured; return the groups that cannot take weights.

    Raises:
        ConfigurationError: a kernel that does not sum-pool under ``kernel_pooling="sum"``, or an
            fbgemm-gpu-cpu TBE with bf16 rows or output (fbgemm's CPU forward has no bf16 kernel).
    """
    no_weights: list[int] = []
    for g_i, (group, (kind, out_dtype)) in enumerate(zip(groups, kinds, strict=True)):
        names = ", ".join(f"`{n}`" for n in group.features)
        pooling = _kernel_pooling(group.kernel)
        if kernel_pooling == "sum" and pooling not in (None, "sum"):
            raise ConfigurationError(
                f"kernel group {g_i} (features {names}) holds a {type(group.kernel).__name__} with pooling "
                f"mode {pooling!r}, but this lookup was built with `kernel_pooling='sum'`: its owner (e.g. a "
                "sharded module, whose `kernel_factory` must build sum-pooling kernels) applies mean pooling "
                "itself after the lookup, so a mean-pooling kernel would divide by the bag length twice; "
                "build the kernel with sum pooling"
            )
        if kind != "fbgemm-cpu":
            continue
        weights_dtype = _fbgemm_weights_dtype(group.kernel)
        if torch.bfloat16 in (weights_dtype, out_dtype):
            raise ConfigurationError(
                f"kernel group {g_i} (features {names}) is an fbgemm-gpu-cpu TBE with {weights_dtype} rows and "
                f"{out_dtype} output: fbgemm's CPU forward has no bfloat16 kernel; on CPU use float32 or "
                "float16 for its `weights_precision` and `output_dtype` (the lookup's `output_dtype` may "
                "still be bfloat16), or a TorchEmbeddingKernel with bfloat16 weights"
            )
        if pooling == "mean" and out_dtype == torch.float16:
            no_weights.append(g_i)
    return tuple(no_weights)


def _placement(plan: _GroupPlan, total: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Rows of the output viewed ``[-1, granule]`` receiving a kernel's own VBE output, cached per layout.

    The kernel's output is its rank blocks one after the other; block ``r`` goes to
    ``block_starts[r]``. ``granule`` divides every start, size and the total, so one index entry moves
    ``granule`` elements.
    """
    if not plan.placement:
        granule = math.gcd(total, *plan.block_starts, *plan.block_sizes) or 1
        starts = torch.tensor(plan.block_starts, dtype=torch.long) // granule
        sizes = torch.tensor(plan.block_sizes, dtype=torch.long) // granule
        rows = int(sizes.sum())
        own_starts = torch.cumsum(sizes, 0) - sizes
        shift = torch.repeat_interleave(starts - own_starts, sizes, output_size=rows)
        plan.placement.append((_to_device(torch.arange(rows) + shift, device), granule))
    return plan.placement[0]


def _given_length_per_key(features: KeyedJaggedTensorLike) -> Sequence[int] | None:
    """The producer's host-side ids per feature (``length_per_key_or_none()``, torchrec's name), if any."""
    getter = getattr(features, "length_per_key_or_none", None)
    if not callable(getter):
        return None
    known = getter()
    if known is None:
        return None
    return known if isinstance(known, list | tuple) else [int(n) for n in known]


@eager_only  # host-side ints: one D2H copy
def _length_per_key(layout: _Layout, offsets: torch.Tensor) -> list[int]:
    """Host-side ids per input feature from the offsets (when the producer did not supply them)."""
    at = offsets.to(torch.long)[layout.feature_bag_bounds]
    return [int(n) for n in (at[1:] - at[:-1]).tolist()]


@eager_only  # fixed-shape device work, cached per layout; no host sync
def _content_flags(
    layout: _Layout,
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    counts: Sequence[int] | None,
    offsets_from_lengths: bool,
) -> torch.Tensor:
    """``[4]`` bool on the ids' device: offsets vs lengths, lengths vs ids, ``length_per_key``, id ranges.

    Every term is a fixed-shape device computation (no host sync, no loop over features); each one is
    harmless when an earlier one is set (that case is reported first).
    """
    device = values.device
    nnz = values.numel()
    false = torch.zeros((), dtype=torch.bool, device=device)
    bad_offsets = false
    if not offsets_from_lengths:
        bad_offsets = (offsets[:1] != 0).any() | (offsets.diff() != lengths).any()
    bad_lengths = (lengths < 0).any() | (offsets[-1] != nnz)
    bad_counts = false
    if counts is not None:
        at = offsets.index_select(0, layout.feature_bag_bounds)
        given = _to_device(torch.tensor(counts, dtype=torch.long), device)
        bad_counts = (at.diff() != given).any()
    bad_ids = false
    if lengths.numel():
        rows = _rows_of_ids(layout, values, offsets)
        bad_ids = ((values < 0) | (values.to(torch.long) >= rows)).any()
    return torch.stack([bad_offsets, bad_lengths, bad_counts, bad_ids])


def _rows_of_ids(layout: _Layout, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[N]`` long: rows of the table of every id's feature (binary search of its position in the offsets)."""
    positions = torch.arange(values.numel(), device=values.device, dtype=offsets.dtype)
    bag = torch.searchsorted(offsets, positions, right=True) - 1
    bag = bag.clamp(0, max(layout.num_bags - 1, 0))
    return layout.rows_of_feature.index_select(0, layout.feature_of_bag.index_select(0, bag))


def _raise_content_error(
    bad: list[bool],
    layout: _Layout,
    keys: Sequence[str],
    values: torch.Tensor,
    lengths: torch.Tensor,
    offsets: torch.Tensor,
    counts: Sequence[int] | None,
) -> None:
    """Raise the error of the first set flag of :func:`_content_flags`, naming the culprit (error path only)."""
    nnz = values.numel()
    if bad[0]:
        if int(offsets[0]) != 0:
            raise BatchLayoutError(
                f"`offsets[0]` is {int(offsets[0])}; the offsets of the bags must start at 0"
            )
        i = int((offsets.diff() != lengths).nonzero()[0, 0])
        raise BatchLayoutError(
            f"`offsets` disagree with `lengths` at bag {i}: offsets[{i + 1}] - offsets[{i}] = "
            f"{int(offsets[i + 1] - offsets[i])} but lengths[{i}] = {int(lengths[i])}"
        )
    if bad[1]:
        raise BatchLayoutError(
            f"`lengths` sum to {int(offsets[-1])} (or hold a negative length) but `values` holds {nnz} ids; the "
            "bags described by `stride_per_key_per_rank` and `lengths` must cover `values` exactly"
        )
    if bad[2]:
        assert counts is not None  # the flag is only set when they were given
        actual = _length_per_key(layout, offsets)
        f = next(i for i, (a, b) in enumerate(zip(actual, counts, strict=True)) if a != b)
        raise BatchLayoutError(
            f"`length_per_key[{f}]` = {counts[f]} but feature `{keys[f]}`'s `lengths` sum to {actual[f]} ids "
            f"(`length_per_key` = {list(counts)}, from `lengths`: {actual}); it must count each feature's ids"
        )
    if bad[3]:
        rows = _rows_of_ids(layout, values, offsets)
        out_of_range = ((values < 0) | (values.to(torch.long) >= rows)).nonzero()
        i = int(out_of_range[0, 0])
        at = torch.tensor([i], dtype=offsets.dtype, device=offsets.device)
        bag = int(torch.searchsorted(offsets, at, right=True)[0]) - 1
        f = int(layout.feature_of_bag[bag])
        raise IndexOutOfRangeError(
            f"`values[{i}]` = {int(values[i])} is out of range for feature `{keys[f]}`, whose table has "
            f"{int(layout.rows_of_feature[f])} rows ({out_of_range.shape[0]} bad ids in all)"
        )


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host → device without blocking the host (pinned staging on CUDA)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
