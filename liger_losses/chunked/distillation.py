"""Fused linear KL / JSD distillation: a student's LM head against a teacher's, without whole logits.

``loss = hard_label_weight * CE(student) + soft_label_weight * D(teacher, student)`` where D is the generalized
JSD / forward KL / reverse KL of TRL 1.16 (``GKDTrainer.generalized_jsd_loss``, ``DistillationTrainer``):
``beta=0`` (or ``divergence="forward_kl"``) is KL(teacher || student), ``beta=1`` (or ``"reverse_kl"``)
KL(student || teacher), otherwise ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with
``m = (1 - beta) p_s + beta p_t``; both models' logits divided by ``temperature``. Heads with a logit
transform (Gemma-style): ``logit_scale`` then ``softcap`` turn each head's logits ``x`` into
``softcap * tanh(logit_scale * x / softcap)`` (``softcap=None``: no tanh; ``softcap=inf`` is rejected) before the
temperature, for the student AND the teacher tile (not the teacher top-k log-probs, which are given); the CE term is on
the transformed student logits and the gradient flows through the transform. ``soft_label_weight`` defaults
to ``1 - hard_label_weight`` (so the default, ``hard_label_weight=0``, is TRL's pure divergence). The CE is on the raw
student logits (Liger-Kernel's ``weight_hard_loss`` / ``weight_soft_loss`` convention). See
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
GEMMs run in each head's compute dtype (autocast-aware) and write float32 logits tiles for bf16 / fp16 heads
(:func:`~liger_losses.chunked.gemm.project_fp32`: a divergence between close distributions is lost in logits
rounded to bf16; TRL's distillation kernel keeps them in fp32 too), the kernel math in fp32; the gradient tile
goes back to the compute dtype for the backward GEMMs.

Reductions (TRL's ``generalized_jsd_loss`` over the valid tokens): ``"batchmean"`` (default) divergence summed
over tokens / number of valid tokens (0 when there is none); ``"sum"``; ``"mean"``: divided by
``tokens * Vs`` (TRL's element mean over ``[tokens, V]``). ``num_items_in_batch`` (HF gradient accumulation)
overrides them: ``sum / num_items_in_batch`` (a number must be ``> 0``; a tensor's value is not read on the
host, so it is not checked). The CE part is the mean over valid tokens (``sum`` for ``"sum"``,
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

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from liger_losses.chunked.autograd import needs_head_grads, save_forward_grads, scaled_grads
from liger_losses.chunked.config import get_engine_config
from liger_losses.chunked.gemm import HeadGrads, compute_dtype, itemsize, project_fp32, weight_accum
from liger_losses.chunked.module import ChunkedLossModule
from liger_losses.chunked.options import (
    HeadOptions,
    check_flag,
    check_head_inputs,
    check_num_items,
    check_real,
    set_fields,
)
from liger_losses.chunked.output import LossOutput
from liger_losses.chunked.planning import chunk_bounds
from liger_losses.chunked.tokens import grad_like, token_rows
from liger_losses.chunked.weights import gather_weight, head_in_dtype
from liger_losses.kernels.divergence_tile import (
    DIVERGENCES,
    TEACHER_VOCAB_MODES,
    check_topk,
    divergence_tile,
)
from liger_losses.kernels.utils import check_choice, check_same_device, check_tensor, eager_under_compile

REDUCTIONS = ("batchmean", "mean", "sum")

# our metric name -> the name TRL 1.16 logs for the same quantity (DistillationTrainer logs "entropy";
# SFTTrainer logs "mean_token_accuracy"); divergence / nll / num_tokens have no TRL counterpart.
TRL_METRIC_NAMES = {
    "entropy": "entropy",
    "token_accuracy": "mean_token_accuracy",
}


@dataclass(frozen=True)
class DistillationOptions:
    """Distillation's own options: ``divergence`` in ``DIVERGENCES``, ``beta`` in ``[0, 1]``,
    ``hard_label_weight`` and ``soft_label_weight`` (None: ``1 - hard_label_weight``) finite
    ``>= 0``, ``teacher_vocab`` in ``TEACHER_VOCAB_MODES``, ``topk_tail`` a bool, ``reduction`` in
    :data:`REDUCTIONS`."""

    divergence: str = "jsd"
    beta: float = 0.5
    hard_label_weight: float = 0.0
    soft_label_weight: Optional[float] = None
    teacher_vocab: str = "renormalize"
    topk_tail: bool = True
    reduction: str = "batchmean"

    def __post_init__(self):
        check_choice("divergence", self.divergence, DIVERGENCES)
        check_choice("reduction", self.reduction, REDUCTIONS)
        check_choice("teacher_vocab", self.teacher_vocab, TEACHER_VOCAB_MODES)
        soft = self.soft_label_weight
        set_fields(
            self, beta=check_real("beta", self.beta, 0.0, 1.0),
            hard_label_weight=check_real("hard_label_weight", self.hard_label_weight, 0.0, None),
            soft_label_weight=None if soft is None else check_real("soft_label_weight", soft, 0.0, None),
            topk_tail=check_flag("topk_tail", self.topk_tail),
        )

    def term_weights(self) -> tuple[float, float]:
        """``(hard, soft)`` weights of the CE and divergence terms before the reduction."""
        hard = self.hard_label_weight
        return hard, (self.soft_label_weight if self.soft_label_weight is not None else 1.0 - hard)


@dataclass(frozen=True)
class Teacher:
    """The teacher's inputs (detached): its hidden states and head, or its top-k log-probs."""

    hidden: Optional[Tensor] = None
    weight: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    topk_logprobs: Optional[Tensor] = None
    topk_indices: Optional[Tensor] = None

    @property
    def topk(self) -> bool:
        return self.topk_logprobs is not None or self.topk_indices is not None

    def detached(self) -> "Teacher":
        return Teacher(*(None if t is None else t.detach() for t in
                         (self.hidden, self.weight, self.bias, self.topk_logprobs, self.topk_indices)))


