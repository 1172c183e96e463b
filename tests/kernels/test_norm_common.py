"""Tests of liger_losses/kernels/norm_common.py's ``sum_partials``: the column sum of the fp32
partial parameter-gradient rows that both norm backward kernels write ([P, H] or [G, P, H]).

Held to the float64 sum of the same fp32 rows at 1e-6 relative for an fp32 result (fp32
accumulation over at most a few hundred rows) and at bf16/fp16 rounding (1e-2) for a rounded one.
Runs the Triton kernel (the interpreter on the CPU). Also: both norm backward kernels with the
next-tile prefetch on and off, against float64 autograd.
"""

import pytest
import torch

from liger_losses.kernels import norm_common
from liger_losses.kernels.norm_common import sum_partials
from liger_losses.kernels.utils import triton_runs_on
from tests.helpers import TOL, assert_close_rel

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


@pytest.mark.parametrize("block_cols", [32, 256])
def test_sum_partials_more_rows_than_a_block(block_cols):
    # 600 rows: with 32-column tiles of <= 8192 elements (256 rows) several BLOCK_R steps of the
    # row loop and a ragged last one; 256 columns: 32-row steps. fp32 sums of 600 terms: 1e-6.
    partial = torch.randn(600, 70, dtype=torch.float32, device=DEVICE)
    with norm_common.SUM_TUNING.override(block_cols=block_cols):
        out = sum_partials(partial, torch.float32)
    assert_close_rel(out, partial.double().sum(0), 1e-6, "column sums")


@pytest.mark.parametrize("small_h", [1024, 16, "mid"], ids=["tile-acc", "row-acc", "mid-width"])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("module", ["rms_norm", "layer_norm"])
def test_backward_with_and_without_prefetch(module, prefetch, small_h):
    """The norm backward kernels with the next-tile prefetch on and off (``bwd_prefetch``), with
    tile-shaped (short rows) and row-shaped (long rows: ``bwd_small_h`` below H) accumulators, and
    the mid-width settings (``bwd_mid_h``: 2-row tiles here), over programs that walk several tiles
    (37 rows, 4 programs, tiles of 4 rows: full, partial and empty last tiles): input, weight (and
    LayerNorm bias) gradients within 1e-5 of float64 autograd (fp32)."""
    import importlib

    mod = importlib.import_module(f"liger_losses.kernels.{module}")
    changes = dict(bwd_prefetch=prefetch, bwd_small_h_tile_elems=4 * 64, bwd_tile_elems=4 * 64)
    if small_h == "mid":
        changes.update(bwd_small_h=16, bwd_mid_h=64, bwd_mid_h_tile_elems=2 * 64, bwd_mid_h_programs_per_sm=2)
    else:
        changes.update(bwd_small_h=small_h, bwd_mid_h=0)
    slot = mod.RMS_NORM_TUNING if module == "rms_norm" else mod.LAYER_NORM_TUNING
    with slot.override(**changes):
        grads, ref_grads = _norm_grads(mod, module)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_close_rel(g, r, TOL[torch.float32], f"grad {name}")


def _norm_grads(mod, module):
    """(Triton gradients, float64 autograd gradients) of a 37 x 50 norm (fp32)."""
    x = torch.randn(37, 50, device=DEVICE, requires_grad=True)
    w = (torch.rand(50, device=DEVICE) + 0.5).requires_grad_()
    b = torch.randn(50, device=DEVICE, requires_grad=True)
    dy = torch.randn(37, 50, device=DEVICE)
    xd, wd, bd = (t.detach().double().requires_grad_() for t in (x, w, b))
    if module == "rms_norm":
        inputs, ref_inputs = (x, w), (xd, wd)
        out = mod.rms_norm(x, w, eps=1e-6, impl="triton")
        ref = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))
    else:
        inputs, ref_inputs = (x, w, b), (xd, wd, bd)
        out = mod.layer_norm(x, w, b, eps=1e-5, impl="triton")
        ref = torch.nn.functional.layer_norm(xd, (50,), wd, bd, 1e-5)
    return torch.autograd.grad(out, inputs, dy), torch.autograd.grad(ref, ref_inputs, dy.double())
