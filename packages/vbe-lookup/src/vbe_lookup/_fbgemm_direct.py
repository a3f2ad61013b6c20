"""fbgemm TBE lookups below the Python module: fbgemm's lookup op called with arguments prepared per layout.

``SplitTableBatchedEmbeddingBagsCodegen.forward`` spends ~0.2 ms of host time per call before its op runs
(input preparation, VBE metadata, stats and debug hooks, prefetch bookkeeping, ~40 arguments packed into
lists by the generated invoker), and a grouped lookup pays that once per kernel. For a TBE in the plain
training configuration (rows in device memory on CUDA or host memory on CPU, no UVM cache, row-wise Adagrad
or SGD without counters or global weight decay, no stats reporter, input multiplexer, writeback hook or
input-stats printing, bounds check off or version 1), :class:`DirectTBE` calls the op the invoker calls
(``split_embedding_codegen_lookup_{optimizer}_function_pt2``) with the arguments the invoker passes:

* per layout (:meth:`DirectTBE.prepare`, cached by the caller): the VBE metadata, from the module's own
  ``_generate_vbe_metadata``; or, on the CPU when every feature has the same batch size per rank, a call
  without VBE and the order that puts its output in VBE order (fbgemm-gpu-cpu's VBE kernels are slow);
* per call: the ids, offsets, per-sample weights and ``vbe_output``, and the module's tensors and
  optimizer arguments read from the module (so ``.to()``, ``load_state_dict`` and ``set_learning_rate``
  keep working).

The module's side effects that matter after the call are kept: fbgemm's bounds check (when the TBE has
one), its ``step``/``timestep`` counters and, for row-wise Adagrad, the checkpointed ``iter`` buffer (the
caller adds 1 to every kernel's ``iter`` with one ``_foreach_add_``). ``iter_cpu`` (a host mirror fbgemm
re-reads from ``iter`` while it is 0, and reads only in modes the direct path does not take) is left alone.
A TBE outside that configuration, or an fbgemm whose op schema differs from the one this was written
against (fbgemm-gpu 1.6 to 1.8), keeps the module path: :func:`direct_tbe` says why.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from vbe_lookup import _fbgemm

__all__ = ["PLAIN_LAYOUT", "DirectTBE", "LayoutArgs", "direct_tbe", "invoke_op"]

# fbgemm's OptimType name -> (op name, whether the op takes row-wise Adagrad's momentum and optim args).
_OPS: dict[str, tuple[str, bool]] = {
    "EXACT_ROWWISE_ADAGRAD": ("split_embedding_codegen_lookup_rowwise_adagrad_function_pt2", True),
    "EXACT_SGD": ("split_embedding_codegen_lookup_sgd_function_pt2", False),
}
_COMMON_ARGS = (
    "placeholder_autograd_tensor",
    "weights",
    "D_offsets",
    "total_D",
    "max_D",
    "hash_size_cumsum",
    "total_hash_size_bits",
    "indices",
    "offsets",
    "pooling_mode",
    "indice_weights",
    "feature_requires_grad",
    "output_dtype",
    "aux_tensor",
    "aux_int",
    "aux_float",
    "aux_bool",
    "learning_rate_tensor",
    "max_B",
    "max_B_feature_rank",
    "vbe_output_size",
    "vbe_output",
)
_ROWWISE_ARGS = ("momentum1", "optim_int", "optim_float")
# The module state each call reads: rows (and row-wise Adagrad's momentum) in host memory (fbgemm-gpu-cpu) or
# in device memory, then the rest, in the order `DirectTBE.__call__` unpacks them.
_ROWS_CPU = ("weights_host", "weights_placements", "weights_offsets")
_ROWS_DEV = ("weights_dev", "weights_uvm", "weights_placements", "weights_offsets", "lxu_cache_weights")
_MOMENTUM_CPU = ("momentum1_host", "momentum1_placements", "momentum1_offsets")
_MOMENTUM_DEV = ("momentum1_dev", "momentum1_uvm", "momentum1_placements", "momentum1_offsets")
_PLAIN = (
    "placeholder_autograd_tensor",
    "D_offsets",
    "total_D",
    "max_D",
    "hash_size_cumsum",
    "total_hash_size_bits",
    "pooling_mode",
    "output_dtype",
    "lxu_cache_locations_empty",
    "info_B_num_bits",
    "info_B_mask",
    "is_experimental",
    "use_uniq_cache_locations_bwd",
    "use_homogeneous_placements",
    "mixed_D",
    "learning_rate_tensor",
    "optimizer_args",
)
# Attributes whose presence (and value) put a TBE outside the configuration the direct path reproduces.
_OFF_WHEN_SET = (
    "stats_reporter",
    "tbe_input_multiplexer",
    "_report_input_params",
    "use_writeback_bwd_prehook",
    "gather_uvm_cache_stats",
    "_used_rowwise_adagrad_with_counter",
    "_used_rowwise_adagrad_with_global_weight_decay",
    "enable_raw_embedding_streaming",
)


@dataclass(frozen=True, slots=True, eq=False)
class LayoutArgs:
    """The op arguments that depend on one batch-size layout (and on nothing else of the batch)."""

    max_B: int
    max_B_feature_rank: int
    output_size: int
    B_offsets: torch.Tensor | None
    output_offsets_feature_rank: torch.Tensor | None
    B_offsets_rank_per_feature: torch.Tensor | None
    vbe_output_offsets: torch.Tensor | None
    # A call without VBE (CPU, every feature with the same batch size per rank): the granule rows of its
    # [B, total_D] output in VBE order (rank -> feature -> sample -> dim), and the granule.
    vbe_order: torch.Tensor | None = None
    granule: int = 1

    @classmethod
    def from_vbe_metadata(cls, metadata: Any) -> LayoutArgs:
        """The arguments of fbgemm's VBE metadata (``_generate_vbe_metadata``'s result)."""
        return cls(
            max_B=metadata.max_B,
            max_B_feature_rank=metadata.max_B_feature_rank,
            output_size=metadata.output_size,
            B_offsets=metadata.B_offsets,
            output_offsets_feature_rank=metadata.output_offsets_feature_rank,
            B_offsets_rank_per_feature=metadata.B_offsets_rank_per_feature,
            vbe_output_offsets=metadata.vbe_output_offsets,
        )


PLAIN_LAYOUT = LayoutArgs(
    max_B=-1,
    max_B_feature_rank=-1,
    output_size=-1,
    B_offsets=None,
    output_offsets_feature_rank=None,
    B_offsets_rank_per_feature=None,
    vbe_output_offsets=None,
)
"""A call without VBE (every feature ``B`` samples): the op's ``[B, total_D]`` output, as fbgemm's module's."""


