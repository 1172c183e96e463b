"""``GKDTrainer``: TRL 1.16's GKD trainer whose loss can come from our chunked distillation loss (``use_liger=True``).

``GKDTrainer(model, teacher_model, args, ..., use_liger=False, liger_patch_model=True, liger_chunk_tokens=None)``
takes every argument of ``trl.experimental.gkd.GKDTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer.
* ``use_liger=True``: ``compute_loss`` runs the student's and (under ``no_grad``) the teacher's *backbones* to get
  the last hidden states ``[B, T, H]`` / ``[B, T, Ht]`` and the loss is
  :func:`liger_losses.chunked.distillation.fused_linear_distillation_loss` on ``hidden[:, :-1]``, the labels
  ``labels[:, 1:]`` (``-100`` on prompt and padding) and both LM heads (student ``weight [V, H]``, teacher
  ``[V, Ht]``) -- neither model's ``[B, T, V]`` logits are held whole. As TRL's ``generalized_jsd_loss`` in
  ``GKDTrainer.compute_loss``: the generalized JSD with ``GKDConfig.beta`` (0 = forward KL, 1 = reverse KL) at
  temperature 1 (GKD's ``temperature`` only drives sampling), summed over the valid tokens and divided by their
  number, or by ``num_items_in_batch`` when the Trainer gives it. On-policy generation (``lmbda``) and sequence KD
  (``seq_kd``) are TRL's, untouched: they only change the batch. TRL's GKD logs no metric besides the loss; nor
  does this. ``liger_patch_model=True`` also swaps both models' layers for our kernels.

Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the option:
a student and a teacher whose heads transform logits differently (softcap / logit scale: the loss applies one
transform to both), vision-language models, PEFT prompt learning. :func:`shared_head_transform` and
:class:`LigerDistillationMixin` (the constructor, construction checks, the loss through both heads) are shared
with the distillation adapter.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from trl.experimental.gkd import GKDTrainer as _TRLGKDTrainer

from ..chunked.distillation import fused_linear_distillation_loss
from .base import (
    IGNORE_INDEX,
    LigerTrainerMixin,
    gathered_params,
    head_logit_options,
    reject,
    unwrap_causal_lm,
)
from .multimodal import reject_vision


def shared_head_transform(student, teacher) -> dict:
    """The logit transform (``softcap``, ``logit_scale``) that the student's and the teacher's heads
    share, as keyword arguments of the distillation loss; a ``ValueError`` naming the option when the
    two heads transform their logits differently (the chunked loss applies one transform to both)."""
    s_opts = head_logit_options(unwrap_causal_lm(student).config)
    t_opts = head_logit_options(unwrap_causal_lm(teacher).config)
    for key, name in (("softcap", "final_logit_softcapping"), ("logit_scale", "logit scale")):
        if s_opts[key] != t_opts[key]:
            reject(f"teacher_model.config {name}", t_opts[key],
                   f"the student's is {s_opts[key]!r}; the chunked distillation loss applies one logit "
                   "transform to both heads")
    return {"softcap": s_opts["softcap"], "logit_scale": s_opts["logit_scale"]}


class LigerDistillationMixin(LigerTrainerMixin):
    """What the GKD and on-policy distillation adapters share: the construction checks and the loss through both
    heads. List it before the TRL trainer class; the trainer has ``teacher_model``, ``beta`` and ``_is_vlm``."""

    _liger_require_teacher: bool = False  # reject a trainer built without a local teacher_model
    _liger_serves_vision: bool = False  # True where the batch's image inputs reach both backbones as in TRL's step

    def __init__(
        self,
        model=None,
        teacher_model=None,
        args=None,
        *trl_args: Any,
        use_liger: bool = False,
        liger_patch_model: bool = True,
        liger_chunk_tokens: Optional[int] = None,
        **trl_kwargs: Any,
    ):
        """TRL's ``(model, teacher_model, args, ...)`` plus the three ``liger_*`` keywords."""
        self._liger_setup(
            use_liger=use_liger, liger_patch_model=liger_patch_model, liger_chunk_tokens=liger_chunk_tokens
        )
        super().__init__(model, teacher_model, args, *trl_args, **trl_kwargs)
        if use_liger:
            self._liger_after_trl_init(trl_kwargs)

    def _liger_after_trl_init(self, trl_kwargs) -> None:
        """After TRL's ``__init__``: reject VLMs where not served (and, with ``_liger_require_teacher``, a missing
        teacher), fix the shared head transform, patch both models' layers."""
        if self._is_vlm and not self._liger_serves_vision:
            reject_vision(self.processing_class)
        if self._liger_require_teacher and self.teacher_model is None:
            reject("teacher_model", None, "the chunked loss needs a local teacher model (its hidden states and head)")
        self._liger_head_transform = shared_head_transform(self.model, self.teacher_model)
        self._liger_after_init(self.model, self.teacher_model, trl_kwargs=trl_kwargs)

    def _liger_jsd(self, student, teacher, hidden, teacher_hidden, labels, *, temperature: float,
                   num_items_in_batch):
        """:func:`fused_linear_distillation_loss` (generalized JSD with ``self.beta`` at ``temperature``, summed over
        the valid tokens, divided by their number or ``num_items_in_batch``) of the student's ``hidden [B, K, H]``
        and the teacher's ``teacher_hidden [B, K, Ht]`` on ``labels [B, K]`` through both LM heads (the teacher's
        detached); a ``LossOutput``."""
        weight, bias = self._liger_head(student)
        t_weight, t_bias = self._liger_head(teacher)
        with gathered_params(weight, bias, t_weight, t_bias):
            return fused_linear_distillation_loss(
                weight, hidden, teacher_hidden.to(hidden.device), labels.to(hidden.device),
                teacher_weight=t_weight.detach(), teacher_bias=None if t_bias is None else t_bias.detach(),
                bias=bias, divergence="jsd", beta=float(self.beta), temperature=float(temperature),
                ignore_index=IGNORE_INDEX, reduction="batchmean", num_items_in_batch=num_items_in_batch,
                chunk_tokens=self.liger_chunk_tokens, **self._liger_head_transform,
            )


class GKDTrainer(LigerDistillationMixin, _TRLGKDTrainer):
    """``trl.experimental.gkd.GKDTrainer`` with ``use_liger`` (see the module docstring)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.use_liger:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        model_kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
        labels = inputs["labels"][:, 1:]

        teacher = self.teacher_model
        teacher.eval()
        with torch.no_grad():
            teacher_hidden = self._liger_run(teacher, self._liger_backbone_hidden, teacher, model_kwargs)[:, :-1]

        def head_loss():
            hidden = self._liger_backbone_hidden(model, model_kwargs)[:, :-1]
            return self._liger_jsd(model, teacher, hidden, teacher_hidden, labels, temperature=1.0,
                                   num_items_in_batch=num_items_in_batch)

        loss, _ = self._liger_run(model, head_loss)
        return self._liger_return(model, model_kwargs, loss, return_outputs)  # TRL returns the student's outputs
