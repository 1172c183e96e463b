"""Distillation divergence on one logits tile: per-row KL / generalized JSD (+ optional hard-label CE),
with the gradient w.r.t. the student logits written in place into the student tile.

Shapes and dtypes
-----------------
* ``student``  ``[n, Vs]`` bf16 / fp16 / fp32 (/ fp64) logits tile, last dim contiguous; gradient lands here.
* ``teacher``  ``[n, Vt]`` with ``Vt >= Vs`` (any float dtype, read only), **or** top-k mode:
  ``topk_logprobs [n, k]`` float teacher log-probs and ``topk_indices [n, k]`` integer token ids.
* ``labels``   ``[n]`` integer (optional): hard labels for the CE term; ``ignore_index`` rows get no CE.
* ``grad_scale``  ``[n]`` fp32 tensor or a Python float: per-row upstream gradient d(total)/d(row loss).
* Outputs (fp32 ``[n]`` each, see :class:`DivergenceTileStats`): ``loss`` = ``hard_weight * ce +
  soft_weight * divergence``, ``divergence``, ``ce``, ``entropy`` (student, at the temperature), ``correct``
  (argmax of the student logits == label). All math runs in fp32 registers.

Conventions (identical to TRL 1.16, ``GKDTrainer.generalized_jsd_loss`` and ``trl.kernels.chunked_divergence``)
------------------------------------------------------------------------------------------------------------
Both tiles are divided by ``temperature``; ``p_s = softmax(student / T)``, ``p_t = softmax(teacher / T)``.

* ``divergence="forward_kl"``: ``KL(p_t || p_s) = sum p_t (log p_t - log p_s)``  (TRL's ``beta == 0``)
* ``divergence="reverse_kl"``: ``KL(p_s || p_t)``                                (TRL's ``beta == 1``)
* ``divergence="jsd"``: generalized JSD with mixture ``m = (1 - beta) p_s + beta p_t``:
  ``beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)``; as in TRL, ``beta == 0`` / ``beta == 1`` give the
  forward / reverse KL above (not the limit of the formula, which is 0).

Teacher vocabulary larger than the student's (``Vt > Vs``; TRL itself requires equal vocabularies):
``teacher_vocab="renormalize"`` (default) takes the teacher softmax over the shared first ``Vs`` columns only,
i.e. exactly TRL/GKD applied to ``teacher_logits[..., :Vs]`` (the usual fix for padded LM heads); the loss stays
a true divergence (>= 0, 0 iff the distributions match) and the extra teacher columns are never read.
``teacher_vocab="full"`` normalises the teacher over all ``Vt`` columns and sums the divergence over the shared
``Vs`` columns (teacher mass on the extra columns is simply dropped; the value can then be negative).

Top-k mode (teacher given as top-k log-probs; semantics of TRL 1.16 ``experimental/server_distillation``,
``_add_tail_bucket`` + ``_jsd_divergence`` with a support mask): ``topk_logprobs`` are used as given (already
computed by the teacher at the distillation temperature); entries equal to ``-inf`` are padding and ignored.
The student's log-probs at temperature T (full softmax over ``Vs``) are gathered at ``topk_indices``. With
``topk_tail=True`` (TRL's default ``loss_add_tail``) both get a (k+1)-th "tail" entry ``log(1 - sum_k p)`` (the
sum clamped to ``<= exp(-1e-7)``); with ``topk_tail=False`` both are renormalised over the valid entries. The
divergence (same three kinds) is then taken over these small distributions. Valid indices of one row must be
distinct (checked by :func:`divergence_tile`). The exact gradient flows through the student's full softmax.

Hard-label CE: ``ce = logsumexp(student) - student[label]`` on the *raw* (not temperature-scaled) logits, as in
Liger-Kernel's distillation losses (``weight_hard_loss`` / ``weight_soft_loss`` there).

Gradient (when ``grad_scale`` is given): ``student[r, j] <- grad_scale[r] * d loss[r] / d student[r, j]``, in
the student tile's dtype. The teacher never receives a gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch

from liger_losses.kernels.divergence_torch import divergence_tile_torch
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import (
    check_choice,
    check_labels,
    check_range,
    check_same_device,
    check_tensor,
    device_ctx,
    import_triton,
    next_power_of_2,
    resolve_impl,
)

triton, tl = import_triton()
if triton is not None:
    from liger_losses.kernels.divergence_kernel import divergence_tile_kernel

DIVERGENCES = ("jsd", "forward_kl", "reverse_kl")
TEACHER_VOCAB_MODES = ("renormalize", "full")


@dataclass(frozen=True)
class DivergenceTileTuning(Knobs):
    """Launch knobs of the divergence kernel (slot ``divergence_tile``;
    ``benchmark/experiments/diag_tile_occupancy.py`` times them, ``diag_registers.py`` there
    counts their registers).

    ``block_cap``: columns per block of the row loops on the GPU (capped at the row width; 1024
    on the CPU). ``num_warps``: warps per program (0: 8 for blocks >= 2048, else 4).
    ``loop_stages``: software-pipelining depth of the row loops (``tl.range(num_stages=...)``;
    None: Triton's default loop). ``lane_sums``: pass-1 sums per lane (see the kernel); off until
    timed on a GPU (with 2048-column blocks and 8 warps its five [BLOCK] accumulators take 40
    registers per thread). ``pass2_reversed``: the gradient's sum pass (JSD / reverse KL) walks the
    rows from their last block back, where pass 1 ended (the rows' tails may still be in L2); the
    last pass then starts where it ends; False: front to back (the sum's rounding order differs,
    nothing else). ``maxnreg``: register cap per thread (Triton's ``maxnreg``; None: the compiler's
    choice, 64 with an 8-byte spill at 4096 / 8 warps); see ``LogitsTileTuning.maxnreg``.

    Why these defaults: see the measurements above the slot.
    """

    block_cap: int = knob(4096, minimum=1)
    num_warps: int = knob(0)
    loop_stages: Optional[int] = knob(None)
    lane_sums: bool = knob(False)
    pass2_reversed: bool = knob(True)
    maxnreg: Optional[int] = knob(None)


# Special-function (MUFU: ex2 / lg2 / rcp) ops per element, dense teacher, with the gradient (pass 1 +
# pass 2 + last pass; +1 in pass 1 and +1 in the last pass with hard labels at temperature != 1):
#   forward KL 2 + 0 + 2 = 4 (unchanged); reverse KL 2 + 1 + 1 = 4 (unchanged; p_t is never computed);
#   JSD before 2 + 4 + 5 = 11 (softplus via Kahan's log1p: a log and an fp32 division each time),
#   JSD now    2 + 3 + 3 = 8  (exp(-|x|), exp(max log-weight), one log; see divergence_kernel._div_terms).
# Before (H200, JSD beta=0.5, 8192 x 128256 bf16, forward + gradient): 7.35 ms against a 2.44 ms
# memory floor, and no BLOCK_CAP / NUM_WARPS / LOOP_STAGES setting changed it (7.3-8.9 ms): bound by
# per-element arithmetic, not by the launch configuration. Not yet timed after.
DIVERGENCE_TILE_TUNING = register("divergence_tile", DivergenceTileTuning())


def _block_settings(width: int, knobs: DivergenceTileTuning, *, on_gpu: bool = True,
                    block_size: Optional[int] = None) -> tuple[int, int]:
    """(columns per block, warps) for rows of ``width`` columns (``block_size`` overrides the block)."""
    block = block_size or min(next_power_of_2(width), knobs.block_cap if on_gpu else 1024)
    return block, knobs.num_warps or (8 if block >= 2048 else 4)


class DivergenceTileStats(NamedTuple):
    """Per-row statistics of :func:`divergence_tile` (fp32 ``[n]`` each)."""

    loss: torch.Tensor
    divergence: torch.Tensor
    ce: torch.Tensor
    entropy: torch.Tensor
    correct: torch.Tensor


def divergence_mode(divergence: str, beta: float) -> int:
    """0 = forward KL(teacher||student), 1 = reverse KL(student||teacher), 2 = generalized JSD (TRL's mapping)."""
    if divergence == "forward_kl":
        return 0
    if divergence == "reverse_kl":
        return 1
    if beta == 0.0:
        return 0
    if beta == 1.0:
        return 1
    return 2


# --------------------------------------------------------------------------- public entry


def _check_inputs(student, teacher, labels, topk_logprobs, topk_indices, grad_scale, *, divergence, beta,
                  temperature, teacher_vocab, ignore_index):
    check_tensor("student", student, ndim=2, floating=True)
    n, vs = student.shape
    if student.stride(-1) != 1:
        raise ValueError("student must have a contiguous last dimension (it receives the gradient in place)")
    check_choice("divergence", divergence, DIVERGENCES)
    check_choice("teacher_vocab", teacher_vocab, TEACHER_VOCAB_MODES)
    check_range("beta", beta, 0.0, 1.0)
    check_range("temperature", temperature, 0.0, None, low_inclusive=False)
    topk = topk_logprobs is not None or topk_indices is not None
    if topk and teacher is not None:
        raise ValueError("give either teacher [n, Vt] or teacher top-k (topk_logprobs, topk_indices), not both")
    if not topk and teacher is None:
        raise ValueError("teacher [n, Vt] is required unless topk_logprobs and topk_indices are given")
    if teacher is not None:
        check_tensor("teacher", teacher, ndim=2, floating=True)
        if teacher.shape[0] != n:
            raise ValueError(f"teacher must have shape [{n}, Vt] like student's rows, got {tuple(teacher.shape)}")
        if teacher.shape[1] < vs:
            raise ValueError(
                f"teacher vocabulary ({teacher.shape[1]}) must be >= the student's ({vs}); got teacher shape "
                f"{tuple(teacher.shape)}"
            )
        if teacher.stride(-1) != 1:
            raise ValueError("teacher must have a contiguous last dimension")
    if topk:
        if topk_logprobs is None or topk_indices is None:
            raise ValueError("top-k mode needs both topk_logprobs and topk_indices")
        check_tensor("topk_logprobs", topk_logprobs, ndim=2, floating=True)
        check_tensor("topk_indices", topk_indices, ndim=2, floating=False)
        if topk_logprobs.shape[0] != n or topk_indices.shape != topk_logprobs.shape:
            raise ValueError(
                f"topk_logprobs and topk_indices must both have shape [{n}, k], got "
                f"{tuple(topk_logprobs.shape)} and {tuple(topk_indices.shape)}"
            )
        check_topk(topk_logprobs, topk_indices, vs)
    if labels is not None:
        check_tensor("labels", labels, ndim=1, floating=False)
        if labels.shape[0] != n:
            raise ValueError(f"labels must have shape [{n}], got {tuple(labels.shape)}")
        check_labels("labels", labels, vs, ignore_index)
    if isinstance(grad_scale, torch.Tensor):
        check_tensor("grad_scale", grad_scale, ndim=1, floating=True)
        if grad_scale.shape[0] != n:
            raise ValueError(f"grad_scale must have shape [{n}], got {tuple(grad_scale.shape)}")
    check_same_device(student=student, teacher=teacher, labels=labels, topk_logprobs=topk_logprobs,
                      topk_indices=topk_indices,
                      grad_scale=grad_scale if isinstance(grad_scale, torch.Tensor) else None)


def check_topk(topk_logprobs: torch.Tensor, topk_indices: torch.Tensor, vocab: int) -> None:
    """Raise ``ValueError`` unless valid (``> -inf``) top-k entries have distinct indices in ``[0, vocab)`` and
    log-probs ``<= 0`` (no NaN). One host synchronisation."""
    valid = topk_logprobs > float("-inf")
    idx = topk_indices.long()
    bad_idx = valid & ((idx < 0) | (idx >= vocab))
    bad_lp = torch.isnan(topk_logprobs) | (topk_logprobs > 1e-4)
    srt, order = torch.where(valid, idx, -1 - torch.arange(idx.shape[-1], device=idx.device)).sort(-1)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    flags = torch.stack([bad_idx.any(), bad_lp.any(), dup.any()]).tolist()
    if flags[0]:
        raise ValueError(f"topk_indices must be in [0, {vocab}) where topk_logprobs > -inf")
    if flags[1]:
        raise ValueError("topk_logprobs must be log-probabilities (<= 0, not NaN; -inf marks padding)")
    if flags[2]:
        raise ValueError("topk_indices must be distinct within a row (among entries with topk_logprobs > -inf)")


def divergence_tile(
    student: torch.Tensor,
    teacher: Optional[torch.Tensor],
    labels: Optional[torch.Tensor] = None,
    *,
    topk_logprobs: Optional[torch.Tensor] = None,
    topk_indices: Optional[torch.Tensor] = None,
    divergence: str = "jsd",
    beta: float = 0.5,
    temperature: float = 1.0,
    teacher_vocab: str = "renormalize",
    topk_tail: bool = True,
    hard_weight: float = 0.0,
    soft_weight: float = 1.0,
    ignore_index: int = -100,
    grad_scale: Union[torch.Tensor, float, None] = None,
    check_inputs: bool = True,
    impl: str = "auto",
    block_size: Optional[int] = None,
) -> DivergenceTileStats:
    """Per-row distillation loss of a student logits tile against a teacher tile (or teacher top-k).

    When ``grad_scale`` is given, ``student`` is overwritten with ``grad_scale[r] * d loss[r] / d student[r]``.
    ``check_inputs=False`` skips validation (and its host syncs) for callers that validated once up front.
    ``block_size`` (power of 2) overrides the Triton column block (tests use it to force several blocks).
    """
    if check_inputs:
        _check_inputs(student, teacher, labels, topk_logprobs, topk_indices, grad_scale, divergence=divergence,
                      beta=beta, temperature=temperature, teacher_vocab=teacher_vocab, ignore_index=ignore_index)
    n, vs = student.shape
    mode = divergence_mode(divergence, beta)
    inv_t = 1.0 / float(temperature)
    topk = topk_logprobs is not None
    n_t_cols = vs if (topk or teacher_vocab == "renormalize") else teacher.shape[1]
    which = resolve_impl(impl, student, teacher, topk_logprobs)
    if which == "torch":
        return DivergenceTileStats(*divergence_tile_torch(
            student, teacher, labels, topk_logprobs, topk_indices, grad_scale, mode=mode, beta=float(beta),
            inv_t=inv_t, n_t_cols=n_t_cols, tail=bool(topk_tail), w_hard=float(hard_weight),
            w_soft=float(soft_weight), ignore_index=ignore_index,
        ))

    dev = student.device
    outs = [torch.empty(n, device=dev, dtype=torch.float32) for _ in range(5)]
    if n == 0:
        return DivergenceTileStats(*outs)
    width = max(vs, n_t_cols)
    knobs = DIVERGENCE_TILE_TUNING.current
    block, warps = _block_settings(width, knobs, on_gpu=dev.type == "cuda", block_size=block_size)
    dummy = outs[0]
    row_scale = isinstance(grad_scale, torch.Tensor)
    k = topk_logprobs.shape[1] if topk else 0
    b = float(beta)
    with device_ctx(student):  # Triton launches on the current GPU
        divergence_tile_kernel[(n,)](
            student, student.stride(0),
            teacher if teacher is not None else dummy, teacher.stride(0) if teacher is not None else 0,
            labels if labels is not None else dummy,
            topk_logprobs if topk else dummy, topk_logprobs.stride(0) if topk else 0,
            topk_indices if topk else dummy, topk_indices.stride(0) if topk else 0,
            grad_scale.float().contiguous() if row_scale else dummy,
            float(grad_scale) if (grad_scale is not None and not row_scale) else 1.0,
            *outs,
            vs, n_t_cols, k,
            inv_t, 1.0 - b,  # 1 - beta rounded once (fp32 1 - fp32(0.999) is off by 1.3e-5 relative)
            math.log1p(-b) if b < 1.0 else 0.0, math.log(b) if b > 0.0 else 0.0,
            float(hard_weight), float(soft_weight), int(ignore_index),
            MODE=mode, TOPK=topk, TAIL=bool(topk_tail), HAS_LABELS=labels is not None,
            SEP_RAW=(labels is not None and float(temperature) != 1.0),
            WRITE_GRAD=grad_scale is not None, ROW_SCALE=row_scale,
            BLOCK=block, BLOCK_K=max(2, next_power_of_2(k + 1)) if topk else 2, STAGES=knobs.loop_stages,
            LANE_SUMS=knobs.lane_sums, REVERSED=knobs.pass2_reversed,
            num_warps=warps, **({} if knobs.maxnreg is None else {"maxnreg": knobs.maxnreg}),
        )
    return DivergenceTileStats(*outs)
