"""DPO family: the chunked loss vs TRL 1.16's DPOTrainer code on float64 full-logits log-probs.

The reference is TRL's own ``DPOTrainer._compute_loss`` (run unbound on stand-ins, see
``reference.py``) fed per-token log-probs from the whole float64 logits; ours runs in fp32 through
the chunked engine. Tolerance: relative error <= 1e-5 (the fp32 bar) on the loss, the gradients of
hidden/weight/bias and every metric TRL logs. Shapes are tiny (3 pairs x 8 tokens, H=16, V=64) so the
Triton interpreter stays fast; most loss-type sweeps use ``impl="torch"`` (same engine, PyTorch tiles),
the Triton tile path is covered by dedicated cases.
"""

import math

import pytest
import torch

from liger_losses.chunked.preference.dpo import (
    DPO_LOSS_TYPES,
    TRL_METRIC_NAMES,
    DPOObjective,
    DPOOptions,
    LigerFusedLinearDPOLoss,
    dpo_metrics,
    fused_linear_dpo_loss,
    ld_token_weights,
)
from liger_losses.chunked.sequence import fused_linear_sequence_objective
from tests.chunked.preference.reference import (
    assert_metrics_match,
    grads,
    leaf64,
    make_inputs,
    token_outputs64,
    trl_dpo,
)
from tests.helpers import TOL, rel_err

SHAPE = dict(batch=6, seq=8, hid=16, vocab=64)
TRL_ONLY = ("rpo_alpha", "reference_free")


def _trl_kwargs(kw):
    kw = dict(kw)
    for k in TRL_ONLY:
        kw.pop(k, None)
    return kw


def run_vs_trl(loss_kwargs, *, impl="torch", chunk_tokens=24, bias=False, need_entropy=False, empty_rows=(),
               ref_mode="hidden", trl_kwargs=None, seed=0):
    """Run ours and TRL on the same fresh inputs; assert loss, grads and metrics agree (fp32 bar)."""
    w, h, rh, lab, b = make_inputs(**SHAPE, bias=bias, empty_rows=empty_rows, seed=seed)
    w64, h64, b64 = leaf64(w, h, b)
    ref_b64 = None if b64 is None else b64.detach()
    tw = ld_token_weights(lab, loss_kwargs["ld_alpha"]) if loss_kwargs.get("ld_alpha") is not None else None
    pol = token_outputs64(w64, h64, lab, b64, token_weights=tw)
    ref = token_outputs64(w64.detach(), rh.double(), lab, ref_b64)
    call = dict(bias=b, chunk_tokens=chunk_tokens, impl=impl, need_entropy=need_entropy, **loss_kwargs)
    if ref_mode == "hidden":
        out = fused_linear_dpo_loss(w, h, rh, lab, **call)
    elif ref_mode == "logps":
        ref_sums = (ref.log_probs * (tw if tw is not None else 1.0)).sum(1).float()
        half = ref_sums.shape[0] // 2
        out = fused_linear_dpo_loss(
            w, h, None, lab, ref_chosen_logps=ref_sums[:half], ref_rejected_logps=ref_sums[half:], **call
        )
    else:  # reference-free
        out = fused_linear_dpo_loss(w, h, None, lab, reference_free=True, **call)
        ref.log_probs = torch.zeros_like(ref.log_probs)
    trl_kw = trl_kwargs or _trl_kwargs(loss_kwargs)
    if trl_kw.get("f_divergence_type") == "alpha_divergence":
        # TRL's alpha-divergence clamp table has no float64 entry: feed it float32 log-probs
        # (still ~1e-7 accurate, and differentiable back to the float64 leaves)
        pol.log_probs, ref.log_probs = pol.log_probs.float(), ref.log_probs.float()
    loss64, m64 = trl_dpo(pol, ref, pol.mask, **trl_kw)
    assert torch.isfinite(out.loss)
    assert rel_err(out.loss, loss64) <= TOL[torch.float32], (float(out.loss), float(loss64))
    for name, got, want in zip(("hidden", "weight", "bias"), grads(out.loss, h, w, b), grads(loss64, h64, w64, b64)):
        if want is not None:
            err = rel_err(got, want)
            assert err <= TOL[torch.float32], f"grad {name}: rel err {err:.2e}"
    skip = ("num_tokens",) if need_entropy else ("num_tokens", "entropy")
    assert_metrics_match(out.metrics, m64, TRL_METRIC_NAMES, skip=skip)
    return out


