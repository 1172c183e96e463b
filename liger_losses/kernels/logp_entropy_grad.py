"""The gradient of ``a * logp + c * entropy`` of each row of a logits tile, written in place (layer 1).

For losses whose per-token upstream gradients ``d loss / d logp`` and ``d loss / d entropy`` are
known once the row's statistics are (GRPO's entropy bonus, a two-phase pass that recomputes the
tile after a first pass took the statistics): given ``x [n, V]`` (bf16 / fp16 / fp32 / fp64 logits,
unit column stride), ``labels [n]``, the row statistics ``lse [n]`` and ``entropy [n]`` (float32,
from :func:`~liger_losses.kernels.logits_tile.logits_tile`) and the upstream gradients
``grad_logp [n]``, ``grad_entropy [n]`` (or None: zero), the tile is overwritten by

    d/dx (grad_logp * logp + grad_entropy * entropy)
      = (grad_logp * (onehot - p) - grad_entropy * p * (z - lse + entropy)) * dz/dx

with the transform of :mod:`~liger_losses.kernels.logits_tile` (``y = logit_scale * x``, optional
``softcap * tanh(y / softcap)``, ``z = y / temperature``; ``dz/dx = logit_scale / temperature *
(1 - tanh^2)``) and ``p = exp(z - lse)`` (``d entropy / d z_k = -p_k (log p_k + entropy)``).
Rows whose label is ``ignore_index`` or outside ``[0, V)`` get a zero row. One read and one write
of the tile (the statistics are inputs); float32 arithmetic. ``impl="torch"``: the same in PyTorch
(float64 arithmetic for float64 logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from liger_losses.kernels.logits_tile import transform_logits_torch
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import (
    check_range,
    check_same_device,
    check_tensor,
    device_ctx,
    import_triton,
    next_power_of_2,
    resolve_impl,
    triton_interpret,
)

triton, tl = import_triton()


@dataclass(frozen=True)
class LogpEntropyGradTuning(Knobs):
    """Launch knobs of the logp/entropy gradient kernel (slot ``logp_entropy_grad``):
    ``block_cap`` columns per block of the row loop on the GPU (1024 in the interpreter, which
    runs smaller blocks faster), ``num_warps`` warps per program (0: 8 for blocks >= 4096, else 4).
    The kernel is one read and one write of the tile; no sweep of these knobs is recorded."""

    block_cap: int = knob(4096, minimum=1)
    num_warps: int = knob(0)


LOGP_ENTROPY_GRAD_TUNING = register("logp_entropy_grad", LogpEntropyGradTuning())

if triton is not None:

    from liger_losses.kernels.utils import transform_logits  # jit helper

    @triton.jit
    def _logp_entropy_grad_kernel(
        X, stride_x, LABELS, LSE, ENT, GL, GE, V, ignore_index, logit_scale, inv_temp, softcap,
        HAS_SOFTCAP: tl.constexpr, HAS_GE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_ptr = X + row * stride_x
        label = tl.load(LABELS + row).to(tl.int64)
        valid = (label != ignore_index) & (label >= 0) & (label < V)
        lse = tl.where(valid, tl.load(LSE + row), 0.0)
        gl = tl.where(valid, tl.load(GL + row).to(tl.float32), 0.0)
        coef = tl.where(valid, logit_scale * inv_temp, 0.0)
        ge = 0.0
        ent = 0.0
        if HAS_GE:
            ge = tl.where(valid, tl.load(GE + row).to(tl.float32), 0.0)
            ent = tl.where(valid, tl.load(ENT + row), 0.0)
        v_read = tl.where(valid, V, 0)  # ignored rows: nothing read, a zero row written
        offs = tl.arange(0, BLOCK)
        for b in range(0, tl.cdiv(V, BLOCK)):
            cols = b * BLOCK + offs
            mask = cols < V
            x = tl.load(x_ptr + cols, mask=cols < v_read, other=0.0).to(tl.float32)
            z, t = transform_logits(x, logit_scale, inv_temp, softcap, HAS_SOFTCAP)
            p = tl.exp(tl.minimum(z - lse, 0.0))
            g = -gl * p
            if HAS_GE:
                g = g - ge * p * (z - lse + ent)
            g = tl.where(cols == label, g + gl, g) * coef
            if HAS_SOFTCAP:
                g = g * (1.0 - t * t)
            tl.store(x_ptr + cols, g.to(X.dtype.element_ty), mask=mask)


def _logp_entropy_grad_torch(x, labels, lse, entropy, grad_logp, grad_entropy, ignore_index,
                             logit_scale, temperature, softcap) -> None:
    n, V = x.shape
    valid = (labels != ignore_index) & (labels >= 0) & (labels < V)
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    z, t = transform_logits_torch(x, logit_scale, temperature, softcap)
    zero = torch.zeros_like(lse, dtype=z.dtype)
    lse_v = torch.where(valid, lse.to(z.dtype), zero)[:, None]
    p = torch.exp((z - lse_v).clamp(max=0.0))
    gl = torch.where(valid, grad_logp.to(z.dtype), zero)[:, None]
    g = -gl * p
    if grad_entropy is not None:
        ge = torch.where(valid, grad_entropy.to(z.dtype), zero)[:, None]
        ent = torch.where(valid, entropy.to(z.dtype), zero)[:, None]
        g = g - ge * p * (z - lse_v + ent)
    g = g + gl * torch.zeros_like(g).scatter_(1, safe[:, None], 1.0)
    g = g * (logit_scale / temperature)
    if t is not None:
        g = g * (1.0 - t * t)
    x.copy_(torch.where(valid[:, None], g, torch.zeros_like(g)))


def logp_entropy_grad_(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    grad_logp: Tensor,
    *,
    entropy: Optional[Tensor] = None,
    grad_entropy: Optional[Tensor] = None,
    ignore_index: int = -100,
    logit_scale: float = 1.0,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    impl: str = "auto",
) -> Tensor:
    """Overwrite ``logits [n, V]`` by ``d (grad_logp * logp + grad_entropy * entropy) / d logits``
    (see the module docstring); ``lse``, ``grad_logp``, ``entropy``, ``grad_entropy`` are ``[n]``
    (``entropy`` needed with ``grad_entropy``). Returns ``logits``."""
    check_tensor("logits", logits, ndim=2, floating=True)
    check_tensor("labels", labels, ndim=1, floating=False)
    n, V = logits.shape
    named = {"labels": labels, "lse": lse, "grad_logp": grad_logp, "entropy": entropy, "grad_entropy": grad_entropy}
    for name, value in named.items():
        if value is None:
            continue
        if name != "labels":
            check_tensor(name, value, ndim=1, floating=True)
        if value.shape[0] != n:
            raise ValueError(f"{name} must have shape [{n}] (rows of logits), got {tuple(value.shape)}")
    if grad_entropy is not None and entropy is None:
        raise ValueError("entropy is needed with grad_entropy (the gradient of the entropy uses it)")
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride in the last dimension to take the gradient in place")
    check_range("logit_scale", float(logit_scale), 0.0, None, low_inclusive=False)
    check_range("temperature", float(temperature), 0.0, None, low_inclusive=False)
    if softcap is not None:
        check_range("softcap", float(softcap), 0.0, None, low_inclusive=False)
    check_same_device(logits=logits, **named)
    if resolve_impl(impl, logits) == "torch" or n == 0:
        _logp_entropy_grad_torch(logits, labels, lse, entropy, grad_logp, grad_entropy, ignore_index,
                                 float(logit_scale), float(temperature), None if softcap is None else float(softcap))
        return logits
    knobs = LOGP_ENTROPY_GRAD_TUNING.current
    block = min(next_power_of_2(V), 1024 if triton_interpret() else knobs.block_cap)
    has_ge = grad_entropy is not None
    lse32 = lse.float().contiguous()
    gl = grad_logp.float().contiguous()
    ge = grad_entropy.float().contiguous() if has_ge else gl
    ent = entropy.float().contiguous() if has_ge else lse32
    with device_ctx(logits):
        _logp_entropy_grad_kernel[(n,)](
            logits, logits.stride(0), labels.contiguous(), lse32, ent, gl, ge, V, int(ignore_index),
            float(logit_scale), 1.0 / float(temperature), float(softcap) if softcap is not None else 1.0,
            HAS_SOFTCAP=softcap is not None, HAS_GE=has_ge, BLOCK=block,
            num_warps=knobs.num_warps or (8 if block >= 4096 else 4),
        )
    return logits
