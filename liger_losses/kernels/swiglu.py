"""SwiGLU: ``silu(gate) * up`` on the gated Triton kernels (:mod:`gated`, ``ACT`` 0).

Shapes: ``gate`` and ``up`` have the same shape ``[..., I]`` (any leading dims); the output has that
shape too. ``swiglu_packed(gate_up)`` takes the Phi-3 layout ``[..., 2I]`` (gate first, then up) and
returns ``[..., I]``. Dtypes: any float dtype (fp32, bf16, fp16); the math runs in fp32 inside the
kernel and results are stored in the input dtype.

Backward recomputes ``sigmoid(gate)`` from the saved ``gate`` and ``up`` (nothing else is saved):

    d_up   = d_out * silu(gate)
    d_gate = d_out * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))

By default the gradients go to fresh tensors. With ``inplace_backward=True`` they are written
into the buffers of ``gate`` and ``up`` (no extra memory in backward); that is only right when the
caller owns those tensors, as the MLP modules here do (``gate_proj(x)`` is seen by nobody else).
The buffers' autograd version counters are bumped, so a graph that did save them elsewhere fails
loudly ("modified by an inplace operation") instead of computing a wrong gradient.

Public API:
    swiglu(gate, up, *, inplace_backward=False, impl="auto") -> Tensor
    swiglu_packed(gate_up, *, inplace_backward=False, impl="auto") -> Tensor
    SWIGLU_TUNING               the kernels' launch knobs (a gated.GatedTuning slot)
The SwiGLU MLP modules are in :mod:`liger_losses.kernels.mlp`.
"""

from __future__ import annotations

import torch

from liger_losses.kernels.gated import (
    ACTIVATIONS,
    GatedTuning,
    check_inplace_backward,
    checked_gated_impl,
    gated_backward,
    gated_bwd_kernel,
    gated_forward,
    gated_fwd_kernel,
    gated_torch,
    guard_second_backward,
    launch_rows,
    writes_grads_inplace,
)
from liger_losses.kernels.tuning import register
from liger_losses.kernels.utils import check_tensor, resolve_impl

SILU = ACTIVATIONS["silu"]

# Elements per program and warps of the pointwise kernels (read at launch time).
SWIGLU_TUNING = register("swiglu", GatedTuning())


# --------------------------------------------------------------------------- autograd


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up; saves gate and up only. ``inplace_backward`` writes grads into them."""

    @staticmethod
    def forward(ctx, gate, up, inplace_backward=False):
        return gated_forward(ctx, gate, up, inplace_backward, gated_fwd_kernel, SWIGLU_TUNING.current, ACT=SILU)

    @staticmethod
    def backward(ctx, grad_out):
        return (*gated_backward(ctx, grad_out, gated_bwd_kernel, SWIGLU_TUNING.current, ACT=SILU,
                                WRITE_PROD=False), None)


class SwiGLUPackedFunction(torch.autograd.Function):
    """silu(gate) * up with ``gate, up = gate_up.chunk(2, -1)``; the gradient is one ``[..., 2I]``."""

    @staticmethod
    def forward(ctx, gate_up, inplace_backward=False):
        inter = gate_up.shape[-1] // 2
        gu2 = gate_up.contiguous().view(-1, 2 * inter)
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
        if out.numel():
            launch_rows(gated_fwd_kernel, (gu2[:, :inter], gu2[:, inter:], out.view(-1, inter)),
                        SWIGLU_TUNING.current, ACT=SILU)
        ctx.inplace = writes_grads_inplace(inplace_backward, gate_up, gu2)
        # the contiguous copy when one was made (the backward reads it again), else gate_up itself
        ctx.save_for_backward(gate_up if gate_up.is_contiguous() else gu2)
        ctx.shape = gate_up.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        guard_second_backward(ctx)
        (saved,) = ctx.saved_tensors
        inter = ctx.shape[-1] // 2
        gu2 = saved.view(-1, 2 * inter)
        d2 = gu2 if ctx.inplace else torch.empty_like(gu2)
        if d2.numel():
            dc2 = grad_out.contiguous().view(-1, inter)
            launch_rows(
                gated_bwd_kernel,
                (dc2, gu2[:, :inter], gu2[:, inter:], d2[:, :inter], d2[:, inter:]), SWIGLU_TUNING.current,
                ACT=SILU, WRITE_PROD=False,
            )
        if ctx.inplace:
            torch.autograd.graph.increment_version(saved)
            return saved, None
        return d2.view(ctx.shape), None


# --------------------------------------------------------------------------- public functions


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    inplace_backward: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """``silu(gate) * up`` (same shape as the inputs), computed in fp32, stored in gate's dtype.

    ``inplace_backward=True`` writes the gradients into gate's and up's buffers (see the module
    docstring: only for callers that own those tensors).
    """
    if checked_gated_impl(gate, up, inplace_backward, impl) == "torch":
        return gated_torch(gate, up, "silu")
    return SwiGLUFunction.apply(gate, up, inplace_backward)


def swiglu_packed(
    gate_up: torch.Tensor,
    *,
    inplace_backward: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = gate_up.chunk(2, dim=-1)`` (Phi-3): ``[..., 2I] -> [..., I]``."""
    check_tensor("gate_up", gate_up, min_ndim=1, floating=True)
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up must have an even last dimension (2 * intermediate_size), got shape {tuple(gate_up.shape)}"
        )
    check_inplace_backward(inplace_backward)
    if resolve_impl(impl, gate_up) == "torch":
        gate, up = gate_up.chunk(2, dim=-1)
        return gated_torch(gate, up, "silu")
    return SwiGLUPackedFunction.apply(gate_up, inplace_backward)


liger_swiglu = swiglu
