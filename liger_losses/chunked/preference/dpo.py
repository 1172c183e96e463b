"""DPO and its family (IPO, EXO, NCA, robust, BCO, SPPO, AOT, APO, DiscoPOP, SFT/RPO, ...) from hidden states.

``fused_linear_dpo_loss(weight, hidden, ref_hidden, labels, ...)`` computes TRL 1.16's ``DPOTrainer``
loss straight from the last hidden states and the LM head, in chunks (logits never held whole):

* ``weight [V, H]``, ``hidden [2P, T, H]`` laid out ``[chosen; rejected]`` on dim 0 (TRL's layout),
  ``labels [2P, T]`` int (already shifted: ``hidden[b, t]`` is scored against ``labels[b, t]``;
  prompt and padding positions hold ``ignore_index``), optional ``bias [V]``;
* the reference: ``ref_hidden [2P, T, H_ref]`` (with ``ref_weight``/``ref_bias``, default the
  policy's head) or precomputed ``ref_chosen_logps``/``ref_rejected_logps [P]`` or
  ``reference_free=True`` (reference log-probs 0);
* float32 statistics and loss whatever the input dtype (bf16/fp16/fp32 GEMMs in the input dtype).

Per sequence the engine gives ``logps = sum_t w_t log p(label_t)`` (``w_t = 1``, or LD-DPO's
``ld_alpha`` beyond the pair's shared completion length); :func:`dpo_pair_losses` turns the pair
statistics into per-pair losses exactly as TRL 1.16 does for every ``loss_type`` (and weighted
lists of them), ``f_divergence_type``, ``label_smoothing``, ``discopop_tau``. The loss is the mean
over pairs. Returns ``LossOutput(loss, metrics)`` with the 0-d means TRL logs (``TRL_METRIC_NAMES``).

``use_weighting`` (WPO) multiplies every pair's loss by the detached weight ``w_chosen * w_rejected``,
``w = exp(mean over the completion's tokens of log p(label) - log sum_v p_v^2)``: the engine takes
``log sum_v p_v^2`` from the same tiles (``stats.aligned_logps``), no extra GEMM. Not supported, raising
``NotImplementedError`` as TRL does or for want of a statistic: ``use_weighting`` with ``"aot"`` /
``"aot_unpaired"`` (they sort the pairs) and ``ld_alpha`` together with an ``"sft"`` term (TRL's SFT term
uses the unweighted log-probs, a second statistic the engine does not return).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ...kernels.utils import check_choice, eager_under_compile
from ..module import ChunkedLossModule
from ..objective import Objective
from ..options import HeadOptions, check_flag, check_real, set_fields
from ..output import LossOutput
from ..sequence import check_sequence_inputs, run_sequence_objective
from .common import (
    PAIR_TRL_METRIC_NAMES,
    check_sequence_values,
    chosen_nll_per_unit,
    detached,
    entropy_metric,
    mean_margin_gradient_ratio,
    pair_reward_metrics,
    split_pairs,
    token_mean,
)

DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
    "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# Loss types built on the chosen-rejected score difference: the only ones with an f-DPO generalisation.
F_DIVERGENCE_LOSS_TYPES = frozenset(
    {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
)
# Loss types that sort over the batch: not separable over pairs (objective sees the whole batch).
SORTING_LOSS_TYPES = frozenset({"aot", "aot_unpaired"})
# Loss types that depend on a pair only through its margin (chosen - rejected scores; "aot" through
# its rank among the batch's margins) or its length-normalised margin: for these the gradient
# w.r.t. the rejected log-probs is a fixed multiple of the chosen one (DPOObjective.pair_gradient_ratio).
MARGIN_LOSS_TYPES = frozenset({"sigmoid", "hinge", "exo_pair", "robust", "discopop", "aot"})
LENGTH_NORMALISED_MARGIN_TYPES = frozenset({"ipo", "sigmoid_norm"})

# our metric key -> the name TRL 1.16's DPOTrainer logs
TRL_METRIC_NAMES = {**PAIR_TRL_METRIC_NAMES, "mean_token_accuracy": "mean_token_accuracy", "entropy": "entropy"}


# --------------------------------------------------------------------------- the formula


def f_divergence_scores(
    logratios: torch.Tensor, f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = 0.5
) -> torch.Tensor:
    """f'(π/π_ref) of the f-DPO paper applied to ``logratios = log π - log π_ref`` (TRL 1.16)."""
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        a = f_alpha_divergence_coef
        if abs(a - 1.0) < 1e-6:  # limit alpha -> 1 is log t
            return logratios
        t = (a - 1.0) * logratios
        clamp_max = {torch.float16: 11.0}.get(t.dtype, 80.0)
        return (torch.exp(torch.clamp(t.float(), max=clamp_max)) - 1.0).to(t.dtype) / (a - 1.0)
    raise ValueError(f"f_divergence_type must be one of {F_DIVERGENCE_TYPES}, got {f_divergence_type!r}")


