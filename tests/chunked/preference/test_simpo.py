"""SimPO: CPO's "simpo" loss (length-averaged log-probs, target margin gamma, no reference) vs TRL.

Reference: TRL 1.16's CPO code with ``loss_type="simpo"`` (``reference.trl_cpo_reference``) on float64
full logits. Tolerance: relative error <= 1e-5 (fp32 bar) on loss, grads and metrics.
"""

import pytest
import torch

from liger_losses.chunked.preference.cpo import (
    LigerFusedLinearSimPOLoss,
    fused_linear_cpo_loss,
    fused_linear_simpo_loss,
)
from tests.chunked.preference.reference import assert_matches_trl_cpo, grads, make_inputs

SHAPE = dict(batch=6, seq=8, hid=16, vocab=64)


@pytest.mark.parametrize(
    "options,impl,chunk_tokens",
    [
        (dict(), "torch", 24),
        (dict(beta=2.5, gamma=1.0, label_smoothing=0.1, cpo_alpha=0.3), "torch", 24),
        (dict(beta=2.0, gamma=0.5), "auto", 5),
    ],
)
def test_matches_trl_simpo(options, impl, chunk_tokens):
    """Module defaults (beta=2, gamma=0.5, cpo_alpha=0) and custom options; torch tiles one pass and
    Triton tiles two-phase: loss, grads of hidden/weight, metrics within 1e-5 of TRL's CPO 'simpo'."""
    w, h, _, lab, _ = make_inputs(**SHAPE, seed=4)
    out = LigerFusedLinearSimPOLoss(**options, impl=impl, chunk_tokens=chunk_tokens)(w, h, lab)
    trl_opts = dict(beta=options.get("beta", 2.0), loss_type="simpo", simpo_gamma=options.get("gamma", 0.5),
                    label_smoothing=options.get("label_smoothing", 0.0), cpo_alpha=options.get("cpo_alpha", 0.0))
    assert_matches_trl_cpo(out, w, h, None, lab, trl_opts)


def test_simpo_is_cpo_simpo_and_empty_sequence_finite():
    """fused_linear_simpo_loss == fused_linear_cpo_loss(loss_type='simpo', simpo_gamma=gamma) exactly;
    with a prompt-only sequence (TRL: NaN from 0/0) the loss, grads and metrics stay finite."""
    w, h, _, lab, _ = make_inputs(**SHAPE, empty_rows=(1, 3))
    a = fused_linear_simpo_loss(w, h, lab, beta=2.0, gamma=0.7, impl="torch")
    b = fused_linear_cpo_loss(w, h, lab, beta=2.0, loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.0, impl="torch")
    assert float(a.loss.detach()) == float(b.loss.detach())
    assert torch.isfinite(a.loss)
    gh, gw = grads(a.loss, h, w)
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert all(torch.isfinite(v) for v in a.metrics.values())
    with pytest.raises(ValueError, match="beta"):
        LigerFusedLinearSimPOLoss(beta=-2.0)
