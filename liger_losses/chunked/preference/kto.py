"""KTO (Kahneman-Tversky optimisation, unpaired) from hidden states.

``fused_linear_kto_loss(weight, hidden, ref_hidden, labels, *, preference_labels, ...)`` with
``weight [V, H]``, ``hidden [B, T, H]``, ``labels [B, T]`` int (shifted; ignored positions
``ignore_index``), ``preference_labels [B]`` bool (True = desirable; an integer tensor is rejected
with ``TypeError`` -- convert 0/1 labels with ``.bool()``), the reference as
``ref_hidden [B, T, H_ref]`` (with ``ref_weight``/``ref_bias``, default the policy head) or
precomputed ``ref_logps [B]``. The KL estimate uses mismatched completions: ``kl_hidden [B', T', H]``
with ``kl_labels [B', T']`` and their reference ``kl_ref_hidden`` or ``ref_kl_logps [B']``.
Statistics and loss are float32.

As TRL 1.16's ``KTOTrainer``: with ``r = logp - ref_logp`` per sequence and
``kl = clamp(mean(kl_logps - ref_kl_logps), min=0)`` (detached: the KL forward runs without grad),

    loss_type="kto":               desirable  w_d (1 - sigmoid(beta (r - kl)))
                                   undesirable w_u (1 - sigmoid(beta (kl - r)))
    loss_type="apo_zero_unpaired": desirable  w_d (1 - sigmoid(beta r)),  undesirable w_u sigmoid(beta r)
    loss = mean over all B sequences.

``"apo_zero_unpaired"`` needs no KL sequences (TRL doesn't build them); any KL inputs are ignored.
Note: TRL averages ``kl`` over all processes before the loss; here it is this call's batch (the
caller can pass ``kl=`` a gathered value instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...kernels.utils import check_choice, check_tensor, eager_under_compile
from ..module import ChunkedLossModule
from ..objective import Objective
from ..options import HeadOptions, check_real, set_fields
from ..output import LossOutput
from ..sequence import check_sequence_inputs, run_sequence_objective
from .common import (
    check_sequence_values,
    detached,
    entropy_metric,
    sequence_metrics,
    zero_objective,
)

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")

# our metric key -> the name TRL 1.16's KTOTrainer logs
TRL_METRIC_NAMES = {
    "kl": "kl",
    "entropy": "entropy",
    "chosen_logits_mean": "logits/chosen",
    "rejected_logits_mean": "logits/rejected",
    "chosen_rewards": "rewards/chosen",
    "chosen_logps": "logps/chosen",
    "rejected_rewards": "rewards/rejected",
    "rejected_logps": "logps/rejected",
    "reward_margins": "rewards/margins",
}


def kto_sequence_losses(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl,
    *,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> torch.Tensor:
    """Per-sequence KTO losses ``[S]`` (TRL 1.16); ``desirable`` bool ``[S]``, ``kl`` 0-d (detached)."""
    logratios = logps - ref_logps
    if loss_type == "kto":
        chosen = 1 - torch.sigmoid(beta * (logratios - kl))
        rejected = 1 - torch.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        chosen = 1 - torch.sigmoid(beta * logratios)
        rejected = torch.sigmoid(beta * logratios)
    else:
        raise ValueError(f"loss_type must be one of {KTO_LOSS_TYPES}, got {loss_type!r}")
    return torch.where(desirable, desirable_weight * chosen, undesirable_weight * rejected)


@dataclass(frozen=True)
class KTOOptions:
    """KTO's own options (errors name the option): ``beta`` finite ``> 0``, ``loss_type`` in
    :data:`KTO_LOSS_TYPES`, ``desirable_weight`` and ``undesirable_weight`` finite ``>= 0``."""

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, KTO_LOSS_TYPES)
        set_fields(
            self, beta=check_real("beta", self.beta, 0.0, None, low_inclusive=False),
            desirable_weight=check_real("desirable_weight", self.desirable_weight, 0.0, None),
            undesirable_weight=check_real("undesirable_weight", self.undesirable_weight, 0.0, None),
        )


class KTOObjective(Objective):
    """``objective(stats) -> (losses [S], {})`` for the chunked engine (single sequences,
    separable): :class:`KTOOptions`, ``preference_labels [B]`` bool and the 0-d ``kl``."""

    separable = True

    def __init__(self, options: KTOOptions, *, preference_labels: torch.Tensor, kl: torch.Tensor):
        self.options, self.preference_labels, self.kl = options, preference_labels, kl

    def __call__(self, stats):
        if stats.ref_logps is None:
            raise ValueError("the KTO objective needs reference log-probs (stats.ref_logps is None)")
        o = self.options
        desirable = self.preference_labels[stats.index]
        losses = kto_sequence_losses(
            stats.logps, stats.ref_logps, desirable, self.kl, beta=o.beta, loss_type=o.loss_type,
            desirable_weight=o.desirable_weight, undesirable_weight=o.undesirable_weight,
        )
        return losses, {}


def kto_metrics(stats, preference_labels: torch.Tensor, kl: torch.Tensor, *, beta: float) -> dict:
    """What TRL's KTOTrainer logs, from the whole-batch (detached) stats.

    As TRL, keys whose count is zero are left out (``chosen_*`` without desirable sequences,
    ``*_logits_mean`` without tokens, ``reward_margins`` unless both kinds are present). One host sync.
    """
    des = preference_labels
    und = ~preference_labels
    rewards = beta * (stats.logps - stats.ref_logps)
    counts = torch.stack(
        [des.sum(), und.sum(), stats.num_tokens[des].sum(), stats.num_tokens[und].sum()]
    ).tolist()
    n_des, n_und, tok_des, tok_und = counts
    metrics = {"kl": kl.reshape(()), **entropy_metric(stats)}
    if tok_des > 0:
        metrics.update(sequence_metrics(stats, des, "chosen"))
    if tok_und > 0:
        metrics.update(sequence_metrics(stats, und, "rejected"))
    if n_des > 0:
        metrics["chosen_rewards"] = rewards[des].nansum() / n_des
        metrics["chosen_logps"] = stats.logps[des].nansum() / n_des
    if n_und > 0:
        metrics["rejected_rewards"] = rewards[und].nansum() / n_und
        metrics["rejected_logps"] = stats.logps[und].nansum() / n_und
    if n_des > 0 and n_und > 0:
        metrics["reward_margins"] = metrics["chosen_rewards"] - metrics["rejected_rewards"]
    return detached(metrics)


def kto_kl(
    weight: torch.Tensor,
    kl_hidden: torch.Tensor,
    kl_labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    kl_ref_hidden: Optional[torch.Tensor] = None,
    ref_weight: Optional[torch.Tensor] = None,
    ref_bias: Optional[torch.Tensor] = None,
    ref_kl_logps: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    impl: str = "auto",
) -> torch.Tensor:
    """KTO's KL estimate, 0-d float32, detached: ``clamp(mean_b(kl_logps_b - ref_kl_logps_b), min=0)``.

    Forward only (no gradient, no weight-gradient GEMM): one policy and (unless ``ref_kl_logps``
    is given) one reference pass over the mismatched KL completions. Run under ``torch.no_grad()``,
    so the engine computes no gradient even when the inputs require one.
    """
    head = HeadOptions(ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale, chunk_tokens=chunk_tokens,
                       impl=impl)
    return _kto_kl(weight, kl_hidden, kl_labels, head, bias=bias, kl_ref_hidden=kl_ref_hidden, ref_weight=ref_weight,
                   ref_bias=ref_bias, ref_kl_logps=ref_kl_logps)


def _kto_kl(weight, kl_hidden, kl_labels, head: HeadOptions, *, bias, kl_ref_hidden, ref_weight, ref_bias,
            ref_kl_logps) -> torch.Tensor:
    if (kl_ref_hidden is None) == (ref_kl_logps is None):
        raise ValueError("loss_type 'kto' needs exactly one KL reference: kl_ref_hidden or ref_kl_logps")
    check_sequence_inputs(weight, kl_hidden, kl_labels, head, group_size=1, bias=bias, ref_hidden=kl_ref_hidden,
                          ref_weight=ref_weight, ref_bias=ref_bias, hidden_name="kl_hidden", labels_name="kl_labels",
                          ref_hidden_name="kl_ref_hidden")
    if ref_kl_logps is not None:
        ref_kl_logps = check_sequence_values("ref_kl_logps", ref_kl_logps, kl_hidden.shape[0], kl_hidden.device)
    with torch.no_grad():
        _, _, stats = run_sequence_objective(
            weight, kl_hidden, kl_labels, zero_objective, head, group_size=1, bias=bias,
            ref_hidden=None if ref_kl_logps is not None else kl_ref_hidden, ref_weight=ref_weight,
            ref_bias=ref_bias, ref_logps=ref_kl_logps,
        )
    return (stats.logps - stats.ref_logps).mean().clamp(min=0).detach()


def _check_preference_labels(preference_labels, batch: int, device) -> torch.Tensor:
    check_tensor("preference_labels", preference_labels, ndim=1)
    if preference_labels.shape[0] != batch:
        raise ValueError(
            f"preference_labels must have shape [{batch}] (one per sequence of hidden), "
            f"got {tuple(preference_labels.shape)}"
        )
    if preference_labels.dtype != torch.bool:
        raise TypeError(f"preference_labels must be a bool tensor (True = desirable), got dtype "
                        f"{preference_labels.dtype}; convert 0/1 labels with .bool()")
    if preference_labels.device != device:
        raise ValueError(f"preference_labels must be on {device} like hidden, got {preference_labels.device}")
    return preference_labels


def _kl_value(options: KTOOptions, head: HeadOptions, weight, hidden, bias, kl, kl_hidden, kl_labels,
              kl_ref_hidden, ref_weight, ref_bias, ref_kl_logps) -> torch.Tensor:
    """The 0-d KL term: 0 for ``apo_zero_unpaired``, the given ``kl``, else :func:`kto_kl`."""
    if options.loss_type == "apo_zero_unpaired":
        return torch.zeros((), device=hidden.device, dtype=torch.float32)
    if kl is not None:
        check_tensor("kl", kl, floating=True)
        if kl.numel() != 1:
            raise ValueError(f"kl must hold one value, got shape {tuple(kl.shape)}")
        return kl.detach().float().reshape(()).to(hidden.device)
    if kl_hidden is None or kl_labels is None:
        raise ValueError("loss_type 'kto' needs the KL completions: kl_hidden and kl_labels (or a precomputed kl=)")
    kl_head = HeadOptions(ignore_index=head.ignore_index, softcap=head.softcap, logit_scale=head.logit_scale,
                          chunk_tokens=head.chunk_tokens, impl=head.impl)
    return _kto_kl(weight, kl_hidden, kl_labels, kl_head, bias=bias, kl_ref_hidden=kl_ref_hidden,
                   ref_weight=ref_weight, ref_bias=ref_bias, ref_kl_logps=ref_kl_logps)


def run_kto(weight, hidden, ref_hidden, labels, *, head: HeadOptions, options: KTOOptions, preference_labels,
            bias=None, ref_weight=None, ref_bias=None, kl_hidden=None, kl_ref_hidden=None, kl_labels=None,
            ref_logps=None, ref_kl_logps=None, kl=None) -> LossOutput:
    """:func:`fused_linear_kto_loss` with its options already validated."""
    check_sequence_inputs(weight, hidden, labels, head, group_size=1, bias=bias, ref_hidden=ref_hidden,
                          ref_weight=ref_weight, ref_bias=ref_bias)
    batch = hidden.shape[0]
    preference_labels = _check_preference_labels(preference_labels, batch, hidden.device)
    if (ref_hidden is None) == (ref_logps is None):
        raise ValueError("KTO needs exactly one reference: ref_hidden or ref_logps")
    if ref_logps is not None:
        ref_logps = check_sequence_values("ref_logps", ref_logps, batch, hidden.device)
    kl_value = _kl_value(options, head, weight, hidden, bias, kl, kl_hidden, kl_labels, kl_ref_hidden, ref_weight,
                         ref_bias, ref_kl_logps)
    objective = KTOObjective(options, preference_labels=preference_labels, kl=kl_value)
    loss, _, stats = run_sequence_objective(
        weight, hidden, labels, objective, head, group_size=1, bias=bias,
        ref_hidden=ref_hidden if ref_logps is None else None, ref_weight=ref_weight, ref_bias=ref_bias,
        ref_logps=ref_logps,
    )
    return LossOutput(loss, kto_metrics(stats, preference_labels, kl_value, beta=options.beta))


@eager_under_compile
def fused_linear_kto_loss(
    weight: torch.Tensor,
    hidden: torch.Tensor,
    ref_hidden: Optional[torch.Tensor],
    labels: torch.Tensor,
    *,
    preference_labels: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ref_weight: Optional[torch.Tensor] = None,
    ref_bias: Optional[torch.Tensor] = None,
    kl_hidden: Optional[torch.Tensor] = None,
    kl_ref_hidden: Optional[torch.Tensor] = None,
    kl_labels: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    ref_kl_logps: Optional[torch.Tensor] = None,
    kl: Optional[torch.Tensor] = None,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    need_entropy: bool = False,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> LossOutput:
    """KTO loss of TRL 1.16 from hidden states; see the module docstring for shapes and formula.

    ``kl`` (0-d, optional) replaces the KL estimate from ``kl_hidden`` (e.g. one gathered across
    processes); it is used as given (detached). Options: :class:`KTOOptions` and
    :class:`~liger_losses.chunked.options.HeadOptions`.
    """
    options = KTOOptions(beta=beta, loss_type=loss_type, desirable_weight=desirable_weight,
                         undesirable_weight=undesirable_weight)
    head = HeadOptions(need_entropy=need_entropy, ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale,
                       chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl)
    return run_kto(
        weight, hidden, ref_hidden, labels, head=head, options=options, preference_labels=preference_labels, bias=bias,
        ref_weight=ref_weight, ref_bias=ref_bias, kl_hidden=kl_hidden, kl_ref_hidden=kl_ref_hidden,
        kl_labels=kl_labels, ref_logps=ref_logps, ref_kl_logps=ref_kl_logps, kl=kl,
    )


class LigerFusedLinearKTOLoss(ChunkedLossModule):
    """Module twin of :func:`fused_linear_kto_loss`.

    ``loss_fn(weight, hidden, ref_hidden, labels, *, preference_labels, bias=None, ref_weight=None,
    ref_bias=None, kl_hidden=None, kl_ref_hidden=None, kl_labels=None, ref_logps=None,
    ref_kl_logps=None, kl=None) -> LossOutput``.
    """

    runner = staticmethod(run_kto)
    TRL_METRIC_NAMES = TRL_METRIC_NAMES
    REPR_KEYS = ("beta", "loss_type")

    def __init__(
        self,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        *,
        loss_type: str = "kto",
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
            KTOOptions(beta=beta, loss_type=loss_type, desirable_weight=desirable_weight,
                       undesirable_weight=undesirable_weight),
        )

    def forward(
        self,
        weight: torch.Tensor,
        hidden: torch.Tensor,
        ref_hidden: Optional[torch.Tensor],
        labels: torch.Tensor,
        *,
        preference_labels: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        ref_weight: Optional[torch.Tensor] = None,
        ref_bias: Optional[torch.Tensor] = None,
        kl_hidden: Optional[torch.Tensor] = None,
        kl_ref_hidden: Optional[torch.Tensor] = None,
        kl_labels: Optional[torch.Tensor] = None,
        ref_logps: Optional[torch.Tensor] = None,
        ref_kl_logps: Optional[torch.Tensor] = None,
        kl: Optional[torch.Tensor] = None,
    ) -> LossOutput:
        return self.run(
            weight, hidden, ref_hidden, labels, preference_labels=preference_labels, bias=bias,
            ref_weight=ref_weight, ref_bias=ref_bias, kl_hidden=kl_hidden, kl_ref_hidden=kl_ref_hidden,
            kl_labels=kl_labels, ref_logps=ref_logps, ref_kl_logps=ref_kl_logps, kl=kl,
        )
