"""Vision-language models whose text model is a supported family: ``apply_liger_kernels`` patches the text
model's layers and leaves the vision tower, the projector and the model's own loss as they are.

On text-only inputs the patched model computes what the unpatched one computes: loss, logits and every
gradient within 1e-5 relative error (fp32; the bar and its reason are test_families.py's: only summation
order differs, observed ~1e-6). Gemma-3's ConditionalGeneration class (what ``AutoModelForCausalLM`` loads for
Gemma-3 4B and up), Mistral-3 (Mistral-Small-3.x) and Llava (a Llama text model).
"""

import copy

import pytest
import torch

from liger_losses.patching import apply_liger_kernels
from liger_losses.patching.apply import family_and_target
from tests.helpers import TOL, assert_close_rel
from tests.patching.tiny_models import (
    COMPOSITES,
    assert_loss_and_grads,
    eval_logits,
    loss_and_grads,
    reference_outputs,
    tiny_batch,
    tiny_composite,
)

FP32 = TOL[torch.float32]


def _text_only(batch):
    return {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}


@pytest.mark.parametrize("model_type", sorted(COMPOSITES))
def test_text_model_is_patched_and_computes_what_it_did(model_type):
    """The text model's norms are ours and nothing outside it changed class; loss, gradients and logits on a
    text-only batch equal the unpatched model's (rel <= 1e-5)."""
    ref = tiny_composite(model_type)
    model = copy.deepcopy(ref)
    batch = _text_only(tiny_batch(ref.config.get_text_config()))
    ref_logits, ref_loss, ref_grads = reference_outputs(ref, batch)

    spec, text_model = family_and_target(model)
    assert spec.model_type == COMPOSITES[model_type] and text_model is not model
    outside = {name: type(m) for name, m in model.named_modules() if not any(m is t for t in text_model.modules())}
    assert apply_liger_kernels(model) is model
    assert {type(m).__name__ for m in text_model.modules() if "Norm" in type(m).__name__} <= {
        "LigerRMSNorm", "LigerGemmaRMSNorm"}
    assert {name: type(m) for name, m in model.named_modules() if name in outside} == outside

    out, grads = loss_and_grads(model, batch)
    assert set(grads) == set(ref_grads)
    assert_loss_and_grads(out, grads, ref_loss, ref_grads)
    assert_close_rel(eval_logits(model, batch), ref_logits, FP32, "logits")


def test_a_composite_without_a_supported_text_model_is_refused():
    """A model whose own type and text config are no family's gets the ValueError listing the supported types."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model_type must be one of"):
        apply_liger_kernels(model)
