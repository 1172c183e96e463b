"""Tests of liger_losses/kernels/rms_norm.py: RMSNorm forward and gradients against a float64
reference, on both implementations, HF drop-in parity, and input checks.

On the CPU the Triton path runs in the Triton interpreter, whose fp32->bf16 conversion truncates
instead of rounding to nearest (the GPU rounds to nearest even); so bf16 bit-exactness against
Hugging Face is asserted only for impl="torch" on CPU, and for both paths in the GPU tests.
"""

import pytest
import torch

from liger_losses.kernels.rms_norm import (
    LigerGemmaRMSNorm,
    LigerRMSNorm,
    RMSNormFunction,
    rms_norm,
)
from tests.helpers import TOL, assert_close_rel

IMPLS = ["triton", "torch"]
MODES = ["llama", "gemma", "none"]


def reference(hidden, weight, eps, offset):
    """RMSNorm in float64: (x * rsqrt(mean(x^2) + eps)) * (offset + weight)."""
    x = hidden.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * (offset + weight.double())


def run_both(hidden, weight, *, eps=1e-6, offset=0.0, casting_mode="llama", impl="triton", **kw):
    """Forward + backward of ours and of the float64 reference, with one random upstream grad.

    Returns [(name, ours, reference)] for the output and every gradient.
    """
    x = hidden.detach().requires_grad_()  # a new leaf with hidden's strides (clone would not keep them)
    w = None if weight is None else weight.detach().requires_grad_()
    out = rms_norm(x, w, eps=eps, offset=offset, casting_mode=casting_mode, impl=impl, **kw)
    grad = torch.randn(out.shape, dtype=torch.float64, device=out.device).to(out.dtype)
    out.backward(grad.clone())
    x64 = hidden.detach().double().requires_grad_()
    w64 = None if weight is None else weight.detach().double().requires_grad_()
    ref = reference(x64, w64, eps, offset)
    ref.backward(grad.double())
    pairs = [("out", out, ref), ("grad_hidden", x.grad, x64.grad)]
    if weight is not None:
        pairs.append(("grad_weight", w.grad, w64.grad))
    return pairs


def check_all(pairs, tol):
    for name, ours, ref in pairs:
        assert_close_rel(ours, ref, tol, name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(21, 77), (1, 300), (2, 3, 64), (37, 1500)])
def test_matches_float64_reference(impl, dtype, mode, shape):
    """Output, grad_hidden and grad_weight agree with float64 to 1e-5 (fp32) / 1e-2 (bf16) /
    5e-3 (fp16) relative error for every casting mode, on odd H (77, 300), one row, 21 rows (not a
    multiple of the 16-row tile) and 3-D input; weights away from 1 and a non-zero offset exercise
    every term."""
    hidden = torch.randn(shape, dtype=dtype) * 2
    weight = (torch.rand(shape[-1]) + 0.5).to(dtype)
    pairs = run_both(hidden, weight, offset=0.25, casting_mode=mode, impl=impl)
    check_all(pairs, TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_many_rows_several_programs(impl):
    """70 rows of H=40 in fp32: the backward splits the row tiles over several programs, each with
    a partial weight-gradient row; the summed result matches float64 to 1e-5."""
    hidden = torch.randn(70, 40)
    weight = torch.randn(40)
    check_all(run_both(hidden, weight, impl=impl), TOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["row_stride", "last_stride", "transposed"])
def test_non_contiguous_input(impl, layout):
    """Strided views (row stride 2H; last-dim stride 2; a transposed 3-D tensor) give the same
    output and gradients as float64 to 1e-5 in fp32."""
    H = 33
    if layout == "row_stride":
        hidden = torch.randn(9, 2 * H)[:, :H]
    elif layout == "last_stride":
        hidden = torch.randn(9, 2 * H)[:, ::2]
    else:
        hidden = torch.randn(4, 3, H).transpose(0, 1)
    assert not hidden.is_contiguous()
    weight = torch.randn(H)
    check_all(run_both(hidden, weight, impl=impl), TOL[torch.float32])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_weight(impl, dtype):
    """weight=None normalises only; output and grad_hidden match float64 to the dtype tolerance."""
    hidden = torch.randn(5, 50, dtype=dtype)
    check_all(run_both(hidden, None, impl=impl), TOL[dtype])


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_weight_bf16_hidden_promotes_like_hf(impl):
    """llama mode with an fp32 weight and bf16 hidden returns fp32 (HF's promotion), gemma mode
    returns bf16; both within 1e-2 of float64 (the bf16 input rounding dominates)."""
    hidden = torch.randn(6, 48, dtype=torch.bfloat16)
    weight = torch.rand(48) + 0.5
    for mode, want in (("llama", torch.float32), ("gemma", torch.bfloat16)):
        pairs = run_both(hidden, weight, casting_mode=mode, impl=impl)
        assert pairs[0][1].dtype == want, mode
        assert pairs[2][1].dtype == torch.float32  # grad_weight in the weight's dtype
        check_all(pairs, TOL[torch.bfloat16])


def test_triton_and_torch_agree_fp32():
    """The two implementations agree with each other to 1e-6 in fp32 (same math, other order)."""
    hidden = torch.randn(3, 5, 96)
    weight = torch.randn(96)
    torch.manual_seed(1)
    a = run_both(hidden, weight, impl="triton", casting_mode="gemma", offset=1.0)
    torch.manual_seed(1)  # same upstream gradient
    b = run_both(hidden, weight, impl="torch", casting_mode="gemma", offset=1.0)
    for (name, x, _), (_, y, _) in zip(a, b):
        assert_close_rel(x, y, 1e-6, name)


def test_inplace_backward_writes_into_grad_output():
    """inplace_backward=True gives the same grad_hidden as the default (bitwise) and writes it into
    the upstream gradient's buffer (no extra [rows, H] tensor)."""
    hidden = torch.randn(8, 64)
    weight = torch.randn(64)
    grad = torch.randn(8, 64)
    results = []
    for inplace in (False, True):
        x = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        g = grad.clone()
        rms_norm(x, w, inplace_backward=inplace, impl="triton").backward(g)
        results.append((x.grad, w.grad, g))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], grad)  # default leaves the upstream gradient alone
    assert torch.equal(results[1][2], results[1][0])  # in place: the buffer now holds grad_hidden


