"""``CPOTrainer``: TRL 1.16's CPO trainer (CPO, SimPO, AlphaPO) whose loss can come from our chunked CPO loss.

``CPOTrainer(model, args, ..., use_liger=False, liger_patch_model=True, liger_chunk_tokens=None)`` takes every
argument of ``trl.experimental.cpo.CPOTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer (nothing overridden does anything).
* ``use_liger=True``: ``get_batch_loss_metrics`` (TRL's method that runs the model on the ``[chosen; rejected]``
  batch and applies the CPO formula, in training and evaluation) runs the policy *backbone* to get the last
  hidden states ``[2P, T, H]`` and the loss comes from
  :class:`liger_losses.chunked.preference.cpo.LigerFusedLinearCPOLoss` on ``hidden[:, :-1]``, the completion
  labels ``[2P, T-1]`` (int64, ``-100`` on prompt and padding) and the LM head ``weight [V, H]`` (+ ``bias``) --
  the ``[2P, T, V]`` logits are never held whole. SimPO is ``CPOConfig(loss_type="simpo", cpo_alpha=0)``,
  AlphaPO ``alpha != 0``. Every metric TRL logs (``rewards/*``, ``logps/*``, ``logits/*``, ``nll_loss``) is
  returned under TRL's name (``eval_`` prefixed in evaluation). ``logits/chosen`` / ``logits/rejected`` are, as in
  TRL, the mean logit over *every* position and vocabulary entry of the chosen / rejected rows, obtained without
  logits from ``mean(hidden) . mean_v(weight) + mean(bias)`` (see :func:`mean_logit_all_positions`).
  ``liger_patch_model=True`` also swaps the model's layers for our kernels; ``liger_chunk_tokens`` fixes the
  tokens per logits tile.

Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the option:
encoder-decoder models (``is_encoder_decoder``), PEFT prompt learning. MoE models: ``aux_loss_coef *
aux_loss`` of the policy's own backbone forward is added to the loss, as TRL does (not logged, as TRL's CPO
does not log it). Also :func:`mean_logit_all_positions` / :func:`mean_logits_of_groups` and
:func:`gathered_metric_means` live here and are shared by the ORPO adapter.
"""

from __future__ import annotations

import functools
from typing import Any, List, Mapping, Optional, Sequence

import torch
from trl.experimental.cpo import CPOConfig
from trl.experimental.cpo import CPOTrainer as _TRLCPOTrainer

from ..chunked.preference.cpo import TRL_METRIC_NAMES, LigerFusedLinearCPOLoss
from .base import (
    LigerTrainerMixin,
    build_config_loss,
    gather_metric_tensor,
    gathered_params,
    head_logit_options,
    reject,
    unwrap_causal_lm,
)
from .live_options import LiveLoss
from .metrics import QueuedMetrics
from .router_aux import policy_hidden_and_router_aux

# CPOConfig field -> keyword of LigerFusedLinearCPOLoss
_CPO_OPTIONS = {
    "beta": "beta",
    "loss_type": "loss_type",
    "cpo_alpha": "cpo_alpha",
    "label_smoothing": "label_smoothing",
    "simpo_gamma": "simpo_gamma",
    "alpha": "alpha",
}


def mean_logit_all_positions(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                             softcap: Optional[float] = None, logit_scale: float = 1.0,
                             chunk_rows: int = 1024) -> torch.Tensor:
    """0-d float32 mean of ``logits = softcap(logit_scale * (hidden @ weight.T + bias))`` over every row of
    ``hidden [..., H]`` and every vocabulary entry of ``weight [V, H]``, under no grad.

    Without softcap the mean is linear: ``logit_scale * (mean_rows(hidden) . mean_v(weight) + mean(bias))``, two
    reductions and no GEMM. With a softcap the logits are formed ``chunk_rows`` rows at a time (forward only).
    0 for an empty ``hidden``. :func:`mean_logits_of_groups` does several row groups with one head reduction.
    """
    return mean_logits_of_groups([hidden], weight, bias, softcap=softcap, logit_scale=logit_scale,
                                 chunk_rows=chunk_rows)[0]


def mean_logits_of_groups(groups: Sequence[torch.Tensor], weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                          *, softcap: Optional[float] = None, logit_scale: float = 1.0,
                          chunk_rows: int = 1024) -> List[torch.Tensor]:
    """:func:`mean_logit_all_positions` of each hidden-state tensor of ``groups`` (e.g. the chosen and the rejected
    rows), reducing (no softcap: ``mean_v(weight)``, ``mean(bias)``) or gathering (softcap: a DTensor head's
    ``full_tensor()``) the head once for all of them. A list of 0-d float32 tensors."""
    with torch.no_grad():
        rows_of = [hidden.reshape(-1, hidden.shape[-1]) for hidden in groups]
        vocab = weight.shape[0]
        if all(rows.shape[0] == 0 for rows in rows_of):
            return [torch.zeros((), dtype=torch.float32, device=rows.device) for rows in rows_of]
        if softcap is None:
            w_mean = weight.sum(0, dtype=torch.float32) / vocab
            if hasattr(w_mean, "full_tensor"):  # DTensor (sharded head): only the [H] result is gathered
                w_mean = w_mean.full_tensor()
            b_mean = None
            if bias is not None:
                b_mean = bias.sum(dtype=torch.float32) / vocab
                b_mean = b_mean.full_tensor() if hasattr(b_mean, "full_tensor") else b_mean
        else:
            w = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
            b = bias.full_tensor() if hasattr(bias, "full_tensor") else bias
        out = []
        for rows in rows_of:
            n = rows.shape[0]
            if n == 0:
                out.append(torch.zeros((), dtype=torch.float32, device=rows.device))
            elif softcap is None:
                value = rows.sum(0, dtype=torch.float32).div_(n) @ w_mean.to(rows.device)
                if b_mean is not None:
                    value = value + b_mean.to(value.device)
                out.append(value * float(logit_scale))
            else:
                total = torch.zeros((), dtype=torch.float32, device=rows.device)
                for start in range(0, n, chunk_rows):
                    z = rows[start:start + chunk_rows] @ w.to(rows.dtype).t()
                    if b is not None:
                        z = z + b.to(z.dtype)
                    z = z.float() * float(logit_scale)
                    total += (float(softcap) * torch.tanh(z / float(softcap))).sum()
                out.append(total / (n * vocab))
        return out


