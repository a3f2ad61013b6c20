"""``BackwardOverlap``: each embedding module's backward on its own stream, after the dense backward.

Autograd runs every backward op on the stream its forward op ran on. So the helper runs each embedding
module's forward on a stream of its own (one per module, created once and reused for every batch; torchrec
#2117 found per-batch alternation deadlocks NCCL under autograd), cuts the module's outputs from the dense graph
(the dense part sees detached leaves that require grad), and ``backward(loss)`` first runs the dense backward,
then each module's backward from the gradients its leaves received, on that module's stream. The dense
optimizer step (and the next batch's dense work) can then overlap the embedding backwards, which fused
optimizers (fbgemm TBE, key-value tables) finish by updating their rows.

Stream hand-offs: the module stream waits for the current stream before the forward and ``record_stream`` s
every input tensor; the current stream waits for the module stream after it and ``record_stream`` s the
outputs; before the embedding backward the module stream waits for the dense backward and ``record_stream`` s
the gradients. On CPU everything runs inline, in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from pipeline_stages._streams import record_stream_all, stream_context
from pipeline_stages.errors import InvalidStageError
from pipeline_stages.interfaces import KeyedTensorLike

__all__ = ["BackwardOverlap"]


class BackwardOverlap:
    """Run pipelined embedding modules' backwards on their own streams after the dense backward.

    Example::

        overlap = BackwardOverlap()
        pooled = overlap.run("ebc", model.ebc, batch.sparse_features)   # forward on the `ebc` stream
        loss = model.dense(batch.dense_features, pooled)                 # dense graph ends at the cut
        overlap.backward(loss)        # dense backward, then the ebc backward on its own stream
        dense_optimizer.step()        # overlaps the embedding backward on CUDA

    Args:
        cuda: use CUDA streams; default: whether CUDA is available. With False (or on CPU) everything runs
            inline on the current thread, in the same order.
    """

    def __init__(self, *, cuda: bool | None = None) -> None:
        self._cuda = torch.cuda.is_available() if cuda is None else cuda
        self._streams: dict[str, torch.cuda.Stream] = {}
        self._cuts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def streams(self) -> Mapping[str, torch.cuda.Stream]:
        """The stream of each module name seen so far (empty on CPU)."""
        return dict(self._streams)

    def stream(self, name: str, device: torch.device | None = None) -> torch.cuda.Stream | None:
        """The stream of module ``name`` (created on first use on ``device``), or None on CPU."""
        if not self._cuda:
            return None
        stream = self._streams.get(name)
        if stream is None:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # unannotated in torch
            self._streams[name] = stream
        return stream

    def run(self, name: str, module: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``module(*args, **kwargs)`` on module ``name``'s stream and cut its outputs.

        Args:
            name: the module's name (one stream per name).
            module: the embedding module (any callable).
            *args: its positional inputs (their CUDA tensors are ``record_stream`` ed on the module stream).
            **kwargs: its keyword inputs.

        Returns:
            The output with every tensor that requires grad replaced by a leaf (see :meth:`cut`); outputs
            may be tensors, :class:`~pipeline_stages.interfaces.KeyedTensorLike` objects (torchrec's or
            kt-regroup's ``KeyedTensor``: cut at ``values()`` and rebuilt as the same type), lists, tuples,
            dicts and dataclasses of them.

        Raises:
            InvalidStageError: an output object holds tensors that require grad but is none of the above
                (cut its tensors with :meth:`cut` yourself), or a KeyedTensor-like output cannot be rebuilt
                with ``type(kt)(keys=, length_per_key=, values=)``.
        """
        if not isinstance(name, str) or not name:
            raise InvalidStageError(f"`name` must be a non-empty str, got {name!r}")
        stream = self.stream(name)
        if stream is None:
            return self._cut_all(name, module(*args, **kwargs))
        current = torch.cuda.current_stream(stream.device)
        stream.wait_stream(current)
        record_stream_all((args, kwargs), stream)
        with stream_context(stream):
            output = module(*args, **kwargs)
        current.wait_stream(stream)
        record_stream_all(output, current)
        return self._cut_all(name, output)

    def cut(self, name: str, output: torch.Tensor) -> torch.Tensor:
        """Detach ``output`` (a module output) from the dense graph.

        Returns a leaf sharing ``output``'s storage that requires grad when ``output`` does; the gradient the
        dense backward leaves on it is later fed to ``output``'s own backward by :meth:`backward`.
        """
        if not isinstance(output, torch.Tensor):
            raise InvalidStageError(f"`output` must be a torch.Tensor, got {type(output).__name__}")
        if not output.requires_grad:
            return output
        leaf = output.detach().requires_grad_(True)
        self._cuts.setdefault(name, []).append((output, leaf))
        return leaf

    def _cut_all(self, name: str, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self.cut(name, output)
        if isinstance(output, KeyedTensorLike):
            return self._cut_keyed(name, output)
        if isinstance(output, (list, tuple)):
            items = [self._cut_all(name, item) for item in output]
            if hasattr(output, "_fields"):  # named tuple
                return type(output)(*items)
            return type(output)(items)
        if isinstance(output, dict):
            return {key: self._cut_all(name, value) for key, value in output.items()}
        if dataclasses.is_dataclass(output) and not isinstance(output, type):
            changes = {
                f.name: self._cut_all(name, getattr(output, f.name))
                for f in dataclasses.fields(output)
                if f.init
            }
            return dataclasses.replace(output, **changes)
        if _holds_grad_tensors(output):
            raise InvalidStageError(
                f"cannot cut an output of type {type(output).__name__} of module `{name}`; call the module "
                "yourself and cut its tensors with BackwardOverlap.cut()"
            )
        return output

    def _cut_keyed(self, name: str, output: KeyedTensorLike) -> Any:
        values = output.values()
        if not isinstance(values, torch.Tensor) or not values.requires_grad:
            return output
        leaf = self.cut(name, values)
        kwargs: dict[str, Any] = {"keys": output.keys(), "length_per_key": output.length_per_key()}
        if output.key_dim() != 1:  # only passed when needed: vbe-lookup's pooled output has no key_dim
            kwargs["key_dim"] = output.key_dim()
        rebuild: Callable[..., Any] = type(output)
        try:
            return rebuild(values=leaf, **kwargs)
        except TypeError as error:
            self._cuts[name].pop()
            raise InvalidStageError(
                f"cannot rebuild the {type(output).__name__} output of module `{name}` around its cut "
                f"values: `{type(output).__name__}(keys=, length_per_key=, values=)` raised {error}; call "
                "the module yourself and cut its values() with BackwardOverlap.cut()"
            ) from error

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """Dense backward from ``loss``, then each cut module's backward on its own stream (in reverse order).

        Returns without waiting for the embedding backwards on CUDA; call :meth:`wait` before the current
        stream reads gradients they produce (non-fused embedding parameters).
        """
        cuts, self._cuts = self._cuts, {}
        loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated
        for name in reversed(list(cuts)):
            pairs = [(out, leaf.grad) for out, leaf in cuts[name] if leaf.grad is not None]
            if not pairs:
                continue
            outputs = [out for out, _ in pairs]
            grads = [grad for _, grad in pairs]
            stream = self._streams.get(name) if self._cuda else None
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(stream.device))
                for grad in grads:
                    grad.record_stream(stream)
            with stream_context(stream):
                torch.autograd.backward(outputs, grads, retain_graph=retain_graph)

    def wait(self) -> None:
        """Make the current stream wait for every module stream (no-op on CPU)."""
        for stream in self._streams.values():
            torch.cuda.current_stream(stream.device).wait_stream(stream)

    def clear(self) -> None:
        """Forget the cuts of the current step without running their backwards (e.g. an eval forward)."""
        self._cuts = {}


def _holds_grad_tensors(obj: Any) -> bool:
    """Whether ``obj``'s attributes (``__dict__`` and ``__slots__``) hold a tensor that requires grad."""
    values = getattr(obj, "__dict__", None)
    attributes = list(values.values()) if isinstance(values, dict) else []
    for kind in type(obj).__mro__:
        slots = kind.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            attributes.append(getattr(obj, slot, None))
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in attributes)
