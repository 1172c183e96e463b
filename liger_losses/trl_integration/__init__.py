"""Layer 3: TRL trainers that take ``use_liger=True``.

Each trainer is TRL 1.16's (stable or ``trl.experimental``) with three extra keywords:
``use_liger`` (the loss from :mod:`liger_losses.chunked` on the backbone's last hidden states and the
LM head, never the whole logits), ``liger_patch_model`` (swap the model's layers for our kernels)
and ``liger_chunk_tokens`` (tokens per logits tile). ``use_liger=False`` is TRL's trainer unchanged.
``base`` holds the machinery every adapter shares.
"""

from liger_losses.trl_integration.cpo import CPOTrainer
from liger_losses.trl_integration.distillation import DistillationTrainer
from liger_losses.trl_integration.dpo import DPOTrainer
from liger_losses.trl_integration.gkd import GKDTrainer
from liger_losses.trl_integration.grpo import GRPOTrainer
from liger_losses.trl_integration.kto import KTOTrainer
from liger_losses.trl_integration.orpo import ORPOTrainer
from liger_losses.trl_integration.rloo import RLOOTrainer
from liger_losses.trl_integration.sft import SFTTrainer

__all__ = [
    "CPOTrainer",
    "DPOTrainer",
    "DistillationTrainer",
    "GKDTrainer",
    "GRPOTrainer",
    "KTOTrainer",
    "ORPOTrainer",
    "RLOOTrainer",
    "SFTTrainer",
]
