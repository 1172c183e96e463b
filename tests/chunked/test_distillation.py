"""Tests of liger_losses/chunked/distillation.py: the chunked fused-linear KL/JSD distillation loss against a
plain float64 reference with full logits, whose divergence is TRL 1.16's ``GKDTrainer.generalized_jsd_loss`` (and
TRL's server-distillation top-k math for the top-k mode), restated here so the GPU machine needs no trl;
``test_reference_is_trl`` checks the restatement against TRL's own functions. Tiny shapes, ``chunk_tokens=5`` so that
chunk boundaries fall inside sequences; fp32 inputs, tolerance 1e-5 (fp32 vs float64).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_losses.chunked.distillation import (
    TRL_METRIC_NAMES,
    LigerFusedLinearDistillationLoss,
    fused_linear_distillation_loss,
)
from tests.helpers import TOL, rel_err


def generalized_jsd_loss(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0,
                         reduction="batchmean"):
    """TRL 1.16's GKDTrainer.generalized_jsd_loss written plainly here (so the GPU machine needs no trl);
    test_reference_is_trl checks it equals TRL's own function."""
    ls = torch.log_softmax(student_logits / temperature, -1)
    lt = torch.log_softmax(teacher_logits / temperature, -1)
    if beta == 0:
        elem = lt.exp() * (lt - ls)
    elif beta == 1:
        elem = ls.exp() * (ls - lt)
    else:
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        elem = beta * lt.exp() * (lt - lm) + (1 - beta) * ls.exp() * (ls - lm)
    if labels is not None:
        elem = elem[labels != -100]
    if reduction == "batchmean":
        return elem.sum() / max(elem.shape[0], 1)
    return elem.sum() if reduction == "sum" else elem.mean()