def test_backward_is_deterministic():
    """Two backward passes on the same input give bitwise-identical gradients (no atomics)."""
    hidden = torch.randn(40, 24)
    weight = torch.randn(24)
    grads = []
    for _ in range(2):
        x = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        rms_norm(x, w, impl="triton").backward(torch.ones(40, 24))
        grads.append((x.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_only_weight_requires_grad():
    """With a frozen input only grad_weight is computed, and it matches float64 to 1e-5."""
    hidden = torch.randn(10, 20)
    w = torch.randn(20, requires_grad=True)
    rms_norm(hidden, w, impl="triton").sum().backward()
    w64 = w.detach().double().requires_grad_()
    reference(hidden.double(), w64, 1e-6, 0.0).sum().backward()
    assert_close_rel(w.grad, w64.grad, 1e-5, "grad_weight")


def test_autograd_function_direct():
    """RMSNormFunction.apply is usable directly and equals rms_norm(impl='triton') bitwise."""
    hidden = torch.randn(4, 16)
    weight = torch.randn(16)
    a = RMSNormFunction.apply(hidden, weight, 1e-6, 0.0, "llama", False)
    b = rms_norm(hidden, weight, impl="triton")
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- HF drop-in parity


def _hf_classes():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    return llama.LlamaRMSNorm, gemma.GemmaRMSNorm, gemma2.Gemma2RMSNorm


def _pairs(H, impl):
    LlamaRMSNorm, GemmaRMSNorm, Gemma2RMSNorm = _hf_classes()
    return [
        (LlamaRMSNorm(H, eps=1e-5), LigerRMSNorm(H, eps=1e-5, impl=impl)),
        (GemmaRMSNorm(H), LigerGemmaRMSNorm(H, impl=impl)),
        (Gemma2RMSNorm(H), LigerGemmaRMSNorm(H, impl=impl)),
    ]


def test_modules_mirror_hf_constructor_and_state():
    """Same parameter names/initial values/attributes/repr as the HF modules, and HF state dicts
    load into ours."""
    for hf, ours in _pairs(40, "auto"):
        assert torch.equal(hf.weight, ours.weight)
        assert list(hf.state_dict()) == list(ours.state_dict())
        assert hf.extra_repr() == ours.extra_repr()
        ours.load_state_dict(hf.state_dict())
    llama, _ = _pairs(40, "auto")[0]
    assert llama.variance_epsilon == 1e-5
    assert LigerRMSNorm(8, 1e-3).variance_epsilon == 1e-3
    assert LigerGemmaRMSNorm(8, 1e-3).eps == 1e-3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_match_hf(impl, dtype):
    """Random-weight HF modules and ours agree: forward and gradients within 1e-5 relative (fp32) /
    1e-2 (bf16); in bf16 the torch path is bit-exact and the Triton path is within two bf16 ulps
    (the interpreter truncates where the GPU rounds; the GPU test checks near-exactness)."""
    H = 96
    for hf, ours in _pairs(H, impl):
        with torch.no_grad():
            hf.weight.normal_(0, 0.5)
        ours.load_state_dict(hf.state_dict())
        hf.to(dtype)
        ours.to(dtype)
        x = torch.randn(2, 7, H, dtype=dtype) * 3
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        a, b = hf(x1), ours(x2)
        assert a.dtype == b.dtype and a.shape == b.shape
        grad = torch.randn_like(a)
        a.backward(grad)
        b.backward(grad)
        name = type(hf).__name__
        assert_close_rel(b, a, TOL[dtype], f"{name} out")
        assert_close_rel(x2.grad, x1.grad, TOL[dtype], f"{name} grad_hidden")
        assert_close_rel(ours.weight.grad, hf.weight.grad, TOL[dtype], f"{name} grad_weight")
        if dtype == torch.bfloat16:
            if impl == "torch":
                assert torch.equal(a, b), name
            else:
                ulp = (a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-6)
                # two truncations (llama rounds y, then the product) move at most 2 bf16 ulps
                assert ulp.max() <= 2.0**-6 + 1e-6, name


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        (dict(weight=torch.ones(7)), ValueError, "weight must have last dimension 8"),
        (dict(weight=torch.ones(2, 8)), ValueError, "weight must have 1 dimensions"),
        (dict(weight=torch.ones(8, dtype=torch.int32)), TypeError, "weight must be a floating"),
        (dict(hidden=torch.ones(3, 8, dtype=torch.int64)), TypeError, "hidden must be a floating"),
        (dict(hidden=torch.tensor(1.0)), ValueError, "hidden must have at least 1"),
        (dict(hidden=torch.ones(3, 0)), ValueError, "non-empty last dimension"),
        (dict(hidden=[1.0, 2.0]), TypeError, "hidden must be a torch.Tensor"),
        (dict(weight=torch.ones(8, device="meta")), ValueError, "one device"),
        (dict(eps=-1.0), ValueError, "eps must be in"),
        (dict(eps="1e-6"), TypeError, "eps must be a real number"),
        (dict(casting_mode="t5"), ValueError, "casting_mode must be one of"),
        (dict(impl="cuda"), ValueError, "impl must be one of"),
    ],
)
def test_bad_input_raises(kwargs, exc, words):
    """Bad shapes, dtypes, devices and options raise ValueError/TypeError naming the argument."""
    args = dict(hidden=torch.randn(3, 8), weight=torch.ones(8))
    args.update(kwargs)
    hidden, weight = args.pop("hidden"), args.pop("weight")
    with pytest.raises(exc, match=words):
        rms_norm(hidden, weight, **args)


