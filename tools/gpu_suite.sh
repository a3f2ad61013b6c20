#!/usr/bin/env bash
# Run every package's `gpu`-marked tests and GPU benchmarks on a CUDA machine without installing the packages
# (the lent H200 has torch and triton but no network): sources on PYTHONPATH, REQUIRE_GPU=1 so that a missing
# device fails. Writes at most 8 files under $OUT: gpu-tests.log, bench.log and one bench-<package>.json each.
#
#   OUT=/tmp/gpu EXTRA_PYTHONPATH=/root/gpu-deps/site:/tmp/site bash tools/gpu_suite.sh [tests|bench|all]
set -u
cd "$(dirname "$0")/.."
what=${1:-all}
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
# NVLink multicast stays off on shared hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export REQUIRE_GPU=1 PYTHONUNBUFFERED=1
src=$(ls -d packages/*/src | paste -sd: -)
export PYTHONPATH=${EXTRA_PYTHONPATH:+$EXTRA_PYTHONPATH:}$src
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  for dir in packages/*/; do
    pkg=$(basename "$dir")
    echo "== gpu tests: $pkg" | tee -a "$OUT/gpu-tests.log"
    timeout 900 python3 -m pytest -m gpu -q -p no:cacheprovider "$dir/tests" >>"$OUT/gpu-tests.log" 2>&1 || rc=1
    tail -n 2 "$OUT/gpu-tests.log"
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for dir in packages/*/; do
    pkg=$(basename "$dir")
    mod=${pkg//-/_}
    [ -f "$dir/src/$mod/bench.py" ] || continue
    echo "== bench: $pkg" | tee -a "$OUT/bench.log"
    timeout 600 python3 -m "$mod.bench" ${BENCH_ARGS:-} --json "$OUT/bench-$pkg.json" >>"$OUT/bench.log" 2>&1 || rc=1
    tail -n 25 "$OUT/bench.log"
  done
fi
exit $rc
