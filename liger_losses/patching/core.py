"""The machinery that patches one model family: swap modules in an instance, or patch its module.

A family is described by a ``FamilySpec`` (``specs.py``: its modeling module, class names, norm and
MLP kinds, whether its RoPE is the kernel's, its logit divisor, MoE). Before anything is changed,
``checks.py`` verifies that the modeling module and the model have the classes, attributes and
signatures the patch replaces; a mismatch raises ``FamilyMismatchError`` and nothing is patched.
``patch_family(spec, model, ...)``:

* ``model`` given (an instance of the family, or a PEFT wrapper of one): in place,
  - every RMSNorm module becomes ``LigerRMSNorm`` / ``LigerGemmaRMSNorm`` / ``LigerOlmoRMSNorm``
    (``modules.py``) holding the SAME weight
    ``Parameter`` (no copy; device, dtype, ties and optimizer state are kept), same eps;
  - every MLP becomes ``LigerSwiGLUMLP`` / ``LigerPhi3SwiGLUMLP`` / ``LigerGEGLUMLP`` holding the
    SAME ``nn.Linear`` sub-modules (built on the meta device first, so nothing is allocated or
    re-initialised); skipped with a warning when the config's activation is not the one the kernel
    computes;
  - the instance's ``forward`` becomes the loss-aware forward of ``causal_lm.py`` (only for the
    family's ``*ForCausalLM``; a bare ``*Model`` has no head and keeps its forward).
* ``model=None``: the modeling module's RMSNorm/MLP names are bound to our classes and the
  ``*ForCausalLM`` class gets the loss-aware forward, so models built afterwards use our kernels.

RoPE is always patched at module level (both cases): the modeling module's
``apply_rotary_pos_emb`` is replaced, which affects EVERY model of that family in this process,
patched or not. ``revert_liger_kernels()`` undoes all module- and class-level patches (it does not
touch instances whose modules were already swapped). Patching twice is harmless: originals are
remembered once, already-swapped modules are not swapped again, forwards do not nest.
"""

from __future__ import annotations

import importlib
import types
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from liger_losses.patching.causal_lm import make_causal_lm_forward
from liger_losses.patching.checks import check_instance, check_module, raise_mismatch
from liger_losses.patching.modules import mlp_class, mlp_parts, norm_class
from liger_losses.patching.rope import make_rotary_replacement
from liger_losses.patching.specs import FAMILIES, MLP_KINDS, NORM_KINDS, FamilySpec  # noqa: F401 (re-exported)

SILU_ACTS = ("silu", "swish")
GELU_ACTS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu")


# --------------------------------------------------------------------------- patch registry

# (module name, attribute) -> original value; (class, "forward") -> original function.
_MODULE_PATCHES: Dict[Tuple[str, str], object] = {}
_CLASS_PATCHES: Dict[Tuple[type, str], object] = {}


def _patch_module_attr(module: types.ModuleType, attr: str, new) -> None:
    _MODULE_PATCHES.setdefault((module.__name__, attr), getattr(module, attr))
    setattr(module, attr, new)


def _original_module_attr(module: types.ModuleType, attr: str):
    return _MODULE_PATCHES.get((module.__name__, attr), getattr(module, attr))


def _patch_class_attr(cls: type, attr: str, new) -> None:
    _CLASS_PATCHES.setdefault((cls, attr), cls.__dict__[attr])
    setattr(cls, attr, new)


def revert_liger_kernels(model_type: Optional[str] = None) -> None:
    """Undo module- and class-level patches (RoPE functions, class bindings, class forwards).

    ``model_type=None`` reverts every family. Instances whose modules were swapped keep them:
    reload such a model to get the original modules back.
    """
    modules = None
    if model_type is not None:
        if model_type not in FAMILIES:
            raise ValueError(f"model_type must be one of {sorted(FAMILIES)}, got {model_type!r}")
        modules = {FAMILIES[model_type].module}
    for (mod_name, attr), original in list(_MODULE_PATCHES.items()):
        if modules is None or mod_name in modules:
            setattr(importlib.import_module(mod_name), attr, original)
            del _MODULE_PATCHES[(mod_name, attr)]
    for (cls, attr), original in list(_CLASS_PATCHES.items()):
        if modules is None or cls.__module__ in modules:
            setattr(cls, attr, original)
            del _CLASS_PATCHES[(cls, attr)]


