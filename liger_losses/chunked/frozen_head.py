"""The hidden-state gradient of a frozen head without an ``[n, V]`` tile: an online softmax over
vocabulary blocks.

When a per-token pass wants only ``d loss / d hidden`` (the head's weight and bias frozen: LoRA,
a frozen LM head), the gradient of token ``i`` is a softmax-weighted sum of the head's rows::

    ce:    g_i = s_i * ((1 + 2 z_w lse_i) * sum_v p_iv d_iv W_v - (1 - eps) d_iy W_y - eps / V * sum_v d_iv W_v)
    logp:  g_i = s_i * (d_iy W_y - sum_v p_iv d_iv W_v)

(``p = softmax(z)``, ``d = dz/dx`` of the logit transform, ``s`` the row's upstream scale, ``eps``
label smoothing, ``z_w`` the z-loss weight). The sum is computed as attention is: per chunk of
``n`` tokens and block of ``Vb`` vocabulary columns, the logits block ``[n, Vb]`` (one GEMM),
:func:`~liger_losses.kernels.online_block.online_block` (exponentials against a running
reference, the row statistics, a rescale of the rows whose reference moved) and
``acc [n, H] (fp32) += block @ W[block]`` (one GEMM); then one launch per chunk
(:func:`~liger_losses.kernels.online_finish.online_finish`) gives the chunk's statistics and writes
its gradient rows. The FLOPs are the tile path's (logits and hidden-gradient GEMMs, ``4 N H V``);
the transient memory is one ``[n, Vb]`` block and the fp32 accumulator instead of an ``[n, V]``
tile sized for the weight-gradient GEMM (half the head: 512 MiB at V=128256, H=4096), so the
pass's peak stays near the hidden gradient it produces.

Served: ``mode`` "ce" (label smoothing only without softcap: with it, the smoothing term needs a
second weighted sum) and "logp"; no class weights; every reduction's row scale. Statistics
(``loss``, ``lse``, ``logp``, ``correct``, ``entropy``) are the logits-tile kernel's, float32 ``[N]``.
Chunk and block sizes: ``EngineConfig.frozen_budget_bytes`` and ``frozen_block_columns``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch
from torch import Tensor

from liger_losses.chunked.config import get_engine_config
from liger_losses.chunked.gemm import HeadGrads, mm_into
from liger_losses.chunked.planning import chunk_bounds
from liger_losses.chunked.tokens import RowGather
from liger_losses.kernels.logits_tile import torch_stats_dtype
from liger_losses.kernels.online_block import OnlineState, online_block
from liger_losses.kernels.online_finish import online_finish


def online_eligible(*, chunk_tokens: Optional[int], mode: str, grad: bool, needs_hidden: bool,
                    needs_weight: bool, needs_bias: bool, kernel_opts: Optional[Mapping[str, Any]]) -> bool:
    """Whether a per-token pass takes the frozen-head path (see the module docstring); a pass with a
    fixed ``chunk_tokens`` keeps the tile path, whose chunks that size means."""
    cfg = get_engine_config()
    if chunk_tokens is not None or not (cfg.frozen_head_online and grad and needs_hidden):
        return False
    if needs_weight or needs_bias:
        return False
    opts = dict(kernel_opts or {})
    if mode not in ("ce", "logp") or opts.get("class_weight") is not None:
        return False
    return not (mode == "ce" and float(opts.get("label_smoothing", 0.0)) > 0.0 and opts.get("softcap") is not None)


def vocab_blocks(V: int) -> list[tuple[int, int]]:
    """``[0, V)`` in balanced blocks of at most ``frozen_block_columns`` columns (multiples of
    ``chunk_align`` where that fits): :func:`~.planning.chunk_bounds` with a budget in columns."""
    return chunk_bounds(V, 1, budget_bytes=get_engine_config().frozen_block_columns, itemsize=1)


def online_token_chunks(V: int, H: int, itemsize: int, num_tokens: int) -> list[tuple[int, int]]:
    """Token chunks of the frozen-head path: per token, a row of the logits block (``itemsize``
    bytes a column) and of the fp32 accumulator, within ``frozen_budget_bytes``; balanced, as the
    tile path's."""
    cols = vocab_blocks(V)[0][1] if V else 1
    per_token = cols * itemsize + H * 4
    return chunk_bounds(num_tokens, per_token, budget_bytes=get_engine_config().frozen_budget_bytes, itemsize=1)


