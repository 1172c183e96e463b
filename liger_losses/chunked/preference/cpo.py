"""CPO and SimPO (and AlphaPO) from hidden states, reference-free.

``fused_linear_cpo_loss(weight, hidden, labels, *, bias=None, beta=0.1, loss_type="sigmoid", ...)``
and ``fused_linear_simpo_loss(...)`` with ``weight [V, H]``, ``hidden [2P, T, H]`` laid out
``[chosen; rejected]`` on dim 0, ``labels [2P, T]`` int (shifted; ignored positions
``ignore_index``), optional ``bias [V]``. Statistics and loss are float32.

As TRL 1.16's ``CPOTrainer`` (``trl.experimental.cpo``): per sequence ``s`` = summed completion
log-prob (``"sigmoid"``, ``"hinge"``) or mean per token (``"ipo"``, ``"simpo"``); with AlphaPO's
``alpha != 0`` the reward is ``r = (1 - e^{-alpha s}) / alpha`` (TRL writes ``(1 - p^-alpha)/alpha``
with ``p = e^s``; same value, no overflow), else ``r = s``. With ``z = r_c - r_r``
(``- simpo_gamma/beta`` for SimPO):

    sigmoid/simpo: -(1-eps) logsigmoid(beta z) - eps logsigmoid(-beta z)
    hinge:         relu(1 - beta z)
    ipo:           (z - 1/(2 beta))^2
    loss = mean_pairs(losses) + cpo_alpha * NLL_chosen   (token-averaged over the batch's chosen tokens)

SimPO is ``loss_type="simpo"`` (TRL's ``CPOConfig(loss_type="simpo", cpo_alpha=0)``); its module
defaults to ``beta=2.0, gamma=0.5, cpo_alpha=0.0``. Difference from TRL: ``logits/chosen`` is the mean
logit over valid tokens (TRL: over every position, prompt and padding included). An empty sequence
has mean log-prob 0 (TRL: NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ...kernels.utils import check_choice, eager_under_compile
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
    mean_margin_gradient_ratio,
    pair_reward_metrics,
    split_pairs,
)

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
AVERAGED_LOSS_TYPES = frozenset({"ipo", "simpo"})

# our metric key -> the name TRL 1.16's CPOTrainer logs
TRL_METRIC_NAMES = {**PAIR_TRL_METRIC_NAMES, "nll_loss": "nll_loss", "entropy": "entropy"}


def alphapo_rewards(logps: torch.Tensor, alpha: float) -> torch.Tensor:
    """AlphaPO reward ``(1 - p^-alpha) / alpha`` with ``p = exp(logps)``, as ``-expm1(-alpha logps) / alpha``."""
    if alpha == 0.0:
        return logps
    return -torch.expm1(-alpha * logps) / alpha


def cpo_pair_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
) -> torch.Tensor:
    """Per-pair CPO/SimPO preference losses ``[P]`` (without the NLL term), TRL 1.16's ``cpo_loss``.

    ``chosen_logps``/``rejected_logps`` are already averaged for ``"ipo"``/``"simpo"``.
    """
    z = alphapo_rewards(chosen_logps, alpha) - alphapo_rewards(rejected_logps, alpha)
    eps = label_smoothing
    if loss_type == "simpo":
        z = z - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        return -F.logsigmoid(beta * z) * (1 - eps) - F.logsigmoid(-beta * z) * eps
    if loss_type == "hinge":
        return torch.relu(1 - beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    raise ValueError(f"loss_type must be one of {CPO_LOSS_TYPES}, got {loss_type!r}")


@dataclass(frozen=True)
class CPOOptions:
    """CPO/SimPO/AlphaPO's own options (errors name the option): ``beta`` finite ``> 0``,
    ``loss_type`` in :data:`CPO_LOSS_TYPES` or ``"alphapo"`` (which becomes ``"simpo"`` with
    ``cpo_alpha=0``, as in TRL), ``cpo_alpha`` finite ``>= 0``, ``label_smoothing`` in ``[0, 1]``,
    ``simpo_gamma`` and AlphaPO's ``alpha`` finite."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    cpo_alpha: float = 1.0
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, CPO_LOSS_TYPES + ("alphapo",))
        loss_type, cpo_alpha = self.loss_type, self.cpo_alpha
        if loss_type == "alphapo":
            loss_type, cpo_alpha = "simpo", 0.0
        set_fields(
            self, loss_type=loss_type, beta=check_real("beta", self.beta, 0.0, None, low_inclusive=False),
            label_smoothing=check_real("label_smoothing", self.label_smoothing, 0.0, 1.0),
            cpo_alpha=check_real("cpo_alpha", cpo_alpha, 0.0, None),
            simpo_gamma=check_real("simpo_gamma", self.simpo_gamma), alpha=check_real("alpha", self.alpha),
        )


