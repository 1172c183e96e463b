"""RMSNorm over the last dimension, with Triton forward/backward kernels and HF drop-in modules.

Computes, for ``hidden`` of shape ``[..., H]`` (any leading dims, any strides) and ``weight`` of
shape ``[H]`` (or ``None``), with ``rstd = rsqrt(mean(x32**2, -1) + eps)`` and ``x32`` the row in
fp32 (fp64 stays fp64 on the torch path):

* ``casting_mode="llama"`` (``LlamaRMSNorm``, Qwen, Mistral...):
  ``out = (offset + weight) * (x32 * rstd).to(hidden.dtype)``; the sum ``offset + weight`` is
  rounded to ``weight.dtype`` and the product to ``promote_types(weight.dtype, hidden.dtype)``
  (the output dtype, as in Hugging Face: fp32 weight with bf16 hidden gives an fp32 output).
* ``casting_mode="gemma"`` (``GemmaRMSNorm``/``Gemma2RMSNorm``, offset 1):
  ``out = (x32 * rstd * (offset + weight.float())).to(hidden.dtype)``, all in fp32.
* ``casting_mode="none"``: ``out = (x32 * rstd * (offset + weight).float()).to(hidden.dtype)``:
  everything in fp32 except the sum ``offset + weight``, which stays in ``weight.dtype``.
* ``weight=None``: ``out = (x32 * rstd).to(hidden.dtype)`` in every mode.

Output: ``[..., H]``. Dtypes: fp32, bf16, fp16 on the Triton path (fp64 goes to the torch path).

Backward (``g = grad_out * (offset + weight)`` in fp32, ``y = x32 * rstd``):
``grad_hidden = rstd * (g - y * mean(g * y, -1))`` and
``grad_weight = sum_rows(grad_out * y)`` (``y`` rounded to ``hidden.dtype`` first in llama mode,
as the forward uses it). The forward saves ``rstd`` ``[rows]`` fp32 next to ``hidden``. The
backward reads ``hidden`` and ``grad_out`` once; each of ``num_programs`` programs (one per SM
on CUDA by default) walks a contiguous range of rows and writes its fp32 partial weight-gradient row into a
``[num_programs, H]`` buffer, summed once afterwards (deterministic, fp32 accumulation).

``inplace_backward=True`` writes ``grad_hidden`` into the buffer of ``grad_out`` (saves one
``[rows, H]`` tensor in backward, as liger-kernel does by default). It is only right when nobody
else reads that gradient buffer afterwards: true when the norm's output feeds only Linear layers
(Hugging Face decoder norms), false when e.g. the output is added to a residual branch as-is.

Public API:
    rms_norm(hidden, weight, *, eps=1e-6, offset=0.0, casting_mode="llama",
             inplace_backward=False, impl="auto") -> Tensor
    RMSNormFunction           the torch.autograd.Function of the Triton path
    LigerRMSNorm(hidden_size, eps=1e-6, *, offset=0.0, casting_mode="llama",
                 inplace_backward=False, impl="auto")        drop-in for LlamaRMSNorm
    LigerGemmaRMSNorm(dim, eps=1e-6, *, inplace_backward=False, impl="auto")
                                                             drop-in for GemmaRMSNorm/Gemma2RMSNorm
    RMS_NORM_TUNING           the launch knobs (a norm_common.NormTuning slot, "rms_norm")
"""

from __future__ import annotations

from typing import Optional

import torch
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
    CheckedSignatures,
    as_rows,
    check_choice,
    check_no_double_backward,
    check_number,
    device_ctx,
    import_triton,
    records_autograd,
    tensor_signature,
)

triton, tl = import_triton()
if triton is not None:
    from liger_losses.kernels.norm_common import load_row_tiles, step_row_tiles  # backward jit helpers
    from liger_losses.kernels.pdl import pdl_prologue
    from liger_losses.kernels.utils import keep_or_sum, kept_total

CASTING_MODES = ("llama", "gemma", "none")
_CASTING_CODE = {"llama": 0, "gemma": 1, "none": 2}

