"""Tests of liger_losses/kernels/logits_tile.py: row statistics and in-place gradients of a tile.

Reference: float64 PyTorch autograd written plainly below. Bars (tests/helpers.py): fp32 1e-5,
bf16 1e-2 relative error, on outputs and the gradient.
"""

import pytest
import torch

from liger_losses.kernels.logits_tile import logits_tile
from tests.helpers import TOL, assert_close_rel

IMPLS = ["torch", "triton"]
OPTIONS = [
    {},
    {"softcap": 2.0, "logit_scale": 1.5, "temperature": 0.7},
    {"label_smoothing": 0.1, "z_loss_weight": 1e-2},
    {"label_smoothing": 0.2, "class_weight": "rand"},
]


def reference(x, labels, mode, grad_scale, *, logit_scale=1.0, softcap=None, temperature=1.0,
              label_smoothing=0.0, z_loss_weight=0.0, class_weight=None, ignore_index=-100):
    """float64 per-row loss, lse, logp, entropy, log_sum_sq, logits_sum and d(sum scale*loss)/dx."""
    xd = x.detach().double().requires_grad_()
    y = xd * logit_scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    z = y / temperature
    V = z.shape[1]
    valid = labels != ignore_index
    safe = labels.clamp(min=0)
    lp = torch.log_softmax(z, 1)
    lpy = lp.gather(1, safe[:, None]).squeeze(1)
    lse = torch.logsumexp(z, 1)
    if mode == "ce":
        w = class_weight.double() if class_weight is not None else torch.ones(V, dtype=torch.float64)
        eps = label_smoothing
        loss = (1 - eps) * w[safe] * (-lpy) + eps / V * (-(lp * w).sum(1)) + z_loss_weight * lse**2
    else:
        loss = lpy
    loss = torch.where(valid, loss, 0.0)
    (loss * grad_scale.double()).sum().backward()
    p = lp.exp()
    ent = torch.where(valid, -(p * lp).sum(1), 0.0)
    return dict(
        loss=loss.detach(), lse=torch.where(valid, lse, 0.0).detach(),
        logp=torch.where(valid, lpy, 0.0).detach(), entropy=ent.detach(),
        log_sum_sq=torch.where(valid, (p * p).sum(1).log(), 0.0).detach(),
        logits_sum=torch.where(valid, z.sum(1), 0.0).detach(),
        correct=(z.argmax(1) == labels) & valid, grad=xd.grad,
    )


def _inputs(n, V, dtype=torch.float32):
    x = (torch.randn(n, V) * 3).to(dtype)
    labels = torch.randint(0, V, (n,))
    labels[1] = -100
    return x, labels


@pytest.fixture(params=[4096, 0], ids=["lane-sums", "block-sums"])
def vec_sums_max_block(request):
    """Both pass-1 sum paths of the Triton kernel: per-lane sums (blocks up to
    ``vec_sums_max_block``, the default) and per-block sums (larger blocks on the GPU)."""
    from liger_losses.kernels import logits_tile as lt

    with lt.LOGITS_TILE_TUNING.override(vec_sums_max_block=request.param):
        yield request.param


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["ce", "logp"])
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_matches_fp64_reference(impl, mode, opt, vec_sums_max_block):
    """Every statistic (``log sum p^2`` included) and the in-place gradient (with a per-row scale) match float64 within
    1e-5 (fp32) for each option set, with either pass-1 sum path; ignored rows give zeros."""
    kw = dict(OPTIONS[opt])
    if kw.get("class_weight") == "rand":
        kw["class_weight"] = torch.rand(300) + 0.5
    x, labels = _inputs(7, 300)
    scale = torch.rand(7)
    ref = reference(x, labels, mode, scale, **kw)
    tile = x.clone()
    st = logits_tile(tile, labels, mode=mode, grad_scale=scale, need_entropy=True, need_log_sum_sq=True, impl=impl,
                     **kw)
    for k in ("loss", "lse", "logp", "entropy", "log_sum_sq", "logits_sum"):
        assert_close_rel(getattr(st, k), ref[k], TOL[torch.float32], k)
    assert torch.equal(st.correct, ref["correct"])
    assert_close_rel(tile, ref["grad"], TOL[torch.float32], "grad")
    assert torch.all(tile[1] == 0) and st.loss[1] == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_multiple_blocks_and_row_stride(impl, vec_sums_max_block):
    """V larger than one block (1500 > 1024 in the interpreter) and a tile that is a column
    slice of a wider buffer (row stride != V): stats/grad within 1e-5, the rest untouched."""
    V = 1500
    buf = torch.randn(3, V + 17) * 2
    labels = torch.tensor([5, 1499, 700])
    tile = buf[:, :V]
    ref = reference(tile, labels, "ce", torch.ones(3), label_smoothing=0.05)
    tail = buf[:, V:].clone()
    st = logits_tile(tile, labels, mode="ce", label_smoothing=0.05, impl=impl)
    assert_close_rel(st.loss, ref["loss"], TOL[torch.float32], "loss")
    assert_close_rel(tile, ref["grad"], TOL[torch.float32], "grad")
    assert torch.equal(buf[:, V:], tail)


