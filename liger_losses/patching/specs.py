"""The supported model families as data: one ``FamilySpec`` per ``model_type`` (where its modeling
code lives, what its classes are called, which norm and MLP kinds it uses), in ``FAMILIES``.

| model_type | norm                        | MLP                           | notes                     |
|------------|-----------------------------|-------------------------------|---------------------------|
| llama      | LigerRMSNorm                | LigerSwiGLUMLP                |                           |
| mistral    | LigerRMSNorm                | LigerSwiGLUMLP                |                           |
| qwen2      | LigerRMSNorm                | LigerSwiGLUMLP                |                           |
| qwen3      | LigerRMSNorm (+ q/k norms)  | LigerSwiGLUMLP                |                           |
| gemma      | LigerGemmaRMSNorm (1 + w)   | LigerGEGLUMLP (tanh GELU)     |                           |
| gemma2     | LigerGemmaRMSNorm (sandwich)| LigerGEGLUMLP (tanh GELU)     | final logit softcapping   |
| phi3       | LigerRMSNorm                | LigerPhi3SwiGLUMLP (gate_up)  | partial rotary supported  |

Nothing here imports the patching machinery (``core.py``) or the patch functions (``families.py``):
both import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

NORM_KINDS = ("llama", "gemma")
MLP_KINDS = ("swiglu", "phi3", "geglu")


@dataclass(frozen=True)
class FamilySpec:
    """What differs between families: where the modeling code lives and what it is called."""

    model_type: str
    module: str  # e.g. "transformers.models.llama.modeling_llama"
    causal_lm: str  # e.g. "LlamaForCausalLM"
    rms_norm: str  # e.g. "LlamaRMSNorm"
    norm_kind: str  # "llama": x_hat * w ; "gemma": x_hat * (1 + w)
    mlp: str  # e.g. "LlamaMLP"
    mlp_kind: str  # "swiglu" | "phi3" (fused gate_up_proj) | "geglu"

    def __post_init__(self) -> None:
        if self.norm_kind not in NORM_KINDS:
            raise ValueError(f"norm_kind must be one of {NORM_KINDS}, got {self.norm_kind!r}")
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"mlp_kind must be one of {MLP_KINDS}, got {self.mlp_kind!r}")

    @property
    def mlp_flag(self) -> str:
        """The name of the ``apply_liger_kernels`` flag that switches this family's MLP."""
        return "geglu" if self.mlp_kind == "geglu" else "swiglu"


def _spec(model_type, stem, norm_kind="llama", mlp_kind="swiglu") -> FamilySpec:
    return FamilySpec(
        model_type=model_type,
        module=f"transformers.models.{model_type}.modeling_{model_type}",
        causal_lm=f"{stem}ForCausalLM",
        rms_norm=f"{stem}RMSNorm",
        norm_kind=norm_kind,
        mlp=f"{stem}MLP",
        mlp_kind=mlp_kind,
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
    )
}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
