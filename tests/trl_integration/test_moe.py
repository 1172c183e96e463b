"""Every trainer (use_liger=True: SFT, DPO, KTO, ORPO, CPO, GKD, distillation, GRPO, RLOO) on a tiny MoE vs TRL 1.16.

A tiny random Qwen3-MoE (2 layers, 4 experts, top-2, ``router_aux_loss_coef=0.5`` so the aux term
is far above the tolerance) built offline for the bundled character tokenizer. Parity: TRL's trainer
and ours on deep copies of the same weights and batch; loss, every metric TRL logs (``aux_loss``
included) and every parameter gradient (router weights included) agree to a relative error <= 1e-4
(the same fp32 math in another summation order agrees to ~1e-6). TRL 1.16 adds
``router_aux_loss_coef * aux_loss`` in each of these trainers (GRPO: divided by the accumulation steps
in training; RLOO, KTO, DPO: as is) and logs ``aux_loss``; so must ours. GRPO and RLOO: TRL's trainer
generates and scores the batch (old log-probs moved so that clipping acts), then both ``compute_loss``;
their short runs (3 steps, ``num_iterations=2``, the second step reusing the generations) log the same
numbers within 1e-3 (the issue's bar for trainer parity).
"""

import pytest
import torch

from liger_losses.patching.pad_free import varlen_call_count
from liger_losses.trl_integration import DPOTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer, SFTTrainer

from .test_grpo import _assert_logs_match, _batch, _config, _dataset, _reward_len, _step0, pad_rl_batch
from .test_kto import kto_config, unpaired_dataset
from .utils import (
    PAIRS,
    assert_grads_match,
    assert_metrics_match,
    check_compute_loss,
    dpo_config,
    first_batch,
    make_pair,
    preference_dataset,
    rel,
    sft_config,
    sft_dataset,
    train_logs,
    trl_config,
)

TOL = 1e-4
AUX_COEF = 0.5


def tiny_moe(tok, *, seed, family="qwen3_moe"):
    """A seeded random ``Qwen3MoeForCausalLM`` for ``tok`` (hidden 64, 4 experts of 32, top-2); ``family="olmoe"``:
    an ``OlmoeForCausalLM`` of the same sizes (experts of 128)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(moe_intermediate_size=32) if family == "qwen3_moe" else {}
    config = AutoConfig.for_model(
        family, vocab_size=len(tok), hidden_size=64, intermediate_size=128, **sizes,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=AUX_COEF, max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    generator = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # router weights are zeros at init: draw them so the routing is not uniform
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model


def _aux_matters(metrics, loss):
    assert metrics["aux_loss"] > 0
    assert AUX_COEF * metrics["aux_loss"] > 1e-2 * float(loss.detach())


@pytest.mark.parametrize("num_items_in_batch", [None, 37], ids=["token-mean", "num_items_in_batch"])
def test_sft_step0_parity_with_router_aux_loss(tok, tmp_path, num_items_in_batch):
    """SFT: loss (NLL + coef * aux, the aux divided by the accumulation steps when num_items_in_batch
    is given, as TRL: 2 steps here), entropy, accuracy, num_tokens, aux_loss and every gradient equal TRL's."""
    theirs, ours = make_pair(SFTTrainer, [tiny_moe(tok, seed=0)], lambda d: sft_config(d), tmp_path,
                             lambda: sft_dataset(), processing_class=tok)
    assert theirs.aux_loss_enabled and ours.aux_loss_enabled
    batch = first_batch(theirs)
    count = None if num_items_in_batch is None else torch.tensor(num_items_in_batch)
    losses, metrics = [], []
    for trainer in (theirs, ours):
        trainer._metrics["train"].clear()
        trainer.current_gradient_accumulation_steps = 2  # set by Trainer's loop; TRL divides the aux by it
        trainer.model.train()
        losses.append(trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=count))
        metrics.append({k: v[-1] for k, v in trainer._metrics["train"].items()})
    assert rel(losses[1].detach(), losses[0].detach()) <= TOL, (float(losses[1]), float(losses[0]))
    assert "aux_loss" in metrics[0]
    assert_metrics_match(metrics[1], metrics[0], TOL)
    _aux_matters(metrics[0], losses[0])
    assert_grads_match(losses[0], losses[1], theirs, ours, TOL)
    assert ours.model.model.layers[0].mlp.gate.weight.grad is not None


