"""Per-token passes: the chunk loop of the losses whose upstream gradient each token knows.

Cross-entropy, token log-probs (and the engine's other per-token losses) run here:

* :func:`run_tiles` -- one chunked pass over compacted tokens: per chunk :func:`~.gemm.project`,
  the logits-tile kernel (``kernels.logits_tile``, ``mode`` "ce" | "logp") writing row statistics
  and, with ``grad``, ``d loss / d logits`` in place, then :class:`~.gemm.HeadGrads`;
* :func:`run_token_tiles` -- the token compaction (one host sync, labels range-checked) then
  :func:`run_tiles`, with the first chunk issued before that sync
  (``EngineConfig.speculative_first_chunk``);
* :class:`RecomputedTokenFunction` -- the autograd Function of a per-token output whose backward
  recomputes each tile with the per-token upstream gradient as its row scale
  (``reduction="none"`` cross-entropy, token log-probs), set up by a frozen :class:`TokenPass`.

Shapes: ``weight [V, H]`` (full, in the compute dtype), ``hidden [..., H]``, ``labels [...]``;
statistics are float32 ``[N]`` over the ``N`` valid tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from liger_losses.chunked.autograd import check_no_double_backward_of_loss
from liger_losses.chunked.config import get_engine_config
from liger_losses.chunked.frozen_head import (
    OnlinePass,
    online_chunk_capacity,
    online_eligible,
    online_token_chunks,
    run_online_chunks,
)
from liger_losses.chunked.gemm import HeadGrads, WeightAccum, itemsize, project, weight_accum
from liger_losses.chunked.planning import token_chunks
from liger_losses.chunked.tokens import (
    PendingLabelScan,
    RowGather,
    grad_like,
    hidden_rows_at,
    per_row_scale,
    scatter_rows,
    valid_index,
)
from liger_losses.chunked.weights import head_in_dtype, weight_grad_like
from liger_losses.kernels.logits_tile import logits_tile

STAT_NAMES = ("loss", "lse", "logp", "correct", "entropy")


def run_tiles(
    weight: Tensor,
    hidden_rows: RowGather,
    labels_valid: Tensor,
    bias: Optional[Tensor],
    *,
    mode: str,
    grad: bool,
    grad_scale=1.0,
    need_entropy: bool = False,
    kernel_opts: Optional[Mapping[str, Any]] = None,
    chunk_tokens: Optional[int] = None,
    accum: Optional[WeightAccum] = None,
    needs_hidden: bool = True,
    needs_weight: bool = True,
    needs_bias: bool = False,
):
    """One chunked pass of a per-token loss over the non-ignored tokens.

    ``weight [V, H]`` (full, already in the compute dtype), ``hidden_rows`` (``tokens.token_rows``:
    ``N`` tokens of an ``[M, H]`` tensor), ``labels_valid [N]``. Per chunk: ``project``, the
    logits-tile kernel in ``mode`` ("ce" | "logp") with ``kernel_opts`` and ``grad_scale`` (a float, a
    one-entry tensor, or a 1-D tensor of at least ``N`` entries sliced per chunk: :func:`~.tokens.per_row_scale`),
    and when ``grad`` the gradient GEMMs. Returns ``(stats,
    grad_hidden [M, H] | None (zeros at ignored rows), grad_weight [V, H] (``accum``, by default
    :func:`~.gemm.weight_accum` of the weight's dtype) | None, grad_bias [V] fp32 | None)`` where ``stats`` maps
    loss/lse/logp/correct(/entropy) to ``[N]`` tensors.
    """
    grads, tile_opts = _pass_setup(
        weight, hidden_rows, labels_valid.device, mode=mode, grad=grad, need_entropy=need_entropy,
        kernel_opts=kernel_opts, accum=accum, needs_hidden=needs_hidden,
        needs_weight=needs_weight, needs_bias=needs_bias,
    )
    parts: dict[str, list] = {}
    V, H = weight.shape
    if online_eligible(chunk_tokens=chunk_tokens, mode=mode, grad=grad, needs_hidden=needs_hidden,
                       needs_weight=needs_weight, needs_bias=needs_bias, kernel_opts=kernel_opts):
        run_online_chunks(weight, hidden_rows, labels_valid, bias, grads, parts, grad_scale, tile_opts)
    else:
        bounds = token_chunks(V, H, itemsize(weight.dtype), labels_valid.shape[0], chunk_tokens,
                              wide_accum=grads.wide_accum)
        _run_chunks(weight, hidden_rows, labels_valid, bias, bounds, grads, parts, grad_scale, tile_opts)
    return (_stats_of(parts, need_entropy, labels_valid.device), *grads.finish())


def _pass_setup(weight: Tensor, rows: Optional[RowGather], device, *, mode: str, grad: bool,
                need_entropy: bool, kernel_opts: Optional[Mapping[str, Any]],
                accum: Optional[WeightAccum], needs_hidden: bool, needs_weight: bool,
                needs_bias: bool):
    """``(grads, tile_opts)`` of one pass: the :class:`HeadGrads` to fill and the logits-tile
    keywords of every chunk."""
    V, H = weight.shape
    accum = accum if accum is not None else weight_accum(None, weight.dtype)
    grads = HeadGrads(rows, V, H, dtype=weight.dtype, accum=accum, device=device,
                      hidden=grad and needs_hidden, weight=grad and needs_weight, bias=grad and needs_bias)
    return grads, dict(mode=mode, grad=grad, need_entropy=need_entropy, **dict(kernel_opts or {}))


def run_token_tiles(
    weight: Tensor,
    hidden: Tensor,
    labels: Tensor,
    bias: Optional[Tensor],
    *,
    ignore_index: int,
    mode: str,
    grad: bool,
    grad_scale=1.0,
    need_entropy: bool = False,
    kernel_opts: Optional[Mapping[str, Any]] = None,
    chunk_tokens: Optional[int] = None,
    accum: Optional[WeightAccum] = None,
    needs_hidden: bool = True,
    needs_weight: bool = True,
    needs_bias: bool = False,
):
    """The token compaction of ``hidden [..., H]`` / ``labels [...]`` (labels range-checked against
    ``V``) then :func:`run_tiles` (same keywords), with the first chunk issued before the host sync
    (``EngineConfig.speculative_first_chunk``). A tensor ``grad_scale`` needs at least one entry
    per token of ``labels`` (sliced in the valid tokens' order). Returns ``(stats, grad_hidden,
    grad_weight, grad_bias, labels_valid, index)``, the first four as :func:`run_tiles`'."""
    V, H = weight.shape
    accum = accum if accum is not None else weight_accum(None, weight.dtype)
    wide = grad and needs_weight and accum.widens
    opts = dict(mode=mode, grad=grad, need_entropy=need_entropy, kernel_opts=kernel_opts,
                accum=accum, needs_hidden=needs_hidden, needs_weight=needs_weight,
                needs_bias=needs_bias)
    flat_labels = labels.reshape(-1)
    total = flat_labels.shape[0]
    size = itemsize(weight.dtype)
    online = online_eligible(chunk_tokens=chunk_tokens, mode=mode, grad=grad, needs_hidden=needs_hidden,
                             needs_weight=needs_weight, needs_bias=needs_bias, kernel_opts=kernel_opts)
    if online:
        bounds = online_token_chunks(V, H, size, total)
    else:
        bounds = token_chunks(V, H, size, total, chunk_tokens, wide_accum=wide)
    first = bounds[0][1] if bounds else 0
    per_row = per_row_scale(grad_scale, total)
    pending = pos = None
    if get_engine_config().speculative_first_chunk and first > 0 and total >= 2 * first:
        pending = PendingLabelScan(labels, ignore_index, V)
        try:  # the first `first` valid positions, padded with -1
            pos = torch.nonzero_static(pending.valid.reshape(-1), size=first, fill_value=-1).squeeze(1)
        except (AttributeError, NotImplementedError, RuntimeError):  # older torch / backend: plain path
            pos = None
    if pos is None:
        scan = pending.result() if pending is not None else None
        labels_valid, index = valid_index(labels, ignore_index, num_classes=V, scan=scan)
        return (*run_tiles(weight, hidden_rows_at(hidden, index), labels_valid, bias, grad_scale=grad_scale,
                           chunk_tokens=chunk_tokens, **opts), labels_valid, index)
    # the first chunk: padding and labels out of range count as ignored here (label ignore_index;
    # on the frozen-head path label 0, which only indexes W, their results dropped), so no kernel
    # reads past the vocabulary; rows not known valid are zeroed, as the plain path never reads
    # ignored rows, whose hidden states may be non-finite (fully masked padding), and 0 * NaN in the
    # weight-gradient GEMM is NaN
    at = pos.clamp_min(0)
    keep = (pos >= 0) & pending.in_range.reshape(-1).index_select(0, at)
    first_labels = torch.where(keep, flat_labels.index_select(0, at).long(),
                               torch.full_like(at, 0 if online else ignore_index))
    first_rows = hidden.reshape(-1, H).index_select(0, at).masked_fill_(~keep.unsqueeze(1), 0)
    grads, tile_opts = _pass_setup(weight, None, labels.device, **opts)
    first_scale = grad_scale[:first] if per_row else grad_scale
    if online:
        op = OnlinePass(weight, bias, tile_opts, min(total, online_chunk_capacity(V, H, size)))
        first_stats = op.stats_buffers(first)
        first_grad = grads.detached_rows(first)  # the path always wants the hidden gradient
        op.chunk(first_rows, first_labels, first_scale, first_grad, None, first_stats)
    else:
        tile = project(first_rows, weight, bias)
        first_stats = logits_tile(tile, first_labels, grad_scale=first_scale, need_logits_sum=False,
                                  **tile_opts)._asdict()
        first_grad = grads.add_detached(tile, first_rows, weight) if grad else None
        del tile
    del first_rows
    scan = pending.result()  # the one host sync (raises on labels out of range)
    labels_valid, index = valid_index(labels, ignore_index, scan=scan)
    rows = hidden_rows_at(hidden, index)
    grads.attach(rows)
    done = min(first, scan.num_valid)
    grads.commit_detached(first_grad, 0, done)
    del first_grad  # not held through the later chunks (the peak is one tile above the gradients)
    parts: dict[str, list] = {k: [v[:done]] for k, v in first_stats.items() if v is not None}
    if online:
        run_online_chunks(weight, rows, labels_valid, bias, grads, parts, grad_scale, tile_opts, done=done, online=op)
    else:
        rest = [(done + a, done + b) for a, b in token_chunks(V, H, size, scan.num_valid - done, chunk_tokens,
                                                                    wide_accum=wide)]
        _run_chunks(weight, rows, labels_valid, bias, rest, grads, parts, grad_scale, tile_opts)
    return (_stats_of(parts, need_entropy, labels.device), *grads.finish(), labels_valid, index)


def _run_chunks(weight, rows, labels_valid, bias, bounds, grads, parts, grad_scale, tile_opts) -> None:
    """The chunk loop of :func:`run_tiles`: tokens ``[ts, te)`` of ``rows`` for each bound, their
    statistics appended to ``parts`` and their gradients added to ``grads``."""
    per_row = per_row_scale(grad_scale, bounds[-1][1] if bounds else 0)
    for ts, te in bounds:
        h = rows(ts, te)
        tile = project(h, weight, bias)
        st = logits_tile(tile, labels_valid[ts:te], grad_scale=grad_scale[ts:te] if per_row else grad_scale,
                         need_logits_sum=False, **tile_opts)
        for k, v in st._asdict().items():
            if v is not None:
                parts.setdefault(k, []).append(v)
        if tile_opts["grad"]:
            grads.add(tile, h, weight, ts, te)
        del tile


def _stats_of(parts: dict, need_entropy: bool, device) -> dict:
    stats = {}
    for k in STAT_NAMES:
        if k in parts:
            stats[k] = torch.cat(parts[k])
        elif k != "entropy" or need_entropy:
            stats[k] = torch.zeros(0, dtype=torch.bool if k == "correct" else torch.float32, device=device)
    return stats


# --------------------------------------------------------------------------- recomputed per-token outputs


@dataclass(frozen=True)
class TokenPass:
    """The settings of a per-token output computed by :class:`RecomputedTokenFunction`: the tile
    kernel's ``mode`` and keywords, the statistic returned per token (``output``: "loss" or
    "logp"), chunking, precision and whether the forward also computes the entropy."""

    mode: str
    output: str
    ignore_index: int
    kernel_opts: Mapping[str, Any]
    compute_dtype: torch.dtype
    chunk_tokens: Optional[int] = None
    accum_dtype: Optional[torch.dtype] = None
    need_entropy: bool = False


@dataclass
class TokenPassResult:
    """What the forward of :class:`RecomputedTokenFunction` leaves besides its output: the
    valid tokens' statistics (``[N]``, detached) and their flat positions."""

    stats: dict = field(default_factory=dict)
    index: Optional[Tensor] = None


def scatter_token_values(values: Tensor, index: Tensor, labels: Tensor) -> Tensor:
    """``[N_valid]`` per-token values back to ``labels``' shape, 0 at ignored positions."""
    return scatter_rows(values.unsqueeze(1), index, tuple(labels.shape) + (1,)).squeeze(-1)


class RecomputedTokenFunction(torch.autograd.Function):
    """``apply(weight, hidden, bias, labels, spec, result) -> [...]`` the per-token ``spec.output``
    (0 at ignored positions). Forward: statistics only (no gradient GEMM), first chunk before the
    host sync; the valid tokens' labels and positions are saved, so backward needs no second
    sync. Backward: each tile recomputed with the per-token upstream gradient as the row scale."""

    @staticmethod
    def forward(ctx, weight, hidden, bias, labels, spec: TokenPass, result: TokenPassResult):
        with torch.no_grad():
            w_full, w_c = head_in_dtype(weight, spec.compute_dtype)
            stats, _, _, _, l_valid, index = run_token_tiles(
                w_c, hidden, labels, bias, ignore_index=spec.ignore_index, mode=spec.mode, grad=False,
                kernel_opts=spec.kernel_opts, chunk_tokens=spec.chunk_tokens, need_entropy=spec.need_entropy,
            )
        ctx.save_for_backward(weight, hidden, bias, l_valid, index)
        ctx.spec = spec
        # the accumulator dtype the forward's engine config gives, not the one in force at backward (the
        # chunk plan is still made at backward, under the config in force then)
        ctx.accum = weight_accum(spec.accum_dtype, w_full.dtype)
        result.stats, result.index = stats, index
        return scatter_token_values(stats[spec.output], index, labels)

    @staticmethod
    def backward(ctx, grad_out):
        check_no_double_backward_of_loss()
        weight, hidden, bias, l_valid, index = ctx.saved_tensors
        spec = ctx.spec
        needs_w, needs_h, needs_b = ctx.needs_input_grad[:3]
        needs_b = needs_b and bias is not None
        _, w_c = head_in_dtype(weight, spec.compute_dtype)
        rows = hidden_rows_at(hidden, index)
        scale = grad_out.reshape(-1).float()
        scale = scale.index_select(0, index) if scale.shape[0] != index.shape[0] else scale
        _, gh, gw, gb = run_tiles(
            w_c, rows, l_valid, bias, mode=spec.mode, grad=True, grad_scale=scale.contiguous(),
            kernel_opts=spec.kernel_opts, chunk_tokens=spec.chunk_tokens,
            accum=ctx.accum,
            needs_hidden=needs_h, needs_weight=needs_w, needs_bias=needs_b,
        )
        if gh is not None:
            gh = grad_like(gh, hidden)
        if gw is not None:
            gw = weight_grad_like(weight, gw if gw.dtype == weight.dtype else gw.to(weight.dtype))
        if gb is not None:
            gb = gb.to(bias.dtype)
        return gw, gh, gb, None, None, None
