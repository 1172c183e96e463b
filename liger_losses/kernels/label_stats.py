"""Per-call label statistics on the device (layer 1): the label range check's flag and the scale
of a mean, in one launch and without a host read.

``label_stats(labels, num_classes, ignore_index, class_weight=None)`` for ``labels [n]`` (integer,
any device) returns two 1-element tensors on the labels' device:

* ``bad [1]`` int32: 1 when some label lies outside ``[0, num_classes)`` and is not
  ``ignore_index``, else 0 (what :func:`utils.start_label_check` reads behind an event);
* ``scale [1]`` float32: ``1 / denom`` with ``denom`` the number of non-ignored labels, or -- with
  ``class_weight [V]`` -- the sum of ``class_weight[label]`` over them (``torch``'s mean with
  weights); ``scale = 1`` when ``denom`` is 0 (an all-ignored batch then gives a zero loss, not
  NaN). Out-of-range labels count in neither (the caller raises on them anyway).

Triton: one program walks the labels in blocks (a few microseconds for 10^5 labels); it replaces
the ~10 small PyTorch launches the same statistics take. ``impl="torch"``: the same in PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import (
    check_same_device,
    check_tensor,
    device_ctx,
    import_triton,
    resolve_impl,
    triton_interpret,
)

triton, tl = import_triton()


@dataclass(frozen=True)
class LabelStatsTuning(Knobs):
    """Launch knobs of the one-program label scan (slot ``label_stats``): ``block`` labels per step
    (256 in the interpreter) and ``num_warps``."""

    block: int = knob(4096, minimum=1)
    num_warps: int = knob(4, minimum=1)


LABEL_STATS_TUNING = register("label_stats", LabelStatsTuning())

if triton is not None:

    @triton.jit
    def _label_stats_kernel(LABELS, CW, BAD, SCALE, n, num_classes, ignore_index,
                            HAS_CW: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        denom = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            idx = start + offs
            lab = tl.load(LABELS + idx, mask=idx < n, other=ignore_index).to(tl.int64)
            kept = lab != ignore_index
            inside = (lab >= 0) & (lab < num_classes)
            bad = tl.maximum(bad, tl.where(kept & ~inside, 1, 0))
            counted = kept & inside
            if HAS_CW:
                w = tl.load(CW + tl.where(counted, lab, 0), mask=counted, other=0.0).to(tl.float32)
                denom += w
            else:
                denom += tl.where(counted, 1.0, 0.0)
        total = tl.sum(denom, axis=0)
        tl.store(BAD, tl.max(bad, axis=0))
        tl.store(SCALE, 1.0 / tl.where(total > 0, total, 1.0))

    _label_stats_kernel = fast_kernel(_label_stats_kernel)


def _label_stats_torch(labels: Tensor, num_classes: int, ignore_index: int,
                       class_weight: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    kept = labels != ignore_index
    inside = (labels >= 0) & (labels < num_classes)
    bad = (kept & ~inside).any().to(torch.int32).reshape(1)
    counted = kept & inside
    if class_weight is not None:
        w = class_weight.float()[torch.where(counted, labels, torch.zeros_like(labels))]
        denom = (w * counted).sum()
    else:
        denom = counted.sum().float()
    scale = (1.0 / torch.where(denom > 0, denom, torch.ones_like(denom))).reshape(1)
    return bad, scale


def label_stats(
    labels: Tensor,
    num_classes: int,
    ignore_index: int,
    class_weight: Optional[Tensor] = None,
    *,
    impl: str = "auto",
) -> tuple[Tensor, Tensor]:
    """``(bad [1] int32, scale [1] float32)`` of ``labels`` (see the module docstring)."""
    check_tensor("labels", labels, floating=False)
    if class_weight is not None:
        check_tensor("class_weight", class_weight, ndim=1, floating=True)
        if class_weight.shape[0] != num_classes:
            raise ValueError(f"class_weight must have shape [{num_classes}], got {tuple(class_weight.shape)}")
    check_same_device(labels=labels, class_weight=class_weight)
    flat = labels.reshape(-1)
    if resolve_impl(impl, flat) == "torch" or flat.numel() == 0:
        return _label_stats_torch(flat, int(num_classes), int(ignore_index), class_weight)
    flat = flat.contiguous()
    bad = torch.empty(1, dtype=torch.int32, device=flat.device)
    scale = torch.empty(1, dtype=torch.float32, device=flat.device)
    cw = class_weight.contiguous() if class_weight is not None else scale
    knobs = LABEL_STATS_TUNING.current
    block = 256 if triton_interpret() else knobs.block
    with device_ctx(flat):
        _label_stats_kernel[(1,)](flat, cw, bad, scale, flat.numel(), int(num_classes), int(ignore_index),
                                  HAS_CW=class_weight is not None, BLOCK=block, num_warps=knobs.num_warps)
    return bad, scale
