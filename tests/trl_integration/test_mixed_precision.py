"""Every trainer with ``use_liger=True`` runs its models under the autocast TRL's own trainer runs them under.

accelerate applies ``bf16=True`` by wrapping the prepared model's ``forward`` in an autocast context; our adapters
run the backbone as the model's forward (``LigerTrainerMixin._liger_run``), so they must apply the same context
(``base.forward_autocast``) or the policy, its PEFT adapters and the reference would train in the weights' dtype.

Each test trains TRL's trainer (``use_liger=False``) and ours for one optimizer step through ``Trainer.train`` (so
accelerate prepares the models as in a real run) and records, at every call of a backbone (the decoder under the
LM head) of the policy, reference or teacher: the model's role, whether grad mode is on, whether CPU autocast is on
and its dtype. Ours must hold TRL's records and, beyond them, only the first step's logits check (one no-grad
forward of each model in a state TRL's records have, ``utils.assert_autocast_records_match``): exact, no tolerance.
The tiny models are fp32, so with ``bf16=True`` autocast is the only source of bf16 compute. The logged loss of
TRL's and our step must then agree to a relative 3e-2: both run bf16 GEMMs, ours tile by tile in another order,
and a bf16 logit carries a relative rounding error of 2^-8 = 3.9e-3 that sums over the vocabulary and tokens.
"""

from __future__ import annotations

import pytest
import torch

from liger_losses.trl_integration import DPOTrainer, SFTTrainer
from liger_losses.trl_integration.base import forward_autocast

from .utils import (
    PAIRS,
    assert_autocast_records_match,
    build_tiny_model,
    dpo_config,
    lora_config,
    make_pair,
    preference_dataset,
    record_backbone_autocast,
    rel,
    sft_config,
    sft_dataset,
    student_teacher,
)

BF16_LOSS_TOL = 3e-2



def _check_same_autocast(theirs, ours, *, expect_autocast: bool, loss_tol=BF16_LOSS_TOL):
    """One training step each; equal backbone records, the expected autocast state, close losses."""
    seen_t, seen_o = record_backbone_autocast(theirs), record_backbone_autocast(ours)
    theirs.train()
    ours.train()
    assert seen_t, "TRL's step ran no backbone"
    assert_autocast_records_match(seen_o, seen_t)
    assert {on for _, _, on, _ in seen_t} == {expect_autocast}
    loss_t = [h["loss"] for h in theirs.state.log_history if "loss" in h]
    loss_o = [h["loss"] for h in ours.state.log_history if "loss" in h]
    assert len(loss_t) == len(loss_o) == 1
    assert rel(loss_o[0], loss_t[0]) <= loss_tol, (loss_o[0], loss_t[0])


def _one_step(config_fn, **cfg):
    return lambda run_dir: config_fn(run_dir, max_steps=1, **cfg)


# ----------------------------------------------------------------------------------------------- SFT / DPO matrix


@pytest.mark.parametrize("patch", [False, True], ids=["hf-layers", "patched"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_sft_autocast_matches_trl(tok, tmp_path, patch, precision):
    """SFT, full fine-tuning: bf16=True runs the backbone under bf16 autocast as TRL does; fp32 runs none."""
    theirs, ours = make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)],
                             _one_step(sft_config, bf16=precision == "bf16"), tmp_path, sft_dataset,
                             liger_kwargs={"liger_patch_model": patch}, processing_class=tok)
    _check_same_autocast(theirs, ours, expect_autocast=precision == "bf16",
                         loss_tol=BF16_LOSS_TOL if precision == "bf16" else 1e-4)


@pytest.mark.slow
def test_sft_peft_autocast_matches_trl(tok, tmp_path):
    """SFT with a LoRA adapter (fp32 adapter weights, as PEFT keeps them): the adapter runs under TRL's autocast."""
    theirs, ours = make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)], _one_step(sft_config, bf16=True),
                             tmp_path, sft_dataset, processing_class=tok, peft_config=lora_config())
    _check_same_autocast(theirs, ours, expect_autocast=True)


@pytest.mark.parametrize(
    "ref, peft, patch, cfg",
    [
        (True, False, False, {}),
        (True, False, True, {}),
        (False, True, False, {}),
        (True, False, False, {"precompute_ref_log_probs": True}),
    ],
    ids=["ref-model", "ref-model-patched", "peft-adapter-off-reference", "precomputed-reference"],
)
def test_dpo_autocast_matches_trl(tok, tmp_path, ref, peft, patch, cfg):
    """DPO under bf16=True: policy and reference (a reference model, the PEFT policy with its adapter off, or the
    precompute pass) run under the autocast TRL runs them under."""
    models = [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1) if ref else None]
    theirs, ours = make_pair(DPOTrainer, models, _one_step(dpo_config, bf16=True, **cfg), tmp_path,
                             lambda: preference_dataset(PAIRS), liger_kwargs={"liger_patch_model": patch},
                             processing_class=tok, peft_config=lora_config() if peft else None)
    _check_same_autocast(theirs, ours, expect_autocast=True)