def _schema_names(op: Any) -> set[str] | None:
    try:
        return {a.name for a in op.default._schema.arguments}
    except (AttributeError, RuntimeError):
        return None


def direct_tbe(kernel: Any) -> tuple[DirectTBE | None, str]:
    """``(DirectTBE for kernel, "direct")`` or ``(None, why the module path is kept)``."""
    module = _fbgemm.training_module()
    if module is None or type(kernel) is not module.SplitTableBatchedEmbeddingBagsCodegen:
        return None, "not fbgemm's own training TBE class (a subclass may override forward)"
    optimizer = getattr(getattr(kernel, "optimizer", None), "name", None)
    if optimizer not in _OPS:
        return None, f"optimizer {optimizer} (direct path: {', '.join(_OPS)})"
    for name in _OFF_WHEN_SET:
        if getattr(kernel, name, None) not in (None, False):
            return None, f"`{name}` is set"
    if kernel.weights_uvm.numel() or kernel.lxu_cache_weights.numel():
        return None, "rows in UVM or behind a UVM cache"
    debug_print = getattr(kernel, "_debug_print_input_stats", None)
    if getattr(debug_print, "__name__", None) != "_debug_print_input_stats_factory_null":
        return None, "fbgemm's input-stats printing is on"
    if int(kernel.bounds_check_mode_int) != _fbgemm.bounds_check_none() and kernel.bounds_check_version != 1:
        return None, f"bounds check version {kernel.bounds_check_version}"
    op_name, rowwise = _OPS[optimizer]
    op = getattr(torch.ops.fbgemm, op_name, None)
    wanted = set(_COMMON_ARGS) | (set(_ROWWISE_ARGS) if rowwise else set())
    if op is None or _schema_names(op) != wanted:
        return None, f"fbgemm's `{op_name}` has another schema than the one the direct path calls"
    return DirectTBE(kernel, op, rowwise), "direct"