def test_float64_auto_uses_torch_and_triton_refuses():
    """fp64 input: impl='auto' falls back to the torch path (exact to 1e-12 vs float64);
    impl='triton' raises TypeError naming the supported dtypes."""
    hidden = torch.randn(4, 10, dtype=torch.float64)
    weight = torch.randn(10, dtype=torch.float64)
    assert_close_rel(rms_norm(hidden, weight), reference(hidden, weight, 1e-6, 0.0), 1e-12)
    with pytest.raises(TypeError, match="supports hidden/weight dtypes"):
        rms_norm(hidden, weight, impl="triton")


def test_empty_rows():
    """Zero rows give an empty output of the right shape and dtype (no kernel launch)."""
    out = rms_norm(torch.randn(0, 3, 16), torch.ones(16), impl="triton")
    assert out.shape == (0, 3, 16) and out.dtype == torch.float32


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_large_bf16_matches_reference(mode):
    """4096 x 4096 bf16 on CUDA (compiled kernels, many programs): output and all gradients within
    1e-2 of float64; offset 1 for gemma."""
    hidden = torch.randn(2, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    weight = (torch.rand(4096, device="cuda") + 0.5).to(torch.bfloat16)
    offset = 1.0 if mode == "gemma" else 0.0
    check_all(run_both(hidden, weight, casting_mode=mode, offset=offset, impl="triton"), 1e-2)


@pytest.mark.gpu
def test_gpu_fp32_and_small_hidden():
    """fp32 on CUDA at 1e-5, at H=4096 (one row per tile), H=2048 and 1536 (the mid-width backward
    settings: two programs per SM, 2-row tiles) and H=896 (several rows per tile)."""
    for rows, H in ((1000, 4096), (3001, 2048), (2999, 1536), (3001, 896)):
        hidden = torch.randn(rows, H, device="cuda")
        weight = torch.randn(H, device="cuda")
        check_all(run_both(hidden, weight, impl="triton"), 1e-5)


@pytest.mark.gpu
def test_gpu_bf16_matches_hf_modules():
    """On CUDA (round-to-nearest casts) ours matches HF's bf16 output bit-exactly for >= 99% of
    elements and within two bf16 ulps everywhere."""
    H = 4096
    for hf, ours in _pairs(H, "triton"):
        with torch.no_grad():
            hf.weight.normal_(0, 0.5)
        ours.load_state_dict(hf.state_dict())
        hf.to("cuda", torch.bfloat16)
        ours.to("cuda", torch.bfloat16)
        x = torch.randn(4096, H, device="cuda", dtype=torch.bfloat16)
        a, b = hf(x), ours(x)
        assert (a == b).float().mean() >= 0.99, type(hf).__name__
        ulp = (a.float() - b.float()).abs() / a.float().abs().clamp_min(1e-6)
        assert ulp.max() <= 2.0**-6 + 1e-6  # a 1-ulp rstd/y difference, then the product


@pytest.mark.gpu
def test_gpu_inplace_backward():
    """inplace_backward on CUDA equals the default bitwise."""
    hidden = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    grads = []
    for inplace in (False, True):
        x = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        rms_norm(x, w, inplace_backward=inplace).backward(torch.ones_like(hidden))
        grads.append((x.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
