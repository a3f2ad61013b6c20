"""Compatible fbgemm TBEs fused into one lookup op call (``fuse_kernels=True``) against one call per TBE and
against fbgemm's module path.

Three lookups over identical kernels (fused, unfused direct, module) trained side by side over random layouts
(2-5 kernels, fbgemm TBEs of one or two optimizers, learning rates and bounds-check modes mixed with
``TorchEmbeddingKernel``s, different dims per kernel, VBE and plain layouts, per-id weights, ``vbe_output``
chaining): outputs, gradients of the per-id weights, rows, optimizer state and fbgemm's counters agree after
every step, and the fused lookup fuses exactly the compatible TBEs. Then what may break a fusion: a learning
rate or optimizer argument set on one kernel, rows replaced (``.data``, ``load_state_dict(assign=True)``),
``state_dict`` round trips and what ``torch.save`` writes.
"""

from __future__ import annotations

import io
import random
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vbe_lookup import GroupedVBELookup, KernelGroup, TorchEmbeddingKernel, VBEFeatures, _fbgemm
from vbe_lookup.testing import random_features

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_fbgemm_direct import _train_layouts_in_children

HAS_FBGEMM = _fbgemm.fbgemm_available()
pytestmark = pytest.mark.skipif(
    not HAS_FBGEMM, reason="fbgemm-gpu is not installed: the fused path calls its lookup ops"
)
PATHS = ("fused", "unfused", "module")


