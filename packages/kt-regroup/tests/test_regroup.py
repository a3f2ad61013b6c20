"""Every CPU backend against the slice + cat reference, forward and backward (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kt_regroup import KeyedTensor, KTRegroupAsDict, _torch_impl, available_backends, regroup, regroup_as_dict
from kt_regroup.testing import clone_kts, make_kts, reference, run_backward

CPU_BACKENDS = available_backends("cpu")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# (rtol, atol): repeats are summed in another order (and, for fp16/bf16, with fewer roundings) than
# autograd sums the reference's repeats, so low precision allows a few ulps for up to 8 repeats.
TOLERANCE = {
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


@st.composite
def layouts(draw: st.DrawFn, max_inputs: int = 3) -> tuple[list[list[str]], list[list[int]], list[list[str]]]:
    """Random inputs (keys and lengths per KeyedTensor) and groups with repeats, skips and empty groups."""
    n_inputs = draw(st.integers(1, max_inputs))
    dims = st.sampled_from([0, 1, 2, 3, 4, 8]) if draw(st.booleans()) else st.sampled_from([0, 4, 8, 12])
    keys: list[list[str]] = []
    lengths: list[list[int]] = []
    counter = 0
    for _ in range(n_inputs):
        n_keys = draw(st.integers(0, 5))
        keys.append([f"k{counter + i}" for i in range(n_keys)])
        lengths.append([draw(dims) for _ in range(n_keys)])
        counter += n_keys
    all_keys = [k for kt_keys in keys for k in kt_keys]
    if all_keys:
        groups = draw(st.lists(st.lists(st.sampled_from(all_keys), max_size=7), max_size=4))
    else:
        groups = draw(st.lists(st.just([]), max_size=2))
    return keys, lengths, [list(g) for g in groups]


def check_against_reference(
    kts: list[KeyedTensor], groups: list[list[str]], outputs: list[torch.Tensor], ref_kts: list[KeyedTensor]
) -> None:
    """Forward bitwise equal to the reference; gradients close, skipped keys exactly 0."""
    expected = reference(ref_kts, groups)
    assert len(outputs) == len(expected)
    for out, exp in zip(outputs, expected, strict=True):
        assert out.shape == exp.shape
        assert out.dtype == exp.dtype
        assert torch.equal(out.detach(), exp.detach())
    run_backward(outputs)
    run_backward(expected)
    used = {k for g in groups for k in g}
    for kt, ref_kt in zip(kts, ref_kts, strict=True):
        grad = kt.values().grad
        ref_grad = ref_kt.values().grad
        if grad is None:  # no group at all: nothing to differentiate
            assert not groups
            continue
        if ref_grad is None:  # the reference never read this input
            ref_grad = torch.zeros_like(kt.values())
        rtol, atol = TOLERANCE[grad.dtype]
        torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=atol)
        blocks = torch.split(grad, kt.length_per_key(), dim=kt.key_dim())
        for key, block in zip(kt.keys(), blocks, strict=True):
            if key not in used:
                assert torch.equal(block, torch.zeros_like(block)), key


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=CPU_BACKENDS)
@settings(max_examples=30, deadline=None)
@given(
    layout=layouts(),
    batch=st.integers(0, 4),
    dtype=st.sampled_from(DTYPES),
    key_dim=st.sampled_from([0, 1]),
)
def test_regroup_matches_slice_cat_reference(
    backend: str,
    layout: tuple[list[list[str]], list[list[int]], list[list[str]]],
    batch: int,
    dtype: torch.dtype,
    key_dim: int,
) -> None:
    """regroup equals slice+cat forward (bitwise) and backward, with repeats, skips and empty groups."""
    keys, lengths, groups = layout
    kts = make_kts(keys, lengths, batch, dtype, key_dim)
    ref_kts = clone_kts(kts)
    outputs = regroup(kts, groups, backend=backend)
    check_against_reference(kts, groups, outputs, ref_kts)


@settings(max_examples=30, deadline=None)
@given(
    layout=layouts(),
    batch=st.integers(0, 4),
    dtype=st.sampled_from(DTYPES),
    key_dim=st.sampled_from([0, 1]),
)
def test_torch_index_path_matches_reference(
    layout: tuple[list[list[str]], list[list[int]], list[list[str]]],
    batch: int,
    dtype: torch.dtype,
    key_dim: int,
) -> None:
    """The torch backend's index path (CUDA's; CPU uses split + cat) also equals the reference."""
    keys, lengths, groups = layout
    kts = make_kts(keys, lengths, batch, dtype, key_dim)
    ref_kts = clone_kts(kts)
    saved = set(_torch_impl.CAT_DEVICES)
    _torch_impl.CAT_DEVICES.clear()
    try:
        outputs = regroup(kts, groups, backend="torch")
        check_against_reference(kts, groups, outputs, ref_kts)
    finally:
        _torch_impl.CAT_DEVICES.update(saved)


@pytest.mark.parametrize("backend", ["auto", *CPU_BACKENDS], ids=["auto", *CPU_BACKENDS])
@settings(max_examples=15, deadline=None)
@given(layout=layouts(), dtype=st.sampled_from(DTYPES))
def test_module_matches_reference(
    backend: str, layout: tuple[list[list[str]], list[list[int]], list[list[str]]], dtype: torch.dtype
) -> None:
    """KTRegroupAsDict gives the reference's tensors under the given names, twice (cached plan)."""
    keys, lengths, groups = layout
    names = [f"g{i}" for i in range(len(groups))]
    module = KTRegroupAsDict(groups, names, backend=backend)
    for seed in (0, 1):
        kts = make_kts(keys, lengths, 3, dtype, 1, seed=seed)
        ref_kts = clone_kts(kts)
        result = module(kts)
        assert list(result) == names
        check_against_reference(kts, groups, list(result.values()), ref_kts)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_backward_is_bitwise_deterministic(backend: str, dtype: torch.dtype) -> None:
    """Two backwards over the same inputs give the same bits (keys repeated up to 4 times)."""
    keys = [[f"a{i}" for i in range(6)], [f"b{i}" for i in range(5)]]
    lengths = [[8, 16, 8, 24, 8, 8], [16, 8, 8, 8, 32]]
    groups = [["a0", "b1", "a0", "a3"], ["b4", "a0", "a3", "b0"], ["a0", "b4", "a5"]]
    grads = []
    for _ in range(2):
        kts = make_kts(keys, lengths, 33, dtype, 1)
        run_backward(regroup(kts, groups, backend=backend))
        grads.append([kt.values().grad for kt in kts])
    for first, second in zip(grads[0], grads[1], strict=True):
        assert first is not None
        assert second is not None
        assert torch.equal(first, second)


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=CPU_BACKENDS)
def test_skipped_keys_get_exactly_zero_gradient(backend: str) -> None:
    """Keys in no group get 0, not fbgemm's uninitialised memory, also for wide inputs."""
    keys = [[f"k{i}" for i in range(64)]]
    lengths = [[32] * 64]
    groups = [[f"k{i}" for i in range(0, 64, 3)]]
    for _ in range(3):
        kts = make_kts(keys, lengths, 256, torch.float32, 1)
        run_backward(regroup(kts, groups, backend=backend))
        grad = kts[0].values().grad
        assert grad is not None
        for i, block in enumerate(torch.split(grad, 32, dim=1)):
            if i % 3:
                assert torch.equal(block, torch.zeros_like(block))
            else:
                assert block.abs().sum() > 0


