"""ORPO (odds-ratio preference optimisation) from hidden states, reference-free.

``fused_linear_orpo_loss(weight, hidden, labels, *, bias=None, beta=0.1, ...)`` with ``weight [V, H]``,
``hidden [2P, T, H]`` laid out ``[chosen; rejected]`` on dim 0, ``labels [2P, T]`` int (shifted;
ignored positions ``ignore_index``), optional ``bias [V]``. Statistics and loss are float32.

As TRL 1.16's ``ORPOTrainer`` (``trl.experimental.orpo``): with ``a_c, a_r`` the per-token mean
log-probs of the chosen/rejected completions,

    log_odds = (a_c - a_r) - (log(1 - e^{a_c}) - log(1 - e^{a_r}))
    loss     = NLL_chosen - beta * mean_pairs(logsigmoid(log_odds))

where ``NLL_chosen`` is the token-averaged cross-entropy over all chosen tokens of the batch.

Differences from TRL, both forced by computing from hidden states without the full logits:
* TRL's NLL term counts the chosen *prompt* tokens too (labels from the attention mask); here it
  is over the tokens ``labels`` marks valid (pass prompt labels to include them, which also puts
  them in the odds ratio);
* TRL's ``logits/chosen`` averages over every position (prompt and padding included); here over
  the valid tokens.
An empty sequence (no valid token) has mean log-prob 0 (TRL: NaN); a pair with an empty side gets
no odds-ratio term (its NLL share stays), and ``log(1 - e^a)`` is kept finite by clamping ``a`` to
``<= -tiny``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ...kernels.utils import eager_under_compile
from ..objective import Objective
from ..options import HeadOptions, check_real, set_fields
from ..output import LossOutput
from ..sequence import check_sequence_inputs, run_sequence_objective
from .common import (
    PAIR_TRL_METRIC_NAMES,
    PreferenceLossModule,
    average_logps,
    batch_chosen_nll,
    chosen_nll_per_unit,
    detached,
    entropy_metric,
    log1mexp,
    pair_reward_metrics,
    safe_mean,
    split_pairs,
)

# our metric key -> the name TRL 1.16's ORPOTrainer logs
TRL_METRIC_NAMES = {
    **PAIR_TRL_METRIC_NAMES,
    "nll_loss": "nll_loss",
    "log_odds_ratio": "log_odds_ratio",
    "log_odds_chosen": "log_odds_chosen",
    "entropy": "entropy",
}


def orpo_log_odds(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor) -> torch.Tensor:
    """``[P]`` log odds ratio of the chosen over the rejected completion (mean log-probs in)."""
    tiny = torch.finfo(chosen_avg_logps.dtype).tiny
    c = chosen_avg_logps
    r = rejected_avg_logps
    return (c - r) - (log1mexp(c.clamp(max=-tiny)) - log1mexp(r.clamp(max=-tiny)))


def orpo_pair_losses(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float = 0.1,
    valid_pairs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-pair ORPO losses ``[P]``: ``chosen_nll - beta * logsigmoid(log_odds)``; the mean over the
    batch is TRL's loss when ``chosen_nll`` has the batch's token-averaged NLL as its mean.

    ``valid_pairs`` (bool ``[P]``): pairs where both completions have a valid token; the odds-ratio
    term of the others is 0 (TRL gives NaN there).
    """
    ratio = F.logsigmoid(orpo_log_odds(chosen_avg_logps, rejected_avg_logps))
    if valid_pairs is not None:
        ratio = torch.where(valid_pairs, ratio, torch.zeros_like(ratio))
    return chosen_nll - beta * ratio


@dataclass(frozen=True)
class ORPOOptions:
    """ORPO's own option: ``beta``, finite ``>= 0`` (the weight of the odds-ratio term)."""

    beta: float = 0.1

    def __post_init__(self):
        set_fields(self, beta=check_real("beta", self.beta, 0.0, None))


class ORPOObjective(Objective):
    """``objective(stats) -> (losses [U], {})`` for the chunked engine (pairs, separable)."""

    separable = True

    def __init__(self, *, beta: float):
        self.beta = beta

    def __call__(self, stats):
        avg = average_logps(stats.logps, stats.num_tokens)
        chosen_avg, rejected_avg = split_pairs(avg)
        chosen_sum, _ = split_pairs(stats.logps)
        nll = chosen_nll_per_unit(chosen_sum, stats.batch_num_tokens)
        c_len, r_len = split_pairs(stats.num_tokens)
        valid = (c_len > 0) & (r_len > 0)
        return orpo_pair_losses(chosen_avg, rejected_avg, nll, beta=self.beta, valid_pairs=valid), {}


def orpo_metrics(stats, *, beta: float) -> dict:
    """The 0-d means TRL's ORPOTrainer logs, from the whole-batch (detached) stats."""
    avg = average_logps(stats.logps, stats.num_tokens)
    chosen, rejected = split_pairs(avg)
    log_odds = orpo_log_odds(chosen, rejected)
    return detached({
        **pair_reward_metrics(stats, chosen, rejected, beta * chosen, beta * rejected),
        "nll_loss": batch_chosen_nll(stats.logps, stats.num_tokens),
        "log_odds_ratio": safe_mean(F.logsigmoid(log_odds)),
        "log_odds_chosen": safe_mean(log_odds),
        **entropy_metric(stats),
    })


def run_orpo(weight, hidden, labels, *, head: HeadOptions, options: ORPOOptions, bias=None) -> LossOutput:
    """:func:`fused_linear_orpo_loss` with its options already validated."""
    check_sequence_inputs(weight, hidden, labels, head, group_size=2, bias=bias)
    loss, _, stats = run_sequence_objective(weight, hidden, labels, ORPOObjective(beta=options.beta), head,
                                            group_size=2, bias=bias)
    return LossOutput(loss, orpo_metrics(stats, beta=options.beta))


@eager_under_compile
def fused_linear_orpo_loss(
    weight: torch.Tensor,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    beta: float = 0.1,
    need_entropy: bool = False,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> LossOutput:
    """ORPO loss of TRL 1.16 from hidden states; see the module docstring for shapes and formula.
    Options: :class:`ORPOOptions` and :class:`~liger_losses.chunked.options.HeadOptions`."""
    head = HeadOptions(need_entropy=need_entropy, ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale,
                       chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl)
    return run_orpo(weight, hidden, labels, head=head, options=ORPOOptions(beta=beta), bias=bias)


class LigerFusedLinearORPOLoss(PreferenceLossModule):
    """Module twin of :func:`fused_linear_orpo_loss`: ``loss_fn(weight, hidden, labels, *, bias=None)``."""

    runner = staticmethod(run_orpo)
    TRL_METRIC_NAMES = TRL_METRIC_NAMES
    REPR_KEYS = ("beta",)

    def __init__(
        self,
        beta: float = 0.1,
        *,
        need_entropy: bool = False,
        ignore_index: int = -100,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        chunk_tokens: Optional[int] = None,
        accum_dtype: Optional[torch.dtype] = None,
        impl: str = "auto",
    ):
        super().__init__(
            HeadOptions(need_entropy=need_entropy, ignore_index=ignore_index, softcap=softcap,
                        logit_scale=logit_scale, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl),
            ORPOOptions(beta=beta),
        )
