"""SFT and DPO with gradient accumulation, then ``evaluate()``: ours against TRL's trainer, CPU, fp32.

With ``gradient_accumulation_steps > 1`` TRL's loss divides by ``num_items_in_batch``, the tokens of
all accumulated micro-batches, and its logged metrics average the micro-batches; a loss that took its
own batch's token count instead trains a differently weighted objective with the same logs at
accumulation 1. ``evaluate()`` runs the no-grad prediction step, a separate path. Tolerances: the
logged loss and metrics 1e-4 relative (fp32, summation order only; below 1e-3 in magnitude, as the
mean logits that cancel to ~1e-5 at initialisation, absolutely), the
weights after two optimizer steps 1e-3 (AdamW divides each gradient by its own running magnitude, so
entries with near-zero gradients amplify summation-order differences of ~1e-7 to ~2e-4).
"""

import pytest
import torch

from liger_losses.trl_integration import DPOTrainer, SFTTrainer

from .utils import PAIRS, build_tiny_model, dpo_config, make_pair, preference_dataset, sft_config, sft_dataset


def _pair(task, tok, tmp_path):
    common = dict(max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=2,
                  per_device_eval_batch_size=3)
    if task == "sft":
        return make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)], lambda d: sft_config(d, **common), tmp_path,
                         sft_dataset, processing_class=tok, eval_dataset=sft_dataset(6))
    return make_pair(DPOTrainer, [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=0)],
                     lambda d: dpo_config(d, **common), tmp_path, lambda: preference_dataset(PAIRS),
                     processing_class=tok, eval_dataset=preference_dataset(6))


def _assert_close(ours: dict, theirs: dict, tol: float, skip=("runtime", "per_second")):
    for key, ref in theirs.items():
        if not isinstance(ref, float) or any(s in key for s in skip):
            continue
        assert key in ours, f"{key} logged by TRL only"
        err = abs(ours[key] - ref) / max(abs(ref), 1e-3)
        assert err <= tol, f"{key}: ours {ours[key]} vs TRL {ref}"


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_accumulated_steps_then_evaluate_match_trl(tok, tmp_path, task):
    theirs, ours = _pair(task, tok, tmp_path)
    theirs.train()
    ours.train()
    logs_t = [h for h in theirs.state.log_history if "loss" in h]
    logs_o = [h for h in ours.state.log_history if "loss" in h]
    assert len(logs_t) == len(logs_o) == 2
    for o, t in zip(logs_o, logs_t):
        _assert_close(o, t, 1e-4)
    weights_t = dict(theirs.model.named_parameters())
    for name, p in ours.model.named_parameters():
        ref = weights_t[name].detach()
        assert float((p.detach() - ref).norm() / ref.norm()) <= 1e-3, name
    eval_t, eval_o = theirs.evaluate(), ours.evaluate()
    assert any(k != "eval_loss" and k.startswith("eval_") for k in eval_t)
    _assert_close(eval_o, eval_t, 1e-4)
    assert torch.isfinite(torch.tensor(eval_o["eval_loss"]))
