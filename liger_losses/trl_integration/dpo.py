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
  ``liger_chunk_tokens`` fixes the tokens per logits tile (default: sized from a memory budget).

Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the
option: ``use_weighting`` (WPO), ``ld_alpha`` with an ``"sft"`` loss term, vision-language models,
PEFT prompt learning, MoE router auxiliary loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
import trl
from trl.models.utils import disable_gradient_checkpointing

from ..chunked.preference.dpo import TRL_METRIC_NAMES, LigerFusedLinearDPOLoss
from .base import (
    IGNORE_INDEX,
    LigerTrainerMixin,
    build_loss,
    gathered_params,
    head_logit_options,
    is_peft_model,
    reference_adapter,
    reject,
    unwrap_causal_lm,
)

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


def _config_defaults(config_cls) -> dict:
    out = {}
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def build_dpo_loss(args, *, chunk_tokens: Optional[int] = None, softcap=None, logit_scale: float = 1.0):
    """The :class:`LigerFusedLinearDPOLoss` serving a ``trl.DPOConfig`` (ValueError for what it can't)."""
    options = {field: (kw, getattr(args, field)) for field, kw in _DPO_OPTIONS.items()}
    options["liger_chunk_tokens"] = ("chunk_tokens", chunk_tokens)
    options["need_entropy"] = ("need_entropy", True)  # TRL logs the entropy
    options["ignore_index"] = ("ignore_index", IGNORE_INDEX)
    defaults = _config_defaults(trl.DPOConfig)
    defaults.update(liger_chunk_tokens=None, need_entropy=True, ignore_index=IGNORE_INDEX)
    if softcap is not None:
        options["final_logit_softcapping"] = ("softcap", softcap)
    if logit_scale != 1.0:
        options["logit_scale"] = ("logit_scale", logit_scale)
    defaults.update(final_logit_softcapping=None, logit_scale=1.0)
    return build_loss(LigerFusedLinearDPOLoss, options, defaults, "DPOConfig")


def _ld_alpha_sums(per_token: torch.Tensor, shift_completion_mask: torch.Tensor, ld_alpha) -> torch.Tensor:
    """Per-sequence sums of ``per_token [2P, T]``; with LD-DPO, tokens beyond the pair's shared
    completion length weighted by ``ld_alpha`` (TRL 1.16's rule)."""
    if ld_alpha is None:
        return per_token.sum(dim=1)
    pos = shift_completion_mask.cumsum(dim=1)
    lens = shift_completion_mask.sum(dim=1).long()
    c_len, r_len = lens.chunk(2, dim=0)
    shared = torch.minimum(c_len, r_len)
    shared = torch.cat([shared, shared], dim=0).unsqueeze(1)
    shared_mask = (pos > 0) & (pos <= shared)
    tail_mask = pos > shared
    return (per_token * shared_mask).sum(dim=1) + ld_alpha * (per_token * tail_mask).sum(dim=1)