def test_sft_label_smoothing_keeps_the_router_aux_loss(tok, tmp_path):
    """The one deliberate difference from TRL 1.16 (``trl_integration/sft.py``): with label smoothing
    TRL's SFT step drops the router aux loss from the loss (its smoothing branch never weights it) but
    logs it; ours adds ``coef * aux`` as without smoothing. So ours = TRL's loss + coef * logged aux
    (rel <= 1e-4), and the logged metrics equal TRL's; our trainer warns of it at construction."""
    with pytest.warns(UserWarning, match="label-smoothing step leaves it out"):
        theirs, ours = make_pair(SFTTrainer, [tiny_moe(tok, seed=0)],
                                 lambda d: sft_config(d, label_smoothing_factor=0.1), tmp_path,
                                 lambda: sft_dataset(), processing_class=tok)
    batch = first_batch(theirs)
    losses, metrics = [], []
    for trainer in (theirs, ours):
        trainer._metrics["train"].clear()
        trainer.model.train()
        losses.append(trainer.compute_loss(trainer.model, dict(batch)))
        metrics.append({k: v[-1] for k, v in trainer._metrics["train"].items()})
    assert_metrics_match(metrics[1], metrics[0], TOL)
    _aux_matters(metrics[0], losses[0])
    expected = float(losses[0]) + AUX_COEF * metrics[0]["aux_loss"]
    assert rel(losses[1].detach(), torch.tensor(expected)) <= TOL, (float(losses[1]), expected)


def test_dpo_step0_parity_with_router_aux_loss(tok, tmp_path):
    """DPO with a reference model: loss (DPO + coef * the policy's aux loss), every metric TRL logs
    (aux_loss included) and every gradient equal TRL's."""
    models = [tiny_moe(tok, seed=0), tiny_moe(tok, seed=1)]
    theirs, ours = make_pair(DPOTrainer, models, lambda d: dpo_config(d), tmp_path,
                             lambda: preference_dataset(PAIRS), processing_class=tok)
    assert theirs.aux_loss_enabled and ours.aux_loss_enabled
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    assert "aux_loss" in m_t
    assert AUX_COEF * m_t["aux_loss"] > 1e-2  # the DPO loss is ~0.7 at step 0


def test_kto_step0_parity_with_router_aux_loss(tok, tmp_path):
    """KTO with a reference model: loss (KTO + coef * the policy's aux loss), every metric TRL logs (aux_loss,
    kl included) and every gradient (router weights included) equal TRL's."""
    models = [tiny_moe(tok, seed=0), tiny_moe(tok, seed=1)]
    theirs, ours = make_pair(KTOTrainer, models, lambda d: kto_config(d), tmp_path, unpaired_dataset,
                             processing_class=tok)
    assert theirs.aux_loss_enabled and ours.aux_loss_enabled
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    assert {"aux_loss", "kl"} <= set(m_t)
    assert AUX_COEF * m_t["aux_loss"] > 1e-2  # the KTO loss is ~0.5 at step 0
    assert ours.model.model.layers[0].mlp.gate.weight.grad is not None


