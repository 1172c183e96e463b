"""AutoLigerModelForCausalLM: load a saved tiny model offline and get it patched (fp32, 1e-5).

fp32 bar 1e-5 (tests/helpers.TOL): the loaded, patched model must compute the saved model's loss.
"""

import pytest
import torch

from liger_losses.patching import AutoLigerModelForCausalLM
from liger_losses.patching.causal_lm import is_liger_forward
from tests.helpers import TOL, assert_close_rel
from tests.patching.tiny_models import FAMILIES, tiny_batch, tiny_config, tiny_model


def test_from_pretrained_patches_saved_model(tmp_path):
    """save_pretrained of a tiny random Qwen3 then AutoLigerModelForCausalLM.from_pretrained (all
    offline): modules are ours, weights are the saved ones, and the training-mode loss equals the
    original model's HF loss within 1e-5."""
    from liger_losses.kernels.mlp import LigerSwiGLUMLP
    from liger_losses.kernels.rms_norm import LigerRMSNorm

    ref = tiny_model("qwen3")
    batch = tiny_batch(ref.config)
    with torch.no_grad():
        ref_loss = ref(**batch).loss
    ref.save_pretrained(tmp_path)
    model = AutoLigerModelForCausalLM.from_pretrained(
        tmp_path, local_files_only=True, attn_implementation="eager"
    )
    assert isinstance(model.model.layers[0].mlp, LigerSwiGLUMLP)
    assert isinstance(model.model.layers[0].self_attn.q_norm, LigerRMSNorm)
    assert is_liger_forward(model.forward)
    model.train()
    with torch.no_grad():
        out = model(**batch)
    assert out.logits is None
    assert_close_rel(out.loss, ref_loss, TOL[torch.float32], "loaded loss")


def test_flags_and_unsupported_type(tmp_path):
    """Liger flags are passed on (swiglu=False keeps HF MLPs); an unsupported saved model_type
    raises ValueError from its config, before any weights load; the class is not instantiable."""
    from transformers import GPT2Config
    from transformers.models.llama import modeling_llama as ml

    tiny_model("llama").save_pretrained(tmp_path / "llama")
    model = AutoLigerModelForCausalLM.from_pretrained(tmp_path / "llama", swiglu=False)
    assert isinstance(model.model.layers[0].mlp, ml.LlamaMLP)
    assert not isinstance(model.model.norm, ml.LlamaRMSNorm)

    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path / "gpt2")  # no weights
    with pytest.raises(ValueError, match="model_type must be one of"):
        AutoLigerModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    with pytest.raises(EnvironmentError):
        AutoLigerModelForCausalLM()


def test_from_config():
    """from_config builds a fresh random model of the config, patched."""
    from liger_losses.kernels.mlp import LigerGEGLUMLP

    model = AutoLigerModelForCausalLM.from_config(tiny_config("gemma"))
    assert isinstance(model.model.layers[0].mlp, LigerGEGLUMLP)


def test_from_config_of_a_composite_patches_its_text_model():
    """Gemma-3 4B+'s composite config (``AutoModelForCausalLM`` builds ``Gemma3ForConditionalGeneration``) is
    accepted and its text model patched."""
    from liger_losses.kernels.mlp import LigerGEGLUMLP
    from tests.patching.tiny_models import tiny_composite_config

    model = AutoLigerModelForCausalLM.from_config(tiny_composite_config("gemma3"))
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert isinstance(model.model.language_model.layers[0].mlp, LigerGEGLUMLP)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_from_pretrained_every_family(model_type, tmp_path):
    """Every supported family: a saved tiny random model loads through
    AutoLigerModelForCausalLM.from_pretrained (offline) patched (no transformers RMSNorm left, our
    forward), and its training-mode loss (MoE: router aux loss included) equals the saved model's
    transformers loss within 1e-5 (fp32)."""
    import importlib

    from liger_losses.patching.specs import FAMILIES as SPECS

    ref = tiny_model(model_type)
    batch = tiny_batch(ref.config)
    with torch.no_grad():
        ref_loss = ref(**batch).loss
    ref.save_pretrained(tmp_path)
    model = AutoLigerModelForCausalLM.from_pretrained(
        tmp_path, local_files_only=True, attn_implementation="eager"
    ).train()
    hf_norm = getattr(importlib.import_module(SPECS[model_type].module), SPECS[model_type].rms_norm)
    assert not any(isinstance(m, hf_norm) for m in model.modules())
    assert is_liger_forward(model.forward)
    with torch.no_grad():
        out = model(**batch)
    assert out.logits is None
    assert_close_rel(out.loss, ref_loss, TOL[torch.float32], "loaded loss")
