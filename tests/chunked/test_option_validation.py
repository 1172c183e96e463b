"""Every chunked loss rejects bad options and inputs with TypeError/ValueError naming the argument:
non-finite numbers that would make the loss NaN or inf, ``softcap=inf`` (rejected: ``inf * tanh(x /
inf)`` is NaN; ``None`` means no cap), non-numbers such as ``None`` / ``"0.1"``, a non-positive
``num_items_in_batch``, bool labels, non-bool KTO preference labels, and unknown keyword options.
Checks only: no loss value is compared, so there is no tolerance."""

import math

import pytest
import torch

import liger_losses as ll
from liger_losses.chunked.options import HeadOptions
from liger_losses.chunked.preference.cpo import CPOOptions
from liger_losses.chunked.preference.dpo import DPOOptions
from liger_losses.chunked.preference.kto import KTOOptions
from liger_losses.chunked.preference.orpo import ORPOOptions

B, T, H, V = 4, 3, 8, 11
INF, NAN = math.inf, math.nan


def inputs(labels_dtype=torch.long):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g)
    hidden = torch.randn(B, T, H, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    if labels_dtype == torch.bool:
        labels = labels > 5
    return weight, hidden, labels


@pytest.mark.parametrize("build,name", [
    (lambda v: ll.LigerFusedLinearSimPOLoss(gamma=v), "gamma"),
    (lambda v: CPOOptions(simpo_gamma=v), "simpo_gamma"),
    (lambda v: CPOOptions(alpha=v), "alpha"),
    (lambda v: DPOOptions(loss_type=["sigmoid", "hinge"], loss_weights=[1.0, v]), "loss_weights"),
    (lambda v: DPOOptions(loss_type="sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=v),
     "f_alpha_divergence_coef"),
    (lambda v: DPOOptions(beta=v), "beta"),
    (lambda v: CPOOptions(beta=v), "beta"),
    (lambda v: ORPOOptions(beta=v), "beta"),
    (lambda v: KTOOptions(beta=v), "beta"),
    (lambda v: KTOOptions(desirable_weight=v), "desirable_weight"),
    (lambda v: ll.LigerFusedLinearDistillationLoss(beta=v), "beta"),
    (lambda v: ll.LigerFusedLinearDistillationLoss(hard_label_weight=v), "hard_label_weight"),
    (lambda v: HeadOptions(temperature=v), "temperature"),
    (lambda v: HeadOptions(logit_scale=v), "logit_scale"),
    (lambda v: HeadOptions(softcap=v), "softcap"),
    (lambda v: ll.LigerFusedLinearCrossEntropyLoss(z_loss_weight=v), "z_loss_weight"),
])
@pytest.mark.parametrize("value", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
def test_non_finite_numbers_are_rejected_by_name(build, name, value):
    with pytest.raises(ValueError, match=name):
        build(value)


@pytest.mark.parametrize("value", [None, "0.1", True], ids=["None", "str", "bool"])
@pytest.mark.parametrize("build", [
    lambda v: ll.LigerFusedLinearDPOLoss(beta=v), lambda v: ll.LigerFusedLinearCPOLoss(beta=v),
    lambda v: ll.LigerFusedLinearSimPOLoss(beta=v), lambda v: ll.LigerFusedLinearORPOLoss(beta=v),
    lambda v: ll.LigerFusedLinearKTOLoss(beta=v), lambda v: ll.LigerFusedLinearDistillationLoss(beta=v),
], ids=["dpo", "cpo", "simpo", "orpo", "kto", "distillation"])
def test_beta_that_is_not_a_number_is_a_type_error_naming_beta(build, value):
    with pytest.raises(TypeError, match="beta"):
        build(value)


def test_softcap_inf_is_rejected_everywhere():
    """softcap=inf: ValueError naming softcap from every functional and module (None is no cap)."""
    w, h, lab = inputs()
    calls = [
        lambda: ll.fused_linear_cross_entropy(w, h, lab, softcap=INF),
        lambda: ll.fused_linear_token_logprobs(w, h, lab, softcap=INF),
        lambda: ll.fused_linear_dpo_loss(w, h, None, lab, reference_free=True, softcap=INF),
        lambda: ll.fused_linear_orpo_loss(w, h, lab, softcap=INF),
        lambda: ll.fused_linear_distillation_loss(w, h, h, lab, softcap=INF),
        lambda: ll.fused_linear_sequence_objective(w, h, lab, lambda s: (s.logps, {}), softcap=INF),
        lambda: ll.LigerFusedLinearCrossEntropyLoss(softcap=INF),
        lambda: ll.LigerFusedLinearKTOLoss(softcap=INF),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="softcap"):
            call()


@pytest.mark.parametrize("value", [0, -2.0, 0.0], ids=["0", "-2.0", "0.0"])
def test_distillation_num_items_in_batch_must_be_positive(value):
    w, h, lab = inputs()
    with pytest.raises(ValueError, match="num_items_in_batch"):
        ll.fused_linear_distillation_loss(w, h, h, lab, num_items_in_batch=value)
    with pytest.raises(TypeError, match="num_items_in_batch"):
        ll.fused_linear_distillation_loss(w, h, h, lab, num_items_in_batch="8")


def test_bool_labels_are_a_type_error():
    """Bool labels would be read as classes 0/1: every loss raises TypeError naming labels."""
    w, h, lab = inputs(torch.bool)
    calls = [
        lambda: ll.fused_linear_cross_entropy(w, h, lab),
        lambda: ll.fused_linear_token_logprobs(w, h, lab),
        lambda: ll.fused_linear_dpo_loss(w, h, None, lab, reference_free=True),
        lambda: ll.fused_linear_simpo_loss(w, h, lab),
        lambda: ll.fused_linear_distillation_loss(w, h, h, lab),
        lambda: ll.fused_linear_sequence_objective(w, h, lab, lambda s: (s.logps, {})),
        lambda: ll.fused_linear_kto_loss(w, h, h, lab, preference_labels=torch.ones(B, dtype=torch.bool),
                                         loss_type="apo_zero_unpaired"),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="labels"):
            call()


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.uint8])
def test_kto_preference_labels_must_be_bool(dtype):
    """Integer preference labels are rejected (convert 0/1 with .bool()); bool ones run."""
    w, h, lab = inputs()
    with pytest.raises(TypeError, match="preference_labels"):
        ll.fused_linear_kto_loss(w, h, h, lab, preference_labels=torch.tensor([1, 0, 1, 0], dtype=dtype),
                                 loss_type="apo_zero_unpaired")
    out = ll.fused_linear_kto_loss(w, h, h, lab, preference_labels=torch.tensor([True, False, True, False]),
                                   loss_type="apo_zero_unpaired")
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("cls", [
    ll.LigerFusedLinearCrossEntropyLoss, ll.LigerFusedLinearDistillationLoss, ll.LigerFusedLinearDPOLoss,
    ll.LigerFusedLinearCPOLoss, ll.LigerFusedLinearSimPOLoss, ll.LigerFusedLinearORPOLoss,
    ll.LigerFusedLinearKTOLoss, ll.LigerFusedLinearGRPOLoss,
])
def test_every_module_rejects_an_unknown_option_by_name(cls):
    with pytest.raises(TypeError, match="chunk_token"):
        cls(chunk_token=8)


def test_module_signatures_name_their_options():
    """The TRL adapters read the modules' options from inspect.signature: no **kwargs catch-all."""
    import inspect

    for cls in (ll.LigerFusedLinearCrossEntropyLoss, ll.LigerFusedLinearDistillationLoss, ll.LigerFusedLinearDPOLoss,
                ll.LigerFusedLinearCPOLoss, ll.LigerFusedLinearSimPOLoss, ll.LigerFusedLinearORPOLoss,
                ll.LigerFusedLinearKTOLoss, ll.LigerFusedLinearGRPOLoss):
        params = inspect.signature(cls.__init__).parameters.values()
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params), cls.__name__
        assert "chunk_tokens" in {p.name for p in params}, cls.__name__
