"""Layer 3: one-line patching of Hugging Face causal LMs with liger_losses kernels."""

from liger_losses.patching.apply import apply_liger_kernels
from liger_losses.patching.auto import AutoLigerModelForCausalLM
from liger_losses.patching.causal_lm import causal_lm_fused_loss, make_causal_lm_forward
from liger_losses.patching.checks import FamilyMismatchError
from liger_losses.patching.core import revert_liger_kernels
from liger_losses.patching.families import (
    SUPPORTED_MODEL_TYPES,
    apply_liger_kernels_to_deepseek_v3,
    apply_liger_kernels_to_exaone4,
    apply_liger_kernels_to_gemma,
    apply_liger_kernels_to_gemma2,
    apply_liger_kernels_to_gemma3_text,
    apply_liger_kernels_to_glm4,
    apply_liger_kernels_to_gpt_oss,
    apply_liger_kernels_to_granite,
    apply_liger_kernels_to_llama,
    apply_liger_kernels_to_llama4_text,
    apply_liger_kernels_to_ministral,
    apply_liger_kernels_to_mistral,
    apply_liger_kernels_to_mixtral,
    apply_liger_kernels_to_olmo2,
    apply_liger_kernels_to_olmo3,
    apply_liger_kernels_to_phi3,
    apply_liger_kernels_to_qwen2,
    apply_liger_kernels_to_qwen2_moe,
    apply_liger_kernels_to_qwen3,
    apply_liger_kernels_to_qwen3_moe,
    apply_liger_kernels_to_smollm3,
)

__all__ = [
    "AutoLigerModelForCausalLM",
    "FamilyMismatchError",
    "SUPPORTED_MODEL_TYPES",
    "apply_liger_kernels",
    "apply_liger_kernels_to_deepseek_v3",
    "apply_liger_kernels_to_exaone4",
    "apply_liger_kernels_to_gemma",
    "apply_liger_kernels_to_gemma2",
    "apply_liger_kernels_to_gemma3_text",
    "apply_liger_kernels_to_glm4",
    "apply_liger_kernels_to_gpt_oss",
    "apply_liger_kernels_to_granite",
    "apply_liger_kernels_to_llama",
    "apply_liger_kernels_to_llama4_text",
    "apply_liger_kernels_to_ministral",
    "apply_liger_kernels_to_mistral",
    "apply_liger_kernels_to_mixtral",
    "apply_liger_kernels_to_olmo2",
    "apply_liger_kernels_to_olmo3",
    "apply_liger_kernels_to_phi3",
    "apply_liger_kernels_to_qwen2",
    "apply_liger_kernels_to_qwen2_moe",
    "apply_liger_kernels_to_qwen3",
    "apply_liger_kernels_to_qwen3_moe",
    "apply_liger_kernels_to_smollm3",
    "causal_lm_fused_loss",
    "make_causal_lm_forward",
    "revert_liger_kernels",
]
