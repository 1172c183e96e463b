"""Tests of liger_losses/kernels/geglu.py: gelu(gate, approximate) * up, its gradients, the Gemma MLP drop-in.

Every accuracy check compares against a float64 autograd reference by relative error
(tests/helpers.py): fp32 <= 1e-5, bf16 <= 1e-2, for the output and both gradients.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_losses.kernels.geglu import geglu
from liger_losses.kernels.mlp import LigerGEGLUMLP
from tests.helpers import TOL, assert_close_rel

IMPLS = ["triton", "torch"]
DTYPES = [torch.float32, torch.bfloat16]
APPROX = ["tanh", "none"]


def _check(gate, up, impl, dtype, approximate, **kw):
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    out = geglu(gate, up, approximate=approximate, impl=impl, **kw)
    grad = torch.randn_like(out)
    out.backward(grad)
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    ref = F.gelu(g, approximate=approximate) * u
    ref.backward(grad.double())
    assert out.dtype == dtype and out.shape == gate.shape
    assert_close_rel(out, ref, TOL[dtype], "out")
    assert_close_rel(gate.grad, g.grad, TOL[dtype], "d_gate")
    assert_close_rel(up.grad, u.grad, TOL[dtype], "d_up")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("shape", [(7,), (3, 5, 7), (4, 300), (2, 1, 4097)])
def test_geglu_matches_float64(shape, approximate, dtype, impl):
    """Output, d_gate, d_up within fp32 1e-5 / bf16 1e-2 of float64, both GELU variants, odd sizes."""
    gate = (2 * torch.randn(shape)).to(dtype)
    up = torch.randn(shape).to(dtype)
    _check(gate, up, impl, dtype, approximate)


@pytest.mark.parametrize("approximate", APPROX)
def test_geglu_non_contiguous_inputs(approximate):
    """Transposed gate and a column slice of up give the float64 result (fp32, 1e-5)."""
    gate = torch.randn(6, 40).t()
    up = torch.randn(40, 10)[:, 2:8]
    _check(gate, up, "triton", torch.float32, approximate)


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("approximate", APPROX)
def test_geglu_extreme_values_finite(approximate):
    """|gate| up to 1e4 (fp32): tanh/erf saturate without NaN/inf; output and grads match float64 to 1e-5."""
    gate = torch.tensor([[-1e4, -50.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 50.0, 1e4]])
    up = torch.randn(1, 9)
    _check(gate, up, "triton", torch.float32, approximate)


def test_geglu_inplace_backward_intermediates():
    """inplace_backward=True on Linear outputs: input and weight grads equal the out-of-place ones (1e-5)."""
    lin_g, lin_u = torch.nn.Linear(8, 30), torch.nn.Linear(8, 30)
    x = torch.randn(5, 8, requires_grad=True)
    grads = []
    for inplace in (False, True):
        for p in (*lin_g.parameters(), *lin_u.parameters(), x):
            p.grad = None
        out = geglu(lin_g(x), lin_u(x), inplace_backward=inplace, impl="triton")
        out.backward(torch.ones_like(out))
        grads.append([x.grad.clone(), lin_g.weight.grad.clone(), lin_u.weight.grad.clone()])
    for a, b in zip(*grads):
        assert_close_rel(b, a, 1e-5, "inplace vs out-of-place")


def test_geglu_inplace_backward_detects_other_users():
    """If another op saved up, the in-place gradient write raises autograd's version error."""
    lin_g, lin_u = torch.nn.Linear(4, 6), torch.nn.Linear(4, 6)
    x = torch.randn(3, 4)
    gate, up = lin_g(x), lin_u(x)
    other = (up * up).sum()
    out = geglu(gate, up, inplace_backward=True, impl="triton")
    with pytest.raises(RuntimeError, match="inplace"):
        (out.sum() + other).backward()


# --------------------------------------------------------------------------- drop-in parity


def _gemma_config(**kw):
    from transformers import GemmaConfig

    return GemmaConfig(
        hidden_size=24, intermediate_size=70, num_attention_heads=4, num_key_value_heads=2,
        head_dim=6, **kw,
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu_new"])
def test_gemma_mlp_drop_in(act, impl):
    """LigerGEGLUMLP has GemmaMLP's parameters; output, d_x and parameter grads agree to 1e-5 (fp32)."""
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    cfg = _gemma_config(hidden_act=act)
    theirs = GemmaMLP(cfg)
    ours = LigerGEGLUMLP(cfg, impl=impl)
    assert set(dict(ours.named_parameters())) == set(dict(theirs.named_parameters()))
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 3, 24)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    o1, o2 = ours(x1), theirs(x2)
    g = torch.randn_like(o2)
    o1.backward(g)
    o2.backward(g)
    assert_close_rel(o1, o2, 1e-5, "forward")
    assert_close_rel(x1.grad, x2.grad, 1e-5, "d_x")
    p2 = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert_close_rel(p.grad, p2[name].grad, 1e-5, f"d_{name}")


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    """Shape/dtype/device/option mistakes raise ValueError/TypeError naming the argument."""
    a = torch.randn(3, 4)
    with pytest.raises(ValueError, match="up must have the same shape"):
        geglu(a, torch.randn(4, 3))
    with pytest.raises(TypeError, match="up must be a floating-point"):
        geglu(a, torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="up must have gate's dtype"):
        geglu(a, a.half())
    with pytest.raises(ValueError, match="one device"):
        geglu(a, torch.randn(3, 4, device="meta"))
    with pytest.raises(ValueError, match="approximate must be one of"):
        geglu(a, a, approximate="erf")
    with pytest.raises(ValueError, match="impl must be one of"):
        geglu(a, a, impl="")
    with pytest.raises(ValueError, match="hidden_act"):
        LigerGEGLUMLP(_gemma_config(hidden_act="silu"))


# --------------------------------------------------------------------------- GPU, 8B shapes


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", APPROX)
def test_geglu_8b_shape_gpu(approximate):
    """4096 tokens x 14336 bf16 on the GPU: out and grads within 1e-2 of float64."""
    gate = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    _check(gate, up, "triton", torch.bfloat16, approximate)
