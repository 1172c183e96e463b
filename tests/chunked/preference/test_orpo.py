"""ORPO: the chunked loss vs TRL 1.16's ORPOTrainer code on float64 full logits.

Reference: float64 logits ``hidden @ weight.T (+ bias)``, TRL's ``get_batch_logps`` (mean per token),
TRL's ``odds_ratio_loss`` and the NLL term as TRL computes it (``nn.CrossEntropyLoss`` over the chosen
half; here over completion labels, see the module docstring), metrics as TRL's
``get_batch_loss_metrics`` logs them (``logits/*`` over valid tokens, our documented difference).
Tolerance: relative error <= 1e-5 (fp32 bar) on loss, grads of hidden/weight/bias and metrics.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_losses.chunked.preference.orpo import (
    TRL_METRIC_NAMES,
    LigerFusedLinearORPOLoss,
    fused_linear_orpo_loss,
)
from tests.chunked.preference.reference import (
    assert_metrics_match,
    chosen_nll,
    grads,
    leaf64,
    make_inputs,
    trl_batch_logps,
    trl_orpo,
    valid_token_mean,
)
from tests.helpers import TOL, rel_err

SHAPE = dict(batch=6, seq=8, hid=16, vocab=64)


def trl_reference(w64, h64, b64, labels, beta):
    """(loss, {trl name: value}) following TRL's ORPO get_batch_loss_metrics in float64."""
    logits = h64 @ w64.T
    if b64 is not None:
        logits = logits + b64
    avg = trl_batch_logps(logits, labels, average=True)
    half = avg.shape[0] // 2
    losses, c_rew, r_rew, log_odds_ratio, log_odds_chosen = trl_orpo(avg[:half], avg[half:], beta=beta)
    log_odds_ratio, log_odds_chosen = log_odds_ratio.detach(), log_odds_chosen.detach()
    nll = chosen_nll(logits, labels)
    loss = nll - losses.mean()
    avg, nll = avg.detach(), nll.detach()
    mask = labels != -100
    mean_logits = logits.detach().mean(-1)
    metrics = {
        "rewards/chosen": float(c_rew.mean()),
        "rewards/rejected": float(r_rew.mean()),
        "rewards/accuracies": float((c_rew > r_rew).float().mean()),
        "rewards/margins": float((c_rew - r_rew).mean()),
        "logps/chosen": float(avg[:half].mean()),
        "logps/rejected": float(avg[half:].mean()),
        "logits/chosen": valid_token_mean(mean_logits[:half], mask[:half]),
        "logits/rejected": valid_token_mean(mean_logits[half:], mask[half:]),
        "nll_loss": float(nll),
        "log_odds_ratio": float(log_odds_ratio),
        "log_odds_chosen": float(log_odds_chosen),
    }
    return loss, metrics


def run_vs_trl(*, beta=0.1, impl="torch", chunk_tokens=24, bias=False, seed=0):
    w, h, _, lab, b = make_inputs(**SHAPE, bias=bias, seed=seed)
    out = fused_linear_orpo_loss(w, h, lab, bias=b, beta=beta, impl=impl, chunk_tokens=chunk_tokens)
    w64, h64, b64 = leaf64(w, h, b)
    loss64, m64 = trl_reference(w64, h64, b64, lab, beta)
    assert rel_err(out.loss, loss64) <= TOL[torch.float32]
    for name, got, want in zip(("hidden", "weight", "bias"), grads(out.loss, h, w, b), grads(loss64, h64, w64, b64)):
        if want is not None:
            assert rel_err(got, want) <= TOL[torch.float32], name
    assert_metrics_match(out.metrics, m64, TRL_METRIC_NAMES)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_matches_trl(beta):
    """Loss, grads of hidden/weight and all logged metrics within 1e-5 of TRL in float64 (one pass)."""
    run_vs_trl(beta=beta)


@pytest.mark.parametrize("chunk_tokens", [5, 24])
def test_triton_tiles_with_bias(chunk_tokens):
    """Triton tiles (interpreter), LM-head bias; chunk_tokens=5 cuts pairs (two phases), 24 keeps whole
    pairs (one pass): within 1e-5 of TRL, bias gradient included."""
    run_vs_trl(beta=0.2, impl="auto", chunk_tokens=chunk_tokens, bias=True, seed=1)


def test_empty_sequence_pair_is_finite():
    """A prompt-only chosen (row 0): TRL gives NaN (0/0 mean); ours keeps the loss and grads finite, drops
    that pair's odds-ratio term and keeps the NLL over the remaining chosen tokens (1e-5 vs float64)."""
    w, h, _, lab, _ = make_inputs(**SHAPE, empty_rows=(0,))
    out = fused_linear_orpo_loss(w, h, lab, beta=0.1, impl="torch", chunk_tokens=24)
    w64, h64 = leaf64(w, h)
    logits = h64 @ w64.T
    mask = lab != -100
    lp = torch.log_softmax(logits, -1).gather(-1, lab.clamp(min=0)[..., None]).squeeze(-1) * mask
    avg = lp.sum(1) / mask.sum(1).clamp(min=1)
    c, r = avg[:3], avg[3:]
    log_odds = (c - r) - (torch.log(-torch.expm1(c.clamp(max=-1e-300))) - torch.log(-torch.expm1(r)))
    valid = mask[:3].any(1) & mask[3:].any(1)
    ratio = torch.where(valid, F.logsigmoid(log_odds), torch.zeros_like(log_odds))
    loss64 = chosen_nll(logits, lab) - 0.1 * ratio.mean()
    assert torch.isfinite(out.loss)
    assert rel_err(out.loss, loss64) <= TOL[torch.float32]
    for got, want in zip(grads(out.loss, h, w), grads(loss64, h64, w64)):
        assert rel_err(got, want) <= TOL[torch.float32]
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_module_equals_functional_and_bad_inputs():
    """The module gives the functional's loss exactly; odd batch, label/hidden mismatch, vocab mismatch
    and negative beta raise ValueError naming the argument."""
    w, h, _, lab, _ = make_inputs(**SHAPE)
    loss, metrics = LigerFusedLinearORPOLoss(beta=0.3, impl="torch")(w, h, lab)
    assert float(loss.detach()) == float(fused_linear_orpo_loss(w, h, lab, beta=0.3, impl="torch").loss.detach())
    assert set(metrics) <= set(TRL_METRIC_NAMES)
    with pytest.raises(ValueError, match="even"):
        fused_linear_orpo_loss(w, h[:3], lab[:3])
    with pytest.raises(ValueError, match="labels"):
        fused_linear_orpo_loss(w, h, lab[:, 1:])
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_orpo_loss(w[:, :4], h, lab)
    with pytest.raises(ValueError, match="beta"):
        LigerFusedLinearORPOLoss(beta=-1.0)
