"""Review tests of liger_losses/kernels/gated_down.py and the shared gated kernels (gated.py) used
by swiglu.py / geglu.py: input layouts, aliasing, autocast, grid limits, and the failure modes a
review found.

Accuracy: outputs and every gradient against a float64 autograd reference by relative error
(tests/helpers.py): fp32 <= 1e-5, fp16 <= 5e-3, bf16 <= 1e-2. ``small_chunks`` makes the forward
run several token chunks and the backward several column blocks (the last ones partial).

The last section holds the five bugs the review found (an output view that could not be modified
in place, double backward silently dropping second-order terms, in-place gradients written into a
leaf through its view, down_proj's backward hooks skipped by the fused tail, I = 0 crashing), each
failing before its fix.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import liger_losses.kernels.gated as gated
import liger_losses.kernels.gated_down as gd
from liger_losses.kernels.gated_down import GATED_DOWN_TUNING, gated_down_proj, gated_down_proj_packed
from liger_losses.kernels.geglu import geglu
from liger_losses.kernels.mlp import MLP_TUNING, mlp_tail
from liger_losses.kernels.swiglu import swiglu, swiglu_packed
from tests.helpers import TOL, assert_close_rel, rel_err

N, H, I = 30, 8, 300  # 1 token chunk of 64 rows at most; column blocks 256 + 44 with small_chunks


@pytest.fixture
def small_chunks():
    """2048-element buffers: several token chunks and column blocks at these sizes."""
    with GATED_DOWN_TUNING.override(chunk_elems=2048, forward_chunk_elems=2048):
        yield


def _act(activation):
    if activation == "silu":
        return F.silu
    return lambda g: F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


def _leaves(n, h, i, *, packed, dtype, bias, need_inputs=True, need_weight=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=gen).to(dtype).requires_grad_(need_inputs)
    w_gate = (torch.randn(2 * i if packed else i, h, generator=gen) / h**0.5 * 2).to(dtype).requires_grad_(need_inputs)
    w_up = (torch.randn(i, h, generator=gen) / h**0.5).to(dtype).requires_grad_(need_inputs)
    w_down = (torch.randn(h, i, generator=gen) / i**0.5).to(dtype).requires_grad_(need_weight)
    b = torch.randn(h, generator=gen).to(dtype).requires_grad_() if bias else None
    grad = torch.randn(n, h, generator=gen).to(dtype)
    return [x, w_gate, w_up, w_down, b], grad


def _grads_vs_float64(make, *, n=N, h=H, i=I, packed=False, dtype=torch.float32, bias=False,
                      inplace=True, activation="silu", need_inputs=True, need_weight=True):
    """Relative errors of (out, d_x, d_w_gate, d_w_up, d_w_down, d_bias) against float64, where
    ``make(x, w_gate, w_up) -> (gate, up)`` builds the inputs (up None: packed gate_up); None
    where a leaf takes no gradient."""
    leaves, grad = _leaves(n, h, i, packed=packed, dtype=dtype, bias=bias,
                           need_inputs=need_inputs, need_weight=need_weight)

    def run(leaves, fn, grad):
        x, w_gate, w_up, w_down, b = leaves
        gate, up = make(x, w_gate, w_up)
        out = fn(gate, up, w_down, b)
        out.backward(grad.reshape(out.shape))
        return [out] + [None if t is None else t.grad for t in leaves]

    def ours(g, u, w, b):
        if u is None:
            return gated_down_proj_packed(g, w, b, activation=activation, inplace_backward=inplace, impl="triton")
        return gated_down_proj(g, u, w, b, activation=activation, inplace_backward=inplace, impl="triton")

    def ref(g, u, w, b):
        if u is None:
            g, u = g.chunk(2, dim=-1)
        return F.linear(_act(activation)(g) * u, w, b)

    leaves64 = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    expected = run(leaves64, ref, grad.double())
    got = run(leaves, ours, grad)
    return [None if r is None else rel_err(g, r) for g, r in zip(got, expected)]


def _assert_all(errs, tol):
    assert all(e is None or e <= tol for e in errs), errs


# --------------------------------------------------------------------------- layouts and grads


@pytest.mark.parametrize(
    "layout",
    ["chunk_views", "same_tensor", "transposed_lead", "column_strided", "strided_slice"],
)
def test_input_layouts_with_inplace_backward(layout, small_chunks):
    """gate/up as views of one buffer (``proj(x).chunk(2, -1)``, the unpacked function, in-place
    backward asked for), one tensor passed as both, lead dims transposed, column stride != 1
    (a transposed GEMM output), a strided slice: fp32 output and all gradients within 1e-5."""
    def make(x, wg, wu):
        if layout == "chunk_views":
            return (x @ torch.cat([wg, wu]).t()).chunk(2, dim=-1)
        if layout == "same_tensor":
            g = x @ wg.t()
            return g, g
        if layout == "transposed_lead":
            return ((x @ wg.t()).view(5, 6, -1).transpose(0, 1), (x @ wu.t()).view(5, 6, -1).transpose(0, 1))
        if layout == "column_strided":
            return (wg @ x.t()).t(), (wu @ x.t()).t()
        return (x @ torch.cat([wg, wu]).t())[:, :I], x @ wu.t()

    _assert_all(_grads_vs_float64(make), TOL[torch.float32])


@pytest.mark.parametrize("layout", ["contiguous", "column_slice", "transposed"])
def test_packed_layouts(layout, small_chunks):
    """gate_up contiguous (in place), a column slice of a wider output (strided rows), a
    transposed GEMM output (copied): fp32 output and all gradients within 1e-5."""
    def make(x, wg, wu):
        if layout == "contiguous":
            return x @ wg.t(), None
        if layout == "column_slice":
            return (x @ torch.cat([wu, wg]).t())[:, I:], None
        return (wg @ x.t()).t(), None

    _assert_all(_grads_vs_float64(make, packed=True), TOL[torch.float32])


@pytest.mark.parametrize("case", ["one_row", "small_I", "I_not_aligned"])
def test_odd_sizes(case, small_chunks):
    """1 token; I=37 (< 256, one partial block); N=150, I=555 (3 token chunks, 3 column blocks,
    both last ones partial): fp32 output and all gradients within 1e-5, with bias."""
    n, i = {"one_row": (1, I), "small_I": (N, 37), "I_not_aligned": (150, 555)}[case]
    errs = _grads_vs_float64(lambda x, wg, wu: (x @ wg.t(), x @ wu.t()), n=n, i=i, bias=True)
    _assert_all(errs, TOL[torch.float32])


@pytest.mark.parametrize("which", ["bias_only", "weight_only", "inputs_only"])
def test_partial_requires_grad(which, small_chunks):
    """Only the bias takes a gradient (weight and gate/up frozen), only the weight (gate/up
    frozen), only gate/up (weight frozen): those gradients within 1e-5, the others None."""
    errs = _grads_vs_float64(
        lambda x, wg, wu: (x @ wg.t(), x @ wu.t()), bias=which == "bias_only",
        need_inputs=which == "inputs_only", need_weight=which == "weight_only",
    )
    present = [e for e in errs if e is not None]
    assert len(present) == {"bias_only": 2, "weight_only": 2, "inputs_only": 4}[which], errs
    _assert_all(errs, TOL[torch.float32])


def test_expanded_grad_out_and_leading_dims(small_chunks):
    """out [B, T, H] reduced by ``.sum()`` (the incoming gradient is a stride-0 expand): gate, up
    and weight gradients within 1e-5 of float64."""
    gate = torch.randn(2, 7, I, requires_grad=True)
    up = torch.randn(2, 7, I, requires_grad=True)
    w = torch.randn(H, I, requires_grad=True)
    gated_down_proj(gate * 1, up * 1, w, inplace_backward=True, impl="triton").sum().backward()
    g64, u64, w64 = (t.detach().double().requires_grad_() for t in (gate, up, w))
    F.linear(F.silu(g64) * u64, w64).sum().backward()
    for got, ref in ((gate, g64), (up, u64), (w, w64)):
        assert_close_rel(got.grad, ref.grad, TOL[torch.float32])


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_fp16(activation, small_chunks):
    """fp16 (no autocast): output and all gradients within the fp16 bar 5e-3 of float64."""
    errs = _grads_vs_float64(lambda x, wg, wu: (x @ wg.t(), x @ wu.t()), dtype=torch.float16,
                             activation=activation, bias=True)
    _assert_all(errs, TOL[torch.float16])


def test_more_rows_than_grid_y(small_chunks, monkeypatch):
    """The grid's second axis is capped (MAX_GRID_Y, 65535 on CUDA): with the cap at 7 rows the
    forward chunks and the backward's column blocks (30 rows each) are launched in row slices,
    unpacked and packed; fp32 results within 1e-5 and more than one launch per block."""
    monkeypatch.setattr(gated, "MAX_GRID_Y", 7)
    launches = []
    real = gated.gated_bwd_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(gd, "gated_bwd_kernel", Counting())
    _assert_all(_grads_vs_float64(lambda x, wg, wu: (x @ wg.t(), x @ wu.t())), TOL[torch.float32])
    assert len(launches) == 2 * 5 and all(g[1] <= 7 for g in launches)  # 2 blocks x ceil(30 / 7)
    _assert_all(_grads_vs_float64(lambda x, wg, wu: (x @ wg.t(), None), packed=True), TOL[torch.float32])


@pytest.mark.parametrize("packed", [False, True])
def test_second_backward_without_inplace(packed):
    """retain_graph=True and a second backward with inplace_backward=False: the gradients
    accumulate to exactly twice the first ones."""
    gu = torch.randn(6, 2 * 40 if packed else 40, requires_grad=True)
    up = torch.randn(6, 40, requires_grad=True)
    w = torch.randn(8, 40, requires_grad=True)
    if packed:
        out = gated_down_proj_packed(gu * 1, w, impl="triton")
    else:
        out = gated_down_proj(gu * 1, up * 1, w, impl="triton")
    out.sum().backward(retain_graph=True)
    first = [t.grad.clone() for t in (gu, w)]
    out.sum().backward()
    for t, g in zip((gu, w), first):
        assert torch.equal(t.grad, 2 * g)


def test_inplace_backward_other_user_fails_loudly():
    """gate also saved by another op whose backward runs after ours (created earlier): the
    in-place backward bumps gate's version, so autograd raises instead of using the gradient."""
    x = torch.randn(6, 8, requires_grad=True)
    wg, wu, w = torch.randn(40, 8), torch.randn(40, 8), torch.randn(8, 40)
    gate, up = x @ wg.t(), x @ wu.t()
    other = (gate * gate).sum()
    out = gated_down_proj(gate, up, w, inplace_backward=True, impl="triton")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + other).backward()