def dpo_pair_losses(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Optional[Sequence[float]] = None,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    chosen_num_tokens: Optional[torch.Tensor] = None,
    rejected_num_tokens: Optional[torch.Tensor] = None,
    chosen_nll: Optional[torch.Tensor] = None,
    pair_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-pair DPO-family losses ``[P]`` whose mean over the batch is TRL 1.16's loss.

    All inputs ``[P]`` float. ``chosen_num_tokens``/``rejected_num_tokens`` (completion lengths) are
    needed by ``"ipo"`` and ``"sigmoid_norm"``; ``chosen_nll`` (``[P]`` values whose mean is the
    token-averaged NLL of the chosen tokens, see ``common.chosen_nll_per_unit``) by ``"sft"``.
    For several loss types the result is ``sum_k loss_weights[k] * losses_k``. ``"aot"`` and
    ``"aot_unpaired"`` sort over the given pairs, so their values are per rank, not per pair: only
    their mean is meaningful, and they must see the whole batch at once. ``pair_weights [P]`` (WPO,
    detached) multiply every term, as TRL multiplies each loss type's per-sequence loss; the ``"sft"``
    term is then the batch mean times each pair's weight (what TRL 1.16's code means: it raises there, its
    in-place product writing into the expanded mean), so with weights the given pairs must be the whole batch.
    """
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(types):
        raise ValueError(f"loss_weights must have {len(types)} entries (one per loss_type), got {len(weights)}")
    beta = float(beta)
    eps = float(label_smoothing)

    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores = f_divergence_scores(chosen_logratios, f_divergence_type, f_alpha_divergence_coef)
    rejected_scores = f_divergence_scores(rejected_logratios, f_divergence_type, f_alpha_divergence_coef)
    delta_score = chosen_scores - rejected_scores

    def need_lengths(name):
        if chosen_num_tokens is None or rejected_num_tokens is None:
            raise ValueError(f"loss_type {name!r} needs chosen_num_tokens and rejected_num_tokens")
        return chosen_num_tokens.clamp(min=1.0), rejected_num_tokens.clamp(min=1.0)

    total = torch.zeros_like(chosen_logps)
    for name, weight in zip(types, weights):
        if name == "sigmoid":
            losses = -F.logsigmoid(beta * delta_score)
        elif name == "hinge":
            losses = torch.relu(1 - beta * delta_score)
        elif name == "ipo":
            # length-normalised (per completion token), as TRL does
            c_len, r_len = need_lengths(name)
            ipo_delta = chosen_scores / c_len - rejected_scores / r_len
            losses = (ipo_delta - 1 / (2 * beta)) ** 2
        elif name == "exo_pair":
            z = beta * delta_score
            losses = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
                F.logsigmoid(-z) - math.log(eps)
            )
        elif name == "nca_pair":
            cr, rr = beta * chosen_logratios, beta * rejected_logratios
            losses = -F.logsigmoid(cr) - 0.5 * F.logsigmoid(-cr) - 0.5 * F.logsigmoid(-rr)
        elif name == "robust":
            z = beta * delta_score
            losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
        elif name == "bco_pair":
            losses = -F.logsigmoid(beta * chosen_logratios) - F.logsigmoid(-beta * rejected_logratios)
        elif name == "sppo_hard":
            losses = (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
        elif name == "aot":
            logratios, _ = torch.sort(chosen_logps - rejected_logps, dim=0)
            ref_logratios, _ = torch.sort(ref_chosen_logps - ref_rejected_logps, dim=0)
            delta = logratios - ref_logratios
            losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
        elif name == "aot_unpaired":
            c_sorted, _ = torch.sort(chosen_logratios, dim=0)
            r_sorted, _ = torch.sort(rejected_logratios, dim=0)
            delta = c_sorted - r_sorted
            losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
        elif name == "apo_zero":
            losses = (1 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)
        elif name == "apo_down":
            losses = torch.sigmoid(beta * chosen_logratios) + (
                1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))
            )
        elif name == "discopop":
            z = beta * delta_score
            modulation = torch.sigmoid(z / discopop_tau)
            losses = -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z) * modulation
        elif name == "sft":
            if chosen_nll is None:
                raise ValueError("loss_type 'sft' needs chosen_nll")
            # TRL: the batch's token-mean NLL expanded to every pair (only the mean is used unweighted)
            losses = chosen_nll if pair_weights is None else chosen_nll.mean().expand_as(chosen_nll)
        elif name == "sigmoid_norm":
            c_len, r_len = need_lengths(name)
            losses = -F.logsigmoid(beta * (chosen_scores / c_len - rejected_scores / r_len))
        else:
            raise ValueError(f"loss_type entries must be in {DPO_LOSS_TYPES}, got {name!r}")
        if pair_weights is not None:
            losses = losses * pair_weights
        total = total + weight * losses
    return total


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class DPOOptions:
    """DPO's own options, validated as TRL 1.16 does (errors name the option): ``beta`` finite
    ``> 0``; ``loss_type`` a name of :data:`DPO_LOSS_TYPES` or a sequence of them with
    ``loss_weights`` (finite, one per type); ``label_smoothing`` in ``[0, 1)``;
    ``f_divergence_type`` in :data:`F_DIVERGENCE_TYPES` (not ``reverse_kl`` only for the types of
    :data:`F_DIVERGENCE_LOSS_TYPES`) with a finite ``f_alpha_divergence_coef``; ``discopop_tau``
    finite ``> 0``; ``ld_alpha`` None or in ``[0, 1]``; ``rpo_alpha`` (sugar for an ``"sft"``
    term of that weight) None or finite; ``use_weighting`` (WPO) a bool, not with ``"aot"`` /
    ``"aot_unpaired"``; ``reference_free`` a bool. ``loss_types`` / ``term_weights``: the normalised terms."""

    beta: float = 0.1
    loss_type: str | Sequence[str] = "sigmoid"
    loss_weights: Optional[Sequence[float]] = None
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    ld_alpha: Optional[float] = None
    use_weighting: bool = False
    rpo_alpha: Optional[float] = None
    reference_free: bool = False
    loss_types: tuple = field(init=False, repr=False)
    term_weights: tuple = field(init=False, repr=False)

    def __post_init__(self):
        loss_type = self.loss_type if isinstance(self.loss_type, str) else tuple(self.loss_type)
        types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
        if not types:
            raise ValueError("loss_type must name at least one loss type")
        for t in types:
            check_choice("loss_type", t, DPO_LOSS_TYPES)
        if self.loss_weights is None:
            loss_weights, weights = None, [1.0] * len(types)
        else:
            loss_weights = tuple(self.loss_weights)
            weights = [check_real("loss_weights", w) for w in loss_weights]
            if len(weights) != len(types):
                raise ValueError(
                    f"loss_weights must have the same length as loss_type ({len(types)}), got {len(weights)}"
                )
        if self.rpo_alpha is not None:
            types.append("sft")
            weights.append(check_real("rpo_alpha", self.rpo_alpha))
        check_real("beta", self.beta, 0.0, None, low_inclusive=False)
        eps = check_real("label_smoothing", self.label_smoothing, 0.0, 1.0, high_inclusive=False)
        check_choice("f_divergence_type", self.f_divergence_type, F_DIVERGENCE_TYPES)
        if self.f_divergence_type != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSS_TYPES:
            raise ValueError(
                f"f_divergence_type={self.f_divergence_type!r} is only supported for loss types "
                f"{sorted(F_DIVERGENCE_LOSS_TYPES)}, got {types}"
            )
        check_real("f_alpha_divergence_coef", self.f_alpha_divergence_coef)
        check_real("discopop_tau", self.discopop_tau, 0.0, None, low_inclusive=False)
        _check_smoothing_for(types, eps)
        if self.ld_alpha is not None:
            check_real("ld_alpha", self.ld_alpha, 0.0, 1.0)
            if "sft" in types:
                raise NotImplementedError(
                    "ld_alpha together with an 'sft' term (or rpo_alpha) is not supported: TRL's SFT term uses the "
                    "unweighted log-probs, a second per-sequence statistic the chunked engine does not compute"
                )
        use_weighting = check_flag("use_weighting", self.use_weighting)
        if use_weighting and set(types) & SORTING_LOSS_TYPES:
            raise NotImplementedError(
                "use_weighting (WPO) is not implemented for 'aot' or 'aot_unpaired': those losses sort the pairs, "
                "which would misalign the per-pair weights (as TRL)"
            )
        set_fields(self, loss_type=loss_type, loss_weights=loss_weights, loss_types=tuple(types),
                   term_weights=tuple(weights), use_weighting=use_weighting,
                   reference_free=check_flag("reference_free", self.reference_free))


def _check_smoothing_for(types, label_smoothing: float) -> None:
    """The label-smoothing rules of the EXO and robust losses."""
    if "exo_pair" in types and label_smoothing == 0.0:
        raise ValueError("label_smoothing must be > 0 for loss_type 'exo_pair' (the EXO paper suggests 1e-3)")
    if "robust" in types:
        if label_smoothing == 0.5:
            raise ValueError("label_smoothing must not be 0.5 for loss_type 'robust' (division by 1 - 2*0.5)")
        if not 0.0 <= label_smoothing < 0.5:
            warnings.warn(
                f"label_smoothing should lie in [0.0, 0.5) for the 'robust' loss, got {label_smoothing}",
                stacklevel=5,
            )


def ld_token_weights(labels: torch.Tensor, ld_alpha: float, ignore_index: int = -100) -> torch.Tensor:
    """LD-DPO token weights ``[2P, T]`` float32 from the labels mask (:func:`ld_mask_weights` of
    ``labels != ignore_index``)."""
    return ld_mask_weights(labels != ignore_index, ld_alpha)


def ld_mask_weights(mask: torch.Tensor, ld_alpha: float) -> torch.Tensor:
    """LD-DPO token weights ``[2P, T]`` float32 from the bool ``mask [2P, T]`` of valid tokens of a
    ``[chosen; rejected]`` batch.

    The k-th valid token (k = 1, 2, ...) of a sequence gets weight 1 when ``k <= min(len_chosen,
    len_rejected)`` of its pair, ``ld_alpha`` beyond; invalid positions 0. TRL applies the same
    weights to the reference log-probs, and so does the engine (and the TRL adapter's precompute).
    """
    pos = mask.cumsum(dim=1)
    lens = mask.sum(dim=1)
    c_len, r_len = split_pairs(lens)
    shared = torch.minimum(c_len, r_len)
    shared = torch.cat([shared, shared]).unsqueeze(1)
    weights = torch.where(pos <= shared, 1.0, float(ld_alpha)).to(torch.float32)
    return weights * mask


# --------------------------------------------------------------------------- engine objective


class DPOObjective(Objective):
    """``objective(stats) -> (losses [U], {})`` for the chunked engine (pairs, ``group_size=2``)
    of the :class:`DPOOptions` ``options``."""

    def __init__(self, options: DPOOptions, sequence_lengths: Optional[torch.Tensor] = None):
        self.options = options
        self.sequence_lengths = sequence_lengths  # [2P] float: the length-normalised types' divisors

    @property
    def separable(self) -> bool:
        """False when a loss type ranks over the whole batch (AOT), or when WPO weights the ``"sft"`` term (TRL
        multiplies the batch's NLL, a statistic of every pair, by each pair's weight)."""
        types = set(self.options.loss_types)
        return not (types & SORTING_LOSS_TYPES or (self.options.use_weighting and "sft" in types))

    def pair_gradient_ratio(self, chosen_tokens: int, rejected_tokens: int) -> Optional[float]:
        """``r`` with ``d loss / d rejected_logps = r * d loss / d chosen_logps`` for every pair of
        these lengths, or None. Lets the engine back-propagate a long pair in one pass before its
        upstream gradient is known (engine's two-phase path). Types on the policy-minus-reference
        margin (reverse-KL scores): ``-1``; the length-normalised ones (``ipo``, ``sigmoid_norm``):
        ``-chosen_tokens / rejected_tokens``; a mix of the two kinds, other f-divergences and the
        types with separate chosen/rejected terms (``sft``, ``nca_pair``, ``bco_pair``...): None."""
        if self.options.f_divergence_type != "reverse_kl":
            return None
        ratios = set()
        for name in self.options.loss_types:
            if name in MARGIN_LOSS_TYPES:
                ratios.add(-1.0)
            elif name in LENGTH_NORMALISED_MARGIN_TYPES:
                if self.sequence_lengths is not None:  # divisors other than these counts: not known here
                    return None
                ratios.add(mean_margin_gradient_ratio(chosen_tokens, rejected_tokens))
            else:
                return None
        return ratios.pop() if len(ratios) == 1 else None

    def __call__(self, stats):
        if stats.ref_logps is None:
            raise ValueError("the DPO objective needs reference log-probs (stats.ref_logps is None)")
        o = self.options
        chosen, rejected = split_pairs(stats.logps)
        ref_chosen, ref_rejected = split_pairs(stats.ref_logps)
        lengths = stats.num_tokens if self.sequence_lengths is None else self.sequence_lengths[stats.index]
        c_len, r_len = split_pairs(lengths)
        nll = chosen_nll_per_unit(chosen, stats.batch_num_tokens) if "sft" in o.loss_types else None
        pair_weights = None
        if o.use_weighting:  # WPO: mean aligned log-prob over the completion's (label) tokens, detached
            if stats.aligned_logps is None:
                raise ValueError("use_weighting needs stats.aligned_logps: run the objective with "
                                 "need_aligned_logps=True")
            w = torch.exp(stats.aligned_logps / stats.num_tokens.clamp(min=1.0)).detach()
            w_chosen, w_rejected = split_pairs(w)
            pair_weights = w_chosen * w_rejected
        losses = dpo_pair_losses(
            chosen, rejected, ref_chosen, ref_rejected,
            beta=o.beta, loss_type=o.loss_types, loss_weights=o.term_weights,
            label_smoothing=o.label_smoothing, f_divergence_type=o.f_divergence_type,
            f_alpha_divergence_coef=o.f_alpha_divergence_coef, discopop_tau=o.discopop_tau,
            chosen_num_tokens=c_len, rejected_num_tokens=r_len, chosen_nll=nll, pair_weights=pair_weights,
        )
        return losses, {}


def dpo_metrics(stats, *, beta: float) -> dict:
    """The 0-d means TRL 1.16's DPOTrainer logs, from the whole-batch (detached) stats."""
    chosen, rejected = split_pairs(stats.logps)
    ref_chosen, ref_rejected = split_pairs(stats.ref_logps)
    chosen_rewards = beta * (chosen - ref_chosen)
    rejected_rewards = beta * (rejected - ref_rejected)
    c_sel = slice(0, chosen.shape[0])
    return detached({
        **pair_reward_metrics(stats, chosen, rejected, chosen_rewards, rejected_rewards),
        "mean_token_accuracy": token_mean(stats.correct[c_sel], stats.num_tokens[c_sel]),
        **entropy_metric(stats),
    })


# --------------------------------------------------------------------------- functional + module


def _reference_logps(options: DPOOptions, ref_hidden, ref_chosen_logps, ref_rejected_logps, hidden):
    """The ``[2P]`` reference log-probs given (or zeros, reference-free), None when ``ref_hidden``
    computes them; ``ValueError`` for a missing or doubly given reference."""
    num_pairs = hidden.shape[0] // 2
    have_pre = (ref_chosen_logps is not None, ref_rejected_logps is not None)
    if any(have_pre) and not all(have_pre):
        raise ValueError("ref_chosen_logps and ref_rejected_logps must be given together")
    if options.reference_free:
        if ref_hidden is not None or any(have_pre):
            raise ValueError("reference_free=True takes no ref_hidden, ref_chosen_logps or ref_rejected_logps")
        return torch.zeros(2 * num_pairs, device=hidden.device, dtype=torch.float32)
    if all(have_pre):
        if ref_hidden is not None:
            raise ValueError("give either ref_hidden or ref_chosen_logps/ref_rejected_logps, not both")
        return torch.cat([
            check_sequence_values("ref_chosen_logps", ref_chosen_logps, num_pairs, hidden.device),
            check_sequence_values("ref_rejected_logps", ref_rejected_logps, num_pairs, hidden.device),
        ])
    if ref_hidden is None:
        raise ValueError(
            "DPO needs a reference: pass ref_hidden, or ref_chosen_logps and ref_rejected_logps, "
            "or set reference_free=True"
        )
    return None


def run_dpo(weight, hidden, ref_hidden, labels, *, head: HeadOptions, options: DPOOptions, bias=None,
            ref_weight=None, ref_bias=None, ref_chosen_logps=None, ref_rejected_logps=None,
            sequence_lengths=None) -> LossOutput:
    """:func:`fused_linear_dpo_loss` with its options already validated."""
    check_sequence_inputs(weight, hidden, labels, head, group_size=2, bias=bias, ref_hidden=ref_hidden,
                          ref_weight=ref_weight, ref_bias=ref_bias)
    ref_logps = _reference_logps(options, ref_hidden, ref_chosen_logps, ref_rejected_logps, hidden)
    if sequence_lengths is not None:  # values are not read on the host (no sync): clamped to >= 1 where used
        sequence_lengths = check_sequence_values("sequence_lengths", sequence_lengths, hidden.shape[0], hidden.device)
    token_weights = None
    if options.ld_alpha is not None:
        token_weights = ld_token_weights(labels, options.ld_alpha, head.ignore_index)
    loss, _, stats = run_sequence_objective(
        weight, hidden, labels, DPOObjective(options, sequence_lengths), head, group_size=2, bias=bias,
        ref_hidden=None if ref_logps is not None else ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias,
        ref_logps=ref_logps, token_weights=token_weights, need_aligned_logps=options.use_weighting,
    )
    return LossOutput(loss, dpo_metrics(stats, beta=options.beta))


@eager_under_compile
def fused_linear_dpo_loss(
    weight: torch.Tensor,
    hidden: torch.Tensor,
    ref_hidden: Optional[torch.Tensor],
    labels: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ref_weight: Optional[torch.Tensor] = None,
    ref_bias: Optional[torch.Tensor] = None,
    ref_chosen_logps: Optional[torch.Tensor] = None,
    ref_rejected_logps: Optional[torch.Tensor] = None,
    sequence_lengths: Optional[torch.Tensor] = None,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Optional[Sequence[float]] = None,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    ld_alpha: Optional[float] = None,
    use_weighting: bool = False,
    rpo_alpha: Optional[float] = None,
    reference_free: bool = False,
    need_entropy: bool = False,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> LossOutput:
    """DPO-family loss of TRL 1.16 from hidden states; see the module docstring for shapes.

    Options: :class:`DPOOptions` and :class:`~liger_losses.chunked.options.HeadOptions`.
    ``sequence_lengths [2P]`` (float, ``[chosen; rejected]``): what the length-normalised types
    (``"ipo"``, ``"sigmoid_norm"``) divide each sequence's log-prob by (clamped to at least 1); default
    its valid label count.
    TRL divides by the completion mask's count before the label shift, one more where a completion
    token sits at position 0 (no prompt token before it): its trainer passes that count. Returns
    ``LossOutput(loss 0-d float32 differentiable w.r.t. hidden/weight/bias, metrics)``.
    """
    options = DPOOptions(
        beta=beta, loss_type=loss_type, loss_weights=loss_weights, label_smoothing=label_smoothing,
        f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
        discopop_tau=discopop_tau, ld_alpha=ld_alpha, use_weighting=use_weighting, rpo_alpha=rpo_alpha,
        reference_free=reference_free,
    )
    head = HeadOptions(ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale, chunk_tokens=chunk_tokens,
                       accum_dtype=accum_dtype, impl=impl, need_entropy=need_entropy)
    return run_dpo(weight, hidden, ref_hidden, labels, head=head, options=options, bias=bias, ref_weight=ref_weight,
                   ref_bias=ref_bias, ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
                   sequence_lengths=sequence_lengths)


class LigerFusedLinearDPOLoss(ChunkedLossModule):
    """Module twin of :func:`fused_linear_dpo_loss`: options at construction, tensors at call.

    ``loss_fn(weight, hidden, ref_hidden, labels, *, bias=None, ref_weight=None, ref_bias=None,
    ref_chosen_logps=None, ref_rejected_logps=None) -> LossOutput``.
    """

    runner = staticmethod(run_dpo)
    TRL_METRIC_NAMES = TRL_METRIC_NAMES
    REPR_KEYS = ("beta", "loss_type")

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str | Sequence[str] = "sigmoid",
        loss_weights: Optional[Sequence[float]] = None,
        label_smoothing: float = 0.0,
        *,
        f_divergence_type: str = "reverse_kl",
        f_alpha_divergence_coef: float = 0.5,
        discopop_tau: float = 0.05,
        ld_alpha: Optional[float] = None,
        use_weighting: bool = False,
        rpo_alpha: Optional[float] = None,
        reference_free: bool = False,
        need_entropy: bool = False,
        ignore_index: int = -100,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        chunk_tokens: Optional[int] = None,
        accum_dtype: Optional[torch.dtype] = None,
        impl: str = "auto",
    ):
        super().__init__(
            HeadOptions(ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale,
                        chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl, need_entropy=need_entropy),
            DPOOptions(
                beta=beta, loss_type=loss_type, loss_weights=loss_weights, label_smoothing=label_smoothing,
                f_divergence_type=f_divergence_type, f_alpha_divergence_coef=f_alpha_divergence_coef,
                discopop_tau=discopop_tau, ld_alpha=ld_alpha, use_weighting=use_weighting, rpo_alpha=rpo_alpha,
                reference_free=reference_free,
            ),
        )

    def forward(
        self,
        weight: torch.Tensor,
        hidden: torch.Tensor,
        ref_hidden: Optional[torch.Tensor],
        labels: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        ref_weight: Optional[torch.Tensor] = None,
        ref_bias: Optional[torch.Tensor] = None,
        ref_chosen_logps: Optional[torch.Tensor] = None,
        ref_rejected_logps: Optional[torch.Tensor] = None,
        sequence_lengths: Optional[torch.Tensor] = None,
    ) -> LossOutput:
        return self.run(weight, hidden, ref_hidden, labels, bias=bias, ref_weight=ref_weight, ref_bias=ref_bias,
                        ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps,
                        sequence_lengths=sequence_lengths)
