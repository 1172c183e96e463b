"""Shared helpers of the kernel layer: choosing an implementation, checking inputs, sizing blocks.

Every public kernel function takes a keyword ``impl``:

* ``"auto"`` (default): Triton when the tensors are on a CUDA device, or on the CPU when the
  Triton interpreter is on (``TRITON_INTERPRET=1``, set before ``liger_losses`` is imported);
  the pure-PyTorch fallback otherwise, and while ``torch.compile`` traces (the compiler then
  generates and fuses the layer's kernels itself; see :func:`resolve_impl`).
* ``"triton"``: Triton, or a ``RuntimeError`` saying why it cannot run here.
* ``"torch"``: the pure-PyTorch fallback, on any device.

Input checks raise ``TypeError``/``ValueError`` that name the argument and what was expected, so
that bad input never reaches a kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import sys
from typing import Iterable, Optional, Sequence

import torch
import torch.autograd.forward_ad as _forward_ad

IMPLS = ("auto", "triton", "torch")


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    """True when the ``triton`` package imports in this process."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the machine
        return False
    return True


def import_triton():
    """``(triton, triton.language)`` when Triton imports here, else ``(None, None)`` (machines
    without Triton use the torch paths only)."""
    if not triton_importable():  # pragma: no cover - depends on the machine
        return None, None
    import triton
    import triton.language as tl

    return triton, tl


_triton, _tl = import_triton()
if _triton is not None:

    @_triton.jit
    def keep_or_sum(x, KEEP: _tl.constexpr):
        """The term an accumulator takes from ``x``: ``x`` itself when the accumulator keeps
        ``x``'s shape (summed once at the end by :func:`kept_total`: no cross-warp reduction per
        step, more live registers) or ``x`` summed over its first axis (a reduction per step)."""
        if KEEP:
            out = x
        else:
            out = _tl.sum(x, axis=0)
        return out

    @_triton.jit
    def acc_zero(BLOCK: _tl.constexpr, KEEP: _tl.constexpr):
        """A zero accumulator for :func:`keep_or_sum`: ``[BLOCK]`` fp32 zeros when it keeps the
        terms' shape, else a scalar 0."""
        if KEEP:
            out = _tl.zeros([BLOCK], dtype=_tl.float32)
        else:
            out = 0.0
        return out

    @_triton.jit
    def transform_logits(x, logit_scale, inv_temp, softcap, HAS_SOFTCAP: _tl.constexpr):
        """``(z, t)``: the head's logit transform ``z = softcap * tanh(logit_scale * x / softcap) / T``
        (``logit_scale * x / T`` without softcap) and the tanh ``t`` (0 without softcap), fp32."""
        y = x * logit_scale
        t = y * 0.0
        if HAS_SOFTCAP:
            u = y / softcap
            e = _tl.exp(-2.0 * _tl.abs(u))
            t = (1.0 - e) / (1.0 + e)
            t = _tl.where(u < 0, -t, t)
            y = softcap * t
        return y * inv_temp, t

    @_triton.jit
    def max_transformed(x_row, n, offs, logit_scale, inv_temp, softcap, HAS_SOFTCAP: _tl.constexpr,
                        BLOCK: _tl.constexpr):
        """The largest transformed logit of the first ``n`` columns at ``x_row`` (-inf when ``n`` is 0),
        in steps of ``BLOCK`` (``offs = arange(0, BLOCK)``): the transform is monotone, so it is the
        transform of the largest logit (one scalar transform, no per-element one)."""
        xmax = _tl.full((BLOCK,), float("-inf"), _tl.float32)
        for start in range(0, n, BLOCK):
            cols = start + offs
            xmax = _tl.maximum(xmax, _tl.load(x_row + cols, mask=cols < n, other=float("-inf")).to(_tl.float32))
        z, _t = transform_logits(_tl.max(xmax, axis=0), logit_scale, inv_temp, softcap, HAS_SOFTCAP)
        return _tl.where(n > 0, z, float("-inf"))

    @_triton.jit
    def kept_total(acc, KEEP: _tl.constexpr):
        """The first-axis sum of an accumulator built with :func:`keep_or_sum`."""
        if KEEP:
            out = _tl.sum(acc, axis=0)
        else:
            out = acc
        return out


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