class CPOObjective(Objective):
    """``objective(stats) -> (losses [U], {})`` for the chunked engine (pairs, separable) of the
    :class:`CPOOptions` ``options``."""

    separable = True

    def __init__(self, options: CPOOptions):
        self.options = options

    def pair_gradient_ratio(self, chosen_tokens: int, rejected_tokens: int) -> Optional[float]:
        """``r`` with ``d loss / d rejected_logps = r * d loss / d chosen_logps`` (see
        ``DPOObjective.pair_gradient_ratio``): every CPO type is a function of the chosen-minus-
        rejected (mean) log-prob, so ``-1``, or ``-chosen_tokens / rejected_tokens`` for the
        length-averaged ``ipo``/``simpo``; None with the NLL term (``cpo_alpha``) or AlphaPO's
        nonlinear reward (``alpha``)."""
        if self.options.cpo_alpha != 0.0 or self.options.alpha != 0.0:
            return None
        if self.options.loss_type in AVERAGED_LOSS_TYPES:
            return mean_margin_gradient_ratio(chosen_tokens, rejected_tokens)
        return -1.0

    def __call__(self, stats):
        o = self.options
        logps = stats.logps
        if o.loss_type in AVERAGED_LOSS_TYPES:
            logps = average_logps(logps, stats.num_tokens)
        chosen, rejected = split_pairs(logps)
        losses = cpo_pair_losses(
            chosen, rejected, beta=o.beta, loss_type=o.loss_type, label_smoothing=o.label_smoothing,
            simpo_gamma=o.simpo_gamma, alpha=o.alpha,
        )
        if o.cpo_alpha != 0.0:
            chosen_sum, _ = split_pairs(stats.logps)
            losses = losses + o.cpo_alpha * chosen_nll_per_unit(chosen_sum, stats.batch_num_tokens)
        return losses, {}


def cpo_metrics(stats, *, beta: float, loss_type: str, cpo_alpha: float, alpha: float) -> dict:
    """The 0-d means TRL's CPOTrainer logs, from the whole-batch (detached) stats."""
    logps = stats.logps
    if loss_type in AVERAGED_LOSS_TYPES:
        logps = average_logps(logps, stats.num_tokens)
    chosen, rejected = split_pairs(logps)
    chosen_rewards = beta * alphapo_rewards(chosen, alpha)
    rejected_rewards = beta * alphapo_rewards(rejected, alpha)
    nll = batch_chosen_nll(stats.logps, stats.num_tokens) if cpo_alpha != 0.0 else stats.logps.new_zeros(())
    return detached({
        **pair_reward_metrics(stats, chosen, rejected, chosen_rewards, rejected_rewards),
        "nll_loss": nll,
        **entropy_metric(stats),
    })


def run_cpo(weight, hidden, labels, *, head: HeadOptions, options: CPOOptions, bias=None) -> LossOutput:
    """:func:`fused_linear_cpo_loss` with its options already validated."""
    check_sequence_inputs(weight, hidden, labels, head, group_size=2, bias=bias)
    loss, _, stats = run_sequence_objective(weight, hidden, labels, CPOObjective(options), head, group_size=2,
                                            bias=bias)
    o = options
    return LossOutput(loss, cpo_metrics(stats, beta=o.beta, loss_type=o.loss_type, cpo_alpha=o.cpo_alpha,
                                        alpha=o.alpha))


