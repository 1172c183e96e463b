"""Programmatic dependent launch (PDL, Hopper and newer) for the row-norm kernels.

A kernel launched with PDL may be scheduled before the kernel ahead of it in the stream has
finished (once every program of that kernel has started or ended), so its launch latency and
ramp overlap the tail of its predecessor. Each PDL kernel calls :func:`pdl_prologue` first: it
lets its own successor launch early, then waits (``griddepcontrol.wait``) until the predecessor has
completed and its writes are visible -- before the kernel touches memory, so no hazard is opened in
either direction. Without PDL the two instructions are no-ops.

``pdl_launch(device, kernel)`` says whether to launch ``kernel`` (a name in ``KERNELS``'s terms:
``"norm_fwd"`` / ``"norm_bwd"`` for the row norms' forward / backward, ``"sum"`` for their
partial-sum reduction, ``"rope"``) with PDL on ``device``: CUDA capability >= 9, a Triton that has the grid-dependency
instructions, not the interpreter, not while ``torch.compile`` traces, ``PDL_CONFIG.current.enabled``
(from the environment ``LIGER_LOSSES_PDL``, default on; ``0`` turns it off) and ``kernel in
PDL_CONFIG.current.kernels``. Callers pass the result both as the kernel's ``PDL`` constexpr and as
the launch option ``launch_pdl``. Benchmarks change the configuration with
``PDL_CONFIG.override(kernels=frozenset({...}))`` (see :mod:`liger_losses.kernels.tuning`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from liger_losses.kernels.tuning import Knobs, knob, register
from liger_losses.kernels.utils import env_switch, import_triton, is_compiling, triton_interpret

triton, tl = import_triton()


@dataclass(frozen=True)
class PDLConfig(Knobs):
    """Where PDL is used.

    ``enabled``: the switch for every kernel (the default instance reads ``LIGER_LOSSES_PDL``).
    ``kernels``: the kernels launched with PDL. H200 (benchmark/experiments/diag_norm_launch.py,
    CUDA-graph time of forward + backward, bf16): all three norm kernels with PDL save 0.7-1.2 us at
    4096-8192 x 4096 (RMSNorm 4096 tokens 0.0555 -> 0.0548 ms, LayerNorm 8192 0.1009 -> 0.0997);
    at 8192 x 896 the LayerNorm forward (4-row tiles) with PDL lost 3.3 us while the backward and
    partial sum gained 1.2, so the forwards use it only for one-row tiles (norm_common.fwd_pdl).
    RoPE: the same time at the 8B shapes, 25% slower at Qwen2-0.5B's (0.0175 -> 0.0219 ms): off.
    """

    enabled: bool = knob(True)
    kernels: frozenset = knob(frozenset({"norm_fwd", "norm_bwd", "sum"}))


PDL_CONFIG = register("pdl", PDLConfig(enabled=env_switch("LIGER_LOSSES_PDL")))

_HAS_GDC = False
if triton is not None:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        _HAS_GDC = True
    except ImportError:  # pragma: no cover - older triton: no-ops (pdl_launch is then False)

        @triton.jit
        def gdc_launch_dependents():
            pass

        @triton.jit
        def gdc_wait():
            pass

    @triton.jit
    def pdl_prologue(PDL: tl.constexpr):
        """At a PDL kernel's start: let the next kernel launch, then wait for the previous one."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


_WITH_PDL = {"launch_pdl": True}
_WITHOUT = {}


def launch_options(pdl: bool) -> dict:
    """The launch options for ``pdl`` (``launch_pdl=True``, or none: older launchers)."""
    return _WITH_PDL if pdl else _WITHOUT


def pdl_launch(device: torch.device, kernel: str) -> bool:
    """True when ``kernel`` on ``device`` should be launched with PDL (see the module docstring)."""
    config = PDL_CONFIG.current
    if not (config.enabled and _HAS_GDC) or kernel not in config.kernels or device.type != "cuda":
        return False
    if triton_interpret():
        return False
    if is_compiling():  # torch.compile traces triton's own launch: no launch option it may not know
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capable(index)