def _add_tail_bucket(log_probs, valid):
    """TRL's server-distillation tail bucket: append log(1 - sum exp(log_probs)), the sum clamped below 1."""
    lsum = torch.logsumexp(log_probs, -1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([log_probs, torch.log(-torch.expm1(lsum))], -1), torch.cat([valid, valid[..., :1] | True], -1)


def _sparse_divergence(ls, lt, beta, support):
    """TRL's server-distillation _jsd_divergence with a support mask (masked entries contribute 0)."""
    zero = torch.zeros((), dtype=ls.dtype, device=ls.device)
    ls_, lt_ = torch.where(support, ls, zero), torch.where(support, lt, zero)
    ps, pt = torch.where(support, ls.exp(), zero), torch.where(support, lt.exp(), zero)
    if beta == 0:
        return pt * (lt_ - ls_)
    if beta == 1:
        return ps * (ls_ - lt_)
    lm = torch.where(support, torch.log(((1 - beta) * ps + beta * pt).clamp_min(torch.finfo(ps.dtype).tiny)), zero)
    return beta * pt * (lt_ - lm) + (1 - beta) * ps * (ls_ - lm)

FP32 = TOL[torch.float32]
B, T, H, HT, VS, VT = 3, 7, 16, 24, 96, 110


def make(vt=VT, ht=HT, dtype=torch.float32, ignore=True, bias=True):
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(VS, H, generator=g) / H**0.5 * 4).to(dtype).requires_grad_(True)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    b = (torch.randn(VS, generator=g) * 0.5).to(dtype).requires_grad_(True) if bias else None
    tw = (torch.randn(vt, ht, generator=g) / ht**0.5 * 4).to(dtype)
    th = torch.randn(B, T, ht, generator=g).to(dtype)
    tb = (torch.randn(vt, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, VS, (B, T), generator=g)
    if ignore:
        labels[0, :3] = -100  # a prompt
        labels[2, -2:] = -100  # padding
    return weight, hidden, b, th, tw, tb, labels


def reference(weight, hidden, bias, th, tw, tb, labels, *, beta=0.5, divergence="jsd", temperature=1.0,
              reduction="batchmean", hard=0.0, soft=None, teacher_vocab="renormalize", num_items=None,
              topk=None, tail=True, softcap=None, logit_scale=1.0):
    """Float64 full-logits loss: TRL's generalized_jsd_loss (or the top-k server math) + CE mix; both heads'
    logits transformed as a model's head does (``logit_scale *``, then ``softcap * tanh(. / softcap)``)."""

    def head(z):
        z = z * logit_scale
        return z if softcap is None else softcap * torch.tanh(z / softcap)

    beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(divergence, beta)
    soft = 1.0 - hard if soft is None else soft
    mask = labels != -100
    s = head(hidden.double() @ weight.double().T + (bias.double() if bias is not None else 0.0))
    s = s[mask]
    n = int(mask.sum())
    if topk is not None:
        lp, idx = topk[0][mask].double(), topk[1][mask]
        sl = torch.log_softmax(s / temperature, -1)
        valid = lp > -math.inf
        s_k = torch.where(valid, sl.gather(1, torch.where(valid, idx, 0)), -math.inf)
        t_k = torch.where(valid, lp, -math.inf)
        if tail:
            s_k, sup = _add_tail_bucket(s_k, valid)
            t_k, _ = _add_tail_bucket(t_k, valid)
        else:
            sup = valid
            s_k = s_k - torch.logsumexp(s_k, -1, keepdim=True)
            t_k = t_k - torch.logsumexp(t_k, -1, keepdim=True)
        per_tok = _sparse_divergence(s_k, t_k, beta, sup).sum(-1)
        div = per_tok.sum() / max(n, 1) if reduction == "batchmean" else per_tok.sum()
    else:
        t = head(th.double() @ tw.double().T + tb.double())[mask]
        if teacher_vocab == "renormalize":
            div = generalized_jsd_loss(s[None], t[None, :, :VS], labels[mask][None], beta=beta,
                                       temperature=temperature, reduction=reduction if n else "sum")
        else:  # teacher normalised over all Vt, divergence over the shared Vs columns
            ls = torch.log_softmax(s / temperature, -1)
            lt = torch.log_softmax(t / temperature, -1)[:, :VS]
            ps, pt = ls.exp(), lt.exp()
            lm = torch.log((1 - beta) * ps + beta * pt)
            elem = {0.0: pt * (lt - ls), 1.0: ps * (ls - lt)}.get(
                beta, beta * pt * (lt - lm) + (1 - beta) * ps * (ls - lm))
            div = elem.sum() / {"batchmean": max(n, 1), "sum": 1, "mean": max(n * VS, 1)}[reduction]
    ce = F.cross_entropy(s, labels[mask], reduction="sum") if n else s.sum() * 0
    ce = ce / max(n, 1) if reduction != "sum" else ce
    if num_items is not None:
        div = (div * max(n, 1) if reduction == "batchmean" else div) / float(num_items)
        ce = ce * max(n, 1) / float(num_items)
    return hard * ce + soft * div


def grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def check_all(out, ref, inputs, what):
    """Loss and grads (hidden, weight, bias) of `out` vs `ref` to fp32's 1e-5."""
    weight, hidden, bias = inputs
    assert rel_err(out, ref) <= FP32, f"{what} loss {rel_err(out, ref):.2e}"
    names = ["weight", "hidden", "bias"][: 2 + (bias is not None)]
    for name, a, r in zip(names, grads(out, weight, hidden, bias), grads(ref, weight, hidden, bias)):
        err = rel_err(a, r)
        assert err <= FP32, f"{what} grad {name}: {err:.2e}"


def test_reference_is_trl():
    """The test's reference functions equal TRL 1.16's own (GKD generalized_jsd_loss for every beta and
    reduction, server-distillation _add_tail_bucket/_jsd_divergence), float64, to 1e-12; and our loss equals
    TRL's generalized_jsd_loss on the same full logits to 1e-5."""
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    server = pytest.importorskip("trl.experimental.server_distillation.server_distillation_trainer")
    weight, hidden, bias, th, tw, tb, labels = make(vt=VS)
    with torch.no_grad():
        s = (hidden.double() @ weight.double().T + bias.double())
        t = (th.double() @ tw.double().T + tb.double())
    for beta in (0.0, 0.3, 1.0):
        for red in ("batchmean", "sum", "mean"):
            a = generalized_jsd_loss(s, t, labels, beta=beta, temperature=1.7, reduction=red)
            b = gkd.GKDTrainer.generalized_jsd_loss(s, t, labels, beta=beta, temperature=1.7, reduction=red)
            assert rel_err(a, b) <= 1e-12, (beta, red)
        ours = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb,
                                              bias=bias, beta=beta, temperature=1.7, chunk_tokens=5).loss
        trl_loss = gkd.GKDTrainer.generalized_jsd_loss(s, t, labels, beta=beta, temperature=1.7)
        assert rel_err(ours, trl_loss) <= FP32, beta
    lp, idx = torch.log_softmax(t, -1).topk(4, dim=-1)
    lp[0, 0, 2:] = -math.inf
    valid = lp > -math.inf
    sl = torch.where(valid, torch.log_softmax(s, -1).gather(-1, idx), -math.inf)
    ours_t, sup = _add_tail_bucket(sl, valid)
    trl_t, trl_sup = server._add_tail_bucket(sl, valid)
    assert torch.equal(sup, trl_sup) and torch.allclose(ours_t, trl_t, rtol=1e-12, atol=0)  # -inf at padding
    lt_t, _ = server._add_tail_bucket(torch.where(valid, lp, -math.inf), valid)
    for beta in (0.0, 0.5, 1.0):
        restated = _sparse_divergence(trl_t, lt_t, beta, sup)
        assert rel_err(restated, server._jsd_divergence(trl_t, lt_t, beta, sup)) <= 1e-12