# The launch knobs (norm_common.NormTuning; its defaults are these). A tile holds about
# *_tile_elems elements (one row when H is large, several when H is small). Set from CUDA-graph
# sweeps on the H200 (bench_norm.py --sweep with BENCH_GRAPH=1: GPU time alone; the earlier eager sweeps were dominated
# by host time and misleading). Forward: any tile <= 16384 is within 2% (one row per tile at H=4096). Backward: one
# program per SM with 4-row tiles (16384 elements) at H=4096: 0.122 ms at N=16384 (1.30x the bytes floor; 8/SM one-row
# tiles 0.143, liger-kernel 0.189) and 0.227 ms at N=32768 (1.21x); at H=896 one program per SM with a tile-shaped
# accumulator, 8-row tiles since the prefetch (below; 16-row tiles with it spill: 0.057 vs 0.041 ms forward + backward).
# Backward programs on CUDA: bwd_programs_per_sm per SM, but at least bwd_min_rows_per_program
# rows each. One per SM is fastest (above) and keeps the fp32 partial rows ([programs, H],
# written then summed by norm_common.sum_partials) at 132 x H x 4 bytes: 2.1 MiB at H=4096.
# Rows of bwd_small_h < H <= bwd_mid_h: smaller tiles, two programs per SM. H200
# (benchmark/experiments/diag_norm_backward.py: backward = graph time of forward + backward minus
# forward, L2 cleared before each replay), 16384 x 2048 bf16 (Llama-3.2-1B at 8 x 2048 tokens):
# 0.0602 ms, 1.29x the HBM floor, against 0.157 ms (3.35x) with the H=4096 settings above (our
# trainer profile: 0.168 per call) and liger-kernel's 0.137; gradients bitwise equal. At 4096 x
# 4096 the same settings are 6% slower than the defaults (0.0347 vs 0.0327 ms), hence the width
# bound.
# Warps: 0, from the tile size (benchmark/experiments/diag_norm_backward.py sweeps them: no setting
# beat the defaults by more than 2%).
# Backward prefetch (load the next tile while computing this one; see the kernel). H200 sweep
# (graph time, forward + backward, bf16, H=4096, one program per SM, 4-row tiles): 0.101 / 0.185 /
# 0.356 ms at 8k / 16k / 32k tokens (1.30x / 1.19x / 1.14x the HBM floor) vs 0.107 / 0.190 / 0.359
# without; H=896: 0.041 vs 0.045 ms.
# Backward programs on the CPU interpreter: 4 (small: the interpreter is slow per program).
RMS_NORM_TUNING = register("rms_norm", NormTuning(
    fwd_tile_elems=4096, bwd_tile_elems=16384, bwd_small_h=1024, bwd_small_h_tile_elems=8192,
    max_rows_per_tile=16, bwd_programs_per_sm=1, bwd_min_rows_per_program=16, cpu_bwd_programs=4,
    bwd_mid_h=2048, bwd_mid_h_tile_elems=4096, bwd_mid_h_programs_per_sm=2,
    fwd_num_warps=0, bwd_num_warps=0, bwd_prefetch=True,
))


