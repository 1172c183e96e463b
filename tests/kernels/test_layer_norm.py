"""Tests of liger_losses/kernels/layer_norm.py: LayerNorm forward and gradients (hidden, weight,
bias) against a float64 reference on both implementations, nn.LayerNorm drop-in parity, and
input checks.

On the CPU the Triton path runs in the Triton interpreter, whose fp32->bf16 conversion truncates
instead of rounding to nearest (the GPU rounds to nearest even); so bf16 near-exactness against
nn.LayerNorm is asserted only for impl="torch" on CPU, and for the Triton path in the GPU tests.
"""

import pytest
import torch
from torch import nn

from liger_losses.kernels.layer_norm import LayerNormFunction, LigerLayerNorm, layer_norm
from tests.helpers import TOL, assert_close_rel

IMPLS = ["triton", "torch"]


def reference(hidden, weight, bias, eps):
    """LayerNorm in float64 with the biased variance, as nn.LayerNorm."""
    x = hidden.double()
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.double()
    if bias is not None:
        y = y + bias.double()
    return y


def run_both(hidden, weight, bias, *, eps=1e-5, impl="triton"):
    """Forward + backward of ours and of the float64 reference with one random upstream grad.

    Returns [(name, ours, reference)] for the output and every gradient.
    """
    # detach() gives new leaves that keep hidden's strides (clone would make them contiguous)
    leaves = [None if t is None else t.detach().requires_grad_()
              for t in (hidden, weight, bias)]
    out = layer_norm(*leaves, eps=eps, impl=impl)
    grad = torch.randn(out.shape, dtype=torch.float64, device=out.device).to(out.dtype)
    out.backward(grad.clone())
    leaves64 = [None if t is None else t.detach().double().requires_grad_()
                for t in (hidden, weight, bias)]
    ref = reference(*leaves64, eps)
    ref.backward(grad.double())
    pairs = [("out", out, ref)]
    for name, a, b in zip(("grad_hidden", "grad_weight", "grad_bias"), leaves, leaves64):
        if a is not None:
            pairs.append((name, a.grad, b.grad))
    return pairs


