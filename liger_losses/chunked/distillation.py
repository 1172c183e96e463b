"""Fused linear KL / JSD distillation: a student's LM head against a teacher's, without whole logits.

``loss = hard_label_weight * CE(student) + soft_label_weight * D(teacher, student)`` where D is the generalized
JSD / forward KL / reverse KL of TRL 1.16 (``GKDTrainer.generalized_jsd_loss``, ``DistillationTrainer``):
``beta=0`` (or ``divergence="forward_kl"``) is KL(teacher || student), ``beta=1`` (or ``"reverse_kl"``)
KL(student || teacher), otherwise ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with
``m = (1 - beta) p_s + beta p_t``; both models' logits divided by ``temperature``. Heads with a logit
transform (Gemma-style): ``logit_scale`` then ``softcap`` turn each head's logits ``x`` into
``softcap * tanh(logit_scale * x / softcap)`` (``softcap=None``: no tanh) before the temperature, for the student
AND the teacher tile (not the teacher top-k log-probs, which are given); the CE term is on the transformed student
logits and the gradient flows through the transform. ``soft_label_weight`` defaults
to ``1 - hard_label_weight`` (so the default, ``hard_label_weight=0``, is TRL's pure divergence). The CE is on the
raw student logits (Liger-Kernel's ``weight_hard_loss`` / ``weight_soft_loss`` convention). See
``liger_losses.kernels.divergence_tile`` for the exact per-token semantics, the teacher's larger vocabulary
(``teacher_vocab``) and the teacher top-k mode (TRL's server distillation, ``topk_tail``).

Shapes and dtypes
-----------------
``weight [Vs, H]``, ``hidden [..., H]`` (e.g. ``[B, T, H]``), ``labels [...]`` integer (already shifted: hidden
at a position is scored against the label at that position; ``ignore_index`` positions carry no loss and never
enter a GEMM), ``bias [Vs]``. Teacher: ``teacher_hidden [..., Ht]`` with ``teacher_weight [Vt, Ht]``
(``Vt >= Vs``, ``Ht`` may differ from ``H``; default: the student's ``weight`` and, unless ``teacher_bias`` is
given, ``bias``), ``teacher_bias [Vt]``; or, instead of ``teacher_hidden`` (pass ``None``),
``teacher_topk_logprobs [..., k]`` float and ``teacher_topk_indices [..., k]`` integer. Any float dtypes; the
tiles and GEMMs run in each head's compute dtype (autocast-aware), the kernel math in fp32.

Reductions (TRL's ``generalized_jsd_loss`` over the valid tokens): ``"batchmean"`` (default) divergence summed
over tokens / number of valid tokens (0 when there is none); ``"sum"``; ``"mean"``: divided by
``tokens * Vs`` (TRL's element mean over ``[tokens, V]``). ``num_items_in_batch`` (HF gradient accumulation)
overrides them: ``sum / num_items_in_batch``. The CE part is the mean over valid tokens (``sum`` for ``"sum"``,
``/ num_items_in_batch`` when given).

One pass: per chunk of valid tokens, the student tile is projected, the teacher tile projected under no grad,
the kernel writes the per-token loss and ``d loss / d student logits`` in place, and the tile is back-propagated
into ``grad_hidden`` / ``grad_weight`` / ``grad_bias``; backward only multiplies by the scalar ``grad_output``.
The teacher (hidden, weight, bias, top-k) never receives a gradient.

Metrics (detached 0-d, means over valid tokens): ``divergence`` (per-token D), ``nll`` (per-token CE),
``entropy`` (student softmax entropy at the temperature, nats; TRL's ``entropy``), ``token_accuracy`` (student
argmax == label), ``num_tokens``. :data:`TRL_METRIC_NAMES` maps them to the names TRL logs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.engine import (
    DEFAULT_BUDGET_BYTES,
    HeadGrads,
    _check_common,
    _needs_input_grads,
    _scaled_grads,
    chunk_bounds,
    compute_dtype,
    gather_weight,
    grad_like,
    project,
    token_rows,
)
from liger_losses.chunked.output import LossOutput
from liger_losses.kernels.divergence_tile import (
    DIVERGENCES,
    TEACHER_VOCAB_MODES,
    check_topk,
    divergence_tile,
)
from liger_losses.kernels.utils import check_choice, check_range, check_same_device, check_tensor

REDUCTIONS = ("batchmean", "mean", "sum")

# our metric name -> the name TRL 1.16 logs for the same quantity (DistillationTrainer logs "entropy";
# SFTTrainer logs "mean_token_accuracy"); divergence / nll / num_tokens have no TRL counterpart.
TRL_METRIC_NAMES = {
    "entropy": "entropy",
    "token_accuracy": "mean_token_accuracy",
}


def _check(weight, hidden, teacher_hidden, labels, o):
    """The engine's common checks (student head, hidden, labels, shared options), then the
    distillation-specific ones (options, teacher tensors); returns whether the teacher is top-k."""
    Vs = _check_common(weight, hidden, labels, o["bias"], o["ignore_index"], o["temperature"], o["softcap"],
                       o["logit_scale"], o["chunk_tokens"], o["accum_dtype"], o["impl"])
    lead = tuple(hidden.shape[:-1])
    check_choice("divergence", o["divergence"], DIVERGENCES)
    check_choice("reduction", o["reduction"], REDUCTIONS)
    check_choice("teacher_vocab", o["teacher_vocab"], TEACHER_VOCAB_MODES)
    check_range("beta", float(o["beta"]), 0.0, 1.0)
    check_range("hard_label_weight", float(o["hard_label_weight"]), 0.0, None)
    if o["soft_label_weight"] is not None:
        check_range("soft_label_weight", float(o["soft_label_weight"]), 0.0, None)
    nib = o["num_items_in_batch"]
    if nib is not None and not isinstance(nib, (int, float, Tensor)):
        raise TypeError(f"num_items_in_batch must be a number or a tensor, got {type(nib).__name__}")
    if isinstance(nib, Tensor) and nib.numel() != 1:
        raise ValueError(f"num_items_in_batch must hold one number, got shape {tuple(nib.shape)}")

    topk_lp, topk_idx = o["teacher_topk_logprobs"], o["teacher_topk_indices"]
    topk = topk_lp is not None or topk_idx is not None
    tw, tb = o["teacher_weight"], o["teacher_bias"]
    if topk:
        if teacher_hidden is not None:
            raise ValueError("give either teacher_hidden or teacher_topk_logprobs/teacher_topk_indices, not both")
        if topk_lp is None or topk_idx is None:
            raise ValueError("teacher top-k mode needs both teacher_topk_logprobs and teacher_topk_indices")
        check_tensor("teacher_topk_logprobs", topk_lp, floating=True)
        check_tensor("teacher_topk_indices", topk_idx, floating=False)
        if topk_lp.dim() != len(lead) + 1 or tuple(topk_lp.shape[:-1]) != lead:
            raise ValueError(f"teacher_topk_logprobs must have shape {lead + ('k',)}, got {tuple(topk_lp.shape)}")
        if topk_idx.shape != topk_lp.shape:
            raise ValueError(f"teacher_topk_indices must have the shape of teacher_topk_logprobs "
                             f"{tuple(topk_lp.shape)}, got {tuple(topk_idx.shape)}")
    else:
        if teacher_hidden is None:
            raise ValueError("teacher_hidden is required (or teacher_topk_logprobs and teacher_topk_indices)")
        check_tensor("teacher_hidden", teacher_hidden, floating=True)
        if tw is not None:
            check_tensor("teacher_weight", tw, ndim=2, floating=True)
        t_w = weight if tw is None else tw
        Vt, Ht = t_w.shape
        if Vt < Vs:
            raise ValueError(f"teacher_weight must have at least the student's vocabulary: shape [Vt >= {Vs}, Ht], "
                             f"got {tuple(t_w.shape)}")
        if tuple(teacher_hidden.shape) != lead + (Ht,):
            raise ValueError(f"teacher_hidden must have shape {lead + (Ht,)} (hidden.shape[:-1] and the "
                             f"teacher_weight's hidden size {Ht}), got {tuple(teacher_hidden.shape)}")
        if tb is not None:
            check_tensor("teacher_bias", tb, ndim=1, floating=True)
            if tb.shape[0] != Vt:
                raise ValueError(f"teacher_bias must have shape [{Vt}] (vocab of teacher_weight), got "
                                 f"{tuple(tb.shape)}")
    check_same_device(weight=weight, hidden=hidden, labels=labels, bias=o["bias"], teacher_hidden=teacher_hidden,
                      teacher_weight=tw, teacher_bias=tb, teacher_topk_logprobs=topk_lp,
                      teacher_topk_indices=topk_idx)
    return topk


_TRANSFORM_ROWS = 256  # rows per fp32 slice of the softcap transform (bounds its temporary memory)


def _head_transform(tile: Tensor, logit_scale: float, softcap: Optional[float], *, want_factor: bool):
    """In place ``tile <- softcap * tanh(logit_scale * tile / softcap)`` (plain scaling when ``softcap`` is None),
    computed in fp32 slices. Returns d(out)/d(tile): a float, or (softcap, want_factor) a tile-shaped tensor in the
    tile's dtype, ``logit_scale / cosh(logit_scale * x / softcap)**2`` (no cancellation near saturation)."""
    if softcap is None:
        if logit_scale != 1.0:
            tile.mul_(logit_scale)
        return logit_scale
    factor = torch.empty_like(tile) if want_factor else None
    a = logit_scale / softcap
    for r0 in range(0, tile.shape[0], _TRANSFORM_ROWS):
        part = tile[r0:r0 + _TRANSFORM_ROWS]
        x = part.float().mul_(a)
        if factor is not None:
            factor[r0:r0 + _TRANSFORM_ROWS].copy_(torch.cosh(x).pow_(-2).mul_(logit_scale))
        part.copy_(x.tanh_().mul_(softcap))
    return factor