@pytest.mark.parametrize("mode", ["ce", "logp"])
def test_ignored_rows_zero_gradient_whatever_their_logits(mode):
    """Rows with ``ignore_index`` get an exact zero gradient row and zero statistics even when
    their logits are NaN/inf (the Triton kernel does not read them), with softcap and smoothing:
    nothing non-finite leaks from a padded position into the gradient."""
    x, labels = _inputs(4, 300)
    x[1, :7] = float("nan")
    x[1, 7:] = float("inf")
    tile = x.clone()
    st = logits_tile(tile, labels, mode=mode, softcap=5.0, label_smoothing=0.1 if mode == "ce" else 0.0,
                     need_entropy=True, impl="triton")
    assert torch.all(tile[1] == 0)
    assert torch.isfinite(tile).all()
    for k in ("loss", "lse", "logp", "entropy"):
        assert getattr(st, k)[1] == 0, k


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_tile(impl):
    """A bf16 tile: fp32 math in registers, stats within 1e-5 of float64 on the same (rounded)
    input, gradient within 1e-2 (bf16 storage of the gradient)."""
    x, labels = _inputs(6, 257, torch.bfloat16)
    ref = reference(x.float(), labels, "logp", torch.full((6,), 0.5), softcap=5.0)
    tile = x.clone()
    st = logits_tile(tile, labels, mode="logp", grad_scale=0.5, softcap=5.0, impl=impl)
    assert tile.dtype == torch.bfloat16
    assert_close_rel(st.logp, ref["logp"], TOL[torch.float32], "logp")
    assert_close_rel(tile, ref["grad"], TOL[torch.bfloat16], "grad")


@pytest.mark.parametrize("impl", IMPLS)
def test_no_grad_mode_keeps_tile(impl):
    """grad=False computes the statistics and leaves the tile bit-identical."""
    x, labels = _inputs(4, 100)
    tile = x.clone()
    st = logits_tile(tile, labels, mode="logp", grad=False, impl=impl)
    assert torch.equal(tile, x)
    ref = reference(x, labels, "logp", torch.ones(4))
    assert_close_rel(st.logp, ref["logp"], TOL[torch.float32], "logp")


def test_argmax_hits_while_torch_compile_traces(monkeypatch):
    """While torch.compile traces, the Triton path writes the argmax hits into int8 and returns
    them converted (Inductor cannot lower a bool tensor's dtype view): the same bool tensor and
    the same statistics as the eager path's view (exact)."""
    import liger_losses.kernels.logits_tile as lt

    x, labels = _inputs(6, 300)
    labels[0], labels[2] = x[0].argmax(), x[2].argmax()  # two hits among misses and an ignored row
    eager = logits_tile(x.clone(), labels, mode="ce", grad=False, impl="triton")
    monkeypatch.setattr(lt, "is_compiling", lambda: True)
    traced = logits_tile(x.clone(), labels, mode="ce", grad=False, impl="triton")
    assert traced.correct.dtype == torch.bool and torch.equal(traced.correct, eager.correct)
    assert eager.correct.any() and torch.equal(traced.loss, eager.loss)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["ce", "logp"])
