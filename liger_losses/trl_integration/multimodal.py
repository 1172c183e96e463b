"""Multimodal models in the trainers: the backbone a call with images (or audio) runs, and the RL steps' image inputs.

A call of a composite model (a vision-language or audio model: its config holds a text config) with keywords beyond
the text ones (pixels, audio features, token types...) runs the model's base model (:func:`runs_base_model`,
:func:`multimodal_backbone_of`: ``LlavaModel``, ``Qwen2VLModel``, ``Gemma4Model``...: the encoders, the projectors and
the language model), as TRL's fused head runs every call; ``get_decoder()`` gives the language model alone, which
takes those keywords through its ``**kwargs`` and ignores them. A text-only call keeps the language model (and
pad-free). In a base model's call, the language model runs pad-free where its family is served
(:func:`packed_language_model`: Qwen2/2.5/3-VL's M-RoPE text models, the Llama of Llava, LLaVA-NeXT, Idefics3
and SmolVLM, InternVL's Qwen2, Mistral-3's Mistral...): the vision tower and
the projector run on the padded batch as in TRL's forward, the language model on the attended tokens alone, packed
(its input embeddings and the positions the base model gives it), and its output goes back to the padded layout.
SFT, DPO and KTO hand the backbone their batch's keywords as TRL hands them to the model; the trainers that
serve no images refuse a vision-language processor (:func:`reject_vision`).

TRL 1.16's GRPO and RLOO steps pass the batch's image fields to the policy beside ``input_ids`` and
``attention_mask`` (``_get_per_token_logps_and_entropies``); our trainers run the policy's backbone on the same
inputs. :func:`rl_multimodal_inputs` picks them from the step's ``inputs`` as TRL does for one chunk holding the whole
batch (its ``batch_size=None`` call), so the two forwards see the same images:

* ``pixel_values`` (any shape: ``[patches, C*T*P*P]`` for Qwen2/2.5/3-VL, ``[images, C, H, W]`` for Llava or
  Gemma-3, ``[tiles, ...]`` for InternVL or LFM2-VL), with its index of the first kind present: ``image_grid_thw
  [images, 3]`` (Qwen-VL), else ``image_position_ids`` (per image), else ``spatial_shapes`` with
  ``pixel_attention_mask`` (LFM2-VL, per tile);
* ``pixel_attention_mask`` without ``spatial_shapes`` (Idefics-style, per row), ``image_sizes`` (Llava-NeXT,
  per image), ``token_type_ids`` and ``mm_token_type_ids`` (``[B, T]``: Gemma-3, Qwen-VL's M-RoPE).

``num_images`` and ``num_tiles`` only slice the batch in TRL's chunked calls and are not model inputs. A text batch
gives ``{}`` (or only its token types, where TRL keeps them).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Mapping, Optional

import torch
from torch import nn

from ..patching.pad_free import pack_batch

# the fields TRL passes through whatever the image layout, when present
_PER_ROW_FIELDS = ("image_sizes", "token_type_ids", "mm_token_type_ids")


def rl_multimodal_inputs(inputs: Mapping[str, Any]) -> Dict[str, Any]:
    """The image keywords of the policy's forward on the whole batch ``inputs`` (see the module docstring)."""
    out: Dict[str, Any] = {}
    pixel_values = inputs.get("pixel_values")
    spatial_shapes = inputs.get("spatial_shapes")
    if pixel_values is not None:
        out["pixel_values"] = pixel_values
        if inputs.get("image_grid_thw") is not None:
            out["image_grid_thw"] = inputs["image_grid_thw"]
        elif inputs.get("image_position_ids") is not None:
            out["image_position_ids"] = inputs["image_position_ids"]
        elif spatial_shapes is not None:
            out["pixel_attention_mask"] = inputs.get("pixel_attention_mask")
            out["spatial_shapes"] = spatial_shapes
    if inputs.get("pixel_attention_mask") is not None and spatial_shapes is None:
        out["pixel_attention_mask"] = inputs["pixel_attention_mask"]
    for name in _PER_ROW_FIELDS:
        if inputs.get(name) is not None:
            out[name] = inputs[name]
    return out


