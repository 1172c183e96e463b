"""The value every chunked loss returns: the scalar loss and the metrics a trainer logs.

``LossOutput(loss, metrics)`` is a NamedTuple, so ``loss, metrics = loss_fn(...)`` works.
``loss`` is a 0-d differentiable tensor (or ``[N]`` for ``reduction="none"``); ``metrics`` maps
names such as ``"chosen_logps"`` or ``"token_accuracy"`` to detached tensors (0-d means, or
per-sequence ``[B]`` vectors where the name says so). Computing metrics never adds a GEMM.
"""

from __future__ import annotations

from typing import Dict, NamedTuple

import torch


class LossOutput(NamedTuple):
    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]
