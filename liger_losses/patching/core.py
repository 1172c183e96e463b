"""The machinery that patches one model family: swap modules in an instance, or patch its module.

A family is described by a ``FamilySpec`` (``specs.py``: its modeling module, class names, norm and
MLP kinds).
``patch_family(spec, model, ...)``:

* ``model`` given (an instance of the family, or a PEFT wrapper of one): in place,
  - every RMSNorm module becomes ``LigerRMSNorm`` / ``LigerGemmaRMSNorm`` holding the SAME weight
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

from liger_losses.kernels.mlp import LigerGEGLUMLP, LigerPhi3SwiGLUMLP, LigerSwiGLUMLP
from liger_losses.kernels.rms_norm import LigerGemmaRMSNorm, LigerRMSNorm
from liger_losses.patching.causal_lm import make_causal_lm_forward
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


def _norm_class(kind: str):
    return LigerGemmaRMSNorm if kind == "gemma" else LigerRMSNorm


def _mlp_class(kind: str):
    return {"geglu": LigerGEGLUMLP, "phi3": LigerPhi3SwiGLUMLP}.get(kind, LigerSwiGLUMLP)


def _mlp_parts(kind: str) -> Tuple[str, ...]:
    return ("gate_up_proj", "down_proj") if kind == "phi3" else ("gate_proj", "up_proj", "down_proj")


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
    cls = _norm_class(kind)

    def make(old: nn.Module) -> nn.Module:
        eps = getattr(old, "variance_epsilon", getattr(old, "eps", 1e-6))
        new = _on_meta(lambda: cls(old.weight.shape[0], eps=eps))
        new.weight = old.weight
        _check_materialised(new, cls.__name__)
        return new.train(old.training)

    return make


def _make_mlp(kind: str, config):
    cls = _mlp_class(kind)

    def make(old: nn.Module) -> nn.Module:
        new = _on_meta(lambda: cls(config))
        for part in _mlp_parts(kind):
            setattr(new, part, getattr(old, part))
        _check_materialised(new, cls.__name__)
        return new.train(old.training)

    return make


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _patch_instance_forward(target: nn.Module, cls: type) -> None:
    new = types.MethodType(make_causal_lm_forward(cls.forward), target)
    if hasattr(target, "_hf_hook") and hasattr(target, "_old_forward"):
        target._old_forward = new  # accelerate keeps its hook around the forward it stored
    else:
        target.forward = new


# --------------------------------------------------------------------------- entry point


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def patch_family(
    spec: FamilySpec,
    model: Optional[nn.Module],
    *,
    rms_norm: bool,
    rope: bool,
    mlp: bool,
    cross_entropy: bool,
):
    """Patch one family (see the module docstring). Returns ``model`` (``None`` for class level)."""
    _check_flags(rms_norm=rms_norm, rope=rope, **{spec.mlp_flag: mlp}, cross_entropy=cross_entropy)
    modeling = importlib.import_module(spec.module)
    causal_lm_cls = getattr(modeling, spec.causal_lm)
    norm_cls = _original_module_attr(modeling, spec.rms_norm)
    mlp_cls = _original_module_attr(modeling, spec.mlp)

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

    if rope:
        original = _original_module_attr(modeling, "apply_rotary_pos_emb")
        _patch_module_attr(modeling, "apply_rotary_pos_emb", make_rotary_replacement(original))

    if target is None:  # class level: models built from now on use our modules
        if rms_norm:
            _patch_module_attr(modeling, spec.rms_norm, _norm_class(spec.norm_kind))
        if mlp:
            _patch_module_attr(modeling, spec.mlp, _mlp_class(spec.mlp_kind))
        if cross_entropy:
            _patch_class_attr(causal_lm_cls, "forward", make_causal_lm_forward(causal_lm_cls.forward))
        return None

    if rms_norm:
        _swap(target, norm_cls, _make_norm(spec.norm_kind))
    if mlp:
        if mlp_activation_supported(target.config, spec.mlp_kind):
            _swap(target, mlp_cls, _make_mlp(spec.mlp_kind, target.config))
        else:
            warnings.warn(
                f"{spec.model_type}: activation {_activation(target.config, spec.mlp_kind)!r} is not "
                f"what the fused {spec.mlp_kind} MLP computes; MLPs left unpatched",
                stacklevel=3,
            )
    if cross_entropy and isinstance(target, causal_lm_cls):
        _patch_instance_forward(target, causal_lm_cls)
    return model