def test_no_groups_and_empty_groups() -> None:
    """No groups gives []; an empty group gives [B, 0] ([0, B] for key_dim 0)."""
    kt = KeyedTensor(["a"], [2], torch.randn(3, 2))
    assert regroup([kt], []) == []
    (empty,) = regroup([kt], [[]])
    assert empty.shape == (3, 0)
    kt0 = KeyedTensor(["a"], [2], torch.randn(2, 3), key_dim=0)
    assert regroup([kt0], [[]])[0].shape == (0, 3)
    assert KTRegroupAsDict([], [])([kt]) == {}


class _TorchrecLike:
    """A foreign KeyedTensor-like (torchrec's KeyedTensor has these four methods)."""

    def __init__(self, keys: list[str], lengths: list[int], values: torch.Tensor) -> None:
        self._k, self._l, self._v = keys, lengths, values

    def keys(self) -> list[str]:
        return self._k

    def length_per_key(self) -> list[int]:
        return self._l

    def values(self) -> torch.Tensor:
        return self._v

    def key_dim(self) -> int:
        return 1


def test_accepts_any_keyed_tensor_like() -> None:
    """Objects with keys/length_per_key/values/key_dim work like KeyedTensor."""
    values = torch.arange(12.0).view(2, 6)
    foreign = _TorchrecLike(["x", "y"], [4, 2], values)
    (out,) = regroup([foreign], [["y", "x"]])
    torch.testing.assert_close(out, torch.cat([values[:, 4:], values[:, :4]], dim=1))
    result = KTRegroupAsDict([["y"]], ["only_y"])([foreign])
    torch.testing.assert_close(result["only_y"], values[:, 4:])


