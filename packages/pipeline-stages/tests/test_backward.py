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
