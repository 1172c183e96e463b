"""Tests of liger_losses/kernels/cross_entropy.py against torch's cross-entropy in float64.

Bars: fp32 1e-5, bf16 1e-2 relative error on the loss and the logits gradient (random upstream
gradient for reduction="none").
"""

import pytest
import torch
import torch.nn.functional as F

from liger_losses.kernels.cross_entropy import LigerCrossEntropyLoss, cross_entropy
from tests.helpers import TOL, assert_close_rel

IMPLS = ["torch", "triton"]


def _ref(x, labels, reduction, *, weight=None, label_smoothing=0.0, z_loss_weight=0.0,
         softcap=None, ignore_index=-100):
    """float64 torch cross-entropy (+ z-loss term reduced the same way); returns loss and x."""
    xd = x.detach().double().requires_grad_()
    z = softcap * torch.tanh(xd / softcap) if softcap is not None else xd
    V = z.shape[-1]
    w = weight.double() if weight is not None else None
    loss = F.cross_entropy(z.reshape(-1, V), labels.reshape(-1), weight=w, reduction=reduction,
                           label_smoothing=label_smoothing, ignore_index=ignore_index)
    if z_loss_weight:
        valid = labels.reshape(-1) != ignore_index
        zl = z_loss_weight * torch.logsumexp(z.reshape(-1, V), -1) ** 2 * valid
        loss = loss + {"mean": zl.sum() / valid.sum(), "sum": zl.sum(), "none": zl}[reduction]
    if reduction == "none":
        loss = loss.reshape(labels.shape)
    return loss, xd


def _inputs(shape=(3, 4), V=120, dtype=torch.float32):
    x = (torch.randn(*shape, V) * 2).to(dtype)
    labels = torch.randint(0, V, shape)
    labels.view(-1)[::5] = -100
    return x, labels


CASES = [
    {},
    {"label_smoothing": 0.1},
    {"weight": "rand"},
    {"weight": "rand", "label_smoothing": 0.2},
    {"z_loss_weight": 1e-3, "softcap": 4.0},
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_torch_fp64(impl, reduction, case):
    """Loss and logits gradient within 1e-5 of float64 torch for every option (ignore_index
    with smoothing and class weights included), on [B, T, V] logits."""
    kw = dict(CASES[case])
    x, labels = _inputs()
    if kw.get("weight") == "rand":
        kw["weight"] = torch.rand(x.shape[-1]) + 0.5
    ref, xd = _ref(x, labels, reduction, **kw)
    go = torch.randn_like(ref)
    (ref * go).sum().backward()
    xx = x.clone().requires_grad_()
    out = cross_entropy(xx, labels, reduction=reduction, impl=impl, **kw)
    (out * go).sum().backward()
    assert_close_rel(out, ref, TOL[torch.float32], "loss")
    assert_close_rel(xx.grad, xd.grad, TOL[torch.float32], "grad")


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16(impl):
    """bf16 logits: loss (returned in bf16 as torch does) and gradient within 1e-2 of float64
    computed on the same rounded logits."""
    x, labels = _inputs(dtype=torch.bfloat16)
    ref, xd = _ref(x.float(), labels, "mean", label_smoothing=0.1)
    ref.backward()
    xx = x.clone().requires_grad_()
    out = cross_entropy(xx, labels, label_smoothing=0.1, impl=impl)
    out.backward()
    assert out.dtype == torch.bfloat16 and xx.grad.dtype == torch.bfloat16
    assert_close_rel(out, ref, TOL[torch.bfloat16], "loss")
    assert_close_rel(xx.grad, xd.grad, TOL[torch.bfloat16], "grad")


def test_inplace_backward_reuses_logits():
    """inplace_backward=True: the gradient is written into the logits' own storage (no new
    buffer: afterwards the logits hold the gradient) and is correct within 1e-5."""
    x, labels = _inputs(shape=(6,))
    ref, xd = _ref(x, labels, "mean")
    ref.backward()
    leaf = x.clone().requires_grad_()
    logits = leaf * 1.0  # a non-leaf whose values nobody else needs
    cross_entropy(logits, labels, inplace_backward=True).backward()
    assert torch.equal(logits.detach(), leaf.grad)
    assert_close_rel(leaf.grad, xd.grad, TOL[torch.float32], "grad")


def test_all_ignored_is_zero():
    """All labels ignored with mean: loss 0 and zero gradient, no NaN (torch gives NaN)."""
    x, _ = _inputs(shape=(4,))
    labels = torch.full((4,), -100)
    xx = x.clone().requires_grad_()
    out = cross_entropy(xx, labels)
    out.backward()
    assert out.item() == 0.0 and torch.all(xx.grad == 0)


def test_module_matches_torch_module():
    """LigerCrossEntropyLoss(...)(logits, labels) equals torch.nn.CrossEntropyLoss with the same
    options within 1e-5."""
    x, labels = _inputs(shape=(10,))
    w = torch.rand(x.shape[-1]) + 0.5
    ours = LigerCrossEntropyLoss(ignore_index=-100, reduction="mean", label_smoothing=0.05, weight=w)
    theirs = torch.nn.CrossEntropyLoss(weight=w.double(), label_smoothing=0.05)
    assert_close_rel(ours(x, labels), theirs(x.double(), labels), TOL[torch.float32], "module")


def test_bad_inputs():
    """Shape, dtype, range and option errors name the argument."""
    x, labels = _inputs(shape=(4,), V=10)
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(x, labels[:3])
    with pytest.raises(ValueError, match="labels"):
        cross_entropy(x, torch.full((4,), 10))
    with pytest.raises(TypeError, match="logits"):
        cross_entropy(x.long(), labels)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, labels, reduction="avg")
    with pytest.raises(ValueError, match="weight"):
        cross_entropy(x, labels, weight=torch.ones(3))
    with pytest.raises(ValueError, match="impl"):
        cross_entropy(x, labels, impl="cuda")
    with pytest.raises(ValueError, match="softcap"):  # inf would give NaN gradients, not "no cap"
        cross_entropy(x, labels, softcap=float("inf"))


