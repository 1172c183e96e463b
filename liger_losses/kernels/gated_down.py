"""``down_proj(act(gate) * up)`` that never saves the product ``act(gate) * up`` for the backward.

The tail of a gated MLP (Llama/Qwen/Mistral SwiGLU, Gemma GeGLU, Phi-3's packed ``gate_up``):

    prod = act(gate) * up                [N, I]
    out  = prod @ weight.T (+ bias)      [N, H]

The forward runs in token chunks when it records a graph (one ``[rows, I]`` buffer of about
``GatedDownTuning.forward_chunk_elems`` elements, reused; without a graph, as in gradient
checkpointing's first pass, in one chunk), the backward in blocks of intermediate columns
``[i0, i1)`` (one ``[N, i1 - i0]`` buffer of about ``GatedDownTuning.chunk_elems`` elements, reused):

    d_prod = d_out @ weight[:, i0:i1]                   GEMM into the block buffer
    d_gate, d_up, prod = kernel(d_prod, gate, up)       prod written over d_prod in the buffer
    grad_weight[:, i0:i1] = d_out.T @ prod              GEMM into the block's columns: complete, rounded once

What the backward needs is gate and up, which the unfused MLP saves too (for the activation's
backward); the product is never saved. Per MLP that is one ``[N, I]`` tensor less from forward
to backward, and at the start of the backward one block buffer instead of the product and its
gradient (two ``[N, I]`` tensors): under gradient checkpointing, the layer's peak.
The price: the backward kernel writes the product once more (``N * I`` elements) and the GEMMs
run in blocks (``benchmark/bench_mlp_tail.py`` measures both).

Shapes: ``gate``, ``up`` ``[..., I]`` (or ``gate_up [..., 2I]``, gate first), ``weight [H, I]``
(``down_proj.weight``), ``bias [H]`` or None; ``out [..., H]``.
Dtypes: the GEMMs run in the autocast dtype when autocast is on for the inputs' device (weight
and bias cast as ``F.linear`` does under autocast), else gate/up/weight/bias must share one float
dtype. The activation runs in fp32 inside the kernels; ``prod`` is rounded to the GEMM dtype,
exactly as the unfused MLP stores it. ``activation``: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (Hugging
Face's ``gelu_pytorch_tanh``) or ``"gelu"`` (erf).

``inplace_backward=True`` writes ``d_gate``/``d_up`` into gate's and up's buffers when the caller
owns them (autograd intermediates seen by nobody else, as in the MLP modules); a second backward
through the same graph then raises a RuntimeError.

Public API:
    gated_down_proj(gate, up, weight, bias=None, *, activation="silu", inplace_backward=False, impl="auto")
    gated_down_proj_packed(gate_up, weight, bias=None, *, activation="silu", inplace_backward=False, impl="auto")
    GATED_DOWN_TUNING   the buffer sizes (a :class:`GatedDownTuning` slot)
The MLP modules use it through :func:`liger_losses.kernels.mlp.mlp_tail` when
``MLP_TUNING.current.fuse_down_proj`` is on (off by default; ``with tuning(mlp={"fuse_down_proj":
True})`` turns it on for every patched model).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from liger_losses.kernels.gated import (
    ACTIVATIONS,
    GatedTuning,
    check_inplace_backward,
    gated_bwd_kernel,
    gated_fwd_kernel,
    gated_torch,
    guard_second_backward,
    launch_rows,
    writes_grads_inplace,
)
from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import (
    autocast_dtype,
    check_choice,
    check_same_device,
    check_tensor,
    next_power_of_2,
    resolve_impl,
    rows_view,
)


@dataclass(frozen=True)
class GatedDownTuning(Knobs):
    """Buffer sizes of the fused tail (read at call time; ``benchmark/bench_mlp_tail.py`` sweeps
    them).

    ``chunk_elems``: elements of the backward's block buffer (64 MiB in bf16).
    ``forward_chunk_elems``: elements of the forward's chunk buffer (its product is freed before
    the backward: it bounds a transient, not what is saved).
    ``col_align`` / ``row_align``: column blocks / token chunks are multiples of these (GEMM
    operand alignment, whole vectors per kernel row).
    """

    chunk_elems: int = knob(1 << 25, minimum=1)
    forward_chunk_elems: int = knob(1 << 25, minimum=1)
    col_align: int = knob(256, minimum=1)
    row_align: int = knob(64, minimum=1)


GATED_DOWN_TUNING = register("gated_down", GatedDownTuning())


@functools.lru_cache(maxsize=None)
def _knobs(n_cols: int) -> GatedTuning:
    """BLOCK / warps for rows of ``n_cols``: up to 4096 elements per program, 8 per thread."""
    block = min(4096, max(256, next_power_of_2(n_cols)))
    return GatedTuning(block_size=block, num_warps=max(1, min(8, block // 256)))


def _rows_per_chunk(n_rows: int, n_cols: int) -> int:
    knobs = GATED_DOWN_TUNING.current
    align = knobs.row_align
    rows = max(align, (knobs.forward_chunk_elems // max(n_cols, 1)) // align * align)
    return max(1, min(rows, n_rows))


def _cols_per_block(n_rows: int, n_cols: int) -> int:
    knobs = GATED_DOWN_TUNING.current
    align = knobs.col_align
    cols = max(align, (knobs.chunk_elems // max(n_rows, 1)) // align * align)
    return max(1, min(cols, n_cols))


def _buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def _halves(x2: torch.Tensor):
    """(gate rows, up rows): the halves of a packed ``gate_up [rows, 2I]``."""
    inter = x2.shape[1] // 2
    return x2[:, :inter], x2[:, inter:]


class GatedDownFunction(torch.autograd.Function):
    """``(act(gate) * up) @ weight.T + bias`` in chunks; saves gate/up (or gate_up) and weight.

    ``forward(ctx, gate, up, weight, bias, act, inplace_backward, chunked=True)``: ``up=None``
    means ``gate`` is the packed ``gate_up``; ``chunked=False`` runs the forward in one chunk (no
    graph to build: the product is only a transient). All tensors already in the GEMM dtype, on
    one device.
    """

    @staticmethod
    def forward(ctx, gate, up, weight, bias, act, inplace_backward, chunked=True):
        packed = up is None
        if packed:
            g2 = rows_view(gate)
            a2, b2 = _halves(g2)
            ctx.inplace = writes_grads_inplace(inplace_backward, gate, g2)
            saved = (g2 if g2.untyped_storage().data_ptr() != gate.untyped_storage().data_ptr() else gate,)
        else:
            a2, b2 = rows_view(gate), rows_view(up)
            ctx.inplace = writes_grads_inplace(inplace_backward, gate, a2, up, b2)
            saved = (gate, up)
        n_rows, inter = a2.shape
        # allocated in its final shape and returned as is (not a view made here), so callers may
        # modify it in place as they may down_proj's output; the GEMMs write through out2
        out = torch.empty((*gate.shape[:-1], weight.shape[0]), dtype=weight.dtype, device=weight.device)
        out2 = out.view(n_rows, weight.shape[0])
        rows = _rows_per_chunk(n_rows, inter) if chunked else max(n_rows, 1)
        if n_rows and inter:
            buf = _buffer(min(rows, n_rows) * inter, a2)
            knobs = _knobs(inter)
            for r0 in range(0, n_rows, rows):
                r1 = min(n_rows, r0 + rows)
                prod = buf[: (r1 - r0) * inter].view(r1 - r0, inter)
                launch_rows(gated_fwd_kernel, (a2[r0:r1], b2[r0:r1], prod), knobs, ACT=act)
                if bias is None:
                    torch.mm(prod, weight.t(), out=out2[r0:r1])
                else:
                    torch.addmm(bias, prod, weight.t(), out=out2[r0:r1])
        elif bias is not None:
            out2.copy_(bias.expand_as(out2))
        else:
            out.zero_()
        ctx.packed, ctx.act, ctx.has_bias = packed, act, bias is not None
        ctx.lead = gate.shape[:-1]
        ctx.save_for_backward(*saved, weight)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        guard_second_backward(ctx)
        *saved, weight = ctx.saved_tensors
        packed = ctx.packed
        need_gate = ctx.needs_input_grad[0] or (not packed and ctx.needs_input_grad[1])
        need_weight = ctx.needs_input_grad[2]
        need_bias = ctx.has_bias and ctx.needs_input_grad[3]
        if packed:
            g2 = rows_view(saved[0])
            a2, b2 = _halves(g2)
        else:
            a2, b2 = rows_view(saved[0]), rows_view(saved[1])
        n_rows, inter = a2.shape
        hidden = weight.shape[0]
        d_out = grad_out.reshape(n_rows, hidden)
        if d_out.dtype != weight.dtype:
            d_out = d_out.to(weight.dtype)
        d_out = d_out.contiguous()

        grads_g = None
        if need_gate:
            if ctx.inplace:
                da2, db2 = a2, b2
            elif packed:
                d_packed = torch.empty((n_rows, 2 * inter), dtype=a2.dtype, device=a2.device)
                da2, db2 = _halves(d_packed)
            else:
                da2, db2 = torch.empty_like(a2), torch.empty_like(b2)
        # written block by block: grad_weight[:, i0:i1] is a strided [H, w] view (row stride I)
        # that cuBLAS writes in place, so the gradient leaves in the weight's own layout
        grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else None
        if n_rows and inter and (need_gate or need_weight):
            cols = _cols_per_block(n_rows, inter)
            buf = _buffer(n_rows * cols, a2)
            for i0 in range(0, inter, cols):
                i1 = min(inter, i0 + cols)
                blk = buf[: n_rows * (i1 - i0)].view(n_rows, i1 - i0)
                knobs = _knobs(i1 - i0)
                if need_gate:
                    torch.mm(d_out, weight[:, i0:i1], out=blk)
                    launch_rows(
                        gated_bwd_kernel,
                        (blk, a2[:, i0:i1], b2[:, i0:i1], da2[:, i0:i1], db2[:, i0:i1]),
                        knobs, ACT=ctx.act, WRITE_PROD=need_weight,
                    )
                else:
                    launch_rows(gated_fwd_kernel, (a2[:, i0:i1], b2[:, i0:i1], blk), knobs, ACT=ctx.act)
                if need_weight:
                    torch.mm(d_out.t(), blk, out=grad_weight[:, i0:i1])
        elif need_gate:
            da2.zero_()
            db2.zero_()
        if need_weight and not (n_rows and inter):
            grad_weight.zero_()

        if need_gate:
            if ctx.inplace:
                for t in saved:  # anyone else who saved them now fails loudly, not silently
                    torch.autograd.graph.increment_version(t)
                grads_g = (saved[0], None) if packed else (saved[0], saved[1])
            elif packed:
                grads_g = (d_packed.view(*ctx.lead, 2 * inter), None)
            else:
                grads_g = (da2.view(*ctx.lead, inter), db2.view(*ctx.lead, inter))
        else:
            grads_g = (None, None)
        grad_bias = d_out.sum(0, dtype=torch.float32).to(weight.dtype) if need_bias else None
        return (*grads_g, grad_weight, grad_bias, None, None, None)


# --------------------------------------------------------------------------- public functions


def _check(gate, up, weight, bias, activation, inplace_backward, inter_name="gate"):
    check_choice("activation", activation, tuple(ACTIVATIONS))
    check_inplace_backward(inplace_backward)
    check_tensor("weight", weight, ndim=2, floating=True)
    if bias is not None:
        check_tensor("bias", bias, ndim=1, floating=True)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"bias must have shape [H] = [{weight.shape[0]}] (weight's first dim), got {tuple(bias.shape)}"
            )
    inter = gate.shape[-1] if up is not None else gate.shape[-1] // 2
    if weight.shape[1] != inter:
        raise ValueError(
            f"weight must have shape [H, I] with I = {inter} ({inter_name}'s intermediate size), "
            f"got {tuple(weight.shape)}"
        )
    check_same_device(gate=gate, up=up, weight=weight, bias=bias)
    if not torch.is_autocast_enabled(gate.device.type):
        for name, t in (("up", up), ("weight", weight), ("bias", bias)):
            if t is not None and t.dtype != gate.dtype:
                raise TypeError(
                    f"{name} must have gate's dtype {gate.dtype} (or run under autocast), got {t.dtype}"
                )


def _run(gate, up, weight, bias, activation, inplace_backward, impl):
    """Checked inputs -> the PyTorch composition (impl "torch") or the chunked Function;
    ``up=None``: ``gate`` is the packed ``gate_up``."""
    if resolve_impl(impl, gate, up, weight) == "torch":
        g, u = gate.chunk(2, dim=-1) if up is None else (gate, up)
        return F.linear(gated_torch(g, u, activation), weight, bias)
    dtype = autocast_dtype(gate, weight.dtype)
    cast = [t if t is None or t.dtype == dtype else t.to(dtype) for t in (gate, up, weight, bias)]
    with torch.autocast(device_type=gate.device.type, enabled=False):
        # Without a graph (inference, gradient checkpointing's first pass) nothing is saved and
        # the product is a transient either way: one chunk, as few GEMMs as the unfused MLP.
        chunked = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in cast)
        return GatedDownFunction.apply(*cast, ACTIVATIONS[activation], inplace_backward, chunked)


def gated_down_proj(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    activation: str = "silu",
    inplace_backward: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """``F.linear(act(gate) * up, weight, bias)`` without saving ``act(gate) * up`` for the backward.

    gate, up: ``[..., I]`` (one shape and dtype); weight ``[H, I]``; bias ``[H]`` or None.
    Returns ``[..., H]`` in the GEMM dtype (see the module docstring).
    """
    check_tensor("gate", gate, min_ndim=1, floating=True)
    check_tensor("up", up, min_ndim=1, floating=True)
    if up.shape != gate.shape:
        raise ValueError(f"up must have the same shape as gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    _check(gate, up, weight, bias, activation, inplace_backward)
    return _run(gate, up, weight, bias, activation, inplace_backward, impl)


def gated_down_proj_packed(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    activation: str = "silu",
    inplace_backward: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """:func:`gated_down_proj` with ``gate, up = gate_up.chunk(2, dim=-1)`` (Phi-3):
    ``gate_up [..., 2I]``, weight ``[H, I]`` -> ``[..., H]``."""
    check_tensor("gate_up", gate_up, min_ndim=1, floating=True)
    if gate_up.shape[-1] % 2:
        raise ValueError(
            f"gate_up must have an even last dimension (2 * intermediate_size), got shape {tuple(gate_up.shape)}"
        )
    _check(gate_up, None, weight, bias, activation, inplace_backward, inter_name="gate_up")
    return _run(gate_up, None, weight, bias, activation, inplace_backward, impl)
