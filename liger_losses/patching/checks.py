"""Checks that the installed transformers still has what a family's patch replaces, run before
anything is patched (so a failed check leaves the model and the modeling module untouched).

``check_module(spec, modeling, *, rope, mlp, cross_entropy)`` checks the modeling module: the
``*ForCausalLM`` class, its ``forward`` taking ``labels`` and ``logits_to_keep`` (and
``output_router_logits`` for MoE families), the RMSNorm class built as ``(hidden_size, eps)``, the
MLP class (when the MLP is swapped), ``apply_rotary_pos_emb(q, k, cos, sin, ...)`` (when RoPE is
patched; read through a hub-kernel wrapper, ``rope.underlying_function``) and
``load_balancing_loss_func`` (MoE families).
``check_instance(spec, target, norm_cls, mlp_cls, *, mlp, cross_entropy)`` checks a model instance:
every RMSNorm module holds a 1-D ``weight`` and an ``eps``/``variance_epsilon``, every MLP module the
linear projections our MLP re-binds (``nn.Linear`` or a PEFT layer around one), and the causal LM
has ``model`` and ``lm_head`` (and the router attributes transformers' MoE forward reads).

A failed check raises ``FamilyMismatchError`` naming the family, the transformers version and
every mismatch found.
"""

from __future__ import annotations

import inspect
from typing import Callable, List, Optional, Sequence

from torch import nn

from liger_losses.patching.causal_lm import LIGER_MARK
from liger_losses.patching.rope import underlying_function
from liger_losses.patching.specs import FamilySpec


class FamilyMismatchError(RuntimeError):
    """The installed transformers does not have what a family's patch expects; nothing was patched."""


def transformers_version() -> str:
    try:
        import transformers
    except ImportError:  # pragma: no cover - layer 3 always has transformers
        return "not installed"
    return getattr(transformers, "__version__", "unknown")


def raise_mismatch(spec: FamilySpec, problems: Sequence[str]) -> None:
    if problems:
        raise FamilyMismatchError(
            f"cannot patch model_type {spec.model_type!r} with transformers {transformers_version()}: "
            + "; ".join(problems)
            + ". Nothing was patched."
        )


def _parameters(fn: Callable) -> Optional[dict]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _positional_count(fn: Callable) -> int:
    params = _parameters(fn) or {}
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params.values())


def _class(modeling, name: str, problems: List[str]) -> Optional[type]:
    value = getattr(modeling, name, None)
    if not isinstance(value, type):
        problems.append(f"{modeling.__name__}.{name} is missing (or not a class)")
        return None
    return value


def check_module(spec: FamilySpec, modeling, *, rope: bool, mlp: bool, cross_entropy: bool,
                 originals: Callable[[str], object]) -> None:
    """Check the modeling module (see the module docstring); ``originals(name)`` gives the
    module attribute as transformers defined it (before any patch of ours)."""
    problems: List[str] = []
    causal_lm = _class(modeling, spec.causal_lm, problems)
    if causal_lm is not None and cross_entropy:
        needed = ["labels", "logits_to_keep"] + (["output_router_logits"] if spec.moe else [])
        forward = getattr(causal_lm, "forward", None)
        params = _parameters(getattr(forward, LIGER_MARK, forward)) or {}
        missing = [n for n in needed if n not in params]
        if missing:
            problems.append(f"{spec.causal_lm}.forward takes no {', '.join(missing)}")
    if getattr(modeling, spec.rms_norm, None) is None:
        problems.append(f"{modeling.__name__}.{spec.rms_norm} is missing")
    else:
        norm = originals(spec.rms_norm)
        if not isinstance(norm, type) or _positional_count(norm.__init__) < 3:
            problems.append(f"{spec.rms_norm} is not a class built as (hidden_size, eps)")
    if mlp and spec.mlp is not None:
        if getattr(modeling, spec.mlp, None) is None:
            problems.append(f"{modeling.__name__}.{spec.mlp} is missing")
        elif not isinstance(originals(spec.mlp), type):
            problems.append(f"{spec.mlp} is not a class")
    if rope and spec.rope:
        fn = originals("apply_rotary_pos_emb") if hasattr(modeling, "apply_rotary_pos_emb") else None
        params = _parameters(underlying_function(fn)) if callable(fn) else None
        if not callable(fn):
            problems.append(f"{modeling.__name__}.apply_rotary_pos_emb is missing")
        elif params is not None and list(params)[:4] != ["q", "k", "cos", "sin"]:
            problems.append(f"{modeling.__name__}.apply_rotary_pos_emb is not (q, k, cos, sin, ...), "
                            f"got {tuple(params)}")
    if spec.moe and cross_entropy and not callable(getattr(modeling, "load_balancing_loss_func", None)):
        problems.append(f"{modeling.__name__}.load_balancing_loss_func is missing")
    raise_mismatch(spec, problems)


_MLP_PARTS = {"phi3": ("gate_up_proj", "down_proj"), "swiglu": ("gate_proj", "up_proj", "down_proj"),
              "geglu": ("gate_proj", "up_proj", "down_proj")}


def is_projection(module) -> bool:
    """A linear projection our MLP can call: ``nn.Linear`` (quantized linears subclass it), or a
    wrapper of one (PEFT's LoRA layers hold it as ``base_layer``; adapters run in their forward)."""
    while isinstance(module, nn.Module) and not isinstance(module, nn.Linear):
        module = getattr(module, "base_layer", None)
    return isinstance(module, nn.Linear)


def mlp_parts(kind: str):
    """The sub-modules our MLP of ``kind`` re-binds from the transformers MLP."""
    return _MLP_PARTS[kind]


def check_instance(spec: FamilySpec, target: nn.Module, norm_cls: type, mlp_cls: Optional[type], *,
                   rms_norm: bool, mlp: bool, cross_entropy: bool, causal_lm_cls: type) -> None:
    """Check a model instance (see the module docstring) before any of its modules is swapped."""
    problems: List[str] = []
    for name, module in target.named_modules():
        if rms_norm and isinstance(module, norm_cls):
            weight = getattr(module, "weight", None)
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
            if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
                problems.append(f"{name} ({spec.rms_norm}) has no 1-D weight parameter")
            if not isinstance(eps, (int, float)):
                problems.append(f"{name} ({spec.rms_norm}) has no eps / variance_epsilon number")
        if mlp and mlp_cls is not None and isinstance(module, mlp_cls):
            for part in mlp_parts(spec.mlp_kind):
                if not is_projection(getattr(module, part, None)):
                    problems.append(f"{name} ({spec.mlp}) has no linear {part}")
        if len(problems) >= 8:
            break
    if cross_entropy and isinstance(target, causal_lm_cls):
        for attr in ("model", "lm_head"):
            if not isinstance(getattr(target, attr, None), nn.Module):
                problems.append(f"{spec.causal_lm} instance has no {attr} module")
        if not hasattr(getattr(target, "lm_head", None), "weight"):
            problems.append(f"{spec.causal_lm}.lm_head has no weight")
        if spec.moe:
            for attr in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok"):
                if not hasattr(target, attr):
                    problems.append(f"{spec.causal_lm} instance has no {attr}")
    raise_mismatch(spec, problems)
