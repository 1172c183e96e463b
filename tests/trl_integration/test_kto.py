"""KTOTrainer(use_liger=True) against TRL 1.16's own (stable) KTO path, on tiny offline fp32 models.

Parity tests build TRL's trainer (use_liger=False) and ours on deep copies of the same weights and batch and
compare the loss, every metric TRL logs and every parameter gradient to a relative error <= 1e-4: both compute
the same fp32 math (log-softmax, sums, the KL estimate, the KTO formula) in a different order, so they agree to
~1e-6; 1e-4 leaves room for accumulation-order noise only. The reference model has other weights than the policy
(its own seed), so rewards and the KL estimate are not 0.
"""

import copy

import pytest
import torch

from liger_losses.patching.pad_free import varlen_call_count
from liger_losses.trl_integration.kto import KTOTrainer

from .utils import (
    PAIRS,
    build_tiny_model,
    check_compute_loss,
    first_batch,
    lora_config,
    make_pair,
    preference_dataset,
    step0,
    train_logs,
    trl_config,
)

TOL = 1e-4


def kto_config(tmp_path, **overrides):
    import trl

    return trl_config(trl.KTOConfig, tmp_path, **{"max_length": 32, **overrides})


def unpaired_dataset(n=PAIRS):
    """Each preference pair as two unpaired rows: (prompt, chosen, True) and (prompt, rejected, False)."""
    from datasets import Dataset

    rows = []
    for r in preference_dataset(n).to_list():
        rows.append({"prompt": r["prompt"], "completion": r["chosen"], "label": True})
        rows.append({"prompt": r["prompt"], "completion": r["rejected"], "label": False})
    return Dataset.from_list(rows)


def _pair(tok, tmp_path, *, ref=True, liger_kwargs=None, peft_config=None, **cfg):
    """(TRL trainer, our trainer) on copies of one policy (seed 0) and reference (seed 1)."""
    models = [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1) if ref else None]
    return make_pair(KTOTrainer, models, lambda run_dir: kto_config(run_dir, **cfg), tmp_path, unpaired_dataset,
                     liger_kwargs=liger_kwargs, processing_class=tok, peft_config=peft_config)


@pytest.mark.parametrize(
    "cfg",
    [dict(), dict(beta=0.5, desirable_weight=1.5, undesirable_weight=0.7), dict(loss_type="apo_zero_unpaired")],
    ids=["kto", "kto-weighted", "apo_zero_unpaired"],
)
def test_step0_parity_with_ref_model(tok, tmp_path, cfg):
    """Loss, every metric TRL logs (kl, entropy, logits, rewards, logps, margins) and every gradient equal TRL's
    (rel <= 1e-4), small tiles (chunk 5 tokens)."""
    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_chunk_tokens": 5}, **cfg)
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    assert {"kl", "entropy", "logits/chosen", "rewards/margins"} <= set(m_t)
    assert abs(m_t["rewards/margins"]) > 0  # policy != reference
    if not cfg:
        assert m_t["kl"] >= 0


def test_step0_parity_pad_free(tok, tmp_path, monkeypatch):
    """Forced pad-free (``LIGER_LOSSES_PAD_FREE=1``: every backbone call -- policy, reference, and both KL
    forwards -- on the attended tokens alone, packed; the CPU's reference attention) on TRL's padded batch: loss,
    every metric and every gradient equal TRL's (rel <= 1e-4)."""
    monkeypatch.setenv("LIGER_LOSSES_PAD_FREE", "1")
    theirs, ours = _pair(tok, tmp_path)
    batch = first_batch(theirs)
    assert not batch["attention_mask"].all() and not batch["KL_attention_mask"].all()
    calls = varlen_call_count()
    m_t, _ = check_compute_loss(theirs, ours, TOL, batch)
    assert varlen_call_count() - calls == 4 * ours.model.config.num_hidden_layers
    assert m_t["kl"] >= 0 and abs(m_t["rewards/margins"]) > 0


def test_step0_parity_precomputed_ref_logps(tok, tmp_path):
    """precompute_ref_log_probs=True: our precomputed ref_logps / ref_KL_logps columns equal TRL's (rel <= 1e-4),
    and the step-0 loss, metrics and gradients computed from them match too."""
    theirs, ours = _pair(tok, tmp_path, precompute_ref_log_probs=True)
    for col in ("ref_logps", "ref_KL_logps"):
        a = torch.tensor(theirs.train_dataset[col])
        b = torch.tensor(ours.train_dataset[col])
        assert float((a - b).norm() / a.norm()) <= TOL, col
    batch = first_batch(theirs)
    assert "ref_KL_logps" in batch
    check_compute_loss(theirs, ours, TOL, batch)


def test_step0_parity_peft_lora(tok, tmp_path):
    """PEFT LoRA (random non-zero B so the adapter changes the policy): the reference is the policy with the
    adapter disabled. Loss, metrics and LoRA gradients match TRL's (rel <= 1e-4)."""
    theirs, ours = _pair(tok, tmp_path, ref=False, peft_config=lora_config())
    assert ours.ref_model is None
    m_t, _ = check_compute_loss(theirs, ours, TOL)
    assert abs(m_t["rewards/margins"]) > 0


def test_short_run_tracks_trl(tok, tmp_path):
    """5 optimizer steps with our loss: each logged loss and kl track TRL's run (rel <= 1e-3, absolute 1e-6
    for a kl clamped at 0: fp32 sums in another order, amplified a little by Adam), logged names are TRL's."""
    theirs, ours = _pair(tok, tmp_path, max_steps=5)
    lo, lt = train_logs(theirs, ours, 5, loss_tol=1e-3)
    for a, b in zip(lo, lt):
        assert abs(a["kl"] - b["kl"]) <= 1e-3 * abs(b["kl"]) + 1e-6


def test_use_liger_false_is_trl(tok, tmp_path):
    """use_liger=False is TRL's trainer: the same loss as trl.KTOTrainer itself, bit for bit."""
    import trl

    policy, reference = build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)
    ours = KTOTrainer(copy.deepcopy(policy), copy.deepcopy(reference), args=kto_config(tmp_path / "a"),
                      train_dataset=unpaired_dataset(), processing_class=tok)
    plain = trl.KTOTrainer(copy.deepcopy(policy), copy.deepcopy(reference), args=kto_config(tmp_path / "b"),
                           train_dataset=unpaired_dataset(), processing_class=tok)
    batch = first_batch(plain)
    assert float(step0(ours, batch)[0]) == float(step0(plain, batch)[0])


@pytest.mark.parametrize("kwargs, exc", [({"liger_chunk_tokens": 0}, ValueError), ({"use_liger": 1}, TypeError)])
def test_bad_liger_options(tok, tmp_path, kwargs, exc):
    """Bad values of our own keywords raise before any work (ValueError/TypeError naming them)."""
    name = next(iter(kwargs))
    with pytest.raises(exc, match=name):
        KTOTrainer(build_tiny_model(tok), build_tiny_model(tok, seed=1), args=kto_config(tmp_path),
                   train_dataset=unpaired_dataset(), processing_class=tok, **{"use_liger": True, **kwargs})
