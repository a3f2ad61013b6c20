"""The dense optimizer step as one CUDA graph replay: Adagrad's update and the gradients' reset.

The dense Adagrad (foreach) spends ~0.7 ms of host time per step on the H200 (the optimizer's wrapper and
hooks, grouping the tensors by device and dtype, ~8 foreach launches) for a few microseconds of GPU work.
:class:`DenseStep` runs the same foreach ops, in the same order with the same scalars (so the same bits as
``torch.optim.Adagrad.step``), captured once in a CUDA graph, followed by zeroing the gradients in the same
graph; each step then costs one replay and one host-side add to the optimizer's step counters (kept for
its ``state_dict``), run through the optimizer's step wrapper so that its step hooks (which profilers and
the bench count steps with) fire as for ``step()``. The gradients stay allocated (zeroed, not set to ``None``) so that the graph reads
the tensors the backward accumulates into.

The graph is used only where it reproduces the eager step: CUDA parameters with dense gradients, every
group with a constant float ``lr``, ``lr_decay == 0``, ``weight_decay == 0``, no ``maximize`` or
``differentiable``. It is captured after ``warmup`` eager steps (the optimizer's state exists, and DDP has
rebuilt its gradient buckets); if the tensors it captured are no longer the parameters' gradients or the
optimizer's state (a ``load_state_dict``, DDP's bucket views rebuilt) or ``lr`` changed, it is captured
again. Everywhere else (CPU, other settings) the eager step runs. ``own_gradients`` (gradients that DDP's
buckets do not own) replaces each gradient by a copy at the capture: a gradient autograd took over from a
graphed callable's backward is that graph's output buffer, which its next replay would add twice.
"""

from __future__ import annotations

import torch

__all__ = ["DenseStep", "adagrad_update", "update_and_reset"]

_SUPPORTED = {"lr_decay": 0, "weight_decay": 0, "maximize": False, "differentiable": False}


class DenseStep:
    """``zero_grad()`` before the forward, ``step()`` after the backward: the optimizer's step, graphed."""

    def __init__(
        self, optimizer: torch.optim.Adagrad, *, graph: bool, warmup: int = 3, own_gradients: bool = False
    ) -> None:
        self.optimizer = optimizer
        self.own_gradients = own_gradients
        self.graph = graph and self._graphable()
        self.warmup = warmup
        self._eager_steps = 0
        self._captured: torch.cuda.CUDAGraph | None = None
        self._tensors: list[torch.Tensor] = []  # what the graph read and wrote: grads, then state sums
        self._steps: list[torch.Tensor] = []  # the optimizer's step counters (host tensors)
        self._lrs: list[float] = []

    @property
    def graphed(self) -> bool:
        """Whether the last :meth:`step` was a graph replay."""
        return self._captured is not None

    def _graphable(self) -> bool:
        for group in self.optimizer.param_groups:
            if not isinstance(group["lr"], float) or any(group.get(k) != v for k, v in _SUPPORTED.items()):
                return False
            if any(p.device.type != "cuda" for p in group["params"]):
                return False
        return torch.cuda.is_available()

    def zero_grad(self) -> None:
        """Before the forward: the eager step's gradients are set to ``None``; the graph zeroed its own."""
        if self._captured is None:
            self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """The optimizer step (graph replay once captured; eager before, and where it cannot be graphed)."""
        if self._captured is not None and not self._still_valid():
            self._captured = None
        if self._captured is None:
            params = self._params()
            if not self.graph or self._eager_steps < self.warmup or any(p.grad is None for p in params):
                self.optimizer.step()
                self._eager_steps += 1
                return
            self._capture(params)
        # Through the optimizer's own step wrapper: its pre/post step hooks and profiler label, as for step().
        _hooked_replay(self.optimizer, self)

    def _replay(self) -> None:
        assert self._captured is not None
        self._captured.replay()
        torch._foreach_add_(self._steps, 1.0)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _still_valid(self) -> bool:
        params = self._params()
        state = self.optimizer.state
        now = [p.grad for p in params] + [state[p]["sum"] for p in params]
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        return lrs == self._lrs and all(a is b for a, b in zip(now, self._tensors, strict=True))

    def _capture(self, params: list[torch.Tensor]) -> None:
        """Record this step's update and the gradients' reset (not run: :meth:`step` replays it)."""
        state = self.optimizer.state
        if self.own_gradients:
            # A gradient that autograd stole from a graphed callable's backward (make_graphed_callables returns
            # its static buffer) is that buffer: its next replay would write the gradient into `.grad` and
            # the accumulation then add it again (twice the gradient). Own copies break the alias.
            for p in params:
                assert p.grad is not None
                p.grad = p.grad.clone()
        grads = [p.grad for p in params]
        sums = [state[p]["sum"] for p in params]
        assert all(g is not None for g in grads)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):  # an optimizer's update is not part of autograd
            update_and_reset(self.optimizer)
        self._captured = graph
        self._tensors = [*grads, *sums]  # type: ignore[list-item]
        self._steps = [state[p]["step"] for p in params]
        self._lrs = [group["lr"] for group in self.optimizer.param_groups]


@torch.optim.Optimizer.profile_hook_step
def _hooked_replay(optimizer: torch.optim.Optimizer, step: DenseStep) -> None:
    """``step``'s graph replay as a step of ``optimizer`` (hooks that count or time steps see it)."""
    del optimizer  # the wrapper's `self`
    step._replay()


def update_and_reset(optimizer: torch.optim.Adagrad) -> None:
    """What the graph holds: ``optimizer``'s multi-tensor update (``lr_decay == weight_decay == 0``), op by
    op as ``torch.optim.Adagrad`` runs it, then every gradient zeroed. Its step counters are not touched."""
    grads: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                raise ValueError("a parameter has no gradient: the dense step runs after a backward")
            grads.append(p.grad)
    adagrad_update(optimizer, grads)
    torch._foreach_zero_(grads)


def adagrad_update(optimizer: torch.optim.Adagrad, grads: list[torch.Tensor]) -> None:
    """``optimizer``'s multi-tensor update with ``grads`` (one per parameter, in its groups' order), op by op
    as ``torch.optim.Adagrad`` runs it (``lr_decay == weight_decay == 0``). Its step counters are not touched."""
    state = optimizer.state
    first = 0
    for group in optimizer.param_groups:
        params = list(group["params"])
        g = grads[first : first + len(params)]
        first += len(params)
        s = [state[p]["sum"] for p in params]
        torch._foreach_addcmul_(s, g, g, value=1)
        std = torch._foreach_sqrt(s)
        torch._foreach_add_(std, float(group["eps"]))
        numerator = torch._foreach_mul(g, [-float(group["lr"])] * len(g))
        torch._foreach_addcdiv_(params, numerator, std)
