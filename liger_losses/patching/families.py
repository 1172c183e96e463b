"""The one-line patch functions of the supported model families (the families themselves, as
data, are ``specs.FAMILIES``).

Each ``apply_liger_kernels_to_<family>(model=None, *, rms_norm=True, rope=True, swiglu|geglu=True,
cross_entropy=True)`` patches ``model`` in place and returns it, or, with ``model=None``, patches
the family's modeling module so that models created afterwards use our kernels (and returns
``None``). See ``core.py`` for what is swapped and the process-wide effect of the RoPE patch, and
``specs.py`` for the table of families (norm and MLP kinds).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from liger_losses.patching.core import patch_family
from liger_losses.patching.specs import FAMILIES, SUPPORTED_MODEL_TYPES, FamilySpec  # noqa: F401 (re-exported)


def _patcher(model_type: str, doc: str):
    """``apply_liger_kernels_to_<model_type>``: the MLP option is named after the family's MLP
    kind (``swiglu`` or ``geglu``), as in liger-kernel."""
    if FAMILIES[model_type].mlp_kind == "geglu":

        def patch(
            model: Optional[nn.Module] = None, *, rms_norm=True, rope=True, geglu=True, cross_entropy=True
        ):
            return patch_family(
                FAMILIES[model_type], model, rms_norm=rms_norm, rope=rope, mlp=geglu,
                cross_entropy=cross_entropy,
            )

    else:

        def patch(
            model: Optional[nn.Module] = None, *, rms_norm=True, rope=True, swiglu=True, cross_entropy=True
        ):
            return patch_family(
                FAMILIES[model_type], model, rms_norm=rms_norm, rope=rope, mlp=swiglu,
                cross_entropy=cross_entropy,
            )

    patch.__name__ = patch.__qualname__ = f"apply_liger_kernels_to_{model_type}"
    patch.__doc__ = doc
    return patch


apply_liger_kernels_to_llama = _patcher(
    "llama", "Patch a Llama model (or, with ``model=None``, the Llama modeling module)."
)
apply_liger_kernels_to_mistral = _patcher(
    "mistral", "Patch a Mistral model (or, with ``model=None``, the Mistral modeling module)."
)
apply_liger_kernels_to_qwen2 = _patcher(
    "qwen2", "Patch a Qwen2 model (or, with ``model=None``, the Qwen2 modeling module)."
)
apply_liger_kernels_to_qwen3 = _patcher(
    "qwen3", "Patch a Qwen3 model (or, with ``model=None``, the Qwen3 modeling module); q/k norms too."
)
apply_liger_kernels_to_gemma = _patcher(
    "gemma", "Patch a Gemma model (or, with ``model=None``, the Gemma modeling module)."
)
apply_liger_kernels_to_gemma2 = _patcher(
    "gemma2", "Patch a Gemma-2 model (or its modeling module); the loss honours final_logit_softcapping."
)
apply_liger_kernels_to_phi3 = _patcher(
    "phi3", "Patch a Phi-3 model (or, with ``model=None``, the Phi-3 modeling module)."
)
apply_liger_kernels_to_gemma3_text = _patcher(
    "gemma3_text",
    "Patch a Gemma-3 text model (or its modeling module): sandwich and q/k norms (1 + w), GeGLU, "
    "RoPE; the loss honours final_logit_softcapping.",
)
apply_liger_kernels_to_olmo2 = _patcher(
    "olmo2", "Patch an OLMo-2 model (or its modeling module): post-norms and full-width q/k norms."
)
apply_liger_kernels_to_olmo3 = _patcher(
    "olmo3", "Patch an OLMo-3 model (or its modeling module): post-norms and full-width q/k norms."
)
apply_liger_kernels_to_glm4 = _patcher(
    "glm4",
    "Patch a GLM-4 model (or its modeling module): norms and the packed gate_up MLP; its partial, "
    "interleaved RoPE stays transformers' (``rope`` is accepted and ignored).",
)
apply_liger_kernels_to_granite = _patcher(
    "granite", "Patch a Granite model (or its modeling module); the loss divides the logits by logits_scaling."
)
apply_liger_kernels_to_smollm3 = _patcher(
    "smollm3", "Patch a SmolLM3 model (or its modeling module); its layers without RoPE stay so."
)
apply_liger_kernels_to_ministral = _patcher(
    "ministral", "Patch a Ministral model (or, with ``model=None``, the Ministral modeling module)."
)
apply_liger_kernels_to_exaone4 = _patcher(
    "exaone4", "Patch an EXAONE-4 model (or its modeling module): post-norms and q/k norms."
)
apply_liger_kernels_to_mixtral = _patcher(
    "mixtral",
    "Patch a Mixtral model (or its modeling module): norms, RoPE, the loss with the router aux loss; "
    "the experts stay transformers' (``swiglu`` is accepted: there is no dense MLP).",
)
apply_liger_kernels_to_qwen2_moe = _patcher(
    "qwen2_moe",
    "Patch a Qwen2-MoE model (or its modeling module): norms, RoPE, the shared expert and dense MLPs, "
    "the loss with the router aux loss.",
)
apply_liger_kernels_to_qwen3_moe = _patcher(
    "qwen3_moe",
    "Patch a Qwen3-MoE model (or its modeling module): norms (q/k too), RoPE, dense MLPs, the loss "
    "with the router aux loss.",
)
apply_liger_kernels_to_gpt_oss = _patcher(
    "gpt_oss",
    "Patch a gpt-oss model (or its modeling module): norms (fp32 product), the loss with the router aux "
    "loss; RoPE, attention sinks and the clamped-SwiGLU experts stay transformers' (``rope`` and "
    "``swiglu`` are accepted and change nothing).",
)
apply_liger_kernels_to_deepseek_v3 = _patcher(
    "deepseek_v3",
    "Patch a DeepSeek-V3 model (or its modeling module): norms (MLA's LoRA norms too), dense and shared-"
    "expert MLPs, the non-interleaved RoPE, the loss; MLA and the routed experts stay transformers'.",
)
apply_liger_kernels_to_llama4_text = _patcher(
    "llama4_text",
    "Patch a Llama-4 text model (or its modeling module): norms, dense and shared-expert MLPs, the loss; "
    "its complex-number RoPE, L2 q/k norms and routed experts stay transformers' (``rope`` is ignored).",
)
apply_liger_kernels_to_ministral3 = _patcher(
    "ministral3",
    "Patch a Ministral-3 text model (or its modeling module); its position-scaled queries stay transformers'.",
)
apply_liger_kernels_to_seed_oss = _patcher(
    "seed_oss", "Patch a Seed-OSS model (or, with ``model=None``, the Seed-OSS modeling module)."
)
apply_liger_kernels_to_hunyuan_v1_dense = _patcher(
    "hunyuan_v1_dense", "Patch a Hunyuan dense (v1) model (or its modeling module); q/k norms too."
)
apply_liger_kernels_to_olmoe = _patcher(
    "olmoe",
    "Patch an OLMoE model (or its modeling module): norms (full-width q/k too), RoPE, the loss with the router "
    "aux loss; the experts stay transformers' (``swiglu`` is accepted: there is no dense MLP).",
)
apply_liger_kernels_to_glm4_moe = _patcher(
    "glm4_moe",
    "Patch a GLM-4-MoE model (or its modeling module): norms, dense and shared-expert MLPs, its partial "
    "rotate-half RoPE, the loss; the router and routed experts stay transformers'.",
)
apply_liger_kernels_to_dots1 = _patcher(
    "dots1",
    "Patch a dots.llm1 model (or its modeling module): norms (q/k too), dense and shared-expert MLPs, RoPE, "
    "the loss; the router and routed experts stay transformers'.",
)
