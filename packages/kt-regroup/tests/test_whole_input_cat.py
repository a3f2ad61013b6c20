"""Groups that concatenate whole inputs in order run as one ``torch.cat`` (``backend="auto"``).

Compared with the reference and with the permute kernels (``backend="torch"``): values and gradients
equal, over random layouts of whole-input runs; any other layout keeps the permute path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kt_regroup import KTRegroupAsDict
from kt_regroup._plan import whole_input_runs
from kt_regroup.testing import clone_kts, make_kts, reference, run_backward


def _concat_of(module: KTRegroupAsDict) -> list[tuple[tuple[int, ...], ...] | None]:
    return [cached.concat for cached in module._plans.values()]


@st.composite
def _whole_input_layouts(draw: st.DrawFn) -> tuple[list[list[str]], list[list[int]], list[list[str]], int]:
    """Inputs of unique keys, groups that are runs of whole inputs (each input in at least one)."""
    num_inputs = draw(st.integers(1, 5))
    keys: list[list[str]] = []
    lengths: list[list[int]] = []
    for i in range(num_inputs):
        n = draw(st.integers(1, 4))
        keys.append([f"k{i}_{j}" for j in range(n)])
        lengths.append([draw(st.integers(1, 5)) for _ in range(n)])
    runs = draw(
        st.lists(st.lists(st.integers(0, num_inputs - 1), min_size=1, max_size=4), min_size=1, max_size=3)
    )
    runs.append(list(range(num_inputs)))  # every input in some group
    groups = [[k for i in run for k in keys[i]] for run in runs]
    key_dim = draw(st.sampled_from([0, 1]))
    return keys, lengths, groups, key_dim


@settings(max_examples=40, deadline=None)
@given(layout=_whole_input_layouts(), batch=st.integers(1, 7), seed=st.integers(0, 1000))
def test_whole_input_groups_match_reference_and_permute(
    layout: tuple[list[list[str]], list[list[int]], list[list[str]], int], batch: int, seed: int
) -> None:
    keys, lengths, groups, key_dim = layout
    names = [f"g{i}" for i in range(len(groups))]
    fast = KTRegroupAsDict(groups, names)
    permute = KTRegroupAsDict(groups, names, backend="torch")
    kts = make_kts(keys, lengths, batch, torch.float64, key_dim, seed=seed)
    twin, ref_in = clone_kts(kts), clone_kts(kts)
    got, other = fast(kts), permute(twin)
    assert _concat_of(fast) != [None]  # the cat path ran
    assert _concat_of(permute) == [None]  # an explicit backend keeps its kernels
    expected = reference(ref_in, groups)
    for name, exp in zip(names, expected, strict=True):
        torch.testing.assert_close(got[name], exp, rtol=0, atol=0)
        torch.testing.assert_close(other[name], exp, rtol=0, atol=0)
    run_backward([got[n] for n in names], seed=seed)
    run_backward([other[n] for n in names], seed=seed)
    run_backward(expected, seed=seed)
    for a, b, c in zip(kts, twin, ref_in, strict=True):
        torch.testing.assert_close(a.values().grad, c.values().grad)
        torch.testing.assert_close(b.values().grad, c.values().grad)


@pytest.mark.parametrize(
    ("keys", "groups"),
    [
        ([["a", "b"], ["c"]], [["a", "c"]]),  # part of an input
        ([["a", "b"], ["c"]], [["b", "a", "c"]]),  # an input's keys reordered
        ([["a", "b"], ["c"]], [["a", "b"]]),  # input 1 in no group: it must get a zero gradient
        ([["a", "b"], ["a"]], [["a", "b", "a"]]),  # a key name in two inputs
        ([["a", "b"], ["c"]], [["a", "b", "x"]]),  # unknown key (the planner reports it)
        ([["a", "b"], ["c"]], [[]]),  # an empty group
    ],
)
def test_other_layouts_are_not_whole_input_runs(keys: list[list[str]], groups: list[list[str]]) -> None:
    assert whole_input_runs(keys, groups) is None


def test_whole_input_runs_found() -> None:
    assert whole_input_runs([["d"], ["a", "b"], ["c"]], [["d", "a", "b", "c"], ["c", "d"]]) == (
        (0, 1, 2),
        (2, 0),
    )


def test_dlrm_interaction_group_is_one_cat_and_compiles() -> None:
    """The DLRM's group (dense, then every pooled feature in order) is a cat, eager and fullgraph-compiled."""
    keys = [["dense"], [f"f{i}" for i in range(6)]]
    lengths = [[8], [8] * 6]
    module = KTRegroupAsDict([["dense", *keys[1]]], ["inter"])
    kts = make_kts(keys, lengths, 5, torch.float32, 1)
    eager = module(kts)["inter"]
    assert _concat_of(module) == [((0, 1),)]
    compiled = torch.compile(lambda k: module(k), fullgraph=True, backend="aot_eager")(clone_kts(kts))[
        "inter"
    ]
    torch.testing.assert_close(eager, torch.cat([kt.values() for kt in kts], dim=1), rtol=0, atol=0)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
