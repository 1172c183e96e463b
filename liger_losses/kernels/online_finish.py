"""The end of an online softmax over a head's vocabulary (layer 1): a token chunk's statistics and
hidden gradient, in one launch.

After the last vocabulary block of :func:`~liger_losses.kernels.online_block.online_block`, row
``r`` of a chunk of ``n`` tokens holds its :class:`~liger_losses.kernels.online_block.OnlineState`
(``ref``, ``sumexp``, ``zexp``, ``zsum``, ``zmax``, ``z_y``, ``d_y``, ``zpre``; float32 ``[n]``) and
``acc [n, H]`` (float32) ``= sum_v exp(z_v - ref) d_v W_v``. :func:`online_finish` turns them into

* the row statistics, written into float32 ``[n]`` outputs: ``lse = ref + log(sumexp)``,
  ``logp = z_y - lse``, ``loss`` (``mode`` "ce": ``(1 - eps) (-logp) + z_w lse^2 (+ eps (lse -
  zsum / V))``; "logp": ``logp``), ``entropy = lse - zexp / sumexp`` (``need_entropy``) and the
  argmax hit ``z_y >= zmax and zpre < z_y`` (bool ``[n]``: the label is the first maximal column, as
  ``torch.argmax`` counts it);
* the hidden gradient row, in ``out``'s dtype, with ``s`` the row's upstream scale::

      ce:    s * ((1 + 2 z_w lse) / sumexp * acc - (1 - eps) d_y W_y - eps d * mean_v W_v)
      logp:  s * (d_y W_y - acc / sumexp)

  (``d`` = ``logit_scale / T``, the constant ``dz/dx`` of a head without softcap: label smoothing
  is served only there), written at row ``r`` of ``out [n, H]`` or, given ``out_rows [n]``, at
  row ``out_rows[r]`` of ``out [M, H]`` (the compacted tokens' positions: no ``[n, H]`` buffer and
  no scatter launch).

Why one kernel: the same in PyTorch is about twenty small launches per chunk; at 8192 x 4096 x
128256 (16 chunks) their host time left the GPU idle between chunks
(``benchmark/experiments/diag_frozen_head.py``; results in ``benchmark/NOTES.md``).

Triton: one program per row (the scalars, then ``H`` in column blocks). ``impl="torch"`` (or no
Triton on the device, or float64 statistics): the same in PyTorch, in the state's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.online_block import OnlineState
from liger_losses.kernels.utils import (
    device_ctx,
    import_triton,
    next_power_of_2,
    resolve_impl,
    row_scales,
    triton_interpret,
)

MODES = ("ce", "logp")

triton, tl = import_triton()

if triton is not None:

    @triton.jit
    def _online_finish_kernel(ref_ptr, se_ptr, ze_ptr, zs_ptr, zm_ptr, zy_ptr, dy_ptr, zp_ptr, acc_ptr, stride_acc,
                              w_ptr, stride_w, lab_ptr, wmean_ptr, scale_ptr, scale_stride, scale_value,
                              out_ptr, stride_out, rows_ptr, loss_ptr, lse_ptr, logp_ptr, hit_ptr, ent_ptr,
                              H, inv_V, eps, z_w, dz_dx,
                              MODE_CE: tl.constexpr, HAS_EPS: tl.constexpr, NEED_ENTROPY: tl.constexpr,
                              SCALE_PTR: tl.constexpr, SCATTER: tl.constexpr, BLOCK_H: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        se = tl.load(se_ptr + row)
        lse = tl.load(ref_ptr + row) + tl.log(se)
        z_y = tl.load(zy_ptr + row)
        d_y = tl.load(dy_ptr + row)
        logp = z_y - lse
        if SCALE_PTR:
            s = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
        else:
            s = scale_value
        if MODE_CE:
            loss = (1.0 - eps) * (-logp) + z_w * lse * lse
            if HAS_EPS:
                loss += eps * (lse - tl.load(zs_ptr + row) * inv_V)
            coef_p = s * (1.0 + 2.0 * z_w * lse) / se
            coef_y = s * (1.0 - eps) * d_y
        else:
            loss = logp
            coef_p = -s / se
            coef_y = -s * d_y
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, logp)
        hit = (z_y >= tl.load(zm_ptr + row)) & (tl.load(zp_ptr + row) < z_y)
        tl.store(hit_ptr + row, tl.where(hit, 1, 0).to(tl.int8))
        if NEED_ENTROPY:
            tl.store(ent_ptr + row, lse - tl.load(ze_ptr + row) / se)
        if SCATTER:
            out_row = out_ptr + tl.load(rows_ptr + row).to(tl.int64) * stride_out
        else:
            out_row = out_ptr + row * stride_out
        a_row = acc_ptr + row * stride_acc
        w_row = w_ptr + tl.load(lab_ptr + row).to(tl.int64) * stride_w
        offs = tl.arange(0, BLOCK_H)
        for hs in range(0, H, BLOCK_H):
            hc = hs + offs
            mask = hc < H
            g = coef_p * tl.load(a_row + hc, mask=mask, other=0.0) \
                - coef_y * tl.load(w_row + hc, mask=mask, other=0.0).to(tl.float32)
            if HAS_EPS:
                g -= (s * eps * dz_dx) * tl.load(wmean_ptr + hc, mask=mask, other=0.0)
            tl.store(out_row + hc, g.to(out_ptr.dtype.element_ty), mask=mask)

    _online_finish_kernel = fast_kernel(_online_finish_kernel)


def _online_finish_torch(state, acc, weight, labels, scale, out, out_rows, stats, mode, eps, z_w, dz_dx,
                         w_mean, need_entropy):
    s = scale if isinstance(scale, Tensor) else torch.tensor(float(scale), device=acc.device)
    s = s.to(state.ref.dtype).reshape(-1)  # [n] or [1], in the state's dtype (float64 runs stay float64)
    lse = state.ref + torch.log(state.sumexp)
    logp = state.z_y - lse
    if mode == "ce":
        loss = (1.0 - eps) * (-logp) + z_w * lse * lse
        if eps > 0.0:
            loss = loss + eps * (lse - state.zsum / weight.shape[0])
        coef_p, coef_y = s * (1.0 + 2.0 * z_w * lse) / state.sumexp, s * (1.0 - eps) * state.d_y
    else:
        loss, coef_p, coef_y = logp, -s / state.sumexp, -s * state.d_y
    g = acc * coef_p.unsqueeze(1) - weight.index_select(0, labels).to(acc.dtype) * coef_y.unsqueeze(1)
    if eps > 0.0:
        g = g - w_mean.to(acc.dtype).unsqueeze(0) * (s * eps * dz_dx).unsqueeze(1)
    if out_rows is None:
        out.copy_(g)
    else:
        out.index_copy_(0, out_rows, g.to(out.dtype))
    stats["loss"].copy_(loss)
    stats["lse"].copy_(lse)
    stats["logp"].copy_(logp)
    stats["correct"].copy_((state.z_y >= state.zmax) & (state.zpre < state.z_y))
    if need_entropy:
        stats["entropy"].copy_(lse - state.zexp / state.sumexp)


def online_finish(state: OnlineState, acc: Tensor, weight: Tensor, labels: Tensor, *, mode: str, scale,
                  out: Tensor, out_rows: Optional[Tensor], stats: dict, label_smoothing: float = 0.0,
                  z_loss_weight: float = 0.0, dz_dx: float = 1.0, w_mean: Optional[Tensor] = None,
                  impl: str = "auto") -> None:
    """The statistics and hidden gradient of a chunk's ``n`` rows (see the module docstring).

    ``state`` (``[n]`` rows, after the last block), ``acc [n, H]`` (float32; float64 in a float64
    run; unit column stride), ``weight [V, H]``, ``labels [n]`` (in ``[0, V)``), ``scale`` (a float, a
    one-entry tensor or an ``[n]`` tensor: the rows' upstream scales), ``out`` (``[n, H]``, or
    ``[M, H]`` with ``out_rows [n]`` int64 positions), ``stats``: the outputs ``loss``, ``lse``,
    ``logp`` (``[n]`` in the state's dtype), ``correct`` (bool ``[n]``) and, when present,
    ``entropy``. ``label_smoothing`` (``mode`` "ce" only) needs ``w_mean [H]`` (the weight's row
    mean, float32) and ``dz_dx``, the head's constant ``dz/dx``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    n, H = acc.shape
    eps = float(label_smoothing) if mode == "ce" else 0.0
    if labels.shape != (n,) or weight.shape[1] != H or out.shape[1] != H:
        raise ValueError(f"acc must be [n, H] with labels [n], weight [V, H] and out [*, H]; got acc "
                         f"{tuple(acc.shape)}, labels {tuple(labels.shape)}, weight {tuple(weight.shape)}, "
                         f"out {tuple(out.shape)}")
    if out_rows is None and out.shape[0] != n:
        raise ValueError(f"out must have n={n} rows without out_rows; got {tuple(out.shape)}")
    if out_rows is not None and out_rows.shape != (n,):
        raise ValueError(f"out_rows must be [n] with n={n}; got {tuple(out_rows.shape)}")
    if eps > 0.0 and w_mean is None:
        raise ValueError("label_smoothing > 0 needs w_mean, the weight's row mean [H]")
    per_row = isinstance(scale, Tensor)
    scale_t, scale_stride = row_scales("scale", scale, n) if per_row else (state.ref, 0)
    if n == 0:
        return
    need_entropy = "entropy" in stats
    use_torch = (resolve_impl(impl, acc) == "torch" or state.ref.dtype != torch.float32
                 or acc.stride(1) != 1 or out.stride(1) != 1 or weight.stride(1) != 1)
    if use_torch:
        _online_finish_torch(state, acc, weight, labels, scale, out, out_rows, stats, mode, eps,
                             float(z_loss_weight), float(dz_dx), w_mean, need_entropy)
        return
    hits = stats["correct"].view(torch.int8)
    ent = stats.get("entropy", stats["lse"])
    wmean = w_mean if w_mean is not None else state.ref
    with device_ctx(acc):
        _online_finish_kernel[(n,)](
            state.ref, state.sumexp, state.zexp, state.zsum, state.zmax, state.z_y, state.d_y, state.zpre, acc,
            acc.stride(0),
            weight, weight.stride(0), labels, wmean, scale_t, scale_stride,
            0.0 if per_row else float(scale), out, out.stride(0), out_rows if out_rows is not None else labels,
            stats["loss"], stats["lse"], stats["logp"], hits, ent, H, 1.0 / weight.shape[0], eps,
            float(z_loss_weight), float(dz_dx),
            MODE_CE=mode == "ce", HAS_EPS=eps > 0.0, NEED_ENTROPY=need_entropy, SCALE_PTR=per_row,
            SCATTER=out_rows is not None, BLOCK_H=min(next_power_of_2(H), 256 if triton_interpret() else 1024),
            num_warps=4,
        )
