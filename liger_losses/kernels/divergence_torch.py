"""The PyTorch path of :func:`liger_losses.kernels.divergence_tile.divergence_tile`: the same
per-row statistics and in-place student gradient as the Triton kernel, in fp32 (fp64 for fp64
students), with whole-row PyTorch ops (no blocks, no online softmax).

Inputs are those of ``divergence_tile`` after its checks: ``student [n, Vs]`` (overwritten by the
gradient when ``grad_scale`` is given), ``teacher [n, Vt]`` or top-k ``topk_logprobs [n, k]`` /
``topk_indices [n, k]``, ``labels [n]`` or None. Returns five fp32 ``[n]`` tensors (loss,
divergence, ce, entropy, correct).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TAIL_CLAMP = -1e-7  # TRL's clamp of log(sum of top-k probs) before the tail bucket


def _terms_torch(ls, lt, beta, mode):
    """(d, g, t) as the kernel's ``_div_terms`` (softplus form; same values): divergence term, d div / d ls, and
    g = p_s * t (modes 1, 2)."""
    ps, pt = ls.exp(), lt.exp()
    if mode == 0:
        return pt * (lt - ls), -pt, torch.zeros_like(ls)
    if mode == 1:
        t = ls - lt + 1.0
        return ps * (ls - lt), ps * t, t
    x = (ls - lt) + (math.log1p(-beta) - math.log(beta))
    # both softpluses evaluated directly (not softplus(x) = softplus(-x) + x, which loses the small one's
    # relative accuracy when beta is near 1)
    lsm = -math.log1p(-beta) - F.softplus(-x)
    ltm = -math.log(beta) - F.softplus(x)
    t = (1.0 - beta) * lsm
    return beta * pt * ltm + (1.0 - beta) * ps * lsm, ps * t, t


def _log1mexp(x):
    return torch.log(-torch.expm1(x))


def divergence_tile_torch(
    student, teacher, labels, topk_logprobs, topk_indices, grad_scale, *, mode, beta, inv_t, n_t_cols,
    tail, w_hard, w_soft, ignore_index,
):
    """``(loss, divergence, ce, entropy, correct)`` (fp32 ``[n]`` each) of ``divergence_tile``'s
    checked inputs (``mode`` from ``divergence_mode``, ``inv_t = 1 / temperature``); with
    ``grad_scale`` the gradient is written into ``student``."""
    acc = torch.float64 if student.dtype == torch.float64 else torch.float32
    n, vs = student.shape
    raw = student.to(acc)
    zs = raw * inv_t
    lse_s = torch.logsumexp(zs, dim=-1)
    ls = zs - lse_s[:, None]
    ps = ls.exp()
    entropy = -(ps * ls).sum(-1)
    lse_r = torch.logsumexp(raw, dim=-1)
    if labels is not None:
        has = labels != ignore_index
        safe = torch.where(has, labels, torch.zeros_like(labels)).long()
        ce = torch.where(has, lse_r - raw.gather(1, safe[:, None])[:, 0], torch.zeros_like(lse_r))
        correct = (has & (raw.argmax(-1) == safe)).to(acc)
    else:
        ce = torch.zeros_like(lse_r)
        correct = torch.zeros_like(lse_r)

    if topk_logprobs is None:
        zt = teacher[:, :n_t_cols].to(acc) * inv_t
        lt = zt[:, :vs] - torch.logsumexp(zt, dim=-1)[:, None]
        d, g, t = _terms_torch(ls, lt, beta, mode)
        div = d.sum(-1)
        if mode == 0:
            grad_soft = g - ps * g.sum(-1, keepdim=True)
        else:  # shifted by t at the student's argmax (no cancellation on the peak entry)
            t = t - t.gather(1, raw.argmax(-1, keepdim=True))
            grad_soft = ps * (t - (ps * t).sum(-1, keepdim=True))
    else:
        lt = topk_logprobs.to(acc)
        valid = lt > float("-inf")
        idx = torch.where(valid, topk_indices.long(), torch.zeros_like(topk_indices, dtype=torch.long))
        ls_full = ls.gather(1, idx)
        neg_inf = float("-inf")
        ls_k = torch.where(valid, ls_full, neg_inf)
        lt_k = torch.where(valid, lt, neg_inf)
        if tail:
            lsum_s_raw = torch.logsumexp(ls_k, dim=-1)
            clamped = lsum_s_raw > TAIL_CLAMP
            lsum_s = lsum_s_raw.clamp(max=TAIL_CLAMP)
            tail_s = _log1mexp(lsum_s)
            tail_t = _log1mexp(torch.logsumexp(lt_k, dim=-1).clamp(max=TAIL_CLAMP))
            ls_sp, lt_sp = ls_k, lt_k
        else:
            ls_sp = ls_k - torch.logsumexp(ls_k, dim=-1, keepdim=True)
            lt_sp = lt_k - torch.logsumexp(lt_k, dim=-1, keepdim=True)
        zero = torch.zeros((), dtype=acc, device=student.device)
        d, g, _ = _terms_torch(torch.where(valid, ls_sp, zero), torch.where(valid, lt_sp, zero), beta, mode)
        d = torch.where(valid, d, zero)
        g = torch.where(valid, g, zero)
        div = d.sum(-1)
        sum_g = g.sum(-1)
        if tail:
            d_tail, g_tail, _ = _terms_torch(tail_s, tail_t, beta, mode)
            div = div + d_tail
            w = torch.where(clamped, zero, g_tail * torch.exp(-tail_s))
            coef_dense = sum_g - w * lsum_s.exp()
            a_k = g - w[:, None] * ls_full.exp()
        else:
            coef_dense = torch.zeros_like(sum_g)
            a_k = g - ls_sp.exp().masked_fill(~valid, 0.0) * sum_g[:, None]
        grad_soft = -ps * coef_dense[:, None]
        grad_soft = grad_soft.scatter_add(1, idx, torch.where(valid, a_k, zero))

    loss = w_hard * ce + w_soft * div
    if grad_scale is not None:
        scale = grad_scale.to(acc)[:, None] if isinstance(grad_scale, torch.Tensor) else float(grad_scale)
        grad = (w_soft * inv_t) * grad_soft
        if labels is not None:
            pr = (raw - lse_r[:, None]).exp()
            pr = pr - torch.nn.functional.one_hot(safe, vs).to(acc)
            grad = grad + w_hard * pr * has[:, None].to(acc)
        student.copy_(grad * scale)
    f32 = torch.float32
    return loss.to(f32), div.to(f32), ce.to(f32), entropy.to(f32), correct.to(f32)