def test_kto_short_run_tracks_trl(tok, tmp_path):
    """3 optimizer steps: each logged loss and aux_loss within 1e-3 of TRL's, the same names logged."""
    models = [tiny_moe(tok, seed=0), tiny_moe(tok, seed=1)]
    theirs, ours = make_pair(KTOTrainer, models, lambda d: kto_config(d, max_steps=3), tmp_path, unpaired_dataset,
                             processing_class=tok)
    lo, lt = train_logs(theirs, ours, steps=3, loss_tol=1e-3)
    for a, b in zip(lo, lt):
        assert rel(a["aux_loss"], b["aux_loss"]) <= 1e-3, (a["aux_loss"], b["aux_loss"])


def _rl_pair(trainer_cls, tok, tmp_path, config):
    """(TRL's trainer, ours) of ``trainer_cls`` on the tiny MoE saved at a path (TRL builds the reference of
    beta != 0 from it), ``config(run_dir)`` each."""
    path = tmp_path / "tiny-moe"
    tiny_moe(tok, seed=0).save_pretrained(path)
    out = []
    for use_liger in (False, True):
        extra = {"liger_patch_model": False, "liger_chunk_tokens": 3} if use_liger else {}
        out.append(trainer_cls(str(path), _reward_len, config(tmp_path / str(use_liger)), train_dataset=_dataset(),
                               processing_class=tok, use_liger=use_liger, **extra))
    assert all(t.aux_loss_enabled for t in out)
    return out


def _check_rl_step(theirs, ours, batch):
    loss_t, m_t = _step0(theirs, batch)
    loss_o, m_o = _step0(ours, batch)
    assert rel(loss_o, loss_t) <= TOL, (float(loss_o), float(loss_t))
    assert "aux_loss" in m_t
    assert_metrics_match(m_o, m_t, TOL)
    assert_grads_match(loss_t, loss_o, theirs, ours, TOL)
    assert ours.model.model.layers[0].mlp.gate.weight.grad is not None
    return m_t, loss_t


def _rl_run(theirs, ours, steps=3):
    """Train both with the same sampling seed; the logged numbers (aux_loss included) within 1e-3."""
    from transformers import set_seed

    for trainer in (theirs, ours):
        set_seed(0)
        trainer.train()
    lt = [h for h in theirs.state.log_history if "loss" in h]
    lo = [h for h in ours.state.log_history if "loss" in h]
    assert len(lt) == steps and all("aux_loss" in h for h in lt)
    _assert_logs_match(lo, lt, 1e-3)


@pytest.mark.parametrize("cfg", [dict(loss_type="dapo"), dict(loss_type="grpo", beta=0.04)],
                         ids=["dapo", "grpo-beta"])
def test_grpo_step0_parity_with_router_aux_loss(tok, tmp_path, cfg):
    """GRPO with 2 accumulation steps (TRL divides the aux term by them, as its policy loss): loss, every metric
    (aux_loss, clip ratios included) and every gradient equal TRL's; chunk boundaries inside completions."""
    theirs, ours = _rl_pair(GRPOTrainer, tok, tmp_path, lambda d: _config(d, gradient_accumulation_steps=2, **cfg))
    for t in (theirs, ours):
        t.current_gradient_accumulation_steps = 2
    m_t, loss_t = _check_rl_step(theirs, ours, _batch(theirs))
    assert AUX_COEF * m_t["aux_loss"] / 2 > 1e-3 * max(abs(float(loss_t.detach())), 1.0)  # the aux term shows


