"""GRPO's options and its per-token objective: TRL 1.16 ``GRPOTrainer._compute_loss`` on ``[n]`` tensors.

:class:`GRPOOptions` holds the loss options (validated once, at construction). :class:`GRPOBatch`
holds what is known from the labels and the side inputs before any GEMM -- the valid-token mask,
sequence lengths, each token's normalisation weight, advantages / old / reference / sampling
log-probs and the vLLM importance-sampling ratio as flat ``[B * T]`` tensors -- and
:class:`GRPOObjective` turns a chunk of tokens (:class:`~liger_losses.chunked.token_objective.TokenChunk`)
into its share of the loss and additive metric sums, differentiable in the chunk's log-probs and
entropies. :func:`finish_metrics` turns the sums into the 0-d values TRL logs.

All formulas run in the engine's statistics dtype (float32; float64 for a float64 head, so that a
float64 run has no float32 step); see :mod:`liger_losses.chunked.grpo` for
the semantics of every option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.options import check_real, set_fields
from liger_losses.chunked.token_objective import TokenChunk, TokenObjective
from liger_losses.kernels.utils import check_choice

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# loss types whose sum is divided by num_items_in_batch (TRL: the generation batch's token count)
TOKEN_COUNT_LOSS_TYPES = ("cispo", "dapo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
_LOG_MIN_WEIGHT = math.log(1e-8)  # VESPO's lower clamp of log-weights (TRL's get_gamma_weights)


@dataclass(frozen=True)
class GRPOOptions:
    """The options of the GRPO family (TRL 1.16 ``GRPOConfig`` names and defaults); ``epsilon_high=None``
    means ``epsilon_low``."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: Optional[float] = None
    delta: Optional[float] = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: Optional[float] = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    max_completion_length: Optional[int] = None

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        if not isinstance(self.use_bias_correction_kl, bool):  # strict: 1 is not accepted as True here
            raise TypeError(f"use_bias_correction_kl must be a bool, got {type(self.use_bias_correction_kl).__name__}")
        values = {name: check_real(name, getattr(self, name), 0.0, None) for name in ("beta", "epsilon_low")}
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef"):
            values[name] = check_real(name, getattr(self, name))
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            values[name] = check_real(name, getattr(self, name), 0.0, None, low_inclusive=False)
        values["top_entropy_quantile"] = check_real("top_entropy_quantile", self.top_entropy_quantile, 0.0, 1.0)
        if self.epsilon_high is not None:
            values["epsilon_high"] = check_real("epsilon_high", self.epsilon_high, 0.0, None)
        if self.delta is not None:
            values["delta"] = check_real("delta", self.delta, 0.0, None, low_inclusive=False)
        if self.off_policy_mask_threshold is not None:
            values["off_policy_mask_threshold"] = check_real("off_policy_mask_threshold",
                                                             self.off_policy_mask_threshold)
        if self.loss_type == "dr_grpo":
            m = self.max_completion_length
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"max_completion_length must be a positive int for loss_type='dr_grpo', got {m!r}")
        set_fields(self, **values)

    @property
    def eps_high(self) -> float:
        return float(self.epsilon_low if self.epsilon_high is None else self.epsilon_high)


@dataclass
class GRPOBatch:
    """What is known before any GEMM, flat over ``[B * T]`` (``None`` where not given)."""

    B: int
    # every float tensor in the statistics dtype (float32; float64 for a float64 head)
    lengths: Tensor  # [B] valid tokens per sequence
    num_valid: Tensor  # 0-d
    token_weight: Tensor  # [B * T]: d loss / d per-token loss (the loss type's normaliser)
    advantages: Tensor  # [B * T]
    advantages_per_sequence: bool  # advantages were [B] (TRL's (B, 1))
    old_logps: Optional[Tensor]
    ref_logps: Optional[Tensor]
    sampling_logps: Optional[Tensor]
    is_ratio: Optional[Tensor]  # [B * T] vLLM importance-sampling ratio, broadcast
    vespo_log_is: Optional[Tensor]  # [B] sum over the ratio's last dim of clamp(log ratio) (VESPO)


