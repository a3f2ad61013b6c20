"""TorchEmbeddingKernel: TBE semantics against a plain EmbeddingBag reference and against fbgemm's TBE."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vbe_lookup import EmbeddingKernel, TorchEmbeddingKernel, VBEFeatures, _fbgemm
from vbe_lookup.errors import BatchLayoutError, VBELookupError
from vbe_lookup.testing import ReferenceOptimizer, random_features, reference_pooled

HAS_FBGEMM = _fbgemm.fbgemm_available()


def test_fits_the_embedding_kernel_protocol() -> None:
    """TorchEmbeddingKernel is an EmbeddingKernel (static and runtime check)."""
    kernel: EmbeddingKernel = TorchEmbeddingKernel([10], [4])
    assert isinstance(kernel, EmbeddingKernel)


@st.composite
def kernel_cases(draw: Any) -> dict[str, Any]:
    n_tables = draw(st.integers(1, 3))
    n_features = draw(st.integers(1, 4))
    n_ranks = draw(st.integers(1, 3))
    return {
        "rows": [draw(st.integers(1, 10)) for _ in range(n_tables)],
        "dims": [draw(st.sampled_from([1, 3, 4])) for _ in range(n_tables)],
        "ftm": [draw(st.integers(0, n_tables - 1)) for _ in range(n_features)],
        "stride": [[draw(st.integers(0, 3)) for _ in range(n_ranks)] for _ in range(n_features)],
        "pooling": draw(st.sampled_from(["sum", "mean"])),
        "optimizer": draw(st.sampled_from(["sgd", "rowwise_adagrad", None])),
        "weighted": draw(st.booleans()),
        "vbe": draw(st.booleans()),
        "index_dtype": draw(st.sampled_from([torch.int32, torch.int64])),
        "seed": draw(st.integers(0, 1000)),
    }


@settings(max_examples=20, deadline=None)
@given(case=kernel_cases())
@example(  # non-VBE rows of sum(dims) = 5 elements: the placement granule must divide the row stride
    case={
        "rows": [1, 1, 1],
        "dims": [4, 1, 1],
        "ftm": [0, 1],
        "stride": [[0], [0]],
        "pooling": "sum",
        "optimizer": "sgd",
        "weighted": False,
        "vbe": False,
        "index_dtype": torch.int32,
        "seed": 0,
    }
)
def test_matches_reference_forward_backward(case: dict[str, Any]) -> None:
    """Output, per-sample-weight gradients and tables after two steps equal the EmbeddingBag reference."""
    rows, dims, ftm = case["rows"], case["dims"], case["ftm"]
    stride = case["stride"] if case["vbe"] else [[2]] * len(ftm)
    lr = 0.1
    kernel = TorchEmbeddingKernel(
        rows,
        dims,
        feature_table_map=ftm,
        pooling=case["pooling"],
        optimizer=case["optimizer"],
        learning_rate=lr,
    )
    ref_tables = [w.detach().clone().requires_grad_(True) for w in kernel.split_embedding_weights()]
    ref_opt = ReferenceOptimizer(ref_tables, case["optimizer"] or "sgd", lr)
    dense_opt = torch.optim.SGD(kernel.parameters(), lr=lr) if case["optimizer"] is None else None
    keys = [f"f{i}" for i in range(len(ftm))]
    for step in range(2):
        features = random_features(
            keys,
            [rows[t] for t in ftm],
            stride,
            weighted=case["weighted"],
            generator=torch.Generator().manual_seed(case["seed"] + step),
            index_dtype=case["index_dtype"],
        )
        weights = features.weights_or_none()
        psw = None if weights is None else weights.clone().requires_grad_(True)
        psw_ref = None if weights is None else weights.clone().requires_grad_(True)
        out = kernel(
            features.values(),
            features.offsets(),
            per_sample_weights=psw,
            batch_size_per_feature_per_rank=stride if case["vbe"] else None,
        )
        ref_features = VBEFeatures(keys, features.values(), features.lengths(), stride, psw_ref)
        ref = reference_pooled(
            {k: ref_tables[t] for k, t in zip(keys, ftm, strict=True)}, ref_features, pooling=case["pooling"]
        )
        if not case["vbe"]:
            # Non-VBE output is [B, sum(dims)]: sample-major, features side by side.
            blocks = torch.split(ref, [2 * dims[t] for t in ftm])
            ref = torch.cat([b.view(2, -1) for b in blocks], dim=1)
            assert out.shape == (2, sum(dims[t] for t in ftm))
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(step))
        torch.autograd.backward(out, grad)
        torch.autograd.backward(ref, grad)
        if psw is not None and psw_ref is not None:
            torch.testing.assert_close(psw.grad, psw_ref.grad, atol=1e-5, rtol=1e-5)
        ref_opt.step()
        if dense_opt is not None:
            dense_opt.step()
            dense_opt.zero_grad()
        for w, want in zip(kernel.split_embedding_weights(), ref_tables, strict=True):
            torch.testing.assert_close(w, want.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm unavailable")
@settings(max_examples=20, deadline=None)
@given(
    pooling=st.sampled_from(["sum", "mean"]),
    optimizer=st.sampled_from(["sgd", "rowwise_adagrad"]),
    weighted=st.booleans(),
    stride=st.lists(st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=1, max_size=4),
    seed=st.integers(0, 1000),
)
def test_matches_fbgemm_tbe(
    pooling: str, optimizer: str, weighted: bool, stride: list[list[int]], seed: int
) -> None:
    """Same forward and same tables after two fused steps as fbgemm's SplitTableBatchedEmbeddingBagsCodegen.

    Weighted mean is compared forward only: fbgemm's weighted-mean backward drops the 1/L factor.
    """
    rows = [5 + 3 * i for i in range(len(stride))]
    dims = [4 * (1 + i % 2) for i in range(len(stride))]
    ours = TorchEmbeddingKernel(rows, dims, pooling=pooling, optimizer=optimizer, learning_rate=0.1)  # type: ignore[arg-type]
    theirs = _fbgemm.new_tbe(rows, dims, pooling=pooling, optimizer=optimizer, learning_rate=0.1)
    with torch.no_grad():
        for a, b in zip(theirs.split_embedding_weights(), ours.split_embedding_weights(), strict=True):
            a.copy_(b)
    keys = [f"f{i}" for i in range(len(stride))]
    for step in range(2):
        features = random_features(
            keys, rows, stride, weighted=weighted, generator=torch.Generator().manual_seed(seed + step)
        )
        kwargs = {"per_sample_weights": features.weights_or_none(), "batch_size_per_feature_per_rank": stride}
        out = ours(features.values(), features.offsets(), **kwargs)
        want = theirs(features.values(), features.offsets(), **kwargs)
        torch.testing.assert_close(out, want.reshape(-1), atol=1e-5, rtol=1e-5)
        if weighted and pooling == "mean":
            continue
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
        torch.autograd.backward(out, grad)
        torch.autograd.backward(want, grad.view(want.shape))
        for a, b in zip(ours.split_embedding_weights(), theirs.split_embedding_weights(), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_vbe_output_chains_two_kernels() -> None:
    """Two kernels writing one buffer at [R, F] offsets: the returned tensor chains, one backward updates both."""
    torch.manual_seed(0)
    k1, k2 = TorchEmbeddingKernel([10, 10], [4, 8]), TorchEmbeddingKernel([10], [4])
    f1 = random_features(["a", "b"], [10, 10], [[1, 2], [2, 1]])
    f2 = random_features(["c"], [10], [[2, 2]])
    # rank 0: a 1*4, b 2*8, c 2*4; rank 1: a 2*4, b 1*8, c 2*4
    vo1 = torch.tensor([[0, 4], [28, 36]])
    vo2 = torch.tensor([[20], [44]])
    tables = {
        k: w.detach().clone().requires_grad_(True)
        for k, w in zip("abc", [*k1.split_embedding_weights(), *k2.split_embedding_weights()], strict=True)
    }
    buffer = torch.empty(52)
    o1 = k1(
        f1.values(),
        f1.offsets(),
        batch_size_per_feature_per_rank=[[1, 2], [2, 1]],
        vbe_output=buffer,
        vbe_output_offsets=vo1,
    )
    o2 = k2(
        f2.values(),
        f2.offsets(),
        batch_size_per_feature_per_rank=[[2, 2]],
        vbe_output=o1,
        vbe_output_offsets=vo2,
    )
    assert o1.data_ptr() == o2.data_ptr() == buffer.data_ptr()
    r1 = reference_pooled({"a": tables["a"], "b": tables["b"]}, f1)
    r2 = reference_pooled({"c": tables["c"]}, f2)
    ref = torch.cat([r1[:20], r2[:8], r1[20:], r2[8:]])
    torch.testing.assert_close(o2, ref)
    grad = torch.randn(52)
    torch.autograd.backward(o2, grad)
    torch.autograd.backward(ref, grad)
    ReferenceOptimizer(list(tables.values()), "sgd", 0.01).step()
    for w, k in zip([*k1.split_embedding_weights(), *k2.split_embedding_weights()], "abc", strict=True):
        torch.testing.assert_close(w, tables[k].detach(), msg=k)


def test_split_embedding_weights_are_writable_views() -> None:
    """Writing a returned table changes what the kernel looks up; optimizer states come per table."""
    kernel = TorchEmbeddingKernel([3, 4, 5], [2, 4, 2], optimizer="rowwise_adagrad")
    tables = kernel.split_embedding_weights()
    assert [tuple(t.shape) for t in tables] == [(3, 2), (4, 4), (5, 2)]
    with torch.no_grad():
        tables[2].fill_(1.5)
    out = kernel(torch.tensor([4]), torch.tensor([0, 0, 0, 1]))
    assert out[0, -2:].tolist() == [1.5, 1.5]
    assert [tuple(s.shape) for s in kernel.split_optimizer_states()] == [(3,), (4,), (5,)]


def test_empty_batch_and_no_grad() -> None:
    """Zero bags give an empty output; inference under no_grad leaves tables untouched."""
    kernel = TorchEmbeddingKernel([3], [4])
    out = kernel(
        torch.zeros(0, dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
        batch_size_per_feature_per_rank=[[0, 0]],
    )
    assert out.shape == (0,)
    before = kernel.split_embedding_weights()[0].clone()
    with torch.no_grad():
        y = kernel(torch.tensor([1]), torch.tensor([0, 1]))
    assert y.shape == (1, 4)
    torch.testing.assert_close(kernel.split_embedding_weights()[0], before)
    torch.testing.assert_close(y[0], F.embedding(torch.tensor(1), before))


REAL_EMBEDDING_BAG = F.embedding_bag


@settings(max_examples=10, deadline=None)
@given(
    n_dims=st.integers(2, 8),
    optimizer=st.sampled_from(["sgd", "rowwise_adagrad", None]),
    pooling=st.sampled_from(["sum", "mean"]),
    vbe=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_mixed_dims_one_pass_matches_masked_path(
    n_dims: int, optimizer: Any, pooling: Any, vbe: bool, seed: int
) -> None:
    """With up to 8 distinct dims, each dim's pooling reads only its own ids (the ids are walked once in
    all), and output, weight gradients and updated tables equal the every-id masked path."""
    from vbe_lookup import _torch_kernel

    dims = [2 * (i + 1) for i in range(n_dims)]
    rows = [5 + i for i in range(n_dims)]
    ftm = [i % n_dims for i in range(n_dims + 2)]
    stride = [[1 + (f + r) % 3 for r in range(2)] for f in range(len(ftm))] if vbe else [[3]] * len(ftm)
    keys = [f"f{i}" for i in range(len(ftm))]
    kernels = [
        TorchEmbeddingKernel(rows, dims, feature_table_map=ftm, pooling=pooling, optimizer=optimizer)
        for _ in range(2)
    ]
    kernels[1].load_state_dict(kernels[0].state_dict())
    features = random_features(
        keys, [rows[t] for t in ftm], stride, weighted=True, generator=torch.Generator().manual_seed(seed)
    )
    weights = features.weights_or_none()
    assert weights is not None
    real_plan = _torch_kernel._Plan
    outs, grads = [], []
    for masked, kernel in zip((False, True), kernels, strict=True):

        def plan(*args: Any, masked: bool = masked) -> Any:
            p = real_plan(*args)
            if masked:
                p.group_ids = None  # the old path: every dim group pools every id
            return p

        read: list[int] = []

        def counting_bag(
            input: torch.Tensor, *args: Any, read: list[int] = read, **kwargs: Any
        ) -> torch.Tensor:
            read.append(input.numel())
            return REAL_EMBEDDING_BAG(input, *args, **kwargs)

        psw = weights.clone().requires_grad_(True)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_torch_kernel, "_Plan", plan)
            mp.setattr(F, "embedding_bag", counting_bag)
            out = kernel(
                features.values(),
                features.offsets(),
                per_sample_weights=psw,
                batch_size_per_feature_per_rank=stride if vbe else None,
            )
            forward_reads = sum(read)
            torch.autograd.backward(out, torch.linspace(-1, 1, out.numel()).view(out.shape))
        expected_reads = features.values().numel() * (n_dims if masked else 1)
        assert forward_reads == expected_reads, (masked, read)
        outs.append(out.detach())
        grads.append(psw.grad)
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)
    if optimizer is None:
        for p0, p1 in zip(kernels[0].parameters(), kernels[1].parameters(), strict=True):
            torch.testing.assert_close(p0.grad, p1.grad, atol=1e-5, rtol=1e-5)
    for w0, w1 in zip(
        kernels[0].split_embedding_weights(), kernels[1].split_embedding_weights(), strict=True
    ):
        torch.testing.assert_close(w0, w1, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([1, 2, 3, 4, 4], r"`offsets` must start at 0, got offsets\[0\] = 1"),
        ([0, 3, 2, 4, 4], r"`offsets` must never decrease, got offsets\[1\] = 3 > offsets\[2\] = 2"),
        ([0, 1, 2, 3, 5], r"`offsets` must end at len\(`indices`\) = 4, got offsets\[-1\] = 5"),
        ([0, 1, 2, 3, 3], r"`offsets` must end at len\(`indices`\) = 4, got offsets\[-1\] = 3"),
    ],
    ids=["not-from-0", "decreasing", "past-the-ids", "short-of-the-ids"],
)
def test_direct_call_rejects_bad_offsets(offsets: list[int], match: str) -> None:
    """Offsets that do not start at 0, decrease or miss the ids' end raise BatchLayoutError naming `offsets`."""
    kernel = TorchEmbeddingKernel([10, 10], [4, 4])
    with pytest.raises(BatchLayoutError, match=match) as info:
        kernel(torch.tensor([1, 2, 3, 4]), torch.tensor(offsets))
    assert isinstance(info.value, VBELookupError)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "sync-free"])
