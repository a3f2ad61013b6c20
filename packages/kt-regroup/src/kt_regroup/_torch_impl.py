"""Pure-PyTorch regroup: one gather per (group, input) over blocks of ``unit`` columns.

Every key's width is a multiple of ``unit`` (the gcd of the key lengths), so values are viewed as
``[outer, width / unit, unit * inner]`` and whole blocks move with ``index_select`` / ``index_copy_``:
contiguous copies of ``unit`` elements, no per-key Python loop. ``key_dim == 1``: ``outer = B``,
``inner = 1``; ``key_dim == 0``: ``outer = 1``, ``inner = B``.

The backward writes each input block with ``index_copy_`` from the first occurrence of its key and then
adds later occurrences round by round (each round touches distinct blocks): no atomics, the same bits on
every run, and skipped keys exactly 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kt_regroup._plan import decode_torch_meta

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
    results = []
    for input_index, width in enumerate(in_lengths):
        blocks = _empty_blocks(
            grads[0], key_dim, width, unit, batch, acc, zero=decoded.zero_init[input_index]
        )
        for occurrence, group, dst, src in decoded.bwd[input_index]:
            source = views[group] if src < 0 else torch.index_select(views[group], 1, plan[src])
            if source.dtype != acc:
                source = source.to(acc)
            if occurrence == 0:
                blocks.index_copy_(1, plan[dst], source)
            else:
                blocks.index_copy_(1, plan[dst], torch.index_select(blocks, 1, plan[dst]).add_(source))
        results.append(_unview(blocks.to(dtype), key_dim, width, batch))
    return results
