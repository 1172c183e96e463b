"""LayerNorm over the last dimension: Triton forward/backward kernels and an nn.LayerNorm drop-in.

Computes, for ``hidden`` of shape ``[..., H]`` (any leading dims, any strides), ``weight`` and
``bias`` of shape ``[H]`` (each may be ``None``), in fp32 (fp64 stays fp64 on the torch path):

    mean = mean(x, -1);  rstd = rsqrt(mean((x - mean)**2, -1) + eps)      (biased variance)
    out  = ((x - mean) * rstd * weight + bias).to(hidden.dtype)

Output: ``[..., H]`` in ``hidden.dtype`` (as ``nn.LayerNorm`` with matching parameter dtypes).
Dtypes: fp32, bf16, fp16 on the Triton path (fp64 goes to the torch path); weight/bias may have
another float dtype than ``hidden`` (they are read as fp32).

Backward (``xhat = (x - mean) * rstd``, ``g = grad_out * weight``, all fp32):
``grad_hidden = rstd * (g - mean(g, -1) - xhat * mean(g * xhat, -1))``,
``grad_weight = sum_rows(grad_out * xhat)``, ``grad_bias = sum_rows(grad_out)``.
The forward saves ``mean`` and ``rstd`` ``[rows]`` fp32 next to ``hidden``. The backward reads
``hidden`` and ``grad_out`` once; each of ``num_programs`` programs (one per SM on CUDA by default) walks a
contiguous range of rows and writes fp32 partial rows of the weight and bias gradients into
``[num_programs, H]`` buffers, summed once afterwards (deterministic, fp32 accumulation).

Public API:
    layer_norm(hidden, weight, bias, *, eps=1e-5, impl="auto") -> Tensor
    LayerNormFunction     the torch.autograd.Function of the Triton path
    LigerLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                   device=None, dtype=None, *, impl="auto")   drop-in for nn.LayerNorm (last dim)
    LAYER_NORM_TUNING     the launch knobs (a norm_common.NormTuning slot, "layer_norm")
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.norm_common import (
    NormTuning,
    bwd_tiling,
    check_norm_args,
    fwd_pdl,
    fwd_tiling,
    norm_impl,
    partial_rows,
    sum_partials,
)
from liger_losses.kernels.pdl import launch_options, pdl_launch
from liger_losses.kernels.tuning import register
from liger_losses.kernels.utils import (
    IMPLS,
    as_rows,
    check_choice,
    check_last_dim,
    check_no_double_backward,
    check_tensor,
    device_ctx,
    import_triton,
)

triton, tl = import_triton()
if triton is not None:
    from liger_losses.kernels.norm_common import load_row_tiles, step_row_tiles  # backward jit helpers
    from liger_losses.kernels.pdl import pdl_prologue
    from liger_losses.kernels.utils import keep_or_sum, kept_total

# The launch knobs (norm_common.NormTuning, as in rms_norm.py: a tile is BLOCK_M whole rows
# holding about *_tile_elems elements).
# From CUDA-graph sweeps on the H200 (bench_norm.py --sweep with BENCH_GRAPH=1, GPU time alone):
# forward one-row tiles (any tile <= 4096 at H=4096; 0.073 ms at N=16384, 1.17x floor);
# backward one program per SM with 2-row tiles at H=4096 (0.152 ms at N=16384 vs 0.24 with
# 8/SM, liger-kernel 0.205; 0.285 ms at N=32768, 1.52x floor), and at H <= 1024 4-row tiles
# with tile-shaped accumulators (0.041 ms at 8192 x 896). One program per SM also keeps the two
# fp32 partial buffers at 2 x 132 x H x 4 bytes (4.1 MiB at H=4096, as liger-kernel's).
# Rows of bwd_small_h < H <= bwd_mid_h: 4096-element tiles, two programs per SM (as rms_norm).
# H200 (benchmark/experiments/diag_norm_backward.py --kind layer, graph time, L2 cleared), bf16
# 16384 x 2048: backward 0.0625 ms (1.34x the HBM floor) against 0.2016 ms (4.31x) with the
# H=4096 settings (2-row 8192-element tiles spill with the prefetch) and liger-kernel's 0.1596.
# Warps: 0, from the tile size (benchmark/experiments/diag_norm_backward.py sweeps them: no setting
# beat the defaults by more than 2%).
# Backward prefetch: H200 sweep (graph time, forward + backward, bf16, H=4096, one program per SM,
# 2-row tiles): 0.107 / 0.195 / 0.364 ms at 8k / 16k / 32k tokens (1.37x / 1.25x / 1.17x the HBM
# floor) vs 0.124 / 0.224 / 0.423 without (same tiles).
LAYER_NORM_TUNING = register("layer_norm", NormTuning(
    fwd_tile_elems=4096, bwd_tile_elems=8192, bwd_small_h=1024, bwd_small_h_tile_elems=4096,
    max_rows_per_tile=16, bwd_programs_per_sm=1, bwd_min_rows_per_program=16, cpu_bwd_programs=4,
    bwd_mid_h=2048, bwd_mid_h_tile_elems=4096, bwd_mid_h_programs_per_sm=2,
    fwd_num_warps=0, bwd_num_warps=0, bwd_prefetch=True,
))


if triton is not None:

    @triton.jit
    def _layer_norm_fwd_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr,
        n_rows, n_cols, stride_x, stride_y, eps,
        HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        """One tile of BLOCK_M rows: mean and rstd (fp32, stored) and the normalised rows."""
        pdl_prologue(PDL)  # PDL launch: wait for the previous kernel before any memory access
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        mean = tl.sum(x, axis=1) / n_cols
        diff = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=1) / n_cols + eps)
        tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        y = diff * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y * w[None, :]
        if HAS_BIAS:
            b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y + b[None, :]
        tl.store(
            y_ptr + rows[:, None] * stride_y + cols[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=mask,
        )

    @triton.jit
    def _layer_norm_bwd_kernel(
        dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, db_partial_ptr,
        n_rows, n_cols, stride_dy, stride_x, stride_dx,
        n_blocks, blocks_per_program,
        HAS_WEIGHT: tl.constexpr, COMPUTE_DX: tl.constexpr,
        COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_ACC: tl.constexpr, PREFETCH: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """A contiguous range of row tiles: grad rows and partial dW / dB rows (fp32)."""
        pdl_prologue(PDL)  # PDL launch: wait for the previous kernel before any memory access
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        # Short rows (several per tile): [BLOCK_M, BLOCK_N] accumulators, reduced once at the end
        # (no cross-warp reduction per tile). Long rows: [BLOCK_N] rows (fewer live registers).
        acc_w = keep_or_sum(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), TILE_ACC)
        acc_b = keep_or_sum(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), TILE_ACC)
        first = pid * blocks_per_program
        last = tl.minimum(first + blocks_per_program, n_blocks)
        # PREFETCH: the loads of tile b + 1 are issued before tile b is computed (rms_norm.py).
        # mean and rstd come with their tile (prefetched too)
        x, dy, mean, rstd = load_row_tiles(x_ptr, dy_ptr, mean_ptr, rstd_ptr, first, last, n_rows, stride_x,
                                           stride_dy, cols, col_mask, BLOCK_M, PREFETCH, True)
        for block in range(first, last):
            x, dy, mean, rstd, x_next, dy_next, mean_next, rstd_next = step_row_tiles(
                x_ptr, dy_ptr, mean_ptr, rstd_ptr, x, dy, mean, rstd, block, last, n_rows, stride_x, stride_dy,
                cols, col_mask, BLOCK_M, PREFETCH, True,
            )
            rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            if COMPUTE_DW:
                acc_w += keep_or_sum(dy * xhat, TILE_ACC)
            if COMPUTE_DB:
                acc_b += keep_or_sum(dy, TILE_ACC)
            if COMPUTE_DX:
                if HAS_WEIGHT:
                    g = dy * w[None, :]
                else:
                    g = dy
                c1 = tl.sum(g * xhat, axis=1) / n_cols
                c2 = tl.sum(g, axis=1) / n_cols
                dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
                tl.store(
                    dx_ptr + rows[:, None] * stride_dx + cols[None, :],
                    dx.to(dx_ptr.dtype.element_ty),
                    mask=mask,
                )
            x, dy, mean, rstd = x_next, dy_next, mean_next, rstd_next
        if COMPUTE_DW:
            tl.store(dw_partial_ptr + pid * n_cols + cols, kept_total(acc_w, TILE_ACC), mask=col_mask)
        if COMPUTE_DB:
            tl.store(db_partial_ptr + pid * n_cols + cols, kept_total(acc_b, TILE_ACC), mask=col_mask)

    # host launches go through launch.fast_kernel (the compiled launcher after a first launch)
    _layer_norm_fwd_kernel = fast_kernel(_layer_norm_fwd_kernel)
    _layer_norm_bwd_kernel = fast_kernel(_layer_norm_bwd_kernel)


# --------------------------------------------------------------------------- host side


def _forward(x2, weight, bias, eps, out2):
    """Launch the forward kernel on ``x2`` ``[rows, H]`` into ``out2`` (a contiguous ``[rows, H]``
    view of the caller's output); returns (mean, rstd), ``[rows]`` fp32 each."""
    n_rows, n_cols = x2.shape
    mean = torch.empty((n_rows,), dtype=torch.float32, device=x2.device)
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x2.device)
    block_m, block_n, warps, programs = fwd_tiling(n_rows, n_cols, LAYER_NORM_TUNING.current)
    pdl = fwd_pdl(x2.device, block_m)
    with device_ctx(x2):
        _layer_norm_fwd_kernel[(programs,)](
            x2, weight if weight is not None else x2, bias if bias is not None else x2,
            out2, mean, rstd,
            n_rows, n_cols, x2.stride(0), out2.stride(0), float(eps),
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, PDL=pdl, num_warps=warps, **launch_options(pdl),
        )
    return mean, rstd


