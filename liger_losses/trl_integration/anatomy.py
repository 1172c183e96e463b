"""The anatomy of a Hugging Face causal LM as the TRL adapters see it: through PEFT, accelerate, DDP/FSDP and
``torch.compile`` wrappers to the causal LM itself (:func:`unwrap_causal_lm`, :func:`innermost_module`), its
decoder backbone returning ``last_hidden_state [B, T, H]`` (:func:`backbone_of`), its LM head's ``weight [V, H]``
and ``bias [V]`` (:func:`lm_head_params`, which refuses a head that is more than ``hidden @ weight.T + bias``)
and the logit transform after the head (:func:`head_logit_options`: softcap, scale).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..chunked.weights import is_dtensor


def is_peft_model(model: nn.Module) -> bool:
    """True for a ``peft.PeftModel`` (peft imported lazily; False when peft is absent)."""
    try:
        from peft import PeftModel
    except Exception:  # pragma: no cover - peft not installed
        return False
    return isinstance(model, PeftModel)


def wrapper_chain(model: nn.Module, *, max_depth: int = 8) -> List[nn.Module]:
    """``model`` and the modules its DDP/FSDP1/DeepSpeed wrappers hold (``.module``), outermost first, at most
    ``max_depth`` wrappers deep."""
    chain = [model]
    for _ in range(max_depth):
        inner = getattr(chain[-1], "module", None)
        if not isinstance(inner, nn.Module):
            break
        chain.append(inner)
    return chain


def innermost_module(model: nn.Module, *, max_depth: int = 8) -> nn.Module:
    """``model`` with its DDP/FSDP1/DeepSpeed wrappers (``.module``) taken off, at most ``max_depth`` of them."""
    return wrapper_chain(model, max_depth=max_depth)[-1]


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
    # Llama4ForCausalLM / MllamaForCausalLM: base_model_prefix "language_model", the decoder stored as `model`
    model = getattr(causal_lm, "model", None)
    if isinstance(model, nn.Module) and model is not causal_lm.get_output_embeddings():
        return model
    raise ValueError(
        f"cannot find the decoder backbone of {type(causal_lm).__name__}: expected a Hugging Face "
        "causal LM with get_decoder(), base_model_prefix or a .model decoder; pass use_liger=False to train "
        "with the model's own forward"
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
    # Any parameter besides weight and bias takes part in the head's forward, nn.Linear subclasses included (a
    # learned per-vocabulary logit scale: Dory; an FP8 head's scales). A PEFT wrapper holds its adapters'
    # parameters: the module it computes with is checked instead.
    base = _peft_base(head)
    checked = head if base is None else base
    extra = sorted(n for n, _ in checked.named_parameters() if n not in ("weight", "bias"))
    if extra:
        raise ValueError(
            f"{name}'s LM head {type(checked).__name__} has parameters besides weight and bias ({', '.join(extra)}): "
            "its forward is more than hidden @ weight.T + bias, which the fused loss computes; pass "
            "use_liger=False to train with the model's own forward"
        )
    weight, bias = head.weight, getattr(head, "bias", None)
    vocab = getattr(_text_config(getattr(causal_lm, "config", None)), "unpadded_vocab_size", None)
    if vocab is not None and vocab < getattr(weight, "ds_shape", weight.shape)[0]:
        # Inkling pads its head to a round row count and cuts the logits to the real vocabulary: the padded rows
        # take no part in the softmax
        if hasattr(weight, "ds_id") or is_dtensor(weight):
            raise ValueError(
                f"{name} cuts its logits to unpadded_vocab_size={vocab} of its head's rows; the fused loss "
                "cannot slice a sharded head (DeepSpeed ZeRO-3, FSDP2): pass use_liger=False"
            )
        weight, bias = weight[:vocab], None if bias is None else bias[:vocab]
    return weight, bias


def _text_config(config):
    """``config``'s text config (a composite model's), or ``config`` itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_is_peft_wrapped(causal_lm: nn.Module) -> bool:
    """Whether PEFT wraps ``causal_lm``'s LM head (LoRA on it, ``modules_to_save``, trainable tokens): then the
    head the adapters-off reference computes with may differ from the policy's."""
    return _peft_base(causal_lm.get_output_embeddings()) is not None


def _peft_base(head: nn.Module) -> Optional[nn.Module]:
    """The module a PEFT wrapper of the head computes with (a LoRA layer's innermost base layer; the original
    module of ``modules_to_save`` and trainable-token wrappers, whose trained copy or token delta has its
    shape), or None when PEFT does not wrap the head."""
    if not type(head).__module__.startswith("peft."):
        return None
    if isinstance(getattr(head, "original_module", None), nn.Module):
        return head.original_module
    getter = getattr(head, "get_base_layer", None)
    return getter() if callable(getter) else None


