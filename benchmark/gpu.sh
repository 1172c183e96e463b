#!/usr/bin/env bash
# GPU runner (the device machine, or any CUDA box): installs the carried wheels (./.whl, made by
# ../shared/gpu/wheels.sh), runs the GPU tests and the benchmarks, and writes logs and results
# under $OUT (default ./out).
#
#   bash benchmark/gpu.sh [tests] [bench:NAME ...] [diag:NAME ...] [quick]
#
# With no arguments: the GPU tests and every benchmark. `bench:norm` runs `python -m benchmark.bench_norm`
# (with $BENCH_ARGS); `diag:profile_loss` runs `python -m benchmark.experiments.diag_profile_loss`
# (with $DIAG_ARGS, output appended to $OUT/diag.log); `quick` passes --quick to the benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/results"
export BENCH_OUT="$OUT/results" PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    || echo "wheel install failed"
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv 2>/dev/null | tee "$OUT/gpu_info.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu_info.txt"

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(tests all)
quick=""
for a in "${args[@]}"; do [ "$a" = quick ] && quick="--quick"; done
for a in "${args[@]}"; do
  case "$a" in
    tests)
      timeout ${TEST_TIMEOUT:-600} python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=300 tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    tests:*)
      timeout ${TEST_TIMEOUT:-600} python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=300 ${a#tests:} 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -40 ;;
    all)
      for f in benchmark/bench_*.py; do
        m=benchmark.$(basename "$f" .py)
        echo "=== $m"; timeout ${BENCH_TIMEOUT:-300} python3 -m "$m" $quick 2>&1 | tee -a "$OUT/bench.log"
      done ;;
    bench:*)
      m=benchmark.bench_${a#bench:}
      echo "=== $m"; timeout ${BENCH_TIMEOUT:-300} python3 -m "$m" $quick ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log" ;;
    diag:*)
      m=benchmark.experiments.diag_${a#diag:}
      echo "=== $m ${DIAG_ARGS:-}"; timeout ${BENCH_TIMEOUT:-300} python3 -m "$m" ${DIAG_ARGS:-} 2>&1 | grep -v "^WARNING: Target" | tee -a "$OUT/diag.log" ;;
    quick) ;;
    *) echo "unknown argument $a" ;;
  esac
done
(cd "$OUT" && tar czf "results-$(date +%H%M%S).tar.gz" results && rm -rf results)
