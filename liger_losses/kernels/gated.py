"""The gated pointwise kernels ``act(gate) * up`` and the host-side pieces shared by
:mod:`swiglu`, :mod:`geglu` and :mod:`gated_down`: the two Triton kernels (``ACT``: 0 silu,
1 tanh GELU, 2 erf GELU), their launch knobs (:class:`GatedTuning`), input checks, the row-split
launch, and the autograd forward/backward bodies.

    forward:   c = act(a) * b
    backward:  da = dc * b * act'(a),  db = dc * act(a)   (+ c over dc with WRITE_PROD)

    silu:   act(a) = a sigmoid(a),                  act'(a) = s + a s (1 - s),  s = sigmoid(a)
    tanh:   act(a) = 0.5 a (1 + tanh(u)) = a s,     s = sigmoid(2u), u = sqrt(2/pi) (a + 0.044715 a^3)
            act'(a) = s + 2 a s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 a^2)    (1 - tanh(u)^2 = 4 s (1 - s))
    erf:    act(a) = 0.5 a (1 + erf(a / sqrt(2))),  act'(a) = 0.5 (1 + erf(a / sqrt(2))) + a phi(a)

``gate`` and ``up`` have one shape ``[..., I]`` and dtype; the kernels see them as one flat row
when both are contiguous (:func:`launch_flat`), else as 2-D views ``[rows, I]``
(:func:`~liger_losses.kernels.utils.rows_view`), on a grid ``(cdiv(I, BLOCK), rows)``;
each kernel takes ``(*pointers, I, *row_strides, BLOCK)`` (+ its own constexprs).
The backward writes ``d_gate``/``d_up`` into fresh tensors, or with ``inplace_backward`` into the
buffers of ``gate`` and ``up`` (only when the caller owns them: see :mod:`swiglu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from liger_losses.kernels.launch import fast_kernel
from liger_losses.kernels.tuning import Knobs, knob
from liger_losses.kernels.utils import (
    MAX_GRID_Y,
    CheckedSignatures,
    check_no_double_backward,
    check_same_device,
    check_tensor,
    device_ctx,
    import_triton,
    owns_buffer,
    resolve_impl,
    rows_view,
    tensor_signature,
)

triton, tl = import_triton()

# The kernels' ACT constexpr per activation name.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}


@dataclass(frozen=True)
class GatedTuning(Knobs):
    """Launch knobs of the gated kernels: ``block_size`` elements per program (a power of 2) and
    ``num_warps``. The defaults (4096 / 8: 16 elements, two 16-byte bf16 vectors, per thread) are
    :mod:`swiglu`'s and :mod:`geglu`'s (each has its slot: ``tuning(swiglu=...)``,
    ``tuning(geglu=...)``); :mod:`gated_down` sizes them per column block."""

    block_size: int = knob(4096, minimum=1)
    num_warps: int = knob(8, minimum=1)


if triton is not None:

    @triton.jit
    def _act_value(a, ACT: tl.constexpr):
        """act(a) in fp32: 0 silu, 1 tanh GELU, 2 erf GELU."""
        if ACT == 0:
            f = a * tl.sigmoid(a)
        elif ACT == 1:
            u = 0.7978845608028654 * a * (1.0 + 0.044715 * a * a)
            f = a * tl.sigmoid(2.0 * u)  # 0.5 (1 + tanh(u)) == sigmoid(2u)
        else:
            f = a * (0.5 * (1.0 + tl.math.erf(a * 0.7071067811865476)))
        return f

    @triton.jit
    def _act_and_grad(a, ACT: tl.constexpr):
        """(act(a), act'(a)) in fp32, sharing their sigmoid / erf; act(a) by the same formula as
        :func:`_act_value`, so the backward's recomputed product equals the forward's."""
        if ACT == 0:
            sig = tl.sigmoid(a)
            f = a * sig
            d = sig + f * (1.0 - sig)
        elif ACT == 1:
            a2 = a * a
            u = 0.7978845608028654 * a * (1.0 + 0.044715 * a2)
            s = tl.sigmoid(2.0 * u)  # 0.5 (1 + tanh(u)); 1 - tanh(u)^2 = 4 s (1 - s)
            f = a * s
            d = s + 2.0 * f * (1.0 - s) * 0.7978845608028654 * (1.0 + 0.134145 * a2)
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(a * 0.7071067811865476))
            f = a * cdf
            d = cdf + a * 0.3989422804014327 * tl.exp(-0.5 * a * a)
        return f, d

    @triton.jit
    def gated_fwd_kernel(
        a_ptr, b_ptr, c_ptr,
        n_cols, stride_a, stride_b, stride_c,
        ACT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """c = act(a) * b over one block of one row."""
        row = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
        c = _act_value(a, ACT) * b
        tl.store(c_ptr + row * stride_c + cols, c.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def gated_bwd_kernel(
        dc_ptr, a_ptr, b_ptr, da_ptr, db_ptr,
        n_cols, stride_dc, stride_a, stride_b, stride_da, stride_db,
        ACT: tl.constexpr, WRITE_PROD: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """da = dc * b * act'(a), db = dc * act(a); with WRITE_PROD the product act(a) * b is
        stored over dc (each element read before it is written, by the same thread). da/db may
        alias a/b."""
        row = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dc = tl.load(dc_ptr + row * stride_dc + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + row * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
        f, d = _act_and_grad(a, ACT)
        tl.store(da_ptr + row * stride_da + cols, (dc * b * d).to(da_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + row * stride_db + cols, (dc * f).to(db_ptr.dtype.element_ty), mask=mask)
        if WRITE_PROD:
            tl.store(dc_ptr + row * stride_dc + cols, (f * b).to(dc_ptr.dtype.element_ty), mask=mask)

    gated_fwd_kernel = fast_kernel(gated_fwd_kernel)
    gated_bwd_kernel = fast_kernel(gated_bwd_kernel)



def check_gate_up(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise unless ``gate`` and ``up`` are float tensors of one shape, dtype and device."""
    check_tensor("gate", gate, min_ndim=1, floating=True)
    check_tensor("up", up, min_ndim=1, floating=True)
    if up.shape != gate.shape:
        raise ValueError(
            f"up must have the same shape as gate {tuple(gate.shape)}, got {tuple(up.shape)}"
        )
    if up.dtype != gate.dtype:
        raise TypeError(f"up must have gate's dtype {gate.dtype}, got {up.dtype}")
    check_same_device(gate=gate, up=up)


def check_inplace_backward(inplace_backward) -> None:
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be a bool, got {type(inplace_backward).__name__}")


_CHECKED = CheckedSignatures()


def checked_gated_impl(gate, up, inplace_backward, impl: str, *options, check_options=None) -> str:
    """"triton" or "torch" for a gated call, after :func:`check_gate_up`, ``check_options()`` (the
    caller's own option checks, on ``options``) and :func:`check_inplace_backward`; remembered per
    signature (:class:`~liger_losses.kernels.utils.CheckedSignatures`)."""
    g_sig, u_sig = tensor_signature(gate), tensor_signature(up)
    same_shape = up.shape == gate.shape if g_sig and u_sig else None  # None: not two plain tensors
    key = _CHECKED.key(g_sig, u_sig, same_shape, type(inplace_backward), inplace_backward, impl, *options)
    which = _CHECKED.get(key)
    if which is None:
        check_gate_up(gate, up)
        if check_options is not None:
            check_options()
        check_inplace_backward(inplace_backward)
        which = resolve_impl(impl, gate, up)
        _CHECKED.remember(key, which)
    return which


def launch_rows(kernel, tensors, knobs: GatedTuning, **constexprs) -> None:
    """Launch ``kernel[(cdiv(I, BLOCK), rows)](*tensors, I, *row_strides, ...)`` over the 2-D
    ``tensors`` (all ``[rows, I]``), ``BLOCK``/``num_warps`` from ``knobs`` (the caller reads its
    slot's current value at call time), in slices of at most ``MAX_GRID_Y`` rows (the grid's
    second axis holds at most 65535 programs; the usual one flat row takes one launch)."""
    rows, n_cols = tensors[0].shape
    strides = tuple(t.stride(0) for t in tensors)
    block = knobs.block_size
    grid_x = -(-n_cols // block)
    with device_ctx(tensors[0]):
        for r0 in range(0, rows, MAX_GRID_Y):
            r1 = min(rows, r0 + MAX_GRID_Y)
            views = tensors if r1 - r0 == rows else [t[r0:r1] for t in tensors]
            kernel[(grid_x, r1 - r0)](
                *views, n_cols, *strides, BLOCK=block, num_warps=knobs.num_warps, **constexprs
            )


def launch_flat(kernel, tensors, knobs: GatedTuning, **constexprs) -> None:
    """:func:`launch_rows` over contiguous ``tensors`` of one size seen as one flat row, without
    making the 2-D views (host time: the MLP calls this on every layer of every step)."""
    n = tensors[0].numel()
    block = knobs.block_size
    with device_ctx(tensors[0]):
        kernel[(-(-n // block), 1)](
            *tensors, n, *((n,) * len(tensors)), BLOCK=block, num_warps=knobs.num_warps, **constexprs
        )


def gated_torch(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """The PyTorch path of the kernels: ``act(gate) * up`` in fp32, stored in gate's dtype
    (``activation`` a key of :data:`ACTIVATIONS`)."""
    g = gate.float()
    if activation == "silu":
        f = F.silu(g)
    else:
        f = F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")
    return (f * up.float()).to(gate.dtype)


def writes_grads_inplace(inplace_backward: bool, gate, a2, up=None, b2=None) -> bool:
    """Whether a backward may write d_gate/d_up into the inputs' buffers: asked for, and the
    caller owns them (:func:`~liger_losses.kernels.utils.owns_buffer` through the 2-D views
    ``a2``/``b2``, None for contiguous inputs seen whole) -- two separate buffers for ``gate``
    and ``up``, or with ``up=None`` one contiguous packed ``gate_up`` (``gate``) seen through
    ``a2``."""
    if not inplace_backward:
        return False
    if up is None:
        return gate.is_contiguous() and owns_buffer(gate, a2)
    return (owns_buffer(gate, a2) and owns_buffer(up, b2)
            and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr())


def _operands(gate, up):
    """``(a, b, launch)``: gate and up as the kernels see them -- themselves, launched as one flat
    row (:func:`launch_flat`), when both are contiguous; else their 2-D views (:func:`launch_rows`)."""
    if gate.is_contiguous() and up.is_contiguous():
        return gate, up, launch_flat
    return rows_view(gate), rows_view(up), launch_rows


def gated_forward(ctx, gate, up, inplace_backward, kernel, knobs, **constexprs) -> torch.Tensor:
    """Autograd forward: ``kernel`` over gate and up (one flat row when both are contiguous, else
    their 2-D views, :func:`launch_rows`) into an output made in gate's shape (returned as is, not
    as a view made here, so callers may modify it in place); saves gate and up and whether the
    backward may write into their buffers."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    a, b, launch = _operands(gate, up)
    flat = a is gate
    if out.numel():
        launch(kernel, (a, b, out if flat else out.view(a.shape)), knobs, **constexprs)
    ctx.inplace = writes_grads_inplace(inplace_backward, gate, None if flat else a, up, None if flat else b)
    ctx.save_for_backward(gate, up)
    return out


def guard_second_backward(ctx) -> None:
    """Raise a RuntimeError that names the cause when an in-place backward (``ctx.inplace``) runs a
    second time through the same graph (``retain_graph=True``): the first one overwrote the saved
    inputs with the gradients (autograd's own error would only name a version counter)."""
    if ctx.inplace and getattr(ctx, "backward_done", False):
        raise RuntimeError(
            "a second backward through this gated MLP (retain_graph=True) is not supported with "
            "inplace_backward=True: the first backward wrote the gradients into the saved gate/up "
            "buffers; use inplace_backward=False (apply_liger_kernels(..., swiglu=False/geglu=False) "
            "for patched models)"
        )
    check_no_double_backward(
        "the gated MLP kernels",
        'use impl="torch" (apply_liger_kernels(..., swiglu=False/geglu=False) for patched models)',
    )
    ctx.backward_done = True


def gated_backward(ctx, grad_out, kernel, knobs, **constexprs) -> tuple[torch.Tensor, torch.Tensor]:
    """Autograd backward: ``kernel(dc, a, b, da, db)`` (flat when gate, up and the gradient are
    contiguous, else over the 2-D views); returns (grad_gate, grad_up). With the in-place backward a
    second backward through the same graph (``retain_graph=True``) raises a RuntimeError saying so
    (the first one overwrote gate and up)."""
    guard_second_backward(ctx)
    gate, up = ctx.saved_tensors
    a, b, launch = _operands(gate, up)
    flat = a is gate
    dc = grad_out.contiguous() if flat else grad_out.contiguous().view(a.shape)
    if ctx.inplace:
        da, db = a, b
    else:
        da = torch.empty(a.shape, dtype=gate.dtype, device=gate.device)
        db = torch.empty(b.shape, dtype=up.dtype, device=up.device)
    if da.numel():
        launch(kernel, (dc, a, b, da, db), knobs, **constexprs)
    if not flat:
        da, db = da.view(gate.shape), db.view(up.shape)
    if ctx.inplace:
        # Anyone else who saved gate/up now gets a loud version-counter error, not wrong grads.
        torch.autograd.graph.increment_version(gate)
        torch.autograd.graph.increment_version(up)
        return gate, up
    return da, db
