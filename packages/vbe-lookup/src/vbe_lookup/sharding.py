"""Sharded embedding modules over ``torch.distributed``: table-wise and row-wise, VBE input and output dist.

A plan places every table on one rank (:class:`TableWise`) or splits its rows over ranks
(:class:`RowWise`), in named kernel groups. Each rank builds one kernel per kernel group it holds
(``kernel_factory``; any ``EmbeddingKernel``: fbgemm TBE, :class:`~vbe_lookup.TorchEmbeddingKernel`, a
key-value table) and looks them up together with :class:`~vbe_lookup.GroupedVBELookup`.

One step (every rank runs the same calls, in the same order):

1. ``start_input_dist(features)`` (local batch ``B`` samples, may be 0): bucketize every id to the rank
   holding its row (table-wise: by key, without a sort), exchange a small header (batch sizes, ids per
   feature, errors) and the lengths and ids: on CPU in the header's own all-to-all (within a capacity
   per pair of ranks; a larger payload takes a second one), on CUDA in one more, launched here.
2. ``wait_input_dist(handle)``: the weights' all-to-all (if any) and the reorder → :class:`DistributedFeatures`
   (a VBE batch: each owned feature has a batch from every source rank).
3. ``forward``: the lookup writes one 1-D output (source → group → feature → sample → dim), the output
   all-to-all returns every source its block, and the source assembles :class:`PooledEmbeddings`
   ``[B, sum(dims)]`` (row-wise partial sums added, mean applied) or, for
   :class:`ShardedSequenceEmbeddings`, one embedding per id (:class:`SequenceEmbeddings`).
4. backward: the gradient goes back through the output all-to-all to the owners, whose fused
   optimizers update their rows; weights that require grad get theirs through the input all-to-all.

``state_dict()`` gathers every table to its unsharded ``[num_embeddings, embedding_dim]`` layout on
every rank (``f"{table}.weight"``, plus ``f"{table}.momentum"`` for row-wise Adagrad), and
``load_state_dict`` scatters such a dict back to whatever plan and world size the module has: a model
trained on N ranks resumes on M. Tables in kernels without ``split_embedding_weights()`` (key-value
tables) keep their kernel's own (per-rank) state entries instead.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from vbe_lookup import _fbgemm, _sharded_state
from vbe_lookup._dist_comm import Communicator
from vbe_lookup._dist_input import DistributedFeatures, InputDist, InputDistHandle
from vbe_lookup._dist_output import OutputDistBase, PooledOutputDist, SequenceOutputDist
from vbe_lookup._features import VBEFeatures, complete_cumsum
from vbe_lookup._grouped import GroupedVBELookup, KernelGroup
from vbe_lookup._sharding_errors import (
    CollectiveOrderError,
    CollectiveTimeoutError,
    PeerRankError,
    ShardingPlanError,
    UnknownFeatureError,
)
from vbe_lookup._sharding_plan import (
    KernelSpec,
    RowWise,
    ShardingLayout,
    ShardingPlan,
    TableConfig,
    TableShard,
    TableWise,
)
from vbe_lookup._torch_kernel import Optimizer, TorchEmbeddingKernel
from vbe_lookup.errors import ConfigurationError, InvalidFeaturesError, VBELookupError
from vbe_lookup.interfaces import EmbeddingKernel

__all__ = [
    "CollectiveOrderError",
    "CollectiveTimeoutError",
    "DistributedFeatures",
    "InputDistHandle",
    "KernelFactory",
    "KernelSpec",
    "PeerRankError",
    "PooledEmbeddings",
    "RowWise",
    "SequenceEmbeddings",
    "ShardedEmbeddingBags",
    "ShardedSequenceEmbeddings",
    "ShardingPlan",
    "ShardingPlanError",
    "TableConfig",
    "TableWise",
    "UnknownFeatureError",
    "torch_kernel_factory",
]

KernelFactory = Callable[[KernelSpec], EmbeddingKernel]
"""Builds the kernel of one kernel group of one rank from its :class:`KernelSpec`."""

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def torch_kernel_factory(
    *,
    optimizer: Optimizer | None = "sgd",
    learning_rate: float = 0.01,
    eps: float = 1.0e-8,
    weights_dtype: torch.dtype = torch.float32,
) -> KernelFactory:
    """A ``kernel_factory`` building :class:`~vbe_lookup.TorchEmbeddingKernel` s (sum pooling).

    Args:
        optimizer: fused optimizer (``"sgd"``, ``"rowwise_adagrad"``) or ``None`` for plain parameters.
        learning_rate: step size of the fused optimizer.
        eps: Adagrad epsilon.
        weights_dtype: dtype of the table rows.
    """

    def build(spec: KernelSpec) -> EmbeddingKernel:
        return TorchEmbeddingKernel(
            list(spec.num_embeddings),
            list(spec.embedding_dims),
            feature_table_map=list(spec.feature_table_map),
            pooling="sum",
            optimizer=optimizer,
            learning_rate=learning_rate,
            eps=eps,
            weights_dtype=weights_dtype,
            device=spec.device,
        )

    return build


class PooledEmbeddings:
    """Pooled embeddings of the local batch; a KeyedTensor-like object (kt-regroup accepts it).

    ``values()`` is ``[B, sum(dims)]`` (``key_dim() == 1``), keys in the module's feature order (tables
    in the given order, each table's features in order).
    """

    __slots__ = ("_keys", "_length_per_key", "_offsets", "_values")

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: Tensor) -> None:
        self._keys = list(keys)
        self._length_per_key = [int(n) for n in length_per_key]
        self._values = values
        self._offsets = [0, *itertools.accumulate(self._length_per_key)]

    @classmethod
    def _sharing(cls, layout: PooledEmbeddings, values: Tensor) -> PooledEmbeddings:
        """``values`` with ``layout``'s keys and dims, sharing its lists (never mutated: the accessors return
        copies), so that a module's step builds no per-feature list."""
        out = cls.__new__(cls)
        out._keys, out._length_per_key, out._offsets = layout._keys, layout._length_per_key, layout._offsets
        out._values = values
        return out

    def keys(self) -> list[str]:
        """Feature names."""
        return list(self._keys)

    def length_per_key(self) -> list[int]:
        """Embedding dim of each key."""
        return list(self._length_per_key)

    def offset_per_key(self) -> list[int]:
        """``[F + 1]`` column offsets of the keys in ``values()``."""
        return list(self._offsets)

    def values(self) -> Tensor:
        """``[B, sum(dims)]`` pooled embeddings (``B`` may be 0)."""
        return self._values

    def key_dim(self) -> int:
        """Always 1: keys are laid out along the columns."""
        return 1

    def __getitem__(self, key: str) -> Tensor:
        i = self._keys.index(key)
        return self._values[:, self._offsets[i] : self._offsets[i + 1]]

    def to_dict(self) -> dict[str, Tensor]:
        """``{key: [B, dim]}`` views."""
        return {k: self[k] for k in self._keys}

    def __repr__(self) -> str:
        return f"PooledEmbeddings(keys={self._keys}, values={tuple(self._values.shape)} {self._values.dtype})"


