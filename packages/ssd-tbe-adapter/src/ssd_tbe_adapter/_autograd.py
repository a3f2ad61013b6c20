"""The autograd node of one :class:`~ssd_tbe_adapter.KeyValueEmbeddingBags` forward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ssd_tbe_adapter._layout import chained_input_grad
from ssd_tbe_adapter._plan import Plan

if TYPE_CHECKING:
    from ssd_tbe_adapter._module import KeyValueEmbeddingBags

__all__ = ["KVBagFunction"]


class KVBagFunction(torch.autograd.Function):
    """Autograd node of one forward: backward applies the fused optimizer to the touched rows."""

    @staticmethod
    def forward(
        ctx: Any,
        anchor: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        vbe_output: torch.Tensor | None,
        module: KeyValueEmbeddingBags,
        plan: Plan,
    ) -> torch.Tensor:
        del anchor
        output, rows, indices_device = module._forward_impl(plan, per_sample_weights, vbe_output)
        if vbe_output is not None:
            ctx.mark_dirty(vbe_output)
        ctx.module = module
        ctx.plan = plan
        ctx.rows = rows
        ctx.indices_device = indices_device
        ctx.per_sample_weights = per_sample_weights
        ctx.chained = vbe_output is not None
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        module: KeyValueEmbeddingBags = ctx.module
        grad_psw = module._backward_impl(
            ctx.plan, ctx.indices_device, ctx.rows, ctx.per_sample_weights, grad_output.contiguous()
        )
        grad_vbe: torch.Tensor | None = None
        if ctx.chained and ctx.needs_input_grad[2]:  # the chain's first kernel writes a fresh buffer
            # Our blocks overwrote whatever the input buffer held there: no gradient flows to it.
            feature_dims = [module._dims[table] for table in module._feature_table_map]
            grad_vbe = chained_input_grad(ctx.plan, grad_output, feature_dims)
        ctx.rows = None
        return None, grad_psw, grad_vbe, None, None
