"""The DLRM's dense optimizer step: the graphed Adagrad step gives the eager step's bits, and falls back
where it cannot be graphed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from examples.dlrm.dense_step import DenseStep, update_and_reset
from examples.dlrm.train import dense_optimizer


def _mlp(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)


def _train(
    model: torch.nn.Module, step: DenseStep | None, optimizer: torch.optim.Adagrad, x: torch.Tensor
) -> None:
    if step is None:
        optimizer.zero_grad(set_to_none=True)
    else:
        step.zero_grad()
    model(x).square().mean().backward()
    if step is None:
        optimizer.step()
    else:
        step.step()


def _compare(
    a: torch.nn.Module, oa: torch.optim.Adagrad, b: torch.nn.Module, ob: torch.optim.Adagrad
) -> None:
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
        assert torch.equal(oa.state[pa]["sum"], ob.state[pb]["sum"])
        assert float(oa.state[pa]["step"]) == float(ob.state[pb]["step"])


def test_dense_step_on_cpu_is_the_eager_step() -> None:
    """On the CPU nothing is graphed and the step is the optimizer's own."""
    eager, stepped = _mlp("cpu"), _mlp("cpu")
    oe, os_ = (
        dense_optimizer(list(eager.parameters()), lr=0.1),
        dense_optimizer(list(stepped.parameters()), lr=0.1),
    )
    step = DenseStep(os_, graph=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        x = torch.randn(16, 13, generator=gen)
        _train(eager, None, oe, x)
        _train(stepped, step, os_, x)
        _compare(eager, oe, stepped, os_)
    assert not step.graphed


def test_graph_body_is_the_eager_adagrad_step_bit_for_bit() -> None:
    """What the graph records (run eagerly here, on the CPU), accumulating into its zeroed gradients, gives the
    bits of `torch.optim.Adagrad`'s own steps with fresh gradients."""
    eager, body = _mlp("cpu"), _mlp("cpu")
    oe, ob = (
        dense_optimizer(list(eager.parameters()), lr=0.1),
        dense_optimizer(list(body.parameters()), lr=0.1),
    )
    gen = torch.Generator().manual_seed(3)
    for i in range(8):
        x = torch.randn(16, 13, generator=gen)
        _train(eager, None, oe, x)
        if i < 2:  # eager warm-up: the optimizer's state exists
            _train(body, None, ob, x)
        else:
            if i == 2:  # as DenseStep.zero_grad before its first capture; the graph zeroes them after
                ob.zero_grad(set_to_none=True)
            body(x).square().mean().backward()
            with torch.no_grad():
                update_and_reset(ob)
            for p in body.parameters():
                ob.state[p]["step"] += 1
                assert p.grad is not None
                assert not p.grad.any()
        _compare(eager, oe, body, ob)


@pytest.mark.gpu
def test_graphed_dense_step_matches_the_eager_step_bit_for_bit() -> None:
    """On CUDA the graph replays (after the warm-up) give the eager Adagrad's rows, sums and step counts,
    also across a `load_state_dict` (the graph is captured again for the new state tensors)."""
    eager, stepped = _mlp("cuda"), _mlp("cuda")
    oe = dense_optimizer(list(eager.parameters()), lr=0.05)
    os_ = dense_optimizer(list(stepped.parameters()), lr=0.05)
    step = DenseStep(os_, graph=True, warmup=2)
    seen: list[int] = []
    handle = register_optimizer_step_post_hook(lambda o, a, k: seen.append(id(o)))
    gen = torch.Generator().manual_seed(2)
    for i in range(12):
        x = torch.randn(64, 13, generator=gen).cuda()
        _train(eager, None, oe, x)
        _train(stepped, step, os_, x)
        _compare(eager, oe, stepped, os_)
        assert step.graphed == (i >= 2)
        if i == 6:
            os_.load_state_dict(copy.deepcopy(oe.state_dict()))  # load_state_dict keeps the given tensors
    handle.remove()
    assert step.graphed
    assert seen.count(id(os_)) == 12  # every step, replays too, is seen by step hooks
