"""Shared helpers of the kernel layer: choosing an implementation, checking inputs, sizing blocks.

Every public kernel function takes a keyword ``impl``:

* ``"auto"`` (default): Triton when the tensors are on a CUDA device, or on the CPU when the
  Triton interpreter is on (``TRITON_INTERPRET=1``, set before ``liger_losses`` is imported);
  the pure-PyTorch fallback otherwise.
* ``"triton"``: Triton, or a ``RuntimeError`` saying why it cannot run here.
* ``"torch"``: the pure-PyTorch fallback, on any device.

Input checks raise ``TypeError``/``ValueError`` that name the argument and what was expected, so
that bad input never reaches a kernel.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable, Optional, Sequence

import torch

IMPLS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the ``triton`` package imports in this process."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the machine
        return False
    return True


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def triton_runs_on(device: torch.device) -> bool:
    """True when a Triton kernel can run on tensors living on ``device``."""
    if not triton_importable():
        return False
    if triton_interpret():
        return True
    return device.type == "cuda"


def resolve_impl(impl: str, *tensors: Optional[torch.Tensor]) -> str:
    """Map ``impl`` ("auto" | "triton" | "torch") to "triton" or "torch" for these tensors."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    device = next(t.device for t in tensors if t is not None)
    if impl == "torch":
        return "torch"
    if triton_runs_on(device):
        return "triton"
    if impl == "triton":
        reason = (
            "triton is not importable"
            if not triton_importable()
            else f"tensors are on {device.type} (set TRITON_INTERPRET=1 to run Triton on the CPU)"
        )
        raise RuntimeError(f"impl='triton' cannot run here: {reason}")
    return "torch"


# --------------------------------------------------------------------------- input checks


def check_tensor(
    name: str,
    value,
    *,
    ndim: Optional[int | Sequence[int]] = None,
    min_ndim: Optional[int] = None,
    floating: Optional[bool] = None,
    dtypes: Optional[Iterable[torch.dtype]] = None,
) -> torch.Tensor:
    """Raise a clear error unless ``value`` is a tensor of the given rank and dtype kind."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimensions, got shape {tuple(value.shape)}"
        )
    if floating is True and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if floating is False and (value.is_floating_point() or value.is_complex()):
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {dtypes}, got {value.dtype}")
    return value


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the arguments when the given tensors sit on different devices."""
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def check_last_dim(name: str, value: torch.Tensor, size: int, what: str) -> None:
    """Raise ``ValueError`` unless ``value.shape[-1] == size``."""
    if value.shape[-1] != size:
        raise ValueError(
            f"{name} must have last dimension {size} ({what}), got shape {tuple(value.shape)}"
        )


def check_labels(
    name: str, labels: torch.Tensor, num_classes: int, ignore_index: int
) -> None:
    """Raise ``ValueError`` when a label is outside ``[0, num_classes)`` and not ``ignore_index``.

    This costs one host synchronisation; it runs once per call, never inside a chunk loop.
    """
    check_tensor(name, labels, floating=False)
    if labels.numel() == 0:
        return
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= num_classes))
    if bool(bad.any()):
        example = int(labels[bad][0])
        raise ValueError(
            f"{name} must be in [0, {num_classes}) or equal ignore_index={ignore_index}, "
            f"found {example}"
        )


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_range(
    name: str,
    value: float,
    low: Optional[float] = None,
    high: Optional[float] = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> None:
    """Raise ``ValueError`` unless ``value`` lies in the given (in/exclusive) range."""
    ok = True
    if low is not None:
        ok &= value >= low if low_inclusive else value > low
    if high is not None:
        ok &= value <= high if high_inclusive else value < high
    if not ok:
        lb = "[" if low_inclusive else "("
        hb = "]" if high_inclusive else ")"
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in {lb}{lo}, {hi}{hb}, got {value!r}")


# --------------------------------------------------------------------------- block sizing


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def row_block_settings(n_cols: int, max_block: int = 65536) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for a kernel that holds one row of ``n_cols`` in registers."""
    block = next_power_of_2(n_cols)
    if block > max_block:
        raise ValueError(f"rows of {n_cols} elements exceed the kernel's limit of {max_block}")
    if block >= 32768:
        warps = 32
    elif block >= 8192:
        warps = 16
    elif block >= 2048:
        warps = 8
    else:
        warps = 4
    return block, warps


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as a contiguous 2-D ``[rows, last_dim]`` tensor (copies only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2
