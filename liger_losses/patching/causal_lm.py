"""The loss-aware forward of a Hugging Face ``*ForCausalLM``: cross-entropy without the logits.

``make_causal_lm_forward(original_forward)`` returns a forward that wraps ``original_forward``
(the model class's own forward). With labels and ``skip_logits`` it runs the base model
(``self.model(...)``), keeps the last hidden states ``[B, T, H]`` (sliced by ``logits_to_keep``),
and scores them against the labels with
``liger_losses.chunked.cross_entropy.fused_linear_cross_entropy(self.lm_head.weight, hidden,
shifted_labels, ...)``, so the ``[B, T, V]`` logits are never held. Everything else (no labels,
``skip_logits=False``) goes to ``original_forward`` unchanged.

Semantics, matching ``transformers.loss.loss_utils.ForCausalLMLoss``:

* labels are shifted left by one inside the loss (position ``t`` predicts ``labels[t + 1]``; the
  last position gets ``ignore_index``); a caller-supplied ``shift_labels`` is used as is;
* ``ignore_index`` (default -100) positions contribute nothing;
* ``num_items_in_batch`` given: ``sum of token losses / num_items_in_batch``; else the mean over
  non-ignored tokens;
* ``config.final_logit_softcapping`` (Gemma-2, Gemma-3) caps logits as ``c * tanh(logits / c)``;
* ``logits_divisor`` (the name of a config attribute, Granite's ``logits_scaling``): the logits are
  divided by it (``logit_scale = 1 / value``; applied before the softcap, as transformers does);
* ``lm_head.bias`` is used when present;
* MoE families (``aux_loss_fn`` given: the modeling module's ``load_balancing_loss_func``): with
  ``output_router_logits`` (the argument, else ``config.output_router_logits``) the base model
  returns the router logits, ``aux_loss = aux_loss_fn(router_logits, self.num_experts,
  self.num_experts_per_tok, attention_mask)`` and ``loss += self.router_aux_loss_coef * aux_loss``,
  exactly as the transformers forward does; the output is a ``MoeCausalLMOutputWithPast`` with
  ``aux_loss`` and ``router_logits``.

``logits_to_keep`` (int: the last k positions, 0 = all; or an index tensor as accepted by
transformers) slices the hidden states. Labels may be given for the full sequence ``[B, T]``
(they are shifted over the full sequence and then sliced the same way, which is what one means)
or for the kept positions only (shifted within them, which is what Hugging Face does).

The choice about logits: ``skip_logits=None`` (default) means "skip" when the model is in
training mode and labels are given -- then ``outputs.logits`` is ``None``. In eval mode the
original forward runs, so ``Trainer.evaluate``/``compute_metrics`` still get logits (and the loss
comes from them, with no extra GEMM). Pass ``skip_logits=True``/``False`` to force either path.
The loss is float32, as in Hugging Face (which upcasts the logits to float first).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from liger_losses.chunked.cross_entropy import fused_linear_cross_entropy
from liger_losses.chunked.weights import run_with_head_params

LIGER_MARK = "_liger_original_forward"  # our forwards carry the one they wrap here


def _select_positions(x: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """Slice dim 1 of ``x`` (``[B, T, ...]``) the way transformers slices hidden states."""
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0, got {logits_to_keep}")
        return x if logits_to_keep == 0 else x[:, -logits_to_keep:]
    if not isinstance(logits_to_keep, torch.Tensor):
        raise TypeError(
            f"logits_to_keep must be an int or a tensor, got {type(logits_to_keep).__name__}"
        )
    idx = logits_to_keep.to(x.device)
    if idx.dim() == 1:
        return x[:, idx]
    if idx.dim() == 2:
        if idx.dtype == torch.bool:
            return x[idx]
        if x.dim() == 3:
            return torch.take_along_dim(x, idx[..., None], dim=1)
        return torch.take_along_dim(x, idx, dim=1)
    raise ValueError(f"logits_to_keep tensor must have 1 or 2 dimensions, got {idx.dim()}")


def _shift(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _targets(labels, shift_labels, hidden_full, hidden_kept, logits_to_keep, ignore_index):
    """Per-kept-position targets, shaped like ``hidden_kept.shape[:-1]``."""
    if shift_labels is None:
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
        shifted = _shift(labels, ignore_index)
        name = "labels"
    else:
        shifted = shift_labels
        name = "shift_labels"
    if shifted.is_floating_point():
        raise TypeError(f"{name} must be an integer tensor, got dtype {shifted.dtype}")
    shifted = shifted.to(hidden_full.device)
    full_shape = tuple(hidden_full.shape[:-1])
    kept_shape = tuple(hidden_kept.shape[:-1])
    if tuple(shifted.shape) == full_shape:
        return _select_positions(shifted, logits_to_keep)
    if tuple(shifted.shape) == kept_shape:
        return shifted
    raise ValueError(
        f"{name} must have shape {list(full_shape)} (the whole sequence) or {list(kept_shape)} "
        f"(the positions kept by logits_to_keep), got {list(shifted.shape)}"
    )


def _output_class(moe: bool):
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    return MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast


def _build_output(base_outputs, loss, *, moe: bool = False, aux_loss=None):
    cls = _output_class(moe)
    names = cls.__dataclass_fields__  # not dataclasses.fields(): torch.compile breaks its graph there
    fields = dict(loss=loss, logits=None)
    for cache_name in ("cache", "past_key_values"):
        if cache_name in names:
            fields[cache_name] = getattr(base_outputs, "cache", None) or getattr(
                base_outputs, "past_key_values", None
            )
            break
    fields["hidden_states"] = getattr(base_outputs, "hidden_states", None)
    fields["attentions"] = getattr(base_outputs, "attentions", None)
    if moe:
        fields["aux_loss"] = aux_loss
        fields["router_logits"] = getattr(base_outputs, "router_logits", None)
    return cls(**fields)


def causal_lm_fused_loss(
    model,
    hidden_full: torch.Tensor,
    labels: Optional[torch.Tensor],
    *,
    shift_labels: Optional[torch.Tensor] = None,
    logits_to_keep=0,
    ignore_index: int = -100,
    num_items_in_batch=None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """The causal-LM loss of ``model`` (a ``*ForCausalLM``) from last hidden states ``[B, T, H]``;
    the logits are ``logit_scale * (hidden @ lm_head.weight.T + bias)``, then softcapped."""
    hidden = _select_positions(hidden_full, logits_to_keep)
    targets = _targets(labels, shift_labels, hidden_full, hidden, logits_to_keep, ignore_index)
    head = model.lm_head
    softcap = getattr(model.config, "final_logit_softcapping", None)
    # head.weight read inside: an FSDP2-sharded head is unsharded there (run_with_head_params)
    return run_with_head_params(head, lambda: fused_linear_cross_entropy(
        head.weight,
        hidden,
        targets,
        bias=getattr(head, "bias", None),
        ignore_index=ignore_index,
        softcap=softcap,
        logit_scale=logit_scale,
        reduction="mean",
        num_items_in_batch=num_items_in_batch,  # sum / num_items_in_batch, scaled in fp32
    ))


def _logit_scale(config, logits_divisor: Optional[str]) -> float:
    if logits_divisor is None:
        return 1.0
    value = getattr(config, logits_divisor, None)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.{logits_divisor} must be a positive number, got {value!r}")
    return 1.0 / float(value)


def _add_aux_loss(self, aux_loss_fn, base_outputs, attention_mask, loss):
    """transformers' MoE step: ``(loss + router_aux_loss_coef * aux_loss, aux_loss)``."""
    aux_loss = aux_loss_fn(
        base_outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask
    )
    if isinstance(aux_loss, torch.Tensor):
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    else:  # transformers returns a plain 0 when there are no router logits
        loss = loss + self.router_aux_loss_coef * aux_loss
    return loss, aux_loss


