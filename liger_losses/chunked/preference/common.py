"""Shared pieces of the preference losses: input checks, pair splitting, metrics from sequence stats.

Every preference loss is a small formula on per-sequence statistics (``SequenceStats`` of the
chunked engine: ``[S]`` float32 tensors). This module holds what the DPO/ORPO/CPO/SimPO/KTO modules
share:

* :func:`check_sequence_values` -- a per-sequence float tensor such as precomputed reference
  log-probs (the other input checks are the driver's, ``sequence.check_sequence_inputs``);
* :func:`split_pairs` -- ``[chosen; rejected]`` halves of a ``[2P]`` tensor (TRL's layout);
* :func:`token_mean` -- ``sum(num) / sum(den)`` with 0 for an empty denominator (no NaN);
* :func:`chosen_nll_per_unit` -- the per-pair share of a batch-token-averaged NLL term on the
  chosen sequences, so that the engine's mean over pairs gives exactly the token mean;
* :func:`sequence_metrics` -- token-weighted mean logits, token accuracy and entropy of a subset of
  sequences, read off the (detached) whole-batch stats: no extra GEMM;
* :func:`pair_reward_metrics` -- the reward/log-prob/logit means every paired loss logs
  (``PAIR_TRL_METRIC_NAMES``), and :func:`detached`;
* :class:`PreferenceLossModule` -- base of the reference-free ``nn.Module`` twins
  (``forward(weight, hidden, labels, *, bias=None)``), on ``chunked.module.ChunkedLossModule``;
* :func:`zero_objective` (forward-only passes) and :func:`log1mexp`.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from ...kernels.utils import check_tensor
from ..module import ChunkedLossModule
from ..objective import Objective

# All preference logps/ratios are float32 [S] tensors from the engine; formulas run in that dtype.


def check_sequence_values(name: str, value, size: int, device: torch.device) -> torch.Tensor:
    """Check a per-sequence float tensor (e.g. precomputed reference logps) of shape ``[size]``."""
    check_tensor(name, value, ndim=1, floating=True)
    if value.shape[0] != size:
        raise ValueError(f"{name} must have shape [{size}], got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like hidden, got {value.device}")
    return value.detach().float()


def split_pairs(x: torch.Tensor):
    """``(chosen, rejected)`` halves of a ``[2P]`` tensor laid out ``[chosen; rejected]``."""
    half = x.shape[0] // 2
    return x[:half], x[half:]


def token_mean(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """0-d ``num.sum() / den.sum()``; 0 when the denominator is 0 (TRL logs 0.0 there too)."""
    n = num.sum()
    d = den.sum()
    return torch.where(d > 0, n / d.clamp(min=1e-30), torch.zeros_like(n))


def safe_mean(x: torch.Tensor) -> torch.Tensor:
    """0-d mean that is 0 for an empty tensor (instead of NaN)."""
    return x.mean() if x.numel() > 0 else x.new_zeros(())


def mean_margin_gradient_ratio(chosen_tokens: int, rejected_tokens: int) -> float:
    """d loss / d rejected_logps over d loss / d chosen_logps for a loss of the per-token means'
    margin ``chosen / len_c - rejected / len_r`` (lengths clamped to 1 as :func:`average_logps`
    does): ``-len_c / len_r``. The ``pair_gradient_ratio`` of the length-normalised types."""
    return -max(chosen_tokens, 1) / max(rejected_tokens, 1)


def average_logps(logps: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean log-prob ``logps / num_tokens``; 0 for a sequence with no valid token.

    TRL divides by the raw count and gives NaN there; an empty sequence's log-prob is 0 here.
    """
    return logps / num_tokens.clamp(min=1.0)


