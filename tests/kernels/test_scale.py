"""Tests of liger_losses/kernels/scale.py's ``scale_unless_one_`` and of the chunked engine's
backward with ``engine_config(device_scale=True)``.

Held bitwise to ``x`` times ``scale`` in fp32, rounded once to x's dtype (so any difference is a
bug, not rounding; ``x.mul_(scale)`` would first round an fp32 scale to a bf16 ``x``'s dtype): scales 1 (the kernel's
early exit: x untouched), 0.5, -3.25 and a random one; fp32 and bf16; sizes from one element to several tiles per
program of the persistent grid. Exception: Triton's CPU interpreter (3.9) rounds fp32 -> bf16 toward zero instead of to
nearest, so there bf16 results are held to one bf16 ulp (2^-7 relative). Runs the Triton kernel (the interpreter on the
CPU). On the GPU also: no host sync.
"""

import pytest
import torch

from liger_losses.chunked.config import engine_config
from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
from liger_losses.chunked.preference.dpo import fused_linear_dpo_loss
from liger_losses.kernels import scale as scale_mod
from liger_losses.kernels.scale import scale_unless_one_
from liger_losses.kernels.utils import triton_interpret, triton_runs_on

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _needs_triton():
    if not triton_runs_on(torch.device(DEVICE)):
        pytest.skip("Triton cannot run here")


@pytest.mark.parametrize("value", [1.0, 0.5, -3.25, None], ids=["one", "half", "neg", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 1000, 5 * 8192 + 7])
def test_matches_mul_bitwise(value, dtype, n):
    x = torch.randn(n, device=DEVICE).to(dtype)
    s = torch.tensor(torch.rand(()).item() + 0.1 if value is None else value, device=DEVICE)
    expected = (x.float() * s).to(dtype)
    out = scale_unless_one_(x, s)
    assert out is x
    if dtype == torch.bfloat16 and triton_interpret() and value != 1.0:
        torch.testing.assert_close(x.float(), expected.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(x, expected)


def test_several_tiles_per_program():
    # a small tile: 4 interpreter programs stride over 25 tiles (the persistent loop)
    x = torch.randn(1600 + 3, device=DEVICE)
    s = torch.tensor(0.3, device=DEVICE)
    expected = x.clone().mul_(s)
    with scale_mod.SCALE_TUNING.override(block=64):
        assert torch.equal(scale_unless_one_(x, s), expected)


def test_non_contiguous_and_empty():
    x = torch.randn(30, 20, device=DEVICE)
    view = x.t()
    expected = view.clone().mul_(2.0)
    assert torch.equal(scale_unless_one_(view, torch.tensor([2.0], device=DEVICE)), expected)
    empty = torch.empty(0, device=DEVICE)
    assert scale_unless_one_(empty, torch.tensor(2.0, device=DEVICE)) is empty


def test_bad_arguments():
    x = torch.randn(8, device=DEVICE)
    with pytest.raises(ValueError, match="scale"):
        scale_unless_one_(x, torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="scale"):
        scale_unless_one_(x, 2.0)
    with pytest.raises(TypeError, match="floating"):
        scale_unless_one_(torch.ones(8, dtype=torch.long, device=DEVICE), torch.tensor(2.0, device=DEVICE))


@pytest.mark.parametrize("upstream", [1.0, 0.37])
@pytest.mark.parametrize("loss", ["cross_entropy", "dpo"])
def test_engine_backward_with_device_scale(loss, upstream):
    """Gradients of hidden and weight with ``device_scale`` on equal (bitwise) those with it off, for an
    upstream gradient of 1 (no pass) and 0.37 (a pass): the same fp32 multiply either way."""
    torch.manual_seed(0)
    w = (torch.randn(50, 16, device=DEVICE) * 0.1).requires_grad_()
    h = torch.randn(4, 12, 16, device=DEVICE).requires_grad_()
    ref_h = torch.randn(4, 12, 16, device=DEVICE)
    labels = torch.randint(0, 50, (4, 12), device=DEVICE)
    labels[:, :3] = -100

    def grads():
        if loss == "cross_entropy":
            out = fused_linear_cross_entropy(w, h, labels)
        else:
            out = fused_linear_dpo_loss(w, h, ref_h, labels).loss
        return torch.autograd.grad(out * upstream, (w, h))

    with engine_config(device_scale=False):
        off = grads()
    with engine_config(device_scale=True):
        on = grads()
    for a, b in zip(on, off):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("value", [1.0, 0.37])
def test_gpu_bitwise_and_no_host_sync(value):
    """GPU: bf16 results bitwise equal to ``x * scale`` computed in fp32 and rounded to nearest
    once (``x.mul_(scale)`` would round the fp32 scale to bf16 first: one ulp off for 0.37), over
    several tiles per program; and no host sync."""
    from tests.helpers import count_host_syncs

    x = torch.randn((1 << 22) + 5, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor(value, device="cuda")
    expected = (x.float() * s).to(torch.bfloat16)
    scale_unless_one_(x, s)
    assert torch.equal(x, expected)
    y = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    assert count_host_syncs(lambda: scale_unless_one_(y, s)) == 0
