"""Tests of liger_losses/kernels/logits_tile_split.py: the logits tile with each row split over
several programs (one read per logit).

Reference: the float64 autograd reference of tests/kernels/test_logits_tile.py. Bars
(tests/helpers.py): fp32 1e-5, bf16 1e-2 relative error, on every statistic and the gradient.
On the CPU the interpreter runs the ``two_pass`` phase with several slices per row (forced by a
small ``SEG``) and the ``fused`` phase with one slice (its per-row meeting then waits for nobody:
the interpreter runs programs one after another). The fused phase with many slices, its meeting
between programs, runs in the ``gpu`` tests.
"""

import pytest
import torch

from liger_losses.kernels import logits_tile_split as split_mod
from liger_losses.kernels.logits_tile import logits_tile
from tests.helpers import TOL, assert_close_rel
from tests.kernels.test_logits_tile import OPTIONS, reference

STATS = ("loss", "lse", "logp", "entropy", "logits_sum")


@pytest.fixture
def split(monkeypatch):
    """Force the split kernel: slices of ``seg`` columns, the given phase."""

    def set_split(seg, phase=None, min_splits=2):
        monkeypatch.setattr(split_mod, "SEG", seg)
        monkeypatch.setattr(split_mod, "PHASE", phase)
        monkeypatch.setattr(split_mod, "MIN_SPLITS", min_splits)

    return set_split


def _options(opt, V, device="cpu"):
    kw = dict(OPTIONS[opt])
    if kw.get("class_weight") == "rand":
        kw["class_weight"] = torch.rand(V, device=device) + 0.5
    return kw


def _check(st, tile, ref, grad_tol=TOL[torch.float32]):
    for k in STATS:
        assert_close_rel(getattr(st, k).cpu(), ref[k], TOL[torch.float32], k)
    assert torch.equal(st.correct.cpu(), ref["correct"])
    assert_close_rel(tile.float().cpu(), ref["grad"], grad_tol, "grad")


@pytest.mark.parametrize("mode", ["ce", "logp"])
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
@pytest.mark.parametrize("seg", [64, 128])
def test_two_pass_several_slices_match_fp64(split, mode, opt, seg):
    """V = 300 cut into 5 (seg 64, last slice partial) or 3 slices: every statistic, the argmax
    hit and the in-place gradient (per-row scale) within 1e-5 of float64, for each option set
    (softcap + scale + temperature, smoothing + z-loss, class weights); ignored rows zero."""
    split(seg)
    x = torch.randn(7, 300) * 3
    labels = torch.randint(0, 300, (7,))
    labels[1] = -100
    labels[4] = 299  # the label in the last, partial slice
    kw = _options(opt, 300)
    scale = torch.rand(7)
    ref = reference(x, labels, mode, scale, **kw)
    tile = x.clone()
    st = logits_tile(tile, labels, mode=mode, grad_scale=scale, need_entropy=True, impl="triton", **kw)
    _check(st, tile, ref)
    assert torch.all(tile[1] == 0) and st.loss[1] == 0


@pytest.mark.parametrize("mode", ["ce", "logp"])
def test_fused_one_slice_matches_fp64(split, mode):
    """The fused phase (one launch, ticket order, per-row meeting) with one slice per row, which
    the interpreter can run: the same statistics and gradient within 1e-5 of float64."""
    split(512, phase="fused", min_splits=1)
    x = torch.randn(5, 300) * 3
    labels = torch.tensor([0, -100, 299, 17, 150])
    ref = reference(x, labels, mode, torch.full((5,), 0.5), label_smoothing=0.1 if mode == "ce" else 0.0)
    tile = x.clone()
    st = logits_tile(tile, labels, mode=mode, grad_scale=0.5, need_entropy=True, impl="triton",
                     label_smoothing=0.1 if mode == "ce" else 0.0)
    _check(st, tile, ref)


def test_out_buffer_row_stride_bf16(split):
    """A bf16 column slice of a wider buffer (row stride != V) with ``out=``: the tile and the
    buffer's tail stay bit-identical, statistics within 1e-5 of float64 on the rounded input, the
    gradient within 1e-2 (bf16 storage)."""
    split(64)
    V = 257
    buf = (torch.randn(4, V + 9) * 2).bfloat16()
    labels = torch.tensor([3, -100, 256, 42])
    tile = buf[:, :V]
    before = buf.clone()
    ref = reference(tile.float(), labels, "ce", torch.full((4,), 0.7), softcap=4.0)
    out = torch.full((4, V), float("nan"), dtype=torch.bfloat16)
    st = logits_tile(tile, labels, grad_scale=0.7, softcap=4.0, need_entropy=True, out=out, impl="triton")
    assert torch.equal(buf, before)
    _check(st, out, ref, grad_tol=TOL[torch.bfloat16])


