"""Several fbgemm TBEs called through ONE lookup op: their rows in one buffer, one set of op arguments.

On the direct path (:mod:`vbe_lookup._fbgemm_direct`) each TBE still costs one op call, and most of that
call's host time is fbgemm's backward (~0.5 ms per TBE on the H200). TBEs whose op calls differ only in their
tables can share one call: a :class:`FusedTBE` copies their rows (and row-wise Adagrad's momentum) into one
buffer per kind and re-binds every TBE's ``weights_{host,dev}`` and ``momentum1_{host,dev}`` (through
``.data``: the tensor objects stay the module's) as views of its own range, then calls the op once, with the
features of all of them in a row and the merged per-feature arguments (``weights_offsets``, ``D_offsets``,
``hash_size_cumsum``, ...) of what one TBE holding every table would have. The modules still hold and own their
rows: the op updates them in place, and ``state_dict``, ``load_state_dict`` and ``split_embedding_weights``
read or write the views.

Compatible (:func:`fusion_key`): the same op (optimizer), rows in the same memory (host or device) with the
same dtype and device, the same output dtype, pooling mode, bounds-check mode, index dtype and fbgemm flags,
and equal learning rates and optimizer arguments (eps, weight decay and its mode, max norm, gradient
clipping, stochastic rounding). Rows are independent under SGD and row-wise Adagrad, so one call over all
tables gives each table what its own call gives.

:class:`Fusion` keeps the grouping true to the kernels' state, checked per forward with a few attribute reads
per kernel (no tensor work): a learning rate set on one kernel (fbgemm fills its ``learning_rate_tensor`` in
place: its version counter moves), new optimizer arguments, or rows that are no longer the views it bound
(``.to()``, ``load_state_dict(assign=True)``, a replaced ``.data``) make it plan again: incompatible kernels
fall back to their own direct calls, moved ones are fused anew.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from vbe_lookup import _fbgemm
from vbe_lookup._fbgemm_direct import (
    PLAIN_LAYOUT,
    DirectTBE,
    LayoutArgs,
    _bounds_check,
    _ids,
    _uniform,
    _vbe_order,
    invoke_op,
)

__all__ = ["FusedTBE", "Fusion", "fusion_key"]

# id(first fused TBE) -> the FusedTBE that last bound its kernels' rows, while a lookup holds it: lookups over the
# same kernels share one fusion. Weak (nothing is kept alive for it, nothing is added to the modules); a hit is
# checked against its kernels by identity, so a reused id never matches.
_SHARED: weakref.WeakValueDictionary[int, FusedTBE] = weakref.WeakValueDictionary()
# Positions in `_fbgemm_direct._PLAIN` of what a fused call replaces with its merged value.
_D_OFFSETS, _TOTAL_D, _MAX_D, _HASH_SIZE_CUMSUM, _HASH_BITS, _INFO_BITS, _INFO_MASK, _MIXED_D = (
    1,
    2,
    3,
    4,
    5,
    9,
    10,
    14,
)


def _int(value: Any) -> int:
    """An fbgemm enum (``PoolingMode``, ``SparseType``) or int as an int."""
    return int(getattr(value, "value", value))


def _state_names(direct: DirectTBE, host: bool) -> tuple[str, ...]:
    """The module tensors a fused call merges: rows, and row-wise Adagrad's momentum."""
    prefix = "_host" if host else "_dev"
    return ("weights" + prefix, "momentum1" + prefix) if direct.rowwise else ("weights" + prefix,)


def _hyper(kernel: Any) -> tuple[Any, ...]:
    """The learning rate and the optimizer arguments the op reads (what may change between calls)."""
    args = kernel.optimizer_args
    return (
        float(kernel.learning_rate_tensor),
        args.weight_decay_mode,
        args.eps,
        args.weight_decay,
        args.max_norm,
        args.max_gradient,
        args.gradient_clipping,
        args.stochastic_rounding,
    )


def fusion_key(direct: DirectTBE) -> tuple[Any, ...] | None:
    """What must be equal for TBEs to share one op call (``None``: this one never shares)."""
    k = direct.kernel
    host = k.weights_host.numel() > 0
    state = [getattr(k, name) for name in _state_names(direct, host)]
    if not bool(k.use_homogeneous_placements) or any(t.dim() != 1 for t in state):
        return None
    weights = state[0]
    return (
        direct.op,
        host,
        weights.dtype,
        weights.device,
        _int(k.output_dtype),
        _int(k.pooling_mode),
        _int(k.bounds_check_mode_int),
        direct._index_dtype,
        bool(k.is_experimental),
        bool(k.use_uniq_cache_locations_bwd),
        *_hyper(k),
    )


