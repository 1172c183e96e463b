"""Lean activation checkpointing of the policy's layers (``trl_integration/checkpointing.py``).

The trainers run the policy's checkpointed layers in torch's reentrant form where it gives what TRL's default
(non-reentrant) form gives. Held here: our trainers with checkpointing on equal TRL's with it (loss, metrics and
every gradient, fp32 on the CPU: the same ops on the same inputs, so the bar is the trainers' usual 1e-4, and
dropout included: both forms replay the forward's RNG state), PEFT LoRA included; the reentrant form really runs;
the layers get their own function back; and each case where the forms differ keeps torch's.
"""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import liger_losses.trl_integration.checkpointing as ck
from liger_losses.trl_integration import DPOTrainer, SFTTrainer
from liger_losses.trl_integration.anatomy import backbone_of, unwrap_causal_lm

from .utils import (
    build_tiny_model,
    check_compute_loss,
    dpo_config,
    lora_config,
    make_pair,
    preference_dataset,
    sft_config,
    sft_dataset,
)

TOL = 1e-4
TRL_DEFAULT = {"use_reentrant": False}


@pytest.fixture
def forms(monkeypatch):
    """Counts the layer calls that took the reentrant form (True) and torch's (False)."""
    seen = {True: 0, False: 0}
    decide = ck.reentrant_is_equivalent

    def counted(function, args):
        out = decide(function, args)
        seen[out] += 1
        return out

    monkeypatch.setattr(ck, "reentrant_is_equivalent", counted)
    return seen


def _checkpointed(*trainers):
    """Activation checkpointing on as ``Trainer.train`` turns it on (TRL's default kwargs)."""
    for trainer in trainers:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(TRL_DEFAULT))


def _layer_functions(trainer):
    return [m.__dict__.get("_gradient_checkpointing_func")
            for m in backbone_of(unwrap_causal_lm(trainer.model)).modules() if hasattr(m, "gradient_checkpointing")]


def test_sft_and_dpo_with_checkpointing_equal_trl(tok, tmp_path, forms):
    """SFT and DPO (reference model) with checkpointing: loss, metrics and every gradient equal TRL's
    (rel <= 1e-4); every policy layer took the reentrant form; afterwards each layer holds TRL's checkpoint
    function again."""
    cases = ((SFTTrainer, [build_tiny_model(tok)], sft_config, sft_dataset),
             (DPOTrainer, [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)], dpo_config,
              lambda: preference_dataset(8)))
    for cls, models, config, dataset in cases:
        forms[True] = forms[False] = 0
        theirs, ours = make_pair(cls, models, lambda d, c=config: c(d, gradient_checkpointing=True),
                                 tmp_path / cls.__name__, dataset, processing_class=tok)
        _checkpointed(theirs, ours)
        check_compute_loss(theirs, ours, TOL)
        layers = len(unwrap_causal_lm(ours.model).model.layers)
        assert forms == {True: layers, False: 0}, forms
        funcs = _layer_functions(ours)
        assert funcs and all(f.func is checkpoint and f.keywords == TRL_DEFAULT for f in funcs)


def test_dropout_draws_the_same_in_both_forms(tok, tmp_path, monkeypatch):
    """Attention dropout 0.3, the same seed: our SFT step in the lean form and in torch's form gives the same
    loss and gradients (rel <= 1e-6: the same ops and masks; both forms replay the forward's RNG state in the
    recompute), and dropout acts (the loss differs from the step without it)."""
    from .utils import first_batch, grads_of, rel, step0

    def run(dropout, lean):
        monkeypatch.setenv(ck.LEAN_ENV.name, "1" if lean else "0")
        model = build_tiny_model(tok)
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = dropout
        trainer = SFTTrainer(model, sft_config(tmp_path / f"{dropout}{lean}", gradient_checkpointing=True),
                             train_dataset=sft_dataset(), processing_class=tok, use_liger=True,
                             liger_patch_model=False)
        _checkpointed(trainer)
        batch = first_batch(trainer)
        torch.manual_seed(3)
        loss, _ = step0(trainer, batch)
        loss.backward()
        return float(loss), grads_of(trainer.model)

    loss_lean, grads_lean = run(0.3, True)
    loss_torch, grads_torch = run(0.3, False)
    assert rel(loss_lean, loss_torch) <= 1e-6
    assert grads_lean.keys() == grads_torch.keys()
    for name, g in grads_lean.items():
        assert rel((g - grads_torch[name]).norm(), 0.0) <= 1e-6 * max(1.0, float(grads_torch[name].norm())), name
    assert abs(run(0.0, True)[0] - loss_lean) > 1e-3