# --------------------------------------------------------------------------- dtypes and autocast


@pytest.mark.parametrize("packed", [False, True])
def test_autocast_fp32_weight_equals_unfused(packed, small_chunks):
    """CPU bf16 autocast, fp32 parameters (with bias): the fused tail's output and every
    parameter gradient equal the unfused path's (activation kernel, then F.linear under autocast)
    within 1e-6 -- both round the same product to bf16 and run the same bf16 GEMMs."""
    leaves, grad = _leaves(N, H, I, packed=packed, dtype=torch.float32, bias=True)
    results = []
    for fused in (True, False):
        for t in leaves:
            t.grad = None
        x, wg, wu, wd, b = leaves
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gate = F.linear(x, wg)
            up = None if packed else F.linear(x, wu)
            if fused:
                out = (gated_down_proj_packed(gate, wd, b, inplace_backward=True, impl="triton") if packed
                       else gated_down_proj(gate, up, wd, b, inplace_backward=True, impl="triton"))
            else:
                g, u = gate.chunk(2, dim=-1) if packed else (gate, up)
                out = F.linear(swiglu(g, u, impl="triton"), wd, b)
        out.backward(grad.bfloat16())
        results.append([out] + [t.grad for t in leaves if t.grad is not None])
    assert results[0][0].dtype == torch.bfloat16
    assert len(results[0]) == len(results[1]) == (5 if packed else 6)
    for a, b_ in zip(*results):
        assert a.dtype == b_.dtype
        assert_close_rel(a, b_, 1e-6)


