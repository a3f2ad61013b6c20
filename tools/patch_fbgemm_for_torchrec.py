"""Let torchrec import over a partial fbgemm-gpu (the GPU pack of ../shared/gpu): benchmark baselines only.

torchrec's import runs ``fbgemm_gpu.sparse_ops``, which registers fake kernels and autograd for every fbgemm op,
including ops of libraries the pack leaves out (inference, index-select, ...); those registrations fail with
"operator ... does not exist". This patch makes them skip absent ops. fbgemm's kernels are untouched, and the
torchrec code the benchmarks run (``StagedTrainPipeline``, ``KTRegroupAsDict``) never calls the skipped ops.

    python3 tools/patch_fbgemm_for_torchrec.py /root/gpu-deps/site
    # then: pip install --no-index --no-deps --target /tmp/site .whl/torchrec/*.whl  (torchrec 1.6.1 + deps)
"""

from __future__ import annotations

import sys
from pathlib import Path

_OLD_FAKE = """        for dkey in ["CompositeImplicitAutograd", "Meta"]:
            if torch._C._dispatch_has_kernel_for_dispatch_key(op_name, dkey):
                return
        torch.library.register_fake(op_name, fn)"""
_NEW_FAKE = """        try:  # an op of a library left out of the pack does not exist
            torch._C._dispatch_has_kernel_for_dispatch_key(op_name, "Meta")
        except RuntimeError:
            return
        for dkey in ["CompositeImplicitAutograd", "Meta"]:
            if torch._C._dispatch_has_kernel_for_dispatch_key(op_name, dkey):
                return
        torch.library.register_fake(op_name, fn)"""
_OLD_AUTOGRAD = """        if key not in torch.library._impls:
            torch.library.register_autograd(op_name, fn, setup_context=setup_context)"""
_NEW_AUTOGRAD = """        if key not in torch.library._impls:
            try:
                torch.library.register_autograd(op_name, fn, setup_context=setup_context)
            except (RuntimeError, ValueError):
                return"""


def main(site: str) -> None:
    path = Path(site) / "fbgemm_gpu" / "sparse_ops.py"
    text = path.read_text()
    if _NEW_FAKE in text:
        print(f"already patched: {path}")
        return
    if _OLD_FAKE not in text or _OLD_AUTOGRAD not in text:
        raise SystemExit(f"{path}: unexpected fbgemm version (the registration helpers differ); not patched")
    path.write_text(text.replace(_OLD_FAKE, _NEW_FAKE).replace(_OLD_AUTOGRAD, _NEW_AUTOGRAD))
    print(f"patched {path}")


if __name__ == "__main__":
    main(sys.argv[1])