@pytest.mark.parametrize(
    "divergence,beta", [("jsd", 0.5), ("jsd", 0.0), ("jsd", 1.0), ("forward_kl", 0.5), ("reverse_kl", 0.5)]
)
def test_matches_trl_reference(divergence, beta):
    """Every divergence (TRL's beta mapping), temperature 2, Vt > Vs, teacher hidden size != student's,
    biases, ignored prompt/padding tokens, 5-token chunks: loss and grads of hidden/weight/bias match the
    float64 full-logits reference (TRL's generalized_jsd_loss) to 1e-5."""
    weight, hidden, bias, th, tw, tb, labels = make()
    kw = dict(divergence=divergence, beta=beta, temperature=2.0)
    out = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb, bias=bias,
                                         chunk_tokens=5, **kw).loss
    ref = reference(weight, hidden, bias, th, tw, tb, labels, **kw)
    check_all(out, ref, (weight, hidden, bias), f"{divergence} beta={beta}")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reductions(reduction):
    """reduction 'sum' and 'mean' (TRL: mean over [tokens, V] elements) with a 0.25 CE mix: loss and grads
    to 1e-5 of the float64 reference."""
    weight, hidden, bias, th, tw, tb, labels = make()
    out = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb, bias=bias,
                                         reduction=reduction, hard_label_weight=0.25, chunk_tokens=4).loss
    ref = reference(weight, hidden, bias, th, tw, tb, labels, reduction=reduction, hard=0.25)
    check_all(out, ref, (weight, hidden, bias), reduction)


@pytest.mark.parametrize("num_items", [40, "tensor"])
def test_num_items_in_batch(num_items):
    """num_items_in_batch (int or 0-d tensor) replaces the token count: sum / num_items for both terms."""
    weight, hidden, bias, th, tw, tb, labels = make()
    n = torch.tensor(40.0) if num_items == "tensor" else num_items
    out = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb, bias=bias,
                                         hard_label_weight=0.5, soft_label_weight=1.0, num_items_in_batch=n,
                                         chunk_tokens=6).loss
    ref = reference(weight, hidden, bias, th, tw, tb, labels, hard=0.5, soft=1.0, num_items=40)
    check_all(out, ref, (weight, hidden, bias), f"num_items={num_items}")


