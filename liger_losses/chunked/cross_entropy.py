"""Fused linear cross-entropy: ``CE(hidden @ weight.T + bias, labels)`` without whole logits.

``weight [V, H]``, ``hidden [..., H]``, ``labels [...]`` (integer, ``ignore_index`` allowed),
``bias [V]`` optional. Logits are transformed as in ``kernels.logits_tile`` (``logit_scale``,
then ``softcap * tanh(. / softcap)``); the per-token loss is
``(1 - eps) * nll + eps * mean_v(-log p_v) + z_loss_weight * lse**2``.

Reductions: ``"mean"`` (sum over non-ignored tokens divided by their count, or by
``num_items_in_batch`` when given -- Hugging Face's convention for gradient accumulation),
``"sum"``, ``"none"`` (``[...]``, zeros at ignored positions). All-ignored input gives 0.

``mean``/``sum``: gradients are computed in the forward, chunk by chunk (one pass, no
recompute) and scaled by ``grad_output`` in backward. ``none``: the forward only computes the
losses; backward recomputes each tile with the per-token upstream gradient as the row scale.
Tiles and GEMMs run in the compute dtype (autocast dtype, else the weight dtype); the loss is
float32; gradients have the dtypes of their inputs.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from liger_losses.chunked.engine import (
    NO_DOUBLE_BACKWARD_INSTEAD,
    _check_common,
    _needs_input_grads,
    _scaled_grads,
    grad_like,
    hidden_rows_at,
    compute_dtype,
    gather_weight,
    run_tiles,
    run_token_tiles,
    scatter_rows,
    weight_grad_like,
)
from liger_losses.chunked.output import LossOutput
from liger_losses.kernels.utils import check_choice, check_no_double_backward, check_range

REDUCTIONS = ("mean", "sum", "none")


def _check_options(reduction, label_smoothing, z_loss_weight):
    check_choice("reduction", reduction, REDUCTIONS)
    check_range("label_smoothing", float(label_smoothing), 0.0, 1.0)
    check_range("z_loss_weight", float(z_loss_weight), 0.0, None)


def _full_weight(weight, cfg):
    """``(w_full, w_c)``: the gathered ``[V, H]`` weight and the same in the compute dtype."""
    w_full = gather_weight(weight)
    cdt = cfg["compute_dtype"]
    return w_full, (w_full if w_full.dtype == cdt else w_full.to(cdt))


def _sink_stats(sink, stats, num_tokens, cfg):
    """The metrics' raw sums of one forward (valid tokens, argmax hits, z-loss, entropy)."""
    sink["num_tokens"] = num_tokens
    sink["correct"] = stats["correct"].sum()
    sink["z_sum"] = (stats["lse"] ** 2).sum() * cfg["z_loss_weight"]
    if cfg["need_entropy"]:
        sink["entropy_sum"] = stats["entropy"].sum()


class _FusedLinearCEFunction(torch.autograd.Function):
    """mean / sum: gradients computed in forward."""

    @staticmethod
    def forward(ctx, weight, hidden, bias, labels, denom, cfg, sink):
        needs_w, needs_h, needs_b = _needs_input_grads(ctx, cfg["grad_enabled"])
        needs_b = needs_b and bias is not None
        w_full, w_c = _full_weight(weight, cfg)
        grad = needs_h or needs_w or needs_b
        scale = 1.0
        if denom is not None:  # 1/denom applied in the kernel (fp32), not to bf16 gradients later
            scale = (1.0 / denom).reshape(1).expand(labels.numel()).contiguous()
        # the first chunk is issued before the host sync (engine.SPECULATIVE_FIRST_CHUNK)
        stats, gh, gw, gb, l_valid, _ = run_token_tiles(
            w_c, hidden, labels, bias, ignore_index=cfg["ignore_index"], mode="ce", grad=grad,
            grad_scale=scale, kernel_opts=cfg["kernel_opts"], need_entropy=cfg["need_entropy"],
            chunk_tokens=cfg["chunk_tokens"], accum_dtype=cfg["accum_dtype"] or w_full.dtype,
            needs_hidden=needs_h, needs_weight=needs_w, needs_bias=needs_b,
        )
        total = stats["loss"].sum()
        loss = total / denom if denom is not None else total
        _sink_stats(sink, stats, l_valid.shape[0], cfg)
        if gh is not None:
            gh = grad_like(gh, hidden)
        ctx.save_for_backward(gh, gw, gb)
        ctx.has = (gh is not None, gw is not None, gb is not None)
        ctx.weight_ref = weight
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        gh, gw, gb = _scaled_grads(ctx, grad_loss)
        return gw, gh, gb, None, None, None, None