def test_mismatched_dtypes_raise_type_error():
    """Without autocast: up, weight or bias in another dtype than gate raises a TypeError naming
    the argument (both impls); fp32 everywhere runs and returns fp32."""
    gate, up, w = torch.randn(4, 6), torch.randn(4, 6), torch.randn(3, 6)
    for impl in ("triton", "torch"):
        with pytest.raises(TypeError, match="up must have gate's dtype"):
            gated_down_proj(gate, up.bfloat16(), w, impl=impl)
        with pytest.raises(TypeError, match="weight must have gate's dtype"):
            gated_down_proj(gate.half(), up.half(), w, impl=impl)
        with pytest.raises(TypeError, match="bias must have gate's dtype"):
            gated_down_proj(gate, up, w, torch.randn(3).double(), impl=impl)
        with pytest.raises(TypeError, match="weight must have gate's dtype"):
            gated_down_proj_packed(torch.randn(4, 12), w.bfloat16(), impl=impl)
    assert gated_down_proj(gate, up, w, impl="triton").dtype == torch.float32


# --------------------------------------------------------------------------- swiglu / geglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
def test_gated_kernels_match_torch_path(activation, dtype):
    """swiglu/geglu on the shared kernels vs their pure-PyTorch path (impl="torch"), inputs of
    scale 8 (saturated activations), [3, 5, 130]: output and both gradients within 1e-5 (fp32)
    or 1e-2 (bf16)."""
    gate0 = (torch.randn(3, 5, 130) * 8).to(dtype)
    up0 = torch.randn(3, 5, 130).to(dtype)
    grad = torch.randn(3, 5, 130).to(dtype)
    results = []
    for impl in ("triton", "torch"):
        gate, up = gate0.clone().requires_grad_(), up0.clone().requires_grad_()
        if activation == "silu":
            out = swiglu(gate, up, impl=impl)
        else:
            out = geglu(gate, up, approximate="tanh" if activation == "gelu_tanh" else "none", impl=impl)
        out.backward(grad)
        results.append((out, gate.grad, up.grad))
    for a, b in zip(*results):
        assert a.dtype == dtype
        assert_close_rel(a, b, TOL[dtype])