LOSS_OPTIONS = {
    "exo_pair": dict(label_smoothing=1e-3),
    "robust": dict(label_smoothing=0.1),
    "aot": dict(label_smoothing=0.05),
    "aot_unpaired": dict(label_smoothing=0.05),
    "discopop": dict(discopop_tau=0.05),
}


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_every_loss_type_matches_trl(loss_type):
    """Each of TRL 1.16's 15 loss types: loss, grads and metrics within 1e-5 of TRL's code in float64
    (chunks of whole pairs: one pass; 'aot' types sort the batch and take the two-phase path)."""
    run_vs_trl(dict(beta=0.2, loss_type=loss_type, **LOSS_OPTIONS.get(loss_type, {})))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "bco_pair"])
@pytest.mark.parametrize("ld_alpha", [None, 0.5], ids=["plain", "ld"])
def test_wpo_weighting_matches_trl(loss_type, ld_alpha):
    """``use_weighting=True`` (WPO: each pair's loss times the detached ``w_chosen * w_rejected``, ``w`` the exp of
    the completion's mean ``log p(label) - log sum_v p^2``), with LD-DPO's token weights too (WPO reads the
    unweighted log-probs): loss, grads and metrics within 1e-5 of TRL's code in float64. The weights are live:
    unweighted, the loss differs by more than 10x the bar."""
    kw = dict(beta=0.2, loss_type=loss_type, ld_alpha=ld_alpha)
    weighted = run_vs_trl(dict(kw, use_weighting=True), trl_kwargs=dict(kw, use_weighting=True))
    plain = run_vs_trl(kw)
    assert rel_err(weighted.loss, plain.loss) > 10 * TOL[torch.float32]


def test_wpo_weighting_of_the_sft_term():
    """WPO with an ``"sft"`` term (``rpo_alpha``): TRL 1.16 means the batch's chosen-token NLL times each pair's
    weight (its code multiplies the expanded NLL in place and raises there), so the reference is TRL's weighted
    sigmoid loss plus ``rpo_alpha * mean(w_chosen * w_rejected) * NLL``, in float64; ours takes the two-phase path
    (the term needs every pair). Loss and grads within 1e-5."""
    w, h, rh, lab, _ = make_inputs(**SHAPE)
    w64, h64 = leaf64(w, h)
    pol = token_outputs64(w64, h64, lab)
    ref = token_outputs64(w64.detach(), rh.double(), lab)
    sigmoid, _ = trl_dpo(pol, ref, pol.mask, beta=0.2, use_weighting=True)
    mask = pol.mask.double()
    with torch.no_grad():
        seq = torch.exp(((pol.log_probs - pol.log_sum_sq_probs) * mask).sum(1) / mask.sum(1).clamp(min=1))
    pairs = seq[: seq.shape[0] // 2] * seq[seq.shape[0] // 2:]
    chosen = slice(0, seq.shape[0] // 2)
    nll = -pol.log_probs[chosen].sum() / mask[chosen].sum()
    want = sigmoid + 0.5 * pairs.mean() * nll
    out = fused_linear_dpo_loss(w, h, rh, lab, beta=0.2, rpo_alpha=0.5, use_weighting=True, chunk_tokens=24,
                                impl="torch")
    assert rel_err(out.loss, want) <= TOL[torch.float32], (float(out.loss), float(want))
    for name, got, ref_grad in zip(("hidden", "weight"), grads(out.loss, h, w), grads(want, h64, w64)):
        assert rel_err(got, ref_grad) <= TOL[torch.float32], name


@pytest.mark.parametrize(
    "f_div,coef,loss_type",
    [
        ("forward_kl", 0.5, "sigmoid"),
        ("js_divergence", 0.5, "hinge"),
        ("alpha_divergence", 0.5, "ipo"),
        ("alpha_divergence", 0.3, "sigmoid_norm"),
        ("alpha_divergence", 1.0, "robust"),
        ("js_divergence", 0.5, "discopop"),
    ],
)
def test_f_divergences_match_trl(f_div, coef, loss_type):
    """f-DPO scores (forward KL, JS, alpha incl. the alpha=1 limit) on the loss types TRL allows:
    within 1e-5 of TRL in float64."""
    kw = dict(beta=0.1, loss_type=loss_type, f_divergence_type=f_div, f_alpha_divergence_coef=coef)
    kw.update(LOSS_OPTIONS.get(loss_type, {}))
    run_vs_trl(kw)


def test_weighted_combination_with_bias_matches_trl():
    """MPO-style list (sigmoid + bco_pair + sft, weights 0.8/0.2/1.0) with an LM-head bias shared by
    the reference: loss and grads of hidden, weight, bias within 1e-5 of TRL."""
    run_vs_trl(dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]), bias=True)


