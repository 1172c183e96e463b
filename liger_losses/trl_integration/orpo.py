"""``ORPOTrainer``: TRL 1.16's ORPO trainer whose loss can come from our chunked engine (``use_liger=True``).

``ORPOTrainer(model, args, ..., use_liger=False, liger_patch_model=True, liger_chunk_tokens=None)`` takes every
argument of ``trl.experimental.orpo.ORPOTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer.
* ``use_liger=True``: ``get_batch_loss_metrics`` runs the policy *backbone* on the ``[chosen; rejected]`` batch
  (hidden ``[2P, T, H]``) and computes TRL's ORPO loss from ``hidden[:, :-1]`` and the LM head ``weight [V, H]``
  in chunks -- the ``[2P, T, V]`` logits are never held whole:

      loss = NLL_chosen - beta * mean_pairs(logsigmoid(log_odds(a_c, a_r)))

  with ``a_c, a_r`` the per-token mean log-probs of the chosen/rejected *completions* and, as in TRL,
  ``NLL_chosen`` the token-averaged cross-entropy over every attended token of the chosen sequences (prompt
  *and* completion). Our ``LigerFusedLinearORPOLoss`` takes one label set (its NLL covers the same tokens as the
  odds ratio), so this adapter runs the engine
  (:func:`liger_losses.chunked.sequence.fused_linear_sequence_objective`) itself, in one pass, on four groups of
  sequences laid out as pairs ``[chosen completion; chosen prompt | rejected completion; empty]`` (the chosen
  hidden states enter twice, with disjoint labels, so no token is projected twice): the real pairs carry the
  odds ratio, every chosen group its share of the NLL (:class:`ORPOPromptNLLObjective`). The formula pieces are
  :func:`liger_losses.chunked.preference.orpo.orpo_pair_losses` and ``orpo_log_odds``. Every metric TRL logs
  (``rewards/*``, ``logps/*``, ``logits/*``, ``nll_loss``, ``log_odds_ratio``, ``log_odds_chosen``) is returned
  under TRL's name (``eval_`` prefixed in evaluation); ``logits/*`` are the mean over every position but the last
  and every vocabulary entry, as TRL's.

Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the option:
encoder-decoder models, PEFT prompt learning. MoE models: ``aux_loss_coef * aux_loss`` of the policy's own
backbone forward is added to the loss, as TRL does (not logged, as TRL's ORPO does not log it).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from trl.experimental.orpo import ORPOConfig
from trl.experimental.orpo import ORPOTrainer as _TRLORPOTrainer

from ..chunked.preference.common import average_logps, chosen_nll_per_unit, split_pairs
from ..chunked.preference.orpo import TRL_METRIC_NAMES, orpo_log_odds, orpo_pair_losses
from ..chunked.sequence import fused_linear_sequence_objective
from ..kernels.utils import check_range
from .base import (
    IGNORE_INDEX,
    LigerTrainerMixin,
    completion_labels,
    gathered_params,
    head_logit_options,
    unwrap_causal_lm,
)
from .cpo import DeferredStoreMixin, check_paired_model, gathered_metric_means, mean_logits_of_groups
from .router_aux import policy_hidden_and_router_aux


class ORPOPromptNLLObjective:
    """Engine objective (pairs, separable) for TRL's ORPO on the layout ``[c_comp; c_prompt | r_comp; empty]``.

    The batch holds ``4P`` sequences: chosen completions (``0..P-1``), chosen prompt tokens (``P..2P-1``),
    rejected completions (``2P..3P-1``), empty rows (``3P..4P-1``); the engine's pairs are ``(u, u + 2P)``, i.e.
    ``2P`` units. Per unit: its chosen sequence's share of the chosen-token NLL (whose mean over the ``2P`` units
    is the batch's token-averaged NLL) minus, for the ``P`` real pairs only, ``2 beta logsigmoid(log_odds)``
    (so that the mean over ``2P`` units is ``beta`` times the mean over pairs). A pair with an empty side gets no
    odds-ratio term (TRL gives NaN there).
    """

    separable = True

    def __init__(self, *, beta: float, num_pairs: int):
        self.beta = beta
        self.num_pairs = num_pairs

    def __call__(self, stats):
        # orpo_pair_losses with 2 beta: nll - (2 beta) logsigmoid(log_odds), 0 odds term where not ``real``
        chosen_sum, _ = split_pairs(stats.logps)
        nll = chosen_nll_per_unit(chosen_sum, stats.batch_num_tokens)
        chosen_avg, rejected_avg = split_pairs(average_logps(stats.logps, stats.num_tokens))
        c_len, r_len = split_pairs(stats.num_tokens)
        chosen_index, _ = split_pairs(stats.index)
        real = (chosen_index < self.num_pairs) & (c_len > 0) & (r_len > 0)
        return orpo_pair_losses(chosen_avg, rejected_avg, nll, beta=2.0 * self.beta, valid_pairs=real), {}


def orpo_trl_metrics(stats, *, beta: float, num_pairs: int) -> dict:
    """The 0-d values TRL's ORPOTrainer logs (our keys), from the whole-batch stats of the 4P layout."""
    P = num_pairs
    avg = average_logps(stats.logps, stats.num_tokens)
    chosen, rejected = avg[:P], avg[2 * P:3 * P]
    log_odds = orpo_log_odds(chosen, rejected)
    chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
    n_chosen = stats.num_tokens[:2 * P].sum()
    metrics = {
        "chosen_rewards": chosen_rewards.mean(),
        "rejected_rewards": rejected_rewards.mean(),
        "reward_accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "reward_margins": (chosen_rewards - rejected_rewards).mean(),
        "chosen_logps": chosen.mean(),
        "rejected_logps": rejected.mean(),
        "nll_loss": -stats.logps[:2 * P].sum() / n_chosen.clamp(min=1.0),
        "log_odds_ratio": F.logsigmoid(log_odds).mean(),
        "log_odds_chosen": log_odds.mean(),
    }
    return {k: v.detach() for k, v in metrics.items()}


