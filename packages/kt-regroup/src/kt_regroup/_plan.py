"""Backend plans: a :class:`RegroupSpec` turned into small int index tensors on the inputs' device.

A plan is ``(tensors, meta)``: ``tensors`` are int32/int64 index tensors (cached as buffers by
``KTRegroupAsDict``), ``meta`` a flat list of ints that says how to read them. Both travel through the
``kt_regroup::permute`` op schema, which has no string arguments (``torch.export`` needs that).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kt_regroup._spec import RegroupSpec

__all__ = [
    "BACKEND_IDS",
    "TRITON_MAX_TENSORS",
    "IndexData",
    "Plan",
    "PlanData",
    "TorchMeta",
    "build_plan",
    "build_plan_data",
    "decode_torch_meta",
    "make_tensors",
    "whole_input_runs",
]

BACKEND_IDS = {"torch": 0, "fbgemm": 1, "triton": 2}
# The Triton kernels take this many input and output pointers as plain arguments (no pointer table).
TRITON_MAX_TENSORS = 8
TRITON_BLOCK_D = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything the op needs besides the values: index tensors plus the static ints of the schema."""

    tensors: tuple[torch.Tensor, ...]
    meta: tuple[int, ...]
    in_lengths: tuple[int, ...]
    out_lengths: tuple[int, ...]
    key_dim: int
    backend: int


# An index tensor before it is made: flat values, shape, dtype ("int32" or "int64").
IndexData = tuple[tuple[int, ...], tuple[int, ...], str]


def _index(values: list[int], dtype: str = "int64", shape: tuple[int, ...] | None = None) -> IndexData:
    return tuple(values), shape if shape is not None else (len(values),), dtype


def _table(rows: list[list[int]], width: int) -> IndexData:
    return _index([v for row in rows for v in row], "int32", (len(rows), width))