def _check(weight, hidden, labels, bias, teacher: Teacher, head: HeadOptions) -> None:
    """The engine's checks of the student head, then those of the teacher's tensors."""
    Vs = check_head_inputs(weight, hidden, labels, bias, head)
    lead = tuple(hidden.shape[:-1])
    topk_lp, topk_idx, tw, tb = teacher.topk_logprobs, teacher.topk_indices, teacher.weight, teacher.bias
    if teacher.topk:
        if teacher.hidden is not None:
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
        if teacher.hidden is None:
            raise ValueError("teacher_hidden is required (or teacher_topk_logprobs and teacher_topk_indices)")
        check_tensor("teacher_hidden", teacher.hidden, floating=True)
        if tw is not None:
            check_tensor("teacher_weight", tw, ndim=2, floating=True)
        t_w = weight if tw is None else tw
        Vt, Ht = t_w.shape
        if Vt < Vs:
            raise ValueError(f"teacher_weight must have at least the student's vocabulary: shape [Vt >= {Vs}, Ht], "
                             f"got {tuple(t_w.shape)}")
        if tuple(teacher.hidden.shape) != lead + (Ht,):
            raise ValueError(f"teacher_hidden must have shape {lead + (Ht,)} (hidden.shape[:-1] and the "
                             f"teacher_weight's hidden size {Ht}), got {tuple(teacher.hidden.shape)}")
        if tb is not None:
            check_tensor("teacher_bias", tb, ndim=1, floating=True)
            if tb.shape[0] != Vt:
                raise ValueError(f"teacher_bias must have shape [{Vt}] (vocab of teacher_weight), got "
                                 f"{tuple(tb.shape)}")
    check_same_device(weight=weight, hidden=hidden, labels=labels, bias=bias, teacher_hidden=teacher.hidden,
                      teacher_weight=tw, teacher_bias=tb, teacher_topk_logprobs=topk_lp,
                      teacher_topk_indices=topk_idx)


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


