"""Distillation divergence on one logits tile: per-row KL / generalized JSD (+ optional hard-label CE),
with the gradient w.r.t. the student logits written in place into the student tile.

Shapes and dtypes
-----------------
* ``student``  ``[n, Vs]`` bf16 / fp16 / fp32 (/ fp64) logits tile, last dim contiguous; gradient lands here.
* ``teacher``  ``[n, Vt]`` with ``Vt >= Vs`` (any float dtype, read only), **or** top-k mode:
  ``topk_logprobs [n, k]`` float teacher log-probs and ``topk_indices [n, k]`` integer token ids.
* ``labels``   ``[n]`` integer (optional): hard labels for the CE term; ``ignore_index`` rows get no CE.
* ``grad_scale``  ``[n]`` fp32 tensor or a Python float: per-row upstream gradient d(total)/d(row loss).
* Outputs (fp32 ``[n]`` each, see :class:`DivergenceTileStats`): ``loss`` = ``hard_weight * ce +
  soft_weight * divergence``, ``divergence``, ``ce``, ``entropy`` (student, at the temperature), ``correct``
  (argmax of the student logits == label). All math runs in fp32 registers.

Conventions (identical to TRL 1.16, ``GKDTrainer.generalized_jsd_loss`` and ``trl.kernels.chunked_divergence``)
------------------------------------------------------------------------------------------------------------
Both tiles are divided by ``temperature``; ``p_s = softmax(student / T)``, ``p_t = softmax(teacher / T)``.

* ``divergence="forward_kl"``: ``KL(p_t || p_s) = sum p_t (log p_t - log p_s)``  (TRL's ``beta == 0``)
* ``divergence="reverse_kl"``: ``KL(p_s || p_t)``                                (TRL's ``beta == 1``)
* ``divergence="jsd"``: generalized JSD with mixture ``m = (1 - beta) p_s + beta p_t``:
  ``beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)``; as in TRL, ``beta == 0`` / ``beta == 1`` give the
  forward / reverse KL above (not the limit of the formula, which is 0).

Teacher vocabulary larger than the student's (``Vt > Vs``; TRL itself requires equal vocabularies):
``teacher_vocab="renormalize"`` (default) takes the teacher softmax over the shared first ``Vs`` columns only,
i.e. exactly TRL/GKD applied to ``teacher_logits[..., :Vs]`` (the usual fix for padded LM heads); the loss stays
a true divergence (>= 0, 0 iff the distributions match) and the extra teacher columns are never read.
``teacher_vocab="full"`` normalises the teacher over all ``Vt`` columns and sums the divergence over the shared
``Vs`` columns (teacher mass on the extra columns is simply dropped; the value can then be negative).

Top-k mode (teacher given as top-k log-probs; semantics of TRL 1.16 ``experimental/server_distillation``,
``_add_tail_bucket`` + ``_jsd_divergence`` with a support mask): ``topk_logprobs`` are used as given (already
computed by the teacher at the distillation temperature); entries equal to ``-inf`` are padding and ignored.
The student's log-probs at temperature T (full softmax over ``Vs``) are gathered at ``topk_indices``. With
``topk_tail=True`` (TRL's default ``loss_add_tail``) both get a (k+1)-th "tail" entry ``log(1 - sum_k p)`` (the
sum clamped to ``<= exp(-1e-7)``); with ``topk_tail=False`` both are renormalised over the valid entries. The
divergence (same three kinds) is then taken over these small distributions. Valid indices of one row must be
distinct (checked by :func:`divergence_tile`). The exact gradient flows through the student's full softmax.

Hard-label CE: ``ce = logsumexp(student) - student[label]`` on the *raw* (not temperature-scaled) logits, as in
Liger-Kernel's distillation losses (``weight_hard_loss`` / ``weight_soft_loss`` there).

Gradient (when ``grad_scale`` is given): ``student[r, j] <- grad_scale[r] * d loss[r] / d student[r, j]``, in
the student tile's dtype. The teacher never receives a gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F

from liger_losses.kernels.launch import fast_kernel
from .utils import (
    check_choice,
    check_labels,
    check_range,
    check_same_device,
    check_tensor,
    device_ctx,
    import_triton,
    next_power_of_2,
    resolve_impl,
)

DIVERGENCES = ("jsd", "forward_kl", "reverse_kl")
TEACHER_VOCAB_MODES = ("renormalize", "full")
_TAIL_CLAMP = -1e-7  # TRL's clamp of log(sum of top-k probs) before the tail bucket

# Columns per block of the row loops on the GPU (capped at the row width), warps per program (0: 8
# for blocks >= 2048, else 4) and the software-pipelining depth of the row loops (``tl.range(
# num_stages=...)``; None: Triton's default loop). Module constants so that a benchmark can sweep
# them (``benchmark/diag_ce_registers.py --kernel divergence``).
# Special-function (MUFU: ex2 / lg2 / rcp) ops per element, dense teacher, with the gradient (pass 1 +
# pass 2 + last pass; +1 in pass 1 and +1 in the last pass with hard labels at temperature != 1):
#   forward KL 2 + 0 + 2 = 4 (unchanged); reverse KL 2 + 1 + 1 = 4 (unchanged; p_t is never computed);
#   JSD before 2 + 4 + 5 = 11 (softplus via Kahan's log1p: a log and an fp32 division each time),
#   JSD now    2 + 3 + 3 = 8  (exp(-|x|), exp(max log-weight), one log; see _div_terms).
# Before (H200, JSD beta=0.5, 8192 x 128256 bf16, forward + gradient): 7.35 ms against a 2.44 ms
# memory floor, and no BLOCK_CAP / NUM_WARPS / LOOP_STAGES setting changed it (7.3-8.9 ms): bound by
# per-element arithmetic, not by the launch configuration. Not yet timed after.
BLOCK_CAP = 4096
NUM_WARPS = 0
LOOP_STAGES = None
# Pass-1 sums per lane (see the kernel): off until timed on a GPU (with 2048-column blocks and 8
# warps its five [BLOCK] accumulators take 40 registers per thread).
LANE_SUMS = False
# The gradient's sum pass (JSD / reverse KL) walks the rows from their last block back, where pass 1
# ended (the rows' tails may still be in L2); the last pass then starts where it ends. False: front
# to back (the sum's rounding order differs, nothing else).
PASS2_REVERSED = True
# Register cap per thread (Triton's ``maxnreg``; None: the compiler's choice, 64 with an 8-byte
# spill at 4096 / 8 warps); see logits_tile.MAXNREG.
MAXNREG = None


def _block_settings(width: int, *, on_gpu: bool = True, block_size: Optional[int] = None) -> tuple[int, int]:
    """(columns per block, warps) for rows of ``width`` columns (``block_size`` overrides the block)."""
    block = block_size or min(next_power_of_2(width), BLOCK_CAP if on_gpu else 1024)
    return block, NUM_WARPS or (8 if block >= 2048 else 4)


class DivergenceTileStats(NamedTuple):
    """Per-row statistics of :func:`divergence_tile` (fp32 ``[n]`` each)."""

    loss: torch.Tensor
    divergence: torch.Tensor
    ce: torch.Tensor
    entropy: torch.Tensor
    correct: torch.Tensor


def divergence_mode(divergence: str, beta: float) -> int:
    """0 = forward KL(teacher||student), 1 = reverse KL(student||teacher), 2 = generalized JSD (TRL's mapping)."""
    if divergence == "forward_kl":
        return 0
    if divergence == "reverse_kl":
        return 1
    if beta == 0.0:
        return 0
    if beta == 1.0:
        return 1
    return 2


# --------------------------------------------------------------------------- Triton kernel

triton, tl = import_triton()

if triton is not None:
    from liger_losses.kernels.utils import acc_zero, keep_or_sum, kept_total  # jit helpers

    @triton.jit
    def _expm1_neg(x):
        # expm1 for x <= 0 from exp/log only (Kahan's trick): accurate near 0 where exp(x) - 1 cancels.
        u = tl.exp(x)
        um1 = u - 1.0
        safe = tl.where((u == 1.0) | (um1 == -1.0), 1.0, um1)
        logu = tl.where((u == 1.0) | (um1 == -1.0), 1.0, tl.log(u))
        return tl.where(u == 1.0, x, tl.where(um1 == -1.0, -1.0, safe * x / logu))

    @triton.jit
    def _log1p_unit(r):
        # log(1 + r) for 0 <= r <= 1 from one log, with relative accuracy down to tiny r: u = fl(1 + r), and
        # r - (u - 1) is exactly the rounding error of that sum (u - 1 is exact by Sterbenz; Fast2Sum, |r| <= 1);
        # log(1 + r) = log(u) + (r - (u - 1)) / u + O(ulp^2), and dropping the / u costs < r * ulp(1) (no division)
        u = 1.0 + r
        return tl.log(u) + (r - (u - 1.0))

    @triton.jit
    def _div_terms(ls, lt, one_m_beta, log_1m_beta, log_beta, MODE: tl.constexpr):
        # For student / teacher log-probs (ls, lt): the divergence term d, g = d div / d ls, t with g = p_s * t
        # (modes 1, 2; t is what the gradient passes shift to avoid cancellation; mode 0: t = 0), and p_s.
        # Outputs a caller leaves unused are dead code (Triton removes them; equal exps are CSE'd).
        if MODE == 0:
            ps = tl.exp(ls)
            pt = tl.exp(lt)
            d = pt * (lt - ls)
            g = -pt
            t = 0.0 * ls
        elif MODE == 1:
            ps = tl.exp(ls)  # reverse KL needs no p_t
            t = ls - lt + 1.0
            d = ps * (ls - lt)
            g = ps * t
        else:
            # Mixture m = a + c with a = (1-beta) p_s, c = beta p_t, from three MUFU ops (two ex2, one lg2):
            # x = log a - log c, r = exp(-|x|) = min(a, c) / max(a, c), max(a, c) = exp(max(log a, log c)),
            # log(m / max) = log1p(r); ls - log m = -log(1-beta) - softplus(-x), lt - log m = -log(beta) -
            # softplus(x), each softplus as max(+-x, 0) + log1p(r) (so that the small one keeps its relative
            # accuracy: beta near 0 or 1 makes the divergence a difference of such small terms). Never 0 * inf:
            # every factor stays finite for finite ls, lt, and a = c = 0 where both probabilities underflow.
            # (The plain log(m) form, same MUFU count, loses up to 1e-3 relative in the gradient at beta=1e-3
            # or with a peaked teacher: its absolute error ~ulp(log m) is not small next to these differences.)
            x = (ls - lt) + (log_1m_beta - log_beta)
            r = tl.exp(-tl.abs(x))
            big = tl.exp(tl.maximum(ls + log_1m_beta, lt + log_beta))
            small = big * r
            s_big = x >= 0.0
            a = tl.where(s_big, big, small)
            c = tl.where(s_big, small, big)
            l1p = _log1p_unit(r)
            lsm = -log_1m_beta - (tl.maximum(-x, 0.0) + l1p)
            ltm = -log_beta - (tl.maximum(x, 0.0) + l1p)
            d = c * ltm + a * lsm
            t = one_m_beta * lsm
            g = a * lsm
            ps = a * (1.0 / one_m_beta)
        return d, g, t, ps

    @triton.jit
    def _divergence_tile_kernel(
        s_ptr,
        s_stride,
        t_ptr,
        t_stride,
        labels_ptr,
        tk_lp_ptr,
        tk_lp_stride,
        tk_idx_ptr,
        tk_idx_stride,
        scale_ptr,
        scale_value,
        loss_ptr,
        div_ptr,
        ce_ptr,
        ent_ptr,
        correct_ptr,
        n_cols,
        n_t_cols,
        K,
        inv_t,
        one_m_beta,
        log_1m_beta,
        log_beta,
        w_hard,
        w_soft,
        ignore_index,
        MODE: tl.constexpr,
        TOPK: tl.constexpr,
        TAIL: tl.constexpr,
        HAS_LABELS: tl.constexpr,
        SEP_RAW: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
        ROW_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
        LANE_SUMS: tl.constexpr,
        REVERSED: tl.constexpr,
    ):
        one_m_beta = tl.cast(one_m_beta, tl.float32)
        inv_t = tl.cast(inv_t, tl.float32)
        row = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + row * s_stride
        cols = tl.arange(0, BLOCK)

        # ---- pass 1: student (and, dense mode, teacher) statistics in one sweep; scalar online max per row:
        # block max, m_new = max(m, bmax), d = d * exp(m - m_new) + sum(exp(z - m_new)) -- one exp per element.
        # The sums are scalars (a block-wide reduction each per block) or, LANE_SUMS, [BLOCK] vectors rescaled by
        # the same scalar factors and reduced once after the loop (two block reductions per block instead of
        # five to seven: the student's max with its index and the teacher's max).
        m_s = float("-inf")
        m_r = float("-inf")
        best = float("-inf")
        best_idx = 0
        m_t = float("-inf")
        d_s = acc_zero(BLOCK, LANE_SUMS)
        x_s = acc_zero(BLOCK, LANE_SUMS)
        d_r = acc_zero(BLOCK, LANE_SUMS)
        d_t = acc_zero(BLOCK, LANE_SUMS)
        d_ts = acc_zero(BLOCK, LANE_SUMS)  # teacher sum-exp over the shared first n_cols columns (forward KL)
        if TOPK:
            n_loop = n_cols
        else:
            n_loop = n_t_cols
            t_row = t_ptr + row * t_stride
        for start in tl.range(0, n_loop, BLOCK, num_stages=STAGES):
            offs = start + cols
            mask = offs < n_cols
            raw = tl.load(s_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
            braw, bidx = tl.max(raw, axis=0, return_indices=True)
            if start < n_cols:
                zs = raw * inv_t
                bm = braw * inv_t  # x -> x * inv_t (inv_t > 0) is monotone in fp32: same max
                new_m = tl.maximum(m_s, bm)
                resc = tl.exp(m_s - new_m)
                e = tl.where(mask, tl.exp(zs - new_m), 0.0)
                d_s = d_s * resc + keep_or_sum(e, LANE_SUMS)
                x_s = x_s * resc + keep_or_sum(e * tl.where(mask, zs, 0.0), LANE_SUMS)
                m_s = new_m
                if SEP_RAW:
                    new_mr = tl.maximum(m_r, braw)
                    d_r = d_r * tl.exp(m_r - new_mr) + keep_or_sum(tl.where(mask, tl.exp(raw - new_mr), 0.0), LANE_SUMS)
                    m_r = new_mr
                best_idx = tl.where(braw > best, bidx + start, best_idx)
                best = tl.maximum(best, braw)
            if not TOPK:
                tmask = offs < n_t_cols
                zt = tl.load(t_row + offs, mask=tmask, other=float("-inf")).to(tl.float32) * inv_t
                new_mt = tl.maximum(m_t, tl.max(zt, axis=0))
                rt = tl.exp(m_t - new_mt)
                et = tl.where(tmask, tl.exp(zt - new_mt), 0.0)
                d_t = d_t * rt + keep_or_sum(et, LANE_SUMS)
                if MODE == 0:
                    d_ts = d_ts * rt + keep_or_sum(tl.where(mask, et, 0.0), LANE_SUMS)
                m_t = new_mt
        d_s = kept_total(d_s, LANE_SUMS)
        x_s = kept_total(x_s, LANE_SUMS)
        d_r = kept_total(d_r, LANE_SUMS)
        d_t = kept_total(d_t, LANE_SUMS)
        d_ts = kept_total(d_ts, LANE_SUMS)
        lse_s = m_s + tl.log(d_s)
        entropy = lse_s - x_s / d_s
        if SEP_RAW:
            lse_r = m_r + tl.log(d_r)
        else:
            lse_r = lse_s / inv_t

        ce = 0.0
        label = 0
        has_label = False
        correct = 0.0
        if HAS_LABELS:
            label = tl.load(labels_ptr + row).to(tl.int64)
            has_label = label != ignore_index
            safe_label = tl.where(has_label, label, 0)
            x_label = tl.load(s_row + safe_label).to(tl.float32)
            ce = tl.where(has_label, lse_r - x_label, 0.0)
            correct = tl.where(has_label & (best_idx.to(tl.int64) == label), 1.0, 0.0)

        if WRITE_GRAD:
            if ROW_SCALE:
                scale = tl.load(scale_ptr + row).to(tl.float32)
            else:
                scale = tl.cast(scale_value, tl.float32)
            c_soft = scale * w_soft * inv_t
            c_hard = scale * w_hard

        if TOPK:
            # ---- sparse divergence over the teacher's top-k support (+ tail bucket)
            kk = tl.arange(0, BLOCK_K)
            kmask = kk < K
            lt = tl.load(tk_lp_ptr + row * tk_lp_stride + kk, mask=kmask, other=float("-inf")).to(tl.float32)
            idx = tl.load(tk_idx_ptr + row * tk_idx_stride + kk, mask=kmask, other=0).to(tl.int64)
            valid = kmask & (lt > float("-inf"))
            idx = tl.where(valid, idx, 0)
            zk = tl.load(s_row + idx, mask=valid, other=0.0).to(tl.float32) * inv_t
            ls_full = zk - lse_s  # student log-prob (full softmax) at the support
            ls = tl.where(valid, ls_full, float("-inf"))
            if TAIL:
                top_s = tl.max(ls, axis=0)
                top_s_safe = tl.where(top_s > float("-inf"), top_s, 0.0)
                sum_s = tl.sum(tl.where(valid, tl.exp(ls - top_s_safe), 0.0), axis=0)
                log_sum_s = tl.where(top_s > float("-inf"), top_s_safe + tl.log(tl.where(sum_s > 0, sum_s, 1.0)), float("-inf"))
                clamped_s = log_sum_s > -1e-7  # TRL's clamp (_TAIL_CLAMP)
                log_sum_s = tl.minimum(log_sum_s, -1e-7)
                tail_s = tl.log(-_expm1_neg(log_sum_s))
                top_t = tl.max(lt, axis=0)
                top_t_safe = tl.where(top_t > float("-inf"), top_t, 0.0)
                sum_t = tl.sum(tl.where(valid, tl.exp(lt - top_t_safe), 0.0), axis=0)
                log_sum_t = tl.where(top_t > float("-inf"), top_t_safe + tl.log(tl.where(sum_t > 0, sum_t, 1.0)), float("-inf"))
                log_sum_t = tl.minimum(log_sum_t, -1e-7)
                tail_t = tl.log(-_expm1_neg(log_sum_t))
                ls_sp = ls
                lt_sp = lt
            else:
                top_s = tl.max(ls, axis=0)
                top_s_safe = tl.where(top_s > float("-inf"), top_s, 0.0)
                lse_sup_s = top_s_safe + tl.log(tl.sum(tl.where(valid, tl.exp(ls - top_s_safe), 0.0), axis=0))
                top_t = tl.max(lt, axis=0)
                top_t_safe = tl.where(top_t > float("-inf"), top_t, 0.0)
                lse_sup_t = top_t_safe + tl.log(tl.sum(tl.where(valid, tl.exp(lt - top_t_safe), 0.0), axis=0))
                ls_sp = tl.where(valid, ls - lse_sup_s, 0.0)
                lt_sp = tl.where(valid, lt - lse_sup_t, 0.0)
            dk, gk, _tk, _pk = _div_terms(
                tl.where(valid, ls_sp, 0.0), tl.where(valid, lt_sp, 0.0), one_m_beta, log_1m_beta, log_beta, MODE
            )
            dk = tl.where(valid, dk, 0.0)
            gk = tl.where(valid, gk, 0.0)
            div = tl.sum(dk, axis=0)
            sum_g = tl.sum(gk, axis=0)
            if TAIL:
                d_tail, g_tail, _tt, _pt = _div_terms(tail_s, tail_t, one_m_beta, log_1m_beta, log_beta, MODE)
                div += d_tail
                # d tail_s / d z_j = -(q_j [j in support] - S p_j) / (1 - S); w = g_tail / (1 - S), 0 if clamped
                w = tl.where(clamped_s, 0.0, g_tail * tl.exp(-tail_s))
                s_mass = tl.exp(log_sum_s)
                coef_dense = sum_g - w * s_mass
                ps_k = tl.exp(ls_full)
                a_k = gk - w * ps_k
            else:
                coef_dense = 0.0
                r_k = tl.exp(ls_sp)
                a_k = gk - r_k * sum_g
        else:
            lse_t = m_t + tl.log(d_t)
            div = 0.0
            coef_dense = 0.0
            t_c = 0.0
            if MODE == 0:
                # forward KL: d div / d z_j = p_s,j * S - p_t,j with S = teacher mass on the shared columns
                # (exactly 1 with teacher_vocab="renormalize"): known after pass 1, so no extra pass
                coef_dense = -(d_ts / d_t)
            elif WRITE_GRAD:
                # shift c = t at the student's argmax: grad_j = p_j ((t_j - c) - sum_i p_i (t_i - c)) has no
                # cancellation on the peak entry
                ls_c = tl.load(s_row + best_idx).to(tl.float32) * inv_t - lse_s
                lt_c = tl.load(t_row + best_idx).to(tl.float32) * inv_t - lse_t
                _dc, _gc, t_c, _pc = _div_terms(ls_c, lt_c, one_m_beta, log_1m_beta, log_beta, MODE)
                # ---- pass 2: sum_i p_i (t_i - c) for the gradient (only t, no divergence term);
                # REVERSED: last block first (see PASS2_REVERSED)
                n_blk = tl.cdiv(n_cols, BLOCK)
                for bi in tl.range(0, n_blk, num_stages=STAGES):
                    if REVERSED:
                        offs = (n_blk - 1 - bi) * BLOCK + cols
                    else:
                        offs = bi * BLOCK + cols
                    mask = offs < n_cols
                    ls = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32) * inv_t - lse_s
                    lt = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32) * inv_t - lse_t
                    _dd, _gg, tt, ps = _div_terms(ls, lt, one_m_beta, log_1m_beta, log_beta, MODE)
                    coef_dense += tl.sum(tl.where(mask, ps * (tt - t_c), 0.0), axis=0)
            if not WRITE_GRAD:
                # ---- no gradient wanted: pass 2 is the divergence itself (then there is no last pass)
                for start in tl.range(0, n_cols, BLOCK, num_stages=STAGES):
                    offs = start + cols
                    mask = offs < n_cols
                    ls = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32) * inv_t - lse_s
                    lt = tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32) * inv_t - lse_t
                    dd, _gg, _tt, _ps = _div_terms(ls, lt, one_m_beta, log_1m_beta, log_beta, MODE)
                    div += tl.sum(tl.where(mask, dd, 0.0), axis=0)

        if WRITE_GRAD:
            # ---- last pass: gradient in place over the whole student row (+ the dense divergence, accumulated
            # here since both log-normalisers are known after pass 1)
            for start in tl.range(0, n_cols, BLOCK, num_stages=STAGES):
                offs3 = start + cols
                mask3 = offs3 < n_cols
                raw3 = tl.load(s_row + offs3, mask=mask3, other=0.0).to(tl.float32)
                ls3 = raw3 * inv_t - lse_s
                if TOPK:
                    ps3 = tl.exp(ls3)
                    grad3 = -c_soft * ps3 * coef_dense
                else:
                    lt3 = tl.load(t_row + offs3, mask=mask3, other=0.0).to(tl.float32) * inv_t - lse_t
                    dd3, gg3, tt3, ps3 = _div_terms(ls3, lt3, one_m_beta, log_1m_beta, log_beta, MODE)
                    div += tl.sum(tl.where(mask3, dd3, 0.0), axis=0)
                    if MODE == 0:
                        grad3 = c_soft * (gg3 - ps3 * coef_dense)
                    else:
                        grad3 = c_soft * ps3 * ((tt3 - t_c) - coef_dense)
                if HAS_LABELS:
                    if SEP_RAW:
                        pr3 = tl.exp(raw3 - lse_r)
                    else:
                        pr3 = ps3  # temperature 1: the CE softmax is the divergence softmax
                    onehot3 = tl.where(offs3.to(tl.int64) == label, 1.0, 0.0)
                    grad3 += tl.where(has_label, c_hard * (pr3 - onehot3), 0.0)
                tl.store(s_row + offs3, grad3.to(s_ptr.dtype.element_ty), mask=mask3)
        loss = w_hard * ce + w_soft * div
        tl.store(loss_ptr + row, loss)
        tl.store(div_ptr + row, div)
        tl.store(ce_ptr + row, ce)
        tl.store(ent_ptr + row, entropy)
        tl.store(correct_ptr + row, correct)

        if WRITE_GRAD:
            if TOPK:
                # the support entries: overwrite with their full value (dense part + support part)
                tl.debug_barrier()
                ps_k = tl.exp(ls_full)
                gval = c_soft * (a_k - ps_k * coef_dense)
                if HAS_LABELS:
                    rawk = zk / inv_t
                    prk = tl.exp(rawk - lse_r)
                    onehot_k = tl.where(idx == label, 1.0, 0.0)
                    gval += tl.where(has_label, c_hard * (prk - onehot_k), 0.0)
                tl.store(s_row + idx, gval.to(s_ptr.dtype.element_ty), mask=valid)

    # host launches go through launch.fast_kernel (the compiled launcher after a first launch)
    _divergence_tile_kernel = fast_kernel(_divergence_tile_kernel)


