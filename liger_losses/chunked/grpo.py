"""GRPO and its family (DAPO, Dr. GRPO, BNPO, CISPO, SAPO, LUSPO, VESPO, GSPO) from hidden states.

``fused_linear_grpo_loss(weight, hidden, ref_hidden, labels, *, advantages, ...)`` computes TRL 1.16's
``GRPOTrainer`` loss straight from the completions' last hidden states and the LM head, in chunks
(the ``[tokens, vocab]`` logits are never held whole), with the gradient written in the forward:

* ``weight [V, H]``, ``hidden [B, T, H]`` (``hidden[b, t]`` is scored against ``labels[b, t]``:
  already shifted, ``ignore_index`` at padding and at TRL's ``completion_mask * tool_mask == 0``),
  optional ``bias [V]``; ``advantages [B]`` or ``[B, T]``;
* ``old_logps [B, T]`` (``None``: on-policy, the current log-probs detached, as TRL does when
  ``num_iterations == 1``); the reference for ``beta != 0``: ``ref_logps [B, T]``, or
  ``ref_hidden [B, T, Hr]`` through ``ref_weight`` (default ``weight``; ``ref_bias`` default
  ``bias`` when the head is shared) in the same pass, no grad;
* ``importance_sampling_ratio`` ``[B, T]``, ``[B, 1]`` or ``[B]``: TRL's vLLM importance-sampling
  correction (``inputs["importance_sampling_ratio"]``), ``sampling_logps [B, T]``: the sampler's
  log-probs for the off-policy mask (TRL's ``sampling_per_token_logps``).

Log-probs and entropies are those of ``softmax(z / temperature)`` (TRL divides the logits by
``temperature``), float32 whatever the input dtype -- float64 for a float64 head (weight or autocast
dtype), where the whole computation stays float64 (on the PyTorch path; the Triton kernels' registers
are float32). With ``m`` the valid-token mask, ``r`` the
importance ratio and ``A`` the advantages, TRL's semantics of every option:

* ``importance_sampling_level``: ``"token"``: ``r = exp(logp - old)`` per token; ``"sequence"``
  (GSPO): ``r = exp(sum_t m (logp - old) / max(|m|, 1))`` per sequence.
* ``loss_type`` (per-token loss ``l``, then the normaliser):
  ``grpo``/``bnpo``/``dr_grpo``/``dapo``/``luspo``: ``l = -min(r' A, clip(r, 1 - epsilon_low,
  1 + epsilon_high) A)`` with ``r' = min(r, delta)`` when ``delta`` is set (two-sided clip), else
  ``r``; ``cispo``: ``l = -min(r, epsilon_high).detach() A logp``; ``sapo``:
  ``l = -4 sigmoid(tau (r - 1)) / tau A`` with ``tau = sapo_temperature_pos`` where ``A > 0`` else
  ``sapo_temperature_neg``; ``vespo``: ``l = -phi A logp`` with the detached gamma weight
  ``phi = exp(lambda + k log w - lambda w)``, ``log w = clamp(sum_t m clamp(logp - old, +-20) +
  sum_t clamp(log importance_sampling_ratio, log 1e-8, 20), log 1e-8, 20)`` and ``(k, lambda) =
  (vespo_k_pos, vespo_lambda_pos)`` where ``A >= 0`` else ``(vespo_k_neg, vespo_lambda_neg)``.
  Normalisers of ``sum l m``: ``grpo``, ``sapo``: per-sequence ``/ max(|m_b|, 1)``, then mean over
  ``B``; ``bnpo``: ``/ max(sum m, 1)``; ``dr_grpo``: ``/ (B * max_completion_length)``; ``dapo``,
  ``cispo``, ``vespo``: ``/ max(num_items_in_batch, 1)`` (default: the batch's valid tokens; a
  trainer passes TRL's ``num_items_in_batch / num_processes * grad_accum / steps_per_generation``);
  ``luspo``: per-sequence sums, mean over ``B``. TRL's further division of the other types by the
  gradient-accumulation steps is the caller's (``num_items_in_batch`` with them raises).
* ``off_policy_mask_threshold``: ``l`` times ``A >= 0 or mean_t m (sampling - logp) <= threshold``
  per sequence (``sampling`` = ``sampling_logps``, else ``old``; NaN counts 0).
* ``top_entropy_quantile < 1``: ``l`` times ``entropy >= quantile(entropy of the batch's tokens,
  1 - top_entropy_quantile)``; with ``torch.distributed`` initialized (several processes) the quantile is
  over every process's tokens, as TRL gathers them (a collective: every process calls the loss).
* ``importance_sampling_ratio`` (not for ``vespo``, which folds it into ``w``): ``l`` times it.
* ``beta != 0``: ``l += beta * kl`` with the k3 estimator ``kl = exp(ref - logp) - (ref - logp) - 1``,
  times ``r`` when ``use_bias_correction_kl`` (TRL's default True).
* ``entropy_coef``: ``loss -= entropy_coef * sum(entropy * m') / max(sum m', 1)`` with ``m'`` the
  mask (and the entropy mask when ``top_entropy_quantile < 1``); the entropy is differentiated.

Paths (FLOPs of the policy head; the reference from ``ref_hidden`` adds ``2 N H V``): one pass over
chunks of any size, ``6 N H V``, at token level (VESPO and the off-policy mask included when
``old_logps`` and ``sampling_logps`` are ``None``: their per-sequence values are then known and
detached). Per-sequence sums are needed first for ``importance_sampling_level="sequence"`` (each
token's gradient sums over its sequence, on-policy too) and for VESPO / the off-policy mask with
old or sampling log-probs: one pass over chunks of whole sequences while a sequence fits the tile
budget (up to ``EngineConfig.unit_budget_factor`` default budgets), else two phases.
``top_entropy_quantile < 1`` always runs two phases (statistics of every token, the quantile, then
each tile recomputed: ``8 N H V``). See
:mod:`liger_losses.chunked.token_objective`.

Returns ``LossOutput(loss, metrics)``: the 0-d loss and the 0-d metrics TRL logs
(``TRL_METRIC_NAMES`` maps the keys to TRL's names), from per-token statistics (no extra GEMM); with
``top_entropy_quantile < 1`` also ``masked_entropy_sum`` and ``masked_entropy_tokens``: the entropy summed over
the tokens the entropy mask keeps and their count (what TRL's adaptive entropy controller averages).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.gemm import compute_dtype
from liger_losses.chunked.grpo_objective import (
    TOKEN_COUNT_LOSS_TYPES,
    GRPOBatch,
    GRPOObjective,
    GRPOOptions,
    finish_metrics,
    token_weights,
)
from liger_losses.chunked.module import ChunkedLossModule
from liger_losses.chunked.options import HeadOptions, check_head_inputs
from liger_losses.chunked.output import LossOutput
from liger_losses.chunked.token_objective import run_token_objective
from liger_losses.kernels.logits_tile import torch_stats_dtype
from liger_losses.kernels.utils import check_same_device, check_tensor, eager_under_compile

# metric keys -> the names TRL 1.16's GRPOTrainer logs them under
TRL_METRIC_NAMES = {
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio_low_mean": "clip_ratio/low_mean",
    "clip_ratio_low_min": "clip_ratio/low_min",
    "clip_ratio_high_mean": "clip_ratio/high_mean",
    "clip_ratio_high_max": "clip_ratio/high_max",
    "clip_ratio_region_mean": "clip_ratio/region_mean",
    "cispo_clip_ratio": "cispo_clip_ratio",
    "vespo_phi_seq_mean": "vespo/phi_seq_mean",
    "policy_loss": "policy_loss",
}


def _per_token(name: str, value: Optional[Tensor], B: int, T: int, dtype: torch.dtype,
               allow_sequence: bool = False):
    """``value`` checked as a float ``[B, T]`` tensor (or ``[B]`` / ``[B, 1]`` with ``allow_sequence``),
    returned flat ``[B * T]`` in ``dtype``, detached, broadcast over T."""
    if value is None:
        return None
    check_tensor(name, value, floating=True)
    shapes = [(B, T)] + ([(B,), (B, 1)] if allow_sequence else [])
    if tuple(value.shape) not in shapes:
        want = " or ".join(f"[{', '.join(map(str, s))}]" for s in shapes)
        raise ValueError(f"{name} must have shape {want}, got {tuple(value.shape)}")
    v = value.detach().to(dtype).reshape(B, -1)
    return v.expand(B, T).reshape(-1)


def _check_num_items(loss_type: str, num_items_in_batch):
    if num_items_in_batch is None:
        return
    if loss_type not in TOKEN_COUNT_LOSS_TYPES:
        raise ValueError(f"num_items_in_batch normalises loss_type in {TOKEN_COUNT_LOSS_TYPES}; "
                         f"loss_type={loss_type!r} has its own normaliser (divide the loss for accumulation)")
    if isinstance(num_items_in_batch, Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(f"num_items_in_batch must be a number or a 1-element tensor, "
                             f"got shape {tuple(num_items_in_batch.shape)}")
        return
    if isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, (int, float)):
        raise TypeError(f"num_items_in_batch must be a number or a tensor, got {type(num_items_in_batch).__name__}")
    if not (math.isfinite(num_items_in_batch) and num_items_in_batch > 0):
        raise ValueError(f"num_items_in_batch must be a positive finite number, got {num_items_in_batch!r}")


def _batch(opts, labels, ignore_index, advantages, old_logps, ref_logps, sampling_logps,
           importance_sampling_ratio, num_items_in_batch, dtype: torch.dtype) -> GRPOBatch:
    """The :class:`GRPOBatch` of the inputs, its tensors in ``dtype`` (the engine's statistics dtype)."""
    B, T = labels.shape
    check_tensor("advantages", advantages, floating=True)
    if tuple(advantages.shape) not in ((B,), (B, T)):
        raise ValueError(f"advantages must have shape [{B}] or [{B}, {T}], got {tuple(advantages.shape)}")
    mask = labels != ignore_index
    lengths = mask.sum(-1).to(dtype)
    num_valid = lengths.sum()
    vespo_log_is = None
    is_ratio = _per_token("importance_sampling_ratio", importance_sampling_ratio, B, T, dtype, allow_sequence=True)
    if is_ratio is not None and opts.loss_type == "vespo":
        raw = importance_sampling_ratio.detach().to(dtype).reshape(B, -1)
        vespo_log_is = torch.log(raw).clamp(math.log(1e-8), 20.0).sum(-1)
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.detach().to(dtype).reshape(()).to(labels.device)
    return GRPOBatch(
        B=B, lengths=lengths, num_valid=num_valid,
        token_weight=token_weights(opts, lengths, num_valid, T, num_items_in_batch),
        advantages=_per_token("advantages", advantages, B, T, dtype, allow_sequence=True),
        advantages_per_sequence=advantages.dim() == 1,
        old_logps=_per_token("old_logps", old_logps, B, T, dtype),
        ref_logps=_per_token("ref_logps", ref_logps, B, T, dtype),
        sampling_logps=_per_token("sampling_logps", sampling_logps, B, T, dtype),
        is_ratio=is_ratio, vespo_log_is=vespo_log_is,
    )


def run_grpo(weight: Tensor, hidden: Tensor, ref_hidden: Optional[Tensor], labels: Tensor, *,
             head: HeadOptions, options: GRPOOptions, advantages: Tensor, old_logps: Optional[Tensor] = None,
             ref_logps: Optional[Tensor] = None, ref_weight: Optional[Tensor] = None,
             ref_bias: Optional[Tensor] = None, bias: Optional[Tensor] = None, num_items_in_batch=None,
             importance_sampling_ratio: Optional[Tensor] = None,
             sampling_logps: Optional[Tensor] = None) -> LossOutput:
    """:func:`fused_linear_grpo_loss` with its options already validated (``head``, ``options``)."""
    check_head_inputs(weight, hidden, labels, bias, head, hidden_ndim=3)
    _check_num_items(options.loss_type, num_items_in_batch)
    if options.beta != 0.0 and ref_logps is None and ref_hidden is None:
        raise ValueError("beta != 0 needs the reference: pass ref_logps [B, T] or ref_hidden [B, T, Hr]")
    check_same_device(hidden=hidden, advantages=advantages, old_logps=old_logps, ref_logps=ref_logps,
                      sampling_logps=sampling_logps, importance_sampling_ratio=importance_sampling_ratio)
    batch = _batch(options, labels, head.ignore_index, advantages, old_logps, ref_logps, sampling_logps,
                   importance_sampling_ratio, num_items_in_batch, torch_stats_dtype(compute_dtype(weight)))
    objective = GRPOObjective(options, batch)
    use_ref_hidden = options.beta != 0.0 and ref_logps is None  # no reference GEMM when it is not used
    loss, sums, _ = run_token_objective(
        weight, hidden, labels, objective, head=head, bias=bias,
        ref_hidden=ref_hidden if use_ref_hidden else None, ref_weight=ref_weight if use_ref_hidden else None,
        ref_bias=ref_bias if use_ref_hidden else None, entropy_grad=options.entropy_coef != 0.0,
        inputs_checked=True,
    )
    return LossOutput(loss, finish_metrics(objective, sums))


def grpo_head_options(*, temperature: float = 1.0, ignore_index: int = -100, softcap: Optional[float] = None,
                      logit_scale: float = 1.0, chunk_tokens: Optional[int] = None,
                      accum_dtype: Optional[torch.dtype] = None, impl: str = "auto") -> HeadOptions:
    """The shared options of a GRPO-family loss (the entropy is always taken: TRL logs it)."""
    return HeadOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                       chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl, need_entropy=True)


