"""GroupedVBELookup: grouped output == one kernel holding every table == plain EmbeddingBag reference."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures, VBEOutput, _fbgemm
from vbe_lookup.testing import ReferenceOptimizer, random_features, reference_pooled

HAS_FBGEMM = _fbgemm.fbgemm_available()
LR = 0.05


@dataclass
class Case:
    """One random problem: features, their split over kernels, and the training setup."""

    keys: list[str]
    rows: list[int]
    dims: list[int]
    stride: list[list[int]]
    input_order: list[int]
    kernel_of_feature: list[int]
    kinds: list[str]
    pooling: str
    optimizer: str
    weighted: bool
    merge: str
    seed: int


@st.composite
def cases(draw: Any) -> Case:
    n_features = draw(st.integers(1, 6))
    n_ranks = draw(st.integers(1, 3))
    n_kernels = draw(st.integers(1, min(4, n_features)))
    pooling = draw(st.sampled_from(["sum", "mean"]))
    weighted = draw(st.booleans())
    kinds_allowed = ["torch"]
    # fbgemm's weighted-mean backward omits the 1/L factor (see docs); compare it elsewhere.
    if HAS_FBGEMM and not (weighted and pooling == "mean"):
        kinds_allowed.append("fbgemm")
    kernel_of_feature = list(range(n_kernels)) + [
        draw(st.integers(0, n_kernels - 1)) for _ in range(n_features - n_kernels)
    ]
    return Case(
        keys=[f"f{i}" for i in range(n_features)],
        rows=[draw(st.integers(1, 12)) for _ in range(n_features)],
        dims=[draw(st.sampled_from([4, 8, 12])) for _ in range(n_features)],
        stride=[[draw(st.integers(0, 3)) for _ in range(n_ranks)] for _ in range(n_features)],
        input_order=draw(st.permutations(list(range(n_features)))),
        kernel_of_feature=draw(st.permutations(kernel_of_feature)),
        kinds=[draw(st.sampled_from(kinds_allowed)) for _ in range(n_kernels)],
        pooling=pooling,
        optimizer=draw(st.sampled_from(["sgd", "rowwise_adagrad"])),
        weighted=weighted,
        merge=draw(st.sampled_from(["preallocated", "legacy"])),
        seed=draw(st.integers(0, 2**16)),
    )


def make_kernel(kind: str, rows: list[int], dims: list[int], pooling: str, optimizer: str) -> Any:
    """A kernel of `kind` with one table per feature."""
    if kind == "fbgemm":
        return _fbgemm.new_tbe(rows, dims, pooling=pooling, optimizer=optimizer, learning_rate=LR)
    return TorchEmbeddingKernel(
        rows,
        dims,
        pooling=pooling,  # type: ignore[arg-type]  # drawn from the Literal's values
        optimizer=optimizer,  # type: ignore[arg-type]
        learning_rate=LR,
    )


def build(case: Case) -> tuple[GroupedVBELookup, GroupedVBELookup, dict[str, torch.Tensor], list[str]]:
    """(grouped lookup, one-kernel lookup, reference tables, output key order), same initial weights."""
    gen = torch.Generator().manual_seed(case.seed)
    init = {
        k: torch.rand(r, d, generator=gen) * 2 - 1
        for k, r, d in zip(case.keys, case.rows, case.dims, strict=True)
    }
    rng = random.Random(case.seed)
    groups = []
    for g in range(len(case.kinds)):
        feats = [i for i in range(len(case.keys)) if case.kernel_of_feature[i] == g]
        rng.shuffle(feats)
        kernel = make_kernel(
            case.kinds[g],
            [case.rows[i] for i in feats],
            [case.dims[i] for i in feats],
            case.pooling,
            case.optimizer,
        )
        with torch.no_grad():
            for w, i in zip(kernel.split_embedding_weights(), feats, strict=True):
                w.copy_(init[case.keys[i]])
        groups.append(KernelGroup(kernel, [case.keys[i] for i in feats], [case.dims[i] for i in feats]))
    grouped = GroupedVBELookup(groups, merge=case.merge)  # type: ignore[arg-type]
    order = [k for g in groups for k in g.features]
    index = {k: i for i, k in enumerate(case.keys)}
    single_kernel = TorchEmbeddingKernel(
        [case.rows[index[k]] for k in order],
        [case.dims[index[k]] for k in order],
        pooling=case.pooling,  # type: ignore[arg-type]
        optimizer=case.optimizer,  # type: ignore[arg-type]
        learning_rate=LR,
    )
    with torch.no_grad():
        for w, k in zip(single_kernel.split_embedding_weights(), order, strict=True):
            w.copy_(init[k])
    single = GroupedVBELookup([KernelGroup(single_kernel, order, [case.dims[index[k]] for k in order])])
    tables = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    return grouped, single, tables, order


def kernel_tables(lookup: GroupedVBELookup) -> dict[str, torch.Tensor]:
    """Current table of every feature, read back through split_embedding_weights()."""
    out = {}
    for group in lookup.groups:
        for name, w in zip(group.features, group.kernel.split_embedding_weights(), strict=True):  # type: ignore[attr-defined]
            out[name] = w.detach().clone()
    return out


def input_features(case: Case, step: int) -> VBEFeatures:
    """The step's random input, keys in the case's input order."""
    keys = [case.keys[i] for i in case.input_order]
    return random_features(
        keys,
        [case.rows[i] for i in case.input_order],
        [case.stride[i] for i in case.input_order],
        weighted=case.weighted,
        generator=torch.Generator().manual_seed(case.seed * 7 + step),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_grouped_equals_single_kernel_and_reference(case: Case) -> None:
    """Forward output and weights after two fused-optimizer steps agree for grouped, single and reference."""
    grouped, single, tables, order = build(case)
    ref_opt = ReferenceOptimizer(list(tables.values()), case.optimizer, LR)
    for step in range(2):
        features = input_features(case, step)
        out = grouped(features)
        out_single = single(features)
        ref = reference_pooled(tables, features, pooling=case.pooling, order=order)
        assert out.keys() == order
        torch.testing.assert_close(out.values(), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_single.values(), ref, atol=1e-5, rtol=1e-5)
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(step))
        if ref.numel():
            torch.autograd.backward(ref, grad)
            ref_opt.step()
        if out.values().requires_grad:
            torch.autograd.backward(out.values(), grad)
        if out_single.values().requires_grad:
            torch.autograd.backward(out_single.values(), grad)
        want = {k: v.detach() for k, v in tables.items()}
        for name, w in kernel_tables(grouped).items():
            torch.testing.assert_close(w, want[name], atol=1e-5, rtol=1e-5, msg=f"grouped table {name}")
        for name, w in kernel_tables(single).items():
            torch.testing.assert_close(w, want[name], atol=1e-5, rtol=1e-5, msg=f"single table {name}")


def _two_kernel_lookup(
    merge: str = "preallocated",
    *,
    pooling: str = "sum",
    weights_dtype: torch.dtype = torch.float32,
    output_dtype: torch.dtype | None = None,
    second: str = "torch",
) -> tuple[GroupedVBELookup, dict[str, torch.Tensor]]:
    """Kernel 0 serves a (dim 4) and b (dim 8); kernel 1 serves c (dim 4)."""
    torch.manual_seed(0)
    k0 = TorchEmbeddingKernel([10, 20], [4, 8], pooling=pooling, weights_dtype=weights_dtype)  # type: ignore[arg-type]
    if second == "fbgemm":
        k1: Any = _fbgemm.new_tbe([30], [4], pooling=pooling)
    else:
        k1 = TorchEmbeddingKernel([30], [4], pooling=pooling, weights_dtype=weights_dtype)  # type: ignore[arg-type]
    lookup = GroupedVBELookup(
        [KernelGroup(k0, ["a", "b"], [4, 8]), KernelGroup(k1, ["c"], [4])],
        merge=merge,  # type: ignore[arg-type]
        output_dtype=output_dtype,
    )
    tables = dict(
        zip(["a", "b", "c"], k0.split_embedding_weights() + k1.split_embedding_weights(), strict=True)
    )
    return lookup, tables


MERGES = pytest.mark.parametrize("merge", ["preallocated", "legacy"], ids=["preallocated", "legacy"])


@MERGES
@pytest.mark.parametrize(
    "stride",
    [
        [[2, 0, 3], [1, 0, 2], [3, 0, 1]],  # rank 1 sends nothing
        [[0, 0], [0, 0], [0, 0]],  # every rank empty
        [[2, 1], [1, 3], [0, 0]],  # kernel 1 has no bag on any rank
        [[0, 2], [0, 0], [1, 0]],
    ],
    ids=["empty-rank", "all-empty", "kernel-without-bags", "sparse"],
)
def test_empty_ranks_and_kernels(merge: str, stride: list[list[int]]) -> None:
    """Empty ranks, all-empty input and a kernel with no bags give the reference (and never crash)."""
    lookup, tables = _two_kernel_lookup(merge)
    features = random_features(
        ["a", "b", "c"], [10, 20, 30], stride, generator=torch.Generator().manual_seed(1)
    )
    out = lookup(features)
    torch.testing.assert_close(out.values(), reference_pooled(tables, features))
    assert out.size_per_rank() == [
        sum(t.numel() for t in out.values_per_rank()[r : r + 1]) for r in range(len(stride[0]))
    ]
    if out.values().requires_grad:
        torch.autograd.backward(out.values().sum())


@MERGES
def test_feature_without_ids(merge: str) -> None:
    """A feature whose bags are all empty pools to zeros."""
    lookup, tables = _two_kernel_lookup(merge)
    features = VBEFeatures(
        ["a", "b", "c"],
        torch.tensor([1, 2, 3]),
        torch.tensor([0, 0, 2, 1, 0, 0, 0]),
        [[1, 1], [1, 1], [2, 1]],
    )
    out = lookup(features)
    ref = reference_pooled(tables, features)
    torch.testing.assert_close(out.values(), ref)
    assert out.values()[:4].abs().sum() == 0  # feature a, rank 0


@MERGES
@pytest.mark.parametrize("pooling", ["sum", "mean"], ids=["sum", "mean"])
def test_weighted_features(merge: str, pooling: str) -> None:
    """Per-id weights multiply rows (weighted mean divides by the bag length)."""
    lookup, tables = _two_kernel_lookup(merge, pooling=pooling)
    features = random_features(
        ["a", "b", "c"],
        [10, 20, 30],
        [[2, 1], [1, 3], [2, 2]],
        weighted=True,
        generator=torch.Generator().manual_seed(2),
    )
    torch.testing.assert_close(lookup(features).values(), reference_pooled(tables, features, pooling=pooling))


@MERGES
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_output_dtype_is_carried(merge: str, dtype: torch.dtype) -> None:
    """Kernels in fp16/bf16 give an fp16/bf16 output (bf16 stays bf16)."""
    lookup, tables = _two_kernel_lookup(merge, weights_dtype=dtype)
    assert lookup.output_dtype == dtype
    features = random_features(["a", "b", "c"], [10, 20, 30], [[2, 1], [1, 3], [2, 2]])
    out = lookup(features)
    assert out.values().dtype == dtype
    torch.testing.assert_close(out.values(), reference_pooled(tables, features))


@MERGES
def test_explicit_output_dtype(merge: str) -> None:
    """`output_dtype` overrides the kernels' dtype; kernels of another dtype are placed with a cast."""
    lookup, tables = _two_kernel_lookup(merge, output_dtype=torch.bfloat16)
    features = random_features(["a", "b", "c"], [10, 20, 30], [[2, 1], [1, 3], [2, 2]])
    out = lookup(features)
    assert out.values().dtype == torch.bfloat16
    torch.testing.assert_close(out.values(), reference_pooled(tables, features).to(torch.bfloat16))
    torch.autograd.backward(out.values().float().sum())


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm unavailable")
@MERGES
def test_fbgemm_on_cpu_is_placed_with_one_copy(merge: str) -> None:
    """An fbgemm TBE on CPU (no `vbe_output` there) is emulated and gives the reference, fwd and bwd."""
    lookup, tables = _two_kernel_lookup(merge, second="fbgemm")
    features = random_features(["a", "b", "c"], [10, 20, 30], [[2, 1, 0], [1, 3, 2], [2, 2, 1]])
    ref_tables = {k: v.detach().clone().requires_grad_(True) for k, v in tables.items()}
    out = lookup(features)
    ref = reference_pooled(ref_tables, features)
    torch.testing.assert_close(out.values(), ref)
    grad = torch.randn(ref.shape)
    torch.autograd.backward(out.values(), grad)
    torch.autograd.backward(ref, grad)
    ReferenceOptimizer(list(ref_tables.values()), "sgd", 0.01).step()
    for name, w in tables.items():
        torch.testing.assert_close(w, ref_tables[name].detach(), msg=name)