def _run(weight, hidden, bias, teacher_hidden, labels, o, needs_h, needs_w, needs_b, sink):
    """The chunk loop. Returns (loss 0-d fp32, grad_hidden | None, grad_weight | None, grad_bias | None)."""
    dev = hidden.device
    Vs = weight.shape[0]
    w_full = gather_weight(weight)
    cdt = o["compute_dtype"]
    w_c = w_full if w_full.dtype == cdt else w_full.to(cdt)
    h_rows, l_valid, index = token_rows(hidden, labels, o["ignore_index"], num_classes=Vs)  # one host sync
    N = l_valid.shape[0]

    topk = o["topk"]
    if topk:
        k = o["teacher_topk_logprobs"].shape[-1]
        lp_valid = o["teacher_topk_logprobs"].reshape(-1, k).index_select(0, index).contiguous()
        idx_valid = o["teacher_topk_indices"].reshape(-1, k).index_select(0, index).contiguous()
        check_topk(lp_valid, idx_valid, Vs)
        n_t_cols, t_item = 0, 0
    else:
        tw_given = o["teacher_weight"] is not None
        tb = o["teacher_bias"] if (tw_given or o["teacher_bias"] is not None) else bias
        tb = None if tb is None else tb.detach()
        if tw_given:
            tw_full = gather_weight(o["teacher_weight"])  # detached by the caller
            n_t_cols = Vs if o["teacher_vocab"] == "renormalize" else tw_full.shape[0]
            tdt = compute_dtype(tw_full)
            tw_c = tw_full[:n_t_cols]
            tw_c = tw_c if tw_c.dtype == tdt else tw_c.to(tdt)
        else:  # the student's head, already gathered and cast (all Vs columns, in cdt)
            n_t_cols, tdt, tw_c = Vs, cdt, w_c.detach()
        tb_c = None if tb is None else tb[:n_t_cols]
        th_rows = h_rows.like(teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1]))
        t_item = torch.finfo(tdt).bits // 8

    # weights of the two terms and the per-row upstream factor (see the module docstring)
    red = o["reduction"]
    w_hard = float(o["hard_label_weight"])
    w_soft = float(o["soft_label_weight"]) if o["soft_label_weight"] is not None else 1.0 - w_hard
    nib = o["num_items_in_batch"]
    scale: object = 1.0
    if nib is not None:
        if isinstance(nib, Tensor):
            scale = (1.0 / nib.to(device=dev, dtype=torch.float32)).reshape(1).expand(max(N, 1)).contiguous()
        else:
            scale = 1.0 / float(nib)
    elif red == "batchmean":
        w_hard, w_soft = w_hard / max(N, 1), w_soft / max(N, 1)
    elif red == "mean":
        w_hard, w_soft = w_hard / max(N, 1), w_soft / max(N * Vs, 1)
    grad = needs_h or needs_w or needs_b

    s_item = torch.finfo(cdt).bits // 8
    width = Vs + (n_t_cols * t_item + s_item - 1) // s_item
    H = w_c.shape[1]
    grads = HeadGrads(h_rows, Vs, H, dtype=cdt, weight_dtype=o["accum_dtype"] or w_full.dtype, device=dev,
                      hidden=grad and needs_h, weight=grad and needs_w, bias=grad and needs_b)
    sums = torch.zeros(5, dtype=torch.float32, device=dev)  # loss, divergence, ce, entropy, correct
    kopts = dict(divergence=o["divergence"], beta=float(o["beta"]), temperature=float(o["temperature"]),
                 teacher_vocab=o["teacher_vocab"], topk_tail=o["topk_tail"], hard_weight=w_hard,
                 soft_weight=w_soft, ignore_index=o["ignore_index"], check_inputs=False, impl=o["impl"])
    softcap = None if o["softcap"] is None else float(o["softcap"])
    logit_scale = float(o["logit_scale"])
    if softcap is not None:
        width += Vs  # the transform's derivative tile
    # two tiles (student, teacher) live per chunk: each gets the engine's default tile budget
    # (measured on the H200 at 8192 x 128256: 1024-token chunks 64.7 ms / 1.47x the memory floor,
    # against 70.8 ms / 1.24x with the budget shared)
    budget = 2 * DEFAULT_BUDGET_BYTES
    for ts, te in chunk_bounds(N, width, chunk_tokens=o["chunk_tokens"], budget_bytes=budget, itemsize=s_item):
        h = h_rows(ts, te)
        s_tile = project(h, w_c, bias)
        d_head = _head_transform(s_tile, logit_scale, softcap, want_factor=grad)
        if topk:
            t_tile = None
            extra = dict(topk_logprobs=lp_valid[ts:te], topk_indices=idx_valid[ts:te])
        else:
            with torch.no_grad():
                t_tile = project(th_rows(ts, te), tw_c, tb_c)
                _head_transform(t_tile, logit_scale, softcap, want_factor=False)
            extra = {}
        row_scale = scale[ts:te] if isinstance(scale, Tensor) else scale
        st = divergence_tile(s_tile, t_tile, l_valid[ts:te], grad_scale=row_scale if grad else None,
                             **extra, **kopts)
        del t_tile
        part = torch.stack([st.loss.sum(), st.divergence.sum(), st.ce.sum(), st.entropy.sum(), st.correct.sum()])
        if isinstance(scale, Tensor):
            part[0] = (st.loss * row_scale).sum()
        sums += part
        if grad:
            if isinstance(d_head, Tensor) or d_head != 1.0:
                s_tile.mul_(d_head)
            del d_head
            grads.add(s_tile, h, w_c, ts, te)
        del s_tile
    gh, gw, gb = grads.finish()
    if gh is not None:
        gh = grad_like(gh, hidden)
    loss = sums[0] if not isinstance(scale, float) or scale == 1.0 else sums[0] * scale
    n = max(N, 1)
    sink["metrics"] = {
        "divergence": sums[1] / n,
        "nll": sums[2] / n,
        "entropy": sums[3] / n,
        "token_accuracy": sums[4] / n,
        "num_tokens": torch.full((), float(N), dtype=torch.float32, device=dev),
    }
    return loss, gh, gw, gb


