"""Helpers of the TRL-integration tests: tiny offline models, the local tokenizer, trainer pairs.

Everything is built locally (``liger_losses.demo``'s character tokenizer and tiny random Llama), fp32,
on the CPU; no download. ``make_pair`` builds TRL's trainer (``use_liger=False``) and ours
(``use_liger=True``) on deep copies of the same weights, so their losses and metrics can be compared;
``trl_config`` gives the short deterministic run config of every trainer, ``assert_grads_match`` /
``check_batch_loss_metrics`` / ``train_logs`` the comparisons the test modules share.
"""

from __future__ import annotations

import copy
import math

import torch

from liger_losses.demo import build_tiny_model, build_tokenizer, preference_dataset

PAIRS = 8  # preference examples used by the tests

# Preference rows whose chosen and rejected completions differ in length within each pair (the bundled set's pairs
# are of one length): what LD-DPO's shared-length weights, the length-normalised types and WPO's per-sequence means
# need to be tested at all.
UNEVEN_PAIRS = [
    {"prompt": "6+6=", "chosen": "12", "rejected": "6612"},
    {"prompt": "qrst>", "chosen": "uvwxy", "rejected": "r"},
    {"prompt": "ghc|", "chosen": "c", "rejected": "ghcab"},
    {"prompt": "5+9=", "chosen": "14", "rejected": "1"},
    {"prompt": "ab>", "chosen": "cdefg", "rejected": "cd"},
    {"prompt": "eba|", "chosen": "abe", "rejected": "ebaeba"},
    {"prompt": "4+8=", "chosen": "1", "rejected": "148"},
    {"prompt": "efgh>", "chosen": "ijkl", "rejected": "fg"},
]


def uneven_preference_dataset():
    """:data:`UNEVEN_PAIRS` as a ``datasets.Dataset``."""
    from datasets import Dataset

    return Dataset.from_list(UNEVEN_PAIRS)


def trl_config(config_cls, tmp_path, **overrides):
    """A TRL ``config_cls`` for a short deterministic fp32 CPU run writing to ``tmp_path``; ``overrides`` win."""
    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def dpo_config(tmp_path, **overrides):
    import trl

    return trl_config(trl.DPOConfig, tmp_path, **{"max_length": 32, **overrides})


def sft_config(tmp_path, **overrides):
    import trl

    return trl_config(trl.SFTConfig, tmp_path, **{"max_length": 32, **overrides})


def make_pair(trainer_cls, models, config, tmp_path, dataset, *, liger_kwargs=None, **trainer_kwargs):
    """[TRL's trainer (``use_liger=False``), ours (``use_liger=True``)], each
    ``trainer_cls(*deep copies of models, config(run_dir), train_dataset=dataset(), **trainer_kwargs)`` with its
    own ``run_dir`` under ``tmp_path``; ours also gets ``liger_kwargs`` (``liger_patch_model=False`` unless given)."""
    out = []
    for use_liger in (False, True):
        kwargs = {"liger_patch_model": False, **(liger_kwargs or {})} if use_liger else {}
        out.append(trainer_cls(
            *[copy.deepcopy(m) for m in models], config(tmp_path / ("ours" if use_liger else "trl")),
            train_dataset=dataset(), use_liger=use_liger, **trainer_kwargs, **kwargs,
        ))
    return out


def student_teacher(tok):
    """[student (seed 0), teacher (seed 1, wider: H=96)] tiny models of the distillation tests."""
    return [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1, hidden_size=96)]


def check_compute_loss(theirs, ours, tol, batch=None, skip=()):
    """:func:`step0` of TRL's and our trainer on ``batch`` (TRL's first one by default): loss and every metric
    TRL logs (but ``skip``) agree to a relative error <= ``tol``, then every gradient (:func:`assert_grads_match`).
    ``(TRL's metrics, ours)``."""
    batch = first_batch(theirs) if batch is None else batch
    loss_t, m_t = step0(theirs, dict(batch))  # each its own dict: TRL's MoE step adds output_router_logits to it
    loss_o, m_o = step0(ours, dict(batch))
    assert rel(loss_o, loss_t) <= tol, (float(loss_o), float(loss_t))
    assert_metrics_match(m_o, m_t, tol, skip=skip)
    assert_grads_match(loss_t, loss_o, theirs, ours, tol)
    return m_t, m_o


def check_batch_loss_metrics(theirs, ours, tol, train_eval="train"):
    """``get_batch_loss_metrics`` of TRL's and our trainer on TRL's first batch: loss and every metric TRL
    returns agree to a relative error <= ``tol``, then every gradient (:func:`assert_grads_match`). TRL's metrics."""
    batch = first_batch(theirs)
    theirs.model.train()
    ours.model.train()
    loss_t, m_t = theirs.get_batch_loss_metrics(theirs.model, batch, train_eval)
    loss_o, m_o = ours.get_batch_loss_metrics(ours.model, batch, train_eval)
    assert rel(loss_o.detach(), loss_t.detach()) <= tol, (float(loss_o), float(loss_t))
    assert_metrics_match(m_o, m_t, tol)
    assert_grads_match(loss_t, loss_o, theirs, ours, tol)
    return m_t