def _backward(dy2, x2, weight, mean, rstd, need_dx, need_dw, need_db, sum_dtype=torch.float32):
    """Launch the backward kernel; returns (grad_hidden [rows, H], grad_weight, grad_bias), the
    parameter gradients in ``sum_dtype``."""
    n_rows, n_cols = x2.shape
    dx = torch.empty_like(x2, memory_format=torch.contiguous_format) if need_dx else None
    knobs = LAYER_NORM_TUNING.current
    block_m, block_n, warps, n_blocks, programs, blocks_per_program, tile_acc = bwd_tiling(x2, knobs)
    n_partial = int(need_dw) + int(need_db)
    partial = partial_rows(n_partial, programs, x2)
    dw_partial = partial[0] if need_dw else x2
    db_partial = partial[n_partial - 1] if need_db else x2
    pdl = pdl_launch(x2.device, "norm_bwd")
    with device_ctx(x2):
        _layer_norm_bwd_kernel[(programs,)](
            dy2, x2, weight if weight is not None else x2, mean, rstd,
            dx if dx is not None else x2, dw_partial, db_partial,
            n_rows, n_cols, dy2.stride(0), x2.stride(0), dx.stride(0) if dx is not None else 0,
            n_blocks, blocks_per_program,
            HAS_WEIGHT=weight is not None, COMPUTE_DX=need_dx,
            COMPUTE_DW=need_dw, COMPUTE_DB=need_db,
            BLOCK_M=block_m, BLOCK_N=block_n, TILE_ACC=tile_acc, PREFETCH=knobs.bwd_prefetch,
            PDL=pdl, num_warps=warps, **launch_options(pdl),
        )
    sums = sum_partials(partial, sum_dtype) if n_partial else None
    dw = sums[0] if need_dw else None
    db = sums[n_partial - 1] if need_db else None
    return dx, dw, db


