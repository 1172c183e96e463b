"""Every Triton kernel's default launch configuration compiles for sm_90 (H100 / H200) on the CPU.

The CPU suite runs the kernels in Triton's interpreter, which accepts programs the compiler refuses
(e.g. a branch that retypes a loop variable: ``CompilationError`` on the GPU only). This compiles
each default case of ``benchmark/experiments/diag_registers.py`` with the wheel's own compiler and
ptxas (no GPU needed), in a subprocess: the interpreter's environment variable must not be set
there, and must stay set here.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_every_default_kernel_compiles_for_sm90():
    """No compile error in any default case, and every case uses at most 255 registers a thread."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmark.experiments.diag_registers", "--json", "--defaults"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) >= 20  # every kernel family is there
    errors = {name: r["error"] for name, r in results.items() if "error" in r}
    assert not errors, errors
    assert all(r["regs"] <= 255 for r in results.values())
