#!/usr/bin/env bash
# Sets up ./.venv and runs the main job: DPO on a tiny model with DPOTrainer(use_liger=True)
# on the bundled preference data (GPU if there is one, else CPU), ending with a short report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m liger_losses.demo "$@"
