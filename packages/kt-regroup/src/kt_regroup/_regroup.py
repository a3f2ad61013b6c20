"""Public regroup entry points: ``regroup``, ``regroup_as_dict`` and the ``KTRegroupAsDict`` module."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kt_regroup._backend import resolve_backend
from kt_regroup._ops import PlanArgs, run_permute
from kt_regroup._plan import Plan, PlanData, build_plan, build_plan_data, make_tensors, whole_input_runs
from kt_regroup._spec import (
    InputLayout,
    as_lengths,
    build_spec,
    check_keyed_tensors,
    normalize_groups,
    read_layout,
)
from kt_regroup.errors import ArgumentTypeError, InvalidGroupsError, LayoutMismatchError, LengthMismatchError
from kt_regroup.interfaces import KeyedTensorLike

__all__ = ["KTRegroupAsDict", "regroup", "regroup_as_dict"]

_PLAN_CACHE: OrderedDict[tuple[object, ...], Plan] = OrderedDict()
_PLAN_CACHE_SIZE = 64


def _plan_for(layout: InputLayout, groups: tuple[tuple[str, ...], ...], backend: str) -> Plan:
    spec = build_spec(layout.keys, layout.lengths, groups)
    name = resolve_backend(
        backend, layout.device, layout.key_dim, layout.dtype, len(layout.keys), len(groups)
    )
    return build_plan(spec, name, layout.key_dim, layout.device, layout.dtype)


@torch._dynamo.assume_constant_result  # type: ignore[untyped-decorator]  # untyped in torch
def _constant_plan(
    keys: tuple[tuple[str, ...], ...],
    lengths: tuple[tuple[int, ...], ...],
    groups: tuple[tuple[str, ...], ...],
    backend: str,
    key_dim: int,
    device: str,
    dtype: str,
) -> tuple[object, ...]:
    """A plan as nested tuples of ints, computed outside the traced graph (for a cold ``torch.compile``)."""
    spec = build_spec(keys, lengths, groups)
    dev = torch.device(device)
    dt = getattr(torch, dtype.removeprefix("torch."))
    name = resolve_backend(backend, dev, key_dim, dt, len(keys), len(groups))
    data = build_plan_data(spec, name, key_dim, dt)
    return (data.index, data.meta, data.in_lengths, data.out_lengths, data.key_dim, data.backend)


def _cached_plan(layout: InputLayout, groups: tuple[tuple[str, ...], ...], backend: str) -> Plan:
    """Plans of the functional API, kept in a small LRU keyed by layout, groups and backend.

    The key leaves out the batch size: a plan does not depend on it, and a varying batch (the last batch
    of an epoch, VBE) must not fill the LRU with copies of one plan.
    """
    from kt_regroup import _env

    key = (
        layout.keys,
        layout.lengths,
        layout.key_dim,
        layout.device,
        layout.dtype,
        groups,
        backend,
        _env.BACKEND.get(),
    )
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        plan = _plan_for(layout, groups, backend)
        _PLAN_CACHE[key] = plan
        if len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
            _PLAN_CACHE.popitem(last=False)
    else:
        _PLAN_CACHE.move_to_end(key)
    return plan


def _traced_by_fx(keyed_tensors: Sequence[KeyedTensorLike]) -> bool:
    """Whether ``torch.fx.symbolic_trace`` is tracing these inputs (some values are fx Proxies).

    Raises:
        ArgumentTypeError: ``keyed_tensors`` is not a list of KeyedTensor-likes (see
            :func:`check_keyed_tensors`, which only runs when something is wrong: the eager path pays one
            ``isinstance`` per input).
    """
    given: object = keyed_tensors  # callers without type checking pass a single KeyedTensor
    if not isinstance(given, (list, tuple)):
        check_keyed_tensors(given)  # raises (a single KeyedTensor would be iterated by key `0`)
    try:
        return any(isinstance(kt.values(), torch.fx.Proxy) for kt in keyed_tensors)
    except (AttributeError, RuntimeError):
        # A plain tensor (its values() is the sparse op) or None in the list: say so, not the raw error.
        check_keyed_tensors(keyed_tensors)
        raise


def _fx_regroup(
    values: list[torch.Tensor],
    keys: tuple[tuple[str, ...], ...],
    lengths: tuple[tuple[int, ...], ...],
    key_dim: int,
    groups: tuple[tuple[str, ...], ...],
    backend: str,
) -> list[torch.Tensor]:
    """One node of a ``torch.fx`` graph: the regroup of ``values`` laid out as ``keys`` / ``lengths``.

    Wrapped with ``torch.fx.wrap``, so symbolic tracing records a call (its arguments are the traced values
    and plain constants) instead of tracing into plan building; when the graph runs, this is the
    functional :func:`regroup` (same checks, its plan cache per layout).
    """
    from kt_regroup._keyed_tensor import KeyedTensor  # imports this module

    kts = [KeyedTensor(k, n, v, key_dim) for k, n, v in zip(keys, lengths, values, strict=True)]
    return regroup(kts, groups, backend=backend)


torch.fx.wrap("_fx_regroup")


def _trace_fx(
    keyed_tensors: Sequence[KeyedTensorLike], groups: tuple[tuple[str, ...], ...], backend: str
) -> list[torch.Tensor]:
    """Under ``torch.fx.symbolic_trace``: one ``_fx_regroup`` node, indexed per group (a list of Proxies)."""
    key_dims = {kt.key_dim() for kt in keyed_tensors}
    if len(key_dims) != 1:
        raise LayoutMismatchError(f"the KeyedTensors have key_dims {sorted(key_dims)}; expected one key_dim")
    outputs = _fx_regroup(
        [kt.values() for kt in keyed_tensors],
        tuple(tuple(kt.keys()) for kt in keyed_tensors),
        tuple(
            as_lengths(kt.length_per_key(), f"KeyedTensor {i}'s `length_per_key`")
            for i, kt in enumerate(keyed_tensors)
        ),
        key_dims.pop(),
        groups,
        backend,
    )
    return [outputs[index] for index in range(len(groups))]


def _args(plan: Plan, tensors: Sequence[torch.Tensor] | None = None) -> PlanArgs:
    return (
        tuple(plan.tensors if tensors is None else tensors),
        plan.meta,
        plan.in_lengths,
        plan.out_lengths,
        plan.key_dim,
        plan.backend,
    )


def _run(keyed_tensors: Sequence[KeyedTensorLike], plan: Plan) -> list[torch.Tensor]:
    if not plan.out_lengths:
        return []
    return run_permute([kt.values() for kt in keyed_tensors], _args(plan))


def regroup(
    keyed_tensors: Sequence[KeyedTensorLike],
    groups: Sequence[Sequence[str]],
    *,
    backend: str = "auto",
) -> list[torch.Tensor]:
    """Regroup the keys of one or more KeyedTensors into feature groups.

    Args:
        keyed_tensors: KeyedTensor-likes (``keys()``, ``length_per_key()``, ``values()``, ``key_dim()``)
            with one batch size, device, dtype and ``key_dim``; keys unique across all of them.
        groups: the keys of each output group, in output order. Keys may repeat (within and across
            groups) and may be left out.
        backend: ``"auto"``, ``"torch"``, ``"fbgemm"`` or ``"triton"`` (``KT_REGROUP_BACKEND`` overrides).

    Returns:
        One ``[B, sum(dims of the group's keys)]`` tensor per group (``[sum(dims), B]`` for
        ``key_dim == 0``); ``[B, 0]`` for an empty group, ``[]`` for no groups. Differentiable: a
        repeated key's gradient is the sum over its occurrences, a skipped key's gradient is 0.

    Raises:
        UnknownKeyError: a group names a key that no input holds.
        AmbiguousKeyError: a key is in two inputs.
        LayoutMismatchError: inputs differ in batch size, device, dtype or key_dim.
        LengthMismatchError: an input's lengths do not match its values.
        InvalidGroupsError: ``groups`` is malformed.
        ArgumentTypeError: ``keyed_tensors`` is not a list of KeyedTensor-likes (a single one, a plain tensor
            or ``None`` in it), ``groups`` or a group is ``None``, or a length is not an int.
        UnknownBackendError, BackendUnavailableError: see ``backend``.
    """
    groups_t = normalize_groups(groups)
    if _traced_by_fx(keyed_tensors):
        return _trace_fx(keyed_tensors, groups_t, backend)
    layout = read_layout(keyed_tensors)
    return _run(keyed_tensors, _cached_plan(layout, groups_t, backend))


def _check_names(groups: tuple[tuple[str, ...], ...], keys: Sequence[str]) -> tuple[str, ...]:
    if isinstance(keys, str):
        raise InvalidGroupsError(f"`keys` must be a list of names, one per group; got the str {keys!r}")
    given: object = keys  # callers without type checking pass None
    if not isinstance(given, Iterable):
        got = "None" if given is None else type(given).__name__
        raise ArgumentTypeError(f"`keys` must be a list of names, one per group; got {got}")
    names = tuple(keys)
    for name in names:
        if not isinstance(name, str):
            raise InvalidGroupsError(f"`keys` holds {name!r} ({type(name).__name__}); expected str names")
    if len(names) != len(groups):
        raise InvalidGroupsError(f"`keys` has {len(names)} names but `groups` has {len(groups)} groups")
    if len(set(names)) != len(names):
        raise InvalidGroupsError(f"`keys` names an output twice: {list(names)}")
    return names


def regroup_as_dict(
    keyed_tensors: Sequence[KeyedTensorLike],
    groups: Sequence[Sequence[str]],
    keys: Sequence[str],
    *,
    backend: str = "auto",
) -> dict[str, torch.Tensor]:
    """:func:`regroup`, with the outputs named: ``{keys[g]: output of group g}``.

    Raises:
        InvalidGroupsError: ``keys`` does not name each group exactly once (plus :func:`regroup`'s errors).
    """
    groups_t = normalize_groups(groups)
    names = _check_names(groups_t, keys)
    return dict(zip(names, regroup(keyed_tensors, groups_t, backend=backend), strict=False))


class _LayoutKey(tuple[Any, ...]):
    """A plan cache key that hashes once: hashing a thousand key names and lengths costs ~15 us a lookup.

    Equal to (and hashed like) the plain tuple of its items, so it finds plans stored under either.
    """

    _hash: int

    def __new__(cls, items: Iterable[Any]) -> _LayoutKey:
        key = super().__new__(cls, items)
        key._hash = tuple.__hash__(key)
        return key

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt (and re-hashed) on unpickling: str hashes differ between processes.
        return (_LayoutKey, (tuple(self),))


@dataclass(frozen=True, slots=True)
class _CachedPlan:
    buffers: tuple[str, ...]
    plan: Plan  # the plan's tensors live in the module's buffers (moved by .to()); these are not used
    # Per group, the inputs it concatenates whole (``backend="auto"`` only): then a ``torch.cat``, whose
    # backward is views of the gradient, replaces the permute kernels.
    concat: tuple[tuple[int, ...], ...] | None = None


class KTRegroupAsDict(nn.Module):
    """Regroup KeyedTensors into named feature groups, with the plan cached per input layout.

    The plan (small int index tensors) is computed on the first call with a given layout (keys, lengths,
    ``key_dim``, device, dtype) and kept as non-persistent buffers, so later calls do no host metadata
    work beyond recognising the layout; ``clear_cache()`` drops the plans (and re-reads
    ``KT_REGROUP_BACKEND``).

    Args:
        groups: the keys of each output group (keys may repeat or be left out).
        keys: one output name per group.
        backend: ``"auto"``, ``"torch"``, ``"fbgemm"`` or ``"triton"``.

    Call with a list of KeyedTensor-likes; returns ``{keys[g]: [B, sum(dims of group g)]}``.
    """

    def __init__(
        self, groups: Sequence[Sequence[str]], keys: Sequence[str], *, backend: str = "auto"
    ) -> None:
        super().__init__()
        from kt_regroup._backend import _check_name

        self._groups = normalize_groups(groups)
        self._keys = _check_names(self._groups, keys)
        self._backend = _check_name(backend, "`backend`")
        self._plans: dict[tuple[object, ...], _CachedPlan] = {}
        # The eager path's arguments per layout, holding the buffers themselves (refreshed by _apply).
        self._eager_args: dict[tuple[object, ...], PlanArgs] = {}
        # The previous eager call's (keys, lengths, (key_dim, device, dtype), plan key): see _layout_key.
        self._last_layout: (
            tuple[list[list[str]], list[list[int]], tuple[Any, ...], tuple[Any, ...]] | None
        ) = None

    @property
    def groups(self) -> list[list[str]]:
        """The groups given at construction."""
        return [list(g) for g in self._groups]

    def clear_cache(self) -> None:
        """Drop every cached plan and its buffers; the next call builds a fresh one."""
        for cached in self._plans.values():
            for name in cached.buffers:
                delattr(self, name)
        self._plans.clear()
        self._eager_args.clear()
        self._last_layout = None

    def _build(self, key: tuple[object, ...], layout: InputLayout) -> _CachedPlan:
        # Stored under the plain tuple: dynamo cannot hash a dict key whose class overrides __hash__ (a
        # _LayoutKey still finds it: equal, and hashed alike).
        key = tuple(key)
        plan = _plan_for(layout, self._groups, self._backend)
        names = []
        slot = len(self._plans)
        while any(hasattr(self, f"_kt_plan_{slot}_0") for _ in (0,)):
            slot += 1
        for index, tensor in enumerate(plan.tensors):
            name = f"_kt_plan_{slot}_{index}"
            self.register_buffer(name, tensor, persistent=False)
            names.append(name)
        from kt_regroup import _env

        concat = None
        if self._backend == "auto" and _env.BACKEND.get() in ("", "auto"):
            concat = whole_input_runs(layout.keys, self._groups)
        cached = _CachedPlan(tuple(names), plan, concat)
        self._plans[key] = cached
        self._eager_args[key] = _args(plan, [getattr(self, name) for name in names])
        return cached

    def _apply(self, fn: Any, recurse: bool = True) -> KTRegroupAsDict:
        """``.to()`` / ``.cuda()`` replace the buffers: point the eager arguments at the new ones."""
        result: KTRegroupAsDict = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]  # untyped in torch
        for key, cached in self._plans.items():
            self._eager_args[key] = _args(cached.plan, [getattr(self, name) for name in cached.buffers])
        return result

    def forward(self, keyed_tensors: list[KeyedTensorLike]) -> dict[str, torch.Tensor]:
        """``{name: [B, sum(dims)]}`` for every group (``[sum(dims), B]`` for ``key_dim == 0`` inputs)."""
        if _traced_by_fx(keyed_tensors):  # also the precise error for a single KeyedTensor, None, a tensor
            outputs = _trace_fx(keyed_tensors, self._groups, self._backend)
            return dict(zip(self._keys, outputs, strict=True))
        if not keyed_tensors:
            raise LayoutMismatchError("`keyed_tensors` is empty: at least one KeyedTensor is needed")
        first = keyed_tensors[0].values()
        try:
            key = self._layout_key(keyed_tensors, first)
        except AttributeError:
            check_keyed_tensors(keyed_tensors)  # an input without keys() / length_per_key() / key_dim()
            raise
        cached = self._plans.get(key)
        if cached is None and torch.compiler.is_compiling():
            return self._traced_cold(keyed_tensors, key)
        if cached is None:
            cached = self._build(key, read_layout(keyed_tensors))
        else:
            self._check_cheap(keyed_tensors, cached.plan)
        plan = cached.plan
        if not plan.out_lengths:
            return {}
        if cached.concat is not None:
            values = [kt.values() for kt in keyed_tensors]
            return {
                name: torch.cat([values[i] for i in run], dim=plan.key_dim)
                for name, run in zip(self._keys, cached.concat, strict=True)
            }
        if torch.compiler.is_compiling():
            # Read the buffers through the module so dynamo / export see them as buffers.
            args = _args(plan, [getattr(self, name) for name in cached.buffers])
        else:
            args = self._eager_args[key]
            if args[0] and args[0][0].device != first.device:
                # The plan was made for another device (the module was not moved with its inputs).
                for name in cached.buffers:
                    delattr(self, name)
                del self._plans[key]
                cached = self._build(key, read_layout(keyed_tensors))
                args = self._eager_args[key]
        outputs = run_permute([kt.values() for kt in keyed_tensors], args)
        return dict(zip(self._keys, outputs, strict=True))

    def _layout_key(self, keyed_tensors: Sequence[KeyedTensorLike], first: torch.Tensor) -> tuple[Any, ...]:
        """The plan cache key: keys, lengths, key_dim, device, dtype of the inputs.

        Eager calls first compare the inputs' key and length lists with copies kept from the previous
        call (a list comparison, no tuple building or hashing of a thousand keys) and reuse its key.
        """
        keys = [kt.keys() for kt in keyed_tensors]
        lengths = [kt.length_per_key() for kt in keyed_tensors]
        rest = (keyed_tensors[0].key_dim(), first.device, first.dtype)
        if torch.compiler.is_compiling():
            return (tuple(map(tuple, keys)), tuple(map(tuple, lengths)), *rest)
        last = self._last_layout
        if last is not None and last[0] == keys and last[1] == lengths and last[2] == rest:
            return last[3]
        key = _LayoutKey((tuple(map(tuple, keys)), tuple(map(tuple, lengths)), *rest))
        # Copies: a caller may mutate its lists in place between calls.
        self._last_layout = ([list(k) for k in keys], [list(n) for n in lengths], rest, key)
        return key

    def _traced_cold(
        self, keyed_tensors: Sequence[KeyedTensorLike], key: tuple[Any, ...]
    ) -> dict[str, torch.Tensor]:
        """Under ``torch.compile`` with no cached plan: the plan becomes constants of the graph.

        Registering buffers while dynamo traces would break the graph, so the plan is computed outside
        the trace (``assume_constant_result``) and its index tensors are built inside the graph.
        """
        keys, lengths, key_dim, device, dtype = key
        index, meta, in_lengths, out_lengths, plan_key_dim, backend = _constant_plan(
            keys, lengths, self._groups, self._backend, key_dim, str(device), str(dtype)
        )
        data = PlanData(
            index=index,
            meta=meta,
            in_lengths=in_lengths,
            out_lengths=out_lengths,
            key_dim=plan_key_dim,
            backend=backend,
        )
        if not data.out_lengths:
            return {}
        args: PlanArgs = (
            make_tensors(data.index, device),
            data.meta,
            data.in_lengths,
            data.out_lengths,
            data.key_dim,
            data.backend,
        )
        outputs = run_permute([kt.values() for kt in keyed_tensors], args)
        return dict(zip(self._keys, outputs, strict=True))

    @staticmethod
    def _check_cheap(keyed_tensors: Sequence[KeyedTensorLike], plan: Plan) -> None:
        """Per-call checks that cost O(inputs): key_dim, widths, batch size, device and dtype agree.

        The layout key holds the first input's ``key_dim`` only, so every other input's is checked here: a
        ``[W, W]`` input that switched to ``key_dim=0`` would otherwise pass the width check.
        """
        key_dim = plan.key_dim
        first = keyed_tensors[0].values()
        for index, (kt, width) in enumerate(zip(keyed_tensors, plan.in_lengths, strict=False)):
            if kt.key_dim() != key_dim:
                read_layout(keyed_tensors)  # raises the precise LayoutMismatchError
            values = kt.values()
            if values.dim() != 2 or values.size(key_dim) != width:
                raise LengthMismatchError(
                    f"KeyedTensor {index}'s `length_per_key` sums to {width} but its values have shape "
                    f"{tuple(values.shape)} (key_dim={key_dim})"
                )
            if index and (
                values.size(1 - key_dim) != first.size(1 - key_dim)
                or values.device != first.device
                or values.dtype != first.dtype
            ):
                read_layout(keyed_tensors)  # raises the precise LayoutMismatchError

    def extra_repr(self) -> str:
        return f"groups={len(self._groups)}, keys={list(self._keys)}, backend={self._backend!r}"
