"""The supported model families as data: one ``FamilySpec`` per ``model_type`` (where its modeling
code lives, what its classes are called, which norm and MLP kinds it uses, whether its RoPE and its
head need anything special), in ``FAMILIES``.

What is swapped (every family: its RMSNorm modules, q/k norms included, and the causal-LM forward,
which computes the labelled loss with the chunked cross-entropy from the hidden states), and what is
left to transformers:

| model_type  | norm                  | MLP swapped    | RoPE       | loss             | left to HF (below)      |
|-------------|-----------------------|----------------|------------|------------------|-------------------------|
| llama       | llama                 | SwiGLU         | kernel     |                  |                         |
| mistral     | llama                 | SwiGLU         | kernel     |                  |                         |
| qwen2       | llama                 | SwiGLU         | kernel     |                  |                         |
| qwen3       | llama, q/k per head   | SwiGLU         | kernel     |                  |                         |
| gemma       | gemma (1 + w)         | GeGLU (tanh)   | kernel     |                  | scaled embedding        |
| gemma2      | gemma, sandwich       | GeGLU (tanh)   | kernel     | softcap          | attention softcap       |
| phi3        | llama                 | packed SwiGLU  | kernel     |                  |                         |
| gemma3_text | gemma, sandwich, q/k  | GeGLU (tanh)   | kernel     | softcap          | scaled embedding, masks |
| olmo2       | olmo, post, q/k full  | SwiGLU         | kernel     |                  |                         |
| olmo3       | olmo, post, q/k full  | SwiGLU         | kernel     |                  | masks                   |
| glm4        | llama, 4 per layer    | packed SwiGLU  | HF (1)     |                  |                         |
| granite     | llama                 | SwiGLU         | kernel     | 1/logits_scaling | multipliers             |
| smollm3     | llama                 | SwiGLU         | kernel     |                  | layers without RoPE     |
| ministral   | llama                 | SwiGLU         | kernel     |                  | masks                   |
| exaone4     | llama, post, q/k      | SwiGLU         | kernel     |                  | masks, NoPE layers      |
| mixtral     | llama                 | none           | kernel     | + aux loss       | router, experts (2)     |
| qwen2_moe   | llama                 | shared + dense | kernel     | + aux loss       | router, experts, gate   |
| qwen3_moe   | llama, q/k per head   | dense layers   | kernel     | + aux loss       | router, experts         |
| gpt_oss     | olmo                  | none           | HF (3)     | + aux loss       | sinks, clamped experts  |
| llama4_text | llama                 | shared + dense | HF (4)     |                  | L2 q/k norms, experts   |
| deepseek_v3 | llama, MLA LoRA norms | shared + dense | kernel (5) |                  | MLA, router, experts    |
| ministral3  | llama                 | SwiGLU         | kernel     |                  | position-scaled queries |
| seed_oss    | llama                 | SwiGLU         | kernel     |                  |                         |
| hunyuan_v1_dense | llama, q/k per head | SwiGLU       | kernel     |                  |                         |
| olmoe       | llama, q/k full       | none           | kernel     | + aux loss       | router, experts         |
| glm4_moe    | llama, q/k per head   | shared + dense | kernel (6) |                  | router, experts         |
| dots1       | llama, q/k per head   | shared + dense | kernel     |                  | router, experts         |

Why left to transformers: multipliers (Granite's embedding/residual/attention), sliding-window masks,
scaled embeddings and softcaps inside attention are elementwise or mask work with no kernel of ours;
Phi-3's partial rotary is the kernel's (it rotates the first R features); (1) GLM-4's rotary is partial AND interleaved
(pairs 2i, 2i+1), not the rotate-half our kernel computes; (2) MoE experts are 3-D parameters
dispatched by transformers' expert backends (top-k routing), not ``nn.Linear`` MLPs, so their
activation stays; (3) gpt-oss rotates with half-width tables (not ``cat(freqs, freqs)``); (4) Llama-4
rotates complex numbers; (5) DeepSeek-V3 with ``rope_interleave=True`` (the default) calls
``apply_rotary_pos_emb_interleave``, which is not patched: only non-interleaved configs use our kernel;
(6) GLM-4-MoE's rotary is partial but rotate-half (unlike GLM-4's), so the kernel's, as Phi-3's.
Ministral-3's position-dependent query scale (``llama_4_scaling_beta``) stays in its attention.
"head / loss": ``softcap`` = ``final_logit_softcapping``; ``1/logits_scaling`` = the loss's logit
scale; ``+ aux loss`` = the router load-balancing loss added as transformers adds it. DeepSeek-V3,
Llama-4, GLM-4-MoE and dots1 add none (transformers' forwards have none).

Norm kinds: ``llama`` ``w * x_hat.to(dtype)``; ``gemma`` ``(x_hat * (1 + w)).to(dtype)`` in fp32;
``olmo`` ``(w * x_hat).to(dtype)`` with the product in fp32. "kernel" RoPE: the modeling module's
``apply_rotary_pos_emb`` is ours (``rope.py``); "HF": the ``rope`` flag is accepted and ignored.
MoE families: the forward keeps the router's load-balancing loss exactly as transformers adds it
(the modeling module's own ``load_balancing_loss_func``, times ``router_aux_loss_coef``, when
``output_router_logits``); the experts' activation stays in transformers (the experts are 3-D
parameters dispatched by transformers' expert backends, not ``nn.Linear`` MLPs).

Nothing here imports the patching machinery (``core.py``) or the patch functions (``families.py``):
both import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

NORM_KINDS = ("llama", "gemma", "olmo")
MLP_KINDS = ("swiglu", "phi3", "geglu")


@dataclass(frozen=True)
class FamilySpec:
    """What differs between families: where the modeling code lives and what it is called."""

    model_type: str
    module: str  # e.g. "transformers.models.llama.modeling_llama"
    causal_lm: str  # e.g. "LlamaForCausalLM"
    rms_norm: str  # e.g. "LlamaRMSNorm"
    norm_kind: str  # "llama": w * x_hat ; "gemma": x_hat * (1 + w) ; "olmo": (w * x_hat) in fp32
    mlp: Optional[str]  # e.g. "LlamaMLP"; None: no dense MLP to swap (Mixtral)
    mlp_kind: str  # "swiglu" | "phi3" (packed gate_up_proj) | "geglu"
    rope: bool = True  # False: the family's rotary is not the rotate-half our kernel computes
    logits_divisor: Optional[str] = None  # config attribute the logits are divided by (Granite)
    moe: bool = False  # the forward adds the router's load-balancing loss

    def __post_init__(self) -> None:
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(f"norm_kind must be one of {NORM_KINDS}, got {self.norm_kind!r}")
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"mlp_kind must be one of {MLP_KINDS}, got {self.mlp_kind!r}")

    @property
    def mlp_flag(self) -> str:
        """The name of the ``apply_liger_kernels`` flag that switches this family's MLP."""
        return "geglu" if self.mlp_kind == "geglu" else "swiglu"