# ----------------------------------------------------------------------------------------------- the other trainers


def test_kto_autocast_matches_trl(tok, tmp_path):
    from liger_losses.trl_integration.kto import KTOTrainer

    from .test_kto import kto_config, unpaired_dataset

    models = [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=1)]
    theirs, ours = make_pair(KTOTrainer, models, _one_step(kto_config, bf16=True), tmp_path, unpaired_dataset,
                             processing_class=tok)
    _check_same_autocast(theirs, ours, expect_autocast=True)


@pytest.mark.parametrize("name", ["cpo", "orpo"])
def test_cpo_orpo_autocast_matches_trl(tok, tmp_path, name):
    if name == "cpo":
        from liger_losses.trl_integration.cpo import CPOTrainer as cls

        from .test_cpo import cpo_config as config
    else:
        from liger_losses.trl_integration.orpo import ORPOTrainer as cls

        from .test_orpo import orpo_config as config
    theirs, ours = make_pair(cls, [build_tiny_model(tok, seed=0)], _one_step(config, bf16=True), tmp_path,
                             lambda: preference_dataset(PAIRS), processing_class=tok)
    _check_same_autocast(theirs, ours, expect_autocast=True)


def test_gkd_autocast_matches_trl(tok, tmp_path):
    from liger_losses.trl_integration.gkd import GKDTrainer

    from .test_gkd import chat_dataset, gkd_config

    theirs, ours = make_pair(GKDTrainer, student_teacher(tok), _one_step(gkd_config, bf16=True), tmp_path,
                             chat_dataset, processing_class=tok)
    _check_same_autocast(theirs, ours, expect_autocast=True)


@pytest.mark.slow
def test_distillation_autocast_matches_trl(tmp_path):
    """TRL's DistillationTrainer runs its loss through its own forward redirection (which replaces the prepared
    forward, autocast wrapper included); ours keeps TRL's redirection, so both run the same way."""
    from liger_losses.trl_integration.distillation import DistillationTrainer

    from .test_distillation import distill_config, prompt_dataset
    from .utils import build_tokenizer

    tok = build_tokenizer()
    tok.padding_side = "left"
    theirs, ours = make_pair(DistillationTrainer, student_teacher(tok), _one_step(distill_config, bf16=True),
                             tmp_path, prompt_dataset, processing_class=tok)
    seen_t, seen_o = record_backbone_autocast(theirs), record_backbone_autocast(ours)
    theirs.train()
    ours.train()
    assert_autocast_records_match(seen_o, seen_t)


# ----------------------------------------------------------------------------------------------- the helper itself


def test_forward_autocast_follows_accelerate_wrapper():
    """``forward_autocast`` is accelerate's autocast exactly when ``prepare_model`` wrapped the module's forward
    (under DDP-style ``.module`` wrappers too), and a null context otherwise."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # a state another test of this process left (its own mixed precision) would refuse this one's bf16; and this
    # one's is not left to the next
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        _check_forward_autocast(Accelerator(cpu=True, mixed_precision="bf16"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _check_forward_autocast(accelerator):
    model = torch.nn.Linear(4, 4)
    with forward_autocast(model, accelerator):
        assert not torch.is_autocast_enabled("cpu")
    prepared = accelerator.prepare_model(torch.nn.Linear(4, 4), evaluation_mode=True)

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    for m in (prepared, Wrapper(prepared)):
        with forward_autocast(m, accelerator):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with forward_autocast(prepared, None):
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("patch", [True, False], ids=["patched", "not-patched"])
def test_sft_peft_step_takes_the_fused_lora_forward(tok, tmp_path, monkeypatch, patch):
    """SFT with a LoRA adapter and bf16=True: with layer patching every LoRA linear of the policy runs the
    fused adapter forward (``patching/lora.py``; PEFT's class forward is never entered), without it PEFT's;
    the step's loss agrees with TRL's within the bf16 tolerance of the module docstring either way."""
    peft = pytest.importorskip("peft")
    cls = peft.tuners.lora.layer.Linear
    calls = []
    original = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    theirs, ours = make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)], _one_step(sft_config, bf16=True),
                             tmp_path, sft_dataset, processing_class=tok, peft_config=lora_config(),
                             liger_kwargs={"liger_patch_model": patch})
    theirs.train()
    assert calls, "TRL's step ran no LoRA linear"
    calls.clear()
    ours.train()
    assert (calls == []) == patch
    loss_t = [h["loss"] for h in theirs.state.log_history if "loss" in h]
    loss_o = [h["loss"] for h in ours.state.log_history if "loss" in h]
    assert rel(loss_o[0], loss_t[0]) <= BF16_LOSS_TOL