def test_rpo_alpha_is_sigmoid_plus_weighted_sft():
    """rpo_alpha=0.5 (RPO) equals TRL 1.16's loss_type=['sigmoid', 'sft'], loss_weights=[1, 0.5]
    (the token-averaged chosen NLL of the whole batch, kept exact across chunks): within 1e-5."""
    run_vs_trl(
        dict(loss_type="sigmoid", rpo_alpha=0.5),
        trl_kwargs=dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_ld_alpha_matches_trl(loss_type):
    """LD-DPO (ld_alpha=0.4): tokens beyond the pair's shared completion length weighted by 0.4 in the
    policy AND reference log-probs (as TRL does); ipo still normalises by the raw lengths: within 1e-5."""
    run_vs_trl(dict(loss_type=loss_type, ld_alpha=0.4))


def test_ld_token_weights_layout():
    """The LD weights: 1 for the first min(len_c, len_r) valid tokens of each side, ld_alpha after,
    0 at ignored positions (exact)."""
    labels = torch.tensor([[-100, 1, 2, 3, 4], [-100, -100, 5, -100, -100]])  # pair: chosen len 4, rejected 1
    w = ld_token_weights(labels, 0.25)
    assert torch.equal(w, torch.tensor([[0, 1, 0.25, 0.25, 0.25], [0, 0, 1, 0, 0]]))


@pytest.mark.parametrize("ref_mode", ["logps", "free"])
def test_precomputed_reference_and_reference_free(ref_mode):
    """Precomputed ref_chosen_logps/ref_rejected_logps give TRL's result; reference_free=True equals TRL
    with reference log-probs 0 (within 1e-5)."""
    run_vs_trl(dict(loss_type="sigmoid"), ref_mode=ref_mode)


@pytest.mark.parametrize("chunk_tokens", [5, 24])
def test_triton_tiles_one_pass_and_two_phase(chunk_tokens):
    """Triton tile kernels (interpreter on CPU), bias, entropy metric: chunk_tokens=5 cuts pairs (two
    phases, logits recomputed), 24 holds whole pairs (one pass). Both within 1e-5 of TRL; so is WPO's
    weighting on the Triton kernel's ``log sum p^2``."""
    run_vs_trl(dict(beta=0.1, loss_type=["sigmoid", "sft"]), impl="auto", chunk_tokens=chunk_tokens, bias=True,
               need_entropy=True)
    wpo = dict(beta=0.1, loss_type="sigmoid", use_weighting=True)
    run_vs_trl(wpo, impl="auto", chunk_tokens=chunk_tokens, bias=True, trl_kwargs=wpo)


def test_whole_batch_objective_path_equals_one_pass():
    """The DPO objective run with separable=False (one objective call on the whole batch, logits
    recomputed for the gradient) gives the same loss and grads as the one-pass module (<= 1e-6), and the
    same metrics within the fp32 bar (1e-5: the rewards are differences of sums accumulated in another
    chunk order, so they can lose a few ulps to cancellation)."""
    w, h, rh, lab, _ = make_inputs(**SHAPE, seed=3)
    obj = DPOObjective(DPOOptions(beta=0.1, loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.3)))
    loss2, _, stats = fused_linear_sequence_objective(
        w, h, lab, obj, group_size=2, separable=False, ref_hidden=rh, chunk_tokens=24, impl="torch"
    )
    g2 = grads(loss2, h, w)
    out = fused_linear_dpo_loss(w, h, rh, lab, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.3],
                                chunk_tokens=24, impl="torch")
    assert rel_err(loss2, out.loss) <= 1e-6
    for a, b in zip(g2, grads(out.loss, h, w)):
        assert rel_err(a, b) <= 1e-6
    m = dpo_metrics(stats, beta=0.1)
    for k, v in out.metrics.items():
        assert rel_err(m[k], v) <= 1e-5, k


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sft"])
def test_fully_ignored_sequences_no_nan(loss_type):
    """A prompt-only chosen (row 0) and a prompt-only rejected (row 4): logps 0 as in TRL, the loss and
    grads stay finite and match TRL within 1e-5 ('ipo' divides by clamp(len, 1) like TRL)."""
    run_vs_trl(dict(loss_type=loss_type), empty_rows=(0, 4))


