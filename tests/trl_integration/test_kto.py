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

from liger_losses.trl_integration.kto import KTOTrainer

from .utils import PAIRS, assert_metrics_match, build_tiny_model, build_tokenizer, grads_of, preference_dataset, rel

TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def kto_config(tmp_path, **overrides):
    import trl

    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, max_length=32, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return trl.KTOConfig(**kwargs)


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
    policy = build_tiny_model(tok, seed=0)
    reference = build_tiny_model(tok, seed=1) if ref else None
    out = []
    for use_liger in (False, True):
        kwargs = dict(liger_kwargs or {}) if use_liger else {}
        if use_liger:
            kwargs.setdefault("liger_patch_model", False)
        out.append(KTOTrainer(
            copy.deepcopy(policy), copy.deepcopy(reference) if ref else None,
            args=kto_config(tmp_path / ("ours" if use_liger else "trl"), **cfg),
            train_dataset=unpaired_dataset(), processing_class=tok, peft_config=peft_config,
            use_liger=use_liger, **kwargs,
        ))
    return out


def _batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def _step0(trainer, batch):
    trainer._metrics["train"].clear()
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _check_step0(theirs, ours, batch=None):
    batch = _batch(theirs) if batch is None else batch
    loss_t, m_t = _step0(theirs, batch)
    loss_o, m_o = _step0(ours, batch)
    assert rel(loss_o.detach(), loss_t.detach()) <= TOL, (float(loss_o), float(loss_t))
    assert_metrics_match(m_o, m_t, TOL)
    loss_t.backward()
    loss_o.backward()
    g_t, g_o = grads_of(theirs.model), grads_of(ours.model)
    assert g_t.keys() == g_o.keys() and g_t
    for name, g in g_t.items():
        err = float((g_o[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= TOL, f"grad {name}: rel err {err:.2e}"
    return m_t


@pytest.mark.parametrize(
    "cfg",
    [dict(), dict(beta=0.5, desirable_weight=1.5, undesirable_weight=0.7), dict(loss_type="apo_zero_unpaired")],
    ids=["kto", "kto-weighted", "apo_zero_unpaired"],
)
def test_step0_parity_with_ref_model(tok, tmp_path, cfg):
    """Loss, every metric TRL logs (kl, entropy, logits, rewards, logps, margins) and every gradient equal TRL's
    (rel <= 1e-4), small tiles (chunk 5 tokens)."""
    theirs, ours = _pair(tok, tmp_path, liger_kwargs={"liger_chunk_tokens": 5}, **cfg)
    m_t = _check_step0(theirs, ours)
    assert {"kl", "entropy", "logits/chosen", "rewards/margins"} <= set(m_t)
    assert abs(m_t["rewards/margins"]) > 0  # policy != reference
    if not cfg:
        assert m_t["kl"] >= 0


def test_step0_parity_precomputed_ref_logps(tok, tmp_path):
    """precompute_ref_log_probs=True: our precomputed ref_logps / ref_KL_logps columns equal TRL's (rel <= 1e-4),
    and the step-0 loss, metrics and gradients computed from them match too."""
    theirs, ours = _pair(tok, tmp_path, precompute_ref_log_probs=True)
    for col in ("ref_logps", "ref_KL_logps"):
        a = torch.tensor(theirs.train_dataset[col])
        b = torch.tensor(ours.train_dataset[col])
        assert float((a - b).norm() / a.norm()) <= TOL, col
    batch = _batch(theirs)
    assert "ref_KL_logps" in batch
    _check_step0(theirs, ours, batch)


def test_step0_parity_peft_lora(tok, tmp_path):
    """PEFT LoRA (random non-zero B so the adapter changes the policy): the reference is the policy with the
    adapter disabled. Loss, metrics and LoRA gradients match TRL's (rel <= 1e-4)."""
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                          task_type="CAUSAL_LM")
    theirs, ours = _pair(tok, tmp_path, ref=False, peft_config=cfg)
    assert ours.ref_model is None
    m_t = _check_step0(theirs, ours)
    assert abs(m_t["rewards/margins"]) > 0


def test_short_run_tracks_trl(tok, tmp_path):
    """10 optimizer steps with our loss: each logged loss and kl track TRL's run (rel <= 1e-3, absolute 1e-6
    for a kl clamped at 0: fp32 sums in another order, amplified a little by Adam), logged names are TRL's."""
    theirs, ours = _pair(tok, tmp_path, max_steps=10)
    theirs.train()
    ours.train()
    lt = [h for h in theirs.state.log_history if "loss" in h]
    lo = [h for h in ours.state.log_history if "loss" in h]
    assert len(lt) == len(lo) == 10
    assert set(lt[0]) == set(lo[0])
    for a, b in zip(lo, lt):
        assert rel(a["loss"], b["loss"]) <= 1e-3, (a["loss"], b["loss"])
        assert abs(a["kl"] - b["kl"]) <= 1e-3 * abs(b["kl"]) + 1e-6


def test_use_liger_false_is_trl(tok, tmp_path):
    """use_liger=False is TRL's trainer: the same loss as trl.KTOTrainer itself, bit for bit."""
    import trl

    policy, reference = build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)
    ours = KTOTrainer(copy.deepcopy(policy), copy.deepcopy(reference), args=kto_config(tmp_path / "a"),
                      train_dataset=unpaired_dataset(), processing_class=tok)
    plain = trl.KTOTrainer(copy.deepcopy(policy), copy.deepcopy(reference), args=kto_config(tmp_path / "b"),
                           train_dataset=unpaired_dataset(), processing_class=tok)
    batch = _batch(plain)
    assert float(_step0(ours, batch)[0]) == float(_step0(plain, batch)[0])


@pytest.mark.parametrize("kwargs, exc", [({"liger_chunk_tokens": 0}, ValueError), ({"use_liger": 1}, TypeError)])
def test_bad_liger_options(tok, tmp_path, kwargs, exc):
    """Bad values of our own keywords raise before any work (ValueError/TypeError naming them)."""
    name = next(iter(kwargs))
    with pytest.raises(exc, match=name):
        KTOTrainer(build_tiny_model(tok), build_tiny_model(tok, seed=1), args=kto_config(tmp_path),
                   train_dataset=unpaired_dataset(), processing_class=tok, **{"use_liger": True, **kwargs})
