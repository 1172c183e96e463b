"""CPO (and AlphaPO): the chunked loss vs TRL 1.16's CPOTrainer code on float64 full logits.

Reference (``reference.trl_cpo_reference``): float64 logits, TRL's ``get_batch_logps`` (summed, or mean
per token for ipo/simpo), TRL's ``cpo_loss`` and ``cpo_alpha`` x the chosen NLL (``nn.CrossEntropyLoss``),
metrics as TRL logs them (``logits/*`` over valid tokens: our documented difference).
Tolerance: relative error <= 1e-5 (fp32 bar) on loss, grads of hidden/weight/bias and metrics.
"""

import pytest

from liger_losses.chunked.preference.cpo import (
    CPO_LOSS_TYPES,
    TRL_METRIC_NAMES,
    LigerFusedLinearCPOLoss,
    fused_linear_cpo_loss,
)
from tests.chunked.preference.reference import assert_matches_trl_cpo, make_inputs

SHAPE = dict(batch=6, seq=8, hid=16, vocab=64)


def run_vs_trl(options, *, impl="torch", chunk_tokens=24, bias=False, seed=0, trl_options=None):
    w, h, _, lab, b = make_inputs(**SHAPE, bias=bias, seed=seed)
    out = fused_linear_cpo_loss(w, h, lab, bias=b, impl=impl, chunk_tokens=chunk_tokens, **options)
    assert_matches_trl_cpo(out, w, h, b, lab, trl_options or options)


@pytest.mark.parametrize("loss_type", CPO_LOSS_TYPES)
@pytest.mark.parametrize("extra", [dict(), dict(label_smoothing=0.1, cpo_alpha=0.5), dict(alpha=0.2, cpo_alpha=0.0)])
def test_matches_trl(loss_type, extra):
    """Every CPO loss type, with label smoothing + a weighted NLL, and with AlphaPO rewards (alpha=0.2)
    and no NLL: loss, grads and metrics within 1e-5 of TRL in float64."""
    run_vs_trl(dict(beta=0.2, loss_type=loss_type, simpo_gamma=0.3, **extra))


def test_alphapo_sugar():
    """loss_type='alphapo' is TRL's sugar for loss_type='simpo' with cpo_alpha=0 (within 1e-5)."""
    run_vs_trl(dict(beta=1.0, loss_type="alphapo", alpha=0.5),
               trl_options=dict(beta=1.0, loss_type="simpo", alpha=0.5, cpo_alpha=0.0))


@pytest.mark.parametrize("chunk_tokens", [5, 24])
def test_triton_tiles_with_bias(chunk_tokens):
    """Triton tiles (interpreter) with bias; two-phase (5) and one-pass (24) chunking: within 1e-5."""
    run_vs_trl(dict(beta=0.1, loss_type="sigmoid", cpo_alpha=1.0), impl="auto", chunk_tokens=chunk_tokens,
               bias=True, seed=2)


def test_module_equals_functional_and_bad_options():
    """The module gives the functional's loss exactly; unknown loss_type, label_smoothing > 1, negative
    cpo_alpha and beta <= 0 raise ValueError naming the option; an odd batch raises ValueError."""
    w, h, _, lab, _ = make_inputs(**SHAPE)
    mod = LigerFusedLinearCPOLoss(beta=0.1, loss_type="hinge", cpo_alpha=0.5, impl="torch")
    loss, metrics = mod(w, h, lab)
    ref = fused_linear_cpo_loss(w, h, lab, beta=0.1, loss_type="hinge", cpo_alpha=0.5, impl="torch")
    assert float(loss.detach()) == float(ref.loss.detach())
    assert set(metrics) <= set(TRL_METRIC_NAMES)
    for kwargs, match in [
        (dict(loss_type="kto_pair"), "loss_type"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(cpo_alpha=-1.0), "cpo_alpha"),
        (dict(beta=0.0), "beta"),
    ]:
        with pytest.raises(ValueError, match=match):
            LigerFusedLinearCPOLoss(**kwargs)
    with pytest.raises(ValueError, match="even"):
        mod(w, h[:5], lab[:5])


@pytest.mark.parametrize("loss_type", CPO_LOSS_TYPES)
def test_long_pair_exemption_matches_trl(loss_type):
    """chunk_tokens=5 cuts every pair (two phases) with cpo_alpha=0: the longest pair is back-propagated
    in phase 1 with the objective's rejected/chosen gradient ratio (-1, or -len_c/len_r for the averaged
    ipo/simpo). Loss, grads and metrics within 1e-5 of TRL in float64, Triton tiles, bias."""
    run_vs_trl(dict(beta=0.2, loss_type=loss_type, simpo_gamma=0.3, cpo_alpha=0.0), impl="auto", chunk_tokens=5,
               bias=True, seed=1)


@pytest.mark.parametrize("loss_type", CPO_LOSS_TYPES)
@pytest.mark.parametrize("extra", [dict(), dict(cpo_alpha=0.5), dict(alpha=0.2)])
def test_pair_gradient_ratio_is_the_objectives_own(loss_type, extra):
    """CPOObjective.pair_gradient_ratio against autograd of the objective on random stats of pairs with
    7 chosen / 3 rejected tokens: declared -> d loss/d rejected = ratio * d loss/d chosen (1e-12, float64);
    None with the NLL term or AlphaPO's reward."""
    import torch

    from liger_losses.chunked.preference.cpo import CPOObjective, CPOOptions
    from liger_losses.chunked.sequence import SequenceStats

    options = dict(beta=0.3, loss_type=loss_type, label_smoothing=0.1, cpo_alpha=0.0, simpo_gamma=0.3, alpha=0.0)
    options.update(extra)
    obj = CPOObjective(CPOOptions(**options))
    ratio = obj.pair_gradient_ratio(7, 3)
    assert (ratio is None) == bool(extra)
    if ratio is None:
        return
    P = 4
    torch.manual_seed(0)
    logps = (-torch.rand(2 * P, dtype=torch.float64) * 20).requires_grad_()
    counts = torch.tensor([7.0] * P + [3.0] * P, dtype=torch.float64)
    stats = SequenceStats(logps=logps, num_tokens=counts, logits_sum=torch.zeros(2 * P), correct=torch.zeros(2 * P),
                          entropy_sum=None, ref_logps=None, batch_num_tokens=counts, index=torch.arange(2 * P))
    losses, _ = obj(stats)
    (g,) = torch.autograd.grad(losses.sum(), logps)
    assert torch.allclose(g[P:], ratio * g[:P], rtol=1e-12, atol=1e-15)
