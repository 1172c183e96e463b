"""Chunk planning: how many tokens go into one logits tile, and which path a sequence loss takes.

Pure functions of token counts and sizes (no tensors), so every plan can be tested on its own.

* :func:`tile_budget` -- the default memory budget of one ``[n, V]`` tile (bytes);
* :func:`chunk_bounds` -- ``[0, N)`` cut into balanced chunks whose tile fits the budget (or of
  exactly ``chunk_tokens``); :func:`token_chunks` the same for an LM head's shape;
* :func:`group_chunk_bounds` -- chunks of whole groups (sequences or pairs);
* :func:`plan_sequence_passes` -- the :class:`SequencePlan` of the sequence-objective driver:
  ``"one_pass"`` (whole units per chunk, each tile back-propagated while it exists),
  ``"two_phase"`` (statistics of the whole batch first, the objective once; the longest unit is
  back-propagated in phase 1 and rescaled once its upstream gradient is known) or
  ``"recompute"`` (two phases where the other tiles are recomputed in phase 2 for their
  gradient).

The knobs (budget, alignment, unit budget factor) are read from
:func:`liger_losses.chunked.config.get_engine_config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from liger_losses.chunked.config import get_engine_config

Bounds = tuple[tuple[int, int], ...]


def tile_budget(vocab: int, hidden_size: int, itemsize: int, *, wide_accum: bool = False) -> int:
    """The default tile budget in bytes for a ``[vocab, hidden_size]`` head of ``itemsize``-byte
    elements: the larger of ``default_budget_bytes`` and ``weight_budget_fraction`` of the head
    (``wide_accum_budget_fraction`` when ``wide_accum``: the weight gradient accumulates in a wider
    dtype than the weight's, :attr:`~.gemm.WeightAccum.widens`)."""
    cfg = get_engine_config()
    fraction = cfg.wide_accum_budget_fraction if wide_accum else cfg.weight_budget_fraction
    return max(cfg.default_budget_bytes, int(fraction * vocab * hidden_size * itemsize))


def _max_chunk(vocab: int, chunk_tokens, budget_bytes, itemsize) -> tuple[int, bool]:
    if chunk_tokens is not None:
        if int(chunk_tokens) < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
        return int(chunk_tokens), True
    budget = get_engine_config().default_budget_bytes if budget_bytes is None else int(budget_bytes)
    if budget <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes!r}")
    return max(1, budget // max(1, vocab * itemsize)), False


def chunk_bounds(
    num_tokens: int,
    vocab: int,
    *,
    chunk_tokens: Optional[int] = None,
    budget_bytes: Optional[int] = None,
    itemsize: int = 2,
) -> list[tuple[int, int]]:
    """Split ``[0, num_tokens)`` into ``(start, end)`` chunks whose ``[n, vocab]`` tile of
    ``itemsize`` bytes fits ``budget_bytes`` (default ``EngineConfig.default_budget_bytes``). From
    the budget, chunks are balanced (equal sizes, rounded up to a multiple of ``chunk_align`` when
    that still fits); ``chunk_tokens`` instead fixes the chunk size exactly (the last may be short)."""
    if num_tokens <= 0:
        return []
    size, exact = _max_chunk(vocab, chunk_tokens, budget_bytes, itemsize)
    if not exact:
        align = get_engine_config().chunk_align
        k = math.ceil(num_tokens / size)
        bal = math.ceil(num_tokens / k)
        aligned = math.ceil(bal / align) * align
        size = aligned if aligned <= size else bal
    return [(s, min(s + size, num_tokens)) for s in range(0, num_tokens, size)]


def token_chunks(vocab: int, hidden_size: int, itemsize: int, num_tokens: int,
                 chunk_tokens: Optional[int], *, wide_accum: bool = False) -> list[tuple[int, int]]:
    """:func:`chunk_bounds` of ``num_tokens`` rows for a ``[vocab, hidden_size]`` head of
    ``itemsize``-byte elements, with the head's default :func:`tile_budget`."""
    return chunk_bounds(num_tokens, vocab, chunk_tokens=chunk_tokens,
                        budget_bytes=tile_budget(vocab, hidden_size, itemsize, wide_accum=wide_accum),
                        itemsize=itemsize)


def group_chunk_bounds(
    group_token_counts: Sequence[int],
    vocab: int,
    *,
    chunk_tokens: Optional[int] = None,
    budget_bytes: Optional[int] = None,
    itemsize: int = 2,
) -> Optional[list[tuple[int, int, int, int]]]:
    """Chunks of whole groups (sequences or pairs), greedily filled up to the token limit:
    ``(group_start, group_end, token_start, token_end)``; groups are laid out contiguously in
    the given order. ``None`` when one group alone exceeds the limit."""
    limit, _ = _max_chunk(vocab, chunk_tokens, budget_bytes, itemsize)
    out: list[tuple[int, int, int, int]] = []
    g0, t0, t = 0, 0, 0
    for g, c in enumerate(group_token_counts):
        c = int(c)
        if c > limit:
            return None
        if t + c - t0 > limit and g > g0:
            out.append((g0, g, t0, t))
            g0, t0 = g, t
        t += c
    if len(group_token_counts) > g0:
        out.append((g0, len(group_token_counts), t0, t))
    return out


# --------------------------------------------------------------------------- the sequence driver's plan


def unit_order(batch: int, group_size: int) -> list[int]:
    """The batch's sequences in unit order: pairs (``group_size=2``, batch laid out
    ``[chosen; rejected]``) interleaved ``c0, r0, c1, r1, ...`` so that a chunk of whole units is
    one contiguous token range; sequences (``group_size=1``) in batch order."""
    if group_size == 2:
        half = batch // 2
        return [i for p in range(half) for i in (p, p + half)]
    return list(range(batch))


@dataclass(frozen=True)
class SequencePlan:
    """How the sequence-objective driver runs one call (token ranges index the valid tokens laid
    out in unit order; positions index the sequences in unit order).

    * ``mode``: ``"one_pass"``, ``"two_phase"`` (no tile recomputed: the exempt unit is every
      token) or ``"recompute"`` (two phases with ``recompute_chunks``);
    * ``unit_chunks`` (one pass): ``(unit_start, unit_end, token_start, token_end)``;
    * ``exempt_position``: the position (sequence, or a pair's chosen sequence) whose upstream
      gradient scales the tiles back-propagated in phase 1, None when the batch is empty;
    * ``exempt_tokens``: ``(start, mid, end)``, that unit's tokens ``[start, end)``; with a
      ``rejected_ratio`` (a pair exempt as a whole), ``[mid, end)`` are the rejected sequence's,
      back-propagated with that row scale (``mid == end`` otherwise);
    * ``exempt_chunks`` / ``recompute_chunks``: ``(token_start, token_end)`` of phase 1's
      back-propagated tiles and of the tiles recomputed in phase 2 (statistics-only in phase 1).
    """

    mode: str
    unit_chunks: tuple[tuple[int, int, int, int], ...] = ()
    exempt_position: Optional[int] = None
    exempt_tokens: tuple[int, int, int] = (0, 0, 0)
    rejected_ratio: Optional[float] = None
    exempt_chunks: Bounds = ()
    recompute_chunks: Bounds = ()


def plan_sequence_passes(
    position_counts: Sequence[int],
    *,
    group_size: int,
    separable: bool,
    vocab: int,
    hidden_size: int,
    itemsize: int,
    chunk_tokens: Optional[int] = None,
    pair_gradient_ratio: Optional[Callable[[int, int], Optional[float]]] = None,
    wide_accum: bool = False,
) -> SequencePlan:
    """The :class:`SequencePlan` for sequences of ``position_counts`` valid tokens (unit order,
    :func:`unit_order`) through a ``[vocab, hidden_size]`` head of ``itemsize``-byte elements.

    One pass when the objective is ``separable`` and whole units fit a chunk: of ``chunk_tokens``
    when given, else of the default :func:`tile_budget` (``wide_accum``: of a weight gradient
    accumulated wider than the weight) or -- for a unit larger than that --
    ``unit_budget_factor`` default budgets (one pass costs 6NHV, recomputing every tile 8NHV).
    Otherwise two phases, where the longest sequence is exempt from the recompute (8NHV - 2N*HV);
    for pairs, the longest pair as a whole when ``pair_gradient_ratio(chosen_tokens,
    rejected_tokens)`` gives ``r`` with d loss/d rejected = r * d loss/d chosen (a single long
    pair then costs 6NHV). The exempt unit's tokens are chunked apart whether or not gradients are
    wanted, so the loss does not depend on it.
    """
    counts = [int(c) for c in position_counts]
    B, g = len(counts), group_size
    budget = tile_budget(vocab, hidden_size, itemsize, wide_accum=wide_accum)
    if separable:
        groups = [sum(counts[u * g:(u + 1) * g]) for u in range(B // g)]
        plan = group_chunk_bounds(groups, vocab, chunk_tokens=chunk_tokens, budget_bytes=budget,
                                  itemsize=itemsize)
        if plan is None and chunk_tokens is None:
            cfg = get_engine_config()
            plan = group_chunk_bounds(
                groups, vocab, budget_bytes=max(cfg.unit_budget_factor * cfg.default_budget_bytes, budget),
                itemsize=itemsize,
            )
        if plan is not None:
            return SequencePlan("one_pass", unit_chunks=tuple(plan))

    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    total = starts[-1]
    star, ratio = (max(range(B), key=lambda p: counts[p]), None) if B > 0 else (None, None)
    if g == 2 and B > 0 and pair_gradient_ratio is not None:
        pair = max(range(B // 2), key=lambda u: counts[2 * u] + counts[2 * u + 1])
        r = pair_gradient_ratio(counts[2 * pair], counts[2 * pair + 1])
        if r is not None:
            star, ratio = 2 * pair, float(r)
    a = starts[star] if star is not None else 0
    b = starts[star + (1 if ratio is None else 2)] if star is not None else 0
    mid = starts[star + 1] if ratio is not None else b

    def spans(lo, hi):
        return tuple((lo + s0, lo + s1) for s0, s1 in chunk_bounds(
            hi - lo, vocab, chunk_tokens=chunk_tokens, budget_bytes=budget, itemsize=itemsize))

    recompute = spans(0, a) + spans(b, total)
    return SequencePlan(
        "recompute" if recompute else "two_phase", exempt_position=star, exempt_tokens=(a, mid, b),
        rejected_ratio=ratio, exempt_chunks=spans(a, b), recompute_chunks=recompute,
    )
