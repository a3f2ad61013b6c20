"""KeyedTensor's torchrec surface: to(), device(), record_stream(), the regroup statics, torch.fx tracing."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.fx._symbolic_trace import PH  # torch.fx.PH

from kt_regroup import KeyedTensor, KTRegroupAsDict, regroup, regroup_as_dict


def _kts() -> list[KeyedTensor]:
    gen = torch.Generator().manual_seed(0)
    return [
        KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5, generator=gen)),
        KeyedTensor(["c"], [4], torch.randn(4, 4, generator=gen)),
    ]


@pytest.mark.parametrize("key_dim", [0, 1], ids=["key_dim0", "key_dim1"])
def test_to_moves_the_values_and_keeps_the_layout(key_dim: int) -> None:
    """to(device, non_blocking) returns a KeyedTensor on that device with the same keys, lengths, key_dim."""
    values = torch.randn(5, 4) if key_dim == 0 else torch.randn(4, 5)
    kt = KeyedTensor(["a", "b"], [2, 3], values, key_dim=key_dim)
    moved = kt.to(torch.device("meta"), non_blocking=True)
    assert isinstance(moved, KeyedTensor)
    assert moved.values().device.type == "meta"
    assert moved.values().shape == values.shape
    assert (moved.keys(), moved.length_per_key(), moved.key_dim()) == (["a", "b"], [2, 3], key_dim)
    back = kt.to("cpu")
    assert torch.equal(back.values(), values)
    assert back.offset_per_key() == [0, 2, 5]


def test_device_is_the_values_device() -> None:
    """device() is where values() lives (torchrec's name)."""
    kt = _kts()[0]
    assert kt.device() == torch.device("cpu")
    assert kt.to(torch.device("meta")).device() == torch.device("meta")


class _RecordingTensor(torch.Tensor):
    """A tensor that notes record_stream calls instead of running them (CPU has no record_stream kernel)."""

    streams: ClassVar[list[Any]] = []

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if func is torch.Tensor.record_stream:
            cls.streams.append((args[0].data_ptr(), args[1]))
            return None
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]  # untyped in torch


def test_record_stream_records_the_values() -> None:
    """record_stream(stream) calls values().record_stream(stream) (the values are its only tensor)."""
    values = torch.randn(4, 5).as_subclass(_RecordingTensor)
    kt = KeyedTensor(["a", "b"], [2, 3], values)
    stream = torch.Stream(device="cpu")
    _RecordingTensor.streams.clear()
    kt.record_stream(stream)
    assert _RecordingTensor.streams == [(values.data_ptr(), stream)]


def test_record_stream_leaves_values_on_another_device_type_alone() -> None:
    """Host values and a stream of another device type: nothing to record, no error (CPU has no kernel)."""
    kt = _kts()[0]
    kt.record_stream(torch.Stream(device="meta"))
    with pytest.raises(NotImplementedError):  # what calling it anyway would do
        kt.values().record_stream(torch.Stream(device="meta"))


def test_regroup_staticmethods_match_the_functions() -> None:
    """KeyedTensor.regroup / regroup_as_dict (torchrec's statics) give what regroup / regroup_as_dict give."""
    kts = _kts()
    groups = [["c", "a"], ["b", "b"], []]
    for got, expected in zip(KeyedTensor.regroup(kts, groups), regroup(kts, groups), strict=True):
        assert torch.equal(got, expected)
    named = KeyedTensor.regroup_as_dict(kts, groups, ["x", "y", "z"])
    assert list(named) == ["x", "y", "z"]
    for name, expected in regroup_as_dict(kts, groups, ["x", "y", "z"]).items():
        assert torch.equal(named[name], expected)


class _UsesKeyedTensors(nn.Module):
    """Builds KeyedTensors from plain tensors; regroups them through the module, the statics and indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.regroup = KTRegroupAsDict([["c", "a"], ["b"]], ["x", "y"])

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        kts = [KeyedTensor(["a", "b"], [2, 3], dense), KeyedTensor(["c"], [4], sparse)]
        grouped: dict[str, torch.Tensor] = self.regroup(kts)
        (both,) = KeyedTensor.regroup(kts, [["b", "c"]])
        named = KeyedTensor.regroup_as_dict(kts, [["a"]], ["only_a"])
        return (
            grouped["x"].sum(1) * 2
            + grouped["y"].sum(1)
            + both.mean(1)
            + named["only_a"].sum(1)
            + kts[0]["b"].sum(1)
        )


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_fx_symbolic_trace_of_a_module_using_keyed_tensors(warm: bool) -> None:
    """torch.fx.symbolic_trace traces the module (cold, or with a cached plan); the graph runs like eager."""
    model = _UsesKeyedTensors()
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(3, 5, generator=gen, requires_grad=True)
    sparse = torch.randn(3, 4, generator=gen, requires_grad=True)
    if warm:
        model(dense, sparse)
    traced = torch.fx.symbolic_trace(model)
    expected = model(dense, sparse)
    expected.sum().backward()
    grads = (dense.grad, sparse.grad)
    dense.grad = sparse.grad = None
    got = traced(dense, sparse)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    torch.testing.assert_close((dense.grad, sparse.grad), grads)
    # New batch size, same layout: the graph is not specialised to the traced inputs' shapes.
    wide = (torch.randn(7, 5, generator=gen), torch.randn(7, 4, generator=gen))
    torch.testing.assert_close(traced(*wide), model(*wide))


class _TakesKeyedTensors(nn.Module):
    """A module whose inputs are KeyedTensors."""

    def __init__(self) -> None:
        super().__init__()
        self.regroup = KTRegroupAsDict([["c", "a"], ["b"]], ["x", "y"])

    def forward(self, first: KeyedTensor, second: KeyedTensor) -> torch.Tensor:
        out: dict[str, torch.Tensor] = self.regroup([first, second])
        return out["x"].sum(1) + out["y"].mean(1)


_PH: Any = PH  # fx's placeholder (typed Any: it stands where a tensor goes)


def test_fx_symbolic_trace_with_keyed_tensor_inputs() -> None:
    """KeyedTensor inputs trace with concrete_args templates whose values are torch.fx.PH (a pytree node)."""
    model = _TakesKeyedTensors()
    template = {
        "first": KeyedTensor(["a", "b"], [2, 3], _PH),
        "second": KeyedTensor(["c"], [4], _PH),
    }
    traced = torch.fx.symbolic_trace(model, concrete_args=template)
    first, second = _kts()
    torch.testing.assert_close(traced(first, second), model(first, second))