class LayerNormFunction(torch.autograd.Function):
    """Triton LayerNorm: ``apply(hidden, weight, bias, eps)``.

    ``hidden`` ``[..., H]`` float, ``weight``/``bias`` ``[H]`` or ``None``; inputs are assumed
    checked (use :func:`layer_norm`). Saves ``hidden`` as ``[rows, H]``, ``mean`` and ``rstd``
    ``[rows]`` fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, eps):
        shape = hidden.shape
        x2 = as_rows(hidden)
        # made in its final shape and returned as is (not a view made inside the Function), so
        # callers may modify it in place
        out = torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
        mean, rstd = _forward(x2, weight, bias, eps, out.view(-1, shape[-1]))
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.shape = shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        check_no_double_backward("the Triton LayerNorm")  # (see RMSNormFunction.backward)
        x2, weight, mean, rstd = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        need_dw = weight is not None and ctx.needs_input_grad[1]
        need_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        if not (need_dx or need_dw or need_db):
            return None, None, None, None
        dtypes = {weight.dtype} if need_dw else set()
        if need_db:
            dtypes.add(ctx.bias_dtype)
        sum_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        dx, dw, db = _backward(
            as_rows(grad_out), x2, weight, mean, rstd, need_dx, need_dw, need_db, sum_dtype
        )
        if dx is not None:
            dx = dx.view(ctx.shape)
        if dw is not None:
            dw = dw.to(weight.dtype)
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dx, dw, db, None


def layer_norm_torch(
    hidden: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    *,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Pure-PyTorch LayerNorm (the ``impl="torch"`` path): fp32 math, autograd through it."""
    compute = torch.promote_types(hidden.dtype, torch.float32)
    w = weight.to(compute) if weight is not None else None
    b = bias.to(compute) if bias is not None else None
    out = F.layer_norm(hidden.to(compute), (hidden.shape[-1],), w, b, eps)
    return out.to(hidden.dtype)