def check_all(pairs, tol):
    for name, ours, ref in pairs:
        assert_close_rel(ours, ref, tol, name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("affine", ["weight_bias", "weight_only", "bias_only", "none"])
@pytest.mark.parametrize("shape", [(21, 77), (1, 300), (2, 3, 64), (37, 1500)])
def test_matches_float64_reference(impl, dtype, affine, shape):
    """Output and every gradient (hidden, weight, bias when present) agree with float64 to 1e-5
    (fp32) / 1e-2 (bf16) / 5e-3 (fp16) relative error, on odd H, one row, 21 rows (not a multiple
    of the tile), 3-D input; the input has a non-zero mean and scale so the mean/variance terms
    matter."""
    H = shape[-1]
    hidden = (torch.randn(shape) * 3 + 1.5).to(dtype)
    weight = (torch.rand(H) + 0.5).to(dtype) if "weight" in affine else None
    bias = torch.randn(H).to(dtype) if "bias" in affine else None
    check_all(run_both(hidden, weight, bias, impl=impl), TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_many_rows_several_programs(impl):
    """70 rows of H=40 in fp32: several backward programs each write partial weight/bias rows;
    the summed gradients match float64 to 1e-5."""
    check_all(run_both(torch.randn(70, 40), torch.randn(40), torch.randn(40), impl=impl), 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["row_stride", "last_stride", "transposed"])
def test_non_contiguous_input(impl, layout):
    """Strided views (row stride 2H; last-dim stride 2; a transposed 3-D tensor) give output and
    gradients within 1e-5 of float64 in fp32."""
    H = 33
    if layout == "row_stride":
        hidden = torch.randn(9, 2 * H)[:, :H]
    elif layout == "last_stride":
        hidden = torch.randn(9, 2 * H)[:, ::2]
    else:
        hidden = torch.randn(4, 3, H).transpose(0, 1)
    assert not hidden.is_contiguous()
    check_all(run_both(hidden, torch.randn(H), torch.randn(H), impl=impl), 1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_params_bf16_hidden(impl):
    """fp32 weight/bias with bf16 hidden: output stays bf16, gradients keep the parameters'
    dtypes, all within 1e-2 of float64."""
    hidden = torch.randn(6, 48, dtype=torch.bfloat16)
    pairs = run_both(hidden, torch.rand(48) + 0.5, torch.randn(48), impl=impl)
    dtypes = [p[1].dtype for p in pairs]
    assert dtypes == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    check_all(pairs, 1e-2)


def test_triton_and_torch_agree_fp32():
    """The two implementations agree with each other to 1e-6 in fp32 (same math, other order)."""
    hidden, weight, bias = torch.randn(3, 5, 96), torch.randn(96), torch.randn(96)
    torch.manual_seed(1)
    a = run_both(hidden, weight, bias, impl="triton")
    torch.manual_seed(1)  # same upstream gradient
    b = run_both(hidden, weight, bias, impl="torch")
    for (name, x, _), (_, y, _) in zip(a, b):
        assert_close_rel(x, y, 1e-6, name)


def test_backward_is_deterministic():
    """Two backward passes give bitwise-identical gradients (partial rows, then one sum)."""
    hidden, weight, bias = torch.randn(40, 24), torch.randn(24), torch.randn(24)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        layer_norm(*leaves, impl="triton").backward(torch.ones(40, 24))
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_only_parameters_require_grad():
    """A frozen input: weight and bias gradients alone, within 1e-5 of float64."""
    hidden = torch.randn(10, 20)
    w, b = torch.randn(20, requires_grad=True), torch.randn(20, requires_grad=True)
    layer_norm(hidden, w, b, impl="triton").sum().backward()
    w64, b64 = (t.detach().double().requires_grad_() for t in (w, b))
    reference(hidden, w64, b64, 1e-5).sum().backward()
    assert_close_rel(w.grad, w64.grad, 1e-5, "grad_weight")
    assert_close_rel(b.grad, b64.grad, 1e-5, "grad_bias")


def test_autograd_function_direct():
    """LayerNormFunction.apply equals layer_norm(impl='triton') bitwise."""
    hidden, weight, bias = torch.randn(4, 16), torch.randn(16), torch.randn(16)
    assert torch.equal(LayerNormFunction.apply(hidden, weight, bias, 1e-5),
                       layer_norm(hidden, weight, bias, impl="triton"))


# --------------------------------------------------------------------------- nn.LayerNorm drop-in


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(eps=1e-6), dict(elementwise_affine=False), dict(bias=False),
     dict(dtype=torch.bfloat16)],
)
def test_module_mirrors_nn_layernorm(kwargs):
    """Same parameters (names, shapes, dtypes, initial values), eps, repr and state dict as
    nn.LayerNorm for every constructor option; an int and a 1-tuple shape are both accepted."""
    ref = nn.LayerNorm(40, **kwargs)
    for shape in (40, (40,), [40]):
        ours = LigerLayerNorm(shape, **kwargs)
        assert isinstance(ours, nn.LayerNorm)
        assert ours.normalized_shape == ref.normalized_shape and ours.eps == ref.eps
        assert repr(ours) == repr(ref).replace("LayerNorm", "LigerLayerNorm")
        assert list(ours.state_dict()) == list(ref.state_dict())
        for (n1, p1), (n2, p2) in zip(ref.named_parameters(), ours.named_parameters()):
            assert n1 == n2 and p1.dtype == p2.dtype and torch.equal(p1, p2)
        ours.load_state_dict(ref.state_dict())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [dict(), dict(bias=False), dict(elementwise_affine=False)])
