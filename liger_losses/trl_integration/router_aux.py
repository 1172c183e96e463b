"""The MoE router load-balancing loss of a policy forward, as TRL 1.16's fused LM head computes it.

``backbone_hidden_and_router_aux(model, backbone, model_kwargs)`` runs ``backbone`` (``model``'s) with
``output_router_logits=True`` and returns ``(last_hidden_state [B, T, H], aux_loss)``, where
``aux_loss`` (0-d fp32) is ``transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
router_logits, text_config.num_experts, text_config.num_experts_per_tok, attention_mask)`` -- the
function, arguments and attention mask (``None`` for padding-free batches: every token counts) TRL's
``add_fused_lm_head`` forward uses. ``policy_hidden_and_router_aux(trainer, model, model_kwargs)`` is the
same when ``trainer.aux_loss_enabled`` (TRL's rule: the config has ``output_router_logits`` and the
coefficient is not 0), else the plain backbone forward and ``None``; ``log_router_aux_loss`` logs it as
TRL does (``aux_loss``: the mean over processes). The trainers add ``router_aux_loss_coef * aux_loss``
to their loss where TRL does: SFT divided by the accumulation steps when ``num_items_in_batch`` is
given; GRPO divided by them in training (its policy loss is already scaled); DPO, KTO and RLOO as is.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ..patching.pad_free import pack_batch
from .base import unwrap_causal_lm

# where a family keeps its expert count and top-k: the causal LM's own attributes (what its forward passes to the
# load-balancing loss: Mixtral, Granite-MoE, PhiMoE...), else the text config under these names
_EXPERT_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_NAMES = ("num_experts_per_tok", "moe_topk", "moe_k")


def moe_sizes(causal_lm: nn.Module) -> Tuple[int, int]:
    """``(experts, experts per token)`` of an MoE causal LM for its load-balancing loss. ``ValueError`` naming the
    attributes looked for when the model has neither."""
    text_config = causal_lm.config.get_text_config()

    def first(names):
        for owner in (causal_lm, text_config):
            for name in names:
                value = getattr(owner, name, None)  # per-layer attributes of heterogeneous configs raise AttributeError
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
        return None

    experts, top_k = first(_EXPERT_COUNT_NAMES), first(_TOP_K_NAMES)
    if experts is None or top_k is None:
        raise ValueError(
            f"router_aux_loss_coef != 0: the load-balancing loss of {type(causal_lm).__name__} needs its expert count "
            f"({' / '.join(_EXPERT_COUNT_NAMES)}) and experts per token ({' / '.join(_TOP_K_NAMES)}), and its "
            "config has not both; set router_aux_loss_coef=0.0 in the trainer's config, or pass use_liger=False"
        )
    return experts, top_k


def router_aux_loss(model: nn.Module, router_logits, attention_mask) -> torch.Tensor:
    """TRL's load-balancing loss of ``router_logits`` (one ``[tokens, experts]`` tensor per MoE layer): Mixtral's
    function, which TRL's fused head applies to every family, with the family's own expert count and top-k
    (:func:`moe_sizes`; TRL 1.16 reads ``config.num_experts``, which Granite-MoE, PhiMoE and Llama-4 name
    ``num_local_experts``)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    causal_lm = unwrap_causal_lm(model)
    if isinstance(router_logits, list):  # Mixtral's function takes a tuple and returns 0 for anything else
        router_logits = tuple(router_logits)
    if router_logits is None or (isinstance(router_logits, tuple) and not router_logits):
        raise ValueError(
            f"router_aux_loss_coef != 0 but {type(causal_lm).__name__}'s backbone returned no router logits to "
            "balance; set router_aux_loss_coef=0.0 in the trainer's config, or pass use_liger=False"
        )
    experts, top_k = moe_sizes(causal_lm)
    return load_balancing_loss_func(router_logits, experts, top_k, attention_mask)


def backbone_hidden_and_router_aux(model: nn.Module, backbone: nn.Module, model_kwargs: Dict[str, Any],
                                   read_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(last hidden states [B, T, H], aux_loss)`` of ``backbone`` -- ``model``'s, as the trainer calls it
    (``LigerTrainerMixin._liger_backbone``: compiled when the model is) -- run with its router logits; on the
    attended tokens alone where ``read_mask [B, T]`` (what the loss reads) lets
    :func:`~..patching.pad_free.pack_batch` pack them. Packed, the router logits are the attended tokens' alone
    (no mask: each counts), so the balance is over the tokens the padded call's mask counts."""
    packed = pack_batch(backbone, model_kwargs, read_mask)
    kwargs = model_kwargs if packed is None else packed.kwargs
    outputs = backbone(**kwargs, output_router_logits=True)
    aux = router_aux_loss(model, outputs.router_logits, model_kwargs.get("attention_mask") if packed is None else None)
    hidden = outputs.last_hidden_state
    return (hidden if packed is None else packed.unpack(hidden)), aux


def policy_hidden_and_router_aux(trainer, model: nn.Module, model_kwargs: Dict[str, Any], *,
                                 enabled: Optional[bool] = None, read_mask: Optional[torch.Tensor] = None
                                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(last hidden states [B, T, H], aux_loss or None)``: with the router logits when the aux loss is
    served (``enabled``, default TRL's rule ``trainer.aux_loss_enabled``), else the trainer's plain backbone
    forward (no router logits asked for: ``LigerTrainerMixin._liger_backbone_hidden``); either pad-free where
    ``read_mask``, the positions the loss reads, allows."""
    if trainer.aux_loss_enabled if enabled is None else enabled:
        trainer._liger_check_logits(model, model_kwargs)
        # torch's checkpoint form here, not the lean one: transformers collects the router logits with forward hooks
        # inside the layers, and a layer run under no grad would hand the aux loss logits without a graph
        return backbone_hidden_and_router_aux(model, trainer._liger_backbone(model, model_kwargs), model_kwargs,
                                             read_mask)
    return trainer._liger_backbone_hidden(model, model_kwargs, read_mask), None


def log_router_aux_loss(trainer, mode: str, aux_loss: torch.Tensor) -> None:
    """Log ``aux_loss`` as TRL's trainers do: ``aux_loss``, the mean over processes (queued on the trainer,
    read when its metrics are)."""
    mean = trainer.accelerator.gather_for_metrics(aux_loss.detach()).mean()
    trainer._liger_defer(mean, lambda values: trainer._metrics[mode]["aux_loss"].append(values[0]))
