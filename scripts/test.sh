#!/usr/bin/env bash
# Sets up ./.venv and runs the test suite on the CPU: Triton kernels run through Triton's
# interpreter, the pure-PyTorch fallbacks run as they are; GPU tests are skipped
# (run them on a CUDA machine with `bash benchmark/gpu.sh tests`). Two worker processes (pytest-xdist):
# CI's machine has two cores; `bash scripts/test.sh -n 0` runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q -m "not gpu" -p no:cacheprovider --timeout=1800 -n 2 "$@"
