"""BackwardOverlap: dense backward first, then each embedding module's backward; gradients as plain autograd."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipeline_stages import BackwardOverlap, InvalidStageError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.EmbeddingBag(20, 4, mode="sum")
        self.item = nn.EmbeddingBag(30, 3, mode="mean")
        self.dense = nn.Linear(4 + 3 + 2, 1)

    def tower(self, dense: torch.Tensor, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.dense(torch.cat([dense, user, item], dim=1)).pow(2).sum()
        return out


def inputs(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, 2, generator=generator)
    user = torch.randint(0, 20, (batch, 3), generator=generator)
    item = torch.randint(0, 30, (batch, 2), generator=generator)
    return dense, user, item


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 9), seed=st.integers(0, 1000))
def test_gradients_equal_plain_backward(batch: int, seed: int) -> None:
    """Every parameter gets the gradient plain loss.backward() gives (dense and both embedding modules)."""
    torch.manual_seed(seed)
    reference = Net()
    net = copy.deepcopy(reference)
    dense, user, item = inputs(batch, seed)

    loss = reference.tower(dense, reference.user(user), reference.item(item))
    loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated

    overlap = BackwardOverlap(cuda=False)
    pooled_user = overlap.run("user", net.user, user)
    pooled_item = overlap.run("item", net.item, item)
    assert pooled_user.is_leaf
    assert pooled_user.requires_grad
    overlap.backward(net.tower(dense, pooled_user, pooled_item))
    for (name, expected), (_, got) in zip(reference.named_parameters(), net.named_parameters(), strict=True):
        assert got.grad is not None, name
        assert expected.grad is not None, name
        torch.testing.assert_close(got.grad, expected.grad, msg=name)


def test_dense_backward_runs_before_embedding_backward() -> None:
    """The embedding module's backward starts only after the dense backward finished."""
    order: list[str] = []

    class Tap(torch.autograd.Function):
        @staticmethod
        def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, tag: str) -> torch.Tensor:
            ctx.tag = tag  # type: ignore[attr-defined]  # ctx carries arbitrary attributes
            return x.clone()

        @staticmethod
        def backward(
            ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
        ) -> tuple[torch.Tensor, None]:
            order.append(ctx.tag)  # type: ignore[attr-defined]  # set in forward
            return grad, None

    emb = nn.EmbeddingBag(10, 2)
    bottom = nn.Linear(2, 2)
    overlap = BackwardOverlap(cuda=False)
    tap = Tap.apply  # untyped in torch: one place to say so
    pooled = overlap.run("emb", lambda ids: tap(emb(ids), "embedding"), torch.tensor([[1, 2]]))  # type: ignore[no-untyped-call]  # Function.apply
    dense_in = tap(bottom(torch.ones(1, 2)), "dense-bottom")  # type: ignore[no-untyped-call]  # Function.apply
    loss = tap(pooled + dense_in, "dense-top").sum()  # type: ignore[no-untyped-call]  # Function.apply
    overlap.backward(loss)
    assert order == ["dense-top", "dense-bottom", "embedding"]


@dataclass(frozen=True)
class Pooled:
    values: torch.Tensor
    keys: tuple[str, ...]


def test_structured_outputs_are_cut() -> None:
    """Tuples, dicts and dataclasses of tensors are cut tensor by tensor; non-grad tensors pass through."""
    emb = nn.EmbeddingBag(10, 2, mode="sum")
    overlap = BackwardOverlap(cuda=False)
    ids = torch.tensor([[1, 2], [3, 4]])
    out = overlap.run(
        "m", lambda x: {"a": emb(x), "b": (emb(x), x), "c": Pooled(values=emb(x), keys=("f",))}, ids
    )
    assert out["a"].is_leaf
    assert out["a"].requires_grad
    assert out["b"][0].is_leaf
    assert out["b"][1] is ids
    assert isinstance(out["c"], Pooled)
    assert out["c"].values.is_leaf
    assert out["c"].keys == ("f",)
    loss = out["a"].sum() + out["b"][0].sum() * 2 + out["c"].values.sum() * 3
    overlap.backward(loss)
    assert emb.weight.grad is not None
    expected = torch.zeros(10, 2)
    expected[[1, 2, 3, 4]] = 6.0
    torch.testing.assert_close(emb.weight.grad, expected)


def test_unknown_output_type_with_grad_tensors_is_rejected() -> None:
    """An opaque object holding grad tensors cannot be cut automatically: clear error."""

    class Opaque:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    emb = nn.EmbeddingBag(10, 2)
    with pytest.raises(InvalidStageError, match=r"BackwardOverlap\.cut"):
        BackwardOverlap(cuda=False).run("m", lambda x: Opaque(emb(x)), torch.tensor([[1]]))


