"""The chunked fused-linear engine: the primitives every fused-linear loss runs on.

Computes losses of ``logits = hidden @ weight.T (+ bias)`` without ever holding the whole
``[tokens, vocab]`` logits: tokens whose label is ``ignore_index`` are dropped first
(:func:`token_rows`: their rows are gathered chunk by chunk, never copied whole, and
:class:`RowScatter` writes their gradient back in place), the remaining ``N`` tokens are cut
into chunks whose logits tile fits a
memory budget (:func:`chunk_bounds`, :func:`group_chunk_bounds`), each tile is formed by
:func:`project` (``[n, V]`` in the compute dtype), a logits-tile kernel
(``liger_losses.kernels.logits_tile``) writes row statistics and the gradient
``d loss / d logits`` into the tile in place, and :func:`backprop_tile` turns that gradient into
``grad_hidden`` (``G @ W``, written into the caller's buffer) and ``grad_weight`` (``G^T @ hidden``,
accumulated across chunks in the weight dtype or ``accum_dtype``).

Host syncs: one per loss, reading back the valid-token count (and per-sequence counts) with the
labels' range check (:func:`_scan_labels`). Per-token losses (:func:`run_token_tiles`, used by
cross-entropy) issue their first chunk before that wait (:class:`PendingScan`,
:data:`SPECULATIVE_FIRST_CHUNK`), so the GPU is not idle while the host plans the chunks.

Shapes and dtypes: ``weight [V, H]``, ``hidden [..., H]``, ``labels [...]`` integer, ``bias [V]``.
The compute dtype of the tiles and GEMMs is the autocast dtype when autocast is on for the
device, else the weight's dtype. Row statistics are float32.

Per-token losses (cross-entropy, token log-probs, distillation) run their chunks through
:func:`run_tiles` / :func:`run_token_tiles` here; the preference losses through the
sequence-objective driver built on these primitives (:mod:`liger_losses.chunked.sequence`).
Both compute the gradients inside the forward and scale them by ``grad_output`` in backward
(:func:`_scaled_grads`).

Sharded weights: :func:`gather_weight` is the one place a sharded LM head becomes full, and
:func:`weight_grad_like` maps the full gradient back to the weight's layout.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from liger_losses.kernels.logits_tile import logits_tile
from liger_losses.kernels.scale import scale_unless_one_
from liger_losses.kernels.utils import (
    autocast_dtype,
    check_no_double_backward,
    check_range,
    check_same_device,
    check_tensor,
    needs_input_grads,
    resolve_impl,
    triton_runs_on,
)

# Default memory budget of one logits tile (bytes): the larger of DEFAULT_BUDGET_BYTES and
# WEIGHT_BUDGET_FRACTION of the head's [V, H] weight (tile_budget). The weight-gradient GEMM's
# inner dimension is the chunk's token count: at 1024 tokens it ran at 1.18x its FLOP floor on the
# H200 (logits GEMM 1.03x). Half the weight -> H/2 tokens per chunk (2048 at H=4096): cross-entropy
# 8192 x 4096 x 128256 41.8 -> 40.3 ms, DPO 1 pair x 16384 172.3 -> 163.5 ms (session 5), while the
# peak above the inputs stays below 1.5x the gradients (weight + half of it + hidden).
DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024
WEIGHT_BUDGET_FRACTION = 0.5
# Chunk sizes found from the budget are rounded to a multiple of this (GEMM efficiency).
CHUNK_ALIGN = 128
# Backward of the one-pass losses: scale the forward's gradients by the upstream scalar on the
# device (kernels.scale: no host sync, no memory pass when it is 1) instead of reading it on the
# host (one sync per backward; False restores that). H200 (session 5 profile, CE 8192 tokens):
# GPU idle per step 1.74 -> 1.42 ms. The scale is applied in fp32 (``x.mul_(s)`` rounds ``s`` to
# a bf16 gradient's dtype first), so a non-unit upstream gradient can differ by one bf16 ulp.
DEVICE_SCALE = True
# What the double-backward error of the chunked losses suggests instead (their gradients are
# computed in the forward or by recomputed tiles: no graph for create_graph=True).
NO_DOUBLE_BACKWARD_INSTEAD = (
    "compute the logits (hidden @ weight.T) and use a plain PyTorch loss for second-order terms "
    "(apply_liger_kernels(..., cross_entropy=False) for patched models)"
)
# Per-token losses (cross-entropy): issue the first chunk before the one host sync. The label scan's
# counts go to pinned host memory through a non-blocking copy; the first chunk's rows are taken from
# ``nonzero_static`` of a known size (ignored rows padded out: label ignore_index, zero loss and
# gradient), its GEMMs and tile are enqueued, and only then does the host wait -- for the copy, not
# for the chunk. The GPU runs the chunk while the host plans the rest, instead of idling from the
# sync until the host has issued the first GEMM. Only when the rows fill at least two chunks; the
# cost is the ignored rows among the first chunk's (all of them valid unless more than half the
# rows are ignored).
SPECULATIVE_FIRST_CHUNK = True


# --------------------------------------------------------------------------- sharded weights


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor

        return DTensor
    except Exception:  # pragma: no cover - depends on the torch build
        return None


def _is_dtensor(t) -> bool:
    dt = _dtensor_type()
    return dt is not None and isinstance(t, dt)


def gather_weight(weight: Tensor) -> Tensor:
    """The full ``[V, H]`` weight: a ``DTensor`` is gathered (``full_tensor()``), a plain tensor
    is returned as is, and a DeepSpeed ZeRO-3 partitioned parameter raises ``ValueError`` (gather
    it first with ``deepspeed.zero.GatheredParameters``, as the TRL adapter does)."""
    if _is_dtensor(weight):
        return weight.full_tensor()
    if hasattr(weight, "ds_id") or hasattr(weight, "ds_status"):
        status = getattr(weight, "ds_status", None)
        name = getattr(status, "name", str(status))
        if name != "AVAILABLE" or weight.numel() == 0:
            raise ValueError(
                "weight is a DeepSpeed ZeRO-3 partitioned parameter (ds_status="
                f"{name}); gather it before calling the loss, e.g. "
                "`with deepspeed.zero.GatheredParameters([lm_head.weight]): loss = ...`"
            )
    return weight


def weight_grad_like(weight: Tensor, full_grad: Tensor) -> Tensor:
    """The gradient autograd must return for ``weight`` given the full ``[V, H]`` gradient:
    for a ``DTensor`` the gradient is laid out with the weight's mesh and placements (every rank
    holds the same full gradient, so each keeps its own shard; no communication); else as is."""
    if not _is_dtensor(weight):
        return full_grad
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for p in weight.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(
                f"weight has placement {p}; only Shard and Replicate weights are supported"
            )
    try:
        return distribute_tensor(
            full_grad, weight.device_mesh, weight.placements, src_data_rank=None
        )
    except TypeError:  # older torch without src_data_rank
        return distribute_tensor(full_grad, weight.device_mesh, weight.placements)


# --------------------------------------------------------------------------- token compaction


class LabelScan(NamedTuple):
    """What :func:`_scan_labels` reads with its one host sync."""

    valid: Tensor  # [*labels.shape] bool: label != ignore_index
    num_valid: int
    row_counts: Optional[Tensor]  # [B] long on the device (labels [B, T]), when asked for
    row_counts_host: Optional[list]  # the same as Python ints


def _label_counts(labels: Tensor, ignore_index: int, num_classes: Optional[int], row_counts: bool):
    """Device side of a label scan: ``(valid, in_range, counts, parts)`` with ``valid`` = label !=
    ignore_index, ``in_range`` = valid and within ``[0, num_classes)`` (``valid`` when no
    ``num_classes``), ``counts`` the per-row counts ``[B]`` (``labels [B, T]``, when asked) and
    ``parts`` the long vector to read back: ``[valid tokens, (in-range tokens,) (counts...)]``."""
    valid = labels != ignore_index
    counts = valid.sum(1) if row_counts else None
    parts = [valid.sum().reshape(1) if counts is None else counts.sum().reshape(1)]
    in_range = valid
    if num_classes is not None:
        in_range = valid & (labels >= 0) & (labels < num_classes)
        parts.append(in_range.sum().reshape(1))
    if counts is not None:
        parts.append(counts)
    return valid, in_range, counts, torch.cat(parts)


def _label_scan(labels: Tensor, ignore_index: int, num_classes: Optional[int], valid: Tensor,
                in_range: Tensor, counts: Optional[Tensor], host: list) -> LabelScan:
    """The :class:`LabelScan` of :func:`_label_counts`' results, ``host`` being its ``parts`` read
    back; ``ValueError`` when a valid label is outside ``[0, num_classes)``."""
    if num_classes is not None:
        if host[1] != host[0]:
            example = int(labels[valid & ~in_range][0])
            raise ValueError(
                f"labels must be in [0, {num_classes}) or equal ignore_index={ignore_index}, "
                f"found {example}"
            )
        host = host[:1] + host[2:]
    return LabelScan(valid, int(host[0]), counts, host[1:] if counts is not None else None)


def _scan_labels(labels: Tensor, ignore_index: int, num_classes: Optional[int],
                 row_counts: bool = False) -> LabelScan:
    """The valid-token mask and counts of ``labels`` with ONE host sync: the range check of the
    labels (when ``num_classes`` is given: every label in ``[0, num_classes)`` or ``ignore_index``,
    else ``ValueError``), the number of valid tokens and, with ``row_counts``, each row's count
    (``labels [B, T]``) are read back together."""
    valid, in_range, counts, parts = _label_counts(labels, ignore_index, num_classes, row_counts)
    host = parts.tolist()  # the one host sync
    return _label_scan(labels, ignore_index, num_classes, valid, in_range, counts, host)


class PendingScan:
    """:func:`_scan_labels` in two halves: the constructor enqueues the scan and a non-blocking copy
    of its counts to pinned host memory; :meth:`result` waits for that copy alone (CUDA event), not
    for the work enqueued after it, and returns the :class:`LabelScan` (raising on labels out of
    ``[0, num_classes)``, like :func:`_scan_labels`). ``valid`` and ``in_range`` (valid and within
    the classes: what may be fed to a kernel before the check) are available at once."""

    def __init__(self, labels: Tensor, ignore_index: int, num_classes: Optional[int]):
        self.labels, self.ignore_index, self.num_classes = labels, ignore_index, num_classes
        self.valid, self.in_range, _, counts = _label_counts(labels, ignore_index, num_classes, False)
        self.event = None
        if counts.is_cuda:
            self.host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self.host.copy_(counts, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(counts.device))  # the copy's stream
        else:
            self.host = counts

    def result(self) -> LabelScan:
        if self.event is not None:
            self.event.synchronize()  # the one host sync: waits for the counts' copy only
        return _label_scan(self.labels, self.ignore_index, self.num_classes, self.valid, self.in_range,
                           None, self.host.tolist())


def _nonzero(mask: Tensor, count: int) -> Tensor:
    """Indices ``[count]`` of the True entries of the flat ``mask`` whose number is known
    (``nonzero_static``: no second host sync)."""
    try:
        return torch.nonzero_static(mask, size=count).squeeze(1)
    except (AttributeError, NotImplementedError, RuntimeError):  # older torch / backend
        return mask.nonzero().squeeze(1)


def _valid_index(labels: Tensor, ignore_index: int, order: Optional[Tensor] = None, *,
                 num_classes: Optional[int] = None, scan=None):
    """``(labels_valid [N] long, index [N] long)``: the non-ignored positions of the flattened
    ``labels``, sequences taken in ``order`` (a permutation of dim 0 of ``labels [B, T]``) when
    given. With ``num_classes`` the labels' range is checked too. One host sync in all (none
    when ``scan``, a result of :func:`_scan_labels`, is passed in)."""
    flat = labels.reshape(-1)
    valid, n, _, _ = scan if scan is not None else _scan_labels(labels, ignore_index, num_classes)
    if order is None:
        if n == flat.numel():
            return flat.long(), torch.arange(n, device=flat.device)
        index = _nonzero(valid.reshape(-1), n)
    else:
        T = labels.shape[1]
        pos = _nonzero(valid.index_select(0, order).reshape(-1), n)
        index = order[pos // T] * T + pos % T
    return flat.index_select(0, index).long(), index


def compact_tokens(hidden: Tensor, labels: Tensor, ignore_index: int, *,
                   num_classes: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Drop ignored tokens: ``hidden [..., H]``, ``labels [...]`` ->
    ``(hidden_valid [N, H], labels_valid [N] long, index [N] long)`` where ``index`` holds the
    positions in the flattened ``[...]`` layout. One host sync. When no token is ignored the
    returned hidden is a view (no copy); the engine's own passes use :func:`token_rows` instead,
    which never copies."""
    rows, labels_valid, index = token_rows(hidden, labels, ignore_index, num_classes=num_classes)
    return rows(0, index.numel()), labels_valid, index


