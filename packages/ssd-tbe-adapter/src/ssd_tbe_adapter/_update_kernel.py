"""Triton kernels for the device cache's backward (CUDA only, imported lazily): each unique row's gradient
summed over its lookups, then the row-wise optimizer applied to its slot, in two launches.

The torch version (:meth:`~ssd_tbe_adapter._device_path.DevicePath.update` then
:meth:`~ssd_tbe_adapter._device_cache.DeviceCache.update`) takes ~13 kernels: a gather of every lookup's bag
gradient, an ``index_add_`` of them into the unique rows (one atomic per lookup and column), and the
optimizer's gathers, squares and ``index_add_`` of the state and of the weights.

- sum: each program takes ``CHUNK`` consecutive lookups of the survey's sorted order (``order``; ``pairs``:
  their rows, ascending), gathers their bag gradients (times the per-sample weights), sums each row's run with
  a segmented scan and adds the sum to the row's gradient: one atomic row per run, so a Zipf-hot row with
  hundreds of lookups costs one atomic per chunk, and no program walks a long row alone (one program per row
  made the hottest row's chain of loads the launch's length: 76 us in the DLRM trainer).
- apply: each program updates ``ROWS`` unique rows: the state, the weights and the dirty flag of their slots.

Same arithmetic as the torch version up to the order of the sums (float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fused_update"]

_CHUNK = 32
_ROWS = 16


@triton.jit
def _segment_add(row_a, sum_a, row_b, sum_b):  # type: ignore[no-untyped-def]  # Triton JIT function
    # On rows in ascending order: the sum of the run of row_b that ends here.
    return row_b, tl.where(row_a == row_b, sum_a + sum_b, sum_b)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _sum_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    grad_bags,
    grad_stride,
    bag_of_lookup,
    psw,
    order,
    pairs,
    grads,
    positions,
    lookups,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_PSW: tl.constexpr,
):
    at = tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    in_range = at < positions
    lookup = tl.load(order + at, mask=in_range, other=0)
    real = in_range & (lookup < lookups)  # past `lookups`: the survey's padding
    row = tl.load(pairs + at, mask=in_range, other=-1)
    bag = tl.load(bag_of_lookup + lookup, mask=real, other=0)
    columns = tl.arange(0, BLOCK_D)
    in_row = columns < D
    values = tl.load(
        grad_bags + bag[:, None] * grad_stride + columns[None, :],
        mask=real[:, None] & in_row[None, :],
        other=0.0,
    )
    if HAS_PSW:
        values = values * tl.load(psw + lookup, mask=real, other=0.0)[:, None]
    rows = tl.broadcast_to(row[:, None], (CHUNK, BLOCK_D))
    _, sums = tl.associative_scan((rows, values), 0, _segment_add)
    following = tl.load(pairs + at + 1, mask=(at + 1) < positions, other=-1)
    last = in_range & ((following != row) | (tl.arange(0, CHUNK) == CHUNK - 1))
    tl.atomic_add(
        grads + row[:, None] * D + columns[None, :], sums, mask=last[:, None] & in_row[None, :], sem="relaxed"
    )


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _apply_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    grads,
    unique_slots,
    slot_tables,
    dims,
    weights,
    weight_stride,
    state,
    dirty,
    count,
    trash,
    learning_rate,
    eps,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    ADAGRAD: tl.constexpr,
    ROUND_FP16: tl.constexpr,
):
    at = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(unique_slots + at, mask=at < count, other=trash)
    live = slot != trash
    columns = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (columns < D)[None, :]
    g = tl.load(grads + at[:, None] * D + columns[None, :], mask=mask, other=0.0)
    row = weights + slot[:, None] * weight_stride + columns[None, :]
    if ADAGRAD:
        dim = tl.load(dims + tl.load(slot_tables + slot, mask=live, other=0), mask=live, other=1.0)
        total = tl.load(state + slot, mask=live, other=0.0) + tl.sum(g * g, axis=1) / dim
        tl.store(state + slot, total, mask=live)
        scale = -learning_rate * (1.0 / (tl.sqrt(total) + eps))
        updated = tl.load(row, mask=mask, other=0.0) + g * scale[:, None]
    else:
        updated = tl.load(row, mask=mask, other=0.0) - learning_rate * g
    if ROUND_FP16:
        updated = updated.to(tl.float16).to(tl.float32)
    tl.store(row, updated, mask=mask)
    tl.store(dirty + slot, tl.full([ROWS], 1, tl.uint8), mask=live)


def fused_update(
    grad_bags: torch.Tensor,
    bag_of_lookup: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    order: torch.Tensor,
    pairs: torch.Tensor,
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
    the lookups sorted by row are ``order`` (entries ``>= lookups`` are padding), their rows ``pairs``
    (positions in ``unique_slots``, ascending), each one's bag ``bag_of_lookup`` and weight
    ``per_sample_weights``. ``dims``: float32 ``D`` per table (row-wise Adagrad averages over the row's own
    columns; the ones past it have zero gradient). Marks the rows dirty. No sync; contiguous CUDA tensors."""
    count, width, positions = unique_slots.numel(), weights.shape[1], order.numel()
    if count == 0 or positions == 0:
        return
    block_d = int(triton.next_power_of_2(width))
    grads = torch.zeros(count, width, dtype=torch.float32, device=weights.device)
    _sum_kernel[(triton.cdiv(positions, _CHUNK),)](
        grad_bags,
        grad_bags.stride(0),
        bag_of_lookup,
        grad_bags if per_sample_weights is None else per_sample_weights,
        order,
        pairs,
        grads,
        positions,
        lookups,
        D=width,
        BLOCK_D=block_d,
        CHUNK=_CHUNK,
        HAS_PSW=per_sample_weights is not None,
    )
    _apply_kernel[(triton.cdiv(count, _ROWS),)](
        grads,
        unique_slots,
        slot_tables,
        dims,
        weights,
        weights.stride(0),
        state,
        dirty.view(torch.uint8),
        count,
        trash,
        learning_rate,
        eps,
        D=width,
        BLOCK_D=block_d,
        ROWS=_ROWS,
        ADAGRAD=adagrad,
        ROUND_FP16=round_fp16,
    )
