"""``KTOTrainer``: TRL 1.16's (stable) KTO trainer whose loss can come from our chunked KTO loss (``use_liger=True``).

``KTOTrainer(model, ref_model=None, args=None, ..., use_liger=False, liger_patch_model=True,
liger_chunk_tokens=None)`` takes every argument of ``trl.KTOTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer.
* ``use_liger=True``: ``_compute_loss`` runs the policy *backbone* to get the last hidden states ``[B, T, H]`` of
  the unpaired batch and the loss comes from :class:`liger_losses.chunked.preference.kto.LigerFusedLinearKTOLoss`
  on ``hidden[:, :-1]``, the completion labels ``[B, T-1]`` (``-100`` on prompt and padding), the desirability
  ``label [B]`` and the LM head ``weight [V, H]`` -- the logits are never held whole. The reference is the
  reference model's backbone hidden states under ``no_grad`` (with its own head), or the policy with its PEFT
  adapter disabled (or the "ref" adapter), or the precomputed ``ref_logps`` column
  (``precompute_ref_log_probs=True``; the precompute itself also uses our chunked log-probs, see
  :meth:`KTOTrainer.compute_ref_log_probs`). For ``loss_type="kto"`` the KL estimate is, as in TRL,
  ``clamp(mean over processes of mean_b(KL_logps - ref_KL_logps), min=0)`` on the mismatched ``KL_*``
  completions, computed forward-only with chunked log-probs and handed to the loss as ``kl=``. Every metric TRL
  logs (``kl``, ``entropy``, ``logits/*``, ``rewards/*``, ``logps/*``, ``rewards/margins``, ``num_tokens``) is
  logged under TRL's name, reduced across processes as TRL does (sums over processes / global counts).
  ``liger_patch_model=True`` also swaps the models' layers for our kernels; ``liger_chunk_tokens`` fixes the
  tokens per logits tile.

Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the option:
vision-language models / datasets, MoE router auxiliary loss (``router_aux_loss_coef``), PEFT prompt learning.
"""

from __future__ import annotations

from typing import Optional

import torch
import trl

from ..chunked.preference.kto import LigerFusedLinearKTOLoss
from .base import IGNORE_INDEX, build_config_loss, is_peft_model
from .reference import LigerReferenceTrainerMixin

# batch keys that are not model inputs (TRL's unpaired-preference collator / precompute add them)
_NON_MODEL_KEYS = frozenset({
    "completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask", "KL_token_type_ids",
    "KL_mm_token_type_ids", "label", "ref_logps", "ref_KL_logps",
})

# KTOConfig field -> keyword of LigerFusedLinearKTOLoss
_KTO_OPTIONS = {
    "beta": "beta",
    "loss_type": "loss_type",
    "desirable_weight": "desirable_weight",
    "undesirable_weight": "undesirable_weight",
}


def build_kto_loss(args, *, chunk_tokens: Optional[int] = None, softcap=None, logit_scale: float = 1.0):
    """The :class:`LigerFusedLinearKTOLoss` serving a ``trl.KTOConfig`` (ValueError for what it can't)."""
    return build_config_loss(LigerFusedLinearKTOLoss, args, _KTO_OPTIONS, trl.KTOConfig, chunk_tokens=chunk_tokens,
                             softcap=softcap, logit_scale=logit_scale, need_entropy=True)