def test_ignored_rows_never_read(split):
    """An ignored row full of NaN/inf gives an exact zero gradient row and zero statistics: the
    split kernel does not read it either."""
    split(64)
    x = torch.randn(3, 300)
    x[1] = float("nan")
    labels = torch.tensor([4, -100, 7])
    tile = x.clone()
    st = logits_tile(tile, labels, softcap=5.0, label_smoothing=0.1, need_entropy=True, impl="triton")
    assert torch.all(tile[1] == 0) and torch.isfinite(tile).all()
    for k in STATS:
        assert getattr(st, k)[1] == 0, k


def test_split_phase_choice(split, monkeypatch):
    """Which kernel ``logits_tile`` takes: the split one from ``MIN_SPLITS`` slices up, never with
    ``SEG = 0``, the interpreter's ``two_pass`` on the CPU, ``fused`` on a GPU only while a row has
    at most one slice per SM (its programs must all be resident to meet)."""
    split(8192)
    cpu = torch.device("cpu")
    assert split_mod.split_phase(8192, cpu) is None  # one slice
    assert split_mod.split_phase(8193, cpu) == "two_pass"
    assert split_mod.split_settings(128256) == (8192, 16)
    monkeypatch.setattr(split_mod, "num_sms", lambda device: 8)
    cuda = torch.device("cuda", 0)
    assert split_mod.split_phase(8 * 8192, cuda) == "fused"
    assert split_mod.split_phase(8 * 8192 + 1, cuda) is None  # 9 slices > 8 SMs
    split(0)
    assert split_mod.split_phase(10**6, cpu) is None
    with pytest.raises(ValueError, match="phase"):
        split_mod.split_logits_tile(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long), phase="x",
                                    **dict.fromkeys(_LAUNCH_KEYS))


_LAUNCH_KEYS = (
    "g", "scale_ptr", "scale_value", "cw_arg", "loss", "lse", "logp", "ent", "correct", "lsum",
    "ignore_index", "logit_scale", "inv_temp", "softcap", "eps", "z_w", "mode_ce", "grad",
    "per_row", "has_softcap", "has_cw", "need_ent", "need_lsum",
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["ce", "logp"])
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_gpu_fused_matches_fp64(mode, opt, dtype):
    """The default GPU path at V = 128256 (32 slices of 4096 meeting per row, ticket order):
    every statistic within 1e-5 of float64, the gradient within the dtype's bar, per option set."""
    V = 128256
    assert split_mod.split_phase(V, torch.device("cuda")) == "fused"
    x = (torch.randn(48, V, device="cuda") * 2).to(dtype)
    labels = torch.randint(0, V, (48,), device="cuda")
    labels[3] = -100
    labels[5] = V - 1
    kw = _options(opt, V, "cuda")
    scale = torch.rand(48, device="cuda")
    ref_kw = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in kw.items()}
    ref = reference(x.float().cpu(), labels.cpu(), mode, scale.cpu(), **ref_kw)
    tile = x.clone()
    st = logits_tile(tile, labels, mode=mode, grad_scale=scale, need_entropy=True, **kw)
    _check(st, tile, ref, grad_tol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("V", [128256, 151936, 32000, 262144])
def test_gpu_fused_many_rows_deterministic(V):
    """Many rows (more programs than fit on the device at once, so programs wait on rows whose
    other slices start later): the fused phase finishes, equals the two-pass phase bitwise (same
    arithmetic, only the meeting differs), twice in a row, and matches the row kernel within 1e-5."""
    n = 4096
    x = torch.randn(n, V, device="cuda", dtype=torch.bfloat16) * 2
    labels = torch.randint(0, V, (n,), device="cuda")
    labels[::7] = -100
    outs = []
    for phase in ("fused", "fused", "two_pass"):
        split_mod.PHASE = phase
        try:
            g = torch.empty_like(x)
            st = logits_tile(x, labels, label_smoothing=0.1, out=g)
        finally:
            split_mod.PHASE = None
        outs.append((st, g))
    for st, g in outs[1:]:
        assert torch.equal(g, outs[0][1])
        assert torch.equal(st.loss, outs[0][0].loss)
    seg = split_mod.SEG
    split_mod.SEG = 0  # the one-program-per-row kernel
    try:
        g_row = torch.empty_like(x)
        st_row = logits_tile(x, labels, label_smoothing=0.1, out=g_row)
    finally:
        split_mod.SEG = seg
    assert_close_rel(outs[0][0].loss, st_row.loss, TOL[torch.float32], "loss")
    assert_close_rel(outs[0][1].float(), g_row.float(), TOL[torch.bfloat16], "grad")


@pytest.mark.gpu
def test_gpu_fused_in_cuda_graph():
    """Captured in a CUDA graph and replayed: the zeroed counters are part of the graph, so every
    replay meets afresh and gives the eager result bitwise."""
    V = 128256
    x = torch.randn(256, V, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (256,), device="cuda")
    g = torch.empty_like(x)
    eager = logits_tile(x, labels, out=g).loss.clone()
    g_eager = g.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        logits_tile(x, labels, out=g)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st = logits_tile(x, labels, out=g)
    for _ in range(3):
        g.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(st.loss, eager) and torch.equal(g, g_eager)