@dataclass
class _TeacherHead:
    """The teacher per chunk: top-k rows ``[N, k]`` or its rows and head in its compute dtype."""

    columns: int = 0  # teacher logits columns per tile
    item: int = 0  # bytes per teacher tile element
    rows: object = None
    weight: Optional[Tensor] = None
    bias: Optional[Tensor] = None
    topk_logprobs: Optional[Tensor] = None
    topk_indices: Optional[Tensor] = None


def _teacher_head(teacher: Teacher, opts: DistillationOptions, h_rows, index, w_c, bias, Vs, cdt) -> _TeacherHead:
    if teacher.topk:
        k = teacher.topk_logprobs.shape[-1]
        lp_valid = teacher.topk_logprobs.reshape(-1, k).index_select(0, index).contiguous()
        idx_valid = teacher.topk_indices.reshape(-1, k).index_select(0, index).contiguous()
        check_topk(lp_valid, idx_valid, Vs)
        return _TeacherHead(topk_logprobs=lp_valid, topk_indices=idx_valid)
    tw_given = teacher.weight is not None
    tb = teacher.bias if (tw_given or teacher.bias is not None) else bias
    tb = None if tb is None else tb.detach()
    if tw_given:
        tw_full = gather_weight(teacher.weight)  # detached by the caller
        n_t_cols = Vs if opts.teacher_vocab == "renormalize" else tw_full.shape[0]
        tdt = compute_dtype(tw_full)
        tw_c = tw_full[:n_t_cols]
        tw_c = tw_c if tw_c.dtype == tdt else tw_c.to(tdt)
    else:  # the student's head, already gathered and cast (all Vs columns, in cdt)
        n_t_cols, tdt, tw_c = Vs, cdt, w_c.detach()
    rows = h_rows.like(teacher.hidden.reshape(-1, teacher.hidden.shape[-1]))
    return _TeacherHead(columns=n_t_cols, item=itemsize(tdt), rows=rows, weight=tw_c,
                        bias=None if tb is None else tb[:n_t_cols])


def _upstream(opts: DistillationOptions, num_items, N: int, Vs: int, dev):
    """``(hard_weight, soft_weight, scale)``: the kernel's term weights after the reduction and the
    per-row upstream factor (``1 / num_items_in_batch``: a float, or an ``[N]`` tensor)."""
    w_hard, w_soft = opts.term_weights()
    scale: object = 1.0
    if num_items is not None:
        if isinstance(num_items, Tensor):
            scale = (1.0 / num_items.to(device=dev, dtype=torch.float32)).reshape(1).expand(max(N, 1)).contiguous()
        else:
            scale = 1.0 / float(num_items)
    elif opts.reduction == "batchmean":
        w_hard, w_soft = w_hard / max(N, 1), w_soft / max(N, 1)
    elif opts.reduction == "mean":
        w_hard, w_soft = w_hard / max(N, 1), w_soft / max(N * Vs, 1)
    return w_hard, w_soft, scale


