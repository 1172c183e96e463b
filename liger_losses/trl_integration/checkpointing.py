"""Activation checkpointing of the policy's decoder layers without recording each layer's graph twice.

Hugging Face decoder layers checkpoint through ``layer._gradient_checkpointing_func(partial(forward, **kwargs),
*args)``; under TRL's default that function is ``functools.partial(torch.utils.checkpoint.checkpoint,
use_reentrant=False)``. The non-reentrant form runs the layer's forward in grad mode: it records the layer's
autograd graph and passes every tensor the graph saves through a pack hook, only to drop both; the backward then
recomputes the layer and records it again. The reentrant form runs the forward under no grad and records the layer
once, in the recompute: the same ops on the same inputs, with the same RNG and autocast state, so the same values
and gradients, for less host work per layer -- which is what bounds a step of a few thousand tokens.

The two forms differ where a layer exchanges gradient-carrying tensors through anything but its positional inputs
and its output, where one parameter takes part in several checkpointed calls under DDP (each reentrant backward
marks it ready), and where a kernel chooses another algorithm under no grad (attention with dropout: SDPA picks its
backend by grad mode, so the forward and the recompute would draw different masks). So the lean form is taken only
where none of these can happen:

* :func:`lean_allowed` (once per model): the switch on (``LIGER_LOSSES_LEAN_CHECKPOINT=0`` turns it off), a family
  whose decoder layers we patch (``patching/specs.py``: their layers were read for the above), no attention dropout,
  parameters not sharded, not compiled, no DDP looking for unused parameters, no DeepSpeed engine but ZeRO 0-2's;
* :func:`lean_checkpointing` (per backbone call): where the step is host-bound -- tokens x a layer's parameters at
  most :data:`LEAN_MAX_LAYER_WORK`: the reentrant recompute runs the whole layer, one GEMM more than torch's early
  stopped one --, on layers whose checkpoint function is exactly TRL's default, in a backbone whose checkpointed
  layers share no trainable parameter (with each other or with the rest of the
  backbone) and were each called once in a first checkpointing call run in torch's form (a looped model calls a
  layer several times);
* per layer call: grad mode on, not under Dynamo, some positional tensor requiring grad, and every other argument
  immutable and without a graph (:func:`plain_argument`: a shared dict that layers write K/V into is not).

The trainers take it for the policy backbone's call, not on the MoE router-aux path (transformers collects the
router logits with hooks inside the layers, which under no grad would carry no graph). Measured:
``benchmark/NOTES.md``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, List, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.utils import env_switch
from .anatomy import compiled_module, unwrap_causal_lm, wrapper_chain
from .logit_check import is_sharded

# LIGER_LOSSES_LEAN_CHECKPOINT=0 keeps torch's checkpoint form everywhere (read when a trainer first runs a model)
LEAN_SWITCH = "LIGER_LOSSES_LEAN_CHECKPOINT"

# What a backbone keeps on itself (so it lives and dies with it; a global cache would hold every model a process
# ever trained): its checkpointed layers, and whether they qualify (None until a first call in torch's form
# has counted the calls per layer).
_STATE_ATTR = "_liger_lean_checkpoint_state"
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


def plain_argument(value: Any) -> bool:
    """Immutable and without a graph: None, a scalar, a string, a dtype or device, a tensor that does not require
    grad, a flex-attention ``BlockMask``, or a tuple of those. A dict, a list or another object (a cache, a store
    that layers share K/V through) may carry gradient-carrying tensors from one layer to another."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, torch.Tensor):
        return not value.requires_grad
    if isinstance(value, tuple):
        return all(plain_argument(v) for v in value)
    return type(value).__name__ == "BlockMask"


def reentrant_is_equivalent(layer: nn.Module, function: Any, args: tuple) -> bool:
    """Whether checkpointing ``function(*args)`` -- ``layer``'s forward or call, bound in ``functools.partial`` with
    its keywords -- the reentrant way gives the gradients the non-reentrant way gives: grad mode on, not traced,
    some positional tensor requiring grad, every other positional and bound argument :func:`plain_argument` (the
    layer itself aside)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return False
    if not all(plain_argument(a) for a in args if not isinstance(a, torch.Tensor)):
        return False
    while isinstance(function, functools.partial):
        if not all(a is layer or plain_argument(a) for a in function.args):
            return False
        if not all(plain_argument(v) for v in function.keywords.values()):
            return False
        function = function.func
    return getattr(function, "__self__", layer) is layer


def _lean_layer_call(layer: nn.Module, function, *args):
    """``layer``'s checkpoint function in the lean form: reentrant where :func:`reentrant_is_equivalent`, else
    torch's non-reentrant one."""
    return checkpoint(function, *args, use_reentrant=reentrant_is_equivalent(layer, function, args))


def lean_allowed(model: nn.Module) -> bool:
    """Whether ``model`` (as the trainer holds it, wrappers included) may run its policy layers in the lean form
    (module docstring): the switch on, a family whose layers we patch, no attention dropout, parameters not sharded
    across processes, not compiled, no DDP that looks for unused parameters, and no DeepSpeed engine but ZeRO stage
    0-2's own (ZeRO-3 partitions the parameters; a pipeline or hybrid engine runs the layers itself)."""
    from ..patching.apply import family_type

    causal_lm = unwrap_causal_lm(model)
    if not env_switch(LEAN_SWITCH) or family_type(getattr(causal_lm, "config", None)) is None:
        return False
    if compiled_module(model) is not None or is_sharded(model, causal_lm):
        return False
    if any(float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0.0 for m in causal_lm.modules()):
        return False
    return not any(getattr(w, "find_unused_parameters", False) or _deepspeed_refuses(w) for w in wrapper_chain(model))