def _devices() -> list[Any]:
    return [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")]


def _random_config(rng: random.Random) -> dict[str, Any]:
    optimizer = rng.choice(["rowwise_adagrad", "sgd"])
    bounds_check = rng.choice(["warning", "none"])
    kernels = []
    feature = 0
    for _ in range(rng.randint(2, 5)):
        n = rng.randint(1, 3)
        kernels.append(
            {
                "kind": "torch" if rng.random() < 0.2 else "fbgemm",
                "features": [f"f{feature + i}" for i in range(n)],
                "rows": [rng.randint(5, 40) for _ in range(n)],
                "dims": [4 * rng.randint(1, 6) for _ in range(n)],
                "optimizer": optimizer if rng.random() < 0.75 else rng.choice(["rowwise_adagrad", "sgd"]),
                "lr": 0.05 if rng.random() < 0.8 else 0.1,
                "bounds_check": bounds_check if rng.random() < 0.8 else rng.choice(["warning", "none"]),
            }
        )
        feature += n
    return {
        "kernels": kernels,
        "pooling": rng.choice(["sum", "mean"]),
        "weighted": rng.random() < 0.4,
        "ranks": rng.randint(1, 4),
    }


def _kernels(config: dict[str, Any], device: str, seed: int) -> list[Any]:
    torch.manual_seed(seed)
    out = []
    for k in config["kernels"]:
        if k["kind"] == "torch":
            out.append(
                TorchEmbeddingKernel(
                    k["rows"],
                    k["dims"],
                    pooling=config["pooling"],
                    optimizer=k["optimizer"],
                    learning_rate=k["lr"],
                    device=device,
                )
            )
        else:
            out.append(
                _fbgemm.new_tbe(
                    k["rows"],
                    k["dims"],
                    pooling=config["pooling"],
                    optimizer=k["optimizer"],
                    learning_rate=k["lr"],
                    device=device,
                    bounds_check=k["bounds_check"],
                )
            )
    return out


def _lookup(groups: list[KernelGroup], path: str, **kwargs: Any) -> GroupedVBELookup:
    if path == "module":
        return GroupedVBELookup(groups, fbgemm_call="module", check_indices="never", **kwargs)
    return GroupedVBELookup(groups, fuse_kernels=path == "fused", check_indices="never", **kwargs)


def _groups(config: dict[str, Any], kernels: list[Any]) -> list[KernelGroup]:
    return [KernelGroup(t, k["features"], k["dims"]) for t, k in zip(kernels, config["kernels"], strict=True)]


def _expected_fusion(config: dict[str, Any]) -> tuple[str | None, ...]:
    """What the fused lookup must report: fbgemm TBEs with the same optimizer, learning rate and bounds-check
    mode share a call when there are two or more of them (every other property is the same here)."""
    units: dict[tuple[Any, ...], list[int]] = {}
    for g_i, k in enumerate(config["kernels"]):
        if k["kind"] == "fbgemm":
            units.setdefault((k["optimizer"], k["lr"], k["bounds_check"]), []).append(g_i)
    out: list[str | None] = []
    for k in config["kernels"]:
        if k["kind"] != "fbgemm":
            out.append(None)
            continue
        unit = units[(k["optimizer"], k["lr"], k["bounds_check"])]
        out.append(
            "fused: groups " + ", ".join(map(str, unit)) + " in one op call" if len(unit) > 1 else "unfused"
        )
    return tuple(out)


def _batch(config: dict[str, Any], rng: random.Random, device: str, seed: int) -> VBEFeatures:
    kernels = config["kernels"]
    keys = [name for k in kernels for name in k["features"]]
    rows = [r for k in kernels for r in k["rows"]]
    stride = [[rng.choice([0, 1, 2, 5]) for _ in range(config["ranks"])] for _ in keys]
    if (
        random.Random(seed).random() < 0.4
    ):  # a sharded step's layout: on the CPU, fbgemm is called without VBE
        batch = [random.Random(seed + r).choice([1, 2, 5]) for r in range(config["ranks"])]
        stride = [list(batch) for _ in keys]
    order = list(range(len(keys)))
    rng.shuffle(order)  # the input's key order differs from the groups'
    return random_features(
        [keys[i] for i in order],
        [rows[i] for i in order],
        [stride[i] for i in order],
        weighted=config["weighted"],
        generator=torch.Generator().manual_seed(seed),
        device=device,
    )


def _state(kernels: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for k in kernels:
        if isinstance(k, TorchEmbeddingKernel):
            out.extend(t.detach().clone() for t in k.state_dict().values())
            continue
        out.extend(w.detach().clone() for w in k.split_embedding_weights())
        for states in k.split_optimizer_states():
            out.extend(s.detach().clone() for s in states)
        out.append(k.iter.detach().clone())
    return out


def _with_grad_weights(features: VBEFeatures) -> tuple[VBEFeatures, torch.Tensor | None]:
    weights = features.weights_or_none()
    if weights is None:
        return features, None
    weights = weights.detach().clone().requires_grad_(True)
    keys, stride = features.keys(), features.stride_per_key_per_rank()
    return VBEFeatures(keys, features.values(), features.lengths(), stride, weights=weights), weights


def _step(lookup: GroupedVBELookup, features: VBEFeatures) -> tuple[torch.Tensor, torch.Tensor | None]:
    features, weights = _with_grad_weights(features)
    out = lookup(features).values()
    (out * torch.linspace(-1.0, 1.0, out.numel(), device=out.device)).sum().backward()
    return out.detach().cpu(), None if weights is None or weights.grad is None else weights.grad.cpu()


def _train_layout(seed: int, device: str, path: str) -> dict[str, Any]:
    """Three steps of one random layout through one path: what the three paths must agree on."""
    rng = random.Random(seed)
    config = _random_config(rng)
    kernels = _kernels(config, device, seed)
    lookup = _lookup(_groups(config, kernels), path)
    record: dict[str, Any] = {"fusion": lookup.fbgemm_fusion, "outputs": [], "weight_grads": [], "state": []}
    for step in range(3):
        out, grad = _step(lookup, _batch(config, rng, device, 1000 * seed + step))
        record["outputs"].append(out)
        record["weight_grads"].append(grad)
        record["state"].append([t.cpu() for t in _state(kernels)])
    record["steps"] = [getattr(k, "step", None) for k in kernels]
    record["expected"] = _expected_fusion(config)
    return record


def _check_paths_agree(records: dict[str, dict[str, Any]]) -> None:
    fused = records["fused"]
    got = tuple(None if r is None else r if r.startswith("fused") else "unfused" for r in fused["fusion"])
    assert got == fused["expected"]
    assert all(r is None or r == "unfused: fuse_kernels=False" for r in records["unfused"]["fusion"])
    for path in ("unfused", "module"):
        for key in ("outputs", "weight_grads", "state"):
            torch.testing.assert_close(fused[key], records[path][key], msg=f"{path} {key}")
        assert fused["steps"] == records[path]["steps"]


LAYOUTS = range(16)


def test_random_layouts_fuse_some_kernels() -> None:
    """The random layouts below do fuse (so their comparisons test the fused call), and also leave some
    fbgemm TBEs unfused."""
    expected = [_expected_fusion(_random_config(random.Random(seed))) for seed in LAYOUTS]
    flat = [r for layout in expected for r in layout if r is not None]
    assert sum(r.startswith("fused") for r in flat) >= 10
    assert sum(r == "unfused" for r in flat) >= 3


@pytest.mark.parametrize("seed", LAYOUTS, ids=lambda s: f"layout{s}")
def test_fused_matches_unfused_and_module(seed: int) -> None:
    """Fused, unfused-direct and module lookups agree on outputs, weight grads, rows, optimizer state and
    counters over three steps of a random layout (CPU), and exactly the compatible TBEs are fused."""
    _check_paths_agree({path: _train_layout(seed, "cpu", path) for path in PATHS})


@pytest.fixture(scope="module")
def cuda_layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    """Every layout trained on CUDA by each path, in child processes (only the `gpu` tests ask for it)."""
    out = tmp_path_factory.mktemp("fused-layouts")
    return {
        path: _train_layouts_in_children("cuda", path, LAYOUTS, out, module="test_fbgemm_fused")
        for path in PATHS
    }


@pytest.mark.gpu
@pytest.mark.parametrize("seed", LAYOUTS, ids=lambda s: f"layout{s}")
def test_fused_matches_unfused_and_module_on_cuda(seed: int, cuda_layouts: dict[str, dict[int, Any]]) -> None:
    """The same on CUDA (fbgemm TBEs write in place, chained through ``vbe_output``), each path in child
    processes as in test_fbgemm_direct.py: a layout all three paths die on (fbgemm's CUDA backward SIGFPE)
    is skipped; one only some die on fails."""
    records = {path: cuda_layouts[path][seed] for path in PATHS}
    codes = {r for r in records.values() if isinstance(r, int)}
    if len(codes) == 1 and all(isinstance(r, int) for r in records.values()):
        pytest.skip(f"every path dies of signal {-codes.pop()} on this layout (fbgemm's own module path too)")
    for path, record in records.items():
        assert isinstance(record, dict), f"the {path} path's child exited with {record}"
    _check_paths_agree(records)


# ---------------------------------------------------------------- what may break a fusion


def _three_tbes(device: str, seed: int = 0, lr: float = 0.05) -> list[Any]:
    torch.manual_seed(seed)
    return [
        _fbgemm.new_tbe(rows, dims, optimizer="rowwise_adagrad", learning_rate=lr, device=device)
        for rows, dims in (([10, 20], [8, 4]), ([30], [16]), ([15, 25], [4, 12]))
    ]


KEYS = [["a", "b"], ["c"], ["d", "e"]]


def _pair(device: str) -> tuple[GroupedVBELookup, list[Any], GroupedVBELookup, list[Any]]:
    """A fused lookup and an unfused reference over identical TBEs."""
    fused_tbes, reference_tbes = _three_tbes(device), _three_tbes(device)
    fused = _lookup(
        [KernelGroup(t, k, _fbgemm.tbe_feature_dims(t)) for t, k in zip(fused_tbes, KEYS, strict=True)],
        "fused",
    )
    reference = _lookup(
        [KernelGroup(t, k, _fbgemm.tbe_feature_dims(t)) for t, k in zip(reference_tbes, KEYS, strict=True)],
        "unfused",
    )
    return fused, fused_tbes, reference, reference_tbes


def _features(seed: int, device: str) -> VBEFeatures:
    return random_features(
        ["a", "b", "c", "d", "e"],
        [10, 20, 30, 15, 25],
        [[2, 0, 3], [1, 4, 2], [3, 3, 1], [0, 2, 2], [5, 1, 0]],
        weighted=True,
        generator=torch.Generator().manual_seed(seed),
        device=device,
    )


def _agree(
    fused: GroupedVBELookup,
    fused_tbes: list[Any],
    reference: GroupedVBELookup,
    reference_tbes: list[Any],
    seed: int,
) -> None:
    """One training step of both lookups on the same batch: equal outputs, weight grads, state, counters."""
    features = _features(seed, "cpu" if fused_tbes[0].use_cpu else "cuda")
    got, want = _step(fused, features), _step(reference, features)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(_state(fused_tbes), _state(reference_tbes))
    assert [t.step for t in fused_tbes] == [t.step for t in reference_tbes]


ALL_FUSED = ("fused: groups 0, 1, 2 in one op call",) * 3


@pytest.mark.parametrize("device", _devices())
def test_learning_rate_change_falls_back_and_fuses_again(device: str) -> None:
    """A learning rate set on one TBE takes it out of the fused call (same results as per-TBE calls); the
    same rate set on the others fuses them again; the same new rate set on all keeps the fusion as it is."""
    fused, fused_tbes, reference, reference_tbes = _pair(device)
    assert fused.fbgemm_fusion == ALL_FUSED
    _agree(fused, fused_tbes, reference, reference_tbes, 0)
    for tbes in (fused_tbes, reference_tbes):
        tbes[1].set_learning_rate(0.2)
    _agree(fused, fused_tbes, reference, reference_tbes, 1)
    assert fused.fbgemm_fusion[0] == fused.fbgemm_fusion[2] == "fused: groups 0, 2 in one op call"
    assert str(fused.fbgemm_fusion[1]).startswith("unfused")
    for tbes in (fused_tbes, reference_tbes):
        tbes[0].set_learning_rate(0.2)
        tbes[2].set_learning_rate(0.2)
    _agree(fused, fused_tbes, reference, reference_tbes, 2)
    assert fused.fbgemm_fusion == ALL_FUSED
    assert fused._fusion is not None
    call = fused._fusion.calls[(0, 1, 2)]
    for tbes in (fused_tbes, reference_tbes):
        for t in tbes:
            t.set_learning_rate(0.3)
    _agree(fused, fused_tbes, reference, reference_tbes, 3)
    assert fused._fusion.calls[(0, 1, 2)] is call  # planned once, not again
    for tbes in (fused_tbes, reference_tbes):
        tbes[2].update_hyper_parameters({"eps": 0.5})
    _agree(fused, fused_tbes, reference, reference_tbes, 4)
    assert fused.fbgemm_fusion[:2] == ("fused: groups 0, 1 in one op call",) * 2
    assert str(fused.fbgemm_fusion[2]).startswith("unfused")


@pytest.mark.parametrize("device", _devices())
def test_replaced_rows_are_fused_again(device: str) -> None:
    """Rows replaced under the fusion (a new ``.data``, ``load_state_dict(assign=True)``) are detected at the
    next forward and fused anew from the kernels' current tensors."""
    fused, fused_tbes, reference, reference_tbes = _pair(device)
    _agree(fused, fused_tbes, reference, reference_tbes, 0)
    assert fused._fusion is not None
    before = fused._fusion.calls[(0, 1, 2)]
    rows = fused_tbes[1].weights_host if device == "cpu" else fused_tbes[1].weights_dev
    with torch.no_grad():
        rows.data = rows.detach().clone()
    _agree(fused, fused_tbes, reference, reference_tbes, 1)
    after = fused._fusion.calls[(0, 1, 2)]
    assert after is not before
    fused.load_state_dict({k: v.clone() for k, v in fused.state_dict().items()}, assign=True)
    _agree(fused, fused_tbes, reference, reference_tbes, 2)
    assert fused._fusion.calls[(0, 1, 2)] is not after
    assert fused.fbgemm_fusion == ALL_FUSED


@pytest.mark.parametrize("device", _devices())
def test_state_dict_round_trip(device: str) -> None:
    """A fused lookup's ``state_dict`` loads into a fresh fused lookup (in place: the fusion holds) and into
    an unfused one; all three then train alike."""
    fused, fused_tbes, reference, reference_tbes = _pair(device)
    for seed in range(2):
        _agree(fused, fused_tbes, reference, reference_tbes, seed)
    state = fused.state_dict()
    fresh_tbes = _three_tbes(device, seed=7)
    fresh = _lookup(
        [KernelGroup(t, k, _fbgemm.tbe_feature_dims(t)) for t, k in zip(fresh_tbes, KEYS, strict=True)],
        "fused",
    )
    assert fresh._fusion is not None
    call = fresh._fusion.calls[(0, 1, 2)]
    fresh.load_state_dict(state)
    for (
        t
    ) in fresh_tbes:  # fbgemm's counters are not in its state_dict (`iter` is a non-persistent buffer here)
        t.step = fused_tbes[0].step
        t.iter.copy_(fused_tbes[0].iter)
    torch.testing.assert_close(_state(fresh_tbes), _state(fused_tbes))
    for seed in range(2, 4):
        _agree(fresh, fresh_tbes, reference, reference_tbes, seed)
    assert fresh._fusion.calls[(0, 1, 2)] is call  # loaded in place into the fused rows
    unfused_tbes = _three_tbes(device, seed=8)
    unfused = _lookup(
        [KernelGroup(t, k, _fbgemm.tbe_feature_dims(t)) for t, k in zip(unfused_tbes, KEYS, strict=True)],
        "unfused",
    )
    unfused.load_state_dict(fresh.state_dict())
    for t in unfused_tbes:
        t.iter.copy_(reference_tbes[0].iter)
    torch.testing.assert_close(_state(unfused_tbes), _state(reference_tbes))


def _saved_bytes(obj: object) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getbuffer().nbytes


def test_torch_save_of_fused_state() -> None:
    """``torch.save`` of the whole lookup's ``state_dict`` writes each fused buffer once (about the unfused
    size); of ONE fused TBE's ``state_dict`` alone, the whole buffers it is a view of (documented)."""
    fused, fused_tbes, reference, _ = _pair("cpu")
    whole_fused, whole_unfused = _saved_bytes(fused.state_dict()), _saved_bytes(reference.state_dict())
    assert abs(whole_fused - whole_unfused) < 0.05 * whole_unfused
    rows = sum(t.weights_host.nbytes + t.momentum1_host.nbytes for t in fused_tbes)
    own = fused_tbes[1].weights_host.nbytes + fused_tbes[1].momentum1_host.nbytes
    alone = _saved_bytes(fused_tbes[1].state_dict())
    assert alone >= rows > 2 * own
    loaded = torch.load(io.BytesIO(_save(fused_tbes[1].state_dict())), weights_only=True)
    torch.testing.assert_close(loaded["weights_host"], fused_tbes[1].weights_host.detach())


def _save(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("device", _devices())
def test_fusion_across_other_groups_in_batch_major(device: str) -> None:
    """TBEs fused across a group they cannot share a call with (an SGD TBE between two Adagrad ones) give the
    columns of per-TBE calls, in group order, in the batch-major path a sharded module takes for its own batch,
    and in forward."""

    def build(path: str) -> tuple[GroupedVBELookup, list[Any]]:
        torch.manual_seed(0)
        tbes = [
            _fbgemm.new_tbe([10, 20], [8, 4], optimizer="rowwise_adagrad", learning_rate=0.1, device=device),
            _fbgemm.new_tbe([30], [16], optimizer="sgd", learning_rate=0.1, device=device),
            _fbgemm.new_tbe([15], [12], optimizer="rowwise_adagrad", learning_rate=0.1, device=device),
        ]
        groups = [
            KernelGroup(t, k, _fbgemm.tbe_feature_dims(t))
            for t, k in zip(tbes, [["a", "b"], ["c"], ["d"]], strict=True)
        ]
        return _lookup(groups, path), tbes

    lookups = {path: build(path) for path in PATHS}
    assert lookups["fused"][0].fbgemm_fusion[0] == "fused: groups 0, 2 in one op call"
    for seed in range(3):
        features = random_features(
            ["a", "b", "c", "d"],
            [10, 20, 30, 15],
            [[4]] * 4,
            weighted=True,
            generator=torch.Generator().manual_seed(seed),
            device=device,
        )
        grad = torch.linspace(-1, 1, 4 * 40, device=device).view(4, 40)
        outs = {}
        for path, (lookup, _) in lookups.items():
            batch_major: torch.Tensor | None
            if path == "module":  # fbgemm's module has no call without VBE: its VBE output of one rank is
                dims = [8, 4, 16, 12]  # each feature's [4, dim] rows, one feature after the other
                blocks = lookup(features).values().split([4 * d for d in dims])
                batch_major = torch.cat([b.view(4, d) for b, d in zip(blocks, dims, strict=True)], 1)
            else:
                batch_major = lookup._batch_major(features)
            assert batch_major is not None
            assert batch_major.shape == (4, 40)
            torch.autograd.backward((batch_major * grad).sum())
            outs[path] = batch_major.detach().cpu()
        for path in ("unfused", "module"):
            torch.testing.assert_close(outs["fused"], outs[path])
            torch.testing.assert_close(_state(lookups["fused"][1]), _state(lookups[path][1]))


def test_fuse_kernels_off_and_legacy_keep_one_call_per_tbe() -> None:
    """``fuse_kernels=False`` (the default) and ``merge="legacy"`` call every TBE on its own and say so."""
    tbes = _three_tbes("cpu")
    groups = [KernelGroup(t, k, _fbgemm.tbe_feature_dims(t)) for t, k in zip(tbes, KEYS, strict=True)]
    off = GroupedVBELookup(groups, fuse_kernels=False)
    assert off._fusion is None
    assert off.fbgemm_fusion == ("unfused: fuse_kernels=False",) * 3
    assert GroupedVBELookup(groups)._fusion is None  # opt-in
    legacy = GroupedVBELookup(groups, merge="legacy", fuse_kernels=True)
    assert legacy._fusion is None
    assert legacy.fbgemm_fusion == ("unfused: merge='legacy'",) * 3
    assert all(t.weights_host.untyped_storage().nbytes() == t.weights_host.nbytes for t in tbes)


def test_two_lookups_over_the_same_tbes_share_one_fusion() -> None:
    """A second fused lookup over the same TBEs re-uses the first one's buffers (no copy back and forth per
    step); both keep training the same rows as an unfused reference."""
    fused, fused_tbes, reference, reference_tbes = _pair("cpu")
    other = _lookup(
        [KernelGroup(t, k, _fbgemm.tbe_feature_dims(t)) for t, k in zip(fused_tbes, KEYS, strict=True)],
        "fused",
    )
    assert fused._fusion is not None
    assert other._fusion is not None
    assert other._fusion.calls[(0, 1, 2)] is fused._fusion.calls[(0, 1, 2)]
    for seed in range(4):
        _agree(fused if seed % 2 else other, fused_tbes, reference, reference_tbes, seed)
    assert other._fusion.calls[(0, 1, 2)] is fused._fusion.calls[(0, 1, 2)]
