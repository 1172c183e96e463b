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
from liger_losses.chunked.tokens import RowGather, per_row_scale
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


def _per_token_bytes(V: int, H: int, itemsize: int) -> int:
    """Transient bytes per token of a chunk: a row of the logits block and of the fp32 accumulator."""
    cols = vocab_blocks(V)[0][1] if V else 1
    return cols * itemsize + H * 4


def online_token_chunks(V: int, H: int, itemsize: int, num_tokens: int) -> list[tuple[int, int]]:
    """Token chunks of the frozen-head path: per token, a row of the logits block (``itemsize``
    bytes a column) and of the fp32 accumulator, within ``frozen_budget_bytes``; balanced, as the
    tile path's."""
    return chunk_bounds(num_tokens, _per_token_bytes(V, H, itemsize),
                        budget_bytes=get_engine_config().frozen_budget_bytes, itemsize=1)


def online_chunk_capacity(V: int, H: int, itemsize: int) -> int:
    """The most tokens one chunk of :func:`online_token_chunks` holds, whatever the token count."""
    return max(1, get_engine_config().frozen_budget_bytes // _per_token_bytes(V, H, itemsize))


class OnlinePass:
    """One frozen-head pass: the head's vocabulary blocks, the options of every chunk and the
    buffers the chunks reuse (a logits block, the fp32 accumulator and the running state, for
    chunks of at most ``rows`` tokens). ``weight [V, H]`` in the compute dtype, ``bias [V]`` or None,
    ``tile_opts`` the logits-tile keywords of the pass (``mode`` "ce" | "logp", the logit transform,
    ``label_smoothing``, ``z_loss_weight``, ``need_entropy``, ``impl``)."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor], tile_opts: Mapping[str, Any], rows: int):
        opts = dict(tile_opts)
        V, H = weight.shape
        self.weight, self.H, self.mode = weight, H, opts["mode"]
        self.eps = float(opts.get("label_smoothing", 0.0)) if self.mode == "ce" else 0.0
        self.z_loss_weight = float(opts.get("z_loss_weight", 0.0))
        self.stats_dtype = torch_stats_dtype(weight.dtype)  # a float64 run stays float64 end to end
        self.w_mean = weight.to(self.stats_dtype).mean(0) if self.eps > 0.0 else None
        self.need_entropy = bool(opts.get("need_entropy", False))
        self.transform = dict(logit_scale=opts.get("logit_scale", 1.0), temperature=opts.get("temperature", 1.0),
                              softcap=opts.get("softcap"))
        self.dz_dx = float(self.transform["logit_scale"]) / float(self.transform["temperature"])  # without softcap
        self.impl = opts.get("impl", "auto")
        blocks = vocab_blocks(V)
        self.head_blocks = [(v0, weight[v0:v1], None if bias is None else bias[v0:v1].to(weight.dtype))
                            for v0, v1 in blocks]
        cols, dev = max(v1 - v0 for v0, v1 in blocks), weight.device
        self.buf = torch.empty(rows * cols, dtype=weight.dtype, device=dev)
        self.acc_buf = torch.empty(rows * H, dtype=self.stats_dtype, device=dev)
        self.state_buf = OnlineState.uninitialized(rows, dev, self.stats_dtype)

    def stats_buffers(self, n: int) -> dict:
        """The statistics' outputs of ``n`` tokens: float32 (float64) ``loss``/``lse``/``logp``
        (/``entropy``), bool ``correct``."""
        names = ("loss", "lse", "logp", "entropy") if self.need_entropy else ("loss", "lse", "logp")
        stats = {k: torch.empty(n, dtype=self.stats_dtype, device=self.weight.device) for k in names}
        stats["correct"] = torch.empty(n, dtype=torch.bool, device=self.weight.device)
        return stats

    def chunk(self, h: Tensor, labels: Tensor, scale, out: Tensor, out_rows: Optional[Tensor], stats: dict) -> None:
        """One chunk of ``n`` tokens ``h [n, H]`` with ``labels [n]`` (in ``[0, V)``) and upstream
        ``scale`` (a float or a tensor of one entry or ``n``): per vocabulary block three launches (the
        logits GEMM into the reused block buffer, the block kernel, the GEMM accumulating into the
        fp32 rows), then :func:`~liger_losses.kernels.online_finish.online_finish` writing ``stats``
        (``[n]`` outputs) and the gradient rows into ``out`` (at ``out_rows``, when given)."""
        n, H = h.shape[0], self.H
        w = self.weight
        state, acc = self.state_buf.rows(n), self.acc_buf[: n * H].view(n, H)
        with torch.autocast(device_type=w.device.type, enabled=False):  # the operands are in the compute dtype
            if h.dtype != w.dtype:
                h = h.to(w.dtype)
            for b, (v0, w_block, b_block) in enumerate(self.head_blocks):
                tile = self.buf[: n * w_block.shape[0]].view(n, w_block.shape[0])
                if b_block is None:
                    torch.mm(h, w_block.t(), out=tile)
                else:
                    torch.addmm(b_block, h, w_block.t(), out=tile)
                online_block(tile, labels, v0, state, acc, first=b == 0, need_zexp=self.need_entropy,
                             need_zsum=self.eps > 0.0, impl=self.impl, **self.transform)
                mm_into(acc, tile, w_block, accumulate=b > 0)
            online_finish(state, acc, w, labels, mode=self.mode, scale=scale, out=out, out_rows=out_rows,
                          stats=stats, label_smoothing=self.eps, z_loss_weight=self.z_loss_weight,
                          dz_dx=self.dz_dx, w_mean=self.w_mean, impl=self.impl)


def run_online_chunks(weight: Tensor, rows: RowGather, labels_valid: Tensor, bias: Optional[Tensor],
                      grads: HeadGrads, parts: dict, grad_scale, tile_opts: Mapping[str, Any], *, done: int = 0,
                      online: Optional[OnlinePass] = None) -> None:
    """The frozen-head pass over the valid tokens ``[done, N)`` of ``rows`` (labels ``labels_valid
    [N]``; the first ``done`` were run before, as :func:`~.token_passes.run_token_tiles`' first
    chunk is): their statistics (``[N - done]`` each) into ``parts``, their hidden gradient rows into
    ``grads`` at their tokens' positions. ``online``: the pass whose buffers to reuse (its chunks
    hold at least :func:`online_chunk_capacity` tokens, or all of them)."""
    V, H = weight.shape
    N = labels_valid.shape[0]
    chunks = [(done + a, done + b) for a, b in online_token_chunks(V, H, weight.element_size(), N - done)]
    if not chunks:
        return
    if online is None:
        online = OnlinePass(weight, bias, tile_opts, max(e - s for s, e in chunks))
    stats = online.stats_buffers(N - done)
    per_row = per_row_scale(grad_scale, N)
    for ts, te in chunks:
        out, out_rows = grads.hidden.rows_target(ts, te)
        online.chunk(rows(ts, te), labels_valid[ts:te], grad_scale[ts:te] if per_row else grad_scale, out, out_rows,
                     {k: v[ts - done:te - done] for k, v in stats.items()})
    for k, v in stats.items():
        parts.setdefault(k, []).append(v)
