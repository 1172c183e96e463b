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
    first_batch,
    lora_config,
    make_pair,
    preference_dataset,
    rel,
    sft_config,
    sft_dataset,
    step0,
)

TOL = 1e-4
TRL_DEFAULT = {"use_reentrant": False}


@pytest.fixture
def forms(monkeypatch):
    """Counts the layer calls that took the reentrant form (True) and torch's (False)."""
    seen = {True: 0, False: 0}
    decide = ck.reentrant_is_equivalent

    def counted(layer, function, args):
        out = decide(layer, function, args)
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
    """SFT and DPO (reference model) with checkpointing, two steps: loss, metrics and every gradient equal TRL's
    (rel <= 1e-4) in both; the first ran in torch's form (it counts the calls per layer), the second took the
    reentrant form in every policy layer; afterwards each layer holds TRL's checkpoint function again."""
    cases = ((SFTTrainer, [build_tiny_model(tok)], sft_config, sft_dataset),
             (DPOTrainer, [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)], dpo_config,
              lambda: preference_dataset(8)))
    for cls, models, config, dataset in cases:
        forms[True] = forms[False] = 0
        theirs, ours = make_pair(cls, models, lambda d, c=config: c(d, gradient_checkpointing=True),
                                 tmp_path / cls.__name__, dataset, processing_class=tok)
        _checkpointed(theirs, ours)
        batch = first_batch(theirs)
        check_compute_loss(theirs, ours, TOL, batch=batch)  # the first call counts the layer calls, torch's form
        assert forms == {True: 0, False: 0}, forms
        theirs.model.zero_grad()
        ours.model.zero_grad()
        check_compute_loss(theirs, ours, TOL, batch=batch)
        layers = len(unwrap_causal_lm(ours.model).model.layers)
        assert forms == {True: layers, False: 0}, forms
        funcs = _layer_functions(ours)
        assert funcs and all(f.func is checkpoint and f.keywords == TRL_DEFAULT for f in funcs)


def test_attention_dropout_keeps_torchs_form(tok, tmp_path, forms):
    """Attention dropout 0.3 (SDPA picks its backend by grad mode, so a no-grad forward and the recompute could
    draw different masks): the model is not allowed the lean form, and the step, seeded alike, equals TRL's."""
    model = build_tiny_model(tok)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    theirs, ours = make_pair(SFTTrainer, [model], lambda d: sft_config(d, gradient_checkpointing=True), tmp_path,
                             sft_dataset, processing_class=tok)
    _checkpointed(theirs, ours)
    assert not ck.lean_allowed(ours.model)
    batch = first_batch(theirs)
    torch.manual_seed(3)
    loss_t, _ = step0(theirs, dict(batch))
    torch.manual_seed(3)
    loss_o, _ = step0(ours, dict(batch))
    assert rel(loss_o, loss_t) <= TOL
    assert forms == {True: 0, False: 0}


def test_lora_with_checkpointing_equals_trl(tok, tmp_path, forms):
    """DPO with a PEFT LoRA policy (frozen embeddings: transformers makes their output require grad when it turns
    checkpointing on) and checkpointing: equal to TRL's (rel <= 1e-4), LoRA gradients included, reentrant form."""
    theirs, ours = make_pair(DPOTrainer, [build_tiny_model(tok), None],
                             lambda d: dpo_config(d, gradient_checkpointing=True), tmp_path,
                             lambda: preference_dataset(8), processing_class=tok, peft_config=lora_config())
    _checkpointed(theirs, ours)
    batch = first_batch(theirs)
    for _ in range(2):  # the first call counts the layer calls in torch's form
        theirs.model.zero_grad()
        ours.model.zero_grad()
        check_compute_loss(theirs, ours, TOL, batch=batch)
    assert forms[True] > 0 and forms[False] == 0, forms


def test_the_switch_keeps_torchs_form(tok, tmp_path, forms, monkeypatch):
    """``LIGER_LOSSES_LEAN_CHECKPOINT=0``: no layer takes the lean function."""
    monkeypatch.setenv(ck.LEAN_SWITCH, "0")
    trainer = SFTTrainer(build_tiny_model(tok), sft_config(tmp_path, gradient_checkpointing=True),
                         train_dataset=sft_dataset(), processing_class=tok, use_liger=True, liger_patch_model=False)
    _checkpointed(trainer)
    batch = first_batch(trainer)
    step0(trainer, batch)
    step0(trainer, batch)
    assert forms == {True: 0, False: 0}


