"""Patch machinery: class-level patching, revert, idempotency, PEFT wrappers (fp32, 1e-5).

fp32 bar 1e-5 (tests/helpers.TOL) where numbers are compared: our kernels and HF differ only in
summation order.
"""

import copy

import pytest
import torch

from liger_losses.patching import (
    apply_liger_kernels,
    apply_liger_kernels_to_gemma2,
    apply_liger_kernels_to_llama,
    revert_liger_kernels,
)
from liger_losses.patching.causal_lm import is_liger_forward
from liger_losses.patching.core import is_rope_patched
from liger_losses.patching.specs import FAMILIES as SPECS
from tests.helpers import TOL, assert_close_rel
from tests.patching.tiny_models import FAMILIES, loss_and_grads, tiny_batch, tiny_config, tiny_model

FP32 = TOL[torch.float32]


def test_class_level_patch_and_revert():
    """apply_liger_kernels_to_llama() (no model) makes models built afterwards use our norms, MLPs,
    RoPE and forward; revert_liger_kernels() restores HF's module attributes and class forward, so
    later models are plain HF again."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama as ml

    from liger_losses.kernels.mlp import LigerSwiGLUMLP
    from liger_losses.kernels.rms_norm import LigerRMSNorm

    hf_norm, hf_mlp, hf_rope = ml.LlamaRMSNorm, ml.LlamaMLP, ml.apply_rotary_pos_emb
    hf_forward = ml.LlamaForCausalLM.forward
    assert apply_liger_kernels_to_llama() is None
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert isinstance(model.model.norm, LigerRMSNorm)
    assert isinstance(model.model.layers[1].mlp, LigerSwiGLUMLP)
    assert is_liger_forward(ml.LlamaForCausalLM.forward) and is_liger_forward(model.forward)
    assert is_rope_patched("llama")

    revert_liger_kernels("llama")
    assert (ml.LlamaRMSNorm, ml.LlamaMLP, ml.apply_rotary_pos_emb) == (hf_norm, hf_mlp, hf_rope)
    assert ml.LlamaForCausalLM.forward is hf_forward
    fresh = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert type(fresh.model.norm) is hf_norm and not is_rope_patched("llama")


def test_class_level_model_matches_hf():
    """A model built after class-level patching of Gemma-2 (GeGLU via hidden_activation, gemma
    norms, softcap) gives the HF loss and grads of the same weights within 1e-5 (fp32)."""
    from transformers import AutoModelForCausalLM

    ref = tiny_model("gemma2")
    batch = tiny_batch(ref.config)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    apply_liger_kernels_to_gemma2()
    model = AutoModelForCausalLM.from_config(tiny_config("gemma2"), attn_implementation="eager")
    model.load_state_dict(ref.state_dict())
    out, grads = loss_and_grads(model.train(), batch)
    assert out.logits is None
    assert_close_rel(out.loss, ref_out.loss, FP32, "loss")
    for name, g in ref_grads.items():
        assert_close_rel(grads[name], g, FP32, f"grad {name}")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_class_level_patch_of_every_family_matches_hf(model_type):
    """Each family patched at class level (``apply_liger_kernels_to_<family>()``, no model) builds its models with
    our modules -- MoE shared-expert and dense MLPs too, which transformers constructs with their own
    ``intermediate_size`` -- and a model so built gives the unpatched model's loss and gradients of the same weights
    (1e-5, fp32)."""
    from transformers import AutoModelForCausalLM

    import liger_losses.patching as patching

    ref = tiny_model(model_type)
    batch = tiny_batch(ref.config)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    getattr(patching, f"apply_liger_kernels_to_{model_type}")()
    model = AutoModelForCausalLM.from_config(ref.config, attn_implementation="eager")
    model.load_state_dict(ref.state_dict())
    spec = SPECS[model_type]
    assert any(type(m).__name__.startswith("Liger") and "RMSNorm" in type(m).__name__ for m in model.modules())
    if spec.mlp is not None and any(type(m).__name__ == spec.mlp for m in ref.modules()):
        assert not any(type(m).__name__ == spec.mlp for m in model.modules())  # every HF MLP is ours
    out, grads = loss_and_grads(model.train(), batch)
    assert_close_rel(out.loss, ref_out.loss, FP32, "loss")
    for name, g in ref_grads.items():
        assert_close_rel(grads[name], g, FP32, f"grad {name}")


def test_class_level_seed_oss_keeps_its_mlp_dropout():
    """Seed-OSS patched at class level: our MLP reads ``config.residual_dropout`` as transformers' does, so under one
    seed the loss equals the unpatched model's (1e-5, fp32) with both dropouts live."""
    from transformers import AutoModelForCausalLM

    from liger_losses.patching import apply_liger_kernels_to_seed_oss

    ref = tiny_model("seed_oss", attention_dropout=0.3, residual_dropout=0.3)
    batch = tiny_batch(ref.config)
    torch.manual_seed(5)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    apply_liger_kernels_to_seed_oss()
    model = AutoModelForCausalLM.from_config(ref.config, attn_implementation="eager")
    model.load_state_dict(ref.state_dict())
    assert {m.residual_dropout for m in model.modules() if type(m).__name__ == "LigerSwiGLUMLP"} == {0.3}
    torch.manual_seed(5)
    out, grads = loss_and_grads(model.train(), batch)
    assert_close_rel(out.loss, ref_out.loss, FP32, "loss")
    for name, g in ref_grads.items():
        assert_close_rel(grads[name], g, FP32, f"grad {name}")