def is_rope_patched(model_type: str) -> bool:
    """True while the family's module-level ``apply_rotary_pos_emb`` is ours."""
    return (FAMILIES[model_type].module, "apply_rotary_pos_emb") in _MODULE_PATCHES


# --------------------------------------------------------------------------- kernels by kind


def _activation(config, kind: str) -> Optional[str]:
    # The attribute the HF MLP reads: Gemma/Llama ``hidden_act``, Gemma-2 ``hidden_activation``
    # (its ``hidden_act`` is None); LigerGEGLUMLP reads them in the same order.
    act = getattr(config, "hidden_act", None)
    if kind == "geglu":
        act = act or getattr(config, "hidden_activation", None)
    return act


def mlp_activation_supported(config, kind: str) -> bool:
    """True when our fused MLP computes the same activation as the config asks for."""
    return _activation(config, kind) in (GELU_ACTS if kind == "geglu" else SILU_ACTS)


# --------------------------------------------------------------------------- instance swaps


def _on_meta(factory: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return factory()


def _check_materialised(new: nn.Module, what: str) -> None:
    for name, t in list(new.named_parameters()) + list(new.named_buffers()):
        if t.is_meta:  # our module has a tensor the HF one did not: a bug in the kernel module
            raise RuntimeError(f"{what}: {name} was not re-bound from the original module")


def _swap(root: nn.Module, old_cls: type, make: Callable[[nn.Module], nn.Module]) -> int:
    count = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, old_cls):
                setattr(parent, name, make(child))
                count += 1
    return count


def _make_norm(kind: str):
    cls = norm_class(kind)

    def make(old: nn.Module) -> nn.Module:
        eps = getattr(old, "variance_epsilon", getattr(old, "eps", 1e-6))
        new = _on_meta(lambda: cls(old.weight.shape[0], eps=eps))
        new.weight = old.weight
        _check_materialised(new, cls.__name__)
        return new.train(old.training)

    return make


def _make_mlp(kind: str, config):
    cls = mlp_class(kind)

    def make(old: nn.Module) -> nn.Module:
        # MoE shared/dense MLPs are not config-sized: the module's own width
        new = _on_meta(lambda: cls(config, getattr(old, "intermediate_size", None)))
        for part in mlp_parts(kind):
            setattr(new, part, getattr(old, part))
        dropout = float(getattr(old, "residual_dropout", 0.0) or 0.0)  # Seed-OSS: its output's dropout
        if hasattr(new, "residual_dropout"):
            new.residual_dropout = dropout  # the module's, which may differ from the config's
        elif dropout > 0.0:
            raise RuntimeError(f"{type(old).__name__} drops out its output; {cls.__name__} does not")
        _check_materialised(new, cls.__name__)
        return new.train(old.training)

    return make


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _hf_hooked(target: nn.Module) -> bool:
    return hasattr(target, "_hf_hook") and hasattr(target, "_old_forward")


def instance_forward(target: nn.Module) -> Optional[Callable]:
    """The forward ``target`` runs in place of its class's (the one accelerate's hook wraps, else
    an instance attribute), or None when it runs its class's."""
    if _hf_hooked(target):
        current = target._old_forward
        return None if getattr(current, "__func__", None) is type(target).forward else current
    return target.__dict__.get("forward")


def set_instance_forward(target: nn.Module, forward: Callable) -> None:
    """Make ``forward`` (a callable of the call's arguments) what ``target`` runs as its forward,
    inside accelerate's hook where there is one (it keeps the forward it stored)."""
    if _hf_hooked(target):
        target._old_forward = forward
    else:
        target.forward = forward


