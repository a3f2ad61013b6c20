"""Pure-PyTorch regroup: one gather per (group, input) over blocks of ``unit`` columns.

Every key's width is a multiple of ``unit`` (the gcd of the key lengths), so values are viewed as
``[outer, width / unit, unit * inner]`` and whole blocks move with ``index_select`` / ``index_copy_``:
contiguous copies of ``unit`` elements, no per-key Python loop. ``key_dim == 1``: ``outer = B``,
``inner = 1``; ``key_dim == 0``: ``outer = 1``, ``inner = B``.

On CPU, where the copies themselves dominate, the forward (and the first-occurrence part of the
backward) is instead one ``torch.cat`` per output over views from one ``torch.split`` per input: a
single memory pass even when a group mixes inputs; the views are picked with a precomputed
``operator.itemgetter`` (C-level, no per-key Python loop). The cat writes into a recycled host buffer
(:mod:`kt_regroup._host_pool`): a fresh one would cost more in page faults than the copy itself.

The backward writes each input block with ``index_copy_`` from the first occurrence of its key and then
adds later occurrences round by round (each round touches distinct blocks): no atomics, the same bits on
every run, and skipped keys exactly 0.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kt_regroup._host_pool import host_empty
from kt_regroup._plan import TorchMeta, decode_torch_meta

# The split + cat path runs on these device types (tests turn it off to cover the index path on CPU).
CAT_DEVICES = {"cpu"}

__all__ = ["torch_backward", "torch_forward"]


def _block_view(t: torch.Tensor, key_dim: int, unit: int) -> torch.Tensor:
    t = t.contiguous()
    if key_dim == 1:
        return t.view(t.size(0), t.size(1) // unit, unit)
    return t.view(1, t.size(0) // unit, unit * t.size(1))


def _unview(blocks: torch.Tensor, key_dim: int, width: int, batch: int) -> torch.Tensor:
    return blocks.view(batch, width) if key_dim == 1 else blocks.view(width, batch)


def _empty_blocks(
    like: torch.Tensor, key_dim: int, width: int, unit: int, batch: int, dtype: torch.dtype, zero: bool
) -> torch.Tensor:
    shape = (batch, width // unit, unit) if key_dim == 1 else (1, width // unit, unit * batch)
    make = torch.zeros if zero else torch.empty
    return make(shape, dtype=dtype, device=like.device)


_GETTERS: dict[tuple[int, ...], Callable[[Any], tuple[Any, ...]]] = {}


def _getter(indices: tuple[int, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """``operator.itemgetter`` that always returns a tuple (memoised per index tuple)."""
    getter = _GETTERS.get(indices)
    if getter is None:
        if len(indices) == 1:
            single = operator.itemgetter(indices[0])

            def getter(items: Any, single: Any = single) -> tuple[Any, ...]:
                return (single(items),)

        else:
            getter = operator.itemgetter(*indices)
        if len(_GETTERS) < 4096:
            _GETTERS[indices] = getter
    return getter


def _cat(
    pieces: tuple[torch.Tensor, ...], like: torch.Tensor, key_dim: int, batch: int, width: int
) -> torch.Tensor:
    """``torch.cat`` of ``pieces`` along ``key_dim`` into a recycled host buffer of ``width`` columns."""
    shape = (batch, width) if key_dim == 1 else (width, batch)
    if not pieces:
        return like.new_empty(shape)
    return torch.cat(pieces, dim=key_dim, out=host_empty(shape, like.dtype))


def _cat_forward(
    values: Sequence[torch.Tensor], decoded: TorchMeta, out_lengths: Sequence[int], key_dim: int, batch: int
) -> list[torch.Tensor]:
    pieces: list[torch.Tensor] = []
    for value, lengths in zip(values, decoded.key_lengths, strict=True):
        pieces.extend(torch.split(value, list(lengths), dim=key_dim))
    return [
        _cat(_getter(keys)(pieces) if keys else (), values[0], key_dim, batch, width)
        for keys, width in zip(decoded.group_keys, out_lengths, strict=True)
    ]


def torch_forward(
    values: Sequence[torch.Tensor],
    plan: Sequence[torch.Tensor],
    meta: Sequence[int],
    out_lengths: Sequence[int],
    key_dim: int,
) -> list[torch.Tensor]:
    """Regrouped outputs, ``[B, out_lengths[g]]`` each (``[out_lengths[g], B]`` for ``key_dim == 0``)."""
    decoded = decode_torch_meta(meta, len(out_lengths))
    unit = decoded.unit
    batch = values[0].size(1 - key_dim)
    if values[0].device.type in CAT_DEVICES:
        return _cat_forward(values, decoded, out_lengths, key_dim, batch)
    views = [_block_view(v, key_dim, unit) for v in values]
    outputs = []
    for group, width in enumerate(out_lengths):
        pieces = decoded.fwd[group]
        if len(pieces) == 1 and pieces[0][2] < 0:
            input_index, src, _ = pieces[0]
            blocks = torch.index_select(views[input_index], 1, plan[src])
        else:
            blocks = _empty_blocks(values[0], key_dim, width, unit, batch, values[0].dtype, zero=False)
            for input_index, src, dst in pieces:
                blocks.index_copy_(1, plan[dst], torch.index_select(views[input_index], 1, plan[src]))
        outputs.append(_unview(blocks, key_dim, width, batch))
    return outputs


def torch_backward(
    grads: Sequence[torch.Tensor],
    plan: Sequence[torch.Tensor],
    meta: Sequence[int],
    in_lengths: Sequence[int],
    key_dim: int,
) -> list[torch.Tensor]:
    """Input gradients, ``[B, in_lengths[i]]`` each: sums over occurrences, exact 0 for skipped keys."""
    decoded = decode_torch_meta(meta, len(grads))
    unit = decoded.unit
    dtype = grads[0].dtype
    acc = torch.float32 if decoded.acc_fp32 else dtype
    batch = grads[0].size(1 - key_dim)
    views = [_block_view(g, key_dim, unit) for g in grads]
    first_by_cat = grads[0].device.type in CAT_DEVICES
    if first_by_cat:
        pieces: list[torch.Tensor] = []
        for grad, lengths in zip(grads, decoded.entry_lengths, strict=True):
            pieces.extend(torch.split(grad, list(lengths), dim=key_dim))
        if decoded.skipped_lengths:
            width = sum(decoded.skipped_lengths)
            zeros = host_empty((batch, width) if key_dim == 1 else (width, batch), grads[0].dtype).zero_()
            pieces.extend(torch.split(zeros, list(decoded.skipped_lengths), dim=key_dim))
    results = []
    for input_index, width in enumerate(in_lengths):
        if first_by_cat:
            order = decoded.input_order[input_index]
            first = _cat(_getter(order)(pieces) if order else (), grads[0], key_dim, batch, width)
            blocks = _block_view(first.to(acc), key_dim, unit)
        else:
            blocks = _empty_blocks(
                grads[0], key_dim, width, unit, batch, acc, zero=decoded.zero_init[input_index]
            )
        for occurrence, group, dst, src in decoded.bwd[input_index]:
            if first_by_cat and occurrence == 0:
                continue
            source = views[group] if src < 0 else torch.index_select(views[group], 1, plan[src])
            if source.dtype != acc:
                source = source.to(acc)
            if occurrence == 0:
                blocks.index_copy_(1, plan[dst], source)
            else:
                blocks.index_copy_(1, plan[dst], torch.index_select(blocks, 1, plan[dst]).add_(source))
        results.append(_unview(blocks.to(dtype), key_dim, width, batch))
    return results