def make_tensors(data: tuple[IndexData, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The index tensors of a plan, on ``device``."""
    return tuple(
        torch.tensor(list(flat), dtype=getattr(torch, dtype), device=device).reshape(shape)
        for flat, shape, dtype in data
    )


def _blocks(start: int, length: int, unit: int) -> range:
    return range(start // unit, (start + length) // unit)


def _torch_plan(spec: RegroupSpec, dtype: torch.dtype) -> tuple[list[IndexData], list[int]]:
    """Block-level gather plan for the pure-PyTorch backend (see ``_torch_impl``)."""
    unit = spec.unit
    tensors: list[IndexData] = []

    def add(values: list[int]) -> int:
        tensors.append(_index(values))
        return len(tensors) - 1

    # Forward: per group, per input: source blocks in the input, target blocks in the group.
    fwd: list[int] = []
    n_fwd = 0
    by_group: dict[int, dict[int, tuple[list[int], list[int]]]] = defaultdict(dict)
    for entry in spec.entries:
        src, dst = by_group[entry.group].setdefault(entry.input, ([], []))
        src.extend(_blocks(entry.in_offset, entry.length, unit))
        dst.extend(_blocks(entry.out_offset, entry.length, unit))
    for group in range(len(spec.out_widths)):
        parts = by_group.get(group, {})
        for input_index, (src, dst) in parts.items():
            whole = len(parts) == 1
            fwd += [group, input_index, add(src), -1 if whole else add(dst)]
            n_fwd += 1
    # Backward: per input, per occurrence round, per group: target blocks in the input's gradient and
    # source blocks in the group's gradient. Within one piece the targets are distinct, so a plain
    # index_copy_ (no atomics) is exact and deterministic; rounds > 0 add onto round 0 in group order.
    pieces: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
    covered = [0] * len(spec.in_widths)
    for entry in spec.entries:
        dst, src = pieces.setdefault((entry.input, entry.occurrence, entry.group), ([], []))
        dst.extend(_blocks(entry.in_offset, entry.length, unit))
        src.extend(_blocks(entry.out_offset, entry.length, unit))
        if entry.occurrence == 0:
            covered[entry.input] += entry.length
    bwd: list[int] = []
    for (input_index, occurrence, group), (dst, src) in sorted(pieces.items()):
        whole = src == list(range(spec.out_widths[group] // unit))
        bwd += [input_index, occurrence, group, add(dst), -1 if whole else add(src)]
    zero_init = [int(c != w) for c, w in zip(covered, spec.in_widths, strict=False)]
    reduced = dtype in (torch.float16, torch.bfloat16)
    acc_fp32 = int(reduced and spec.max_occurrences >= 3)
    meta = [unit, acc_fp32, len(spec.in_widths), *zero_init, n_fwd, *fwd, len(pieces), *bwd]
    # The CPU path (split + cat, see _torch_impl): key counts and lengths per input, each group's key
    # ids, each input's gradient pieces (entry index of the key's first use, or a zero piece).
    n_groups = len(spec.out_widths)
    counts = [0] * len(spec.in_widths)
    for input_index, _, _ in spec.key_segments:
        counts[input_index] += 1
    group_keys: list[list[int]] = [[] for _ in range(n_groups)]
    for entry in spec.entries:
        group_keys[entry.group].append(entry.key_id)
    orders: list[list[int]] = [[] for _ in spec.in_widths]
    n_skipped = 0
    for key_id, (input_index, _, _) in enumerate(spec.key_segments):
        users = spec.key_entries[key_id]
        if users:
            orders[input_index].append(users[0])
        else:
            orders[input_index].append(len(spec.entries) + n_skipped)
            n_skipped += 1
    meta += [*counts, *(length for _, _, length in spec.key_segments)]
    for keys in group_keys:
        meta += [len(keys), *keys]
    for order in orders:
        meta += order
    return tensors, meta


@dataclass(frozen=True, slots=True)
class TorchMeta:
    """Decoded ``meta`` of a torch plan."""

    unit: int
    acc_fp32: bool
    zero_init: tuple[bool, ...]
    fwd: tuple[tuple[tuple[int, int, int], ...], ...]  # per group: (input, src slot, dst slot or -1)
    bwd: tuple[
        tuple[tuple[int, int, int, int], ...], ...
    ]  # per input: (round, group, dst slot, src slot or -1)
    # Split + cat path (CPU):
    key_lengths: tuple[tuple[int, ...], ...]  # per input, in key order
    group_keys: tuple[tuple[int, ...], ...]  # per group: global key ids (input-major), in output order
    entry_lengths: tuple[tuple[int, ...], ...]  # per group: widths of its entries
    input_order: tuple[tuple[int, ...], ...]  # per input: gradient piece per key (entry, or zero piece)
    skipped_lengths: tuple[int, ...]  # widths of the zero pieces (keys in no group)


_TORCH_META_CACHE: dict[tuple[int, ...], TorchMeta] = {}
# Eager calls pass the plan's own meta tuple every time: look it up by identity, not by hashing it.
_TORCH_META_BY_ID: dict[int, tuple[Sequence[int], TorchMeta]] = {}


def decode_torch_meta(meta: Sequence[int], n_groups: int) -> TorchMeta:
    """Parse a torch plan's ``meta`` (memoised: plans are few)."""
    hit = _TORCH_META_BY_ID.get(id(meta))
    if hit is not None and hit[0] is meta:
        return hit[1]
    key = (n_groups, *meta)
    cached = _TORCH_META_CACHE.get(key)
    if cached is not None:
        if isinstance(meta, tuple) and len(_TORCH_META_BY_ID) < 1024:
            _TORCH_META_BY_ID[id(meta)] = (meta, cached)
        return cached
    unit, acc_fp32, n_in = meta[0], meta[1], meta[2]
    zero_init = tuple(bool(z) for z in meta[3 : 3 + n_in])
    pos = 3 + n_in
    n_fwd = meta[pos]
    pos += 1
    fwd: list[list[tuple[int, int, int]]] = [[] for _ in range(n_groups)]
    for _ in range(n_fwd):
        group, input_index, src, dst = meta[pos : pos + 4]
        fwd[group].append((input_index, src, dst))
        pos += 4
    n_bwd = meta[pos]
    pos += 1
    bwd: list[list[tuple[int, int, int, int]]] = [[] for _ in range(n_in)]
    for _ in range(n_bwd):
        input_index, occurrence, group, dst, src = meta[pos : pos + 5]
        bwd[input_index].append((occurrence, group, dst, src))
        pos += 5
    counts = meta[pos : pos + n_in]
    pos += n_in
    key_lengths = []
    for count in counts:
        key_lengths.append(tuple(meta[pos : pos + count]))
        pos += count
    all_lengths = [length for lengths in key_lengths for length in lengths]
    group_keys = []
    for _ in range(n_groups):
        count = meta[pos]
        group_keys.append(tuple(meta[pos + 1 : pos + 1 + count]))
        pos += 1 + count
    input_order = []
    for count in counts:
        input_order.append(tuple(meta[pos : pos + count]))
        pos += count
    used = {key for keys in group_keys for key in keys}
    decoded = TorchMeta(
        unit=unit,
        acc_fp32=bool(acc_fp32),
        zero_init=zero_init,
        fwd=tuple(tuple(p) for p in fwd),
        bwd=tuple(tuple(p) for p in bwd),
        key_lengths=tuple(key_lengths),
        group_keys=tuple(group_keys),
        entry_lengths=tuple(tuple(all_lengths[k] for k in keys) for keys in group_keys),
        input_order=tuple(input_order),
        skipped_lengths=tuple(all_lengths[k] for k in range(len(all_lengths)) if k not in used),
    )
    if len(_TORCH_META_CACHE) < 1024:
        _TORCH_META_CACHE[key] = decoded
    if isinstance(meta, tuple) and len(_TORCH_META_BY_ID) < 1024:
        _TORCH_META_BY_ID[id(meta)] = (meta, decoded)
    return decoded


def _fbgemm_plan(spec: RegroupSpec) -> tuple[list[IndexData], list[int]]:
    """fbgemm ``permute_multi_embedding`` arguments built from our spec (no ``str[][]`` op call).

    Rows: ``[in_tensor, out_tensor, in_offset, out_offset, length, next]``. ``next`` chains the
    occurrences of a repeated key for fbgemm's backward: the first row holds the index of the second,
    each later row minus the index of the one after it (minus the row count for the last).
    """
    rows = []
    n_rows = len(spec.entries)
    for entry in spec.entries:
        chain = spec.key_entries[entry.key_id]
        if len(chain) == 1:
            nxt = 0
        elif entry.occurrence == 0:
            nxt = chain[1]
        else:
            following = chain[entry.occurrence + 1] if entry.occurrence + 1 < len(chain) else n_rows
            nxt = -following
        rows.append([entry.input, entry.group, entry.in_offset, entry.out_offset, entry.length, nxt])
    permutes = _table(rows, 6)
    in_shapes = _index(list(spec.in_widths), "int32")
    out_shapes = _index(list(spec.out_widths), "int32")
    skipped: list[list[int]] = [[] for _ in spec.in_widths]
    for key_id, (input_index, offset, length) in enumerate(spec.key_segments):
        if not spec.key_entries[key_id]:
            skipped[input_index].extend(range(offset, offset + length))
    tensors = [permutes, in_shapes, out_shapes] + [_index(s) for s in skipped]
    meta = [len(spec.in_widths), *(int(bool(s)) for s in skipped)]
    return tensors, meta


def _triton_plan(spec: RegroupSpec) -> tuple[list[IndexData], list[int]]:
    """Tile tables for the Triton kernels (``key_dim == 1``; see ``_triton_impl``).

    Forward tiles ``[in, in_col, out, out_col, ncols]``: each program copies ``ncols <= BLOCK_D``
    columns of a block of rows. Backward tiles ``[in, in_col, ncols, occ_start, occ_count]`` cover every
    input column exactly once; a tile sums its ``occ_count`` occurrences ``occ[occ_start + j] = [out,
    out_col]`` in group order (no atomics), or writes zeros when the key is in no group.
    """
    longest = max((length for _, _, length in spec.key_segments), default=1)
    block = 16
    while block < min(longest, TRITON_BLOCK_D):
        block *= 2
    fwd = []
    for entry in spec.entries:
        for start in range(0, entry.length, block):
            ncols = min(block, entry.length - start)
            fwd.append([entry.input, entry.in_offset + start, entry.group, entry.out_offset + start, ncols])
    bwd = []
    occ: list[list[int]] = []
    for key_id, (input_index, offset, length) in enumerate(spec.key_segments):
        users = [spec.entries[e] for e in spec.key_entries[key_id]]
        for start in range(0, length, block):
            ncols = min(block, length - start)
            bwd.append([input_index, offset + start, ncols, len(occ), len(users)])
            occ.extend([u.group, u.out_offset + start] for u in users)
    align = 16
    for value in (*spec.in_widths, *spec.out_widths):
        align = _gcd(align, value)
    for row in fwd:
        align = _gcd(_gcd(_gcd(align, row[1]), row[3]), row[4])
    for row in bwd:
        align = _gcd(_gcd(align, row[1]), row[2])
    for row in occ:
        align = _gcd(align, row[1])
    tensors = [_table(fwd, 5), _table(bwd, 5), _table(occ, 2)]
    meta = [block, max(align, 1), len(fwd), len(bwd)]
    return tensors, meta


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanData:
    """A plan before its index tensors are made (plain ints: cacheable, and a constant for dynamo)."""

    index: tuple[IndexData, ...]
    meta: tuple[int, ...]
    in_lengths: tuple[int, ...]
    out_lengths: tuple[int, ...]
    key_dim: int
    backend: int

    def materialize(self, device: torch.device) -> Plan:
        """The plan with its index tensors on ``device``."""
        return Plan(
            tensors=make_tensors(self.index, device),
            meta=self.meta,
            in_lengths=self.in_lengths,
            out_lengths=self.out_lengths,
            key_dim=self.key_dim,
            backend=self.backend,
        )


def build_plan_data(spec: RegroupSpec, backend: str, key_dim: int, dtype: torch.dtype) -> PlanData:
    """The plan of ``spec`` for ``backend`` ("torch", "fbgemm" or "triton"), as plain ints."""
    if backend == "torch":
        index, meta = _torch_plan(spec, dtype)
    elif backend == "fbgemm":
        index, meta = _fbgemm_plan(spec)
    elif backend == "triton":
        index, meta = _triton_plan(spec)
    else:  # pragma: no cover - callers resolve the backend first
        raise ValueError(f"`backend` {backend!r} has no plan")
    return PlanData(
        index=tuple(index),
        meta=tuple(meta),
        in_lengths=spec.in_widths,
        out_lengths=spec.out_widths,
        key_dim=key_dim,
        backend=BACKEND_IDS[backend],
    )


def build_plan(
    spec: RegroupSpec, backend: str, key_dim: int, device: torch.device, dtype: torch.dtype
) -> Plan:
    """The plan of ``spec`` for ``backend`` with its index tensors on ``device``."""
    return build_plan_data(spec, backend, key_dim, dtype).materialize(device)


def whole_input_runs(
    keys: Sequence[Sequence[str]], groups: Sequence[Sequence[str]]
) -> tuple[tuple[int, ...], ...] | None:
    """Per group, the inputs whose keys, laid end to end in order, are exactly the group; else ``None``.

    Then every group is a ``torch.cat`` of whole inputs (its backward: views of the gradient, no kernel).
    ``None`` unless every key name is unique over all inputs, every group is such a run and every input is
    in some group (an input in no group must get a zero gradient, which a ``cat`` would not give).
    """
    flat = [k for input_keys in keys for k in input_keys]
    if len(set(flat)) != len(flat):
        return None
    first_key = {input_keys[0]: i for i, input_keys in enumerate(keys) if len(input_keys)}
    runs: list[tuple[int, ...]] = []
    used: set[int] = set()
    for group in groups:
        run: list[int] = []
        at = 0
        while at < len(group):
            i = first_key.get(group[at])
            if i is None:
                return None
            width = len(keys[i])
            if tuple(group[at : at + width]) != tuple(keys[i]):
                return None
            run.append(i)
            at += width
        if not run:
            return None
        runs.append(tuple(run))
        used.update(run)
    if len(used) != sum(1 for input_keys in keys if len(input_keys)) or any(not len(k) for k in keys):
        return None
    return tuple(runs)