def token_weights(opts: GRPOOptions, lengths: Tensor, num_valid: Tensor, T: int, num_items_in_batch) -> Tensor:
    """``[B * T]`` in ``lengths``' dtype: the factor of each token's loss in the total, per TRL's normalisation."""
    B = lengths.shape[0]
    t = opts.loss_type
    if t in ("grpo", "sapo"):
        per_seq = 1.0 / (B * lengths.clamp(min=1.0))
    elif t == "bnpo":
        per_seq = (1.0 / num_valid.clamp(min=1.0)).expand(B)
    elif t == "dr_grpo":
        per_seq = torch.full_like(lengths, 1.0 / (B * opts.max_completion_length))
    elif t == "luspo":
        per_seq = torch.full_like(lengths, 1.0 / B)
    else:  # cispo, dapo, vespo
        n = num_valid if num_items_in_batch is None else num_items_in_batch
        n = torch.as_tensor(n, dtype=lengths.dtype, device=lengths.device)
        per_seq = (1.0 / n.clamp(min=1.0)).expand(B)
    return per_seq.to(lengths.dtype)[:, None].expand(B, T).reshape(-1)


def gather_over_processes(x: Tensor) -> Tensor:
    """``x [n]`` of every process concatenated in rank order (``n`` may differ between processes) when
    ``torch.distributed`` is initialized with more than one process, else ``x``. A collective: every
    process must call it. Goes through the CPU for a backend without device collectives (gloo)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    world = dist.get_world_size()
    on_device = x.device.type != "cpu" and "nccl" in str(dist.get_backend()).lower()
    dev = x.device if on_device else torch.device("cpu")
    local = x.detach().reshape(-1).to(dev)
    count = torch.tensor([local.numel()], dtype=torch.long, device=dev)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]  # host read: the padded length
    padded = local.new_zeros(max(sizes))
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(x.device)


def entropy_quantile_mask(entropy: Tensor, quantile: float) -> Tensor:
    """TRL's high-entropy mask: ``entropy >= q-quantile(entropies)`` with ``q = 1 - top_entropy_quantile``
    (linear interpolation, as ``torch.quantile``, which is limited to 2^24 elements: sorted here instead).
    The quantile is over the valid tokens of every process when ``torch.distributed`` is initialized with
    several (TRL 1.16 gathers them, :func:`gather_over_processes`: every process must call the loss),
    else over this batch's; all False when there is no token anywhere."""
    pool = gather_over_processes(entropy.detach())
    if pool.numel() == 0:
        return torch.zeros_like(entropy, dtype=torch.bool)
    s = pool.sort().values
    pos = (1.0 - quantile) * (s.numel() - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, s.numel() - 1)
    threshold = torch.lerp(s[lo], s[hi], pos - lo)
    return entropy.detach() >= threshold


def _clip_flags(opts: GRPOOptions, coef_1: Tensor, adv: Tensor) -> dict:
    """The clipping indicators TRL logs (in ``coef_1``'s dtype), per token."""
    dt = coef_1.dtype
    if opts.loss_type == "cispo":
        return {"cispo_clip_ratio": ((coef_1 > opts.eps_high) & (adv > 0)).to(dt)}
    if opts.loss_type in CLIP_LOSS_TYPES:
        low = (coef_1 < 1 - opts.epsilon_low) & (adv < 0)
        high = (coef_1 > 1 + opts.eps_high) & (adv > 0)
        return {"clip_ratio_low": low.to(dt), "clip_ratio_high": high.to(dt), "clip_ratio_region": (low | high).to(dt)}
    return {}


