"""Activation checkpointing of the policy's decoder layers without recording each layer's graph twice.

Hugging Face decoder layers checkpoint through ``layer._gradient_checkpointing_func(partial(forward, **kwargs),
*args)``; under TRL's default that function is ``functools.partial(torch.utils.checkpoint.checkpoint,
use_reentrant=False)``. The non-reentrant form runs the layer's forward in grad mode: it records the layer's
autograd graph and passes every tensor the graph saves through a pack hook, only to drop both; the backward then
recomputes the layer and records it again. The reentrant form runs the forward under no grad and records the layer
once, in the recompute: the same ops on the same inputs, with the same RNG and autocast state, so the same values
and gradients, for less host work per layer -- which is what bounds a step of a few thousand tokens.

:func:`lean_checkpointing` swaps the reentrant form in, for one call of the policy's backbone, on the layers whose
checkpoint function is exactly TRL's default (offloading to the CPU, a ``context_fn`` or determinism options keep
torch's), and each layer call takes it only where the two forms are equivalent (:func:`lean_checkpoint`): the
reentrant form propagates gradients to the layer's positional tensor arguments and its parameters only, so every
tensor that requires grad must be a positional argument, and at least one must (otherwise no gradient would reach
the parameters); grad mode on; not while Dynamo traces. The trainers take it only on a model whose parameters are
not sharded (FSDP and DeepSpeed run hooks around the recompute) and not under a DDP that looks for unused
parameters (a reentrant backward marks them ready inside its nested backward), and only where the backbone's
output is all they use: a forward that also collects tensors with hooks inside the layers (an MoE's router logits
for the aux loss) keeps torch's form, since under no grad those tensors would carry no graph. Measured:
``benchmark/NOTES.md``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator, List

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .anatomy import compiled_module, unwrap_causal_lm
from .logit_check import is_sharded


class _EnvSwitch:
    """``LIGER_LOSSES_LEAN_CHECKPOINT=0`` keeps torch's checkpoint form everywhere (read when a trainer first runs
    a model)."""

    name = "LIGER_LOSSES_LEAN_CHECKPOINT"

    def enabled(self) -> bool:
        return os.environ.get(self.name, "1").strip() != "0"


LEAN_ENV = _EnvSwitch()

# where a backbone keeps the list of its layers that carry a checkpoint function (found once; a layer's function
# is read per call): on the backbone itself, so the list lives and dies with it (a global cache of it would hold
# every model a process ever trained)
_LAYERS_ATTR = "_liger_checkpointed_layers"


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_requires_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_requires_grad(v) for v in value.values())
    return False


def reentrant_is_equivalent(function: Any, args: tuple) -> bool:
    """Whether checkpointing ``function(*args)`` the reentrant way gives the gradients the non-reentrant way
    gives: grad mode on, not traced, some positional tensor requiring grad, and none among the tensors bound in
    ``function`` (a ``functools.partial``'s arguments and keywords, nested containers included)."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return False
    if _requires_grad([a for a in args if not isinstance(a, torch.Tensor)]):
        return False
    while isinstance(function, functools.partial):
        if _requires_grad(function.args) or _requires_grad(function.keywords):
            return False
        function = function.func
    return True


def lean_checkpoint(function, *args):
    """A layer's checkpoint function: the reentrant form where it is equivalent (:func:`reentrant_is_equivalent`),
    else torch's non-reentrant one."""
    return checkpoint(function, *args, use_reentrant=reentrant_is_equivalent(function, args))


def lean_allowed(model: nn.Module) -> bool:
    """Whether ``model`` (as the trainer holds it, wrappers included) may run its policy layers in the lean form:
    the switch on, parameters not sharded across processes, not compiled (Dynamo traces torch's form), and no
    wrapper the reentrant form is not known to suit -- a DDP that looks for unused parameters, or a DeepSpeed
    engine (which reduces gradients from hooks of its own: untested with the reentrant form)."""
    if not LEAN_ENV.enabled() or compiled_module(model) is not None or is_sharded(model, unwrap_causal_lm(model)):
        return False
    wrapper = model
    for _ in range(8):
        if getattr(wrapper, "find_unused_parameters", False) or type(wrapper).__name__ == "DeepSpeedEngine":
            return False
        inner = getattr(wrapper, "module", None)
        if not isinstance(inner, nn.Module):
            return True
        wrapper = inner
    return True


def _is_trl_default(func: Any) -> bool:
    """``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)`` and nothing else."""
    return (isinstance(func, functools.partial) and func.func is checkpoint and not func.args
            and func.keywords == {"use_reentrant": False})


def _checkpointed_layers(backbone: nn.Module) -> List[nn.Module]:
    layers = backbone.__dict__.get(_LAYERS_ATTR)
    if layers is None:
        layers = [m for m in backbone.modules() if m is not backbone and hasattr(m, "gradient_checkpointing")]
        backbone.__dict__[_LAYERS_ATTR] = layers
    return layers


@contextlib.contextmanager
def lean_checkpointing(backbone: nn.Module, enabled: bool = True) -> Iterator[None]:
    """For the duration of one backbone call: every layer of ``backbone`` whose checkpoint function is TRL's
    default takes :func:`lean_checkpoint` instead; put back afterwards, also on error (the backward needs no
    function: the reentrant form's recompute is held by the autograd graph)."""
    if not enabled or not torch.is_grad_enabled():
        yield
        return
    swapped = []
    for layer in _checkpointed_layers(backbone):
        func = layer.__dict__.get("_gradient_checkpointing_func")
        if layer.gradient_checkpointing and _is_trl_default(func):
            layer._gradient_checkpointing_func = lean_checkpoint
            swapped.append((layer, func))
    try:
        yield
    finally:
        for layer, func in swapped:
            layer._gradient_checkpointing_func = func
