"""Tests of liger_losses/kernels/utils.py's deferred label check (``start_label_check`` /
``finish_label_check``) on the CPU; its CUDA behaviour (no host sync, the event on the labels'
device, capture) is held by tests/kernels/test_cross_entropy.py's ``gpu`` tests."""

import pytest
import torch

from liger_losses.kernels.utils import finish_label_check, start_label_check

NO_BAD = torch.zeros(1, dtype=torch.int32)  # the device flag (unread on the CPU, checked at once)


def test_cpu_checks_at_once():
    """On the CPU there is nothing to overlap: a bad label raises from ``start_label_check``
    itself, naming the argument, the range and the value; good labels leave nothing pending."""
    labels = torch.tensor([0, 4, -100, 2])
    assert start_label_check("labels", labels, 5, -100, NO_BAD) is None
    finish_label_check(None)  # no-op
    with pytest.raises(ValueError, match=r"targets must be in \[0, 5\).*found 7"):
        start_label_check("targets", torch.tensor([0, 7]), 5, -100, NO_BAD)
    with pytest.raises(ValueError, match="found -1"):
        start_label_check("labels", torch.tensor([-1, 0]), 5, -100, NO_BAD)


def test_empty_and_integer_only():
    """No labels: nothing to check. Float labels: TypeError naming the argument."""
    assert start_label_check("labels", torch.zeros(0, dtype=torch.long), 5, -100, NO_BAD) is None
    with pytest.raises(TypeError, match="labels"):
        start_label_check("labels", torch.zeros(3), 5, -100, NO_BAD)