def test_regroup_as_dict_names_the_groups() -> None:
    """regroup_as_dict maps each name to its group's tensor."""
    kt = KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(2, 3))
    result = regroup_as_dict([kt], [["b"], ["a", "b"]], ["first", "second"])
    assert list(result) == ["first", "second"]
    torch.testing.assert_close(result["second"], kt.values())


def test_module_caches_one_plan_per_layout() -> None:
    """The plan is built once per layout, kept as non-persistent buffers, and dropped by clear_cache."""
    module = KTRegroupAsDict([["a", "c"], ["b"]], ["x", "y"])
    kts = [KeyedTensor(["a", "b"], [2, 2], torch.randn(3, 4)), KeyedTensor(["c"], [2], torch.randn(3, 2))]
    module(kts)
    first = {name for name, _ in module.named_buffers()}
    assert first
    module(kts)
    assert {name for name, _ in module.named_buffers()} == first
    assert module.state_dict() == {}
    other = [KeyedTensor(["c", "a", "b"], [2, 2, 2], torch.randn(3, 6))]
    result = module(other)
    torch.testing.assert_close(result["x"], torch.cat([other[0]["a"], other[0]["c"]], dim=1))
    assert len({name for name, _ in module.named_buffers()}) > len(first)
    module.clear_cache()
    assert list(module.named_buffers()) == []
    torch.testing.assert_close(module(kts)["y"], kts[0]["b"])


def test_gradcheck_and_double_backward() -> None:
    """The op's backward (and the backward's backward) match finite differences in fp64."""
    keys, lengths = [["a", "b", "c"]], [[2, 3, 1]]
    groups = [["c", "a", "c"], ["b"], []]

    def fn(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kt = KeyedTensor(keys[0], lengths[0], values)
        return tuple(regroup([kt], groups, backend="torch"))

    values = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (values,))
    assert torch.autograd.gradgradcheck(fn, (values,))


def test_module_to_keeps_working_and_matches_the_op() -> None:
    """After .to() the module uses its moved buffers; eager path and custom op give the same tensors."""
    from kt_regroup._ops import permute

    module = KTRegroupAsDict([["b", "a", "b"], ["c"]], ["x", "y"])
    kts = make_kts([["a", "b", "c"]], [[2, 4, 2]], 5, torch.float32, 1)
    first = module(kts)
    module.to("cpu")
    again = module(kts)
    (cached,) = module._plans.values()
    plan = cached.plan
    via_op = permute(
        [kts[0].values()],
        [getattr(module, name) for name in cached.buffers],
        list(plan.meta),
        list(plan.in_lengths),
        list(plan.out_lengths),
        plan.key_dim,
        plan.backend,
    )
    for name, op_out in zip(["x", "y"], via_op, strict=True):
        assert torch.equal(first[name], again[name])
        assert torch.equal(first[name], op_out)


def test_functional_plan_cache_keys_on_the_layout_not_the_batch_size() -> None:
    """40 batch sizes of one layout share one cached plan (and each result is right)."""
    from kt_regroup import _regroup

    _regroup._PLAN_CACHE.clear()
    groups = [["b", "a"], ["a"]]
    for batch in range(1, 41):
        kt = KeyedTensor(["a", "b"], [2, 3], torch.randn(batch, 5))
        first, second = regroup([kt], groups, backend="torch")
        torch.testing.assert_close(first, torch.cat([kt["b"], kt["a"]], dim=1), rtol=0, atol=0)
        torch.testing.assert_close(second, kt["a"], rtol=0, atol=0)
    assert len(_regroup._PLAN_CACHE) == 1


def test_nothing_to_differentiate_skips_the_autograd_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under no_grad, or with inputs that need no grad, the kernel runs without an autograd.Function node."""
    from kt_regroup import _ops

    def refuse(*args: object) -> object:
        raise AssertionError("autograd.Function used with nothing to differentiate")

    groups = [["b", "a"], ["a"]]
    module = KTRegroupAsDict(groups, ["x", "y"], backend="torch")
    kts = make_kts([["a", "b"]], [[2, 3]], 4, torch.float32, 1)
    expected = reference(clone_kts(kts), groups)
    monkeypatch.setattr(_ops._EagerPermute, "apply", refuse)
    with torch.no_grad():
        out = module(kts)
    plain = [KeyedTensor(kt.keys(), kt.length_per_key(), kt.values().detach()) for kt in kts]
    for got in (out, module(plain)):
        assert got["x"].grad_fn is None
        torch.testing.assert_close(got["x"], expected[0].detach())
        torch.testing.assert_close(got["y"], expected[1].detach())
    with pytest.raises(AssertionError, match="nothing to differentiate"):
        module(kts)  # inputs that require grad still go through the Function
