"""The worked example of CONTRIBUTING.md: a new preference loss is one objective function.

"Odds-ratio with margin": per pair, ``-log sigmoid(beta * (log_odds - margin))`` with ORPO's log
odds of the chosen over the rejected completion (mean log-probs per token). The objective below is
the whole loss; the engine (``fused_linear_sequence_objective`` with ``group_size=2``) does the
chunking, the reference-free statistics and the backward through the LM head. Checked against the
same formula on float64 logits: loss, gradients and metrics within 1e-5 relative error (the fp32
bar), in one pass and with 5-token chunks that cut every pair (two phases with recompute).

Part 2 registers it as a loss module like the built-in ones: a frozen options dataclass (validated
once, at construction), a runner on the package's sequence driver, and a ``ChunkedLossModule``
subclass with explicit keyword options (unknown ones raise ``TypeError``).
"""

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

import liger_losses as ll
from liger_losses.chunked.objective import Objective
from liger_losses.chunked.options import HeadOptions, check_real
from liger_losses.chunked.output import LossOutput
from liger_losses.chunked.preference.common import PreferenceLossModule, average_logps, split_pairs
from liger_losses.chunked.preference.orpo import orpo_log_odds
from liger_losses.chunked.sequence import check_sequence_inputs, run_sequence_objective
from tests.helpers import TOL, lm_head_inputs, rel_err

FP32 = TOL[torch.float32]
P, T, H, V = 3, 6, 8, 13


# --- the example: everything a new preference loss needs ------------------------------------
class OddsRatioMarginObjective(Objective):
    """Per pair: -log sigmoid(beta * (log_odds(chosen, rejected) - margin))."""

    separable = True  # a pair's loss depends on that pair only

    def __init__(self, beta: float = 0.5, margin: float = 0.2):
        self.beta, self.margin = beta, margin

    def __call__(self, stats):
        chosen, rejected = split_pairs(average_logps(stats.logps, stats.num_tokens))
        log_odds = orpo_log_odds(chosen, rejected)
        losses = -F.logsigmoid(self.beta * (log_odds - self.margin))
        return losses, {"log_odds": log_odds.detach()}


def odds_ratio_margin_loss(weight, hidden, labels, **options):
    loss, unit_metrics, _ = ll.fused_linear_sequence_objective(
        weight, hidden, labels, OddsRatioMarginObjective(), group_size=2, **options)
    return loss, unit_metrics
# ----------------------------------------------------------------------------------------------


def reference(weight, hidden, labels, beta=0.5, margin=0.2):
    """The same loss on float64 logits (all logits held): loss and per-pair log odds."""
    logits = hidden.double() @ weight.double().t()
    valid = labels != -100
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    avg = (logp * valid).sum(1) / valid.sum(1).clamp(min=1)
    c, r = avg[:P], avg[P:]
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
    return -F.logsigmoid(beta * (log_odds - margin)).mean(), log_odds


@pytest.mark.parametrize("chunk_tokens", [None, 5], ids=["one-pass", "two-phase"])
def test_odds_ratio_with_margin_matches_float64(chunk_tokens):
    g = torch.Generator().manual_seed(0)
    weight, hidden, _, labels = lm_head_inputs(g, 2 * P, T, H, V)
    labels[:, :2] = -100  # prompt
    labels[1, -1] = -100  # padding
    loss, unit_metrics = odds_ratio_margin_loss(weight, hidden, labels, chunk_tokens=chunk_tokens, impl="torch")
    gw, gh = torch.autograd.grad(loss, (weight, hidden))

    w64 = weight.detach().double().requires_grad_()
    h64 = hidden.detach().double().requires_grad_()
    ref_loss, ref_odds = reference(w64, h64, labels)
    rw, rh = torch.autograd.grad(ref_loss, (w64, h64))
    assert rel_err(loss, ref_loss) <= FP32
    assert rel_err(gw, rw) <= FP32 and rel_err(gh, rh) <= FP32
    assert rel_err(unit_metrics["log_odds"], ref_odds) <= FP32


# --- part 2: the same objective registered as a loss module ---------------------------------
@dataclass(frozen=True)
class OddsRatioMarginOptions:
    beta: float = 0.5
    margin: float = 0.2

    def __post_init__(self):
        check_real("beta", self.beta, 0.0, None, low_inclusive=False)  # names the option
        check_real("margin", self.margin)


def run_odds_ratio_margin(weight, hidden, labels, *, head: HeadOptions, options: OddsRatioMarginOptions,
                          bias=None) -> LossOutput:
    check_sequence_inputs(weight, hidden, labels, head, group_size=2, bias=bias)
    objective = OddsRatioMarginObjective(options.beta, options.margin)
    loss, unit_metrics, _ = run_sequence_objective(weight, hidden, labels, objective, head, group_size=2, bias=bias)
    return LossOutput(loss, {"log_odds": unit_metrics["log_odds"].mean()})


class LigerFusedLinearOddsRatioMarginLoss(PreferenceLossModule):
    runner = staticmethod(run_odds_ratio_margin)
    REPR_KEYS = ("beta", "margin")

    def __init__(self, beta: float = 0.5, margin: float = 0.2, *, chunk_tokens: Optional[int] = None,
                 impl: str = "auto"):
        super().__init__(HeadOptions(chunk_tokens=chunk_tokens, impl=impl), OddsRatioMarginOptions(beta, margin))
# ----------------------------------------------------------------------------------------------


def test_registered_module_equals_the_objective_and_validates_its_options():
    """The module gives the functional form's loss bitwise and the mean log odds; a non-finite
    margin and an unknown option raise naming them."""
    g = torch.Generator().manual_seed(1)
    weight, hidden, _, labels = lm_head_inputs(g, 2 * P, T, H, V)
    labels[:, :2] = -100
    module = LigerFusedLinearOddsRatioMarginLoss(chunk_tokens=5, impl="torch")
    out = module(weight, hidden, labels)
    loss, unit_metrics = odds_ratio_margin_loss(weight, hidden, labels, chunk_tokens=5, impl="torch")
    assert torch.equal(out.loss, loss)
    assert torch.equal(out.metrics["log_odds"], unit_metrics["log_odds"].mean())
    assert "margin=0.2" in repr(module)
    with pytest.raises(ValueError, match="margin"):
        LigerFusedLinearOddsRatioMarginLoss(margin=float("inf"))
    with pytest.raises(TypeError, match="marginn"):
        LigerFusedLinearOddsRatioMarginLoss(marginn=0.1)
