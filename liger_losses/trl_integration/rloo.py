"""``RLOOTrainer``: TRL 1.16's RLOO trainer whose loss can come from our fused RLOO loss (``use_liger=True``).

``RLOOTrainer(model, reward_funcs, args=None, ..., use_liger=False, liger_patch_model=True,
liger_chunk_tokens=None)`` takes every argument of ``trl.RLOOTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer.
* ``use_liger=True``: ``_compute_loss`` runs the policy *backbone* on prompt + completion, keeps the
  ``[B, C, H]`` positions that predict the completion tokens, and the loss comes from
  :func:`liger_losses.chunked.rloo.fused_linear_rloo_loss` (TRL's clipped ratio of the sequences'
  summed log-probs, mean over the batch; the Trainer divides it for gradient accumulation, as TRL's)
  on them and the LM head -- logits are never held whole. Generation, rewards (with TRL's KL term),
  advantages and old log-probs are TRL's. Metrics (``entropy``, ``clip_ratio/*``) under TRL's names,
  reduced over processes as TRL does (token / sequence weighted means, min / max over processes).
  MoE models (``aux_loss_enabled``, TRL's rule): the same backbone forward returns the router logits
  and, as TRL, ``router_aux_loss_coef * aux_loss`` is added to the (unscaled) loss and ``aux_loss``
  logged (``router_aux.py``). Without router logits the backbone runs pad-free where it can: the attended
  tokens alone, packed (``patching/pad_free.py``; ``LIGER_LOSSES_PAD_FREE``). A vision-language model's backbone
  gets the batch's images as TRL's policy forward does (``multimodal.py``; its language model pad-free where
  served).

Options use_liger=True cannot serve raise ``ValueError`` at construction, naming the option: PEFT prompt learning,
and ``cast_lm_head_to_fp32=True`` on a config that has it (TRL 1.16's ``RLOOConfig`` has no such field: its old
log-probs come from the head in the model's precision, so a float32 head in the loss alone would move every
on-policy ratio off 1).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import trl

from ..chunked.rloo import RLOO_TRL_METRIC_NAMES, fused_linear_rloo_loss
from ..patching.pad_free import completion_read_mask
from .base import (
    IGNORE_INDEX,
    LigerTrainerMixin,
    gathered_params,
    head_logit_options,
    reject,
    unwrap_causal_lm,
)
from .grpo import log_rl_metrics
from .multimodal import rl_policy_inputs
from .router_aux import log_router_aux_loss, policy_hidden_and_router_aux


class RLOOTrainer(LigerTrainerMixin, trl.RLOOTrainer):
    """``trl.RLOOTrainer`` with ``use_liger`` (see the module docstring)."""

    def __init__(self, model, reward_funcs=None, args=None, *trl_args: Any, use_liger: bool = False,
                 liger_patch_model: bool = True, liger_chunk_tokens: Optional[int] = None, **trl_kwargs: Any):
        self._liger_setup(use_liger=use_liger, liger_patch_model=liger_patch_model,
                          liger_chunk_tokens=liger_chunk_tokens)
        if use_liger and getattr(args, "cast_lm_head_to_fp32", False):
            reject("cast_lm_head_to_fp32", True, "TRL's RLOO computes its old log-probs with the head in the model's "
                   "precision; a float32 head in the loss alone would move every on-policy ratio off 1")
        super().__init__(model, reward_funcs, args, *trl_args, **trl_kwargs)
        if use_liger:
            self._liger_after_init(self.model, self.ref_model, trl_kwargs=trl_kwargs)

    def _compute_loss(self, model, inputs):
        if not self.use_liger:
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        prompt_ids = inputs["prompt_ids"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        model_kwargs = rl_policy_inputs(inputs)  # a vision-language model's images too, as TRL passes them
        labels = self._liger_scan_ahead(model, completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX))
        start = prompt_ids.size(1) - 1  # the position predicting the first completion token
        read = completion_read_mask(model_kwargs["attention_mask"], start, labels, IGNORE_INDEX)
        logit_opts = head_logit_options(unwrap_causal_lm(model).config)

        def run():
            hidden, aux = policy_hidden_and_router_aux(self, model, model_kwargs, read_mask=read)
            hidden = hidden[:, start:start + labels.size(1)]
            weight, bias = self._liger_head(model)
            with gathered_params(weight, bias):
                return aux, fused_linear_rloo_loss(
                    weight, hidden, labels, bias=bias, advantages=inputs["advantages"],
                    old_logps=inputs["old_logps"], epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                    temperature=self.temperature, ignore_index=IGNORE_INDEX,
                    chunk_tokens=self.liger_chunk_tokens, **logit_opts,
                )

        with self.accelerator.autocast():
            aux, (loss, metrics) = self._liger_run(model, run)
        if aux is not None:  # TRL: the loss is unscaled (the Trainer divides it), so is the aux term
            loss = loss + self.router_aux_loss_coef * aux
            log_router_aux_loss(self, mode, aux)
        n_seqs = torch.tensor(float(labels.size(0)), device=labels.device)
        counts = {k: n_seqs for k in RLOO_TRL_METRIC_NAMES}
        counts["entropy"] = completion_mask.sum()
        log_rl_metrics(self, mode, metrics, RLOO_TRL_METRIC_NAMES, counts)
        return loss
