"""The ``kt_regroup::permute`` / ``kt_regroup::permute_backward`` ops, and the eager fast path.

The ops are ``torch.library`` custom ops whose schema carries only tensors, ints and int lists (no
``str[][]``), so ``torch.compile(fullgraph=True)`` traces through without a graph break and
``torch.export`` exports modules that call them. Fake kernels give the output shapes; autograd is
registered for both ops (the backward of the backward is the forward).

Eager calls (not compiling, not exporting) skip the custom-op machinery (argument pytrees, schema
checks, redispatch), which costs more host time than the kernel itself at typical sizes, and run the
same kernels through a plain ``autograd.Function``: :func:`run_permute` picks the path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kt_regroup._torch_impl import torch_backward, torch_forward

__all__ = ["permute", "permute_backward", "run_permute"]

_TORCH, _FBGEMM, _TRITON = 0, 1, 2


def _shapes(like: torch.Tensor, widths: Sequence[int], key_dim: int) -> list[torch.Tensor]:
    batch = like.size(1 - key_dim)
    return [like.new_empty((batch, w) if key_dim == 1 else (w, batch)) for w in widths]


def _nothing_to_write(like: torch.Tensor, widths: Sequence[int], key_dim: int) -> bool:
    """Whether outputs of ``widths`` hold no element (batch 0, or every width 0).

    fbgemm's CUDA kernel launches ``(rows / warps, batch)`` blocks and fails with "grid.x value 0" when
    either is 0 (an empty batch, or a plan without rows: every group empty), so it is not called then.
    Shapes only: no host sync.
    """
    return like.size(1 - key_dim) == 0 or not any(widths)


def forward_impl(
    values: Sequence[torch.Tensor],
    plan: Sequence[torch.Tensor],
    meta: Sequence[int],
    in_lengths: Sequence[int],
    out_lengths: Sequence[int],
    key_dim: int,
    backend: int,
) -> list[torch.Tensor]:
    """Run the forward kernel of ``backend`` (no autograd)."""
    if backend == _TRITON:
        from kt_regroup._triton_impl import triton_forward

        return triton_forward(values, plan, meta, in_lengths, out_lengths)
    if backend == _FBGEMM and _nothing_to_write(values[0], out_lengths, key_dim):
        return _shapes(values[0], out_lengths, key_dim)
    if backend == _FBGEMM:
        from kt_regroup._fbgemm import permute_multi_embedding_function

        return permute_multi_embedding_function(
            [v.contiguous() for v in values], plan[0], plan[1], plan[2], list(out_lengths), False
        )
    return torch_forward(values, plan, meta, out_lengths, key_dim)


def backward_impl(
    grads: Sequence[torch.Tensor],
    plan: Sequence[torch.Tensor],
    meta: Sequence[int],
    in_lengths: Sequence[int],
    out_lengths: Sequence[int],
    key_dim: int,
    backend: int,
) -> list[torch.Tensor]:
    """Run the backward kernel of ``backend`` (no autograd)."""
    if backend == _TRITON:
        from kt_regroup._triton_impl import triton_backward

        return triton_backward(grads, plan, meta, in_lengths, out_lengths)
    if backend == _FBGEMM and _nothing_to_write(grads[0], in_lengths, key_dim):
        return _shapes(grads[0], in_lengths, key_dim)
    if backend == _FBGEMM and not any(out_lengths):
        # No group has a column (every group empty): every input's gradient is 0, and fbgemm would launch
        # an empty grid (its plan has no rows).
        return [z.zero_() for z in _shapes(grads[0], in_lengths, key_dim)]
    if backend == _FBGEMM:
        from kt_regroup._fbgemm import permute_multi_embedding_function

        n_in = meta[0]
        # Reverse mode reads the group widths where the forward reads the input widths.
        result = permute_multi_embedding_function(
            [g.contiguous() for g in grads], plan[0], plan[2], plan[1], list(in_lengths), True
        )
        # fbgemm leaves the columns of keys in no group uninitialised: zero them.
        for index in range(n_in):
            if meta[1 + index]:
                result[index].index_fill_(1, plan[3 + index], 0)
        return result
    return torch_backward(grads, plan, meta, in_lengths, key_dim)


@torch.library.custom_op("kt_regroup::permute", mutates_args=())
def permute(
    values: list[torch.Tensor],
    plan: list[torch.Tensor],
    meta: list[int],
    in_lengths: list[int],
    out_lengths: list[int],
    key_dim: int,
    backend: int,
) -> list[torch.Tensor]:
    """Regroup ``values`` (one 2-D tensor per input KeyedTensor) into one tensor per group.

    Args:
        values: ``[B, in_lengths[i]]`` each (``[in_lengths[i], B]`` when ``key_dim == 0``), one dtype
            and device.
        plan: the plan's int index tensors, on the values' device.
        meta: the plan's static ints (how to read ``plan``).
        in_lengths: widths of the inputs along ``key_dim``.
        out_lengths: widths of the groups along ``key_dim``.
        key_dim: 0 or 1.
        backend: 0 torch, 1 fbgemm, 2 triton.

    Returns:
        ``[B, out_lengths[g]]`` per group (``[out_lengths[g], B]`` for ``key_dim == 0``), fresh tensors.
    """
    return forward_impl(values, plan, meta, in_lengths, out_lengths, key_dim, backend)


@permute.register_fake
def _permute_fake(
    values: list[torch.Tensor],
    plan: list[torch.Tensor],
    meta: list[int],
    in_lengths: list[int],
    out_lengths: list[int],
    key_dim: int,
    backend: int,
) -> list[torch.Tensor]:
    return _shapes(values[0], out_lengths, key_dim)


@torch.library.custom_op("kt_regroup::permute_backward", mutates_args=())
def permute_backward(
    grads: list[torch.Tensor],
    plan: list[torch.Tensor],
    meta: list[int],
    in_lengths: list[int],
    out_lengths: list[int],
    key_dim: int,
    backend: int,
) -> list[torch.Tensor]:
    """Gradients of ``permute``'s inputs from its outputs' gradients (same plan and ints).

    Returns:
        ``[B, in_lengths[i]]`` per input: the sum over every occurrence of each key, in group order,
        and exactly 0 for keys that are in no group. Deterministic, no atomics.
    """
    return backward_impl(grads, plan, meta, in_lengths, out_lengths, key_dim, backend)


@permute_backward.register_fake
def _permute_backward_fake(
    grads: list[torch.Tensor],
    plan: list[torch.Tensor],
    meta: list[int],
    in_lengths: list[int],
    out_lengths: list[int],
    key_dim: int,
    backend: int,
) -> list[torch.Tensor]:
    return _shapes(grads[0], in_lengths, key_dim)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, plan, meta, in_lengths, out_lengths, key_dim, backend = inputs
    ctx.plan = plan  # int index tensors: no grad, not saved for backward
    ctx.args = (meta, in_lengths, out_lengths, key_dim, backend)  # static ints


def _materialize(
    grads: Sequence[torch.Tensor | None], widths: Sequence[int], key_dim: int
) -> list[torch.Tensor]:
    """Unused outputs get ``None`` gradients; the kernels want zeros of the right shape."""
    like = next((g for g in grads if g is not None), None)
    if like is None or all(g is not None for g in grads):
        return [g for g in grads if g is not None]
    zeros = _shapes(like, widths, key_dim)
    return [g if g is not None else z.zero_() for g, z in zip(grads, zeros, strict=True)]


def _permute_autograd(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[object, ...]:
    meta, in_lengths, out_lengths, key_dim, backend = ctx.args
    result = permute_backward(
        _materialize(grads, out_lengths, key_dim), ctx.plan, meta, in_lengths, out_lengths, key_dim, backend
    )
    return result, [None] * len(ctx.plan), None, None, None, None, None


def _permute_backward_autograd(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[object, ...]:
    meta, in_lengths, out_lengths, key_dim, backend = ctx.args
    result = permute(
        _materialize(grads, in_lengths, key_dim), ctx.plan, meta, in_lengths, out_lengths, key_dim, backend
    )
    return result, [None] * len(ctx.plan), None, None, None, None, None


permute.register_autograd(_permute_autograd, setup_context=_setup_context)
permute_backward.register_autograd(_permute_backward_autograd, setup_context=_setup_context)


# (plan tensors, meta, in_lengths, out_lengths, key_dim, backend)
PlanArgs = tuple[Sequence[torch.Tensor], Sequence[int], Sequence[int], Sequence[int], int, int]


# The kernel of one direction of the eager pair (forward_impl or backward_impl).
_Kernel = Callable[
    [Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[int], Sequence[int], Sequence[int], int, int],
    list[torch.Tensor],
]


def _eager_forward(
    ctx: Any, args: PlanArgs, tensors: Sequence[torch.Tensor], kernel: _Kernel
) -> tuple[torch.Tensor, ...]:
    plan, meta, in_lengths, out_lengths, key_dim, backend = args
    ctx.args = args
    return tuple(kernel(tensors, plan, meta, in_lengths, out_lengths, key_dim, backend))


def _eager_backward(
    ctx: Any, grads: Sequence[torch.Tensor | None], of_outputs: bool, kernel: _Kernel, twin: Any
) -> tuple[Any, ...]:
    """Gradients through the other direction: its kernel directly, or its Function under ``create_graph``."""
    args: PlanArgs = ctx.args
    # ``grads`` are of this Function's outputs: the groups' widths (permute) or the inputs' (its backward).
    dense = _materialize(grads, args[3] if of_outputs else args[2], args[4])
    if not torch.is_grad_enabled():
        # The usual backward (no create_graph): run the kernel directly, no second Function node.
        plan, meta, in_lengths, out_lengths, key_dim, backend = args
        return (None, *kernel(dense, plan, meta, in_lengths, out_lengths, key_dim, backend))
    return (None, *twin.apply(args, *dense))


class _EagerPermute(torch.autograd.Function):
    """Eager twin of ``kt_regroup::permute``: same kernels, plain autograd.Function overhead."""

    @staticmethod
    def forward(ctx: Any, args: PlanArgs, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _eager_forward(ctx, args, values, forward_impl)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return _eager_backward(ctx, grads, True, backward_impl, _EagerPermuteBackward)


class _EagerPermuteBackward(torch.autograd.Function):
    """Eager twin of ``kt_regroup::permute_backward`` (its backward is the forward permute)."""

    @staticmethod
    def forward(ctx: Any, args: PlanArgs, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _eager_forward(ctx, args, grads, backward_impl)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        return _eager_backward(ctx, grads, False, forward_impl, _EagerPermute)


def run_permute(values: list[torch.Tensor], args: PlanArgs) -> list[torch.Tensor]:
    """Regroup ``values`` with a plan: the custom op when compiling/exporting, the eager twin otherwise.

    With nothing to differentiate (grad mode off, or no input requires grad) the kernel runs alone: an
    ``autograd.Function`` costs host time even when it records nothing. Every backend returns fresh
    tensors, so the outputs never alias the inputs either way.
    """
    plan, meta, in_lengths, out_lengths, key_dim, backend = args
    if torch.compiler.is_compiling():
        result: list[torch.Tensor] = permute(
            values, list(plan), list(meta), list(in_lengths), list(out_lengths), key_dim, backend
        )
        return result
    if not torch.is_grad_enabled() or not any(v.requires_grad for v in values):
        return forward_impl(values, plan, meta, in_lengths, out_lengths, key_dim, backend)
    return list(_EagerPermute.apply(args, *values))  # type: ignore[no-untyped-call]  # untyped in torch
