"""Autograd glue shared by the chunked losses' ``torch.autograd.Function`` classes.

The one-pass losses compute their gradients inside the forward (chunk by chunk, while each tile
exists) and only scale them by the upstream gradient in backward (:func:`scaled_grads`); which
gradients to compute is read once from the Function's context (:func:`needs_head_grads`). Their
gradients come from the forward or from recomputed tiles, so there is no graph for
``create_graph=True``: a double backward raises with :data:`NO_DOUBLE_BACKWARD_INSTEAD`.
"""

from __future__ import annotations

from typing import Optional

from liger_losses.chunked.config import get_engine_config
from liger_losses.chunked.weights import weight_grad_like
from liger_losses.kernels.scale import scale_unless_one_
from liger_losses.kernels.utils import check_no_double_backward, needs_input_grads, triton_runs_on

# What the double-backward error of the chunked losses suggests instead.
NO_DOUBLE_BACKWARD_INSTEAD = (
    "compute the logits (hidden @ weight.T) and use a plain PyTorch loss for second-order terms "
    "(apply_liger_kernels(..., cross_entropy=False) for patched models)"
)


def check_no_double_backward_of_loss() -> None:
    """Raise when a chunked loss is differentiated with ``create_graph=True``."""
    check_no_double_backward("a fused-linear loss", NO_DOUBLE_BACKWARD_INSTEAD)


def needs_head_grads(ctx, grad_enabled: bool) -> tuple[bool, bool, bool]:
    """``(needs_weight, needs_hidden, needs_bias)`` of a fused-linear ``autograd.Function`` whose
    first inputs are ``(weight, hidden, bias)`` (:func:`~liger_losses.kernels.utils.needs_input_grads`:
    all False when grad mode was off at ``.apply``, so the one-pass losses run no gradient GEMM
    during evaluation)."""
    return needs_input_grads(ctx, grad_enabled, 3)


def save_forward_grads(ctx, weight, grad_hidden, grad_weight, grad_bias, needs_weight: bool) -> None:
    """Keep the gradients a forward computed for :func:`scaled_grads`."""
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
    ctx.weight_ref = weight if needs_weight else None
    ctx.has = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)


def scaled_grads(ctx, grad_scale, saved: Optional[tuple] = None):
    """Multiply the gradients computed in forward (:func:`save_forward_grads`) by the upstream
    scalar (in place, once); returns ``(grad_hidden, grad_weight, grad_bias)`` (None where not
    computed), the weight gradient in the weight's dtype and layout."""
    check_no_double_backward_of_loss()
    if getattr(ctx, "consumed", False):
        raise RuntimeError(
            "backward through a fused-linear loss ran twice; its gradients are computed in the "
            "forward and released by the first backward (retain_graph is not supported)"
        )
    ctx.consumed = True
    gh, gw, gb = ctx.saved_tensors[:3] if saved is None else saved
    has_h, has_w, has_b = ctx.has
    # The usual upstream gradient of a loss is exactly 1: skip the in-place passes over the
    # [V, H] weight gradient. Default: one host sync here (outside any chunk loop) reads the value.
    # device_scale: no sync -- a kernel whose programs read the value and return when it is 1.
    if grad_scale.numel() == 1 and get_engine_config().device_scale and grad_scale.is_floating_point() \
            and triton_runs_on(grad_scale.device):
        def scale(t):
            return scale_unless_one_(t, grad_scale)
    elif grad_scale.numel() == 1 and bool(grad_scale == 1):
        scale = None
    else:
        def scale(t):
            return t.mul_(grad_scale)
    out = []
    if has_h:
        out.append(gh if scale is None else scale(gh))
    else:
        out.append(None)
    if has_w:
        if scale is not None:
            scale(gw)
        w = ctx.weight_ref
        g = gw if gw.dtype == w.dtype else gw.to(w.dtype)
        out.append(weight_grad_like(w, g))
    else:
        out.append(None)
    if has_b:
        out.append(gb if scale is None else scale(gb))
    else:
        out.append(None)
    return tuple(out)