def make_causal_lm_forward(
    original_forward: Callable,
    *,
    logits_divisor: Optional[str] = None,
    aux_loss_fn: Optional[Callable] = None,
) -> Callable:
    """A forward for ``*ForCausalLM`` that computes the labelled loss without logits.

    ``original_forward`` is the unbound forward of the model class; if it is itself one of ours,
    its original is used (so patching twice does not nest). ``logits_divisor``: the config attribute
    the family divides its logits by (Granite: ``"logits_scaling"``). ``aux_loss_fn``: the MoE
    family's ``load_balancing_loss_func`` (see the module docstring).
    """
    original_forward = getattr(original_forward, LIGER_MARK, original_forward)

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        *,
        labels=None,
        logits_to_keep=0,
        skip_logits: Optional[bool] = None,
        **kwargs,
    ):
        shift_labels = kwargs.get("shift_labels")
        has_targets = labels is not None or shift_labels is not None
        if skip_logits is None:
            skip_logits = self.training and has_targets
        if skip_logits and not has_targets:
            raise ValueError("skip_logits=True needs labels (or shift_labels) to compute a loss")
        if not skip_logits:
            return original_forward(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                labels=labels,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )

        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        shift_labels = kwargs.pop("shift_labels", None)
        moe = aux_loss_fn is not None
        if moe:
            output_router_logits = kwargs.pop("output_router_logits", None)
            if output_router_logits is None:
                output_router_logits = bool(getattr(self.config, "output_router_logits", False))
            kwargs["output_router_logits"] = output_router_logits

        base_outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **kwargs,
        )
        hidden_full = base_outputs[0]
        loss = causal_lm_fused_loss(
            self,
            hidden_full,
            labels,
            shift_labels=shift_labels,
            logits_to_keep=logits_to_keep,
            ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch,
            logit_scale=_logit_scale(self.config, logits_divisor),
        )
        aux_loss = None
        if moe and output_router_logits:
            loss, aux_loss = _add_aux_loss(self, aux_loss_fn, base_outputs, attention_mask, loss)
        output = _build_output(base_outputs, loss, moe=moe, aux_loss=aux_loss)
        return output if return_dict else output.to_tuple()

    setattr(forward, LIGER_MARK, original_forward)
    forward.__doc__ = __doc__
    forward.__name__ = "forward"
    forward.__qualname__ = getattr(original_forward, "__qualname__", "forward")
    return forward


def is_liger_forward(fn) -> bool:
    return hasattr(getattr(fn, "__func__", fn), LIGER_MARK)
