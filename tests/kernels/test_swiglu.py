"""Tests of liger_losses/kernels/swiglu.py: silu(gate) * up, its gradients, the SwiGLU MLP drop-ins.

Every accuracy check compares against a float64 autograd reference by relative error
(tests/helpers.py): fp32 <= 1e-5, bf16 <= 1e-2, for the output and both gradients.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_losses.kernels.mlp import LigerPhi3SwiGLUMLP, LigerSwiGLUMLP
from liger_losses.kernels.swiglu import swiglu, swiglu_packed
from tests.helpers import TOL, assert_close_rel

IMPLS = ["triton", "torch"]
DTYPES = [torch.float32, torch.bfloat16]


def _reference(gate, up, grad):
    """Output and (d_gate, d_up) in float64."""
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    out = F.silu(g) * u
    out.backward(grad.double())
    return out, g.grad, u.grad


def _check(gate, up, impl, dtype, **kw):
    gate = gate.detach().requires_grad_()
    up = up.detach().requires_grad_()
    out = swiglu(gate, up, impl=impl, **kw)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, dg, du = _reference(gate, up, grad)
    assert out.dtype == dtype and out.shape == gate.shape
    assert_close_rel(out, ref, TOL[dtype], "out")
    assert_close_rel(gate.grad, dg, TOL[dtype], "d_gate")
    assert_close_rel(up.grad, du, TOL[dtype], "d_up")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 5, 7), (4, 300), (1, 1), (2, 1, 4097)])
def test_swiglu_matches_float64(shape, dtype, impl):
    """Output, d_gate, d_up within fp32 1e-5 / bf16 1e-2 of float64; odd sizes and > one block."""
    gate = (2 * torch.randn(shape)).to(dtype)
    up = torch.randn(shape).to(dtype)
    _check(gate, up, impl, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_non_contiguous_inputs(dtype):
    """Transposed gate and a column slice of up (row-strided) give the float64 result (same tol)."""
    gate = torch.randn(6, 40).to(dtype).t()  # [40, 6], not contiguous
    up = torch.randn(40, 10).to(dtype)[:, 2:8]  # [40, 6], rows of stride 10
    _check(gate, up, "triton", dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_swiglu_extreme_values_finite():
    """|gate| up to 1e4 (fp32): sigmoid saturates without NaN/inf; output and grads match float64 to 1e-5."""
    gate = torch.tensor([[-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4]])
    up = torch.randn(1, 7)
    _check(gate, up, "triton", torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_swiglu_inplace_backward_intermediates(impl):
    """inplace_backward=True on Linear outputs: input and weight grads equal the out-of-place ones (1e-5)."""
    lin_g, lin_u = torch.nn.Linear(8, 30), torch.nn.Linear(8, 30)
    x = torch.randn(5, 8, requires_grad=True)
    grads = []
    for inplace in (False, True):
        for p in (*lin_g.parameters(), *lin_u.parameters(), x):
            p.grad = None
        out = swiglu(lin_g(x), lin_u(x), inplace_backward=inplace, impl=impl)
        out.backward(torch.ones_like(out))
        grads.append([x.grad.clone(), lin_g.weight.grad.clone(), lin_u.weight.grad.clone()])
    for a, b in zip(*grads):
        assert_close_rel(b, a, 1e-5, "inplace vs out-of-place")


def test_swiglu_inplace_backward_detects_other_users():
    """If another op saved gate, the in-place gradient write raises the autograd version error
    instead of silently corrupting that op's gradient."""
    lin_g, lin_u = torch.nn.Linear(4, 6), torch.nn.Linear(4, 6)
    x = torch.randn(3, 4)
    gate, up = lin_g(x), lin_u(x)
    other = (gate * gate).sum()  # saves gate; runs after swiglu's backward
    out = swiglu(gate, up, inplace_backward=True, impl="triton")
    with pytest.raises(RuntimeError, match="inplace"):
        (out.sum() + other).backward()


@pytest.mark.parametrize("packed", [False, True], ids=["gate-up", "packed"])
@pytest.mark.parametrize("inplace", [True, False])
def test_swiglu_second_backward(inplace, packed):
    """retain_graph=True and a second backward: with inplace_backward a RuntimeError that names the
    cause and the way out (the first backward overwrote the saved gate/up); without it the second
    backward's gradients equal the first's (1e-6)."""
    lin_g, lin_u = torch.nn.Linear(4, 6), torch.nn.Linear(4, 6)
    x = torch.randn(3, 4, requires_grad=True)
    out = swiglu(lin_g(x), lin_u(x), inplace_backward=inplace, impl="triton")
    if packed:
        out = swiglu_packed(torch.cat([lin_g(x), lin_u(x)], -1), inplace_backward=inplace, impl="triton")
    first = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
    if inplace:
        with pytest.raises(RuntimeError, match="second backward.*inplace_backward=False"):
            torch.autograd.grad(out.sum(), x)
    else:
        assert_close_rel(torch.autograd.grad(out.sum(), x)[0], first, 1e-6, "second backward")


def test_swiglu_inplace_backward_skips_leaves():
    """Leaf inputs are never overwritten (their .grad would alias them): values and grads stay right (1e-5)."""
    gate = torch.randn(4, 9, requires_grad=True)
    up = torch.randn(4, 9, requires_grad=True)
    before = gate.detach().clone()
    out = swiglu(gate, up, inplace_backward=True, impl="triton")
    out.backward(torch.ones_like(out))
    assert torch.equal(gate.detach(), before)
    _, dg, _ = _reference(before, up, torch.ones(4, 9))
    assert_close_rel(gate.grad, dg, 1e-5, "d_gate")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