def chosen_nll_per_unit(
    chosen_logps: torch.Tensor, batch_num_tokens: torch.Tensor
) -> torch.Tensor:
    """Per-pair share of the chosen-token NLL ``-sum(chosen logps) / N_chosen`` of the WHOLE batch.

    ``chosen_logps [U]`` (summed log-probs of the chosen sequences of the units in this call),
    ``batch_num_tokens [B]`` (valid tokens of every sequence of the whole batch, ``[chosen; rejected]``).
    Returns ``[U]`` values whose mean over all ``P = B/2`` pairs of the batch is the token-averaged
    NLL over the batch's chosen tokens (``nn.CrossEntropyLoss`` mean, as TRL computes it), so the
    term stays separable over pairs. 0 when the batch has no chosen token.
    """
    num_pairs = batch_num_tokens.shape[0] // 2
    n_chosen = batch_num_tokens[:num_pairs].sum()
    scale = num_pairs / n_chosen.clamp(min=1.0)
    return -chosen_logps * scale


def batch_chosen_nll(logps: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """0-d token-averaged NLL over the chosen half of a ``[chosen; rejected]`` batch (0 if empty)."""
    c_logps, _ = split_pairs(logps)
    c_tokens, _ = split_pairs(num_tokens)
    return -token_mean(c_logps, c_tokens)


def sequence_metrics(stats, select: torch.Tensor, prefix: str) -> Dict[str, torch.Tensor]:
    """``{prefix}_logits_mean``: token-weighted mean logit of the selected sequences (TRL's
    ``logits/chosen``: sum over valid tokens of the mean-over-vocab logit / number of tokens).

    ``select`` is a bool ``[B]`` mask or a slice over the batch's sequences.
    """
    return {f"{prefix}_logits_mean": token_mean(stats.logits_sum[select], stats.num_tokens[select])}


# The metric keys every paired loss logs (see :func:`pair_reward_metrics`) -> TRL 1.16's names.
PAIR_TRL_METRIC_NAMES = {
    "chosen_rewards": "rewards/chosen",
    "rejected_rewards": "rewards/rejected",
    "reward_accuracies": "rewards/accuracies",
    "reward_margins": "rewards/margins",
    "chosen_logps": "logps/chosen",
    "rejected_logps": "logps/rejected",
    "chosen_logits_mean": "logits/chosen",
    "rejected_logits_mean": "logits/rejected",
}


def pair_reward_metrics(
    stats, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
) -> Dict[str, torch.Tensor]:
    """The ``PAIR_TRL_METRIC_NAMES`` keys of a ``[chosen; rejected]`` batch: 0-d means over the ``P``
    pairs of the given ``[P]`` log-probs and rewards (0 when empty), reward accuracy and margin, and
    the token-weighted mean logits of each half (:func:`sequence_metrics`)."""
    half = chosen_logps.shape[0]
    return {
        "chosen_rewards": safe_mean(chosen_rewards),
        "rejected_rewards": safe_mean(rejected_rewards),
        "reward_accuracies": safe_mean((chosen_rewards > rejected_rewards).float()),
        "reward_margins": safe_mean(chosen_rewards - rejected_rewards),
        "chosen_logps": safe_mean(chosen_logps),
        "rejected_logps": safe_mean(rejected_logps),
        **sequence_metrics(stats, slice(0, half), "chosen"),
        **sequence_metrics(stats, slice(half, 2 * half), "rejected"),
    }


def detached(metrics: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``metrics`` with every value detached (what the losses return)."""
    return {k: v.detach() for k, v in metrics.items()}


def entropy_metric(stats) -> Dict[str, torch.Tensor]:
    """``entropy``: mean softmax entropy over all valid tokens of the batch, when the engine gave it."""
    if stats.entropy_sum is None:
        return {}
    return {"entropy": token_mean(stats.entropy_sum, stats.num_tokens)}


class ZeroObjective(Objective):
    """Objective with zero loss, for forward-only passes (e.g. KTO's KL sequences)."""

    def __call__(self, stats):
        return stats.logps * 0.0, {}


zero_objective = ZeroObjective()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return torch.where(
        x < -math.log(2.0), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x))
    )


class PreferenceLossModule(ChunkedLossModule):
    """Base of the reference-free preference modules (CPO, SimPO, ORPO): options fixed at
    construction, ``forward(weight, hidden, labels, *, bias=None)`` calling the loss's runner."""

    def forward(
        self, weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor, *, bias: Optional[torch.Tensor] = None
    ):
        return self.run(weight, hidden, labels, bias=bias)
