"""A low-overhead launcher for ``@triton.jit`` kernels: after the first launch of a
specialization, later launches call the compiled kernel's launcher directly.

Why: ``JITFunction.run`` spends tens of microseconds of Python per launch (binding the
arguments, specializing each one, building the cache key, hooks) before the compiled launcher
(a few microseconds) runs. At a short training step the GPU waits on that host time.

Usage (call sites keep their syntax)::

    _my_kernel_fast = fast_kernel(_my_kernel)          # _my_kernel is a @triton.jit function
    _my_kernel_fast[grid](x, y, n, BLOCK=256, num_warps=4)

Positional arguments are the kernel's runtime arguments in parameter order; constexprs come by
keyword; launch options (``num_warps``, ``num_stages``, ...) by keyword.

Slow path: exactly ``jit_fn[grid](*args, **kwargs)``. It is taken while ``torch.compile`` traces
(so the compiler sees triton's own kernel launch), under ``TRITON_INTERPRET=1``
(the interpreter has no compiled kernels), for anything that is not a ``JITFunction``, on the first
launch of each key, when ``LIGER_LOSSES_FAST_LAUNCH=0``, on every triton minor version outside
``TESTED_TRITON_VERSIONS`` (no override), while launch hooks or pre-run hooks are installed, for
callable grids, for runtime arguments passed by keyword, and whenever something unexpected happens
(a fast launch that raises while the slow path succeeds turns the fast path off for that kernel).

The fence: the key below re-implements Triton's specialization and the hit calls Triton's private
launcher convention, so a Triton release that adds a specialization dimension could let two
argument classes share one entry. The fast path is therefore on only for the minor versions in
``TESTED_TRITON_VERSIONS``, each of which passed the contract test
``tests/kernels/test_launch_contract.py`` (GPU: for a grid of argument specializations, the kernel
each key maps to is the one ``JITFunction``'s own cache holds for those arguments). To admit a new
version, run that test with ``TESTED_TRITON_VERSIONS`` extended (the test shows how) and add it
here; ``pyproject.toml``'s triton range spans the lowest to the highest tested minor (the minors
between run on the JITFunction launches; ``tests/kernels/test_launch.py`` holds the range to that
rule). The fast path saves host time only: ~7 us per
launch on the H200 machine's CPU (``benchmark/bench_launch.py``; table "Host time per launch" in
``benchmark/results/README.md``), ~1.6 ms of a ~140 ms 2048-token training step.

Fast path key (a refinement of Triton's own specialization: the same key means Triton would pick
the same compiled kernel): the current device, the debug flags (``knobs.runtime.debug``, the
kernel's own) and Triton's instrumentation knobs (the options ``JITFunction.run`` adds), and per
positional argument its exact type plus

* tensor: ``dtype`` and ``data_ptr() % 16 == 0``;
* int: ``== 1`` (Triton turns 1 into a constexpr), ``% 16 == 0``, in int32 range, ``<= 2**63-1``
  (Triton: ``i32`` / ``i64`` / ``u64``, ``"D"`` for divisible by 16; below ``-2**63`` both
  Triton and the compiled launcher raise ``OverflowError``);
* bool, float, None: the type only (Triton: ``u1``, ``fp32``, constexpr ``None``);

plus the keyword arguments (names, values and value types: constexprs and launch options; a call
passing a constexpr by position keeps the slow path, its value not being in the key). The
per-position "kind" (tensor / int / other) is learned at the first launch and compiled into a
small key function; a call whose kinds differ gets a different key (types are in it) and is never
inserted, so it keeps the slow path.

On a hit: ``kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None,
None, *args, *constexpr_values)`` -- the call ``JITFunction.run`` makes in triton 3.6 and 3.9
(bound arguments in parameter order, constexprs included), with ``launch_metadata`` and the hooks
as ``None``, which is what the compiled launcher does when the hook chains are empty.

``launch_stats()`` sums the per-kernel counters (``fast`` hits, ``slow`` launches) for tests and
benchmarks; ``set_fast_launch()`` switches the fast path on/off for every wrapper.
"""

from __future__ import annotations

import inspect
import weakref
from functools import partial
from typing import Any, Callable, Optional

import torch

from .utils import env_switch, import_triton, is_compiling, triton_interpret

ENV_SWITCH = "LIGER_LOSSES_FAST_LAUNCH"
# The triton minor versions whose JITFunction.run / CompiledKernel / launcher calling convention
# was read and passed tests/kernels/test_launch_contract.py; any other keeps the slow path.
TESTED_TRITON_VERSIONS = ("3.6", "3.9")
_MAX_ENTRIES = 4096  # per kernel; beyond it new keys just keep the slow path

