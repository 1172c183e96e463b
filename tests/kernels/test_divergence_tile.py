"""Tests of liger_losses/kernels/divergence_tile.py: per-row KL / JSD (+ hard CE) and the in-place student
gradient, Triton (interpreter on CPU) and PyTorch paths, against float64 autograd references written here, and
against TRL's own functions (GKD ``generalized_jsd_loss``; server-distillation ``_jsd_divergence``).

Tiny shapes (n <= 7, V <= 200) with ``block_size=64`` so that rows span several column blocks.
Every Triton test runs twice: with the kernel's pass-1 sums reduced per block (the default) and kept
per lane (``LANE_SUMS``, off by default until timed on a GPU).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_losses.kernels import divergence_tile as dt
from liger_losses.kernels.divergence_tile import DivergenceTileStats as DivStats
from liger_losses.kernels.divergence_tile import divergence_tile
from tests.helpers import TOL, rel_err

IMPLS = ["triton", "torch"]
FP32 = TOL[torch.float32]


@pytest.fixture(autouse=True, params=[False, True], ids=["block-sums", "lane-sums"])
def lane_sums(request):
    """Both pass-1 sum layouts of the Triton kernel (the PyTorch path has one: run it once)."""
    callspec = getattr(request.node, "callspec", None)
    if request.param and callspec is not None and callspec.params.get("impl") == "torch":
        pytest.skip("the PyTorch path has no lane sums")
    with dt.DIVERGENCE_TILE_TUNING.override(lane_sums=request.param):
        yield


# --------------------------------------------------------------------------- float64 references


def _div_terms(ls, lt, mode, beta):
    """Elementwise divergence terms on log-probs (TRL's conventions), float64, differentiable."""
    ps, pt = ls.exp(), lt.exp()
    if mode == 0:
        return pt * (lt - ls)
    if mode == 1:
        return ps * (ls - lt)
    m = (1 - beta) * ps + beta * pt
    # where both probabilities underflow (m == 0) every term is 0 (a guarded log keeps autograd free of 0 * inf)
    log_m = torch.log(torch.where(m > 0, m, torch.ones_like(m)))
    return beta * pt * (lt - log_m) + (1 - beta) * ps * (ls - log_m)


def _mode(divergence, beta):
    return {"forward_kl": 0, "reverse_kl": 1}.get(divergence, 0 if beta == 0 else 1 if beta == 1 else 2)


def reference(student, teacher=None, labels=None, *, divergence="jsd", beta=0.5, temperature=1.0,
              teacher_vocab="renormalize", hard_weight=0.0, soft_weight=1.0, scale=None,
              topk_logprobs=None, topk_indices=None, topk_tail=True, ignore_index=-100):
    """(per-row loss, divergence, ce, entropy, grad of sum(scale * loss) w.r.t. student), all float64."""
    s = student.detach().double().requires_grad_(True)
    vs = s.shape[1]
    mode = _mode(divergence, beta)
    ls = torch.log_softmax(s / temperature, -1)
    if topk_logprobs is None:
        t = teacher.double() / temperature
        t = t[:, :vs] if teacher_vocab == "renormalize" else t
        lt = torch.log_softmax(t, -1)[:, :vs]
        div = _div_terms(ls, lt, mode, beta).sum(-1)
    else:
        valid = topk_logprobs > -math.inf
        idx = torch.where(valid, topk_indices, 0)
        ls_k = torch.where(valid, ls.gather(1, idx), -math.inf)
        lt_k = torch.where(valid, topk_logprobs.double(), -math.inf)
        if topk_tail:
            def add_tail(x):
                lsum = torch.logsumexp(x, -1, keepdim=True).clamp(max=-1e-7)
                return torch.cat([x, torch.log(-torch.expm1(lsum))], -1)

            ls_k, lt_k = add_tail(ls_k), add_tail(lt_k)
            valid = torch.cat([valid, torch.ones_like(valid[:, :1])], -1)
        else:
            ls_k = ls_k - torch.logsumexp(ls_k, -1, keepdim=True)
            lt_k = lt_k - torch.logsumexp(lt_k, -1, keepdim=True)
        terms = _div_terms(torch.where(valid, ls_k, 0.0), torch.where(valid, lt_k, 0.0), mode, beta)
        div = torch.where(valid, terms, 0.0).sum(-1)
    if labels is not None:
        ce = F.cross_entropy(s, labels, ignore_index=ignore_index, reduction="none")
    else:
        ce = torch.zeros_like(div)
    loss = hard_weight * ce + soft_weight * div
    entropy = -(ls.exp() * ls).sum(-1)
    sc = torch.ones_like(loss) if scale is None else (scale.double() if torch.is_tensor(scale) else scale)
    (grad,) = torch.autograd.grad((loss * sc).sum(), s)
    return loss.detach(), div.detach(), ce.detach(), entropy.detach(), grad


def _inputs(n=6, vs=150, vt=None, dtype=torch.float32, spread=3.0):
    vt = vt or vs
    student = torch.randn(n, vs, dtype=dtype) * spread
    teacher = torch.randn(n, vt, dtype=dtype) * spread
    return student, teacher


def _check(stats, ref, grad_tile, tol, what):
    loss, div, ce, ent, grad = ref
    for name, out, r in (("loss", stats.loss, loss), ("divergence", stats.divergence, div),
                         ("ce", stats.ce, ce), ("entropy", stats.entropy, ent), ("grad", grad_tile, grad)):
        err = rel_err(out, r)
        assert err <= tol, f"{what} {name}: relative error {err:.2e} > {tol:.0e}"


# --------------------------------------------------------------------------- full-tile mode


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "divergence,beta",
    [("jsd", 0.5), ("jsd", 0.0), ("jsd", 1.0), ("jsd", 0.2), ("forward_kl", 0.5), ("reverse_kl", 0.5)],
)
def test_full_tile_matches_float64(impl, divergence, beta):
    """Every divergence (TRL's beta mapping: jsd with beta 0/1 = forward/reverse KL), temperature 2, per-row
    upstream scale: loss, divergence, entropy and in-place student gradient within fp32's 1e-5 of float64."""
    student, teacher = _inputs()
    scale = torch.rand(student.shape[0]) + 0.5
    ref = reference(student, teacher, divergence=divergence, beta=beta, temperature=2.0, scale=scale)
    tile = student.clone()
    stats = divergence_tile(tile, teacher, divergence=divergence, beta=beta, temperature=2.0, grad_scale=scale,
                            impl=impl, block_size=64)
    _check(stats, ref, tile, FP32, f"{impl} {divergence} beta={beta}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("teacher_vocab", ["renormalize", "full"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_teacher_vocab_larger(impl, teacher_vocab, beta):
    """Vt > Vs: renormalize = softmax over the shared columns, full = teacher normalised over all Vt; both
    match their float64 definition (values, gradient) to 1e-5."""
    student, teacher = _inputs(n=5, vs=130, vt=170)
    ref = reference(student, teacher, beta=beta, temperature=0.7, teacher_vocab=teacher_vocab, scale=1.0)
    tile = student.clone()
    stats = divergence_tile(tile, teacher, beta=beta, temperature=0.7, teacher_vocab=teacher_vocab,
                            grad_scale=1.0, impl=impl, block_size=64)
    _check(stats, ref, tile, FP32, f"{impl} {teacher_vocab} beta={beta}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_hard_label_mix(impl, temperature):
    """loss = 0.3 CE(raw logits) + 0.7 JSD(T), with one ignored label row (no CE there): values, accuracy of
    the argmax and gradient to 1e-5."""
    student, teacher = _inputs(n=7)
    labels = torch.randint(0, student.shape[1], (7,))
    labels[2] = -100
    labels[4] = int(student[4].argmax())
    ref = reference(student, teacher, labels, temperature=temperature, hard_weight=0.3, soft_weight=0.7, scale=0.25)
    tile = student.clone()
    stats = divergence_tile(tile, teacher, labels, temperature=temperature, hard_weight=0.3, soft_weight=0.7,
                            grad_scale=0.25, impl=impl, block_size=64)
    _check(stats, ref, tile, FP32, f"{impl} T={temperature}")
    expected = ((student.argmax(-1) == labels) & (labels != -100)).float()
    assert torch.equal(stats.correct, expected)
    assert stats.ce[2] == 0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("teacher_vocab", ["renormalize", "full"])
def test_no_grad_leaves_student(impl, beta, teacher_vocab):
    """Without grad_scale (the kernel's divergence-only passes, every mode; Vt > Vs so the fused statistics
    sweep runs past the student's columns) the student tile is untouched and divergence / entropy are exact
    (1e-5 of float64)."""
    student, teacher = _inputs(n=3, vs=100, vt=140)
    tile = student.clone()
    stats = divergence_tile(tile, teacher, beta=beta, teacher_vocab=teacher_vocab, impl=impl, block_size=64)
    assert torch.equal(tile, student)
    ref = reference(student, teacher, beta=beta, teacher_vocab=teacher_vocab)
    assert rel_err(stats.divergence, ref[1]) <= FP32
    assert rel_err(stats.entropy, ref[3]) <= FP32


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_tiles(impl):
    """bf16 student/teacher tiles (math in fp32): values and gradient within bf16's 1e-2 of float64 on the same
    bf16 inputs."""
    student, teacher = _inputs(n=4, dtype=torch.bfloat16)
    ref = reference(student, teacher, beta=0.5, temperature=2.0, scale=1.0)
    tile = student.clone()
    stats = divergence_tile(tile, teacher, beta=0.5, temperature=2.0, grad_scale=1.0, impl=impl, block_size=64)
    assert tile.dtype == torch.bfloat16
    _check(stats, ref, tile, TOL[torch.bfloat16], f"{impl} bf16")


def _adversarial_rows(vs=160):
    """fp32 rows that stress the divergence terms (row names in ``ADVERSARIAL``), temperature 1."""
    g = torch.Generator().manual_seed(7)

    def rn(*shape):
        return torch.randn(*shape, generator=g)

    s, t = rn(8, vs) * 3, rn(8, vs) * 3
    s[1, 3] = 30.0  # very peaked student (ls >> lt on its peak)
    t[2, 7] = 30.0  # very peaked teacher (ls << lt there)
    s[3, 3], t[3, 7] = 25.0, 25.0  # both peaked, on different entries
    s[4], t[4, 11] = rn(vs) * 0.3, 25.0  # near-uniform student, near-one-hot teacher
    s[5], t[5] = -1e4 + rn(vs), -1e4 + rn(vs)  # everything underflows (both p = 0, m = 0) except one entry each
    s[5, 5], t[5, 9] = 0.0, 0.0
    s[6], t[6] = -1e4 + rn(vs), -1e4 + rn(vs)  # ... the same surviving entry (+ one teacher runner-up)
    s[6, 5], t[6, 5], t[6, 9] = 0.0, 0.0, -2.0
    t[7] = s[7] + rn(vs) * 0.3  # close distributions (small divergence)
    return s, t


ADVERSARIAL = ["random", "peaked student", "peaked teacher", "both peaked", "flat student / peaked teacher",
               "one survivor each", "one shared survivor", "close"]


def _check_rows(stats, tile, ref, tol, what, names, loose=None):
    """Per-row relative errors (a row with a tiny value cannot hide behind a large one), finite everywhere;
    ``loose`` maps (row name, "loss" / "divergence" / "grad") to that entry's own bar."""
    assert torch.isfinite(tile).all() and all(torch.isfinite(x).all() for x in stats), f"{what}: NaN/inf"
    for r, name in enumerate(names):
        for label, out, exp in (("loss", stats.loss[r], ref[0][r]), ("divergence", stats.divergence[r], ref[1][r]),
                                ("grad", tile[r], ref[4][r])):
            bar = (loose or {}).get((name, label), tol)
            err = rel_err(out.reshape(-1), exp.reshape(-1))
            assert err <= bar, f"{what} row {r} ({name}) {label}: relative error {err:.2e} > {bar:.0e}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "divergence,beta",
    [("jsd", 1e-3), ("jsd", 0.5), ("jsd", 0.999), ("forward_kl", 0.5), ("reverse_kl", 0.5)],
)
def test_adversarial_rows_fp32(impl, divergence, beta):
    """Adversarial fp32 rows (very peaked student or teacher, ls >> lt and ls << lt, rows where all but one
    entry underflow so the mixture is 0 there, close distributions; plus +-1e4 logits at temperature 1000),
    beta near 0 and 1: per row, loss, divergence and gradient within fp32's 1e-5 of float64 and never NaN/inf.
    (JSD at beta=0.999 failed this before the kernel's mixture rewrite: 1 - beta rounded in fp32, and
    softplus(x) taken as softplus(-x) + x.) One exception, 2e-4: the peaked-teacher row's gradient at
    beta=0.999 is saturated (norm ~1e-7, a difference of nearly equal terms), so the fp32 rounding of the
    log-probs themselves (ulp of |ls| ~ 10) shows at ~1e-4 in both implementations, with any formula; and
    5e-5 for forward / reverse KL on the close row (value ~0.05): KL is first-order sensitive to that same
    rounding of ls and lt (~5e-7 absolute each), unlike the JSD, whose sensitivity is p * (log-ratio)."""
    s, t = _adversarial_rows()
    ref = reference(s, t, divergence=divergence, beta=beta, scale=1.0)
    tile = s.clone()
    stats = divergence_tile(tile, t, divergence=divergence, beta=beta, grad_scale=1.0, impl=impl, block_size=64)
    loose = {("peaked teacher", "grad"): 2e-4} if beta == 0.999 else {}
    if divergence != "jsd":
        loose = {("close", "loss"): 5e-5, ("close", "divergence"): 5e-5}
    _check_rows(stats, tile, ref, FP32, f"{impl} {divergence} beta={beta}", ADVERSARIAL, loose)

    g = torch.Generator().manual_seed(8)
    s, t = ((torch.rand(2, 2, 160, generator=g) * 2 - 1) * 1e4).unbind(0)
    ref = reference(s, t, divergence=divergence, beta=beta, temperature=1000.0, scale=1.0)
    tile = s.clone()
    stats = divergence_tile(tile, t, divergence=divergence, beta=beta, temperature=1000.0, grad_scale=1.0,
                            impl=impl, block_size=64)
    _check_rows(stats, tile, ref, FP32, f"{impl} {divergence} beta={beta} +-1e4 T=1000", ["wide"] * 2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("temperature", [1.0, 100.0])
@pytest.mark.parametrize(
    "divergence,beta",
    [("jsd", 1e-3), ("jsd", 0.5), ("jsd", 0.999), ("forward_kl", 0.5), ("reverse_kl", 0.5)],
)
def test_huge_logit_range_finite(impl, temperature, divergence, beta):
    """+-1e4 logits at temperature 1 and 100 (most probabilities underflow to 0): no NaN/inf anywhere, and the
    divergence within 1e-4 of float64. Looser than 1e-5 on purpose: log-probs z - lse with |z| ~ 1e4 carry fp32
    rounding ~5e-4 absolute (both implementations, any divergence formula), and the gradient there is either
    subnormal (T=1) or a saturated difference of nearly equal terms (T=100), so only its finiteness is held."""
    g = torch.Generator().manual_seed(9)
    s, t = ((torch.rand(2, 3, 160, generator=g) * 2 - 1) * 1e4).unbind(0)
    ref = reference(s, t, divergence=divergence, beta=beta, temperature=temperature, scale=1.0)
    tile = s.clone()
    stats = divergence_tile(tile, t, divergence=divergence, beta=beta, temperature=temperature, grad_scale=1.0,
                            impl=impl, block_size=64)
    assert torch.isfinite(tile).all() and all(torch.isfinite(x).all() for x in stats)
    assert rel_err(stats.divergence, ref[1]) <= 1e-4


# --------------------------------------------------------------------------- top-k mode


def _topk_inputs(n=6, vs=120, k=5, temperature=1.0):
    student = torch.randn(n, vs) * 3
    teacher = torch.randn(n, vs) * 3
    lp, idx = torch.log_softmax(teacher / temperature, -1).topk(k, dim=-1)
    # padding: row 1 has two padded entries, row 3 none valid (all padding)
    lp[1, -2:] = -math.inf
    idx[1, -2:] = 0
    lp[3] = -math.inf
    return student, lp, idx


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_matches_float64(impl, tail, beta):
    """Teacher top-k log-probs (with padding rows) + tail bucket or renormalisation, every beta, T=1.3, plus a
    0.2 hard-label CE: loss and exact student gradient (through the full softmax) within 1e-5 of float64."""
    student, lp, idx = _topk_inputs(temperature=1.3)
    labels = torch.randint(0, student.shape[1], (student.shape[0],))
    labels[0] = int(idx[0, 0])  # label on a support entry
    scale = torch.rand(student.shape[0]) + 0.5
    ref = reference(student, labels=labels, beta=beta, temperature=1.3, topk_logprobs=lp, topk_indices=idx,
                    topk_tail=tail, hard_weight=0.2, soft_weight=0.8, scale=scale)
    tile = student.clone()
    stats = divergence_tile(tile, None, labels, topk_logprobs=lp, topk_indices=idx, beta=beta, temperature=1.3,
                            topk_tail=tail, hard_weight=0.2, soft_weight=0.8, grad_scale=scale, impl=impl,
                            block_size=64)
    _check(stats, ref, tile, FP32, f"{impl} tail={tail} beta={beta}")


def test_topk_matches_trl_server_distillation():
    """Our top-k divergence equals TRL 1.16's own server-distillation math (_add_tail_bucket + _jsd_divergence
    with a support mask) on the same inputs, per row, to 1e-5 (TRL run in float64)."""
    pytest.importorskip("trl")
    from trl.experimental.server_distillation.server_distillation_trainer import _add_tail_bucket, _jsd_divergence

    student, lp, idx = _topk_inputs()
    lp, idx = lp[[0, 1, 2, 4, 5]], idx[[0, 1, 2, 4, 5]]  # TRL's path has no all-padding rows
    student = student[[0, 1, 2, 4, 5]]
    for beta in (0.0, 0.5, 1.0):
        sl = torch.log_softmax(student.double(), -1)
        valid = lp > -math.inf
        s_k = torch.where(valid, sl.gather(1, idx), -math.inf)
        t_k = torch.where(valid, lp.double(), -math.inf)
        s_sp, mask = _add_tail_bucket(s_k, valid)
        t_sp, _ = _add_tail_bucket(t_k, valid)
        trl_rows = _jsd_divergence(s_sp, t_sp, beta, mask).sum(-1)
        ours = divergence_tile(student.clone(), None, topk_logprobs=lp, topk_indices=idx, beta=beta,
                               impl="triton", block_size=64)
        assert rel_err(ours.divergence, trl_rows) <= FP32, beta


def test_full_tile_matches_trl_generalized_jsd():
    """TRL GKD's generalized_jsd_loss (float64 autograd, reduction 'sum') and our kernel agree on the value and
    on the gradient w.r.t. the student logits for beta in {0, 0.5, 1} and temperature 2, to 1e-5."""
    pytest.importorskip("trl")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    student, teacher = _inputs(n=5, vs=90)
    for beta in (0.0, 0.5, 1.0):
        s = student.double().requires_grad_(True)
        trl_loss = GKDTrainer.generalized_jsd_loss(s[None], teacher.double()[None], beta=beta, temperature=2.0,
                                                   reduction="sum")
        (trl_grad,) = torch.autograd.grad(trl_loss, s)
        tile = student.clone()
        stats = divergence_tile(tile, teacher, beta=beta, temperature=2.0, grad_scale=1.0, impl="triton",
                                block_size=32)
        assert rel_err(stats.divergence.sum(), trl_loss) <= FP32, beta
        assert rel_err(tile, trl_grad) <= FP32, beta


def test_triton_and_torch_agree():
    """The two implementations give the same statistics and gradient (3e-6, rounding order only) on one mixed
    configuration."""
    student, teacher = _inputs(n=4, vs=100, vt=120)
    labels = torch.randint(0, 100, (4,))
    outs = []
    for impl in IMPLS:
        tile = student.clone()
        st = divergence_tile(tile, teacher, labels, beta=0.7, temperature=0.8, teacher_vocab="full",
                             hard_weight=0.5, soft_weight=0.5, grad_scale=torch.full((4,), 0.1), impl=impl,
                             block_size=32)
        outs.append((st, tile))
    (a, ta), (b, tb) = outs
    for x, y in zip(a, b):
        assert rel_err(x, y) <= 3e-6
    assert rel_err(ta, tb) <= 3e-6


# --------------------------------------------------------------------------- bad input


def test_bad_inputs():
    """Bad shapes, dtypes, options and labels raise ValueError/TypeError naming the argument."""
    s, t = _inputs(n=3, vs=20)
    with pytest.raises(ValueError, match="teacher vocabulary"):
        divergence_tile(s.clone(), t[:, :10])
    with pytest.raises(ValueError, match="teacher must have shape"):
        divergence_tile(s.clone(), t[:2])
    with pytest.raises(ValueError, match="beta"):
        divergence_tile(s.clone(), t, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        divergence_tile(s.clone(), t, temperature=0.0)
    with pytest.raises(ValueError, match="divergence"):
        divergence_tile(s.clone(), t, divergence="kl")
    with pytest.raises(TypeError, match="student"):
        divergence_tile(s.long(), t)
    with pytest.raises(ValueError, match="student"):
        divergence_tile(s[0], t)
    with pytest.raises(ValueError, match="labels"):
        divergence_tile(s.clone(), t, torch.tensor([0, 1, 20]))
    with pytest.raises(TypeError, match="labels"):
        divergence_tile(s.clone(), t, torch.zeros(3))
    with pytest.raises(ValueError, match="either teacher"):
        divergence_tile(s.clone(), t, topk_logprobs=torch.zeros(3, 2) - 1, topk_indices=torch.zeros(3, 2).long())
    with pytest.raises(ValueError, match="distinct"):
        divergence_tile(s.clone(), None, topk_logprobs=torch.zeros(3, 2) - 1, topk_indices=torch.zeros(3, 2).long())
    with pytest.raises(ValueError, match="topk_indices must be in"):
        divergence_tile(s.clone(), None, topk_logprobs=torch.full((3, 1), -1.0),
                        topk_indices=torch.full((3, 1), 25))
    with pytest.raises(ValueError, match="topk_logprobs must be"):
        divergence_tile(s.clone(), None, topk_logprobs=torch.full((3, 1), 2.0), topk_indices=torch.zeros(3, 1).long())
    with pytest.raises(ValueError, match="impl"):
        divergence_tile(s.clone(), t, impl="cuda")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gpu_bf16_large_vocab(beta):
    """On the GPU, bf16 tiles with a 32k vocabulary (several 4096-column blocks), Vt > Vs: kernel within bf16's
    1e-2 of float64 for the loss and the gradient."""
    student = (torch.randn(64, 32000, device="cuda") * 3).bfloat16()
    teacher = (torch.randn(64, 32128, device="cuda") * 3).bfloat16()
    labels = torch.randint(0, 32000, (64,), device="cuda")
    ref = reference(student, teacher, labels, beta=beta, temperature=2.0, hard_weight=0.5, soft_weight=0.5,
                    scale=1.0)
    tile = student.clone()
    stats = divergence_tile(tile, teacher, labels, beta=beta, temperature=2.0, hard_weight=0.5, soft_weight=0.5,
                            grad_scale=1.0)
    _check(stats, ref, tile, TOL[torch.bfloat16], f"gpu beta={beta}")


@pytest.mark.gpu
def test_gpu_topk_fp32():
    """On the GPU, top-k mode (k=20, tail) in fp32 matches float64 to 1e-5 (exercises the barrier-ordered
    support overwrite on real hardware)."""
    student = torch.randn(128, 5000, device="cuda") * 3
    lp, idx = torch.log_softmax(torch.randn(128, 5000, device="cuda") * 3, -1).topk(20, dim=-1)
    ref = reference(student, beta=0.5, topk_logprobs=lp, topk_indices=idx, scale=1.0)
    tile = student.clone()
    stats = divergence_tile(tile, None, topk_logprobs=lp, topk_indices=idx, beta=0.5, grad_scale=1.0)
    _check(stats, ref, tile, FP32, "gpu topk")


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [1e-3, 0.5, 0.999])
def test_gpu_adversarial_rows_fp32(beta):
    """On the GPU (hardware ex2 / lg2 approximations, which the CPU interpreter does not model), the adversarial
    fp32 rows of ``test_adversarial_rows_fp32`` (JSD) meet the same per-row bars."""
    s, t = _adversarial_rows()
    ref = reference(s, t, beta=beta, scale=1.0)
    tile = s.cuda()
    stats = divergence_tile(tile, t.cuda(), beta=beta, grad_scale=1.0)
    loose = {("peaked teacher", "grad"): 2e-4} if beta == 0.999 else {}
    _check_rows(DivStats(*(x.cpu() for x in stats)), tile.cpu(), ref, FP32, f"gpu beta={beta}", ADVERSARIAL, loose)