_OFF_WORDS = ("0", "false", "off", "no")


def env_switch(name: str, default: bool = True) -> bool:
    """The on/off switch in environment variable ``name``: off for ``0``/``false``/``off``/``no``
    (any case, surrounding blanks ignored), on for any other value, ``default`` when unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _OFF_WORDS


# True while torch.compile traces (kernels then take Triton's own launch, with no options the
# compiler may not know); always False on a torch without torch.compiler.
is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def eager_under_compile(fn):
    """``fn``, run as it is -- outside the graph, one graph break -- when ``torch.compile`` traces
    a caller. For the chunked losses: their Python is the algorithm (chunk loops sized from the
    labels read on the host, gradients written in the forward), which the tracer would split at
    every host read, and their tile kernels are tuned launches Inductor should not recompile. In
    eager mode the call goes straight to ``fn``. The disabled wrapper needs ``torch._dynamo``
    (~1.4 s to import): it is made here when something (transformers does) imported it already,
    else on the first traced call (one more graph break in that first trace)."""
    disabled = [torch.compiler.disable(fn)] if "torch._dynamo" in sys.modules else []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if is_compiling():
            if not disabled:
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    call.runs_eagerly_under_compile = True
    return call


def triton_runs_on(device: torch.device) -> bool:
    """True when a Triton kernel can run on tensors living on ``device``."""
    if not triton_importable():
        return False
    if triton_interpret():
        return True
    return device.type == "cuda"


def resolve_impl(impl: str, *tensors: Optional[torch.Tensor]) -> str:
    """Map ``impl`` ("auto" | "triton" | "torch") to "triton" or "torch" for these tensors."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    device = next(t.device for t in tensors if t is not None)
    if impl == "torch":
        return "torch"
    # While torch.compile traces, "auto" takes the PyTorch path: Inductor then generates the layer's
    # kernels and fuses them with their neighbours (residual adds, casts), and nothing of ours
    # (overlap checks, storage pointers, compiled launchers) reaches the tracer as a graph break.
    # What a compiled patched model gains, measured against eager: benchmark/results/compile.csv.
    if impl == "auto" and is_compiling():
        return "torch"
    if triton_runs_on(device):
        return "triton"
    if impl == "triton":
        reason = (
            "triton is not importable"
            if not triton_importable()
            else f"tensors are on {device.type} (set TRITON_INTERPRET=1 to run Triton on the CPU)"
        )
        raise RuntimeError(f"impl='triton' cannot run here: {reason}")
    return "torch"


# --------------------------------------------------------------------------- checked signatures


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# The part types a CheckedSignatures key may hold: immutable, hashable, compared by value (a None
# part -- an argument that must be checked every call -- is not among them).
_KEY_TYPES = (tuple, str, int, float, bool, type)