def test_a_step_whose_layers_do_much_work_keeps_torchs_form(tok, tmp_path, forms, monkeypatch):
    """Tokens x a layer's parameters above ``LEAN_MAX_LAYER_WORK`` (a GPU-bound step, where the reentrant backward
    costs more GPU time than the host time it saves): torch's form; at or below it, the lean form. The padded
    call (pad-free off): its tokens are the batch's ``B x T``; a packed call counts the attended tokens."""
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "0")
    trainer = SFTTrainer(build_tiny_model(tok), sft_config(tmp_path, gradient_checkpointing=True),
                         train_dataset=sft_dataset(), processing_class=tok, use_liger=True, liger_patch_model=False)
    _checkpointed(trainer)
    batch = first_batch(trainer)
    step0(trainer, batch)  # counts the layer calls
    layer_params = sum(p.numel() for p in unwrap_causal_lm(trainer.model).model.layers[0].parameters())
    work = batch["input_ids"].numel() * layer_params
    monkeypatch.setattr(ck, "LEAN_MAX_LAYER_WORK", work - 1)
    step0(trainer, batch)
    assert forms == {True: 0, False: 0}, forms
    monkeypatch.setattr(ck, "LEAN_MAX_LAYER_WORK", work)
    step0(trainer, batch)
    assert forms[True] == len(unwrap_causal_lm(trainer.model).model.layers) and forms[False] == 0, forms


def test_a_4bit_weight_counts_its_own_shape():
    """A bitsandbytes 4-bit weight (two values packed to a byte, its shape in ``quant_state``) counts as the layer
    computes with it, not as stored."""
    import types

    packed = torch.nn.Parameter(torch.zeros(32, 1, dtype=torch.uint8), requires_grad=False)
    packed.quant_state = types.SimpleNamespace(shape=torch.Size([8, 8]))
    assert ck._param_count(packed) == 64
    assert ck._param_count(torch.zeros(3, 5)) == 15


class _Layer(torch.nn.Module):
    """Stands in for a decoder layer: ``function`` is a ``functools.partial`` of its forward, as transformers'."""

    def forward(self, x, scale=None, store=None):
        return x * 2 if scale is None else x * scale


def test_reentrant_only_where_equivalent():
    """Torch's form when no positional tensor requires grad (no gradient would reach the parameters), when a bound
    tensor does (the reentrant form would drop its gradient, in a tuple too), when an argument is a mutable or
    unknown object (a dict, a list, a store layers share K/V through), when the function is another module's,
    under no grad; the reentrant form for the layer's own forward with plain keywords."""
    from collections import UserDict

    layer = _Layer()
    x = torch.randn(2, 3, requires_grad=True)
    frozen = torch.randn(2, 3)

    def bound(**kwargs):
        return functools.partial(_Layer.forward, layer, **kwargs)

    plain = bound(scale=torch.ones(3), store=(frozen, None, 1, "sliding", torch.float32))
    assert ck.reentrant_is_equivalent(layer, plain, (x,))
    assert ck.reentrant_is_equivalent(layer, functools.partial(layer.__call__, scale=torch.ones(3)), (x,))
    assert not ck.reentrant_is_equivalent(layer, plain, (frozen,))
    assert not ck.reentrant_is_equivalent(layer, bound(scale=x), (x,))
    assert not ck.reentrant_is_equivalent(layer, bound(store=(frozen, x)), (x,))
    assert not ck.reentrant_is_equivalent(layer, bound(store={}), (x,))
    assert not ck.reentrant_is_equivalent(layer, bound(store=UserDict()), (x,))
    assert not ck.reentrant_is_equivalent(layer, plain, (x, [frozen]))
    assert not ck.reentrant_is_equivalent(layer, functools.partial(_Layer().__call__), (x,))
    with torch.no_grad():
        assert not ck.reentrant_is_equivalent(layer, plain, (x,))


def test_a_keyword_tensor_that_requires_grad_gets_its_gradient():
    """Through the lean layer call, a tensor bound as a keyword (which the reentrant form would not differentiate)
    gets the gradient of the plain computation (exact: the same ops)."""
    layer = _Layer()
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    out = ck._lean_layer_call(layer, functools.partial(_Layer.forward, layer, scale=w), x)
    out.tanh().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x * w).tanh().sum().backward()
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