def test_grpo_step0_parity_pad_free_with_router_aux_loss(tok, tmp_path, monkeypatch):
    """Forced pad-free (the CPU's reference attention) with the aux loss: the policy's call packed, so its router
    logits are the attended tokens' alone and the balance counts the tokens TRL's padding mask counts; loss, every
    metric (aux_loss included) and every gradient equal TRL's padded step (rel <= 1e-4)."""
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    theirs, ours = _rl_pair(GRPOTrainer, tok, tmp_path, lambda d: _config(d, loss_type="grpo", beta=0.04))
    batch = pad_rl_batch(_batch(theirs))
    calls = varlen_call_count()
    m_t, _ = _check_rl_step(theirs, ours, batch)
    assert varlen_call_count() - calls == ours.model.config.num_hidden_layers
    assert m_t["aux_loss"] > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_dpo_step0_parity_pad_free_with_router_aux_loss(tok, tmp_path, monkeypatch, family):
    """Forced pad-free DPO with a reference model and the aux loss: the policy's and the reference's calls packed;
    loss, every metric (aux_loss included) and every gradient equal TRL's padded step (rel <= 1e-4); OLMoE (its
    own load-balancing function in transformers, its full-width q/k norms) as Qwen3-MoE."""
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    models = [tiny_moe(tok, seed=0, family=family), tiny_moe(tok, seed=1, family=family)]
    theirs, ours = make_pair(DPOTrainer, models, lambda d: dpo_config(d), tmp_path,
                             lambda: preference_dataset(PAIRS), processing_class=tok)
    batch = first_batch(theirs)
    assert not batch["attention_mask"].bool().all()  # padding to skip
    calls = varlen_call_count()
    m_t, _ = check_compute_loss(theirs, ours, TOL, batch=batch)
    assert varlen_call_count() - calls == 2 * ours.model.config.num_hidden_layers  # policy and reference
    assert m_t["aux_loss"] > 0


def test_grpo_training_parity_with_router_aux_loss(tok, tmp_path):
    """3 optimizer steps of dapo, num_iterations=2: loss and every logged metric (aux_loss included) within 1e-3."""
    theirs, ours = _rl_pair(GRPOTrainer, tok, tmp_path, lambda d: _config(d, max_steps=3, learning_rate=5e-3))
    _rl_run(theirs, ours)


def _rloo_config(run_dir, **overrides):
    import trl

    kwargs = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1,
                  num_iterations=2, beta=0.0, epsilon_high=0.28)
    kwargs.update(overrides)
    return trl_config(trl.RLOOConfig, run_dir, **kwargs)


def test_rloo_step0_parity_with_router_aux_loss(tok, tmp_path):
    """RLOO: loss (the unscaled clipped loss + coef * aux), every metric and every gradient equal TRL's."""
    theirs, ours = _rl_pair(RLOOTrainer, tok, tmp_path, _rloo_config)
    torch.manual_seed(0)
    theirs.model.train()
    batch = theirs._prepare_inputs(next(iter(theirs.get_train_dataloader())))
    g = torch.Generator().manual_seed(0)
    batch["old_logps"] = batch["old_logps"] + 0.5 * torch.randn(batch["old_logps"].shape, generator=g)
    m_t, loss_t = _check_rl_step(theirs, ours, batch)
    assert AUX_COEF * m_t["aux_loss"] > 1e-3 * max(abs(float(loss_t.detach())), 1.0)


def test_rloo_training_parity_with_router_aux_loss(tok, tmp_path):
    """3 optimizer steps, num_iterations=2: every logged number (aux_loss included) within 1e-3."""
    theirs, ours = _rl_pair(RLOOTrainer, tok, tmp_path,
                            lambda d: _rloo_config(d, max_steps=3, learning_rate=5e-3))
    _rl_run(theirs, ours)


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_paired_step0_parity_with_router_aux_loss(tok, tmp_path, kind):
    """ORPO and CPO (TRL's experimental trainers): loss (+ aux_loss_coef * the policy's aux loss, which
    TRL adds but does not log), every metric TRL returns and every gradient (the router's included) equal
    TRL's (rel <= 1e-4); the aux term is a visible part of the loss."""
    from .utils import check_batch_loss_metrics

    if kind == "orpo":
        from liger_losses.trl_integration.orpo import ORPOTrainer as trainer_cls

        from .test_orpo import orpo_config as config
    else:
        from liger_losses.trl_integration.cpo import CPOTrainer as trainer_cls

        from .test_cpo import cpo_config as config
    model = tiny_moe(tok, seed=0)
    model.config.output_router_logits = True  # what these trainers read to enable the aux loss
    theirs, ours = make_pair(trainer_cls, [model], lambda d: config(d), tmp_path,
                             lambda: preference_dataset(PAIRS), processing_class=tok)
    assert theirs.aux_loss_enabled and ours.aux_loss_enabled
    check_batch_loss_metrics(theirs, ours, TOL)
    batch = first_batch(theirs)
    with torch.no_grad():
        out = theirs.concatenated_forward(theirs.model, batch)
    assert AUX_COEF * float(out[-1]) > 1e-2  # TRL's aux loss, far above the tolerance


