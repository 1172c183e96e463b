"""The base of the chunked losses' ``nn.Module`` twins: validated options in, the functional out.

A loss module's ``__init__`` takes its options as named keyword parameters (so that
``inspect.signature`` lists them: the TRL adapters read it), builds the frozen option dataclasses
once -- :class:`~liger_losses.chunked.options.HeadOptions` and the loss's own (``DPOOptions``,
...), which validate themselves -- and hands them to :class:`ChunkedLossModule`. ``forward`` takes
the tensors and calls the loss's runner (the functional twin without its option parsing) with
those options; nothing is re-validated per call. An unknown option is a ``TypeError`` from Python
itself (no ``**options`` swallows it).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict

from torch import nn

from liger_losses.chunked.options import HeadOptions, field_values
from liger_losses.kernels.utils import eager_under_compile


class ChunkedLossModule(nn.Module):
    """Holds ``head`` (:class:`HeadOptions`) and ``loss_options`` (the loss's frozen dataclass);
    :meth:`run` calls ``runner(*tensors, head=..., options=..., **inputs)``. Subclasses set
    ``runner`` (a ``staticmethod``), ``TRL_METRIC_NAMES`` and ``REPR_KEYS`` (what ``extra_repr``
    shows, by option name)."""

    runner: ClassVar[Callable[..., Any]]
    TRL_METRIC_NAMES: ClassVar[Dict[str, str]] = {}
    REPR_KEYS: ClassVar[tuple] = ()

    def __init__(self, head: HeadOptions, loss_options):
        super().__init__()
        self.head = head
        self.loss_options = loss_options

    @property
    def options(self) -> Dict[str, Any]:
        """Every option by name: the loss's own, then the shared ones."""
        return {**field_values(self.loss_options), **field_values(self.head)}

    @eager_under_compile  # as the functional losses: run eagerly while torch.compile traces a caller
    def run(self, *tensors, **inputs):
        return type(self).runner(*tensors, head=self.head, options=self.loss_options, **inputs)

    def extra_repr(self) -> str:
        options = self.options
        return ", ".join(f"{k}={options[k]!r}" for k in self.REPR_KEYS)
