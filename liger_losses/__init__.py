"""liger-losses: chunked fused-linear post-training losses and Triton kernels.

Public names are re-exported here; nothing else lives in this file. The TRL trainers live in
``liger_losses.trl_integration`` (imported on demand, since they import ``trl``).
"""

__version__ = "0.1.0"

from liger_losses.chunked.cross_entropy import (
    LigerFusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
)
from liger_losses.chunked.distillation import (
    LigerFusedLinearDistillationLoss,
    fused_linear_distillation_loss,
)
from liger_losses.chunked.grpo import LigerFusedLinearGRPOLoss, fused_linear_grpo_loss
from liger_losses.chunked.output import LossOutput
from liger_losses.chunked.preference import (
    LigerFusedLinearCPOLoss,
    LigerFusedLinearDPOLoss,
    LigerFusedLinearKTOLoss,
    LigerFusedLinearORPOLoss,
    LigerFusedLinearSimPOLoss,
    fused_linear_cpo_loss,
    fused_linear_dpo_loss,
    fused_linear_kto_loss,
    fused_linear_orpo_loss,
    fused_linear_simpo_loss,
)
from liger_losses.chunked.rloo import fused_linear_rloo_loss
from liger_losses.chunked.sequence import SequenceStats, fused_linear_sequence_objective
from liger_losses.chunked.token_logprobs import fused_linear_token_logprobs
from liger_losses.kernels.cross_entropy import LigerCrossEntropyLoss, cross_entropy
from liger_losses.kernels.gated_down import gated_down_proj, gated_down_proj_packed
from liger_losses.kernels.geglu import geglu
from liger_losses.kernels.layer_norm import LigerLayerNorm, layer_norm
from liger_losses.kernels.mlp import LigerGEGLUMLP, LigerPhi3SwiGLUMLP, LigerSwiGLUMLP
from liger_losses.kernels.rms_norm import LigerGemmaRMSNorm, LigerRMSNorm, rms_norm
from liger_losses.kernels.rope import apply_rotary_pos_emb
from liger_losses.kernels.swiglu import swiglu
from liger_losses.patching import AutoLigerModelForCausalLM, apply_liger_kernels, revert_liger_kernels

__all__ = [
    "AutoLigerModelForCausalLM",
    "LigerCrossEntropyLoss",
    "LigerFusedLinearCPOLoss",
    "LigerFusedLinearCrossEntropyLoss",
    "LigerFusedLinearDPOLoss",
    "LigerFusedLinearDistillationLoss",
    "LigerFusedLinearGRPOLoss",
    "LigerFusedLinearKTOLoss",
    "LigerFusedLinearORPOLoss",
    "LigerFusedLinearSimPOLoss",
    "LigerGEGLUMLP",
    "LigerGemmaRMSNorm",
    "LigerLayerNorm",
    "LigerPhi3SwiGLUMLP",
    "LigerRMSNorm",
    "LigerSwiGLUMLP",
    "LossOutput",
    "SequenceStats",
    "apply_liger_kernels",
    "apply_rotary_pos_emb",
    "cross_entropy",
    "fused_linear_cpo_loss",
    "fused_linear_cross_entropy",
    "fused_linear_distillation_loss",
    "fused_linear_dpo_loss",
    "fused_linear_grpo_loss",
    "fused_linear_kto_loss",
    "fused_linear_orpo_loss",
    "fused_linear_rloo_loss",
    "fused_linear_sequence_objective",
    "fused_linear_simpo_loss",
    "fused_linear_token_logprobs",
    "gated_down_proj",
    "gated_down_proj_packed",
    "geglu",
    "layer_norm",
    "revert_liger_kernels",
    "rms_norm",
    "swiglu",
]