# --------------------------------------------------------------------------- checkpointing


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_inplace_matches_plain(reentrant):
    """Gradient checkpointing (reentrant: first pass under no_grad, one forward chunk;
    non-reentrant: saved tensors recomputed) with the in-place backward: the input gradient
    equals the un-checkpointed one exactly."""
    x = torch.randn(6, 8, requires_grad=True)
    wg, wu = torch.randn(40, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    w = torch.randn(8, 40, requires_grad=True)

    def f(x):
        return gated_down_proj(x @ wg.t(), x @ wu.t(), w, inplace_backward=True, impl="triton")

    checkpoint(f, x, use_reentrant=reentrant).sum().backward()
    got = [t.grad.clone() for t in (x, wg, wu, w)]
    for t in (x, wg, wu, w):
        t.grad = None
    f(x).sum().backward()
    for g, t in zip(got, (x, wg, wu, w)):
        assert torch.equal(g, t.grad)


# --------------------------------------------------------------------------- bugs the review found (fixed)


@pytest.mark.parametrize("packed", [False, True])
def test_output_may_be_modified_in_place(packed):
    """The MLP output (a drop-in for ``down_proj(...)``'s fresh tensor) can be modified in place
    (``out.add_(residual)``); gradients stay within 1e-5 of float64."""
    gate = torch.randn(2, 3, 2 * 40 if packed else 40, requires_grad=True)
    up = torch.randn(2, 3, 40, requires_grad=True)
    w = torch.randn(8, 40, requires_grad=True)
    out = (gated_down_proj_packed(gate * 1, w, impl="triton") if packed
           else gated_down_proj(gate * 1, up * 1, w, impl="triton"))
    out.mul_(2.0)
    out.sum().backward()
    g64, u64, w64 = (t.detach().double().requires_grad_() for t in (gate, up, w))
    g, u = g64.chunk(2, dim=-1) if packed else (g64, u64)
    (2.0 * F.linear(F.silu(g) * u, w64)).sum().backward()
    assert_close_rel(gate.grad, g64.grad, TOL[torch.float32])
    assert_close_rel(w.grad, w64.grad, TOL[torch.float32])


def _call(kind, gate, up, w):
    if kind == "gated_down":
        return gated_down_proj(gate, up, w, impl="triton")
    if kind == "gated_down_packed":
        return gated_down_proj_packed(torch.cat([gate, up], -1), w, impl="triton")
    if kind == "swiglu":
        return swiglu(gate, up, impl="triton")
    if kind == "swiglu_packed":
        return swiglu_packed(torch.cat([gate, up], -1), impl="triton")
    return geglu(gate, up, impl="triton")


@pytest.mark.parametrize("kind", ["gated_down", "gated_down_packed", "swiglu", "swiglu_packed", "geglu"])
def test_double_backward_raises_clear_error(kind):
    """A gradient penalty (``torch.autograd.grad(..., create_graph=True)``) through the kernels
    raises a RuntimeError naming double backward, instead of a gradient that silently drops the
    second-order term (or an unrelated error)."""
    gate = torch.randn(5, 40, requires_grad=True)
    up = torch.randn(5, 40)
    w = torch.randn(8, 40)
    out = _call(kind, gate, up, w)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), gate, create_graph=True)


