"""The sequence-objective driver: losses on per-sequence sums of token log-probabilities.

:func:`fused_linear_sequence_objective` is what every preference loss (DPO and its variants, SimPO,
CPO, ORPO, KTO) and the sequence-level SFT/ORPO terms run on. It scores ``hidden [B, T, H]``
against ``labels [B, T]`` through ``weight [V, H]`` (+ ``bias [V]``) chunk by chunk, reduces the
token log-probabilities to per-sequence sums (:class:`~.objective.SequenceStats`, float32 ``[S]``)
and hands them to a small PyTorch objective (:class:`~.objective.Objective`, or a plain
``objective(stats) -> (losses [U], metrics {name: [U]})``) over units of one sequence or of a
``[chosen; rejected]`` pair. A new preference loss is one such function.

The driver is three parts: the plan (:func:`~.planning.plan_sequence_passes`: one pass, two
phases, or two phases with recompute -- a pure function of token counts), the accumulator
(:class:`~.sequence_accumulator.SequenceAccumulator`: the per-position statistics, the heads and
the objective call) and :func:`drive_sequence_objective` here, which runs the plan's chunks.
Gradients are computed inside the forward and scaled by ``grad_output`` in backward. One host
sync per call (the labels' scan), none in the chunk loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.autograd import needs_head_grads, save_forward_grads, scaled_grads
from liger_losses.chunked.gemm import compute_dtype
from liger_losses.chunked.objective import Objective, SequenceStats, as_objective
from liger_losses.chunked.options import HeadOptions, check_head_inputs, check_labels_tensor
from liger_losses.chunked.planning import plan_sequence_passes
from liger_losses.chunked.sequence_accumulator import SequenceAccumulator, SequenceCall
from liger_losses.chunked.tokens import grad_like
from liger_losses.kernels.utils import check_last_dim, check_same_device, check_tensor, eager_under_compile

__all__ = [
    "Objective",
    "SequenceStats",
    "check_sequence_inputs",
    "drive_sequence_objective",
    "fused_linear_sequence_objective",
    "run_sequence_objective",
]


@dataclass
class SequenceResult:
    """What the driver's forward leaves besides the loss: unit metrics and batch statistics."""

    metrics: dict = field(default_factory=dict)
    stats: Optional[SequenceStats] = None