def _spec(model_type, stem, norm_kind="llama", mlp_kind="swiglu", *, module=None, mlp="MLP", **options):
    return FamilySpec(
        model_type=model_type,
        module=f"transformers.models.{module or model_type}.modeling_{module or model_type}",
        causal_lm=f"{stem}ForCausalLM",
        rms_norm=f"{stem}RMSNorm",
        norm_kind=norm_kind,
        mlp=None if mlp is None else f"{stem}{mlp}",
        mlp_kind=mlp_kind,
        **options,
    )


FAMILIES: Dict[str, FamilySpec] = {
    s.model_type: s
    for s in (
        _spec("llama", "Llama"),
        _spec("mistral", "Mistral"),
        _spec("qwen2", "Qwen2"),
        _spec("qwen3", "Qwen3"),
        _spec("gemma", "Gemma", "gemma", "geglu"),
        _spec("gemma2", "Gemma2", "gemma", "geglu"),
        _spec("phi3", "Phi3", "llama", "phi3"),
        _spec("gemma3_text", "Gemma3", "gemma", "geglu", module="gemma3"),
        _spec("olmo2", "Olmo2", "olmo"),
        _spec("olmo3", "Olmo3", "olmo"),
        _spec("glm4", "Glm4", "llama", "phi3", rope=False),
        _spec("granite", "Granite", logits_divisor="logits_scaling"),
        _spec("smollm3", "SmolLM3"),
        _spec("ministral", "Ministral"),
        _spec("exaone4", "Exaone4"),
        _spec("mixtral", "Mixtral", mlp=None, moe=True),
        _spec("qwen2_moe", "Qwen2Moe", moe=True),
        _spec("qwen3_moe", "Qwen3Moe", moe=True),
        _spec("gpt_oss", "GptOss", "olmo", mlp=None, rope=False, moe=True),
        _spec("deepseek_v3", "DeepseekV3"),
        _spec("ministral3", "Ministral3"),
        _spec("seed_oss", "SeedOss"),
        _spec("hunyuan_v1_dense", "HunYuanDenseV1"),
        _spec("olmoe", "Olmoe", mlp=None, moe=True),
        _spec("glm4_moe", "Glm4Moe"),
        _spec("dots1", "Dots1"),
        FamilySpec(model_type="llama4_text", module="transformers.models.llama4.modeling_llama4",
                   causal_lm="Llama4ForCausalLM", rms_norm="Llama4TextRMSNorm", norm_kind="llama",
                   mlp="Llama4TextMLP", mlp_kind="swiglu", rope=False),
    )
}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
