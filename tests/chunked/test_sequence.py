"""Tests of liger_losses/chunked/sequence.py: the sequence-objective driver.

The driver is checked against a float64 reference written plainly (full logits, log-softmax,
per-sequence sums, a DPO-like objective, autograd). Bar: fp32 1e-5 relative error on the loss
and on every gradient; chunk_tokens small so that chunk boundaries fall inside sequences.
"""


import pytest
import torch
import torch.nn.functional as F

from liger_losses.chunked.sequence import SequenceStats, fused_linear_sequence_objective
from tests.helpers import TOL, assert_close_rel, lm_head_inputs

FP32 = TOL[torch.float32]


# ----------------------------------------------------------------------------- the driver

B, T, H, V = 4, 6, 16, 50


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    w, h, b, labels = lm_head_inputs(g, B, T, H, V)
    labels[:, :2] = -100
    labels[1, 4] = -100
    ref_h = torch.randn(B, T, H, generator=g)
    tw = torch.rand(B, T, generator=g)
    return w, h, b, labels, ref_h, tw


def _seq_logps(h, w, b, labels, tw=None, temperature=1.0, softcap=None):
    z = h @ w.T + (b if b is not None else 0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lp = torch.log_softmax(z / temperature, -1)
    t = lp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels != -100)
    if tw is not None:
        t = t * tw.double()
    return t.sum(1)


def dpo_objective(stats: SequenceStats):
    """A DPO-like pair objective (+ an NLL term using whole-batch token counts)."""
    P = stats.logps.shape[0] // 2
    c, r = stats.logps[:P], stats.logps[P:]
    ref = stats.ref_logps if stats.ref_logps is not None else torch.zeros_like(stats.logps)
    margin = (c - ref[:P]) - (r - ref[P:])
    n_c = stats.batch_num_tokens[stats.index[:P]]
    losses = -F.logsigmoid(0.1 * margin) - 0.05 * c / n_c
    return losses, {"margin": margin.detach(), "chosen_tokens": stats.num_tokens[:P]}


def seq_objective(stats: SequenceStats):
    """A per-sequence objective (group_size=1)."""
    return -stats.logps / stats.num_tokens.clamp(min=1), {"logps": stats.logps.detach()}


def _reference(w, h, b, labels, group_size, ref_mode, ref_h, tw, **kw):
    wd, hd, bd = [x.detach().double().requires_grad_() for x in (w, h, b)]
    logps = _seq_logps(hd, wd, bd, labels, tw, **kw)
    n = (labels != -100).sum(1).double()
    if ref_mode == "hidden":
        ref = _seq_logps(ref_h.double(), wd.detach(), bd.detach(), labels, tw, **kw)
    elif ref_mode == "logps":
        ref = ref_h
    else:
        ref = torch.zeros(B, dtype=torch.float64)
    if group_size == 2:
        P = B // 2
        margin = (logps[:P] - ref[:P]) - (logps[P:] - ref[P:])
        loss = (-F.logsigmoid(0.1 * margin) - 0.05 * logps[:P] / n[:P]).mean()
    else:
        loss = (-logps / n.clamp(min=1)).mean()
    loss.backward()
    return loss, hd.grad, wd.grad, bd.grad, logps.detach()


def _check(out, ref, w, h, b):
    loss = out[0]
    loss.backward()
    assert_close_rel(loss, ref[0], FP32, "loss")
    assert_close_rel(h.grad, ref[1], FP32, "grad_hidden")
    assert_close_rel(w.grad, ref[2], FP32, "grad_weight")
    assert_close_rel(b.grad, ref[3], FP32, "grad_bias")
    assert_close_rel(out[2].logps, ref[4], FP32, "stats.logps")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("separable,chunk_tokens", [(True, None), (True, 7), (False, 5)])