class _SequenceObjectiveFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, hidden, bias, call: SequenceCall, result: SequenceResult):
        needs_w, needs_h, needs_b = needs_head_grads(ctx, call.grad_enabled)
        loss, gh, gw, gb = drive_sequence_objective(
            weight, hidden, bias, call, result, needs_h, needs_w, needs_b and bias is not None
        )
        save_forward_grads(ctx, weight, gh, gw, gb, needs_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        gh, gw, gb = scaled_grads(ctx, grad_loss)
        return gw, gh, gb, None, None


def drive_sequence_objective(weight, hidden, bias, call: SequenceCall, result: SequenceResult,
                             needs_hidden: bool, needs_weight: bool, needs_bias: bool):
    """Run one call: plan, then the plan's chunks on a :class:`SequenceAccumulator`. Returns
    ``(loss 0-d fp32, grad_hidden | None, grad_weight | None, grad_bias | None)`` and fills
    ``result``."""
    acc = SequenceAccumulator(weight, hidden, bias, call, needs_hidden, needs_weight, needs_bias)
    need_grad = needs_hidden or needs_weight or needs_bias
    g, B = call.group_size, acc.batch
    plan = plan_sequence_passes(
        acc.position_counts, group_size=g, separable=call.objective.separable, vocab=acc.vocab,
        hidden_size=acc.hidden_size, itemsize=acc.itemsize, chunk_tokens=call.head.chunk_tokens,
        pair_gradient_ratio=call.objective.pair_gradient_ratio,
        wide_accum=acc.grads.wide_accum,
    )
    if plan.mode == "one_pass":
        # every chunk holds whole units; gradients computed while the tile exists
        for u0, u1, ts, te in plan.unit_chunks:
            p0, p1 = u0 * g, u1 * g
            tile, seg = acc.chunk_stats(ts, te, p0, p1, need_grad)
            grad_pos = acc.call_objective(p0, p1, need_grad)
            if need_grad and te > ts:
                acc.backprop(tile, ts, te, grad_pos[seg])
            del tile
    else:
        # phase 1: statistics of every tile; the exempt unit's tiles back-propagated with a unit
        # row scale (the rejected side of an exempt pair with the objective's ratio) while the
        # weight-gradient buffer holds nothing else, scaled once the upstream gradient is known
        for ts, te in plan.recompute_chunks:
            tile, _ = acc.chunk_stats(ts, te, 0, B, False)  # statistics only, sums into all positions
            del tile
        a, mid, b = plan.exempt_tokens
        for ts, te in plan.exempt_chunks:
            tile, _ = acc.chunk_stats(ts, te, 0, B, need_grad)
            if need_grad:
                row_scale = None
                if plan.rejected_ratio is not None and te > mid:  # the tile reaches the rejected sequence
                    row_scale = torch.where(torch.arange(ts, te, device=acc.device) < mid, 1.0,
                                            plan.rejected_ratio)
                acc.backprop(tile, ts, te, row_scale)
            del tile
        grad_pos = acc.call_objective(0, B, need_grad)
        if need_grad:
            if plan.exempt_chunks:  # only the exempt unit's tiles were added so far
                acc.grads.scale(a, b, grad_pos[plan.exempt_position])
            for ts, te in plan.recompute_chunks:  # phase 2: recomputed for the gradient
                tile = acc.gradient_tile(ts, te)
                acc.backprop(tile, ts, te, grad_pos[acc.pos_of_tok[ts:te]])
                del tile

    gh, gw, gb = acc.grads.finish()
    result.metrics = acc.unit_metrics()
    result.stats = acc.batch_stats()
    return acc.loss, (grad_like(gh, hidden) if gh is not None else None), gw, gb


def check_sequence_inputs(
    weight: Tensor, hidden: Tensor, labels: Tensor, head: HeadOptions, *, group_size: int,
    bias: Optional[Tensor] = None, ref_hidden: Optional[Tensor] = None, ref_weight: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None, ref_logps: Optional[Tensor] = None,
    token_weights: Optional[Tensor] = None, hidden_name: str = "hidden", labels_name: str = "labels",
    ref_hidden_name: str = "ref_hidden",
) -> None:
    """Every check of the driver's inputs, in one place (``TypeError``/``ValueError`` naming the
    argument): ``weight [V, H]`` float, ``hidden [B, T, H]`` float, ``labels [B, T]`` integer
    (not bool), ``bias [V]``, an even ``B`` for pairs (``[chosen; rejected]`` on dim 0),
    ``ref_weight [V, Hr]``, ``ref_hidden [B, T, Hr]`` (``Hr`` of ``ref_weight``, default
    ``weight``), ``ref_bias [V]``, ``ref_logps [B]``, ``token_weights [B, T]``, one device, and
    ``head.impl`` runnable there. ``*_name``: the names the errors use (e.g. KTO's ``kl_hidden``).
    Label values are checked by the driver's one host sync."""
    if group_size not in (1, 2):
        raise ValueError(f"group_size must be 1 (sequences) or 2 (pairs), got {group_size!r}")
    if hidden_name == "hidden" and labels_name == "labels":
        check_head_inputs(weight, hidden, labels, bias, head, hidden_ndim=3)
    else:
        check_tensor("weight", weight, ndim=2, floating=True)
        check_tensor(hidden_name, hidden, ndim=3, floating=True)
        check_labels_tensor(labels_name, labels, ndim=2)
        check_last_dim(hidden_name, hidden, weight.shape[1], "the hidden size of weight [V, H]")
        if tuple(labels.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"{labels_name} must have shape {tuple(hidden.shape[:2])} ({hidden_name}'s "
                             f"[B, T]), got {tuple(labels.shape)}")
        _check_vocab_rows("bias", bias, 1, weight.shape[0])
        check_same_device(weight=weight, **{hidden_name: hidden, labels_name: labels}, bias=bias)
    B, T, _ = hidden.shape
    V = weight.shape[0]
    if group_size == 2 and B % 2 != 0:
        raise ValueError(f"{hidden_name} must hold an even number of sequences laid out [chosen; rejected] "
                         f"on dim 0 (group_size=2), got batch size {B}")
    _check_vocab_rows("ref_weight", ref_weight, 2, V)
    _check_vocab_rows("ref_bias", ref_bias, 1, V)
    if ref_hidden is not None:
        check_tensor(ref_hidden_name, ref_hidden, ndim=3, floating=True)
        Hr = (ref_weight if ref_weight is not None else weight).shape[1]
        if tuple(ref_hidden.shape) != (B, T, Hr):
            raise ValueError(
                f"{ref_hidden_name} must have shape {(B, T, Hr)} ([B, T] of {hidden_name}, H of ref_weight), "
                f"got {tuple(ref_hidden.shape)}"
            )
    if ref_logps is not None:
        check_tensor("ref_logps", ref_logps, floating=True)
        if tuple(ref_logps.shape) != (B,):
            raise ValueError(f"ref_logps must have shape [{B}] (one per sequence), got {tuple(ref_logps.shape)}")
    if token_weights is not None:
        check_tensor("token_weights", token_weights, floating=True)
        if tuple(token_weights.shape) != (B, T):
            raise ValueError(f"token_weights must have shape {(B, T)} (as labels), got {tuple(token_weights.shape)}")
    check_same_device(hidden=hidden, ref_hidden=ref_hidden, ref_weight=ref_weight,
                      ref_bias=ref_bias, ref_logps=ref_logps, token_weights=token_weights)


def _check_vocab_rows(name: str, value: Optional[Tensor], ndim: int, vocab: int) -> None:
    """An optional float ``ndim``-d head tensor whose dim 0 is the vocabulary."""
    if value is not None:
        check_tensor(name, value, ndim=ndim, floating=True)
        if value.shape[0] != vocab:
            raise ValueError(f"{name} must have {vocab} rows (weight's vocab size), got shape {tuple(value.shape)}")


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


def run_sequence_objective(
    weight: Tensor, hidden: Tensor, labels: Tensor, objective: Objective, head: HeadOptions, *,
    group_size: int = 1, bias: Optional[Tensor] = None, ref_hidden: Optional[Tensor] = None,
    ref_weight: Optional[Tensor] = None, ref_bias: Optional[Tensor] = None,
    ref_logps: Optional[Tensor] = None, token_weights: Optional[Tensor] = None, need_aligned_logps: bool = False,
) -> tuple[Tensor, dict, SequenceStats]:
    """:func:`fused_linear_sequence_objective` for inputs already checked
    (:func:`check_sequence_inputs`) and an :class:`Objective`: what the preference losses call."""
    call = SequenceCall(
        labels=labels, objective=objective, group_size=group_size, head=head,
        compute_dtype=compute_dtype(weight), grad_enabled=torch.is_grad_enabled(),
        ref_hidden=_detached(ref_hidden), ref_weight=_detached(ref_weight), ref_bias=_detached(ref_bias),
        ref_logps=_detached(ref_logps), token_weights=_detached(token_weights),
        need_aligned_logps=bool(need_aligned_logps),
    )
    result = SequenceResult()
    loss = _SequenceObjectiveFunction.apply(weight, hidden, bias, call, result)
    return loss, result.metrics, result.stats


@eager_under_compile
def fused_linear_sequence_objective(
    weight: Tensor,
    hidden: Tensor,
    labels: Tensor,
    objective,
    *,
    group_size: int = 1,
    separable: bool = True,
    bias: Optional[Tensor] = None,
    ref_hidden: Optional[Tensor] = None,
    ref_weight: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    ref_logps: Optional[Tensor] = None,
    token_weights: Optional[Tensor] = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    need_entropy: bool = False,
    need_aligned_logps: bool = False,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> tuple[Tensor, dict, SequenceStats]:
    """A loss on per-sequence sums of token log-probabilities, computed chunk by chunk.

    ``hidden [B, T, H]`` is scored against ``labels [B, T]`` (already shifted) through
    ``weight [V, H]`` (+ ``bias [V]``). Units: ``group_size=1`` -> each sequence; ``group_size=2``
    -> pairs, the batch laid out ``[chosen; rejected]`` on dim 0 (pair ``p`` = sequences ``p`` and
    ``p + B/2``). ``objective(stats) -> (losses [U], metrics {name: [U]})`` is plain PyTorch,
    differentiable in ``stats.logps``; for pairs the stats come ordered
    ``[chosen of the units; rejected of the units]``. The loss is the mean over all units.
    ``objective`` is an :class:`~liger_losses.chunked.objective.Objective` (which declares
    ``separable`` and ``pair_gradient_ratio``) or a plain callable (separable as ``separable``
    says); ``separable=False`` runs any objective whole.

    Reference log-probs: ``ref_logps [B]`` if given, else computed from ``ref_hidden [B, T, Hr]``
    with ``ref_weight [V, Hr]`` and ``ref_bias`` under no grad, else None. ``ref_weight=None``
    means the reference shares the policy head: ``weight`` and, unless ``ref_bias`` is given,
    ``bias``; a given ``ref_weight`` without ``ref_bias`` has no bias.
    ``token_weights [B, T]`` weight each token's log-prob in ``logps`` (and ``ref_logps``).
    ``need_aligned_logps`` adds ``stats.aligned_logps``: per sequence the unweighted sum of
    ``log p(label) - log sum_v p_v^2`` (WPO's weights), detached.
    Shared options (``ignore_index`` ... ``impl``): :class:`~liger_losses.chunked.options.HeadOptions`.

    Separable objectives whose units fit the chunk budget run in one pass (gradients computed
    while each tile exists, objective called per chunk of units); others in two phases
    (statistics of the whole batch, objective once, then tiles recomputed for the gradient), see
    :func:`~liger_losses.chunked.planning.plan_sequence_passes`.

    Returns ``(loss, unit_metrics, stats)``: ``loss`` 0-d, differentiable w.r.t. ``hidden``,
    ``weight``, ``bias``; ``unit_metrics`` ``{name: [U]}`` detached, in unit order; ``stats`` the
    detached :class:`SequenceStats` of the whole batch in batch order (``index = arange(B)``).
    """
    head = HeadOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                       logit_scale=logit_scale, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
                       impl=impl, need_entropy=need_entropy)
    objective = as_objective(objective, separable=bool(separable))
    check_sequence_inputs(weight, hidden, labels, head, group_size=group_size, bias=bias, ref_hidden=ref_hidden,
                          ref_weight=ref_weight, ref_bias=ref_bias, ref_logps=ref_logps,
                          token_weights=token_weights)
    return run_sequence_objective(
        weight, hidden, labels, objective, head, group_size=group_size, bias=bias, ref_hidden=ref_hidden,
        ref_weight=ref_weight, ref_bias=ref_bias, ref_logps=ref_logps, token_weights=token_weights,
        need_aligned_logps=need_aligned_logps,
    )
