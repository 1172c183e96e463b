"""Tiny random Hugging Face causal LMs and batches for tests (offline: built from configs).

``tiny_config(model_type, **overrides)``: 2 layers, hidden 64, 4 heads / 2 KV heads of 16,
intermediate 128, vocab 128, eager attention; each family's own features switched on so that they
matter at this scale: Phi-3 partial rotary (factor 0.5), Gemma-2/3 a final-logit softcap of 1.0,
one sliding-window layer (window 4) for Gemma-3, OLMo-3, Ministral and EXAONE-4, Granite's
multipliers and ``logits_scaling=4``, a SmolLM3 layer without RoPE, Ministral-3's YaRN with its
position-dependent query scale varying over the batch, GLM-4-MoE's partial rotary and q/k norms, Seed-OSS
without its default dropouts (a test of their own); MoE families 4 experts, top-2,
``output_router_logits=True`` with ``router_aux_loss_coef=0.1``, and (Qwen MoE) layer 1 dense.
``tiny_model(model_type, *, dtype=torch.float32, device="cpu", **overrides)``: that model with
every weight drawn afresh (matrices N(0, 0.1^2); norm weights = their init value + N(0, 0.1^2), so
Gemma's ``1 + w`` and Llama's ``w`` are both exercised), in training mode.
``tiny_batch(config, *, batch=2, seq=8, device="cpu")``: ``dict(input_ids, attention_mask,
labels)`` with ``input_ids`` ``[batch, seq]`` int64 in ``[3, vocab)``, ``labels`` a copy of them
with the first 3 positions of row 0 and the last position of row 1 set to -100, attention mask of
ones. Other helpers may import these.
"""

from __future__ import annotations

import torch

DENSE_FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3",
    "gemma3_text", "olmo2", "olmo3", "glm4", "granite", "smollm3", "ministral", "exaone4",
    "ministral3", "seed_oss", "hunyuan_v1_dense",
)
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "olmoe")
OTHER_FAMILIES = ("deepseek_v3", "llama4_text", "glm4_moe", "dots1")  # MoE without an aux loss
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES + OTHER_FAMILIES

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# One sliding layer of window 4 (shorter than the batches' 8 tokens) where the family has them.
_SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)

_PER_FAMILY = {
    "gemma2": dict(final_logit_softcapping=1.0, query_pre_attn_scalar=16),
    "phi3": dict(partial_rotary_factor=0.5),
    "gemma3_text": dict(final_logit_softcapping=1.0, query_pre_attn_scalar=16, **_SLIDING),
    "olmo3": dict(_SLIDING),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1,
                    logits_scaling=4.0),
    "smollm3": dict(no_rope_layers=[1, 0]),  # layer 1 has no RoPE
    "ministral": dict(_SLIDING),
    "exaone4": dict(_SLIDING),  # the full layer has no RoPE when a sliding window is set
    "mixtral": dict(num_local_experts=4, **_MOE),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      mlp_only_layers=[1], **_MOE),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1], **_MOE),
    "gpt_oss": dict(num_local_experts=4, intermediate_size=32, **_SLIDING, **_MOE),
    # layer 0 dense, layer 1 MoE (4 routed experts in 2 groups + a shared one); MLA with q LoRA;
    # the non-interleaved rotary, so that our RoPE kernel runs
    # layer 0 MoE (4 experts, top-1, a shared expert), layer 1 dense; layer 1 without RoPE
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                        interleave_moe_layer_step=2, moe_layers=[0], no_rope_layers=[1, 0]),
    # YaRN from 4 positions to 64 (factor 16, as the config's default): the llama-4 query scale then varies
    # over the batches' 8 positions
    "ministral3": dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=16.0,
                                            original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0,
                                            mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.1)),
    "seed_oss": dict(attention_dropout=0.0, residual_dropout=0.0),  # its defaults drop out (0.1): a test of its own
    # the language models of Qwen2-VL / Qwen2.5-VL: M-RoPE over three position rows (sections of the 8 frequencies)
    "qwen2_vl_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
    "qwen2_5_vl_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
    "qwen3_vl_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                               mrope_interleaved=True)),
    "olmoe": dict(num_experts=4, **_MOE),
    # layer 0 dense, layer 1 MoE (4 routed experts in 2 groups + a shared one); GLM-4-MoE with its partial
    # rotary (factor 0.5) and q/k norms
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                     n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True),
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                  n_shared_experts=1, first_k_dense_replace=1),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, rope_interleave=False),
}


