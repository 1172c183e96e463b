"""The sequence-objective driver: losses on per-sequence sums of token log-probabilities.

:func:`fused_linear_sequence_objective` is what every preference loss (DPO and its variants, SimPO,
CPO, ORPO, KTO) and the sequence-level SFT/ORPO terms run on. It scores ``hidden [B, T, H]``
against ``labels [B, T]`` through ``weight [V, H]`` (+ ``bias [V]``) chunk by chunk on the
primitives of :mod:`liger_losses.chunked.engine` (token compaction, logits tiles, gradient
GEMMs), reduces the token log-probabilities to per-sequence sums (:class:`SequenceStats`, float32
``[S]``) and hands them to a small PyTorch ``objective(stats) -> (losses [U], metrics {name:
[U]})`` over units of one sequence or of a ``[chosen; rejected]`` pair. A new preference loss is
one such function.

Gradients are computed inside the forward and scaled by ``grad_output`` in backward: in one pass
when whole units fit a chunk (the objective called per chunk of units, each tile back-propagated
while it exists), else in two phases (statistics of the whole batch, the objective once, then the
tiles recomputed), where the longest sequence -- or pair, when the objective fixes the ratio of
its rejected to chosen gradient -- is back-propagated in phase 1 and rescaled afterwards.
One host sync per call (the labels' scan), none in the chunk loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from liger_losses.chunked import engine
from liger_losses.chunked.engine import (
    HeadGrads,
    RowGather,
    _check_common,
    _needs_input_grads,
    _scaled_grads,
    _scan_labels,
    _valid_index,
    chunk_bounds,
    compute_dtype,
    gather_weight,
    grad_like,
    group_chunk_bounds,
    project,
    tile_budget,
)
from liger_losses.kernels.logits_tile import logits_tile
from liger_losses.kernels.utils import check_same_device, check_tensor

# One-pass preference losses need a whole unit (pair) in one tile: a unit may take up to this
# many DEFAULT_BUDGET_BYTES (or one tile_budget, if larger) before the engine falls back to two
# phases, which recompute every tile but the longest pair's (8NHV instead of 6NHV for the policy).
# 4 -> 1 GiB: 4184 tokens at V=128256 in bf16, so a batch of TRL DPO pairs at max_length 2048
# (prompt 512 + 2 x 1536 completion tokens) stays one-pass; the tile is freed before the model's
# backward, whose activations set a trainer's peak.
UNIT_BUDGET_FACTOR = 4


@dataclass
class SequenceStats:
    """Per-sequence statistics handed to a sequence objective; ``[S]`` float32 tensors for the
    ``S`` sequences of the call (for pairs: ``[chosen of the units; rejected of the units]``)."""

    logps: Tensor  # sum over valid tokens of token_weight * log p(label); differentiable in the driver
    num_tokens: Tensor  # valid tokens per sequence
    logits_sum: Tensor  # sum over valid tokens of the mean-over-vocab (transformed) logit
    correct: Tensor  # valid tokens whose argmax is the label
    entropy_sum: Optional[Tensor]  # sum over valid tokens of the softmax entropy (need_entropy)
    ref_logps: Optional[Tensor]  # reference sum log-probs (same token weights), or None
    batch_num_tokens: Tensor  # [B] valid tokens of every sequence of the whole batch
    index: Tensor  # [S] long: positions of these sequences in the whole batch


Objective = Callable[[SequenceStats], tuple[Tensor, dict]]

# Rows of the driver's per-position statistics (positions = sequences in unit order): one [6, B]
# float32 tensor, so that a chunk adds its sums in one kernel and the objective's inputs for a
# chunk of units are gathered in one (the host issues a chunk's small ops faster, which is what
# bounds a chunk at small models).
LOGPS, LOGITS_SUM, CORRECT, ENTROPY_SUM, REF_LOGPS, NUM_TOKENS = range(6)


class _SequenceObjectiveFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, hidden, bias, cfg, sink):
        needs_w, needs_h, needs_b = _needs_input_grads(ctx, cfg["grad_enabled"])
        loss, gh, gw, gb = _run_sequence_objective(
            weight, hidden, bias, cfg, sink, needs_h, needs_w, needs_b and bias is not None
        )
        ctx.save_for_backward(gh, gw, gb)
        ctx.weight_ref = weight if needs_w else None
        ctx.has = (gh is not None, gw is not None, gb is not None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        gh, gw, gb = _scaled_grads(ctx, grad_loss)
        return gw, gh, gb, None, None


def _run_sequence_objective(weight, hidden, bias, cfg, sink, needs_h, needs_w, needs_b):
    B, T, H = hidden.shape
    g = cfg["group_size"]
    U_total = B // g
    dev = hidden.device
    impl = cfg["impl"]
    ign = cfg["ignore_index"]
    labels = cfg["labels"]
    kopts = dict(
        temperature=cfg["temperature"], softcap=cfg["softcap"], logit_scale=cfg["logit_scale"],
        ignore_index=ign, impl=impl,
    )
    need_entropy = cfg["need_entropy"]
    w_full = gather_weight(weight)
    cdt = cfg["compute_dtype"]
    w_c = w_full if w_full.dtype == cdt else w_full.to(cdt)
    b_c = bias
    V = w_c.shape[0]

    # sequences in unit order: pairs interleaved (c0, r0, c1, r1, ...) so that a chunk of whole
    # units is one contiguous token range
    # the one host sync (before the loop): labels' range, valid tokens, per-sequence counts
    scan = _scan_labels(labels, ign, V, row_counts=True)
    counts = scan.row_counts
    batch_num_tokens = counts.float()
    if g == 2:
        P = B // 2
        order_list = [i for p in range(P) for i in (p, p + P)]
        # built on the device: a tensor copied from host memory would wait for the stream to drain
        order = torch.arange(B, device=dev).view(2, P).t().reshape(-1)
    else:
        order_list, order = list(range(B)), None
    ordered_counts = [scan.row_counts_host[i] for i in order_list]
    h2 = hidden.reshape(-1, H)
    l_valid, index = _valid_index(labels, ign, order, scan=scan)
    N = index.numel()
    identity = order is None and N == B * T
    h_rows = RowGather(h2, index, identity)
    order_t = order if order is not None else torch.arange(B, device=dev)
    unit_counts = counts if order is None else counts.index_select(0, order)  # per position
    pos_of_tok = torch.repeat_interleave(torch.arange(B, device=dev), unit_counts, output_size=N)
    tw = cfg["token_weights"]
    tw_valid = tw.reshape(-1).index_select(0, index).float() if tw is not None else None
    ref_logps_in = cfg["ref_logps"]
    ref_hidden = cfg["ref_hidden"]
    if ref_hidden is not None:
        rh_rows = h_rows.like(ref_hidden.reshape(-1, ref_hidden.shape[-1]))
        rw = cfg["ref_weight"]
        rw = w_c if rw is None else gather_weight(rw)
        rw = rw if rw.dtype == cdt else rw.to(cdt)
        rb = cfg["ref_bias"]
        if rb is None and cfg["ref_weight"] is None:
            rb = bias  # the reference shares the policy's head
    need_grad = needs_h or needs_w or needs_b
    itemsize = torch.finfo(cdt).bits // 8

    # per-position statistics (rows LOGPS ... NUM_TOKENS), in unit order
    acc = torch.zeros(6, B, dtype=torch.float32, device=dev)
    acc[NUM_TOKENS] = unit_counts
    if ref_logps_in is not None:
        acc[REF_LOGPS] = ref_logps_in.float().index_select(0, order_t)
    has_ref = ref_logps_in is not None or ref_hidden is not None
    grads = HeadGrads(h_rows, V, H, dtype=cdt, weight_dtype=cfg["accum_dtype"] or w_full.dtype, device=dev,
                      hidden=needs_h, weight=needs_w, bias=needs_b)

    def chunk_stats(ts, te, p0, p1, with_grad):
        """Tile of tokens [ts, te) (positions [p0, p1)): per-position sums; tile keeps the grad."""
        seg = pos_of_tok[ts:te] - p0
        if ref_hidden is not None and ref_logps_in is None:
            rt = project(rh_rows(ts, te), rw, rb)
            rs = logits_tile(rt, l_valid[ts:te], mode="logp", grad=False, need_logits_sum=False,
                             **kopts)
            del rt
            v = rs.logp if tw_valid is None else rs.logp * tw_valid[ts:te]
            acc[REF_LOGPS, p0:p1].index_add_(0, seg, v.float())
        tile = project(h_rows(ts, te), w_c, b_c)
        st = logits_tile(tile, l_valid[ts:te], mode="logp", grad=with_grad,
                         need_entropy=need_entropy, **kopts)
        v = st.logp if tw_valid is None else st.logp * tw_valid[ts:te]
        rows = [v, st.logits_sum / V, st.correct.float()]  # rows LOGPS, LOGITS_SUM, CORRECT
        if need_entropy:
            rows.append(st.entropy)  # ENTROPY_SUM
        # summed straight into the accumulator's columns (a view): one kernel per chunk
        acc[:len(rows), p0:p1].index_add_(1, seg, torch.stack(rows))
        return tile, seg

    def backprop(tile, ts, te, row_scale):
        """``row_scale`` [te - ts] or None (unit upstream gradient); token weights applied here."""
        if tw_valid is not None:
            row_scale = tw_valid[ts:te] if row_scale is None else row_scale * tw_valid[ts:te]
        grads.add(tile, h_rows(ts, te), w_c, ts, te, row_scale)

    perms: dict = {}

    def perm_of(size):
        """(perm, inverse) taking ``size`` positions in unit order (c0, r0, c1, r1, ...) to the
        objective's order (chosen of the units, then rejected), made once per size on the device (a
        host-to-device copy would drain the stream and idle the GPU); (None, None) for sequences."""
        if g != 2:
            return None, None
        if size not in perms:
            perm = torch.arange(size, device=dev).view(-1, 2).t().reshape(-1)
            perms[size] = (perm, torch.arange(size, device=dev).view(2, -1).t().reshape(-1))
        return perms[size]

    def call_objective(p0, p1, want_grad):
        """Objective on positions [p0, p1); returns (loss sum/U_total, metrics, grad per position)."""
        size = p1 - p0
        perm, inverse = perm_of(size)
        # a copy: the objective never sees the accumulators themselves
        rows = acc[:, p0:p1].clone() if perm is None else acc[:, p0:p1].index_select(1, perm)
        with torch.enable_grad():
            leaf = rows[LOGPS].clone().requires_grad_(want_grad)
            stats = SequenceStats(
                logps=leaf, num_tokens=rows[NUM_TOKENS], logits_sum=rows[LOGITS_SUM],
                correct=rows[CORRECT], entropy_sum=rows[ENTROPY_SUM] if need_entropy else None,
                ref_logps=rows[REF_LOGPS] if has_ref else None, batch_num_tokens=batch_num_tokens,
                index=order_t[p0:p1] if perm is None else order_t[p0:p1].index_select(0, perm),
            )
            losses, metrics = cfg["objective"](stats)
            u = size // g
            if not isinstance(losses, Tensor) or losses.numel() != u:
                raise ValueError(
                    f"objective must return losses of shape [{u}] (one per unit), got "
                    f"{tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__}"
                )
            total = losses.float().sum() / U_total
            grad_pos = None
            if want_grad:
                if total.requires_grad:
                    (gl,) = torch.autograd.grad(total, leaf, allow_unused=True)
                else:
                    gl = None
                if gl is None:
                    grad_pos = torch.zeros(size, dtype=torch.float32, device=dev)
                else:  # back to unit order
                    grad_pos = gl.float() if inverse is None else gl.float().index_select(0, inverse)
        mets = {}
        for k, m in (metrics or {}).items():
            m = m.detach()
            if m.numel() != u:
                raise ValueError(f"objective metric {k!r} must have shape [{u}], got {tuple(m.shape)}")
            mets[k] = m if m.dim() == 1 else m.reshape(u)
        return total.detach(), mets, grad_pos

    loss = torch.zeros((), dtype=torch.float32, device=dev)
    metric_parts: dict[str, list] = {}
    groups = [sum(ordered_counts[u * g:(u + 1) * g]) for u in range(U_total)]
    plan = None
    budget = tile_budget(V, H, itemsize)
    if cfg["separable"]:
        plan = group_chunk_bounds(groups, V, chunk_tokens=cfg["chunk_tokens"], budget_bytes=budget,
                                  itemsize=itemsize)
        if plan is None and cfg["chunk_tokens"] is None:
            # a unit (pair) larger than the default tile budget: one pass is still cheaper than
            # recomputing every tile (6NHV instead of 8NHV) as long as one unit's tile stays
            # within UNIT_BUDGET_FACTOR budgets; chunks then hold exactly the units that fit
            plan = group_chunk_bounds(
                groups, V, budget_bytes=max(UNIT_BUDGET_FACTOR * engine.DEFAULT_BUDGET_BYTES, budget),
                itemsize=itemsize,
            )
    if plan is not None:
        # one pass: every chunk holds whole units; gradients computed while the tile exists
        for u0, u1, ts, te in plan:
            p0, p1 = u0 * g, u1 * g
            tile, seg = chunk_stats(ts, te, p0, p1, need_grad)
            total, mets, grad_pos = call_objective(p0, p1, need_grad)
            loss = loss + total
            for k, m in mets.items():
                metric_parts.setdefault(k, []).append(m)
            if need_grad and te > ts:
                backprop(tile, ts, te, grad_pos[seg])
            del tile
    else:
        # two phases: statistics of the whole batch, objective, then recompute with row scales.
        # One sequence (the longest) is exempt from the recompute: its tiles are back-propagated
        # in phase 1 with a unit row scale while the weight-gradient buffer is still empty, and
        # the result is scaled once its upstream gradient is known (8NHV - 2N*HV instead of 8NHV;
        # a single long pair costs 7NHV). Its tokens are chunked apart whether or not gradients are
        # wanted, so the loss does not depend on it (bitwise the same under torch.no_grad()).
        ck = cfg["chunk_tokens"]
        starts = [0]
        for c in ordered_counts:
            starts.append(starts[-1] + c)
        # A pair whose objective fixes d loss / d rejected = ratio * d loss / d chosen (DPO on the
        # margin: ratio -1) is exempt as a whole: its chosen tiles are back-propagated with row
        # scale 1, its rejected ones with ``ratio``, and both scaled by the chosen gradient later
        # (a single long pair then costs 6NHV, no recompute).
        star, star_ratio = (max(range(B), key=lambda p: ordered_counts[p]), None) if B > 0 else (None, None)
        ratio_of = getattr(cfg["objective"], "pair_gradient_ratio", None)
        if g == 2 and B > 0 and callable(ratio_of):
            pair = max(range(B // 2), key=lambda u: ordered_counts[2 * u] + ordered_counts[2 * u + 1])
            ratio = ratio_of(ordered_counts[2 * pair], ordered_counts[2 * pair + 1])
            if ratio is not None:
                star, star_ratio = 2 * pair, float(ratio)
        a = starts[star] if star is not None else 0
        b = starts[star + (1 if star_ratio is None else 2)] if star is not None else 0
        mid = starts[star + 1] if star_ratio is not None else b  # chosen [a, mid), rejected [mid, b)

        def spans(lo, hi):
            return [(lo + s0, lo + s1) for s0, s1 in chunk_bounds(
                hi - lo, V, chunk_tokens=ck, budget_bytes=budget, itemsize=itemsize)]

        star_bounds = spans(a, b)
        other_bounds = spans(0, a) + spans(b, N)
        for ts, te in other_bounds:
            tile, _ = chunk_stats(ts, te, 0, B, False)  # statistics only, sums into all positions
            del tile
        for ts, te in star_bounds:
            tile, _ = chunk_stats(ts, te, 0, B, need_grad)
            if need_grad:
                row_scale = None
                if star_ratio is not None and te > mid:  # the tile reaches the rejected sequence
                    row_scale = torch.where(torch.arange(ts, te, device=dev) < mid, 1.0, star_ratio)
                backprop(tile, ts, te, row_scale)
            del tile
        total, mets, grad_pos = call_objective(0, B, need_grad)
        loss = loss + total
        for k, m in mets.items():
            metric_parts.setdefault(k, []).append(m)
        if need_grad:
            if star_bounds:  # only the star's tiles were added so far: scale them by its gradient
                grads.scale(a, b, grad_pos[star])
            for ts, te in other_bounds:
                tile = project(h_rows(ts, te), w_c, b_c)
                # statistics were taken in phase 1: only the gradient is wanted here
                logits_tile(tile, l_valid[ts:te], mode="logp", grad=True, need_logits_sum=False, **kopts)
                backprop(tile, ts, te, grad_pos[pos_of_tok[ts:te]])
                del tile

    gh, gw, gb = grads.finish()
    # outputs
    metrics = {k: torch.cat(v) for k, v in metric_parts.items()}  # [U_total], unit order
    full = acc if order is None else torch.empty_like(acc).index_copy_(1, order, acc)  # batch order
    sink["metrics"] = metrics
    sink["stats"] = SequenceStats(
        logps=full[LOGPS], num_tokens=batch_num_tokens, logits_sum=full[LOGITS_SUM],
        correct=full[CORRECT], entropy_sum=full[ENTROPY_SUM] if need_entropy else None,
        ref_logps=full[REF_LOGPS] if has_ref else None, batch_num_tokens=batch_num_tokens,
        index=torch.arange(B, device=dev),
    )
    grad_hidden = grad_like(gh, hidden) if gh is not None else None
    return loss, grad_hidden, gw, gb


def fused_linear_sequence_objective(
    weight: Tensor,
    hidden: Tensor,
    labels: Tensor,
    objective: Objective,
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

    Reference log-probs: ``ref_logps [B]`` if given, else computed from ``ref_hidden [B, T, Hr]``
    with ``ref_weight [V, Hr]`` and ``ref_bias`` under no grad, else None. ``ref_weight=None``
    means the reference shares the policy head: ``weight`` and, unless ``ref_bias`` is given,
    ``bias``; a given ``ref_weight`` without ``ref_bias`` has no bias.
    ``token_weights [B, T]`` weight each token's log-prob in ``logps`` (and ``ref_logps``).

    ``separable=True`` and whole units fit the chunk budget -> one pass (gradients computed while
    each tile exists, objective called per chunk of units); otherwise two phases (statistics of the
    whole batch, objective once, then tiles recomputed for the gradient). In two phases the longest
    sequence is back-propagated in phase 1 and rescaled once its gradient is known; for pairs, the
    longest pair instead when the objective has a method ``pair_gradient_ratio(chosen_tokens,
    rejected_tokens) -> float | None`` returning ``r`` with d loss/d rejected = r * d loss/d chosen
    for every pair of those lengths (e.g. -1 for a loss of the chosen-minus-rejected margin).

    Returns ``(loss, unit_metrics, stats)``: ``loss`` 0-d, differentiable w.r.t. ``hidden``,
    ``weight``, ``bias``; ``unit_metrics`` ``{name: [U]}`` detached, in unit order; ``stats`` the
    detached :class:`SequenceStats` of the whole batch in batch order (``index = arange(B)``).
    """
    _check_common(weight, hidden, labels, bias, ignore_index, temperature, softcap, logit_scale,
                  chunk_tokens, accum_dtype, impl, hidden_ndim=3)
    if not callable(objective):
        raise TypeError(f"objective must be callable, got {type(objective).__name__}")
    if group_size not in (1, 2):
        raise ValueError(f"group_size must be 1 (sequences) or 2 (pairs), got {group_size!r}")
    B, T, _ = hidden.shape
    V = weight.shape[0]
    if group_size == 2 and B % 2 != 0:
        raise ValueError(
            f"group_size=2 needs an even batch laid out [chosen; rejected] on dim 0, got B={B}"
        )
    if ref_weight is not None:
        check_tensor("ref_weight", ref_weight, ndim=2, floating=True)
        if ref_weight.shape[0] != V:
            raise ValueError(
                f"ref_weight must have shape [{V}, Hr] (same vocab as weight), got {tuple(ref_weight.shape)}"
            )
    if ref_hidden is not None:
        check_tensor("ref_hidden", ref_hidden, ndim=3, floating=True)
        Hr = (ref_weight if ref_weight is not None else weight).shape[1]
        if tuple(ref_hidden.shape) != (B, T, Hr):
            raise ValueError(
                f"ref_hidden must have shape {(B, T, Hr)} ([B, T] of hidden, H of ref_weight), "
                f"got {tuple(ref_hidden.shape)}"
            )
    if ref_bias is not None:
        check_tensor("ref_bias", ref_bias, ndim=1, floating=True)
        if ref_bias.shape[0] != V:
            raise ValueError(f"ref_bias must have shape [{V}], got {tuple(ref_bias.shape)}")
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
    cfg = dict(
        labels=labels, objective=objective, group_size=group_size, separable=bool(separable),
        ref_hidden=None if ref_hidden is None else ref_hidden.detach(),
        ref_weight=None if ref_weight is None else ref_weight.detach(),
        ref_bias=None if ref_bias is None else ref_bias.detach(),
        ref_logps=None if ref_logps is None else ref_logps.detach(),
        token_weights=None if token_weights is None else token_weights.detach(),
        ignore_index=ignore_index, temperature=float(temperature),
        softcap=None if softcap is None else float(softcap), logit_scale=float(logit_scale),
        need_entropy=bool(need_entropy), chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
        impl=impl, compute_dtype=compute_dtype(weight), grad_enabled=torch.is_grad_enabled(),
    )
    sink: dict = {}
    loss = _SequenceObjectiveFunction.apply(weight, hidden, bias, cfg, sink)
    return loss, sink["metrics"], sink["stats"]