def test_all_ignored_batch_is_finite():
    """Every label ignored: finite loss (sigmoid: log 2), zero gradients, metrics finite (token means 0)."""
    w, h, rh, lab, _ = make_inputs(**SHAPE)
    lab[:] = -100
    out = fused_linear_dpo_loss(w, h, rh, lab, impl="torch")
    assert abs(float(out.loss.detach()) - math.log(2)) < 1e-6
    gh, gw = grads(out.loss, h, w)
    assert float(gh.abs().max()) == 0.0 and float(gw.abs().max()) == 0.0
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_module_equals_functional():
    """LigerFusedLinearDPOLoss(...)(weight, hidden, ref_hidden, labels) == the functional (exact) and
    returns a LossOutput whose metric keys all map to TRL names."""
    w, h, rh, lab, _ = make_inputs(**SHAPE)
    mod = LigerFusedLinearDPOLoss(beta=0.2, loss_type="hinge", impl="torch")
    a = mod(w, h, rh, lab)
    b = fused_linear_dpo_loss(w, h, rh, lab, beta=0.2, loss_type="hinge", impl="torch")
    loss, metrics = a
    assert float(loss.detach()) == float(b.loss.detach())
    assert set(metrics) <= set(TRL_METRIC_NAMES)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(loss_type="nope"), ValueError, "loss_type"),
        (dict(loss_type="exo_pair"), ValueError, "label_smoothing"),
        (dict(loss_type="bco_pair", f_divergence_type="forward_kl"), ValueError, "f_divergence_type"),
        (dict(f_divergence_type="kl"), ValueError, "f_divergence_type"),
        (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), ValueError, "loss_weights"),
        (dict(beta=0.0), ValueError, "beta"),
        (dict(ld_alpha=1.5), ValueError, "ld_alpha"),
        (dict(loss_type="aot", use_weighting=True), NotImplementedError, "use_weighting"),
        (dict(loss_type=["sigmoid", "aot_unpaired"], use_weighting=True), NotImplementedError, "use_weighting"),
        (dict(ld_alpha=0.5, rpo_alpha=1.0), NotImplementedError, "ld_alpha"),
        (dict(loss_type="robust", label_smoothing=0.5), ValueError, "label_smoothing"),
    ],
)
def test_bad_options_raise(kwargs, exc, match):
    """Bad or unsupported options fail at construction with an error naming the option."""
    with pytest.raises(exc, match=match):
        LigerFusedLinearDPOLoss(**kwargs)


