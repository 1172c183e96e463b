"""KTO: the chunked loss vs TRL 1.16's KTOTrainer code on float64 full-logits log-probs.

Reference: TRL's own ``KTOTrainer._compute_loss`` (run unbound on stand-ins, precomputed-reference
path, see ``reference.py``) fed per-token log-probs of the whole float64 logits; the reference and KL
log-probs come from the same float64 computation. Tolerance: relative error <= 1e-5 (fp32 bar) on
the loss, the gradients of hidden/weight/bias and every metric TRL logs.
"""

import pytest
import torch

from liger_losses.chunked.preference.kto import (
    TRL_METRIC_NAMES,
    LigerFusedLinearKTOLoss,
    fused_linear_kto_loss,
)
from tests.chunked.preference.reference import (
    assert_metrics_match,
    grads,
    leaf64,
    make_inputs,
    token_outputs64,
    trl_kto,
)
from tests.helpers import TOL, rel_err

SHAPE = dict(batch=6, seq=8, hid=16, vocab=64)
PREF = torch.tensor([True, False, True, True, False, False])


def kl_inputs(seed=7):
    """Mismatched KL completions [6, 7, 16]; the reference is a sharper head (2x hidden) so the KL
    estimate is positive and the KL term of the loss is exercised."""
    _, kl_h, _, kl_lab, _ = make_inputs(batch=6, seq=7, hid=16, vocab=64, seed=seed)
    kl_h = kl_h.detach()
    return kl_h, 2.0 * kl_h, kl_lab


def run_vs_trl(*, loss_type="kto", impl="torch", chunk_tokens=24, bias=False, need_entropy=False, pref=PREF,
               precomputed=False, seed=0, **options):
    w, h, rh, lab, b = make_inputs(**SHAPE, bias=bias, seed=seed)
    kl_h, kl_rh, kl_lab = kl_inputs()
    w64, h64, b64 = leaf64(w, h, b)
    bd = None if b64 is None else b64.detach()
    pol = token_outputs64(w64, h64, lab, b64)
    ref_logps = token_outputs64(w64.detach(), rh.double(), lab, bd).log_probs.sum(1)
    kl_logps = token_outputs64(w64.detach(), kl_h.double(), kl_lab, bd).log_probs.sum(1)
    ref_kl_logps = token_outputs64(w64.detach(), kl_rh.double(), kl_lab, bd).log_probs.sum(1)
    if loss_type == "kto":
        assert float((kl_logps - ref_kl_logps).mean()) > 0  # the KL term is exercised
    call = dict(preference_labels=pref, bias=b, loss_type=loss_type, impl=impl, chunk_tokens=chunk_tokens,
                need_entropy=need_entropy, **options)
    if precomputed:
        out = fused_linear_kto_loss(w, h, None, lab, ref_logps=ref_logps.float(), kl_hidden=kl_h, kl_labels=kl_lab,
                                    ref_kl_logps=ref_kl_logps.float(), **call)
    else:
        out = fused_linear_kto_loss(w, h, rh, lab, kl_hidden=kl_h, kl_ref_hidden=kl_rh, kl_labels=kl_lab, **call)
    loss64, m64 = trl_kto(pol, pol.mask, pref, ref_logps, kl_logps, ref_kl_logps, loss_type=loss_type, **options)
    assert rel_err(out.loss, loss64) <= TOL[torch.float32], (float(out.loss.detach()), float(loss64.detach()))
    for name, got, want in zip(("hidden", "weight", "bias"), grads(out.loss, h, w, b), grads(loss64, h64, w64, b64)):
        if want is not None:
            assert rel_err(got, want) <= TOL[torch.float32], name
    skip = ("num_tokens",) if need_entropy else ("num_tokens", "entropy")
    assert_metrics_match(out.metrics, m64, TRL_METRIC_NAMES, skip=skip)
    inverse = {v: k for k, v in TRL_METRIC_NAMES.items()}
    assert set(out.metrics) == {inverse[k] for k in m64 if k not in skip}  # same keys present/absent as TRL
    return out


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_matches_trl(loss_type):
    """Both TRL 1.16 KTO loss types with unequal desirable/undesirable weights (1.3/0.7) and beta=0.2:
    loss, grads and metrics (kl, rewards, logps, logits, margins) within 1e-5 of TRL in float64."""
    run_vs_trl(loss_type=loss_type, beta=0.2, desirable_weight=1.3, undesirable_weight=0.7)