def test_clear_forgets_cuts() -> None:
    """clear() drops pending cuts: backward then runs the dense part only."""
    emb = nn.EmbeddingBag(10, 2)
    overlap = BackwardOverlap(cuda=False)
    pooled = overlap.run("m", emb, torch.tensor([[1]]))
    overlap.clear()
    overlap.backward(pooled.sum())
    assert emb.weight.grad is None
    assert overlap.streams == {}


class DictKeyedTensor:
    """torchrec's KeyedTensor shape: attributes in ``__dict__``, constructor keys/length_per_key/values/key_dim."""

    def __init__(
        self, keys: list[str], length_per_key: list[int], values: torch.Tensor, key_dim: int = 1
    ) -> None:
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim

    def keys(self) -> list[str]:
        return self._keys

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim


class SlotsKeyedTensor:
    """kt-regroup's KeyedTensor shape: ``__slots__``, no ``__dict__``."""

    __slots__ = ("_key_dim", "_keys", "_length_per_key", "_values")

    def __init__(
        self, keys: list[str], length_per_key: list[int], values: torch.Tensor, key_dim: int = 1
    ) -> None:
        self._keys = keys
        self._length_per_key = length_per_key
        self._values = values
        self._key_dim = key_dim

    def keys(self) -> list[str]:
        return self._keys

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim


@pytest.mark.parametrize(
    "kind", [DictKeyedTensor, SlotsKeyedTensor], ids=["torchrec-like", "kt-regroup-like"]
)
@pytest.mark.parametrize("key_dim", [1, 0], ids=["key-dim-1", "key-dim-0"])
def test_keyed_tensor_outputs_are_cut_and_rebuilt(
    kind: type[DictKeyedTensor | SlotsKeyedTensor], key_dim: int
) -> None:
    """A KeyedTensor-like output is cut at values() and rebuilt as its own type; gradients as plain autograd."""
    torch.manual_seed(0)
    emb = nn.EmbeddingBag(20, 3, mode="sum")
    reference = copy.deepcopy(emb)
    ids = torch.randint(0, 20, (4, 2))

    def module(x: torch.Tensor, table: nn.EmbeddingBag) -> DictKeyedTensor | SlotsKeyedTensor:
        pooled = torch.cat([table(x), table(x) * 2], dim=1)
        return kind(["a", "b"], [3, 3], pooled if key_dim == 1 else pooled.t(), key_dim)

    want = module(ids, reference).values()
    (want.pow(2).sum()).backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated
    overlap = BackwardOverlap(cuda=False)
    out = overlap.run("ebc", module, ids, emb)
    assert type(out) is kind
    assert hasattr(out, "__dict__") == (kind is DictKeyedTensor)
    assert (out.keys(), out.length_per_key(), out.key_dim()) == (["a", "b"], [3, 3], key_dim)
    assert out.values().is_leaf
    assert out.values().requires_grad
    assert all(p.grad is None for p in emb.parameters())  # the embedding backward waits for backward()
    overlap.backward(out.values().pow(2).sum())
    assert emb.weight.grad is not None
    assert reference.weight.grad is not None
    torch.testing.assert_close(emb.weight.grad, reference.weight.grad)


def test_opaque_slotted_output_with_grad_tensors_is_rejected() -> None:
    """An object with __slots__ holding grad tensors (no KeyedTensor methods) is an error, not passed through."""

    class Opaque:
        __slots__ = ("t",)

        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    emb = nn.EmbeddingBag(10, 2)
    with pytest.raises(InvalidStageError, match=r"BackwardOverlap\.cut"):
        BackwardOverlap(cuda=False).run("m", lambda x: Opaque(emb(x)), torch.tensor([[1]]))


def test_keyed_tensor_that_cannot_be_rebuilt_names_the_constructor() -> None:
    """A KeyedTensor-like type whose constructor differs is a clear error naming the expected constructor."""

    class Positional(DictKeyedTensor):
        def __init__(self, *parts: object) -> None:
            super().__init__(*parts)  # type: ignore[arg-type]  # positional on purpose

    emb = nn.EmbeddingBag(10, 2)
    overlap = BackwardOverlap(cuda=False)
    with pytest.raises(InvalidStageError, match=r"Positional\(keys=, length_per_key=, values=\)"):
        overlap.run("m", lambda x: Positional(["a"], [2], emb(x)), torch.tensor([[1]]))
    overlap.backward(torch.ones(1, requires_grad=True).sum())  # the failed cut left nothing behind
    assert emb.weight.grad is None
