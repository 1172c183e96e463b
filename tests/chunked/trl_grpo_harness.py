"""TRL 1.16's own ``GRPOTrainer._compute_loss`` run on given per-token log-probs (for parity tests).

``trl_grpo_loss`` builds the few attributes ``_compute_loss`` reads on a stand-in object (one process,
no gradient accumulation, train mode) and makes its model call return the given ``logps`` and
``entropy`` ``[B, T]`` tensors, so TRL's formulas, masks, normalisers and logged metrics run
unchanged on the same per-token statistics. Importing this module needs ``trl``.
"""

from collections import defaultdict
from types import SimpleNamespace

import torch
from trl.trainer.grpo_trainer import GRPOTrainer


class _OneProcess:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    def gather_for_metrics(self, x):
        return x

    def reduce(self, x, reduction="sum"):
        return x

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x


class _Stand_in:
    get_high_entropy_mask = GRPOTrainer.get_high_entropy_mask
    get_off_policy_mask = staticmethod(GRPOTrainer.get_off_policy_mask)
    get_gamma_weights = staticmethod(GRPOTrainer.get_gamma_weights)


def trl_grpo_loss(logps, entropy, mask, advantages, *, loss_type="dapo", beta=0.0, epsilon_low=0.2,
                  epsilon_high=None, delta=None, importance_sampling_level="token", use_bias_correction_kl=True,
                  sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                  vespo_k_neg=3.0, vespo_lambda_neg=2.0, off_policy_mask_threshold=None, top_entropy_quantile=1.0,
                  entropy_coef=0.0, max_completion_length=None, old_logps=None, ref_logps=None,
                  sampling_logps=None, importance_sampling_ratio=None, num_items_in_batch=None):
    """``(loss, {TRL metric name: float})`` from TRL's code; ``mask [B, T]`` is the completion mask."""
    t = _Stand_in()
    t.args = SimpleNamespace(use_bias_correction_kl=use_bias_correction_kl, delta=delta,
                             sapo_temperature_pos=sapo_temperature_pos, sapo_temperature_neg=sapo_temperature_neg,
                             vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                             vespo_lambda_neg=vespo_lambda_neg, steps_per_generation=1)
    t.accelerator = _OneProcess()
    t.model = SimpleNamespace(training=True)
    t.aux_loss_enabled = False
    t.top_entropy_quantile = top_entropy_quantile
    t.off_policy_mask_threshold = off_policy_mask_threshold
    t.importance_sampling_level = importance_sampling_level
    t.beta = beta
    t.loss_type = loss_type
    t.epsilon_low = epsilon_low
    t.epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    t.use_vllm = importance_sampling_ratio is not None
    t.vllm_importance_sampling_correction = importance_sampling_ratio is not None
    t.current_gradient_accumulation_steps = 1
    t.max_completion_length = max_completion_length
    t.entropy_coef = entropy_coef
    t.use_adaptive_entropy = False
    t._entropy_bonus_enabled = entropy_coef != 0.0
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropy, None)
    B, T = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": torch.as_tensor(float(mask.sum() if num_items_in_batch is None else num_items_in_batch)),
    }
    for key, value in (("old_per_token_logps", old_logps), ("ref_per_token_logps", ref_logps),
                       ("sampling_per_token_logps", sampling_logps),
                       ("importance_sampling_ratio", importance_sampling_ratio)):
        if value is not None:
            inputs[key] = value
    loss = GRPOTrainer._compute_loss(t, None, inputs)
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}
