"""A Triton kernel for the device cache's backward (CUDA only, imported lazily): each unique row's gradient
summed over its lookups and the row-wise optimizer applied to its slot, in one launch.

The torch version (:meth:`~ssd_tbe_adapter._device_path.DevicePath.update` then
:meth:`~ssd_tbe_adapter._device_cache.DeviceCache.update`) takes ~13 kernels: a gather of every lookup's bag
gradient, an ``index_add_`` of them into the unique rows (atomics), and the optimizer's gathers, squares,
``index_add_`` of the state and of the weights. Here one program owns one unique row: it walks that row's
lookups in the survey's sorted order (``order`` from ``starts[u]`` to ``starts[u + 1]``, ``BLOCK_L`` at a
time: a row's steps are a chain of dependent loads, so the hottest row's step count bounds the launch), sums their bag gradients (times the per-sample weights), then updates the state, the weights and the
dirty flag of the row's slot. No atomics (each slot has one owner), no gradient buffer. Same arithmetic as
the torch version up to the order of the sums (float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_update"]

_BLOCK_L = 128  # lookups per step of a row's loop: a Zipf-hot row (hundreds of lookups) takes a few steps


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _update_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    grad_bags,
    grad_stride,
    bag_of_lookup,
    psw,
    order,
    starts,
    unique_slots,
    slot_tables,
    dims,
    weights,
    weight_stride,
    state,
    dirty,
    lookups,
    trash,
    learning_rate,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HAS_PSW: tl.constexpr,
    ADAGRAD: tl.constexpr,
    ROUND_FP16: tl.constexpr,
):
    u = tl.program_id(0)
    slot = tl.load(unique_slots + u)
    start = tl.load(starts + u)
    end = tl.load(starts + u + 1)
    if (slot != trash) & (end > start):
        columns = tl.arange(0, BLOCK_D)
        in_row = columns < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        first = start
        while first < end:
            at = first + tl.arange(0, BLOCK_L)
            in_segment = at < end
            lookup = tl.load(order + at, mask=in_segment, other=0)
            real = in_segment & (lookup < lookups)  # past `lookups`: the survey's padding
            bag = tl.load(bag_of_lookup + lookup, mask=real, other=0)
            grads = tl.load(
                grad_bags + bag[:, None] * grad_stride + columns[None, :],
                mask=real[:, None] & in_row[None, :],
                other=0.0,
            )
            if HAS_PSW:
                grads = grads * tl.load(psw + lookup, mask=real, other=0.0)[:, None]
            acc += tl.sum(grads, axis=0)
            first += BLOCK_L
        row = weights + slot * weight_stride + columns
        if ADAGRAD:
            dim = tl.load(dims + tl.load(slot_tables + slot))
            total = tl.load(state + slot) + tl.sum(acc * acc, axis=0) / dim
            tl.store(state + slot, total)
            scale = -learning_rate * (1.0 / (tl.sqrt(total) + eps))
            updated = tl.load(row, mask=in_row, other=0.0) + acc * scale
        else:
            updated = tl.load(row, mask=in_row, other=0.0) - learning_rate * acc
        if ROUND_FP16:
            updated = updated.to(tl.float16).to(tl.float32)
        tl.store(row, updated, mask=in_row)
        tl.store(dirty + slot, 1)


def fused_update(
    grad_bags: torch.Tensor,
    bag_of_lookup: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    order: torch.Tensor,
    starts: torch.Tensor,
    unique_slots: torch.Tensor,
    slot_tables: torch.Tensor,
    dims: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    dirty: torch.Tensor,
    *,
    lookups: int,
    trash: int,
    learning_rate: float,
    eps: float,
    adagrad: bool,
    round_fp16: bool,
) -> None:
    """Apply one optimizer step to the rows in ``unique_slots`` (``[U]``, distinct; the trash slot is skipped)
    with gradients summed from ``grad_bags`` (``[bags, D]`` float32, unit column stride) over their lookups:
    row ``u``'s lookups are ``order[starts[u]:starts[u + 1]]`` (entries ``>= lookups`` skipped), each one's
    bag is ``bag_of_lookup`` and weight ``per_sample_weights``. ``dims``: float32 ``D`` per table (row-wise
    Adagrad averages over the row's own columns; the ones past it have zero gradient). Marks the rows dirty.
    No sync; contiguous CUDA tensors."""
    count, width = unique_slots.numel(), weights.shape[1]
    if count == 0:
        return
    _update_kernel[(count,)](
        grad_bags,
        grad_bags.stride(0),
        bag_of_lookup,
        grad_bags if per_sample_weights is None else per_sample_weights,
        order,
        starts,
        unique_slots,
        slot_tables,
        dims,
        weights,
        weights.stride(0),
        state,
        dirty.view(torch.uint8),
        lookups,
        trash,
        learning_rate,
        eps,
        D=width,
        BLOCK_D=int(triton.next_power_of_2(width)),
        BLOCK_L=_BLOCK_L,
        HAS_PSW=per_sample_weights is not None,
        ADAGRAD=adagrad,
        ROUND_FP16=round_fp16,
        num_warps=8,
    )