class SequenceEmbeddings:
    """Unpooled (sequence) embeddings of the local batch: one row per id, jagged per key.

    ``embeddings(key)`` is ``[n_key, dim_key]`` in the input's id order (sample by sample);
    ``lengths(key)`` is ``[B]`` the number of ids of each sample.
    """

    __slots__ = ("_embeddings", "_index", "_keys", "_lengths")

    def __init__(self, keys: Sequence[str], embeddings: Sequence[Tensor], lengths: Tensor) -> None:
        self._keys = list(keys)
        self._embeddings = list(embeddings)
        self._lengths = lengths
        self._index = {k: i for i, k in enumerate(self._keys)}

    def keys(self) -> list[str]:
        """Feature names (module order)."""
        return list(self._keys)

    def embeddings(self, key: str) -> Tensor:
        """``[n_key, dim]`` one embedding per id of ``key``."""
        return self._embeddings[self._index[key]]

    def lengths(self, key: str) -> Tensor:
        """``[B]`` ids per sample of ``key``."""
        return self._lengths[self._index[key]]

    def __getitem__(self, key: str) -> Tensor:
        return self.embeddings(key)

    def to_dict(self) -> dict[str, Tensor]:
        """``{key: [n_key, dim]}``."""
        return {k: self._embeddings[i] for i, k in enumerate(self._keys)}

    def __repr__(self) -> str:
        shapes = {k: tuple(e.shape) for k, e in zip(self._keys, self._embeddings, strict=True)}
        return f"SequenceEmbeddings({shapes})"