def test_hard_label_mix_and_metrics():
    """hard_label_weight=0.3 (soft defaults to 0.7), T=1.5: loss/grads to 1e-5; metrics (divergence, nll,
    entropy, token accuracy, token count) equal their float64 definitions (1e-5)."""
    weight, hidden, bias, th, tw, tb, labels = make()
    labels[1, 0] = int((hidden[1, 0] @ weight.T + bias).argmax())  # at least one correct token
    out, metrics = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb,
                                                  bias=bias, temperature=1.5, hard_label_weight=0.3,
                                                  chunk_tokens=5)
    ref = reference(weight, hidden, bias, th, tw, tb, labels, temperature=1.5, hard=0.3)
    check_all(out, ref, (weight, hidden, bias), "mix")
    mask = labels != -100
    with torch.no_grad():
        s = (hidden.double() @ weight.double().T + bias.double())[mask]
        t = (th.double() @ tw.double().T + tb.double())[mask][:, :VS]
        ls = torch.log_softmax(s / 1.5, -1)
        expect = {
            "divergence": generalized_jsd_loss(s[None], t[None], labels[mask][None], beta=0.5, temperature=1.5),
            "nll": F.cross_entropy(s, labels[mask]),
            "entropy": -(ls.exp() * ls).sum(-1).mean(),
            "token_accuracy": (s.argmax(-1) == labels[mask]).double().mean(),
        }
    for k, v in expect.items():
        assert rel_err(metrics[k], v) <= FP32, k
    assert metrics["num_tokens"] == int(mask.sum())
    assert expect["token_accuracy"] > 0
    assert set(TRL_METRIC_NAMES) <= set(metrics)


@pytest.mark.parametrize("teacher_vocab", ["renormalize", "full"])
def test_teacher_vocab_modes(teacher_vocab):
    """Vt > Vs both ways (teacher softmax over the shared columns, or over all Vt): loss/grads to 1e-5."""
    weight, hidden, bias, th, tw, tb, labels = make()
    out = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb, bias=bias,
                                         beta=0.3, teacher_vocab=teacher_vocab, chunk_tokens=5).loss
    ref = reference(weight, hidden, bias, th, tw, tb, labels, beta=0.3, teacher_vocab=teacher_vocab)
    check_all(out, ref, (weight, hidden, bias), teacher_vocab)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_teacher_topk(tail, beta):
    """Teacher given as top-5 log-probs (one token with padded entries): matches TRL's server-distillation
    sparse divergence (tail bucket or renormalised) in float64, loss and grads to 1e-5."""
    weight, hidden, bias, th, tw, tb, labels = make()
    with torch.no_grad():
        lp, idx = torch.log_softmax((th @ tw[:VS].T + tb[:VS]) / 1.2, -1).topk(5, dim=-1)
    lp[1, 3, 3:] = -math.inf
    out = fused_linear_distillation_loss(weight, hidden, None, labels, bias=bias, teacher_topk_logprobs=lp,
                                         teacher_topk_indices=idx, beta=beta, temperature=1.2, topk_tail=tail,
                                         chunk_tokens=5).loss
    ref = reference(weight, hidden, bias, th, tw, tb, labels, beta=beta, temperature=1.2, topk=(lp, idx), tail=tail)
    check_all(out, ref, (weight, hidden, bias), f"topk tail={tail} beta={beta}")


