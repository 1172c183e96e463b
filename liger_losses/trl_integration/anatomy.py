"""The anatomy of a Hugging Face causal LM as the TRL adapters see it: through PEFT, accelerate, DDP/FSDP and
``torch.compile`` wrappers to the causal LM itself (:func:`unwrap_causal_lm`, :func:`innermost_module`), its
decoder backbone returning ``last_hidden_state [B, T, H]`` (:func:`backbone_of`), its LM head's ``weight [V, H]``
and ``bias [V]`` (:func:`lm_head_params`, which refuses a head that is more than ``hidden @ weight.T + bias``)
and the logit transform after the head (:func:`head_logit_options`: softcap, scale).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..patching.checks import is_projection


def is_peft_model(model: nn.Module) -> bool:
    """True for a ``peft.PeftModel`` (peft imported lazily; False when peft is absent)."""
    try:
        from peft import PeftModel
    except Exception:  # pragma: no cover - peft not installed
        return False
    return isinstance(model, PeftModel)


def innermost_module(model: nn.Module, *, max_depth: int = 8) -> nn.Module:
    """``model`` with its DDP/FSDP1/DeepSpeed wrappers (``.module``) taken off, at most ``max_depth`` of them."""
    for _ in range(max_depth):
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def compiled_module(model: nn.Module) -> Optional[nn.Module]:
    """``model`` when it is a ``torch.compile`` wrapper (``OptimizedModule``: what accelerate makes of a
    prepared model under ``torch_compile=True``), else None. ``torch._dynamo`` is not imported for it: a
    compiled module exists only once it is."""
    dynamo = sys.modules.get("torch._dynamo")
    wrapper = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)
    return model if wrapper is not None and isinstance(model, wrapper) else None


def compiled_like(wrapper: nn.Module, module: nn.Module) -> nn.Module:
    """``module`` compiled as the ``torch.compile`` wrapper ``wrapper`` compiles its own: under the
    wrapper's Dynamo context (its backend, mode and options, whoever called ``torch.compile``)."""
    return sys.modules["torch._dynamo"].eval_frame.OptimizedModule(module, wrapper.dynamo_ctx)


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether ``module`` itself has forward (pre-)hooks (FSDP2's ``fully_shard`` registers its
    unshard / reshard as such)."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face ``...ForCausalLM`` inside ``model``: through ``torch.compile``'s (``_orig_mod``),
    DDP/FSDP/DeepSpeed (``.module``) and PEFT (``get_base_model()``) wrappers."""
    if compiled_module(model) is not None:
        model = model._orig_mod
    model = innermost_module(model)
    if is_peft_model(model):
        model = model.get_base_model()
    return model


def backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The decoder (``LlamaModel`` for ``LlamaForCausalLM``...): the module that returns
    ``last_hidden_state`` [B, T, H] before the LM head."""
    getter = getattr(causal_lm, "get_decoder", None)
    if callable(getter):
        try:
            decoder = getter()
        except Exception:
            decoder = None
        if isinstance(decoder, nn.Module) and decoder is not causal_lm:
            if decoder is causal_lm.get_output_embeddings() or isinstance(decoder, nn.Linear):
                # e.g. ModernBertDecoderForCausalLM: get_decoder() is the vocabulary projection, behind a
                # prediction head of its own that the fused loss would skip
                raise ValueError(
                    f"{type(causal_lm).__name__}.get_decoder() is its vocabulary projection, not a backbone: "
                    "a model with layers between its backbone and the LM head is not served by the fused loss"
                )
            return decoder
    prefix = getattr(causal_lm, "base_model_prefix", None)
    if prefix and isinstance(getattr(causal_lm, prefix, None), nn.Module):
        return getattr(causal_lm, prefix)
    raise ValueError(
        f"cannot find the decoder backbone of {type(causal_lm).__name__}: expected a Hugging Face "
        "causal LM with get_decoder() or base_model_prefix"
    )


def _active_peft_adapter(head: nn.Module) -> bool:
    """Whether ``head`` is a PEFT tuner layer (LoRA...) whose adapter acts in its forward now: not
    merged, not disabled, an active adapter among its layers."""
    if hasattr(head, "modules_to_save"):  # a trained copy of the head: its weight is the active copy's
        return False
    layer_names = getattr(head, "adapter_layer_names", ())
    if not layer_names or getattr(head, "merged", False) or getattr(head, "disable_adapters", False):
        return False
    active = getattr(head, "active_adapters", None) or []
    for name in layer_names:
        layers = getattr(head, name, None)
        if hasattr(layers, "keys") and any(a in layers.keys() for a in active):
            return True
    return False


def lm_head_params(causal_lm: nn.Module) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight [V, H], bias [V] or None) of the model's output embeddings (the LM head).

    The losses use the head as ``hidden @ weight.T + bias``; a head whose forward does more is refused
    (``ValueError``) rather than silently replaced by that: an active PEFT adapter on it (LoRA on
    ``lm_head``: merge it, or leave ``lm_head`` out of ``target_modules``), or a head module of its own
    with parameters besides ``weight`` and ``bias`` (e.g. a learned logit scale). PEFT's
    ``modules_to_save`` copy of the head is a plain head."""
    head = causal_lm.get_output_embeddings()
    name = type(causal_lm).__name__
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"{name} has no LM head with a weight (get_output_embeddings())")
    if _active_peft_adapter(head):
        raise ValueError(
            f"{name}'s LM head carries an active PEFT adapter ({type(head).__name__}); the fused loss reads "
            "lm_head.weight and would ignore it: merge the adapter into the head, or leave lm_head out of "
            "target_modules"
        )
    if not (is_projection(head) or hasattr(head, "modules_to_save")):
        extra = sorted(n for n, _ in head.named_parameters() if n not in ("weight", "bias"))
        if extra:
            raise ValueError(
                f"{name}'s LM head {type(head).__name__} has parameters besides weight and bias ({', '.join(extra)}): "
                "its forward is more than hidden @ weight.T + bias, which the fused loss computes"
            )
    return head.weight, getattr(head, "bias", None)


def head_logit_options(config) -> Dict[str, Any]:
    """The logit transform a model applies after its LM head, as our loss options.

    ``{"softcap": final_logit_softcapping (RecurrentGemma: logits_soft_cap) or None, "logit_scale": float}``;
    the scale is read from the text config's ``logit_scale`` / ``output_multiplier`` /
    ``lm_head_multiplier`` / ``1/logits_scaling`` (the same attributes TRL's fused head honours), 1.0
    when none is set.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if softcap is None:  # RecurrentGemma's name for the same tanh cap
        softcap = getattr(text_config, "logits_soft_cap", None)
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        scale = getattr(text_config, name, None)
        if scale is not None:
            break
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        ls = text_config.logits_scaling
        scale = ls if getattr(text_config, "model_type", "") == "hyperclovax" else 1.0 / ls
    return {"softcap": softcap, "logit_scale": 1.0 if scale is None else float(scale)}
