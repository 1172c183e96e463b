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
promotion), adapters disabled or merged, mixed-adapter batches (``adapter_names``) and other
keywords, LoRA variants (DoRA, aLoRA...), adapter biases, a tensor scaling, adapter weights of a
dtype autocast does not take, and adapters whose weights the fused forward must not read directly:
``lora_A``/``lora_B`` that are not plain ``nn.Linear`` (an FSDP1 unit), that carry forward hooks
(DeepSpeed ZeRO-3's gathers, FSDP2 on the adapter itself) or DTensor / ZeRO-3 weights, or any
global module hook. A base layer whose output leaves autocast's dtype gets PEFT's sum on that
output. Shapes and dtypes are PEFT's: the output has the base output's shape and dtype.
"""

from __future__ import annotations

import functools
import numbers

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module_impl

from liger_losses.patching.core import instance_forward, set_instance_forward


def _lora_linear_class():
    """PEFT's ``lora.layer.Linear`` (None when PEFT is not installed)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return None
    return Linear


@functools.lru_cache(maxsize=None)
def _variant_keys() -> tuple:
    """PEFT's variant keywords of ``lora.Linear.forward`` (looked up once: read at every call)."""
    try:
        from peft.tuners.lora.layer import VARIANT_KWARG_KEYS
    except ImportError:  # older PEFT: no variant keywords
        return ()
    return tuple(VARIANT_KWARG_KEYS)


def _plain_linear(module) -> bool:
    """``module`` is an ``nn.Linear`` whose weight the fused forward may read directly: no hooks of
    its own (a ZeRO-3 gather, an FSDP unit, pruning), no global module hooks, a plain tensor
    weight (not a DTensor or a ZeRO-3 partition), no bias."""
    if type(module) is not nn.Linear or module.bias is not None:
        return False
    if module._forward_pre_hooks or module._forward_hooks:
        return False
    weight = module.weight
    return (type(weight) in (nn.Parameter, torch.Tensor) and not hasattr(weight, "ds_id")
            and tuple(weight.shape) == (module.out_features, module.in_features))


def _adapters_fusable(layer, names, dtype) -> bool:
    """Every active adapter of ``layer`` is vanilla LoRA on plain linears without biases, with a
    numeric scaling, and its weights in ``dtype`` (None, under autocast: a float dtype autocast
    takes)."""
    variants = getattr(layer, "lora_variant", {}) or {}
    dora = getattr(layer, "use_dora", {}) or {}
    for name in names:
        if name not in layer.lora_A:
            continue
        if name in variants or dora.get(name, False):
            return False
        a, b = layer.lora_A[name], layer.lora_B[name]
        if not (_plain_linear(a) and _plain_linear(b)):
            return False
        allowed = (dtype,) if dtype is not None else (torch.float32, torch.bfloat16, torch.float16)
        if a.weight.dtype not in allowed or b.weight.dtype not in allowed:
            return False
        if not isinstance(layer.scaling[name], numbers.Real):
            return False
    return True


def _global_hooks() -> bool:
    return bool(getattr(_module_impl, "_global_forward_pre_hooks", None)
                or getattr(_module_impl, "_global_forward_hooks", None))


def _peft_adapter_sum(layer, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """PEFT's vanilla adapter sum on an already computed base output (its own ops and dtypes)."""
    result_dtype = result.dtype
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
        h = layer._cast_input_dtype(x, lora_a.weight.dtype)
        result = result + lora_b(lora_a(layer.lora_dropout[name](h))) * layer.scaling[name]
    return result.to(result_dtype)


def lora_linear_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward :func:`patch_lora_linears` binds to a ``lora.Linear`` (see the module docstring)."""
    keys = _variant_keys()
    floating = torch.is_floating_point(x)
    autocast = floating and torch.is_autocast_enabled(x.device.type)
    # without autocast, one dtype for input, base weight and adapters (else PEFT's promotion rules)
    same = None if autocast else x.dtype
    base_weight = getattr(self.get_base_layer(), "weight", None)
    if (self.disable_adapters or self.merged or not floating
            or args or any(k != "adapter_names" and k not in keys for k in kwargs)
            or kwargs.get("adapter_names") is not None or any(kwargs.get(k) is not None for k in keys)
            or (same is not None and (base_weight is None or base_weight.dtype != same))
            or not _adapters_fusable(self, self.active_adapters, same) or _global_hooks()):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    expected = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
    if result.dtype != expected:  # a base layer that left autocast's dtype: PEFT's sum on its output
        return _peft_adapter_sum(self, x, result)
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


def _is_ours(forward) -> bool:
    return isinstance(forward, functools.partial) and forward.func is lora_linear_forward


def patch_lora_linears(model: nn.Module) -> int:
    """Give every PEFT ``lora.Linear`` in ``model`` the forward of :func:`lora_linear_forward`, where
    it runs PEFT's class forward: a subclass with a forward of its own, or an instance whose forward
    was replaced already (X-LoRA's, a user's wrapper), is left alone. Returns how many layers carry
    it (patching twice changes nothing). The forward is a ``functools.partial`` of a module-level
    function, so a patched model pickles."""
    cls = _lora_linear_class()
    if cls is None:
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, cls) or type(module).forward is not cls.forward:
            continue
        current = instance_forward(module)
        if _is_ours(current):
            count += 1
            continue
        if current is not None:
            continue
        set_instance_forward(module, functools.partial(lora_linear_forward, module))
        count += 1
    return count
