"""Sharded LM-head weights: the one place a sharded ``[V, H]`` weight becomes full, and back.

:func:`gather_weight` returns the full weight of a ``DTensor`` (``full_tensor()``) or a plain
tensor as is, and refuses a DeepSpeed ZeRO-3 partitioned parameter; :func:`weight_grad_like` lays
the full ``[V, H]`` gradient out like the weight (a ``DTensor`` keeps its mesh and placements);
:func:`head_in_dtype` is the gathered weight in the compute dtype of the tiles and GEMMs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor

        return DTensor
    except Exception:  # pragma: no cover - depends on the torch build
        return None


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch has none)."""
    dt = _dtensor_type()
    return dt is not None and isinstance(t, dt)


def gather_weight(weight: Tensor) -> Tensor:
    """The full ``[V, H]`` weight: a ``DTensor`` is gathered (``full_tensor()``), a plain tensor
    is returned as is, and a DeepSpeed ZeRO-3 partitioned parameter raises ``ValueError`` (gather
    it first with ``deepspeed.zero.GatheredParameters``, as the TRL adapter does)."""
    if is_dtensor(weight):
        return weight.full_tensor()
    if hasattr(weight, "ds_id") or hasattr(weight, "ds_status"):
        status = getattr(weight, "ds_status", None)
        name = getattr(status, "name", str(status))
        if name != "AVAILABLE" or weight.numel() == 0:
            raise ValueError(
                "weight is a DeepSpeed ZeRO-3 partitioned parameter (ds_status="
                f"{name}); gather it before calling the loss, e.g. "
                "`with deepspeed.zero.GatheredParameters([lm_head.weight]): loss = ...`"
            )
    return weight


def head_in_dtype(weight: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(full, cast)``: :func:`gather_weight` of ``weight`` and the same in ``dtype`` (no copy
    when it already has that dtype)."""
    full = gather_weight(weight)
    return full, (full if full.dtype == dtype else full.to(dtype))


def weight_grad_like(weight: Tensor, full_grad: Tensor) -> Tensor:
    """The gradient autograd must return for ``weight`` given the full ``[V, H]`` gradient:
    for a ``DTensor`` the gradient is laid out with the weight's mesh and placements (every rank
    holds the same full gradient, so each keeps its own shard; no communication); else as is."""
    if not is_dtensor(weight):
        return full_grad
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    for p in weight.placements:
        if not isinstance(p, (Shard, Replicate)):
            raise ValueError(
                f"weight has placement {p}; only Shard and Replicate weights are supported"
            )
    try:
        return distribute_tensor(
            full_grad, weight.device_mesh, weight.placements, src_data_rank=None
        )
    except TypeError:  # older torch without src_data_rank
        return distribute_tensor(full_grad, weight.device_mesh, weight.placements)