def test_bad_inputs_raise():
    """Odd batch, labels/hidden mismatch, vocab/hidden-size mismatch, bad bias, label out of range,
    integer hidden, missing or doubled reference, wrong ref logps shape: clear ValueError/TypeError."""
    w, h, rh, lab, _ = make_inputs(**SHAPE)
    f = lambda *a, **k: fused_linear_dpo_loss(*a, impl="torch", **k)  # noqa: E731
    with pytest.raises(ValueError, match="even"):
        f(w, h[:5], rh[:5], lab[:5])
    with pytest.raises(ValueError, match="labels"):
        f(w, h, rh, lab[:, :5])
    with pytest.raises(ValueError, match="hidden"):
        f(w[:, :8], h, rh, lab)
    with pytest.raises(ValueError, match="bias"):
        f(w, h, rh, lab, bias=torch.zeros(63))
    bad = lab.clone()
    bad[0, 3] = 64
    with pytest.raises(ValueError, match="labels"):
        f(w, h, rh, bad)
    with pytest.raises(TypeError, match="hidden"):
        f(w, h.long(), rh, lab)
    with pytest.raises(ValueError, match="reference"):
        f(w, h, None, lab)
    with pytest.raises(ValueError, match="ref_hidden"):
        f(w, h, rh[:, :5], lab)
    half = torch.zeros(3)
    with pytest.raises(ValueError, match="not both"):
        f(w, h, rh, lab, ref_chosen_logps=half, ref_rejected_logps=half)
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        f(w, h, None, lab, ref_chosen_logps=torch.zeros(4), ref_rejected_logps=torch.zeros(4))
    with pytest.raises(ValueError, match="together"):
        f(w, h, None, lab, ref_chosen_logps=half)