def _run(weight, hidden, bias, labels, teacher: Teacher, head: HeadOptions, opts: DistillationOptions,
         num_items, needs_h, needs_w, needs_b, metrics: dict):
    """The chunk loop. Returns (loss 0-d fp32, grad_hidden | None, grad_weight | None, grad_bias | None)."""
    dev = hidden.device
    Vs = weight.shape[0]
    cdt = compute_dtype(weight)
    w_full, w_c = head_in_dtype(weight, cdt)
    h_rows, l_valid, index = token_rows(hidden, labels, head.ignore_index, num_classes=Vs)  # one host sync
    N = l_valid.shape[0]
    th = _teacher_head(teacher, opts, h_rows, index, w_c, bias, Vs, cdt)
    w_hard, w_soft, scale = _upstream(opts, num_items, N, Vs, dev)
    grad = needs_h or needs_w or needs_b

    s_item = itemsize(cdt)
    width = Vs + (th.columns * th.item + s_item - 1) // s_item
    H = w_c.shape[1]
    grads = HeadGrads(h_rows, Vs, H, dtype=cdt, accum=weight_accum(head.accum_dtype, w_full.dtype), device=dev,
                      hidden=grad and needs_h, weight=grad and needs_w, bias=grad and needs_b)
    sums = torch.zeros(5, dtype=torch.float32, device=dev)  # loss, divergence, ce, entropy, correct
    kopts = dict(divergence=opts.divergence, beta=opts.beta, temperature=head.temperature,
                 teacher_vocab=opts.teacher_vocab, topk_tail=opts.topk_tail, hard_weight=w_hard,
                 soft_weight=w_soft, ignore_index=head.ignore_index, check_inputs=False, impl=head.impl)
    softcap, logit_scale = head.softcap, head.logit_scale
    if softcap is not None:
        width += Vs  # the transform's derivative tile
    # two tiles (student, teacher) live per chunk: the chunk takes as many tokens as two tiles in the
    # compute dtype fit in twice the engine's default budget (measured with bf16 tiles on the H200 at
    # 8192 x 128256: 1024-token chunks 64.7 ms / 1.47x the memory floor, against 70.8 ms / 1.24x with
    # the budget shared). The tiles are fp32 (project_fp32), so a bf16 / fp16 head's take twice those
    # bytes: 1 GiB at 1024 x 128256, the size of the head's bf16 weight gradient, which the fp32
    # accumulator's final cast holds beside it at the end anyway (peak-neutral when it widens).
    budget = 2 * get_engine_config().default_budget_bytes
    for ts, te in chunk_bounds(N, width, chunk_tokens=head.chunk_tokens, budget_bytes=budget, itemsize=s_item):
        h = h_rows(ts, te)
        # float32 logits for bf16 / fp16 heads (the same tokens a chunk: twice the bytes): a divergence of two
        # close distributions is a small difference of softmaxes, which logits rounded to bf16 swamp
        s_tile = project_fp32(h, w_c, bias)
        d_head = _head_transform(s_tile, logit_scale, softcap, want_factor=grad)
        if th.topk_logprobs is not None:
            t_tile = None
            extra = dict(topk_logprobs=th.topk_logprobs[ts:te], topk_indices=th.topk_indices[ts:te])
        else:
            with torch.no_grad():
                t_tile = project_fp32(th.rows(ts, te), th.weight, th.bias)
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
            s_tile = s_tile.to(cdt)  # the GEMMs' operand dtype (the fp32 tile is freed here)
            grads.add(s_tile, h, w_c, ts, te)
        del s_tile
    gh, gw, gb = grads.finish()
    if gh is not None:
        gh = grad_like(gh, hidden)
    loss = sums[0] if not isinstance(scale, float) or scale == 1.0 else sums[0] * scale
    n = max(N, 1)
    metrics.update({
        "divergence": sums[1] / n,
        "nll": sums[2] / n,
        "entropy": sums[3] / n,
        "token_accuracy": sums[4] / n,
        "num_tokens": torch.full((), float(N), dtype=torch.float32, device=dev),
    })
    return loss, gh, gw, gb


class _FusedLinearDistillationFunction(torch.autograd.Function):
    """Gradients of the student head computed in forward; backward scales them by ``grad_output``."""

    @staticmethod
    def forward(ctx, weight, hidden, bias, labels, teacher, head, opts, num_items, grad_enabled, metrics):
        needs_w, needs_h, needs_b = needs_head_grads(ctx, grad_enabled)
        needs_b = needs_b and bias is not None
        loss, gh, gw, gb = _run(weight, hidden, bias, labels, teacher, head, opts, num_items,
                                needs_h, needs_w, needs_b, metrics)
        save_forward_grads(ctx, weight, gh, gw, gb, needs_w)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        gh, gw, gb = scaled_grads(ctx, grad_loss)
        if gb is not None:
            gb = gb.to(ctx.bias_dtype)
        return (gw, gh, gb) + (None,) * 7


