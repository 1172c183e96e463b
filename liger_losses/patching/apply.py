"""``apply_liger_kernels(model, ...)``: patch a Hugging Face causal LM in place, by its model_type.

Detects the family from ``model.config.model_type`` (through a PEFT wrapper if there is one; for a
composite vision-language model, from its text config, and patches its text model's layers: the loss
stays the model's own) and calls the family's patch function (``specs.py``: the table of families; ``core.py``: what is
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

from typing import Optional, Tuple

from torch import nn

from liger_losses.patching.core import patch_family, unwrap_model
from liger_losses.patching.lora import patch_lora_linears
from liger_losses.patching.specs import FAMILIES, SUPPORTED_MODEL_TYPES, FamilySpec


def family_of(model: nn.Module):
    """The ``FamilySpec`` of ``model``; ``ValueError`` listing the supported types if none."""
    return family_and_target(model)[0]


def family_type(config) -> Optional[str]:
    """The ``model_type`` of the family that patches a model of ``config``: its own when it is a family's, else
    its text config's when that is one (a composite vision-language model's text model), else None."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return model_type
    try:
        text_type = getattr(config.get_text_config(), "model_type", None)
    except (AttributeError, ValueError):  # no text config, or several (an encoder-decoder's)
        return None
    return text_type if text_type in FAMILIES else None


def family_and_target(model: nn.Module) -> Tuple[FamilySpec, nn.Module]:
    """``(spec, target)``: the family to patch and the module to patch it in. ``target`` is the transformers model
    itself (through a PEFT wrapper) when its ``model_type`` is a family's; else, for a composite model (a
    vision-language ``...ForConditionalGeneration``) whose text config is a family's, its text model (the first
    sub-model of that ``model_type``: Gemma-3 4B+ and ShieldGemma-2, Mistral-3, Llava, PaliGemma, InternVL...).
    ``ValueError`` listing the supported types if neither."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    root = unwrap_model(model)
    config = getattr(root, "config", None)
    family = family_type(config)
    if family is not None and family == config.model_type:
        return FAMILIES[family], model
    if family is not None:
        for module in root.modules():
            if module is not root and getattr(getattr(module, "config", None), "model_type", None) == family:
                return FAMILIES[family], module
    raise ValueError(
        f"model.config.model_type must be one of {SUPPORTED_MODEL_TYPES} (or a composite model's text config), "
        f"got {getattr(config, 'model_type', None)!r}"
    )


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
    spec, target = family_and_target(model)
    for name, value in (("swiglu", swiglu), ("geglu", geglu), ("lora", lora)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    mlp = geglu if spec.mlp_kind == "geglu" else swiglu
    # a composite model's loss is its own forward's: only its text model's layers are swapped
    patch_family(spec, target, rms_norm=rms_norm, rope=rope, mlp=mlp, cross_entropy=cross_entropy and target is model)
    if lora:
        patch_lora_linears(model)
    return model
