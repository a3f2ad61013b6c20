"""Collectives of the sharded modules: all-to-alls with explicit splits, timeouts and autograd.

Every collective is issued with ``async_op=True`` and waited with the module's timeout, so a stuck or
departed peer surfaces as :class:`CollectiveTimeoutError` (or :class:`PeerRankError` when the transport
reports the peer gone) instead of a hang. gloo's list ``all_to_all`` needs equal sizes, so everything goes
through ``all_to_all_single`` with split lists.

A group of one rank issues no collective at all: its own block is the whole exchange, so an all-to-all is the
identity (its backward too), a gather is the rank's own value and a sum all-reduce leaves the tensor as it
is. On one GPU that removes every NCCL launch, wait and autograd node of the input and output dists.
"""

from __future__ import annotations

import datetime
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from vbe_lookup._sharding_errors import CollectiveTimeoutError, PeerRankError

__all__ = ["Communicator"]

_MESSAGE_BYTES = 1024


@dataclass(frozen=True, slots=True)
class _BackwardCollective:
    """The reverse all-to-all one differentiable all-to-all owes its peers in the backward."""

    order: int  # forward issue order (backward runs them newest first)
    what: str
    grad_shape: tuple[int, ...]
    dtype: torch.dtype
    send_splits: list[int]  # what the backward sends to each rank (the forward's out_splits)
    recv_splits: list[int]  # what it receives (the forward's in_splits)


class _Pending:
    """Held by an all-to-all's autograd context: its graph's death without a backward is a skip."""

    __slots__ = ("__weakref__", "done")

    def __init__(self, done: list[bool]) -> None:
        self.done = done  # [ran]: shared with the finalizer, which must not hold this object


