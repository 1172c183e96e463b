"""Per-token log-probabilities ``log softmax(z)[label]`` of ``hidden @ weight.T (+ bias)``, chunked.

``weight [V, H]``, ``hidden [..., H]``, ``labels [...]`` -> ``logps [...]`` float32, 0 at
``ignore_index`` positions; ``z = softcap * tanh(logit_scale * logits / softcap) / temperature``
(softcap optional). Optionally ``entropy [...]`` of ``softmax(z)`` (detached, 0 at ignored).

Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``: the forward only computes statistics
(``2 N H V`` FLOPs); backward recomputes each tile with the per-token upstream gradient as the
row scale of the in-place log-prob gradient. This is the primitive for custom losses; losses
whose upstream gradient is known in the forward should use the one-pass drivers instead.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.cross_entropy import _recompute_saved_backward, _stats_forward, _scatter_token_values
from liger_losses.chunked.engine import _check_common, compute_dtype


class _TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, hidden, bias, labels, cfg, sink):
        stats, index = _stats_forward(ctx, weight, hidden, bias, labels, cfg, "logp", need_entropy=cfg["need_entropy"])
        if cfg["need_entropy"]:
            sink["entropy"] = _scatter_token_values(stats["entropy"], index, labels)
        return _scatter_token_values(stats["logp"], index, labels)

    @staticmethod
    def backward(ctx, grad_out):
        return _recompute_saved_backward(ctx, grad_out, "logp")


def fused_linear_token_logprobs(
    weight: Tensor,
    hidden: Tensor,
    labels: Tensor,
    *,
    bias: Optional[Tensor] = None,
    ignore_index: int = -100,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    return_entropy: bool = False,
    chunk_tokens: Optional[int] = None,
    impl: str = "auto",
):
    """``logps [...]`` (float32, 0 at ignored positions), or ``(logps, entropy)`` when
    ``return_entropy`` (entropy detached). See the module docstring."""
    _check_common(weight, hidden, labels, bias, ignore_index, temperature, softcap, logit_scale,
                  chunk_tokens, None, impl)
    cfg = dict(
        ignore_index=ignore_index, compute_dtype=compute_dtype(weight), chunk_tokens=chunk_tokens,
        accum_dtype=None, need_entropy=bool(return_entropy),
        kernel_opts=dict(
            ignore_index=ignore_index, temperature=float(temperature),
            softcap=None if softcap is None else float(softcap), logit_scale=float(logit_scale),
            impl=impl,
        ),
    )
    sink: dict = {}
    logps = _TokenLogprobsFunction.apply(weight, hidden, bias, labels, cfg, sink)
    if return_entropy:
        return logps, sink["entropy"]
    return logps
