"""Per-token log-probabilities ``log softmax(z)[label]`` of ``hidden @ weight.T (+ bias)``, chunked.

``weight [V, H]``, ``hidden [..., H]``, ``labels [...]`` -> ``logps [...]`` float32, 0 at
``ignore_index`` positions; ``z = softcap * tanh(logit_scale * logits / softcap) / temperature``
(softcap optional: None is no cap, inf is rejected). Optionally ``entropy [...]`` of
``softmax(z)`` (detached, 0 at ignored).

Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``: the forward only computes statistics
(``2 N H V`` FLOPs); backward recomputes each tile with the per-token upstream gradient as the
row scale of the in-place log-prob gradient
(:class:`~liger_losses.chunked.token_passes.RecomputedTokenFunction`). This is the primitive for
custom losses; losses whose upstream gradient is known in the forward should use the one-pass
drivers instead.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from liger_losses.chunked.gemm import compute_dtype
from liger_losses.chunked.options import HeadOptions, check_head_inputs
from liger_losses.chunked.token_passes import (
    RecomputedTokenFunction,
    TokenPass,
    TokenPassResult,
    scatter_token_values,
)
from liger_losses.kernels.utils import eager_under_compile


@eager_under_compile
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
    ``return_entropy`` (entropy detached). See the module docstring; options:
    :class:`~liger_losses.chunked.options.HeadOptions`."""
    head = HeadOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                       logit_scale=logit_scale, chunk_tokens=chunk_tokens, impl=impl,
                       need_entropy=return_entropy)
    check_head_inputs(weight, hidden, labels, bias, head)
    spec = TokenPass(mode="logp", output="logp", ignore_index=head.ignore_index, kernel_opts=head.tile_options(),
                     compute_dtype=compute_dtype(weight), chunk_tokens=head.chunk_tokens,
                     need_entropy=head.need_entropy)
    result = TokenPassResult()
    logps = RecomputedTokenFunction.apply(weight, hidden, bias, labels, spec, result)
    if head.need_entropy:
        return logps, scatter_token_values(result.stats["entropy"], result.index, labels)
    return logps