# model_type -> why its causal-LM forward computes the logits from something else than the backbone's last hidden
# state, in a way its module tree does not show
_OTHER_LOGIT_INPUTS = {
    "prophetnet": "ProphetNet computes its logits from the n-gram predicting streams",
    "xlm-prophetnet": "XLM-ProphetNet computes its logits from the n-gram predicting streams",
}


def check_head_path(causal_lm: nn.Module) -> None:
    """Raise ``ValueError`` unless ``causal_lm``'s logits are ``head(backbone(...).last_hidden_state)`` as far as
    its module tree shows: every direct child with parameters is the backbone (:func:`backbone_of`), holds it (a
    vision-language model's base model) or is the LM head (:func:`lm_head_params` checks the head itself). A
    child with parameters of its own besides those is a layer between the backbone and the head that the fused
    loss would skip: a BERT-style prediction head (``cls.predictions.transform``, RoBERTa's ``lm_head.dense``,
    ELECTRA's ``generator_predictions``), RemBERT's output projection. Looks at the module tree only, once per
    model (the adapters call it when the trainer is built)."""
    name = type(causal_lm).__name__
    model_type = getattr(getattr(causal_lm, "config", None), "model_type", None)
    if model_type in _OTHER_LOGIT_INPUTS:
        raise ValueError(f"{name} is not served by the fused loss: {_OTHER_LOGIT_INPUTS[model_type]}; pass "
                         "use_liger=False to train with the model's own forward")
    backbone = backbone_of(causal_lm)
    head = causal_lm.get_output_embeddings()
    lm_head_params(causal_lm)
    head_params = {id(p) for p in head.parameters()}
    for child_name, child in causal_lm.named_children():
        if child is head or child is backbone or any(m is backbone for m in child.modules()):
            continue
        own = [n for n, p in child.named_parameters() if id(p) not in head_params]
        if own:
            where = "around its LM head" if any(m is head for m in child.modules()) else "beside its backbone"
            raise ValueError(
                f"{name}.{child_name} ({type(child).__name__}) has parameters {where} ({', '.join(own[:3])}"
                f"{', ...' if len(own) > 3 else ''}): the model computes its logits through more than "
                "hidden @ weight.T + bias of its backbone's last hidden state, which the fused loss computes; pass "
                "use_liger=False to train with the model's own forward (a vision-language model: load its text "
                "model with AutoModelForCausalLM)"
            )


# Config attributes a model reads but its causal LM's forward does not apply: by model_type, what to skip.
# MPT's config has logit_scale, MptForCausalLM never uses it; Gemma3ForConditionalGeneration (model_type
# "gemma3", what AutoModelForCausalLM gives for Gemma-3 checkpoints from 4B up) applies no softcap, though its
# text config may carry one (Gemma3ForCausalLM's); Cohere2VisionForConditionalGeneration applies no logit scale,
# though its Cohere2 text config has one (0.0625 by default).
_UNUSED_LOGIT_ATTRS = {"mpt": ("logit_scale",), "gemma3": ("final_logit_softcapping",),
                       "cohere2_vision": ("logit_scale",)}


def head_logit_options(config) -> Dict[str, Any]:
    """The logit transform a model applies after its LM head, as our loss options.

    ``{"softcap": float or None, "logit_scale": float}``. The softcap is the text config's
    ``final_logit_softcapping`` (RecurrentGemma: ``logits_soft_cap``, xLSTM: ``output_logit_soft_cap``); the
    scale its ``logit_scale`` / ``output_multiplier`` / ``lm_head_multiplier`` (the attributes TRL's fused head
    honours), else ``1/logits_scaling`` (HyperCLOVA X: ``logits_scaling`` itself), else
    ``1/logits_mup_width_multiplier`` (Inkling divides the hidden states by it before the head), 1.0 when none
    is set. An attribute the family's causal-LM forward does not apply (``_UNUSED_LOGIT_ATTRS``) is not read.
    """
    text_config = _text_config(config)
    unused = _UNUSED_LOGIT_ATTRS.get(getattr(config, "model_type", ""), ())

    def attr(name):
        return None if name in unused else getattr(text_config, name, None)

    softcap = None
    for name in ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap"):
        softcap = attr(name)
        if softcap is not None:
            break
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        scale = attr(name)
        if scale is not None:
            break
    if scale is None and attr("logits_scaling") is not None:
        ls = text_config.logits_scaling
        scale = ls if getattr(text_config, "model_type", "") == "hyperclovax" else 1.0 / ls
    if scale is None and attr("logits_mup_width_multiplier") is not None:
        scale = 1.0 / text_config.logits_mup_width_multiplier
    return {"softcap": softcap, "logit_scale": 1.0 if scale is None else float(scale)}
