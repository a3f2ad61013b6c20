"""Triton kernels (CUDA, ``key_dim == 1``): one launch forward, one launch backward.

Imported lazily, only when a regroup runs on CUDA tensors with the Triton backend. Up to 8 inputs and
8 groups are passed as plain pointer arguments (no per-call pointer table, no host-to-device copy): the
only per-call host work is the launch itself.

* Forward: program ``(t, b)`` copies tile ``t`` of the plan (``<= BLOCK_D`` columns of one key's block
  into one group) for rows ``[b * BLOCK_B, (b + 1) * BLOCK_B)``. Outputs are written directly, no
  intermediate cat; loads and stores are vectorised (alignment hints from the plan).
* Backward: program ``(t, b)`` owns a tile of *input* columns and sums every occurrence of that key's
  columns in the groups' gradients, in group order, in fp32 (fp64 for fp64), then stores once. Every
  input column belongs to exactly one tile, so there are no atomics and the result is bitwise
  deterministic; keys in no group get exact zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kt_regroup import _env
from kt_regroup._plan import TRITON_MAX_TENSORS

__all__ = ["triton_backward", "triton_forward"]

# Rows per program and warps per program; the environment overrides exist for tuning sweeps only.
BLOCK_B = int(_env.TRITON_BLOCK_B.get())
NUM_WARPS = int(_env.TRITON_NUM_WARPS.get())


@triton.jit
def _pick(i, p0, p1, p2, p3, p4, p5, p6, p7):  # type: ignore[no-untyped-def]  # Triton JIT function
    p = p0
    if i == 1:
        p = p1
    if i == 2:
        p = p2
    if i == 3:
        p = p3
    if i == 4:
        p = p4
    if i == 5:
        p = p5
    if i == 6:
        p = p6
    if i == 7:
        p = p7
    return p


# Widths are never specialised: a width of 1 would become a constexpr and break the scalar selects.
@triton.jit(do_not_specialize=[f"iw{i}" for i in range(8)] + [f"ow{i}" for i in range(8)])  # type: ignore[untyped-decorator]  # triton ships no types
def _regroup_fwd_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    tiles,
    batch,
    i0, i1, i2, i3, i4, i5, i6, i7,
    iw0, iw1, iw2, iw3, iw4, iw5, iw6, iw7,
    o0, o1, o2, o3, o4, o5, o6, o7,
    ow0, ow1, ow2, ow3, ow4, ow5, ow6, ow7,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    base = tiles + tile * 5
    src_idx = tl.load(base)
    src_col = tl.multiple_of(tl.load(base + 1), ALIGN)
    dst_idx = tl.load(base + 2)
    dst_col = tl.multiple_of(tl.load(base + 3), ALIGN)
    ncols = tl.multiple_of(tl.load(base + 4), ALIGN)
    src = _pick(src_idx, i0, i1, i2, i3, i4, i5, i6, i7)
    src_w = tl.multiple_of(_pick(src_idx, iw0, iw1, iw2, iw3, iw4, iw5, iw6, iw7), ALIGN)
    dst = _pick(dst_idx, o0, o1, o2, o3, o4, o5, o6, o7)
    dst_w = tl.multiple_of(_pick(dst_idx, ow0, ow1, ow2, ow3, ow4, ow5, ow6, ow7), ALIGN)
    mask = (rows[:, None] < batch) & (cols[None, :] < ncols)
    rows64 = rows.to(tl.int64)[:, None]
    values = tl.load(src + rows64 * src_w + src_col + cols[None, :], mask=mask)
    tl.store(dst + rows64 * dst_w + dst_col + cols[None, :], values, mask=mask)


@triton.jit(do_not_specialize=[f"gw{i}" for i in range(8)] + [f"rw{i}" for i in range(8)])  # type: ignore[untyped-decorator]  # triton ships no types
def _regroup_bwd_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    tiles,
    occ,
    batch,
    g0, g1, g2, g3, g4, g5, g6, g7,
    gw0, gw1, gw2, gw3, gw4, gw5, gw6, gw7,
    r0, r1, r2, r3, r4, r5, r6, r7,
    rw0, rw1, rw2, rw3, rw4, rw5, rw6, rw7,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    base = tiles + tile * 5
    dst_idx = tl.load(base)
    dst_col = tl.multiple_of(tl.load(base + 1), ALIGN)
    ncols = tl.multiple_of(tl.load(base + 2), ALIGN)
    occ_start = tl.load(base + 3)
    occ_count = tl.load(base + 4)
    mask = (rows[:, None] < batch) & (cols[None, :] < ncols)
    rows64 = rows.to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=ACC)
    j = occ_start
    while j < occ_start + occ_count:
        src_idx = tl.load(occ + j * 2)
        src_col = tl.multiple_of(tl.load(occ + j * 2 + 1), ALIGN)
        src = _pick(src_idx, g0, g1, g2, g3, g4, g5, g6, g7)
        src_w = tl.multiple_of(_pick(src_idx, gw0, gw1, gw2, gw3, gw4, gw5, gw6, gw7), ALIGN)
        acc += tl.load(src + rows64 * src_w + src_col + cols[None, :], mask=mask, other=0.0).to(ACC)
        j += 1
    dst = _pick(dst_idx, r0, r1, r2, r3, r4, r5, r6, r7)
    dst_w = tl.multiple_of(_pick(dst_idx, rw0, rw1, rw2, rw3, rw4, rw5, rw6, rw7), ALIGN)
    tl.store(dst + rows64 * dst_w + dst_col + cols[None, :], acc.to(dst.dtype.element_ty), mask=mask)


def _pad(items: Sequence[Any], fill: Any) -> list[Any]:
    return list(items) + [fill] * (TRITON_MAX_TENSORS - len(items))


def triton_forward(
    values: Sequence[torch.Tensor],
    plan: Sequence[torch.Tensor],
    meta: Sequence[int],
    in_lengths: Sequence[int],
    out_lengths: Sequence[int],
) -> list[torch.Tensor]:
    """Regrouped ``[B, out_lengths[g]]`` CUDA tensors, one launch (see the module docstring)."""
    block_d, align, n_fwd = meta[0], meta[1], meta[2]
    inputs = [v.contiguous() for v in values]
    batch = inputs[0].size(0)
    outputs = [inputs[0].new_empty((batch, w)) for w in out_lengths]
    if n_fwd and batch:
        grid = (n_fwd, triton.cdiv(batch, BLOCK_B))
        _regroup_fwd_kernel[grid](
            plan[0],
            batch,
            *_pad(inputs, inputs[0]),
            *_pad(list(in_lengths), 0),
            *_pad(outputs, outputs[0]),
            *_pad(list(out_lengths), 0),
            BLOCK_B=BLOCK_B,
            BLOCK_D=block_d,
            ALIGN=align,
            num_warps=NUM_WARPS,
        )
    return outputs


def triton_backward(
    grads: Sequence[torch.Tensor],
    plan: Sequence[torch.Tensor],
    meta: Sequence[int],
    in_lengths: Sequence[int],
    out_lengths: Sequence[int],
) -> list[torch.Tensor]:
    """Input gradients ``[B, in_lengths[i]]``, one launch, no atomics (see the module docstring)."""
    block_d, align, n_bwd = meta[0], meta[1], meta[3]
    sources = [g.contiguous() for g in grads]
    batch = sources[0].size(0)
    results = [sources[0].new_empty((batch, w)) for w in in_lengths]
    if n_bwd and batch:
        acc = tl.float64 if sources[0].dtype == torch.float64 else tl.float32
        grid = (n_bwd, triton.cdiv(batch, BLOCK_B))
        _regroup_bwd_kernel[grid](
            plan[1],
            plan[2],
            batch,
            *_pad(sources, sources[0]),
            *_pad(list(out_lengths), 0),
            *_pad(results, results[0]),
            *_pad(list(in_lengths), 0),
            BLOCK_B=BLOCK_B,
            BLOCK_D=block_d,
            ALIGN=align,
            ACC=acc,
            num_warps=NUM_WARPS,
        )
    return results