@pytest.mark.parametrize("softcap,logit_scale,extra", [
    (3.0, 1.0, dict(beta=0.5)),
    (None, 0.6, dict(beta=0.0, teacher_vocab="full")),
    (2.5, 1.7, dict(beta=1.0, temperature=2.0, hard_label_weight=0.3)),
    (4.0, 0.8, dict(beta=0.3, temperature=1.5, hard_label_weight=0.2, impl="torch")),
])
def test_softcap_and_logit_scale(softcap, logit_scale, extra):
    """softcap / logit_scale applied to student AND teacher logits as a model's head does (logits * scale, then
    softcap * tanh(. / softcap); temperature after; the CE term on the transformed student logits), with
    saturated logits (|logits| up to ~10 > softcap): loss and grads of weight/hidden/bias within fp32's 1e-5 of
    the float64 reference."""
    weight, hidden, bias, th, tw, tb, labels = make()
    kw = dict(extra)
    out = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb, bias=bias,
                                         softcap=softcap, logit_scale=logit_scale, chunk_tokens=5, **kw).loss
    kw.pop("impl", None)
    hard = kw.pop("hard_label_weight", 0.0)
    ref = reference(weight, hidden, bias, th, tw, tb, labels, softcap=softcap, logit_scale=logit_scale, hard=hard,
                    **kw)
    check_all(out, ref, (weight, hidden, bias), f"softcap={softcap} logit_scale={logit_scale}")


def test_softcap_topk_and_module():
    """Top-k teacher mode: the transform applies to the student only (the teacher's log-probs are given); the
    module passes softcap / logit_scale through; loss and grads to 1e-5."""
    weight, hidden, bias, th, tw, tb, labels = make()
    g = torch.Generator().manual_seed(5)
    lp = torch.log_softmax(torch.randn(B, T, VS, generator=g) * 2, -1).topk(4, -1)
    topk = (lp.values, lp.indices)
    mod = LigerFusedLinearDistillationLoss(softcap=2.0, logit_scale=1.3, beta=0.5, chunk_tokens=6)
    out = mod(weight, hidden, None, labels, bias=bias, teacher_topk_logprobs=topk[0], teacher_topk_indices=topk[1])
    ref = reference(weight, hidden, bias, th, tw, tb, labels, topk=topk, softcap=2.0, logit_scale=1.3)
    check_all(out.loss, ref, (weight, hidden, bias), "topk softcap")
    assert "softcap=2.0" in repr(mod)


def test_teacher_gets_no_grad_and_shared_head():
    """The teacher never receives a gradient (its tensors requiring grad stay .grad None), and with
    teacher_weight=None the teacher uses the student's head (and bias) as a constant: matches the reference
    with a detached copy of the head, to 1e-5."""
    weight, hidden, bias, _, _, _, labels = make()
    th = torch.randn(B, T, H, requires_grad=True)
    out = fused_linear_distillation_loss(weight, hidden, th, labels, bias=bias, chunk_tokens=5).loss
    ref = reference(weight, hidden, bias, th.detach(), weight.detach(), bias.detach(), labels)
    check_all(out, ref, (weight, hidden, bias), "shared head")
    tw = torch.randn(VT, HT, requires_grad=True)
    th2 = torch.randn(B, T, HT, requires_grad=True)
    out2 = fused_linear_distillation_loss(weight, hidden, th2, labels, teacher_weight=tw, chunk_tokens=5).loss
    out2.backward()
    assert tw.grad is None and th2.grad is None
    assert hidden.grad is not None and weight.grad is not None


def test_all_ignored():
    """Every label ignored: loss 0 (no NaN), zero gradients, zero metrics."""
    weight, hidden, bias, th, tw, tb, labels = make()
    labels[:] = -100
    out, metrics = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, bias=bias)
    gw, gh, gb = grads(out, weight, hidden, bias)
    assert out.item() == 0.0
    assert gw.abs().sum() == 0 and gh.abs().sum() == 0 and gb.abs().sum() == 0
    assert all(torch.isfinite(v).all() for v in metrics.values())


