"""Triton kernels (CUDA, ``key_dim == 1``): one launch forward, one launch backward.

Imported lazily, only when a regroup runs on CUDA tensors with the Triton backend. Up to 8 inputs and
8 groups are passed as plain pointer arguments (no per-call pointer table, no host-to-device copy): the
only per-call host work is the launch itself.

* Forward: program ``(t, b)`` copies tile ``t`` of the plan (``<= BLOCK_D`` columns of one key's block
  into one group) for rows ``[b * BLOCK_B, (b + 1) * BLOCK_B)``. Outputs are written directly, no
  intermediate cat; loads and stores are vectorised (alignment hints from the plan).
* Backward: program ``(t, b)`` owns a tile of *input* columns and sums every occurrence of that key's
  columns in the groups' gradients, in group order, in fp32 (fp64 for fp64), then stores once. Every
  input column belongs to exactly one tile, so there are no atomics and the result is bitwise
  deterministic; keys in no group get exact zeros.

Launch: after a kernel variant's first launch through the JIT (which compiles it), later launches call
the compiled kernel's launcher directly with a prebuilt argument list (see :class:`_Kernel`): the JIT's
per-call binding and specialization work costs more host time than the rest of a regroup.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kt_regroup import _env
from kt_regroup._plan import TRITON_MAX_TENSORS

__all__ = ["triton_backward", "triton_forward"]

# Rows per program and warps per program; the environment overrides exist for tuning sweeps only.
BLOCK_B = int(_env.TRITON_BLOCK_B.get())
NUM_WARPS = int(_env.TRITON_NUM_WARPS.get())


@triton.jit
def _pick(i, p0, p1, p2, p3, p4, p5, p6, p7):  # type: ignore[no-untyped-def]  # Triton JIT function
    p = p0
    if i == 1:
        p = p1
    if i == 2:
        p = p2
    if i == 3:
        p = p3
    if i == 4:
        p = p4
    if i == 5:
        p = p5
    if i == 6:
        p = p6
    if i == 7:
        p = p7
    return p


# Widths are never specialised: a width of 1 would become a constexpr and break the scalar selects.
@triton.jit(do_not_specialize=[f"iw{i}" for i in range(8)] + [f"ow{i}" for i in range(8)])  # type: ignore[untyped-decorator]  # triton ships no types
def _regroup_fwd_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    tiles,
    batch,
    i0, i1, i2, i3, i4, i5, i6, i7,
    iw0, iw1, iw2, iw3, iw4, iw5, iw6, iw7,
    o0, o1, o2, o3, o4, o5, o6, o7,
    ow0, ow1, ow2, ow3, ow4, ow5, ow6, ow7,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    base = tiles + tile * 5
    src_idx = tl.load(base)
    src_col = tl.multiple_of(tl.load(base + 1), ALIGN)
    dst_idx = tl.load(base + 2)
    dst_col = tl.multiple_of(tl.load(base + 3), ALIGN)
    ncols = tl.multiple_of(tl.load(base + 4), ALIGN)
    src = _pick(src_idx, i0, i1, i2, i3, i4, i5, i6, i7)
    src_w = tl.multiple_of(_pick(src_idx, iw0, iw1, iw2, iw3, iw4, iw5, iw6, iw7), ALIGN)
    dst = _pick(dst_idx, o0, o1, o2, o3, o4, o5, o6, o7)
    dst_w = tl.multiple_of(_pick(dst_idx, ow0, ow1, ow2, ow3, ow4, ow5, ow6, ow7), ALIGN)
    mask = (rows[:, None] < batch) & (cols[None, :] < ncols)
    rows64 = rows.to(tl.int64)[:, None]
    values = tl.load(src + rows64 * src_w + src_col + cols[None, :], mask=mask)
    tl.store(dst + rows64 * dst_w + dst_col + cols[None, :], values, mask=mask)


@triton.jit(do_not_specialize=[f"gw{i}" for i in range(8)] + [f"rw{i}" for i in range(8)])  # type: ignore[untyped-decorator]  # triton ships no types
def _regroup_bwd_kernel(  # type: ignore[no-untyped-def]  # Triton JIT function
    tiles,
    occ,
    batch,
    g0, g1, g2, g3, g4, g5, g6, g7,
    gw0, gw1, gw2, gw3, gw4, gw5, gw6, gw7,
    r0, r1, r2, r3, r4, r5, r6, r7,
    rw0, rw1, rw2, rw3, rw4, rw5, rw6, rw7,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_D)
    base = tiles + tile * 5
    dst_idx = tl.load(base)
    dst_col = tl.multiple_of(tl.load(base + 1), ALIGN)
    ncols = tl.multiple_of(tl.load(base + 2), ALIGN)
    occ_start = tl.load(base + 3)
    occ_count = tl.load(base + 4)
    mask = (rows[:, None] < batch) & (cols[None, :] < ncols)
    rows64 = rows.to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=ACC)
    j = occ_start
    while j < occ_start + occ_count:
        src_idx = tl.load(occ + j * 2)
        src_col = tl.multiple_of(tl.load(occ + j * 2 + 1), ALIGN)
        src = _pick(src_idx, g0, g1, g2, g3, g4, g5, g6, g7)
        src_w = tl.multiple_of(_pick(src_idx, gw0, gw1, gw2, gw3, gw4, gw5, gw6, gw7), ALIGN)
        acc += tl.load(src + rows64 * src_w + src_col + cols[None, :], mask=mask, other=0.0).to(ACC)
        j += 1
    dst = _pick(dst_idx, r0, r1, r2, r3, r4, r5, r6, r7)
    dst_w = tl.multiple_of(_pick(dst_idx, rw0, rw1, rw2, rw3, rw4, rw5, rw6, rw7), ALIGN)
    tl.store(dst + rows64 * dst_w + dst_col + cols[None, :], acc.to(dst.dtype.element_ty), mask=mask)


# Direct launches of compiled kernels (see _Kernel), on unless KT_REGROUP_TRITON_FAST_LAUNCH=0. Tests and the
# bench switch it to compare with the JIT's launch.
FAST_LAUNCH = _env.TRITON_FAST_LAUNCH.get() == "1"

try:  # Triton >= 3.4: launch hooks live in knobs, and the launcher takes every bound argument.
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: every launch goes through the JIT
    _knobs = None

# Pointer arguments per kernel: 8 sources and 8 destinations (unused slots repeat the first tensor).
_SLOTS = TRITON_MAX_TENSORS
_MAX_I32 = 2**31 - 1
# A compiled variant, ready to launch: (launcher, CUfunction handle, packed launch metadata, stream getter).
_Compiled = tuple[Any, Any, Any, Any]
_MAX_VARIANTS = 256
_MAX_LAYOUTS = 256


class _Kernel:
    """One of the two JIT kernels, plus its compiled variants launched without the JIT's per-call work.

    ``JITFunction.run`` spends tens of microseconds of host time on every launch: it binds the 37
    arguments, builds a specialization key string from all of them and re-reads the environment. Here
    everything it decides is fixed by the variant: dtype, device, constexprs and how ``batch`` is
    specialised (1 is a constant, a multiple of 16 is marked divisible, as the JIT does; the widths are
    never specialised), once every pointer is 16-byte aligned (the JIT's pointer specialization). So the
    first launch of a variant goes through the JIT, which compiles it (or finds it compiled) and returns
    its ``CompiledKernel``; later launches call that kernel's launcher directly with the argument tuple the
    JIT would pass (every bound argument in order, constexprs included; pointers as ints), on the stream
    the JIT would use. A misaligned pointer, launch hooks (profilers such as proton), pre-run hooks, a
    device other than the current one, a compiled kernel whose signature is not the expected one or a
    Triton without ``knobs`` take the JIT path, as does ``FAST_LAUNCH = False``; a launcher that rejects
    the arguments (another Triton's calling convention) drops the variant and takes it too.
    """

    __slots__ = ("constexpr_names", "fast_launches", "jit", "n_heads", "pre_run_hooks", "refused", "variants")

    def __init__(self, jit: Any, n_heads: int, constexpr_names: tuple[str, ...]) -> None:
        self.jit = jit
        self.pre_run_hooks: list[Any] = getattr(jit, "pre_run_hooks", [])  # the JIT's own list
        self.n_heads = n_heads  # plan tensors before `batch`
        self.constexpr_names = constexpr_names
        # (dtype, device index, BLOCK_D, ALIGN, batch class) -> compiled variant
        self.variants: dict[tuple[object, ...], _Compiled] = {}
        self.fast_launches = 0  # direct launches so far (tests check that the fast path ran)
        self.refused = ""  # why the last compiled kernel was not kept for direct launches, if it was not

    def launch(
        self,
        grid_x: int,
        batch: int,
        heads: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        src_widths: tuple[int, ...],
        dsts: Sequence[torch.Tensor],
        dst_widths: tuple[int, ...],
        constexprs: tuple[Any, ...],
        variant: tuple[object, ...],
    ) -> None:
        """Launch ``grid_x`` tiles x ``cdiv(batch, BLOCK_B)`` row blocks on the current stream.

        ``variant`` is ``(dtype, device index, BLOCK_D, ALIGN, batch class)``: what picks the compiled
        kernel (see :func:`_batch_class`).
        """
        grid_y = (batch + BLOCK_B - 1) // BLOCK_B
        hit = self.variants.get(variant) if FAST_LAUNCH else None
        if hit is not None:
            head_ptrs = [t.data_ptr() for t in heads]
            src_ptrs = [t.data_ptr() for t in srcs]
            dst_ptrs = [t.data_ptr() for t in dsts]
            bits = 0
            for ptr in (*head_ptrs, *src_ptrs, *dst_ptrs):
                bits |= ptr
            if (
                not bits & 15
                and batch <= _MAX_I32
                and _idle(_knobs.runtime.launch_enter_hook)
                and _idle(_knobs.runtime.launch_exit_hook)
                and not self.pre_run_hooks
                and variant[1] == torch.cuda.current_device()
            ):
                run, function, metadata, stream = hit
                try:
                    # The launcher's arguments as JITFunction.run passes them: grid, stream, function,
                    # packed metadata, launch metadata and the two hooks (only read by hooks: None when
                    # none is set), then the kernel's own.
                    run(
                        grid_x, grid_y, 1, stream(variant[1]), function, metadata, None, None, None,
                        *head_ptrs,
                        batch,
                        *src_ptrs, *[src_ptrs[0]] * (_SLOTS - len(src_ptrs)), *src_widths,
                        *dst_ptrs, *[dst_ptrs[0]] * (_SLOTS - len(dst_ptrs)), *dst_widths,
                        *constexprs,
                    )  # fmt: skip
                except TypeError as error:  # raised while parsing the arguments, before any launch
                    del self.variants[variant]
                    self.refused = f"the launcher rejected the arguments: {error}"
                else:
                    self.fast_launches += 1
                    return
        self._launch_jit(
            grid_x, grid_y, batch, heads, srcs, src_widths, dsts, dst_widths, constexprs, variant
        )

    def _launch_jit(
        self,
        grid_x: int,
        grid_y: int,
        batch: int,
        heads: Sequence[torch.Tensor],
        srcs: Sequence[torch.Tensor],
        src_widths: tuple[int, ...],
        dsts: Sequence[torch.Tensor],
        dst_widths: tuple[int, ...],
        constexprs: tuple[Any, ...],
        variant: tuple[object, ...],
    ) -> None:
        """The JIT's own launch; keeps the compiled kernel for direct launches when it may (see the class)."""
        args = (*heads, batch, *_pad(srcs), *src_widths, *_pad(dsts), *dst_widths)
        options = dict(zip(self.constexpr_names, constexprs, strict=True))
        current = variant[1] == torch.cuda.current_device()
        # The JIT launches on the current device: make it the tensors' one.
        with contextlib.nullcontext() if current else torch.cuda.device(srcs[0].device):
            compiled = self.jit[(grid_x, grid_y)](*args, **options, num_warps=NUM_WARPS)
        aligned = not any(t.data_ptr() & 15 for t in (*heads, *srcs, *dsts))
        if current and aligned and batch <= _MAX_I32 and _knobs is not None and not self.pre_run_hooks:
            self._keep(compiled, variant, len(args) + len(constexprs))

    def _keep(self, compiled: Any, variant: tuple[object, ...], n_args: int) -> None:
        """Cache ``compiled`` for direct launches if its signature is the one this module passes."""
        signature = getattr(getattr(compiled, "src", None), "signature", None)
        if not isinstance(signature, dict) or len(signature) != n_args:
            self.refused = f"signature {signature!r} does not have {n_args} arguments"
            return
        types = [str(t) for t in signature.values()]
        heads = range(self.n_heads)
        srcs = range(self.n_heads + 1, self.n_heads + 1 + _SLOTS)
        dsts = range(self.n_heads + 1 + 2 * _SLOTS, self.n_heads + 1 + 3 * _SLOTS)
        n_const = len(self.constexpr_names)
        if (
            types[self.n_heads] not in ("i32", "constexpr")
            or not all(types[i].startswith("*") for i in (*heads, *srcs, *dsts))
            or any(t != "constexpr" for t in types[-n_const:])
        ):
            self.refused = f"unexpected argument types {types}"
            return
        try:
            from triton.runtime.driver import driver

            entry = (
                compiled.run,
                compiled.function,
                compiled.packed_metadata,
                driver.active.get_current_stream,
            )
        except AttributeError as error:
            self.refused = f"no launcher: {error}"
            return
        if entry[1] is None:
            self.refused = "no CUfunction handle"
            return
        if len(self.variants) >= _MAX_VARIANTS:
            self.variants.clear()
        self.variants[variant] = entry


def _batch_class(batch: int) -> int:
    """How the JIT specialises ``batch``: 1 becomes a constant, a multiple of 16 is marked divisible."""
    return 1 if batch == 1 else 0 if batch & 15 else 16


def _idle(hook: Any) -> bool:
    """Whether a launch hook does nothing: unset, or an empty ``HookChain`` (Triton 3.5+'s default)."""
    return hook is None or not getattr(hook, "calls", True)


_FORWARD = _Kernel(_regroup_fwd_kernel, 1, ("BLOCK_B", "BLOCK_D", "ALIGN"))
_BACKWARD = _Kernel(_regroup_bwd_kernel, 2, ("BLOCK_B", "BLOCK_D", "ALIGN", "ACC"))


def _pad(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [*tensors, *[tensors[0]] * (_SLOTS - len(tensors))]


def _pad_widths(widths: Sequence[int]) -> tuple[int, ...]:
    return (*widths, *[0] * (_SLOTS - len(widths)))


class _Layout:
    """What the launches of one plan need besides its tensors: grid sizes, padded widths, constexprs."""

    __slots__ = (
        "align",
        "block_d",
        "bwd_constexprs",
        "fwd_constexprs",
        "in_lengths",
        "in_widths",
        "n_bwd",
        "n_fwd",
        "out_lengths",
        "out_widths",
    )

    def __init__(
        self, meta: tuple[int, ...], in_lengths: tuple[int, ...], out_lengths: tuple[int, ...]
    ) -> None:
        self.block_d, self.align, self.n_fwd, self.n_bwd = meta[0], meta[1], meta[2], meta[3]
        self.in_lengths = in_lengths
        self.out_lengths = out_lengths
        self.in_widths = _pad_widths(in_lengths)
        self.out_widths = _pad_widths(out_lengths)
        self.fwd_constexprs = (BLOCK_B, self.block_d, self.align)
        # Backward constexprs by accumulator: fp64 sums for fp64, fp32 for every other dtype.
        self.bwd_constexprs = {
            dtype: (*self.fwd_constexprs, tl.float64 if dtype == torch.float64 else tl.float32)
            for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        }

    def forward(self, values: Sequence[torch.Tensor], tiles: torch.Tensor) -> list[torch.Tensor]:
        """``[B, out_lengths[g]]`` per group from ``[B, in_lengths[i]]`` per input (one launch)."""
        inputs = [v.contiguous() for v in values]
        first = inputs[0]
        batch = first.size(0)
        outputs = [first.new_empty((batch, w)) for w in self.out_lengths]
        if self.n_fwd and batch:
            _FORWARD.launch(
                self.n_fwd,
                batch,
                (tiles,),
                inputs,
                self.in_widths,
                outputs,
                self.out_widths,
                self.fwd_constexprs,
                (first.dtype, first.get_device(), self.block_d, self.align, _batch_class(batch)),
            )
        return outputs

    def backward(
        self, grads: Sequence[torch.Tensor], tiles: torch.Tensor, occ: torch.Tensor
    ) -> list[torch.Tensor]:
        """``[B, in_lengths[i]]`` input gradients from the groups' ``[B, out_lengths[g]]`` (one launch)."""
        sources = [g.contiguous() for g in grads]
        first = sources[0]
        batch = first.size(0)
        results = [first.new_empty((batch, w)) for w in self.in_lengths]
        if self.n_bwd and batch:
            dtype = first.dtype
            _BACKWARD.launch(
                self.n_bwd,
                batch,
                (tiles, occ),
                sources,
                self.out_widths,
                results,
                self.in_widths,
                self.bwd_constexprs[dtype],
                (dtype, first.get_device(), self.block_d, self.align, _batch_class(batch)),
            )
        return results


_LAYOUTS: dict[tuple[tuple[int, ...], ...], _Layout] = {}


def _layout(meta: Sequence[int], in_lengths: Sequence[int], out_lengths: Sequence[int]) -> _Layout:
    """The :class:`_Layout` of a plan, built once (keyed by content: eager calls pass the plan's tuples)."""
    key = (tuple(meta), tuple(in_lengths), tuple(out_lengths))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _Layout(*key)
    return layout


def triton_forward(
    values: Sequence[torch.Tensor],
    plan: Sequence[torch.Tensor],
    meta: Sequence[int],
    in_lengths: Sequence[int],
    out_lengths: Sequence[int],
) -> list[torch.Tensor]:
    """Regrouped ``[B, out_lengths[g]]`` CUDA tensors, one launch (see the module docstring)."""
    return _layout(meta, in_lengths, out_lengths).forward(values, plan[0])


def triton_backward(
    grads: Sequence[torch.Tensor],
    plan: Sequence[torch.Tensor],
    meta: Sequence[int],
    in_lengths: Sequence[int],
    out_lengths: Sequence[int],
) -> list[torch.Tensor]:
    """Input gradients ``[B, in_lengths[i]]``, one launch, no atomics (see the module docstring)."""
    return _layout(meta, in_lengths, out_lengths).backward(grads, plan[1], plan[2])
