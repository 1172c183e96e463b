"""RLOO's clipped sequence-ratio loss (TRL 1.16 ``RLOOTrainer._compute_loss``) from hidden states.

``fused_linear_rloo_loss(weight, hidden, labels, *, advantages [B], old_logps [B], ...)``: with
``logps_b = sum_t m log p(label_t)`` (the sequence's summed log-probs of ``softmax(z / temperature)``,
``m`` the valid-token mask), ``r_b = exp(logps_b - old_logps_b)`` and ``A_b`` the advantages, the loss
is ``mean_b -min(r_b A_b, clip(r_b, 1 - epsilon_low, 1 + epsilon_high) A_b)`` over all ``B``
sequences (one without a valid token has ``logps_b = 0``: a constant term, as in TRL). KL enters
RLOO through the rewards, not the loss. ``weight [V, H]``, ``hidden [B, T, H]``, ``labels [B, T]``
(``ignore_index`` at padding), ``bias [V]``.

Each token's gradient needs its sequence's sum: one pass over chunks of whole sequences while a
sequence fits the tile budget, else two phases (:mod:`liger_losses.chunked.token_objective`).
Returns ``LossOutput(loss, metrics)`` with the metrics TRL logs (``RLOO_TRL_METRIC_NAMES``): the token
mean ``entropy``, and over the ``B`` sequences the clipped fractions ``clip_ratio_low_mean``,
``clip_ratio_low_min``, ``clip_ratio_high_mean``, ``clip_ratio_high_max``, ``clip_ratio_region_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.gemm import compute_dtype
from liger_losses.chunked.options import HeadOptions, check_head_inputs, check_real, set_fields
from liger_losses.chunked.output import LossOutput
from liger_losses.chunked.token_objective import TokenChunk, TokenObjective, run_token_objective
from liger_losses.kernels.logits_tile import torch_stats_dtype
from liger_losses.kernels.utils import check_same_device, check_tensor, eager_under_compile

RLOO_TRL_METRIC_NAMES = {
    "entropy": "entropy",
    "clip_ratio_low_mean": "clip_ratio/low_mean",
    "clip_ratio_low_min": "clip_ratio/low_min",
    "clip_ratio_high_mean": "clip_ratio/high_mean",
    "clip_ratio_high_max": "clip_ratio/high_max",
    "clip_ratio_region_mean": "clip_ratio/region_mean",
}


@dataclass(frozen=True)
class RLOOOptions:
    """RLOO's clipping range (TRL 1.16 ``RLOOConfig`` names and defaults): finite numbers ``>= 0``;
    ``epsilon_high=None`` means ``epsilon_low``."""

    epsilon_low: float = 0.2
    epsilon_high: Optional[float] = None

    def __post_init__(self):
        low = check_real("epsilon_low", self.epsilon_low, 0.0, None)
        high = None if self.epsilon_high is None else check_real("epsilon_high", self.epsilon_high, 0.0, None)
        set_fields(self, epsilon_low=low, epsilon_high=high)

    @property
    def eps_high(self) -> float:
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high


def _clipped(log_ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float):
    """``(per-sequence loss, low flags, high flags)`` of TRL's RLOO formula."""
    coef_1 = torch.exp(log_ratio)
    coef_2 = coef_1.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)
    c = coef_1.detach()
    return loss, ((c < 1 - eps_low) & (adv < 0)).to(c.dtype), ((c > 1 + eps_high) & (adv > 0)).to(c.dtype)


class RLOOObjective(TokenObjective):
    """Token-driver objective: the chunk's sequences' share of the mean over B (a token's loss needs
    its sequence's summed log-probs: sequence coupling)."""

    coupling = "sequence"

    def __init__(self, advantages: Tensor, old_logps: Tensor, eps_low: float, eps_high: float):
        self.adv, self.old, self.eps_low, self.eps_high = advantages, old_logps, eps_low, eps_high
        self.B = advantages.shape[0]

    def __call__(self, chunk: TokenChunk) -> tuple[Tensor, dict]:
        zeros = torch.zeros(self.B, dtype=chunk.logps.dtype, device=self.adv.device)
        seq_logps = zeros.index_add(0, chunk.seq, chunk.logps)
        present = zeros.index_add(0, chunk.seq, torch.ones_like(chunk.logps)) > 0
        loss, low, high = _clipped(seq_logps - self.old, self.adv, self.eps_low, self.eps_high)
        keep = present.to(zeros.dtype)
        sums = {"entropy": chunk.entropy.detach().sum(), "low@seq": low * keep, "high@seq": high * keep}
        return (loss * keep).sum() / self.B, sums


def run_rloo(weight: Tensor, hidden: Tensor, labels: Tensor, *, head: HeadOptions, options: RLOOOptions,
             advantages: Tensor, old_logps: Tensor, bias: Optional[Tensor] = None) -> LossOutput:
    """:func:`fused_linear_rloo_loss` with its options already validated (``head``, ``options``)."""
    check_head_inputs(weight, hidden, labels, bias, head, hidden_ndim=3)
    B = labels.shape[0]
    for name, value in (("advantages", advantages), ("old_logps", old_logps)):
        check_tensor(name, value, floating=True)
        if tuple(value.shape) != (B,):
            raise ValueError(f"{name} must have shape [{B}] (one per sequence), got {tuple(value.shape)}")
    check_same_device(hidden=hidden, advantages=advantages, old_logps=old_logps)
    eps_low, eps_high = options.epsilon_low, options.eps_high
    dtype = torch_stats_dtype(compute_dtype(weight))  # float64 only for a float64 head: no float32 step then
    adv, old = advantages.detach().to(dtype), old_logps.detach().to(dtype)
    objective = RLOOObjective(adv, old, eps_low, eps_high)
    loss, sums, _ = run_token_objective(weight, hidden, labels, objective, head=head, bias=bias,
                                        inputs_checked=True)
    # sequences without a valid token: logps 0, a constant term and their flags
    mask = labels != head.ignore_index
    empty = ~mask.any(-1)
    e_loss, e_low, e_high = _clipped(torch.zeros_like(old) - old, adv, eps_low, eps_high)
    loss = loss + (e_loss * empty).sum() / max(B, 1)
    low = torch.where(empty, e_low, sums.get("low@seq", torch.zeros_like(adv)))
    high = torch.where(empty, e_high, sums.get("high@seq", torch.zeros_like(adv)))
    n = mask.sum().clamp(min=1).to(dtype)
    metrics = {
        "entropy": sums.get("entropy", torch.zeros((), device=adv.device)) / n,
        "clip_ratio_low_mean": low.mean(), "clip_ratio_low_min": low.min(),
        "clip_ratio_high_mean": high.mean(), "clip_ratio_high_max": high.max(),
        "clip_ratio_region_mean": ((low + high) > 0).float().mean(),
    }
    return LossOutput(loss, metrics)


@eager_under_compile
def fused_linear_rloo_loss(
    weight: Tensor,
    hidden: Tensor,
    labels: Tensor,
    *,
    advantages: Tensor,
    old_logps: Tensor,
    bias: Optional[Tensor] = None,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> LossOutput:
    """TRL 1.16's RLOO loss from hidden states; see the module docstring. Shared options:
    :class:`~liger_losses.chunked.options.HeadOptions`; the others: :class:`RLOOOptions`."""
    options = RLOOOptions(epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    head = HeadOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                       chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl, need_entropy=True)
    return run_rloo(weight, hidden, labels, head=head, options=options, advantages=advantages,
                    old_logps=old_logps, bias=bias)
