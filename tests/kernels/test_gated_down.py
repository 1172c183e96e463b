"""Tests of liger_losses/kernels/gated_down.py: ``down_proj(act(gate) * up)`` in chunks, without
the product stored, and the MLP modules' use of it (``mlp_tail``).

Accuracy: the output and every gradient (gate, up or gate_up, weight, bias, and the MLP input
through the projections) against a float64 autograd reference by relative error
(tests/helpers.py): fp32 <= 1e-5 (measured ~3e-7), bf16 no worse than the unfused path
(activation kernel then ``F.linear``) plus 1e-3 -- both round the product to bf16 once.
``CHUNK_ELEMS`` is made small so the forward runs several token chunks and the backward several
column blocks, the last one partial.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from liger_losses.kernels.gated_down import GATED_DOWN_TUNING, gated_down_proj, gated_down_proj_packed
from liger_losses.kernels.mlp import MLP_TUNING, fusable_linear, mlp_tail
from tests.helpers import TOL, assert_close_rel, rel_err

ACTS = ["silu", "gelu_tanh", "gelu"]


@pytest.fixture
def small_chunks():
    """2048-element buffers: with N=150, I=600 the forward runs 3 chunks of 64 rows (the last 22)
    and the backward 3 column blocks of 256 (the last 88)."""
    with GATED_DOWN_TUNING.override(chunk_elems=2048, forward_chunk_elems=2048):
        yield


def _act_ref(gate, up, activation):
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if activation == "gelu_tanh" else "none") * up


def _mlp_inputs(n, h, i, *, packed, bias, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen)
    w_gate = torch.randn(2 * i if packed else i, h, generator=gen) / h**0.5 * 2
    w_up = torch.randn(i, h, generator=gen) / h**0.5
    w_down = torch.randn(h, i, generator=gen) / i**0.5
    b = torch.randn(h, generator=gen) if bias else None
    grad = torch.randn(n, h, generator=gen)
    leaves = [t.to(dtype).requires_grad_() for t in (x, w_gate, w_up, w_down) + ((b,) if bias else ())]
    return leaves, grad.to(dtype)


def _run(leaves, grad, *, packed, activation, fn):
    """out = fn(gate(s), w_down, bias) with gate/up projected from x (non-leaf, owned); returns
    out and the gradients of every leaf."""
    x, w_gate, w_up, w_down, *b = leaves
    bias = b[0] if b else None
    for t in leaves:
        t.grad = None
    if packed:
        out = fn(x @ w_gate.t(), None, w_down, bias)
    else:
        out = fn(x @ w_gate.t(), x @ w_up.t(), w_down, bias)
    out.backward(grad)
    return [out] + [t.grad for t in leaves]  # w_up's is None when packed


def _reference(leaves, grad, *, packed, activation):
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]

    def fn(g, u, w, b):
        if u is None:
            g, u = g.chunk(2, dim=-1)
        return F.linear(_act_ref(g, u, activation), w, b)

    return _run(leaves64, grad.double(), packed=packed, activation=activation, fn=fn)


def _ours(activation, inplace, impl="triton"):
    def fn(g, u, w, b):
        if u is None:
            return gated_down_proj_packed(g, w, b, activation=activation, inplace_backward=inplace, impl=impl)
        return gated_down_proj(g, u, w, b, activation=activation, inplace_backward=inplace, impl=impl)

    return fn


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("activation", ACTS)
def test_matches_float64_in_chunks(activation, packed, bias, inplace, small_chunks):
    """fp32, 3 token chunks x 3 column blocks: output and all gradients within 1e-5 of float64."""
    leaves, grad = _mlp_inputs(150, 24, 600, packed=packed, bias=bias)
    got = _run(leaves, grad, packed=packed, activation=activation, fn=_ours(activation, inplace))
    ref = _reference(leaves, grad, packed=packed, activation=activation)
    assert len(got) == len(ref) == 5 + bias
    for name, g, r in zip(["out", "d_x", "d_w_gate", "d_w_up", "d_w_down", "d_bias"], got, ref):
        if packed and name == "d_w_up":
            assert g is None and r is None
            continue
        assert_close_rel(g, r, TOL[torch.float32], name)


@pytest.mark.parametrize("activation", ACTS)
def test_torch_impl_matches_float64(activation):
    """The pure-PyTorch path (impl="torch") against the same float64 reference, 1e-5."""
    leaves, grad = _mlp_inputs(20, 16, 40, packed=False, bias=True)
    got = _run(leaves, grad, packed=False, activation=activation, fn=_ours(activation, True, impl="torch"))
    ref = _reference(leaves, grad, packed=False, activation=activation)
    for g, r in zip(got, ref):
        assert_close_rel(g, r, TOL[torch.float32])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_bf16_as_exact_as_unfused(activation, small_chunks):
    """bf16: each of out and the gradients is within (unfused error + 1e-3) of float64, the
    unfused path being the activation kernel and then F.linear (what the MLP did before)."""
    from liger_losses.kernels.geglu import geglu
    from liger_losses.kernels.swiglu import swiglu

    def unfused(g, u, w, b):
        if activation == "silu":
            prod = swiglu(g, u, inplace_backward=True, impl="triton")
        else:
            prod = geglu(g, u, approximate="tanh", inplace_backward=True, impl="triton")
        return F.linear(prod, w, b)

    leaves, grad = _mlp_inputs(150, 24, 600, packed=False, bias=True, dtype=torch.bfloat16, seed=1)
    ref = _reference(leaves, grad, packed=False, activation=activation)
    base = _run(leaves, grad, packed=False, activation=activation, fn=unfused)
    got = _run(leaves, grad, packed=False, activation=activation, fn=_ours(activation, True))
    for name, g, b, r in zip(["out", "d_x", "d_w_gate", "d_w_up", "d_w_down", "d_bias"], got, base, ref):
        assert g.dtype == torch.bfloat16
        assert rel_err(g, r) <= rel_err(b, r) + 1e-3, name
        assert rel_err(g, r) <= TOL[torch.bfloat16], name


def test_product_is_never_saved(small_chunks):
    """What autograd keeps for the backward is gate, up and the weight: no [N, I] product."""
    leaves, grad = _mlp_inputs(150, 24, 600, packed=False, bias=False)
    x, w_gate, w_up, w_down = leaves
    gate, up = x @ w_gate.t(), x @ w_up.t()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gated_down_proj(gate, up, w_down, inplace_backward=True, impl="triton")
    ptrs = {t.data_ptr() for t in saved}
    assert ptrs == {gate.data_ptr(), up.data_ptr(), w_down.data_ptr()}
    out.backward(grad)
    assert w_down.grad is not None and x.grad is not None


def test_frozen_weight_and_frozen_projections(small_chunks):
    """Only the inputs' gradients (frozen down_proj, as with LoRA elsewhere), or only the weight's
    (gate/up not requiring grad): each within 1e-5 of float64, the other left None."""
    leaves, grad = _mlp_inputs(150, 24, 600, packed=False, bias=False)
    x, w_gate, w_up, w_down = leaves
    ref = _reference(leaves, grad, packed=False, activation="silu")

    w_frozen = w_down.detach()
    x.grad = None
    out = gated_down_proj(x @ w_gate.t(), x @ w_up.t(), w_frozen, inplace_backward=True, impl="triton")
    out.backward(grad)
    assert_close_rel(x.grad, ref[1], 1e-5, "d_x")

    w_down.grad = None
    gate, up = (x @ w_gate.t()).detach(), (x @ w_up.t()).detach()
    out = gated_down_proj(gate, up, w_down, impl="triton")
    out.backward(grad)
    assert_close_rel(w_down.grad, ref[4], 1e-5, "d_w_down")


def test_autocast_casts_weight_like_linear():
    """Under CPU autocast (bf16) with an fp32 weight: bf16 output, fp32 weight gradient, both equal
    to F.linear under autocast on the same product (the GEMM sees the same bf16 operands)."""
    torch.manual_seed(0)
    gate = torch.randn(40, 300).bfloat16().requires_grad_()
    up = torch.randn(40, 300).bfloat16().requires_grad_()
    w = (torch.randn(16, 300) / 17).requires_grad_()
    grad = torch.randn(40, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = gated_down_proj(gate, up, w, impl="triton")
    out.backward(grad)
    assert out.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    g2, u2, w2 = (t.detach().requires_grad_() for t in (gate, up, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(_act_ref(g2.float(), u2.float(), "silu").bfloat16(), w2)
    ref.backward(grad)
    assert_close_rel(out, ref, 1e-2, "out")
    assert_close_rel(w.grad, w2.grad, 1e-2, "d_w")
    assert_close_rel(gate.grad, g2.grad, 1e-2, "d_gate")


@pytest.mark.parametrize("packed", [False, True])
def test_no_tokens(packed):
    """Zero rows: an empty [0, H] output, zero-size input gradients, a zero weight gradient."""
    leaves, _ = _mlp_inputs(0, 8, 32, packed=packed, bias=True)
    got = _run(leaves, torch.zeros(0, 8), packed=packed, activation="silu", fn=_ours("silu", True))
    assert got[0].shape == (0, 8)
    assert all(float(g.abs().sum()) == 0 for g in got[1:] if g is not None)


def test_forward_without_graph_equals_chunked_forward(small_chunks):
    """Under no_grad (gradient checkpointing's first pass) the forward runs in one chunk; it gives
    the chunked forward's output (fp32, 1e-6 relative)."""
    leaves, _ = _mlp_inputs(150, 24, 600, packed=False, bias=True)
    x, w_gate, w_up, w_down, b = leaves
    gate, up = x @ w_gate.t(), x @ w_up.t()
    with_graph = gated_down_proj(gate, up, w_down, b, impl="triton")
    with torch.no_grad():
        without = gated_down_proj(gate, up, w_down, b, impl="triton")
    assert with_graph.grad_fn is not None and without.grad_fn is None
    assert_close_rel(without, with_graph.detach(), 1e-6)


def test_leading_dims_kept():
    """gate/up [B, T, I] -> out [B, T, H]."""
    gate, up = torch.randn(2, 3, 40), torch.randn(2, 3, 40)
    w = torch.randn(8, 40)
    out = gated_down_proj(gate, up, w, impl="triton")
    assert out.shape == (2, 3, 8)
    assert_close_rel(out, F.linear(F.silu(gate) * up, w), 1e-5)


def test_second_backward_with_inplace_raises():
    """retain_graph=True then a second backward: the first one wrote the gradients over gate/up,
    so the second raises a RuntimeError that says so (not a silently wrong gradient)."""
    leaves, grad = _mlp_inputs(10, 8, 32, packed=False, bias=False)
    x, w_gate, w_up, w_down = leaves
    out = gated_down_proj(x @ w_gate.t(), x @ w_up.t(), w_down, inplace_backward=True, impl="triton")
    out.backward(grad, retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_backward"):
        out.backward(grad)


def test_bad_inputs_raise_clear_errors():
    gate, up, w = torch.randn(4, 6), torch.randn(4, 6), torch.randn(3, 6)
    with pytest.raises(ValueError, match="weight must have shape"):
        gated_down_proj(gate, up, torch.randn(3, 5))
    with pytest.raises(ValueError, match="bias must have shape"):
        gated_down_proj(gate, up, w, torch.randn(4))
    with pytest.raises(ValueError, match="up must have the same shape"):
        gated_down_proj(gate, torch.randn(4, 5), w)
    with pytest.raises(TypeError, match="weight must have gate's dtype"):
        gated_down_proj(gate, up, w.double())
    with pytest.raises(ValueError, match="activation"):
        gated_down_proj(gate, up, w, activation="relu")
    with pytest.raises(TypeError, match="inplace_backward"):
        gated_down_proj(gate, up, w, inplace_backward=1)
    with pytest.raises(ValueError, match="even last dimension"):
        gated_down_proj_packed(torch.randn(4, 7), w)
    with pytest.raises(ValueError, match="weight must have shape"):
        gated_down_proj_packed(torch.randn(4, 12), torch.randn(3, 12))
    with pytest.raises(TypeError, match="weight"):
        gated_down_proj(gate, up, torch.arange(18).view(3, 6))


# --------------------------------------------------------------------------- the MLP modules


def _config(**kw):
    from types import SimpleNamespace

    base = dict(hidden_size=24, intermediate_size=600, hidden_act="silu", mlp_bias=False)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("kind", ["swiglu", "phi3", "geglu"])
def test_mlp_modules_equal_with_and_without_fusion(kind, small_chunks):
    """The MLP drop-ins give the same output and parameter gradients (fp32, 1e-6 relative) with
    the fused tail and with the activation kernel + down_proj."""
    from liger_losses.kernels.mlp import LigerGEGLUMLP, LigerPhi3SwiGLUMLP, LigerSwiGLUMLP

    torch.manual_seed(0)
    if kind == "swiglu":
        mlp = LigerSwiGLUMLP(_config(mlp_bias=True))
    elif kind == "phi3":
        mlp = LigerPhi3SwiGLUMLP(_config())
    else:
        mlp = LigerGEGLUMLP(_config(hidden_act="gelu_pytorch_tanh"))
    x = torch.randn(2, 75, 24)
    grad = torch.randn(2, 75, 24)
    results = []
    for fuse in (True, False):
        mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with MLP_TUNING.override(fuse_down_proj=fuse):
            out = mlp(xi)
            out.backward(grad)
        results.append([out, xi.grad] + [p.grad for p in mlp.parameters()])
    for a, b in zip(*results):
        assert_close_rel(a, b, 1e-6)


def test_fusable_linear_rules():
    """Plain nn.Linear: fused. A subclass (LoRA/quantized layers), a module with a forward hook
    (ZeRO-3 and accelerate gather or move parameters in one), a meta weight: not fused."""

    class Sub(nn.Linear):
        pass

    assert fusable_linear(nn.Linear(4, 3))
    assert not fusable_linear(Sub(4, 3))
    hooked = nn.Linear(4, 3)
    hooked.register_forward_pre_hook(lambda m, a: None)
    assert not fusable_linear(hooked)
    assert not fusable_linear(nn.Linear(4, 3, device="meta"))


def test_mlp_tail_calls_a_hooked_down_proj():
    """A down_proj with a forward hook is called (the hook runs), not bypassed."""
    down = nn.Linear(40, 8)
    calls = []
    down.register_forward_hook(lambda m, a, o: calls.append(o.shape))
    gate, up = torch.randn(5, 40), torch.randn(5, 40)
    out = mlp_tail(down, gate, up, activation="silu", impl="triton")
    assert calls == [(5, 8)]
    assert_close_rel(out, down(F.silu(gate) * up), 1e-6)


@pytest.fixture
def blocks_of_2_23():
    """Backward block buffers of 2^23 elements (4 column blocks of 1024 at N=8192)."""
    with GATED_DOWN_TUNING.override(chunk_elems=1 << 23):
        yield


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gpu_bf16_accuracy_and_memory(activation, blocks_of_2_23):
    """CUDA bf16 at N=8192, H=1024, I=4096 with chunk_elems = 2^23 (8 token chunks, 4 column
    blocks of 1024): every output within the unfused error + 1e-3 of float64, and the step's
    peak at least one [N, I] buffer lower than the unfused path's (measured 72 MiB = 1.1 buffers:
    without the product and its gradient the peak moves to the projections' backward)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from liger_losses.kernels.geglu import geglu
    from liger_losses.kernels.swiglu import swiglu

    n, h, i = 8192, 1024, 4096
    leaves, grad = _mlp_inputs(n, h, i, packed=False, bias=False, dtype=torch.bfloat16, seed=3)
    leaves = [t.detach().cuda().requires_grad_() for t in leaves]
    grad = grad.cuda()

    def unfused(g, u, w, b):
        prod = swiglu(g, u, inplace_backward=True) if activation == "silu" else geglu(
            g, u, approximate="tanh", inplace_backward=True
        )
        return F.linear(prod, w, b)

    ref = _reference(leaves, grad, packed=False, activation=activation)
    peaks = {}
    outs = {}
    for name, fn in (("unfused", unfused), ("fused", _ours(activation, True, impl="auto"))):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        outs[name] = _run(leaves, grad, packed=False, activation=activation, fn=fn)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
    for k, (g, b, r) in enumerate(zip(outs["fused"], outs["unfused"], ref)):
        assert rel_err(g, r) <= rel_err(b, r) + 1e-3, k
    assert peaks["unfused"] - peaks["fused"] >= 1.0 * n * i * 2, peaks