def _lean_funcs(layers):
    return [isinstance(f, functools.partial) and f.func is ck._lean_layer_call
            for f in (layer._gradient_checkpointing_func for layer in layers)]


def test_other_checkpoint_functions_are_kept_and_restored_on_error(tok):
    """A layer whose function is not exactly TRL's default (offloading, other options) keeps it; the swapped ones
    are put back also when the call raises."""
    model = build_tiny_model(tok)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(TRL_DEFAULT))
    layers = list(model.model.layers)
    other = functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False)
    layers[0]._gradient_checkpointing_func = other
    before = [layer._gradient_checkpointing_func for layer in layers]
    ck._state(model.model).suits = True  # as after a first call that found each layer called once
    with pytest.raises(RuntimeError, match="boom"):
        with ck.lean_checkpointing(model.model):
            assert layers[0]._gradient_checkpointing_func is other
            assert _lean_funcs(layers[1:]) == [True] * (len(layers) - 1)
            raise RuntimeError("boom")
    assert [layer._gradient_checkpointing_func for layer in layers] == before


def test_a_looped_or_parameter_sharing_backbone_keeps_torchs_form(tok):
    """A backbone that calls one checkpointed layer twice per call (a looped model), or whose checkpointed layers
    share a trainable parameter with each other (Zamba's shared blocks) or with the rest of the backbone (a tied
    norm): each reentrant backward would mark the parameter ready under DDP, which raises; such a backbone never
    takes the lean form. A plain one does after its first call."""
    def run(model):
        ids = torch.randint(0, len(tok), (2, 8))
        for _ in range(2):
            with ck.lean_checkpointing(model.model):
                model.model(input_ids=ids).last_hidden_state.sum().backward()
        return ck._state(model.model).suits

    plain = build_tiny_model(tok)
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(TRL_DEFAULT))
    plain.train()
    assert run(plain) is True

    looped = build_tiny_model(tok)
    looped.model.layers.append(looped.model.layers[0])  # layer 0 runs twice
    looped.config.num_hidden_layers += 1
    looped.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(TRL_DEFAULT))
    looped.train()
    ck._state(looped.model).layers = list(looped.model.layers[:-1])  # as found in the module tree: each once
    assert run(looped) is False

    shared = build_tiny_model(tok)
    shared.model.layers[1].mlp.down_proj.weight = shared.model.layers[0].mlp.down_proj.weight
    assert ck._state(shared.model).suits is False
    tied_outside = build_tiny_model(tok)
    tied_outside.model.norm.weight = tied_outside.model.layers[0].input_layernorm.weight
    assert ck._state(tied_outside.model).suits is False


def test_a_first_call_in_eval_mode_decides_nothing(tok):
    """Transformers checkpoints only in training mode: a grad-mode call in eval mode counts no layer call, so it
    leaves the decision to the first training call (a looped backbone is still caught there)."""
    looped = build_tiny_model(tok)
    looped.model.layers.append(looped.model.layers[0])
    looped.config.num_hidden_layers += 1
    looped.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(TRL_DEFAULT))
    ids = torch.randint(0, len(tok), (2, 8))
    looped.eval()
    with ck.lean_checkpointing(looped.model):
        looped.model(input_ids=ids)
    assert ck._state(looped.model).suits is None
    looped.train()
    with ck.lean_checkpointing(looped.model):
        looped.model(input_ids=ids).last_hidden_state.sum().backward()
    assert ck._state(looped.model).suits is False


def test_unpatched_families_keep_torchs_form(tok):
    """A family whose decoder layers are not ours to vouch for (Phi here; transformers' Gemma-3n and Gemma-4
    share K/V between layers, Zamba parameters): torch's form."""
    from .test_unpatched_families import tiny_model

    assert ck.lean_allowed(build_tiny_model(tok))
    assert not ck.lean_allowed(tiny_model(tok, "phi"))


class _DDPLike(torch.nn.Module):
    def __init__(self, module, find_unused_parameters):
        super().__init__()
        self.module, self.find_unused_parameters = module, find_unused_parameters