def test_gkd_step0_parity_on_moe(tok, tmp_path):
    """GKD with a MoE student and teacher (``output_router_logits`` on): TRL 1.16's GKD loss is the
    divergence alone (its compute_loss adds no aux loss), so ours equals it: loss and every student
    gradient (router included) within 1e-4."""
    from liger_losses.trl_integration.gkd import GKDTrainer

    from .test_gkd import chat_dataset, gkd_config

    models = [tiny_moe(tok, seed=0), tiny_moe(tok, seed=1)]
    for m in models:
        m.config.output_router_logits = True
    theirs, ours = make_pair(GKDTrainer, models, lambda d: gkd_config(d, beta=0.5), tmp_path, chat_dataset,
                             processing_class=tok)
    batch = first_batch(theirs)
    theirs.model.train()
    ours.model.train()
    loss_t = theirs.compute_loss(theirs.model, batch)
    loss_o = ours.compute_loss(ours.model, batch)
    assert float(loss_t) > 0
    assert rel(loss_o.detach(), loss_t.detach()) <= TOL, (float(loss_o), float(loss_t))
    assert_grads_match(loss_t, loss_o, theirs, ours, TOL)


def test_distillation_step0_parity_on_moe(tok, tmp_path):
    """The distillation trainer with a MoE student and teacher: on one generated batch, loss and every
    student gradient equal TRL's within 1e-4 (TRL's loss is the divergence alone, no aux loss). Router
    logits stay off: with them on, transformers' own generate (TRL's sampling) fails in the MoE
    load-balancing loss on the cached step's attention mask."""
    from liger_losses.trl_integration.distillation import DistillationTrainer

    from .test_distillation import _generated_batch, distill_config, prompt_dataset
    from .utils import step0

    models = [tiny_moe(tok, seed=0), tiny_moe(tok, seed=1)]
    theirs, ours = make_pair(DistillationTrainer, models, lambda d: distill_config(d), tmp_path, prompt_dataset,
                             processing_class=tok)
    batch = _generated_batch(theirs)
    loss_t, _ = step0(theirs, batch)
    loss_o, _ = step0(ours, batch)
    assert float(loss_t) > 0
    assert rel(loss_o.detach(), loss_t.detach()) <= TOL, (float(loss_o), float(loss_t))
    assert_grads_match(loss_t, loss_o, theirs, ours, TOL)


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_checkpointed_router_aux_loss_keeps_its_gradient(tok, tmp_path, kind):
    """Activation checkpointing on (TRL's default form): the router logits transformers collects with hooks inside
    the layers must carry their graph, so the policy's checkpointed forward stays in torch's form on this path; loss,
    metrics and every gradient (the routers' from the aux loss included) equal TRL's (rel <= 1e-4)."""
    if kind == "sft":
        models, cls, config, data = [tiny_moe(tok, seed=0)], SFTTrainer, sft_config, sft_dataset
    else:
        models, cls, config, data = [tiny_moe(tok, seed=0), tiny_moe(tok, seed=1)], DPOTrainer, dpo_config, \
            lambda: preference_dataset(PAIRS)
    theirs, ours = make_pair(cls, models, lambda d: config(d, gradient_checkpointing=True), tmp_path, data,
                             processing_class=tok)
    for trainer in (theirs, ours):
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    assert AUX_COEF * m_t["aux_loss"] > 1e-2