class Communicator:
    """One process group, its rank, size, timeout and the device its tensors live on.

    Args:
        process_group: The group the module is sharded over (``None``: the default group).
        timeout: Longest wait for any one collective.
        device: Device of the tensors exchanged (CPU for gloo, the rank's CUDA device for NCCL).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        timeout: datetime.timedelta,
        device: torch.device,
    ) -> None:
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.timeout = timeout
        self.device = device
        # NCCL's ``wait(timeout)`` blocks the host until the collective finishes, which would serialize
        # the pipeline; there the wait is stream-ordered and NCCL's watchdog (the process group's
        # ``timeout``) bounds a stuck collective instead.
        self._host_timeout = str(dist.get_backend(process_group)) != "nccl"
        # Backward collectives of graphs freed before their backward ran (see `catch_up_skipped_backward`).
        self._skipped: list[_BackwardCollective] = []
        self._order = itertools.count()
        self._alone = self.world_size == 1  # a group of one: no collective is ever issued

    @property
    def alone(self) -> bool:
        """A group of one rank: no collective is issued (its callers may skip the exchange's bookkeeping)."""
        return self._alone

    # -- waiting -----------------------------------------------------------------------------------
    def wait(self, work: Any, what: str) -> None:
        """Wait for ``work`` at most ``timeout``; turn a timeout or a lost peer into our errors."""
        try:
            if self._host_timeout:
                work.wait(self.timeout)
            else:
                work.wait()
        except RuntimeError as err:
            text = str(err)
            if "timed out" in text.lower() or "timeout" in text.lower():
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: {what} did not complete within `timeout`="
                    f"{self.timeout.total_seconds():g}s (world size {self.world_size}); a peer rank is stuck, "
                    f"gone, or called a different collective ({text.strip().splitlines()[0]})"
                ) from err
            raise PeerRankError(
                f"rank {self.rank}: {what} failed (world size {self.world_size}): {text.strip()}"
            ) from err

    # -- all-to-all --------------------------------------------------------------------------------
    def start_all_to_all(self, x: Tensor, out_splits: list[int], in_splits: list[int]) -> tuple[Tensor, Any]:
        """Launch ``all_to_all_single`` of ``x`` (split along dim 0); returns ``(output, work)``."""
        if self._alone:
            return x.contiguous(), _DONE
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(
            out, x.contiguous(), out_splits, in_splits, group=self.group, async_op=True
        )
        return out, work

    def all_to_all(
        self,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        what: str,
        while_in_flight: Callable[[], None] | None = None,
    ) -> Tensor:
        """Blocking ``all_to_all_single`` (no autograd): rank ``r`` gets ``in_splits[r]`` rows of ``x``.

        ``while_in_flight``: see :meth:`_exchange`; its error propagates once the collective completed.
        """
        out, raised = self._exchange(x, out_splits, in_splits, what, while_in_flight)
        if raised:
            _raise_dropping_references(raised)
        return out

    def _exchange(
        self,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        what: str,
        while_in_flight: Callable[[], None] | None,
    ) -> tuple[Tensor, list[BaseException]]:
        """Launch the all-to-all, run ``while_in_flight``, wait; returns the output and the callback's error
        (in a list the caller empties: see :func:`_raise_dropping_references`).

        ``while_in_flight`` runs once the collective is launched and before it is waited for, and only
        where that wait blocks the host (not NCCL, whose waits are stream-ordered) and a collective is
        issued at all (not in a group of one): host work that would otherwise wait idle. The collective
        is waited for whatever the callback does, so every rank's collectives stay in step.
        """
        out, work = self.start_all_to_all(x, out_splits, in_splits)
        raised: list[BaseException] = []
        if while_in_flight is not None and self._host_timeout and not self._alone:
            try:
                while_in_flight()
            except BaseException as error:  # re-raised by the caller once the collective completed
                raised.append(error)
        self.wait(work, what)
        return out, raised

    def all_to_all_autograd(
        self,
        x: Tensor,
        out_splits: list[int],
        in_splits: list[int],
        what: str,
        anchor: Tensor | None,
        while_in_flight: Callable[[], None] | None = None,
    ) -> Tensor:
        """``all_to_all_single`` whose backward is the reverse all-to-all of the gradient.

        ``anchor`` (a 0-element leaf that requires grad) makes the output require grad on every rank even
        when ``x`` does not (a rank that holds no tables), so that all ranks run the backward collective
        together; pass it whenever grad mode is on. ``while_in_flight``: see :meth:`_exchange` (forward
        only).
        """
        if self._alone:  # its own block is everything; the gradient flows back to it unchanged
            if anchor is not None and not x.requires_grad:
                # Still part of the graph, as on any rank (an empty batch).
                return x + anchor.sum().to(x.dtype)
            return x
        if anchor is None and not x.requires_grad:
            return self.all_to_all(x, out_splits, in_splits, what, while_in_flight)
        inputs = (x, anchor if anchor is not None else x.new_empty(0))
        out: Tensor = _AllToAll.apply(self, what, out_splits, in_splits, while_in_flight, *inputs)  # type: ignore[no-untyped-call]  # Function.apply is untyped
        return out

    def _track(self, ctx: Any, record: _BackwardCollective) -> None:
        """Remember ``record`` as owed if ``ctx`` (an autograd context) dies before its backward ran."""
        done = [False]
        ctx.pending = _Pending(done)
        finalizer = weakref.finalize(ctx.pending, _on_graph_freed, weakref.ref(self), record, done)
        finalizer.atexit = False

    def catch_up_skipped_backward(self) -> list[str]:
        """Run, with zero gradients, the backward all-to-alls of graphs freed without a backward.

        A rank that drops a training step's output without calling ``backward`` would otherwise issue its
        next collectives while its peers run their backward ones: those would pair with the wrong calls
        and the peers would apply this rank's next header or ids as gradients. Sending zeros in the
        owed calls keeps every rank's collective sequence in step (the peers' tables get no
        contribution from this rank); the caller then reports the skip on every rank.

        Returns:
            What was owed (``"backward of pooled output dist"``, ...), oldest first; empty if nothing.
        """
        if not self._skipped:
            return []
        owed, self._skipped = sorted(self._skipped, key=lambda r: -r.order), []
        for record in owed:
            zeros = torch.zeros(record.grad_shape, dtype=record.dtype, device=self.device)
            self.all_to_all(zeros, record.recv_splits, record.send_splits, f"catch-up {record.what}")
        return [r.what for r in reversed(owed)]

    # -- small exchanges ---------------------------------------------------------------------------
    def all_gather_int64(self, values: list[int], what: str) -> list[list[int]]:
        """All-gather a short int64 vector of equal length from every rank (host lists)."""
        if self._alone:
            return [[int(v) for v in values]]
        x = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        work = dist.all_gather(out, x, group=self.group, async_op=True)
        self.wait(work, what)
        rows: list[list[int]] = torch.stack(out).tolist()
        return rows

    def gather_messages(self, message: str, what: str) -> list[str]:
        """All-gather one UTF-8 message per rank (truncated to 1 KiB); every rank must call it."""
        raw = message.encode("utf-8")[: _MESSAGE_BYTES - 1]
        if self._alone:
            return [_decode_message(raw)]
        buf = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if raw:
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        buf = buf.to(self.device)
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
        work = dist.all_gather(out, buf, group=self.group, async_op=True)
        self.wait(work, what)
        return [_decode_message(bytes(t.cpu().tolist())) for t in out]

    def all_reduce_sum_(self, x: Tensor, what: str) -> None:
        """In-place sum all-reduce of ``x`` over the group."""
        if self._alone:
            return
        work = dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.wait(work, what)


