#!/usr/bin/env bash
# Sets up a virtual environment (./.venv) and runs the test suite on the CPU.
# Triton kernels run through Triton's interpreter; GPU tests are skipped (run them with
# `bash benchmark/gpu.sh` on a CUDA machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned: on the CPU machines this is the local CPU build (no CUDA download).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
.venv/bin/python -m pytest -q -m "not gpu" --timeout=1800 "$@"
