"""In-place multiply by a scalar that lives on the device, skipped on the device when it is 1.

``scale_unless_one_(x, scale)``: ``x`` (any float dtype, contiguous) ``*= scale`` (a 1-element
float tensor on ``x``'s device), computed in fp32 and rounded once to ``x``'s dtype -- what
``x.mul_(scale)`` gives. Every program of the Triton kernel reads ``scale`` first and returns when
it is exactly 1, so the usual upstream gradient of a loss (1) costs one launch instead of a read and
a write of ``x``, and the host never reads the value (no device-to-host sync). Used by the chunked
engine's backward to scale gradients computed in the forward (``EngineConfig.device_scale``).

Without Triton on ``x``'s device (or for non-contiguous ``x``) the same product in PyTorch (in
``scale``'s dtype when it is wider than ``x``'s, slab by slab).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import device_ctx, import_triton, num_sms, triton_runs_on

triton, tl = import_triton()


@dataclass(frozen=True)
class ScaleTuning(Knobs):
    """Launch knobs of the scale kernel (slot ``scale``): ``block`` elements per tile (a power of
    2), ``num_warps``, and ``programs_per_sm`` of the persistent grid (the early exit then costs a
    few hundred programs, not one per block)."""

    block: int = knob(8192, minimum=1)
    num_warps: int = knob(8, minimum=1)
    programs_per_sm: int = knob(4, minimum=1)


SCALE_TUNING = register("scale", ScaleTuning())
_SLAB = 1 << 20  # elements per step of the PyTorch path's widened multiply

if triton is not None:

    @triton.jit
    def _scale_unless_one_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
        """Programs stride over ``x`` in BLOCK-element tiles; all return at once when scale == 1."""
        s = tl.load(scale_ptr).to(tl.float32)
        if s != 1.0:
            pid = tl.program_id(0).to(tl.int64)
            step = tl.num_programs(0).to(tl.int64) * BLOCK
            offs = tl.arange(0, BLOCK)
            for start in range(pid * BLOCK, n, step):
                idx = start + offs
                mask = idx < n
                x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                tl.store(x_ptr + idx, (x * s).to(x_ptr.dtype.element_ty), mask=mask)

    _scale_unless_one_kernel = fast_kernel(_scale_unless_one_kernel)


def scale_unless_one_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x *= scale`` in place (see the module docstring); returns ``x``."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        raise ValueError(f"scale must be a 1-element tensor, got {scale!r}")
    if scale.device != x.device:
        raise ValueError(f"scale must be on x's device ({x.device}), got {scale.device}")
    if not (x.is_floating_point() and scale.is_floating_point()):
        raise TypeError(f"x and scale must be floating point, got {x.dtype} and {scale.dtype}")
    if x.numel() == 0:
        return x
    if not x.is_contiguous() or not triton_runs_on(x.device):
        s = scale.reshape(())
        if x.element_size() >= s.element_size():
            return x.mul_(s)
        # x.mul_(s) would round s to x's (narrower) dtype first: compute in s's dtype, a slab at a time
        flat = x.view(-1) if x.is_contiguous() else None
        if flat is None:
            return x.copy_(x.to(s.dtype) * s)
        for i in range(0, flat.numel(), _SLAB):
            part = flat[i:i + _SLAB]
            part.copy_(part.to(s.dtype) * s)
        return x
    n = x.numel()
    knobs = SCALE_TUNING.current
    tiles = -(-n // knobs.block)
    on_gpu = x.device.type == "cuda"  # else the interpreter on the CPU
    programs = min(tiles, knobs.programs_per_sm * num_sms(x.device) if on_gpu else 4)
    with device_ctx(x):
        _scale_unless_one_kernel[(programs,)](x, scale.reshape(1), n, BLOCK=knobs.block, num_warps=knobs.num_warps)
    return x