class _ShardedModule(nn.Module):
    """Plan check, kernels, two-phase input dist, pipelined-input FIFO, prefetch and state dict."""

    # Whether the output dist reads each id's place in the input dist's send order (sequence outputs do).
    _ID_ORDER: ClassVar[bool] = True
    _output_dist: OutputDistBase  # built by the concrete module's _init_output_dist

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        process_group: dist.ProcessGroup | None = None,
        *,
        kernel_factory: KernelFactory | None = None,
        device: torch.device | str | None = None,
        output_dtype: torch.dtype | None = None,
        timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ShardingPlanError(
                "torch.distributed is not initialized: call `torch.distributed.init_process_group` first"
            )
        if device is None:
            backend = str(dist.get_backend(process_group))
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        device = torch.device(device)
        if device == torch.device("cuda"):
            # "cuda" means the current device; its tensors report "cuda:<index>", which the input checks compare.
            device = torch.device("cuda", torch.cuda.current_device())
        self._comm = Communicator(process_group, timeout, device)
        comm = self._comm

        # Validate locally, then agree on every rank: a bad plan raises everywhere, never hangs a peer.
        error: VBELookupError | None = None
        layout: ShardingLayout | None = None
        try:
            layout = ShardingLayout.build(tables, plan)
            if plan.world_size != comm.world_size:
                raise ShardingPlanError(
                    f"`plan` is for `world_size`={plan.world_size} but `process_group` has "
                    f"{comm.world_size} ranks; build the plan for the group you shard over"
                )
        except VBELookupError as err:
            error = err
        fingerprint = layout.fingerprint if layout is not None else 0
        rows = comm.all_gather_int64([int(error is not None), fingerprint], "plan check")
        if any(r[0] for r in rows):
            messages = comm.gather_messages(str(error) if error is not None else "", "plan check report")
            if error is not None:
                raise error
            failed = [i for i, r in enumerate(rows) if r[0]]
            raise PeerRankError(
                f"rank {comm.rank}: rank(s) {', '.join(map(str, failed))} rejected the tables/plan: "
                + "; ".join(f"rank {i}: {messages[i]}" for i in failed)
            )
        if len({r[1] for r in rows}) > 1:
            raise ShardingPlanError(
                f"rank {comm.rank}: the ranks were built with different `tables`/`plan` (fingerprints "
                f"{[r[1] for r in rows]}); every rank must pass the same tables and plan"
            )
        assert layout is not None  # error is None here, so build() returned
        self.layout = layout
        self.output_dtype: torch.dtype = torch.float32 if output_dtype is None else output_dtype
        self.device = device

        factory = kernel_factory if kernel_factory is not None else torch_kernel_factory()
        self._specs = tuple(dataclasses.replace(s, device=device) for s in layout.ranks[comm.rank].kernels)
        self._kernels: list[EmbeddingKernel] = [factory(spec) for spec in self._specs]
        groups = [
            KernelGroup(kernel, spec.feature_names, [spec.embedding_dims[t] for t in spec.feature_table_map])
            for kernel, spec in zip(self._kernels, self._specs, strict=True)
        ]
        self.lookup: GroupedVBELookup | None = (
            GroupedVBELookup(
                groups, output_dtype=self.output_dtype, check_indices="never", kernel_pooling="sum"
            )
            if groups
            else None
        )
        if self.lookup is not None:
            # The input dist checks every rank's ids and lengths (raising before any lookup) and builds the
            # offsets itself: fbgemm's bounds check finds nothing to repair in them, so no defensive copy.
            self.lookup._trusted_inputs = True
        self._input_dist = InputDist(layout, comm, id_order=self._ID_ORDER)
        self._anchor_leaf = torch.zeros(0, device=device, requires_grad=True)
        self._queue: collections.deque[DistributedFeatures] = collections.deque()
        self.register_state_dict_post_hook(_state_dict_post_hook)  # type: ignore[no-untyped-call]  # untyped in torch
        self.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)  # type: ignore[no-untyped-call]  # untyped in torch
        self._init_output_dist()

    def _init_output_dist(self) -> None:
        """Create ``self._output_dist`` (pooled or sequence); each concrete module defines it."""
        raise NotImplementedError

    # ------------------------------------------------------------------ description
    def extra_repr(self) -> str:
        shards = sum(len(s.table_names) for s in self._specs)
        return (
            f"rank={self.rank}/{self.world_size}, tables={len(self.layout.tables)}, "
            f"features={len(self.layout.features)}, local_shards={shards}, "
            f"kernel_groups={[s.group for s in self._specs]}, output_dtype={self.output_dtype}"
        )

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group the module is sharded over."""
        return self._comm.group

    @property
    def rank(self) -> int:
        """This rank in the process group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """Ranks in the process group."""
        return self._comm.world_size

    def feature_names(self) -> list[str]:
        """Every feature the module serves, in output order."""
        return list(self.layout.features)

    def kernel_specs(self) -> list[KernelSpec]:
        """What each of this rank's kernels holds."""
        return list(self._specs)

    def kernels(self) -> list[EmbeddingKernel]:
        """This rank's kernels, one per kernel group it holds (possibly none)."""
        return list(self._kernels)

    # ------------------------------------------------------------------ input dist
    def start_input_dist(self, features: Any) -> InputDistHandle:
        """Start distributing this rank's local batch (``KeyedJaggedTensorLike``, ``[[B]] * F`` strides).

        CUDA: exchanges the header (host sync) and launches the lengths-and-ids all-to-all; CPU (gloo):
        launches the one all-to-all of the header with the lengths and ids, which
        :meth:`wait_input_dist` reads. Any bad input on any rank (unknown or missing features, ids out
        of range, inconsistent lengths) raises on every rank, here on CUDA and in
        :meth:`wait_input_dist` on CPU: the offending rank gets the specific error, the others
        :class:`PeerRankError`. On a group of one
        rank nothing is exchanged: the checks run on the device and their host read (the step's one
        sync) is made by :meth:`wait_input_dist`, which raises for ids out of range or bad lengths, so a
        pipeline's start never blocks the host.
        """
        return self._input_dist.start(features)

    def wait_input_dist(self, handle: InputDistHandle) -> DistributedFeatures:
        """Finish the input dist: ids (CUDA) and weights all-to-all; returns this rank's VBE features."""
        return self._input_dist.wait(handle, self._anchor())

    def enqueue_pipelined_input(self, dist_features: DistributedFeatures) -> None:
        """Queue distributed features; the next ``forward`` uses them (FIFO) instead of distributing."""
        if not isinstance(dist_features, DistributedFeatures):
            raise InvalidFeaturesError(
                f"`dist_features` must come from `wait_input_dist`, got {type(dist_features).__name__}"
            )
        self._queue.append(dist_features)

    def set_output_dist_overlap(self, callback: Callable[[], None] | None) -> None:
        """Run ``callback()`` in every later forward while the host waits for the output dist's all-to-all.

        It runs once the all-to-all is launched and before it is waited for, and only where that wait
        blocks the host (gloo; NCCL's is stream-ordered) and an all-to-all is issued (not in a group of
        one): a pipeline prepares its next batch there (pipeline_stages' ``OutputDistOverlap``). The
        all-to-all is waited for before an error of ``callback`` propagates out of the forward, and a
        training forward that raises it owes its backward collectives as any dropped output does.
        ``None`` removes it.

        Raises:
            ConfigurationError: ``callback`` is neither callable nor None.
        """
        if callback is not None and not callable(callback):
            raise ConfigurationError(f"`callback` must be callable or None, got {callback!r}")
        self._output_dist.while_in_flight = callback

    def prefetch(
        self, dist_features: DistributedFeatures, forward_stream: torch.cuda.Stream | None = None
    ) -> None:
        """Call ``prefetch(indices, offsets, batch_size_per_feature_per_rank)`` on every kernel that has it.

        fbgemm TBEs get ``forward_stream`` too (they record their cache tensors on it) and are skipped
        when they have no cache (their ``prefetch`` would have nothing to do).
        """
        features = self._kernel_features(dist_features)
        stride = features.stride_per_key_per_rank()
        per_key = features.length_per_key()
        slot = bag = value = 0
        for spec, kernel in zip(self._specs, self._kernels, strict=True):
            n_slots = len(spec.feature_names)
            rows = stride[slot : slot + n_slots]
            n_bags = sum(sum(r) for r in rows)
            n_values = sum(per_key[slot : slot + n_slots])
            fetch = getattr(kernel, "prefetch", None)
            if callable(fetch) and _has_cache(kernel):
                lengths = features.lengths()[bag : bag + n_bags]
                indices = features.values()[value : value + n_values]
                offsets = complete_cumsum(lengths.to(indices.dtype))
                if _fbgemm.is_fbgemm_tbe(kernel):
                    fetch(
                        indices, offsets, forward_stream=forward_stream, batch_size_per_feature_per_rank=rows
                    )
                else:
                    fetch(indices, offsets, batch_size_per_feature_per_rank=rows)
            slot, bag, value = slot + n_slots, bag + n_bags, value + n_values

    def _next_input(self, features: Any) -> DistributedFeatures:
        if self._queue:
            return self._queue.popleft()
        if features is None:
            raise InvalidFeaturesError("`features` is required when no pipelined input is queued")
        return self.wait_input_dist(self.start_input_dist(features))

    def _anchor(self) -> Tensor | None:
        """A 0-element leaf requiring grad (grad mode only) that keeps every rank's collectives in the graph.

        One leaf serves every step (built once: no tensor per step); its gradient has no element.
        """
        return self._anchor_leaf if torch.is_grad_enabled() else None

    def _lookup(self, features: VBEFeatures, anchor: Tensor | None) -> Tensor:
        if self.lookup is None:
            out = torch.zeros(0, dtype=self.output_dtype, device=self.device)
        else:
            out = self.lookup(features).values()
        return self._tie(out, features, anchor)

    @staticmethod
    def _tie(out: Tensor, features: VBEFeatures, anchor: Tensor | None) -> Tensor:
        weights = features.weights_or_none()
        if anchor is not None and weights is not None and weights.requires_grad:
            # Every rank must run the backward of the weights all-to-all; tie the weights to the output.
            out = _TieGrad.apply(out, weights)  # type: ignore[no-untyped-call]  # Function.apply is untyped
        return out

    def _kernel_features(self, dist_features: DistributedFeatures) -> VBEFeatures:
        raise NotImplementedError

    # ------------------------------------------------------------------ state dict
    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's tables as ``ShardedTensor`` views for DCP (no copy, no collective): see ``_sharded_state``."""
        return dict(_sharded_state.sharded_state_dict(self))

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Copy a DCP-loaded :meth:`sharded_state_dict` into the kernels (a no-op where loaded in place)."""
        _sharded_state.load_sharded_state_dict(self, state)

    def _exporting_kernels(self) -> list[tuple[KernelSpec, EmbeddingKernel]]:
        """Kernels whose tables can be read and written as plain rows (``split_embedding_weights()``)."""
        return [
            (spec, kernel)
            for spec, kernel in zip(self._specs, self._kernels, strict=True)
            if callable(getattr(kernel, "split_embedding_weights", None))
        ]

    def _local_shards(self) -> Iterator[tuple[TableShard, Tensor, Tensor | None]]:
        """``(shard, weight [rows, dim], momentum [rows] or None)`` of every exportable shard on this rank.

        Kernels without ``split_embedding_weights()`` (e.g. key-value tables that checkpoint through
        their own ``state_dict`` entries) are left out: their tables stay in the kernel's own state.
        """
        names = [t.name for t in self.layout.tables]
        for spec, kernel in self._exporting_kernels():
            weights = list(kernel.split_embedding_weights())  # type: ignore[attr-defined]  # checked above
            momenta = _momenta(kernel, spec)
            for i, name in enumerate(spec.table_names):
                table = names.index(name)
                shard = next(s for s in self.layout.shards[table] if s.rank == self.rank)
                yield shard, weights[i], momenta[i]

    def _gathered_tables(self) -> dict[str, Tensor]:
        """Every exportable table, unsharded, on every rank (float32, module device): two all-reduces.

        A table is exportable when every one of its shards is held by a kernel with
        ``split_embedding_weights()``; the ranks agree on that through the first (tiny) all-reduce.
        """
        comm, tables = self._comm, self.layout.tables
        num = len(tables)
        local = list(self._local_shards())
        flags = torch.zeros(2 * num, dtype=torch.int64, device=self.device)
        for shard, _, momentum in local:
            flags[shard.table] += 1
            if momentum is not None:
                flags[num + shard.table] = 1
        comm.all_reduce_sum_(flags, "state_dict table flags")
        host = flags.tolist()
        export = [host[t] == len(self.layout.shards[t]) for t in range(num)]
        has_momentum = [export[t] and host[num + t] > 0 for t in range(num)]
        sizes = [t.num_embeddings * t.embedding_dim if e else 0 for t, e in zip(tables, export, strict=True)]
        sizes += [t.num_embeddings if m else 0 for t, m in zip(tables, has_momentum, strict=True)]
        flat = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)
        parts = list(torch.split(flat, sizes))
        with torch.no_grad():
            for shard, weight, momentum in local:
                if not export[shard.table]:
                    continue
                dim = tables[shard.table].embedding_dim
                full = parts[shard.table].view(-1, dim)
                full[shard.row_start : shard.row_start + shard.num_rows] = weight.to(torch.float32)
                if momentum is not None and has_momentum[shard.table]:
                    m = parts[num + shard.table]
                    m[shard.row_start : shard.row_start + shard.num_rows] = momentum.reshape(-1).to(
                        torch.float32
                    )
        comm.all_reduce_sum_(flat, "state_dict gather")
        out: dict[str, Tensor] = {}
        for t, table in enumerate(tables):
            if export[t]:
                out[f"{table.name}.weight"] = parts[t].view(table.num_embeddings, table.embedding_dim)
            if has_momentum[t]:
                out[f"{table.name}.momentum"] = parts[num + t]
        return out

    def _exported_state_prefixes(self) -> list[str]:
        """Module-relative prefixes (``"lookup.kernels.0."``) of the kernels whose state is unsharded."""
        exporting = {id(kernel) for _, kernel in self._exporting_kernels()}
        return [f"{name}." for name, module in self.named_modules() if name and id(module) in exporting]

    def _scatter_tables(
        self, state: dict[str, Any], prefix: str, missing: list[str], errors: list[str]
    ) -> None:
        """Copy the rows of this rank's exportable shards out of unsharded ``state`` (pops table keys).

        A table key is reported missing only on ranks holding an exportable shard of that table.
        """
        tables = self.layout.tables
        local = list(self._local_shards())
        needed = {shard.table for shard, _, _ in local}
        full: dict[int, Tensor] = {}
        moments: dict[int, Tensor] = {}
        for t, table in enumerate(tables):
            key = f"{prefix}{table.name}.weight"
            value = state.pop(key, None)
            m_value = state.pop(f"{prefix}{table.name}.momentum", None)
            if value is None:
                if t in needed:
                    missing.append(key)
                continue
            shape = (table.num_embeddings, table.embedding_dim)
            if not isinstance(value, Tensor) or tuple(value.shape) != shape:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                errors.append(f"`{key}` must be the unsharded table {shape}, got {got}")
                continue
            full[t] = value
            if isinstance(m_value, Tensor) and m_value.numel() == table.num_embeddings:
                moments[t] = m_value.reshape(-1)
        with torch.no_grad():
            for shard, weight, momentum in local:
                rows = slice(shard.row_start, shard.row_start + shard.num_rows)
                if shard.table in full:
                    weight.copy_(full[shard.table][rows])
                if momentum is not None and shard.table in moments:
                    momentum.copy_(moments[shard.table][rows].reshape(momentum.shape))


def _has_cache(kernel: object) -> bool:
    """fbgemm TBEs always have ``prefetch``; only those with a cache (UVM caching) need it."""
    if not _fbgemm.is_fbgemm_tbe(kernel):
        return True
    cache = getattr(kernel, "lxu_cache_weights", None)
    return isinstance(cache, Tensor) and cache.numel() > 0


def _momenta(kernel: object, spec: KernelSpec) -> list[Tensor | None]:
    """Row-wise optimizer state per table (``[rows]``), when the kernel exposes one."""
    states = getattr(kernel, "split_optimizer_states", None)
    out: list[Tensor | None] = [None] * len(spec.table_names)
    if not callable(states):
        return out
    value = states()
    if not isinstance(value, (list, tuple)) or len(value) != len(spec.table_names):
        return out
    for i, item in enumerate(value):
        if isinstance(item, (list, tuple)):
            item = item[0] if len(item) == 1 else None
        if isinstance(item, Tensor) and item.numel() == spec.num_embeddings[i]:
            out[i] = item
    return out


def _state_dict_post_hook(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """Replace the exporting kernels' sharded entries by the unsharded tables (a collective)."""
    del local_metadata
    assert isinstance(module, _ShardedModule)
    sharded = tuple(prefix + p for p in module._exported_state_prefixes())
    for key in [k for k in state if k.startswith(sharded)]:
        del state[key]
    for key, value in module._gathered_tables().items():
        state[prefix + key] = value


