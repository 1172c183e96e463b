"""Tuning knobs of the kernels: one frozen dataclass per kernel, its current value, and a context
manager that changes it for a benchmark.

Each kernel module defines its knobs as a frozen dataclass (the fields are the knobs, the defaults
the measured defaults, each documented where it is defined) and registers one instance::

    @dataclass(frozen=True)
    class ScaleTuning(Knobs):
        block: int = knob(8192, minimum=1)
        ...

    SCALE_TUNING = register("scale", ScaleTuning())

Launch code reads ``SCALE_TUNING.current`` at call time. A benchmark (or a test) changes the knobs
for a block of code, never by assigning module attributes::

    from liger_losses.kernels.tuning import tuning
    from liger_losses.kernels.scale import SCALE_TUNING, ScaleTuning

    with tuning(scale=ScaleTuning(block=4096)):                  # a whole value
        ...
    with tuning(rms_norm={"bwd_tile_elems": 8192}, swiglu={"num_warps": 4}):   # or changes
        ...
    with SCALE_TUNING.override(block=4096):                      # one kernel's slot directly
        ...

The slots (name: knobs class, module): ``rms_norm`` / ``layer_norm``: ``NormTuning``
(norm_common), ``norm_sum``: ``PartialSumTuning`` (norm_common), ``swiglu`` / ``geglu``:
``GatedTuning`` (gated), ``gated_down``: ``GatedDownTuning``, ``mlp``: ``MLPTuning`` (the fused
tail's switch), ``logits_tile``, ``logp_entropy_grad``, ``divergence_tile``, ``label_stats``,
``scale``, ``rope``, ``online_block``: ``<Kernel>Tuning`` in their modules, ``pdl``: ``PDLConfig``, ``rope_patch``:
``RoPEPatchConfig`` (patching/rope.py). The fast launcher's switch stays ``launch.set_fast_launch``.

The value is process-wide (a module global, not a context variable): autograd runs backward
passes on its own threads, which must see the knobs the forward saw. ``registered()`` lists the
slots by name. Knob values are checked once, when a dataclass is built (``TypeError`` /
``ValueError`` naming the knob).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Generic, Iterator, Mapping, TypeVar, Union

T = TypeVar("T", bound="Knobs")

_REGISTRY: Dict[str, "TuningSlot"] = {}


def knob(default: Any, *, minimum: int = 0, optional: bool = False) -> Any:
    """A dataclass field for a knob: ``default``, and for integers the smallest accepted value;
    ``optional``: ``None`` is accepted too (always where the default is ``None``: "the compiler's
    choice")."""
    return dataclasses.field(default=default, metadata={"minimum": minimum, "optional": optional})


class Knobs:
    """Base of the kernels' frozen tuning dataclasses: checks every field once, when built.

    A field whose default is a bool takes a bool; an int default takes an int >= its ``minimum``
    (``knob(..., minimum=...)``, else 0), or None with ``optional=True``; a ``None`` default takes
    None or an int >= minimum (at least 1); a frozenset default takes a frozenset of strings.
    """

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check_knob(type(self).__name__, f, getattr(self, f.name))


def _check_knob(owner: str, f: dataclasses.Field, value: Any) -> None:
    name = f"{owner}.{f.name}"
    default = f.default
    minimum = f.metadata.get("minimum", 0)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    elif isinstance(default, frozenset):
        if not isinstance(value, frozenset) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"{name} must be a frozenset of str, got {value!r}")
    elif isinstance(default, int) or default is None:
        optional = default is None or f.metadata.get("optional", False)
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {value!r}")
        low = max(minimum, 1) if default is None else minimum
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


class TuningSlot(Generic[T]):
    """The current value of one kernel's knobs (``current``), its default and a context manager
    (:meth:`override`) that replaces it for a ``with`` block."""

    def __init__(self, name: str, default: T):
        self.name = name
        self.default = default
        self.current = default

    def _resolve(self, value: Union[T, Mapping[str, Any], None], changes: Mapping[str, Any]) -> T:
        if value is None:
            value = {}
        if isinstance(value, Mapping):
            value = {**value, **changes}
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(self.default)})
            if unknown:
                raise ValueError(
                    f"{self.name} has no knob(s) {unknown}; its knobs: "
                    f"{[f.name for f in dataclasses.fields(self.default)]}"
                )
            return dataclasses.replace(self.current, **value)
        if changes:
            raise TypeError(f"{self.name}: give a {type(self.default).__name__} or keyword changes, not both")
        if type(value) is not type(self.default):
            raise TypeError(f"{self.name} takes a {type(self.default).__name__}, got {type(value).__name__}")
        return value

    @contextlib.contextmanager
    def override(self, value: Union[T, Mapping[str, Any], None] = None, /, **changes: Any) -> Iterator[T]:
        """``with slot.override(KnobsClass(...))`` or ``with slot.override(knob=value, ...)``
        (changes to the current value): the knobs inside the block; the previous value after it."""
        new = self._resolve(value, changes)
        previous = self.current
        self.current = new
        try:
            yield new
        finally:
            self.current = previous

    def __repr__(self) -> str:
        return f"TuningSlot({self.name!r}, current={self.current!r})"


def _qualname(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def register(name: str, default: T) -> TuningSlot[T]:
    """The slot of kernel ``name`` with ``default`` as its value (one per name: a second kernel
    taking a registered name is a ValueError; a reloaded module replaces its own slot)."""
    if not isinstance(default, Knobs) or not dataclasses.is_dataclass(default):
        raise TypeError(f"default must be a Knobs dataclass instance, got {type(default).__name__}")
    if name in _REGISTRY and _qualname(_REGISTRY[name].default) != _qualname(default):
        raise ValueError(
            f"a tuning slot named {name!r} is already registered (for {_qualname(_REGISTRY[name].default)})"
        )
    slot = TuningSlot(name, default)
    _REGISTRY[name] = slot
    return slot


def registered() -> Dict[str, TuningSlot]:
    """The registered slots by name (the kernels whose modules have been imported)."""
    return dict(_REGISTRY)


@contextlib.contextmanager
def tuning(**per_kernel: Union[Knobs, Mapping[str, Any]]) -> Iterator[None]:
    """``with tuning(rms_norm=RMSNormTuning(...), swiglu={"num_warps": 4})``: several kernels'
    knobs for a block (each a whole value or a mapping of changes to its current value)."""
    unknown = sorted(set(per_kernel) - set(_REGISTRY))
    if unknown:
        raise ValueError(f"no tuning slot named {unknown}; registered: {sorted(_REGISTRY)}")
    with contextlib.ExitStack() as stack:
        for name, value in per_kernel.items():
            stack.enter_context(_REGISTRY[name].override(value))
        yield
