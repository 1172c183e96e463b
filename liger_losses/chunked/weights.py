"""Sharded LM-head weights: the one place a sharded ``[V, H]`` weight becomes full, and back.

:func:`gather_weight` returns the full weight of a ``DTensor`` (``full_tensor()``) or a plain tensor
as is, and refuses a DeepSpeed ZeRO-3 partitioned parameter (:func:`zero3_gathered` gathers one);
:func:`weight_grad_like` lays the full ``[V, H]`` gradient out like the weight (a ``DTensor`` keeps its
mesh and placements; a ZeRO-3 parameter gets the full gradient, which DeepSpeed's hook on the
parameter's gradient accumulator reduces); :func:`head_in_dtype` is the gathered weight in the
compute dtype of the tiles and GEMMs. :func:`run_with_head_params` runs a fused loss with the LM-head
module's parameters as a call of that module gives them (FSDP2: unsharded, in the policy's dtype, the
gradient reduce-scattered), through :func:`run_as_forward` (a function run as a module's forward).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn


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


def is_zero3_partitioned(weight) -> bool:
    """Whether ``weight`` is a DeepSpeed ZeRO-3 parameter whose full value is not held now
    (``ds_status`` not ``AVAILABLE``, or an empty ``data``)."""
    if not (hasattr(weight, "ds_id") or hasattr(weight, "ds_status")):
        return False
    status = getattr(weight, "ds_status", None)
    return getattr(status, "name", str(status)) != "AVAILABLE" or weight.numel() == 0


def zero3_gathered(params):
    """``deepspeed.zero.GatheredParameters(params, modifier_rank=None)``: inside, the ZeRO-3 ``params`` hold their
    full values (a collective: every rank must enter it). ValueError when ``deepspeed`` cannot be imported."""
    try:
        import deepspeed  # noqa: WPS433 - lazy: only ZeRO-3 runs need it
    except ImportError as exc:  # a ds_* attribute without deepspeed: nothing can gather it
        raise ValueError(
            "weight is a DeepSpeed ZeRO-3 partitioned parameter and deepspeed cannot be imported to gather it; "
            "gather it before calling the loss, e.g. "
            "`with deepspeed.zero.GatheredParameters([lm_head.weight]): loss = ...`"
        ) from exc
    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


def gather_weight(weight: Tensor) -> Tensor:
    """The full ``[V, H]`` weight: a ``DTensor`` is gathered (``full_tensor()``); a plain tensor (or a gathered
    DeepSpeed ZeRO-3 parameter) is returned as is; a partitioned ZeRO-3 parameter raises ``ValueError``.

    Under ZeRO-3 a loss run inside the engine's forward (the patched causal LM; the TRL adapters, whose
    ``_liger_run`` makes the loss the model's forward) finds the head gathered: DeepSpeed gathers a partitioned
    parameter read there, registers it with the running module and gathers it again for that module's backward,
    where autograd accumulates the full gradient and ZeRO-3's hook on the accumulator reduces it. Outside a
    forward (a reference model's head, under ``no_grad``) gather it with ``deepspeed.zero.GatheredParameters``
    (``trl_integration.base.gathered_params``). A gradient cannot be accumulated into a parameter that is
    partitioned when the backward reaches it, so a copy gathered here would not help."""
    if is_dtensor(weight):
        return weight.full_tensor()
    if is_zero3_partitioned(weight):
        status = getattr(weight, "ds_status", None)
        raise ValueError(
            f"weight is a DeepSpeed ZeRO-3 partitioned parameter (ds_status={getattr(status, 'name', status)}); "
            "run the loss inside the DeepSpeed engine's forward (DeepSpeed gathers the head read there, and again "
            "for the backward), or for a no-grad call gather it first, e.g. "
            "`with deepspeed.zero.GatheredParameters([lm_head.weight]): ...`"
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


def fsdp2_module_type():
    """FSDP2's ``FSDPModule`` (the class ``fully_shard`` mixes into a module), None on a torch without it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def _is_fsdp2_module(module) -> bool:
    fsdp2 = fsdp2_module_type()
    return fsdp2 is not None and isinstance(module, fsdp2)


def run_with_head_params(head: nn.Module, fn: Callable[..., Any], *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` with the LM-head module ``head``'s parameters as a call of ``head`` gives them.

    A fused loss reads ``head.weight`` and never calls ``head``. Where FSDP2 shards the head in a group of
    its own (``fully_shard(lm_head)``, or a size-based auto-wrap), that group's hooks would then never run:
    the weight stays a sharded ``DTensor`` (:func:`gather_weight` gathers it, but its gradient would skip
    FSDP2's reduce-scatter and every rank would keep its own unreduced shard), and the mixed-precision
    cast is skipped. So for an ``FSDPModule`` head, ``fn`` runs *as the head's forward*: ``head()`` is called
    with its ``forward`` swapped for ``fn`` (restored before ``fn`` runs, and on error), so FSDP2 unshards
    the head (in the policy's ``param_dtype``) before, reshards after (``reshard_after_forward``), unshards it
    again before the backward and reduces its gradient. ``fn`` must read ``head.weight`` itself (inside, the
    module holds the unsharded parameter). Any other head (DeepSpeed ZeRO-3's included: reading a partitioned
    parameter inside the engine's forward gathers it and registers it with the running module, which gathers
    it again for the backward, so nothing is needed here): ``fn(*args, **kwargs)`` as is.
    """
    if not _is_fsdp2_module(head):
        return fn(*args, **kwargs)
    return run_as_forward(head, lambda: fn(*args, **kwargs))


def run_as_forward(module: nn.Module, fn: Callable[[], Any], *, call: Optional[nn.Module] = None) -> Any:
    """``fn()`` run *as the forward of* ``module``: ``call()`` (default ``module()``) is made with
    ``module``'s ``forward`` swapped for one that restores the original and runs ``fn``, so every hook
    around that call (FSDP's unshard/reshard, DDP's reducer, accelerate's wrappers) runs around ``fn``,
    and nested calls of the module inside ``fn`` are ordinary. The original ``forward`` (an instance
    attribute or the class's) is restored on error too. Returns ``fn``'s result."""
    had_attr = "forward" in module.__dict__
    saved = module.__dict__.get("forward")

    def restore():
        if had_attr:
            module.__dict__["forward"] = saved
        else:
            module.__dict__.pop("forward", None)

    def redirected(*_a, **_k):
        restore()
        return fn()

    module.forward = redirected
    try:
        return (module if call is None else call)()
    finally:
        restore()
