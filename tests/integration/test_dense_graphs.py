"""The DLRM's dense part: padded, weighted loss equals the plain mean loss; CUDA graph replays equal eager."""

from __future__ import annotations

import pytest
import torch

from examples.dlrm.dense_graphs import bucket_sizes, pad_rows
from examples.dlrm.model import MLP, DLRMHead

F_SPARSE = 5
DIM = 8


def _head(seed: int = 3) -> DLRMHead:
    return DLRMHead(num_embeddings=F_SPARSE + 1, embedding_dim=DIM, top_layers=[16, 8], seed=seed)


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    ("low", "high", "step", "expected"),
    [(4096, 8192, 1024, [4096, 5120, 6144, 7168, 8192]), (1, 10, 4, [4, 8, 12]), (0, 3, 8, [8])],
    ids=["gpu-config", "ragged-top", "zero-low"],
)
def test_bucket_sizes_cover_the_range(low: int, high: int, step: int, expected: list[int]) -> None:
    """Buckets are multiples of the granularity from the smallest batch up to the first one >= the largest."""
    assert bucket_sizes(low, high, step) == expected


def test_bucket_sizes_reject_bad_arguments() -> None:
    """A zero granularity or an empty range is an error naming it."""
    with pytest.raises(ValueError, match="`granularity`"):
        bucket_sizes(1, 8, 0)
    with pytest.raises(ValueError, match="batch range"):
        bucket_sizes(9, 8, 4)


def test_padded_weighted_loss_equals_the_mean_loss_and_its_gradients() -> None:
    """Padding rows with weight 0 gives the unpadded mean BCE and the same parameter and input gradients."""
    gen = torch.Generator().manual_seed(0)
    rows, padded = 37, 48
    head_a, head_b = _head(), _head()
    grouped = torch.randn(rows, (F_SPARSE + 1) * DIM, generator=gen)
    labels = torch.randint(0, 2, (rows,), generator=gen).float()

    x_a = grouped.clone().requires_grad_(True)
    loss_a = torch.nn.functional.binary_cross_entropy_with_logits(head_a.logits(x_a), labels)
    loss_a.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch

    x_b = grouped.clone().requires_grad_(True)
    weight = (torch.arange(padded) < rows).float() / rows
    loss_b = head_b(pad_rows(x_b, padded), pad_rows(labels, padded), weight)
    loss_b.backward()

    torch.testing.assert_close(loss_b, loss_a)
    assert x_a.grad is not None
    assert x_b.grad is not None
    torch.testing.assert_close(x_b.grad, x_a.grad)
    for g_b, g_a in zip(_grads(head_b), _grads(head_a), strict=True):
        torch.testing.assert_close(g_b, g_a)


@pytest.mark.gpu
def test_graph_replays_equal_eager_over_several_batch_sizes() -> None:
    """Graphed bottom + head (padded to their buckets) give the eager loss and gradients, step after step."""
    from examples.dlrm.dense_graphs import DenseGraphs

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    eager_bottom = MLP(13, [16, DIM], final_relu=True, seed=5).to(device)
    eager_head = _head().to(device)
    graph_bottom = MLP(13, [16, DIM], final_relu=True, seed=5).to(device)
    graph_head = _head().to(device)
    graphs = DenseGraphs(
        bottom=graph_bottom,
        head=graph_head,
        num_dense=13,
        grouped_width=(F_SPARSE + 1) * DIM,
        buckets=bucket_sizes(20, 64, 16),
        device=device,
    )
    assert all(p.grad is None for p in [*graph_bottom.parameters(), *graph_head.parameters()])
    for rows in (20, 64, 33, 48, 21):
        dense_in = torch.randn(rows, 13, generator=gen).to(device)
        sparse = torch.randn(rows, F_SPARSE * DIM, generator=gen).to(device)
        labels = torch.randint(0, 2, (rows,), generator=gen).float().to(device)
        for module in (eager_bottom, eager_head, graph_bottom, graph_head):
            module.zero_grad(set_to_none=True)

        dense = eager_bottom(dense_in)
        eager_loss = torch.nn.functional.binary_cross_entropy_with_logits(
            eager_head.logits(torch.cat([dense, sparse], dim=1)), labels
        )
        eager_loss.backward()  # type: ignore[no-untyped-call]  # Tensor.backward is unannotated in torch

        padded = graphs.bucket(rows)
        dense_g = graphs.bottom(pad_rows(dense_in, padded))[:rows]
        grouped = pad_rows(torch.cat([dense_g, sparse], dim=1), padded)
        weight = (torch.arange(padded, device=device) < rows).float() / rows
        graph_loss = graphs.head(grouped, pad_rows(labels, padded), weight)
        graph_loss.backward()  # type: ignore[no-untyped-call]  # as above

        torch.testing.assert_close(graph_loss, eager_loss, rtol=1e-5, atol=1e-6)
        for g_graph, g_eager in zip(
            _grads(graph_bottom) + _grads(graph_head), _grads(eager_bottom) + _grads(eager_head), strict=True
        ):
            torch.testing.assert_close(g_graph, g_eager, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="exceeds the largest captured size"):
        graphs.bucket(65)
