"""Cross-entropy on given logits, with an online-softmax Triton kernel (``kernels.logits_tile``).

``logits [..., V]`` (bf16 / fp16 / fp32) against ``labels [...]`` (integer; ``ignore_index``
positions give zero loss and zero gradient). Per token, with ``z = softcap * tanh(x / softcap)``
(``softcap`` optional), class weights ``w`` (default 1) and smoothing ``eps``::

    loss = (1 - eps) * w[y] * (-log p_y) + eps / V * sum_v w[v] * (-log p_v) + z_loss_weight * lse**2

Reductions as ``torch.nn.functional.cross_entropy``: ``"mean"`` divides the sum by the summed
``w[y]`` of the non-ignored tokens (their count without weights), ``"sum"``, ``"none"``
(``[...]``, zeros at ignored positions). Unlike torch, an all-ignored batch gives 0 (not NaN)
with ``"mean"``. The loss is returned in the logits' dtype (as torch does); statistics are fp32.

Memory: for ``mean``/``sum`` the gradient is computed in the forward into a new buffer the size
of the logits, or -- with ``inplace_backward=True`` -- into the logits themselves. That saves the
buffer but destroys the logits' values: use it only when nothing else reads the logits
afterwards (not the caller; a matmul producing them is fine). It is done only into an autograd
intermediate's buffer (a leaf or a view of one gets a new buffer; under ``torch.no_grad()`` no
gradient is computed), and it bumps the logits' version, so an op that saved them (e.g. a softcap
``tanh`` done outside) raises autograd's in-place error instead of reading gradients.
``"none"`` keeps the logits and computes the gradient in backward with the per-token upstream
gradient. Double backward (``create_graph=True``) raises a RuntimeError.

Host synchronisation: none that drains the GPU. The label range check is queued ahead of the
kernel and its answer read after the kernel is queued (so a bad label raises ``ValueError`` from
this call, with ``inplace_backward=True`` after the logits were overwritten); the backward's
scaling by the upstream gradient is skipped on the device when that gradient is 1. Under CUDA-graph
capture the label check is skipped (out-of-range labels then count as ignored).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from liger_losses.kernels.label_stats import label_stats
from liger_losses.kernels.logits_tile import check_ce_options, logits_tile
from liger_losses.kernels.scale import scale_unless_one_
from liger_losses.kernels.utils import (
    check_choice,
    check_no_double_backward,
    check_range,
    check_same_device,
    check_tensor,
    eager_under_compile,
    finish_label_check,
    needs_input_grads,
    owns_buffer,
    resolve_impl,
    start_label_check,
)

REDUCTIONS = ("mean", "sum", "none")


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, weight, mean_scale, cfg):
        shape = logits.shape
        V = shape[-1]
        x = logits.reshape(-1, V)
        lab = labels.reshape(-1)
        red = cfg["reduction"]
        kopts = cfg["kernel_opts"]
        ctx.shape = shape
        ctx.per_token = red == "none"
        if red == "none":
            st = logits_tile(x, lab, mode="ce", grad=False, class_weight=weight,
                             need_logits_sum=False, **kopts)
            ctx.save_for_backward(logits, labels, weight)
            ctx.cfg = cfg
            return st.loss.reshape(shape[:-1]).to(logits.dtype)
        # mean: every row's gradient scale is 1 / (count or weight sum of the kept labels), a
        # 1-element device tensor from label_stats (1 when all are ignored: the loss is then 0)
        scale = mean_scale if red == "mean" else 1.0
        (grad,) = needs_input_grads(ctx, cfg["grad_enabled"], 1)
        # the gradient goes into x itself (in place) only when the buffer is an intermediate of
        # the graph (not a leaf or a view of one, which the caller owns), else into a new buffer
        inplace = (grad and cfg["inplace_backward"] and x.data_ptr() == logits.data_ptr()
                   and x.is_contiguous() and owns_buffer(logits, x))
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if grad and not inplace else None
        st = logits_tile(x, lab, mode="ce", grad=grad, grad_scale=scale, class_weight=weight,
                         need_logits_sum=False, out=out, **kopts)
        if inplace:  # an op that saved the logits (e.g. a tanh softcap) now raises, not reads grads
            torch.autograd.graph.increment_version(logits)
        total = st.loss.sum()
        loss = total * mean_scale[0] if red == "mean" else total
        # (x detached: a view made here of logits, whose version was bumped, cannot be unpacked)
        ctx.save_for_backward((x.detach() if out is None else out) if grad else None)
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_loss):
        check_no_double_backward(
            "cross_entropy", "compute the loss with torch.nn.functional.cross_entropy instead")
        if ctx.per_token:
            logits, labels, weight = ctx.saved_tensors
            cfg = ctx.cfg
            V = logits.shape[-1]
            x = logits.reshape(-1, V)
            buf = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            logits_tile(
                x, labels.reshape(-1), mode="ce", grad=True,
                grad_scale=grad_loss.reshape(-1), class_weight=weight,
                need_logits_sum=False, out=buf, **cfg["kernel_opts"],
            )
            return buf.view(ctx.shape), None, None, None, None
        (buf,) = ctx.saved_tensors
        # The usual upstream gradient is exactly 1 (loss.backward()): the kernel then returns at
        # once on the device, without a pass over [N, V] and without the host reading the value
        scale_unless_one_(buf, grad_loss.reshape(1))
        return buf.view(ctx.shape), None, None, None, None


@eager_under_compile
def cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    weight: Optional[Tensor] = None,
    inplace_backward: bool = False,
    impl: str = "auto",
) -> Tensor:
    """Cross-entropy of ``logits [..., V]`` against ``labels [...]`` (see the module docstring).
    ``weight [V]``: class weights as in torch."""
    check_tensor("logits", logits, min_ndim=1, floating=True)
    check_tensor("labels", labels, floating=False)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), got {tuple(labels.shape)}"
        )
    V = logits.shape[-1]
    check_choice("reduction", reduction, REDUCTIONS)
    check_ce_options(label_smoothing=label_smoothing, z_loss_weight=z_loss_weight, softcap=softcap)
    if weight is not None:
        check_tensor("weight", weight, ndim=1, floating=True)
        if weight.shape[0] != V:
            raise ValueError(f"weight must have shape [{V}] (one per class), got {tuple(weight.shape)}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_same_device(logits=logits, labels=labels, weight=weight)
    resolve_impl(impl, logits)
    # one launch gives the label range check's flag and the mean's scale; the flag is read after
    # the loss kernels are queued: no host synchronisation drains the GPU (utils.start_label_check)
    bad, mean_scale = label_stats(labels, V, ignore_index, weight, impl=impl)
    pending = start_label_check("labels", labels, V, ignore_index, bad=bad)
    cfg = dict(
        reduction=reduction, inplace_backward=bool(inplace_backward),
        grad_enabled=torch.is_grad_enabled(),
        kernel_opts=dict(
            ignore_index=ignore_index, label_smoothing=float(label_smoothing),
            z_loss_weight=float(z_loss_weight), softcap=None if softcap is None else float(softcap),
            impl=impl,
        ),
    )
    loss = _CrossEntropyFunction.apply(logits, labels, weight, mean_scale, cfg)
    finish_label_check(pending)
    return loss


class LigerCrossEntropyLoss(nn.Module):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` on ``[..., V]`` logits (class dim last), plus
    ``z_loss_weight`` and ``softcap``: ``forward(logits, labels)``."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        z_loss_weight: float = 0.0,
        softcap: Optional[float] = None,
        weight: Optional[Tensor] = None,
    ):
        super().__init__()
        check_choice("reduction", reduction, REDUCTIONS)
        check_range("label_smoothing", float(label_smoothing), 0.0, 1.0)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss_weight = z_loss_weight
        self.softcap = softcap
        self.register_buffer("weight", weight)

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        return cross_entropy(
            logits, labels, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            z_loss_weight=self.z_loss_weight, softcap=self.softcap, reduction=self.reduction,
            weight=self.weight,
        )
