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
state (float32). A relative difference ``||ours - model's|| / ||model's||`` above :data:`RTOL` raises
``ValueError``. The forward is the model's, in the trainer's autocast, so the two differ only by the head's
rounding: a half-precision logit is rounded to 8 (bf16) or 11 (fp16) significant bits, a relative error
below 2^-8 per element, and a softcap computed in bf16 adds two roundings; :data:`RTOL` = 2% is five times
that bound, while the transforms it exists for change the logits by tens of percent (a softcap of 30 on
logits of 20: 12%; MiniCPM's divisor: 89%).

Not checked (``None`` returned): parameters sharded across processes (DeepSpeed ZeRO-3, FSDP1, FSDP2 / tensor
parallel DTensors: their forward is a collective the ranks would have to enter together), inputs without
``input_ids``, non-finite logits (an overflow, not a transform) and ``LIGER_LOSSES_CHECK_LOGITS=0``. A forward
that fails on a plain ``input_ids`` prefix warns and is not checked. The RNG streams are forked around the
forward, so dropout draws as if it had not run.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..chunked.weights import is_dtensor
from ..kernels.logits_tile import transform_logits_torch
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
    fsdp2 = _fsdp2_module_type()
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in (wrapped, *causal_lm.modules())):
        return True
    return any(is_dtensor(p) or hasattr(p, "ds_id") for p in causal_lm.parameters())


def _fsdp2_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # noqa: BLE001 - torch without distributed / FSDP2
        return None
    return FSDPModule


def _last_hidden(output: Any) -> Optional[torch.Tensor]:
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None and isinstance(output, (tuple, list)) and output:
        hidden = output[0]
    return hidden if isinstance(hidden, torch.Tensor) else None


def check_model_logits(wrapped: nn.Module, causal_lm: nn.Module, model_kwargs: Mapping[str, Any], *,
                       softcap: Optional[float], logit_scale: float, role: str = "model") -> Optional[float]:
    """Compare ``causal_lm``'s own logits with the fused loss's formula on its backbone's output (module
    docstring). ``wrapped`` is the model as the trainer holds it (its wrappers tell sharding), ``model_kwargs``
    the step's forward inputs (``input_ids [B, T]`` used), ``softcap`` / ``logit_scale`` the transform the loss
    applies to this model, ``role`` its name in the error. Returns the relative difference, or None when not
    checked; raises ``ValueError`` above :data:`RTOL`."""
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return None
    input_ids = model_kwargs.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.numel() == 0:
        return None
    if is_sharded(wrapped, causal_lm):
        return None
    ids = input_ids[:1, :CHECK_TOKENS]
    captured = []
    handle = backbone_of(causal_lm).register_forward_hook(lambda _m, _a, out: captured.append(_last_hidden(out)))
    on_cpu = ids.device.type == "cpu"
    name = type(causal_lm).__name__
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[] if on_cpu else [ids.device],
                                                   device_type="cuda" if on_cpu else ids.device.type):
            output = causal_lm(input_ids=ids, use_cache=False)
    except Exception as exc:  # noqa: BLE001 - any failure of the model's own forward: say so, train on
        warnings.warn(f"use_liger=True could not check that the fused loss computes {name}'s own logits (its "
                      f"forward on input_ids alone failed: {type(exc).__name__}: {exc})", UserWarning, stacklevel=2)
        return None
    finally:
        handle.remove()
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not captured or captured[0] is None or not isinstance(logits, torch.Tensor):
        return None
    weight, bias = lm_head_params(causal_lm)
    with torch.no_grad():
        ours = formula_logits(captured[0].to(weight.device), weight, bias, softcap=softcap, logit_scale=logit_scale)
        theirs = logits.float()
        if theirs.shape != ours.shape:
            raise ValueError(
                f"use_liger=True cannot serve {role}: {name}'s forward returns logits of shape {tuple(theirs.shape)} "
                f"where its backbone and LM head give {tuple(ours.shape)}; pass use_liger=False to train with the "
                "model's own forward"
            )
        if not (bool(torch.isfinite(theirs).all()) and bool(torch.isfinite(ours).all())):
            return None  # an overflow is not a transform; the loss reports non-finite values itself
        diff = float((ours - theirs).norm() / theirs.norm().clamp_min(torch.finfo(torch.float32).tiny))
    if diff > RTOL:
        raise ValueError(
            f"use_liger=True cannot serve {role}: {name}'s own forward computes logits that differ from "
            f"softcap={softcap}, logit_scale={logit_scale} applied to hidden @ lm_head.weight.T (+ bias) by "
            f"{diff:.3g} (relative, on the first {ids.shape[1]} tokens of this batch; rounding gives < {RTOL}): its "
            "forward transforms the hidden states or the logits in a way its config does not show, and the fused "
            "loss would train another objective. Pass use_liger=False to train with the model's own forward (or "
            f"set {ENV_SWITCH}=0 to skip this check)"
        )
    return diff