def _load_state_dict_pre_hook(
    module: nn.Module,
    state: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Scatter unsharded tables into this rank's shards; exporting kernels then reload their current state.

    Other kernels (no ``split_embedding_weights()``) load their own entries from ``state`` as usual.
    """
    del local_metadata, strict, unexpected_keys
    assert isinstance(module, _ShardedModule)
    module._scatter_tables(state, prefix, missing_keys, error_msgs)
    for child_prefix in module._exported_state_prefixes():
        child = module.get_submodule(child_prefix[:-1])
        state.update(child.state_dict(prefix=f"{prefix}{child_prefix}"))


class ShardedEmbeddingBags(_ShardedModule):
    """Table-wise / row-wise sharded pooled embedding bags; ``forward`` returns :class:`PooledEmbeddings`.

    Args:
        tables: The tables (:class:`TableConfig`), identical on every rank.
        plan: Where each table lives (:class:`ShardingPlan`), identical on every rank; its
            ``world_size`` must equal the process group's size.
        process_group: The group to shard over (``None``: the default group).
        kernel_factory: Builds each kernel from a :class:`KernelSpec` (sum pooling, optimizer fused into
            the backward). Default: :func:`torch_kernel_factory` (``TorchEmbeddingKernel``, SGD, lr 0.01).
        device: Device of the kernels and of the features (default: CPU for gloo, the current CUDA
            device for NCCL).
        output_dtype: dtype of the pooled output (default float32); the same on every rank.
        timeout: Longest wait for any one collective before :class:`CollectiveTimeoutError`.

    Every rank must call the same methods in the same order (as with any collective), and, when
    training, run ``backward`` on a loss that depends on the output (an empty local batch included).
    Every input dist header carries the step number, which every rank checks; a rank that frees a
    training output without its backward sends zeros in the backward collectives it owed (so the
    peers' tables get nothing from it, never its next header), and at the next step every rank raises
    :class:`CollectiveOrderError` (the others :class:`PeerRankError` naming it); every rank dropping
    its output (an evaluation without ``no_grad``) is consistent and no error.
    """

    _ID_ORDER = False  # pooled blocks are placed per (feature, sample): no per-id order
    _output_dist: PooledOutputDist

    def _init_output_dist(self) -> None:
        self._output_dist = PooledOutputDist(self.layout, self._comm)
        self._pooled_layout: PooledEmbeddings | None = None

    def _kernel_features(self, dist_features: DistributedFeatures) -> VBEFeatures:
        return dist_features.features

    def forward(self, features: Any = None) -> PooledEmbeddings:
        """Pooled embeddings ``[B, sum(dims)]`` of this rank's local batch.

        Args:
            features: The local batch (``KeyedJaggedTensorLike`` with ``[[B]] * F`` strides), or
                ``None`` when distributed features were queued with :meth:`enqueue_pipelined_input`
                (then they are used and ``features`` is ignored).
        """
        dist_features = self._next_input(features)
        anchor = self._anchor()
        block = None
        lookup = self.lookup  # a submodule: read once (nn.Module's attribute fallback)
        if self._comm.alone and lookup is not None:
            # A group of one's own batch (every key B samples): the lookup's [B, sum(dims)] block is the output
            # up to the columns' order, so nothing is built in rank → feature → sample order.
            block = lookup._batch_major(dist_features.features)
        if block is not None:
            block = self._tie(block, dist_features.features, anchor)
            values = self._output_dist.from_batch_major(block, dist_features, anchor)
        else:
            out = self._lookup(dist_features.features, anchor)
            values = self._output_dist(out, dist_features, anchor)
        if self._pooled_layout is None:  # the keys and dims of every output, built once
            self._pooled_layout = PooledEmbeddings(
                self.layout.features, self._output_dist.feature_dims, values.new_empty(0)
            )
        return PooledEmbeddings._sharing(self._pooled_layout, values)


class ShardedSequenceEmbeddings(_ShardedModule):
    """Sharded unpooled (sequence) lookup: one embedding per id; ``forward`` returns :class:`SequenceEmbeddings`.

    Same arguments, plans and input dist as :class:`ShardedEmbeddingBags`; the kernels see every id as a
    bag of one, so any ``EmbeddingKernel`` serves sequence lookups. Per-id weights are ignored.
    """

    _output_dist: SequenceOutputDist

    def _init_output_dist(self) -> None:
        self._output_dist = SequenceOutputDist(self.layout, self._comm)

    def _kernel_features(self, dist_features: DistributedFeatures) -> VBEFeatures:
        f = dist_features.features
        n = f.values().numel()
        counts = dist_features.ids_per_slot_per_rank
        return VBEFeatures(
            f.keys(),
            f.values(),
            torch.ones(n, dtype=torch.int64, device=f.values().device),
            counts,
            None,
            length_per_key=[sum(row) for row in counts],
        )

    def forward(self, features: Any = None) -> SequenceEmbeddings:
        """One embedding per id of this rank's local batch (see :meth:`ShardedEmbeddingBags.forward`)."""
        dist_features = self._next_input(features)
        anchor = self._anchor()
        out = self._lookup(self._kernel_features(dist_features), anchor)
        embeddings = self._output_dist(out, dist_features, anchor)
        src = dist_features.source
        batch = src.batch_size
        lengths = src.lengths.view(len(src.keys), batch)
        order = self._output_dist.inverse_keys(src)  # cached per key order: no per-step copy
        return SequenceEmbeddings(self.layout.features, embeddings, lengths.index_select(0, order))


class _TieGrad(torch.autograd.Function):
    """Identity on ``out`` whose backward also gives ``weights`` a (zero) gradient."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, weights: Tensor) -> Tensor:
        ctx.weights_meta = (weights.shape, weights.dtype, weights.device)
        return out.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype, device = ctx.weights_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)