@pytest.mark.gpu
def test_gpu_bf16_close_to_fp64():
    """On the GPU in bf16 (H=256, V=4096, 4 pairs x 256 tokens, Triton tiles): loss and grads of hidden
    and weight within the bf16 bar (1e-2 relative) of a float64 full-logits reference."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    P, T, H, V = 4, 256, 256, 4096
    w = (torch.randn(V, H, device=dev) / H**0.5).bfloat16().requires_grad_()
    h = torch.randn(2 * P, T, H, device=dev).bfloat16().requires_grad_()
    rh = (h.detach().float() + 0.3 * torch.randn_like(h.float())).bfloat16()
    lab = torch.randint(0, V, (2 * P, T), device=dev)
    lab[:, : T // 4] = -100
    out = fused_linear_dpo_loss(w, h, rh, lab, beta=0.1)
    gh, gw = grads(out.loss, h, w)
    w64, h64 = leaf64(w, h)
    lp = torch.log_softmax(h64 @ w64.T, -1)
    rlp = torch.log_softmax(rh.double() @ w64.detach().T, -1)
    mask = lab != -100
    tok = lambda x: (x.gather(-1, lab.clamp(min=0)[..., None]).squeeze(-1) * mask).sum(1)  # noqa: E731
    pol, ref = tok(lp), tok(rlp)
    d = (pol[:P] - ref[:P]) - (pol[P:] - ref[P:])
    loss64 = -torch.nn.functional.logsigmoid(0.1 * d).mean()
    gh64, gw64 = grads(loss64, h64, w64)
    assert rel_err(out.loss, loss64) <= TOL[torch.bfloat16]
    assert rel_err(gh, gh64) <= TOL[torch.bfloat16]
    assert rel_err(gw, gw64) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "sigmoid_norm", "discopop", "aot", "nca_pair"])
def test_long_pair_exemption_matches_trl(loss_type):
    """chunk_tokens=5 cuts every pair (two phases). For loss types with a fixed rejected/chosen
    gradient ratio the longest pair is back-propagated in phase 1 (rejected tiles scaled by the ratio,
    the pair scaled by its chosen gradient afterwards); nca_pair has no such ratio (longest sequence
    only). Loss, grads of hidden/weight/bias, metrics: within 1e-5 of TRL in float64, Triton tiles."""
    run_vs_trl(dict(beta=0.2, loss_type=loss_type, **LOSS_OPTIONS.get(loss_type, {})), impl="auto",
               chunk_tokens=5, bias=True, empty_rows=(1,))


@pytest.mark.parametrize(
    "loss_type,f_div,expect",
    [("sigmoid", "reverse_kl", -1.0), (["hinge", "robust"], "reverse_kl", -1.0), ("ipo", "reverse_kl", -7 / 3),
     ("sigmoid_norm", "reverse_kl", -7 / 3), (["sigmoid", "ipo"], "reverse_kl", None),
     (["sigmoid", "sft"], "reverse_kl", None), ("bco_pair", "reverse_kl", None), ("apo_zero", "reverse_kl", None),
     ("sigmoid", "js_divergence", None), ("aot_unpaired", "reverse_kl", None)],
)
def test_pair_gradient_ratio_is_the_objectives_own(loss_type, f_div, expect):
    """DPOObjective.pair_gradient_ratio (what the engine's two-phase path trusts) against autograd of
    the objective itself on random stats of pairs with 7 chosen / 3 rejected tokens: where a ratio is
    declared, d loss/d rejected = ratio * d loss/d chosen for every pair (1e-12 in float64)."""
    from liger_losses.chunked.sequence import SequenceStats

    types = [loss_type] if isinstance(loss_type, str) else loss_type
    obj = DPOObjective(DPOOptions(beta=0.3, loss_type=tuple(types), label_smoothing=0.1, f_divergence_type=f_div))
    ratio = obj.pair_gradient_ratio(7, 3)
    assert (ratio is None) == (expect is None)
    if ratio is None:
        return
    assert ratio == pytest.approx(expect)
    P = 4
    torch.manual_seed(0)
    logps = (-torch.rand(2 * P, dtype=torch.float64) * 20).requires_grad_()
    counts = torch.tensor([7.0] * P + [3.0] * P, dtype=torch.float64)
    stats = SequenceStats(logps=logps, num_tokens=counts, logits_sum=torch.zeros(2 * P), correct=torch.zeros(2 * P),
                          entropy_sum=None, ref_logps=-torch.rand(2 * P, dtype=torch.float64) * 20,
                          batch_num_tokens=counts, index=torch.arange(2 * P))
    losses, _ = obj(stats)
    (g,) = torch.autograd.grad(losses.sum(), logps)
    assert torch.allclose(g[P:], ratio * g[:P], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["ipo", "sigmoid_norm", ("sigmoid", "ipo")])
@pytest.mark.parametrize("chunk_tokens", [24, 5], ids=["one-pass", "two-phase"])
def test_sequence_lengths_are_the_length_normalised_divisors(loss_type, chunk_tokens):
    """``sequence_lengths`` replaces the label counts that ipo / sigmoid_norm divide by (TRL counts a
    completion token at position 0, which has no label). TRL's loss on a completion mask with one more
    counted position (no log-prob there) in every other sequence: loss and gradients within 1e-5 (the
    fp32 bar), in one pass and in two phases (the long-pair shortcut then stands aside); without the
    lengths ours differs."""
    w, h, rh, lab, _ = make_inputs(**SHAPE, seed=3)
    w64, h64 = leaf64(w, h)
    pol = token_outputs64(w64, h64, lab)
    ref = token_outputs64(w64.detach(), rh.double(), lab)
    mask = pol.mask.clone()
    mask[::2, 1] = True  # position 1 is a prompt position: no label, log-prob 0
    lengths = mask.sum(1).float()
    kw = dict(beta=0.3, loss_type=loss_type)
    out = fused_linear_dpo_loss(w, h, rh, lab, sequence_lengths=lengths, chunk_tokens=chunk_tokens, impl="torch", **kw)
    loss64, _ = trl_dpo(pol, ref, mask, **kw)
    assert rel_err(out.loss, loss64) <= TOL[torch.float32], (float(out.loss), float(loss64))
    for got, want in zip(grads(out.loss, h, w, None), grads(loss64, h64, w64, None)):
        if want is not None:
            assert rel_err(got, want) <= TOL[torch.float32]
    plain = fused_linear_dpo_loss(w.detach(), h.detach(), rh, lab, chunk_tokens=chunk_tokens, impl="torch", **kw)
    assert rel_err(plain.loss, loss64) > 1e-3
    with pytest.raises(ValueError, match="sequence_lengths"):
        fused_linear_dpo_loss(w, h, rh, lab, sequence_lengths=lengths[:-1], **kw)