def test_out_buffer_and_no_logits_sum(impl, mode):
    """``out=``: the gradient lands in ``out`` (within 1e-5 of float64) and the tile -- here a
    row-strided column slice -- is left bit-identical. ``need_logits_sum=False`` returns
    ``logits_sum=None`` and the same other statistics, label smoothing included (it needs the
    row sum internally)."""
    V = 1500  # several blocks in the interpreter
    buf = torch.randn(4, V + 9) * 2
    labels = torch.tensor([3, -100, 1499, 42])
    tile = buf[:, :V]
    before = buf.clone()
    kw = dict(label_smoothing=0.1) if mode == "ce" else {}
    ref = reference(tile, labels, mode, torch.full((4,), 0.7), **kw)
    out = torch.full((4, V), float("nan"))
    st = logits_tile(tile, labels, mode=mode, grad_scale=0.7, need_logits_sum=False, out=out,
                     impl=impl, **kw)
    assert torch.equal(buf, before)
    assert st.logits_sum is None
    assert_close_rel(out, ref["grad"], TOL[torch.float32], "grad")
    for k in ("loss", "lse", "logp"):
        assert_close_rel(getattr(st, k), ref[k], TOL[torch.float32], k)


def test_out_buffer_bad_inputs():
    """``out`` of the wrong shape/dtype/stride, or with grad=False, raises naming ``out``."""
    x, labels = _inputs(3, 20)
    for bad in (torch.empty(3, 21), torch.empty(3, 20, dtype=torch.float64), torch.empty(20, 3).t()):
        with pytest.raises(ValueError, match="out must"):
            logits_tile(x, labels, out=bad)
    with pytest.raises(ValueError, match="out is only written"):
        logits_tile(x, labels, grad=False, out=torch.empty(3, 20))


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_labels_count_as_ignored(impl):
    """Labels outside [0, V) (which callers reject, after queueing the kernel) give the rows of
    ignored ones -- zero statistics and a zero gradient row -- and nothing is read out of bounds;
    the other rows are untouched by them (within 1e-5 of float64)."""
    x, labels = _inputs(5, 40)
    labels[1], labels[3] = -7, 40
    tile = x.clone()
    st = logits_tile(tile, labels, need_entropy=True, impl=impl)
    for r in (1, 3):
        assert torch.all(tile[r] == 0) and st.loss[r] == 0 and not st.correct[r]
    keep = torch.tensor([0, 2, 4])
    ref = reference(x[keep], labels[keep], "ce", torch.ones(3))
    assert_close_rel(st.loss[keep], ref["loss"], TOL[torch.float32], "loss")
    assert_close_rel(tile[keep], ref["grad"], TOL[torch.float32], "grad")


def test_triton_and_torch_agree_all_ignored():
    """All rows ignored: zeros everywhere, no NaN, in both implementations."""
    x, _ = _inputs(3, 50)
    labels = torch.full((3,), -100)
    for impl in IMPLS:
        tile = x.clone()
        st = logits_tile(tile, labels, need_entropy=True, impl=impl)
        assert torch.all(tile == 0)
        for k in ("loss", "lse", "logp", "entropy", "logits_sum"):
            assert torch.all(getattr(st, k) == 0), k