def _block_loop(h: Tensor, labels: Tensor, head_blocks, buf: Tensor, acc: Tensor, state: OnlineState,
                transform: dict, need_entropy: bool, need_zsum: bool, impl: str) -> None:
    """The vocabulary blocks of one token chunk ``h [n, H]``: per block three launches (the logits
    GEMM into the reused buffer ``buf``, the block kernel, the GEMM accumulating into ``acc [n, H]``)."""
    n = h.shape[0]
    for b, (v0, w_block, b_block) in enumerate(head_blocks):
        tile = buf[: n * w_block.shape[0]].view(n, w_block.shape[0])
        if b_block is None:
            torch.mm(h, w_block.t(), out=tile)
        else:
            torch.addmm(b_block, h, w_block.t(), out=tile)
        online_block(tile, labels, v0, state, acc, first=b == 0, need_zexp=need_entropy, need_zsum=need_zsum,
                     impl=impl, **transform)
        mm_into(acc, tile, w_block, accumulate=b > 0)


def run_online_chunks(weight: Tensor, rows: RowGather, labels_valid: Tensor, bias: Optional[Tensor],
                      grads: HeadGrads, parts: dict, grad_scale, tile_opts: Mapping[str, Any]) -> None:
    """The frozen-head pass over the ``N`` valid tokens of ``rows`` (labels ``labels_valid [N]``):
    the statistics (``[N]`` each) into ``parts``, the hidden gradient into ``grads``. Per chunk, the
    block loop then :func:`~liger_losses.kernels.online_finish.online_finish`, which writes the
    chunk's statistics into the pass's ``[N]`` outputs and its gradient rows at their tokens'
    positions."""
    V, H = weight.shape
    opts = dict(tile_opts)
    N = labels_valid.shape[0]
    chunks = online_token_chunks(V, H, weight.element_size(), N)
    if not chunks:
        return
    blocks = vocab_blocks(V)
    head_blocks = [(v0, weight[v0:v1], None if bias is None else bias[v0:v1].to(weight.dtype)) for v0, v1 in blocks]
    mode = opts["mode"]
    eps = float(opts.get("label_smoothing", 0.0)) if mode == "ce" else 0.0
    stats_dtype = torch_stats_dtype(weight.dtype)  # a float64 run stays float64 end to end
    w_mean = weight.to(stats_dtype).mean(0) if eps > 0.0 else None
    need_entropy = bool(opts.get("need_entropy", False))
    transform = dict(logit_scale=opts.get("logit_scale", 1.0), temperature=opts.get("temperature", 1.0),
                     softcap=opts.get("softcap"))
    dz_dx = float(transform["logit_scale"]) / float(transform["temperature"])  # dz/dx without softcap
    impl = opts.get("impl", "auto")
    dev = weight.device
    cols = max(v1 - v0 for v0, v1 in blocks)
    rows_max = max(e - s for s, e in chunks)
    buf = torch.empty(rows_max * cols, dtype=weight.dtype, device=dev)
    acc_buf = torch.empty(rows_max * H, dtype=stats_dtype, device=dev)
    state_buf = OnlineState.uninitialized(rows_max, dev, stats_dtype)
    names = ("loss", "lse", "logp", "entropy") if need_entropy else ("loss", "lse", "logp")
    stats = {k: torch.empty(N, dtype=stats_dtype, device=dev) for k in names}
    stats["correct"] = torch.empty(N, dtype=torch.bool, device=dev)
    per_row = isinstance(grad_scale, Tensor) and grad_scale.numel() > 1
    with torch.autocast(device_type=dev.type, enabled=False):  # the operands are in the compute dtype
        for ts, te in chunks:
            n, h = te - ts, rows(ts, te)
            if h.dtype != weight.dtype:
                h = h.to(weight.dtype)
            labels = labels_valid[ts:te]
            state, acc = state_buf.rows(n), acc_buf[: n * H].view(n, H)
            _block_loop(h, labels, head_blocks, buf, acc, state, transform, need_entropy, eps > 0.0, impl)
            out, out_rows = grads.hidden.rows_target(ts, te)
            online_finish(state, acc, weight, labels, mode=mode, scale=grad_scale[ts:te] if per_row else grad_scale,
                          out=out, out_rows=out_rows, stats={k: v[ts:te] for k, v in stats.items()},
                          label_smoothing=eps, z_loss_weight=float(opts.get("z_loss_weight", 0.0)), dz_dx=dz_dx,
                          w_mean=w_mean, impl=impl)
    for k, v in stats.items():
        parts.setdefault(k, []).append(v)