@eager_under_compile
def fused_linear_cpo_loss(
    weight: torch.Tensor,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    cpo_alpha: float = 1.0,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    need_entropy: bool = False,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> LossOutput:
    """CPO/SimPO/AlphaPO loss of TRL 1.16 from hidden states; see the module docstring. Options:
    :class:`CPOOptions` and :class:`~liger_losses.chunked.options.HeadOptions`."""
    options = CPOOptions(beta=beta, loss_type=loss_type, cpo_alpha=cpo_alpha, label_smoothing=label_smoothing,
                         simpo_gamma=simpo_gamma, alpha=alpha)
    head = HeadOptions(need_entropy=need_entropy, ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale,
                       chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl)
    return run_cpo(weight, hidden, labels, head=head, options=options, bias=bias)


@eager_under_compile
def fused_linear_simpo_loss(
    weight: torch.Tensor,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    cpo_alpha: float = 0.0,
    alpha: float = 0.0,
    need_entropy: bool = False,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> LossOutput:
    """SimPO: :func:`fused_linear_cpo_loss` with ``loss_type="simpo"``, ``simpo_gamma=gamma``
    (a finite number)."""
    check_real("gamma", gamma)
    return fused_linear_cpo_loss(
        weight, hidden, labels, bias=bias, beta=beta, loss_type="simpo", cpo_alpha=cpo_alpha,
        label_smoothing=label_smoothing, simpo_gamma=gamma, alpha=alpha, need_entropy=need_entropy,
        ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale, chunk_tokens=chunk_tokens,
        accum_dtype=accum_dtype, impl=impl,
    )


class LigerFusedLinearCPOLoss(PreferenceLossModule):
    """Module twin of :func:`fused_linear_cpo_loss`: ``loss_fn(weight, hidden, labels, *, bias=None)``."""

    runner = staticmethod(run_cpo)
    TRL_METRIC_NAMES = TRL_METRIC_NAMES
    REPR_KEYS = ("beta", "loss_type", "cpo_alpha")

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        cpo_alpha: float = 1.0,
        label_smoothing: float = 0.0,
        simpo_gamma: float = 0.5,
        *,
        alpha: float = 0.0,
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
            CPOOptions(beta=beta, loss_type=loss_type, cpo_alpha=cpo_alpha, label_smoothing=label_smoothing,
                       simpo_gamma=simpo_gamma, alpha=alpha),
        )


class LigerFusedLinearSimPOLoss(PreferenceLossModule):
    """SimPO module: ``loss_fn(weight, hidden, labels, *, bias=None)``; CPO ``loss_type="simpo"``."""

    runner = staticmethod(run_cpo)
    TRL_METRIC_NAMES = TRL_METRIC_NAMES
    REPR_KEYS = ("beta",)

    def __init__(
        self,
        beta: float = 2.0,
        gamma: float = 0.5,
        *,
        label_smoothing: float = 0.0,
        cpo_alpha: float = 0.0,
        alpha: float = 0.0,
        need_entropy: bool = False,
        ignore_index: int = -100,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        chunk_tokens: Optional[int] = None,
        accum_dtype: Optional[torch.dtype] = None,
        impl: str = "auto",
    ):
        check_real("gamma", gamma)
        super().__init__(
            HeadOptions(need_entropy=need_entropy, ignore_index=ignore_index, softcap=softcap,
                        logit_scale=logit_scale, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl),
            CPOOptions(beta=beta, loss_type="simpo", cpo_alpha=cpo_alpha, label_smoothing=label_smoothing,
                       simpo_gamma=gamma, alpha=alpha),
        )

    def extra_repr(self) -> str:
        return f"beta={self.loss_options.beta!r}, gamma={self.loss_options.simpo_gamma!r}"