if triton is not None:

    @triton.jit
    def _rms_norm_fwd_kernel(
        x_ptr, w_ptr, y_ptr, rstd_ptr,
        n_rows, n_cols, stride_x, stride_y,
        eps, offset,
        CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        """One tile of BLOCK_M rows: rstd (fp32, stored) and the normalised, weighted rows."""
        pdl_prologue(PDL)  # PDL launch: wait for the previous kernel before any memory access
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_mask = rows < n_rows
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
            if CASTING == 1:  # gemma: (offset + w) in fp32
                w_eff = w.to(tl.float32) + offset
            else:  # llama / none: (offset + w) rounded to the weight dtype
                w_eff = (w.to(tl.float32) + offset).to(w_ptr.dtype.element_ty).to(tl.float32)
            if CASTING == 0:  # llama: y is rounded to the input dtype before the product
                y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
            y = y * w_eff[None, :]
        tl.store(
            y_ptr + rows[:, None] * stride_y + cols[None, :],
            y.to(y_ptr.dtype.element_ty),
            mask=mask,
        )

    @triton.jit
    def _rms_norm_bwd_kernel(
        dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
        n_rows, n_cols, stride_dy, stride_x, stride_dx,
        offset, n_blocks, blocks_per_program,
        CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
        COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_ACC: tl.constexpr, PREFETCH: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """A contiguous range of row tiles: grad rows (dx may alias dy) and a partial dW row."""
        pdl_prologue(PDL)  # PDL launch: wait for the previous kernel before any memory access
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=col_mask, other=0.0)
            if CASTING == 1:
                w_eff = w.to(tl.float32) + offset
            else:
                w_eff = (w.to(tl.float32) + offset).to(w_ptr.dtype.element_ty).to(tl.float32)
        # Short rows (several per tile): a [BLOCK_M, BLOCK_N] accumulator, reduced once at the end
        # (no cross-warp reduction per tile). Long rows: a [BLOCK_N] row (fewer live registers).
        acc = keep_or_sum(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), TILE_ACC)
        first = pid * blocks_per_program
        last = tl.minimum(first + blocks_per_program, n_blocks)
        # PREFETCH: the loads of tile b + 1 are issued before tile b is computed (two tiles in
        # flight per program: one program per SM alone leaves HBM latency exposed).
        x, dy, rstd, _ = load_row_tiles(x_ptr, dy_ptr, rstd_ptr, rstd_ptr, first, last, n_rows, stride_x,
                                    stride_dy, cols, col_mask, BLOCK_M, PREFETCH, False)
        for block in range(first, last):
            x, dy, rstd, _, x_next, dy_next, rstd_next, _ = step_row_tiles(
                x_ptr, dy_ptr, rstd_ptr, rstd_ptr, x, dy, rstd, rstd, block, last, n_rows, stride_x, stride_dy,
                cols, col_mask, BLOCK_M, PREFETCH, False,
            )
            rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            y = x * rstd[:, None]
            if COMPUTE_DW:
                if CASTING == 0:
                    prod = dy * y.to(x_ptr.dtype.element_ty).to(tl.float32)
                else:
                    prod = dy * y
                acc += keep_or_sum(prod, TILE_ACC)
            if COMPUTE_DX:
                if HAS_WEIGHT:
                    g = dy * w_eff[None, :]
                else:
                    g = dy
                c = tl.sum(g * y, axis=1) / n_cols
                dx = (g - y * c[:, None]) * rstd[:, None]
                tl.store(
                    dx_ptr + rows[:, None] * stride_dx + cols[None, :],
                    dx.to(dx_ptr.dtype.element_ty),
                    mask=mask,
                )
            x, dy, rstd = x_next, dy_next, rstd_next
        if COMPUTE_DW:
            tl.store(dw_partial_ptr + pid * n_cols + cols, kept_total(acc, TILE_ACC), mask=col_mask)

    # host launches go through launch.fast_kernel (the compiled launcher after a first launch)
    _rms_norm_fwd_kernel = fast_kernel(_rms_norm_fwd_kernel)
    _rms_norm_bwd_kernel = fast_kernel(_rms_norm_bwd_kernel)


# --------------------------------------------------------------------------- host side


def _forward(x2, weight, eps, offset, casting_mode, out):
    """Launch the forward kernel on ``x2`` ``[rows, H]`` (unit last stride) into ``out`` (contiguous,
    ``rows * H`` elements, any shape); returns rstd ``[rows]`` fp32."""
    n_rows, n_cols = x2.shape
    rstd = torch.empty((n_rows,), dtype=torch.float32, device=x2.device)
    block_m, block_n, warps, programs = fwd_tiling(n_rows, n_cols, RMS_NORM_TUNING.current)
    pdl = fwd_pdl(x2.device, block_m)
    with device_ctx(x2):
        _rms_norm_fwd_kernel[(programs,)](
            x2, weight if weight is not None else x2, out, rstd,
            n_rows, n_cols, x2.stride(0), n_cols,
            float(eps), float(offset),
            CASTING=_CASTING_CODE[casting_mode], HAS_WEIGHT=weight is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, PDL=pdl, num_warps=warps, **launch_options(pdl),
        )
    return rstd