def _deepspeed_refuses(wrapper: nn.Module) -> bool:
    """A DeepSpeed engine other than a plain ``DeepSpeedEngine`` at ZeRO stage 0-2. Stages 1-2 reduce each gradient
    from a hook on its accumulation, which the reentrant backward fires once per parameter as torch's form does
    (``tests/distributed/test_deepspeed_trainers.py``)."""
    if not any(c.__name__ == "DeepSpeedEngine" for c in type(wrapper).__mro__):
        return False
    stage = getattr(wrapper, "zero_optimization_stage", None)
    return type(wrapper).__name__ != "DeepSpeedEngine" or not callable(stage) or stage() > 2


def _is_trl_default(func: Any) -> bool:
    """``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)`` and nothing else."""
    return (isinstance(func, functools.partial) and func.func is checkpoint and not func.args
            and func.keywords == {"use_reentrant": False})


# The lean form saves host time and costs GPU time: its recompute runs the layer whole, where torch's form stops
# once the last tensor the backward needs is recomputed, before the MLP's down projection and the residual add
# (an H100 profile of a GPU-bound step: one more GEMM of that shape per layer, ~4% of the step). So it pays only where
# the step is host-bound: where a layer's work, tokens x the layer's parameters, is small. Measured on an H100
# (benchmark/results/lean_checkpoint_h100.csv):
# faster at 1.9e11 (Qwen2.5-1.5B layers, 4096 tokens: 1.36x), 2.2e11 (Gemma-3-1B, 8192: 1.11-1.26x) and 2.5e11
# (Llama-3.2-1B, 4096: 1.02-1.22x); slower at 5.0e11 (Llama-3.2-1B, 8192, fp32 weights: 0.97x) and 7.7e11 (Qwen2.5-1.5B,
# 16384: 0.96x).
LEAN_MAX_LAYER_WORK = 3.5e11


class _BackboneState:
    """A backbone's checkpointed layers, their largest parameter count and whether the lean form suits them (None:
    not known yet)."""

    def __init__(self, backbone: nn.Module):
        self.layers: List[nn.Module] = [m for m in backbone.modules()
                                        if m is not backbone and hasattr(m, "gradient_checkpointing")]
        self.layer_params = max((sum(_param_count(p) for p in layer.parameters()) for layer in self.layers), default=0)
        self.lean_funcs = [functools.partial(_lean_layer_call, layer) for layer in self.layers]
        # a trainable parameter of a layer that takes part in another call too: another layer's, or the backbone's
        # outside the layers (a norm or an embedding tied to it)
        inside = {id(m) for layer in self.layers for _, m in layer.named_modules(remove_duplicate=False)}
        outside = {id(p) for _, m in backbone.named_modules(remove_duplicate=False) if id(m) not in inside
                   for p in m._parameters.values() if p is not None}
        owners: dict = {}
        shared = False
        for layer in self.layers:
            for _, p in layer.named_parameters(remove_duplicate=False):
                if p.requires_grad and (id(p) in outside or owners.setdefault(id(p), id(layer)) != id(layer)):
                    shared = True
        self.suits = False if shared else None


def _param_count(param: torch.Tensor) -> int:
    """The parameter's element count as the layer computes with it: a bitsandbytes 4-bit weight packs two to a byte
    and keeps its shape in ``quant_state``."""
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    return int(torch.Size(shape).numel()) if shape is not None else param.numel()


def _state(backbone: nn.Module) -> _BackboneState:
    state = backbone.__dict__.get(_STATE_ATTR)
    if state is None:
        state = backbone.__dict__[_STATE_ATTR] = _BackboneState(backbone)
    return state


@contextlib.contextmanager
def lean_checkpointing(backbone: nn.Module, enabled: bool = True, tokens: Optional[int] = None) -> Iterator[None]:
    """For the duration of one backbone call on ``tokens`` tokens (batch x sequence; None: not known): every
    checkpointed layer of ``backbone`` whose function is TRL's default takes the lean form instead, where a layer's
    work (``tokens`` x its parameters) is at most :data:`LEAN_MAX_LAYER_WORK`; put back afterwards, also on error (the
    backward needs no function: the reentrant form's recompute is held by the autograd graph). The first call with
    grad runs in torch's form and counts the calls per layer: a layer called twice (a looped model) keeps torch's
    form for good."""
    state = _state(backbone) if enabled and torch.is_grad_enabled() else None
    if state is None or state.suits is False or (tokens is not None
                                                 and tokens * state.layer_params > LEAN_MAX_LAYER_WORK):
        yield
        return
    swapped = []
    calls = {id(layer): 0 for layer in state.layers}
    for layer, lean in zip(state.layers, state.lean_funcs):
        func = layer.__dict__.get("_gradient_checkpointing_func")
        if layer.gradient_checkpointing and _is_trl_default(func):
            if state.suits:
                layer._gradient_checkpointing_func = lean
            else:  # the counting call: torch's form
                layer._gradient_checkpointing_func = functools.partial(_counted_call, calls, id(layer), func)
            swapped.append((layer, func))
    try:
        yield
    finally:
        for layer, func in swapped:
            layer._gradient_checkpointing_func = func
    if state.suits is None and any(calls.values()):  # decided on a call that checkpointed (training mode)
        state.suits = max(calls.values()) <= 1


def _counted_call(calls: dict, key: int, func, function, *args):
    calls[key] += 1
    return func(function, *args)