def test_output_metadata() -> None:
    """`VBEOutput` reports the [R, F] offsets, dims, batch sizes and per-rank split sizes."""
    lookup, _ = _two_kernel_lookup()
    stride = [[2, 1], [1, 3], [2, 0]]
    out = lookup(random_features(["a", "b", "c"], [10, 20, 30], stride))
    assert isinstance(out, VBEOutput)
    assert out.keys() == ["a", "b", "c"]
    assert out.dims() == [4, 8, 4]
    assert out.batch_size_per_feature_per_rank() == stride
    # rank 0: a 2*4, b 1*8, c 2*4 ; rank 1: a 1*4, b 3*8, c 0
    assert out.offsets_list() == [[0, 8, 16], [24, 28, 52]]
    assert out.offsets().tolist() == out.offsets_list()
    assert out.size_per_rank() == [24, 28]
    assert [t.numel() for t in out.values_per_rank()] == [24, 28]


def test_input_key_order_may_differ_from_groups() -> None:
    """Input keys in any order (and non-contiguous per group) give the same output."""
    lookup, tables = _two_kernel_lookup()
    base = random_features(["a", "b", "c"], [10, 20, 30], [[2, 1], [1, 3], [2, 2]], weighted=True)
    shuffled_keys = ["c", "a", "b"]
    parts = {}
    offsets = base.offsets()
    bag = 0
    for key, row in zip(base.keys(), base.stride_per_key_per_rank(), strict=True):
        n = sum(row)
        s, e = int(offsets[bag]), int(offsets[bag + n])
        weights = base.weights_or_none()
        assert weights is not None
        parts[key] = (base.values()[s:e], base.lengths()[bag : bag + n], weights[s:e], row)
        bag += n
    shuffled = VBEFeatures(
        shuffled_keys,
        torch.cat([parts[k][0] for k in shuffled_keys]),
        torch.cat([parts[k][1] for k in shuffled_keys]),
        [parts[k][3] for k in shuffled_keys],
        torch.cat([parts[k][2] for k in shuffled_keys]),
    )
    torch.testing.assert_close(lookup(shuffled).values(), lookup(base).values())
    torch.testing.assert_close(lookup(shuffled).values(), reference_pooled(tables, base))


