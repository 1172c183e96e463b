"""One vocabulary block of an online softmax over a head's logits (layer 1).

The frozen-head path (:mod:`liger_losses.chunked.frozen_head`) computes ``d loss / d hidden`` as
``sum_v g_v W_v`` one vocabulary block at a time, so no ``[n, V]`` tile is ever held. Per block of
logits ``x [n, Vb]`` (bf16 / fp16 / fp32, unit column stride; columns ``[v0, v0 + Vb)`` of the
vocabulary) and a running per-row :class:`OnlineState`, :func:`online_block`:

* transforms ``z`` as :mod:`~liger_losses.kernels.logits_tile` does (``logit_scale``, ``softcap``,
  ``temperature``) and ``dz/dx = logit_scale / T * (1 - tanh^2)``;
* updates the state (float32 ``[n]`` each): ``ref``, the exponent's reference: raised to the block's
  maximum only when that exceeds it by more than ``TAU`` (so ``exp(z - ref) <= e^TAU``, and most
  blocks move no reference); ``sumexp = sum exp(z - ref)``; ``zexp = sum exp(z - ref) z`` (the
  entropy's); ``zsum = sum z`` (label smoothing's); ``zmax = max z`` and ``zpre``, the maximum
  of the columns before the label (argmax hits, first index as ``torch.argmax``: the label is the
  first maximal column when ``z_y >= zmax`` and ``zpre < z_y``); ``z_y``/``d_y``,
  the label's ``z`` and ``dz/dx`` once its block is seen (labels outside the block are left alone;
  ``ignore_index`` or out-of-range labels are never seen);
* overwrites ``x`` by ``exp(z - ref) * dz/dx`` in its own dtype (``sum_v x_v W_v`` is then the
  unnormalized softmax-weighted row sum);
* multiplies row ``r`` of ``acc [n, H]`` (fp32; fp64 in a float64 run; unit column stride) by ``exp(ref_old - ref_new)``
  where the reference moved (``first=True``: no ``acc`` yet, nothing rescaled; a row whose reference
  stayed is not touched, so usually no ``acc`` byte moves).

``first=True`` starts the state: its old values are never read, so it may be uninitialized
(:meth:`OnlineState.uninitialized`).

Triton: one program per row, two passes over its block (the maximum, then the exponentials; the
second mostly from L2). A single pass against the running reference, rescaling the steps a row
has written when its maximum passes it, measured no faster (``benchmark/experiments/
diag_online_block.py``). ``impl="torch"`` (or no Triton on the device, or a float64 state): the
same in PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.logits_tile import transform_logits_torch
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import device_ctx, import_triton, next_power_of_2, resolve_impl, triton_interpret

# How far the exponent's reference may lag a row's maximum. e^16 ~ 8.9e6: exp(z - ref) stays far
# inside bf16's and fp32's range, and a sum over 2^20 columns stays below 1e13 (fp32-exact enough:
# it is a sum of positives).
TAU = 16.0


@dataclass(frozen=True)
class OnlineBlockTuning(Knobs):
    """Launch knobs of the block kernel (slot ``online_block``; ``benchmark/experiments/
    diag_frozen_head.py`` times them): ``block_cap`` columns per step of a row's loops (1024 in the
    interpreter), ``num_warps`` per program (one program per row)."""

    block_cap: int = knob(2048, minimum=1)
    num_warps: int = knob(4, minimum=1)


ONLINE_BLOCK_TUNING = register("online_block", OnlineBlockTuning())


@dataclass
class OnlineState:
    """The running per-row statistics of :func:`online_block` (float32 ``[n]`` each)."""

    ref: Tensor
    sumexp: Tensor
    zexp: Tensor
    zsum: Tensor
    zmax: Tensor
    z_y: Tensor
    d_y: Tensor
    zpre: Tensor

    @classmethod
    def empty(cls, n: int, device, dtype: torch.dtype = torch.float32) -> "OnlineState":
        """A fresh state of ``n`` rows (``dtype``: float32, or float64 for a float64 run's PyTorch path)."""
        buf = torch.zeros((8, n), dtype=dtype, device=device)
        buf[0].fill_(float("-inf"))
        buf[4].fill_(float("-inf"))
        buf[7].fill_(float("-inf"))
        return cls(*buf.unbind(0))

    @classmethod
    def uninitialized(cls, n: int, device, dtype: torch.dtype = torch.float32) -> "OnlineState":
        """A state of ``n`` rows to be started by a ``first=True`` block (no memory pass)."""
        return cls(*torch.empty((8, n), dtype=dtype, device=device).unbind(0))

    def rows(self, n: int) -> "OnlineState":
        """The first ``n`` rows (views)."""
        return OnlineState(*(getattr(self, f.name)[:n] for f in fields(self)))


triton, tl = import_triton()

if triton is not None:
    from liger_losses.kernels.utils import max_transformed
    from liger_losses.kernels.utils import transform_logits as _transform

    @triton.jit
    def _online_block_kernel(x_ptr, stride_x, lab_ptr, v0, Vb, ref_ptr, se_ptr, ze_ptr, zs_ptr, zm_ptr,
                             zy_ptr, dy_ptr, zp_ptr, acc_ptr, stride_acc, H, logit_scale, inv_temp, softcap, tau,
                             FIRST: tl.constexpr, HAS_SOFTCAP: tl.constexpr, NEED_ZEXP: tl.constexpr,
                             NEED_ZSUM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        offs = tl.arange(0, BLOCK)
        block_max = max_transformed(x_row, Vb, offs, logit_scale, inv_temp, softcap, HAS_SOFTCAP, BLOCK)
        # the label's z and dz/dx, when it falls in this block
        local = tl.load(lab_ptr + row).to(tl.int64) - v0
        here = (local >= 0) & (local < Vb)
        x_y = tl.load(x_row + tl.where(here, local, 0), mask=here, other=0.0).to(tl.float32)
        z_y, t_y = _transform(x_y, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
        d_y = logit_scale * inv_temp * (1.0 - t_y * t_y)
        # the maximum of this block's columns before the label: all of them for a block wholly before
        # it, none after it, and in the label's block its prefix read again (from L2; only the rows
        # whose label is here: no per-element work for the others -- tracking the first argmax column
        # per lane cost 16% of the kernel, benchmark/experiments/diag_argmax_ties.py)
        pre = tl.where(local >= Vb, block_max, float("-inf"))
        if here:
            pre = max_transformed(x_row, local.to(tl.int32), offs, logit_scale, inv_temp, softcap, HAS_SOFTCAP, BLOCK)
        tl.debug_barrier()  # every warp has read the label's logit before any overwrites the row below
        if FIRST:  # the state starts here: its old values are never read (it may be uninitialized)
            ref_old = block_max
            ref = block_max
            zm_old = block_max
            zp_old = pre
            zy_old = 0.0
            dy_old = 0.0
        else:
            ref_old = tl.load(ref_ptr + row)
            ref = tl.where(block_max > ref_old + tau, block_max, ref_old)
            zm_old = tl.load(zm_ptr + row)
            zp_old = tl.load(zp_ptr + row)
            zy_old = tl.load(zy_ptr + row)
            dy_old = tl.load(dy_ptr + row)
        tl.store(zm_ptr + row, tl.maximum(zm_old, block_max))
        tl.store(zp_ptr + row, tl.maximum(zp_old, pre))
        tl.store(zy_ptr + row, tl.where(here, z_y, zy_old))
        tl.store(dy_ptr + row, tl.where(here, d_y, dy_old))
        se = tl.zeros((BLOCK,), tl.float32)
        ze = tl.zeros((BLOCK,), tl.float32)
        zs = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, Vb, BLOCK):
            cols = start + offs
            mask = cols < Vb
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            z, t = _transform(x, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
            e = tl.where(mask, tl.exp(z - ref), 0.0)
            se += e
            if NEED_ZEXP:
                ze += e * tl.where(mask, z, 0.0)
            if NEED_ZSUM:
                zs += tl.where(mask, z, 0.0)
            g = e * (logit_scale * inv_temp) * (1.0 - t * t)
            tl.store(x_row + cols, g.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(ref_ptr + row, ref)
        if FIRST:
            tl.store(se_ptr + row, tl.sum(se, axis=0))
            tl.store(ze_ptr + row, tl.sum(ze, axis=0))
            tl.store(zs_ptr + row, tl.sum(zs, axis=0))
        else:
            alpha = tl.exp(ref_old - ref)
            tl.store(se_ptr + row, tl.load(se_ptr + row) * alpha + tl.sum(se, axis=0))
            if NEED_ZEXP:
                tl.store(ze_ptr + row, tl.load(ze_ptr + row) * alpha + tl.sum(ze, axis=0))
            if NEED_ZSUM:
                tl.store(zs_ptr + row, tl.load(zs_ptr + row) + tl.sum(zs, axis=0))
            if ref != ref_old:  # the accumulated row follows its reference
                a_row = acc_ptr + row * stride_acc
                offs_h = tl.arange(0, BLOCK_H)
                for hs in range(0, H, BLOCK_H):
                    hc = hs + offs_h
                    a = tl.load(a_row + hc, mask=hc < H, other=0.0)
                    tl.store(a_row + hc, a * alpha, mask=hc < H)

    _online_block_kernel = fast_kernel(_online_block_kernel)


def _online_block_torch(x, labels, v0, state, acc, first, logit_scale, inv_temp, softcap, need_zexp, need_zsum):
    n, Vb = x.shape
    z, t = transform_logits_torch(x, logit_scale, 1.0 / inv_temp, softcap)
    block_max = z.max(1).values
    if first:  # the state's old values are never read (the Triton kernel's contract)
        for field in (state.sumexp, state.zexp, state.zsum, state.z_y, state.d_y):
            field.zero_()
        state.ref.fill_(float("-inf"))
        state.zmax.fill_(float("-inf"))
        state.zpre.fill_(float("-inf"))
    ref_old = state.ref.clone()
    ref = torch.where(block_max > ref_old + TAU, block_max, ref_old)
    state.zmax.copy_(torch.maximum(state.zmax, block_max))
    local = labels.long() - v0
    before = torch.arange(Vb, device=z.device)[None, :] < local[:, None]  # the columns before the label
    state.zpre.copy_(torch.maximum(state.zpre, torch.where(before, z, float("-inf")).max(1).values))
    here = (local >= 0) & (local < Vb)
    idx = torch.where(here, local, torch.zeros_like(local)).unsqueeze(1)
    z_y = z.gather(1, idx).squeeze(1)
    d = torch.full_like(z, logit_scale * inv_temp) if t is None else logit_scale * inv_temp * (1.0 - t * t)
    state.z_y.copy_(torch.where(here, z_y, state.z_y))
    state.d_y.copy_(torch.where(here, d.gather(1, idx).squeeze(1), state.d_y))
    e = torch.exp(z - ref[:, None])
    alpha = torch.zeros_like(ref) if first else torch.exp(ref_old - ref)
    state.sumexp.copy_(state.sumexp * alpha + e.sum(1))
    if need_zexp:
        state.zexp.copy_(state.zexp * alpha + (e * z).sum(1))
    if need_zsum:
        state.zsum.add_(z.sum(1))
    state.ref.copy_(ref)
    x.copy_(e * d)
    if not first:
        moved = ref != ref_old
        acc.copy_(torch.where(moved[:, None], acc * alpha[:, None], acc))


def online_block(x: Tensor, labels: Tensor, v0: int, state: OnlineState, acc: Optional[Tensor], *,
                 first: bool, logit_scale: float = 1.0, temperature: float = 1.0,
                 softcap: Optional[float] = None, need_zexp: bool = False, need_zsum: bool = False,
                 impl: str = "auto") -> None:
    """One vocabulary block (columns ``[v0, v0 + Vb)``) of the online softmax, in place (see the
    module docstring): ``x [n, Vb]``, ``labels [n]`` (vocabulary ids), ``state`` (``[n]`` rows),
    ``acc [n, H]`` fp32 (None only with ``first=True``)."""
    n, Vb = x.shape
    if labels.shape != (n,) or x.stride(1) != 1:
        raise ValueError(f"x must be [n, Vb] with unit column stride and labels [n]; got x {tuple(x.shape)} "
                         f"strides {tuple(x.stride())}, labels {tuple(labels.shape)}")
    if not first and (acc is None or acc.shape[0] != n or acc.dtype not in (torch.float32, torch.float64)
                      or acc.stride(1) != 1):
        raise ValueError("acc must be an [n, H] float32 (float64) tensor with unit column stride after the first block")
    inv_temp = 1.0 / float(temperature)
    if n == 0:
        return
    if resolve_impl(impl, x) == "torch" or state.ref.dtype != torch.float32:  # the kernel's registers are fp32
        _online_block_torch(x, labels, int(v0), state, acc, first, float(logit_scale), inv_temp,
                            None if softcap is None else float(softcap), need_zexp, need_zsum)
        return
    knobs = ONLINE_BLOCK_TUNING.current
    cap = min(knobs.block_cap, 1024) if triton_interpret() else knobs.block_cap
    block = min(next_power_of_2(Vb), cap)
    H = acc.shape[1] if acc is not None else 1
    acc_arg = acc if acc is not None else state.ref
    with device_ctx(x):
        _online_block_kernel[(n,)](
            x, x.stride(0), labels, int(v0), Vb, state.ref, state.sumexp, state.zexp, state.zsum, state.zmax,
            state.z_y, state.d_y, state.zpre, acc_arg, acc_arg.stride(0) if acc is not None else 0, H,
            float(logit_scale), inv_temp, float(softcap) if softcap is not None else 1.0, TAU,
            FIRST=bool(first), HAS_SOFTCAP=softcap is not None, NEED_ZEXP=bool(need_zexp),
            NEED_ZSUM=bool(need_zsum), BLOCK=block, BLOCK_H=min(next_power_of_2(H), 1024), num_warps=knobs.num_warps,
        )
