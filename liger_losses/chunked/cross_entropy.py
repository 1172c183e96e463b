"""Fused linear cross-entropy: ``CE(hidden @ weight.T + bias, labels)`` without whole logits.

``weight [V, H]``, ``hidden [..., H]``, ``labels [...]`` (integer, ``ignore_index`` allowed),
``bias [V]`` optional. Logits are transformed as in ``kernels.logits_tile`` (``logit_scale``,
then ``softcap * tanh(. / softcap)``; ``softcap=None`` is no cap, ``softcap=inf`` is rejected);
the per-token loss is ``(1 - eps) * nll + eps * mean_v(-log p_v) + z_loss_weight * lse**2``.

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

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from liger_losses.chunked.autograd import needs_head_grads, save_forward_grads, scaled_grads
from liger_losses.chunked.gemm import compute_dtype, weight_accum
from liger_losses.chunked.module import ChunkedLossModule
from liger_losses.chunked.options import HeadOptions, check_flag, check_head_inputs, check_real, set_fields
from liger_losses.chunked.output import LossOutput
from liger_losses.chunked.token_passes import RecomputedTokenFunction, TokenPass, TokenPassResult, run_token_tiles
from liger_losses.chunked.tokens import grad_like
from liger_losses.chunked.weights import head_in_dtype
from liger_losses.kernels.utils import check_choice, eager_under_compile

REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class CrossEntropyOptions:
    """Cross-entropy's own options: ``reduction`` in :data:`REDUCTIONS`, ``label_smoothing`` in
    ``[0, 1]``, ``z_loss_weight`` finite ``>= 0`` and which metrics to return."""

    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss_weight: float = 0.0
    return_token_accuracy: bool = False
    return_z_loss: bool = False
    return_entropy: bool = False

    def __post_init__(self):
        check_choice("reduction", self.reduction, REDUCTIONS)
        set_fields(
            self, label_smoothing=check_real("label_smoothing", self.label_smoothing, 0.0, 1.0),
            z_loss_weight=check_real("z_loss_weight", self.z_loss_weight, 0.0, None),
            return_token_accuracy=check_flag("return_token_accuracy", self.return_token_accuracy),
            return_z_loss=check_flag("return_z_loss", self.return_z_loss),
            return_entropy=check_flag("return_entropy", self.return_entropy),
        )

    def kernel_opts(self, head: HeadOptions) -> dict:
        """The logits-tile keywords of the "ce" mode."""
        return dict(ignore_index=head.ignore_index, label_smoothing=self.label_smoothing,
                    z_loss_weight=self.z_loss_weight, softcap=head.softcap, logit_scale=head.logit_scale,
                    impl=head.impl)


@dataclass
class _Sums:
    """The metrics' raw sums of one forward (valid tokens, argmax hits, z-loss, entropy)."""

    num_tokens: int = 0
    correct: Optional[Tensor] = None
    z_sum: Optional[Tensor] = None
    entropy_sum: Optional[Tensor] = None

    def take(self, stats: dict, num_tokens: int, z_loss_weight: float, need_entropy: bool) -> None:
        self.num_tokens = num_tokens
        self.correct = stats["correct"].sum()
        self.z_sum = (stats["lse"] ** 2).sum() * z_loss_weight
        if need_entropy:
            self.entropy_sum = stats["entropy"].sum()


class _FusedLinearCEFunction(torch.autograd.Function):
    """mean / sum: gradients computed in forward."""

    @staticmethod
    def forward(ctx, weight, hidden, bias, labels, denom, spec: TokenPass, grad_enabled: bool, sums: _Sums):
        needs_w, needs_h, needs_b = needs_head_grads(ctx, grad_enabled)
        needs_b = needs_b and bias is not None
        w_full, w_c = head_in_dtype(weight, spec.compute_dtype)
        grad = needs_h or needs_w or needs_b
        scale = 1.0
        if denom is not None:  # 1/denom applied in the kernel (fp32), not to bf16 gradients later
            scale = (1.0 / denom).reshape(1).expand(labels.numel()).contiguous()
        # the first chunk is issued before the host sync (EngineConfig.speculative_first_chunk)
        stats, gh, gw, gb, l_valid, _ = run_token_tiles(
            w_c, hidden, labels, bias, ignore_index=spec.ignore_index, mode="ce", grad=grad,
            grad_scale=scale, kernel_opts=spec.kernel_opts, need_entropy=spec.need_entropy,
            chunk_tokens=spec.chunk_tokens, accum=weight_accum(spec.accum_dtype, w_full.dtype),
            needs_hidden=needs_h, needs_weight=needs_w, needs_bias=needs_b,
        )
        total = stats["loss"].sum()
        loss = total / denom if denom is not None else total
        sums.take(stats, l_valid.shape[0], spec.kernel_opts["z_loss_weight"], spec.need_entropy)
        if gh is not None:
            gh = grad_like(gh, hidden)
        save_forward_grads(ctx, weight, gh, gw, gb, True)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        gh, gw, gb = scaled_grads(ctx, grad_loss)
        return gw, gh, gb, None, None, None, None, None