# --------------------------------------------------------------------------- PyTorch fallback


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


def _divergence_tile_torch(
    student, teacher, labels, topk_logprobs, topk_indices, grad_scale, *, mode, beta, inv_t, n_t_cols,
    tail, w_hard, w_soft, ignore_index,
):
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
            clamped = lsum_s_raw > _TAIL_CLAMP
            lsum_s = lsum_s_raw.clamp(max=_TAIL_CLAMP)
            tail_s = _log1mexp(lsum_s)
            tail_t = _log1mexp(torch.logsumexp(lt_k, dim=-1).clamp(max=_TAIL_CLAMP))
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
    return DivergenceTileStats(loss.to(f32), div.to(f32), ce.to(f32), entropy.to(f32), correct.to(f32))


# --------------------------------------------------------------------------- public entry


def _check_inputs(student, teacher, labels, topk_logprobs, topk_indices, grad_scale, *, divergence, beta,
                  temperature, teacher_vocab, ignore_index):
    check_tensor("student", student, ndim=2, floating=True)
    n, vs = student.shape
    if student.stride(-1) != 1:
        raise ValueError("student must have a contiguous last dimension (it receives the gradient in place)")
    check_choice("divergence", divergence, DIVERGENCES)
    check_choice("teacher_vocab", teacher_vocab, TEACHER_VOCAB_MODES)
    check_range("beta", beta, 0.0, 1.0)
    check_range("temperature", temperature, 0.0, None, low_inclusive=False)
    topk = topk_logprobs is not None or topk_indices is not None
    if topk and teacher is not None:
        raise ValueError("give either teacher [n, Vt] or teacher top-k (topk_logprobs, topk_indices), not both")
    if not topk and teacher is None:
        raise ValueError("teacher [n, Vt] is required unless topk_logprobs and topk_indices are given")
    if teacher is not None:
        check_tensor("teacher", teacher, ndim=2, floating=True)
        if teacher.shape[0] != n:
            raise ValueError(f"teacher must have shape [{n}, Vt] like student's rows, got {tuple(teacher.shape)}")
        if teacher.shape[1] < vs:
            raise ValueError(
                f"teacher vocabulary ({teacher.shape[1]}) must be >= the student's ({vs}); got teacher shape "
                f"{tuple(teacher.shape)}"
            )
        if teacher.stride(-1) != 1:
            raise ValueError("teacher must have a contiguous last dimension")
    if topk:
        if topk_logprobs is None or topk_indices is None:
            raise ValueError("top-k mode needs both topk_logprobs and topk_indices")
        check_tensor("topk_logprobs", topk_logprobs, ndim=2, floating=True)
        check_tensor("topk_indices", topk_indices, ndim=2, floating=False)
        if topk_logprobs.shape[0] != n or topk_indices.shape != topk_logprobs.shape:
            raise ValueError(
                f"topk_logprobs and topk_indices must both have shape [{n}, k], got "
                f"{tuple(topk_logprobs.shape)} and {tuple(topk_indices.shape)}"
            )
        check_topk(topk_logprobs, topk_indices, vs)
    if labels is not None:
        check_tensor("labels", labels, ndim=1, floating=False)
        if labels.shape[0] != n:
            raise ValueError(f"labels must have shape [{n}], got {tuple(labels.shape)}")
        check_labels("labels", labels, vs, ignore_index)
    if isinstance(grad_scale, torch.Tensor):
        check_tensor("grad_scale", grad_scale, ndim=1, floating=True)
        if grad_scale.shape[0] != n:
            raise ValueError(f"grad_scale must have shape [{n}], got {tuple(grad_scale.shape)}")
    check_same_device(student=student, teacher=teacher, labels=labels, topk_logprobs=topk_logprobs,
                      topk_indices=topk_indices,
                      grad_scale=grad_scale if isinstance(grad_scale, torch.Tensor) else None)


