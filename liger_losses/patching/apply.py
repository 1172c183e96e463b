"""``apply_liger_kernels(model, ...)``: patch a Hugging Face causal LM in place, by its model_type.

Detects the family from ``model.config.model_type`` (through a PEFT wrapper if there is one) and
calls the family's patch function (``specs.py``: the table of families; ``core.py``: what is
swapped). ``swiglu`` applies to the SwiGLU families (every family but the Gemmas; for
Mixtral, which has no dense MLP, it changes nothing), ``geglu`` to the GeGLU families (gemma,
gemma2, gemma3_text). A family whose transformers classes no longer look as the patch expects
raises ``FamilyMismatchError`` before anything is patched (``checks.py``). Returns ``model``
itself. The RoPE patch is module-level: it affects every model of that family in the process
(``revert_liger_kernels`` undoes it). On a model with PEFT LoRA adapters, ``lora=True`` also
gives its LoRA linears the fused adapter forward of ``lora.py`` (under autocast, or when input,
base and adapters share a dtype; PEFT's own forward otherwise).
"""

from __future__ import annotations

from torch import nn

from liger_losses.patching.core import patch_family, unwrap_model
from liger_losses.patching.lora import patch_lora_linears
from liger_losses.patching.specs import FAMILIES, SUPPORTED_MODEL_TYPES


def family_of(model: nn.Module):
    """The ``FamilySpec`` of ``model``; ``ValueError`` listing the supported types if none."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = getattr(unwrap_model(model), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"model.config.model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}"
        )
    return FAMILIES[model_type]


def apply_liger_kernels(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    geglu: bool = True,
    cross_entropy: bool = True,
    lora: bool = True,
) -> nn.Module:
    """Swap in liger_losses kernels (RMSNorm, RoPE, SwiGLU/GeGLU MLP, fused-linear CE) in place;
    ``lora``: PEFT LoRA linears add their adapters with one GEMM (``lora.py``)."""
    spec = family_of(model)
    for name, value in (("swiglu", swiglu), ("geglu", geglu), ("lora", lora)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    mlp = geglu if spec.mlp_kind == "geglu" else swiglu
    patched = patch_family(
        spec, model, rms_norm=rms_norm, rope=rope, mlp=mlp, cross_entropy=cross_entropy
    )
    if lora:
        patch_lora_linears(model)
    return patched
