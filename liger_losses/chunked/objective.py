"""The contract of a sequence objective: what the driver hands it and what it declares.

A per-sequence loss (DPO family, ORPO, SimPO, CPO, KTO, ...) is one function of per-sequence
statistics: ``objective(stats: SequenceStats) -> (losses [U], metrics {name: [U]})`` over units of
one sequence (``group_size=1``) or of a ``[chosen; rejected]`` pair (``group_size=2``), plain
PyTorch, differentiable in ``stats.logps``. The sequence driver
(:func:`liger_losses.chunked.sequence.fused_linear_sequence_objective`) computes the statistics
chunk by chunk and back-propagates through the LM head.

An objective declares how the driver may run it by subclassing :class:`Objective`:

* ``separable`` (class attribute or property): the loss of a unit depends on that unit's
  statistics only (plus batch-wide constants such as ``stats.batch_num_tokens``), so the driver
  may call it on chunks of units in one pass. ``False`` (e.g. a loss that sorts over the batch)
  makes the driver take two phases: statistics of the whole batch, then the objective once.
* ``pair_gradient_ratio(chosen_tokens, rejected_tokens) -> float | None``: ``r`` with
  ``d loss / d rejected_logps = r * d loss / d chosen_logps`` for every pair of those lengths (e.g.
  ``-1`` for a function of the chosen-minus-rejected margin), or None. Lets the two-phase path
  back-propagate the longest pair before its upstream gradient is known (no recompute for it).

A plain callable is accepted too (:func:`as_objective` wraps it: separable as the caller says,
no pair gradient ratio).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Optional

from torch import Tensor


@dataclass
class SequenceStats:
    """Per-sequence statistics handed to a sequence objective; ``[S]`` float32 tensors for the
    ``S`` sequences of the call (for pairs: ``[chosen of the units; rejected of the units]``)."""

    logps: Tensor  # sum over valid tokens of token_weight * log p(label); differentiable in the driver
    num_tokens: Tensor  # valid tokens per sequence
    logits_sum: Tensor  # sum over valid tokens of the mean-over-vocab (transformed) logit
    correct: Tensor  # valid tokens whose argmax is the label
    entropy_sum: Optional[Tensor]  # sum over valid tokens of the softmax entropy (need_entropy)
    ref_logps: Optional[Tensor]  # reference sum log-probs (same token weights), or None
    batch_num_tokens: Tensor  # [B] valid tokens of every sequence of the whole batch
    index: Tensor  # [S] long: positions of these sequences in the whole batch
    # sum over valid tokens of log p(label) - log sum_v p_v^2, unweighted (need_aligned_logps; WPO's weights)
    aligned_logps: Optional[Tensor] = None


class Objective(abc.ABC):
    """Base of the sequence objectives (see the module docstring): subclasses implement
    ``__call__(stats) -> (losses [U], metrics)`` and may override :attr:`separable` and
    :meth:`pair_gradient_ratio`."""

    separable: bool = True

    def pair_gradient_ratio(self, chosen_tokens: int, rejected_tokens: int) -> Optional[float]:
        """``r`` with d loss/d rejected_logps = r * d loss/d chosen_logps, or None (unknown)."""
        return None

    @abc.abstractmethod
    def __call__(self, stats: SequenceStats) -> tuple[Tensor, dict]:
        """``(losses [U], {name: [U]})`` of the units in ``stats``."""


class FunctionObjective(Objective):
    """A plain ``fn(stats) -> (losses, metrics)`` as an :class:`Objective`."""

    def __init__(self, fn: Callable[[SequenceStats], tuple[Tensor, dict]], *, separable: bool = True):
        self.fn, self.separable = fn, bool(separable)

    def __call__(self, stats: SequenceStats) -> tuple[Tensor, dict]:
        return self.fn(stats)


def as_objective(objective, *, separable: bool = True) -> Objective:
    """``objective`` as an :class:`Objective`: an instance is used as it declares itself (run as
    non-separable too when ``separable=False``), a plain callable is wrapped
    (:class:`FunctionObjective`). ``TypeError`` for anything else."""
    if isinstance(objective, Objective):
        if separable or not objective.separable:
            return objective
        return _NonSeparable(objective)
    if not callable(objective):
        raise TypeError(f"objective must be callable, got {type(objective).__name__}")
    return FunctionObjective(objective, separable=separable)


class _NonSeparable(Objective):
    """An objective run whole (``separable=False`` asked by the caller)."""

    separable = False

    def __init__(self, inner: Objective):
        self.inner = inner

    def pair_gradient_ratio(self, chosen_tokens: int, rejected_tokens: int) -> Optional[float]:
        return self.inner.pair_gradient_ratio(chosen_tokens, rejected_tokens)

    def __call__(self, stats: SequenceStats) -> tuple[Tensor, dict]:
        return self.inner(stats)
