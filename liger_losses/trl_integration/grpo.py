"""``GRPOTrainer``: TRL 1.16's GRPO trainer whose loss can come from our fused GRPO loss (``use_liger=True``).

``GRPOTrainer(model, reward_funcs=None, args=None, ..., use_liger=False, liger_patch_model=True,
liger_chunk_tokens=None)`` takes every argument of ``trl.GRPOTrainer`` plus three keywords:

* ``use_liger=False``: exactly TRL's trainer.
* ``use_liger=True``: ``_compute_loss`` (TRL's loss method: it runs the model with TRL's fused LM
  head, then the GRPO formula) runs the policy *backbone* on prompt + completion to get the last
  hidden states, keeps the ``[B, C, H]`` positions that predict the completion tokens, and the loss
  comes from :func:`liger_losses.chunked.grpo.fused_linear_grpo_loss` on them and the LM head's
  ``weight [V, H]``: the gradient is written while each logits tile exists, logits are never held
  whole. Every GRPO option of the config is passed through with TRL's semantics (loss types,
  importance-sampling level, clipping, ``delta``, ``beta`` with the reference log-probs TRL computed,
  the vLLM importance-sampling ratio, the off-policy mask, the entropy quantile and bonus,
  ``temperature``); TRL's gradient-accumulation scaling is applied as TRL does it. Generation, rewards,
  advantages, old and reference log-probs are TRL's. Metrics are logged under TRL's names. MoE models
  (``aux_loss_enabled``, TRL's rule): the same backbone forward returns the router logits and, as TRL,
  ``router_aux_loss_coef * aux_loss`` (divided by the accumulation steps in training) is added to the
  loss and ``aux_loss`` logged (``router_aux.py``). Without router logits the backbone runs pad-free where it
  can: the attended tokens alone, packed (``patching/pad_free.py``; ``LIGER_LOSSES_PAD_FREE``). A
  vision-language model's backbone gets the batch's images as TRL's policy forward does (``multimodal.py``; such a
  call's language model runs pad-free where its family is served). ``liger_patch_model=True`` also swaps the model's
  layers for our kernels.
``cast_lm_head_to_fp32=True`` (ScaleRL's float32 head; TRL casts the head's weight to float32 at construction):
the loss's GEMMs and tiles run in float32 outside autocast, as TRL's fused head runs them
(:func:`head_precision`); the backbone keeps the trainer's autocast.

Metrics are reduced over processes as TRL reduces them (:func:`log_rl_metrics`): token (or
sequence) means weighted by each process's count, ``*_min`` / ``*_max`` over all processes.

The entropy bonus follows TRL's rules, ``use_adaptive_entropy``'s controller included (its coefficient moves at each
optimizer step with the window's entropy over the tokens the bonus acts on, read from our loss's statistics).
PEFT prompt learning raises ``ValueError`` at construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
import trl

from ..chunked.grpo import TRL_METRIC_NAMES, grpo_head_options, run_grpo
from ..chunked.grpo_objective import TOKEN_COUNT_LOSS_TYPES, GRPOOptions
from ..patching.pad_free import completion_read_mask
from .base import (
    IGNORE_INDEX,
    LigerTrainerMixin,
    gather_metric_tensor,
    gathered_params,
    head_logit_options,
    unwrap_causal_lm,
)
from .multimodal import rl_policy_inputs
from .router_aux import log_router_aux_loss, policy_hidden_and_router_aux


@contextlib.contextmanager
def head_precision(args, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """The LM head the loss runs with, as ``(weight, bias)``, and the autocast around it: with
    ``cast_lm_head_to_fp32`` (TRL 1.16's GRPO option; its fused head, which also gives the old and reference
    log-probs, takes float32 hidden states and the head in float32 outside autocast) the head in float32 (TRL casts
    it at construction; an engine that keeps its own copy, DeepSpeed's in bf16, is cast here as TRL's head casts it)
    with autocast off, so the engine's compute dtype is float32 and the hidden states are cast to it; else both as
    they are."""
    if not getattr(args, "cast_lm_head_to_fp32", False):
        yield weight, bias
        return
    with torch.autocast(device_type=weight.device.type, enabled=False):
        yield weight.float(), None if bias is None else bias.float()


# metrics TRL takes over all processes' sequences (nanmin / nanmax of the gathered values)
_MIN_MAX = {"clip_ratio_low_min": "min", "clip_ratio_high_max": "max"}


def log_rl_metrics(trainer, mode: str, metrics, names, counts) -> None:
    """Append ``metrics`` (0-d tensors) under their TRL ``names``, reduced over processes as TRL does:
    a mean weighted by ``counts[key]`` (the local token or sequence count it averages; unweighted when
    absent), or the min / max over processes, NaN ignored, for ``*_min`` / ``*_max`` (NaN when all are).
    Two gathers, queued on the trainer and read when its metrics are (``trainer._liger_defer``)."""
    keys = [k for k in names if k in metrics]
    means = [k for k in keys if k not in _MIN_MAX]
    extremes = [k for k in keys if k in _MIN_MAX]
    if not keys:
        return
    device = metrics[keys[0]].device
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    one = torch.ones((), device=device)
    weights = [torch.as_tensor(counts.get(k, one), device=device).to(dtype) for k in means]
    weighted = [metrics[k].detach().to(dtype) * w for k, w in zip(means, weights)]
    parts = [gather_metric_tensor(trainer.accelerator, weighted + weights, "sum")] if means else []
    if extremes:
        row = torch.stack([metrics[k].detach().to(device=device, dtype=dtype).reshape(()) for k in extremes])
        rows = trainer.accelerator.gather_for_metrics(row.unsqueeze(0))  # [processes, K]
        nan = torch.isnan(rows)
        lows = torch.where(nan, torch.inf, rows).amin(0)
        highs = torch.where(nan, -torch.inf, rows).amax(0)
        is_min = torch.tensor([_MIN_MAX[k] == "min" for k in extremes], device=rows.device)
        picked = torch.where(is_min, lows, highs)
        parts.append(torch.where(nan.all(0), torch.nan, picked))

    def append(values):
        sums, picked = values[:2 * len(means)], values[2 * len(means):]
        for i, k in enumerate(means):
            trainer._metrics[mode][names[k]].append(sums[i] / max(sums[len(means) + i], 1.0))
        for k, value in zip(extremes, picked):
            trainer._metrics[mode][names[k]].append(value)

    trainer._liger_defer(torch.cat(parts) if len(parts) > 1 else parts[0], append)


def grpo_options(trainer) -> GRPOOptions:
    """The loss options of a built ``trl.GRPOTrainer`` (its attributes and config), validated."""
    args = trainer.args
    return GRPOOptions(
        loss_type=trainer.loss_type, beta=float(trainer.beta), epsilon_low=float(trainer.epsilon_low),
        epsilon_high=float(trainer.epsilon_high), delta=args.delta,
        importance_sampling_level=trainer.importance_sampling_level,
        use_bias_correction_kl=bool(args.use_bias_correction_kl),
        sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg, off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        top_entropy_quantile=float(trainer.top_entropy_quantile), entropy_coef=float(trainer.entropy_coef),
        max_completion_length=trainer.max_completion_length,
    )


class GRPOTrainer(LigerTrainerMixin, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with ``use_liger`` (see the module docstring)."""

    def __init__(self, model, reward_funcs=None, args=None, *trl_args: Any, use_liger: bool = False,
                 liger_patch_model: bool = True, liger_chunk_tokens: Optional[int] = None, **trl_kwargs: Any):
        self._liger_setup(use_liger=use_liger, liger_patch_model=liger_patch_model,
                          liger_chunk_tokens=liger_chunk_tokens)
        super().__init__(model, reward_funcs, args, *trl_args, **trl_kwargs)
        if use_liger:
            grpo_options(self)  # the loss options, validated now rather than at the first step
            self._liger_after_init(self.model, self.ref_model, trl_kwargs=trl_kwargs)

    def _liger_normalizers(self, mode: str, inputs):
        """``(num_items_in_batch or None, loss divisor, entropy_coef)`` of TRL's gradient-accumulation rule."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        coef = self._liger_applied_entropy_coef()
        if self.loss_type in TOKEN_COUNT_LOSS_TYPES:
            items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                items = items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            # the policy term is already scaled by items; the entropy bonus is divided by the steps
            return items, 1.0, coef / accumulation
        return None, accumulation, coef

    def _liger_applied_entropy_coef(self) -> float:
        """The entropy bonus's coefficient this step (TRL's rule): the adaptive controller's coefficient while the
        window entropy it last measured is at or below ``entropy_target``, else 0; the static one otherwise."""
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return float(self.entropy_coef)

    def _liger_adapt_entropy(self, metrics, n_tokens) -> None:
        """TRL's adaptive entropy controller, fed with this micro-batch's entropy over the tokens the bonus acts on
        (all scored tokens, or the high-entropy ones under ``top_entropy_quantile < 1``): the sums of the
        accumulation window, reduced over processes at the optimizer step (one host read, as TRL's), move
        ``entropy_coef`` by ``entropy_coef_delta`` towards more entropy while the window's mean is at or below
        ``entropy_target``, else towards less, within ``[entropy_coef_min, entropy_coef_max]``."""
        if "masked_entropy_tokens" in metrics:
            stats = torch.stack([metrics["masked_entropy_sum"], metrics["masked_entropy_tokens"]])
        else:
            n = n_tokens.to(metrics["entropy"].dtype)
            stats = torch.stack([metrics["entropy"] * n, n])
        stats = stats.detach().float()
        window = self._entropy_window_stats
        self._entropy_window_stats = stats if window is None else window + stats
        if not self.accelerator.sync_gradients:
            return
        total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

    def _compute_loss(self, model, inputs):
        if not self.use_liger:
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        prompt_ids = inputs["prompt_ids"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        model_kwargs = rl_policy_inputs(inputs)  # a vision-language model's images too, as TRL passes them
        labels = self._liger_scan_ahead(model, completion_ids.masked_fill(mask == 0, IGNORE_INDEX))
        start = prompt_ids.size(1) - 1  # the position predicting the first completion token
        read = completion_read_mask(model_kwargs["attention_mask"], start, labels, IGNORE_INDEX)
        items, divisor, entropy_coef = self._liger_normalizers(mode, inputs)
        options = dataclasses.replace(grpo_options(self), entropy_coef=entropy_coef)
        head = grpo_head_options(temperature=self.temperature, ignore_index=IGNORE_INDEX,
                                 chunk_tokens=self.liger_chunk_tokens,
                                 **head_logit_options(unwrap_causal_lm(model).config))
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs.get("importance_sampling_ratio")

        def run():
            hidden, aux = policy_hidden_and_router_aux(self, model, model_kwargs, read_mask=read)
            hidden = hidden[:, start:start + labels.size(1)]
            weight, bias = self._liger_head(model)
            with gathered_params(weight, bias), head_precision(self.args, weight, bias) as (weight, bias):
                return aux, run_grpo(
                    weight, hidden, None, labels, head=head, options=options, bias=bias,
                    advantages=inputs["advantages"], old_logps=inputs.get("old_per_token_logps"),
                    ref_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None,
                    sampling_logps=inputs.get("sampling_per_token_logps"),
                    importance_sampling_ratio=is_ratio, num_items_in_batch=items,
                )

        with self.accelerator.autocast():
            aux, (loss, metrics) = self._liger_run(model, run)
        n_tokens = mask.sum()
        if self._entropy_bonus_enabled:
            if "policy_loss" not in metrics:  # a coefficient of 0 this step: the loss is the policy's alone
                metrics = {**metrics, "policy_loss": loss.detach()}
            if self.use_adaptive_entropy and mode == "train":
                self._liger_adapt_entropy(metrics, n_tokens)
        if divisor != 1.0:
            loss = loss / divisor
        if aux is not None:  # TRL: the policy loss is scaled for accumulation, so is the aux term
            steps = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux / steps
            log_router_aux_loss(self, mode, aux)
        n_seqs = torch.tensor(float(mask.size(0)), device=mask.device)
        per_seq = inputs["advantages"].dim() == 1 and self.importance_sampling_level == "sequence"
        counts = {k: n_tokens for k in TRL_METRIC_NAMES}
        counts.pop("policy_loss")  # TRL: the mean over processes
        for k in ("clip_ratio_low_mean", "clip_ratio_high_mean", "clip_ratio_region_mean", "cispo_clip_ratio"):
            if per_seq:
                counts[k] = n_seqs
        if inputs["advantages"].dim() == 1:
            counts["vespo_phi_seq_mean"] = n_seqs
        log_rl_metrics(self, mode, metrics, TRL_METRIC_NAMES, counts)
        if self._entropy_bonus_enabled and mode == "train" and self.accelerator.sync_gradients:
            coef = self.entropy_coef  # once per optimizer step, after the controller moved it, as TRL logs it
            self._liger_defer(None, lambda _: self._metrics[mode]["entropy_coef"].append(coef))
        return loss
