"""Shared preference helpers: log1mexp, token means, the separable chosen-NLL share, and the
sequence driver's input checks (one place: ``sequence.check_sequence_inputs``)."""

import torch

from liger_losses.chunked.preference.common import (
    average_logps,
    chosen_nll_per_unit,
    log1mexp,
    token_mean,
)


def test_log1mexp_matches_float64_on_both_branches():
    """log(1 - e^x) for x in (-31.6, -1e-6): fp32 result within 1e-6 * max(1, |ref|) of the float64
    formula on both sides of the -log 2 branch point (absolute error is what enters ORPO's log odds)."""
    x = -torch.logspace(-6, 1.5, 200, dtype=torch.float64)
    ref = torch.log(-torch.expm1(x))
    got = log1mexp(x.float()).double()
    assert float(((got - ref).abs() / ref.abs().clamp(min=1.0)).max()) <= 1e-6


def test_token_mean_and_average_logps_empty_safe():
    """token_mean is sum/sum and 0 (not NaN) for an empty denominator; average_logps of an empty
    sequence is 0 (exact)."""
    assert float(token_mean(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 3.0]))) == 1.5
    assert float(token_mean(torch.tensor([0.0]), torch.tensor([0.0]))) == 0.0
    assert torch.equal(average_logps(torch.tensor([-6.0, 0.0]), torch.tensor([3.0, 0.0])), torch.tensor([-2.0, 0.0]))


def test_chosen_nll_share_mean_is_batch_token_mean():
    """Splitting pairs into groups and averaging chosen_nll_per_unit over all pairs gives exactly
    -sum(chosen logps) / (chosen tokens of the batch) (1e-6)."""
    batch_num_tokens = torch.tensor([3.0, 5.0, 2.0, 4.0, 4.0, 4.0])  # 3 pairs: chosen 3, 5, 2
    chosen = torch.tensor([-3.0, -7.0, -1.0])
    parts = torch.cat([chosen_nll_per_unit(chosen[:2], batch_num_tokens),
                       chosen_nll_per_unit(chosen[2:], batch_num_tokens)])
    assert abs(float(parts.mean()) - 11.0 / 10.0) < 1e-6


def test_check_inputs_names_the_argument():
    """Shape checks name the offending argument (kl_hidden here) and the expected shape."""
    import pytest

    from liger_losses.chunked.options import HeadOptions
    from liger_losses.chunked.sequence import check_sequence_inputs

    w, head = torch.zeros(10, 4), HeadOptions()
    with pytest.raises(ValueError, match=r"kl_labels must have shape \(2, 3\)"):
        check_sequence_inputs(w, torch.zeros(2, 3, 4), torch.zeros(2, 2, dtype=torch.long), head, group_size=1,
                              hidden_name="kl_hidden", labels_name="kl_labels")
    with pytest.raises(ValueError, match="ref_weight"):
        check_sequence_inputs(w, torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), head, group_size=2,
                              ref_weight=torch.zeros(9, 4))
