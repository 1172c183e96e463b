"""Host-side pieces shared by the row-norm kernels (:mod:`rms_norm`, :mod:`layer_norm`).

Both normalise ``hidden`` ``[..., H]`` over its last dimension with ``[H]`` parameters (each may
be ``None``) and launch one forward kernel over tiles of ``BLOCK_M`` whole rows, and one
persistent backward kernel whose programs walk contiguous ranges of tiles and write fp32 partial
parameter-gradient rows ``[programs, H]``. This module holds their input checks, the choice of
path, the tiling of both launches, and the column sum of the partial rows (:func:`sum_partials`:
one small Triton launch that reads the fp32 partials once and writes the parameter gradient in its
dtype, with no reduction workspace).

The tiling takes the norm's knobs (:class:`NormTuning`, the current value of the kernel's slot,
``tuning(rms_norm=...)`` / ``tuning(layer_norm=...)``), the partial sum its own
(:class:`PartialSumTuning`, slot ``norm_sum``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.pdl import launch_options, pdl_launch
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import (
    check_last_dim,
    check_number,
    check_range,
    check_same_device,
    check_tensor,
    device_ctx,
    import_triton,
    next_power_of_2,
    num_row_programs,
    resolve_impl,
    row_tile,
    triton_fallback,
)

triton, tl = import_triton()
if triton is not None:
    from liger_losses.kernels.pdl import pdl_prologue

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class NormTuning(Knobs):
    """Launch knobs of a row norm (RMSNorm, LayerNorm: each has its slot and its defaults, set and
    measured in its module). A program handles a tile of BLOCK_M whole rows x next_pow2(H) columns,
    BLOCK_M chosen so that the tile holds about ``*_tile_elems`` elements.

    ``fwd_tile_elems``: forward tile. ``bwd_tile_elems``: backward tile for long rows.
    ``bwd_small_h``: rows of at most this width are short (multi-row backward tiles, a tile-shaped
    parameter-gradient accumulator) with ``bwd_small_h_tile_elems``-element tiles.
    ``max_rows_per_tile``: the cap on BLOCK_M.
    ``bwd_programs_per_sm`` / ``bwd_min_rows_per_program``: backward programs on CUDA (per SM, but
    at least this many rows each); ``cpu_bwd_programs``: on the CPU interpreter.
    ``bwd_mid_h``: rows with ``bwd_small_h < H <= bwd_mid_h`` take ``bwd_mid_h_tile_elems`` and
    ``bwd_mid_h_programs_per_sm`` instead (0: no mid-width settings).
    ``fwd_num_warps`` / ``bwd_num_warps``: warps of the launches (0: from the tile size).
    ``bwd_prefetch``: the backward loads the next tile while computing this one.
    """

    fwd_tile_elems: int = knob(4096, minimum=1)
    bwd_tile_elems: int = knob(16384, minimum=1)
    bwd_small_h: int = knob(1024)
    bwd_small_h_tile_elems: int = knob(8192, minimum=1)
    max_rows_per_tile: int = knob(16, minimum=1)
    bwd_programs_per_sm: int = knob(1, minimum=1)
    bwd_min_rows_per_program: int = knob(16, minimum=1)
    cpu_bwd_programs: int = knob(4, minimum=1)
    bwd_mid_h: int = knob(2048)
    bwd_mid_h_tile_elems: int = knob(4096, minimum=1)
    bwd_mid_h_programs_per_sm: int = knob(2, minimum=1)
    fwd_num_warps: int = knob(0)
    bwd_num_warps: int = knob(0)
    bwd_prefetch: bool = knob(True)


@dataclass(frozen=True)
class PartialSumTuning(Knobs):
    """Tiles of the partial-sum reduction (:func:`sum_partials`): ``block_cols`` columns per program
    and up to ``tile_elems`` elements per tile, so the ~1 x #SMs partial rows of a norm backward are
    read in one or two steps per program by H / block_cols programs (the former 256 x 32 tiles gave
    16 programs at H = 4096, each walking its rows in 5 steps). H200, forward + backward at
    H = 4096 (``bench_norm.py --sweep``): 64 columns saves ~3 us (RMSNorm 4096 tokens 0.0592 ->
    0.0560 ms, LayerNorm 0.0633 -> 0.0593); 32 columns about as much."""

    block_cols: int = knob(64, minimum=1)
    tile_elems: int = knob(8192, minimum=1)


SUM_TUNING = register("norm_sum", PartialSumTuning())

if triton is not None:

    @triton.jit
    def _sum_partials_kernel(
        partial_ptr, out_ptr, n_rows, n_cols,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
    ):
        """out[g, c] = sum_r partial[g, r, c] (fp32), stored in out's dtype; one program per
        (column block, group)."""
        pdl_prologue(PDL)  # PDL launch: wait for the previous kernel before any memory access
        group = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        col_mask = cols < n_cols
        base = partial_ptr + group * n_rows * n_cols
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for r0 in range(0, n_rows, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            mask = (rows < n_rows)[:, None] & col_mask[None, :]
            acc += tl.load(base + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
        total = tl.sum(acc, axis=0)
        tl.store(out_ptr + group * n_cols + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)

    @triton.jit
    def load_row_tiles(x_ptr, dy_ptr, stat_ptr, stat2_ptr, block, last, n_rows, stride_x, stride_dy,
                       cols, col_mask, BLOCK_M: tl.constexpr, ACTIVE: tl.constexpr,
                       TWO_STATS: tl.constexpr):
        """Tile ``block`` of the backward (rows ``block * BLOCK_M + [0, BLOCK_M)``): ``x`` and
        ``dy`` as fp32 ``[BLOCK_M, BLOCK_N]`` and the per-row fp32 statistics (the second one only
        with ``TWO_STATS``, else a copy of the first); zeros where the rows run past ``n_rows`` or
        ``block >= last``, and nothing loaded unless ``ACTIVE``. (Keeping a prefetched tile in its
        storage dtype until used changed no register count at the Llama-3-8B shapes.)"""
        rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        if ACTIVE:  # rows of tiles >= last are at or past last * BLOCK_M
            row_mask = rows < tl.minimum(n_rows, last * BLOCK_M)
        else:
            row_mask = rows < 0
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        stat = tl.load(stat_ptr + rows, mask=row_mask, other=0.0)
        if TWO_STATS:
            stat2 = tl.load(stat2_ptr + rows, mask=row_mask, other=0.0)
        else:
            stat2 = stat
        return x.to(tl.float32), dy.to(tl.float32), stat, stat2

    @triton.jit
    def step_row_tiles(x_ptr, dy_ptr, stat_ptr, stat2_ptr, x, dy, stat, stat2, block, last, n_rows,
                       stride_x, stride_dy, cols, col_mask, BLOCK_M: tl.constexpr, PREFETCH: tl.constexpr,
                       TWO_STATS: tl.constexpr):
        """One step of the backward's tile loop: ``(x, dy, stat, stat2)`` of tile ``block`` to
        compute now and the values to carry into the next step. With
        ``PREFETCH`` the given values already hold tile ``block`` (loaded by the previous step, or
        before the loop with ``load_row_tiles(..., first, ..., PREFETCH, TWO_STATS)``) and
        tile ``block + 1`` is loaded here, before the caller computes: two tiles in flight per
        program. Without, tile ``block`` is loaded here and nothing is carried."""
        if PREFETCH:
            x_next, dy_next, stat_next, stat2_next = load_row_tiles(
                x_ptr, dy_ptr, stat_ptr, stat2_ptr, block + 1, last, n_rows, stride_x, stride_dy,
                cols, col_mask, BLOCK_M, True, TWO_STATS,
            )
        else:
            x, dy, stat, stat2 = load_row_tiles(x_ptr, dy_ptr, stat_ptr, stat2_ptr, block, last, n_rows,
                                                stride_x, stride_dy, cols, col_mask, BLOCK_M, True, TWO_STATS)
            x_next, dy_next, stat_next, stat2_next = x, dy, stat, stat2
        return x, dy, stat, stat2, x_next, dy_next, stat_next, stat2_next

    # host launches go through launch.fast_kernel (the compiled launcher after a first launch)
    _sum_partials_kernel = fast_kernel(_sum_partials_kernel)


def sum_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of contiguous fp32 partial rows: ``[P, H] -> [H]`` or ``[G, P, H] -> [G, H]``,
    returned in ``dtype`` (rounded once, from the fp32 total)."""
    squeeze = partial.dim() == 2
    p3 = partial.unsqueeze(0) if squeeze else partial
    groups, n_rows, n_cols = p3.shape
    out = torch.empty((groups, n_cols), dtype=dtype, device=partial.device)
    knobs = SUM_TUNING.current
    block_c = min(knobs.block_cols, next_power_of_2(n_cols))
    block_r = max(1, min(next_power_of_2(n_rows), knobs.tile_elems // block_c))
    pdl = pdl_launch(partial.device, "sum")
    with device_ctx(partial):
        _sum_partials_kernel[(-(-n_cols // block_c), groups)](
            p3, out, n_rows, n_cols, BLOCK_R=block_r, BLOCK_C=block_c, PDL=pdl, num_warps=4,
            **launch_options(pdl),
        )
    return out[0] if squeeze else out
MAX_TRITON_HIDDEN = 65536


def check_norm_args(hidden: torch.Tensor, eps, **params: Optional[torch.Tensor]) -> None:
    """Check ``hidden`` ``[..., H]`` (float, H > 0), each given parameter (float ``[H]`` on
    hidden's device) and ``eps`` (a real number >= 0)."""
    check_tensor("hidden", hidden, min_ndim=1, floating=True)
    hidden_size = hidden.shape[-1]
    if hidden_size == 0:
        raise ValueError(f"hidden must have a non-empty last dimension, got shape {tuple(hidden.shape)}")
    for name, param in params.items():
        if param is not None:
            check_tensor(name, param, ndim=1, floating=True)
            check_last_dim(name, param, hidden_size, "the hidden size, hidden.shape[-1]")
    check_same_device(hidden=hidden, **params)
    check_number("eps", eps)
    check_range("eps", float(eps), 0.0)


def norm_impl(impl: str, hidden: torch.Tensor, **params: Optional[torch.Tensor]) -> str:
    """"triton" or "torch" for these checked inputs: Triton only for fp32/bf16/fp16 tensors and
    ``H <= 65536`` (else ``impl="triton"`` raises, ``impl="auto"`` takes the torch path)."""
    which = resolve_impl(impl, hidden, *params.values())
    if which != "triton":
        return which
    problem = None
    tensors = (hidden, *params.values())
    if any(t is not None and t.dtype not in TRITON_DTYPES for t in tensors):
        names = "/".join(("hidden", *params))
        got = "/".join(str(None if t is None else t.dtype) for t in tensors)
        problem = TypeError(f"impl='triton' supports {names} dtypes {TRITON_DTYPES}, got {got}")
    elif next_power_of_2(hidden.shape[-1]) > MAX_TRITON_HIDDEN:
        problem = ValueError(
            f"impl='triton' supports hidden sizes up to {MAX_TRITON_HIDDEN}, got {hidden.shape[-1]}"
        )
    return triton_fallback(impl, problem)


def fwd_pdl(device: torch.device, block_m: int) -> bool:
    """Whether a norm forward with ``block_m``-row tiles launches with PDL: one-row tiles only (long
    rows; with multi-row tiles the LayerNorm forward at H = 896 lost 3.3 us, pdl.PDLConfig)."""
    return block_m == 1 and pdl_launch(device, "norm_fwd")


def fwd_tiling(n_rows: int, n_cols: int, knobs: NormTuning) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, programs) of the forward launch: one program per tile
    (``fwd_num_warps``, when non-zero, overrides the warps). (Several tiles per program, the next
    one's load issued before this one is computed, was 0-1% slower at 4096-8192 x 4096 on the H200.)"""
    return _fwd_tiling(n_rows, n_cols, knobs.fwd_tile_elems, knobs.max_rows_per_tile, knobs.fwd_num_warps)


@functools.lru_cache(maxsize=1024)
def _fwd_tiling(n_rows: int, n_cols: int, tile_elems: int, max_rows: int,
                num_warps: int = 0) -> tuple[int, int, int, int]:
    block_m, block_n, warps = row_tile(n_cols, n_rows, tile_elems, max_rows)
    return block_m, block_n, num_warps or warps, -(-n_rows // block_m)


def bwd_tiling(x2: torch.Tensor, knobs: NormTuning) -> tuple[int, int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, n_blocks, programs, blocks_per_program, TILE_ACC) of the
    backward launch on ``x2`` ``[rows, H]``: short rows (``H <= bwd_small_h``) take multi-row
    tiles and a tile-shaped parameter-gradient accumulator (``TILE_ACC``), long rows a row-shaped
    one. Cached per shape, device and knob values (host time per call matters for small steps)."""
    n_rows, n_cols = x2.shape
    short = n_cols <= knobs.bwd_small_h
    tile_elems = knobs.bwd_small_h_tile_elems if short else knobs.bwd_tile_elems
    per_sm = knobs.bwd_programs_per_sm
    if not short and n_cols <= knobs.bwd_mid_h:  # mid-width settings
        tile_elems, per_sm = knobs.bwd_mid_h_tile_elems, knobs.bwd_mid_h_programs_per_sm
    return _bwd_tiling(
        n_rows, n_cols, x2.device, tile_elems, knobs.max_rows_per_tile, per_sm,
        knobs.bwd_min_rows_per_program, knobs.cpu_bwd_programs, knobs.bwd_num_warps,
    ) + (short,)


@functools.lru_cache(maxsize=1024)
def _bwd_tiling(n_rows, n_cols, device, tile_elems, max_rows, per_sm, min_rows, cpu_programs, num_warps=0):
    block_m, block_n, warps = row_tile(n_cols, n_rows, tile_elems, max_rows)
    warps = num_warps or warps
    n_blocks = -(-n_rows // block_m)
    programs = num_row_programs(
        device, n_blocks, n_rows, per_sm=per_sm, min_rows=min_rows, cpu_programs=cpu_programs,
    )
    blocks_per_program = -(-n_blocks // programs)
    programs = -(-n_blocks // blocks_per_program)
    return block_m, block_n, warps, n_blocks, programs, blocks_per_program


def partial_rows(count: int, programs: int, x2: torch.Tensor) -> Optional[torch.Tensor]:
    """The fp32 ``[count, programs, H]`` buffer of the backward's partial parameter-gradient rows
    (one allocation and one :func:`sum_partials` launch for all of them), or None for none."""
    if not count:
        return None
    return torch.empty((count, programs, x2.shape[1]), dtype=torch.float32, device=x2.device)
