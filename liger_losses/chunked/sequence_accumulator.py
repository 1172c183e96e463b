"""The sequence driver's state: per-position statistics, the heads, and the objective call.

:class:`SequenceAccumulator` is built once per call of the sequence-objective driver
(:mod:`liger_losses.chunked.sequence`). It owns

* the token layout: the labels' one host sync, the valid tokens in unit order (pairs interleaved
  ``c0, r0, c1, r1, ...``, :func:`~.planning.unit_order`), their rows (never copied) and the
  position (sequence in unit order) of every token;
* the per-position statistics, one ``[7, B]`` float32 tensor (rows :data:`LOGPS` ...
  :data:`NUM_TOKENS`): a chunk adds its sums in one kernel and the objective's inputs for a chunk
  of units are gathered in one (the host issues a chunk's small ops faster, which is what bounds a
  chunk at small models);
* the policy head (gathered, in the compute dtype), the reference head (when the reference
  log-probs are computed from ``ref_hidden``) and the :class:`~.gemm.HeadGrads` being filled;
* the objective call on a range of positions (:meth:`call_objective`): the statistics reordered
  to the objective's layout (chosen of the units, then rejected), ``d loss / d logps`` by autograd
  on those ``[S]`` tensors, mapped back to unit order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.gemm import HeadGrads, itemsize, project, weight_accum
from liger_losses.chunked.objective import Objective, SequenceStats
from liger_losses.chunked.options import HeadOptions
from liger_losses.chunked.planning import unit_order
from liger_losses.chunked.tokens import RowGather, scan_labels, valid_index
from liger_losses.chunked.weights import gather_weight, head_in_dtype
from liger_losses.kernels.logits_tile import logits_tile


@dataclass(frozen=True)
class SequenceCall:
    """The inputs and options of one call of the sequence driver besides the differentiable
    ``(weight, hidden, bias)``; the reference tensors and token weights are detached."""

    labels: Tensor
    objective: Objective
    group_size: int
    head: HeadOptions
    compute_dtype: torch.dtype
    grad_enabled: bool
    ref_hidden: Optional[Tensor] = None
    ref_weight: Optional[Tensor] = None
    ref_bias: Optional[Tensor] = None
    ref_logps: Optional[Tensor] = None
    token_weights: Optional[Tensor] = None
    need_aligned_logps: bool = False


# Rows of the per-position statistics: a chunk's sums fill the leading rows up to ALIGNED_LOGPS.
LOGPS, LOGITS_SUM, CORRECT, ENTROPY_SUM, ALIGNED_LOGPS, REF_LOGPS, NUM_TOKENS = range(7)


class SequenceAccumulator:
    """Per-position statistics of one call and everything a chunk needs (see the module
    docstring); ``call`` holds the call's inputs and options."""

    def __init__(self, weight: Tensor, hidden: Tensor, bias: Optional[Tensor], call: SequenceCall,
                 needs_hidden: bool, needs_weight: bool, needs_bias: bool):
        B, T, H = hidden.shape
        self.call, self.group_size, self.batch = call, call.group_size, B
        self.num_units = B // call.group_size
        dev = self.device = hidden.device
        head = call.head
        self.kernel_opts = head.tile_options()
        self.need_entropy = head.need_entropy
        self.need_aligned = call.need_aligned_logps
        w_full, self.weight = head_in_dtype(weight, call.compute_dtype)
        self.bias = bias
        V = self.vocab = self.weight.shape[0]
        self.hidden_size, self.itemsize = H, itemsize(call.compute_dtype)

        # the one host sync (before any chunk): labels' range, valid tokens, per-sequence counts
        scan = scan_labels(call.labels, head.ignore_index, V, row_counts=True)
        counts = scan.row_counts
        self.batch_num_tokens = counts.float()
        if call.group_size == 2:
            # built on the device: a tensor copied from host memory would wait for the stream to drain
            self.order = torch.arange(B, device=dev).view(2, B // 2).t().reshape(-1)
        else:
            self.order = None
        self.position_counts = [scan.row_counts_host[i] for i in unit_order(B, call.group_size)]
        self.labels_valid, index = valid_index(call.labels, head.ignore_index, self.order, scan=scan)
        N = self.num_tokens = index.numel()
        self.rows = RowGather(hidden.reshape(-1, H), index, self.order is None and N == B * T)
        self.order_t = self.order if self.order is not None else torch.arange(B, device=dev)
        unit_counts = counts if self.order is None else counts.index_select(0, self.order)  # per position
        self.pos_of_tok = torch.repeat_interleave(torch.arange(B, device=dev), unit_counts, output_size=N)
        tw = call.token_weights
        self.token_weights = tw.reshape(-1).index_select(0, index).float() if tw is not None else None
        self._init_reference(bias)

        self.acc = torch.zeros(7, B, dtype=torch.float32, device=dev)
        self.acc[NUM_TOKENS] = unit_counts
        if call.ref_logps is not None:
            self.acc[REF_LOGPS] = call.ref_logps.float().index_select(0, self.order_t)
        self.has_ref = call.ref_logps is not None or call.ref_hidden is not None
        self.grads = HeadGrads(self.rows, V, H, dtype=call.compute_dtype,
                               accum=weight_accum(head.accum_dtype, w_full.dtype), device=dev,
                               hidden=needs_hidden, weight=needs_weight, bias=needs_bias)
        self.loss = torch.zeros((), dtype=torch.float32, device=dev)
        self.metric_parts: dict[str, list] = {}
        self._perms: dict = {}

    def _init_reference(self, bias: Optional[Tensor]) -> None:
        """The reference head, when the reference log-probs come from ``ref_hidden``."""
        call = self.call
        self.ref_rows = None
        if call.ref_hidden is None or call.ref_logps is not None:
            return
        self.ref_rows = self.rows.like(call.ref_hidden.reshape(-1, call.ref_hidden.shape[-1]))
        rw = self.weight if call.ref_weight is None else gather_weight(call.ref_weight)
        self.ref_weight = rw if rw.dtype == call.compute_dtype else rw.to(call.compute_dtype)
        rb = call.ref_bias
        if rb is None and call.ref_weight is None:
            rb = bias  # the reference shares the policy's head
        self.ref_bias = rb

    # ------------------------------------------------------------------ chunks

    def chunk_stats(self, ts: int, te: int, p0: int, p1: int, with_grad: bool):
        """Tile of tokens ``[ts, te)`` (positions ``[p0, p1)``): their sums added to the statistics;
        returns ``(tile, seg)``, the tile holding ``d logp / d logits`` when ``with_grad`` and
        ``seg`` the tokens' positions relative to ``p0``."""
        acc, tw = self.acc, self.token_weights
        seg = self.pos_of_tok[ts:te] - p0
        if self.ref_rows is not None:
            rt = project(self.ref_rows(ts, te), self.ref_weight, self.ref_bias)
            rs = logits_tile(rt, self.labels_valid[ts:te], mode="logp", grad=False, need_logits_sum=False,
                             **self.kernel_opts)
            del rt
            v = rs.logp if tw is None else rs.logp * tw[ts:te]
            acc[REF_LOGPS, p0:p1].index_add_(0, seg, v.float())
        tile = project(self.rows(ts, te), self.weight, self.bias)
        st = logits_tile(tile, self.labels_valid[ts:te], mode="logp", grad=with_grad,
                         need_entropy=self.need_entropy, need_log_sum_sq=self.need_aligned, **self.kernel_opts)
        v = st.logp if tw is None else st.logp * tw[ts:te]
        rows = [v, st.logits_sum / self.vocab, st.correct.float()]  # rows LOGPS, LOGITS_SUM, CORRECT
        if self.need_entropy or self.need_aligned:
            rows.append(st.entropy if self.need_entropy else torch.zeros_like(v))  # ENTROPY_SUM
        if self.need_aligned:  # ALIGNED_LOGPS, unweighted: WPO reads the plain log-probs whatever the token weights
            rows.append(st.logp - st.log_sum_sq)
        # summed straight into the accumulator's columns (a view): one kernel per chunk (the
        # statistics are float32 also for a float64 head, whose tile statistics are float64)
        acc[:len(rows), p0:p1].index_add_(1, seg, torch.stack(rows).to(acc.dtype))
        return tile, seg

    def gradient_tile(self, ts: int, te: int) -> Tensor:
        """The tile of tokens ``[ts, te)`` recomputed for its gradient only (statistics were
        taken in phase 1)."""
        tile = project(self.rows(ts, te), self.weight, self.bias)
        logits_tile(tile, self.labels_valid[ts:te], mode="logp", grad=True, need_logits_sum=False,
                    **self.kernel_opts)
        return tile

    def backprop(self, tile: Tensor, ts: int, te: int, row_scale: Optional[Tensor]) -> None:
        """``row_scale [te - ts]`` or None (unit upstream gradient); token weights applied here."""
        tw = self.token_weights
        if tw is not None:
            row_scale = tw[ts:te] if row_scale is None else row_scale * tw[ts:te]
        self.grads.add(tile, self.rows(ts, te), self.weight, ts, te, row_scale)

    # ------------------------------------------------------------------ the objective

    def _perm_of(self, size: int):
        """(perm, inverse) taking ``size`` positions in unit order (c0, r0, c1, r1, ...) to the
        objective's order (chosen of the units, then rejected), made once per size on the device (a
        host-to-device copy would drain the stream and idle the GPU); (None, None) for sequences."""
        if self.group_size != 2:
            return None, None
        if size not in self._perms:
            dev = self.device
            perm = torch.arange(size, device=dev).view(-1, 2).t().reshape(-1)
            self._perms[size] = (perm, torch.arange(size, device=dev).view(2, -1).t().reshape(-1))
        return self._perms[size]

    def call_objective(self, p0: int, p1: int, want_grad: bool) -> Optional[Tensor]:
        """The objective on positions ``[p0, p1)``: its loss (sum / all units) and metrics are
        added to the call's; returns ``d loss / d logps`` per position (unit order) when
        ``want_grad``."""
        size = p1 - p0
        perm, inverse = self._perm_of(size)
        acc = self.acc
        # a copy: the objective never sees the accumulators themselves
        rows = acc[:, p0:p1].clone() if perm is None else acc[:, p0:p1].index_select(1, perm)
        u = size // self.group_size
        with torch.enable_grad():
            leaf = rows[LOGPS].clone().requires_grad_(want_grad)
            stats = self._stats(leaf, rows, self.order_t[p0:p1] if perm is None
                                else self.order_t[p0:p1].index_select(0, perm))
            losses, metrics = self.call.objective(stats)
            if not isinstance(losses, Tensor) or losses.numel() != u:
                raise ValueError(
                    f"objective must return losses of shape [{u}] (one per unit), got "
                    f"{tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__}"
                )
            total = losses.float().sum() / self.num_units
            grad_pos = None
            if want_grad:
                gl = torch.autograd.grad(total, leaf, allow_unused=True)[0] if total.requires_grad else None
                if gl is None:
                    grad_pos = torch.zeros(size, dtype=torch.float32, device=self.device)
                else:  # back to unit order
                    grad_pos = gl.float() if inverse is None else gl.float().index_select(0, inverse)
        for k, m in (metrics or {}).items():
            m = m.detach()
            if m.numel() != u:
                raise ValueError(f"objective metric {k!r} must have shape [{u}], got {tuple(m.shape)}")
            self.metric_parts.setdefault(k, []).append(m if m.dim() == 1 else m.reshape(u))
        self.loss = self.loss + total.detach()
        return grad_pos

    def _stats(self, logps: Tensor, rows: Tensor, index: Tensor, num_tokens: Optional[Tensor] = None):
        return SequenceStats(
            logps=logps, num_tokens=rows[NUM_TOKENS] if num_tokens is None else num_tokens,
            logits_sum=rows[LOGITS_SUM], correct=rows[CORRECT],
            entropy_sum=rows[ENTROPY_SUM] if self.need_entropy else None,
            ref_logps=rows[REF_LOGPS] if self.has_ref else None, batch_num_tokens=self.batch_num_tokens,
            index=index, aligned_logps=rows[ALIGNED_LOGPS] if self.need_aligned else None,
        )

    # ------------------------------------------------------------------ outputs

    def batch_stats(self) -> SequenceStats:
        """The detached statistics of the whole batch in batch order (``index = arange(B)``)."""
        acc, order = self.acc, self.order
        full = acc if order is None else torch.empty_like(acc).index_copy_(1, order, acc)  # batch order
        return self._stats(full[LOGPS], full, torch.arange(self.batch, device=self.device),
                           num_tokens=self.batch_num_tokens)

    def unit_metrics(self) -> dict:
        """``{name: [U]}`` of the objective's metrics, in unit order."""
        return {k: torch.cat(v) for k, v in self.metric_parts.items()}
