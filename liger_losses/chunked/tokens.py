"""Token compaction: the labels' one host sync, and the non-ignored rows gathered and scattered.

Tokens whose label is ``ignore_index`` never enter a GEMM. :func:`scan_labels` reads, in ONE host
sync, the number of valid tokens (and per-sequence counts) together with the labels' range check;
:class:`PendingLabelScan` is the same in two halves (the range check through
``kernels.utils.start_label_check`` / ``finish_label_check``) so a caller can enqueue work before
it waits. :func:`valid_index` turns a scan into the valid positions (``nonzero_static`` of the
known count: no second sync); :class:`RowGather` gathers chunks of those rows of ``hidden [M, H]``
on demand (never an ``[N, H]`` copy) and :class:`RowScatter` writes their gradient back in place;
:func:`per_row_scale` checks an upstream scale given per valid token.

Shapes: ``labels [...]`` integer, ``hidden [..., H]``; indices are long positions in the
flattened ``[...]`` layout.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from liger_losses.kernels.scale import scale_unless_one_
from liger_losses.kernels.utils import finish_label_check, start_label_check


class LabelScan(NamedTuple):
    """What :func:`scan_labels` reads with its one host sync."""

    valid: Tensor  # [*labels.shape] bool: label != ignore_index
    num_valid: int
    row_counts: Optional[Tensor]  # [B] long on the device (labels [B, T]), when asked for
    row_counts_host: Optional[list]  # the same as Python ints


def label_counts(labels: Tensor, ignore_index: int, num_classes: Optional[int], row_counts: bool):
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


class _AheadScan(NamedTuple):
    """A scan started by :func:`scan_labels_ahead`, kept on the labels tensor."""

    ignore_index: int
    num_classes: Optional[int]
    version: int  # labels._version when the scan was queued: an in-place change since voids it
    stream: Optional[object]  # the CUDA stream it was queued on (None on the CPU)
    valid: Tensor
    in_range: Tensor
    counts: Optional[Tensor]
    host: Tensor  # parts of label_counts (row counts included for 2-D labels), in host memory once event passed
    event: Optional[object]


_AHEAD = "_liger_label_scan"


def _version(labels: Tensor) -> Optional[int]:
    try:
        return labels._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def scan_labels_ahead(labels: Tensor, ignore_index: int, num_classes: Optional[int]) -> Tensor:
    """Queue the scan of :func:`scan_labels` now and keep it on ``labels`` (returned, the same tensor).

    A loss's scan reads its counts on the host, so it waits for everything queued before it: called
    after the model's forward it waits for the forward. A trainer that knows the labels before the
    forward calls this first; a later :func:`scan_labels` (or :class:`PendingLabelScan`) of this same
    tensor, with the same ``ignore_index`` and ``num_classes``, on the same stream and with the
    tensor unchanged since, then waits only for this scan's copy (an event) and reads that. Per-row
    counts are taken for 2-D labels. Anything else (another tensor, a view of it, other options, an
    in-place change) scans as before. A no-op while a CUDA graph is captured."""
    if not isinstance(labels, Tensor) or labels.dim() not in (1, 2) or labels.is_floating_point():
        return labels
    cuda = labels.device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        return labels
    version = _version(labels)
    if version is None:
        return labels
    valid, in_range, counts, parts = label_counts(labels, ignore_index, num_classes, labels.dim() == 2)
    stream = event = None
    host = parts
    if cuda:
        host = torch.empty(parts.shape, dtype=parts.dtype, pin_memory=True)
        host.copy_(parts, non_blocking=True)
        stream = torch.cuda.current_stream(labels.device)
        event = torch.cuda.Event()
        event.record(stream)
    setattr(labels, _AHEAD, _AheadScan(ignore_index, num_classes, version, stream, valid, in_range, counts,
                                        host, event))
    return labels


def _scanned_ahead(labels: Tensor, ignore_index: int, num_classes: Optional[int],
                   row_counts: bool, wait: bool = True) -> Optional[_AheadScan]:
    """The matching scan :func:`scan_labels_ahead` left on ``labels`` (its host copy complete, unless not
    ``wait``); else None."""
    ahead = getattr(labels, _AHEAD, None)
    if ahead is None or ahead.ignore_index != ignore_index or ahead.num_classes != num_classes:
        return None
    if ahead.version != _version(labels) or (row_counts and ahead.counts is None):
        return None
    if ahead.event is not None:
        if torch.cuda.current_stream(labels.device) != ahead.stream:
            return None
        if wait:
            ahead.event.synchronize()  # waits for the scan's copy only, not for the work queued after it
    return ahead


def scan_labels(labels: Tensor, ignore_index: int, num_classes: Optional[int],
                row_counts: bool = False) -> LabelScan:
    """The valid-token mask and counts of ``labels`` with ONE host sync: the range check of the
    labels (when ``num_classes`` is given: every label in ``[0, num_classes)`` or ``ignore_index``,
    else ``ValueError``), the number of valid tokens and, with ``row_counts``, each row's count
    (``labels [B, T]``) are read back together (from a scan queued earlier by
    :func:`scan_labels_ahead` when there is one)."""
    ahead = _scanned_ahead(labels, ignore_index, num_classes, row_counts)
    if ahead is not None:
        return _ahead_result(labels, ahead, row_counts)
    valid, in_range, counts, parts = label_counts(labels, ignore_index, num_classes, row_counts)
    return _label_scan(labels, valid, in_range, counts, parts.tolist(), ignore_index, num_classes)  # the one sync


def _ahead_result(labels: Tensor, ahead: _AheadScan, row_counts: bool) -> LabelScan:
    host = ahead.host.tolist()
    if ahead.counts is not None and not row_counts:
        host = host[:len(host) - ahead.counts.numel()]
    return _label_scan(labels, ahead.valid, ahead.in_range, ahead.counts if row_counts else None, host,
                       ahead.ignore_index, ahead.num_classes)


def _label_scan(labels, valid, in_range, counts, host, ignore_index, num_classes) -> LabelScan:
    """The :class:`LabelScan` of read-back ``host`` parts; ``ValueError`` on labels out of range."""
    if num_classes is not None:
        if host[1] != host[0]:
            example = int(labels[valid & ~in_range][0])
            raise ValueError(
                f"labels must be in [0, {num_classes}) or equal ignore_index={ignore_index}, "
                f"found {example}"
            )
        host = host[:1] + host[2:]
    return LabelScan(valid, int(host[0]), counts, host[1:] if counts is not None else None)


class PendingLabelScan:
    """:func:`scan_labels` (without row counts) in two halves. The constructor enqueues the scan, a
    non-blocking copy of the valid-token count to pinned host memory and then the range check of
    ``kernels.utils.start_label_check`` (whose event is recorded after the count's copy, so waiting
    for it waits for the count too); :meth:`result` waits for that event alone, not for the work
    enqueued after it, raises on labels out of ``[0, num_classes)`` (``finish_label_check``; on the
    CPU the check runs at once) and returns the :class:`LabelScan`. ``valid`` and ``in_range``
    (valid and within the classes: what may be fed to a kernel before the check) are available at
    once."""

    def __init__(self, labels: Tensor, ignore_index: int, num_classes: int):
        self.labels = labels
        self.ahead = _scanned_ahead(labels, ignore_index, num_classes, False, wait=False)
        if self.ahead is not None:  # queued before the forward (scan_labels_ahead): nothing to queue now
            self.valid, self.in_range = self.ahead.valid, self.ahead.in_range
            return
        self.valid, self.in_range, _, parts = label_counts(labels, ignore_index, num_classes, False)
        count = parts[:1]
        bad = parts[:1] - parts[1:2]  # valid labels outside [0, num_classes)
        if count.is_cuda:
            self.host = torch.empty(count.shape, dtype=count.dtype, pin_memory=True)
            self.host.copy_(count, non_blocking=True)
        else:
            self.host = count
        self.check = start_label_check("labels", labels, num_classes, ignore_index, bad)
        self.synced = self.check is not None or not count.is_cuda
        self.device_count = count

    def result(self) -> LabelScan:
        if self.ahead is not None:
            if self.ahead.event is not None:
                self.ahead.event.synchronize()  # the scan's copy only
            return _ahead_result(self.labels, self.ahead, False)
        finish_label_check(self.check)  # the one host sync: waits for the count's copy only
        num_valid = self.host.tolist()[0] if self.synced else self.device_count.tolist()[0]
        return LabelScan(self.valid, int(num_valid), None, None)


def nonzero_known(mask: Tensor, count: int) -> Tensor:
    """Indices ``[count]`` of the True entries of the flat ``mask`` whose number is known
    (``nonzero_static``: no second host sync)."""
    try:
        return torch.nonzero_static(mask, size=count).squeeze(1)
    except (AttributeError, NotImplementedError, RuntimeError):  # older torch / backend
        return mask.nonzero().squeeze(1)


def valid_index(labels: Tensor, ignore_index: int, order: Optional[Tensor] = None, *,
                num_classes: Optional[int] = None, scan: Optional[LabelScan] = None):
    """``(labels_valid [N] long, index [N] long)``: the non-ignored positions of the flattened
    ``labels``, sequences taken in ``order`` (a permutation of dim 0 of ``labels [B, T]``) when
    given. With ``num_classes`` the labels' range is checked too. One host sync in all (none
    when ``scan``, a result of :func:`scan_labels`, is passed in)."""
    flat = labels.reshape(-1)
    valid, n, _, _ = scan if scan is not None else scan_labels(labels, ignore_index, num_classes)
    if order is None:
        if n == flat.numel():
            return flat.long(), torch.arange(n, device=flat.device)
        index = nonzero_known(valid.reshape(-1), n)
    else:
        T = labels.shape[1]
        pos = nonzero_known(valid.index_select(0, order).reshape(-1), n)
        index = order[pos // T] * T + pos % T
    return flat.index_select(0, index).long(), index


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

    def rows_target(self, ts: int, te: int) -> tuple[Tensor, Optional[Tensor]]:
        """Where a kernel writes rows ``[ts, te)`` itself: ``(full[ts:te], None)``, or ``(full,
        positions [te - ts])`` when tokens were dropped (the rows scattered by the writer)."""
        if self.identity:
            return self.full[ts:te], None
        return self.full, self.index[ts:te]

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


def hidden_rows_at(hidden: Tensor, index: Tensor) -> RowGather:
    """:class:`RowGather` of the rows ``index`` (flat positions) of ``hidden [..., H]``; the identity
    when ``index`` covers every row in order (what :func:`valid_index` returns then)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return RowGather(flat, index, index.numel() == flat.shape[0])


