"""``DistillationTrainer``: TRL 1.16's on-policy distillation trainer with our chunked distillation loss.

``DistillationTrainer(model, teacher_model=None, args=None, ..., use_liger=False, liger_patch_model=True,
liger_chunk_tokens=None)`` takes every argument of ``trl.DistillationTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer.
* ``use_liger=True``: ``_compute_loss`` (the method TRL runs inside the student's forward redirection, after its
  on-policy generation built the batch) gets the student's and, under ``no_grad``, the teacher's last hidden
  states aligned to the completion tokens (``[B, K, H]`` / ``[B, K, Ht]``, TRL's own ``_get_last_hidden_state``),
  and the loss is :func:`liger_losses.chunked.distillation.fused_linear_distillation_loss` on them, the completion
  tokens as labels (``-100`` where TRL's loss mask -- completion mask times tool mask -- is 0) and both LM heads
  (``weight [V, H]``, teacher ``[V, Ht]``): the generalized JSD with ``DistillationConfig.beta`` (0 = forward KL,
  1 = reverse KL) at ``temperature``, summed over the valid tokens and divided by their number or by TRL's
  ``num_items_in_batch``. Generation, batching, tool calls are TRL's, untouched. TRL's ``entropy`` metric (the
  student's mean per-token entropy at the temperature) is logged from our loss's statistics, reduced across
  processes as TRL does; the generation metrics are TRL's own. ``liger_patch_model=True`` also swaps both
  models' layers for our kernels; ``liger_chunk_tokens`` fixes the tokens per logits tile. A vision-language
  student and teacher get the batch's image inputs (TRL's ``_get_last_hidden_state`` runs their base models on
  them), as in TRL's step.

Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the option:
a student and a teacher whose heads transform logits differently (softcap / logit scale), a trainer without a local
``teacher_model``, PEFT prompt learning.
"""

from __future__ import annotations

import torch
import trl

from .base import IGNORE_INDEX
from .gkd import LigerDistillationMixin

# the batch's image fields TRL 1.16's step hands both backbones (DistillationTrainer._compute_loss)
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                    "token_type_ids", "mm_token_type_ids", "image_position_ids")


class DistillationTrainer(LigerDistillationMixin, trl.DistillationTrainer):
    """``trl.DistillationTrainer`` with ``use_liger`` (see the module docstring)."""

    _liger_require_teacher = True
    _liger_serves_vision = True

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        """``(loss, entropy_sum, num_valid_tokens)`` of one generated batch (TRL's contract)."""
        if not self.use_liger:
            return super()._compute_loss(unwrapped_student, inputs, num_items_in_batch)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        labels = inputs["completion_ids"].masked_fill(loss_mask == 0, IGNORE_INDEX)
        logits_to_keep = inputs["completion_ids"].size(1)
        images = {k: inputs[k] for k in _MULTIMODAL_KEYS if k in inputs}  # a vision-language batch's, as TRL's

        hidden = self._get_last_hidden_state(unwrapped_student, input_ids, attention_mask, logits_to_keep, **images)
        self.teacher_model.eval()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            teacher_hidden = self._forward_redirection(
                self.teacher_model, unwrapped_teacher, self._get_last_hidden_state, unwrapped_teacher,
                input_ids, attention_mask, logits_to_keep, **images,
            )
        out = self._liger_jsd(unwrapped_student, unwrapped_teacher, hidden, teacher_hidden, labels,
                              temperature=self.temperature, num_items_in_batch=num_items_in_batch)
        num_valid = out.metrics["num_tokens"].detach()
        entropy_sum = (out.metrics["entropy"] * num_valid).detach()
        return out.loss, entropy_sum, num_valid.round().long()