def _backward(dy2, x2, weight, rstd, offset, casting_mode, need_dx, need_dw, inplace):
    """Launch the backward kernel; returns (grad_hidden [rows, H] or None, grad_weight or None)."""
    n_rows, n_cols = x2.shape
    dx = None
    if need_dx:
        if inplace and dy2.dtype == x2.dtype and dy2.is_contiguous():
            dx = dy2
        else:
            dx = torch.empty_like(x2, memory_format=torch.contiguous_format)
    knobs = RMS_NORM_TUNING.current
    block_m, block_n, warps, n_blocks, programs, blocks_per_program, tile_acc = bwd_tiling(x2, knobs)
    partial = partial_rows(int(need_dw), programs, x2)
    pdl = pdl_launch(x2.device, "norm_bwd")
    with device_ctx(x2):
        _rms_norm_bwd_kernel[(programs,)](
            dy2, x2, weight if weight is not None else x2, rstd,
            dx if dx is not None else x2, partial if need_dw else x2,
            n_rows, n_cols, dy2.stride(0), x2.stride(0), dx.stride(0) if dx is not None else 0,
            float(offset), n_blocks, blocks_per_program,
            CASTING=_CASTING_CODE[casting_mode], HAS_WEIGHT=weight is not None,
            COMPUTE_DX=need_dx, COMPUTE_DW=need_dw,
            BLOCK_M=block_m, BLOCK_N=block_n, TILE_ACC=tile_acc, PREFETCH=knobs.bwd_prefetch,
            PDL=pdl, num_warps=warps, **launch_options(pdl),
        )
    dw = sum_partials(partial, weight.dtype)[0] if need_dw else None
    return dx, dw


def _forward_output(hidden, weight, eps, offset, casting_mode):
    """(out, hidden as [rows, H], rstd): the forward kernel into a new output of hidden's shape."""
    shape = hidden.shape
    x2 = as_rows(hidden)
    # the output is allocated in its final shape and returned as is (not a view made inside the
    # Function), so callers may modify views of it in place (e.g. in-place RoPE on Qwen3's q_norm
    # output, transposed)
    out = torch.empty(shape, dtype=_output_dtype(hidden, weight, casting_mode), device=hidden.device)
    rstd = _forward(x2, weight, eps, offset, casting_mode, out)
    return out, x2, rstd


