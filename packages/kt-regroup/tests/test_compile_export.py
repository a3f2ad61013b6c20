"""torch.compile(fullgraph=True) and torch.export of a model that uses KTRegroupAsDict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from kt_regroup import KeyedTensor, KTRegroupAsDict, available_backends

GROUPS = [["a", "c", "a"], ["b"], []]


class _Model(nn.Module):
    """Builds KeyedTensors from plain tensors, regroups them, reduces each group."""

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.regroup = KTRegroupAsDict(GROUPS, ["x", "y", "z"], backend=backend)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        kts = [KeyedTensor(["a", "b"], [2, 3], dense), KeyedTensor(["c", "d"], [4, 1], sparse)]
        out: dict[str, torch.Tensor] = self.regroup(kts)
        return out["x"].sum(1) * 2 + out["y"].sum(1) + out["z"].sum(1)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (
        torch.randn(4, 5, generator=gen, requires_grad=True),
        torch.randn(4, 5, generator=gen, requires_grad=True),
    )


@pytest.mark.parametrize("backend", available_backends("cpu"), ids=available_backends("cpu"))
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_compile_fullgraph_matches_eager(backend: str, warm: bool) -> None:
    """fullgraph=True compiles (no graph break), cold or with a cached plan; values and grads match."""
    torch._dynamo.reset()
    model = _Model(backend)
    dense, sparse = _inputs()
    expected = model(dense, sparse)
    expected.sum().backward()
    grads = (dense.grad, sparse.grad)
    dense.grad = sparse.grad = None
    target = model if warm else _Model(backend)
    compiled = torch.compile(target, fullgraph=True, backend="aot_eager")
    got = compiled(dense, sparse)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    torch.testing.assert_close((dense.grad, sparse.grad), grads)


def test_export_has_no_string_arguments() -> None:
    """torch.export exports the model; the graph calls kt_regroup::permute and runs like eager."""
    model = _Model("torch")
    dense, sparse = _inputs()
    model(dense, sparse)
    exported = torch.export.export(model, (dense.detach(), sparse.detach()))
    targets = [str(node.target) for node in exported.graph.nodes if node.op == "call_function"]
    assert "kt_regroup.permute.default" in targets
    torch.testing.assert_close(
        exported.module()(dense.detach(), sparse.detach()), model(dense, sparse).detach()
    )


class _Direct(nn.Module):
    """Takes two KeyedTensors, returns one regrouped group."""

    def __init__(self) -> None:
        super().__init__()
        self.regroup = KTRegroupAsDict([["c", "a"]], ["g"])

    def forward(self, first: KeyedTensor, second: KeyedTensor) -> torch.Tensor:
        out: dict[str, torch.Tensor] = self.regroup([first, second])
        return out["g"]


def test_export_with_keyed_tensor_inputs() -> None:
    """KeyedTensors are pytree nodes, so they can be the exported module's inputs."""

    first = KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5))
    second = KeyedTensor(["c"], [4], torch.randn(4, 4))
    model = _Direct()
    exported = torch.export.export(model, (first, second))
    torch.testing.assert_close(exported.module()(first, second), model(first, second))


def test_exported_keyed_tensor_program_survives_save_and_load(tmp_path: Path) -> None:
    """torch.export.save / load of a program with KeyedTensor inputs: the loaded one runs new inputs."""
    first = KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5))
    second = KeyedTensor(["c"], [4], torch.randn(4, 4))
    model = _Direct()
    path = tmp_path / "direct.pt2"
    torch.export.save(torch.export.export(model, (first, second)), path)
    loaded = torch.export.load(path)
    fresh = (KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5)), KeyedTensor(["c"], [4], torch.randn(4, 4)))
    torch.testing.assert_close(loaded.module()(*fresh), model(*fresh))
    # The example inputs come back as KeyedTensors through a weights-only load.
    args, _ = loaded.example_inputs
    assert [type(a) for a in args] == [KeyedTensor, KeyedTensor]
    assert args[0].keys() == ["a", "b"]
    assert args[1].length_per_key() == [4]


def test_keyed_tensor_loads_with_weights_only(tmp_path: Path) -> None:
    """A pickled KeyedTensor is rebuilt (and validated) by torch.load(weights_only=True)."""
    kt = KeyedTensor(["a", "b"], [2, 3], torch.randn(4, 5), key_dim=1)
    torch.save(kt, tmp_path / "kt.pt")
    back = torch.load(tmp_path / "kt.pt", weights_only=True)
    assert isinstance(back, KeyedTensor)
    assert (back.keys(), back.length_per_key(), back.key_dim()) == (["a", "b"], [2, 3], 1)
    torch.testing.assert_close(back.values(), kt.values(), rtol=0, atol=0)
