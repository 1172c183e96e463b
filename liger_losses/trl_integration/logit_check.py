"""A one-time check that the fused loss computes the logits the model's own forward computes.

The adapters compute a model's logits as ``softcap(logit_scale * (hidden @ weight.T + bias))`` of its
backbone's last hidden state ``hidden [B, T, H]``: ``weight [V, H]`` / ``bias [V]`` from the LM head
(:func:`~.anatomy.lm_head_params`), ``softcap`` / ``logit_scale`` from the config
(:func:`~.anatomy.head_logit_options`), and :func:`~.anatomy.check_head_path` refuses module trees with layers
between backbone and head. A transform that neither the config nor the module tree shows -- a constant in the
causal LM's forward code, as remote-code models have (MiniCPM divides the hidden states by
``hidden_size / dim_model_base`` before its head) -- passes those checks and would train another objective.

:func:`check_model_logits` closes that gap at a model's first loss step: it runs the causal LM's own forward,
under no grad, on the first :data:`CHECK_TOKENS` tokens of the step's first sequence, takes its backbone's output
with a forward hook and compares the model's logits ``[1, n, V]`` with the formula above on that same hidden
state (float32, computed in a forward pre-hook of the head, where FSDP has gathered the head's weight in its own
hooks before ours runs). A relative difference
``||ours - model's|| / ||model's||`` above :data:`RTOL` raises ``ValueError``. The forward is the model's, in the
trainer's autocast, so the two differ only by the head's rounding: a half-precision logit is rounded to 8 (bf16)
or 11 (fp16) significant bits, a relative error below 2^-8 per element, and a softcap computed in bf16 adds two
roundings; :data:`RTOL` = 2% is five times that bound, while the transforms it exists for change the logits by
tens of percent (a softcap of 30 on logits of 20: 12%; MiniCPM's divisor: 89%).

Every model of a trainer of several processes (sharded, DDP, a DeepSpeed engine; its reference and teacher too) is
checked on every rank: the ranks enter the check at the same step (each model's first), so a sharded forward's
collectives pair up, and the verdict is the largest difference over the ranks (one ``all_reduce``; a rank that
failed to compute it counts as infinite), so all of them raise or none does.

Not checked (``None`` returned): DeepSpeed ZeRO-3 (its prefetcher records the first step's module order, this
forward included, and would replay it), inputs without ``input_ids``, non-finite logits (an overflow, not a
transform), a sharded model whose logits are not made by calling its head module or whose head is not whole in
that call, and ``LIGER_LOSSES_CHECK_LOGITS=0``. A forward that fails on a plain ``input_ids`` prefix warns and is not
checked. The RNG streams are forked around the forward, so dropout draws as if it had not run.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..chunked.weights import fsdp2_module_type, is_dtensor
from ..kernels.logits_tile import transform_logits_torch
from ..kernels.utils import env_switch
from .anatomy import backbone_of, lm_head_params, wrapper_chain

CHECK_TOKENS = 32
RTOL = 0.02
ENV_SWITCH = "LIGER_LOSSES_CHECK_LOGITS"


def formula_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *,
                   softcap: Optional[float], logit_scale: float, rows: int = 8192) -> torch.Tensor:
    """``softcap(logit_scale * (hidden @ weight.T + bias))`` in float32: what the fused losses compute,
    ``[..., V]`` for ``hidden [..., H]``; ``rows`` vocabulary rows of the head at a time in float32 (a float32
    copy of a whole 128k x 4096 head would be 2 GiB)."""
    h = hidden.float()
    logits = torch.cat([h @ weight[v:v + rows].float().t() for v in range(0, weight.shape[0], rows)], dim=-1)
    if bias is not None:
        logits = logits + bias.float()
    return transform_logits_torch(logits, float(logit_scale), 1.0, softcap)[0]


def is_sharded(wrapped: nn.Module, causal_lm: nn.Module) -> bool:
    """Whether the model's parameters are split across processes (its forward is then a collective): FSDP1 in the
    wrapper chain, FSDP2 (``fully_shard``) on any module -- told by the module, since inside the root's forward its
    parameters are unsharded plain tensors --, DTensor parameters (tensor parallel) or DeepSpeed ZeRO-3 ones."""
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in wrapper_chain(wrapped)):
        return True  # FSDP1 flattens the parameters of the module it wraps
    fsdp2 = fsdp2_module_type()
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in (wrapped, *causal_lm.modules())):
        return True
    return any(is_dtensor(p) or hasattr(p, "ds_id") for p in causal_lm.parameters())


def _last_hidden(output: Any) -> Optional[torch.Tensor]:
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None and isinstance(output, (tuple, list)) and output:
        hidden = output[0]
    return hidden if isinstance(hidden, torch.Tensor) else None


def check_model_logits(wrapped: nn.Module, causal_lm: nn.Module, model_kwargs: Mapping[str, Any], *,
                       softcap: Optional[float], logit_scale: float, role: str = "model",
                       distributed: Optional[bool] = None) -> Optional[float]:
    """Compare ``causal_lm``'s own logits with the fused loss's formula on its backbone's output (module
    docstring). ``wrapped`` is the model as the trainer holds it (its wrappers tell sharding and distribution),
    ``model_kwargs`` the step's forward inputs (``input_ids [B, T]`` used), ``softcap`` / ``logit_scale`` the
    transform the loss applies to this model, ``role`` its name in the error, ``distributed`` whether every rank of
    the default process group runs this check now (a trainer of several processes; None: :func:`is_distributed` of
    the model's wrappers). Called inside the trainer's redirected forward (``_liger_run``), where a sharded root is
    gathered. Returns the relative difference (the largest over the ranks when distributed), or None when not
    checked; raises ``ValueError`` above :data:`RTOL`."""
    if not env_switch(ENV_SWITCH):
        return None
    input_ids = model_kwargs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        return None
    ids = input_ids[:1, :CHECK_TOKENS]
    if any(hasattr(p, "ds_id") for p in causal_lm.parameters()):
        return None  # ZeRO-3: its prefetcher replays the first step's module order, this forward included
    sharded = is_sharded(wrapped, causal_lm)
    head = causal_lm.get_output_embeddings()
    hidden, formula = [], []

    def on_backbone(_module, _args, out):
        if not hidden:
            hidden.append(_full(_last_hidden(out)))

    def on_head(_module, _args):
        # the head's own gather hooks (FSDP) ran before this one: its weight is whole here. An error (a head the
        # loss refuses, lm_head_params) is raised after the forward, not taken for a failure of the model's own
        if hidden and hidden[0] is not None and not formula:
            try:
                formula.append(_formula(hidden[0], causal_lm, softcap, logit_scale))
            except Exception as exc:  # noqa: BLE001 - re-raised below
                formula.append(exc)

    handles = [backbone_of(causal_lm).register_forward_hook(on_backbone)]
    if isinstance(head, nn.Module):
        handles.append(head.register_forward_pre_hook(on_head))
    # an FSDP2 head of its own group that the trainer's call holds unsharded (run_with_head_params): this forward's
    # call of the head reshards it on the way out, and the loss must read it unsharded
    fsdp2 = fsdp2_module_type()
    regather = head if (fsdp2 is not None and isinstance(head, fsdp2)
                        and not is_dtensor(getattr(head, "weight", None))) else None
    on_cpu = ids.device.type == "cpu"
    name = _class_name(causal_lm)
    logits, failed = None, False
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[] if on_cpu else [ids.device],
                                                   device_type="cuda" if on_cpu else ids.device.type):
            # sharded: inside the trainer's redirected forward the root is gathered already, and an FSDP2 root's own
            # hooks would run a second time around its call: its forward alone (the groups inside gather themselves)
            output = (causal_lm.forward if sharded else causal_lm)(input_ids=ids, use_cache=False)
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, (tuple, list)) and output:
            logits = output[0]
        logits = _full(logits) if isinstance(logits, torch.Tensor) else None
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own forward: say so, train on
        failed = True
        warnings.warn(f"use_liger=True could not check that the fused loss computes {name}'s own logits (its "
                      f"forward on input_ids alone failed: {type(exc).__name__}: {exc})", UserWarning, stacklevel=2)
    finally:
        for handle in handles:
            handle.remove()
        if regather is not None and is_dtensor(getattr(regather, "weight", None)):
            regather.unshard()
    error = formula[0] if formula and isinstance(formula[0], Exception) else None
    ours = None
    if formula and error is None:
        ours = formula[0]
    elif not formula and not failed and not sharded and hidden and hidden[0] is not None:  # head never called
        ours = _formula(hidden[0], causal_lm, softcap, logit_scale)
    diff = None
    if ours is not None and logits is not None:
        theirs = logits.float()
        if theirs.shape != ours.shape:
            error = ValueError(
                f"use_liger=True cannot serve {role}: {name}'s forward returns logits of shape {tuple(theirs.shape)} "
                f"where its backbone and LM head give {tuple(ours.shape)}; pass use_liger=False to train with the "
                "model's own forward"
            )
        elif bool(torch.isfinite(theirs).all()) and bool(torch.isfinite(ours).all()):  # an overflow is no transform
            diff = float((ours - theirs).norm() / theirs.norm().clamp_min(torch.finfo(torch.float32).tiny))
    if is_distributed(wrapped, causal_lm) if distributed is None else (distributed and _group_size() > 1):
        # a rank with an error still joins the others (as +inf), then each raises
        largest = _largest_over_ranks(math.inf if error is not None else diff, ids.device)
        if error is None and largest == math.inf:
            raise RuntimeError(f"use_liger=True's logits check of {name} failed on another rank, which raised the "
                               f"error (set {ENV_SWITCH}=0 to skip the check)")
        diff = largest
    if error is not None:
        raise error
    if diff is not None and diff > RTOL:
        raise ValueError(
            f"use_liger=True cannot serve {role}: {name}'s own forward computes logits that differ from "
            f"softcap={softcap}, logit_scale={logit_scale} applied to hidden @ lm_head.weight.T (+ bias) by "
            f"{diff:.3g} (relative, on the first {ids.shape[1]} tokens of this batch; rounding gives < {RTOL}): its "
            "forward transforms the hidden states or the logits in a way its config does not show, and the fused "
            "loss would train another objective. Pass use_liger=False to train with the model's own forward (or "
            f"set {ENV_SWITCH}=0 to skip this check)"
        )
    return diff


def _formula(hidden: torch.Tensor, causal_lm: nn.Module, softcap: Optional[float],
             logit_scale: float) -> Optional[torch.Tensor]:
    """:func:`formula_logits` of ``hidden`` with ``causal_lm``'s head as it is now (whole inside the head's gather
    hooks; a DTensor head gathered here, a collective every rank enters in the same forward), float32 with autocast
    off; None where the weight is not whole ``[V, H]`` here (an FSDP1 unit of its own gathers it inside its forward,
    after this hook)."""
    weight, bias = lm_head_params(causal_lm)
    weight, bias = _full(weight), _full(bias)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        return None
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        return formula_logits(hidden.to(weight.device), weight, bias, softcap=softcap, logit_scale=logit_scale)


def _full(value: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A DTensor's whole tensor (a collective), any other tensor (or None) as it is."""
    return value.full_tensor() if value is not None and is_dtensor(value) else value