def _denominator(num_items_in_batch, reduction: str, device) -> Optional[Tensor]:
    """The 0-d fp32 divisor ``num_items_in_batch`` stands for (None when not given)."""
    if num_items_in_batch is None:
        return None
    if reduction != "mean":
        raise ValueError(f"num_items_in_batch only applies to reduction='mean', got reduction={reduction!r}")
    if isinstance(num_items_in_batch, Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(
                f"num_items_in_batch must be a number or a 1-element tensor, got shape "
                f"{tuple(num_items_in_batch.shape)}"
            )
        return num_items_in_batch.detach().reshape(()).to(device=device, dtype=torch.float32)
    value = check_real("num_items_in_batch", num_items_in_batch)
    if value <= 0:
        raise ValueError(f"num_items_in_batch must be positive, got {num_items_in_batch!r}")
    return torch.full((), value, dtype=torch.float32, device=device)


def run_cross_entropy(weight, hidden, labels, *, head: HeadOptions, options: CrossEntropyOptions,
                      bias: Optional[Tensor] = None, num_items_in_batch=None):
    """:func:`fused_linear_cross_entropy` with its options already validated."""
    check_head_inputs(weight, hidden, labels, bias, head)
    reduction = options.reduction
    denom = _denominator(num_items_in_batch, reduction, hidden.device)
    spec = TokenPass(mode="ce", output="loss", ignore_index=head.ignore_index, kernel_opts=options.kernel_opts(head),
                     compute_dtype=compute_dtype(weight), chunk_tokens=head.chunk_tokens,
                     accum_dtype=head.accum_dtype, need_entropy=options.return_entropy)
    sums = _Sums()
    if reduction == "none":
        result = TokenPassResult()
        loss = RecomputedTokenFunction.apply(weight, hidden, bias, labels, spec, result)
        sums.take(result.stats, result.index.shape[0], options.z_loss_weight, options.return_entropy)
    else:
        if reduction == "mean" and denom is None:
            # number of valid tokens, at least 1 (all ignored -> loss 0, zero grads)
            denom = (labels != head.ignore_index).sum().clamp_min(1).float()
        loss = _FusedLinearCEFunction.apply(weight, hidden, bias, labels, denom, spec, torch.is_grad_enabled(), sums)
    if not (options.return_token_accuracy or options.return_z_loss or options.return_entropy):
        return loss
    n = sums.num_tokens
    metrics = {}
    if options.return_token_accuracy:
        metrics["token_accuracy"] = (sums.correct.float() / max(n, 1)).detach()
    if options.return_z_loss:
        z = sums.z_sum
        if reduction == "mean":
            z = z / denom
        elif reduction == "none":
            z = z / max(n, 1)
        metrics["z_loss"] = z.detach()
    if options.return_entropy:
        metrics["entropy"] = (sums.entropy_sum / max(n, 1)).detach()
    return LossOutput(loss, metrics)


@eager_under_compile
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
    tokens, from the same tiles: no extra GEMM), all detached. Shared options:
    :class:`~liger_losses.chunked.options.HeadOptions`; the others: :class:`CrossEntropyOptions`.
    """
    options = CrossEntropyOptions(reduction=reduction, label_smoothing=label_smoothing, z_loss_weight=z_loss_weight,
                                  return_token_accuracy=return_token_accuracy, return_z_loss=return_z_loss,
                                  return_entropy=return_entropy)
    head = HeadOptions(ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale,
                       chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl, need_entropy=return_entropy)
    return run_cross_entropy(weight, hidden, labels, head=head, options=options, bias=bias,
                             num_items_in_batch=num_items_in_batch)


class LigerFusedLinearCrossEntropyLoss(ChunkedLossModule):
    """Module form of :func:`fused_linear_cross_entropy`:
    ``forward(weight, hidden, labels, *, bias=None, num_items_in_batch=None)``."""

    runner = staticmethod(run_cross_entropy)
    REPR_KEYS = ("ignore_index", "label_smoothing", "z_loss_weight", "softcap", "reduction")

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
        super().__init__(
            HeadOptions(ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale,
                        chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl),
            CrossEntropyOptions(reduction=reduction, label_smoothing=label_smoothing, z_loss_weight=z_loss_weight,
                                return_token_accuracy=return_token_accuracy),
        )

    def forward(self, weight, hidden, labels, *, bias=None, num_items_in_batch=None):
        return self.run(weight, hidden, labels, bias=bias, num_items_in_batch=num_items_in_batch)