class _Done:
    """The work handle of a collective a group of one never issues: already complete."""

    __slots__ = ()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True


_DONE = _Done()


def _raise_dropping_references(raised: list[BaseException]) -> None:
    """Raise the one error in ``raised`` with no frame keeping it: its traceback reaches the frames it passed
    (and their callers'), so a local holding it would make a cycle that keeps those frames' locals (an
    autograd ``ctx``, whose death records an owed backward) alive until a GC pass."""
    error = raised.pop()
    try:
        raise error
    finally:
        del error


def _decode_message(data: bytes) -> str:
    """A gathered message: the UTF-8 text before the first NUL (the padding)."""
    return data.split(b"\0", 1)[0].decode("utf-8", errors="replace")


class _AllToAll(torch.autograd.Function):
    """Differentiable ``all_to_all_single``: backward sends each gradient block back to its source."""

    @staticmethod
    def forward(
        ctx: Any,
        comm: Communicator,
        what: str,
        out_splits: list[int],
        in_splits: list[int],
        while_in_flight: Callable[[], None] | None,
        x: Tensor,
        anchor: Tensor,
    ) -> Tensor:
        ctx.comm = comm
        ctx.what = what
        ctx.splits = (out_splits, in_splits)
        out, raised = comm._exchange(x.detach(), out_splits, in_splits, what, while_in_flight)
        record = _BackwardCollective(
            next(comm._order), f"backward of {what}", tuple(out.shape), out.dtype, out_splits, in_splits
        )
        comm._track(ctx, record)
        if raised:  # the graph dies with it: the finalizer records the backward owed to the peers
            _raise_dropping_references(raised)
        # A view: the process group's work may hold `out` a while after the wait; the graph (and the
        # skipped-backward finalizer) must live exactly as long as the user's tensor.
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None, None, None, Tensor, None]:
        comm: Communicator = ctx.comm
        ctx.pending.done[0] = True
        out_splits, in_splits = ctx.splits
        back = comm.all_to_all(grad.contiguous(), in_splits, out_splits, f"backward of {ctx.what}")
        return None, None, None, None, None, back, None


def _on_graph_freed(
    comm_ref: weakref.ref[Communicator], record: _BackwardCollective, done: list[bool]
) -> None:
    """Finalizer of a differentiable all-to-all's context: record the backward it never ran."""
    comm = comm_ref()
    if comm is not None and not done[0]:
        comm._skipped.append(record)
