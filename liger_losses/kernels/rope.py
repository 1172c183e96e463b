"""Rotary position embedding (Hugging Face "rotate-half" layout) for queries and keys, in one launch.

    q_embed = q * cos + rotate_half(q) * sin,   rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

and the same for k, exactly as transformers' llama ``apply_rotary_pos_emb``. Shapes:

* ``unsqueeze_dim=1``: q ``[B, Hq, T, D]``, k ``[B, Hk, T, D]`` (``Hq != Hk`` for GQA);
  ``unsqueeze_dim=2``: q ``[B, T, Hq, D]``, k ``[B, T, Hk, D]``.
* cos, sin ``[B or 1, T, R]`` (position ids already applied by the rotary module; batch 1
  broadcasts). ``R <= D`` and even: when ``R < D`` only the first ``R`` dims of each head rotate
  and the rest pass through (Phi-3 "partial rotary"). A 2-D table ``[S, R]`` plus ``position_ids``
  ``[B or 1, T]`` is accepted too and gathered as ``cos[position_ids]``.

q and k may be non-contiguous (HF makes them by ``.view(B, T, H, D).transpose(1, 2)``): the kernel
takes their strides, so nothing is copied; only the last dim must have unit stride. Dtypes: q and k
any float dtype (the same one); cos/sin any float dtype; math in fp32, outputs in q's dtype.

``inplace=True`` rotates q and k in their own memory (forward allocates nothing; backward
allocates the gradients in q's/k's layouts). One Triton program per token (b, t) loads that token's cos/sin once and
rotates all of its q and k heads. Backward is the transposed map (the inverse rotation, ``sin -> -sin``):

    dx[:R/2] = g[:R/2] * cos[:R/2] + g[R/2:] * sin[R/2:]
    dx[R/2:] = g[R/2:] * cos[R/2:] - g[:R/2] * sin[:R/2]

No gradient flows to cos/sin in the Triton path; with ``impl="auto"`` a cos/sin that requires grad
selects the PyTorch path instead (which differentiates them), ``impl="triton"`` raises.

Public API:
    apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, inplace=False,
                         inplace_backward=False, repeated_tables=False, impl="auto") -> (q_embed, k_embed)
    liger_rotary_pos_emb = apply_rotary_pos_emb
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.layouts import carrier_of, empty_like_layout, overlaps, rebuild
from liger_losses.kernels.pdl import launch_options, pdl_launch
from liger_losses.kernels.rope_checks import check_flags, check_inputs
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import (
    CheckedSignatures,
    check_no_double_backward,
    device_ctx,
    import_triton,
    layout_signature,
    next_power_of_2,
    records_autograd,
    resolve_impl,
    triton_fallback,
)

triton, tl = import_triton()
if triton is not None:
    from liger_losses.kernels.pdl import pdl_prologue


@dataclass(frozen=True)
class RoPETuning(Knobs):
    """Launch knobs of the RoPE kernel (slot ``rope``; ``benchmark/bench_rope.py --sweep`` and
    ``benchmark/experiments/diag_rope.py`` sweep them). H200, CUDA-graph GPU time, forward +
    backward.

    ``tile_elements``: elements of one [heads, R/2] tile per tensor (x1, x2, out1, out2 each) in the
    tiled order. Llama-3-8B shapes, out of place: 1024-element tiles with 4 warps 0.099 ms at 8192
    tokens (1.23x the HBM floor) and 0.362 at 32768 (1.13x); 2048 with 8 warps (the former
    default) 0.114 / 0.421; 16 warps 1.6-1.9x.
    ``num_warps``: warps per program (0: from the tile, see below).
    ``loads_first``: one tile holds all heads of a token (``tile_elements`` ignored) and the kernel
    issues the loads of q's and k's halves before any store -- liger-kernel's order, which the
    compiler cannot reach by itself (a store to q may alias k). q-layout gradients: 8B shapes
    0.0868 ms at 8192 tokens (liger-kernel 0.0868; tiled order 0.0929) and 0.3359 at 32768 (liger
    0.3379; tiled 0.3398); Qwen2-0.5B 8192 tokens 0.0239 (liger 0.0166, tiled 0.0273). 8 warps: 10%
    slower. False: the tiled order.
    ``small_tile_elems``: with ``loads_first`` and ``num_warps=0``, 2 warps below this many q
    elements per half (a Qwen2-0.5B token: 14 -> 16 heads x 32), else 4, and 8 from 4096.
    Qwen2-0.5B 8192 tokens 0.0192 ms with 2 warps against 0.0244 with 4 (liger-kernel 0.0170; in
    place with the gradient rotated in its buffer 0.0179); 8B shapes: 2 warps 17% slower than 4.
    Several tokens per program (2-8, as [tokens, heads, R/2] tiles) were slower at every shape and
    warp count (Qwen2-0.5B best 0.0219, 8B 0.092-0.123 vs 0.088) and were dropped.
    """

    tile_elements: int = knob(1024, minimum=1)
    num_warps: int = knob(0)
    loads_first: bool = knob(True)
    small_tile_elems: int = knob(1024, minimum=1)


ROPE_TUNING = register("rope", RoPETuning())


if triton is not None:

    @triton.jit
    def _rotate_heads(
        x_ptr, o_ptr, x_base, o_base, n_heads, x_sh, o_sh,
        c1, c2, s1, s2, d, d_mask,
        HALF: tl.constexpr, PASS: tl.constexpr, PASS_BLOCK: tl.constexpr,
        BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr,
    ):
        """Rotate (or, for BACKWARD, rotate back) all heads of one token of one tensor."""
        for h0 in range(0, n_heads, BLOCK_H):
            h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
            x1, x2, mask = _load_halves(x_ptr, x_base, h, n_heads, x_sh, d, d_mask, HALF)
            y1, y2 = _rotate_pair(x1, x2, c1, c2, s1, s2, BACKWARD)
            _store_halves(o_ptr, o_base, h, o_sh, d, mask, y1, y2, HALF)
            _copy_pass(x_ptr, o_ptr, x_base, o_base, h, n_heads, x_sh, o_sh, HALF, PASS, PASS_BLOCK)

    @triton.jit
    def _load_halves(x_ptr, x_base, h, n_heads, x_sh, d, d_mask, HALF: tl.constexpr):
        """(x1, x2, mask): the two rotated halves of heads ``h`` of one token, fp32 ``[heads, R/2]``."""
        mask = (h < n_heads)[:, None] & d_mask[None, :]
        xp = x_ptr + x_base + h[:, None] * x_sh + d[None, :]
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
        return x1, x2, mask

    @triton.jit
    def _store_halves(o_ptr, o_base, h, o_sh, d, mask, y1, y2, HALF: tl.constexpr):
        """Store the two halves of heads ``h`` of one token in ``o_ptr``'s dtype."""
        op = o_ptr + o_base + h[:, None] * o_sh + d[None, :]
        tl.store(op, y1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(op + HALF, y2.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _copy_pass(x_ptr, o_ptr, x_base, o_base, h, n_heads, x_sh, o_sh,
                   HALF: tl.constexpr, PASS: tl.constexpr, PASS_BLOCK: tl.constexpr):
        """Partial rotary: copy dims [2*HALF, D) of heads ``h`` unchanged (nothing when PASS is 0)."""
        if PASS > 0:
            p = tl.arange(0, PASS_BLOCK)
            pmask = (h < n_heads)[:, None] & (p < PASS)[None, :]
            xpp = x_ptr + x_base + h[:, None] * x_sh + 2 * HALF + p[None, :]
            opp = o_ptr + o_base + h[:, None] * o_sh + 2 * HALF + p[None, :]
            tl.store(opp, tl.load(xpp, mask=pmask, other=0.0).to(o_ptr.dtype.element_ty), mask=pmask)

    @triton.jit
    def _rotate_pair(x1, x2, c1, c2, s1, s2, BACKWARD: tl.constexpr):
        """(y1, y2): the two rotated halves (BACKWARD: the transposed rotation)."""
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        return y1, y2

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
        T, n_qh, n_kh,
        q_sb, q_st, q_sh, k_sb, k_st, k_sh,
        qo_sb, qo_st, qo_sh, ko_sb, ko_st, ko_sh,
        c_sb, c_st, s_sb, s_st,
        HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
        PASS: tl.constexpr, PASS_BLOCK: tl.constexpr,
        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BACKWARD: tl.constexpr,
        LOADS_FIRST: tl.constexpr, REPEAT_TABLES: tl.constexpr, HEAD_STRIDE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per token: load its cos/sin once, rotate its q heads and its k heads
        (LOADS_FIRST: all heads in one tile, q's and k's loads issued before any store)."""
        pdl_prologue(PDL)  # PDL launch: wait for the previous kernel before any memory access
        if HEAD_STRIDE != 0:  # q, k and the outputs share this head stride: offsets fold into the code
            q_sh = HEAD_STRIDE
            k_sh = HEAD_STRIDE
            qo_sh = HEAD_STRIDE
            ko_sh = HEAD_STRIDE
        pid = tl.program_id(0).to(tl.int64)
        b = pid // T
        t = pid % T
        d = tl.arange(0, HALF_BLOCK)
        d_mask = d < HALF
        cp = cos_ptr + b * c_sb + t * c_st + d
        sp = sin_ptr + b * s_sb + t * s_st + d
        c1 = tl.load(cp, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sp, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        if REPEAT_TABLES:  # the first half of each table row serves both halves (repeated_tables)
            c2 = c1
            s2 = s1
        else:
            c2 = tl.load(cp + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
            s2 = tl.load(sp + HALF, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        q_base, qo_base = b * q_sb + t * q_st, b * qo_sb + t * qo_st
        k_base, ko_base = b * k_sb + t * k_st, b * ko_sb + t * ko_st
        if LOADS_FIRST:
            hq = tl.arange(0, BLOCK_HQ).to(tl.int64)
            hk = tl.arange(0, BLOCK_HK).to(tl.int64)
            q1, q2, mq = _load_halves(q_ptr, q_base, hq, n_qh, q_sh, d, d_mask, HALF)
            k1, k2, mk = _load_halves(k_ptr, k_base, hk, n_kh, k_sh, d, d_mask, HALF)
            yq1, yq2 = _rotate_pair(q1, q2, c1, c2, s1, s2, BACKWARD)
            yk1, yk2 = _rotate_pair(k1, k2, c1, c2, s1, s2, BACKWARD)
            _store_halves(qo_ptr, qo_base, hq, qo_sh, d, mq, yq1, yq2, HALF)
            _store_halves(ko_ptr, ko_base, hk, ko_sh, d, mk, yk1, yk2, HALF)
            _copy_pass(q_ptr, qo_ptr, q_base, qo_base, hq, n_qh, q_sh, qo_sh, HALF, PASS, PASS_BLOCK)
            _copy_pass(k_ptr, ko_ptr, k_base, ko_base, hk, n_kh, k_sh, ko_sh, HALF, PASS, PASS_BLOCK)
        else:
            _rotate_heads(q_ptr, qo_ptr, q_base, qo_base, n_qh, q_sh, qo_sh,
                          c1, c2, s1, s2, d, d_mask, HALF, PASS, PASS_BLOCK, BLOCK_HQ, BACKWARD)
            _rotate_heads(k_ptr, ko_ptr, k_base, ko_base, n_kh, k_sh, ko_sh,
                          c1, c2, s1, s2, d, d_mask, HALF, PASS, PASS_BLOCK, BLOCK_HK, BACKWARD)

    # host launches go through launch.fast_kernel (the compiled launcher after a first launch)
    _rope_kernel = fast_kernel(_rope_kernel)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _config(rot: int, d: int, n_qh: int, n_kh: int, rotate_pass: bool):
    """(HALF, HALF_BLOCK, PASS, PASS_BLOCK, BLOCK_HQ, BLOCK_HK, num_warps, LOADS_FIRST) for the
    current knobs (cached per shape and knob values)."""
    knobs = ROPE_TUNING.current
    return _config_cached(rot, d, n_qh, n_kh, rotate_pass, knobs.tile_elements, knobs.num_warps,
                          knobs.loads_first, knobs.small_tile_elems)


@functools.lru_cache(maxsize=256)
def _config_cached(rot: int, d: int, n_qh: int, n_kh: int, rotate_pass: bool,
                   tile_elements: int, num_warps: int, loads_first: bool, small_tile: int):
    half = rot // 2
    half_block = next_power_of_2(half)
    pass_dims = d - rot if rotate_pass else 0
    pass_block = next_power_of_2(pass_dims) if pass_dims else 1
    if loads_first:  # one tile per tensor: all heads
        block_hq, block_hk = next_power_of_2(max(n_qh, 1)), next_power_of_2(max(n_kh, 1))
        tile = block_hq * half_block
        warps = num_warps or (8 if tile >= 4096 else 4 if tile >= small_tile else 2)
        return half, half_block, pass_dims, pass_block, block_hq, block_hk, warps, True
    max_h = max(1, tile_elements // half_block)
    block_hq = min(next_power_of_2(max(n_qh, 1)), max_h)
    block_hk = min(next_power_of_2(max(n_kh, 1)), max_h)
    warps = num_warps or (8 if max(block_hq, block_hk) * half_block >= 2048 else 4)
    return half, half_block, pass_dims, pass_block, block_hq, block_hk, warps, False


def _launch_into(q, k, qo, ko, cos, sin, head_axis: int, backward: bool, copy_pass: bool = True,
                 repeat: bool = False):
    """Rotate q and k (or their gradients) into qo and ko (same shapes; any strides with a unit
    last stride). ``qo``/``ko`` may be ``q``/``k`` themselves (in place): each program reads both
    halves of a head before writing them and programs touch disjoint tokens, so there is no
    read-after-write hazard; the pass-through dims are then left alone (``copy_pass=False``).
    ``repeat``: only the first half of each cos/sin row is read, for both halves."""
    q_stride, k_stride = q.stride(), k.stride()
    _launch_geometry(q, k, qo, ko, q.shape, k.shape, q_stride, k_stride,
                     q_stride if qo is q else qo.stride(), k_stride if ko is k else ko.stride(),
                     cos, sin, head_axis, backward, copy_pass, repeat)


def _launch_geometry(q, k, qo, ko, q_shape, k_shape, q_stride, k_stride, qo_stride, ko_stride,
                     cos, sin, head_axis: int, backward: bool, copy_pass: bool, repeat: bool):
    """:func:`_launch_into` with the four tensors given as data (their first element) plus shapes and
    strides, so that a carrier (:func:`~liger_losses.kernels.layouts.carrier_of`) is launched on
    without making its view (host time per call matters: every layer of every step)."""
    bsz, d = q_shape[0], q_shape[-1]
    token_axis = 2 if head_axis == 1 else 1
    seq = q_shape[token_axis]
    n_qh, n_kh = q_shape[head_axis], k_shape[head_axis]
    if bsz * seq == 0 or d == 0:
        return
    half, half_block, pass_dims, pass_block, block_hq, block_hk, warps, loads_first = _config(
        cos.shape[-1], d, n_qh, n_kh, copy_pass
    )
    # one head stride for all four (the usual [B, T, H, D] projections): a constexpr, so the
    # kernel's offsets need no per-head address arithmetic (H200, 8B shapes, with repeat: 59 -> 56
    # registers, ~1% less time, benchmark/experiments/diag_rope.py)
    head_stride = q_stride[head_axis]
    if not (k_stride[head_axis] == qo_stride[head_axis] == ko_stride[head_axis] == head_stride):
        head_stride = 0
    cos_stride, sin_stride = cos.stride(), sin.stride()
    c_sb = 0 if cos.shape[0] == 1 else cos_stride[0]
    s_sb = 0 if sin.shape[0] == 1 else sin_stride[0]
    pdl = pdl_launch(q.device, "rope")
    with device_ctx(q):  # Triton launches on the current GPU
        _rope_kernel[(bsz * seq,)](
            q, k, qo, ko, cos, sin,
            seq, n_qh, n_kh,
            q_stride[0], q_stride[token_axis], q_stride[head_axis],
            k_stride[0], k_stride[token_axis], k_stride[head_axis],
            qo_stride[0], qo_stride[token_axis], qo_stride[head_axis],
            ko_stride[0], ko_stride[token_axis], ko_stride[head_axis],
            c_sb, cos_stride[1], s_sb, sin_stride[1],
            HALF=half, HALF_BLOCK=half_block, PASS=pass_dims, PASS_BLOCK=pass_block,
            BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BACKWARD=backward, LOADS_FIRST=loads_first,
            REPEAT_TABLES=repeat, HEAD_STRIDE=head_stride, PDL=pdl, num_warps=warps, **launch_options(pdl),
        )


def _launch(q, k, cos, sin, head_axis: int, backward: bool, layouts=None, repeat: bool = False):
    """Rotate q and k (or their gradients) into new tensors laid out like ``layouts`` =
    ((q shape, q stride), (k shape, k stride)) (default: q's and k's own layouts)."""
    q, k = _unit_last(q), _unit_last(k)
    cos, sin = _unit_last(cos), _unit_last(sin)
    if layouts is None:
        layouts = ((q.shape, q.stride()), (k.shape, k.stride()))
    qo = empty_like_layout(*layouts[0], q)
    ko = empty_like_layout(*layouts[1], k)
    _launch_into(q, k, qo, ko, cos, sin, head_axis, backward, repeat=repeat)
    return qo, ko


# What the double-backward error suggests instead.
_DOUBLE_BACKWARD_INSTEAD = 'use impl="torch" (apply_liger_kernels(..., rope=False) for patched models)'


class RoPEFunction(torch.autograd.Function):
    """(q, k) -> (q_embed, k_embed) in new tensors; saves only cos and sin. No gradient for cos/sin.
    Gradients are allocated in q's and k's layouts, so the HF ``view``/``transpose`` backward that
    follows needs no copy."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, head_axis=1, repeat=False):
        ctx.save_for_backward(cos, sin)
        ctx.head_axis = head_axis
        ctx.repeat = repeat
        ctx.layouts = ((q.shape, q.stride()), (k.shape, k.stride()))
        return _launch(q, k, cos, sin, head_axis, backward=False, repeat=repeat)

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        check_no_double_backward("the Triton RoPE", _DOUBLE_BACKWARD_INSTEAD)
        cos, sin = ctx.saved_tensors
        dq, dk = _launch(dq_embed, dk_embed, cos, sin, ctx.head_axis, backward=True, layouts=ctx.layouts,
                         repeat=ctx.repeat)
        return dq, dk, None, None, None, None


# --------------------------------------------------------------------------- in-place path


def _geometry(t: torch.Tensor, geom) -> tuple:
    """(shape, stride) of ``t`` seen with ``geom`` (:func:`~liger_losses.kernels.layouts.carrier_of`:
    offset 0), or ``t``'s own when ``geom`` is None."""
    return (t.shape, t.stride()) if geom is None else geom[:2]


class RoPEInplaceFunction(torch.autograd.Function):
    """Rotates q and k IN PLACE (through their carriers, see ``carrier_of``) and returns them, marked
    dirty, so autograd raises its usual error for a leaf that requires grad or for a tensor some
    other node saved. Saves only cos and sin. Backward rotates a gradient in its own buffer when that
    buffer is a private copy made here (a gradient laid out unlike the carrier), or, with
    ``inplace_backward``, whenever the buffer is dense; otherwise it allocates (the incoming buffer
    may be shared: autograd hands the same tensor to both inputs of an addition, and a caller's
    ``grad_outputs`` are the caller's)."""

    @staticmethod
    def forward(ctx, qc, kc, cos, sin, q_geom, k_geom, head_axis, inplace_backward=False, repeat=False):
        # the carriers seen with q's and k's geometry (offset 0, see carrier_of), without the views
        (q_shape, q_stride), (k_shape, k_stride) = _geometry(qc, q_geom), _geometry(kc, k_geom)
        _launch_geometry(qc, kc, qc, kc, q_shape, k_shape, q_stride, k_stride, q_stride, k_stride,
                         cos, sin, head_axis, False, False, repeat)
        ctx.repeat = repeat
        ctx.mark_dirty(qc, kc)
        ctx.save_for_backward(cos, sin)
        ctx.geoms = (q_geom, k_geom)
        ctx.head_axis = head_axis
        ctx.layouts = ((qc.shape, qc.stride()), (kc.shape, kc.stride()))
        ctx.inplace_backward = inplace_backward
        return qc, kc

    @staticmethod
    def backward(ctx, dqc, dkc):
        check_no_double_backward("the Triton RoPE (inplace=True)", _DOUBLE_BACKWARD_INSTEAD)
        cos, sin = ctx.saved_tensors
        q_geom, k_geom = ctx.geoms
        given_q, given_k = dqc, dkc
        if q_geom is not None:
            dqc = dqc.contiguous()
        if k_geom is not None:
            dkc = dkc.contiguous()
        dqc, dkc = _unit_last(dqc), _unit_last(dkc)

        def out_buffer(grad, given, layout):
            # the gradient's own buffer when it is ours (a copy made above) or may be overwritten
            if (grad is not given or ctx.inplace_backward) and not overlaps(grad):
                return grad
            return empty_like_layout(*layout, grad)

        outq = out_buffer(dqc, given_q, ctx.layouts[0])
        outk = out_buffer(dkc, given_k, ctx.layouts[1])
        (q_shape, q_stride), (k_shape, k_stride) = _geometry(dqc, q_geom), _geometry(dkc, k_geom)
        _launch_geometry(dqc, dkc, outq, outk, q_shape, k_shape, q_stride, k_stride,
                         _geometry(outq, q_geom)[1], _geometry(outk, k_geom)[1],
                         cos, sin, ctx.head_axis, True, True, ctx.repeat)
        return outq, outk, None, None, None, None, None, None, None


def _rope_inplace_triton(q, k, cos, sin, head_axis, inplace_backward=False, repeat=False):
    """In-place Triton rotation of q and k; returns (q, k) (views rebuilt when lifted to a base)."""
    if overlaps(q) or overlaps(k):
        raise ValueError("q and k must not have overlapping elements (e.g. expanded) with inplace=True")
    if q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
        raise ValueError("q and k must not share memory with inplace=True (e.g. slices of one qkv tensor)")
    cos, sin = _unit_last(cos), _unit_last(sin)
    if q.stride(-1) != 1 or k.stride(-1) != 1:  # rare: rotate out of place, then copy back
        oq, ok = _rope_triton(q, k, cos, sin, head_axis, repeat)
        return q.copy_(oq), k.copy_(ok)
    if not records_autograd(q, k):
        _launch_into(q, k, q, k, cos, sin, head_axis, backward=False, copy_pass=False, repeat=repeat)
        return q, k
    qc, q_geom = carrier_of(q)
    kc, k_geom = carrier_of(k)
    for name, c in (("q", qc), ("k", kc)):
        if c.is_leaf and c.requires_grad:  # autograd's mark_dirty check would come after the write
            raise RuntimeError(
                f"a leaf Variable that requires grad (or a view of one) is being used in an in-place "
                f"operation: {name} with inplace=True; use inplace=False"
            )
    if qc._base is not None or kc._base is not None:
        # A partial view (e.g. a slice of a qkv tensor): autograd cannot mark it dirty in a Function
        # with two outputs; rotate out of place and copy back (an ordinary tracked in-place copy).
        oq, ok = _rope_triton(q, k, cos, sin, head_axis, repeat)
        return q.copy_(oq), k.copy_(ok)
    oq, ok = RoPEInplaceFunction.apply(qc, kc, cos, sin, q_geom, k_geom, head_axis, inplace_backward, repeat)
    if q_geom is not None:
        oq = rebuild(oq, q_geom)
    if k_geom is not None:
        ok = rebuild(ok, k_geom)
    return oq, ok


def _rope_triton(q, k, cos, sin, head_axis, repeat=False):
    if records_autograd(q, k):
        return RoPEFunction.apply(q, k, cos, sin, head_axis, repeat)
    return _launch(q, k, cos, sin, head_axis, backward=False, repeat=repeat)


# --------------------------------------------------------------------------- reference path


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_torch(q, k, cos, sin, head_axis: int, repeat: bool = False):
    """The Hugging Face formula (partial rotary included), computed in fp32 (``repeat``: with the
    first half of each cos/sin row used for both halves)."""
    cos = cos.unsqueeze(head_axis).float()
    sin = sin.unsqueeze(head_axis).float()
    rot = cos.shape[-1]
    if repeat:
        cos = torch.cat((cos[..., : rot // 2],) * 2, dim=-1)
        sin = torch.cat((sin[..., : rot // 2],) * 2, dim=-1)

    def one(x):
        xf = x.float()
        x_rot, x_pass = xf[..., :rot], xf[..., rot:]
        y = x_rot * cos + _rotate_half(x_rot) * sin
        return torch.cat((y, x_pass), dim=-1).to(x.dtype)

    return one(q), one(k)


# --------------------------------------------------------------------------- public function


_CHECKED = CheckedSignatures()


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    unsqueeze_dim: int = 1,
    *,
    inplace: bool = False,
    inplace_backward: bool = False,
    repeated_tables: bool = False,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, same signature and semantics as transformers' llama function.

    ``position_ids`` is only used with a 2-D cos/sin table (then ``cos[position_ids]``); with the
    usual 3-D cos/sin it is ignored, as in transformers. Because transformers 5 dropped that
    argument, an ``int`` given in its place is taken as ``unsqueeze_dim``
    (``apply_rotary_pos_emb(q, k, cos, sin, 2)``). Returns ``(q_embed, k_embed)`` with q's and k's
    shapes, dtype and (when dense) strides.

    ``inplace=True`` writes the rotated values into q and k themselves and returns them (or views
    with their shapes and strides); no output is allocated. Autograd's usual in-place checks apply
    (a leaf that requires grad, or a tensor saved by another op, raises). q and k must not share
    memory or overlap themselves (ValueError).

    ``inplace_backward=True`` (with ``inplace=True``, the Triton path) also rotates the incoming
    gradients of q_embed and k_embed in their own buffers, as liger-kernel does: the backward then
    allocates nothing. Only for a caller that knows those buffers are not used elsewhere, e.g. an
    attention whose q_embed/k_embed feed only the attention kernel (its backward returns fresh
    dq/dk); a gradient autograd shares with another input (q_embed used in an addition) would be
    corrupted. Without it the gradient is rotated in place only into a private copy.

    ``repeated_tables=True`` uses only the first half of each cos/sin row (the first R/2 of the
    rotary dim R) for both halves: the same result whenever the second half repeats the first, as
    in every transformers rotary embedding (``cat(freqs, freqs)``), with half the table reads
    (liger-kernel always reads half). The patched models pass it; with a table whose halves differ
    it gives a different rotation.
    """
    if isinstance(position_ids, int) and not isinstance(position_ids, bool):
        unsqueeze_dim, position_ids = position_ids, None
    # a 3-D cos/sin without position_ids (every patched model) is checked once per signature
    key = _CHECKED.key(layout_signature(q), layout_signature(k), layout_signature(cos), layout_signature(sin),
                       None if position_ids is not None else True, type(unsqueeze_dim), unsqueeze_dim,
                       type(inplace), inplace, type(inplace_backward), inplace_backward,
                       type(repeated_tables), repeated_tables, impl)
    checked = _CHECKED.get(key)
    if checked is None:
        cos, sin, head_axis = check_inputs(q, k, cos, sin, position_ids, unsqueeze_dim)
        resolved = resolve_impl(impl, q, k, cos, sin)
    else:
        head_axis, resolved = checked
    which = resolved
    cos_grad = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    if which == "triton" and cos_grad:
        which = triton_fallback(impl, ValueError(
            "cos and sin must not require grad with impl='triton' (the kernel gives no cos/sin "
            "gradient); use impl='torch' or detach them"
        ))
    if checked is None:
        check_flags(inplace, inplace_backward, repeated_tables)
        if cos.dim() == 3:  # 2-D tables were gathered by position_ids: checked every call
            _CHECKED.remember(key, (head_axis, resolved))
    if which == "torch":
        oq, ok = _rope_torch(q, k, cos, sin, head_axis, repeated_tables)
        return (q.copy_(oq), k.copy_(ok)) if inplace else (oq, ok)
    if inplace:
        return _rope_inplace_triton(q, k, cos, sin, head_axis, inplace_backward, repeated_tables)
    return _rope_triton(q, k, cos, sin, head_axis, repeated_tables)


liger_rotary_pos_emb = apply_rotary_pos_emb
