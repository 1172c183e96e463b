"""The chunked fused-linear engine: an index of the package-public primitives every loss runs on.

Computes losses of ``logits = hidden @ weight.T (+ bias)`` without ever holding the whole
``[tokens, vocab]`` logits. The pieces, one module per concern:

* :mod:`.tokens` -- token compaction: the labels' one host sync (:func:`scan_labels`,
  :class:`PendingLabelScan`), the valid positions (:func:`valid_index`, :func:`token_rows`,
  :func:`compact_tokens`), rows gathered / gradients scattered chunk by chunk
  (:class:`RowGather`, :class:`RowScatter`, :func:`scatter_rows`, :func:`grad_like`);
* :mod:`.planning` -- chunk sizes from a memory budget (:func:`tile_budget`, :func:`chunk_bounds`,
  :func:`token_chunks`, :func:`group_chunk_bounds`) and the sequence driver's plan
  (:func:`plan_sequence_passes`);
* :mod:`.gemm` -- the logits tile and the gradient GEMMs (:func:`compute_dtype`, :func:`project`,
  :func:`backprop_tile`, :class:`HeadGrads`);
* :mod:`.weights` -- sharded weights (:func:`gather_weight`, :func:`weight_grad_like`,
  :func:`head_in_dtype`);
* :mod:`.autograd` -- gradients computed in the forward, scaled in backward
  (:func:`needs_head_grads`, :func:`save_forward_grads`, :func:`scaled_grads`);
* :mod:`.token_passes` -- per-token chunk loops (:func:`run_tiles`, :func:`run_token_tiles`,
  :class:`RecomputedTokenFunction`);
* :mod:`.sequence` -- the sequence-objective driver (preference losses);
* :mod:`.token_objective` -- the per-token objective driver (GRPO, RLOO): objectives of each
  token's log-prob and entropy that declare their coupling (:class:`TokenObjective`);
* :mod:`.options` -- :class:`HeadOptions` (the options every loss shares) and input checks;
* :mod:`.config` -- the tuning knobs (:class:`EngineConfig`, ``with engine_config(...)``).

Per chunk: the tile is formed by :func:`project` (``[n, V]`` in the compute dtype), a logits-tile
kernel (``liger_losses.kernels.logits_tile``) writes row statistics and ``d loss / d logits`` into
the tile in place, and :func:`backprop_tile` turns that gradient into ``grad_hidden`` (``G @ W``)
and ``grad_weight`` (``G^T @ hidden``, accumulated across chunks in fp32 for a bf16 / fp16 head,
or in ``accum_dtype``: :func:`~.gemm.weight_accum`). Row statistics are float32. One host sync per
loss (the labels' scan).

Shapes and dtypes: ``weight [V, H]``, ``hidden [..., H]``, ``labels [...]`` integer, ``bias [V]``.
The compute dtype of the tiles and GEMMs is the autocast dtype when autocast is on for the
device, else the weight's dtype. Import the names from here or from their modules.
"""

from __future__ import annotations

from liger_losses.chunked.autograd import (
    NO_DOUBLE_BACKWARD_INSTEAD,
    check_no_double_backward_of_loss,
    needs_head_grads,
    save_forward_grads,
    scaled_grads,
)
from liger_losses.chunked.config import EngineConfig, engine_config, get_engine_config
from liger_losses.chunked.gemm import HeadGrads, backprop_tile, compute_dtype, itemsize, project
from liger_losses.chunked.options import HeadOptions, check_head_inputs
from liger_losses.chunked.planning import (
    SequencePlan,
    chunk_bounds,
    group_chunk_bounds,
    plan_sequence_passes,
    tile_budget,
    token_chunks,
)
from liger_losses.chunked.token_passes import (
    RecomputedTokenFunction,
    TokenPass,
    TokenPassResult,
    run_tiles,
    run_token_tiles,
    scatter_token_values,
)
from liger_losses.chunked.tokens import (
    LabelScan,
    PendingLabelScan,
    RowGather,
    RowScatter,
    compact_tokens,
    grad_like,
    hidden_rows_at,
    scan_labels,
    scatter_rows,
    token_rows,
    valid_index,
)
from liger_losses.chunked.weights import gather_weight, head_in_dtype, weight_grad_like

__all__ = [
    "NO_DOUBLE_BACKWARD_INSTEAD", "EngineConfig", "HeadGrads", "HeadOptions", "LabelScan",
    "PendingLabelScan", "RecomputedTokenFunction", "RowGather", "RowScatter", "SequencePlan",
    "TokenPass", "TokenPassResult", "backprop_tile", "check_head_inputs",
    "check_no_double_backward_of_loss", "chunk_bounds", "compact_tokens", "compute_dtype",
    "engine_config", "gather_weight", "get_engine_config", "grad_like", "group_chunk_bounds",
    "head_in_dtype", "hidden_rows_at", "itemsize", "needs_head_grads", "plan_sequence_passes",
    "project", "run_tiles", "run_token_tiles", "save_forward_grads", "scaled_grads", "scan_labels",
    "scatter_rows", "scatter_token_values", "tile_budget", "token_chunks", "token_rows",
    "valid_index", "weight_grad_like",
]