class KTOTrainer(LigerReferenceTrainerMixin, trl.KTOTrainer):
    """``trl.KTOTrainer`` with ``use_liger`` (see the module docstring)."""

    _liger_config_cls = trl.KTOConfig
    _liger_build_loss = staticmethod(build_kto_loss)

    # ------------------------------------------------------------------ helpers

    def _liger_sequence_logps(self, model, model_kwargs, labels):
        """Summed completion log-probs ``[B]`` (float32) of ``model`` on ``labels [B, T-1]``, no grad expected."""
        return self._liger_token_logps(model, model_kwargs, labels).float().sum(-1)

    @staticmethod
    def _liger_kl_inputs(model_kwargs, batch):
        """(model kwargs, labels [B, T'-1]) of the mismatched KL completions."""
        kwargs = dict(model_kwargs, input_ids=batch["KL_input_ids"], attention_mask=batch["KL_attention_mask"])
        for key in ("token_type_ids", "mm_token_type_ids"):
            if f"KL_{key}" in batch:
                kwargs[key] = batch[f"KL_{key}"]
        labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, IGNORE_INDEX)[:, 1:]
        return kwargs, labels

    # ------------------------------------------------------------------ reference precompute

    def compute_ref_log_probs(self, model, inputs):
        """Reference ``(completion_logps [B], KL_logps [B] or None)`` of one padded batch (precompute path)."""
        if not self.use_liger:
            return super().compute_ref_log_probs(model, inputs)
        model_kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                        "use_cache": False}
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX)[:, 1:]
        peft_ref = self.ref_model is None and is_peft_model(self.accelerator.unwrap_model(self.model))
        with self._liger_reference_scope(peft_ref), self.accelerator.autocast():
            logps = self._liger_sequence_logps(model, model_kwargs, labels)
            kl_logps = None
            if self.calculate_KL:
                kl_kwargs, kl_labels = self._liger_kl_inputs(model_kwargs, inputs)
                kl_logps = self._liger_sequence_logps(model, kl_kwargs, kl_labels)
        return logps, kl_logps

    # ------------------------------------------------------------------ the loss

    def _compute_loss(self, model, inputs, return_outputs):
        if not self.use_liger:
            return super()._compute_loss(model, inputs, return_outputs)
        mode = "train" if self.model.training else "eval"
        device = self.accelerator.device
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=device)
        model_kwargs = {k: v for k, v in batch.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)[:, 1:]
        if self.calculate_KL:
            kl_kwargs, kl_labels = self._liger_kl_inputs(model_kwargs, batch)

        # reference: precomputed columns, the policy with its adapter off (PEFT), or the reference model
        ref_logps = ref_kl_logps = ref_hidden = ref_weight = ref_bias = None
        if self.precompute_ref_logps:
            ref_logps = batch["ref_logps"].float()
            if self.calculate_KL:
                ref_kl_logps = batch["ref_KL_logps"].float()
        else:
            peft_ref = self.ref_model is None
            ref = model if peft_ref else self.ref_model
            with self._liger_reference_scope(peft_ref):
                ref_hidden = self._liger_run(ref, self._liger_backbone_hidden, ref, model_kwargs)[:, :-1]
                if self.calculate_KL:
                    ref_kl_logps = self._liger_sequence_logps(ref, kl_kwargs, kl_labels)
            if not peft_ref:
                ref_weight, ref_bias = self._liger_head(ref)

        # the KL estimate (forward only), averaged over processes before the clamp as in TRL
        if self.calculate_KL:
            with torch.no_grad():
                kl_logps = self._liger_sequence_logps(model, kl_kwargs, kl_labels)
            kl = (kl_logps - ref_kl_logps.to(kl_logps.device)).mean().detach()
            kl = self.accelerator.gather_for_metrics(kl).mean().clamp(min=0)
        else:
            kl = torch.zeros((), device=device)

        loss, metrics = self._liger_policy_loss(
            model, model_kwargs, labels, ref_hidden, ref_weight, ref_bias, preference_labels=desirable,
            ref_logps=ref_logps, kl=kl,
        )
        self._liger_log_kto(mode, metrics, kl, desirable, batch)
        return self._liger_return(model, model_kwargs, loss, return_outputs)

    def _liger_log_kto(self, mode, metrics, kl, desirable, batch) -> None:
        """Log what TRL logs, reduced as TRL does: sums and counts gathered over processes, then divided."""
        gather = self.accelerator.gather_for_metrics
        log = self._metrics[mode]
        mask = batch["completion_mask"][:, 1:].to(desirable.device)
        tok_des = (mask * desirable.unsqueeze(1)).sum().float()
        tok_all = mask.sum().float()
        tok_und = tok_all - tok_des
        n_des = desirable.sum().float()
        n_und = desirable.numel() - n_des

        def global_sum(key, count):  # local mean * local count, summed over processes (0 when absent)
            local = metrics[key].float() * count if key in metrics else torch.zeros((), device=count.device)
            return gather(local.reshape(1)).sum().item()

        def total(count):
            return gather(count.reshape(1)).sum().item()

        log["kl"].append(kl.item())
        all_tokens = total(tok_all)
        log["entropy"].append(global_sum("entropy", tok_all) / all_tokens if all_tokens > 0 else 0.0)
        self._liger_count_tokens(mode, batch["attention_mask"])
        all_tok_des, all_tok_und = total(tok_des), total(tok_und)
        if all_tok_des > 0:
            log["logits/chosen"].append(global_sum("chosen_logits_mean", tok_des) / all_tok_des)
        if all_tok_und > 0:
            log["logits/rejected"].append(global_sum("rejected_logits_mean", tok_und) / all_tok_und)
        all_des, all_und = total(n_des), total(n_und)
        if all_des > 0:
            log["rewards/chosen"].append(global_sum("chosen_rewards", n_des) / all_des)
            log["logps/chosen"].append(global_sum("chosen_logps", n_des) / all_des)
        if all_und > 0:
            log["rewards/rejected"].append(global_sum("rejected_rewards", n_und) / all_und)
            log["logps/rejected"].append(global_sum("rejected_logps", n_und) / all_und)
        if all_des > 0 and all_und > 0:
            log["rewards/margins"].append(log["rewards/chosen"][-1] - log["rewards/rejected"][-1])
