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
def test_sum_partials_more_rows_than_a_block(block_cols, monkeypatch):
    # 600 rows: with 32-column tiles of <= 8192 elements (256 rows) several BLOCK_R steps of the
    # row loop and a ragged last one; 256 columns: 32-row steps. fp32 sums of 600 terms: 1e-6.
    monkeypatch.setattr(norm_common, "SUM_BLOCK_COLS", block_cols)
    partial = torch.randn(600, 70, dtype=torch.float32, device=DEVICE)
    assert_close_rel(sum_partials(partial, torch.float32), partial.double().sum(0), 1e-6, "column sums")


@pytest.mark.parametrize("small_h", [1024, 16, "mid"], ids=["tile-acc", "row-acc", "mid-width"])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("module", ["rms_norm", "layer_norm"])
def test_backward_with_and_without_prefetch(module, prefetch, small_h, monkeypatch):
    """The norm backward kernels with the next-tile prefetch on and off (``BWD_PREFETCH``), with
    tile-shaped (short rows) and row-shaped (long rows: ``BWD_SMALL_H`` below H) accumulators, and
    the mid-width settings (``BWD_MID_H``: 2-row tiles here), over programs that walk several tiles
    (37 rows, 4 programs, tiles of 4 rows: full, partial and empty last tiles): input, weight (and
    LayerNorm bias) gradients within 1e-5 of float64 autograd (fp32)."""
    import importlib

    mod = importlib.import_module(f"liger_losses.kernels.{module}")
    monkeypatch.setattr(mod, "BWD_PREFETCH", prefetch)
    monkeypatch.setattr(mod, "BWD_SMALL_H_TILE_ELEMS", 4 * 64)
    monkeypatch.setattr(mod, "BWD_TILE_ELEMS", 4 * 64)
    if small_h == "mid":
        monkeypatch.setattr(mod, "BWD_SMALL_H", 16)
        monkeypatch.setattr(mod, "BWD_MID_H", 64)
        monkeypatch.setattr(mod, "BWD_MID_H_TILE_ELEMS", 2 * 64)
        monkeypatch.setattr(mod, "BWD_MID_H_PROGRAMS_PER_SM", 2)
    else:
        monkeypatch.setattr(mod, "BWD_SMALL_H", small_h)
        monkeypatch.setattr(mod, "BWD_MID_H", 0)
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
    grads = torch.autograd.grad(out, inputs, dy)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dy.double())
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_close_rel(g, r, TOL[torch.float32], f"grad {name}")