def test_precomputed_reference_logps():
    """Precomputed ref_logps and ref_kl_logps give TRL's result (within 1e-5)."""
    run_vs_trl(precomputed=True)


@pytest.mark.parametrize("chunk_tokens", [5, 24])
def test_triton_tiles_bias_entropy(chunk_tokens):
    """Triton tiles (interpreter), LM-head bias (shared with the reference), entropy metric; chunks
    cutting sequences (5) and holding several (24): within 1e-5 of TRL."""
    run_vs_trl(impl="auto", chunk_tokens=chunk_tokens, bias=True, need_entropy=True, seed=5)


def test_single_kind_batch_omits_metrics_like_trl():
    """All sequences desirable: TRL logs no rejected_* metrics and no margin; neither do we; the rest
    agrees within 1e-5."""
    run_vs_trl(pref=torch.ones(6, dtype=torch.bool))


def test_explicit_kl_and_empty_sequences():
    """A given kl= (e.g. gathered across ranks) replaces the estimate; prompt-only sequences give a
    finite loss and finite grads."""
    w, h, rh, lab, _ = make_inputs(**SHAPE, empty_rows=(0, 1))
    out = fused_linear_kto_loss(w, h, rh, lab, preference_labels=PREF, kl=torch.tensor(0.25), impl="torch")
    assert torch.isfinite(out.loss) and float(out.metrics["kl"]) == 0.25
    assert all(torch.isfinite(g).all() for g in grads(out.loss, h, w))


def test_module_equals_functional_and_bad_inputs():
    """The module gives the functional's loss exactly; wrong preference_labels shape/dtype, missing KL
    completions for 'kto', a missing or doubled reference and a bad loss_type raise clear errors."""
    w, h, rh, lab, _ = make_inputs(**SHAPE)
    kl_h, kl_rh, kl_lab = kl_inputs()
    kw = dict(preference_labels=PREF, kl_hidden=kl_h, kl_ref_hidden=kl_rh, kl_labels=kl_lab)
    loss, metrics = LigerFusedLinearKTOLoss(beta=0.3, impl="torch")(w, h, rh, lab, **kw)
    ref = fused_linear_kto_loss(w, h, rh, lab, beta=0.3, impl="torch", **kw)
    assert float(loss.detach()) == float(ref.loss.detach())
    f = lambda *a, **k: fused_linear_kto_loss(*a, impl="torch", **k)  # noqa: E731
    with pytest.raises(ValueError, match="preference_labels"):
        f(w, h, rh, lab, **{**kw, "preference_labels": PREF[:4]})
    with pytest.raises(TypeError, match="preference_labels"):
        f(w, h, rh, lab, **{**kw, "preference_labels": PREF.float()})
    with pytest.raises(ValueError, match="kl_hidden"):
        f(w, h, rh, lab, preference_labels=PREF)
    with pytest.raises(ValueError, match="reference"):
        f(w, h, None, lab, **kw)
    with pytest.raises(ValueError, match="reference"):
        f(w, h, rh, lab, ref_logps=torch.zeros(6), **kw)
    with pytest.raises(ValueError, match="kl_labels"):
        f(w, h, rh, lab, **{**kw, "kl_labels": kl_lab[:, :3]})
    with pytest.raises(ValueError, match="loss_type"):
        LigerFusedLinearKTOLoss(loss_type="bco")