def test_layout_is_computed_once() -> None:
    """Repeated batch-size layouts reuse the cached device offsets (no rebuild per step)."""
    lookup, _ = _two_kernel_lookup()
    stride = [[2, 1], [1, 3], [2, 2]]
    first = lookup(random_features(["a", "b", "c"], [10, 20, 30], stride))
    second = lookup(random_features(["a", "b", "c"], [10, 20, 30], stride))
    assert first.offsets() is second.offsets()
    assert len(lookup._layouts) == 1
    lookup(random_features(["a", "b", "c"], [10, 20, 30], [[1, 1], [1, 1], [1, 1]]))
    assert len(lookup._layouts) == 2


def test_single_kernel_never_merges() -> None:
    """With one kernel the output is the kernel's own output (no merge, no copy)."""
    kernel = TorchEmbeddingKernel([10, 20], [4, 8])
    lookup = GroupedVBELookup([KernelGroup(kernel, ["a", "b"], [4, 8])], merge="legacy")
    features = random_features(["a", "b"], [10, 20], [[0, 0], [0, 0]])
    assert lookup(features).values().numel() == 0
    features = random_features(["a", "b"], [10, 20], [[2, 0], [1, 1]])
    out = lookup(features)
    direct = kernel(features.values(), features.offsets(), batch_size_per_feature_per_rank=[[2, 0], [1, 1]])
    torch.testing.assert_close(out.values(), direct)


