"""The MoE router load-balancing loss of a policy forward, as TRL 1.16's fused LM head computes it.

``backbone_hidden_and_router_aux(model, model_kwargs)`` runs ``model``'s backbone with
``output_router_logits=True`` and returns ``(last_hidden_state [B, T, H], aux_loss)``, where
``aux_loss`` (0-d fp32) is ``transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
router_logits, text_config.num_experts, text_config.num_experts_per_tok, attention_mask)`` -- the
function, arguments and attention mask (``None`` for padding-free batches: every token counts) TRL's
``add_fused_lm_head`` forward uses. The trainers add ``router_aux_loss_coef * aux_loss`` to their loss
where TRL does (SFT: divided by the accumulation steps when ``num_items_in_batch`` is given; DPO: as is)
and log ``aux_loss`` like TRL.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

from .base import backbone_of, unwrap_causal_lm


def router_aux_loss(model: nn.Module, router_logits, attention_mask) -> torch.Tensor:
    """TRL's load-balancing loss of ``router_logits`` (one ``[tokens, experts]`` tensor per MoE layer)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    text_config = unwrap_causal_lm(model).config.get_text_config()
    return load_balancing_loss_func(
        router_logits, text_config.num_experts, text_config.num_experts_per_tok, attention_mask
    )


def backbone_hidden_and_router_aux(model: nn.Module, model_kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(last hidden states [B, T, H], aux_loss)`` of ``model``'s backbone run with its router logits."""
    outputs = backbone_of(unwrap_causal_lm(model))(**model_kwargs, output_router_logits=True)
    aux = router_aux_loss(model, outputs.router_logits, model_kwargs.get("attention_mask"))
    return outputs.last_hidden_state, aux
