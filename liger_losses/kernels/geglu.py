"""GeGLU: ``gelu(gate, approximate) * up`` on the gated Triton kernels (:mod:`gated`, ``ACT`` 1/2), and the Gemma MLP.

Shapes: ``gate`` and ``up`` have the same shape ``[..., I]`` (any leading dims); so does the output.
Dtypes: any float dtype; the math runs in fp32 inside the kernel, results are stored in the input
dtype. ``approximate="tanh"`` is Hugging Face's ``gelu_pytorch_tanh`` (Gemma),
``approximate="none"`` the exact erf GELU.

    tanh:  gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
           gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    none:  gelu(x) = 0.5 x (1 + erf(x / sqrt(2))),  gelu'(x) = 0.5 (1 + erf(x / sqrt(2))) + x phi(x)

Backward recomputes gelu from the saved ``gate`` and ``up`` (nothing else is saved):
``d_up = d_out * gelu(gate)``, ``d_gate = d_out * up * gelu'(gate)``. ``inplace_backward=True``
writes them into gate's and up's buffers, exactly as in :mod:`liger_losses.kernels.swiglu`
(only for callers that own those tensors; the Gemma MLP module does).

Public API:
    geglu(gate, up, *, approximate="tanh", inplace_backward=False, impl="auto") -> Tensor
    LigerGEGLUMLP(config)   drop-in for GemmaMLP
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
)
from liger_losses.kernels.gated_down import mlp_tail
from liger_losses.kernels.utils import check_choice, resolve_impl

APPROXIMATIONS = ("tanh", "none")
_ACTIVATION = {"tanh": "gelu_tanh", "none": "gelu"}  # approximate -> gated.ACTIVATIONS key
# Elements per program and warps (read at launch time by gated.launch_rows: the benchmark sweeps them).
BLOCK_SIZE = 4096
NUM_WARPS = 8
_KNOBS = sys.modules[__name__]


class GEGLUFunction(torch.autograd.Function):
    """gelu(gate) * up; saves gate and up only. ``inplace_backward`` writes grads into them."""

    @staticmethod
    def forward(ctx, gate, up, approximate="tanh", inplace_backward=False):
        ctx.act = ACTIVATIONS[_ACTIVATION[approximate]]
        return gated_forward(ctx, gate, up, inplace_backward, gated_fwd_kernel, _KNOBS, ACT=ctx.act)

    @staticmethod
    def backward(ctx, grad_out):
        grads = gated_backward(ctx, grad_out, gated_bwd_kernel, _KNOBS, ACT=ctx.act, WRITE_PROD=False)
        return (*grads, None, None)


def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    approximate: str = "tanh",
    inplace_backward: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """``gelu(gate, approximate) * up`` (same shape as the inputs), fp32 inside, gate's dtype out."""
    check_gate_up(gate, up)
    check_choice("approximate", approximate, APPROXIMATIONS)
    check_inplace_backward(inplace_backward)
    if resolve_impl(impl, gate, up) == "torch":
        return gated_torch(gate, up, _ACTIVATION[approximate])
    return GEGLUFunction.apply(gate, up, approximate, inplace_backward)


# Hugging Face activation names (ACT2FN) -> approximate.
_GELU_NAMES = {
    "gelu_pytorch_tanh": "tanh",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
    "gelu": "none",
}


class LigerGEGLUMLP(nn.Module):
    """Drop-in for ``GemmaMLP``: gate_proj, up_proj, down_proj without bias, same forward.

    ``forward(x) = down_proj(geglu(gate_proj(x), up_proj(x)))`` with the GELU variant named by
    ``config.hidden_act`` (or the older ``config.hidden_activation``), ``gelu_pytorch_tanh`` by default;
    the product is never stored whole when down_proj is a plain ``nn.Linear``
    (:func:`~liger_losses.kernels.gated_down.mlp_tail`).
    """

    def __init__(self, config, *, impl: str = "auto"):
        super().__init__()
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        act = act or "gelu_pytorch_tanh"
        if act not in _GELU_NAMES:
            raise ValueError(
                f"config.hidden_act must be one of {tuple(_GELU_NAMES)} for a GeGLU MLP, got {act!r}"
            )
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.approximate = _GELU_NAMES[act]
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_tail(self.down_proj, self.gate_proj(x), self.up_proj(x),
                        activation=_ACTIVATION[self.approximate], impl=self.impl)


liger_geglu = geglu