class DPOTrainer(LigerTrainerMixin, trl.DPOTrainer):
    """``trl.DPOTrainer`` with ``use_liger`` (see the module docstring)."""

    def __init__(
        self,
        model,
        ref_model=None,
        args: Optional[trl.DPOConfig] = None,
        *trl_args: Any,
        use_liger: bool = False,
        liger_patch_model: bool = True,
        liger_chunk_tokens: Optional[int] = None,
        **trl_kwargs: Any,
    ):
        self._liger_setup(
            use_liger=use_liger, liger_patch_model=liger_patch_model, liger_chunk_tokens=liger_chunk_tokens
        )
        if use_liger:
            if args is None:
                name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
                args = trl.DPOConfig(f"{str(name).split('/')[-1] or 'model'}-DPO")
            self.liger_loss = build_dpo_loss(args, chunk_tokens=liger_chunk_tokens)  # option checks, fail fast
            processing_class = trl_kwargs.get("processing_class")
            if processing_class is None and len(trl_args) >= 4:
                processing_class = trl_args[3]
            from transformers import ProcessorMixin

            if isinstance(processing_class, ProcessorMixin):
                reject("processing_class", type(processing_class).__name__,
                       "vision-language models are not supported (text-only causal LMs)")
        super().__init__(model, ref_model, args, *trl_args, **trl_kwargs)
        if not use_liger:
            return
        if self._is_vision_dataset:
            reject("train_dataset", "<vision dataset>", "vision-language data is not supported")
        if self.aux_loss_enabled:
            reject("router_aux_loss_coef", self.router_aux_loss_coef,
                   "the MoE load-balancing loss needs the router logits of TRL's forward")
        logit_opts = head_logit_options(unwrap_causal_lm(self.model).config)
        if logit_opts["softcap"] is not None or logit_opts["logit_scale"] != 1.0:
            self.liger_loss = build_dpo_loss(self.args, chunk_tokens=liger_chunk_tokens, **logit_opts)
        user_optimizer = trl_kwargs.get("optimizers", (None, None))[0] is not None
        self._liger_after_init(self.model, self.ref_model, user_optimizer=user_optimizer)

    # ------------------------------------------------------------------ reference

    def _liger_reference_context(self):
        """Context where the policy acts as the reference (PEFT without a separate ref model)."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        return reference_adapter(unwrapped)

    def compute_ref_log_probs(self, model, inputs):
        """Reference log-probs ``(chosen [P], rejected [P])`` of one padded batch (precompute path)."""
        if not self.use_liger:
            return super().compute_ref_log_probs(model, inputs)
        from ..chunked.token_logprobs import fused_linear_token_logprobs

        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, IGNORE_INDEX)[:, 1:]
        logit_opts = head_logit_options(unwrap_causal_lm(model).config)

        def per_token_logps():
            hidden = self._liger_backbone_hidden(model, model_kwargs)[:, :-1]
            weight, bias = self._liger_head(model)
            with gathered_params(weight, bias):
                return fused_linear_token_logprobs(
                    weight, hidden, labels.to(hidden.device), bias=bias, ignore_index=IGNORE_INDEX,
                    chunk_tokens=self.liger_chunk_tokens, **logit_opts,
                )

        peft_ref = self.ref_model is None and is_peft_model(self.accelerator.unwrap_model(self.model))
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            self._liger_reference_context() if peft_ref else contextlib.nullcontext(),
            self.accelerator.autocast(),
        ):
            per_token = self._liger_run(model, per_token_logps)
        ref_logps = _ld_alpha_sums(per_token.float(), completion_mask[:, 1:].to(per_token.device), self.ld_alpha)
        return ref_logps.chunk(2, dim=0)

    # ------------------------------------------------------------------ the loss

    def _compute_loss(self, model, inputs, return_outputs):
        if not self.use_liger:
            return super()._compute_loss(model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        model_kwargs = {k: v for k, v in inputs.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, IGNORE_INDEX)[:, 1:]

        ref_chosen = ref_rejected = None
        ref_hidden = ref_weight = ref_bias = None
        ref_model = None
        if self.precompute_ref_logps:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        elif self.ref_model is None:  # PEFT: the policy with its adapter disabled (or the "ref" adapter)
            with (
                torch.no_grad(),
                disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
                self._liger_reference_context(),
            ):
                ref_hidden = self._liger_run(model, self._liger_backbone_hidden, model, model_kwargs)[:, :-1]
        else:
            ref_model = self.ref_model
            with torch.no_grad():
                ref_hidden = self._liger_run(
                    ref_model, self._liger_backbone_hidden, ref_model, model_kwargs
                )[:, :-1]
            ref_weight, ref_bias = self._liger_head(ref_model)

        def policy_loss():
            hidden = self._liger_backbone_hidden(model, model_kwargs)[:, :-1]
            weight, bias = self._liger_head(model)
            with gathered_params(weight, bias, ref_weight, ref_bias):
                return self.liger_loss(
                    weight, hidden, ref_hidden, labels.to(hidden.device), bias=bias,
                    ref_weight=None if ref_weight is None else ref_weight.detach(),
                    ref_bias=None if ref_bias is None else ref_bias.detach(),
                    ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
                )

        loss, metrics = self._liger_run(model, policy_loss)

        if mode == "train":
            num_tokens = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
            self._total_train_tokens += num_tokens // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        self._liger_log(mode, metrics, TRL_METRIC_NAMES)

        if return_outputs:  # TRL's deprecated path: logits for compute_metrics, by an extra forward
            with torch.no_grad():
                outputs = model(**model_kwargs)
            return loss, outputs
        return loss