class DeepSpeedEngine(torch.nn.Module):
    """Named as DeepSpeed's engine, which holds the model as ``.module`` and says its ZeRO stage."""

    def __init__(self, module, stage=2):
        super().__init__()
        self.module, self.stage = module, stage

    def zero_optimization_stage(self):
        return self.stage


class PipelineEngine(DeepSpeedEngine):
    """A subclass, as DeepSpeed's pipeline and hybrid engines are."""


def test_the_trainer_takes_it_only_where_the_model_allows(tok, tmp_path):
    """Not under a DDP that looks for unused parameters, not under a DeepSpeed engine past ZeRO-2 or a subclass of it
    (pipeline, hybrid), not on ZeRO-3 parameters (``ds_id``); under ZeRO-0-2's plain engine, yes; decided once per
    model and class."""
    trainer = SFTTrainer(build_tiny_model(tok), sft_config(tmp_path), train_dataset=sft_dataset(),
                         processing_class=tok, use_liger=True, liger_patch_model=False)
    plain = build_tiny_model(tok)
    sharded = build_tiny_model(tok)
    sharded.lm_head.weight.ds_id = 0
    for model, allowed in ((plain, True), (_DDPLike(build_tiny_model(tok), True), False),
                           (_DDPLike(build_tiny_model(tok), False), True), (sharded, False),
                           (DeepSpeedEngine(build_tiny_model(tok)), True),
                           (DeepSpeedEngine(build_tiny_model(tok), stage=3), False),
                           (PipelineEngine(build_tiny_model(tok)), False)):
        cm = trainer._liger_lean_checkpointing(model, backbone_of(unwrap_causal_lm(model)), {})
        assert trainer._liger_lean_allowed[(id(model), type(model))] is allowed
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


def test_gemma3n_sharing_kv_between_layers_equals_trl(tok, tmp_path):
    """Gemma-3n's later layers reuse the K/V earlier layers store in a dict passed to every layer: a no-grad forward
    would store K/V without a graph (the review's reproduction: embedding gradient 50% off). Its family is not one
    we patch, so its layers keep torch's form: two checkpointed steps equal TRL's (rel <= 1e-4)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    config = Gemma3nTextConfig(
        vocab_size=len(tok), vocab_size_per_layer_input=len(tok), hidden_size=32, intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        activation_sparsity_pattern=[0.0] * 4, laurel_rank=4, altup_num_inputs=2, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs, ours = make_pair(SFTTrainer, [Gemma3nForCausalLM(config).float()],
                             lambda d: sft_config(d, gradient_checkpointing=True), tmp_path, sft_dataset,
                             processing_class=tok)
    _checkpointed(theirs, ours)
    batch = first_batch(theirs)
    for _ in range(2):
        theirs.model.zero_grad()
        ours.model.zero_grad()
        check_compute_loss(theirs, ours, TOL, batch=batch)


@pytest.mark.gpu
def test_patched_kernels_give_the_same_gradients_in_both_forms(tok):
    """Our patched layer kernels take other paths under no grad (in-place RoPE, RMSNorm without its autograd
    Function): the lean form's loss comes from that no-grad forward, its gradient from the recompute. A patched tiny
    Llama in fp32 (CUDA when there is one): the backbone's output and every gradient of the second call equal
    torch's form's to a relative 1e-5 (fp32 math; the same kernels on the same inputs give the same bits)."""
    from liger_losses.patching import apply_liger_kernels, revert_liger_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        results = []
        for lean in (False, True):
            model = build_tiny_model(tok).to(device)
            apply_liger_kernels(model)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(TRL_DEFAULT))
            model.train()
            ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
            for _ in range(2):  # the second call is the lean one (the first counts the layer calls)
                model.zero_grad()
                with ck.lean_checkpointing(model.model, lean):
                    out = model.model(input_ids=ids).last_hidden_state
                out.float().pow(2).mean().backward()
            assert ck._state(model.model).suits is True or not lean
            results.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        (out_t, grads_t), (out_l, grads_l) = results
        assert float((out_l - out_t).norm() / out_t.norm()) <= 1e-5
        assert grads_t.keys() == grads_l.keys() and grads_t
        for name, g in grads_t.items():
            assert float((grads_l[name] - g).norm() / g.norm().clamp_min(1e-30)) <= 1e-5, name
    finally:
        revert_liger_kernels()