class RMSNormFunction(torch.autograd.Function):
    """Triton RMSNorm: ``apply(hidden, weight, eps, offset, casting_mode, inplace_backward)``.

    ``hidden`` ``[..., H]`` float, ``weight`` ``[H]`` or ``None``; inputs are assumed checked (use
    :func:`rms_norm`). Saves ``hidden`` as ``[rows, H]`` and ``rstd`` ``[rows]`` fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, eps, offset, casting_mode, inplace_backward):
        out, x2, rstd = _forward_output(hidden, weight, eps, offset, casting_mode)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = hidden.shape
        ctx.offset = offset
        ctx.casting_mode = casting_mode
        ctx.inplace_backward = inplace_backward
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # not once_differentiable: that raises only when grad_out requires grad and lets a
        # constant upstream gradient (loss = (norm * c).sum()) drop the second-order terms silently
        check_no_double_backward(
            "the Triton RMSNorm",
            'use impl="torch" (apply_liger_kernels(..., rms_norm=False) for patched models)')
        x2, weight, rstd = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        need_dw = weight is not None and ctx.needs_input_grad[1]
        if not (need_dx or need_dw):
            return None, None, None, None, None, None
        dy2 = as_rows(grad_out)
        dx, dw = _backward(
            dy2, x2, weight, rstd, ctx.offset, ctx.casting_mode,
            need_dx, need_dw, ctx.inplace_backward,
        )
        if dx is not None:
            dx = dx.view(ctx.shape)
        return dx, dw, None, None, None, None


def _output_dtype(hidden, weight, casting_mode) -> torch.dtype:
    if casting_mode == "llama" and weight is not None:
        return torch.promote_types(weight.dtype, hidden.dtype)
    return hidden.dtype


def rms_norm_torch(
    hidden: torch.Tensor,
    weight: Optional[torch.Tensor],
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
) -> torch.Tensor:
    """Pure-PyTorch RMSNorm (the ``impl="torch"`` path): Hugging Face's ops, autograd through them."""
    compute = torch.promote_types(hidden.dtype, torch.float32)
    x = hidden.to(compute)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return y.to(hidden.dtype)
    if casting_mode == "llama":
        w = weight if offset == 0 else offset + weight
        return w * y.to(hidden.dtype)
    if casting_mode == "gemma":
        return (y * (offset + weight.to(compute))).to(hidden.dtype)
    return (y * (offset + weight).to(compute)).to(hidden.dtype)


_CHECKED = CheckedSignatures()


def rms_norm(
    hidden: torch.Tensor,
    weight: Optional[torch.Tensor],
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    inplace_backward: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """RMSNorm of ``hidden`` ``[..., H]`` with ``weight`` ``[H]`` (or None); see the module doc.

    Returns ``[..., H]`` in ``hidden.dtype`` (llama mode with a weight: the promoted dtype of
    ``weight`` and ``hidden``, as Hugging Face).
    """
    key = _CHECKED.key(tensor_signature(hidden), tensor_signature(weight), type(eps), eps, type(offset), offset,
                       casting_mode, impl)
    which = _CHECKED.get(key)
    if which is None:
        check_norm_args(hidden, eps, weight=weight)
        check_number("offset", offset)
        check_choice("casting_mode", casting_mode, CASTING_MODES)
        which = norm_impl(impl, hidden, weight=weight)
        _CHECKED.remember(key, which)
    if which == "torch" or hidden.numel() == 0:
        return rms_norm_torch(hidden, weight, eps=eps, offset=offset, casting_mode=casting_mode)
    if not records_autograd(hidden, weight):
        return _forward_output(hidden, weight, eps, offset, casting_mode)[0]  # no graph to record
    return RMSNormFunction.apply(hidden, weight, eps, offset, casting_mode, bool(inplace_backward))


class LigerRMSNorm(nn.Module):
    """Drop-in for ``LlamaRMSNorm(hidden_size, eps)``: weight of ones, ``variance_epsilon`` attr.

    ``forward(hidden_states)`` -> ``weight * normalize(hidden_states)`` in llama casting mode
    (other modes and offsets via the keyword options).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        casting_mode: str = "llama",
        inplace_backward: bool = False,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        check_choice("casting_mode", casting_mode, CASTING_MODES)
        check_choice("impl", impl, IMPLS)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.inplace_backward = inplace_backward
        self.impl = impl

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            hidden_states, self.weight,
            eps=self.variance_epsilon, offset=self.offset, casting_mode=self.casting_mode,
            inplace_backward=self.inplace_backward, impl=self.impl,
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class LigerGemmaRMSNorm(nn.Module):
    """Drop-in for ``GemmaRMSNorm(dim, eps)`` / ``Gemma2RMSNorm``: weight of zeros, ``eps`` attr,
    ``out = (normalize(x.float()) * (1 + weight.float())).type_as(x)`` (gemma mode, offset 1)."""

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        *,
        inplace_backward: bool = False,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        check_choice("impl", impl, IMPLS)
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.inplace_backward = inplace_backward
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            x, self.weight, eps=self.eps, offset=1.0, casting_mode="gemma",
            inplace_backward=self.inplace_backward, impl=self.impl,
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