def sft_dataset(n=PAIRS, conversational=False):
    """Prompt/completion pairs (prompt, chosen) of the bundled preference set."""
    from datasets import Dataset

    rows = preference_dataset(n).to_list()
    if conversational:
        return Dataset.from_list([
            {"prompt": [{"role": "user", "content": r["prompt"]}],
             "completion": [{"role": "assistant", "content": r["chosen"]}]} for r in rows
        ])
    return Dataset.from_list([{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows])


def first_batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def step0(trainer, batch):
    """Loss and logged metrics of one compute_loss call (metrics cleared first)."""
    trainer._metrics["train"].clear()
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss, metrics


def rel(a, b):
    a, b = float(a), float(b)
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(b), 1e-12)


def assert_metrics_match(ours, theirs, tol, skip=()):
    assert set(theirs) <= set(ours), f"metrics TRL logs but we don't: {sorted(set(theirs) - set(ours))}"
    for key, ref in theirs.items():
        if key in skip:
            continue
        val = ours[key]
        # metrics that are exactly 0 at step 0 (rewards with policy == reference) compare absolutely
        err = abs(val - ref) if abs(ref) < 1e-6 else rel(val, ref)
        assert err <= tol or (math.isnan(val) and math.isnan(ref)), f"{key}: ours {val} vs TRL {ref} (err {err:.2e})"


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_match(loss_t, loss_o, theirs, ours, tol):
    """Backward both losses; TRL's and our model then hold gradients for the same (non-empty) set of
    parameters, each equal to TRL's to a relative error (Frobenius norm) <= ``tol``."""
    loss_t.backward()
    loss_o.backward()
    g_t, g_o = grads_of(theirs.model), grads_of(ours.model)
    assert g_t.keys() == g_o.keys() and g_t
    for name, g in g_t.items():
        err = float((g_o[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= tol, f"grad {name}: rel err {err:.2e}"


def train_logs(theirs, ours, steps=10, *, same_names=True, loss_tol=None):
    """Train both trainers; ``(our loss logs, TRL's)``, after checking both logged ``steps`` entries (under the
    same names when ``same_names``; each loss within relative error ``loss_tol`` of TRL's when given)."""
    theirs.train()
    ours.train()
    lt = [h for h in theirs.state.log_history if "loss" in h]
    lo = [h for h in ours.state.log_history if "loss" in h]
    assert len(lt) == len(lo) == steps
    if same_names:
        assert set(lt[0]) == set(lo[0])
    if loss_tol is not None:
        for a, b in zip(lo, lt):
            assert rel(a["loss"], b["loss"]) <= loss_tol, (a["loss"], b["loss"])
    return lo, lt


def lora_config():
    """A PEFT LoRA config (r=4 on q/v) with random non-zero B, so the adapter changes the policy; skips the test
    when peft is not installed."""
    import pytest

    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                           task_type="CAUSAL_LM")


def policy_pair(trainer_cls, config, tok, tmp_path, *, liger_kwargs=None, **cfg):
    """:func:`make_pair` of ``trainer_cls`` on copies of one policy (seed 0), ``config(run_dir, **cfg)`` and the
    preference set."""
    return make_pair(trainer_cls, [build_tiny_model(tok, seed=0)], lambda run_dir: config(run_dir, **cfg), tmp_path,
                     lambda: preference_dataset(PAIRS), liger_kwargs=liger_kwargs, processing_class=tok)


def record_backbone_autocast(trainer, device_type="cpu"):
    """Attach forward pre-hooks to the backbones (the decoders under the LM heads) of ``trainer``'s policy, reference
    and teacher; returns the set they fill, at every call, with ``(role, grad mode on, autocast on for
    device_type, its dtype or None)``."""
    from liger_losses.trl_integration.base import backbone_of, unwrap_causal_lm

    seen = set()
    roles = {"policy": trainer.model, "reference": getattr(trainer, "ref_model", None),
             "teacher": getattr(trainer, "teacher_model", None)}
    for role, model in roles.items():
        if model is None:
            continue

        def hook(module, args, kwargs, role=role):
            on = torch.is_autocast_enabled(device_type)
            seen.add((role, torch.is_grad_enabled(), on, torch.get_autocast_dtype(device_type) if on else None))

        backbone_of(unwrap_causal_lm(model)).register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def assert_autocast_records_match(seen_ours, seen_trl):
    """Our trainer's :func:`record_backbone_autocast` records are TRL's, plus at most the first step's logits check
    (``trl_integration/logit_check.py``): one no-grad forward of each model in an autocast state one of TRL's
    records of that model has (for a policy, a record TRL's step may not have; a reference or teacher runs no grad
    anyway)."""
    allowed = {(role, False, on, dtype) for role, _, on, dtype in seen_trl}
    assert seen_trl and set(seen_trl) <= set(seen_ours) and set(seen_ours) - set(seen_trl) <= allowed, (
        f"ours {sorted(map(str, seen_ours))} vs TRL {sorted(map(str, seen_trl))}")


__all__ = [
    "PAIRS", "UNEVEN_PAIRS", "uneven_preference_dataset", "build_tiny_model", "build_tokenizer", "preference_dataset",
    "trl_config", "dpo_config", "sft_config",
    "make_pair", "policy_pair", "student_teacher", "sft_dataset", "first_batch", "step0", "rel",
    "assert_metrics_match", "grads_of", "assert_grads_match", "check_batch_loss_metrics", "check_compute_loss",
    "train_logs", "lora_config", "record_backbone_autocast", "assert_autocast_records_match", "copy", "torch",
]
