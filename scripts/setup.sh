#!/usr/bin/env bash
# Creates ./.venv (if missing) and installs liger-losses with its dev extra into it.
# torch is pinned first so the CPU machines take their local CPU build instead of a CUDA download;
# on a CUDA machine with torch already in ./.venv nothing is reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
