"""Row statistics of one logits tile and its gradient written in place (layer 1).

Input: a logits tile ``x [n, V]`` (bf16 / fp16 / fp32, any row stride, unit column stride) and
``labels [n]`` (integer; ``ignore_index`` rows give zero statistics and a zero gradient row; labels
outside ``[0, V)`` are treated the same way -- callers check the range and raise).
Each row is transformed ``y = logit_scale * x``; ``y = softcap * tanh(y / softcap)`` when
``softcap`` is set; ``z = y / temperature``; ``p = softmax(z)``. Per row (all float32, ``[n]``):

* ``lse = logsumexp(z)``, ``logp = z[label] - lse``
* ``loss``: in ``mode="ce"`` the cross-entropy
  ``(1 - eps) * w[label] * (-logp) + eps / V * sum_v w[v] * (-log p_v) + z_loss_weight * lse**2``
  (``w`` = class weights, 1 when not given; ``eps`` = label smoothing), in ``mode="logp"``
  ``loss = logp`` (the objective the preference losses differentiate)
* ``entropy = -sum_v p_v log p_v`` (only if ``need_entropy``), ``log_sum_sq = log sum_v p_v^2`` (only if
  ``need_log_sum_sq``: WPO's weights), ``correct = argmax(z) == label``
  (the first maximal index, as ``torch.argmax``: a label that ties the maximum after an earlier
  column is no hit), ``logits_sum = sum_v z_v``

With ``grad=True`` the tile is overwritten, in its own dtype, by
``grad_scale[row] * d loss[row] / d x[row, :]`` (through softcap, scale and temperature); with
``grad=False`` the tile is left untouched (statistics only, e.g. for a reference model). All
arithmetic is float32 in registers. Triton: one program per row, two passes over the row in
blocks (online max / sum-exp, then the gradient). ``impl="torch"``: same semantics in PyTorch,
in float32 -- float64 (statistics included) for float64 logits, so a float64 reference run has no
float32 step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import (
    check_choice,
    check_range,
    check_same_device,
    check_tensor,
    device_ctx,
    import_triton,
    is_compiling,
    next_power_of_2,
    resolve_impl,
    row_scales,
    triton_interpret,
)

MODES = ("ce", "logp")


class TileStats(NamedTuple):
    """Per-row statistics of a logits tile, each ``[n]`` (float32 -- float64 from the PyTorch path on
    float64 logits -- except ``correct``: bool)."""

    loss: Tensor
    lse: Tensor
    logp: Tensor
    entropy: Optional[Tensor]
    correct: Tensor
    logits_sum: Optional[Tensor]  # None when not asked for (need_logits_sum=False)
    log_sum_sq: Optional[Tensor] = None  # log sum_v p_v^2 (need_log_sum_sq), else None


triton, tl = import_triton()

if triton is not None:
    from liger_losses.kernels.utils import acc_zero, keep_or_sum, kept_total, max_transformed  # jit helpers
    from liger_losses.kernels.utils import transform_logits as _transform

    @triton.jit
    def _gradient_pass(x_ptr, g_ptr, SCALE, row, scale_stride, scale_value, CW, valid, lse, safe, w_y, w_sum,
                       V, logit_scale, inv_temp, softcap, eps, z_w, n_blocks, offs,
                       MODE_CE: tl.constexpr, SCALE_PER_ROW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                       HAS_CW: tl.constexpr, BLOCK: tl.constexpr, STAGES2: tl.constexpr, REVERSED: tl.constexpr):
        """Pass 2: the gradient d loss / d x of one row, times the row scale, written to ``g_ptr``."""
        if SCALE_PER_ROW:
            scale = tl.load(SCALE + row * scale_stride).to(tl.float32)
        else:
            scale = scale_value
        lse_s = tl.where(valid, lse, 0.0)
        zc = 2.0 * z_w * lse_s
        # per-row scalars, so that an element costs one exp, one fma and one select (few live
        # registers: large blocks with many warps stay spill-free); coef is 0 on ignored rows
        coef = tl.where(valid, inv_temp * logit_scale * scale, 0.0)
        if MODE_CE:
            a = (1.0 + zc) * coef  # g = p * a - c0, minus c1 at the label
            c0 = eps / V * coef
            c1 = (1.0 - eps) * coef
        else:  # d logp / dz = onehot - p
            a = -coef
            c0 = 0.0
            c1 = -coef
        v_read = tl.where(valid, V, 0)  # ignored rows: nothing read, x = 0, a zero gradient row
        # REVERSED: last block first, where pass 1 ended (the row's tail may still be in L2)
        for b in tl.range(0, n_blocks, num_stages=STAGES2):
            if REVERSED:
                cols = (n_blocks - 1 - b) * BLOCK + offs
            else:
                cols = b * BLOCK + offs
            mask = cols < V
            x = tl.load(x_ptr + cols, mask=cols < v_read, other=0.0).to(tl.float32)
            z, t = _transform(x, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
            p = tl.exp(tl.minimum(z - lse_s, 0.0))
            if HAS_CW and MODE_CE:
                w = tl.load(CW + cols, mask=mask, other=0.0).to(tl.float32)
                g = ((1.0 - eps) * w_y * p + eps / V * (w_sum * p - w) + zc * p) * coef
            else:
                g = p * a - c0
            g = tl.where(cols == safe, g - c1 * w_y, g)
            if HAS_SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(g_ptr + cols, g.to(g_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _logits_tile_kernel(
        X, stride_x, G, stride_g, LABELS, SCALE, scale_stride, scale_value, CW,
        LOSS, LSE, LOGP, ENT, CORRECT, LSUM, SQ,
        V, ignore_index, logit_scale, inv_temp, softcap, eps, z_w,
        MODE_CE: tl.constexpr, WRITE_GRAD: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_CW: tl.constexpr, NEED_ENT: tl.constexpr,
        NEED_LSUM: tl.constexpr, NEED_SQ: tl.constexpr, BLOCK: tl.constexpr, VEC_SUMS: tl.constexpr,
        STAGES1: tl.constexpr, STAGES2: tl.constexpr, REVERSED: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_ptr = X + row * stride_x
        g_ptr = G + row * stride_g  # the gradient row: X itself (in place) or another buffer
        label = tl.load(LABELS + row).to(tl.int64)
        # out-of-range labels count as ignored: nothing is read out of bounds (callers raise on them)
        valid = (label != ignore_index) & (label >= 0) & (label < V)
        safe = tl.where(valid, label, 0)
        n_blocks = tl.cdiv(V, BLOCK)
        n_iter = tl.where(valid, n_blocks, 0)
        offs = tl.arange(0, BLOCK)

        # pass 1: online max / sum-exp with a scalar running max (one exp per element). The sums
        # are per-lane [BLOCK] vectors rescaled by the scalar factor and reduced once after the loop
        # (VEC_SUMS: one block-wide reduction per block, the max) or scalars reduced per block
        # (fewer live registers: what large blocks with many warps need to stay spill-free)
        m = -1e30
        # the maximum of the blocks wholly before the label's: a scalar per block, no per-element
        # work (a per-lane count of the columns reaching the label's logit compiled to 109 registers
        # against 51 at 2048 columns / 4 warps for sm_90: experiments/diag_registers.py)
        label_block = safe // BLOCK
        before = float("-inf")
        d = acc_zero(BLOCK, VEC_SUMS)
        e = acc_zero(BLOCK, VEC_SUMS)
        q = acc_zero(BLOCK, VEC_SUMS)
        s = acc_zero(BLOCK, VEC_SUMS)
        sw = acc_zero(BLOCK, VEC_SUMS)
        w_sum_acc = acc_zero(BLOCK, VEC_SUMS)
        for b in tl.range(0, n_iter, num_stages=STAGES1):  # STAGES1: loads in flight via smem
            cols = b * BLOCK + offs
            mask = cols < V
            x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            z, _t = _transform(x, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
            z = tl.where(mask, z, 0.0)
            zm = tl.where(mask, z, float("-inf"))
            bm = tl.max(zm, axis=0)
            m_new = tl.maximum(m, bm)
            before = tl.where(b < label_block, tl.maximum(before, bm), before)
            alpha = tl.exp(m - m_new)
            p = tl.exp(zm - m_new)
            d = d * alpha + keep_or_sum(p, VEC_SUMS)
            if NEED_ENT:
                e = e * alpha + keep_or_sum(p * z, VEC_SUMS)
            if NEED_SQ:  # sum of squared exponentials against the same running max
                q = q * (alpha * alpha) + keep_or_sum(p * p, VEC_SUMS)
            m = m_new
            if NEED_LSUM:
                s += keep_or_sum(z, VEC_SUMS)
            if HAS_CW:
                w = tl.load(CW + cols, mask=mask, other=0.0).to(tl.float32)
                sw += keep_or_sum(w * z, VEC_SUMS)
                w_sum_acc += keep_or_sum(w, VEC_SUMS)
        d = kept_total(d, VEC_SUMS)
        e_tot = 0.0
        if NEED_ENT:
            e_tot = kept_total(e, VEC_SUMS)
        s_tot = 0.0
        if NEED_LSUM:
            s_tot = kept_total(s, VEC_SUMS)
        d = tl.where(valid, d, 1.0)  # ignored rows: no NaN/inf on the way to the zero outputs
        lse = tl.where(valid, m + tl.log(d), 0.0)

        x_y = tl.load(x_ptr + safe).to(tl.float32)
        z_y, _ty = _transform(x_y, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
        # a hit is the first maximal column (torch.argmax, TRL's token accuracy): the label reaches
        # the maximum and every column before it -- the earlier blocks' and its own block's prefix,
        # read again (mostly from L2) -- stays below its logit (the prefix's maximum from its largest
        # logit, transformed once: a per-element transform spilled with a softcap under Triton 3.6)
        pre = max_transformed(x_ptr + label_block * BLOCK, safe - label_block * BLOCK, offs, logit_scale,
                              inv_temp, softcap, HAS_SOFTCAP, BLOCK)
        logp = z_y - lse
        if HAS_CW:
            w_y = tl.load(CW + safe).to(tl.float32)
            w_sum = kept_total(w_sum_acc, VEC_SUMS)
            sw_tot = kept_total(sw, VEC_SUMS)
        else:
            w_y = 1.0
            w_sum = V * 1.0
            sw_tot = s_tot  # NEED_LSUM is set whenever smoothing needs it
        if MODE_CE:
            loss = (1.0 - eps) * w_y * (-logp) + eps / V * (w_sum * lse - sw_tot) + z_w * lse * lse
        else:
            loss = logp
        tl.store(LOSS + row, tl.where(valid, loss, 0.0))
        tl.store(LSE + row, tl.where(valid, lse, 0.0))
        tl.store(LOGP + row, tl.where(valid, logp, 0.0))
        hit = valid & (z_y >= m) & (before < z_y) & (pre < z_y)
        tl.store(CORRECT + row, tl.where(hit, 1, 0).to(tl.int8))
        tl.store(LSUM + row, tl.where(valid, s_tot, 0.0))
        if NEED_ENT:
            ent = lse - e_tot / d
            tl.store(ENT + row, tl.where(valid, ent, 0.0))
        if NEED_SQ:  # sum_v p_v^2 = q / d^2
            q_tot = tl.where(valid, kept_total(q, VEC_SUMS), 1.0)
            tl.store(SQ + row, tl.where(valid, tl.log(q_tot) - 2.0 * tl.log(d), 0.0))

        # pass 2: gradient d loss / d x, times the row scale, in place
        if WRITE_GRAD:
            _gradient_pass(x_ptr, g_ptr, SCALE, row, scale_stride, scale_value, CW, valid, lse, safe, w_y, w_sum,
                           V, logit_scale, inv_temp, softcap, eps, z_w, n_blocks, offs,
                           MODE_CE, SCALE_PER_ROW, HAS_SOFTCAP, HAS_CW, BLOCK, STAGES2, REVERSED)

    # host launches go through launch.fast_kernel (the compiled launcher after a first launch)
    _logits_tile_kernel = fast_kernel(_logits_tile_kernel)


def torch_stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic (and statistics) dtype of the PyTorch paths: float64 for float64 logits (a
    float64 reference run stays float64 end to end), else float32 (the Triton kernels' registers)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def transform_logits_torch(x: Tensor, logit_scale, temperature, softcap):
    """``(z, t)`` of the Triton kernels' ``transform_logits`` in PyTorch (``t`` None without softcap),
    in :func:`torch_stats_dtype` (fp32; fp64 for fp64 logits)."""
    y = x.to(torch_stats_dtype(x.dtype)) * logit_scale
    t = None
    if softcap is not None:
        t = torch.tanh(y / softcap)
        y = softcap * t
    return y / temperature, t


def _logits_tile_torch(
    logits, labels, scale, ignore_index, logit_scale, temperature, softcap, eps, z_w,
    class_weight, mode_ce, grad, need_entropy, out=None, need_logits_sum=True, need_log_sum_sq=False,
) -> TileStats:
    n, V = logits.shape
    # out-of-range labels count as ignored, as in the Triton kernel (no out-of-bounds gather)
    valid = (labels != ignore_index) & (labels >= 0) & (labels < V)
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    z, t = transform_logits_torch(logits, logit_scale, temperature, softcap)
    lse = torch.logsumexp(z, dim=1)
    z_y = z.gather(1, safe[:, None]).squeeze(1)
    logp = z_y - lse
    s = z.sum(1)
    if class_weight is not None:
        w = class_weight.to(z.dtype)
        w_y = w[safe]
        w_sum = w.sum()
        sw = z @ w
    else:
        w = None
        w_y = torch.ones_like(lse)
        w_sum = float(V)
        sw = s
    if mode_ce:
        loss = (1.0 - eps) * w_y * (-logp) + eps / V * (w_sum * lse - sw) + z_w * lse * lse
    else:
        loss = logp
    zero = torch.zeros_like(lse)
    p = torch.exp(z - lse[:, None])
    entropy = None
    if need_entropy:
        entropy = torch.where(valid, lse - (p * z).sum(1), zero)
    # the first maximal index, as torch.argmax and TRL's accuracy; a label at -inf is never a hit (a row of
    # all -inf, whose argmax is 0, has a NaN loss; the kernel's maximum starts above -inf, so it agrees)
    correct = valid & (z.argmax(1) == safe) & (z_y > float("-inf"))
    log_sum_sq = None
    if need_log_sum_sq:  # log sum_v exp(2 (z_v - lse)), stable
        log_sum_sq = torch.where(valid, torch.logsumexp(2.0 * (z - lse[:, None]), dim=1), zero)
    stats = TileStats(
        torch.where(valid, loss, zero), torch.where(valid, lse, zero),
        torch.where(valid, logp, zero), entropy, correct,
        torch.where(valid, s, zero) if need_logits_sum else None, log_sum_sq,
    )
    if grad:
        onehot = torch.zeros_like(z).scatter_(1, safe[:, None], 1.0)
        if mode_ce:
            if w is not None:
                g = (1.0 - eps) * w_y[:, None] * (p - onehot) + eps / V * (w_sum * p - w[None, :])
            else:
                g = (1.0 - eps) * (p - onehot) + eps * (p - 1.0 / V)
            g = g + 2.0 * z_w * lse[:, None] * p
        else:
            g = onehot - p
        g = g * (logit_scale / temperature)
        if t is not None:
            g = g * (1.0 - t * t)
        scale = scale if isinstance(scale, Tensor) else torch.full_like(lse, float(scale))
        g = g * torch.where(valid, scale.to(z.dtype), zero)[:, None]
        (logits if out is None else out).copy_(g)
    return stats


@dataclass(frozen=True)
class LogitsTileTuning(Knobs):
    """Launch knobs of the logits-tile kernel (slot ``logits_tile``;
    ``benchmark/experiments/diag_tile_occupancy.py`` and ``benchmark/bench_kernels_ce.py --sweep``
    time them, ``benchmark/experiments/diag_registers.py`` counts their registers).

    ``block_cap``: columns per block of the row loops on the GPU (1024 in the interpreter).
    ``num_warps``: warps per program (0: 8 for blocks >= 4096, else 4).
    ``pass1_stages`` / ``pass2_stages``: software-pipelining depth of the pass-1 / pass-2 loops
    (``tl.range(num_stages=...)``: the next blocks' loads go to shared memory while a block is
    reduced, so more bytes are in flight per SM without more registers; None: Triton's default loop).
    H200, CE on 8192 x 128256 bf16 logits, forward + backward, one eager run (table "Cross-entropy
    tile kernel" in benchmark/results/README.md): 4096 / 8 warps unpipelined 2.37 ms (the former
    default), 4096 / 8 / 3 stages 2.24, 2048 / 4 / 3 stages 2.16, liger-kernel 2.11. Without
    pipelining, larger blocks (16384-32768, 16-32 warps, one row per SM like liger-kernel's kernel)
    were no faster (2.3-2.8 ms); a persistent grid was slower (2.9-6.3 ms).
    ``vec_sums_max_block``: blocks up to this size keep the pass-1 sums per lane (see the kernel),
    larger ones per block (fewer live registers: 32768 / 32 warps compiles to 64 registers for sm_90,
    with a 16-byte spill under triton 3.6 and 168 bytes under 3.9; 16384 / 32 warps spills nothing).
    ``pass2_reversed``: pass 2 walks the row from its last block back (pass 1 ended there: the row's
    tail may still be in L2). The gradient is elementwise, so the order changes no value.
    ``maxnreg``: register cap per thread (Triton's ``maxnreg``; None: the compiler's choice). Fewer
    programs per SM keep fewer rows in flight, so more of a row is still in L2 when pass 2 reads it
    again (``benchmark/experiments/diag_tile_occupancy.py`` sweeps it).
    """

    block_cap: int = knob(2048, minimum=1)
    num_warps: int = knob(0)
    pass1_stages: Optional[int] = knob(3, minimum=1, optional=True)
    pass2_stages: Optional[int] = knob(3, minimum=1, optional=True)
    vec_sums_max_block: int = knob(4096)
    pass2_reversed: bool = knob(True)
    maxnreg: Optional[int] = knob(None)


LOGITS_TILE_TUNING = register("logits_tile", LogitsTileTuning())


def _block_settings(V: int, knobs: LogitsTileTuning) -> tuple[int, int]:
    cap = 1024 if triton_interpret() else knobs.block_cap
    block = min(next_power_of_2(V), cap)
    warps = knobs.num_warps or (8 if block >= 4096 else 4)
    return block, warps


def check_ce_options(*, label_smoothing: float, z_loss_weight: float, softcap: Optional[float]) -> None:
    """Raise ``ValueError`` unless ``label_smoothing`` is in [0, 1], ``z_loss_weight`` >= 0 and
    ``softcap`` is ``None`` (no cap) or a finite number > 0 (the cross-entropy options shared with
    :mod:`cross_entropy`); ``softcap=inf`` is rejected: the cap's ``x / softcap`` then rounds every
    logit's gradient to 0 * inf = NaN instead of meaning "no cap"."""
    check_range("label_smoothing", float(label_smoothing), 0.0, 1.0)
    check_range("z_loss_weight", float(z_loss_weight), 0.0, None)
    if softcap is not None:
        check_range("softcap", float(softcap), 0.0, None, low_inclusive=False)
        if not math.isfinite(float(softcap)):
            raise ValueError(f"softcap must be a finite number > 0, or None for no cap, got {softcap!r}")


def logits_tile(
    logits: Tensor,
    labels: Tensor,
    *,
    mode: str = "ce",
    grad: bool = True,
    grad_scale: Union[float, Tensor] = 1.0,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    class_weight: Optional[Tensor] = None,
    need_entropy: bool = False,
    need_logits_sum: bool = True,
    need_log_sum_sq: bool = False,
    out: Optional[Tensor] = None,
    impl: str = "auto",
) -> TileStats:
    """Row statistics of ``logits [n, V]`` against ``labels [n]``; with ``grad=True`` the tile
    is overwritten by ``grad_scale * d loss / d logits`` (see the module docstring), or, when
    ``out`` is given (``[n, V]``, logits' dtype and device, unit column stride), ``out`` is
    written instead and the logits are left untouched.

    ``grad_scale`` is a float, a 1-element tensor (every row's scale, left on the device) or a
    ``[n]`` tensor (cast to float32). ``class_weight [V]`` only
    applies to ``mode="ce"``. ``need_logits_sum=False`` skips the ``logits_sum`` statistic (a
    running sum in the kernel's first pass) and returns it as ``None``; ``need_log_sum_sq=True`` adds
    ``log sum_v p_v^2`` (a running sum of squared exponentials beside the sum-exp). Returns
    :class:`TileStats`.
    """
    check_tensor("logits", logits, ndim=2, floating=True)
    check_tensor("labels", labels, ndim=1, floating=False)
    n, V = logits.shape
    if labels.shape[0] != n:
        raise ValueError(f"labels must have shape [{n}] (rows of logits), got {tuple(labels.shape)}")
    check_choice("mode", mode, MODES)
    check_range("logit_scale", float(logit_scale), 0.0, None, low_inclusive=False)
    check_range("temperature", float(temperature), 0.0, None, low_inclusive=False)
    check_ce_options(label_smoothing=label_smoothing, z_loss_weight=z_loss_weight, softcap=softcap)
    if class_weight is not None:
        check_tensor("class_weight", class_weight, ndim=1, floating=True)
        if class_weight.shape[0] != V:
            raise ValueError(f"class_weight must have shape [{V}], got {tuple(class_weight.shape)}")
    per_row = isinstance(grad_scale, Tensor)
    scale_stride = 1
    if per_row:
        check_tensor("grad_scale", grad_scale, floating=True)
        grad_scale, scale_stride = row_scales("grad_scale", grad_scale, n)
    check_same_device(logits=logits, labels=labels, class_weight=class_weight,
                      grad_scale=grad_scale if per_row else None)
    if out is not None:
        if not grad:
            raise ValueError("out is only written with grad=True")
        check_tensor("out", out, ndim=2, floating=True)
        if tuple(out.shape) != (n, V) or out.dtype != logits.dtype or out.stride(1) != 1:
            raise ValueError(
                f"out must be a [{n}, {V}] {logits.dtype} tensor with unit stride in the last dimension, "
                f"got shape {tuple(out.shape)}, dtype {out.dtype}, strides {tuple(out.stride())}"
            )
        check_same_device(logits=logits, out=out)
    elif grad and logits.stride(1) != 1:
        raise ValueError("logits must have unit stride in the last dimension to take the gradient in place")
    mode_ce = mode == "ce"
    eps = float(label_smoothing) if mode_ce else 0.0
    z_w = float(z_loss_weight) if mode_ce else 0.0
    cw = class_weight if mode_ce else None

    # label smoothing without class weights needs the row sum of z
    need_lsum = bool(need_logits_sum) or (mode_ce and eps > 0.0 and cw is None)

    if resolve_impl(impl, logits) == "torch" or n == 0:
        return _logits_tile_torch(
            logits, labels, grad_scale, ignore_index, float(logit_scale), float(temperature),
            None if softcap is None else float(softcap), eps, z_w, cw, mode_ce, grad, need_entropy,
            out, bool(need_logits_sum), bool(need_log_sum_sq),
        )

    x = logits if logits.stride(1) == 1 else logits.contiguous()
    lab = labels.contiguous()
    dev = logits.device
    # the per-row statistics share one allocation (host time: one allocator call, not six), and
    # the argmax hits are written as bytes straight into a bool tensor (no conversion launch);
    # under torch.compile into int8, converted after the launch: Inductor cannot lower a bool
    # tensor's dtype view (InductorError "torch.bool is not supported by torch.iinfo" on the H200)
    loss, lse, logp, lsum, ent, sq = torch.empty((6, n), dtype=torch.float32, device=dev).unbind(0)
    compiling = is_compiling()
    correct = torch.empty(n, dtype=torch.int8 if compiling else torch.bool, device=dev)
    hits = correct if compiling else correct.view(torch.int8)
    cw_arg = cw.float().contiguous() if cw is not None else loss
    scale_ptr = grad_scale if per_row else loss
    scale_value = 0.0 if per_row else float(grad_scale)
    knobs = LOGITS_TILE_TUNING.current
    block, warps = _block_settings(V, knobs)
    g = out if out is not None else x
    with device_ctx(x):  # Triton launches on the current GPU
        _logits_tile_kernel[(n,)](
            x, x.stride(0), g, g.stride(0), lab, scale_ptr, scale_stride, scale_value, cw_arg,
            loss, lse, logp, ent, hits, lsum, sq,
            V, int(ignore_index), float(logit_scale), 1.0 / float(temperature),
            float(softcap) if softcap is not None else 1.0, eps, z_w,
            MODE_CE=mode_ce, WRITE_GRAD=bool(grad), SCALE_PER_ROW=per_row,
            HAS_SOFTCAP=softcap is not None, HAS_CW=cw is not None, NEED_ENT=bool(need_entropy),
            NEED_LSUM=need_lsum, NEED_SQ=bool(need_log_sum_sq), BLOCK=block, VEC_SUMS=block <= knobs.vec_sums_max_block,
            STAGES1=knobs.pass1_stages, STAGES2=knobs.pass2_stages, REVERSED=knobs.pass2_reversed,
            num_warps=warps, **({} if knobs.maxnreg is None else {"maxnreg": knobs.maxnreg}),
        )
    return TileStats(loss, lse, logp, ent if need_entropy else None, correct.bool() if compiling else correct,
                     lsum if need_logits_sum else None, sq if need_log_sum_sq else None)