def rl_policy_inputs(inputs: Mapping[str, Any]) -> Dict[str, Any]:
    """The policy forward's keywords of a GRPO / RLOO step: ``input_ids`` and ``attention_mask`` of prompt +
    completion ``[B, P + C]``, no cache, and the batch's image fields (:func:`rl_multimodal_inputs`)."""
    return {"input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            "use_cache": False, **rl_multimodal_inputs(inputs)}


# the keywords of a text-only call, which a composite model's language model serves alone
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "position_ids", "use_cache", "return_dict",
                        "output_router_logits"})


def runs_base_model(causal_lm: nn.Module, model_kwargs: Optional[Mapping[str, Any]]) -> bool:
    """Whether a call of ``causal_lm`` on ``model_kwargs`` runs its base model: a composite model's call (its config's
    text config is another) with a keyword beyond the text ones."""
    config = getattr(causal_lm, "config", None)
    text_config = getattr(config, "get_text_config", None)
    if not model_kwargs or not callable(text_config) or text_config() is config:
        return False
    return any(value is not None and key not in _TEXT_KEYS for key, value in model_kwargs.items())


def multimodal_backbone_of(causal_lm: nn.Module) -> nn.Module:
    """The module a composite ``causal_lm`` runs before its LM head on images or audio: its ``base_model``
    (transformers 5's ``base_model_prefix``, as TRL's fused head reads it), which returns ``last_hidden_state [B, T,
    H]``."""
    base = getattr(causal_lm, "base_model", None)
    if not isinstance(base, nn.Module) or base is causal_lm:
        raise ValueError(f"{type(causal_lm).__name__} got multimodal inputs but has no base model to run them "
                         "through; pass use_liger=False to train with the model's own forward")
    return base


@contextlib.contextmanager
def packed_language_model(base_model: nn.Module, read_mask: Optional[torch.Tensor]) -> Iterator[None]:
    """While ``base_model`` (:func:`multimodal_backbone_of`) is called in this context, its ``language_model`` (or
    ``text_model``) runs on the attended tokens alone where :func:`~..patching.pad_free.pack_batch` packs the call the
    base model makes (``inputs_embeds [B, T, H]`` with the images' features in place, a 2-D ``attention_mask``, the
    positions it computed -- M-RoPE's ``[3, B, T]`` for Qwen-VL -- and Qwen3-VL's deepstack inputs), and hands back
    ``last_hidden_state [B, T, H]`` (zeros at the padding) as the padded call would. A call it refuses -- a mask the
    base model built (Gemma-3's bidirectional image blocks), other inputs, another family -- runs as it is; so does
    everything with ``read_mask`` None. The swap is the module's, for the context's duration: one call of the model
    at a time, as a trainer's step makes them."""
    language_model = getattr(base_model, "language_model", None)
    if not isinstance(language_model, nn.Module):  # Idefics3 / SmolVLM name theirs text_model
        language_model = getattr(base_model, "text_model", None)
    if read_mask is None or not isinstance(language_model, nn.Module):
        yield
        return
    own = language_model.__dict__.get("forward")  # an instance-level forward (a hook's) to restore afterwards
    original = language_model.forward

    def forward(*args, **kwargs):
        packed = None if args else pack_batch(language_model, kwargs, read_mask)
        if packed is None:
            return original(*args, **kwargs)
        out = original(**packed.kwargs)
        out.last_hidden_state = packed.unpack(out.last_hidden_state)
        return out

    language_model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del language_model.forward
        else:
            language_model.forward = own


def reject_vision(processing_class: Any) -> None:
    """:func:`reject` a vision-language model's ``processing_class`` (the GKD adapter serves text-only causal LMs, as
    TRL's GKD collator does; SFT, DPO, KTO, GRPO, RLOO and Distillation serve vision-language models too)."""
    from .base import reject  # base imports this module

    reject("processing_class", type(processing_class).__name__,
           "vision-language models are not supported by this trainer (SFT, DPO, KTO, GRPO, RLOO and Distillation "
           "serve them)")
