"""record_stream_all's walk over nested batches (CPU: Pipelineable fakes stand in for CUDA tensors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline_stages import Pipelineable, record_stream_all


class FakeStream:
    """Duck-typed stream: record_stream_all only reads `.device.type` (and CUDA tensors never occur here)."""

    device = torch.device("cuda")


class Leaf:
    """A Pipelineable that counts record_stream calls."""

    def __init__(self) -> None:
        self.calls = 0

    def to(self, device: torch.device, non_blocking: bool = False) -> Leaf:
        return self

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        self.calls += 1


@dataclass
class Holder:
    a: Any
    b: Any = None


class Pair(NamedTuple):
    left: Any
    right: Any


def nest(draw: st.DrawFn, leaves: list[Leaf], depth: int) -> Any:
    if depth == 0 or draw(st.booleans()):
        leaf = Leaf()
        leaves.append(leaf)
        return leaf
    kind = draw(st.sampled_from(["list", "tuple", "dict", "dataclass", "namedtuple", "set-free"]))
    children = [nest(draw, leaves, depth - 1) for _ in range(draw(st.integers(1, 3)))]
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    if kind == "dict":
        return {f"k{i}": child for i, child in enumerate(children)}
    if kind == "dataclass":
        return Holder(a=children, b=torch.ones(2))
    if kind == "namedtuple":
        return Pair(left=children[0], right=children[1:])
    return [*children, "text", 3, None, torch.device("cpu")]


@st.composite
def batches(draw: st.DrawFn) -> tuple[Any, list[Leaf]]:
    leaves: list[Leaf] = []
    return nest(draw, leaves, 4), leaves


@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_every_pipelineable_is_reached_exactly_once(batch: tuple[Any, list[Leaf]]) -> None:
    """Lists, tuples, named tuples, dicts and dataclasses are walked; every Pipelineable is called once."""
    obj, leaves = batch
    record_stream_all(obj, FakeStream())  # type: ignore[arg-type]  # a duck-typed stream on CPU
    assert [leaf.calls for leaf in leaves] == [1] * len(leaves)


def test_shared_and_cyclic_objects_are_visited_once() -> None:
    """An object reachable twice (or through a cycle) gets one record_stream call."""
    leaf = Leaf()
    cycle: list[Any] = [leaf]
    cycle.append(cycle)
    record_stream_all({"a": leaf, "b": [leaf], "c": cycle}, FakeStream())  # type: ignore[arg-type]  # duck-typed
    assert leaf.calls == 1
    assert isinstance(leaf, Pipelineable)


def test_cpu_tensors_are_skipped() -> None:
    """Tensors on another device type than the stream's are left alone (no CPU record_stream)."""
    record_stream_all([torch.ones(3), {"x": torch.zeros(1)}], FakeStream())  # type: ignore[arg-type]  # duck-typed


@dataclass(frozen=True)
class Annotated:
    """Fields annotated with atom types are not walked (their annotation says they hold no tensor)."""

    count: int
    sizes: tuple[tuple[int, ...], ...]
    name: str | None
    anything: list  # type: ignore[type-arg]  # bare on purpose: a bare container may hold anything
    mixed: tuple[int, Any]
    payload: Any


def test_dataclass_fields_annotated_with_atoms_are_not_walked() -> None:
    """Only fields whose annotation can hold a tensor are walked; each Pipelineable is still called once."""
    lying, bare, mixed, payload = Leaf(), Leaf(), Leaf(), Leaf()
    obj = Annotated(
        count=lying,  # type: ignore[arg-type]  # an annotation that lies is trusted: not walked
        sizes=((1, 2), (3,)),
        name=None,
        anything=[bare],
        mixed=(1, mixed),
        payload={"x": payload, "again": payload},
    )
    for _ in range(2):  # the second call uses the per-type plan
        record_stream_all(obj, FakeStream())  # type: ignore[arg-type]  # duck-typed
    assert (lying.calls, bare.calls, mixed.calls, payload.calls) == (0, 2, 2, 2)
