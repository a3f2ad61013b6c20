"""A Triton kernel for :func:`~ssd_tbe_adapter._slot_index.hash_keys` (CUDA only, imported lazily): the two
splitmix64 rounds in one launch instead of ~25 elementwise torch kernels, bit-equal to the torch version."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssd_tbe_adapter._init import _GOLDEN, _MIX1, _MIX2

__all__ = ["hash_pairs"]

_BLOCK = 1024


@triton.jit
def _splitmix(x, golden, mix1, mix2):  # type: ignore[no-untyped-def]  # Triton JIT function
    # int64 arithmetic wraps modulo 2**64; shifts are logical (through uint64), as in ssd_tbe_adapter._init._mix.
    x = x + golden
    x = (x ^ (x.to(tl.uint64, bitcast=True) >> 30).to(tl.int64, bitcast=True)) * mix1
    x = (x ^ (x.to(tl.uint64, bitcast=True) >> 27).to(tl.int64, bitcast=True)) * mix2
    return x ^ (x.to(tl.uint64, bitcast=True) >> 31).to(tl.int64, bitcast=True)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _hash_kernel(tables, ids, out, n, golden, mix1, mix2, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = at < n
    t = tl.load(tables + at, mask=mask, other=0)
    i = tl.load(ids + at, mask=mask, other=0)
    h = _splitmix(_splitmix(t, golden, mix1, mix2) ^ i, golden, mix1, mix2)
    tl.store(out + at, h, mask=mask)


def hash_pairs(tables: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``hash_keys(tables, ids)`` for contiguous int64 CUDA tensors of one shape."""
    out = torch.empty_like(ids)
    n = ids.numel()
    if n:
        grid = (triton.cdiv(n, _BLOCK),)
        _hash_kernel[grid](tables, ids, out, n, _GOLDEN, _MIX1, _MIX2, BLOCK=_BLOCK)
    return out
