"""The gated MLP modules (drop-ins for Hugging Face's SwiGLU / Phi-3 / GeGLU MLPs) and their tail
``down_proj(act(gate) * up)``.

    forward(x) = down_proj(act(gate_proj(x)) * up_proj(x))           x: [..., hidden_size]
    Phi-3:       gate, up = gate_up_proj(x).chunk(2, -1), then the same

``mlp_tail(down_proj, gate, up, *, activation, impl)`` is what the modules call: the activation
kernel (:mod:`swiglu` / :mod:`geglu`, gradients written into gate/up, which the module owns), then
``down_proj``; or, with ``MLP_TUNING.current.fuse_down_proj`` and a plain ``nn.Linear``
``down_proj`` (:func:`fusable_linear`), the fused tail of :mod:`gated_down`, which never saves the
product. Shapes: ``gate``/``up`` ``[..., I]`` (``up=None``: ``gate`` is Phi-3's packed
``gate_up [..., 2I]``); the output ``[..., H]``. Dtypes: those of the projections (autocast applies).

Public API:
    LigerSwiGLUMLP(config)       drop-in for LlamaMLP / Qwen2MLP / MistralMLP
    LigerPhi3SwiGLUMLP(config)   drop-in for Phi3MLP (fused gate_up_proj)
    LigerGEGLUMLP(config)        drop-in for GemmaMLP
    mlp_tail, fusable_linear, MLPTuning / MLP_TUNING (the fused-tail switch)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from liger_losses.kernels.gated_down import gated_down_proj, gated_down_proj_packed
from liger_losses.kernels.geglu import GATED_ACTIVATION, geglu
from liger_losses.kernels.swiglu import swiglu, swiglu_packed
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import resolve_impl


@dataclass(frozen=True)
class MLPTuning(Knobs):
    """``fuse_down_proj``: the MLP modules fuse the down projection (:mod:`gated_down`) when True.
    Off by default: in a whole training step (Llama-3.2-1B shape, 8 x 2048 tokens, H200) it lowers
    DPO's peak by 864 MiB (0.90x -> 0.848x TRL's) but costs 2-4% of the step, its blocked GEMMs
    running slower there than alone (benchmark/results/README.md, "The gated MLP tail without its
    product"). Turn it on when memory binds: ``with tuning(mlp={"fuse_down_proj": True})``."""

    fuse_down_proj: bool = knob(False)


MLP_TUNING = register("mlp", MLPTuning())


# --------------------------------------------------------------------------- the tail


def _global_hooks() -> bool:
    from torch.nn.modules import module as nn_module

    return any(
        getattr(nn_module, name, None)
        for name in (
            "_global_forward_hooks", "_global_forward_pre_hooks",
            "_global_backward_hooks", "_global_backward_pre_hooks",
        )
    )


def fusable_linear(module: nn.Module) -> bool:
    """True when an MLP may read ``module``'s weight and bias directly instead of calling it: a
    plain ``nn.Linear`` (not a LoRA or quantized subclass) with no forward hooks (ZeRO-3 gathers
    parameters in one, accelerate moves them in one) and plain tensor parameters (not DTensor)."""
    if type(module) is not nn.Linear or module._forward_hooks or module._forward_pre_hooks:
        return False
    if module._backward_hooks or module._backward_pre_hooks:  # run only by module.__call__
        return False
    if _global_hooks():
        return False
    params = [p for p in (module.weight, module.bias) if p is not None]
    return all(type(p) in (nn.Parameter, torch.Tensor) and p.device.type != "meta" for p in params)


def mlp_tail(
    down_proj: nn.Module,
    gate: torch.Tensor,
    up: Optional[torch.Tensor],
    *,
    activation: str,
    impl: str = "auto",
) -> torch.Tensor:
    """``down_proj(act(gate) * up)`` for the MLP modules, which own ``gate``/``up`` (gradients are
    written into them). ``up=None``: ``gate`` is Phi-3's packed ``gate_up``. Fused
    (:func:`~liger_losses.kernels.gated_down.gated_down_proj`) when ``MLP_TUNING.current.fuse_down_proj``,
    ``down_proj`` is :func:`fusable_linear` and Triton runs on the inputs' device; else the
    activation kernel, then ``down_proj``."""
    if MLP_TUNING.current.fuse_down_proj and fusable_linear(down_proj) and resolve_impl(impl, gate) == "triton":
        if up is None:
            return gated_down_proj_packed(
                gate, down_proj.weight, down_proj.bias, activation=activation,
                inplace_backward=True, impl=impl,
            )
        return gated_down_proj(
            gate, up, down_proj.weight, down_proj.bias, activation=activation,
            inplace_backward=True, impl=impl,
        )
    if activation == "silu":
        prod = swiglu_packed(gate, inplace_backward=True, impl=impl) if up is None else swiglu(
            gate, up, inplace_backward=True, impl=impl
        )
    else:
        if up is None:
            gate, up = gate.chunk(2, dim=-1)
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        prod = geglu(gate, up, approximate=approximate, inplace_backward=True, impl=impl)
    return down_proj(prod)


# --------------------------------------------------------------------------- modules

_SILU_NAMES = ("silu", "swish")
# Hugging Face activation names (ACT2FN) -> the GeGLU kernel's ``approximate``.
_GELU_NAMES = {
    "gelu_pytorch_tanh": "tanh",
    "gelu_new": "tanh",
    "gelu_fast": "tanh",
    "gelu": "none",
}


def _check_silu(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in _SILU_NAMES:
        raise ValueError(f"config.hidden_act must be one of {_SILU_NAMES} for a SwiGLU MLP, got {act!r}")


class LigerSwiGLUMLP(nn.Module):
    """Drop-in for ``LlamaMLP`` / ``Qwen2MLP`` / ``MistralMLP``: same parameters and forward.

    ``forward(x) = down_proj(swiglu(gate_proj(x), up_proj(x)))``, ``x: [..., hidden_size]``, through
    :func:`mlp_tail`. The gradients of the (private) gate/up projections' outputs are written in
    place. ``residual_dropout`` (``config.residual_dropout``, 0 when absent; Seed-OSS's MLP drops out its
    output in training): the output's dropout, drawn as the Hugging Face MLP draws it.
    ``intermediate_size`` (default ``config.intermediate_size``): MoE shared-expert and dense MLPs are
    built with their own width, as the Hugging Face classes are.
    """

    def __init__(self, config, intermediate_size: Optional[int] = None, *, impl: str = "auto"):
        super().__init__()
        _check_silu(config)
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.residual_dropout = float(getattr(config, "residual_dropout", 0.0) or 0.0)
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = mlp_tail(self.down_proj, self.gate_proj(x), self.up_proj(x), activation="silu", impl=self.impl)
        if self.residual_dropout:
            out = F.dropout(out, p=self.residual_dropout, training=self.training)
        return out


class LigerPhi3SwiGLUMLP(nn.Module):
    """Drop-in for ``Phi3MLP``: ``gate_up_proj`` (hidden -> 2I, no bias) and ``down_proj`` (I -> hidden)."""

    def __init__(self, config, intermediate_size: Optional[int] = None, *, impl: str = "auto"):
        super().__init__()
        _check_silu(config)
        self.config = config
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)
        self.impl = impl

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return mlp_tail(self.down_proj, self.gate_up_proj(hidden_states), None, activation="silu", impl=self.impl)


class LigerGEGLUMLP(nn.Module):
    """Drop-in for ``GemmaMLP``: gate_proj, up_proj, down_proj without bias, same forward.

    ``forward(x) = down_proj(geglu(gate_proj(x), up_proj(x)))`` with the GELU variant named by
    ``config.hidden_act`` (or the older ``config.hidden_activation``), ``gelu_pytorch_tanh`` by
    default, through :func:`mlp_tail`.
    """

    def __init__(self, config, intermediate_size: Optional[int] = None, *, impl: str = "auto"):
        super().__init__()
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        act = act or "gelu_pytorch_tanh"
        if act not in _GELU_NAMES:
            raise ValueError(
                f"config.hidden_act must be one of {tuple(_GELU_NAMES)} for a GeGLU MLP, got {act!r}"
            )
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.approximate = _GELU_NAMES[act]
        self.impl = impl

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlp_tail(self.down_proj, self.gate_proj(x), self.up_proj(x),
                        activation=GATED_ACTIVATION[self.approximate], impl=self.impl)