def test_swiglu_packed_matches_float64(dtype, impl, inplace):
    """swiglu_packed(gate_up) == silu(gate) * up with gate, up = chunk(2); d(gate_up) within tol of float64."""
    src = torch.randn(3, 5, 2 * 37).to(dtype)
    w = torch.ones((), dtype=dtype, requires_grad=True)
    gate_up = src * w  # non-leaf, so the in-place path is allowed
    out = swiglu_packed(gate_up, inplace_backward=inplace, impl=impl)
    grad = torch.randn_like(out)
    gate_up.retain_grad()
    out.backward(grad)
    g64 = src.double().requires_grad_()
    a, b = g64.chunk(2, dim=-1)
    ref = F.silu(a) * b
    ref.backward(grad.double())
    assert out.shape == (3, 5, 37) and out.dtype == dtype
    assert_close_rel(out, ref, TOL[dtype], "out")
    assert_close_rel(gate_up.grad, g64.grad, TOL[dtype], "d_gate_up")


# --------------------------------------------------------------------------- drop-in parity


def _llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=24, intermediate_size=70, num_attention_heads=4, num_key_value_heads=2, **kw)


def _parity(ours, theirs, x, tol=1e-5):
    ours.load_state_dict(theirs.state_dict())
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    o1, o2 = ours(x1), theirs(x2)
    g = torch.randn_like(o2)
    o1.backward(g)
    o2.backward(g)
    assert_close_rel(o1, o2, tol, "forward")
    assert_close_rel(x1.grad, x2.grad, tol, "d_x")
    p2 = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert_close_rel(p.grad, p2[name].grad, tol, f"d_{name}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_llama_mlp_drop_in(mlp_bias, impl):
    """LigerSwiGLUMLP has LlamaMLP's parameters; output, d_x and every parameter grad agree to 1e-5 (fp32)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = _llama_config(mlp_bias=mlp_bias)
    theirs = LlamaMLP(cfg)
    ours = LigerSwiGLUMLP(cfg, impl=impl)
    assert set(dict(ours.named_parameters())) == set(dict(theirs.named_parameters()))
    _parity(ours, theirs, torch.randn(2, 3, 24))


def test_qwen2_mlp_drop_in():
    """LigerSwiGLUMLP built from a Qwen2Config matches Qwen2MLP (forward and grads, 1e-5 fp32)."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    cfg = Qwen2Config(hidden_size=16, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2)
    _parity(LigerSwiGLUMLP(cfg, impl="triton"), Qwen2MLP(cfg), torch.randn(5, 16))


@pytest.mark.parametrize("impl", IMPLS)
def test_phi3_mlp_drop_in(impl):
    """LigerPhi3SwiGLUMLP has Phi3MLP's fused gate_up_proj; output and grads agree to 1e-5 (fp32)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    cfg = Phi3Config(hidden_size=20, intermediate_size=36, num_attention_heads=4, num_key_value_heads=2)
    theirs = Phi3MLP(cfg)
    ours = LigerPhi3SwiGLUMLP(cfg, impl=impl)
    assert set(dict(ours.named_parameters())) == set(dict(theirs.named_parameters()))
    _parity(ours, theirs, torch.randn(2, 3, 20))


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    """Shape/dtype/device/option mistakes raise ValueError/TypeError naming the argument."""
    a = torch.randn(3, 4)
    with pytest.raises(ValueError, match="up must have the same shape"):
        swiglu(a, torch.randn(3, 5))
    with pytest.raises(TypeError, match="gate must be a floating-point"):
        swiglu(torch.ones(3, 4, dtype=torch.int64), a)
    with pytest.raises(TypeError, match="up must have gate's dtype"):
        swiglu(a, a.double())
    with pytest.raises(TypeError, match="gate must be a torch.Tensor"):
        swiglu([1.0], a)
    with pytest.raises(ValueError, match="one device"):
        swiglu(a, torch.randn(3, 4, device="meta"))
    with pytest.raises(ValueError, match="impl must be one of"):
        swiglu(a, a, impl="cuda")
    with pytest.raises(TypeError, match="inplace_backward"):
        swiglu(a, a, inplace_backward=1)
    with pytest.raises(ValueError, match="gate_up must have an even last dimension"):
        swiglu_packed(torch.randn(2, 7))
    with pytest.raises(ValueError, match="hidden_act"):
        LigerSwiGLUMLP(_llama_config(hidden_act="gelu"))


# --------------------------------------------------------------------------- GPU, 8B shapes


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_swiglu_llama3_8b_shape_gpu(packed):
    """Llama-3-8B MLP activation (4096 tokens x 14336, bf16) on the GPU: out and grads within 1e-2 of float64."""
    n, inter = 4096, 14336
    if packed:
        src = torch.randn(n, 2 * inter, device="cuda", dtype=torch.bfloat16)
        gate_up = src.clone().requires_grad_()
        out = swiglu_packed(gate_up, impl="triton")
        grad = torch.randn_like(out)
        out.backward(grad)
        g64 = src.double().requires_grad_()
        a, b = g64.chunk(2, dim=-1)
        ref = F.silu(a) * b
        ref.backward(grad.double())
        assert_close_rel(out, ref, 1e-2, "out")
        assert_close_rel(gate_up.grad, g64.grad, 1e-2, "d_gate_up")
    else:
        gate = torch.randn(n, inter, device="cuda", dtype=torch.bfloat16)
        up = torch.randn(n, inter, device="cuda", dtype=torch.bfloat16)
        _check(gate, up, "triton", torch.bfloat16)
