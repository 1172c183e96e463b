"""The chunked engine's tuning knobs: one frozen :class:`EngineConfig`, read where each knob acts.

The defaults are what the losses ship with; a benchmark or a test that wants another value uses
the context manager ``with engine_config(speculative_first_chunk=False): ...`` (its changes are
taken back on exit, also on an exception). Nothing else changes these values: no
module global is patched. The configuration is process-wide, as the kernels' tuning slots are
(:mod:`liger_losses.kernels.tuning`), not a context variable: autograd runs a CUDA backward on its
own device thread, and ``device_scale`` is read there, so it must see what the forward's thread set.

Knobs (what each one trades, and what was measured):

* ``default_budget_bytes`` / ``weight_budget_fraction``: the memory budget of one logits tile, the
  larger of ``default_budget_bytes`` and ``weight_budget_fraction`` of the head's ``[V, H]`` weight
  (:func:`liger_losses.chunked.planning.tile_budget`). The weight-gradient GEMM's inner dimension
  is the chunk's token count: at 1024 tokens it ran at 1.18x its FLOP floor on the H200 (logits
  GEMM 1.03x). Half the weight gives H/2 tokens per chunk (2048 at H=4096): cross-entropy
  8192 x 4096 x 128256 41.8 -> 40.3 ms, DPO 1 pair x 16384 172.3 -> 163.5 ms (H200, bf16), while
  the peak above the inputs stays below 1.5x the gradients (weight + half of it + hidden) when the
  weight gradient accumulates in the weight's dtype (see ``half_weight_accum_dtype`` and
  ``wide_accum_budget_fraction`` for the fp32 accumulator).
* ``chunk_align``: chunk sizes found from the budget are rounded to a multiple of this (GEMM
  efficiency).
* ``unit_budget_factor``: one-pass preference losses need a whole unit (pair) in one tile; a unit
  may take up to this many ``default_budget_bytes`` (or one tile budget, if larger) before the
  sequence driver falls back to two phases, which recompute every tile but the longest pair's
  (8NHV instead of 6NHV for the policy). 4 -> 1 GiB: 4184 tokens at V=128256 in bf16, so a batch
  of TRL DPO pairs at max_length 2048 (prompt 512 + 2 x 1536 completion tokens) stays one-pass;
  the tile is freed before the model's backward, whose activations set a trainer's peak. The
  per-token driver (``token_objective``, GRPO/RLOO) applies the same rule to one sequence of an
  objective with ``"sequence"`` coupling.
* ``device_scale``: the backward of the one-pass losses scales the forward's gradients by the
  upstream scalar on the device (``kernels.scale``: no host sync, no memory pass when it is 1)
  instead of reading it on the host (one sync per backward; False restores that). H200 profile of
  cross-entropy at 8192 tokens: GPU idle per step 1.74 -> 1.42 ms. The scale is applied in fp32,
  so a non-unit upstream gradient can differ by one bf16 ulp from ``x.mul_(s)``.
* ``speculative_first_chunk``: per-token losses (cross-entropy, token log-probs; on the tile path
  and on the frozen-head path alike) issue their first chunk before the one host sync. The label
  scan's count goes to pinned host memory through a non-blocking copy; the first chunk's rows are
  taken from ``nonzero_static`` of a known size (ignored rows padded out: label ``ignore_index``,
  zero loss and gradient; on the frozen-head path their results are dropped), its GEMMs and
  kernels are enqueued, and only then does the host wait -- for the copy, not for the chunk. The GPU runs
  the chunk while the host plans the rest. Only when the rows fill at least two chunks; the cost
  is the ignored rows among the first chunk's (all valid unless more than half are ignored).
* ``half_weight_accum_dtype``: the accumulator of a bf16 / fp16 head's weight gradient when a loss's
  ``accum_dtype`` is None and more than one chunk adds to it (one chunk writes it in the weight's
  dtype, rounded once, as fp32 accumulation would). Rounding the running sum to bf16 after every
  chunk lowers the entropy of a run: 200 SFT steps of 8 chunks each (``benchmark/bench_convergence.py``,
  ``results/convergence_summary.csv``) gave an entropy 0.0026 below fp32 accumulation's in both
  data orders, 2.5x the seed-to-seed difference, with the loss equal. float32 costs 4 bytes per head
  weight instead of 2 while the loss runs and 6 when the gradient is cast back at its backward;
  None restores accumulation in the weight's dtype. An explicit ``accum_dtype`` overrides it.
* ``wide_accum_budget_fraction``: the tile budget, as a fraction of the head's ``[V, H]`` weight,
  of a pass whose weight gradient accumulates in a wider dtype than the weight's (instead of
  ``weight_budget_fraction``). The accumulator and its cast at the end hold three times the
  weight's bytes (fp32 + bf16), so a tile of the weight's size adds nothing to the pass's peak
  while it halves the chunks: each chunk's weight-gradient GEMM reads and writes the fp32
  accumulator (8 bytes a weight against 4), and with the token count as its inner dimension at
  H/2 it turns memory-bound.
* ``frozen_head_online`` / ``frozen_budget_bytes`` / ``frozen_block_columns``: a per-token pass
  that wants only the hidden gradient (frozen head weight and bias) runs the online-softmax path
  (:mod:`liger_losses.chunked.frozen_head`): token chunks whose logits block of
  ``frozen_block_columns`` columns and fp32 accumulator fit ``frozen_budget_bytes`` (512 tokens at
  H=4096, bf16), instead of a tile sized for a weight-gradient GEMM that does not run. 8192 x 4096 x
  128256: H200 27.5 ms / 92 MiB above the inputs against the tile path's 25.8 / 565
  (``benchmark/results/fused_linear_ce_frozen.csv``); H100 (``benchmark/experiments/
  diag_frozen_head.py``, run with a one-pass variant of the block kernel that measured as fast)
  512-token chunks 29.1-29.5 ms / 92 MiB, 683 tokens (32 MiB) 28.5-29.0 / 101 MiB (past 1.5x the
  hidden gradient), 8192-column blocks of 768 tokens 29.8 / 94.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from liger_losses.kernels.utils import check_number


@dataclass(frozen=True)
class EngineConfig:
    """The engine's tuning knobs (see the module docstring for each one's measurement)."""

    default_budget_bytes: int = 256 * 1024 * 1024
    weight_budget_fraction: float = 0.5
    wide_accum_budget_fraction: float = 1.0
    chunk_align: int = 128
    unit_budget_factor: int = 4
    device_scale: bool = True
    speculative_first_chunk: bool = True
    frozen_head_online: bool = True
    frozen_budget_bytes: int = 24 * 1024 * 1024
    frozen_block_columns: int = 16384
    half_weight_accum_dtype: Optional[torch.dtype] = torch.float32

    def __post_init__(self):
        for name in ("default_budget_bytes", "chunk_align", "unit_budget_factor", "frozen_budget_bytes",
                     "frozen_block_columns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("weight_budget_fraction", "wide_accum_budget_fraction"):
            check_number(name, getattr(self, name))
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.half_weight_accum_dtype not in (None, torch.float32, torch.float64):
            raise ValueError("half_weight_accum_dtype must be None, torch.float32 or torch.float64, got "
                             f"{self.half_weight_accum_dtype!r}")
        for name in ("device_scale", "speculative_first_chunk", "frozen_head_online"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")


_BASE = EngineConfig()
_OVERRIDES: list = []  # (token, changes) of the open engine_config blocks, in the order they opened
_CURRENT = [_BASE]  # one slot, swapped whole: readers see the old or the new value


def get_engine_config() -> EngineConfig:
    """The configuration in force (the defaults unless inside :func:`engine_config`)."""
    return _CURRENT[0]


def _recompute() -> None:
    """``_CURRENT`` from ``_OVERRIDES``, without a lock: write, then start again if the list changed
    meanwhile (another thread, or a block closed by the garbage collector inside this very call,
    where a lock held here would deadlock); the last writer always saw the list as it stands."""
    while True:
        snapshot = tuple(_OVERRIDES)
        cfg = _BASE
        for _, changes in snapshot:
            cfg = dataclasses.replace(cfg, **changes)
        _CURRENT[0] = cfg
        if tuple(_OVERRIDES) == snapshot:
            return


@contextlib.contextmanager
def engine_config(**changes) -> Iterator[EngineConfig]:
    """``with engine_config(knob=value, ...) as cfg:`` runs the block with those knobs changed
    (unknown names raise ``TypeError``, bad values ``ValueError``) and takes them back on exit.

    The configuration in force is the defaults with the changes of every open block applied in the
    order the blocks opened; a block's exit removes its own changes only, so blocks that two threads
    open and close interleaved leave the defaults behind once all have closed (restoring the
    configuration seen at entry would leave the first-closed block's changes in force)."""
    dataclasses.replace(_CURRENT[0], **changes)  # validates before anything changes
    entry = (object(), dict(changes))
    _OVERRIDES.append(entry)  # one list operation each: atomic under the GIL, locked in free-threaded builds
    _recompute()
    new = _CURRENT[0]
    try:
        yield new
    finally:
        _OVERRIDES.remove(entry)
        _recompute()
