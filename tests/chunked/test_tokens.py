"""chunked/tokens.py: a label scan queued ahead (``scan_labels_ahead``) gives exactly what a scan at
the loss gives, and is used only while it still describes the tensor.

Exact (integer counts and masks). CPU: the scan ahead runs at once there, with no event; the GPU
half (no host sync left in the loss) is ``tests/chunked/test_host_syncs.py``.
"""

import pytest
import torch

from liger_losses.chunked import tokens
from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
from liger_losses.chunked.tokens import PendingLabelScan, scan_labels, scan_labels_ahead

V = 11


def _labels():
    torch.manual_seed(0)
    labels = torch.randint(0, V, (3, 7))
    labels[0, :4] = -100
    labels[2, 5:] = -100
    return labels


def _same(a, b):
    assert torch.equal(a.valid, b.valid) and a.num_valid == b.num_valid
    assert (a.row_counts is None) == (b.row_counts is None)
    if a.row_counts is not None:
        assert torch.equal(a.row_counts, b.row_counts) and a.row_counts_host == b.row_counts_host


@pytest.fixture
def counted(monkeypatch):
    """The number of device-side label scans (``label_counts`` calls) made."""
    calls = []
    original = tokens.label_counts
    monkeypatch.setattr(tokens, "label_counts", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("row_counts", [False, True])
def test_scan_ahead_equals_a_scan_at_the_loss(counted, row_counts):
    labels = _labels()
    plain = scan_labels(labels, -100, V, row_counts=row_counts)
    assert scan_labels_ahead(labels, -100, V) is labels
    counted.clear()
    _same(scan_labels(labels, -100, V, row_counts=row_counts), plain)
    pending = PendingLabelScan(labels, -100, V)
    _same(pending.result(), scan_labels(labels, -100, V))
    assert counted == []  # every scan above read the one queued ahead


def test_scan_ahead_is_not_used_once_stale(counted):
    labels = _labels()
    scan_labels_ahead(labels, -100, V)
    counted.clear()
    scan_labels(labels, -100, None)  # no range check asked for
    scan_labels(labels, -100, V + 1)  # other number of classes
    scan_labels(labels[:, 1:], -100, V)  # a view is another tensor
    assert len(counted) == 3
    labels[1, :] = -100  # changed in place after the scan: the scan no longer describes it
    counted.clear()
    scan = scan_labels(labels, -100, V, row_counts=True)
    assert len(counted) == 1 and scan.row_counts_host[1] == 0
    assert scan.num_valid == int((labels != -100).sum())


def test_scan_ahead_still_checks_the_range():
    labels = _labels()
    labels[1, 2] = V + 3
    scan_labels_ahead(labels, -100, V)
    with pytest.raises(ValueError, match=f"labels must be in \\[0, {V}\\).*found {V + 3}"):
        scan_labels(labels, -100, V)
    with pytest.raises(ValueError, match=f"found {V + 3}"):
        PendingLabelScan(labels, -100, V).result()


def test_scan_ahead_ignores_what_it_cannot_scan():
    floats = torch.zeros(2, 3)
    assert scan_labels_ahead(floats, -100, V) is floats and not hasattr(floats, tokens._AHEAD)
    with torch.inference_mode():
        frozen = torch.zeros(2, 3, dtype=torch.long)
    assert scan_labels_ahead(frozen, -100, V) is frozen  # no version counter: scanned at the loss


def test_loss_reads_the_scan_ahead(counted):
    """The loss's result is the same and it queues no scan of its own."""
    torch.manual_seed(1)
    weight, hidden, labels = torch.randn(V, 8), torch.randn(3, 7, 8), _labels()
    ref = fused_linear_cross_entropy(weight, hidden, labels)
    scan_labels_ahead(labels, -100, V)
    counted.clear()
    out = fused_linear_cross_entropy(weight, hidden, labels)
    assert counted == [] and torch.equal(out, ref)