def _merge_cumsum(parts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per-feature cumulative offsets (``[T_k + 1]`` each) of tables laid end to end: ``[sum T_k + 1]``."""
    shifted = []
    base = 0
    for part in parts:
        shifted.append(part[:-1].to(torch.int64) + base)
        base += int(part[-1])
    shifted.append(torch.tensor([base], dtype=torch.int64, device=parts[0].device))
    return torch.cat(shifted).to(dtype)


class FusedTBE:
    """Several compatible fbgemm TBEs called through one lookup op (see the module docstring).

    Built once per grouping (host work and one copy of the kernels' rows); a call does what
    :class:`~vbe_lookup._fbgemm_direct.DirectTBE` does for one TBE, over the features of all of them in the
    order of ``directs``.
    """

    __slots__ = (
        "__weakref__",
        "_bound",
        "_check_bounds",
        "_feature_dims_cpu",
        "_index_dtype",
        "_info",
        "_keywords",
        "_merged",
        "_momentum",
        "_rows",
        "_rows_per_table",
        "_schema_order",
        "directs",
        "feature_dims",
        "host",
        "kernels",
        "overload",
        "rowwise",
    )

    def __init__(self, directs: Sequence[DirectTBE]) -> None:
        first = directs[0]
        k0 = first.kernel
        self.directs = tuple(directs)
        self.kernels = tuple(d.kernel for d in directs)
        self.overload = first.overload
        self.rowwise = first.rowwise
        self._schema_order = first._schema_order
        self._keywords = first._keywords
        self._index_dtype = first._index_dtype
        self._check_bounds = first._check_bounds
        self.host = bool(k0.weights_host.numel() > 0)
        names = _state_names(first, self.host)
        kernels = self.kernels
        # One buffer per merged state tensor, each kernel's range re-bound as a view of it (the module keeps its
        # tensor objects; only their storage changes), and the per-feature offsets into it.
        merged: list[torch.Tensor] = []
        bound: list[tuple[Any, str, torch.Tensor]] = []
        offsets: list[torch.Tensor] = []
        placements: list[torch.Tensor] = []
        with torch.no_grad():
            for name in names:
                parts = [getattr(k, name) for k in kernels]
                buffer = torch.cat([p.detach() for p in parts])
                prefix = name.split("_")[0]
                start = 0
                shifted = []
                for k, part in zip(kernels, parts, strict=True):
                    n = part.numel()
                    part.data = buffer[start : start + n]
                    bound.append((k, name, part))
                    shifted.append(getattr(k, f"{prefix}_offsets") + start)
                    start += n
                merged.append(buffer)
                offsets.append(torch.cat(shifted))
                placements.append(torch.cat([getattr(k, f"{prefix}_placements") for k in kernels]))
        self._merged = tuple(merged)
        # (the dictionary of the module that holds the tensor, its name, the bound view, the view's address)
        self._bound = tuple((_holder(k, name), name, t, t.data_ptr()) for k, name, t in bound)
        if self.host:
            self._rows = [merged[0], placements[0], offsets[0]]
            self._momentum = [merged[1], placements[1], offsets[1]] if self.rowwise else []
        else:
            self._rows = [merged[0], k0.weights_uvm, placements[0], offsets[0], k0.lxu_cache_weights]
            self._momentum = [merged[1], k0.momentum1_uvm, placements[1], offsets[1]] if self.rowwise else []
        # The per-feature arguments of one TBE holding every kernel's tables, features in kernel order.
        self.feature_dims = [d for k in kernels for d in _fbgemm.tbe_feature_dims(k)]
        self._feature_dims_cpu = torch.tensor(self.feature_dims, dtype=torch.int64)
        d_offsets = _merge_cumsum([k.D_offsets for k in kernels], torch.int32)
        hash_size_cumsum = _merge_cumsum([k.hash_size_cumsum for k in kernels], torch.int64)
        total_hash_size = int(hash_size_cumsum[-1])
        hash_bits = int(math.log2(float(total_hash_size)) + 1) if total_hash_size else 0
        info_bits, info_mask = torch.ops.fbgemm.get_infos_metadata(d_offsets, 1, len(self.feature_dims))
        table_dims = [int(spec[1]) for k in kernels for spec in k.embedding_specs]
        self._rows_per_table = torch.cat([k.rows_per_table for k in kernels])
        self._info = (
            d_offsets,
            sum(self.feature_dims),
            max(int(k.max_D) for k in kernels),
            hash_size_cumsum,
            hash_bits,
            int(info_bits),
            int(info_mask),
            any(d != table_dims[0] for d in table_dims),
        )

    def bound(self) -> bool:
        """Whether every kernel still holds the views this fusion bound (not moved, replaced or re-assigned)."""
        return all(
            store.get(name) is want and want.data_ptr() == ptr for store, name, want, ptr in self._bound
        )

    def prepare(
        self, offsets: torch.Tensor, batch_sizes: list[list[int]], vbe_output_offsets: torch.Tensor | None
    ) -> LayoutArgs:
        """The layout's op arguments for the merged features (host work, once per layout), as
        :meth:`DirectTBE.prepare <vbe_lookup._fbgemm_direct.DirectTBE.prepare>` makes them for one TBE."""
        if vbe_output_offsets is None and self.host and _uniform(batch_sizes):
            order, granule = _vbe_order(batch_sizes[0], self.feature_dims)
            return LayoutArgs(
                max_B=PLAIN_LAYOUT.max_B,
                max_B_feature_rank=PLAIN_LAYOUT.max_B_feature_rank,
                output_size=PLAIN_LAYOUT.output_size,
                B_offsets=None,
                output_offsets_feature_rank=None,
                B_offsets_rank_per_feature=None,
                vbe_output_offsets=None,
                vbe_order=order.to(offsets.device),
                granule=granule,
            )
        k0 = self.kernels[0]
        metadata = _fbgemm.generate_vbe_metadata(
            offsets, batch_sizes, k0.pooling_mode, self._feature_dims_cpu, offsets.device, vbe_output_offsets
        )
        return LayoutArgs.from_vbe_metadata(metadata)

    def __call__(
        self,
        layout: LayoutArgs,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None,
        vbe_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The pooled lookup of every fused kernel's features (ids and bags in kernel order), one op call.

        fbgemm's bounds check, when on, runs once over the merged ids in the first kernel's mode; warnings
        are counted in the first kernel's ``bounds_check_warning``. Every kernel's ``step``/``timestep``
        counters advance as if it were called.
        """
        indices, offsets, weights = _ids(self._index_dtype, indices, offsets, weights)
        info = self._info
        if self._check_bounds:
            _bounds_check(
                self.kernels[0], self._rows_per_table, info[5], info[6], layout, indices, offsets, weights
            )
        for direct in self.directs:
            direct.count_call()
        plain = list(self.directs[0]._read_plain())
        (
            plain[_D_OFFSETS],
            plain[_TOTAL_D],
            plain[_MAX_D],
            plain[_HASH_SIZE_CUMSUM],
            plain[_HASH_BITS],
            plain[_INFO_BITS],
            plain[_INFO_MASK],
            plain[_MIXED_D],
        ) = info
        return invoke_op(
            self, tuple(plain), self._rows, self._momentum, layout, indices, offsets, weights, vbe_output
        )


class Fusion:
    """Which groups' fbgemm TBEs share one op call, kept true to the kernels' state.

    Args:
        directs: per kernel group, its direct call (``None``: a group not on the direct path).

    ``units`` lists the call units, each a tuple of group indices in group order (one group: its own call),
    ordered by their first group; ``calls`` maps a unit of several groups to its :class:`FusedTBE`;
    ``report`` says per group whether and with which groups it is fused, or why not.
    """

    def __init__(self, directs: Sequence[DirectTBE | None]) -> None:
        self._directs = tuple(directs)
        self.units: tuple[tuple[int, ...], ...] = ()
        self.calls: dict[tuple[int, ...], FusedTBE] = {}
        self.report: tuple[str | None, ...] = ()
        # Per direct group: (kernel, its learning-rate tensor, that tensor's version, its optimizer arguments)
        # as last planned; a change of any of them re-checks the grouping.
        self._watch: list[tuple[dict[str, Any], torch.Tensor, int, Any]] = []
        self.plan()

    def _partition(self) -> tuple[list[tuple[int, ...]], dict[int, tuple[Any, ...] | None]]:
        """The units of two or more groups with equal :func:`fusion_key`, and every direct group's key."""
        buckets: dict[tuple[Any, ...], list[int]] = {}
        keys: dict[int, tuple[Any, ...] | None] = {}
        for g_i, direct in enumerate(self._directs):
            if direct is None:
                continue
            key = fusion_key(direct)
            keys[g_i] = key
            if key is not None:
                buckets.setdefault(key, []).append(g_i)
        return [tuple(b) for b in buckets.values() if len(b) > 1], keys

    def plan(self) -> None:
        """Group the direct TBEs by :func:`fusion_key`; fuse each group of two or more (re-using a fusion whose
        kernels and views are unchanged); give kernels that leave a fusion rows of their own again."""
        fused, keys = self._partition()
        in_fused = {g_i for unit in fused for g_i in unit}
        singles: list[tuple[int, ...]] = [(g_i,) for g_i in range(len(self._directs)) if g_i not in in_fused]
        old = self.calls
        calls: dict[tuple[int, ...], FusedTBE] = {}
        for unit in fused:
            directs = [self._call(g_i) for g_i in unit]
            hit = old.get(unit)
            if (
                hit is None
            ):  # the same kernels fused by another lookup: share its buffers (no copy, no ping-pong)
                hit = _SHARED.get(id(directs[0].kernel))
                if hit is not None and (
                    len(hit.kernels) != len(directs)
                    or any(k is not d.kernel for k, d in zip(hit.kernels, directs, strict=False))
                ):
                    hit = None
            if hit is None or not hit.bound():
                hit = FusedTBE(directs)
                _SHARED[id(directs[0].kernel)] = hit
            calls[unit] = hit
        for unit, call in old.items():  # kernels fused before and not now: their own rows again
            if unit not in calls:
                for g_i, kernel in zip(unit, call.kernels, strict=True):
                    if g_i not in in_fused:
                        _unbind(kernel)
        self.calls = calls
        self.units = tuple(sorted(fused + singles))
        report: list[str | None] = []
        for g_i, direct in enumerate(self._directs):
            if direct is None:
                report.append(None)
            elif g_i in in_fused:
                unit = next(u for u in fused if g_i in u)
                report.append("fused: groups " + ", ".join(map(str, unit)) + " in one op call")
            elif keys[g_i] is None:
                report.append("unfused: rows placed in more than one memory, or not 1-D")
            else:
                report.append(
                    "unfused: no other direct TBE with the same op, memory, dtypes, modes, learning rate and "
                    "optimizer arguments"
                )
        self.report = tuple(report)
        self._watch = self._watched()

    def _watched(self) -> list[tuple[dict[str, Any], torch.Tensor, int, Any]]:
        """Per direct kernel: its instance dictionary (fbgemm keeps both there, so a read is a dict lookup),
        learning-rate tensor, that tensor's version and optimizer arguments."""
        out = []
        for direct in self._directs:
            if direct is not None:
                k = direct.kernel
                lr = k.learning_rate_tensor
                out.append((k.__dict__, lr, lr._version, k.optimizer_args))
        return out

    def _call(self, g_i: int) -> DirectTBE:
        direct = self._directs[g_i]
        assert direct is not None  # only direct groups are planned
        return direct

    def stale(self) -> bool:
        """Whether the grouping no longer matches the kernels (then :meth:`plan` again): a fused kernel's rows
        are not the views it bound, or a learning rate or the optimizer arguments changed so that the kernels
        group differently. A change that keeps the grouping (the same new learning rate set on every kernel) is
        taken as it is: the fused call reads the first kernel's. A few attribute reads per kernel."""
        for state, lr, version, args in self._watch:
            if (
                state.get("learning_rate_tensor") is not lr
                or lr._version != version
                or state.get("optimizer_args") is not args
            ):
                fused, _ = self._partition()
                if sorted(fused) != sorted(self.calls):
                    return True
                self._watch = self._watched()
                break
        return not all(call.bound() for call in self.calls.values())


def _holder(module: Any, name: str) -> dict[str, Any]:
    """The dictionary of ``module`` that holds attribute ``name`` (parameters, buffers or the instance's)."""
    for store in (module._parameters, module._buffers, module.__dict__):
        if name in store:
            holder: dict[str, Any] = store
            return holder
    return {}  # never matches: the fusion is planned again


def _unbind(kernel: Any) -> None:
    """Give a kernel that leaves a fusion its own storage for every tensor that is a view of a larger one."""
    with torch.no_grad():
        for name in ("weights_host", "weights_dev", "momentum1_host", "momentum1_dev"):
            tensor = getattr(kernel, name, None)
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().nbytes() > tensor.nbytes:
                tensor.data = tensor.detach().clone()
