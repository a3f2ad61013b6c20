"""Backend choice: auto picks a correct path; KT_REGROUP_BACKEND forces one without a code change."""

from __future__ import annotations

import pytest
import torch

from kt_regroup import KeyedTensor, KTRegroupAsDict, UnknownBackendError, available_backends, regroup
from kt_regroup._backend import ENV_VAR, resolve_backend
from kt_regroup._fbgemm import fbgemm_available, fbgemm_status

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


def test_auto_on_cpu_is_torch() -> None:
    """On CPU auto picks the block-gather torch backend (faster than fbgemm's CPU loop here)."""
    assert resolve_backend("auto", CPU, 1, torch.float32, 2, 2) == "torch"


def test_available_backends_on_cpu() -> None:
    """torch is always available; fbgemm when it imports; never triton on CPU."""
    names = available_backends("cpu")
    assert "torch" in names
    assert "triton" not in names
    assert ("fbgemm" in names) == fbgemm_available()


def test_fbgemm_status_reports_a_reason() -> None:
    """The shim says why fbgemm is (not) used."""
    reason = fbgemm_status()
    assert reason
    assert ("with torch" in reason) == fbgemm_available()


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm-gpu not importable")
def test_layouts_fbgemm_cannot_serve_fall_back_to_torch() -> None:
    """fbgemm has no fp64 or key_dim=0 kernel: those calls are served by torch."""
    assert resolve_backend("fbgemm", CPU, 1, torch.float32, 1, 1) == "fbgemm"
    assert resolve_backend("fbgemm", CPU, 1, torch.float64, 1, 1) == "torch"
    assert resolve_backend("fbgemm", CPU, 0, torch.float32, 1, 1) == "torch"


def test_env_var_forces_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """KT_REGROUP_BACKEND overrides the backend argument."""
    monkeypatch.setenv(ENV_VAR, "torch")
    assert resolve_backend("fbgemm", CPU, 1, torch.float32, 1, 1) == "torch"
    assert resolve_backend("auto", CPU, 1, torch.float32, 1, 1) == "torch"


def test_env_var_forcing_an_unavailable_backend_warns_and_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forcing triton on CPU warns once and still regroups correctly."""
    monkeypatch.setenv(ENV_VAR, "triton")
    kt = KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(2, 3))
    with pytest.warns(RuntimeWarning, match=r"KT_REGROUP_BACKEND=triton cannot run on cpu"):
        assert resolve_backend("auto", CPU, 1, torch.float32, 1, 1) == "torch"
    (out,) = regroup([kt], [["b"]])
    torch.testing.assert_close(out, kt["b"])


def test_env_var_with_a_bad_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown name in the environment variable is an error naming the variable."""
    monkeypatch.setenv(ENV_VAR, "cuda")
    kt = KeyedTensor(["a"], [1], torch.zeros(2, 1))
    with pytest.raises(UnknownBackendError, match=r"environment variable `KT_REGROUP_BACKEND` is 'cuda'"):
        regroup([kt], [["a"]])


def test_module_reads_env_var_when_it_builds_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """KTRegroupAsDict picks the backend per plan; clear_cache() makes it look again."""
    kt = KeyedTensor(["a", "b"], [1, 2], torch.arange(6.0).view(2, 3))
    module = KTRegroupAsDict([["b", "a"]], ["g"], backend="auto")
    module([kt])
    (cached,) = module._plans.values()
    assert cached.plan.backend == 0
    if fbgemm_available():
        monkeypatch.setenv(ENV_VAR, "fbgemm")
        module.clear_cache()
        torch.testing.assert_close(module([kt])["g"], torch.cat([kt["b"], kt["a"]], dim=1))
        (cached,) = module._plans.values()
        assert cached.plan.backend == 1


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm-gpu not importable")
@pytest.mark.parametrize(
    "groups",
    [[[]], [[], []], [["z"]], [["a"], []]],
    ids=["one-empty", "two-empty", "zero-width", "mixed"],
)
def test_fbgemm_is_not_called_when_there_is_nothing_to_write(
    monkeypatch: pytest.MonkeyPatch, groups: list[list[str]]
) -> None:
    """fbgemm's CUDA kernel fails on an empty grid (no plan rows, or batch 0): it is only called with work."""
    from kt_regroup import _fbgemm

    real = _fbgemm.permute_multi_embedding_function

    def like_cuda(
        values: list[torch.Tensor],
        permutes: torch.Tensor,
        in_shapes: torch.Tensor,
        out_shapes: torch.Tensor,
        out_lengths: list[int],
        reverse: bool,
    ) -> list[torch.Tensor]:
        # The CUDA launch's grid is (ceil(rows / warps), batch): both must be > 0.
        assert permutes.size(0) > 0, "fbgemm called with a plan of no rows (grid.x 0 on CUDA)"
        assert values[0].size(0) > 0, "fbgemm called with batch 0 (grid.y 0 on CUDA)"
        return real(values, permutes, in_shapes, out_shapes, out_lengths, reverse)

    monkeypatch.setattr(_fbgemm, "permute_multi_embedding_function", like_cuda)
    values = torch.randn(3, 6, requires_grad=True)
    kt = KeyedTensor(["a", "z", "b"], [4, 0, 2], values)
    outputs = regroup([kt], groups, backend="fbgemm")
    assert [tuple(o.shape) for o in outputs] == [(3, 4 if g == ["a"] else 0) for g in groups]
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    expected = torch.zeros(3, 6)
    if ["a"] in groups:
        expected[:, :4] = 1
    assert values.grad is not None
    torch.testing.assert_close(values.grad, expected, rtol=0, atol=0)