def check_topk(topk_logprobs: torch.Tensor, topk_indices: torch.Tensor, vocab: int) -> None:
    """Raise ``ValueError`` unless valid (``> -inf``) top-k entries have distinct indices in ``[0, vocab)`` and
    log-probs ``<= 0`` (no NaN). One host synchronisation."""
    valid = topk_logprobs > float("-inf")
    idx = topk_indices.long()
    bad_idx = valid & ((idx < 0) | (idx >= vocab))
    bad_lp = torch.isnan(topk_logprobs) | (topk_logprobs > 1e-4)
    srt, order = torch.where(valid, idx, -1 - torch.arange(idx.shape[-1], device=idx.device)).sort(-1)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    flags = torch.stack([bad_idx.any(), bad_lp.any(), dup.any()]).tolist()
    if flags[0]:
        raise ValueError(f"topk_indices must be in [0, {vocab}) where topk_logprobs > -inf")
    if flags[1]:
        raise ValueError("topk_logprobs must be log-probabilities (<= 0, not NaN; -inf marks padding)")
    if flags[2]:
        raise ValueError("topk_indices must be distinct within a row (among entries with topk_logprobs > -inf)")


def divergence_tile(
    student: torch.Tensor,
    teacher: Optional[torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    *,
    topk_logprobs: Optional[torch.Tensor] = None,
    topk_indices: Optional[torch.Tensor] = None,
    divergence: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_vocab: str = "renormalize",
    topk_tail: bool = True,
    hard_weight: float = 0.0,
    soft_weight: float = 1.0,
    ignore_index: int = -100,
    grad_scale: Union[torch.Tensor, float, None] = None,
    check_inputs: bool = True,
    impl: str = "auto",
    block_size: Optional[int] = None,
) -> DivergenceTileStats:
    """Per-row distillation loss of a student logits tile against a teacher tile (or teacher top-k).

    When ``grad_scale`` is given, ``student`` is overwritten with ``grad_scale[r] * d loss[r] / d student[r]``.
    ``check_inputs=False`` skips validation (and its host syncs) for callers that validated once up front.
    ``block_size`` (power of 2) overrides the Triton column block (tests use it to force several blocks).
    """
    if check_inputs:
        _check_inputs(student, teacher, labels, topk_logprobs, topk_indices, grad_scale, divergence=divergence,
                      beta=beta, temperature=temperature, teacher_vocab=teacher_vocab, ignore_index=ignore_index)
    n, vs = student.shape
    mode = divergence_mode(divergence, beta)
    inv_t = 1.0 / float(temperature)
    topk = topk_logprobs is not None
    n_t_cols = vs if (topk or teacher_vocab == "renormalize") else teacher.shape[1]
    which = resolve_impl(impl, student, teacher, topk_logprobs)
    if which == "torch":
        return _divergence_tile_torch(
            student, teacher, labels, topk_logprobs, topk_indices, grad_scale, mode=mode, beta=float(beta),
            inv_t=inv_t, n_t_cols=n_t_cols, tail=bool(topk_tail), w_hard=float(hard_weight),
            w_soft=float(soft_weight), ignore_index=ignore_index,
        )

    dev = student.device
    outs = [torch.empty(n, device=dev, dtype=torch.float32) for _ in range(5)]
    if n == 0:
        return DivergenceTileStats(*outs)
    width = max(vs, n_t_cols)
    block, warps = _block_settings(width, on_gpu=dev.type == "cuda", block_size=block_size)
    dummy = outs[0]
    row_scale = isinstance(grad_scale, torch.Tensor)
    k = topk_logprobs.shape[1] if topk else 0
    b = float(beta)
    with device_ctx(student):  # Triton launches on the current GPU
        _divergence_tile_kernel[(n,)](
            student, student.stride(0),
            teacher if teacher is not None else dummy, teacher.stride(0) if teacher is not None else 0,
            labels if labels is not None else dummy,
            topk_logprobs if topk else dummy, topk_logprobs.stride(0) if topk else 0,
            topk_indices if topk else dummy, topk_indices.stride(0) if topk else 0,
            grad_scale.float().contiguous() if row_scale else dummy,
            float(grad_scale) if (grad_scale is not None and not row_scale) else 1.0,
            *outs,
            vs, n_t_cols, k,
            inv_t, 1.0 - b,  # 1 - beta rounded once (fp32 1 - fp32(0.999) is off by 1.3e-5 relative)
            math.log1p(-b) if b < 1.0 else 0.0, math.log(b) if b > 0.0 else 0.0,
            float(hard_weight), float(soft_weight), int(ignore_index),
            MODE=mode, TOPK=topk, TAIL=bool(topk_tail), HAS_LABELS=labels is not None,
            SEP_RAW=(labels is not None and float(temperature) != 1.0),
            WRITE_GRAD=grad_scale is not None, ROW_SCALE=row_scale,
            BLOCK=block, BLOCK_K=max(2, next_power_of_2(k + 1)) if topk else 2, STAGES=LOOP_STAGES,
            LANE_SUMS=LANE_SUMS, REVERSED=PASS2_REVERSED,
            num_warps=warps, **({} if MAXNREG is None else {"maxnreg": MAXNREG}),
        )
    return DivergenceTileStats(*outs)
