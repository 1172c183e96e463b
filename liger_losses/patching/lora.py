"""PEFT LoRA linears under autocast: the adapter's up-projection accumulated into the base output.

PEFT's ``lora.Linear.forward`` computes, per active adapter::

    result = base_layer(x) + lora_B(lora_A(dropout(x.to(A.dtype)))) * scaling

With the adapters in fp32 (PEFT's default on a bf16 / fp16 model) and a trainer's ``bf16=True``
autocast, each adapter then makes an fp32 copy of its ``[tokens, in_features]`` input, which
autocast copies back to bf16 for ``lora_A`` (and saves for backward: one more copy of an input the
base layer already holds), and three passes over the ``[tokens, out_features]`` output (``lora_B``'s
product, the scaling, the sum), each with its own backward pass. That is memory-bound work of the
size of the base layer's activations, for every adapted linear, forward, recomputed forward and
backward.

:func:`patch_lora_linears` gives every vanilla-LoRA ``peft.tuners.lora.layer.Linear`` of a model a
forward that, under autocast, computes the same sum as one GEMM into the base output::

    t = lora_A(x)                                  # [tokens, r]; x as given when there is no dropout
    result = addmm(result, t, lora_B.weight.T, alpha=scaling)

Autocast runs both forms in its lower-precision dtype, so the operands are the same numbers
(``x -> fp32 -> bf16`` is exact); the sum is rounded once instead of three times. Without autocast
the same holds when the input, the base output and the adapters share one dtype (fp32 training,
or bf16 adapters on a bf16 model). With dropout the input is cast and dropped as PEFT does (the
same random mask), only the output side is fused. Everything else runs PEFT's own forward: mixed
dtypes without autocast (fp32 adapters on a bf16 model keep PEFT's fp32 adapter math and type
promotion), adapters disabled or merged, mixed-adapter batches (``adapter_names``), LoRA variants
(DoRA, aLoRA...), adapter biases, a tensor scaling. Shapes and dtypes are PEFT's: the output has
the base output's shape and dtype.
"""

from __future__ import annotations

import numbers
import types

import torch
import torch.nn.functional as F
from torch import nn


def _lora_linear_class():
    """PEFT's ``lora.layer.Linear`` (None when PEFT is not installed)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


def _variant_keys() -> tuple:
    try:
        from peft.tuners.lora.layer import VARIANT_KWARG_KEYS
    except ImportError:  # older PEFT: no variant keywords
        return ()
    return tuple(VARIANT_KWARG_KEYS)


def _adapters_fusable(layer, names, dtype) -> bool:
    """Every active adapter of ``layer`` is vanilla LoRA without biases, with a numeric scaling, and
    (``dtype`` not None: no autocast) its weights in ``dtype``."""
    variants = getattr(layer, "lora_variant", {}) or {}
    dora = getattr(layer, "use_dora", {}) or {}
    for name in names:
        if name not in layer.lora_A:
            continue
        if name in variants or dora.get(name, False):
            return False
        a, b = layer.lora_A[name], layer.lora_B[name]
        if a.bias is not None or b.bias is not None:
            return False
        if dtype is not None and (a.weight.dtype != dtype or b.weight.dtype != dtype):
            return False
        if not isinstance(layer.scaling[name], numbers.Real):
            return False
    return True


def lora_linear_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward :func:`patch_lora_linears` binds to a ``lora.Linear`` (see the module docstring)."""
    keys = _variant_keys()
    autocast = torch.is_floating_point(x) and torch.is_autocast_enabled(x.device.type)
    # without autocast, one dtype for input, base weight and adapters (else PEFT's promotion rules)
    same = None if autocast else x.dtype
    base_weight = getattr(self.get_base_layer(), "weight", None)
    if (self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None
            or any(kwargs.get(k) is not None for k in keys) or not torch.is_floating_point(x)
            or (same is not None and (base_weight is None or base_weight.dtype != same))
            or not _adapters_fusable(self, self.active_adapters, same)):
        return type(self).forward(self, x, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "adapter_names" and k not in keys}
    result = self.base_layer(x, *args, **kwargs)
    shape = result.shape
    out = result.reshape(-1, shape[-1])
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        lora_a, lora_b = self.lora_A[name], self.lora_B[name]
        dropout = self.lora_dropout[name]
        # under autocast lora_A's GEMM casts its input to the autocast dtype either way; only a
        # dropout keeps PEFT's cast, so that it draws its mask on the same tensor PEFT does
        h = x if isinstance(dropout, nn.Identity) else dropout(self._cast_input_dtype(x, lora_a.weight.dtype))
        t = F.linear(h, lora_a.weight)
        out = torch.addmm(out, t.reshape(-1, t.shape[-1]), lora_b.weight.t(), alpha=float(self.scaling[name]))
    return out.view(shape)


def patch_lora_linears(model: nn.Module) -> int:
    """Bind :func:`lora_linear_forward` to every PEFT ``lora.Linear`` in ``model`` whose class
    forward is PEFT's own (subclasses with forwards of their own are left alone). Returns how many
    layers carry it (patching twice changes nothing)."""
    cls = _lora_linear_class()
    if cls is None:
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, cls) or type(module).forward is not cls.forward:
            continue
        current = module._old_forward if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") \
            else module.__dict__.get("forward")
        if getattr(current, "__func__", None) is lora_linear_forward:
            count += 1
            continue
        bound = types.MethodType(lora_linear_forward, module)
        if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
            module._old_forward = bound  # accelerate keeps its hook around the forward it stored
        else:
            module.forward = bound
        count += 1
    return count