def token_rows(hidden: Tensor, labels: Tensor, ignore_index: int, *, num_classes: Optional[int] = None):
    """The non-ignored tokens without copying them: ``(rows, labels_valid [N] long, index [N])``
    where ``rows`` (:class:`RowGather`) gathers chunks of ``hidden [..., H]`` on demand. One host
    sync, which also checks the labels' range when ``num_classes`` is given. The engine's passes
    take these, so no ``[N, H]`` copy of the hidden states is held."""
    labels_valid, index = valid_index(labels, ignore_index, num_classes=num_classes)
    return hidden_rows_at(hidden, index), labels_valid, index


def compact_tokens(hidden: Tensor, labels: Tensor, ignore_index: int, *,
                   num_classes: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Drop ignored tokens: ``hidden [..., H]``, ``labels [...]`` ->
    ``(hidden_valid [N, H], labels_valid [N] long, index [N] long)`` where ``index`` holds the
    positions in the flattened ``[...]`` layout. One host sync. When no token is ignored the
    returned hidden is a view (no copy); the engine's own passes use :func:`token_rows` instead,
    which never copies."""
    rows, labels_valid, index = token_rows(hidden, labels, ignore_index, num_classes=num_classes)
    return rows(0, index.numel()), labels_valid, index


def grad_like(full: Tensor, like: Tensor) -> Tensor:
    """A ``[M, H]`` gradient buffer (:class:`RowScatter`'s ``full``) in ``like``'s shape and dtype."""
    out = full.view(like.shape)
    return out if out.dtype == like.dtype else out.to(like.dtype)


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


def per_row_scale(grad_scale, count: int) -> bool:
    """Whether ``grad_scale`` gives each row its own scale (a tensor of more than one entry, sliced
    per chunk), checked to hold at least ``count`` entries; a float or a one-entry tensor (0-d or
    ``[1]``) scales every row."""
    if not isinstance(grad_scale, Tensor) or grad_scale.numel() == 1:
        return False
    if grad_scale.dim() != 1 or grad_scale.shape[0] < count:
        raise ValueError(f"grad_scale must be a float, a 1-element tensor or a 1-D tensor of at least {count} "
                         f"entries, got shape {tuple(grad_scale.shape)}")
    return True