@pytest.mark.parametrize("kind", ["gated_down", "gated_down_packed", "swiglu", "swiglu_packed"])
def test_inplace_backward_leaves_views_of_leaves_intact(kind):
    """inplace_backward=True with gate/up (or gate_up) that are views of leaf tensors (a view
    has a grad_fn but does not own its buffer): the leaves' data is unchanged by the backward."""
    w = torch.randn(8, 40)
    if kind.endswith("packed"):
        leaf = torch.randn(6, 80, requires_grad=True)
        before = leaf.detach().clone()
        view = leaf.view(6, 80)
        out = (gated_down_proj_packed(view, w, inplace_backward=True, impl="triton") if kind == "gated_down_packed"
               else swiglu_packed(view, inplace_backward=True, impl="triton"))
        leaves, befores = [leaf], [before]
    else:
        gl, ul = torch.randn(6, 40, requires_grad=True), torch.randn(6, 40, requires_grad=True)
        befores = [gl.detach().clone(), ul.detach().clone()]
        g, u = gl.view(6, 40), ul[:]
        out = (gated_down_proj(g, u, w, inplace_backward=True, impl="triton") if kind == "gated_down"
               else swiglu(g, u, inplace_backward=True, impl="triton"))
        leaves = [gl, ul]
    out.sum().backward()
    for leaf, before in zip(leaves, befores):
        assert torch.equal(leaf.detach(), before)


def test_fused_tail_runs_down_proj_backward_hooks():
    """A full backward hook on down_proj fires with the fused tail on (mlp_tail must not bypass
    the module when it has one), as it does with the tail off."""
    down = nn.Linear(40, 8)
    calls = []
    down.register_full_backward_hook(lambda m, gi, go: calls.append(1))
    x = torch.randn(5, 40, requires_grad=True)
    with MLP_TUNING.override(fuse_down_proj=True):
        mlp_tail(down, x * 1, x * 2, activation="silu", impl="triton").sum().backward()
    assert calls == [1]


@pytest.mark.parametrize("packed", [False, True])
def test_zero_intermediate_size(packed):
    """I = 0 (an empty intermediate): out = bias broadcast, zero weight gradient, empty input
    gradients -- as F.linear gives, not a reshape error."""
    gate = torch.randn(4, 0, requires_grad=True)
    up = torch.randn(4, 0, requires_grad=True)
    w = torch.randn(3, 0, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    out = (gated_down_proj_packed(gate * 1, w, b, impl="triton") if packed
           else gated_down_proj(gate * 1, up * 1, w, b, impl="triton"))
    assert torch.equal(out, b.detach().expand(4, 3))
    out.sum().backward()
    assert w.grad.shape == (3, 0) and gate.grad.shape == (4, 0)
    assert torch.equal(b.grad, torch.full((3,), 4.0))
