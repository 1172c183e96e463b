"""The options every chunked loss shares, validated once, and the checks of the head's tensors.

:class:`HeadOptions` (frozen) holds what every fused-linear loss takes besides its own formula's
options: ``ignore_index``, the logit transform (``temperature``, ``softcap``, ``logit_scale``:
``z = softcap * tanh(logit_scale * x / softcap) / temperature``), the chunking and precision
knobs (``chunk_tokens``, ``accum_dtype``), the kernel choice (``impl``) and ``need_entropy``. It
is validated when built (``__post_init__``), with errors naming the option and the accepted
range; a loss builds it once (a module at construction) and passes it down whole.

Accepted values:

* ``ignore_index``: an int;
* ``temperature``, ``logit_scale``: finite real numbers ``> 0``;
* ``softcap``: ``None`` (no cap) or a finite real number ``> 0``. ``softcap=inf`` is rejected
  (``ValueError``): ``inf * tanh(x / inf)`` is ``inf * 0`` = NaN in floating point; pass ``None``
  for no cap;
* ``chunk_tokens``: ``None`` (sized from the memory budget) or an int ``>= 1``;
* ``accum_dtype``: the head's weight-gradient accumulator, one of :data:`ACCUM_DTYPES`; ``None``: the
  weight's dtype, or fp32 for a bf16 / fp16 weight whose gradient more than one chunk adds to
  (``EngineConfig.half_weight_accum_dtype``; pass ``torch.bfloat16`` to keep 2 bytes per weight);
* ``impl``: ``"auto"``, ``"triton"`` or ``"torch"``;
* ``need_entropy``: a bool.

The per-loss option dataclasses (``CrossEntropyOptions``, ``DPOOptions``, ...) use the same
helpers: :func:`check_real` (``TypeError`` for what is not a real number -- ``None``, ``"0.1"``,
``True`` -- and ``ValueError`` for a non-finite value or one out of range) and :func:`check_flag`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor

from liger_losses.kernels.utils import (
    IMPLS,
    check_choice,
    check_number,
    check_range,
    check_same_device,
    check_tensor,
    resolve_impl,
)

ACCUM_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_real(name: str, value, low: Optional[float] = None, high: Optional[float] = None, *,
               low_inclusive: bool = True, high_inclusive: bool = True) -> float:
    """``float(value)`` after checking that it is a finite real number in the given range:
    ``TypeError`` naming ``name`` when it is not a real number (``bool`` is not one),
    ``ValueError`` when it is NaN, infinite or out of range."""
    check_number(name, value)
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    check_range(name, v, low, high, low_inclusive=low_inclusive, high_inclusive=high_inclusive)
    return v


def check_flag(name: str, value) -> bool:
    """``value`` when it is a bool (or a 0/1 int), else ``TypeError`` naming ``name``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r}")


def check_chunk_tokens(value) -> Optional[int]:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {value!r}")
    return value


def set_fields(obj, **values) -> None:
    """Normalised values into a frozen dataclass from its ``__post_init__``."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


def field_values(obj) -> dict:
    """``{field: value}`` of a dataclass instance (shallow, unlike ``dataclasses.asdict``)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass(frozen=True)
class HeadOptions:
    """The options every chunked loss shares (see the module docstring for the accepted values)."""

    ignore_index: int = -100
    temperature: float = 1.0
    softcap: Optional[float] = None
    logit_scale: float = 1.0
    chunk_tokens: Optional[int] = None
    accum_dtype: Optional[torch.dtype] = None
    impl: str = "auto"
    need_entropy: bool = False

    def __post_init__(self):
        if not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {type(self.ignore_index).__name__}")
        softcap = self.softcap
        if softcap is not None:
            check_number("softcap", softcap)
            if not math.isfinite(float(softcap)) or float(softcap) <= 0:
                raise ValueError(
                    f"softcap must be a finite number > 0, or None for no cap, got {softcap!r}"
                )
            softcap = float(softcap)
        if self.accum_dtype not in ACCUM_DTYPES:
            raise ValueError(f"accum_dtype must be one of {ACCUM_DTYPES}, got {self.accum_dtype!r}")
        check_choice("impl", self.impl, IMPLS)
        set_fields(
            self,
            temperature=check_real("temperature", self.temperature, 0.0, None, low_inclusive=False),
            logit_scale=check_real("logit_scale", self.logit_scale, 0.0, None, low_inclusive=False),
            softcap=softcap, chunk_tokens=check_chunk_tokens(self.chunk_tokens),
            need_entropy=check_flag("need_entropy", self.need_entropy),
        )

    def tile_options(self) -> dict:
        """The keyword options of ``kernels.logits_tile`` these stand for."""
        return dict(temperature=self.temperature, softcap=self.softcap, logit_scale=self.logit_scale,
                    ignore_index=self.ignore_index, impl=self.impl)


def check_labels_tensor(name: str, labels, **shape) -> None:
    """``labels`` must be an integer tensor of class indices; a bool tensor (which would be read
    as classes 0/1) raises ``TypeError`` too."""
    check_tensor(name, labels, floating=False, **shape)
    if labels.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor of class indices, got dtype torch.bool")


def check_head_inputs(weight: Tensor, hidden: Tensor, labels: Tensor, bias: Optional[Tensor],
                      head: HeadOptions, *, hidden_ndim: Optional[int] = None) -> int:
    """Shapes, dtypes and devices of ``weight [V, H]``, ``hidden [..., H]`` (``hidden_ndim``
    dimensions when given), ``labels [...]`` (integer, not bool) and ``bias [V]``, and whether
    ``head.impl`` can run on them; returns ``V``. The labels' values are checked by the token
    compaction, in the host sync that counts them."""
    check_tensor("weight", weight, ndim=2, floating=True)
    if hidden_ndim is None:
        check_tensor("hidden", hidden, min_ndim=1, floating=True)
    else:
        check_tensor("hidden", hidden, ndim=hidden_ndim, floating=True)
    check_labels_tensor("labels", labels)
    V, H = weight.shape
    if hidden.shape[-1] != H:
        raise ValueError(
            f"hidden must have last dimension {H} (weight is [V={V}, H={H}]), "
            f"got shape {tuple(hidden.shape)}"
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), "
            f"got {tuple(labels.shape)}"
        )
    if bias is not None:
        check_tensor("bias", bias, ndim=1, floating=True)
        if bias.shape[0] != V:
            raise ValueError(f"bias must have shape [{V}] (vocab of weight), got {tuple(bias.shape)}")
    check_same_device(weight=weight, hidden=hidden, labels=labels, bias=bias)
    resolve_impl(head.impl, hidden)
    return V


def check_num_items(value):
    """``num_items_in_batch``: None, a real number ``> 0`` or a 1-element tensor (whose value is
    not read on the host); ``TypeError`` / ``ValueError`` naming it otherwise."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"num_items_in_batch must hold one number, got shape {tuple(value.shape)}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"num_items_in_batch must be a number or a tensor, got {type(value).__name__}")
    check_real("num_items_in_batch", value, 0.0, None, low_inclusive=False)
    return value
