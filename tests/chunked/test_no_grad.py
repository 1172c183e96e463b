"""Fused-linear losses under ``torch.no_grad()`` compute no gradient.

``ctx.needs_input_grad`` of an ``autograd.Function`` follows ``requires_grad`` even when grad mode
is off, so the one-pass losses (which compute their gradients inside the forward) must record grad
mode before ``.apply``. Under ``torch.no_grad()`` with inputs that require grad, each loss here must
give exactly (bitwise) the loss and metrics of grad mode and never call ``backprop_tile`` (the
gradient GEMMs); in grad mode ``backprop_tile`` is called, so the counter does see the calls.
The pure-PyTorch path (``impl="torch"``) keeps this fast; grad mode is independent of the kernel.
"""

import pytest
import torch

import liger_losses.chunked.gemm as gemm_module
from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
from liger_losses.chunked.distillation import fused_linear_distillation_loss
from liger_losses.chunked.preference.dpo import fused_linear_dpo_loss
from liger_losses.chunked.preference.orpo import fused_linear_orpo_loss
from tests.helpers import lm_head_inputs

B, T, H, V = 4, 7, 16, 40


@pytest.fixture
def backprop_calls(monkeypatch):
    """Counts the calls of ``backprop_tile`` (every loss reaches it through ``gemm.HeadGrads``)."""
    calls = [0]

    def wrap(fn):
        def counted(*args, **kwargs):
            calls[0] += 1
            return fn(*args, **kwargs)

        return counted

    monkeypatch.setattr(gemm_module, "backprop_tile", wrap(gemm_module.backprop_tile))
    return calls


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    weight, hidden, bias, labels = lm_head_inputs(g, B, T, H, V)
    labels[:, :2] = -100  # prompt
    labels[1, -2:] = -100  # padding
    ref_hidden = torch.randn(B, T, H, generator=g)
    return weight, hidden, bias, labels, ref_hidden


def check_no_grad(call, calls):
    """``call() -> (loss, metrics)``: bitwise equal in grad mode and under no_grad, no backprop there."""
    loss, metrics = call()
    assert loss.requires_grad and calls[0] > 0
    calls[0] = 0
    with torch.no_grad():
        ng_loss, ng_metrics = call()
    assert calls[0] == 0
    assert not ng_loss.requires_grad
    assert torch.equal(ng_loss, loss.detach())
    assert ng_metrics.keys() == metrics.keys()
    for k in metrics:
        assert torch.equal(torch.as_tensor(ng_metrics[k]), torch.as_tensor(metrics[k])), k


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_no_grad(reduction, backprop_calls):
    """fused_linear_cross_entropy (mean/sum, gradients in forward): same loss and token accuracy
    bitwise under no_grad, no backprop_tile call."""
    weight, hidden, bias, labels, _ = make()

    def call():
        out = fused_linear_cross_entropy(weight, hidden, labels, bias=bias, reduction=reduction,
                                         return_token_accuracy=True, chunk_tokens=5, impl="torch")
        return out.loss, out.metrics

    check_no_grad(call, backprop_calls)


@pytest.mark.parametrize("chunk_tokens", [None, 3])  # one pass; two phases (sequences > 3 tokens)
def test_dpo_no_grad(chunk_tokens, backprop_calls):
    """fused_linear_dpo_loss through the sequence-objective engine, one-pass and two-phase (with its
    exempt longest sequence): same loss and metrics bitwise under no_grad, no backprop_tile call."""
    weight, hidden, bias, labels, ref_hidden = make(1)
    check_no_grad(lambda: tuple(fused_linear_dpo_loss(weight, hidden, ref_hidden, labels, bias=bias,
                                                      chunk_tokens=chunk_tokens, impl="torch")),
                  backprop_calls)


def test_orpo_no_grad(backprop_calls):
    """fused_linear_orpo_loss: same loss and metrics bitwise under no_grad, no backprop_tile call."""
    weight, hidden, bias, labels, _ = make(2)
    check_no_grad(lambda: tuple(fused_linear_orpo_loss(weight, hidden, labels, bias=bias, chunk_tokens=5,
                                                       impl="torch")), backprop_calls)


def test_distillation_no_grad(backprop_calls):
    """fused_linear_distillation_loss (teacher on the student's head): same loss and metrics bitwise
    under no_grad, no backprop_tile call."""
    weight, hidden, bias, labels, teacher_hidden = make(3)
    check_no_grad(lambda: tuple(fused_linear_distillation_loss(
        weight, hidden, teacher_hidden, labels, bias=bias, hard_label_weight=0.5, chunk_tokens=5,
        impl="torch")), backprop_calls)
