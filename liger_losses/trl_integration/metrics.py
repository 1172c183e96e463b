"""Metrics read on the host when somebody reads them, not when the step computes them.

A trainer step that reads a metric on the host (``.item()``, ``.tolist()``) after its loss waits
there until the GPU has finished the loss; the backward is then issued to an idle GPU. On a step of
a few thousand tokens the host is the bottleneck and that wait adds to the step time. The adapters
therefore queue each step's metric values as device tensors, with the function that turns them into
what TRL logs (:meth:`DeferredMetrics.add`), and read the whole queue in one transfer the first time
anything reads the trainer's metric store: TRL's ``log``, a callback, a test.
:class:`ResolvingStore` wraps that store (``trainer._metrics``, CPO/ORPO's ``_stored_metrics``) so
that every read resolves the queue first; the values and the order in which they are appended are
the ones an immediate read gives.

Shapes: every queued tensor is flattened to ``[K]`` (any float or integer dtype); the function
receives the ``K`` values as Python floats (read through float64, exact for float32 and integers up
to 2**53; float32 on MPS, which has no float64).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

Then = Callable[[List[float]], None]


class DeferredMetrics:
    """A queue of ``(values on the device, function of their floats)``, read in one host transfer.

    :meth:`resolve` calls the functions in the order they were added. It takes the queue before it
    calls them, so a function that reads the store (and so calls :meth:`resolve` again) sees an empty
    queue. The queue is resolved when it holds ``limit`` entries, which bounds what it keeps alive
    when nothing reads the metrics for many steps.
    """

    def __init__(self, limit: int = 256):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        self.limit = limit
        self._items: List[Tuple[Optional[torch.Tensor], Then]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, values: Optional[torch.Tensor | Sequence[torch.Tensor]], then: Then) -> None:
        """Queue ``values`` (a tensor, a sequence of 0-d tensors, or None for none) for ``then``."""
        if not callable(then):
            raise TypeError(f"then must be callable, got {type(then).__name__}")
        if values is not None and not isinstance(values, torch.Tensor):
            values = torch.stack([torch.as_tensor(v).detach().reshape(()) for v in values]) if len(values) else None
        if values is not None:
            values = values.detach().reshape(-1)
            if values.numel() == 0:
                values = None
        self._items.append((values, then))
        if len(self._items) >= self.limit:
            self.resolve()

    def resolve(self) -> None:
        """Read every queued value (one ``tolist`` per device) and call the functions in order."""
        items, self._items = self._items, []
        if not items:
            return
        floats: List[Optional[List[float]]] = [None] * len(items)
        by_device: dict = {}
        for i, (values, _) in enumerate(items):
            if values is not None:
                by_device.setdefault(values.device, []).append(i)
        for device, idx in by_device.items():
            dtype = torch.float32 if device.type == "mps" else torch.float64
            flat = torch.cat([items[i][0].to(dtype) for i in idx]).tolist()
            start = 0
            for i in idx:
                n = items[i][0].numel()
                floats[i] = flat[start:start + n]
                start += n
        for (_, then), vals in zip(items, floats):
            then(vals if vals is not None else [])


class ResolvingStore(MutableMapping):
    """``data`` (a mapping) seen through :meth:`DeferredMetrics.resolve`: every read or write of a key,
    iteration and ``len`` resolve the queue first, so a reader never sees a store the queued values
    have not reached yet. ``data`` holds the values themselves."""

    def __init__(self, data: MutableMapping, pending: DeferredMetrics):
        self.data = data
        self.pending = pending

    def __getitem__(self, key: Any) -> Any:
        self.pending.resolve()
        return self.data[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.pending.resolve()
        self.data[key] = value

    def __delitem__(self, key: Any) -> None:
        self.pending.resolve()
        del self.data[key]

    def __iter__(self) -> Iterator[Any]:
        self.pending.resolve()
        return iter(list(self.data))

    def __len__(self) -> int:
        self.pending.resolve()
        return len(self.data)

    def __repr__(self) -> str:
        return f"ResolvingStore({self.data!r}, {len(self.pending)} queued)"


def install(trainer, attr: str, pending: DeferredMetrics) -> None:
    """Wrap ``trainer.<attr>`` (when it exists and is not wrapped yet) in a :class:`ResolvingStore`."""
    store = getattr(trainer, attr, None)
    if store is not None and not isinstance(store, ResolvingStore):
        setattr(trainer, attr, ResolvingStore(store, pending))


class QueuedMetrics(Mapping):
    """``{name: float}`` whose values are queued on ``pending`` (``values[i]`` for ``names[i]``): reading a
    value resolves the queue; :meth:`when_resolved` runs a function of the dict when the values arrive
    (at once if they have), in the queue's order. For TRL trainers whose loss method returns its metrics
    as a dict of floats (CPO, ORPO) and stores them with ``store_metrics``."""

    def __init__(self, names: Sequence[str], values: torch.Tensor, pending: DeferredMetrics):
        self._names = list(names)
        self._values: Optional[dict] = None
        self._followers: List[Callable[[dict], None]] = []
        self._pending = pending
        pending.add(values, self._fill)

    def _fill(self, floats: List[float]) -> None:
        self._values = dict(zip(self._names, floats))
        followers, self._followers = self._followers, []
        for fn in followers:
            fn(self._values)

    def when_resolved(self, fn: Callable[[dict], None]) -> None:
        if self._values is not None:
            fn(self._values)
        else:
            self._followers.append(fn)

    def _resolved(self) -> dict:
        if self._values is None:
            self._pending.resolve()
        return self._values

    def __getitem__(self, key: str) -> float:
        return self._resolved()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)