class DirectTBE:
    """One fbgemm TBE called through its lookup op (see the module docstring for when and why)."""

    __slots__ = (
        "_check_bounds",
        "_counters",
        "_index_dtype",
        "_keywords",
        "_read_cpu",
        "_read_dev",
        "_read_host",
        "_read_plain",
        "_schema_order",
        "kernel",
        "op",
        "overload",
        "rowwise",
    )

    def __init__(self, kernel: Any, op: Any, rowwise: bool) -> None:
        self.kernel = kernel
        self.op = op
        self.overload = op.default  # called with positional arguments: no keyword matching per call
        self.rowwise = rowwise  # takes momentum1 and counts `iter`
        self._index_dtype: torch.dtype | None = (
            torch.int32 if kernel.embedding_table_index_type == torch.int32 else None
        )
        self._check_bounds = int(kernel.bounds_check_mode_int) != _fbgemm.bounds_check_none()
        # The op's arguments in its schema's order, picked (in C) from a tuple in `_COMMON_ARGS (+ _ROWWISE_ARGS)`
        # order: the schema's order is fbgemm's (checked equal as a set in `direct_tbe`), not ours.
        ours = _COMMON_ARGS + (_ROWWISE_ARGS if rowwise else ())
        position = {name: i for i, name in enumerate(ours)}
        schema = op.default._schema.arguments
        self._schema_order = operator.itemgetter(*(position[a.name] for a in schema))
        # Positional unless the schema makes some argument keyword-only (then by name, in its order).
        self._keywords: tuple[str, ...] | None = (
            tuple(a.name for a in schema) if any(a.kwarg_only for a in schema) else None
        )
        # The module's state the op reads, read every call (so `.to()`, `load_state_dict` and
        # `set_learning_rate` keep working) but each from the dictionary that holds it, found once.
        momentum_cpu = _MOMENTUM_CPU if rowwise else ()
        momentum_dev = _MOMENTUM_DEV if rowwise else ()
        self._read_host = _reader(kernel, ("weights_host",))  # decides which of the next two a call reads
        self._read_cpu = _reader(kernel, _ROWS_CPU + momentum_cpu)
        self._read_dev = _reader(kernel, _ROWS_DEV + momentum_dev)
        self._read_plain = _reader(kernel, _PLAIN)
        # fbgemm's `step` and `timestep` are plain ints of the module: bumped in its `__dict__` (what
        # `nn.Module.__setattr__` does for an int, without its checks) when they are there.
        self._counters = all(isinstance(kernel.__dict__.get(name), int) for name in ("step", "timestep"))

    def prepare(
        self, offsets: torch.Tensor, batch_sizes: list[list[int]], vbe_output_offsets: torch.Tensor | None
    ) -> LayoutArgs:
        """The layout's op arguments (host work, once per layout).

        On the CPU, when every feature has the same batch size on each rank (a sharded step: each rank's
        batch has every feature), the call is made without VBE, over one batch of all ranks' samples in a
        row (the VBE bag order, feature -> rank -> sample, is that batch's feature-major order): fbgemm-gpu-cpu's
        VBE kernels are ~60x slower than its plain ones (a 21-table dim-16 step: 60 ms against 0.6-0.9 ms).
        Its ``[B, total_D]`` output is put in VBE order by one cached ``index_select``. Elsewhere: the
        module's own VBE metadata for these batch sizes.
        """
        if vbe_output_offsets is None and self.kernel.weights_host.numel() > 0 and _uniform(batch_sizes):
            dims = _fbgemm.tbe_feature_dims(self.kernel)
            order, granule = _vbe_order(batch_sizes[0], dims)
            return replace(PLAIN_LAYOUT, vbe_order=order.to(offsets.device), granule=granule)
        metadata = self.kernel._generate_vbe_metadata(offsets, batch_sizes, None, vbe_output_offsets)
        return LayoutArgs.from_vbe_metadata(metadata)

    def __call__(
        self,
        layout: LayoutArgs,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        vbe_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The pooled VBE lookup of ``indices``/``offsets`` (fbgemm's layout), with autograd through the op.

        ``vbe_output`` (1-D, the TBE's output dtype) is written at ``layout.vbe_output_offsets`` and
        returned, as the module does; ``None`` returns a new output.
        """
        k = self.kernel
        indices, offsets, weights = _ids(self._index_dtype, indices, offsets, weights)
        if self._check_bounds:
            _bounds_check(
                k, k.rows_per_table, k.info_B_num_bits, k.info_B_mask, layout, indices, offsets, weights
            )
        self.count_call()
        plain = self._read_plain()
        (weights_host,) = self._read_host()
        if weights_host.numel() > 0:  # rows in host memory (fbgemm-gpu-cpu)
            state_tensors = self._read_cpu()
            rows = list(state_tensors[:3])
            momentum = list(state_tensors[3:])
        else:
            state_tensors = self._read_dev()
            rows = list(state_tensors[:5])
            momentum = list(state_tensors[5:])
        return invoke_op(self, plain, rows, momentum, layout, indices, offsets, weights, vbe_output)

    def count_call(self) -> None:
        """fbgemm's per-call ``step``/``timestep`` counters of the module, as its forward bumps them."""
        if torch.compiler.is_compiling():  # module attributes mutated under dynamo force a restart
            return
        k = self.kernel
        if self._counters:
            state = k.__dict__
            state["step"] += 1
            state["timestep"] += 1
        else:
            k.step += 1
            k.timestep += 1


def _ids(
    index_dtype: torch.dtype | None,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The ids, offsets and per-id weights in the dtypes fbgemm's module hands its op."""
    if index_dtype is not None:
        indices = indices.to(index_dtype)
    if offsets.dtype != indices.dtype:
        offsets = offsets.to(indices.dtype)
    if weights is not None:
        weights = weights.float()
    return indices, offsets, weights


def _bounds_check(
    kernel: Any,
    rows_per_table: torch.Tensor,
    info_b_num_bits: int,
    info_b_mask: int,
    layout: LayoutArgs,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
) -> None:
    """fbgemm's bounds check (version 1) in ``kernel``'s mode, counting warnings in ``kernel``'s counter."""
    torch.ops.fbgemm.bounds_check_indices(
        rows_per_table,
        indices,
        offsets,
        kernel.bounds_check_mode_int,
        kernel.bounds_check_warning,
        weights,
        B_offsets=layout.B_offsets,
        max_B=layout.max_B,
        b_t_map=None,
        info_B_num_bits=info_b_num_bits,
        info_B_mask=info_b_mask,
        bounds_check_version=1,
        prefetch_pipeline=False,
    )


def invoke_op(
    call: DirectTBE | Any,
    plain: tuple[Any, ...],
    rows: list[torch.Tensor],
    momentum: list[torch.Tensor],
    layout: LayoutArgs,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None,
    vbe_output: torch.Tensor | None,
) -> torch.Tensor:
    """fbgemm's lookup op with the arguments fbgemm's invoker passes.

    ``call`` gives the op (``overload``, ``rowwise``, ``_schema_order``, ``_keywords``: a :class:`DirectTBE` or
    a fused call); ``plain`` is the module state in ``_PLAIN`` order; ``rows`` and ``momentum`` the rows'
    (and row-wise Adagrad's momentum's) tensors as the op takes them (host or device lists).
    """
    (
        placeholder,
        d_offsets,
        total_d,
        max_d,
        hash_size_cumsum,
        total_hash_size_bits,
        pooling_mode,
        output_dtype,
        cache_locations_empty,
        info_b_num_bits,
        info_b_mask,
        is_experimental,
        uniq_cache_locations_bwd,
        homogeneous_placements,
        mixed_d,
        learning_rate_tensor,
        args,
    ) = plain
    rowwise: bool = call.rowwise
    values: tuple[Any, ...] = (
        placeholder,
        rows,
        d_offsets,
        total_d,
        max_d,
        hash_size_cumsum,
        total_hash_size_bits,
        indices,
        offsets,
        pooling_mode,
        weights,
        None,  # feature_requires_grad
        output_dtype,
        [
            layout.B_offsets,
            layout.output_offsets_feature_rank,
            layout.B_offsets_rank_per_feature,
            cache_locations_empty,
            None,  # uvm_cache_stats: off (checked in direct_tbe)
            None,  # prev_iter_dev: no global weight decay
            layout.vbe_output_offsets,
        ],
        [0, info_b_num_bits, info_b_mask],  # aux_int; iter: read only by modes not taken here
        [0.0, args.max_gradient],  # aux_float: gwd_lower_bound, max_gradient
        [  # aux_bool
            is_experimental,
            uniq_cache_locations_bwd,
            homogeneous_placements,
            False,  # apply_global_weight_decay
            args.gradient_clipping,
            args.stochastic_rounding,
            mixed_d if rowwise else True,  # fbgemm's module passes mixed_D to row-wise Adagrad only
        ],
        learning_rate_tensor,
        layout.max_B,
        layout.max_B_feature_rank,
        layout.output_size,
        vbe_output,
    )
    if rowwise:
        values += (
            momentum,
            [args.weight_decay_mode],  # optim_int
            [args.eps, args.weight_decay, args.max_norm],  # optim_float
        )
    ordered = call._schema_order(values)
    keywords: tuple[str, ...] | None = call._keywords
    out: torch.Tensor = (
        call.overload(*ordered)
        if keywords is None
        else call.overload(**dict(zip(keywords, ordered, strict=True)))
    )
    if layout.vbe_order is not None:  # [B, total_D] without VBE -> VBE order
        out = out.reshape(-1, layout.granule).index_select(0, layout.vbe_order).reshape(-1)
    return out


def _reader(module: Any, names: tuple[str, ...]) -> Callable[[], tuple[Any, ...]]:
    """A function returning ``tuple(getattr(module, n) for n in names)`` as read now, without
    ``nn.Module.__getattr__``'s Python fallback per name: each name is read from the dictionary that holds it
    (parameters, buffers or the instance's own attributes), found here. ``getattr`` where a name is in none
    of them (a class attribute or property) or where the two reads disagree."""
    stores: list[dict[str, Any]] = []
    for name in names:
        store = next(
            (d for d in (module.__dict__, module._parameters, module._buffers) if name in d),
            None,
        )
        if store is None or store[name] is not getattr(module, name, None):
            getter = operator.attrgetter(*names)  # raises, when called, for a name the module lacks
            return lambda: tuple(getter(module)) if len(names) > 1 else (getter(module),)
        stores.append(store)
    pairs = tuple(zip(stores, names, strict=True))
    return lambda: tuple([store[name] for store, name in pairs])


def _uniform(batch_sizes: list[list[int]]) -> bool:
    """Whether every feature has the same batch size on each rank."""
    return all(row == batch_sizes[0] for row in batch_sizes)


def _vbe_order(batch_per_rank: list[int], dims: list[int]) -> tuple[torch.Tensor, int]:
    """Granule rows of a ``[sum(batch_per_rank), sum(dims)]`` output in VBE order (rank -> feature -> sample ->
    dim), and the granule (the dims' gcd): built once per layout, O(R * F) blocks."""
    granule = math.gcd(*dims)
    width = sum(dims) // granule
    starts = [0]
    for d in dims:
        starts.append(starts[-1] + d // granule)
    blocks = []
    first = 0
    for batch in batch_per_rank:
        rows = torch.arange(first, first + batch).unsqueeze(1) * width
        for f, d in enumerate(dims):
            blocks.append((rows + torch.arange(starts[f], starts[f] + d // granule)).reshape(-1))
        first += batch
    order = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.int64)
    return order, granule
