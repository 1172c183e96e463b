"""The GEMMs of a chunk: the logits tile and the two gradient GEMMs, and the buffers they fill.

* :func:`project` -- ``logits [n, V] = hidden [n, H] @ weight[V, H].T (+ bias)`` in the compute
  dtype (:func:`compute_dtype`: the autocast dtype when autocast is on, else the weight's);
  :func:`project_fp32` the same GEMM writing float32 logits (distillation's tiles);
* :func:`backprop_tile` -- a gradient tile ``G = d loss / d logits [n, V]`` (written in place by
  a logits-tile kernel) into ``grad_hidden = G @ W``, ``grad_weight (+)= G^T @ hidden`` and
  ``grad_bias (+)= colsum(G)``, with an optional per-row upstream factor;
* :class:`HeadGrads` -- those three gradients of one head, filled chunk by chunk (the hidden
  gradient at the compacted tokens' positions, :class:`~liger_losses.chunked.tokens.RowScatter`).

The weight gradient is accumulated in the dtype :func:`weight_accum` gives: a loss's explicit
``accum_dtype``, else the weight's dtype when one chunk writes it and, for a bf16 / fp16 weight that
more than one chunk adds to, ``EngineConfig.half_weight_accum_dtype`` (fp32: no rounding of the running
sum to bf16 per chunk; the accumulator is written by the GEMM itself through ``out_dtype`` where torch
has it). The bias gradient is accumulated in fp32 (fp64 for fp64 tiles: a float64 run has no float32
step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.config import get_engine_config
from liger_losses.chunked.tokens import RowGather, RowScatter
from liger_losses.kernels.logits_tile import torch_stats_dtype
from liger_losses.kernels.scale import scale_unless_one_
from liger_losses.kernels.utils import autocast_dtype


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype of tiles and GEMMs: the autocast dtype when autocast is on for the weight's
    device type, else the weight's dtype."""
    return autocast_dtype(weight, weight.dtype)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of the floating ``dtype``."""
    return torch.finfo(dtype).bits // 8


def project(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Logits tile ``[n, V] = hidden [n, H] @ weight[V, H].T (+ bias)`` in the compute dtype
    (autocast dtype if autocast is on, else the weight dtype), contiguous, no autograd."""
    dtype = compute_dtype(weight)
    with torch.autocast(device_type=weight.device.type, enabled=False):
        h, w = _operands(hidden, weight, dtype)
        if bias is not None:
            b = bias if bias.dtype == dtype else bias.to(dtype)
            return torch.addmm(b, h, w.t())
        return torch.mm(h, w.t())


