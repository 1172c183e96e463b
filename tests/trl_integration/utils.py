"""Helpers of the TRL-integration tests: tiny offline models, the local tokenizer, trainer pairs.

Everything is built locally (``liger_losses.demo``'s character tokenizer and tiny random Llama), fp32,
on the CPU; no download. ``make_pair`` builds TRL's trainer (``use_liger=False``) and ours
(``use_liger=True``) on deep copies of the same weights, so their losses and metrics can be compared.
"""

from __future__ import annotations

import copy
import math

import torch

from liger_losses.demo import build_tiny_model, build_tokenizer, preference_dataset

PAIRS = 8  # preference examples used by the tests


def dpo_config(tmp_path, **overrides):
    import trl

    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, max_length=32, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return trl.DPOConfig(**kwargs)


def sft_config(tmp_path, **overrides):
    import trl

    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, max_length=32, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return trl.SFTConfig(**kwargs)


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


__all__ = [
    "PAIRS", "build_tiny_model", "build_tokenizer", "preference_dataset", "dpo_config", "sft_config",
    "sft_dataset", "first_batch", "step0", "rel", "assert_metrics_match", "grads_of", "copy", "torch",
]
