"""Preference losses from hidden states (layer 2): DPO family, ORPO, CPO, SimPO, KTO.

Each loss is a small formula on per-sequence statistics run by the chunked engine
(``liger_losses.chunked.sequence``); this package re-exports the modules and their functional twins.
"""

from .cpo import (
    LigerFusedLinearCPOLoss,
    LigerFusedLinearSimPOLoss,
    fused_linear_cpo_loss,
    fused_linear_simpo_loss,
)
from .dpo import LigerFusedLinearDPOLoss, fused_linear_dpo_loss
from .kto import LigerFusedLinearKTOLoss, fused_linear_kto_loss
from .orpo import LigerFusedLinearORPOLoss, fused_linear_orpo_loss

__all__ = [
    "LigerFusedLinearCPOLoss",
    "LigerFusedLinearDPOLoss",
    "LigerFusedLinearKTOLoss",
    "LigerFusedLinearORPOLoss",
    "LigerFusedLinearSimPOLoss",
    "fused_linear_cpo_loss",
    "fused_linear_dpo_loss",
    "fused_linear_kto_loss",
    "fused_linear_orpo_loss",
    "fused_linear_simpo_loss",
]
