"""Tests of liger_losses/kernels/norm_common.py's ``sum_partials``: the column sum of the fp32
partial parameter-gradient rows that both norm backward kernels write ([P, H] or [G, P, H]).

Held to the float64 sum of the same fp32 rows at 1e-6 relative for an fp32 result (fp32
accumulation over at most a few hundred rows) and at bf16/fp16 rounding (1e-2) for a rounded one.
Runs the Triton kernel (the interpreter on the CPU).
"""

import pytest
import torch

from liger_losses.kernels.norm_common import sum_partials
from liger_losses.kernels.utils import triton_runs_on
from tests.helpers import assert_close_rel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _needs_triton():
    if not triton_runs_on(torch.device(DEVICE)):
        pytest.skip("Triton cannot run here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7), (5, 300), (33, 257), (2, 40, 96), (3, 1, 1)])
def test_sum_partials_matches_float64(shape, dtype):
    partial = torch.randn(shape, dtype=torch.float32, device=DEVICE)
    out = sum_partials(partial, dtype)
    ref = partial.double().sum(dim=-2)
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close_rel(out, ref, 1e-6 if dtype == torch.float32 else 1e-2, "column sums")


def test_sum_partials_more_rows_than_a_block():
    # 200 rows: several BLOCK_R steps of the row loop, and a ragged last one
    partial = torch.randn(200, 50, dtype=torch.float32, device=DEVICE)
    assert_close_rel(sum_partials(partial, torch.float32), partial.double().sum(0), 1e-6, "column sums")
