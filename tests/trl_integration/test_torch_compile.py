"""``torch_compile=True`` on the trainers: ours compiles too, and its steps equal TRL's compiled steps.

transformers' Trainer has accelerate wrap the prepared model in ``torch.compile`` (here
``backend="aot_eager"``: traced, no code generated, so it runs on the CPU). Our adapters call the
backbone, not the wrapper, so they compile the backbone under the wrapper's Dynamo context
(``LigerTrainerMixin._liger_backbone``); the fused loss runs eagerly after it. Checked: Dynamo built
graphs during our steps (before, our steps ran wholly eager), the policy's decoder is what was
compiled (SFT), and over two steps the logged losses
of TRL's and our step agree to 1e-4 (fp32 tiny models, the same math summed in another order).
"""

from __future__ import annotations

import pytest

from liger_losses.trl_integration import DPOTrainer, SFTTrainer
from liger_losses.trl_integration.base import unwrap_causal_lm

from .utils import (
    build_tiny_model,
    dpo_config,
    lora_config,
    make_pair,
    preference_dataset,
    rel,
    sft_config,
    sft_dataset,
)

pytestmark = pytest.mark.slow  # two trainers, each traced


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(config_fn):
    return lambda run_dir: config_fn(run_dir, max_steps=2, torch_compile=True, torch_compile_backend="aot_eager")


def _losses(trainer):
    """The logged losses of ``trainer.train()``; asserts that the step ran compiled graphs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer.train()
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _assert_same_losses(ours, theirs, tol):
    assert len(theirs) == len(ours) >= 1
    for a, b in zip(ours, theirs):
        assert rel(a, b) <= tol, (ours, theirs)


@pytest.mark.parametrize("patch", [False, True], ids=["hf-layers", "patched"])
def test_sft_step_under_torch_compile_matches_trl(tok, tmp_path, patch):
    theirs, ours = make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)], _compiled(sft_config), tmp_path,
                             sft_dataset, liger_kwargs={"liger_patch_model": patch}, processing_class=tok)
    loss_t, loss_o = _losses(theirs), _losses(ours)
    _assert_same_losses(loss_o, loss_t, 1e-4)
    # what ran compiled in ours: the policy's decoder, once, under the trainer's compile context
    (backbone, compiled), = ours._liger_compiled_backbones.items()
    assert backbone is unwrap_causal_lm(ours.model).model and compiled._orig_mod is backbone


def test_sft_lora_step_under_torch_compile_matches_trl(tok, tmp_path):
    """A PEFT LoRA policy (the compile wrapper holds the PeftModel), layers patched: the same bar."""
    theirs, ours = make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)], _compiled(sft_config), tmp_path,
                             sft_dataset, liger_kwargs={"liger_patch_model": True}, processing_class=tok,
                             peft_config=lora_config())
    loss_t, loss_o = _losses(theirs), _losses(ours)
    _assert_same_losses(loss_o, loss_t, 1e-4)


def test_dpo_step_under_torch_compile_matches_trl(tok, tmp_path):
    theirs, ours = make_pair(DPOTrainer, [build_tiny_model(tok, seed=0), build_tiny_model(tok, seed=0)],
                             _compiled(dpo_config), tmp_path, preference_dataset, processing_class=tok)
    loss_t, loss_o = _losses(theirs), _losses(ours)
    _assert_same_losses(loss_o, loss_t, 1e-4)


@pytest.mark.gpu
def test_sft_steps_under_inductor_on_cuda_match_trl(tok, tmp_path):
    """The same on CUDA with Inductor, bf16 autocast (fp32 weights), layers patched: both compile and
    train; the logged losses agree to 3e-2 (bf16 GEMMs in another order: the mixed-precision tests' bar)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    def config(run_dir):
        return sft_config(run_dir, max_steps=2, torch_compile=True, torch_compile_backend="inductor",
                          use_cpu=False, bf16=True)

    theirs, ours = make_pair(SFTTrainer, [build_tiny_model(tok, seed=0)], config, tmp_path, sft_dataset,
                             liger_kwargs={"liger_patch_model": True}, processing_class=tok)
    loss_t, loss_o = _losses(theirs), _losses(ours)
    _assert_same_losses(loss_o, loss_t, 3e-2)