def test_bad_inputs():
    """Wrong rank, mismatched rows, integer tile, bad mode/options, wrong scale shape raise
    ValueError/TypeError naming the argument."""
    x, labels = _inputs(4, 20)
    with pytest.raises(ValueError, match="logits"):
        logits_tile(x[0], labels)
    with pytest.raises(ValueError, match="labels"):
        logits_tile(x, labels[:3])
    with pytest.raises(TypeError, match="logits"):
        logits_tile(x.long(), labels)
    with pytest.raises(TypeError, match="labels"):
        logits_tile(x, labels.float())
    with pytest.raises(ValueError, match="mode"):
        logits_tile(x, labels, mode="kl")
    with pytest.raises(ValueError, match="temperature"):
        logits_tile(x, labels, temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        logits_tile(x, labels, softcap=-1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        logits_tile(x, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="grad_scale"):
        logits_tile(x, labels, grad_scale=torch.ones(3))
    with pytest.raises(ValueError, match="class_weight"):
        logits_tile(x, labels, class_weight=torch.ones(7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_large_vocab(dtype):
    """Compiled kernel on the GPU, V=128256 (many blocks): stats within 1e-5 of float64,
    gradient within the dtype's bar."""
    x = (torch.randn(64, 128256, device="cuda") * 2).to(dtype)
    labels = torch.randint(0, 128256, (64,), device="cuda")
    labels[3] = -100
    ref = reference(x.float().cpu(), labels.cpu(), "ce", torch.ones(64), label_smoothing=0.1,
                    z_loss_weight=1e-4)
    tile = x.clone()
    st = logits_tile(tile, labels, label_smoothing=0.1, z_loss_weight=1e-4, need_entropy=True, need_log_sum_sq=True)
    assert_close_rel(st.loss.cpu(), ref["loss"], TOL[torch.float32], "loss")
    assert_close_rel(st.entropy.cpu(), ref["entropy"], TOL[torch.float32], "entropy")
    assert_close_rel(st.log_sum_sq.cpu(), ref["log_sum_sq"], TOL[torch.float32], "log_sum_sq")
    assert_close_rel(tile.float().cpu(), ref["grad"], TOL[dtype], "grad")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_argmax_hit_is_the_first_maximal_column(impl, softcap, vec_sums_max_block):
    """Exact ties of the row maximum (bf16 logits tie often; identical head rows always): the label
    is a hit only when it is the first maximal column, as ``torch.argmax`` and TRL's token accuracy
    count it -- a label tying an earlier column (in its block or an earlier one) is a miss, one
    tying only later columns a hit. Compared exactly with ``argmax`` of the transformed logits."""
    V = 2500  # three blocks in the interpreter (1024 columns a block; the last, from 2048, partial)
    x = (torch.randn(11, V, generator=torch.Generator().manual_seed(7)) * 2).to(torch.bfloat16)
    top = x.float().max().item() + 4.0
    ties = {0: (5, 2100), 1: (2100, 5), 2: (300, 301), 3: (301, 300), 4: (1023, 1024), 5: (1024, 1023),
            8: (0, 7), 9: (V - 1, 2049), 10: (2048, 2049)}
    labels = torch.empty(11, dtype=torch.long)
    for row, (first, second) in ties.items():  # the label at `first`, the same maximum at `second`
        x[row, first] = x[row, second] = top
        labels[row] = first
    labels[6] = int(x[6].float().argmax())  # a unique maximum: a hit
    labels[7] = -100
    st = logits_tile(x.clone(), labels, mode="ce", grad=False, softcap=softcap, impl=impl)
    z = x.double() if softcap is None else softcap * torch.tanh(x.double() / softcap)
    want = (z.argmax(1) == labels) & (labels != -100)
    assert want.tolist() == [True, False, True, False, True, False, True, False, True, False, True]
    assert torch.equal(st.correct, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_label_at_minus_inf_is_never_a_hit(impl):
    """A label whose logit is -inf is a miss on every path, also in a row of all -inf (whose loss is NaN
    and whose ``argmax`` is column 0): the kernel's running maximum starts above -inf, the PyTorch path
    says so explicitly. A finite label beside -inf columns is a hit as usual. Exact."""
    x = torch.randn(4, 40)
    x[0] = float("-inf")  # all -inf, label 0
    x[1] = float("-inf")  # all -inf, label 5
    x[2, :10] = float("-inf")  # label 3 at -inf, the maximum elsewhere
    x[3, 1:] = float("-inf")  # only the label's column finite
    labels = torch.tensor([0, 5, 3, 0])
    st = logits_tile(x.clone(), labels, mode="ce", grad=False, impl=impl)
    assert st.correct.tolist() == [False, False, False, True]