def test_patching_twice_is_idempotent():
    """Applying twice (instance after class-level, then again) swaps nothing new, does not nest
    forwards (the stored original is HF's), and keeps the loss equal to HF's (1e-5)."""
    from transformers.models.llama import modeling_llama as ml

    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    batch = tiny_batch(ref.config)
    with torch.no_grad():
        ref_loss = ref(**batch).loss
    hf_forward = ml.LlamaForCausalLM.forward
    apply_liger_kernels_to_llama()
    apply_liger_kernels(model)
    norm = model.model.norm
    apply_liger_kernels(model)
    assert model.model.norm is norm
    assert model.forward.__func__._liger_original_forward is hf_forward
    with torch.no_grad():
        loss = model(**batch).loss
    assert_close_rel(loss, ref_loss, FP32, "loss after double patch")


def test_weights_are_shared_not_copied():
    """Swapped modules hold the very same Parameter objects (optimizer state and ties survive)."""
    model = tiny_model("gemma")
    before = {name: p for name, p in model.named_parameters()}
    apply_liger_kernels(model)
    after = dict(model.named_parameters())
    assert set(before) == set(after)
    assert all(after[n] is p for n, p in before.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # Gemma ties the head


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_peft_wrapped_model(targets):
    """A PEFT LoRA wrapper is patched through get_base_model(): the base model's norms are ours and
    the wrapper's loss equals the unpatched wrapper's (1e-5) with LoRA weights made non-zero. With
    ``all-linear`` the MLP projections are PEFT layers, not ``nn.Linear``: the family check takes
    them (a LoRA user's model) and our MLP calls them, adapters included."""
    peft = pytest.importorskip("peft")
    from liger_losses.kernels.rms_norm import LigerRMSNorm

    base = tiny_model("qwen2")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    ref = peft.get_peft_model(base, lora)
    for n, p in ref.named_parameters():
        if "lora_B" in n:
            with torch.no_grad():
                p.normal_(0, 0.1)
    model = copy.deepcopy(ref)
    batch = tiny_batch(base.config)
    with torch.no_grad():
        ref_loss = ref(**batch).loss
    assert apply_liger_kernels(model) is model
    assert isinstance(model.get_base_model().model.norm, LigerRMSNorm)
    with torch.no_grad():
        loss = model(**batch).loss
    assert_close_rel(loss, ref_loss, FP32, "peft loss")


def test_revert_bad_model_type():
    """revert_liger_kernels with an unknown model_type raises ValueError naming the choices."""
    with pytest.raises(ValueError, match="model_type must be one of"):
        revert_liger_kernels("gpt2")


def test_generate_and_gradient_checkpointing():
    """The patched model greedily generates HF's tokens (KV cache, one-token RoPE steps), and with
    gradient checkpointing its loss and grads still equal HF's without it (1e-5, fp32)."""
    ref = tiny_model("mistral")
    model = copy.deepcopy(ref)
    batch = tiny_batch(ref.config)
    ref_out, ref_grads = loss_and_grads(ref, batch)
    ref.eval()
    prompt = batch["input_ids"][:, :4]
    want = ref.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)

    apply_liger_kernels(model)
    model.eval()
    got = model.generate(prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)

    model.train()
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x
    (enable or model.gradient_checkpointing_enable)()
    out, grads = loss_and_grads(model, batch)
    assert out.logits is None
    assert_close_rel(out.loss, ref_out.loss, FP32, "checkpointed loss")
    for name, g in ref_grads.items():
        assert_close_rel(grads[name], g, FP32, f"checkpointed grad {name}")