def test_pairs_one_pass_and_two_phase(impl, separable, chunk_tokens):
    """Pairs [chosen; rejected] with a reference from ref_hidden: loss, grads of hidden/weight/
    bias and the returned stats match float64 within 1e-5 in one pass (whole pairs per chunk,
    several chunks with chunk_tokens=7) and in two phases (separable=False, chunk_tokens=5 cuts
    sequences)."""
    w, h, b, labels, ref_h, _ = _inputs()
    ref = _reference(w, h, b, labels, 2, "hidden", ref_h, None)
    out = fused_linear_sequence_objective(
        w, h, labels, dpo_objective, group_size=2, separable=separable, bias=b, ref_hidden=ref_h,
        chunk_tokens=chunk_tokens, impl=impl,
    )
    _check(out, ref, w, h, b)
    assert out[1]["margin"].shape == (B // 2,)
    assert out[2].num_tokens.tolist() == (labels != -100).sum(1).float().tolist()


@pytest.mark.parametrize("separable,chunk_tokens", [(True, None), (True, 7), (False, 5)])
def test_float64_head(separable, chunk_tokens):
    """A float64 head runs (its tile statistics, float64, are summed into the driver's float32
    per-sequence statistics): loss and gradients match the float64 reference within the fp32 bar,
    the gradients in float64."""
    w, h, b, labels, ref_h, _ = _inputs(5)
    w, h, b = (x.detach().double().requires_grad_() for x in (w, h, b))
    ref = _reference(w, h, b, labels, 2, "hidden", ref_h, None)
    out = fused_linear_sequence_objective(
        w, h, labels, dpo_objective, group_size=2, separable=separable, bias=b, ref_hidden=ref_h.double(),
        chunk_tokens=chunk_tokens,
    )
    _check(out, ref, w, h, b)
    assert w.grad.dtype == h.grad.dtype == torch.float64


@pytest.mark.parametrize("group_size", [1, 2])
def test_objective_that_edits_its_stats_changes_nothing_else(group_size):
    """An objective that overwrites its inputs in place (num_tokens, logits_sum, correct, ref_logps)
    gets copies: the returned stats, the loss and the gradients equal those of the same objective
    without the edits (exactly), over several chunks and in both unit layouts."""
    w, h, b, labels, ref_h, _ = _inputs(4)
    objective = dpo_objective if group_size == 2 else seq_objective

    def vandal(stats: SequenceStats):
        out = objective(stats)
        for t in (stats.num_tokens, stats.logits_sum, stats.correct, stats.ref_logps):
            if t is not None:
                t.fill_(-7.0)
        return out

    results = []
    for fn in (objective, vandal):
        w_, h_ = w.detach().clone().requires_grad_(), h.detach().clone().requires_grad_()
        loss, _, stats = fused_linear_sequence_objective(
            w_, h_, labels, fn, group_size=group_size, ref_hidden=ref_h, chunk_tokens=7)
        loss.backward()
        results.append((loss.detach(), w_.grad, h_.grad, stats))
    (l0, gw0, gh0, s0), (l1, gw1, gh1, s1) = results
    assert torch.equal(l0, l1) and torch.equal(gw0, gw1) and torch.equal(gh0, gh1)
    for name in ("logps", "num_tokens", "logits_sum", "correct", "ref_logps"):
        assert torch.equal(getattr(s0, name), getattr(s1, name)), name


def test_pairs_split_when_pair_exceeds_chunk():
    """separable=True but a pair larger than chunk_tokens falls back to two phases: same result."""
    w, h, b, labels, ref_h, _ = _inputs(1)
    ref = _reference(w, h, b, labels, 2, "hidden", ref_h, None)
    out = fused_linear_sequence_objective(w, h, labels, dpo_objective, group_size=2, bias=b,
                                          ref_hidden=ref_h, chunk_tokens=3)
    _check(out, ref, w, h, b)


@pytest.mark.parametrize("ref_mode", ["logps", "none"])
def test_reference_from_logps_or_absent(ref_mode):
    """ref_logps given -> used as is; no reference -> stats.ref_logps is None (objective sees
    zeros); loss/grads within 1e-5."""
    w, h, b, labels, _, _ = _inputs(2)
    ref_logps = torch.randn(B) if ref_mode == "logps" else None
    ref = _reference(w, h, b, labels, 2, ref_mode, ref_logps.double() if ref_logps is not None else None, None)
    out = fused_linear_sequence_objective(w, h, labels, dpo_objective, group_size=2, bias=b,
                                          ref_logps=ref_logps, chunk_tokens=8)
    _check(out, ref, w, h, b)
    assert (out[2].ref_logps is None) == (ref_mode == "none")


def test_sequences_token_weights_and_transforms():
    """group_size=1 with token_weights, temperature and softcap: within 1e-5 of float64;
    entropy sums returned when asked."""
    w, h, b, labels, _, tw = _inputs(3)
    kw = dict(temperature=0.8, softcap=6.0)
    ref = _reference(w, h, b, labels, 1, "none", None, tw, **kw)
    out = fused_linear_sequence_objective(w, h, labels, seq_objective, bias=b, token_weights=tw,
                                          chunk_tokens=4, need_entropy=True, **kw)
    _check(out, ref, w, h, b)
    assert out[2].entropy_sum is not None and torch.all(out[2].entropy_sum > 0)


def test_frozen_weight_and_no_bias():
    """weight.requires_grad False: no weight gradient (the G^T GEMM is skipped), hidden grad
    still within 1e-5; no bias argument works."""
    w, h, _, labels, ref_h, _ = _inputs(4)
    w = w.detach()
    zero_b = torch.zeros(V, requires_grad=True)
    ref = _reference(w, h, zero_b, labels, 2, "hidden", ref_h, None)
    loss, _, _ = fused_linear_sequence_objective(w, h, labels, dpo_objective, group_size=2,
                                                 ref_hidden=ref_h, chunk_tokens=8)
    loss.backward()
    assert w.grad is None
    assert_close_rel(h.grad, ref[1], FP32, "grad_hidden")


def test_all_ignored_no_nan():
    """All labels ignored: finite loss, zero gradients, no NaN."""
    w, h, b, labels, _, _ = _inputs(5)
    labels[:] = -100
    loss, _, stats = fused_linear_sequence_objective(w, h, labels, seq_objective, bias=b)
    loss.backward()
    assert torch.isfinite(loss) and torch.all(h.grad == 0) and torch.all(w.grad == 0)
    assert torch.all(stats.num_tokens == 0)


def test_bad_inputs():
    """Odd batch for pairs, mismatched shapes, bad labels, bad objective output raise errors
    naming the argument."""
    w, h, b, labels, ref_h, tw = _inputs(6)
    f = fused_linear_sequence_objective
    with pytest.raises(ValueError, match="even"):
        f(w, h[:3], labels[:3], dpo_objective, group_size=2)
    with pytest.raises(ValueError, match="hidden"):
        f(w, h[..., :5], labels, seq_objective)
    with pytest.raises(ValueError, match="labels"):
        f(w, h, labels[:, :3], seq_objective)
    with pytest.raises(ValueError, match="labels"):
        f(w, h, labels + 1000, seq_objective)
    with pytest.raises(ValueError, match="ref_hidden"):
        f(w, h, labels, seq_objective, ref_hidden=ref_h[:, :2])
    with pytest.raises(ValueError, match="token_weights"):
        f(w, h, labels, seq_objective, token_weights=tw[:2])
    with pytest.raises(ValueError, match="group_size"):
        f(w, h, labels, seq_objective, group_size=3)
    with pytest.raises(TypeError, match="weight"):
        f(w.long(), h, labels, seq_objective)
    with pytest.raises(ValueError, match="objective"):
        f(w, h, labels, lambda s: (s.logps.sum(), {}))


@pytest.mark.gpu
def test_gpu_bf16_pairs_accuracy():
    """GPU, bf16, 8 sequences x 256 tokens, H=1024, V=32000: gradient errors vs float64 no worse
    than 2x plain PyTorch bf16 autograd's (the issue's bar)."""
    from tests.helpers import rel_err

    dev = "cuda"
    Bg, Tg, Hg, Vg = 8, 256, 1024, 32000
    w = (torch.randn(Vg, Hg, device=dev) * 0.02).bfloat16().requires_grad_()
    h = torch.randn(Bg, Tg, Hg, device=dev).bfloat16().requires_grad_()
    labels = torch.randint(0, Vg, (Bg, Tg), device=dev)
    labels[:, :32] = -100

    def plain(wx, hx):
        lp = torch.log_softmax((hx @ wx.T).float(), -1)
        t = lp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * (labels != -100)
        s = t.sum(1)
        P = Bg // 2
        return (-F.logsigmoid(0.1 * (s[:P] - s[P:]))).mean()

    wd, hd = w.detach().double().requires_grad_(), h.detach().double().requires_grad_()
    plain(wd, hd).backward()
    wp, hp = w.detach().clone().requires_grad_(), h.detach().clone().requires_grad_()
    plain(wp, hp).backward()
    loss, _, _ = fused_linear_sequence_objective(w, h, labels, dpo_objective_no_nll, group_size=2)
    loss.backward()
    for ours, pl, ref in ((h.grad, hp.grad, hd.grad), (w.grad, wp.grad, wd.grad)):
        assert rel_err(ours, ref) <= 2 * max(rel_err(pl, ref), 1e-3)


def dpo_objective_no_nll(stats):
    P = stats.logps.shape[0] // 2
    return -F.logsigmoid(0.1 * (stats.logps[:P] - stats.logps[P:])), {}


@pytest.mark.gpu
@pytest.mark.parametrize("separable", [True, False], ids=["one-pass", "recompute"])
def test_gpu_host_syncs_do_not_grow_with_chunks(separable):
    """GPU: the host syncs of a forward + backward (the token count and compaction before the chunk
    loop) are as many with 8 chunks as with 1. A sync inside the loop (e.g. a tensor copied from
    host memory, which drains the stream) left the H200 idle ~10 ms per DPO step
    (benchmark/NOTES.md, "One host sync per loss")."""
    from tests.helpers import count_host_syncs

    dev = "cuda"
    w = (torch.randn(1000, 64, device=dev) * 0.1).requires_grad_()
    h = torch.randn(8, 32, 64, device=dev).requires_grad_()
    labels = torch.randint(0, 1000, (8, 32), device=dev)
    labels[:, :8] = -100
    ref_h = torch.randn(8, 32, 64, device=dev)

    def syncs(chunk_tokens):
        def step():
            loss, _, _ = fused_linear_sequence_objective(
                w, h, labels, dpo_objective_no_nll, group_size=2, separable=separable,
                ref_hidden=ref_h, chunk_tokens=chunk_tokens,
            )
            loss.backward()

        return count_host_syncs(step)

    syncs(None)  # warm-up (compilation)
    assert syncs(24) == syncs(1024)


# ----------------------------------------------------------------------------- the Objective protocol


def test_objective_declarations_choose_the_path():
    """An Objective subclass declares how it may run: separable -> called once per chunk of units
    (one pass); separable=False -> called once on the whole batch (two phases); its
    pair_gradient_ratio is asked for the longest pair's lengths. The loss is the same either way
    (fp32 1e-5: other chunk orders); a plain callable works as a separable objective."""
    from liger_losses.chunked.objective import Objective

    class Margin(Objective):
        def __init__(self, separable):
            self.separable, self.calls, self.asked = separable, [], []

        def pair_gradient_ratio(self, chosen_tokens, rejected_tokens):
            self.asked.append((chosen_tokens, rejected_tokens))
            return -1.0

        def __call__(self, stats):
            self.calls.append(stats.logps.shape[0])
            chosen, rejected = stats.logps.chunk(2)
            return -F.logsigmoid(0.1 * (chosen - rejected)), {}

    w, h, b, labels, _, _ = _inputs(seed=2)
    one, whole = Margin(True), Margin(False)
    loss1, _, _ = fused_linear_sequence_objective(w, h, labels, one, group_size=2, chunk_tokens=8, impl="torch")
    loss2, _, _ = fused_linear_sequence_objective(w, h, labels, whole, group_size=2, chunk_tokens=8, impl="torch")
    assert one.calls == [2, 2] and one.asked == []  # one pair (<= 8 tokens) per chunk
    assert whole.calls == [4] and len(whole.asked) == 1
    assert_close_rel(loss1, loss2, FP32, "one pass vs two phases")
    plain, _, _ = fused_linear_sequence_objective(w, h, labels, one.__call__, group_size=2, chunk_tokens=8,
                                                  impl="torch")
    assert_close_rel(plain, loss1, FP32, "plain callable")