class _FusedLinearCENoneFunction(torch.autograd.Function):
    """reduction none: forward statistics only; backward recomputes tiles with row scales."""

    @staticmethod
    def forward(ctx, weight, hidden, bias, labels, cfg, sink):
        stats, index = _stats_forward(ctx, weight, hidden, bias, labels, cfg, "ce",
                                      need_entropy=cfg["need_entropy"])
        _sink_stats(sink, stats, index.shape[0], cfg)
        return _scatter_token_values(stats["loss"], index, labels)

    @staticmethod
    def backward(ctx, grad_out):
        return _recompute_saved_backward(ctx, grad_out, "ce")


def _stats_forward(ctx, weight, hidden, bias, labels, cfg, mode, **run_opts):
    """Forward of a per-token function whose backward recomputes: tile statistics (no grad) of the
    valid tokens and their flat ``index``; saves the inputs, the valid tokens' labels and ``index``
    (so backward needs no second ``nonzero`` host sync) and ``cfg`` for
    :func:`_recompute_saved_backward`."""
    with torch.no_grad():
        _, w_c = _full_weight(weight, cfg)
        stats, _, _, _, l_valid, index = run_token_tiles(  # first chunk before the host sync
            w_c, hidden, labels, bias, ignore_index=cfg["ignore_index"], mode=mode, grad=False,
            kernel_opts=cfg["kernel_opts"], chunk_tokens=cfg["chunk_tokens"], **run_opts,
        )
    ctx.save_for_backward(weight, hidden, bias, l_valid, index)
    ctx.cfg = cfg
    return stats, index


def _scatter_token_values(values, index, labels):
    """``[N_valid]`` per-token values back to ``labels``' shape, 0 at ignored positions."""
    return scatter_rows(values.unsqueeze(1), index, tuple(labels.shape) + (1,)).squeeze(-1)


def _recompute_saved_backward(ctx, grad_out, mode):
    """Backward of ``f(weight, hidden, bias, labels, cfg, sink)`` saved by :func:`_stats_forward`."""
    check_no_double_backward("a fused-linear loss", NO_DOUBLE_BACKWARD_INSTEAD)
    weight, hidden, bias, l_valid, index = ctx.saved_tensors
    return _recompute_backward(ctx, weight, hidden, bias, l_valid, index, grad_out, ctx.cfg, mode) + (None, None, None)


def _recompute_backward(ctx, weight, hidden, bias, l_valid, index, grad_out, cfg, mode):
    """(grad_weight, grad_hidden, grad_bias) of sum(grad_out * per-token objective); ``l_valid``
    and ``index`` are the valid tokens' labels and flat positions saved by :func:`_stats_forward`."""
    needs_w, needs_h, needs_b = ctx.needs_input_grad[:3]
    needs_b = needs_b and bias is not None
    w_full, w_c = _full_weight(weight, cfg)
    rows = hidden_rows_at(hidden, index)
    scale = grad_out.reshape(-1).float()
    scale = scale.index_select(0, index) if scale.shape[0] != index.shape[0] else scale
    _, gh, gw, gb = run_tiles(
        w_c, rows, l_valid, bias, mode=mode, grad=True, grad_scale=scale.contiguous(),
        kernel_opts=cfg["kernel_opts"], chunk_tokens=cfg["chunk_tokens"],
        accum_dtype=cfg.get("accum_dtype") or w_full.dtype,
        needs_hidden=needs_h, needs_weight=needs_w, needs_bias=needs_b,
    )
    if gh is not None:
        gh = grad_like(gh, hidden)
    if gw is not None:
        gw = weight_grad_like(weight, gw if gw.dtype == weight.dtype else gw.to(weight.dtype))
    if gb is not None:
        gb = gb.to(bias.dtype)
    return gw, gh, gb