class _FusedLinearDistillationFunction(torch.autograd.Function):
    """Gradients of the student head computed in forward; backward scales them by ``grad_output``."""

    @staticmethod
    def forward(ctx, weight, hidden, bias, teacher_hidden, labels, o, sink):
        needs_w, needs_h, needs_b = _needs_input_grads(ctx, o["grad_enabled"])
        needs_b = needs_b and bias is not None
        loss, gh, gw, gb = _run(weight, hidden, bias, teacher_hidden, labels, o, needs_h, needs_w, needs_b, sink)
        ctx.save_for_backward(gh, gw, gb)
        ctx.weight_ref = weight if needs_w else None
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.has = (gh is not None, gw is not None, gb is not None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        gh, gw, gb = _scaled_grads(ctx, grad_loss)
        if gb is not None:
            gb = gb.to(ctx.bias_dtype)
        return gw, gh, gb, None, None, None, None


def fused_linear_distillation_loss(
    weight: Tensor,
    hidden: Tensor,
    teacher_hidden: Optional[Tensor],
    labels: Tensor,
    *,
    teacher_weight: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    teacher_topk_logprobs: Optional[Tensor] = None,
    teacher_topk_indices: Optional[Tensor] = None,
    divergence: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    hard_label_weight: float = 0.0,
    soft_label_weight: Optional[float] = None,
    teacher_vocab: str = "renormalize",
    topk_tail: bool = True,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    num_items_in_batch=None,
    chunk_tokens: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    impl: str = "auto",
) -> LossOutput:
    """Distillation loss of the student head ``(weight, bias)`` on ``hidden`` against the teacher head on
    ``teacher_hidden`` (or teacher top-k log-probs); see the module docstring. Returns
    ``LossOutput(loss 0-d fp32, metrics)``; ``loss`` is differentiable w.r.t. ``hidden``, ``weight``, ``bias``."""
    o = dict(
        teacher_weight=teacher_weight, teacher_bias=teacher_bias, bias=bias,
        teacher_topk_logprobs=teacher_topk_logprobs, teacher_topk_indices=teacher_topk_indices,
        divergence=divergence, beta=beta, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
        hard_label_weight=hard_label_weight,
        soft_label_weight=soft_label_weight, teacher_vocab=teacher_vocab, topk_tail=bool(topk_tail),
        ignore_index=ignore_index, reduction=reduction, num_items_in_batch=num_items_in_batch,
        chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl,
    )
    o["topk"] = _check(weight, hidden, teacher_hidden, labels, o)
    o["compute_dtype"] = compute_dtype(weight)
    for key in ("teacher_weight", "teacher_bias", "teacher_topk_logprobs", "teacher_topk_indices"):
        if o[key] is not None:
            o[key] = o[key].detach()
    o["grad_enabled"] = torch.is_grad_enabled()
    sink: dict = {}
    loss = _FusedLinearDistillationFunction.apply(weight, hidden, bias, teacher_hidden, labels, o, sink)
    return LossOutput(loss, sink["metrics"])


class LigerFusedLinearDistillationLoss(torch.nn.Module):
    """Module form of :func:`fused_linear_distillation_loss`; the constructor takes its keyword options
    (``divergence``, ``beta``, ``temperature``, ``softcap``, ``logit_scale``, ``hard_label_weight``, ``soft_label_weight``, ``teacher_vocab``,
    ``topk_tail``, ``ignore_index``, ``reduction``, ``chunk_tokens``, ``accum_dtype``, ``impl``)."""

    _OPTIONS = ("divergence", "beta", "temperature", "softcap", "logit_scale", "hard_label_weight", "soft_label_weight", "teacher_vocab",
                "topk_tail", "ignore_index", "reduction", "chunk_tokens", "accum_dtype", "impl")

    def __init__(self, **options):
        super().__init__()
        unknown = sorted(set(options) - set(self._OPTIONS))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; expected some of {self._OPTIONS}")
        self.options = dict(options)

    def forward(self, weight, hidden, teacher_hidden, labels, *, teacher_weight=None, teacher_bias=None, bias=None,
                teacher_topk_logprobs=None, teacher_topk_indices=None, num_items_in_batch=None) -> LossOutput:
        return fused_linear_distillation_loss(
            weight, hidden, teacher_hidden, labels, teacher_weight=teacher_weight, teacher_bias=teacher_bias,
            bias=bias, teacher_topk_logprobs=teacher_topk_logprobs, teacher_topk_indices=teacher_topk_indices,
            num_items_in_batch=num_items_in_batch, **self.options,
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())
