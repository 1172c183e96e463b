"""``DPOTrainer``: TRL 1.16's DPO trainer whose loss can come from our chunked DPO loss (``use_liger=True``).

``DPOTrainer(model, ref_model=None, args=None, ..., use_liger=False, liger_patch_model=True,
liger_chunk_tokens=None)`` takes every argument of ``trl.DPOTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer (nothing overridden does anything).
* ``use_liger=True``: ``_compute_loss`` (TRL's narrowest loss method: it runs the model with TRL's
  fused LM head and applies the DPO formula) runs the policy *backbone* to get the last hidden states
  ``[2P, T, H]`` of the ``[chosen; rejected]`` batch, and the loss comes from
  :class:`liger_losses.chunked.preference.dpo.LigerFusedLinearDPOLoss` on those states and the LM
  head's ``weight [V, H]`` -- logits are computed tile by tile, never whole. The reference is the
  reference model's backbone hidden states under ``no_grad`` (with its own LM head), or the policy
  with its PEFT adapter disabled, or the precomputed ``ref_chosen_logps``/``ref_rejected_logps``
  columns (``precompute_ref_log_probs=True``; the precompute itself also uses our chunked log-probs,
  via :meth:`DPOTrainer.compute_ref_log_probs`). Every metric TRL logs is logged under TRL's name.
  ``liger_patch_model=True`` also swaps the models' layers for our kernels (``apply_liger_kernels``).
  ``liger_chunk_tokens`` fixes the tokens per logits tile (default: sized from a memory budget). The
  backbone calls run pad-free where they can: the attended tokens alone, packed (``patching/pad_free.py``). A
  vision-language model's batch with images runs the policy's and the reference's base models on them (the vision
  tower included, as TRL's forward; ``multimodal.py``), the language model pad-free where its family is served.

``use_weighting`` (WPO) weights each pair with the statistic the loss takes from its own tiles (no extra GEMM). One
deliberate difference: with an ``"sft"`` entry in ``loss_type`` TRL 1.16's step raises (its in-place weighting writes
into the expanded batch NLL); ours trains the batch NLL times each pair's weight, what that code means.
Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the option:
``ld_alpha`` with an ``"sft"`` loss term, PEFT prompt learning. MoE models:
``router_aux_loss_coef * aux_loss`` of the policy's own backbone forward is added to the loss and logged as
``aux_loss``, as TRL does (``router_aux.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import trl

from ..chunked.preference.dpo import (
    LENGTH_NORMALISED_MARGIN_TYPES,
    TRL_METRIC_NAMES,
    LigerFusedLinearDPOLoss,
    ld_mask_weights,
)
from .base import IGNORE_INDEX, build_config_loss, completion_labels
from .reference import LigerReferenceTrainerMixin

# batch keys that are not model inputs (TRL's DataCollatorForPreference adds them)
_NON_MODEL_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")

# DPOConfig field -> keyword of LigerFusedLinearDPOLoss
_DPO_OPTIONS = {
    "beta": "beta",
    "loss_type": "loss_type",
    "loss_weights": "loss_weights",
    "label_smoothing": "label_smoothing",
    "f_divergence_type": "f_divergence_type",
    "f_alpha_divergence_coef": "f_alpha_divergence_coef",
    "discopop_tau": "discopop_tau",
    "ld_alpha": "ld_alpha",
    "use_weighting": "use_weighting",
}


def build_dpo_loss(args, *, chunk_tokens: Optional[int] = None, softcap=None, logit_scale: float = 1.0):
    """The :class:`LigerFusedLinearDPOLoss` serving a ``trl.DPOConfig`` (ValueError for what it can't)."""
    return build_config_loss(LigerFusedLinearDPOLoss, args, _DPO_OPTIONS, trl.DPOConfig, chunk_tokens=chunk_tokens,
                             softcap=softcap, logit_scale=logit_scale, need_entropy=True)


def _ld_alpha_sums(per_token: torch.Tensor, shift_completion_mask: torch.Tensor, ld_alpha) -> torch.Tensor:
    """Per-sequence sums of ``per_token [2P, T]``; with LD-DPO, tokens beyond the pair's shared
    completion length weighted by ``ld_alpha`` (the loss's own weights, ``ld_mask_weights``)."""
    if ld_alpha is None:
        return per_token.sum(dim=1)
    return (per_token * ld_mask_weights(shift_completion_mask != 0, ld_alpha)).sum(dim=1)


class DPOTrainer(LigerReferenceTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` with ``use_liger`` (see the module docstring)."""

    _liger_config_cls = trl.DPOConfig
    _liger_build_loss = staticmethod(build_dpo_loss)
    _liger_serves_router_aux_loss = True  # TRL 1.16's DPO: loss + router_aux_loss_coef * aux_loss
    _liger_live_fields = {
        "beta": "beta", "loss_type": "loss_types", "loss_weights": "loss_weights", "label_smoothing": "label_smoothing",
        "f_divergence_type": "f_divergence_type", "f_alpha_divergence_coef": "f_alpha_divergence_coef",
        "discopop_tau": None, "ld_alpha": "ld_alpha", "use_weighting": "use_weighting",
    }

    # ------------------------------------------------------------------ reference

    def compute_ref_log_probs(self, model, inputs):
        """Reference log-probs ``(chosen [P], rejected [P])`` of one padded batch (precompute path)."""
        if not self.use_liger:
            return super().compute_ref_log_probs(model, inputs)
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        labels = completion_labels(inputs["input_ids"], completion_mask)
        with self._liger_reference_scope(self._liger_peft_reference()), self.accelerator.autocast():
            per_token = self._liger_token_logps(model, model_kwargs, labels)
        ref_logps = _ld_alpha_sums(per_token.float(), completion_mask[:, 1:].to(per_token.device), self.ld_alpha)
        return ref_logps.chunk(2, dim=0)

    # ------------------------------------------------------------------ the loss

    def _compute_loss(self, model, inputs, return_outputs):
        if not self.use_liger:
            return super()._compute_loss(model, inputs, return_outputs)
        self._liger_live.refresh(self)  # options a callback set on the trainer (trainer.beta...), as TRL reads them
        mode = "train" if self.model.training else "eval"
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        labels = self._liger_scan_ahead(model, completion_labels(inputs["input_ids"], inputs["completion_mask"]))

        # reference: precomputed columns, the policy with its adapter off (PEFT), or the reference model
        ref_chosen = ref_rejected = ref_hidden = ref_weight = ref_bias = None
        if self.precompute_ref_logps:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            ref_hidden, ref_weight, ref_bias, _ = self._liger_reference_hidden(model, model_kwargs, labels=labels)

        # TRL's ipo / sigmoid_norm divide by the completion mask's count before the label shift (one more than
        # the labels where a completion token sits at position 0: an empty prompt without BOS, keep_end truncation)
        lengths = None
        if set(self.liger_loss.loss_options.loss_types) & LENGTH_NORMALISED_MARGIN_TYPES:
            lengths = inputs["completion_mask"].sum(dim=1).float()
        loss, metrics = self._liger_policy_loss(
            model, model_kwargs, labels, ref_hidden, ref_weight, ref_bias,
            ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected, sequence_lengths=lengths,
        )
        # token-weighted means, reduced over processes as TRL does: by their token counts
        chosen, rejected = (labels != IGNORE_INDEX).sum(dim=1).chunk(2, dim=0)
        counts = {"chosen_logits_mean": chosen.sum(), "rejected_logits_mean": rejected.sum(),
                  "mean_token_accuracy": chosen.sum(), "entropy": chosen.sum() + rejected.sum()}
        self._liger_log(mode, metrics, TRL_METRIC_NAMES, inputs=inputs, token_counts=counts)
        return self._liger_return(model, model_kwargs, loss, return_outputs)