def _patch_instance_forward(target: nn.Module, forward: Callable) -> None:
    set_instance_forward(target, types.MethodType(forward, target))


# --------------------------------------------------------------------------- entry point


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _import_modeling(spec: FamilySpec):
    try:
        return importlib.import_module(spec.module)
    except ImportError as exc:
        raise_mismatch(spec, [f"{spec.module} does not import ({exc})"])


def _causal_lm_forward(spec: FamilySpec, modeling, cls: type):
    aux_loss_fn = _original_module_attr(modeling, "load_balancing_loss_func") if spec.moe else None
    return make_causal_lm_forward(cls.forward, logits_divisor=spec.logits_divisor, aux_loss_fn=aux_loss_fn)


def patch_family(
    spec: FamilySpec,
    model: Optional[nn.Module],
    *,
    rms_norm: bool,
    rope: bool,
    mlp: bool,
    cross_entropy: bool,
):
    """Patch one family (see the module docstring). Returns ``model`` (``None`` for class level).

    Everything the patch replaces is checked first (``checks.py``): on a mismatch with the
    installed transformers ``FamilyMismatchError`` is raised and nothing is patched.
    """
    _check_flags(rms_norm=rms_norm, rope=rope, **{spec.mlp_flag: mlp}, cross_entropy=cross_entropy)
    target = None
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        target = unwrap_model(model)
        model_type = getattr(getattr(target, "config", None), "model_type", None)
        if model_type != spec.model_type:
            raise ValueError(
                f"model must be a {spec.model_type!r} model (config.model_type), got {model_type!r}"
            )
    modeling = _import_modeling(spec)
    rope = rope and spec.rope  # a family whose rotary our kernel does not compute keeps its own
    mlp = mlp and spec.mlp is not None
    check_module(spec, modeling, rope=rope, mlp=mlp, cross_entropy=cross_entropy,
                 originals=lambda name: _original_module_attr(modeling, name))
    causal_lm_cls = getattr(modeling, spec.causal_lm)
    norm_cls = _original_module_attr(modeling, spec.rms_norm)
    mlp_cls = _original_module_attr(modeling, spec.mlp) if mlp else None
    swap_mlp = mlp
    if target is not None:
        swap_mlp = mlp and mlp_activation_supported(target.config, spec.mlp_kind)
        check_instance(spec, target, norm_cls, mlp_cls, rms_norm=rms_norm, mlp=swap_mlp,
                       cross_entropy=cross_entropy, causal_lm_cls=causal_lm_cls)

    # ---- checked: from here on nothing raises before the patch is complete
    if rope:
        original = _original_module_attr(modeling, "apply_rotary_pos_emb")
        _patch_module_attr(modeling, "apply_rotary_pos_emb", make_rotary_replacement(original))

    if target is None:  # class level: models built from now on use our modules
        if rms_norm:
            _patch_module_attr(modeling, spec.rms_norm, norm_class(spec.norm_kind))
        if mlp:
            _patch_module_attr(modeling, spec.mlp, mlp_class(spec.mlp_kind))
        if cross_entropy:
            _patch_class_attr(causal_lm_cls, "forward", _causal_lm_forward(spec, modeling, causal_lm_cls))
        return None

    if rms_norm:
        _swap(target, norm_cls, _make_norm(spec.norm_kind))
    if swap_mlp:
        _swap(target, mlp_cls, _make_mlp(spec.mlp_kind, target.config))
    elif mlp:
        warnings.warn(
            f"{spec.model_type}: activation {_activation(target.config, spec.mlp_kind)!r} is not "
            f"what the fused {spec.mlp_kind} MLP computes; MLPs left unpatched",
            stacklevel=3,
        )
    if cross_entropy and isinstance(target, causal_lm_cls):
        _patch_instance_forward(target, _causal_lm_forward(spec, modeling, causal_lm_cls))
    return model
