"""Tests of liger_losses/chunked/cross_entropy.py against a float64 reference (full logits).

Bars: fp32 1e-5 relative error on the loss and the gradients of hidden, weight and bias; bf16
1e-2. chunk_tokens=4 so that several chunks (and boundaries inside sequences) are exercised.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_losses.chunked.cross_entropy import (
    LigerFusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
)
from liger_losses.chunked.output import LossOutput
from tests.helpers import TOL, assert_close_rel, count_speculative_passes, lm_head_inputs, rel_err

FP32 = TOL[torch.float32]
B, T, H, V = 3, 5, 16, 60


def _inputs(seed=0, dtype=torch.float32):
    w, h, b, labels = lm_head_inputs(torch.Generator().manual_seed(seed), B, T, H, V, dtype)
    labels[:, :2] = -100
    return w, h, b, labels


def reference(w, h, b, labels, reduction="mean", *, label_smoothing=0.0, z_loss_weight=0.0,
              softcap=None, logit_scale=1.0, num_items_in_batch=None):
    """float64 loss and the leaves (for gradients) of the plain formula on full logits."""
    wd, hd = w.detach().double().requires_grad_(), h.detach().double().requires_grad_()
    bd = b.detach().double().requires_grad_() if b is not None else None
    z = (hd @ wd.T + (bd if bd is not None else 0)) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z2, l2 = z.reshape(-1, V), labels.reshape(-1)
    valid = l2 != -100
    per = F.cross_entropy(z2, l2, reduction="none", label_smoothing=label_smoothing)
    per = per + z_loss_weight * torch.logsumexp(z2, -1) ** 2 * valid
    if reduction == "none":
        loss = per.reshape(labels.shape)
    elif reduction == "sum":
        loss = per.sum()
    else:
        loss = per.sum() / (num_items_in_batch if num_items_in_batch is not None else max(int(valid.sum()), 1))
    return loss, (wd, hd, bd)


def _grads_close(ours, leaves, tol, w, h, b):
    wd, hd, bd = leaves
    assert_close_rel(h.grad, hd.grad, tol, "grad_hidden")
    assert_close_rel(w.grad, wd.grad, tol, "grad_weight")
    if b is not None:
        assert_close_rel(b.grad, bd.grad, tol, "grad_bias")


OPTIONS = [
    {},
    {"label_smoothing": 0.1, "z_loss_weight": 1e-3},
    {"softcap": 3.0, "logit_scale": 0.7},
]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_matches_fp64(impl, reduction, opt):
    """Every option x reduction x implementation: loss and all gradients within 1e-5 of float64
    (random upstream gradient for reduction='none', which recomputes in backward)."""
    w, h, b, labels = _inputs(opt)
    ref, leaves = reference(w, h, b, labels, reduction, **OPTIONS[opt])
    go = torch.randn_like(ref)
    (ref * go).sum().backward()
    out = fused_linear_cross_entropy(w, h, labels, bias=b, reduction=reduction, chunk_tokens=4,
                                     impl=impl, **OPTIONS[opt])
    (out * go).sum().backward()
    assert_close_rel(out, ref, FP32, "loss")
    _grads_close(out, leaves, FP32, w, h, b)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items_in_batch(as_tensor):
    """reduction='mean' with num_items_in_batch divides the summed loss by it (HF gradient
    accumulation), as a number or a tensor; within 1e-5."""
    w, h, b, labels = _inputs(1)
    ref, leaves = reference(w, h, b, labels, num_items_in_batch=17)
    ref.backward()
    n = torch.tensor(17) if as_tensor else 17
    out = fused_linear_cross_entropy(w, h, labels, bias=b, num_items_in_batch=n, chunk_tokens=4)
    out.backward()
    assert_close_rel(out, ref, FP32, "loss")
    _grads_close(out, leaves, FP32, w, h, b)


def test_metrics_and_upstream_scale():
    """Token accuracy equals the argmax hit rate of the reference logits; z_loss metric equals
    the z-loss term; a non-unit upstream gradient (x 3) scales every gradient."""
    w, h, b, labels = _inputs(2)
    ref, leaves = reference(w, h, b, labels, z_loss_weight=1e-2)
    (3 * ref).backward()
    out = fused_linear_cross_entropy(w, h, labels, bias=b, z_loss_weight=1e-2,
                                     return_token_accuracy=True, return_z_loss=True, chunk_tokens=4)
    assert isinstance(out, LossOutput)
    (3 * out.loss).backward()
    _grads_close(out, leaves, FP32, w, h, b)
    z = h.detach().double() @ w.detach().double().T + b.detach().double()
    valid = labels != -100
    acc = ((z.argmax(-1) == labels) & valid).sum() / valid.sum()
    assert abs(float(out.metrics["token_accuracy"]) - float(acc)) < 1e-6
    zl = (1e-2 * torch.logsumexp(z, -1) ** 2 * valid).sum() / valid.sum()
    assert_close_rel(out.metrics["z_loss"], zl, FP32, "z_loss")


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_entropy_metric(reduction):
    """return_entropy: the mean softmax entropy of the non-ignored tokens (from the loss's own
    tiles, label smoothing on) within 1e-5 of float64."""
    w, h, b, labels = _inputs(5)
    out = fused_linear_cross_entropy(w, h, labels, bias=b, label_smoothing=0.1, reduction=reduction,
                                     return_entropy=True, chunk_tokens=4)
    z = h.detach().double() @ w.detach().double().T + b.detach().double()
    logp = torch.log_softmax(z, -1)
    valid = labels != -100
    ent = (-(logp.exp() * logp).sum(-1) * valid).sum() / valid.sum()
    assert_close_rel(out.metrics["entropy"], ent, FP32, "entropy")


def test_all_ignored_and_frozen_weight():
    """All labels ignored: loss 0, zero hidden gradient, no NaN. Frozen weight (no grad) and no
    bias: no weight gradient, no error."""
    w, h, _, labels = _inputs(3)
    labels[:] = -100
    w = w.detach()
    out = fused_linear_cross_entropy(w, h, labels)
    out.backward()
    assert out.item() == 0.0 and torch.all(h.grad == 0) and w.grad is None


def test_frozen_weight_grad_hidden():
    """Frozen weight: hidden gradient still within 1e-5 of float64."""
    w, h, b, labels = _inputs(4)
    ref, leaves = reference(w, h, b, labels)
    ref.backward()
    out = fused_linear_cross_entropy(w.detach(), h, labels, bias=b.detach(), chunk_tokens=4)
    out.backward()
    assert_close_rel(h.grad, leaves[1].grad, FP32, "grad_hidden")


def test_bf16_and_autocast():
    """bf16 weight/hidden: loss and gradients within 1e-2 of float64 on the same rounded
    inputs; fp32 inputs under torch.autocast(bf16) likewise, gradients in fp32."""
    w, h, b, labels = _inputs(5, torch.bfloat16)
    ref, leaves = reference(w, h, b, labels)
    ref.backward()
    out = fused_linear_cross_entropy(w, h, labels, bias=b, chunk_tokens=4)
    out.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert_close_rel(out, ref, TOL[torch.bfloat16], "loss")
    _grads_close(out, leaves, TOL[torch.bfloat16], w, h, b)

    w, h, b, labels = _inputs(6)
    ref, leaves = reference(w, h, b, labels)
    ref.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_linear_cross_entropy(w, h, labels, bias=b, chunk_tokens=4, accum_dtype=torch.float32)
    out.backward()
    assert w.grad.dtype == torch.float32
    assert_close_rel(out, ref, TOL[torch.bfloat16], "loss")
    _grads_close(out, leaves, TOL[torch.bfloat16], w, h, b)


def test_module():
    """LigerFusedLinearCrossEntropyLoss(...)(weight, hidden, labels, bias=...) equals the
    function within 1e-6 and returns LossOutput when return_token_accuracy."""
    w, h, b, labels = _inputs(7)
    mod = LigerFusedLinearCrossEntropyLoss(label_smoothing=0.1, return_token_accuracy=True)
    out = mod(w, h, labels, bias=b)
    ref = fused_linear_cross_entropy(w, h, labels, bias=b, label_smoothing=0.1)
    assert rel_err(out.loss, ref) < 1e-6 and "token_accuracy" in out.metrics


def test_bad_inputs():
    """Mismatched H, labels shape, out-of-range labels, bias shape, bad reduction, device-free
    dtype errors and num_items_in_batch misuse raise errors naming the argument."""
    w, h, b, labels = _inputs(8)
    f = fused_linear_cross_entropy
    with pytest.raises(ValueError, match="hidden"):
        f(w, h[..., :3], labels)
    with pytest.raises(ValueError, match="labels"):
        f(w, h, labels[:, :2])
    with pytest.raises(ValueError, match="labels"):
        f(w, h, labels.clamp(min=0) + V)
    with pytest.raises(ValueError, match="bias"):
        f(w, h, labels, bias=b[:3])
    with pytest.raises(ValueError, match="reduction"):
        f(w, h, labels, reduction="avg")
    with pytest.raises(TypeError, match="labels"):
        f(w, h, labels.float())
    with pytest.raises(ValueError, match="num_items_in_batch"):
        f(w, h, labels, reduction="sum", num_items_in_batch=3)
    with pytest.raises(ValueError, match="chunk_tokens"):
        f(w, h, labels, chunk_tokens=0)


@pytest.mark.gpu
def test_gpu_bf16_accuracy_vs_plain():
    """GPU, bf16, N=2048, H=1024, V=32000: gradient errors vs float64 no worse than 2x those of
    plain PyTorch bf16 autograd (logits.float() + F.cross_entropy, as HF does)."""
    dev = "cuda"
    w = (torch.randn(32000, 1024, device=dev) * 0.02).bfloat16()
    h = torch.randn(2048, 1024, device=dev).bfloat16()
    labels = torch.randint(0, 32000, (2048,), device=dev)
    labels[::9] = -100

    def run(fn, dtype):
        wx = w.detach().to(dtype).requires_grad_()
        hx = h.detach().to(dtype).requires_grad_()
        fn(wx, hx).backward()
        return wx.grad, hx.grad

    plain = lambda wx, hx: F.cross_entropy((hx @ wx.T).float(), labels)  # noqa: E731
    ref = run(plain, torch.float64)
    pl = run(plain, torch.bfloat16)
    ours = run(lambda wx, hx: fused_linear_cross_entropy(wx, hx, labels), torch.bfloat16)
    for o, p, r in zip(ours, pl, ref):
        assert rel_err(o, r) <= 2 * max(rel_err(p, r), 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("accum", ["bf16", "fp32"])
@pytest.mark.parametrize("speculative", [True, False], ids=["first-chunk-early", "plain"])
def test_gpu_peak_is_gradients_plus_one_tile(speculative, accum):
    """GPU, bf16, 4 chunks of 512 tokens (V=32000, H=1024), within 2 MiB of the expected peak above
    the inputs during forward + backward (a buffer kept alive across chunks -- the first chunk's
    rows and hidden-gradient rows once did -- shows up here). Weight gradient accumulated in bf16
    (``half_weight_accum_dtype=None``): the two gradients plus one [512, V] logits tile (issue #3's
    bar sits at 1.5x the gradients). In fp32 (the default over several chunks): the fp32
    accumulator and its bf16 cast at the backward (the tile is gone by then) plus the hidden
    gradient."""
    from liger_losses.chunked.config import engine_config

    wide = torch.float32 if accum == "fp32" else None
    with engine_config(speculative_first_chunk=speculative, half_weight_accum_dtype=wide):
        _gpu_peak_check(wide is not None)


def _gpu_peak_check(fp32_accum: bool):
    dev, N, Hs, Vs, chunk = "cuda", 2048, 1024, 32000, 512
    w = (torch.randn(Vs, Hs, device=dev) * 0.02).bfloat16().requires_grad_()
    h = torch.randn(N, Hs, device=dev).bfloat16().requires_grad_()
    labels = torch.randint(0, Vs, (N,), device=dev)
    for _ in range(2):  # warm-up (kernels compiled, allocator pools made)
        torch.autograd.grad(fused_linear_cross_entropy(w, h, labels, chunk_tokens=chunk), (w, h))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(fused_linear_cross_entropy(w, h, labels, chunk_tokens=chunk), (w, h))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    if fp32_accum:
        expected = Vs * Hs * (4 + 2) + N * Hs * 2
    else:
        expected = (Vs * Hs + N * Hs + chunk * Vs) * 2
    assert peak <= expected + 2 * 2**20, (peak / 2**20, expected / 2**20)
    del grads


# --------------------------------------------------------------------------- first chunk before the sync


def _labels_with(valid_count, total=64, seed=3):
    """[4, 16] labels with ``valid_count`` non-ignored tokens at random positions."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.full((total,), -100, dtype=torch.long)
    pos = torch.randperm(total, generator=g)[:valid_count]
    labels[pos] = torch.randint(0, V, (valid_count,), generator=g)
    return labels.view(4, total // 4)


@pytest.mark.parametrize("valid_count", [64, 40, 16, 7, 0],
                         ids=["none-ignored", "chunk1-full", "exactly-chunk1", "chunk1-padded", "all-ignored"])
@pytest.mark.parametrize("options", ["plain", "smoothing-zloss-items-bias"])
def test_speculative_first_chunk_equals_plain_path(valid_count, options, monkeypatch):
    """EngineConfig.speculative_first_chunk (the first 16-token chunk issued before the labels' host sync,
    padded with ignored rows when fewer tokens are valid) gives bitwise the loss, the gradients of
    hidden, weight and bias, and the metrics of the plain path (same fixed chunks, fp32), with every
    token valid, more or fewer valid tokens than one chunk, and none; within 1e-6 when the first
    chunk is padded (its GEMMs' inner dimension differs); the loss within 1e-5 of float64."""
    w, h, b, _ = _inputs(seed=4)
    h = torch.randn(4, 16, H).requires_grad_()
    labels = _labels_with(valid_count)
    kw = dict(chunk_tokens=16, return_token_accuracy=True, return_z_loss=True, return_entropy=True)
    if options != "plain":
        kw.update(bias=b, label_smoothing=0.1, z_loss_weight=1e-3, num_items_in_batch=50)
    leaves = (w, h, b) if options != "plain" else (w, h)

    def run():
        out = fused_linear_cross_entropy(w, h, labels, **kw)
        grads = torch.autograd.grad(out.loss, leaves)
        return (out.loss.detach(), *grads, *(out.metrics[k] for k in sorted(out.metrics)))

    results = _both_paths(monkeypatch, run)
    for got, want in zip(*results):
        if 0 < valid_count < 16:  # the padded first chunk's GEMMs sum over 16 rows, not 7: rounding
            assert_close_rel(got, want, 1e-6, "speculative vs plain")
        else:
            assert torch.equal(got, want)
    ref_loss, leaves = reference(w, h, kw.get("bias"), labels, label_smoothing=kw.get("label_smoothing", 0.0),
                                 z_loss_weight=kw.get("z_loss_weight", 0.0),
                                 num_items_in_batch=kw.get("num_items_in_batch"))
    assert_close_rel(results[0][0], ref_loss, FP32, "loss vs float64")


def test_speculative_first_chunk_rejects_labels_out_of_range():
    """A label >= V among the first chunk's tokens (issued before the range check): ValueError
    naming the labels, no out-of-range read in the kernel."""
    w, h, _, _ = _inputs()
    h = torch.randn(4, 16, H).requires_grad_()
    labels = _labels_with(40)
    flat = labels.view(-1)
    flat[(flat != -100).nonzero()[0]] = V + 3
    with pytest.raises(ValueError, match="labels must be in"):
        fused_linear_cross_entropy(w, h, labels, chunk_tokens=16)


def _both_paths(monkeypatch, fn):
    """``[fn() with speculative_first_chunk on, fn() with it off]``."""
    from liger_losses.chunked.config import engine_config

    out = []
    for speculate in (True, False):
        with engine_config(speculative_first_chunk=speculate):
            out.append(fn())
    return out


def test_speculative_first_chunk_never_reads_ignored_rows(monkeypatch):
    """Hidden states at ignored positions are never used, as on the plain path: NaN there (fully
    masked padding rows can be NaN) leaves the loss and every gradient finite and within 1e-6 of the
    plain path when the first chunk is padded (3 valid tokens of 64, 16-token chunks)."""
    calls = count_speculative_passes(monkeypatch)
    w, _, b, _ = _inputs(seed=4)
    labels = _labels_with(3)
    labels.view(-1)[0] = -100  # the padded rows of the first chunk point at flat row 0
    h = torch.randn(4, 16, H)
    h.view(-1, H)[labels.view(-1) == -100] = float("nan")
    h.requires_grad_()

    def run():
        loss = fused_linear_cross_entropy(w, h, labels, bias=b, chunk_tokens=16)
        return (loss.detach(), *torch.autograd.grad(loss, (w, h, b)))

    fast, plain = _both_paths(monkeypatch, run)
    assert calls, "the speculative path was not taken"
    for name, f, p in zip(("loss", "grad_weight", "grad_hidden", "grad_bias"), fast, plain):
        assert torch.isfinite(f).all(), f"{name} not finite"
        assert_close_rel(f, p, 1e-6, name)


@pytest.mark.parametrize("ignore_index", [0, V - 1, V + 3])
@pytest.mark.parametrize("valid_count", [40, 3])
def test_speculative_first_chunk_other_ignore_index(ignore_index, valid_count, monkeypatch):
    """An ignore_index other than -100 (inside [0, V) too: the padded rows get it as their label)
    gives the plain path's loss and gradients within 1e-6, and the loss within 1e-5 of float64."""
    calls = count_speculative_passes(monkeypatch)
    w, _, _, _ = _inputs(seed=5)
    h = torch.randn(4, 16, H).requires_grad_()
    labels = _labels_with(valid_count, seed=valid_count)
    valid = labels != -100
    labels[valid & (labels == ignore_index)] = (ignore_index + 1) % V
    labels[~valid] = ignore_index

    def run():
        loss = fused_linear_cross_entropy(w, h, labels, ignore_index=ignore_index, chunk_tokens=16)
        return (loss.detach(), *torch.autograd.grad(loss, (w, h)))

    fast, plain = _both_paths(monkeypatch, run)
    assert calls
    for f, p in zip(fast, plain):
        assert_close_rel(f, p, 1e-6, "speculative vs plain")
    ref, _ = reference(w, h, None, torch.where(labels == ignore_index, -100, labels))
    assert_close_rel(fast[0], ref, FP32, "loss vs float64")


@pytest.mark.parametrize("where", ["first", "later"])
@pytest.mark.parametrize("bad", [V, -1])
def test_speculative_first_chunk_rejects_out_of_range_with_ignore_index_0(where, bad, monkeypatch):
    """ignore_index=0 and a label out of [0, V) in or after the first chunk: ValueError naming the
    labels (the first chunk was already issued with that row as ignored: no out-of-range read)."""
    calls = count_speculative_passes(monkeypatch)
    w, _, _, _ = _inputs()
    h = torch.randn(4, 16, H)
    labels = _labels_with(40)
    labels[labels == 0] = 1
    labels[labels == -100] = 0
    pos = (labels.view(-1) != 0).nonzero().squeeze(1)
    labels.view(-1)[pos[1] if where == "first" else pos[-1]] = bad
    with pytest.raises(ValueError, match="labels must be in"):
        fused_linear_cross_entropy(w, h, labels, ignore_index=0, chunk_tokens=16)
    assert calls


@pytest.mark.parametrize("case", ["frozen-weight", "hidden-no-grad", "int32-1d", "shifted-views",
                                  "accum-fp64", "budget-chunks"])
@pytest.mark.parametrize("valid_count", [64, 3])
def test_speculative_first_chunk_variants(case, valid_count, monkeypatch):
    """Frozen weight, hidden without grad, int32 1-D labels, non-contiguous shifted views
    (hidden[:, :-1], labels[:, 1:]), an fp64 accumulator, budget-derived chunks: the speculative
    path (taken: asserted) equals the plain path within 1e-6 in the loss and each gradient asked for."""
    import contextlib

    from liger_losses.chunked.config import engine_config

    calls = count_speculative_passes(monkeypatch)
    budget = contextlib.nullcontext()
    w, _, _, _ = _inputs(seed=6)
    kw = dict(chunk_tokens=16)
    hfull = torch.randn(4, 17, H)
    lab = torch.cat([torch.full((4, 1), -100), _labels_with(valid_count, seed=1)], 1)
    h, labels = hfull[:, 1:], lab[:, 1:]
    if case == "frozen-weight":
        w, h = w.detach(), h.clone().requires_grad_()
        leaves = (h,)
    elif case == "hidden-no-grad":
        h, leaves = h.clone(), (w,)
    elif case == "int32-1d":
        h = h.reshape(64, H).clone().requires_grad_()
        labels, leaves = labels.reshape(64).to(torch.int32), (w, h)
    elif case == "shifted-views":
        hfull.requires_grad_()
        h, labels, leaves = hfull[:, :-1], lab[:, 1:], (w, hfull)
    elif case == "accum-fp64":
        h = h.clone().requires_grad_()
        kw["accum_dtype"], leaves = torch.float64, (w, h)
    else:  # budget-derived chunks of 16 rows
        budget = engine_config(default_budget_bytes=16 * V * 4, weight_budget_fraction=0.0)
        kw, h = {}, h.clone().requires_grad_()
        leaves = (w, h)

    def run():
        loss = fused_linear_cross_entropy(w, h, labels, **kw)
        return (loss.detach(), *torch.autograd.grad(loss, leaves))

    with budget:
        fast, plain = _both_paths(monkeypatch, run)
    assert calls
    for f, p in zip(fast, plain):
        assert_close_rel(f, p, 1e-6, case)