def _class_name(module: nn.Module) -> str:
    """The module's class name as the user wrote it (FSDP2 swaps in an ``FSDP<name>`` subclass)."""
    fsdp2 = fsdp2_module_type()
    if fsdp2 is not None and isinstance(module, fsdp2):
        return next((c.__name__ for c in type(module).__mro__[1:] if not issubclass(c, fsdp2)), type(module).__name__)
    return type(module).__name__


_DISTRIBUTED_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine")


def is_distributed(wrapped: nn.Module, causal_lm: nn.Module) -> bool:
    """Whether the model trains in several processes that step together (sharded, or under DDP / a DeepSpeed
    engine, in a process group of more than one): the check's verdict must then be the same on every rank, or
    the ranks that train on wait forever for the one that raised."""
    if _group_size() <= 1:
        return False
    return is_sharded(wrapped, causal_lm) or any(c.__name__ in _DISTRIBUTED_WRAPPERS
                                                 for m in wrapper_chain(wrapped) for c in type(m).__mro__)


def _group_size() -> int:
    """The default process group's size (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _largest_over_ranks(diff: Optional[float], device: torch.device) -> Optional[float]:
    """The largest ``diff`` over the default process group's ranks (None where no rank checked)."""
    import torch.distributed as dist

    value = torch.tensor([-1.0 if diff is None else diff], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    largest = float(value.item())
    return None if largest < 0 else largest