class ORPOTrainer(LigerTrainerMixin, DeferredStoreMixin, _TRLORPOTrainer):
    """``trl.experimental.orpo.ORPOTrainer`` with ``use_liger`` (see the module docstring)."""

    def __init__(
        self,
        model=None,
        args: Optional[ORPOConfig] = None,
        *trl_args: Any,
        use_liger: bool = False,
        liger_patch_model: bool = True,
        liger_chunk_tokens: Optional[int] = None,
        **trl_kwargs: Any,
    ):
        self._liger_setup(
            use_liger=use_liger, liger_patch_model=liger_patch_model, liger_chunk_tokens=liger_chunk_tokens
        )
        if use_liger and args is not None:
            try:
                check_range("beta", args.beta, 0.0, None)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"use_liger=True cannot serve this ORPOConfig.beta: {exc}") from exc
        super().__init__(model, args, *trl_args, **trl_kwargs)
        if not use_liger:
            return
        check_paired_model(self)
        self._liger_logit_opts = head_logit_options(unwrap_causal_lm(self.model).config)
        self._liger_after_init(self.model, trl_kwargs=trl_kwargs)

    def _liger_orpo(self, weight, bias, hidden, labels, nll_labels):
        """``(loss, metrics)`` of TRL's ORPO from ``hidden [2P, T-1, H]``, the completion ``labels [2P, T-1]``
        and the chosen NLL labels ``nll_labels [P, T-1]`` (every attended token)."""
        P = hidden.shape[0] // 2
        h_c, h_r = hidden[:P], hidden[P:]
        l_c, l_r = labels[:P], labels[P:]
        prompt_labels = nll_labels.masked_fill(l_c != IGNORE_INDEX, IGNORE_INDEX)
        empty = torch.full_like(l_r, IGNORE_INDEX)
        layout_hidden = torch.cat([h_c, h_c, h_r, h_r], dim=0)
        layout_labels = torch.cat([l_c, prompt_labels, l_r, empty], dim=0)
        loss, _, stats = fused_linear_sequence_objective(
            weight, layout_hidden, layout_labels, ORPOPromptNLLObjective(beta=self.beta, num_pairs=P),
            group_size=2, separable=True, bias=bias, ignore_index=IGNORE_INDEX,
            chunk_tokens=self.liger_chunk_tokens, **self._liger_logit_opts,
        )
        return loss, orpo_trl_metrics(stats, beta=self.beta, num_pairs=P)

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        """``(loss, {TRL metric name: float})`` of one ``[chosen; rejected]`` batch."""
        if not self.use_liger:
            return super().get_batch_loss_metrics(model, batch, train_eval)
        cat = self.concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=self.padding_value, device=self.accelerator.device,
        )
        num_pairs = batch["chosen_labels"].shape[0]
        input_ids, attention_mask = cat["concatenated_input_ids"], cat["concatenated_attention_mask"]
        model_kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        labels = cat["concatenated_labels"][:, 1:]
        nll_labels = completion_labels(input_ids[:num_pairs], attention_mask[:num_pairs])  # every attended token

        def head_loss():
            hidden, aux = policy_hidden_and_router_aux(self, model, model_kwargs)
            hidden = hidden[:, :-1]
            weight, bias = self._liger_head(model)
            with gathered_params(weight, bias):
                loss, metrics = self._liger_orpo(
                    weight, bias, hidden, labels.to(hidden.device), nll_labels.to(hidden.device)
                )
                metrics["chosen_logits_mean"], metrics["rejected_logits_mean"] = mean_logits_of_groups(
                    [hidden[:num_pairs], hidden[num_pairs:]], weight, bias, **self._liger_logit_opts)
            return loss, metrics, aux

        loss, metrics, aux = self._liger_run(model, head_loss)
        if aux is not None:  # TRL 1.16's ORPO: loss + aux_loss_coef * aux_loss, not logged
            loss = loss + self.aux_loss_coef * aux
        prefix = "eval_" if train_eval == "eval" else ""
        return loss.to(self.args.device), gathered_metric_means(self, metrics, TRL_METRIC_NAMES, prefix)