def gathered_metric_means(trainer, metrics: Mapping[str, torch.Tensor], names: Mapping[str, str],
                          prefix: str = "") -> QueuedMetrics:
    """``{prefix + names[key]: mean over processes of metrics[key]}`` (keys absent from ``metrics`` are skipped),
    from one gather (:func:`~liger_losses.trl_integration.base.gather_metric_tensor`) queued on the trainer and
    read when a value is (TRL's CPO/ORPO ``gather_for_metrics(x).mean().item()``); ``store_metrics`` of such a
    dict stores it when it is read (:meth:`DeferredStoreMixin.store_metrics`)."""
    keys = [key for key in names if key in metrics]
    values = gather_metric_tensor(trainer.accelerator, [metrics[key] for key in keys], "mean") if keys else None
    return QueuedMetrics([prefix + names[key] for key in keys], values, trainer._liger_pending)


class DeferredStoreMixin:
    """``store_metrics`` of a :class:`QueuedMetrics` dict waits for its values (no host read in the step);
    any other dict is stored at once, as TRL's does."""

    def store_metrics(self, metrics, train_eval="train") -> None:
        if isinstance(metrics, QueuedMetrics):
            metrics.when_resolved(lambda values: super(DeferredStoreMixin, self).store_metrics(values, train_eval))
            return
        super().store_metrics(metrics, train_eval)


def build_cpo_loss(args, *, chunk_tokens: Optional[int] = None, softcap=None, logit_scale: float = 1.0):
    """The :class:`LigerFusedLinearCPOLoss` serving a ``CPOConfig`` (ValueError for what it can't)."""
    return build_config_loss(LigerFusedLinearCPOLoss, args, _CPO_OPTIONS, CPOConfig, chunk_tokens=chunk_tokens,
                             softcap=softcap, logit_scale=logit_scale)


def check_paired_model(trainer) -> None:
    """Construction checks shared by the CPO and ORPO adapters (after TRL's ``__init__``)."""
    if trainer.is_encoder_decoder:
        reject("is_encoder_decoder", True, "encoder-decoder models are not supported (decoder-only causal LMs)")


class CPOTrainer(LigerTrainerMixin, DeferredStoreMixin, _TRLCPOTrainer):
    """``trl.experimental.cpo.CPOTrainer`` with ``use_liger`` (see the module docstring)."""

    def __init__(
        self,
        model=None,
        args: Optional[CPOConfig] = None,
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
            self.liger_loss = build_cpo_loss(args, chunk_tokens=liger_chunk_tokens)  # option checks, fail fast
        super().__init__(model, args, *trl_args, **trl_kwargs)
        if not use_liger:
            return
        check_paired_model(self)
        self._liger_logit_opts = head_logit_options(unwrap_causal_lm(self.model).config)
        build = functools.partial(build_cpo_loss, chunk_tokens=liger_chunk_tokens, **self._liger_logit_opts)
        self.liger_loss = build(self.args)
        # TRL reads these from the trainer at every step: a callback that sets trainer.beta changes both alike
        self._liger_live = LiveLoss(self, {name: name for name in _CPO_OPTIONS}, build)
        self._liger_after_init(self.model, trl_kwargs=trl_kwargs)

    def _liger_padding_value(self) -> int:
        return self.pad_token_id

    def get_batch_loss_metrics(self, model, batch, train_eval="train"):
        """``(loss, {TRL metric name: float})`` of one ``[chosen; rejected]`` batch."""
        if not self.use_liger:
            return super().get_batch_loss_metrics(model, batch, train_eval)
        self._liger_live.refresh(self)
        cat = self.concatenated_inputs(
            batch, is_encoder_decoder=False, padding_value=self._liger_padding_value(),
            device=self.accelerator.device,
        )
        num_pairs = batch["chosen_labels"].shape[0]
        model_kwargs = {"input_ids": cat["concatenated_input_ids"],
                        "attention_mask": cat["concatenated_attention_mask"], "use_cache": False}
        labels = self._liger_scan_ahead(model, cat["concatenated_labels"][:, 1:])

        def head_loss():
            hidden, aux = policy_hidden_and_router_aux(self, model, model_kwargs)
            weight, bias = self._liger_head(model)
            with gathered_params(weight, bias):
                out = self.liger_loss(weight, hidden[:, :-1], labels.to(hidden.device), bias=bias)
                logits_means = mean_logits_of_groups(
                    [hidden[:num_pairs], hidden[num_pairs:]], weight, bias, **self._liger_logit_opts)
            return out, logits_means, aux

        (loss, metrics), (logits_chosen, logits_rejected), aux = self._liger_run(model, head_loss)
        if aux is not None:  # TRL 1.16's CPO: loss + aux_loss_coef * aux_loss, not logged
            loss = loss + self.aux_loss_coef * aux
        metrics = dict(metrics, chosen_logits_mean=logits_chosen, rejected_logits_mean=logits_rejected)
        prefix = "eval_" if train_eval == "eval" else ""
        return loss, gathered_metric_means(self, metrics, TRL_METRIC_NAMES, prefix)
