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
from tests.patching.tiny_models import COMPOSITES, loss_and_grads, tiny_batch, tiny_composite

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
    ref.eval()
    with torch.no_grad():
        ref_logits = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    ref.train()
    ref_out, ref_grads = loss_and_grads(ref, batch)  # the reference runs before the process-wide RoPE patch

    spec, text_model = family_and_target(model)
    assert spec.model_type == COMPOSITES[model_type] and text_model is not model
    outside = {name: type(m) for name, m in model.named_modules() if not any(m is t for t in text_model.modules())}
    assert apply_liger_kernels(model) is model
    assert {type(m).__name__ for m in text_model.modules() if "Norm" in type(m).__name__} <= {
        "LigerRMSNorm", "LigerGemmaRMSNorm"}
    assert {name: type(m) for name, m in model.named_modules() if name in outside} == outside

    out, grads = loss_and_grads(model, batch)
    assert_close_rel(out.loss, ref_out.loss.detach(), FP32, "loss")
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert_close_rel(grads[name], g, FP32, f"grad {name}")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert_close_rel(logits, ref_logits, FP32, "logits")


def test_a_composite_without_a_supported_text_model_is_refused():
    """A model whose own type and text config are no family's gets the ValueError listing the supported types."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="model_type must be one of"):
        apply_liger_kernels(model)