def test_gradients_reach_every_kernel_once() -> None:
    """One backward through the pre-allocated output updates each kernel exactly once (SGD: w - lr*g)."""
    lookup, tables = _two_kernel_lookup()
    before = {k: v.detach().clone() for k, v in tables.items()}
    features = VBEFeatures(["a", "b", "c"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]), [[1], [1], [1]])
    out = lookup(features)
    torch.autograd.backward(out.values(), torch.ones_like(out.values()))
    lr = 0.01
    torch.testing.assert_close(tables["a"][1], before["a"][1] - lr)
    torch.testing.assert_close(tables["b"][2], before["b"][2] - lr)
    torch.testing.assert_close(tables["c"][3], before["c"][3] - lr)
    torch.testing.assert_close(tables["a"][0], before["a"][0])


@pytest.mark.skipif(not HAS_FBGEMM, reason="fbgemm unavailable")
def test_fbgemm_vbe_metadata_is_cached_per_layout() -> None:
    """A wrapped TBE called through its module builds its VBE metadata once per layout and still computes the
    same output."""
    lookup, tables = _two_kernel_lookup(second="fbgemm")
    lookup = GroupedVBELookup(lookup.groups, fbgemm_call="module")
    tbe = lookup.groups[1].kernel
    stride = [[2, 1], [1, 3], [2, 2]]
    for seed in range(3):
        features = random_features(
            ["a", "b", "c"], [10, 20, 30], stride, generator=torch.Generator().manual_seed(seed)
        )
        torch.testing.assert_close(lookup(features).values(), reference_pooled(tables, features))
    assert len(getattr(tbe, "_vbe_lookup_metadata_cache", ())) == 1
    uncached = GroupedVBELookup(lookup.groups, cache_fbgemm_metadata=False, fbgemm_call="module")
    torch.testing.assert_close(uncached(features).values(), reference_pooled(tables, features))


def test_keep_layout_outlives_the_layout_cache() -> None:
    """keep_layout returns the cached layout state; a held handle survives its eviction (the lookup rebuilds)."""
    lookup, _ = _two_kernel_lookup("preallocated")
    keys = ["a", "b", "c"]

    def features(batch: int) -> VBEFeatures:
        return VBEFeatures(
            keys, torch.zeros(0, dtype=torch.int64), torch.zeros(3 * batch, dtype=torch.int64), [[batch]] * 3
        )

    handle = lookup.keep_layout(features(1))
    assert lookup.keep_layout(features(1)) is handle
    lookup(features(1))
    assert lookup.keep_layout(features(1)) is handle  # the forward used the same cached state
    for batch in range(2, 70):  # more layouts than the cache holds: batch 1's is dropped
        lookup.keep_layout(features(batch))
    rebuilt = lookup.keep_layout(features(1))
    assert rebuilt is not handle
    assert type(rebuilt) is type(handle)
