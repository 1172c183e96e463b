"""GeGLU: ``gelu(gate, approximate) * up`` on the gated Triton kernels (:mod:`gated`, ``ACT`` 1/2).

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
    GEGLU_TUNING           the kernels' launch knobs (a gated.GatedTuning slot)
The Gemma MLP module is :class:`liger_losses.kernels.mlp.LigerGEGLUMLP`.
"""

from __future__ import annotations

import torch

from liger_losses.kernels.gated import (
    ACTIVATIONS,
    GatedTuning,
    checked_gated_impl,
    gated_backward,
    gated_bwd_kernel,
    gated_forward,
    gated_fwd_kernel,
    gated_torch,
)
from liger_losses.kernels.tuning import register
from liger_losses.kernels.utils import check_choice

APPROXIMATIONS = ("tanh", "none")
GATED_ACTIVATION = {"tanh": "gelu_tanh", "none": "gelu"}  # approximate -> gated.ACTIVATIONS key
# Elements per program and warps (read at launch time).
GEGLU_TUNING = register("geglu", GatedTuning())


class GEGLUFunction(torch.autograd.Function):
    """gelu(gate) * up; saves gate and up only. ``inplace_backward`` writes grads into them."""

    @staticmethod
    def forward(ctx, gate, up, approximate="tanh", inplace_backward=False):
        ctx.act = ACTIVATIONS[GATED_ACTIVATION[approximate]]
        return gated_forward(ctx, gate, up, inplace_backward, gated_fwd_kernel, GEGLU_TUNING.current, ACT=ctx.act)

    @staticmethod
    def backward(ctx, grad_out):
        grads = gated_backward(ctx, grad_out, gated_bwd_kernel, GEGLU_TUNING.current, ACT=ctx.act,
                               WRITE_PROD=False)
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
    which = checked_gated_impl(gate, up, inplace_backward, impl, approximate,
                               check_options=lambda: check_choice("approximate", approximate, APPROXIMATIONS))
    if which == "torch":
        return gated_torch(gate, up, GATED_ACTIVATION[approximate])
    return GEGLUFunction.apply(gate, up, approximate, inplace_backward)


liger_geglu = geglu
