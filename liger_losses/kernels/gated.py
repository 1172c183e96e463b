"""Host-side pieces shared by the gated pointwise kernels ``act(gate) * up`` (:mod:`swiglu`,
:mod:`geglu`): input checks, the row-split launch, and the autograd forward/backward bodies.

``gate`` and ``up`` have one shape ``[..., I]`` and dtype; the kernels see them as 2-D views
``[rows, I]`` (:func:`~liger_losses.kernels.utils.pair_rows`) on a grid ``(cdiv(I, BLOCK), rows)``;
each kernel takes ``(*pointers, I, *row_strides, BLOCK)`` (+ its own constexprs).
The backward writes ``d_gate``/``d_up`` into fresh tensors, or with ``inplace_backward`` into the
buffers of ``gate`` and ``up`` (only when the caller owns them: see :mod:`swiglu`).
"""

from __future__ import annotations

import torch

from liger_losses.kernels.utils import (
    MAX_GRID_Y,
    check_same_device,
    check_tensor,
    device_ctx,
    owns_buffer,
    pair_rows,
)


def check_gate_up(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise unless ``gate`` and ``up`` are float tensors of one shape, dtype and device."""
    check_tensor("gate", gate, min_ndim=1, floating=True)
    check_tensor("up", up, min_ndim=1, floating=True)
    if up.shape != gate.shape:
        raise ValueError(
            f"up must have the same shape as gate {tuple(gate.shape)}, got {tuple(up.shape)}"
        )
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have gate's dtype {gate.dtype}, got {up.dtype}")
    check_same_device(gate=gate, up=up)


def check_inplace_backward(inplace_backward) -> None:
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {type(inplace_backward).__name__}")


def launch_rows(kernel, tensors, knobs, **constexprs) -> None:
    """Launch ``kernel[(cdiv(I, BLOCK), rows)](*tensors, I, *row_strides, ...)`` over the 2-D
    ``tensors`` (all ``[rows, I]``), ``BLOCK``/``num_warps`` read from ``knobs.BLOCK_SIZE`` /
    ``knobs.NUM_WARPS`` at call time (the benchmark sweeps them), in slices of at most
    ``MAX_GRID_Y`` rows (the grid's second axis holds at most 65535 programs; the usual one flat
    row takes one launch)."""
    rows, n_cols = tensors[0].shape
    strides = tuple(t.stride(0) for t in tensors)
    block = knobs.BLOCK_SIZE
    grid_x = -(-n_cols // block)
    with device_ctx(tensors[0]):
        for r0 in range(0, rows, MAX_GRID_Y):
            r1 = min(rows, r0 + MAX_GRID_Y)
            views = tensors if r1 - r0 == rows else [t[r0:r1] for t in tensors]
            kernel[(grid_x, r1 - r0)](
                *views, n_cols, *strides, BLOCK=block, num_warps=knobs.NUM_WARPS, **constexprs
            )


def gated_forward(ctx, gate, up, inplace_backward, kernel, knobs, **constexprs) -> torch.Tensor:
    """Autograd forward: ``kernel`` over the 2-D views (:func:`launch_rows`) into an output made
    in gate's shape (returned as is, not as a view made here, so callers may modify it in
    place); saves gate and up and whether the backward may write into their buffers."""
    a2, b2 = pair_rows(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        launch_rows(kernel, (a2, b2, out.view(a2.shape)), knobs, **constexprs)
    ctx.inplace = bool(
        inplace_backward
        and owns_buffer(gate, a2) and owns_buffer(up, b2)
        and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
    )
    ctx.save_for_backward(gate, up)
    return out


def guard_second_backward(ctx) -> None:
    """Raise a RuntimeError that names the cause when an in-place backward (``ctx.inplace``) runs a
    second time through the same graph (``retain_graph=True``): the first one overwrote the saved
    inputs with the gradients (autograd's own error would only name a version counter)."""
    if ctx.inplace and getattr(ctx, "backward_done", False):
        raise RuntimeError(
            "a second backward through this gated MLP (retain_graph=True) is not supported with "
            "inplace_backward=True: the first backward wrote the gradients into the saved gate/up "
            "buffers; use inplace_backward=False (apply_liger_kernels(..., swiglu=False/geglu=False) "
            "for patched models)"
        )
    ctx.backward_done = True


def gated_backward(ctx, grad_out, kernel, knobs, **constexprs) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd backward: ``kernel(dc, a, b, da, db)`` over the 2-D views; returns
    (grad_gate, grad_up). With the in-place backward a second backward through the same graph
    (``retain_graph=True``) raises a RuntimeError saying so (the first one overwrote gate and up)."""
    guard_second_backward(ctx)
    gate, up = ctx.saved_tensors
    a2, b2 = pair_rows(gate, up)
    dc2 = grad_out.contiguous().view(a2.shape)
    if ctx.inplace:
        da2, db2 = a2, b2
    else:
        da2 = torch.empty(a2.shape, dtype=gate.dtype, device=gate.device)
        db2 = torch.empty(b2.shape, dtype=up.dtype, device=up.device)
    if da2.numel():
        launch_rows(kernel, (dc2, a2, b2, da2, db2), knobs, **constexprs)
    if ctx.inplace:
        # Anyone else who saved gate/up now gets a loud version-counter error, not wrong grads.
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
        return gate, up
    return da2.view(gate.shape), db2.view(up.shape)