def test_module_matches_nn_layernorm(impl, dtype, kwargs):
    """Random-parameter nn.LayerNorm and ours agree: output and gradients within 1e-5 (fp32) /
    1e-2 (bf16) relative; bf16 output within one bf16 ulp (two for the interpreter's truncation)."""
    H = 96
    ref = nn.LayerNorm(H, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    ours = LigerLayerNorm(H, impl=impl, **kwargs)
    ours.load_state_dict(ref.state_dict())
    ref.to(dtype)
    ours.to(dtype)
    x = (torch.randn(2, 7, H) * 3 + 1).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = ref(x1), ours(x2)
    assert a.dtype == b.dtype == dtype
    grad = torch.randn_like(a)
    a.backward(grad)
    b.backward(grad)
    assert_close_rel(b, a, TOL[dtype], "out")
    assert_close_rel(x2.grad, x1.grad, TOL[dtype], "grad_hidden")
    for (name, p1), (_, p2) in zip(ref.named_parameters(), ours.named_parameters()):
        assert_close_rel(p2.grad, p1.grad, TOL[dtype], f"grad_{name}")
    if dtype == torch.bfloat16:
        ulp = (a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-6)
        bound = 2.0**-7 if impl == "torch" else 2.0**-6
        assert ulp.max() <= bound + 1e-6


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(weight=torch.ones(7)), ValueError, "weight must have last dimension 8"),
        (dict(bias=torch.ones(9)), ValueError, "bias must have last dimension 8"),
        (dict(weight=torch.ones(1, 8)), ValueError, "weight must have 1 dimensions"),
        (dict(bias=torch.ones(8, dtype=torch.int32)), TypeError, "bias must be a floating"),
        (dict(hidden=torch.ones(3, 8, dtype=torch.int64)), TypeError, "hidden must be a floating"),
        (dict(hidden=torch.tensor(1.0)), ValueError, "hidden must have at least 1"),
        (dict(hidden=torch.ones(3, 0)), ValueError, "non-empty last dimension"),
        (dict(bias=torch.ones(8, device="meta")), ValueError, "one device"),
        (dict(eps=-1e-5), ValueError, "eps must be in"),
        (dict(eps=None), TypeError, "eps must be a real number"),
        (dict(impl="gpu"), ValueError, "impl must be one of"),
    ],
)
def test_bad_input_raises(kwargs, exc, words):
    """Bad shapes, dtypes, devices and options raise ValueError/TypeError naming the argument."""
    args = dict(hidden=torch.randn(3, 8), weight=torch.ones(8), bias=torch.zeros(8))
    args.update(kwargs)
    hidden, weight, bias = args.pop("hidden"), args.pop("weight"), args.pop("bias")
    with pytest.raises(exc, match=words):
        layer_norm(hidden, weight, bias, **args)


def test_module_bad_shapes():
    """A multi-dim normalized_shape and an input of the wrong width raise ValueError."""
    with pytest.raises(ValueError, match="normalized_shape must be an int or a 1-tuple"):
        LigerLayerNorm((4, 8))
    with pytest.raises(ValueError, match="input must have last dimension 8"):
        LigerLayerNorm(8)(torch.randn(2, 7))


def test_float64_auto_uses_torch_and_triton_refuses():
    """fp64: impl='auto' takes the torch path (exact to 1e-12); impl='triton' raises TypeError."""
    f64 = dict(dtype=torch.float64)
    hidden, weight, bias = torch.randn(4, 10, **f64), torch.randn(10, **f64), torch.randn(10, **f64)
    assert_close_rel(layer_norm(hidden, weight, bias), reference(hidden, weight, bias, 1e-5), 1e-12)
    with pytest.raises(TypeError, match="supports hidden/weight/bias dtypes"):
        layer_norm(hidden, weight, bias, impl="triton")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("H", [4096, 2048, 1536, 896])
def test_gpu_large_bf16_matches_reference(H):
    """8192 rows bf16 on CUDA (one row per tile at 4096; the mid-width backward settings at 2048
    and 1536; several rows per tile at 896): output and all gradients within 1e-2 of float64."""
    hidden = (torch.randn(8192, H, device="cuda") * 2 + 1).to(torch.bfloat16)
    weight = (torch.rand(H, device="cuda") + 0.5).to(torch.bfloat16)
    bias = torch.randn(H, device="cuda").to(torch.bfloat16)
    check_all(run_both(hidden, weight, bias), 1e-2)


@pytest.mark.gpu
def test_gpu_fp32_matches_reference():
    """fp32 on CUDA within 1e-5 of float64 for output and all gradients."""
    check_all(run_both(torch.randn(1000, 4096, device="cuda"), torch.randn(4096, device="cuda"),
                       torch.randn(4096, device="cuda")), 1e-5)


@pytest.mark.gpu
def test_gpu_bf16_matches_nn_layernorm():
    """On CUDA ours matches nn.LayerNorm's bf16 output within one bf16 ulp (+1e-3 absolute where
    weight * xhat + bias cancels) and is >= 95% bit-exact."""
    ref = nn.LayerNorm(4096)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.5)
    ours = LigerLayerNorm(4096)
    ours.load_state_dict(ref.state_dict())
    ref.to("cuda", torch.bfloat16)
    ours.to("cuda", torch.bfloat16)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    a, b = ref(x), ours(x)
    assert (a == b).float().mean() >= 0.95
    # one bf16 ulp of the result, plus a small absolute slack where weight * xhat + bias cancels
    assert ((a.float() - b.float()).abs() <= 2.0**-7 * a.float().abs() + 1e-3).all()