def fused_linear_cross_entropy(
    weight: Tensor,
    hidden: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_weight: float = 0.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    reduction: str = "mean",
    num_items_in_batch: Optional[Union[int, float, Tensor]] = None,
    return_token_accuracy: bool = False,
    return_z_loss: bool = False,
    return_entropy: bool = False,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
):
    """Cross-entropy of ``hidden [..., H] @ weight[V, H].T (+ bias)`` against ``labels [...]``.

    Returns the loss (0-d for mean/sum, ``[...]`` for none) or, when ``return_token_accuracy``,
    ``return_z_loss`` or ``return_entropy``, ``LossOutput(loss, metrics)`` with
    ``metrics["token_accuracy"]`` (share of non-ignored tokens whose argmax is the label),
    ``metrics["z_loss"]`` (the z-loss part of the loss, reduced like the loss; mean over valid
    tokens for ``none``) and ``metrics["entropy"]`` (mean softmax entropy of the non-ignored
    tokens, from the same tiles: no extra GEMM), all detached.
    """
    _check_options(reduction, label_smoothing, z_loss_weight)
    _check_common(weight, hidden, labels, bias, ignore_index, 1.0, softcap, logit_scale,
                  chunk_tokens, accum_dtype, impl)
    denom = None
    if num_items_in_batch is not None:
        if reduction != "mean":
            raise ValueError(
                f"num_items_in_batch only applies to reduction='mean', got reduction={reduction!r}"
            )
        if isinstance(num_items_in_batch, Tensor):
            if num_items_in_batch.numel() != 1:
                raise ValueError(
                    f"num_items_in_batch must be a number or a 1-element tensor, got shape "
                    f"{tuple(num_items_in_batch.shape)}"
                )
            denom = num_items_in_batch.detach().reshape(()).to(device=hidden.device, dtype=torch.float32)
        else:
            if float(num_items_in_batch) <= 0:
                raise ValueError(f"num_items_in_batch must be positive, got {num_items_in_batch!r}")
            denom = torch.full((), float(num_items_in_batch), dtype=torch.float32, device=hidden.device)
    cfg = dict(
        ignore_index=ignore_index, compute_dtype=compute_dtype(weight), chunk_tokens=chunk_tokens,
        accum_dtype=accum_dtype, z_loss_weight=float(z_loss_weight),
        grad_enabled=torch.is_grad_enabled(), need_entropy=bool(return_entropy),
        kernel_opts=dict(
            ignore_index=ignore_index, label_smoothing=float(label_smoothing),
            z_loss_weight=float(z_loss_weight), softcap=None if softcap is None else float(softcap),
            logit_scale=float(logit_scale), impl=impl,
        ),
    )
    sink: dict = {}
    if reduction == "none":
        loss = _FusedLinearCENoneFunction.apply(weight, hidden, bias, labels, cfg, sink)
    else:
        if reduction == "mean" and denom is None:
            # number of valid tokens, at least 1 (all ignored -> loss 0, zero grads)
            denom = (labels != ignore_index).sum().clamp_min(1).float()
        loss = _FusedLinearCEFunction.apply(weight, hidden, bias, labels, denom, cfg, sink)
    if not (return_token_accuracy or return_z_loss or return_entropy):
        return loss
    n = sink["num_tokens"]
    metrics = {}
    if return_token_accuracy:
        metrics["token_accuracy"] = (sink["correct"].float() / max(n, 1)).detach()
    if return_z_loss:
        z = sink["z_sum"]
        if reduction == "mean":
            z = z / denom
        elif reduction == "none":
            z = z / max(n, 1)
        metrics["z_loss"] = z.detach()
    if return_entropy:
        metrics["entropy"] = (sink["entropy_sum"] / max(n, 1)).detach()
    return LossOutput(loss, metrics)


class LigerFusedLinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`:
    ``forward(weight, hidden, labels, *, bias=None, num_items_in_batch=None)``."""

    def __init__(
        self,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss_weight: float = 0.0,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        reduction: str = "mean",
        return_token_accuracy: bool = False,
        chunk_tokens: Optional[int] = None,
        accum_dtype: Optional[torch.dtype] = None,
        impl: str = "auto",
    ):
        super().__init__()
        _check_options(reduction, label_smoothing, z_loss_weight)
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss_weight = z_loss_weight
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.reduction = reduction
        self.return_token_accuracy = return_token_accuracy
        self.chunk_tokens = chunk_tokens
        self.accum_dtype = accum_dtype
        self.impl = impl

    def forward(self, weight, hidden, labels, *, bias=None, num_items_in_batch=None):
        return fused_linear_cross_entropy(
            weight, hidden, labels, bias=bias, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, z_loss_weight=self.z_loss_weight,
            softcap=self.softcap, logit_scale=self.logit_scale, reduction=self.reduction,
            num_items_in_batch=num_items_in_batch, return_token_accuracy=self.return_token_accuracy,
            chunk_tokens=self.chunk_tokens, accum_dtype=self.accum_dtype, impl=self.impl,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
            f"z_loss_weight={self.z_loss_weight}, softcap={self.softcap}, reduction={self.reduction!r}"
        )