def tiny_config(model_type: str, **overrides):
    """A tiny config of ``model_type`` (see the module docstring)."""
    from transformers import AutoConfig

    kwargs = dict(_COMMON)
    kwargs.update(_PER_FAMILY.get(model_type, {}))
    kwargs.update(overrides)
    if model_type in ("phi3", "deepseek_v3"):
        kwargs.pop("head_dim", None)  # Phi-3: hidden_size / heads; DeepSeek-V3: qk_rope_head_dim
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "eager"
    return config


@torch.no_grad()
def randomize_(model: torch.nn.Module, *, std: float = 0.1) -> torch.nn.Module:
    """Redraw every parameter in place: matrices N(0, std^2), vectors init + N(0, std^2)."""
    for p in model.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std)
        else:
            p.add_(torch.randn_like(p) * std)
    return model


def tiny_model(model_type: str, *, dtype=torch.float32, device="cpu", **overrides):
    """A tiny random ``*ForCausalLM`` of ``model_type`` in training mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model)
    return model.to(device=device, dtype=dtype).train()


def tiny_batch(config, *, batch: int = 2, seq: int = 8, device="cpu"):
    """Inputs and labels (some -100) for ``config``'s vocabulary (see the module docstring)."""
    input_ids = torch.randint(3, config.vocab_size, (batch, seq), device=device)
    labels = input_ids.clone()
    labels[0, :3] = -100
    if batch > 1:
        labels[1, -1] = -100
    attention_mask = torch.ones_like(input_ids)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def loss_and_grads(model, batch, **kwargs):
    """Run ``model(**batch, **kwargs)`` in its current mode, backward the loss.

    Returns ``(outputs, {name: grad.clone()})`` and zeroes the grads afterwards.
    """
    model.zero_grad(set_to_none=True)
    outputs = model(**batch, **kwargs)
    outputs.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return outputs, grads


def eval_logits(model, batch):
    """``model``'s logits on ``batch`` without labels, in eval mode, under no grad (``model`` stays in eval)."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def reference_outputs(ref, batch):
    """``(logits without labels in eval mode, loss, {name: grad})`` of ``ref`` (the loss and grads in train
    mode): what a patched copy must reproduce. Run it before patching (the RoPE patch is process-wide)."""
    logits = eval_logits(ref, batch)
    ref.train()
    out, grads = loss_and_grads(ref, batch)
    return logits, out.loss.detach(), grads


def assert_loss_and_grads(out, grads, ref_loss, ref_grads):
    """``out.loss`` and every gradient of ``ref_grads`` within the fp32 bar of ``tests/helpers.TOL``."""
    from tests.helpers import TOL, assert_close_rel

    assert_close_rel(out.loss, ref_loss, TOL[torch.float32], "loss")
    for name, g in ref_grads.items():
        assert_close_rel(grads[name], g, TOL[torch.float32], f"grad {name}")


# vision-language model_type -> the family of its text model
COMPOSITES = {"gemma3": "gemma3_text", "mistral3": "mistral", "llava": "llama"}


def tiny_composite_config(model_type: str, **text_overrides):
    """The config of a tiny vision-language model of ``model_type`` (a key of ``COMPOSITES``): its text config
    ``tiny_config``'s of its family (with ``text_overrides``), its vision tower one layer of width 32."""
    from transformers import AutoConfig

    text = tiny_config(COMPOSITES[model_type], **text_overrides).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, **({"head_dim": 16} if model_type == "mistral3" else {}))
    extra = {"mm_tokens_per_image": 4} if model_type == "gemma3" else {}
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **extra)


def tiny_composite(model_type: str, **text_overrides):
    """A tiny random vision-language model of :func:`tiny_composite_config` in training mode."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = tiny_composite_config(model_type, **text_overrides)
    auto = AutoModelForCausalLM if model_type == "gemma3" else AutoModelForImageTextToText
    torch.manual_seed(0)
    model = auto.from_config(config, attn_implementation="eager")
    return randomize_(model).float().train()
