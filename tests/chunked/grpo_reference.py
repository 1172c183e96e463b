"""A float64 reference of TRL 1.16's GRPO-family loss on full logits, written for the tests.

``reference_logps(weight, hidden, bias, labels, temperature)`` gives float64 per-token log-probs and
entropies of ``softmax((hidden @ weight.T + bias) / temperature)`` (differentiable);
``reference_loss(...)`` applies the loss on ``[B, T]`` tensors the way ``GRPOTrainer._compute_loss``
states it (read from TRL's documentation and source; no TRL code is imported here).
"""

import math

import torch


def reference_logps(weight, hidden, bias, labels, temperature=1.0, ignore_index=-100):
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    lp_all = torch.log_softmax(z / temperature, -1)
    safe = labels.clamp(min=0)
    logps = lp_all.gather(-1, safe[..., None]).squeeze(-1)
    entropy = -(lp_all.exp() * lp_all).sum(-1)
    mask = (labels != ignore_index).double()
    return logps * mask, entropy * mask, mask


def _as_2d(x):
    """``[B, T]`` / ``[B, 1]`` as given, ``[B]`` as ``[B, 1]``."""
    return x if x.dim() == 2 else x[:, None]


def _seq_mean(x, mask):
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


def reference_loss(logps, entropy, mask, advantages, *, loss_type="dapo", beta=0.0, epsilon_low=0.2,
                   epsilon_high=None, delta=None, importance_sampling_level="token",
                   use_bias_correction_kl=True, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                   vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                   off_policy_mask_threshold=None, top_entropy_quantile=1.0, entropy_coef=0.0,
                   max_completion_length=None, old_logps=None, ref_logps=None, sampling_logps=None,
                   importance_sampling_ratio=None, num_items_in_batch=None, entropy_pool=None):
    """``(loss, metrics)``; metrics as floats under this library's keys (``TRL_METRIC_NAMES``).
    ``entropy_pool``: the valid tokens' entropies the quantile is taken over (TRL gathers every
    process's), default this batch's."""
    eh = epsilon_low if epsilon_high is None else epsilon_high
    B = logps.shape[0]
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if importance_sampling_level == "sequence":
        liw = _seq_mean(log_ratio, mask)
    else:
        liw = log_ratio
    r = torch.exp(liw)
    if beta:
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if use_bias_correction_kl:
            kl = kl * r
    phi = None
    if loss_type == "cispo":
        ptl = -torch.clamp(r, max=eh).detach() * adv * logps
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        r2 = torch.clamp(r, 1 - epsilon_low, 1 + eh)
        if delta is not None:
            r = torch.clamp(r, max=delta)
        ptl = -torch.min(r * adv, r2 * adv)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        ptl = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv
    else:
        with torch.no_grad():
            s = (torch.clamp(log_ratio, -20, 20) * mask).sum(-1, keepdim=True)
            if importance_sampling_ratio is not None:
                isr = _as_2d(importance_sampling_ratio)
                s = s + torch.clamp(torch.log(isr), math.log(1e-8), 20).sum(-1, keepdim=True)
            lw = torch.clamp(s, math.log(1e-8), 20)
            k = torch.where(adv >= 0, vespo_k_pos, vespo_k_neg)
            lam = torch.where(adv >= 0, vespo_lambda_pos, vespo_lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * lw - lam * torch.exp(lw)).nan_to_num(0.0, 0.0, 0.0)
        ptl = -phi * adv * logps
    if off_policy_mask_threshold is not None:
        samp = old if sampling_logps is None else sampling_logps
        seq_kl = _seq_mean(torch.nan_to_num(samp - logps.detach(), nan=0.0), mask)
        ptl = ptl * ((adv >= 0) | (seq_kl <= off_policy_mask_threshold)).double()
    ent_mask = None
    if top_entropy_quantile < 1.0:
        valid = entropy.detach()[mask.bool()] if entropy_pool is None else entropy_pool
        thr = torch.quantile(valid, 1 - top_entropy_quantile)
        ent_mask = ((entropy.detach() * mask) >= thr) & mask.bool()
        ptl = ptl * ent_mask.double()
    if importance_sampling_ratio is not None and loss_type != "vespo":
        isr = _as_2d(importance_sampling_ratio)
        ptl = ptl * isr
    if beta:
        ptl = ptl + beta * kl
    if loss_type in ("grpo", "sapo"):
        loss = ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (ptl * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (ptl * mask).sum() / (B * max_completion_length)
    elif loss_type == "luspo":
        loss = (ptl * mask).sum(-1).mean()
    else:
        n = mask.sum() if num_items_in_batch is None else torch.as_tensor(float(num_items_in_batch))
        loss = (ptl * mask).sum() / n.clamp(min=1.0)
    metrics = {}
    if entropy_coef:
        eff = mask if ent_mask is None else mask * ent_mask
        metrics["policy_loss"] = float(loss)
        loss = loss - entropy_coef * (entropy * eff).sum() / eff.sum().clamp(min=1.0)

    def gmean(x):
        if x.shape[1] == 1:
            return float(x.sum() / B)
        return float((x * mask).sum() / mask.sum().clamp(min=1.0))

    def seq_vals(x):
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    if beta:
        metrics["kl"] = gmean(kl.detach())
    metrics["entropy"] = gmean(entropy.detach())
    r = r.detach()
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        low = ((r < 1 - epsilon_low) & (adv < 0)).double()
        high = ((r > 1 + eh) & (adv > 0)).double()
        metrics["clip_ratio_low_mean"] = gmean(low)
        metrics["clip_ratio_high_mean"] = gmean(high)
        metrics["clip_ratio_region_mean"] = gmean(((low + high) > 0).double())
        lv, hv = seq_vals(low), seq_vals(high)
        metrics["clip_ratio_low_min"] = float(lv[~lv.isnan()].min()) if (~lv.isnan()).any() else math.nan
        metrics["clip_ratio_high_max"] = float(hv[~hv.isnan()].max()) if (~hv.isnan()).any() else math.nan
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = gmean(((r > eh) & (adv > 0)).double())
    elif loss_type == "vespo":
        metrics["vespo_phi_seq_mean"] = gmean(phi)
    return loss, metrics