def layer_norm(
    hidden: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    *,
    eps: float = 1e-5,
    impl: str = "auto",
) -> torch.Tensor:
    """LayerNorm of ``hidden`` ``[..., H]`` with ``weight``/``bias`` ``[H]`` (or None); see the
    module doc. Returns ``[..., H]`` in ``hidden.dtype``."""
    check_norm_args(hidden, eps, weight=weight, bias=bias)
    which = norm_impl(impl, hidden, weight=weight, bias=bias)
    if which == "torch" or hidden.numel() == 0:
        return layer_norm_torch(hidden, weight, bias, eps=eps)
    return LayerNormFunction.apply(hidden, weight, bias, eps)


class LigerLayerNorm(nn.LayerNorm):
    """Drop-in for ``nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias, device, dtype)``
    normalising the last dimension only (``normalized_shape`` an int or a 1-tuple). Same
    parameters (``weight``, ``bias``), state dict, ``extra_repr`` and ``isinstance`` as
    ``nn.LayerNorm``; the forward runs :func:`layer_norm`."""

    def __init__(
        self,
        normalized_shape,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        impl: str = "auto",
    ) -> None:
        if isinstance(normalized_shape, numbers.Integral):
            shape = (int(normalized_shape),)
        else:
            shape = tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(
                f"normalized_shape must be an int or a 1-tuple (LigerLayerNorm normalises the last "
                f"dimension only), got {normalized_shape!r}"
            )
        check_choice("impl", impl, IMPLS)
        super().__init__(shape, eps=eps, elementwise_affine=elementwise_affine, bias=bias,
                         device=device, dtype=dtype)
        self.impl = impl

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.LayerNorm's name
        check_tensor("input", input, min_ndim=1, floating=True)
        check_last_dim("input", input, self.normalized_shape[0], "normalized_shape")
        return layer_norm(input, self.weight, self.bias, eps=self.eps, impl=self.impl)
