"""CUDA: every backend against the reference, bitwise determinism, Triton == torch bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kt_regroup import KeyedTensor, KTRegroupAsDict, available_backends, regroup
from kt_regroup.testing import clone_kts, make_kts, reference, run_backward

pytestmark = pytest.mark.gpu

CUDA_BACKENDS = ["torch", "triton", "fbgemm"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# (rtol, atol): repeats are summed in another order (and, for fp16/bf16, with fewer roundings) than
# autograd sums the reference's repeats, so low precision allows a few ulps for up to 8 repeats.
TOLERANCE = {
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def _need(backend: str) -> None:
    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} not available on this CUDA machine")


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[list[str]], list[list[int]], list[list[str]]]:
    n_inputs = draw(st.integers(1, 3))
    dims = (
        st.sampled_from([0, 1, 3, 4, 8, 64, 130])
        if draw(st.booleans())
        else st.sampled_from([16, 64, 128, 256])
    )
    keys: list[list[str]] = []
    lengths: list[list[int]] = []
    counter = 0
    for _ in range(n_inputs):
        n_keys = draw(st.integers(0, 6))
        keys.append([f"k{counter + i}" for i in range(n_keys)])
        lengths.append([draw(dims) for _ in range(n_keys)])
        counter += n_keys
    all_keys = [k for kt_keys in keys for k in kt_keys]
    groups = draw(st.lists(st.lists(st.sampled_from(all_keys), max_size=8), max_size=4)) if all_keys else []
    return keys, lengths, [list(g) for g in groups]


@pytest.mark.parametrize("backend", CUDA_BACKENDS, ids=CUDA_BACKENDS)
@pytest.mark.parametrize("key_dim", [0, 1])
def test_cuda_empty_batch(backend: str, key_dim: int) -> None:
    """Batch 0 gives ``[0, width]`` outputs and ``[0, width]`` gradients (fbgemm's kernel rejects an empty grid)."""
    _need(backend)
    kts = make_kts([["a", "b"]], [[16, 8]], 0, torch.float32, key_dim, device="cuda")
    outputs = regroup(kts, [["b", "a"], ["a"]], backend=backend)
    widths = [24, 16]
    assert [tuple(o.shape) for o in outputs] == [(0, w) if key_dim == 1 else (w, 0) for w in widths]
    run_backward(outputs)
    grad = kts[0].values().grad
    assert grad is None or grad.numel() == 0


# Groups with nothing to write (fbgemm's kernel plan has no rows, or only rows of width 0) next to a normal one.
EMPTY_GROUPS = [[[]], [[], []], [["z"]], [["a"], []], [["z"], ["b", "z", "a"]]]


@pytest.mark.parametrize("backend", CUDA_BACKENDS, ids=CUDA_BACKENDS)
@pytest.mark.parametrize(
    "groups", EMPTY_GROUPS, ids=["one-empty", "two-empty", "zero-width", "mixed", "zero-key"]
)
def test_cuda_empty_groups_and_no_output_columns(backend: str, groups: list[list[str]]) -> None:
    """Empty groups / groups of 0 columns give ``[B, 0]`` outputs and exact gradients (fbgemm: no empty grid)."""
    _need(backend)
    kts = make_kts([["a", "z", "b"]], [[16, 0, 8]], 5, torch.float32, 1, device="cuda")
    ref_kts = clone_kts(kts)
    outputs = regroup(kts, groups, backend=backend)
    expected = reference(ref_kts, groups)
    for out, exp in zip(outputs, expected, strict=True):
        assert out.shape == exp.shape
        assert torch.equal(out.detach(), exp.detach())
    run_backward(outputs)
    run_backward(expected)
    torch.cuda.synchronize()
    grad, ref_grad = kts[0].values().grad, ref_kts[0].values().grad
    assert grad is not None
    expected_grad = ref_grad if ref_grad is not None else torch.zeros_like(grad)
    assert torch.equal(grad, expected_grad)


@pytest.mark.parametrize("backend", CUDA_BACKENDS, ids=CUDA_BACKENDS)
@settings(max_examples=25, deadline=None)
@given(
    layout=_layouts(),
    batch=st.sampled_from([0, 1, 7, 33, 100]),
    dtype=st.sampled_from(DTYPES),
    key_dim=st.sampled_from([0, 1]),
)
def test_cuda_backend_matches_reference(
    backend: str,
    layout: tuple[list[list[str]], list[list[int]], list[list[str]]],
    batch: int,
    dtype: torch.dtype,
    key_dim: int,
) -> None:
    """Forward bitwise equal to slice+cat on CUDA; backward close; skipped keys exactly 0."""
    _need(backend)
    keys, lengths, groups = layout
    kts = make_kts(keys, lengths, batch, dtype, key_dim, device="cuda")
    ref_kts = clone_kts(kts)
    outputs = regroup(kts, groups, backend=backend)
    expected = reference(ref_kts, groups)
    for out, exp in zip(outputs, expected, strict=True):
        assert out.shape == exp.shape
        assert out.device.type == "cuda"
        assert torch.equal(out.detach(), exp.detach())
    run_backward(outputs)
    run_backward(expected)
    used = {k for g in groups for k in g}
    for kt, ref_kt in zip(kts, ref_kts, strict=True):
        grad, ref_grad = kt.values().grad, ref_kt.values().grad
        if grad is None or ref_grad is None:
            continue
        rtol, atol = TOLERANCE[dtype]
        torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol)
        for key, block in zip(kt.keys(), torch.split(grad, kt.length_per_key(), dim=key_dim), strict=True):
            if key not in used:
                assert torch.equal(block, torch.zeros_like(block)), key


