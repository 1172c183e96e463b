"""Tests of liger_losses/kernels/label_stats.py: the range flag and the mean's scale of a label
tensor, computed on the device in one launch.

Exact comparisons: the flag is an integer; the scale is 1 / (an integer count) or 1 / (a sum of
at most a few hundred fp32 weights), held to 1e-6 relative (fp32 summation order).
"""

import pytest
import torch

from liger_losses.kernels.label_stats import label_stats

IMPLS = ["torch", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 7, 300, 1000])
def test_count_scale_and_flag(impl, n):
    """In-range labels: flag 0, scale 1 / (non-ignored count), over one or several blocks (the
    interpreter's block is 256) and with shapes of any rank."""
    labels = torch.randint(0, 50, (n,))
    labels[::3] = -100
    bad, scale = label_stats(labels.reshape(1, n), 50, -100, impl=impl)
    kept = int((labels != -100).sum())
    assert bad.tolist() == [0]
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    assert scale.item() == pytest.approx(1.0 / kept if kept else 1.0, rel=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad_value", [-1, 50, 10**12])
def test_out_of_range_flagged_and_not_counted(impl, bad_value):
    """A label outside [0, V) other than ignore_index sets the flag and counts in neither the count
    nor the weight sum (nothing is read out of bounds)."""
    labels = torch.tensor([3, -100, bad_value, 7, 7])
    w = torch.rand(50) + 0.5
    bad, scale = label_stats(labels, 50, -100, impl=impl)
    assert bad.tolist() == [1]
    assert scale.item() == pytest.approx(1 / 3, rel=1e-6)
    bad, scale = label_stats(labels, 50, -100, w, impl=impl)
    assert bad.tolist() == [1]
    assert scale.item() == pytest.approx(1 / float(w[3] + 2 * w[7]), rel=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_ignored_and_custom_ignore_index(impl):
    """All labels ignored: scale 1 (the mean of nothing is 0, not NaN); ignore_index need not be
    negative (a class id used as padding is not a bad label)."""
    bad, scale = label_stats(torch.full((9,), -100), 10, -100, impl=impl)
    assert bad.tolist() == [0] and scale.item() == 1.0
    bad, scale = label_stats(torch.tensor([0, 9, 9, 4]), 10, 9, impl=impl)
    assert bad.tolist() == [0] and scale.item() == pytest.approx(0.5)


def test_bad_inputs():
    """Float labels and weights of the wrong size raise naming the argument."""
    with pytest.raises(TypeError, match="labels"):
        label_stats(torch.zeros(3), 5, -100)
    with pytest.raises(ValueError, match="class_weight"):
        label_stats(torch.zeros(3, dtype=torch.long), 5, -100, torch.ones(4))