_KIND_TENSOR, _KIND_INT, _KIND_OTHER, _KIND_UNSUPPORTED = "t", "i", "o", "x"

_REGISTRY: "weakref.WeakSet[FastKernel]" = weakref.WeakSet()
_STATE = {"enabled": None}  # None: read the environment on first use


# --------------------------------------------------------------------------- switches


def _env_enabled() -> bool:
    return env_switch(ENV_SWITCH)


def fast_launch_enabled() -> bool:
    """True unless the fast path was switched off (``LIGER_LOSSES_FAST_LAUNCH=0`` or
    :func:`set_fast_launch`)."""
    if _STATE["enabled"] is None:
        _STATE["enabled"] = _env_enabled()
    return bool(_STATE["enabled"])


def set_fast_launch(enabled: Optional[bool] = None) -> None:
    """Switch the fast path on/off for all wrappers (``None``: re-read ``LIGER_LOSSES_FAST_LAUNCH``).
    Every wrapper forgets its cached entries and starts over from the slow path."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {type(enabled).__name__}")
    _STATE["enabled"] = _env_enabled() if enabled is None else enabled
    for k in list(_REGISTRY):
        k.reset()


def launch_stats(*, reset: bool = False) -> dict:
    """``{"fast": hits, "slow": slow launches, "kernels": wrappers, "off": {name: reason}}``
    summed over all live wrappers; ``reset=True`` zeroes the counters after reading."""
    kernels = list(_REGISTRY)
    out = {
        "fast": sum(k.fast_hits for k in kernels),
        "slow": sum(k.slow_launches for k in kernels),
        "kernels": len(kernels),
        "off": {k.name: k.off_reason for k in kernels if k.off_reason},
    }
    if reset:
        for k in kernels:
            k.fast_hits = 0
            k.slow_launches = 0
    return out


# --------------------------------------------------------------------------- triton internals


def _triton_unsupported_reason() -> Optional[str]:
    """None when this triton's launch internals are the ones this module was written against,
    else why not (then every wrapper keeps the slow path)."""
    triton, _ = import_triton()
    if triton is None:
        return "triton is not importable"
    version = triton_minor_version(triton)
    if version not in TESTED_TRITON_VERSIONS:
        return f"triton {version} not tested (tested: {', '.join(TESTED_TRITON_VERSIONS)})"
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import problem means "not the internals we know"
        return f"triton internals missing: {exc!r}"
    if not isinstance(inspect.getattr_static(CompiledKernel, "run", None), property):
        return "CompiledKernel.run is not a property"
    for name in ("launch_enter_hook", "launch_exit_hook", "debug", "add_stages_inspection_hook"):
        if not hasattr(knobs.runtime, name):
            return f"triton.knobs.runtime.{name} missing"
    if not hasattr(knobs.compilation, "instrumentation_mode"):
        return "triton.knobs.compilation.instrumentation_mode missing"
    if getattr(knobs, "HookChain", None) is None:
        return "triton.knobs.HookChain missing"
    return None


def triton_minor_version(triton_module) -> str:
    """``"3.6"`` for triton 3.6.0 (or 3.6.0+git...): the part the fence compares."""
    return ".".join(str(getattr(triton_module, "__version__", "0.0")).split(".")[:2])


def _driver_functions() -> tuple[Callable[[], int], Callable[[int], int]]:
    """``(get_current_device, get_current_stream)`` of the active triton driver (what
    ``JITFunction.run`` calls), resolved once per wrapper."""
    from triton.runtime import driver

    active = driver.active
    return active.get_current_device, active.get_current_stream


def _arg_kind(a: Any) -> str:
    t = type(a)
    if t is int:
        return _KIND_INT
    if t is bool or t is float or a is None:
        return _KIND_OTHER
    if isinstance(a, torch.Tensor):
        return _KIND_TENSOR
    return _KIND_UNSUPPORTED


def arg_kinds(args: tuple) -> tuple:
    """Per positional argument: "t" tensor, "i" int, "o" bool/float/None, "x" anything else."""
    return tuple(_arg_kind(a) for a in args)


def make_key_fn(kinds: tuple) -> Callable[..., tuple]:
    """Compile ``key(*args) -> tuple`` for arguments of these kinds (see the module docstring).
    The tuple holds each argument's exact type, so arguments of other kinds give other keys (or
    raise, e.g. ``.dtype`` of an int); it never contains the arguments themselves."""
    if _KIND_UNSUPPORTED in kinds:
        raise ValueError(f"kinds must be 't', 'i' or 'o', got {kinds}")
    names = [f"a{i}" for i in range(len(kinds))]
    parts = []
    for n, k in zip(names, kinds):
        parts.append(f"type({n})")
        if k == _KIND_TENSOR:
            parts += [f"{n}.dtype", f"({n}.data_ptr() & 15) == 0"]
        elif k == _KIND_INT:
            # the int tests only when it is an int (never ``&``/compare a tensor: GPU work, syncs)
            parts.append(
                f"(({n} == 1, ({n} & 15) == 0, -2147483648 <= {n} <= 2147483647, "
                f"{n} <= 9223372036854775807) if type({n}) is int else None)"  # i64 vs u64
            )
    body = "(" + "".join(p + ", " for p in parts) + ")"
    src = f"def key({', '.join(names)}):\n    return {body}\n"
    namespace: dict = {}
    exec(compile(src, "<liger_losses.kernels.launch key>", "exec"), namespace)  # noqa: S102
    return namespace["key"]


# --------------------------------------------------------------------------- the wrapper


class FastKernel:
    """``fast_kernel(jit_fn)[grid](*args, **kwargs)``: see the module docstring.

    Attributes: ``jit_fn`` (the wrapped kernel), ``name``, ``fast_hits``, ``slow_launches``,
    ``off_reason`` (why the fast path is off for this kernel, or None).
    """

    def __init__(self, jit_fn):
        if not hasattr(type(jit_fn), "__getitem__"):
            raise TypeError(
                f"jit_fn must be a @triton.jit kernel (launched as jit_fn[grid](...)), "
                f"got {type(jit_fn).__name__}"
            )
        self.jit_fn = jit_fn
        fn = getattr(jit_fn, "fn", None)
        self.name = getattr(fn, "__qualname__", None) or getattr(jit_fn, "__name__", repr(jit_fn))
        self.fast_hits = 0
        self.slow_launches = 0
        self.reset()
        _REGISTRY.add(self)

    # ---- state

    def reset(self) -> None:
        """Forget cached entries and learned kinds; re-check whether the fast path may be used."""
        self._cache: dict = {}
        self._keyfn = None
        self._kinds = None
        self._globals = ()
        self.off_reason = self._static_off_reason()
        self._learn = self.off_reason is None

    def _static_off_reason(self) -> Optional[str]:
        if not fast_launch_enabled():
            return f"{ENV_SWITCH}=0 / set_fast_launch(False)"
        if triton_interpret():
            return "TRITON_INTERPRET=1 (interpreter)"
        reason = _triton_unsupported_reason()
        if reason:
            return reason
        from triton.runtime.jit import JITFunction

        if not isinstance(self.jit_fn, JITFunction):
            return f"not a JITFunction ({type(self.jit_fn).__name__})"
        for p in self.jit_fn.signature.parameters.values():
            if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
                return f"parameter {p.name} is {p.kind.description}"
        return None

    def _turn_off(self, reason: str) -> None:
        self.off_reason = reason
        self._learn = False
        self._keyfn = None
        self._cache = {}

    # ---- launching

    def __getitem__(self, grid):
        if is_compiling():  # torch.compile traces triton's own launch (user-defined kernels)
            return self.jit_fn[grid]
        if callable(grid):
            return partial(self._slow, grid, None)
        return partial(self._launch, grid)

    def _launch(self, grid, /, *args, **kwargs):
        keyfn = self._keyfn
        if keyfn is None:
            return self._first(grid, args, kwargs)
        try:
            rt = self._knobs.runtime
            comp = self._knobs.compilation
            dev = self._get_device()
            key = (
                dev, keyfn(*args), tuple(kwargs.items()), tuple(map(type, kwargs.values())),
                rt.debug, self.jit_fn.debug, comp.instrumentation_mode,
                comp.fpsan_homomorphic_casts if self._has_fpsan else None,
            )
            entry = self._cache.get(key)
        except Exception:  # noqa: BLE001 - odd arguments: let triton handle (or reject) them
            return self._slow(grid, None, *args, **kwargs)
        if entry is None:
            return self._slow(grid, key, *args, **kwargs)
        h_in, h_out = rt.launch_enter_hook, rt.launch_exit_hook
        if (
            (h_in is not None and (type(h_in) is not self._HookChain or h_in.calls))
            or (h_out is not None and (type(h_out) is not self._HookChain or h_out.calls))
            or self.jit_fn.pre_run_hooks
            or rt.add_stages_inspection_hook is not None
        ):
            return self._slow(grid, None, *args, **kwargs)
        for name, val, gdict in self._globals:  # triton's "global changed since compile" check
            if gdict.get(name, _MISSING) != val:
                return self._slow(grid, None, *args, **kwargs)
        run, function, packed, tail, kernel = entry
        n = len(grid)
        g0 = grid[0]
        g1 = grid[1] if n > 1 else 1
        g2 = grid[2] if n > 2 else 1
        try:
            run(g0, g1, g2, self._get_stream(dev), function, packed, None, None, None, *args, *tail)
        except Exception as exc:  # noqa: BLE001
            return self._fast_failed(exc, grid, args, kwargs)
        self.fast_hits += 1
        return kernel

    def _fast_failed(self, exc, grid, args, kwargs):
        """A fast launch raised (before launching: argument conversion or launch errors). Redo it
        on the slow path; if that works the fast path was wrong for this kernel: turn it off."""
        kernel = self._slow(grid, None, *args, **kwargs)  # raises on genuinely bad input
        self._turn_off(f"fast launch raised {exc!r} where the slow path did not")
        return kernel

    def _slow(self, grid, key, /, *args, **kwargs):
        kernel = self.jit_fn[grid](*args, **kwargs)
        self.slow_launches += 1
        if key is not None and self._keyfn is not None:
            try:
                self._insert(key, args, kwargs, kernel)
            except Exception as exc:  # noqa: BLE001
                self._turn_off(f"could not cache a launch: {exc!r}")
        return kernel

    def _first(self, grid, args, kwargs):
        """No key function yet: learn the argument kinds from this call (when the fast path may
        be used here), then take the slow path, caching its kernel."""
        if not self._learn:
            return self._slow(grid, None, *args, **kwargs)
        kinds = arg_kinds(args)
        if _KIND_UNSUPPORTED in kinds:
            return self._slow(grid, None, *args, **kwargs)
        try:
            from triton import knobs

            self._knobs = knobs
            self._HookChain = knobs.HookChain
            self._has_fpsan = hasattr(knobs.compilation, "fpsan_homomorphic_casts")
            self._get_device, self._get_stream = _driver_functions()
            self._params = list(self.jit_fn.params)
            self._kinds = kinds
            self._keyfn = make_key_fn(kinds)
        except Exception as exc:  # noqa: BLE001
            self._turn_off(f"could not set up: {exc!r}")
            return self._slow(grid, None, *args, **kwargs)
        return self._launch(grid, *args, **kwargs)

    def _insert(self, key, args, kwargs, kernel) -> None:
        """Cache ``kernel`` (what the slow path launched for these arguments) under ``key`` when
        the call is of the learned shape; otherwise leave this key to the slow path."""
        if kernel is None or len(self._cache) >= _MAX_ENTRIES:
            return
        if arg_kinds(args) != self._kinds:
            return
        params = self._params
        n = len(args)
        if any(p.is_constexpr for p in params[:n]):
            return  # a constexpr by position: its value is not in the key
        by_name = {p.name: p for p in params}
        for name in kwargs:
            p = by_name.get(name)
            if p is not None and (p.num < n or not p.is_constexpr):
                return  # a runtime argument by keyword: its value is not in the key
        tail = []
        for p in params[n:]:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return
        function = kernel.function
        if function is None:
            return
        run = kernel.run
        self._globals = tuple(
            (name, val, gdict) for (name, _), (val, gdict) in self.jit_fn.used_global_vals.items()
        )
        self._cache[key] = (run, function, kernel.packed_metadata, tuple(tail), kernel)

    def __repr__(self) -> str:
        state = "fast" if self.off_reason is None else f"slow: {self.off_reason}"
        return f"FastKernel({self.name}, {state}, fast={self.fast_hits}, slow={self.slow_launches})"


_MISSING = object()


def fast_kernel(jit_fn) -> FastKernel:
    """Wrap a ``@triton.jit`` kernel so that ``fast_kernel(k)[grid](*args, **kwargs)`` launches
    it like ``k[grid](*args, **kwargs)`` with less host time (see the module docstring). A
    ``FastKernel`` given here is unwrapped first (a new wrapper around the same kernel)."""
    if isinstance(jit_fn, FastKernel):
        jit_fn = jit_fn.jit_fn
    return FastKernel(jit_fn)