def records_autograd(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call on ``tensors`` must go through an autograd Function: grad mode is on and one
    of them requires grad, or a forward-AD dual level is open (a dual tensor's tangent needs the
    Function's ``jvp``, and the tensor itself does not require grad)."""
    if getattr(_forward_ad, "_current_level", 0) >= 0:
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def tensor_signature(t, *, whole_shape: bool = False) -> Optional[tuple]:
    """What the input checks of a tensor argument read -- ``(dtype, device, ndim, last dim)``, or
    ``(dtype, device, shape)`` with ``whole_shape`` (for checks that relate several shapes) -- for a
    plain ``torch.Tensor`` / ``nn.Parameter`` (``()`` for None); None for anything else (a subclass,
    a non-tensor), which then never takes the checked-signature shortcut."""
    if t is None:
        return ()
    if type(t) not in _PLAIN_TENSORS:
        return None
    if whole_shape:
        return (t.dtype, t.device, t.shape)
    ndim = t.dim()
    return (t.dtype, t.device, ndim, t.shape[-1] if ndim else 0)


def layout_signature(t) -> Optional[tuple]:
    """:func:`tensor_signature` with the whole shape."""
    return tensor_signature(t, whole_shape=True)


class CheckedSignatures:
    """Argument signatures that passed a public function's checks, each with what the checks
    resolved (the implementation, normalized options), so that a repeated call -- every layer of
    every step -- skips them. On the GPU machine's CPU the checks of one call are ~10-20 us, a
    sizeable part of a layer kernel's host time (``benchmark/results/host.csv``).

    A key must hold everything the checks and the resolution read: argument types and values,
    :func:`tensor_signature` of each tensor, the ``impl`` switch and :func:`triton_interpret`.
    ``key(...)`` returns None while ``torch.compile`` traces (the compiler sees the plain checks).
    At most ``maxsize`` signatures are kept (then they are forgotten and collected anew)."""

    __slots__ = ("_seen", "maxsize")

    def __init__(self, maxsize: int = 1024):
        self._seen: dict = {}
        self.maxsize = maxsize

    @staticmethod
    def key(*parts) -> Optional[tuple]:
        """``parts`` plus the interpreter switch, or None -- the call is then checked in full --
        when a part is None (an argument that must always be checked) or of any type but the
        immutable plain ones (signature tuples, str, int, float, bool, type: a tensor, an array or
        a list given as an option is never remembered), or while compiling."""
        for part in parts:
            if type(part) not in _KEY_TYPES:
                return None
        if is_compiling():
            return None
        return (*parts, triton_interpret())

    def get(self, key: Optional[tuple]):
        return None if key is None else self._seen.get(key)

    def remember(self, key: Optional[tuple], value) -> None:
        if key is None:
            return
        if len(self._seen) >= self.maxsize:
            self._seen.clear()
        self._seen[key] = value


# --------------------------------------------------------------------------- input checks


def check_tensor(
    name: str,
    value,
    *,
    ndim: Optional[int | Sequence[int]] = None,
    min_ndim: Optional[int] = None,
    floating: Optional[bool] = None,
    dtypes: Optional[Iterable[torch.dtype]] = None,
) -> torch.Tensor:
    """Raise a clear error unless ``value`` is a tensor of the given rank and dtype kind."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in allowed:
            want = " or ".join(str(a) for a in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(value.shape)}")
    if min_ndim is not None and value.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimensions, got shape {tuple(value.shape)}"
        )
    if floating is True and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
    if floating is False and (value.is_floating_point() or value.is_complex()):
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {dtypes}, got {value.dtype}")
    return value


def row_scales(name: str, scale: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """A kernel's per-row upstream scale ``scale`` (a 1-element tensor: every row's, left on the
    device; or ``[n]``) as ``(float32 unit-stride tensor, row stride)``, the stride 0 for one entry
    (the kernel then reads element 0 for every row). Any other shape raises ``ValueError`` naming
    ``name``."""
    one = scale.numel() == 1 and scale.dim() <= 1
    if tuple(scale.shape) != (n,) and not one:
        raise ValueError(f"{name} must be a float, a 1-element or a [{n}] tensor, got {tuple(scale.shape)}")
    return scale.float().reshape(-1).contiguous(), 0 if one else 1


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """Raise ``ValueError`` naming the arguments when the given tensors sit on different devices."""
    present = {k: v for k, v in tensors.items() if v is not None}
    devices = {k: v.device for k, v in present.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def check_last_dim(name: str, value: torch.Tensor, size: int, what: str) -> None:
    """Raise ``ValueError`` unless ``value.shape[-1] == size``."""
    if value.shape[-1] != size:
        raise ValueError(
            f"{name} must have last dimension {size} ({what}), got shape {tuple(value.shape)}"
        )


def check_labels(
    name: str, labels: torch.Tensor, num_classes: int, ignore_index: int
) -> None:
    """Raise ``ValueError`` when a label is outside ``[0, num_classes)`` and not ``ignore_index``.

    This costs one host synchronisation; it runs once per call, never inside a chunk loop.
    """
    check_tensor(name, labels, floating=False)
    if labels.numel() == 0:
        return
    valid = labels != ignore_index
    bad = valid & ((labels < 0) | (labels >= num_classes))
    if bool(bad.any()):
        example = int(labels[bad][0])
        raise ValueError(
            f"{name} must be in [0, {num_classes}) or equal ignore_index={ignore_index}, "
            f"found {example}"
        )


def start_label_check(
    name: str, labels: torch.Tensor, num_classes: int, ignore_index: int, bad: torch.Tensor,
) -> Optional[tuple]:
    """The check of :func:`check_labels` without draining the GPU's queue: on a CUDA device the
    range test is queued (its one-byte answer copied to pinned host memory behind an event) and
    :func:`finish_label_check` -- called once the caller has queued its kernels -- waits for that
    event only, so the kernels queued after it keep the GPU busy while the host goes on. On the
    CPU the check runs at once (returns None). While a CUDA graph is being captured (no host
    read is possible) the check is skipped: callers' kernels count out-of-range labels as ignored.
    ``bad``: the test's answer on the labels' device (a 1-element integer tensor, nonzero when some
    label is out of range: :func:`kernels.label_stats.label_stats`' first output)."""
    check_tensor(name, labels, floating=False)
    if labels.numel() == 0:
        return None
    if labels.device.type != "cuda":
        check_labels(name, labels, num_classes, ignore_index)
        return None
    if torch.cuda.is_current_stream_capturing():
        return None
    flag = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
    flag.copy_(bad, non_blocking=True)  # queued on the labels' device's current stream
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(labels.device))  # that stream, whatever GPU is current
    return name, labels, num_classes, ignore_index, flag, event


def finish_label_check(pending: Optional[tuple]) -> None:
    """Raise ``ValueError`` (as :func:`check_labels`) if the check queued by
    :func:`start_label_check` found a label outside ``[0, num_classes)`` other than
    ``ignore_index``; waits only for that check's event."""
    if pending is None:
        return
    name, labels, num_classes, ignore_index, flag, event = pending
    event.synchronize()
    if flag.item():
        check_labels(name, labels, num_classes, ignore_index)  # raises, naming an example


def check_number(name: str, value) -> None:
    """Raise ``TypeError`` unless ``value`` is a real number (``bool`` is not one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")


def autocast_dtype(tensor: torch.Tensor, default: torch.dtype) -> torch.dtype:
    """The autocast dtype when autocast is on for ``tensor``'s device type, else ``default``
    (the dtype GEMMs run in, as ``F.linear`` would pick it)."""
    dev = tensor.device.type
    try:
        if torch.is_autocast_enabled(dev):
            return torch.get_autocast_dtype(dev)
    except (TypeError, RuntimeError):  # pragma: no cover - older torch signatures
        if dev == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    return default


def triton_fallback(impl: str, problem: Optional[Exception]) -> str:
    """The path to take when Triton was chosen for ``impl``: "triton" when there is no
    ``problem``; with one, raise it for ``impl="triton"``, else fall back to "torch"."""
    if problem is None:
        return "triton"
    if impl == "triton":
        raise problem
    return "torch"


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_range(
    name: str,
    value: float,
    low: Optional[float] = None,
    high: Optional[float] = None,
    *,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> None:
    """Raise ``ValueError`` unless ``value`` lies in the given (in/exclusive) range."""
    ok = True
    if low is not None:
        ok &= value >= low if low_inclusive else value > low
    if high is not None:
        ok &= value <= high if high_inclusive else value < high
    if not ok:
        lb = "[" if low_inclusive else "("
        hb = "]" if high_inclusive else ")"
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in {lb}{lo}, {hi}{hb}, got {value!r}")


# --------------------------------------------------------------------------- block sizing


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def row_block_settings(n_cols: int, max_block: int = 65536) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) for a kernel that holds one row of ``n_cols`` in registers."""
    block = next_power_of_2(n_cols)
    if block > max_block:
        raise ValueError(f"rows of {n_cols} elements exceed the kernel's limit of {max_block}")
    if block >= 32768:
        warps = 32
    elif block >= 8192:
        warps = 16
    elif block >= 2048:
        warps = 8
    else:
        warps = 4
    return block, warps


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as a contiguous 2-D ``[rows, last_dim]`` tensor (copies only if needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


# --------------------------------------------------------------------------- launch helpers
# Host-side helpers shared by the kernel wrappers. They are on every call's path, so they avoid
# anything that synchronises with the GPU or queries the driver more than once per device.


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached per device: no query per call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def device_ctx(t: torch.Tensor):
    """Context making ``t``'s GPU current while launching (Triton launches on the current GPU);
    a no-op context on the CPU and when that GPU is already current (the usual case)."""
    device = t.device
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def row_tile(n_cols: int, n_rows: int, tile_elems: int, max_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a tile of BLOCK_M whole rows of ``n_cols`` elements,
    holding about ``tile_elems`` elements (one row when rows are long, up to ``max_rows``)."""
    block_n, _ = row_block_settings(n_cols)
    block_m = max(1, min(max_rows, tile_elems // block_n, next_power_of_2(n_rows)))
    _, warps = row_block_settings(block_m * block_n)
    return block_m, block_n, warps


def num_row_programs(
    device: torch.device,
    n_blocks: int,
    n_rows: int,
    *,
    per_sm: int,
    min_rows: int,
    cpu_programs: int,
) -> int:
    """Programs of a persistent row kernel with per-program partial sums: ``per_sm`` per SM on
    CUDA but at least ``min_rows`` rows each (never fewer than one per SM), ``cpu_programs`` on
    the CPU interpreter; never more than ``n_blocks``."""
    if device.type == "cuda":
        sms = num_sms(device)
        target = min(sms * per_sm, max(sms, n_rows // min_rows))
    else:
        target = cpu_programs
    return max(1, min(target, n_blocks))


# The second axis of a CUDA grid holds at most 65535 programs.
MAX_GRID_Y = 65535


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, last_dim]`` view with unit column stride; rows may be strided (the
    halves of Phi-3's ``gate_up``). Copies only when no such view exists."""
    shape = (math.prod(x.shape[:-1]), x.shape[-1])  # not -1: ambiguous when the last dim is 0
    try:
        x2 = x.view(shape)
    except RuntimeError:
        x2 = x.contiguous().view(shape)
    if x2.stride(-1) != 1 and x2.shape[-1] > 1:
        x2 = x.contiguous().view(shape)
    return x2


def owns_buffer(x: torch.Tensor, x2: Optional[torch.Tensor] = None) -> bool:
    """True when gradients may be written into ``x``'s buffer through its 2-D view ``x2`` (None:
    through ``x`` itself, contiguous): ``x`` is an autograd intermediate (not a leaf, whose .grad
    could alias it), ``x2`` is a view (no copy was made) and its rows do not overlap. A view
    counts only when its base is an intermediate too: a view of a leaf has a grad_fn but the
    leaf's buffer behind it."""
    base = x._base if x._base is not None else x
    if x.grad_fn is None or base.grad_fn is None:
        return False
    if x2 is None:
        return True
    return (
        x2.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        and (x2.shape[0] == 1 or x2.stride(0) >= x2.shape[1])
    )


# --------------------------------------------------------------------------- autograd guards


def needs_input_grads(ctx, grad_enabled: bool, count: int) -> tuple[bool, ...]:
    """``ctx.needs_input_grad[:count]`` of an ``autograd.Function``, all False when grad mode was
    off at ``.apply`` (``grad_enabled``, recorded by the caller with ``torch.is_grad_enabled()``):
    ``needs_input_grad`` follows ``requires_grad`` even under ``torch.no_grad()``, so without this
    a Function that computes gradients in its forward would do so during evaluation too."""
    if not grad_enabled:
        return (False,) * count
    return tuple(ctx.needs_input_grad[:count])


def check_no_double_backward(name: str, instead: str = 'use impl="torch"') -> None:
    """Raise a RuntimeError at the top of a custom ``autograd.Function.backward`` that runs Triton
    kernels or no-grad code when it is called with grad mode on, i.e. by
    ``backward(create_graph=True)`` / ``torch.autograd.grad(..., create_graph=True)`` (gradient
    penalties, Hessian-vector products): the gradients it returns would carry no graph and the
    second-order terms through ``name`` would be silently dropped. A plain backward (also a
    ``retain_graph=True`` one, and gradient checkpointing, reentrant or not) runs with grad mode
    off and passes. ``instead`` says what to use instead."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"double backward (create_graph=True) through {name} is not supported: its backward "
            "runs Triton kernels / no-grad code, so the gradients would carry no graph and "
            f"second-order terms would be silently dropped; {instead}"
        )