def _operands(hidden: Tensor, weight: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``hidden`` and ``weight`` in ``dtype`` (no copy when they are already)."""
    return (hidden if hidden.dtype == dtype else hidden.to(dtype),
            weight if weight.dtype == dtype else weight.to(dtype))


def project_fp32(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """:func:`project` with float32 logits from bf16 / fp16 operands: the GEMM accumulates in fp32 and
    writes fp32 (``out_dtype``), so the logits are not rounded to the compute dtype. A divergence between
    two close distributions (distillation) is a small difference of softmaxes, which that rounding
    swamps; a cross-entropy is not (its gradient is ``softmax - onehot``). fp32 / fp64 compute dtypes:
    :func:`project` itself. Without ``out_dtype`` (CPU, torch < 2.8): on the CPU the operands are
    widened (exact; the CPU runs tests); on a GPU the product is rounded to the compute dtype and
    widened (an fp32 GEMM would be ~10x slower)."""
    dtype = compute_dtype(weight)
    if itemsize(dtype) >= 4:
        return project(hidden, weight, bias)
    dev = weight.device.type
    with torch.autocast(device_type=dev, enabled=False):
        h, w = _operands(hidden, weight, dtype)
        out = torch.empty(h.shape[0], w.shape[0], dtype=torch.float32, device=weight.device)
        if not _mm_out_dtype(out, h, w.t(), accumulate=False):
            if dev == "cpu":
                torch.mm(h.float(), w.float().t(), out=out)
            else:
                out.copy_(torch.mm(h, w.t()))
        if bias is not None:
            out.add_(bias.float())
    return out


_OUT_DTYPE_MM: dict = {}  # (device type, operand dtype, out dtype) -> whether out_dtype= works
_FALLBACK_BLOCKS = 8


def mm_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b``; ``out`` may have a wider dtype (fp32 accumulator for bf16 operands)."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    if _mm_out_dtype(out, a, b, accumulate):
        return
    # no out_dtype (torch < 2.8): the product in a's dtype, in row blocks of at most an eighth of
    # ``out`` so that its temporary adds 1/8 of a's bytes a weight, not all of them, to the peak
    step = max(1, -(-out.shape[0] // _FALLBACK_BLOCKS))
    for r0 in range(0, out.shape[0], step):
        prod = torch.mm(a[r0:r0 + step], b)
        if accumulate:
            out[r0:r0 + step].add_(prod)
        else:
            out[r0:r0 + step].copy_(prod)


def _mm_out_dtype(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> bool:
    """``out (+)= a @ b`` through torch's ``out_dtype`` GEMM (a wider ``out`` than the operands);
    False, remembered per (device type, dtypes), where torch has none."""
    key = (out.device.type, a.dtype, out.dtype)
    if not _OUT_DTYPE_MM.get(key, True):
        return False
    try:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    except torch.OutOfMemoryError:
        raise  # a RuntimeError, but says nothing about out_dtype: not remembered as unsupported
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        if "ALLOC_FAILED" in str(exc):  # cuBLAS out of workspace memory: the same
            raise
        _OUT_DTYPE_MM[key] = False
        return False
    _OUT_DTYPE_MM[key] = True
    return True


def backprop_tile(
    grad_logits: Tensor,
    hidden: Tensor,
    weight: Tensor,
    *,
    grad_hidden: Optional[Tensor],
    grad_weight: Optional[Tensor],
    grad_bias: Optional[Tensor],
    accumulate: bool,
    row_scale: Optional[Tensor] = None,
) -> None:
    """Back-propagate a gradient tile ``G = d loss / d logits [n, V]`` through the projection.

    * ``grad_hidden [n, H]`` (buffer, overwritten) ``= row_scale * (G @ W)``
    * ``grad_weight [V, H]`` ``(+)= G^T @ (row_scale * hidden)`` (``accumulate=False`` overwrites)
    * ``grad_bias [V]`` (fp32; fp64 for fp64 tiles) ``(+)= G^T @ row_scale`` (column sums of the scaled ``G``)

    ``row_scale [n]`` (float32; float64 for fp64 tiles) is the per-row upstream factor, applied to the small ``[n, H]``
    matrices, never to the tile. ``None`` buffers are skipped (frozen weight: no ``G^T`` GEMM).
    """
    dtype = grad_logits.dtype
    acc = torch_stats_dtype(dtype)
    dev = grad_logits.device.type
    with torch.autocast(device_type=dev, enabled=False):
        w = weight if weight.dtype == dtype else weight.to(dtype)
        if grad_hidden is not None:
            if grad_hidden.dtype == dtype and grad_hidden.is_contiguous():
                torch.mm(grad_logits, w, out=grad_hidden)
            else:
                grad_hidden.copy_(torch.mm(grad_logits, w))
            if row_scale is not None:
                grad_hidden.mul_(row_scale.unsqueeze(1))
        if grad_weight is not None:
            if row_scale is not None:
                h = (hidden.to(acc) * row_scale.to(acc).unsqueeze(1)).to(dtype)
            else:
                h = hidden if hidden.dtype == dtype else hidden.to(dtype)
            mm_into(grad_weight, grad_logits.t(), h, accumulate)
        if grad_bias is not None:
            if row_scale is not None:
                colsum = torch.mv(grad_logits.t(), row_scale.to(dtype)).to(grad_bias.dtype)
            else:
                colsum = grad_logits.sum(0, dtype=grad_bias.dtype)
            if accumulate:
                grad_bias.add_(colsum)
            else:
                grad_bias.copy_(colsum)


@dataclass(frozen=True)
class WeightAccum:
    """The dtype of a head's weight-gradient buffer: ``single`` when one chunk writes the whole
    gradient, ``multi`` when more than one chunk adds to it (:func:`weight_accum`); ``weight`` is
    the head weight's dtype, the gradient's dtype in the end."""

    single: torch.dtype
    multi: torch.dtype
    weight: torch.dtype

    def dtype(self, more_chunks: bool) -> torch.dtype:
        return self.multi if more_chunks else self.single

    @property
    def widens(self) -> bool:
        """Whether several chunks accumulate in a wider dtype than the weight's, so that the buffer
        and its cast to the weight's dtype hold more bytes a weight than a tile of the head's size
        adds (the tile budget then grows: :func:`~.planning.tile_budget`)."""
        return torch.finfo(self.multi).bits > torch.finfo(self.weight).bits


def weight_accum(accum_dtype: Optional[torch.dtype], weight_dtype: torch.dtype) -> WeightAccum:
    """A loss's ``accum_dtype`` option for a head weight of ``weight_dtype``: an explicit dtype is
    used as given; None is the weight's dtype, widened to ``EngineConfig.half_weight_accum_dtype``
    for a bf16 / fp16 weight whose gradient more than one chunk adds to (one chunk rounds its
    product once either way)."""
    if accum_dtype is not None:
        return WeightAccum(accum_dtype, accum_dtype, weight_dtype)
    wide = get_engine_config().half_weight_accum_dtype
    if wide is not None and weight_dtype in (torch.bfloat16, torch.float16):
        return WeightAccum(weight_dtype, wide, weight_dtype)
    return WeightAccum(weight_dtype, weight_dtype, weight_dtype)


class HeadGrads:
    """The gradients of a head's inputs, filled chunk by chunk by :meth:`add`: ``hidden`` (a
    :class:`RowScatter` over ``rows``' tokens), ``weight`` ``[V, H]`` (allocated by the first add, in
    ``accum.dtype(more_chunks)``: whether that add leaves tokens of ``rows`` for later ones) and
    ``bias`` ``[V]`` fp32 (fp64 when ``dtype`` is), each None when not wanted. The first :meth:`add`
    overwrites the weight and bias gradients, later ones accumulate (``started``); :meth:`finish`
    returns ``(grad_hidden [M, H], grad_weight, grad_bias)`` (Nones kept), the weight gradient
    zeroed (``accum.single``) when no chunk was added."""

    def __init__(self, rows: Optional[RowGather], V: int, H: int, *, dtype, accum: WeightAccum, device,
                 hidden: bool, weight: bool, bias: bool):
        self.dtype, self.device, self.V, self.H = dtype, device, V, H
        self.wants_hidden, self.wants_weight, self.accum = hidden, weight, accum
        self.hidden = None
        self.num_tokens: Optional[int] = None
        if rows is not None:
            self.attach(rows)
        self.weight: Optional[Tensor] = None
        self.bias = torch.zeros(V, dtype=torch_stats_dtype(dtype), device=device) if bias else None
        self.started = False

    @property
    def any(self) -> bool:
        """Whether any gradient is wanted."""
        return self.wants_hidden or self.wants_weight or self.bias is not None

    @property
    def wide_accum(self) -> bool:
        """Whether a weight gradient is wanted and several chunks would accumulate it wider than
        the weight (the planners then take :func:`~.planning.tile_budget`'s wide budget)."""
        return self.wants_weight and self.accum.widens

    def _weight_buffer(self, more_chunks: bool) -> Optional[Tensor]:
        if self.wants_weight and self.weight is None:
            self.weight = torch.empty(self.V, self.H, dtype=self.accum.dtype(more_chunks), device=self.device)
        return self.weight

    def attach(self, rows: RowGather) -> None:
        """The tokens whose gradients are wanted (given late when they are known only after
        :meth:`add_detached`)."""
        self.num_tokens = rows.index.numel()
        if self.wants_hidden:
            self.hidden = RowScatter(rows.flat.shape[0], self.H, self.dtype, self.device, rows.index,
                                     rows.identity)

    def detached_rows(self, n: int) -> Optional[Tensor]:
        """A buffer for the hidden gradient rows of ``n`` tokens whose positions are not known yet
        (``[n, H]``, or None when not wanted), for :meth:`commit_detached`."""
        if not self.wants_hidden:
            return None
        return torch.empty(n, self.H, dtype=self.dtype, device=self.device)

    def add_detached(self, grad_logits: Tensor, hidden: Tensor, weight: Tensor) -> Optional[Tensor]:
        """As :meth:`add` for tokens whose positions are not known yet: the weight and bias
        gradients are accumulated, the hidden gradient rows are returned (:meth:`detached_rows`)
        for :meth:`commit_detached` once :meth:`attach` has been called."""
        buf = self.detached_rows(grad_logits.shape[0])
        # a detached chunk runs ahead of the label scan only when the rows fill two chunks or more
        backprop_tile(grad_logits, hidden, weight, grad_hidden=buf, grad_weight=self._weight_buffer(True),
                      grad_bias=self.bias, accumulate=self.started)
        self.started = True
        return buf

    def commit_detached(self, buf: Optional[Tensor], ts: int, te: int) -> None:
        """Rows ``[0, te - ts)`` of ``buf`` (from :meth:`add_detached`) as tokens ``[ts, te)``."""
        if buf is not None and self.hidden is not None and te > ts:
            self.hidden.write(ts, te, buf[: te - ts])

    def add(self, grad_logits: Tensor, hidden: Tensor, weight: Tensor, ts: int, te: int,
            row_scale: Optional[Tensor] = None) -> None:
        """:func:`backprop_tile` of the chunk of tokens ``[ts, te)`` into these gradients."""
        buf = self.hidden.target(ts, te) if self.hidden is not None else None
        more = self.num_tokens is None or te - ts < self.num_tokens
        backprop_tile(grad_logits, hidden, weight, grad_hidden=buf, grad_weight=self._weight_buffer(more),
                      grad_bias=self.bias, accumulate=self.started, row_scale=row_scale)
        if self.hidden is not None:
            self.hidden.commit(ts, te, buf)
        self.started = True

    def scale(self, ts: int, te: int, factor: Tensor) -> None:
        """Multiply what has been added so far by the 0-d ``factor`` (in fp32 -- fp64 for fp64 buffers --
        rounded once: ``mul_`` would round the factor to a bf16 buffer's dtype first): the hidden
        gradient of tokens ``[ts, te)`` and, once a chunk was added, the weight and bias gradients."""
        factor = factor.to(torch_stats_dtype(self.dtype))
        if self.hidden is not None:
            self.hidden.scale(ts, te, factor)
        if self.started:
            if self.weight is not None:
                scale_unless_one_(self.weight, factor.reshape(1))
            if self.bias is not None:
                self.bias.mul_(factor)

    def finish(self):
        if self.wants_weight and self.weight is None:
            self.weight = torch.zeros(self.V, self.H, dtype=self.accum.single, device=self.device)
        return (self.hidden.full if self.hidden is not None else None), self.weight, self.bias