def test_lora_with_checkpointing_equals_trl(tok, tmp_path, forms):
    """DPO with a PEFT LoRA policy (frozen embeddings: transformers makes their output require grad when it turns
    checkpointing on) and checkpointing: equal to TRL's (rel <= 1e-4), LoRA gradients included, reentrant form."""
    theirs, ours = make_pair(DPOTrainer, [build_tiny_model(tok), None],
                             lambda d: dpo_config(d, gradient_checkpointing=True), tmp_path,
                             lambda: preference_dataset(8), processing_class=tok, peft_config=lora_config())
    _checkpointed(theirs, ours)
    check_compute_loss(theirs, ours, TOL)
    assert forms[True] > 0 and forms[False] == 0, forms


def test_the_switch_keeps_torchs_form(tok, tmp_path, forms, monkeypatch):
    """``LIGER_LOSSES_LEAN_CHECKPOINT=0``: no layer takes the lean function."""
    monkeypatch.setenv(ck.LEAN_ENV.name, "0")
    trainer = SFTTrainer(build_tiny_model(tok), sft_config(tmp_path, gradient_checkpointing=True),
                         train_dataset=sft_dataset(), processing_class=tok, use_liger=True, liger_patch_model=False)
    _checkpointed(trainer)
    from .utils import first_batch, step0

    step0(trainer, first_batch(trainer))
    assert forms == {True: 0, False: 0}


def test_reentrant_only_where_equivalent():
    """Torch's form when no positional tensor requires grad (no gradient would reach the parameters), when a bound
    keyword tensor does (the reentrant form would drop its gradient), in nested containers too, under no grad."""
    x = torch.randn(2, 3, requires_grad=True)
    frozen = torch.randn(2, 3)
    f = functools.partial(torch.mul, other=torch.ones(3))
    assert ck.reentrant_is_equivalent(f, (x,))
    assert not ck.reentrant_is_equivalent(f, (frozen,))
    assert not ck.reentrant_is_equivalent(functools.partial(torch.mul, other=x), (x,))
    assert not ck.reentrant_is_equivalent(functools.partial(lambda a, pe: a, pe=(frozen, x)), (x,))
    assert not ck.reentrant_is_equivalent(f, (x, [x]))
    with torch.no_grad():
        assert not ck.reentrant_is_equivalent(f, (x,))


def test_a_keyword_tensor_that_requires_grad_gets_its_gradient():
    """Through :func:`lean_checkpoint`, a tensor bound as a keyword (which the reentrant form would not
    differentiate) gets the gradient of the plain computation (exact: the same ops)."""
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    out = ck.lean_checkpoint(functools.partial(lambda a, scale: (a * scale).tanh(), scale=w), x)
    out.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x * w).tanh().sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


def test_other_checkpoint_functions_are_kept_and_restored_on_error(tok):
    """A layer whose function is not exactly TRL's default (offloading, other options) keeps it; the swapped ones
    are put back also when the call raises."""
    model = build_tiny_model(tok)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(TRL_DEFAULT))
    layers = list(model.model.layers)
    other = functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False)
    layers[0]._gradient_checkpointing_func = other
    before = [layer._gradient_checkpointing_func for layer in layers]
    with pytest.raises(RuntimeError, match="boom"):
        with ck.lean_checkpointing(model.model):
            assert layers[0]._gradient_checkpointing_func is other
            assert all(layer._gradient_checkpointing_func is ck.lean_checkpoint for layer in layers[1:])
            raise RuntimeError("boom")
    assert [layer._gradient_checkpointing_func for layer in layers] == before


class _DDPLike(torch.nn.Module):
    def __init__(self, module, find_unused_parameters):
        super().__init__()
        self.module, self.find_unused_parameters = module, find_unused_parameters


class DeepSpeedEngine(torch.nn.Module):
    """Named as DeepSpeed's engine, which holds the model as ``.module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_the_trainer_takes_it_only_where_the_model_allows(tok, tmp_path):
    """Not under a DDP that looks for unused parameters, not under a DeepSpeed engine, not on ZeRO-3 parameters
    (``ds_id``); decided once per model."""
    trainer = SFTTrainer(build_tiny_model(tok), sft_config(tmp_path), train_dataset=sft_dataset(),
                         processing_class=tok, use_liger=True, liger_patch_model=False)
    plain = build_tiny_model(tok)
    sharded = build_tiny_model(tok)
    sharded.lm_head.weight.ds_id = 0
    for model, allowed in ((plain, True), (_DDPLike(build_tiny_model(tok), True), False),
                           (_DDPLike(build_tiny_model(tok), False), True), (sharded, False),
                           (DeepSpeedEngine(build_tiny_model(tok)), False)):
        cm = trainer._liger_lean_checkpointing(model)
        assert trainer._liger_lean_allowed[id(model)] is allowed
        assert cm.gen.gi_frame.f_locals["enabled"] is allowed


def test_the_layer_list_dies_with_the_model(tok):
    """The backbone keeps the list of its checkpointed layers itself: once the model is gone nothing holds it (a
    process that trains models one after the other keeps none of the earlier ones)."""
    import gc
    import weakref

    model = build_tiny_model(tok)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(TRL_DEFAULT))
    with ck.lean_checkpointing(model.model):
        pass
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
