"""``SFTTrainer``: TRL 1.16's SFT trainer whose loss can come from our chunked cross-entropy (``use_liger=True``).

``SFTTrainer(model, args=None, ..., use_liger=False, liger_patch_model=True, liger_chunk_tokens=None)``
takes every argument of ``trl.SFTTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer.
* ``use_liger=True``: ``compute_loss`` runs the model's backbone to get the last hidden states
  ``[B, T, H]`` and scores ``hidden[:, :-1]`` against ``labels[:, 1:]`` (the label shift; pre-shifted
  ``shift_labels`` are used as they are) through the LM head ``weight [V, H]`` in chunks -- logits
  are never held whole. The labels are the ones TRL's collator builds, so completion-only and
  assistant-only masks (``-100``), padding-free batches and packing work as in TRL. The loss is the
  token mean of the NLL (``sum / num_items_in_batch`` when the Trainer gives the count, as TRL does).
  Logged like TRL: ``entropy`` and ``mean_token_accuracy`` (over the scored tokens), ``num_tokens``.
  A padded batch whose scored positions are all attended runs the backbone pad-free: the attended
  tokens alone, packed (``patching/pad_free.py``). A vision-language model's batch with images runs its base
  model on them (the vision tower included, as TRL's forward; ``multimodal.py``), the language model pad-free where
  its family is served.

How: by default one call of the chunked engine
(:func:`liger_losses.chunked.sequence.fused_linear_sequence_objective`, one unit per sequence, the
objective ``-logps * B / N``) gives the loss, its gradients, the token accuracy *and* the entropy
from the same logits tiles -- no extra GEMM. (When one sequence alone exceeds the tile budget the
engine recomputes tiles in backward.) With ``label_smoothing_factor > 0`` the loss is
:func:`liger_losses.chunked.cross_entropy.fused_linear_cross_entropy`, which gives the token accuracy
and the entropy from its own tiles too.

``loss_type="dft"`` (Dynamic Fine-Tuning, TRL's rule: each token's NLL weighted by its detached
probability, ``-sum(p_y.detach() * log p_y) / num_items_in_batch``; label smoothing does not apply
to it, as in TRL) runs on the per-token engine
(:func:`liger_losses.chunked.token_objective.run_token_objective`): one pass, the gradient of each
tile written while it exists, accuracy and entropy from the same tiles.

Options TRL supports that use_liger=True cannot serve raise ``ValueError`` at construction, naming the
option: ``compute_loss_func``, PEFT prompt learning,
DeepSpeed sequence parallelism. MoE models: the router load-balancing loss of the same backbone
forward is added as TRL adds it (``router_aux.py``) and logged as ``aux_loss``. One deliberate
difference: with ``label_smoothing_factor > 0`` TRL 1.16's SFT step leaves the aux loss out of the
loss it back-propagates (its label-smoothing branch never weights it, though it still logs it); ours
adds it there too, so the router is trained as ``router_aux_loss_coef`` asks whatever the smoothing (a
``UserWarning`` at construction says so).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import trl

from ..chunked.options import HeadOptions
from ..chunked.token_objective import TokenChunk, TokenObjective, run_token_objective
from ..patching.pad_free import label_read_mask
from .base import (
    IGNORE_INDEX,
    LigerTrainerMixin,
    gathered_params,
    head_logit_options,
    reject,
    unwrap_causal_lm,
)
from .router_aux import log_router_aux_loss, policy_hidden_and_router_aux


def _f32_ratio(num: float, den: float) -> float:
    """``num / den`` as a float32 division (the dtype the summed statistics have), as a Python float."""
    return (torch.tensor(num, dtype=torch.float32) / torch.tensor(den, dtype=torch.float32)).item()


class _TokenMeanNLL:
    """Engine objective: per sequence ``-logps * B / denom`` so the engine's mean over the B
    sequences is ``-sum(all token logps) / denom``."""

    def __init__(self, denom: Optional[torch.Tensor]):
        self.denom = denom  # None -> the batch's valid-token count

    def __call__(self, stats):
        num_seqs = stats.batch_num_tokens.shape[0]
        denom = stats.batch_num_tokens.sum() if self.denom is None else self.denom
        scale = num_seqs / torch.as_tensor(denom, dtype=torch.float32, device=stats.logps.device).clamp(min=1.0)
        return -stats.logps * scale, {}


class _TokenMeanDFT(TokenObjective):
    """Engine objective of ``loss_type="dft"``: a chunk's share ``-sum(logp * exp(logp).detach()) / denom``
    (``denom`` a 0-d tensor: ``num_items_in_batch``, or the batch's scored-token count; at least 1, as
    TRL clamps it). Per token, so one pass over chunks of any size."""

    coupling = "token"

    def __init__(self, denom: torch.Tensor):
        self.denom = denom

    def __call__(self, chunk: TokenChunk):
        logps = chunk.logps
        return -(logps * logps.detach().exp()).sum() / self.denom.to(logps.dtype), {}


_SFT_LOSS_TYPES = ("nll", "dft")


class SFTTrainer(LigerTrainerMixin, trl.SFTTrainer):
    """``trl.SFTTrainer`` with ``use_liger`` (see the module docstring)."""

    def __init__(
        self,
        model,
        args: Optional[trl.SFTConfig] = None,
        *trl_args: Any,
        use_liger: bool = False,
        liger_patch_model: bool = True,
        liger_chunk_tokens: Optional[int] = None,
        **trl_kwargs: Any,
    ):
        self._liger_setup(
            use_liger=use_liger, liger_patch_model=liger_patch_model, liger_chunk_tokens=liger_chunk_tokens
        )
        if use_liger and args is not None and args.loss_type not in _SFT_LOSS_TYPES:
            reject("SFTConfig.loss_type", args.loss_type, "the 'nll' and 'dft' losses are implemented")
        if use_liger and trl_kwargs.get("compute_loss_func") is not None:
            reject("compute_loss_func", trl_kwargs["compute_loss_func"], "a custom loss needs the full logits")
        super().__init__(model, args, *trl_args, **trl_kwargs)
        if not use_liger:
            return
        if self.args.loss_type not in _SFT_LOSS_TYPES:
            reject("SFTConfig.loss_type", self.args.loss_type, "the 'nll' and 'dft' losses are implemented")
        if self.compute_loss_func is not None:
            reject("compute_loss_func", self.compute_loss_func, "a custom loss needs the full logits")
        pc = self.accelerator.parallelism_config
        if pc is not None and getattr(pc, "sp_enabled", False) and getattr(pc, "sp_backend", None) == "deepspeed":
            reject("parallelism_config.sp_backend", "deepspeed",
                   "Ulysses sequence parallelism reduces the model's own loss across ranks")
        if (self.args.label_smoothing_factor or 0.0) > 0.0 and self.args.loss_type == "nll" and self.aux_loss_enabled:
            warnings.warn(
                "use_liger=True with label_smoothing_factor > 0 on a model with a router aux loss adds "
                "router_aux_loss_coef * aux_loss to the loss it back-propagates, as SFT does without smoothing; "
                "TRL 1.16's label-smoothing step leaves it out (it only logs it), so the two train the router "
                "differently. Set router_aux_loss_coef=0.0 for TRL's behaviour.", UserWarning, stacklevel=2)
        self._liger_logit_opts = head_logit_options(unwrap_causal_lm(self.model).config)
        self._liger_after_init(self.model, trl_kwargs=trl_kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.use_liger:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        mode = "train" if self.model.training else "eval"
        model_kwargs = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        model_kwargs["use_cache"] = False
        shift_labels = inputs.get("shift_labels")
        labels = self._liger_scan_ahead(model, inputs["labels"][:, 1:] if shift_labels is None else shift_labels)
        smoothing = float(self.args.label_smoothing_factor or 0.0)
        # the positions whose hidden states the loss reads: pad-free where they are all attended
        read = label_read_mask(labels, IGNORE_INDEX) if shift_labels is None else labels != IGNORE_INDEX

        def head_loss():
            # MoE: the router logits of this same forward give the aux loss
            hidden, aux = policy_hidden_and_router_aux(self, model, model_kwargs, read_mask=read)
            if shift_labels is None:
                hidden = hidden[:, :-1]
            weight, bias = self._liger_head(model)
            lab = labels.to(hidden.device)
            with gathered_params(weight, bias):
                if self.args.loss_type == "dft":  # TRL: label smoothing is the NLL's alone
                    return (*self._liger_dft(weight, bias, hidden, lab, num_items_in_batch), aux)
                if smoothing == 0.0:
                    return (*self._liger_nll(weight, bias, hidden, lab, num_items_in_batch), aux)
                return (*self._liger_smoothed(weight, bias, hidden, lab, num_items_in_batch, smoothing), aux)

        loss, num_valid, num_correct, entropy_sum, aux_loss = self._liger_run(model, head_loss)

        # like TRL: `num_items_in_batch` counts the tokens of every rank and DDP averages the gradients
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if aux_loss is not None:  # TRL: a per-micro-batch mean, averaged over the accumulation steps
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + self.router_aux_loss_coef * aux_loss / steps

        def append(sums):
            num_valid, entropy_sum, num_correct = sums
            self._metrics[mode]["entropy"].append(_f32_ratio(entropy_sum, num_valid) if num_valid > 0 else 0.0)
            self._metrics[mode]["mean_token_accuracy"].append(
                _f32_ratio(num_correct, num_valid) if num_valid > 0 else 0.0
            )

        self._liger_gather(mode, [num_valid, entropy_sum, num_correct], "sum", inputs=inputs, then=append)

        if aux_loss is not None:
            log_router_aux_loss(self, mode, aux_loss)
        return self._liger_return(model, model_kwargs, loss, return_outputs)

    # -- the two loss paths; each returns (loss, num_valid, num_correct, entropy_sum) as 0-d tensors

    def _liger_nll(self, weight, bias, hidden, labels, num_items_in_batch):
        """One engine pass: NLL token mean + accuracy + entropy from the same tiles."""
        from ..chunked.sequence import fused_linear_sequence_objective

        loss, _, stats = fused_linear_sequence_objective(
            weight, hidden, labels, _TokenMeanNLL(num_items_in_batch), group_size=1, separable=True, bias=bias,
            ignore_index=IGNORE_INDEX, need_entropy=True, chunk_tokens=self.liger_chunk_tokens,
            **self._liger_logit_opts,
        )
        return loss, stats.num_tokens.sum(), stats.correct.sum(), stats.entropy_sum.sum()

    def _liger_dft(self, weight, bias, hidden, labels, num_items_in_batch):
        """Dynamic Fine-Tuning's loss (``_TokenMeanDFT``), token accuracy and entropy from the same tiles."""
        scored = labels != IGNORE_INDEX
        count = scored.sum() if num_items_in_batch is None else num_items_in_batch
        denom = torch.as_tensor(count, device=hidden.device).to(torch.float32).clamp(min=1.0)
        head = HeadOptions(ignore_index=IGNORE_INDEX, chunk_tokens=self.liger_chunk_tokens, need_entropy=True,
                           **self._liger_logit_opts)
        loss, _, stats = run_token_objective(weight, hidden, labels, _TokenMeanDFT(denom), head=head, bias=bias)
        entropy_sum = loss.new_zeros(()) if stats.entropy is None else stats.entropy.sum()  # None: no scored token
        return loss, scored.sum(), stats.correct.sum(), entropy_sum

    def _liger_smoothed(self, weight, bias, hidden, labels, num_items_in_batch, smoothing):
        """Label-smoothed CE, token accuracy and entropy from the same tiles (one engine pass)."""
        from ..chunked.cross_entropy import fused_linear_cross_entropy

        out = fused_linear_cross_entropy(
            weight, hidden, labels, bias=bias, ignore_index=IGNORE_INDEX, label_smoothing=smoothing,
            num_items_in_batch=num_items_in_batch, return_token_accuracy=True, return_entropy=True,
            chunk_tokens=self.liger_chunk_tokens, **self._liger_logit_opts,
        )
        num_valid = (labels != IGNORE_INDEX).sum()
        return (out.loss, num_valid, out.metrics["token_accuracy"] * num_valid,
                out.metrics["entropy"] * num_valid)