@eager_under_compile
def fused_linear_grpo_loss(
    weight: Tensor,
    hidden: Tensor,
    ref_hidden: Optional[Tensor],
    labels: Tensor,
    *,
    advantages: Tensor,
    old_logps: Optional[Tensor] = None,
    ref_logps: Optional[Tensor] = None,
    ref_weight: Optional[Tensor] = None,
    ref_bias: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    num_items_in_batch=None,
    importance_sampling_ratio: Optional[Tensor] = None,
    sampling_logps: Optional[Tensor] = None,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: Optional[float] = None,
    delta: Optional[float] = None,
    importance_sampling_level: str = "token",
    use_bias_correction_kl: bool = True,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    off_policy_mask_threshold: Optional[float] = None,
    top_entropy_quantile: float = 1.0,
    entropy_coef: float = 0.0,
    max_completion_length: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> LossOutput:
    """TRL 1.16's GRPO-family loss from hidden states; see the module docstring. Shared options:
    :class:`~liger_losses.chunked.options.HeadOptions`; the others: :class:`GRPOOptions`."""
    options = GRPOOptions(
        loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
        importance_sampling_level=importance_sampling_level, use_bias_correction_kl=use_bias_correction_kl,
        sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
        vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
        vespo_lambda_neg=vespo_lambda_neg, off_policy_mask_threshold=off_policy_mask_threshold,
        top_entropy_quantile=top_entropy_quantile, entropy_coef=entropy_coef,
        max_completion_length=max_completion_length,
    )
    head = grpo_head_options(temperature=temperature, ignore_index=ignore_index, softcap=softcap,
                             logit_scale=logit_scale, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl)
    return run_grpo(weight, hidden, ref_hidden, labels, head=head, options=options, advantages=advantages,
                    old_logps=old_logps, ref_logps=ref_logps, ref_weight=ref_weight, ref_bias=ref_bias, bias=bias,
                    num_items_in_batch=num_items_in_batch, importance_sampling_ratio=importance_sampling_ratio,
                    sampling_logps=sampling_logps)


class LigerFusedLinearGRPOLoss(ChunkedLossModule):
    """Module twin of :func:`fused_linear_grpo_loss`: options at construction, tensors at call.

    ``loss_fn(weight, hidden, ref_hidden, labels, *, advantages, old_logps=None, ref_logps=None,
    ref_weight=None, ref_bias=None, bias=None, num_items_in_batch=None, importance_sampling_ratio=None,
    sampling_logps=None) -> LossOutput``.
    """

    runner = staticmethod(run_grpo)
    TRL_METRIC_NAMES = TRL_METRIC_NAMES
    REPR_KEYS = ("loss_type", "beta", "epsilon_low", "epsilon_high", "delta", "importance_sampling_level")

    def __init__(
        self,
        loss_type: str = "dapo",
        beta: float = 0.0,
        *,
        epsilon_low: float = 0.2,
        epsilon_high: Optional[float] = None,
        delta: Optional[float] = None,
        importance_sampling_level: str = "token",
        use_bias_correction_kl: bool = True,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        off_policy_mask_threshold: Optional[float] = None,
        top_entropy_quantile: float = 1.0,
        entropy_coef: float = 0.0,
        max_completion_length: Optional[int] = None,
        temperature: float = 1.0,
        ignore_index: int = -100,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        chunk_tokens: Optional[int] = None,
        accum_dtype: Optional[torch.dtype] = None,
        impl: str = "auto",
    ):
        super().__init__(
            grpo_head_options(temperature=temperature, ignore_index=ignore_index, softcap=softcap,
                              logit_scale=logit_scale, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype,
                              impl=impl),
            GRPOOptions(
                loss_type=loss_type, beta=beta, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                importance_sampling_level=importance_sampling_level,
                use_bias_correction_kl=use_bias_correction_kl, sapo_temperature_pos=sapo_temperature_pos,
                sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
                vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg,
                off_policy_mask_threshold=off_policy_mask_threshold, top_entropy_quantile=top_entropy_quantile,
                entropy_coef=entropy_coef, max_completion_length=max_completion_length,
            ),
        )

    def forward(self, weight: Tensor, hidden: Tensor, ref_hidden: Optional[Tensor], labels: Tensor, *,
                advantages: Tensor, old_logps: Optional[Tensor] = None, ref_logps: Optional[Tensor] = None,
                ref_weight: Optional[Tensor] = None, ref_bias: Optional[Tensor] = None,
                bias: Optional[Tensor] = None, num_items_in_batch=None,
                importance_sampling_ratio: Optional[Tensor] = None,
                sampling_logps: Optional[Tensor] = None) -> LossOutput:
        return self.run(weight, hidden, ref_hidden, labels, advantages=advantages, old_logps=old_logps,
                        ref_logps=ref_logps, ref_weight=ref_weight, ref_bias=ref_bias, bias=bias,
                        num_items_in_batch=num_items_in_batch, importance_sampling_ratio=importance_sampling_ratio,
                        sampling_logps=sampling_logps)