def token_rows(hidden: Tensor, labels: Tensor, ignore_index: int, *, num_classes: Optional[int] = None):
    """The non-ignored tokens without copying them: ``(rows, labels_valid [N] long, index [N])``
    where ``rows`` (:class:`RowGather`) gathers chunks of ``hidden [..., H]`` on demand. One host
    sync, which also checks the labels' range when ``num_classes`` is given. The engine's passes
    take these, so no ``[N, H]`` copy of the hidden states is held."""
    labels_valid, index = _valid_index(labels, ignore_index, num_classes=num_classes)
    return hidden_rows_at(hidden, index), labels_valid, index


def hidden_rows_at(hidden: Tensor, index: Tensor) -> "RowGather":
    """:class:`RowGather` of the rows ``index`` (flat positions) of ``hidden [..., H]``; the identity
    when ``index`` covers every row in order (what :func:`_valid_index` returns then)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return RowGather(flat, index, index.numel() == flat.shape[0])


def grad_like(full: Tensor, like: Tensor) -> Tensor:
    """A ``[M, H]`` gradient buffer (:class:`RowScatter`'s ``full``) in ``like``'s shape and dtype."""
    out = full.view(like.shape)
    return out if out.dtype == like.dtype else out.to(like.dtype)


class RowGather:
    """Rows ``[ts, te)`` of the compacted tokens of ``flat [M, H]``, gathered chunk by chunk, so no
    ``[N, H]`` copy of the hidden states is ever held (a plain slice when nothing was dropped)."""

    def __init__(self, flat: Tensor, index: Tensor, identity: bool):
        self.flat, self.index, self.identity = flat, index, identity

    def like(self, flat: Tensor) -> "RowGather":
        """The same tokens of another ``[M, H']`` tensor (a reference's or teacher's hidden states)."""
        return RowGather(flat, self.index, self.identity)

    def __call__(self, ts: int, te: int) -> Tensor:
        if self.identity:
            return self.flat[ts:te]
        return self.flat.index_select(0, self.index[ts:te])


class RowScatter:
    """The ``[M, H]`` gradient of the hidden states, written chunk by chunk at the compacted
    tokens' positions (zeros elsewhere) without an intermediate ``[N, H]`` buffer."""

    def __init__(self, total: int, H: int, dtype, device, index: Tensor, identity: bool):
        self.index, self.identity, self.H = index, identity, H
        alloc = torch.empty if identity else torch.zeros
        self.full = alloc(total, H, dtype=dtype, device=device)

    def target(self, ts: int, te: int) -> Tensor:
        if self.identity:
            return self.full[ts:te]
        return torch.empty(te - ts, self.H, dtype=self.full.dtype, device=self.full.device)

    def commit(self, ts: int, te: int, buf: Tensor) -> None:
        """Rows ``[ts, te)`` from ``buf``, the :meth:`target` of those rows."""
        if not self.identity:
            self.full.index_copy_(0, self.index[ts:te], buf)

    def write(self, ts: int, te: int, rows: Tensor) -> None:
        """Rows ``[ts, te)`` from ``rows`` computed elsewhere (not in their :meth:`target`)."""
        if self.identity:
            self.full[ts:te].copy_(rows)
        else:
            self.full.index_copy_(0, self.index[ts:te], rows)

    def scale(self, ts: int, te: int, factor: Tensor) -> None:
        """Rows ``[ts, te)`` times the 0-d fp32 ``factor``, computed in fp32 and rounded once."""
        scale = factor.reshape(1)
        if self.identity:
            scale_unless_one_(self.full[ts:te], scale)  # a contiguous row range: in place
        else:
            idx = self.index[ts:te]
            self.full.index_copy_(0, idx, scale_unless_one_(self.full.index_select(0, idx), scale))


class HeadGrads:
    """The gradients of a head's inputs, filled chunk by chunk by :meth:`add`: ``hidden`` (a
    :class:`RowScatter` over ``rows``' tokens), ``weight`` ``[V, H]`` (``weight_dtype``) and ``bias``
    ``[V]`` fp32, each None when not wanted. The first :meth:`add` overwrites the weight and bias
    gradients, later ones accumulate (``started``); :meth:`finish` returns ``(grad_hidden [M, H],
    grad_weight, grad_bias)`` (Nones kept), the weight gradient zeroed when no chunk was added."""

    def __init__(self, rows: Optional[RowGather], V: int, H: int, *, dtype, weight_dtype, device,
                 hidden: bool, weight: bool, bias: bool):
        self.dtype, self.device, self.H, self.wants_hidden = dtype, device, H, hidden
        self.hidden = None
        if rows is not None:
            self.attach(rows)
        self.weight = torch.empty(V, H, dtype=weight_dtype, device=device) if weight else None
        self.bias = torch.zeros(V, dtype=torch.float32, device=device) if bias else None
        self.started = False

    def attach(self, rows: RowGather) -> None:
        """The tokens whose hidden gradient is wanted (given late when they are known only after
        :meth:`add_detached`)."""
        if self.wants_hidden:
            self.hidden = RowScatter(rows.flat.shape[0], self.H, self.dtype, self.device, rows.index,
                                     rows.identity)

    def add_detached(self, grad_logits: Tensor, hidden: Tensor, weight: Tensor) -> Optional[Tensor]:
        """As :meth:`add` for tokens whose positions are not known yet: the weight and bias
        gradients are accumulated, the hidden gradient rows are returned (``[n, H]``, or None when
        not wanted) for :meth:`commit_detached` once :meth:`attach` has been called."""
        buf = None
        if self.wants_hidden:
            buf = torch.empty(grad_logits.shape[0], self.H, dtype=self.dtype, device=self.device)
        backprop_tile(grad_logits, hidden, weight, grad_hidden=buf, grad_weight=self.weight,
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
        backprop_tile(grad_logits, hidden, weight, grad_hidden=buf, grad_weight=self.weight,
                      grad_bias=self.bias, accumulate=self.started, row_scale=row_scale)
        if self.hidden is not None:
            self.hidden.commit(ts, te, buf)
        self.started = True

    def scale(self, ts: int, te: int, factor: Tensor) -> None:
        """Multiply what has been added so far by the 0-d fp32 ``factor`` (in fp32, rounded once:
        ``mul_`` would round the factor to a bf16 buffer's dtype first): the hidden gradient of
        tokens ``[ts, te)`` and, once a chunk was added, the weight and bias gradients."""
        factor = factor.float()
        if self.hidden is not None:
            self.hidden.scale(ts, te, factor)
        if self.started:
            if self.weight is not None:
                scale_unless_one_(self.weight, factor.reshape(1))
            if self.bias is not None:
                self.bias.mul_(factor)

    def finish(self):
        if self.weight is not None and not self.started:
            self.weight.zero_()
        return (self.hidden.full if self.hidden is not None else None), self.weight, self.bias


# --------------------------------------------------------------------------- chunk sizing


def tile_budget(vocab: int, hidden_size: int, itemsize: int) -> int:
    """The default tile budget in bytes for a ``[vocab, hidden_size]`` head of ``itemsize``-byte
    elements (see :data:`WEIGHT_BUDGET_FRACTION`)."""
    return max(DEFAULT_BUDGET_BYTES, int(WEIGHT_BUDGET_FRACTION * vocab * hidden_size * itemsize))


def _max_chunk(vocab: int, chunk_tokens, budget_bytes, itemsize) -> tuple[int, bool]:
    if chunk_tokens is not None:
        if int(chunk_tokens) < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
        return int(chunk_tokens), True
    budget = DEFAULT_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    if budget <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
    return max(1, budget // max(1, vocab * itemsize)), False


def chunk_bounds(
    num_tokens: int,
    vocab: int,
    *,
    chunk_tokens: Optional[int] = None,
    budget_bytes: Optional[int] = None,
    itemsize: int = 2,
) -> list[tuple[int, int]]:
    """Split ``[0, num_tokens)`` into ``(start, end)`` chunks whose ``[n, vocab]`` tile of
    ``itemsize`` bytes fits ``budget_bytes`` (default :data:`DEFAULT_BUDGET_BYTES`). From the
    budget, chunks are balanced (equal sizes, rounded up to a multiple of 128 when that still
    fits); ``chunk_tokens`` instead fixes the chunk size exactly (the last chunk may be short)."""
    if num_tokens <= 0:
        return []
    size, exact = _max_chunk(vocab, chunk_tokens, budget_bytes, itemsize)
    if not exact:
        k = math.ceil(num_tokens / size)
        bal = math.ceil(num_tokens / k)
        aligned = math.ceil(bal / CHUNK_ALIGN) * CHUNK_ALIGN
        size = aligned if aligned <= size else bal
    return [(s, min(s + size, num_tokens)) for s in range(0, num_tokens, size)]


def group_chunk_bounds(
    group_token_counts: list[int],
    vocab: int,
    *,
    chunk_tokens: Optional[int] = None,
    budget_bytes: Optional[int] = None,
    itemsize: int = 2,
) -> Optional[list[tuple[int, int, int, int]]]:
    """Chunks of whole groups (sequences or pairs), greedily filled up to the token limit:
    ``(group_start, group_end, token_start, token_end)``; groups are laid out contiguously in
    the given order. ``None`` when one group alone exceeds the limit."""
    limit, _ = _max_chunk(vocab, chunk_tokens, budget_bytes, itemsize)
    out: list[tuple[int, int, int, int]] = []
    g0, t0, t = 0, 0, 0
    for g, c in enumerate(group_token_counts):
        c = int(c)
        if c > limit:
            return None
        if t + c - t0 > limit and g > g0:
            out.append((g0, g, t0, t))
            g0, t0 = g, t
        t += c
    if len(group_token_counts) > g0:
        out.append((g0, len(group_token_counts), t0, t))
    return out


# --------------------------------------------------------------------------- GEMMs


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The dtype of tiles and GEMMs: the autocast dtype when autocast is on for the weight's
    device type, else the weight's dtype."""
    return autocast_dtype(weight, weight.dtype)


def project(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """Logits tile ``[n, V] = hidden [n, H] @ weight[V, H].T (+ bias)`` in the compute dtype
    (autocast dtype if autocast is on, else the weight dtype), contiguous, no autograd."""
    dtype = compute_dtype(weight)
    dev = weight.device.type
    with torch.autocast(device_type=dev, enabled=False):
        h = hidden if hidden.dtype == dtype else hidden.to(dtype)
        w = weight if weight.dtype == dtype else weight.to(dtype)
        if bias is not None:
            b = bias if bias.dtype == dtype else bias.to(dtype)
            return torch.addmm(b, h, w.t())
        return torch.mm(h, w.t())


_OUT_DTYPE_MM = {}


def _mm_into(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """``out (+)= a @ b``; ``out`` may have a wider dtype (fp32 accumulator for bf16 operands)."""
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    key = (out.device.type, a.dtype, out.dtype)
    if _OUT_DTYPE_MM.get(key, True):
        try:
            if accumulate:
                torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
            else:
                torch.mm(a, b, out_dtype=out.dtype, out=out)
            _OUT_DTYPE_MM[key] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_MM[key] = False
    prod = torch.mm(a, b)
    if accumulate:
        out.add_(prod)
    else:
        out.copy_(prod)


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
    * ``grad_bias [V]`` (fp32) ``(+)= G^T @ row_scale`` (column sums of the scaled ``G``)

    ``row_scale [n]`` (float32) is the per-row upstream factor, applied to the small ``[n, H]``
    matrices, never to the tile. ``None`` buffers are skipped (frozen weight: no ``G^T`` GEMM).
    """
    dtype = grad_logits.dtype
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
                h = (hidden.float() * row_scale.unsqueeze(1)).to(dtype)
            else:
                h = hidden if hidden.dtype == dtype else hidden.to(dtype)
            _mm_into(grad_weight, grad_logits.t(), h, accumulate)
        if grad_bias is not None:
            if row_scale is not None:
                colsum = torch.mv(grad_logits.t(), row_scale.to(dtype)).float()
            else:
                colsum = grad_logits.sum(0, dtype=torch.float32)
            if accumulate:
                grad_bias.add_(colsum)
            else:
                grad_bias.copy_(colsum)


# --------------------------------------------------------------------------- shared by the losses' autograd Functions


_ACCUM_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_common(weight, hidden, labels, bias, ignore_index, temperature, softcap, logit_scale,
                  chunk_tokens, accum_dtype, impl, *, hidden_ndim=None):
    """Checks shared by every fused-linear loss; returns V."""
    check_tensor("weight", weight, ndim=2, floating=True)
    if hidden_ndim is None:
        check_tensor("hidden", hidden, min_ndim=1, floating=True)
    else:
        check_tensor("hidden", hidden, ndim=hidden_ndim, floating=True)
    check_tensor("labels", labels, floating=False)
    V, H = weight.shape
    if hidden.shape[-1] != H:
        raise ValueError(
            f"hidden must have last dimension {H} (weight is [V={V}, H={H}]), "
            f"got shape {tuple(hidden.shape)}"
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), "
            f"got {tuple(labels.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, ndim=1, floating=True)
        if bias.shape[0] != V:
            raise ValueError(f"bias must have shape [{V}] (vocab of weight), got {tuple(bias.shape)}")
    check_same_device(weight=weight, hidden=hidden, labels=labels, bias=bias)
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_range("temperature", float(temperature), 0.0, None, low_inclusive=False)
    check_range("logit_scale", float(logit_scale), 0.0, None, low_inclusive=False)
    if softcap is not None:
        check_range("softcap", float(softcap), 0.0, None, low_inclusive=False)
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    if accum_dtype not in _ACCUM_DTYPES:
        raise ValueError(f"accum_dtype must be one of {_ACCUM_DTYPES}, got {accum_dtype!r}")
    resolve_impl(impl, hidden)
    # the labels' range is checked by the token compaction (token_rows / _valid_index with
    # num_classes), in the same host sync that counts them
    return V


def _needs_input_grads(ctx, grad_enabled: bool) -> tuple[bool, bool, bool]:
    """``(needs_weight, needs_hidden, needs_bias)`` of a fused-linear ``autograd.Function`` whose
    first inputs are ``(weight, hidden, bias)`` (:func:`~liger_losses.kernels.utils.needs_input_grads`:
    all False when grad mode was off at ``.apply``, so the one-pass losses run no gradient GEMM
    during evaluation)."""
    return needs_input_grads(ctx, grad_enabled, 3)


def _scaled_grads(ctx, grad_scale, saved=None):
    """Multiply the gradients computed in forward by the upstream scalar (in place, once);
    returns ``(grad_hidden, grad_weight, grad_bias)`` (None where not computed)."""
    check_no_double_backward("a fused-linear loss", NO_DOUBLE_BACKWARD_INSTEAD)
    if getattr(ctx, "consumed", False):
        raise RuntimeError(
            "backward through a fused-linear loss ran twice; its gradients are computed in the "
            "forward and released by the first backward (retain_graph is not supported)"
        )
    ctx.consumed = True
    gh, gw, gb = ctx.saved_tensors[:3] if saved is None else saved
    has_h, has_w, has_b = ctx.has
    # The usual upstream gradient of a loss is exactly 1: skip the in-place passes over the
    # [V, H] weight gradient. Default: one host sync here (outside any chunk loop) reads the value.
    # DEVICE_SCALE: no sync -- a kernel whose programs read the value and return when it is 1.
    if grad_scale.numel() == 1 and DEVICE_SCALE and grad_scale.is_floating_point() \
            and triton_runs_on(grad_scale.device):
        def scale(t):
            return scale_unless_one_(t, grad_scale)
    elif grad_scale.numel() == 1 and bool(grad_scale == 1):
        scale = None
    else:
        def scale(t):
            return t.mul_(grad_scale)
    out = []
    if has_h:
        out.append(gh if scale is None else scale(gh))
    else:
        out.append(None)
    if has_w:
        if scale is not None:
            scale(gw)
        w = ctx.weight_ref
        g = gw if gw.dtype == w.dtype else gw.to(w.dtype)
        out.append(weight_grad_like(w, g))
    else:
        out.append(None)
    if has_b:
        out.append(gb if scale is None else scale(gb))
    else:
        out.append(None)
    return tuple(out)


# --------------------------------------------------------------------------- per-token passes


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
    kernel_opts: Optional[dict] = None,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    needs_hidden: bool = True,
    needs_weight: bool = True,
    needs_bias: bool = False,
):
    """One chunked pass of a per-token loss over the non-ignored tokens.

    ``weight [V, H]`` (full, already in the compute dtype), ``hidden_rows`` (:func:`token_rows`:
    ``N`` tokens of an ``[M, H]`` tensor), ``labels_valid [N]``. Per chunk: :func:`project`, the
    logits-tile kernel in ``mode`` ("ce" | "logp") with ``grad_scale`` (float or ``[N]`` tensor,
    sliced per chunk), and when ``grad`` :func:`backprop_tile`. Returns ``(stats,
    grad_hidden [M, H] | None (zeros at ignored rows), grad_weight [V, H] (accum_dtype or weight
    dtype) | None, grad_bias [V] fp32 | None)`` where ``stats`` maps
    loss/lse/logp/correct(/entropy) to ``[N]`` tensors.
    """
    grads, tile_opts = _pass_setup(
        weight, hidden_rows, labels_valid.device, mode=mode, grad=grad, need_entropy=need_entropy,
        kernel_opts=kernel_opts, accum_dtype=accum_dtype, needs_hidden=needs_hidden,
        needs_weight=needs_weight, needs_bias=needs_bias,
    )
    parts: dict[str, list] = {}
    _run_chunks(weight, hidden_rows, labels_valid, bias, _token_chunks(weight, labels_valid.shape[0], chunk_tokens),
                grads, parts, grad_scale, tile_opts)
    return (_stats_of(parts, need_entropy, labels_valid.device), *grads.finish())


def _pass_setup(weight: Tensor, rows: Optional[RowGather], device, *, mode: str, grad: bool,
                need_entropy: bool = False, kernel_opts: Optional[dict] = None,
                accum_dtype: Optional[torch.dtype] = None, needs_hidden: bool = True,
                needs_weight: bool = True, needs_bias: bool = False, **_):
    """``(grads, tile_opts)`` of one :func:`run_tiles` pass (its keyword options; others ignored):
    the :class:`HeadGrads` to fill and the logits-tile keywords of every chunk."""
    V, H = weight.shape
    grads = HeadGrads(rows, V, H, dtype=weight.dtype, weight_dtype=accum_dtype or weight.dtype, device=device,
                      hidden=grad and needs_hidden, weight=grad and needs_weight, bias=grad and needs_bias)
    return grads, dict(mode=mode, grad=grad, need_entropy=need_entropy, **dict(kernel_opts or {}))


def _token_chunks(weight: Tensor, num_tokens: int, chunk_tokens: Optional[int]) -> list[tuple[int, int]]:
    """:func:`chunk_bounds` of ``num_tokens`` rows for ``weight``'s head (default tile budget)."""
    itemsize = torch.finfo(weight.dtype).bits // 8
    return chunk_bounds(num_tokens, weight.shape[0], chunk_tokens=chunk_tokens,
                        budget_bytes=tile_budget(weight.shape[0], weight.shape[1], itemsize), itemsize=itemsize)


def run_token_tiles(weight: Tensor, hidden: Tensor, labels: Tensor, bias: Optional[Tensor], *,
                    ignore_index: int, **run_opts):
    """:func:`token_rows` (labels range-checked against ``V``) then :func:`run_tiles` (whose keyword
    options ``run_opts`` are) over ``hidden [..., H]`` / ``labels [...]``, with the first chunk issued
    before the host sync (see :data:`SPECULATIVE_FIRST_CHUNK`). A tensor ``grad_scale`` needs at
    least one entry per token of ``labels`` (sliced in the valid tokens' order). Returns ``(stats,
    grad_hidden, grad_weight, grad_bias, labels_valid, index)``, the first four as :func:`run_tiles`'."""
    V, H = weight.shape
    flat_labels = labels.reshape(-1)
    total = flat_labels.shape[0]
    chunk_tokens = run_opts.get("chunk_tokens")
    bounds = _token_chunks(weight, total, chunk_tokens)
    first = bounds[0][1] if bounds else 0
    grad_scale = run_opts.get("grad_scale", 1.0)
    per_row = isinstance(grad_scale, Tensor)
    pending = pos = None
    if SPECULATIVE_FIRST_CHUNK and first > 0 and total >= 2 * first and not (per_row and grad_scale.shape[0] < first):
        pending = PendingScan(labels, ignore_index, V)
        try:  # the first `first` valid positions, padded with -1
            pos = torch.nonzero_static(pending.valid.reshape(-1), size=first, fill_value=-1).squeeze(1)
        except (AttributeError, NotImplementedError, RuntimeError):  # older torch / backend: plain path
            pos = None
    if pos is None:
        scan = pending.result() if pending is not None else None
        labels_valid, index = _valid_index(labels, ignore_index, num_classes=V, scan=scan)
        return (*run_tiles(weight, hidden_rows_at(hidden, index), labels_valid, bias, **run_opts),
                labels_valid, index)
    # the first chunk: padding and labels out of range count as ignored here (label ignore_index),
    # so the kernel never reads past the vocabulary; rows not known valid are zeroed, as the plain
    # path never reads ignored rows, whose hidden states may be non-finite (fully masked padding),
    # and 0 * NaN in the weight-gradient GEMM is NaN
    at = pos.clamp_min(0)
    keep = (pos >= 0) & pending.in_range.reshape(-1).index_select(0, at)
    first_labels = torch.where(keep, flat_labels.index_select(0, at).long(),
                               torch.full_like(at, ignore_index))
    first_rows = hidden.reshape(-1, H).index_select(0, at).masked_fill_(~keep.unsqueeze(1), 0)
    grads, tile_opts = _pass_setup(weight, None, labels.device, **run_opts)
    tile = project(first_rows, weight, bias)
    first_stats = logits_tile(tile, first_labels, grad_scale=grad_scale[:first] if per_row else grad_scale,
                              need_logits_sum=False, **tile_opts)
    first_grad = grads.add_detached(tile, first_rows, weight) if tile_opts["grad"] else None
    del tile, first_rows
    scan = pending.result()  # the one host sync (raises on labels out of range)
    labels_valid, index = _valid_index(labels, ignore_index, scan=scan)
    rows = hidden_rows_at(hidden, index)
    grads.attach(rows)
    done = min(first, scan.num_valid)
    grads.commit_detached(first_grad, 0, done)
    del first_grad  # not held through the later chunks (the peak is one tile above the gradients)
    parts: dict[str, list] = {k: [v[:done]] for k, v in first_stats._asdict().items() if v is not None}
    rest = [(done + a, done + b) for a, b in _token_chunks(weight, scan.num_valid - done, chunk_tokens)]
    _run_chunks(weight, rows, labels_valid, bias, rest, grads, parts, grad_scale, tile_opts)
    return (_stats_of(parts, tile_opts["need_entropy"], labels.device), *grads.finish(), labels_valid, index)


def _run_chunks(weight, rows, labels_valid, bias, bounds, grads, parts, grad_scale, tile_opts) -> None:
    """The chunk loop of :func:`run_tiles`: tokens ``[ts, te)`` of ``rows`` for each bound, their
    statistics appended to ``parts`` and their gradients added to ``grads``."""
    per_row = isinstance(grad_scale, Tensor)
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
    for k in ("loss", "lse", "logp", "correct", "entropy"):
        if k in parts:
            stats[k] = torch.cat(parts[k])
        elif k != "entropy" or need_entropy:
            stats[k] = torch.zeros(0, dtype=torch.bool if k == "correct" else torch.float32, device=device)
    return stats


def scatter_rows(rows: Tensor, index: Tensor, shape, *, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Rows ``[N, ...]`` of the compacted tokens put back at ``index`` of a zero tensor of
    ``shape`` (leading dims flattened); a plain view when ``index`` covers every position in order."""
    total = 1
    for s in shape[: len(shape) - (rows.dim() - 1)]:
        total *= int(s)
    dtype = dtype or rows.dtype
    if rows.shape[0] == total:  # compaction kept every row in order (see compact_tokens)
        out = rows
    else:
        out = torch.zeros((total,) + tuple(rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        out.index_copy_(0, index, rows)
    out = out.view(tuple(shape))
    return out if out.dtype == dtype else out.to(dtype)