def _seed_like(
    dtype: torch.dtype, batch: int = 512
) -> tuple[list[list[str]], list[list[int]], list[list[str]]]:
    keys = [[f"d{i}" for i in range(20)], [f"s{i}" for i in range(200)]]
    lengths = [[64] * 20, [128] * 200]
    groups = [
        [f"s{i}" for i in range(0, 200, 2)] + ["d0", "d1", "s3", "s3"],
        [f"d{i}" for i in range(20)] + ["s0", "s3", "d0"],
        ["s3", "s0"],
    ]
    return keys, lengths, groups


@pytest.mark.parametrize("backend", ["torch", "triton"], ids=["torch", "triton"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_cuda_backward_is_bitwise_deterministic(backend: str, dtype: torch.dtype) -> None:
    """Repeated keys (up to 5 occurrences): three backwards give the same bits."""
    _need(backend)
    keys, lengths, groups = _seed_like(dtype)
    grads = []
    for _ in range(3):
        kts = make_kts(keys, lengths, 512, dtype, 1, device="cuda")
        run_backward(regroup(kts, groups, backend=backend))
        grads.append([kt.values().grad for kt in kts])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            assert a is not None
            assert b is not None
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp64", "fp16", "bf16"])
def test_triton_and_torch_give_identical_bits(dtype: torch.dtype) -> None:
    """Both our CUDA backends sum repeats in group order with the same rounding: same bits."""
    _need("triton")
    keys, lengths, groups = _seed_like(dtype)
    results = []
    for backend in ("torch", "triton"):
        kts = make_kts(keys, lengths, 300, dtype, 1, device="cuda")
        outputs = regroup(kts, groups, backend=backend)
        run_backward(outputs)
        results.append(([o.detach() for o in outputs], [kt.values().grad for kt in kts]))
    (out_a, grad_a), (out_b, grad_b) = results
    for a, b in zip(out_a + grad_a, out_b + grad_b, strict=True):
        assert a is not None
        assert b is not None
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["auto", *CUDA_BACKENDS], ids=["auto", *CUDA_BACKENDS])
def test_cuda_module_and_compile(backend: str) -> None:
    """KTRegroupAsDict on CUDA matches the reference, eager and under torch.compile(fullgraph=True)."""
    if backend != "auto":
        _need(backend)
    keys, lengths, groups = _seed_like(torch.float32)
    names = ["a", "b", "c"]
    module = KTRegroupAsDict(groups, names, backend=backend).cuda()
    kts = make_kts(keys, lengths, 64, torch.float32, 1, device="cuda")
    expected = reference(clone_kts(kts), groups)
    eager = module(kts)
    # Inductor for the default path, aot_eager (faster to build) for the explicit backends.
    compiler = "inductor" if backend == "auto" else "aot_eager"
    compiled = torch.compile(lambda k: module(k), fullgraph=True, backend=compiler)(kts)
    for name, exp in zip(names, expected, strict=True):
        assert torch.equal(eager[name].detach(), exp.detach())
        assert torch.equal(compiled[name].detach(), exp.detach())


def test_auto_on_cuda_is_triton() -> None:
    """With Triton importable, auto runs the Triton kernels on CUDA."""
    _need("triton")
    from kt_regroup._backend import resolve_backend

    assert resolve_backend("auto", torch.device("cuda"), 1, torch.float32, 2, 2) == "triton"


@st.composite
def _triton_layouts(draw: st.DrawFn) -> tuple[list[list[str]], list[list[int]], list[list[str]]]:
    """Layouts the Triton backend serves (``key_dim == 1``, at most 8 inputs and 8 groups)."""
    keys, lengths, groups = draw(_layouts())
    return keys, lengths, groups[:8]


def _fast_launches() -> tuple[int, int]:
    from kt_regroup import _triton_impl

    return _triton_impl._FORWARD.fast_launches, _triton_impl._BACKWARD.fast_launches


def _triton_run(
    kts: list[KeyedTensor], groups: list[list[str]]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    fresh = clone_kts(kts)
    outputs = regroup(fresh, groups, backend="triton")
    run_backward(outputs)
    return [o.detach() for o in outputs], [kt.values().grad for kt in fresh]


@settings(max_examples=25, deadline=None)
@given(
    layout=_triton_layouts(),
    batch=st.sampled_from([1, 7, 32, 33, 100]),
    dtype=st.sampled_from(DTYPES),
)
def test_triton_fast_launch_matches_jit_launch(
    layout: tuple[list[list[str]], list[list[int]], list[list[str]]], batch: int, dtype: torch.dtype
) -> None:
    """Direct launches of the compiled Triton kernels give the JIT launch's bits, forward and backward."""
    _need("triton")
    from kt_regroup import _triton_impl

    keys, lengths, groups = layout
    kts = make_kts(keys, lengths, batch, dtype, 1, device="cuda")
    previous = _triton_impl.FAST_LAUNCH
    _triton_impl.FAST_LAUNCH = False
    try:
        by_jit = _triton_run(kts, groups)
        _triton_impl.FAST_LAUNCH = True
        _triton_run(kts, groups)  # a variant's first launch goes through the JIT (and is kept)
        before = _fast_launches()
        fast = _triton_run(kts, groups)
        after = _fast_launches()
    finally:
        _triton_impl.FAST_LAUNCH = previous
    widths = {
        k: n
        for kt_keys, kt_lengths in zip(keys, lengths, strict=True)
        for k, n in zip(kt_keys, kt_lengths, strict=True)
    }
    # An empty tensor may sit at any address (it holds no element), and a misaligned one takes the JIT's
    # launch, so the direct launches are only certain when every group has columns.
    if groups and all(any(widths[k] for k in group) for group in groups):
        assert after[0] == before[0] + 1, f"no direct forward launch: {_triton_impl._FORWARD.refused}"
        assert after[1] == before[1] + 1, f"no direct backward launch: {_triton_impl._BACKWARD.refused}"
    for a, b in zip(by_jit[0] + by_jit[1], fast[0] + fast[1], strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a, b)


def test_triton_misaligned_input_takes_the_jit_launch() -> None:
    """An input 4 bytes off a 16-byte boundary is launched by the JIT (its own specialization) and is right."""
    _need("triton")
    keys, lengths, groups = [["a", "b"]], [[16, 32]], [["b", "a", "b"]]
    aligned = make_kts(keys, lengths, 40, torch.float32, 1, device="cuda")
    _triton_run(aligned, groups)  # the aligned variant is compiled and kept
    storage = torch.randn(40 * 48 + 1, device="cuda")
    values = storage[1:].view(40, 48).detach().requires_grad_()
    assert values.is_contiguous()
    assert values.data_ptr() % 16
    shifted = [KeyedTensor(["a", "b"], [16, 32], values)]
    before = _fast_launches()
    outputs = regroup(shifted, groups, backend="triton")
    assert _fast_launches()[0] == before[0]
    expected = reference(clone_kts(shifted), groups)
    assert torch.equal(outputs[0].detach(), expected[0].detach())