def test_frozen_weight_no_grad_mode_and_module():
    """Frozen student weight: only hidden/bias grads (equal to the reference, 1e-5). Under torch.no_grad the
    loss is the same value. The module form gives the same loss as the function."""
    weight, hidden, bias, th, tw, tb, labels = make()
    frozen = weight.detach()
    out = fused_linear_distillation_loss(frozen, hidden, th, labels, teacher_weight=tw, teacher_bias=tb, bias=bias,
                                         chunk_tokens=5).loss
    ref = reference(frozen, hidden, bias, th, tw, tb, labels)
    for a, r in zip(grads(out, hidden, bias), grads(ref, hidden, bias)):
        assert rel_err(a, r) <= FP32
    with torch.no_grad():
        nograd = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb,
                                                bias=bias).loss
    assert rel_err(nograd, ref) <= FP32
    module = LigerFusedLinearDistillationLoss(beta=0.5, chunk_tokens=5)
    mod_out = module(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb, bias=bias).loss
    assert rel_err(mod_out, ref) <= FP32


def test_impls_agree_and_grad_output_scaling():
    """impl='torch' and impl='triton' agree (3e-6); backward multiplies by a non-unit grad_output (x3)."""
    weight, hidden, bias, th, tw, tb, labels = make()
    outs = {}
    for impl in ("torch", "triton"):
        out = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb,
                                             bias=bias, beta=0.7, chunk_tokens=5, impl=impl).loss
        outs[impl] = (out, grads(3.0 * out, weight, hidden, bias))
    ref = reference(weight, hidden, bias, th, tw, tb, labels, beta=0.7)
    assert rel_err(outs["torch"][0], outs["triton"][0]) <= 3e-6
    for a, b, r in zip(outs["torch"][1], outs["triton"][1], grads(3.0 * ref, weight, hidden, bias)):
        assert rel_err(a, b) <= 3e-6
        assert rel_err(b, r) <= FP32


@pytest.mark.parametrize("accum_dtype", [None, torch.float32])
def test_bf16_inputs(accum_dtype):
    """bf16 student and teacher (bf16 tiles and GEMMs, fp32 kernel math), with a 0.2 CE mix: loss and grads
    within bf16's 1e-2 of float64 on the same bf16 inputs, for bf16 and fp32 weight-gradient accumulation; the
    gradients come back in the inputs' dtype."""
    weight, hidden, bias, th, tw, tb, labels = make(dtype=torch.bfloat16)
    out = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb, bias=bias,
                                         hard_label_weight=0.2, chunk_tokens=5, accum_dtype=accum_dtype).loss
    ref = reference(weight, hidden, bias, th, tw, tb, labels, hard=0.2)
    assert rel_err(out, ref) <= TOL[torch.bfloat16]
    for g, r, x in zip(grads(out, weight, hidden, bias), grads(ref, weight, hidden, bias), (weight, hidden, bias)):
        assert g.dtype == x.dtype
        assert rel_err(g, r) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bf16_close_teacher_keeps_fp32_logits(beta, monkeypatch):
    """A bf16 student whose teacher is close (KL ~5e-4, the end of a distillation run): the divergence is a
    small difference of two softmaxes, so logits rounded to bf16 swamp it. Our tiles hold fp32 logits of the
    bf16 GEMM (as TRL's distillation kernel): loss within 1e-3 of float64 on the same bf16 inputs and the
    hidden gradient within 1e-2 (the bf16 gradient tile and operands); measured 2.4e-5 and 2.2e-3 at
    beta=0.5. Rounding the logits to bf16 first (the tiles before this) gives 0.29 and 0.65 there (0.41 and
    0.63-0.73 at V=32000): the last check holds it 10x / 5x worse, so the test fails if the rounding returns."""
    from liger_losses.chunked import distillation, gemm

    g = torch.Generator().manual_seed(0)
    N, H, V, noise = 32, 64, 2048, 0.01
    hs32, ws32 = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * (3.0 / H**0.5)
    ht32 = hs32 + noise * torch.randn(N, H, generator=g)
    wt32 = ws32 + noise * torch.randn(V, H, generator=g) / H**0.5
    hs, ws, ht, wt = (x.bfloat16() for x in (hs32, ws32, ht32, wt32))
    labels = torch.zeros(N, dtype=torch.long)
    h64 = hs.double().requires_grad_()
    s64, t64 = h64 @ ws.double().T, ht.double() @ wt.double().T
    ref = generalized_jsd_loss(s64[None], t64[None], labels[None], beta=beta, temperature=1.0)
    (ref_g,) = torch.autograd.grad(ref, h64)

    def ours():
        h = hs.clone().requires_grad_()
        loss = fused_linear_distillation_loss(ws, h, ht, labels, teacher_weight=wt, beta=beta).loss
        (gh,) = torch.autograd.grad(loss, h)
        return rel_err(loss, ref), rel_err(gh, ref_g)

    loss_err, grad_err = ours()
    assert loss_err <= 1e-3 and grad_err <= 1e-2, (loss_err, grad_err)
    monkeypatch.setattr(distillation, "project_fp32", lambda h, w, b=None: gemm.project(h, w, b).float())
    rounded_loss_err, rounded_grad_err = ours()
    errors = (loss_err, grad_err, rounded_loss_err, rounded_grad_err)
    assert rounded_loss_err >= 10 * loss_err and rounded_grad_err >= 5 * grad_err, errors