def run_distillation(weight, hidden, teacher_hidden, labels, *, head: HeadOptions, options: DistillationOptions,
                     bias=None, teacher_weight=None, teacher_bias=None, teacher_topk_logprobs=None,
                     teacher_topk_indices=None, num_items_in_batch=None) -> LossOutput:
    """:func:`fused_linear_distillation_loss` with its options already validated."""
    num_items = check_num_items(num_items_in_batch)
    teacher = Teacher(teacher_hidden, teacher_weight, teacher_bias, teacher_topk_logprobs, teacher_topk_indices)
    _check(weight, hidden, labels, bias, teacher, head)
    metrics: dict = {}
    loss = _FusedLinearDistillationFunction.apply(weight, hidden, bias, labels, teacher.detached(), head, options,
                                                  num_items, torch.is_grad_enabled(), metrics)
    return LossOutput(loss, metrics)


@eager_under_compile
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
    ``LossOutput(loss 0-d fp32, metrics)``; ``loss`` is differentiable w.r.t. ``hidden``, ``weight``, ``bias``.
    Options: :class:`DistillationOptions` and :class:`~liger_losses.chunked.options.HeadOptions`."""
    options = DistillationOptions(divergence=divergence, beta=beta, hard_label_weight=hard_label_weight,
                                  soft_label_weight=soft_label_weight, teacher_vocab=teacher_vocab,
                                  topk_tail=topk_tail, reduction=reduction)
    head = HeadOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                       chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl)
    return run_distillation(
        weight, hidden, teacher_hidden, labels, head=head, options=options, bias=bias, teacher_weight=teacher_weight,
        teacher_bias=teacher_bias, teacher_topk_logprobs=teacher_topk_logprobs,
        teacher_topk_indices=teacher_topk_indices, num_items_in_batch=num_items_in_batch,
    )


class LigerFusedLinearDistillationLoss(ChunkedLossModule):
    """Module form of :func:`fused_linear_distillation_loss`; the constructor takes its keyword options."""

    runner = staticmethod(run_distillation)
    TRL_METRIC_NAMES = TRL_METRIC_NAMES
    REPR_KEYS = ("divergence", "beta", "temperature", "softcap", "logit_scale", "hard_label_weight",
                 "soft_label_weight", "teacher_vocab", "topk_tail", "ignore_index", "reduction", "chunk_tokens",
                 "accum_dtype", "impl")

    def __init__(self, *, divergence: str = "jsd", beta: float = 0.5, temperature: float = 1.0,
                 softcap: Optional[float] = None, logit_scale: float = 1.0, hard_label_weight: float = 0.0,
                 soft_label_weight: Optional[float] = None, teacher_vocab: str = "renormalize",
                 topk_tail: bool = True, ignore_index: int = -100, reduction: str = "batchmean",
                 chunk_tokens: Optional[int] = None, accum_dtype: Optional[torch.dtype] = None,
                 impl: str = "auto"):
        super().__init__(
            HeadOptions(ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                        logit_scale=logit_scale, chunk_tokens=chunk_tokens, accum_dtype=accum_dtype, impl=impl),
            DistillationOptions(divergence=divergence, beta=beta, hard_label_weight=hard_label_weight,
                                soft_label_weight=soft_label_weight, teacher_vocab=teacher_vocab,
                                topk_tail=topk_tail, reduction=reduction),
        )

    def forward(self, weight, hidden, teacher_hidden, labels, *, teacher_weight=None, teacher_bias=None, bias=None,
                teacher_topk_logprobs=None, teacher_topk_indices=None, num_items_in_batch=None) -> LossOutput:
        return self.run(
            weight, hidden, teacher_hidden, labels, teacher_weight=teacher_weight, teacher_bias=teacher_bias,
            bias=bias, teacher_topk_logprobs=teacher_topk_logprobs, teacher_topk_indices=teacher_topk_indices,
            num_items_in_batch=num_items_in_batch,
        )
