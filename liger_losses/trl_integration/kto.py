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
  tokens per logits tile. MoE models (``aux_loss_enabled``, TRL's rule): the policy's forward on the batch
  returns the router logits and, as TRL, ``router_aux_loss_coef * aux_loss`` is added to the loss and
  ``aux_loss`` logged (``router_aux.py``; the KL and reference forwards take none, as TRL's). The backbone
  calls run pad-free where they can: the attended tokens alone, packed (``patching/pad_free.py``). A
  vision-language model's batch with images runs the base models on them (policy, reference and the KL
  completions, which reuse the prompts' images; ``multimodal.py``), the language model pad-free where served.

Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the option:
PEFT prompt learning.
"""

from __future__ import annotations

from typing import Optional

import torch
import trl

from ..chunked.preference.kto import LigerFusedLinearKTOLoss
from .base import build_config_loss, completion_labels
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
    _liger_serves_router_aux_loss = True  # TRL 1.16's KTO: loss + router_aux_loss_coef * aux_loss
    _liger_live_fields = {"beta": "beta", "loss_type": "loss_type", "desirable_weight": "desirable_weight",
                          "undesirable_weight": "undesirable_weight"}

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
        return kwargs, completion_labels(batch["KL_input_ids"], batch["KL_completion_mask"])

    # ------------------------------------------------------------------ reference precompute

    def compute_ref_log_probs(self, model, inputs):
        """Reference ``(completion_logps [B], KL_logps [B] or None)`` of one padded batch (precompute path)."""
        if not self.use_liger:
            return super().compute_ref_log_probs(model, inputs)
        model_kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                        "use_cache": False}
        labels = completion_labels(inputs["input_ids"], inputs["completion_mask"])
        with self._liger_reference_scope(self._liger_peft_reference()), self.accelerator.autocast():
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
        self._liger_live.refresh(self)  # options a callback set on the trainer (trainer.beta...), as TRL reads them
        mode = "train" if self.model.training else "eval"
        device = self.accelerator.device
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
        desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=device)
        model_kwargs = {k: v for k, v in batch.items() if k not in _NON_MODEL_KEYS}
        model_kwargs["use_cache"] = False
        labels = self._liger_scan_ahead(model, completion_labels(batch["input_ids"], batch["completion_mask"]))
        if self.calculate_KL:
            kl_kwargs, kl_labels = self._liger_kl_inputs(model_kwargs, batch)

        # reference: precomputed columns, the policy with its adapter off (PEFT), or the reference model
        ref_logps = ref_kl_logps = ref_hidden = ref_weight = ref_bias = None
        if self.precompute_ref_logps:
            ref_logps = batch["ref_logps"].float()
            if self.calculate_KL:
                ref_kl_logps = batch["ref_KL_logps"].float()
        else:
            also = (lambda ref: self._liger_sequence_logps(ref, kl_kwargs, kl_labels)) if self.calculate_KL else None
            ref_hidden, ref_weight, ref_bias, ref_kl_logps = self._liger_reference_hidden(
                model, model_kwargs, also=also, labels=labels)

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
        """Log what TRL logs, reduced as TRL does: sums and counts summed over processes (one gather), then divided."""
        mask = batch["completion_mask"][:, 1:].to(desirable.device)
        tok_des = (mask * desirable.unsqueeze(1)).sum().float()
        tok_all = mask.sum().float()
        tok_und = tok_all - tok_des
        n_des = desirable.sum().float()
        n_und = desirable.numel() - n_des

        def local_sum(key, count):  # local mean * local count (0 when absent)
            return metrics[key].float() * count if key in metrics else torch.zeros((), device=count.device)

        def append(sums):
            (kl, all_tokens, entropy, all_tok_des, all_tok_und, logits_c, logits_r, all_des, all_und,
             rewards_c, logps_c, rewards_r, logps_r) = sums
            log = self._metrics[mode]
            log["kl"].append(kl)
            log["entropy"].append(entropy / all_tokens if all_tokens > 0 else 0.0)
            if all_tok_des > 0:
                log["logits/chosen"].append(logits_c / all_tok_des)
            if all_tok_und > 0:
                log["logits/rejected"].append(logits_r / all_tok_und)
            if all_des > 0:
                log["rewards/chosen"].append(rewards_c / all_des)
                log["logps/chosen"].append(logps_c / all_des)
            if all_und > 0:
                log["rewards/rejected"].append(rewards_r / all_und)
                log["logps/rejected"].append(logps_r / all_und)
            if all_des > 0 and all_und > 0:
                log["rewards/margins"].append(log["rewards/chosen"][-1] - log["rewards/rejected"][-1])

        # kl is already the mean over processes (equal on all): its "mean" leaves it as it is
        self._liger_gather(mode, [
            kl, tok_all, local_sum("entropy", tok_all), tok_des, tok_und,
            local_sum("chosen_logits_mean", tok_des), local_sum("rejected_logits_mean", tok_und), n_des, n_und,
            local_sum("chosen_rewards", n_des), local_sum("chosen_logps", n_des),
            local_sum("rejected_rewards", n_und), local_sum("rejected_logps", n_und),
        ], ["mean"] + ["sum"] * 12, inputs=batch, then=append)