def test_bad_inputs():
    """Mismatched teacher shapes, smaller teacher vocab, beta/temperature/options out of range, bad labels raise
    ValueError/TypeError naming the argument."""
    weight, hidden, bias, th, tw, tb, labels = make()
    f = fused_linear_distillation_loss
    with pytest.raises(ValueError, match="teacher_hidden must have shape"):
        f(weight, hidden, th[:, :-1], labels, teacher_weight=tw)
    with pytest.raises(ValueError, match="teacher_hidden must have shape"):
        f(weight, hidden, th, labels)  # Ht=24 but the default teacher head is the student's (H=16)
    with pytest.raises(ValueError, match="teacher_weight must have at least"):
        f(weight, hidden, th, labels, teacher_weight=tw[: VS - 1])
    with pytest.raises(ValueError, match="teacher_bias"):
        f(weight, hidden, th, labels, teacher_weight=tw, teacher_bias=tb[:-1])
    with pytest.raises(ValueError, match="beta"):
        f(weight, hidden, th, labels, teacher_weight=tw, beta=-0.1)
    with pytest.raises(ValueError, match="temperature"):
        f(weight, hidden, th, labels, teacher_weight=tw, temperature=0.0)
    with pytest.raises(ValueError, match="reduction"):
        f(weight, hidden, th, labels, teacher_weight=tw, reduction="none")
    with pytest.raises(ValueError, match="divergence"):
        f(weight, hidden, th, labels, teacher_weight=tw, divergence="tvd")
    with pytest.raises(ValueError, match="labels"):
        f(weight, hidden, th, labels.masked_fill(labels == labels[1, 1], VS), teacher_weight=tw)
    with pytest.raises(ValueError, match="labels must have shape"):
        f(weight, hidden, th, labels[:, :-1], teacher_weight=tw)
    with pytest.raises(TypeError, match="teacher_hidden"):
        f(weight, hidden, th.long(), labels, teacher_weight=tw)
    with pytest.raises(ValueError, match="hidden must have last dimension"):
        f(weight, hidden[..., :-1], th, labels, teacher_weight=tw)
    with pytest.raises(ValueError, match="not both"):
        f(weight, hidden, th, labels, teacher_topk_logprobs=torch.zeros(B, T, 2), teacher_topk_indices=torch.zeros(
            B, T, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="teacher_topk_logprobs must have shape"):
        f(weight, hidden, None, labels, teacher_topk_logprobs=torch.zeros(B, 2), teacher_topk_indices=torch.zeros(
            B, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="unexpected keyword argument .betta."):
        LigerFusedLinearDistillationLoss(betta=0.5)
    weight, hidden, bias, th, tw, tb, labels = make()
    for bad in (dict(softcap=0.0), dict(softcap=-1.0), dict(logit_scale=0.0)):
        with pytest.raises(ValueError, match="softcap|logit_scale"):
            fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, **bad)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gpu_bf16_accuracy_vs_plain_torch(beta):
    """bf16 on the GPU (N=2048 tokens, H=1024, V=32000, teacher H=1536): our loss and student grads (hidden,
    weight) have relative error vs float64 at most 2x that of plain PyTorch bf16 autograd through TRL's
    generalized_jsd_loss (issue #3's accuracy bar; floors 1e-4 for the loss, 1e-3 for gradients, so an exact
    plain path cannot make the bar vanish). The loss is also held to bf16's absolute 1e-2; the gradients are
    not: at beta=1 plain bf16 itself reaches ~1e-2 (the bf16 rounding of the tile and hidden), and ours was
    measured at 0.0110 there, within the 2x bar."""
    torch.manual_seed(0)
    n, h, ht, v = 2048, 1024, 1536, 32000
    dev = "cuda"
    weight = (torch.randn(v, h, device=dev) / h**0.5 * 3).bfloat16().requires_grad_(True)
    hidden = torch.randn(1, n, h, device=dev).bfloat16().requires_grad_(True)
    tw = (torch.randn(v, ht, device=dev) / ht**0.5 * 3).bfloat16()
    th = torch.randn(1, n, ht, device=dev).bfloat16()
    labels = torch.randint(0, v, (1, n), device=dev)

    def plain(w, x, t_w, t_h):
        s = x @ w.T
        t = t_h @ t_w.T
        return generalized_jsd_loss(s.float(), t.float(), labels, beta=beta, temperature=2.0)

    w64, x64 = weight.detach().double().requires_grad_(True), hidden.detach().double().requires_grad_(True)
    ref = plain(w64, x64, tw.double(), th.double())
    ref_g = torch.autograd.grad(ref, (x64, w64))
    pl = plain(weight, hidden, tw, th)
    pl_g = torch.autograd.grad(pl, (hidden, weight))
    ours = fused_linear_distillation_loss(weight, hidden, th, labels, teacher_weight=tw, beta=beta,
                                          temperature=2.0).loss
    ours_g = torch.autograd.grad(ours, (hidden, weight))
    assert rel_err(ours, ref) <= max(2 * rel_err(pl, ref), 1e-4)
    assert rel_err(ours, ref) <= TOL[torch.bfloat16]
    for name, a, p, r in zip(("hidden", "weight"), ours_g, pl_g, ref_g):
        err, plain_err = rel_err(a, r), rel_err(p, r)
        assert err <= max(2 * plain_err, 1e-3), f"grad {name}: rel err {err:.4g} > 2x plain bf16 {plain_err:.4g}"


@pytest.mark.gpu
def test_gpu_fp32_matches_reference():
    """fp32 on the GPU with Vt > Vs, CE mix and a ragged mask: loss and grads within 1e-5 of float64 (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    weight, hidden, bias, th, tw, tb, labels = make()
    cuda = [t.detach().cuda().requires_grad_(t.requires_grad) if t is not None else None
            for t in (weight, hidden, bias)]
    th, tw, tb, labels = th.cuda(), tw.cuda(), tb.cuda(), labels.cuda()
    out = fused_linear_distillation_loss(cuda[0], cuda[1], th, labels, teacher_weight=tw, teacher_bias=tb,
                                         bias=cuda[2], hard_label_weight=0.4, chunk_tokens=5).loss
    ref = reference(cuda[0], cuda[1], cuda[2], th, tw, tb, labels, hard=0.4)
    check_all(out, ref, tuple(cuda), "gpu fp32")