def test_row_gradients_sum_per_row(compact: bool) -> None:
    """Both per-row reductions (compact on CPU, padded sync-free on CUDA) sum weighted bag gradients per row."""
    from vbe_lookup._torch_kernel import _row_gradients

    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 6, (40,), generator=gen)
    rows[:3] = 0  # row 0 is real here and also the padding row of the sync-free variant
    bags = torch.randint(0, 7, (40,), generator=gen)
    grad_bags = torch.randn(7, 3, generator=gen)
    weight = torch.rand(40, generator=gen)
    seg_row, seg_grad = _row_gradients(rows, bags, grad_bags, weight, compact=compact)
    got = torch.zeros(6, 3).index_add_(0, seg_row, seg_grad)
    want = torch.zeros(6, 3).index_add_(0, rows, grad_bags[bags] * weight[:, None])
    torch.testing.assert_close(got, want)
    if compact:
        assert seg_row.tolist() == sorted(set(rows.tolist()))
    else:
        assert seg_row.numel() == 40


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"], ids=["sgd", "rowwise_adagrad"])
def test_sync_free_update_path_matches_reference(monkeypatch: pytest.MonkeyPatch, optimizer: Any) -> None:
    """The CUDA (padded, sync-free) per-row reduction gives the reference tables, run here on CPU."""
    import functools

    from vbe_lookup import _torch_kernel

    monkeypatch.setattr(
        _torch_kernel, "_row_gradients", functools.partial(_torch_kernel._row_gradients, compact=False)
    )
    kernel = TorchEmbeddingKernel([6, 9], [4, 8], optimizer=optimizer, learning_rate=0.1)
    tables = [w.detach().clone().requires_grad_(True) for w in kernel.split_embedding_weights()]
    features = random_features(["a", "b"], [6, 9], [[3, 2], [4, 0]], weighted=True, max_length=6)
    out = kernel(
        features.values(),
        features.offsets(),
        per_sample_weights=features.weights_or_none(),
        batch_size_per_feature_per_rank=[[3, 2], [4, 0]],
    )
    ref = reference_pooled(dict(zip(["a", "b"], tables, strict=True)), features)
    grad = torch.randn(ref.shape)
    torch.autograd.backward(out, grad)
    torch.autograd.backward(ref, grad)
    ReferenceOptimizer(tables, optimizer, 0.1).step()
    for w, want in zip(kernel.split_embedding_weights(), tables, strict=True):
        torch.testing.assert_close(w, want.detach())
