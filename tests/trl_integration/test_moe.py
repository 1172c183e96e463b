"""SFT and DPO trainers (use_liger=True) on a tiny MoE model against TRL 1.16, router aux loss included.

A tiny random Qwen3-MoE (2 layers, 4 experts, top-2, ``router_aux_loss_coef=0.5`` so the aux term
is far above the tolerance) built offline for the bundled character tokenizer. Parity: TRL's trainer
and ours on deep copies of the same weights and batch; loss, every metric TRL logs (``aux_loss``
included) and every parameter gradient (router weights included) agree to a relative error <= 1e-4
(the same fp32 math in another summation order agrees to ~1e-6).
"""

import pytest
import torch

from liger_losses.trl_integration import DPOTrainer, SFTTrainer

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
)

TOL = 1e-4
AUX_COEF = 0.5


def tiny_moe(tok, *, seed):
    """A seeded random ``Qwen3MoeForCausalLM`` for ``tok`` (hidden 64, 4 experts of 32, top-2)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=AUX_COEF, max_position_embeddings=128,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    generator = torch.Generator().manual_seed(seed)
    model = Qwen3MoeForCausalLM(config)
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
