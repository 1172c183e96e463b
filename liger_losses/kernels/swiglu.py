"""SwiGLU: ``silu(gate) * up`` on the gated Triton kernels (:mod:`gated`, ``ACT`` 0), and the SwiGLU MLP modules.

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
    LigerSwiGLUMLP(config)       drop-in for LlamaMLP / Qwen2MLP / MistralMLP
    LigerPhi3SwiGLUMLP(config)   drop-in for Phi3MLP (fused gate_up_proj)
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from liger_losses.kernels.gated import (
    ACTIVATIONS,
    check_gate_up,
    check_inplace_backward,
    gated_backward,
    gated_bwd_kernel,
    gated_forward,
    gated_fwd_kernel,
    gated_torch,
    guard_second_backward,
    launch_rows,
    writes_grads_inplace,
)
from liger_losses.kernels.gated_down import mlp_tail
from liger_losses.kernels.utils import check_tensor, resolve_impl

SILU = ACTIVATIONS["silu"]

# Elements per program and warps of the pointwise kernels: 16 elements (two 16-byte bf16
# vectors) per thread. Module constants read at launch time (gated.launch_rows), so the
# benchmark can sweep them.
BLOCK_SIZE = 4096
NUM_WARPS = 8
_KNOBS = sys.modules[__name__]


# --------------------------------------------------------------------------- autograd


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up; saves gate and up only. ``inplace_backward`` writes grads into them."""

    @staticmethod
    def forward(ctx, gate, up, inplace_backward=False):
        return gated_forward(ctx, gate, up, inplace_backward, gated_fwd_kernel, _KNOBS, ACT=SILU)

    @staticmethod
    def backward(ctx, grad_out):
        return (*gated_backward(ctx, grad_out, gated_bwd_kernel, _KNOBS, ACT=SILU, WRITE_PROD=False), None)


class SwiGLUPackedFunction(torch.autograd.Function):
    """silu(gate) * up with ``gate, up = gate_up.chunk(2, -1)``; the gradient is one ``[..., 2I]``."""

    @staticmethod
    def forward(ctx, gate_up, inplace_backward=False):
        inter = gate_up.shape[-1] // 2
        gu2 = gate_up.contiguous().view(-1, 2 * inter)
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
        if out.numel():
            launch_rows(gated_fwd_kernel, (gu2[:, :inter], gu2[:, inter:], out.view(-1, inter)), _KNOBS, ACT=SILU)
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
                (dc2, gu2[:, :inter], gu2[:, inter:], d2[:, :inter], d2[:, inter:]), _KNOBS,
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
    check_gate_up(gate, up)
    check_inplace_backward(inplace_backward)
    if resolve_impl(impl, gate, up) == "torch":
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


# --------------------------------------------------------------------------- modules

_SILU_NAMES = ("silu", "swish")


def _check_silu(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in _SILU_NAMES:
        raise ValueError(f"config.hidden_act must be one of {_SILU_NAMES} for a SwiGLU MLP, got {act!r}")


class LigerSwiGLUMLP(nn.Module):
    """Drop-in for ``LlamaMLP`` / ``Qwen2MLP`` / ``MistralMLP``: same parameters and forward.

    ``forward(x) = down_proj(swiglu(gate_proj(x), up_proj(x)))``, ``x: [..., hidden_size]``, with
    the product never stored whole (:func:`~liger_losses.kernels.gated_down.mlp_tail`) when
    down_proj is a plain ``nn.Linear``. The gradients of the (private) gate/up projections'
    outputs are written in place.
    """

    def __init__(self, config, *, impl: str = "auto"):
        super().__init__()
        _check_silu(config)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_tail(self.down_proj, self.gate_proj(x), self.up_proj(x), activation="silu", impl=self.impl)


class LigerPhi3SwiGLUMLP(nn.Module):
    """Drop-in for ``Phi3MLP``: ``gate_up_proj`` (hidden -> 2I, no bias) and ``down_proj`` (I -> hidden)."""

    def __init__(self, config, *, impl: str = "auto"):
        super().__init__()
        _check_silu(config)
        self.config = config
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.impl = impl

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return mlp_tail(self.down_proj, self.gate_up_proj(hidden_states), None, activation="silu", impl=self.impl)


liger_swiglu = swiglu