def _vespo_phi(opts: GRPOOptions, seq_log_ratio: Tensor, adv: Tensor) -> Tensor:
    """VESPO's detached gamma weight ``exp(lambda + k log w - lambda w)`` (TRL's get_gamma_weights)."""
    log_w = seq_log_ratio.clamp(_LOG_MIN_WEIGHT, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, opts.vespo_k_pos, opts.vespo_k_neg)
    lam = torch.where(nonneg, opts.vespo_lambda_pos, opts.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()


class GRPOObjective(TokenObjective):
    """``objective(chunk) -> (loss share, metric sums)`` of the GRPO family, a
    :class:`~liger_losses.chunked.token_objective.TokenObjective` whose :attr:`coupling` follows
    from the options and the side inputs."""

    # the per-chunk calls of one pass take the gradient only; the metrics come from one call on
    # every token (TokenObjective.metrics_once)
    metrics_once = True

    def __init__(self, opts: GRPOOptions, batch: GRPOBatch):
        self.opts, self.batch = opts, batch

    @property
    def coupling(self) -> str:
        """``"batch"`` for the entropy quantile; ``"sequence"`` where a token's loss needs its
        sequence's sum of current log-probs (sequence-level ratios, on-policy too; VESPO's weight
        and the off-policy mask once old or sampling log-probs make their values depend on the
        current log-probs); else ``"token"``."""
        o, bt = self.opts, self.batch
        if o.top_entropy_quantile < 1.0:
            return "batch"
        if o.importance_sampling_level == "sequence":  # every token's gradient sums over its sequence
            return "sequence"
        if bt.old_logps is not None and o.loss_type == "vespo":  # the detached weight's value does
            return "sequence"
        if o.off_policy_mask_threshold is not None and (bt.old_logps is not None or bt.sampling_logps is not None):
            return "sequence"
        return "token"

    def seq_sum(self, x: Tensor, seq: Tensor) -> Tensor:
        return torch.zeros(self.batch.B, dtype=x.dtype, device=x.device).index_add(0, seq, x)

    def __call__(self, chunk: TokenChunk) -> tuple[Tensor, dict]:
        o, bt = self.opts, self.batch
        lp, idx, seq = chunk.logps, chunk.index, chunk.seq
        adv = bt.advantages[idx]
        old = lp.detach() if bt.old_logps is None else bt.old_logps[idx]
        log_ratio = lp - old
        if o.importance_sampling_level == "sequence":
            log_iw = (self.seq_sum(log_ratio, seq) / bt.lengths.clamp(min=1.0))[seq]
        else:
            log_iw = log_ratio
        coef_1 = torch.exp(log_iw)
        kl = None
        if o.beta != 0.0:
            ref = chunk.ref_logps if bt.ref_logps is None else bt.ref_logps[idx]
            kl = torch.exp(ref - lp) - (ref - lp) - 1
            if o.use_bias_correction_kl:
                kl = kl * coef_1
        phi = None
        if o.loss_type == "cispo":
            per_token = -coef_1.clamp(max=o.eps_high).detach() * adv * lp
        elif o.loss_type in CLIP_LOSS_TYPES:
            coef_2 = coef_1.clamp(1 - o.epsilon_low, 1 + o.eps_high)
            if o.delta is not None:
                coef_1 = coef_1.clamp(max=o.delta)
            per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        elif o.loss_type == "sapo":
            temps = torch.where(adv > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
            per_token = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * adv
        else:  # vespo
            seq_lr = self.seq_sum(log_ratio.clamp(-20.0, 20.0), seq)
            if bt.vespo_log_is is not None:
                seq_lr = seq_lr + bt.vespo_log_is
            phi = _vespo_phi(o, seq_lr[seq], adv)
            per_token = -phi * adv * lp
        if o.off_policy_mask_threshold is not None:
            sampling = old if bt.sampling_logps is None else bt.sampling_logps[idx]
            seq_kl = self.seq_sum(torch.nan_to_num(sampling - lp.detach(), nan=0.0), seq) / bt.lengths.clamp(min=1.0)
            keep = (adv >= 0) | (seq_kl[seq] <= o.off_policy_mask_threshold)
            per_token = per_token * keep
        entropy_mask = None
        if o.top_entropy_quantile < 1.0:
            entropy_mask = entropy_quantile_mask(chunk.entropy, o.top_entropy_quantile)
            per_token = per_token * entropy_mask
        if bt.is_ratio is not None and o.loss_type != "vespo":
            per_token = per_token * bt.is_ratio[idx]
        if kl is not None:
            per_token = per_token + o.beta * kl
        loss = (per_token * bt.token_weight[idx]).sum()
        policy_loss = loss
        if o.entropy_coef != 0.0:
            if entropy_mask is None:
                bonus = chunk.entropy.sum() / bt.num_valid.clamp(min=1.0)
            else:
                bonus = (chunk.entropy * entropy_mask).sum() / entropy_mask.sum().clamp(min=1.0)
            loss = loss - o.entropy_coef * bonus
        if not chunk.metrics:  # the gradient alone (metrics_once)
            return loss, {}
        sums = {"policy_loss": policy_loss.detach(), "entropy": chunk.entropy.detach().sum()}
        if entropy_mask is not None:  # the tokens the entropy bonus acts on (TRL's adaptive controller reads them)
            sums["masked_entropy_sum"] = (chunk.entropy.detach() * entropy_mask).sum()
            sums["masked_entropy_tokens"] = entropy_mask.sum().to(chunk.entropy.dtype)
        if kl is not None:
            sums["kl"] = kl.detach().sum()
        flags = _clip_flags(o, coef_1.detach(), adv)
        if phi is not None:
            flags["vespo_phi_seq"] = phi
        for name, f in flags.items():
            sums[name] = f.sum()
            sums[name + "@seq"] = self.seq_sum(f, seq)
        return loss, sums

    # ---------------------------------------------------------------- sequences without tokens
    def empty_sequence_values(self) -> dict:
        """Per-sequence ``[B]`` values of the flags for sequences without a valid token, where TRL's
        per-sequence tensors (sequence level, ``[B]`` advantages) still hold a value: ratio 1."""
        o, bt = self.opts, self.batch
        adv = bt.advantages.view(bt.B, -1)[:, 0] if bt.advantages.numel() else bt.advantages
        coef_1 = torch.ones_like(adv)
        if o.loss_type in CLIP_LOSS_TYPES and o.delta is not None:
            coef_1 = coef_1.clamp(max=o.delta)
        out = _clip_flags(o, coef_1, adv)
        if o.loss_type == "vespo":
            seq_lr = torch.zeros_like(adv) if bt.vespo_log_is is None else bt.vespo_log_is
            out["vespo_phi_seq"] = _vespo_phi(o, seq_lr, adv)
        return out


def _nanmin(x: Tensor) -> Tensor:
    """Minimum ignoring NaN, NaN when all are (TRL's nanmin), without a host sync."""
    nan = torch.isnan(x)
    if x.numel() == 0:
        return x.new_tensor(math.nan)
    return torch.where(nan.all(), math.nan, torch.where(nan, math.inf, x).min())


def _nanmax(x: Tensor) -> Tensor:
    return -_nanmin(-x)


def finish_metrics(objective: GRPOObjective, sums: dict) -> dict:
    """The 0-d metrics TRL logs, from the objective's sums over all chunks (keys of ``TRL_METRIC_NAMES``), and with
    ``top_entropy_quantile < 1`` the high-entropy tokens' ``masked_entropy_sum`` and ``masked_entropy_tokens``."""
    o, bt = objective.opts, objective.batch
    n = bt.num_valid.clamp(min=1.0)
    zero = torch.zeros((), dtype=bt.lengths.dtype, device=bt.lengths.device)
    out = {"entropy": sums.get("entropy", zero) / n}
    if o.top_entropy_quantile < 1.0:
        out["masked_entropy_sum"] = sums.get("masked_entropy_sum", zero)
        out["masked_entropy_tokens"] = sums.get("masked_entropy_tokens", zero)
    if o.beta != 0.0:
        out["kl"] = sums.get("kl", zero) / n
    if o.entropy_coef != 0.0:
        out["policy_loss"] = sums.get("policy_loss", zero)
    per_sequence = bt.advantages_per_sequence and o.importance_sampling_level == "sequence"
    empty = objective.empty_sequence_values() if bt.B else {}
    has_tokens = bt.lengths > 0
    for name, e in empty.items():
        if name == "vespo_phi_seq":
            # the weight is per sequence whenever the advantages are (VESPO's ratio is a sequence sum)
            seq_level = bt.advantages_per_sequence
        else:
            seq_level = per_sequence
        seq_sums = sums.get(name + "@seq", torch.zeros_like(bt.lengths))
        if seq_level:  # TRL's (B, 1) tensors: one value per sequence, all B counted
            values = torch.where(has_tokens, seq_sums / bt.lengths.clamp(min=1.0), e.to(seq_sums.dtype))
            mean = values.mean() if bt.B else zero
        else:
            values = seq_sums / bt.lengths  # NaN without tokens (TRL's masked_seq_mean)
            mean = sums.get(name, zero) / n
        key = {"cispo_clip_ratio": "cispo_clip_ratio", "vespo_phi_seq": "vespo_phi_seq_mean"}.get(name, name + "_mean")
        out[key] = mean
        if name == "clip_ratio_low":
            out["clip_ratio_low_min"] = _nanmin(values)
        elif name == "clip_ratio_high":
            out["clip_ratio_high_max"] = _nanmax(values)
    return out
