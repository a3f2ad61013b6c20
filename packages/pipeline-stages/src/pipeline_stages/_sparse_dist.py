"""``SparseDataDistUtil``: the sparse-data-dist and prefetch stages for every sparse module of a model.

No FX rewrite: the util finds the submodules that implement :class:`~pipeline_stages.interfaces.SparseDistModule`
and keeps one context per in-flight batch, in a FIFO that advances in lockstep with the batches:

* ``start_sparse_data_dist(batch)`` (a stage runnable) appends a context and starts every module's input dist.
* ``wait_sparse_data_dist()`` finishes the oldest started, unwaited context (fill callback of that stage;
  with ``wait_after_forward=False`` also after every model forward through a forward hook on the model, as
  torchrec does).
* ``prefetch(batch)`` (a stage runnable) prefetches the rows of the batch's context on every
  :class:`~pipeline_stages.interfaces.Prefetchable` module (waiting for the dist first if needed). With
  ``wait_after_forward=True`` (the default) it only marks the context when an older batch is still to be
  forwarded: the wait and the prefetch then run right after that older batch's forward has been launched
  (see below), so the host never waits for batch ``i+1`` before forward ``i`` is queued.
* ``load_prefetch()`` (fill callback of the prefetch stage, and after every model forward) marks the oldest
  prefetched context as loaded: the input of an upcoming forward.
* A forward pre-hook on every sparse module hands the context's distributed features to the module with
  ``enqueue_pipelined_input`` right before its forward (after the compute stream waited for the dist or
  prefetch work and ``record_stream`` of the features), so the forward pops them instead of distributing.
  A dist not waited or a prefetch not run by then is done there first.
* After a forward that consumed a context (``wait_after_forward=True``): at the end of the model's forward
  when the model is called (``model(batch)``), else at the end of the last sparse module's forward (a
  training loop that calls another method of the model, which runs no model hooks), the oldest context
  whose prefetch was deferred is waited and prefetched; without one, the oldest unwaited dist is waited.
  A module implementing :class:`~pipeline_stages.interfaces.OutputDistOverlap` runs this earlier, while its
  host waits for its output collective (CPU process groups), once the forward consumed every module's part.

Which context a forward consumes: when the util's bound methods are stage callables of a
:class:`~pipeline_stages.StagedTrainPipeline`, the pipeline tags every context with its batch's sequence
number and tells the util which batch it returned; the next model forward consumes exactly that batch's
context (older ones, of batches never forwarded, are finished and dropped), and a forward the pipeline handed
out no batch for (an eval forward, a second forward of the same batch) runs plain, consuming nothing. A stage
error drops the contexts of the batches the pipeline dropped. Driven without a pipeline (or through lambdas),
the util falls back to the FIFO: the oldest context whose batch or features object is not recognised by
identity among the forward's inputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function
from torch.utils.hooks import RemovableHandle

from pipeline_stages._sequence import CURRENT_BATCH
from pipeline_stages._streams import new_event, record_stream_all, stream_context
from pipeline_stages.errors import InvalidStageError, NoSparseModulesError, SparseFeaturesError
from pipeline_stages.interfaces import OutputDistOverlap, Prefetchable, SparseDistModule

__all__ = ["SparseDataDistUtil"]


def _default_sparse_features(batch: Any) -> Any:
    try:
        return batch.sparse_features
    except AttributeError:
        raise SparseFeaturesError(
            f"batch of type {type(batch).__name__} has no attribute `sparse_features`; pass "
            "`sparse_features=` (a callable batch -> features) to SparseDataDistUtil"
        ) from None


@dataclass(slots=True, eq=False)
class _BatchContext:
    """The sparse-dist state of one in-flight batch."""

    index: int
    seq: int | None  # the pipeline's batch sequence number (None when started outside a pipeline stage)
    batch: Any
    features: dict[str, Any]
    handles: dict[str, Any]
    dist: dict[str, Any] | None = None
    event: torch.cuda.Event | None = None
    prefetched: bool = False  # the prefetch stage ran for this batch (its work may be deferred: `deferred`)
    deferred: bool = False  # wait + prefetch still to run: after the previous batch's forward, or in its own
    loaded: bool = False
    consumed: set[str] = field(default_factory=set)


# The model forward in progress runs plain: it consumes no context (the pipeline handed out no batch for it).
_PLAIN = _BatchContext(index=-1, seq=None, batch=None, features={}, handles={})

_TORCHREC_ORDER = "SparseDataDistUtil(model, data_dist_stream, apply_jit, prefetch_stream)"


def _order_hint(apply_jit: object) -> str:
    """The hint for an ``apply_jit`` that looks like a stream meant for ``prefetch_stream`` (our old order)."""
    if not (isinstance(apply_jit, torch.cuda.Stream) or apply_jit is None):
        return ""
    return f"; the positional order is torchrec's, {_TORCHREC_ORDER}: pass `prefetch_stream=` by keyword"


class SparseDataDistUtil:
    """Sparse data dist and prefetch stages for a :class:`~pipeline_stages.StagedTrainPipeline`.

    Example (the stage layout of torchrec; works on CPU with every stream None)::

        sdd = SparseDataDistUtil(model, data_dist_stream=dist_stream, prefetch_stream=prefetch_stream)
        pipeline = StagedTrainPipeline([
            PipelineStage("data_copy", copy_to_device, stream=copy_stream),
            PipelineStage("start_sparse_data_dist", sdd.start_sparse_data_dist, stream=sdd.data_dist_stream,
                          fill_callback=sdd.wait_sparse_data_dist),
            PipelineStage("prefetch", sdd.prefetch, stream=sdd.prefetch_stream, fill_callback=sdd.load_prefetch),
        ])

    Without a prefetch stage, drop the last stage: the forward then uses the waited dist features directly.

    With ``wait_after_forward=True`` (the default), the host-blocking part of batch ``i+1``'s preparation (the
    input dist's wait, and the prefetch, whose host work can be long for key-value tables) runs right after
    forward ``i`` has been launched instead of inside ``progress()`` before it: the GPU already has forward
    ``i`` queued while the host waits. The prefetch stage's runnable then only marks the batch, so its
    ``stats()`` host and device times no longer contain the prefetch. The prefetch still runs on
    ``prefetch_stream`` and forward ``i+1`` waits for its event.

    Args:
        model: the model; every outermost submodule (the model itself included) implementing
            :class:`~pipeline_stages.interfaces.SparseDistModule` is driven.
        data_dist_stream: CUDA stream of the input dists (None on CPU or to use the current stream).
        apply_jit: torchrec's flag (``torch.jit.script`` of the unsharded modules); only False is accepted:
            no FX rewrite happens here, so there is nothing to script. It is here so that torchrec's
            positional order ``(model, data_dist_stream, apply_jit, prefetch_stream)`` binds the same way.
        prefetch_stream: CUDA stream of the prefetches (None on CPU or to use the current stream).
        sparse_features: ``batch -> features`` handed to ``start_input_dist``; defaults to the batch's
            ``sparse_features`` attribute. It may return a mapping ``{module name: features}`` whose keys are
            exactly the names of the driven modules (see :attr:`modules`) to give each module its own input.
        wait_after_forward: run the wait and prefetch of the next batch right after the current batch's
            forward has been launched (True, default) or inside the prefetch stage, before it (False:
            torchrec's placement). Results are the same; errors raised by a deferred wait or prefetch come
            out of the forward that ran it (with a note naming the batch), and the batch's own forward
            retries it.

    Raises:
        NoSparseModulesError: ``model`` has no submodule implementing ``SparseDistModule``.
        InvalidStageError: an argument has the wrong type (a stream in ``apply_jit``'s place names
            torchrec's positional order), or ``apply_jit=True``.

    Each sparse module must be called (through ``__call__``, so its hooks run) exactly once per model forward
    of a pipelined batch. With the util's bound methods as stage callables (as above), a model forward the
    pipeline returned no batch for (an eval forward mid-epoch) runs plain and leaves the pipeline aligned;
    driven otherwise, such a forward would consume a pipelined context: ``detach()`` first, or flush.
    """

    def __init__(
        self,
        model: nn.Module,
        data_dist_stream: torch.cuda.Stream | None = None,
        apply_jit: bool = False,
        prefetch_stream: torch.cuda.Stream | None = None,
        *,
        sparse_features: Callable[[Any], Any] | None = None,
        wait_after_forward: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InvalidStageError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(apply_jit, bool):
            raise InvalidStageError(f"`apply_jit` must be a bool, got {apply_jit!r}{_order_hint(apply_jit)}")
        if apply_jit:
            raise InvalidStageError(
                "`apply_jit=True` is not supported: SparseDataDistUtil rewrites no module (no FX), so there "
                "is nothing to torch.jit.script; pass apply_jit=False"
            )
        for name, stream in (("data_dist_stream", data_dist_stream), ("prefetch_stream", prefetch_stream)):
            if stream is not None and not isinstance(stream, torch.cuda.Stream):
                raise InvalidStageError(f"`{name}` must be a torch.cuda.Stream or None, got {stream!r}")
        if not isinstance(wait_after_forward, bool):
            raise InvalidStageError(f"`wait_after_forward` must be a bool, got {wait_after_forward!r}")
        if sparse_features is not None and not callable(sparse_features):
            raise InvalidStageError(
                f"`sparse_features` must be callable (batch -> features), got {sparse_features!r}"
            )
        self.model = model
        self.data_dist_stream = data_dist_stream
        self.prefetch_stream = prefetch_stream
        self._sparse_features = sparse_features if sparse_features is not None else _default_sparse_features
        self._modules = self._find_modules(model)
        self._prefetchable = {
            name: module for name, module in self._modules.items() if isinstance(module, Prefetchable)
        }
        self.wait_after_forward = wait_after_forward
        self._cuda = data_dist_stream is not None or prefetch_stream is not None
        device = (
            next(s.device for s in (data_dist_stream, prefetch_stream) if s is not None)
            if self._cuda
            else None
        )
        self._forward_stream: torch.cuda.Stream | None = (
            torch.cuda.current_stream(device) if self._cuda else None
        )
        self._contexts: deque[_BatchContext] = deque()
        self._next_index = 0
        self._hooks: list[RemovableHandle] = []
        self._linked = False  # a StagedTrainPipeline reports batch sequence numbers to this util
        self._expected: int | None = None  # sequence number of the batch the next forward is for
        self._active: _BatchContext | None = None  # context of the forward in progress (_PLAIN: none)
        self._in_model_forward = False  # between the model's forward pre- and post-hook
        self._consumed_in_forward = False  # the forward in progress consumed a context (every module's part)
        # Raised by the next batch's wait/prefetch run inside a module's output collective wait; re-raised
        # by that module's forward post-hook (a module's callback must not raise mid-collective).
        self._overlap_error: Exception | None = None
        self.attach()

    # ---------------------------------------------------------------- discovery and hooks

    @staticmethod
    def _find_modules(model: nn.Module) -> dict[str, SparseDistModule]:
        found: dict[str, SparseDistModule] = {}
        for name, module in model.named_modules():
            if any(name == outer or outer == "" or name.startswith(outer + ".") for outer in found):
                continue
            if isinstance(module, SparseDistModule):
                found[name] = module
        if not found:
            raise NoSparseModulesError(
                f"`model` ({type(model).__name__}) has no submodule implementing SparseDistModule "
                "(start_input_dist, wait_input_dist, enqueue_pipelined_input)"
            )
        return found

    @property
    def modules(self) -> Mapping[str, SparseDistModule]:
        """The driven modules by qualified name (``""`` for the model itself)."""
        return dict(self._modules)

    @property
    def num_in_flight(self) -> int:
        """How many batch contexts are held (started and not yet consumed by every module's forward)."""
        return len(self._contexts)

    @property
    def attached(self) -> bool:
        """Whether the hooks that hand pipelined input to the modules are installed."""
        return bool(self._hooks)

    def attach(self) -> None:
        """Install the hooks (done at construction, and again by the first start after ``detach()``)."""
        if self._hooks:
            return
        self._hooks.append(self.model.register_forward_pre_hook(self._model_pre_hook, with_kwargs=True))
        for name, module in self._modules.items():
            assert isinstance(module, nn.Module)
            self._hooks.append(module.register_forward_pre_hook(self._module_pre_hook(name)))
            self._hooks.append(module.register_forward_hook(self._module_post_hook))
            if self.wait_after_forward and isinstance(module, OutputDistOverlap):
                module.set_output_dist_overlap(self._while_output_dist_in_flight)
        self._hooks.append(self.model.register_forward_hook(self._model_post_hook))

    def detach(self) -> nn.Module:
        """Remove the hooks: the model and its modules behave as before; in-flight contexts are kept.

        The next ``start_sparse_data_dist`` (or :meth:`attach`) re-attaches and the pipeline continues where
        it stopped. Returns the model.
        """
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for module in self._modules.values():
            if isinstance(module, OutputDistOverlap):
                module.set_output_dist_overlap(None)
        return self.model

    def reset(self) -> None:
        """Drop every in-flight context (after finishing started dists, so no collective is left open)."""
        for ctx in self._contexts:
            if ctx.dist is None:
                self._wait(ctx)
        self._contexts.clear()
        self._active = None
        self._in_model_forward = self._consumed_in_forward = False
        self._overlap_error = None

    # ---------------------------------------------------------------- stages

    def start_sparse_data_dist(self, batch: Any) -> Any:
        """Stage runnable: start every module's input dist of ``batch``'s sparse features; return ``batch``."""
        if not self._hooks:
            self.attach()
        features = self._features_per_module(batch)
        ctx = _BatchContext(
            index=self._next_index, seq=CURRENT_BATCH.get(), batch=batch, features=features, handles={}
        )
        self._next_index += 1
        with (
            record_function(f"## start_sparse_data_dist {ctx.index} ##"),
            stream_context(self.data_dist_stream),
        ):
            for name, module in self._modules.items():
                ctx.handles[name] = module.start_input_dist(features[name])
        self._contexts.append(ctx)
        return batch

    def wait_sparse_data_dist(self) -> None:
        """Finish the input dist of the oldest context not waited yet (no-op when there is none)."""
        for ctx in self._contexts:
            if ctx.dist is None:
                self._wait(ctx)
                return

    def prefetch(self, batch: Any) -> Any:
        """Stage runnable: prefetch the rows of ``batch``'s context on every Prefetchable module; return ``batch``.

        The context is the one of this batch's sequence number inside a pipeline stage, else the one started
        for this very batch object if there is one, else the oldest one not prefetched yet; its dist is
        waited first if needed. With ``wait_after_forward`` and an older batch still to be forwarded, the
        wait and the prefetch are deferred to right after that forward (see the class docstring).
        """
        seq = CURRENT_BATCH.get()
        ctx = self._context_of_seq(seq) if seq is not None else None
        if ctx is None:
            ctx = self._context_of(batch, lambda c: not c.prefetched)
        if ctx is None:
            return batch
        ctx.prefetched = True
        if self.wait_after_forward and self._hooks and self._contexts[0] is not ctx:
            ctx.deferred = True  # an older batch's forward comes first: run right after it (_after_forward)
            return batch
        self._prefetch(ctx)
        return batch

    def load_prefetch(self) -> None:
        """Mark the oldest prefetched, not yet loaded context as the input of an upcoming forward.

        The hand-off itself (``enqueue_pipelined_input``) happens in the sparse module's forward pre-hook,
        right before the forward that consumes it; the forward's stream then waits for the prefetch.
        """
        for ctx in self._contexts:
            if ctx.prefetched and not ctx.loaded:
                ctx.loaded = True
                return

    # torchrec names of the same callbacks, so torchrec stage layouts work unchanged.
    def wait_sdd_fill_callback(self) -> None:
        """Alias of :meth:`wait_sparse_data_dist` (torchrec's fill callback name)."""
        self.wait_sparse_data_dist()

    def data_exhausted_callback(self) -> None:
        """No-op (torchrec parity): every operation here already tolerates missing contexts."""

    # ---------------------------------------------------------------- pipeline link (see _sequence)

    def _link_pipeline(self) -> None:
        """A pipeline uses this util's bound methods as stage callables and reports sequence numbers."""
        self._linked = True

    def _pipeline_returned(self, seq: int) -> None:
        """The pipeline returned batch ``seq``: the next model forward is for it."""
        self._expected = seq

    def _pipeline_dropped(self, seqs: list[int]) -> None:
        """An error dropped batches ``seqs``: finish their started dists and forget their contexts."""
        dropped = set(seqs)
        kept: deque[_BatchContext] = deque()
        for ctx in self._contexts:
            if ctx.seq is not None and ctx.seq in dropped:
                if ctx.dist is None:
                    self._wait(ctx)
            else:
                kept.append(ctx)
        self._contexts = kept
        if self._expected is not None and self._expected in dropped:
            self._expected = None

    def _context_of_seq(self, seq: int) -> _BatchContext | None:
        return next((ctx for ctx in self._contexts if ctx.seq == seq), None)

    # ---------------------------------------------------------------- internals

    def _features_per_module(self, batch: Any) -> dict[str, Any]:
        features = self._sparse_features(batch)
        if isinstance(features, Mapping) and set(features) == set(self._modules):
            return {name: features[name] for name in self._modules}
        return dict.fromkeys(self._modules, features)

    def _current_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream() if self._cuda else None

    def _prefetch(self, ctx: _BatchContext) -> None:
        """Wait ``ctx``'s dist if needed, then prefetch its rows on every Prefetchable module."""
        if ctx.dist is None:
            self._wait(ctx)
        assert ctx.dist is not None
        if not self._prefetchable:
            ctx.deferred = False
            return  # nothing runs on the prefetch stream: the forward waits for the dist event itself
        with record_function(f"## prefetch {ctx.index} ##"), stream_context(self.prefetch_stream):
            stream = self._current_stream()
            if stream is not None and ctx.event is not None:
                stream.wait_event(ctx.event)
                for name in self._prefetchable:  # only what the prefetch stream reads
                    record_stream_all(ctx.dist[name], stream)
            for name, module in self._prefetchable.items():
                module.prefetch(ctx.dist[name], forward_stream=self._forward_stream)
            if stream is not None:
                ctx.event = new_event(stream)
        ctx.deferred = False  # only once every module prefetched: a failed prefetch is retried by its forward

    def _after_forward(self) -> None:
        """Right after a forward that consumed a context: prepare the next batch (``wait_after_forward``)."""
        ctx = next((c for c in self._contexts if c.deferred), None)
        if ctx is None:
            self.wait_sparse_data_dist()
            return
        try:
            self._prefetch(ctx)
        except Exception as error:
            add_note = getattr(error, "add_note", None)  # Python >= 3.11
            if add_note is not None:
                add_note(
                    f"pipeline_stages: raised by SparseDataDistUtil's wait/prefetch of batch {ctx.index}, run "
                    "after the previous batch's forward (wait_after_forward=True); that batch's own forward "
                    "retries it"
                )
            raise

    def _while_output_dist_in_flight(self) -> None:
        """A driven module's host waits for its output collective: prepare the next batch now if due."""
        if not self._consumed_in_forward or self._overlap_error is not None:
            return
        self._consumed_in_forward = False  # done here: the post-hooks then skip it
        try:
            self._after_forward()
        except Exception as error:
            self._overlap_error = error

    def _wait(self, ctx: _BatchContext) -> None:
        with (
            record_function(f"## wait_sparse_data_dist {ctx.index} ##"),
            stream_context(self.data_dist_stream),
        ):
            ctx.dist = {
                name: module.wait_input_dist(ctx.handles[name]) for name, module in self._modules.items()
            }
            ctx.handles = {}
            stream = self._current_stream()
            if stream is not None:
                ctx.event = new_event(stream)

    def _context_of(self, batch: Any, wanted: Callable[[_BatchContext], bool]) -> _BatchContext | None:
        oldest = None
        for ctx in self._contexts:
            if ctx.batch is batch:
                return ctx
            if oldest is None and wanted(ctx):
                oldest = ctx
        return oldest

    def _model_pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Pick the context this forward consumes; drop stale ones (older than it)."""
        self._active = None
        self._in_model_forward = True
        self._consumed_in_forward = False
        if self._linked:
            seq, self._expected = self._expected, None
            ctx = self._context_of_seq(seq) if seq is not None else None
            if ctx is None:
                # No batch handed out for this forward (eval, or a second forward of the batch): run plain.
                self._active = _PLAIN
                return
            self._drop_older_than(ctx)  # contexts of batches returned but never forwarded
            self._active = ctx
            return
        if len(self._contexts) < 2:
            return
        inputs = [*args, *kwargs.values()]
        for position, ctx in enumerate(self._contexts):
            keys = (ctx.batch, *ctx.features.values())
            if any(value is key for value in inputs for key in keys):
                for _ in range(position):
                    stale = self._contexts.popleft()
                    if stale.dist is None:
                        self._wait(stale)
                return

    def _module_pre_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            ctx = self._active
            if ctx is None:  # called outside a model forward (or the model's forward() called directly)
                if self._linked:
                    ctx = self._context_of_seq(self._expected) if self._expected is not None else None
                    if ctx is not None:
                        self._drop_older_than(ctx)  # batches returned but never forwarded
                else:
                    ctx = next((c for c in self._contexts if name not in c.consumed), None)
                if ctx is None or name in ctx.consumed:
                    return
            elif ctx is _PLAIN or name in ctx.consumed:
                return  # a forward the pipeline handed out no batch for, or a second call within one
            if ctx.deferred:  # its previous batch's forward never ran (skipped): prefetch now
                self._prefetch(ctx)
            if ctx.dist is None:
                self._wait(ctx)
            assert ctx.dist is not None
            features = ctx.dist[name]
            stream = self._current_stream()
            if stream is not None and ctx.event is not None:
                stream.wait_event(ctx.event)
                record_stream_all(features, stream)
            self._modules[name].enqueue_pipelined_input(features)
            ctx.consumed.add(name)
            if len(ctx.consumed) == len(self._modules):
                self._consumed_in_forward = True
                if ctx in self._contexts:
                    self._contexts.remove(ctx)
                if ctx.seq is not None and ctx.seq == self._expected:
                    self._expected = None
            while self._contexts and len(self._contexts[0].consumed) == len(self._modules):
                self._contexts.popleft()

        return hook

    def _drop_older_than(self, ctx: _BatchContext) -> None:
        while self._contexts and self._contexts[0] is not ctx:
            stale = self._contexts.popleft()
            if stale.dist is None:
                self._wait(stale)

    def _module_post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """End of a sparse module's forward: outside a model forward, the point to prepare the next batch."""
        error, self._overlap_error = self._overlap_error, None
        if error is not None:
            if self._in_model_forward:  # the model forward ends with this error: its post-hook won't run
                self._active = None
                self._in_model_forward = False
            raise error
        if self._consumed_in_forward and not self._in_model_forward and self.wait_after_forward:
            self._consumed_in_forward = False
            self._after_forward()

    def _model_post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """After a forward: prepare the next batch (hidden behind this forward) and load its prefetch."""
        self._active = None
        self._in_model_forward = False
        consumed, self._consumed_in_forward = self._consumed_in_forward, False
        if not self.wait_after_forward:
            self.wait_sparse_data_dist()  # torchrec's choreography: after every forward
        elif consumed:
            self._after_forward()
        self.load_prefetch()