@pytest.mark.gpu
def test_gpu_bf16_large_vocab():
    """GPU, bf16 [2048, 32000] logits: gradient error vs float64 no worse than 2x that of plain
    PyTorch bf16 autograd (the issue's bar)."""
    x = torch.randn(2048, 32000, device="cuda", dtype=torch.bfloat16) * 2
    labels = torch.randint(0, 32000, (2048,), device="cuda")
    labels[::7] = -100
    xd = x.double().requires_grad_()
    F.cross_entropy(xd, labels).backward()
    xp = x.clone().requires_grad_()
    F.cross_entropy(xp, labels).backward()
    xx = x.clone().requires_grad_()
    cross_entropy(xx, labels).backward()
    from tests.helpers import rel_err

    assert rel_err(xx.grad, xd.grad) <= 2 * max(rel_err(xp.grad, xd.grad), 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bad", [-5, 32000, 10**9])
def test_gpu_bad_label_raises_after_queueing(bad, weighted, impl):
    """A label outside [0, V) on the GPU raises ValueError naming ``labels`` and the value, from the
    deferred check -- after the kernel was queued with that row counted as ignored, so nothing was
    read out of bounds: the CUDA context stays usable (a later call gives the right loss). Both the
    Triton kernels and the PyTorch fallback (``impl="torch"``)."""
    V = 32000
    x = torch.randn(64, V, device="cuda")
    labels = torch.randint(0, V, (64,), device="cuda")
    w = torch.rand(V, device="cuda") + 0.5 if weighted else None
    bad_labels = labels.clone()
    bad_labels[5] = bad
    with pytest.raises(ValueError, match=f"labels must be in \\[0, {V}\\).*found {bad}"):
        cross_entropy(x.clone().requires_grad_(), bad_labels, weight=w, impl=impl)
    out = cross_entropy(x, labels, weight=w, impl=impl)
    ref = F.cross_entropy(x.double(), labels, weight=None if w is None else w.double())
    assert abs(out.item() - ref.item()) <= 1e-5 * abs(ref.item())


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpu_no_host_sync(reduction):
    """Forward + backward with the usual upstream gradient (1) synchronise the host with the GPU
    nowhere (``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronising call): the
    label check is read behind its own event, the backward's scale is skipped on the device."""
    V = 32000
    x = torch.randn(256, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (256,), device="cuda")
    labels[::5] = -100
    leaf = x.clone().requires_grad_()
    cross_entropy(leaf, labels, reduction=reduction).backward()  # compile outside the check
    torch.cuda.synchronize()
    leaf = x.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = cross_entropy(leaf, labels, reduction=reduction)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = x.double().requires_grad_()
    F.cross_entropy(ref, labels, reduction=reduction).backward()
    from tests.helpers import rel_err

    assert rel_err(leaf.grad, ref.grad) <= 1e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_forward_backward():
    """Forward + backward captured in a CUDA graph (possible now that no host read happens; the
    label check is skipped while capturing) and replayed on new inputs: loss and gradient equal
    the eager ones bitwise; a replay with upstream gradient 2 doubles the gradient."""
    V = 32000
    x = torch.randn(512, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (512,), device="cuda")
    labels[::3] = -100
    static_x = x.clone().requires_grad_()
    static_g = torch.ones((), device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            static_x.grad = None
            cross_entropy(static_x, labels).backward(static_g)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_loss = cross_entropy(static_x, labels)
        static_loss.backward(static_g)
    for scale in (1.0, 2.0):
        new = torch.randn_like(x)
        with torch.no_grad():
            static_x.copy_(new)
        static_g.fill_(scale)
        graph.replay()
        eager_x = new.clone().requires_grad_()
        eager_loss = cross_entropy(eager_x, labels)
        eager_loss.backward(torch.full((), scale, device="cuda", dtype=torch.bfloat16))
        assert torch.equal(static_loss, eager_loss)
        assert torch.equal(static_x.grad, eager_x.grad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_label_check_on_a_non_current_gpu():
    """Logits and labels on cuda:1 while cuda:0 is current: the deferred label check waits on the
    labels' device's stream, so a bad label always raises and good labels never do (20 calls each:
    a read of the pinned flag before its copy landed would show), and the loss matches float64."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    V = 32000
    x = torch.randn(512, V, device=dev)
    labels = torch.randint(0, V, (512,), device=dev)
    ref = F.cross_entropy(x.double(), labels)
    bad = labels.clone()
    bad[100] = V
    for _ in range(20):
        out = cross_entropy(x, labels)
        assert abs(out.item() - ref.item()) <= 1e-5 * abs(ref.item())
        with pytest.raises(ValueError, match="labels must be in"):
            cross_entropy(x, bad)
